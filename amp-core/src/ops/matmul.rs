//! Matrix multiply: 2-D, batched, with batch dims broadcast (and 1-D operands as in PyTorch).
//! f16 runs on gemm's f16 kernel with f32 accumulation; bf16 widens to f32 and rounds once.
//! Derivatives: `dA = dC Bᵀ`, `dB = Aᵀ dC`, summed over broadcast batch dims.

use crate::cpu;
use crate::error::{Error, Result, or_panic};
use crate::layout::broadcast_shapes;
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision> Tensor<E> {
    /// `self @ rhs` for `[..., m, k] @ [..., k, n] -> [..., m, n]`.
    pub fn try_matmul(&self, rhs: &Self) -> Result<Self> {
        // 1-D operands: a vector on the left is a row, on the right a column, removed after.
        if self.rank() == 0 || rhs.rank() == 0 {
            return Err(Error::Shape {
                op: "matmul",
                detail: "both operands need at least one dim".into(),
                shapes: vec![self.shape().to_vec(), rhs.shape().to_vec()],
            });
        }
        if self.rank() == 1 {
            let out = self.unsqueeze(0).try_matmul(rhs)?;
            return Ok(out.squeeze(out.rank() - 2));
        }
        if rhs.rank() == 1 {
            let out = self.try_matmul(&rhs.unsqueeze(1))?;
            return Ok(out.squeeze(out.rank() - 1));
        }
        let (ra, rb) = (self.rank(), rhs.rank());
        let (m, k) = (self.shape()[ra - 2], self.shape()[ra - 1]);
        let (k2, n) = (rhs.shape()[rb - 2], rhs.shape()[rb - 1]);
        if k != k2 {
            return Err(Error::Shape {
                op: "matmul",
                detail: format!("inner dims differ: {k} vs {k2}"),
                shapes: vec![self.shape().to_vec(), rhs.shape().to_vec()],
            });
        }
        let batch = broadcast_shapes("matmul", &self.shape()[..ra - 2], &rhs.shape()[..rb - 2])?;
        let data = cpu::matmul::matmul(&self.storage, &self.layout, &rhs.storage, &rhs.layout, &batch);
        let mut shape = batch;
        shape.extend([m, n]);
        let out = Self::from_parts(data, &shape);
        if !self.requires_grad() && !rhs.requires_grad() {
            return Ok(out);
        }
        let (a, b) = (self.detach(), rhs.detach());
        let needs = (self.requires_grad(), rhs.requires_grad());
        Ok(out.record("matmul", vec![self.node.clone(), rhs.node.clone()], move |g| {
            vec![
                needs.0.then(|| g.matmul(&b.t()).sum_to_shape(a.shape()).into()),
                needs.1.then(|| a.t().matmul(&g).sum_to_shape(b.shape()).into()),
            ]
        }))
    }
    /// `self @ rhs`; panics on incompatible shapes.
    ///
    /// ```
    /// # use amp_core::Tensor;
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    /// let b = Tensor::<f32>::from_vec(vec![5.0, 6.0, 7.0, 8.0], &[2, 2]);
    /// assert_eq!(a.matmul(&b).to_vec(), vec![19.0, 22.0, 43.0, 50.0]);
    /// ```
    #[track_caller]
    pub fn matmul(&self, rhs: &Self) -> Self {
        or_panic(self.try_matmul(rhs))
    }
}
