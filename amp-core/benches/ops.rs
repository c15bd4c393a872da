//! The fused ops at the shapes of one W2 GPT step (performance.md: batch 16, seq 128, d_model
//! 256, 4 heads, vocab 128), forward and forward + backward, per precision. The unfused
//! softmax (max, sub, exp, sum, div as separate ops) runs next to the fused one, so the table
//! shows what fusing buys in the same run.
//!
//! Run: `cargo bench -p amp-core --bench ops`. Compare ratios within one run only.

use amp_core::{Indices, Mask, Precision, Rng, Tensor, bf16, f16};
use divan::Bencher;
use divan::counter::ItemsCount;

fn main() {
    divan::main();
}

const B: usize = 16;
const T: usize = 128;
const D: usize = 256;
const H: usize = 4;
const V: usize = 128;

fn randn<E: Precision>(shape: &[usize], seed: u64) -> Tensor<E> {
    Tensor::<f32>::randn(shape, &mut Rng::seed(seed)).cast::<E>()
}

/// Attention probabilities: softmax over the keys of `[B, H, T, T]` scores (8192 rows of 128).
#[divan::bench(types = [f32, f16, bf16], sample_count = 20)]
fn softmax_attention<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B, H, T, T], 0);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.softmax(3)));
}

/// Attention's softmax as W2 runs it (`scaled_masked_softmax`: the scale, the causal mask, the
/// f32 softmax and the cast back in one pass, f32 probabilities kept for the backward),
/// forward alone, then forward and backward.
#[divan::bench(types = [f32, f16, bf16], sample_count = 30)]
fn scaled_masked_softmax_fwd<E: Precision>(b: Bencher<'_, '_>) {
    let (x, mask) = (randn::<E>(&[B, H, T, T], 0), Mask::causal(T));
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.scaled_masked_softmax(0.125, &mask)));
}

/// [`scaled_masked_softmax_fwd`] with its backward.
#[divan::bench(types = [f32, f16, bf16], sample_count = 30)]
fn scaled_masked_softmax_fwd_bwd<E: Precision>(b: Bencher<'_, '_>) {
    let (x, mask) = (randn::<E>(&[B, H, T, T], 0).requires_grad_(), Mask::causal(T));
    let w = randn::<E>(&[B, H, T, T], 1);
    b.counter(ItemsCount::new(x.numel()))
        .bench_local(|| divan::black_box(x.scaled_masked_softmax(0.125, &mask).mul(&w).sum_all().backward()));
}

/// The same softmax built from separate ops (what an unfused implementation pays).
#[divan::bench(types = [f32, f16, bf16], sample_count = 20)]
fn softmax_attention_unfused<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B, H, T, T], 0);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| {
        let e = x.sub(&x.max(3, true)).exp();
        divan::black_box(e.div(&e.sum(3, true)))
    });
}

/// Causal masking then softmax, forward and backward (the attention step's non-matmul part).
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn masked_softmax_fwd_bwd<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B, H, T, T], 0).requires_grad_();
    let mask = Mask::causal(T);
    let w = randn::<E>(&[B, H, T, T], 1);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| {
        let p = x.masked_fill(&mask, f64::NEG_INFINITY).softmax(3);
        divan::black_box(p.mul(&w).sum_all().backward())
    });
}

/// Causal attention of `[B·H, T, D/H]` heads, forward and backward: the fused kernel
/// (`causal_attention`) next to the ops it replaces (scores, scale, mask, softmax, values),
/// in the same run.
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn causal_attention_fwd_bwd<E: Precision>(b: Bencher<'_, '_>) {
    let [q, k, v] = [0, 1, 2].map(|s| randn::<E>(&[B * H, T, D / H], s).requires_grad_());
    let w = randn::<E>(&[B * H, T, D / H], 3);
    b.counter(ItemsCount::new(B * H * T * T))
        .bench_local(|| divan::black_box(q.causal_attention(&k, &v).mul(&w).sum_all().backward()));
}

/// The same attention from separate ops, forward and backward.
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn causal_attention_unfused_fwd_bwd<E: Precision>(b: Bencher<'_, '_>) {
    let [q, k, v] = [0, 1, 2].map(|s| randn::<E>(&[B * H, T, D / H], s).requires_grad_());
    let w = randn::<E>(&[B * H, T, D / H], 3);
    let mask = Mask::causal(T);
    let scale = 1.0 / ((D / H) as f64).sqrt();
    b.counter(ItemsCount::new(B * H * T * T)).bench_local(|| {
        let scores = q.matmul(&k.transpose(1, 2)).mul_scalar(scale).masked_fill(&mask, f64::NEG_INFINITY);
        let y = scores.softmax(2).matmul(&v);
        divan::black_box(y.mul(&w).sum_all().backward())
    });
}

