//! Primitive benchmarks (issue 2, performance.md "P1"): matmul 1024³ in f32 / f16 / bf16,
//! f32→f16 and f32→bf16 casts of 16M elements next to a plain copy, and elementwise ops.
//!
//! Run: `cargo bench -p amp-core --bench primitives`. Compare ratios within one run only.

use amp_core::{Rng, Tensor, bf16, f16};
use divan::Bencher;
use divan::counter::{BytesCount, ItemsCount};

fn main() {
    divan::main();
}

const N: usize = 16 * 1024 * 1024;
const M: usize = 1024;

fn input() -> Tensor<f32> {
    Tensor::randn(&[N], &mut Rng::seed(0))
}

/// The baseline: copy 16M f32 into a preallocated buffer (read + write 128 MB).
#[divan::bench(sample_count = 20)]
fn copy_f32_16m(b: Bencher<'_, '_>) {
    let src = input().to_vec();
    let mut dst = vec![0f32; N];
    b.counter(BytesCount::new(N * 8)).bench_local(|| {
        use rayon::prelude::*;
        dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
        divan::black_box(&dst);
    });
}

/// The allocating baseline: a copy of 16M f32 into a fresh buffer (`to_vec`), page faults
/// included, as an allocating cast pays them.
#[divan::bench(sample_count = 20)]
fn copy_f32_16m_allocating(b: Bencher<'_, '_>) {
    let x = input();
    b.counter(BytesCount::new(N * 8)).bench_local(|| divan::black_box(x.to_vec()));
}

/// `cast_into` an f16 buffer kept across iterations (compare with `copy_f32_16m`).
#[divan::bench(sample_count = 20)]
fn cast_into_f16_16m(b: Bencher<'_, '_>) {
    let x = input();
    let mut dst = Tensor::<f16>::zeros(&[N]);
    b.counter(BytesCount::new(N * 6)).bench_local(|| x.cast_into(&mut dst));
}

/// `cast_into` a bf16 buffer kept across iterations (compare with `copy_f32_16m`).
#[divan::bench(sample_count = 20)]
fn cast_into_bf16_16m(b: Bencher<'_, '_>) {
    let x = input();
    let mut dst = Tensor::<bf16>::zeros(&[N]);
    b.counter(BytesCount::new(N * 6)).bench_local(|| x.cast_into(&mut dst));
}

/// `Tensor::cast::<f16>()` over 16M elements (allocates its output, like PyTorch's `.half()`).
#[divan::bench(sample_count = 20)]
fn cast_f32_to_f16_16m(b: Bencher<'_, '_>) {
    let x = input();
    b.counter(BytesCount::new(N * 6)).bench_local(|| divan::black_box(x.cast::<f16>()));
}

/// `Tensor::cast::<bf16>()` over 16M elements.
#[divan::bench(sample_count = 20)]
fn cast_f32_to_bf16_16m(b: Bencher<'_, '_>) {
    let x = input();
    b.counter(BytesCount::new(N * 6)).bench_local(|| divan::black_box(x.cast::<bf16>()));
}

/// `Tensor::cast::<f32>()` from f16 over 16M elements.
#[divan::bench(sample_count = 20)]
fn cast_f16_to_f32_16m(b: Bencher<'_, '_>) {
    let x = input().cast::<f16>();
    b.counter(BytesCount::new(N * 6)).bench_local(|| divan::black_box(x.cast::<f32>()));
}

/// Elementwise add of two 16M tensors, per precision.
#[divan::bench(types = [f32, f16, bf16], sample_count = 10)]
fn add_16m<E: amp_core::Precision>(b: Bencher<'_, '_>) {
    let x = input().cast::<E>();
    let y = x.mul_scalar(0.5);
    b.counter(ItemsCount::new(N)).bench_local(|| divan::black_box(x.add(&y)));
}

/// GELU (exact erf) over 16M elements, per precision.
#[divan::bench(types = [f32, f16, bf16], sample_count = 10)]
fn gelu_16m<E: amp_core::Precision>(b: Bencher<'_, '_>) {
    let x = input().cast::<E>();
    b.counter(ItemsCount::new(N)).bench_local(|| divan::black_box(x.gelu()));
}

/// GELU forward and backward over 16M elements (`gelu(x).sum_all().backward()`): the GELU
/// derivative pass is what a training step adds on top of `gelu_16m`.
#[divan::bench(types = [f32, f16, bf16], sample_count = 10)]
fn gelu_fwd_bwd_16m<E: amp_core::Precision>(b: Bencher<'_, '_>) {
    let x = input().cast::<E>().requires_grad_();
    b.counter(ItemsCount::new(N)).bench_local(|| divan::black_box(x.gelu().sum_all().backward()));
}

/// 1024³ matmul; the items counter is FLOPs (2·n³), so items/s is FLOP/s. 100 samples: on
/// AMX the product takes ~1.5 ms, and 10 samples left its median at twice that (the first
/// calls wake the threads and grow the pack buffers).
#[divan::bench(types = [f32, f16, bf16], sample_count = 100)]
fn matmul_1024<E: amp_core::Precision>(b: Bencher<'_, '_>) {
    let mut rng = Rng::seed(1);
    let x = Tensor::<f32>::randn(&[M, M], &mut rng).cast::<E>();
    let y = Tensor::<f32>::randn(&[M, M], &mut rng).cast::<E>();
    b.counter(ItemsCount::new(2 * M * M * M)).bench_local(|| divan::black_box(x.matmul(&y)));
}
