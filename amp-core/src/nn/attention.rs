use amp_macros::Params;

use super::{Dropout, Linear};
use crate::error::{Error, Result, or_panic};
use crate::indices::Mask;
use crate::{Cpu, Device, Precision, Rng, Tensor};

/// Causal multi-head self-attention (GPT-2 layout: one `qkv` projection, then `proj`).
///
/// Scores `q kᵀ/√d` and the value product run in `L`; the masked softmax runs in f32 (the
/// policy table's fp32 category), and the probabilities are cast back to `L` for `p v`: one
/// [`Tensor::scaled_masked_softmax`] kernel each way, or, with attention dropout (applied to
/// the f32 probabilities, as PyTorch's unfused path does), the ops one by one.
/// With [`CausalSelfAttention::with_fused`] the three steps are one
/// [`Tensor::causal_attention`] kernel instead (scores and softmax in f32 inside it, no
/// `t × t` tensor stored: what a long sequence on a GPU needs). Its weights are `W` (f32 by
/// default).
#[derive(Params, Debug, Clone)]
pub struct CausalSelfAttention<W: Precision = f32, D: Device = Cpu> {
    /// `[3 d, d]`: queries, keys and values in one GEMM.
    pub qkv: Linear<W, D>,
    /// `[d, d]` output projection.
    pub proj: Linear<W, D>,
    /// Dropout on the attention probabilities.
    pub attn_dropout: Dropout,
    /// Dropout on the output.
    pub resid_dropout: Dropout,
    /// Number of heads.
    #[param(skip)]
    pub n_heads: usize,
    /// Whether the scores, softmax and value product run as one fused kernel.
    #[param(skip)]
    fused: bool,
}

impl CausalSelfAttention {
    /// Attention over `d` features split into `n_heads` heads. Errs when `d` is not a positive
    /// multiple of `n_heads` or `dropout` is not in `[0, 1)`.
    pub fn try_new(d: usize, n_heads: usize, dropout: f64, rng: &mut Rng) -> Result<Self> {
        if n_heads == 0 || d == 0 || !d.is_multiple_of(n_heads) {
            return Err(Error::InvalidArgument {
                op: "CausalSelfAttention::new",
                name: "n_heads",
                detail: format!("d = {d} must be a positive multiple of n_heads = {n_heads}"),
            });
        }
        let (attn_dropout, resid_dropout) = (Dropout::try_new(dropout)?, Dropout::try_new(dropout)?);
        Ok(CausalSelfAttention {
            qkv: Linear::normal(d, 3 * d, true, 0.02, rng),
            proj: Linear::normal(d, d, true, 0.02, rng),
            attn_dropout,
            resid_dropout,
            n_heads,
            fused: false,
        })
    }
    /// [`CausalSelfAttention::try_new`], panicking with its error's message.
    #[track_caller]
    pub fn new(d: usize, n_heads: usize, dropout: f64, rng: &mut Rng) -> Self {
        or_panic(Self::try_new(d, n_heads, dropout, rng))
    }
}

impl<W: Precision, D: Device> CausalSelfAttention<W, D> {
    /// A copy with its weights rounded to precision `P` (new parameters: their own ids).
    pub fn to_precision<P: Precision>(&self) -> CausalSelfAttention<P, D> {
        CausalSelfAttention {
            qkv: self.qkv.to_precision(),
            proj: self.proj.to_precision(),
            attn_dropout: self.attn_dropout.clone(),
            resid_dropout: self.resid_dropout.clone(),
            n_heads: self.n_heads,
            fused: self.fused,
        }
    }
    /// The same attention computed by the fused [`Tensor::causal_attention`] kernel (`true`)
    /// or by separate ops (`false`, the default). The fused kernel keeps no probabilities to
    /// drop out, so it refuses a nonzero attention dropout.
    pub fn with_fused(mut self, fused: bool) -> Result<Self> {
        if fused && self.attn_dropout.p > 0.0 {
            return Err(Error::InvalidArgument {
                op: "CausalSelfAttention::with_fused",
                name: "fused",
                detail: format!(
                    "the fused kernel stores no attention probabilities, so it cannot apply the attention dropout \
                     (p = {}): build the model with dropout 0 to fuse",
                    self.attn_dropout.p
                ),
            });
        }
        self.fused = fused;
        Ok(self)
    }
    /// Whether the fused kernel computes this attention.
    pub fn is_fused(&self) -> bool {
        self.fused
    }
    /// `x: [B, T, d]` to `[B, T, d]` in precision `L`. Errs on another rank or width, naming
    /// the shape.
    pub fn try_forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>, rng: &mut Rng) -> Result<Tensor<L, D>> {
        let d = self.proj.weight.shape()[0];
        if x.rank() != 3 || x.shape()[2] != d {
            return Err(Error::Shape {
                op: "CausalSelfAttention::forward",
                detail: format!("expected an input [B, T, d] with d = {d}"),
                shapes: vec![x.shape().to_vec()],
            });
        }
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let (h, hd) = (self.n_heads, d / self.n_heads);
        // [B, T, 3, H, hd] -> [3, B, H, T, hd]
        let qkv = self.qkv.try_forward::<L, X>(x)?.reshape(&[b, t, 3, h, hd]).permute(&[2, 0, 3, 1, 4]);
        // q, k and v are narrows of one tensor: autograd adds their gradients into the windows
        // of one [3, B, H, T, hd] buffer (PyTorch's `split` backward), never three zero-padded
        // full-size copies, so the fused projection's backward is one GEMM on one gradient.
        let part = |i: usize| qkv.narrow(0, i, 1).reshape(&[b, h, t, hd]);
        let (q, k, v) = (part(0), part(1), part(2));
        let y = if self.fused { q.causal_attention(&k, &v) } else { self.unfused(&q, &k, &v, rng)? };
        let y = y.permute(&[0, 2, 1, 3]).reshape(&[b, t, d]);
        self.resid_dropout.try_forward(&self.proj.try_forward::<L, L>(&y)?, rng)
    }
    /// [`CausalSelfAttention::try_forward`], panicking with its error's message.
    #[track_caller]
    pub fn forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>, rng: &mut Rng) -> Tensor<L, D> {
        or_panic(self.try_forward(x, rng))
    }
    fn unfused<L: Precision>(
        &self,
        q: &Tensor<L, D>,
        k: &Tensor<L, D>,
        v: &Tensor<L, D>,
        rng: &mut Rng,
    ) -> Result<Tensor<L, D>> {
        let (t, hd) = (q.shape()[2], q.shape()[3]);
        let (scores, scale, causal) = (q.matmul(&k.t()), 1.0 / (hd as f64).sqrt(), Mask::causal(t));
        if self.attn_dropout.p == 0.0 {
            // The chain below in one kernel each way, the same bits (no dropout between the
            // softmax and the cast to drop on the f32 probabilities).
            return Ok(scores.scaled_masked_softmax(scale, &causal).matmul(v)); // [B, H, T, hd]
        }
        let probs = scores.mul_scalar(scale).masked_fill(&causal, f64::NEG_INFINITY).softmax_f32(3);
        let probs = self.attn_dropout.try_forward(&probs, rng)?;
        Ok(probs.cast::<L>().matmul(v)) // [B, H, T, hd]
    }
}
