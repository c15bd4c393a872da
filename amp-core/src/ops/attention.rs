//! Fused causal self-attention, PyTorch's `scaled_dot_product_attention(q, k, v,
//! is_causal=True)`: one kernel per direction (the device's `causal_attention` and
//! `causal_attention_backward`). The scores and probabilities live only inside the kernels,
//! in `E::Acc`, a block of keys at a time: no `t × t` tensor is made, in any precision, so
//! memory grows with `t`, not `t²`. The backward recomputes the probabilities from each row's
//! log-sum-exp.

use crate::backend::{AttentionSpec, Device};
use crate::error::{Error, Result, or_panic};
use crate::precision::Precision;
use crate::tensor::Tensor;

impl<E: Precision, D: Device> Tensor<E, D> {
    /// Causal attention of queries `self`, keys `k` and values `v`, each `[..., t, d]` with
    /// the same shape (the leading dims are batch and heads): row `i` of the output is
    /// `Σ_{j ≤ i} softmax_j(q_i·k_j / √d) v_j`. Computed in `E::Acc` (f32 for f16 and bf16)
    /// with one rounding, without storing the scores (see the module notes). In `#[autocast]`
    /// it runs in the region's precision, like `matmul`.
    ///
    /// Derivatives, with `p` the probabilities and `g` the output's gradient:
    /// `dv_j = Σ_i p_ij g_i`, `dq_i = Σ_j p_ij (g_i·v_j − g_i·y_i) k_j / √d`, and `dk_j` the
    /// same sum over `i` with `q_i`.
    #[track_caller]
    pub fn try_causal_attention(&self, k: &Self, v: &Self) -> Result<Self> {
        let op = "causal_attention";
        crate::__private::check_reach(op, E::DTYPE);
        let shapes = || vec![self.shape().to_vec(), k.shape().to_vec(), v.shape().to_vec()];
        if self.rank() < 2 {
            return Err(Error::Shape {
                op,
                detail: "q, k and v need at least 2 dims ([..., t, d])".into(),
                shapes: shapes(),
            });
        }
        if k.shape() != self.shape() || v.shape() != self.shape() {
            return Err(Error::Shape { op, detail: "q, k and v must have the same shape".into(), shapes: shapes() });
        }
        let r = self.rank();
        let (t, d) = (self.shape()[r - 2], self.shape()[r - 1]);
        let n = self.shape()[..r - 2].iter().product::<usize>();
        if n * t * d == 0 {
            return Ok(self.filled_like(self.shape(), 0.0));
        }
        let spec = AttentionSpec { n, t, d, scale: 1.0 / (d as f64).sqrt() };
        let (y, stats) = self.device.causal_attention(self.raw(), k.raw(), v.raw(), spec);
        let out = self.output(y, self.shape());
        let needs = (self.requires_grad(), k.requires_grad(), v.requires_grad());
        if needs == (false, false, false) {
            return Ok(out);
        }
        let (qs, ks, vs, ys) = (self.detach(), k.detach(), v.detach(), out.detach());
        let parents = vec![self.node.clone(), k.node.clone(), v.node.clone()];
        Ok(out.record(op, parents, move |g| {
            let (dq, dk, dv) =
                qs.device.causal_attention_backward(qs.raw(), ks.raw(), vs.raw(), ys.raw(), g.raw(), &stats, spec);
            let wrap = |needed: bool, s| needed.then(|| qs.output(s, qs.shape()).into());
            vec![wrap(needs.0, dq), wrap(needs.1, dk), wrap(needs.2, dv)]
        }))
    }
    /// Causal attention; panics on mismatched shapes (see [`Tensor::try_causal_attention`]).
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// # use amp::Tensor;
    /// let q = Tensor::<f32>::from_vec(vec![1.0, 0.0, 0.0, 1.0], &[1, 2, 2]); // [heads, t, d]
    /// let v = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 2, 2]);
    /// let y = q.causal_attention(&q, &v).to_vec();
    /// assert_eq!(&y[..2], &[1.0, 2.0]); // the first position sees only itself
    /// ```
    #[track_caller]
    pub fn causal_attention(&self, k: &Self, v: &Self) -> Self {
        or_panic(self.try_causal_attention(k, v))
    }
}
