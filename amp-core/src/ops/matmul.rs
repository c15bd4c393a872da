//! Matrix multiply: 2-D, batched, with batch dims broadcast (and 1-D operands as in PyTorch).
//! Every precision accumulates in f32 (f64 for f64) and rounds each output once: bf16 on an
//! AVX-512 BF16 kernel and f16 on an AVX-512 f32-FMA kernel that widens inside its pack, where
//! the CPU has them (the CPU backend's `gemm_half`); elsewhere f16 and bf16 widen to f32 for gemm.
//! Derivatives: `dA = dC Bᵀ`, `dB = Aᵀ dC`, summed over broadcast batch dims.

use crate::backend::{Cpu, Device};
use crate::error::{Error, Result, or_panic};
use crate::layout::broadcast_shapes;
use crate::param::Param;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// The weight and bias of [`Tensor::linear`]: tensors, or parameters (so a module's fields go
/// in as they are, `x.linear(&self.fc.weight, self.fc.bias.as_ref())`). Both are one type,
/// which is what lets a bare `None` bias take its type from the weight.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `Tensor<{E}>` or a `Param<{E}>`",
    label = "the weight and the bias of `linear` are tensors (or parameters) of the input's precision",
    note = "the weight and the bias must be the same kind: both `Tensor`s or both `Param`s (`&*param` is its tensor)"
)]
pub trait LinearOperand<E: Precision, D: Device = Cpu> {
    /// The tensor.
    fn tensor_ref(&self) -> &Tensor<E, D>;
}

impl<E: Precision, D: Device> LinearOperand<E, D> for Tensor<E, D> {
    #[inline(always)]
    fn tensor_ref(&self) -> &Tensor<E, D> {
        self
    }
}

impl<E: Precision, D: Device> LinearOperand<E, D> for Param<E, D> {
    #[inline(always)]
    fn tensor_ref(&self) -> &Tensor<E, D> {
        self
    }
}

/// Whether the matrices of `x` (its last two dims) are stored column by column: the
/// transpose of a row-major view.
fn column_major<E: Precision, D: Device>(x: &Tensor<E, D>) -> bool {
    let (shape, strides, r) = (&x.layout().shape, &x.layout().strides, x.rank());
    shape[r - 2] > 1 && shape[r - 1] > 1 && strides[r - 2] == 1 && strides[r - 1] != 1
}

/// `l` with its last two dims swapped (the transposed view of the same elements).
fn transposed(l: &crate::layout::Layout) -> crate::layout::Layout {
    let r = l.shape.len();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    l.permuted(&perm)
}

impl<E: Precision, D: Device> Tensor<E, D> {
    /// `self @ rhs` for `[..., m, k] @ [..., k, n] -> [..., m, n]`.
    #[track_caller]
    pub fn try_matmul(&self, rhs: &Self) -> Result<Self> {
        crate::__private::check_reach("matmul", E::DTYPE);
        // 1-D operands: a vector on the left is a row, on the right a column, removed after.
        if self.rank() == 0 || rhs.rank() == 0 {
            return Err(Error::Shape {
                op: "matmul",
                detail: "both operands need at least one dim".into(),
                shapes: vec![self.shape().to_vec(), rhs.shape().to_vec()],
            });
        }
        // Checked on the shapes as given, before vectors are viewed as rows or columns.
        let k = self.shape()[self.rank() - 1];
        let k2 = if rhs.rank() == 1 { rhs.shape()[0] } else { rhs.shape()[rhs.rank() - 2] };
        if k != k2 {
            return Err(Error::Shape {
                op: "matmul",
                detail: format!("inner dims differ: {k} vs {k2}"),
                shapes: vec![self.shape().to_vec(), rhs.shape().to_vec()],
            });
        }
        if self.rank() == 1 {
            // [k] @ [.., k, n] -> [.., 1, n] -> [.., n]; [k] @ [k] -> [1] -> [] (a dot product,
            // 0-dim as in PyTorch).
            let out = self.unsqueeze(0).try_matmul(rhs)?;
            let row = if rhs.rank() == 1 { out.rank() - 1 } else { out.rank() - 2 };
            return Ok(out.squeeze(row));
        }
        if rhs.rank() == 1 {
            let out = self.try_matmul(&rhs.unsqueeze(1))?;
            return Ok(out.squeeze(out.rank() - 1));
        }
        let (ra, rb) = (self.rank(), rhs.rank());
        let (m, n) = (self.shape()[ra - 2], rhs.shape()[rb - 1]);
        let batch = broadcast_shapes("matmul", &self.shape()[..ra - 2], &rhs.shape()[..rb - 2])?;
        let data = self.device.matmul(self.raw(), rhs.raw(), &batch);
        let mut shape = batch;
        shape.extend([m, n]);
        let out = self.output(data, &shape);
        if !self.requires_grad() && !rhs.requires_grad() {
            return Ok(out);
        }
        let (a, b) = (self.detach(), rhs.detach());
        let needs = (self.requires_grad(), rhs.requires_grad());
        Ok(out.record_dest("matmul", vec![self.node.clone(), rhs.node.clone()], move |g, dests| {
            // Each gradient in its operand's memory order, as PyTorch's `mm` backward does: for
            // a transposed operand (attention's `k.t()`) the transpose of a contiguous product,
            // so the gradient reaches `k` contiguous, and the `qkv` gradient's concatenation
            // copies runs instead of gathering a transposed part element by element. Where the
            // engine offers a destination (the operand is a view of a narrow: attention's `q`,
            // `k` and `v` of one `qkv`), the product is written there instead, and there is no
            // concatenation at all.
            let batch = &g.shape()[..g.rank() - 2];
            // An operand with the product's batch dims has no broadcast dims to sum over.
            let unbroadcast = |x: &Tensor<E, D>| x.rank() == g.rank() && &x.shape()[..x.rank() - 2] == batch;
            let ga = needs.0.then(|| {
                let written = unbroadcast(&a)
                    && dests.write::<E>(0, |out, l| {
                        let dev = &g.device;
                        if column_major(&a) {
                            let gt = g.t();
                            dev.matmul_into_view(b.raw(), gt.raw(), batch, out, &transposed(l));
                        } else {
                            let bt = b.t();
                            dev.matmul_into_view(g.raw(), bt.raw(), batch, out, l);
                        }
                    });
                (!written).then(|| {
                    let ga = if column_major(&a) { b.matmul(&g.t()).t() } else { g.matmul(&b.t()) };
                    ga.sum_to_shape(a.shape()).into()
                })
            });
            let gb = needs.1.then(|| {
                let written = unbroadcast(&b)
                    && dests.write::<E>(1, |out, l| {
                        let dev = &g.device;
                        let gt = g.t();
                        if column_major(&b) {
                            dev.matmul_into_view(gt.raw(), a.raw(), batch, out, &transposed(l));
                        } else {
                            let at = a.t();
                            dev.matmul_into_view(at.raw(), g.raw(), batch, out, l);
                        }
                    });
                (!written).then(|| {
                    let gb = if column_major(&b) { g.t().matmul(&a).t() } else { a.t().matmul(&g) };
                    gb.sum_to_shape(b.shape()).into()
                })
            });
            vec![ga.flatten(), gb.flatten()]
        }))
    }
    /// `self @ rhs`; panics on incompatible shapes.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let a = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[2, 2]);
    /// let b = Tensor::<f32>::from_vec(vec![5.0, 6.0, 7.0, 8.0], &[2, 2]);
    /// assert_eq!(a.matmul(&b).to_vec(), vec![19.0, 22.0, 43.0, 50.0]);
    /// ```
    #[track_caller]
    pub fn matmul(&self, rhs: &Self) -> Self {
        or_panic(self.try_matmul(rhs))
    }

