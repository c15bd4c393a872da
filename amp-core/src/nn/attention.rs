use amp_macros::Params;

use super::{Dropout, Linear};
use crate::indices::Mask;
use crate::{Cpu, Device, Precision, Rng, Tensor};

/// Causal multi-head self-attention (GPT-2 layout: one `qkv` projection, then `proj`).
///
/// Scores `q kᵀ/√d` and the value product run in `L`; the masked softmax runs in f32 (the
/// policy table's fp32 category), and the probabilities are cast back to `L` for `p v`.
/// Its weights are `W` (f32 by default).
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
}

impl CausalSelfAttention {
    /// Attention over `d` features split into `n_heads` heads.
    #[track_caller]
    pub fn new(d: usize, n_heads: usize, dropout: f64, rng: &mut Rng) -> Self {
        assert!(
            n_heads > 0 && d.is_multiple_of(n_heads),
            "CausalSelfAttention: d = {d} is not divisible by n_heads = {n_heads}"
        );
        CausalSelfAttention {
            qkv: Linear::normal(d, 3 * d, true, 0.02, rng),
            proj: Linear::normal(d, d, true, 0.02, rng),
            attn_dropout: Dropout::new(dropout),
            resid_dropout: Dropout::new(dropout),
            n_heads,
        }
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
        }
    }
    /// `x: [B, T, d]` to `[B, T, d]` in precision `L`.
    pub fn forward<L: Precision, X: Precision>(&self, x: &Tensor<X, D>, rng: &mut Rng) -> Tensor<L, D> {
        let (b, t, d) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let (h, hd) = (self.n_heads, d / self.n_heads);
        // [B, T, 3, H, hd] -> [3, B, H, T, hd]
        let qkv = self.qkv.forward::<L, X>(x).reshape(&[b, t, 3, h, hd]).permute(&[2, 0, 3, 1, 4]);
        // q, k and v are narrows of one tensor: autograd adds their gradients into the windows
        // of one [3, B, H, T, hd] buffer (PyTorch's `split` backward), never three zero-padded
        // full-size copies, so the fused projection's backward is one GEMM on one gradient.
        let part = |i: usize| qkv.narrow(0, i, 1).reshape(&[b, h, t, hd]);
        let (q, k, v) = (part(0), part(1), part(2));
        let scores = q.matmul(&k.t()).mul_scalar(1.0 / (hd as f64).sqrt());
        let scores = scores.masked_fill(&Mask::causal(t), f64::NEG_INFINITY);
        let probs = scores.cast::<f32>().softmax(3);
        let probs = self.attn_dropout.forward(&probs, rng);
        let y = probs.cast::<L>().matmul(&v); // [B, H, T, hd]
        let y = y.permute(&[0, 2, 1, 3]).reshape(&[b, t, d]);
        self.resid_dropout.forward(&self.proj.forward::<L, L>(&y), rng)
    }
}
