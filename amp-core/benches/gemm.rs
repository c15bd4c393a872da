//! GEMMs at the shapes of one W2 GPT training step (performance.md: d_model 256, MLP 1024,
//! 2048 tokens, 4 heads of 64, seq 128), in f32, bf16 and f16, through the public ops. The
//! items counter is FLOPs, so items/s is FLOP/s.
//!
//! Run: `cargo bench -p amp-core --bench gemm`. Compare ratios within one run only.
//!
//! The main thread is made a compute thread first (`cpu_threads::init`), as in a training
//! loop: the other thread then spins for work between products instead of sleeping, as
//! PyTorch's OpenMP threads do in `tests/python/bench_gemm.py` (`AMP_CPU_SPIN=off` to compare).

use amp_core::{Precision, Rng, Tensor, bf16, f16};
use divan::Bencher;
use divan::counter::ItemsCount;

fn main() {
    amp_core::cpu_threads::init(0).expect("the first use of rayon's pool");
    warm_up();
    divan::main();
}

/// Products for a quarter of a second before any measurement: divan times a benchmark from
/// its first call, and on the 2-core VMs the first few tens of milliseconds of a process ran
/// its products at half speed (Zen 5: the attention scores, measured first, at 244–365
/// GFLOP/s in 7 of 9 runs and 664–671 in the others), while `bench_gemm.py`'s products run
/// after PyTorch's import and three calls each.
fn warm_up() {
    let (a, b) = (randn::<bf16>(&[2048, 256], 0), randn::<bf16>(&[256, 1024], 1));
    let start = std::time::Instant::now();
    while start.elapsed() < std::time::Duration::from_millis(250) {
        divan::black_box(a.matmul(&b));
    }
}

fn randn<E: Precision>(shape: &[usize], seed: u64) -> Tensor<E> {
    Tensor::<f32>::randn(shape, &mut Rng::seed(seed)).cast::<E>()
}

/// Forward `qkv` projection: `x [2048, 256] Wᵀ + b`, `W [768, 256]` (B read transposed).
#[divan::bench(types = [f32, bf16, f16], sample_count = 30)]
fn linear_qkv_fwd<E: Precision>(b: Bencher<'_, '_>) {
    let (x, w, bias) = (randn::<E>(&[2048, 256], 0), randn::<E>(&[768, 256], 1), randn::<E>(&[768], 2));
    b.counter(ItemsCount::new(2usize * 2048 * 256 * 768)).bench_local(|| divan::black_box(x.linear(&w, Some(&bias))));
}

/// Backward input gradient of the MLP's second layer: `dy [2048, 256] @ W [256, 1024]`.
#[divan::bench(types = [f32, bf16, f16], sample_count = 30)]
fn matmul_dx<E: Precision>(b: Bencher<'_, '_>) {
    let (dy, w) = (randn::<E>(&[2048, 256], 3), randn::<E>(&[256, 1024], 4));
    b.counter(ItemsCount::new(2usize * 2048 * 256 * 1024)).bench_local(|| divan::black_box(dy.matmul(&w)));
}

/// Backward weight gradient of the MLP's first layer: `dyᵀ [1024, 2048] @ x [2048, 256]`
/// (A read transposed, k = tokens).
#[divan::bench(types = [f32, bf16, f16], sample_count = 30)]
fn matmul_dw<E: Precision>(b: Bencher<'_, '_>) {
    let (dy, x) = (randn::<E>(&[2048, 1024], 5), randn::<E>(&[2048, 256], 6));
    b.counter(ItemsCount::new(2usize * 1024 * 2048 * 256)).bench_local(|| divan::black_box(dy.t().matmul(&x)));
}

/// Backward input gradient of the MLP's first layer: `dy [2048, 1024] @ W [1024, 256]` (k =
/// 1024: more than one k block of the AMX kernel).
#[divan::bench(types = [f32, bf16, f16], sample_count = 30)]
fn matmul_dx_k1024<E: Precision>(b: Bencher<'_, '_>) {
    let (dy, w) = (randn::<E>(&[2048, 1024], 9), randn::<E>(&[1024, 256], 10));
    b.counter(ItemsCount::new(2usize * 2048 * 1024 * 256)).bench_local(|| divan::black_box(dy.matmul(&w)));
}

/// Backward weight gradient of the MLP's second layer: `dyᵀ [256, 2048] @ h [2048, 1024]` (m =
/// 256, B the larger operand).
#[divan::bench(types = [f32, bf16, f16], sample_count = 30)]
fn matmul_dw_m256<E: Precision>(b: Bencher<'_, '_>) {
    let (dy, h) = (randn::<E>(&[2048, 256], 11), randn::<E>(&[2048, 1024], 12));
    b.counter(ItemsCount::new(2usize * 256 * 2048 * 1024)).bench_local(|| divan::black_box(dy.t().matmul(&h)));
}

/// Attention scores for 16 sequences × 4 heads: `q [64, 128, 64] @ kᵀ [64, 64, 128]`.
#[divan::bench(types = [f32, bf16, f16], sample_count = 30)]
fn attention_scores<E: Precision>(b: Bencher<'_, '_>) {
    let (q, k) = (randn::<E>(&[64, 128, 64], 7), randn::<E>(&[64, 128, 64], 8));
    b.counter(ItemsCount::new(2usize * 64 * 128 * 128 * 64))
        .bench_local(|| divan::black_box(q.matmul(&k.transpose(1, 2))));
}
