//! Loss-scaling primitives (issue 3, performance.md "P1"): the fused unscale + inf/NaN check
//! in place over 16M f32 gradients next to a plain in-place multiply over the same buffer,
//! the global L2 gradient norm of 16M values, and one AdamW update of 16M parameters (and of
//! W2's 54 parameters, 3.26M values).
//!
//! Run: `cargo bench -p amp-core --bench scaler`. Compare ratios within one run only
//! (targets: fused unscale at least 0.7 of the plain pass; norm at most 3.1 ms, PyTorch's time).

use amp_core::clip::global_norm;
use amp_core::nn::{Gpt, GptConfig};
use amp_core::optim::{AdamW, Optimizer};
use amp_core::scaler::{inv_scale, unscale_in_place};
use amp_core::{Grads, Param, Params, Rng, Tensor};
use divan::Bencher;
use divan::counter::BytesCount;
use rayon::prelude::*;

fn main() {
    divan::main();
}

const N: usize = 16 * 1024 * 1024;

fn gradients() -> Vec<f32> {
    Tensor::<f32>::randn(&[N], &mut Rng::seed(0)).mul_scalar(65536.0).to_vec()
}

/// The baseline: `x *= c` in place over 16M f32, parallel in the same chunks (read + write).
#[divan::bench(sample_count = 30)]
fn plain_mul_in_place_16m(b: Bencher<'_, '_>) {
    let mut g = gradients();
    // Multiplying by 1 keeps the values (and their cost) the same from one sample to the next.
    let c = divan::black_box(1.0f32);
    b.counter(BytesCount::new(N * 8)).bench_local(|| {
        g.par_chunks_mut(16 * 1024).for_each(|ch| ch.iter_mut().for_each(|v| *v *= c));
        divan::black_box(&g);
    });
}

/// The fused pass: multiply by PyTorch's f32 `inv` and check every value for inf/NaN.
#[divan::bench(sample_count = 30)]
fn fused_unscale_check_16m(b: Bencher<'_, '_>) {
    let mut g = gradients();
    let inv = divan::black_box(inv_scale(1.0));
    b.counter(BytesCount::new(N * 8)).bench_local(|| divan::black_box(unscale_in_place(&mut g, inv)));
}

/// The global L2 norm that `clip_grad_norm` computes (read only).
#[divan::bench(sample_count = 30)]
fn grad_norm_16m(b: Bencher<'_, '_>) {
    let g = gradients();
    b.counter(BytesCount::new(N * 4)).bench_local(|| divan::black_box(global_norm(&[&g])));
}

/// One AdamW step over a 16M-value parameter: one fused pass over parameter, gradient and
/// both moments (read 16 bytes, write 12 per value).
#[divan::bench(sample_count = 10)]
fn adamw_step_16m(b: Bencher<'_, '_>) {
    let mut p = Param::new(Tensor::<f32>::randn(&[N], &mut Rng::seed(1)));
    let (id, g) = (p.id(), Tensor::<f32>::randn(&[N], &mut Rng::seed(2)).mul_scalar(1e-3));
    // An optimizer applies a set of gradients once (one backward, one step), so each sample
    // gets a set of its own, holding the same gradient (shared, not copied).
    let fresh = || {
        let mut grads = Grads::new();
        grads.insert(id, g.clone().into());
        grads
    };
    let mut opt = AdamW::new(1e-4).build().unwrap();
    opt.step(&mut p, &fresh()).unwrap();
    b.counter(BytesCount::new(N * 28)).with_inputs(fresh).bench_local_refs(|grads| opt.step(&mut p, grads).unwrap());
}

/// One AdamW step over W2's parameters (performance.md: the GPT, 3.26M values in 54 tensors
/// from 256 to 262,144 values): what a training step's optimizer pass costs, next to
/// `adamw_step_16m`'s one large tensor.
#[divan::bench(sample_count = 30)]
fn adamw_step_w2(b: Bencher<'_, '_>) {
    let config = GptConfig { vocab_size: 128, block_size: 128, d_model: 256, n_layers: 4, n_heads: 4, dropout: 0.0 };
    let mut model = Gpt::new(config, &mut Rng::seed(3));
    let grads: Vec<_> = model
        .named_params()
        .iter()
        .enumerate()
        .map(|(i, (_, p))| (p.id(), Tensor::<f32>::randn(p.shape(), &mut Rng::seed(10 + i as u64)).mul_scalar(1e-3)))
        .collect();
    let n: usize = grads.iter().map(|(_, g)| g.numel()).sum();
    let fresh = || {
        let mut set = Grads::new();
        for (id, g) in &grads {
            set.insert(*id, g.clone().into());
        }
        set
    };
    let mut opt = AdamW::new(1e-4).build().unwrap();
    opt.step(&mut model, &fresh()).unwrap();
    b.counter(BytesCount::new(n * 28))
        .with_inputs(fresh)
        .bench_local_refs(|grads| opt.step(&mut model, grads).unwrap());
}
