//! `#[autocast]` costs nothing beyond the casts it inserts, and its weight cast cache saves the
//! repeated ones.
//!
//! - `mlp_*`: forward + backward of a 3-layer MLP (f16, batch 64, 512 → 1024 → 1024 → 512),
//!   `#[autocast]` against the same forward with the casts written by hand.
//! - `rnn_*`: a 16-step recurrence reusing one 1024×1024 weight (batch 2, so converting the
//!   weight is a real share of the work), with the cache and with `cache = false`, forward
//!   alone and forward + backward (the backward casts each use's gradient back either way).
//!
//! After divan's table, `main` prints the ratios from 31 interleaved runs (median and minimum).
//! Run: `cargo bench -p amp-core --bench autocast`.

use std::time::Instant;

use amp_core::__private::{cast_stats, reset_cast_stats};
use amp_core::{Param, Rng, Tensor, autocast, f16};

struct Mlp {
    w: [Param; 3],
    b: [Param; 3],
}

fn mlp() -> (Mlp, Tensor<f32>) {
    let mut rng = Rng::seed(0);
    let dims = [512, 1024, 1024, 512];
    let mut p = |shape: &[usize]| Param::new(Tensor::<f32>::randn(shape, &mut rng).mul_scalar(0.03));
    let w = [p(&dims[0..2]), p(&dims[1..3]), p(&dims[2..4])];
    let b = [p(&[dims[1]]), p(&[dims[2]]), p(&[dims[3]])];
    let x = Tensor::<f32>::randn(&[64, 512], &mut Rng::seed(1));
    (Mlp { w, b }, x)
}

#[autocast]
fn mlp_autocast(m: &Mlp, x: &Tensor<f32>) -> Tensor<f32> {
    let mut h = x.clone();
    for i in 0..3 {
        h = h.matmul(&m.w[i]).add(&m.b[i]).gelu();
    }
    h.square().mean_all()
}

fn mlp_by_hand(m: &Mlp, x: &Tensor<f32>) -> Tensor<f32> {
    let mut h = x.clone();
    for i in 0..3 {
        h = h.cast::<f16>().matmul(&m.w[i].cast::<f16>()).cast::<f32>().add(&m.b[i]).gelu();
    }
    h.square().mean_all()
}

fn rnn() -> (Param, Tensor<f32>) {
    let w = Param::new(Tensor::<f32>::randn(&[1024, 1024], &mut Rng::seed(2)).mul_scalar(0.03));
    (w, Tensor::<f32>::randn(&[2, 1024], &mut Rng::seed(3)))
}

const STEPS: usize = 16;
const RUNS: usize = 31;

#[autocast]
fn rnn_cached(w: &Param, x: &Tensor<f32>) -> Tensor<f32> {
    let mut h = x.matmul(w).tanh();
    for _ in 1..STEPS {
        h = h.matmul(w).tanh();
    }
    h.mean_all()
}

#[autocast(cache = false)]
fn rnn_uncached(w: &Param, x: &Tensor<f32>) -> Tensor<f32> {
    let mut h = x.matmul(w).tanh();
    for _ in 1..STEPS {
        h = h.matmul(w).tanh();
    }
    h.mean_all()
}

#[divan::bench(sample_count = 30)]
fn mlp_autocast_fwd_bwd(b: divan::Bencher<'_, '_>) {
    let (m, x) = mlp();
    b.bench_local(|| mlp_autocast(&m, &x).backward());
}

#[divan::bench(sample_count = 30)]
fn mlp_hand_cast_fwd_bwd(b: divan::Bencher<'_, '_>) {
    let (m, x) = mlp();
    b.bench_local(|| mlp_by_hand(&m, &x).backward());
}

#[divan::bench(sample_count = 30)]
fn rnn_cache_on_fwd(b: divan::Bencher<'_, '_>) {
    let (w, x) = rnn();
    b.bench_local(|| rnn_cached(&w, &x));
}

#[divan::bench(sample_count = 30)]
fn rnn_cache_off_fwd(b: divan::Bencher<'_, '_>) {
    let (w, x) = rnn();
    b.bench_local(|| rnn_uncached(&w, &x));
}

#[divan::bench(sample_count = 30)]
fn rnn_cache_on_fwd_bwd(b: divan::Bencher<'_, '_>) {
    let (w, x) = rnn();
    b.bench_local(|| rnn_cached(&w, &x).backward());
}

#[divan::bench(sample_count = 30)]
fn rnn_cache_off_fwd_bwd(b: divan::Bencher<'_, '_>) {
    let (w, x) = rnn();
    b.bench_local(|| rnn_uncached(&w, &x).backward());
}

/// Seconds of `f` and `g` run alternately (so drift affects both alike): (median, min) each.
/// On a shared machine the minimum is the steadier estimate of the code's own cost.
fn interleaved(mut f: impl FnMut(), mut g: impl FnMut(), runs: usize) -> ((f64, f64), (f64, f64)) {
    let (mut tf, mut tg) = (Vec::new(), Vec::new());
    f();
    g();
    for _ in 0..runs {
        let t = Instant::now();
        f();
        tf.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        g();
        tg.push(t.elapsed().as_secs_f64());
    }
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0])
    };
    (stats(&mut tf), stats(&mut tg))
}

/// One table row: times of `a` (median and min) and their ratios to `base`.
fn row(what: &str, a: (f64, f64), base: (f64, f64)) {
    println!("| {what} | {:.2} ms | {:.2} ms | {:.3} | {:.3} |", a.0 * 1e3, a.1 * 1e3, a.0 / base.0, a.1 / base.1);
}

fn main() {
    divan::main();

    let (m, x) = mlp();
    let (ta, th) = interleaved(
        || {
            mlp_autocast(&m, &x).backward();
        },
        || {
            mlp_by_hand(&m, &x).backward();
        },
        RUNS,
    );
    let (w, xr) = rnn();
    reset_cast_stats();
    rnn_cached(&w, &xr);
    let on = cast_stats();
    reset_cast_stats();
    rnn_uncached(&w, &xr);
    let off = cast_stats();
    let (f_on, f_off) = interleaved(
        || {
            rnn_cached(&w, &xr);
        },
        || {
            rnn_uncached(&w, &xr);
        },
        RUNS,
    );
    let (t_on, t_off) = interleaved(
        || {
            rnn_cached(&w, &xr).backward();
        },
        || {
            rnn_uncached(&w, &xr).backward();
        },
        RUNS,
    );
    println!("\n{RUNS} interleaved runs each");
    println!("| case | median | min | median ratio | min ratio |");
    println!("| --- | --- | --- | --- | --- |");
    row("MLP fwd+bwd, hand-written casts", th, th);
    row("MLP fwd+bwd, #[autocast]", ta, th);
    let casts = |s: amp_core::__private::CastStats| format!("{} casts, {} cache hits", s.casts, s.cache_hits);
    row(&format!("RNN x{STEPS} fwd, cache off ({})", casts(off)), f_off, f_off);
    row(&format!("RNN x{STEPS} fwd, cache on ({})", casts(on)), f_on, f_off);
    row(&format!("RNN x{STEPS} fwd+bwd, cache off"), t_off, t_off);
    row(&format!("RNN x{STEPS} fwd+bwd, cache on"), t_on, t_off);
}