/// Pre-LayerNorm over `[B * T, D]` with affine parameters, forward only.
#[divan::bench(types = [f32, f16, bf16], sample_count = 20)]
fn layer_norm<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B * T, D], 2);
    let (w, bias) = (randn::<E>(&[D], 3), randn::<E>(&[D], 4));
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.layer_norm(Some(&w), Some(&bias), 1e-5)));
}

/// LayerNorm forward and backward (input, weight and bias gradients).
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn layer_norm_fwd_bwd<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B * T, D], 2).requires_grad_();
    let (w, bias) = (randn::<E>(&[D], 3).requires_grad_(), randn::<E>(&[D], 4).requires_grad_());
    let g = randn::<E>(&[B * T, D], 5);
    b.counter(ItemsCount::new(x.numel()))
        .bench_local(|| divan::black_box(x.layer_norm(Some(&w), Some(&bias), 1e-5).mul(&g).sum_all().backward()));
}

/// Cross-entropy over `[B * T, V]` logits with some ignored targets, forward and backward.
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn cross_entropy_fwd_bwd<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B * T, V], 6).requires_grad_();
    let t =
        Indices::from_vec((0..B * T).map(|i| if i % 10 == 0 { -100 } else { (i * 31 % V) as i64 }).collect(), &[B * T]);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.cross_entropy(&t).backward()));
}

/// Token embedding lookup `[V, D]` by `[B, T]` ids, forward and scatter-add backward.
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn embedding_fwd_bwd<E: Precision>(b: Bencher<'_, '_>) {
    let w = randn::<E>(&[V, D], 7).requires_grad_();
    let ids = Indices::from_vec((0..B * T).map(|i| (i * 17 % V) as i64).collect(), &[B, T]);
    let g = randn::<E>(&[B, T, D], 8);
    b.counter(ItemsCount::new(B * T * D))
        .bench_local(|| divan::black_box(w.embedding(&ids).mul(&g).sum_all().backward()));
}

/// Dropout on the MLP activations `[B * T, 4D]`, forward.
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn dropout<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B * T, 4 * D], 9);
    let mut rng = Rng::seed(0);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.dropout(0.1, true, &mut rng)));
}

/// Concatenating the heads back: 4 × `[B, T, D/4]` along the last dim.
#[divan::bench(types = [f32, bf16], sample_count = 20)]
fn cat_heads<E: Precision>(b: Bencher<'_, '_>) {
    let heads: Vec<Tensor<E>> = (0..H).map(|i| randn::<E>(&[B, T, D / H], 10 + i as u64)).collect();
    let refs: Vec<&Tensor<E>> = heads.iter().collect();
    b.counter(ItemsCount::new(B * T * D)).bench_local(|| divan::black_box(Tensor::cat(&refs, 2)));
}

/// Exact GELU forward over the W2 MLP's hidden activations, `[B * T, 4 D]`.
#[divan::bench(types = [f32, bf16], sample_count = 30)]
fn gelu<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B * T, 4 * D], 8);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.gelu()));
}

/// tanh over the same shape (GPT-2's GELU and recurrent cells use it): vectorised
/// (`fastmath`), where a libm call per element took 28x PyTorch's time.
#[divan::bench(types = [f32, bf16], sample_count = 30)]
fn tanh<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B * T, 4 * D], 8);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.tanh()));
}

/// Natural log of positive values over the same shape, vectorised like `tanh`.
#[divan::bench(types = [f32, bf16], sample_count = 30)]
fn log<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B * T, 4 * D], 8).exp();
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.log()));
}

/// A contiguous copy of a per-head transpose, `[B, H, T, D]` from a `[B, H, D, T]` tensor
/// (attention's gradient of `kᵀ` comes back in this layout).
#[divan::bench(types = [f32, bf16], sample_count = 30)]
fn transpose_contiguous<E: Precision>(b: Bencher<'_, '_>) {
    let x = randn::<E>(&[B, H, D / H, T], 11).transpose(2, 3);
    b.counter(ItemsCount::new(x.numel())).bench_local(|| divan::black_box(x.contiguous()));
}