    /// `x Wᵀ + b` (PyTorch's `F.linear`) for `x: [..., in]`, `weight: [out, in]`,
    /// `bias: [out]`: one GEMM with the bias in the accumulator (one rounding). Derivatives:
    /// `dx = dy W`, `dW = dyᵀ x` (computed directly in `W`'s layout), `db = Σ dy`.
    ///
    /// The weight and the bias are both tensors or both parameters ([`LinearOperand`]).
    #[track_caller]
    pub fn try_linear<W: LinearOperand<E, D> + ?Sized>(&self, weight: &W, bias: Option<&W>) -> Result<Self> {
        crate::__private::check_reach("linear", E::DTYPE);
        let (weight, bias) = (weight.tensor_ref(), bias.map(|b| b.tensor_ref()));
        let shapes = || {
            let mut v = vec![self.shape().to_vec(), weight.shape().to_vec()];
            v.extend(bias.map(|b| b.shape().to_vec()));
            v
        };
        let err = |detail: String| Err(Error::Shape { op: "linear", detail, shapes: shapes() });
        if weight.rank() != 2 || self.rank() == 0 {
            return err("needs an input with at least one dim and a 2-D weight [out, in]".into());
        }
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        if self.shape()[self.rank() - 1] != in_f {
            return err(format!("the input's last dim must equal the weight's in_features {in_f}"));
        }
        if bias.is_some_and(|b| b.shape() != [out_f]) {
            return err(format!("the bias must have shape [{out_f}]"));
        }
        let rows = self.numel() / in_f.max(1);
        let x = if self.layout.is_contiguous() { self.clone() } else { self.contiguous() };
        let lx = crate::layout::Layout { shape: vec![rows, in_f], strides: vec![in_f, 1], offset: x.layout.offset };
        let data = self.device.linear((&x.storage, &lx), weight.raw(), bias.map(Tensor::raw));
        let mut shape = self.shape().to_vec();
        *shape.last_mut().unwrap() = out_f;
        let out = self.output(data, &shape);
        let parents = vec![self.node.clone(), weight.node.clone(), bias.and_then(|b| b.node.clone())];
        if parents.iter().all(Option::is_none) {
            return Ok(out);
        }
        let needs = [self.requires_grad(), weight.requires_grad(), bias.is_some_and(|b| b.requires_grad())];
        let (x2, w) = (x.detach().reshape(&[rows, in_f]), weight.detach());
        let in_shape = self.shape().to_vec();
        Ok(out.record("linear", parents, move |g| {
            let g2 = g.reshape(&[rows, out_f]);
            // The bias's sum first, while `g` is still in cache from the op that wrote it (in
            // a W2 step the sums after the two GEMMs ran at a third of their in-cache speed).
            let bias = needs[2].then(|| g2.sum(0, false).into());
            vec![
                needs[0].then(|| g2.matmul(&w).reshape(&in_shape).into()),
                needs[1].then(|| g2.t().matmul(&x2).into()),
                bias,
            ]
        }))
    }
    /// `x Wᵀ + b`; panics on incompatible shapes.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let x = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[1, 2]);
    /// let w = Tensor::<f32>::from_vec(vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2]);
    /// let b = Tensor::<f32>::from_vec(vec![0.5, 0.5, 0.5], &[3]);
    /// assert_eq!(x.linear(&w, Some(&b)).to_vec(), vec![1.5, 2.5, 3.5]);
    /// ```
    #[track_caller]
    pub fn linear<W: LinearOperand<E, D> + ?Sized>(&self, weight: &W, bias: Option<&W>) -> Self {
        or_panic(self.try_linear(weight, bias))
    }
}
