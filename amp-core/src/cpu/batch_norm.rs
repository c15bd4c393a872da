//! Batch norm over dim 1 of a contiguous `[N, C, inner]` tensor: statistics per channel in
//! `E::Acc` (two-pass variance), one rounding of the output, running buffers in f32.
//!
//! A channel's elements are `N` runs of `inner` contiguous values, `C·inner` apart. Statistics
//! and backward's two sums run in parallel over channels (each channel summed in a fixed
//! order, so results do not depend on the thread count); the elementwise passes run in
//! parallel over `(n, c)` runs.

use super::norm::NormStats;
use super::rows::{par_row_ranges, par_rows};
use super::{BUF, sum_buf};
use crate::backend::DimSplit;
use crate::precision::{Accum, Precision};
use num_traits::{One, Zero};

/// `f(buffer)` over a channel's values in `E::Acc`, a buffer of up to [`BUF`] at a time.
fn for_each_buf<E: Precision>(x: &[E], s: DimSplit, c: usize, mut f: impl FnMut(&[E::Acc])) {
    let mut buf = [E::Acc::default(); BUF];
    for n in 0..s.outer {
        for part in x[(n * s.dim + c) * s.inner..][..s.inner].chunks(BUF) {
            let b = &mut buf[..part.len()];
            E::load(part, b);
            f(b);
        }
    }
}

/// A channel's batch statistics: mean, biased variance and unbiased variance.
pub(crate) struct BatchStats<A> {
    pub(crate) mean: Vec<A>,
    pub(crate) var: Vec<A>,
    pub(crate) unbiased: Vec<A>,
}

/// The mean and the variances of every channel (two passes: the mean, then squared
/// deviations from it, so a large offset does not cancel).
pub(crate) fn batch_stats<E: Precision>(x: &[E], s: DimSplit) -> BatchStats<E::Acc> {
    let m = s.outer * s.inner;
    let per = par_row_ranges(
        s.dim,
        m,
        #[inline(always)]
        |cs| {
            cs.map(|c| {
                let mut sum = E::Acc::zero();
                for_each_buf(x, s, c, |b| sum += sum_buf(b));
                let mean = sum / E::Acc::c(m as f64);
                let mut ss = E::Acc::zero();
                for_each_buf(x, s, c, |b| {
                    let mut lanes = E::Acc::zero();
                    for v in b {
                        lanes += (*v - mean) * (*v - mean);
                    }
                    ss += lanes;
                });
                (mean, ss / E::Acc::c(m as f64), ss / E::Acc::c(m.saturating_sub(1) as f64))
            })
            .collect::<Vec<_>>()
        },
    );
    let mut st = BatchStats { mean: Vec::new(), var: Vec::new(), unbiased: Vec::new() };
    for (mean, var, unbiased) in per.into_iter().flatten() {
        st.mean.push(mean);
        st.var.push(var);
        st.unbiased.push(unbiased);
    }
    st
}

/// `running = (1 - momentum) * running + momentum * stat` for the running mean and variance
/// (the unbiased one), in f64, rounded once into f32.
pub(crate) fn update_running<A: Accum>(mean: &mut [f32], var: &mut [f32], st: &BatchStats<A>, momentum: f64) {
    for (r, s) in mean.iter_mut().zip(&st.mean).chain(var.iter_mut().zip(&st.unbiased)) {
        *r = ((1.0 - momentum) * *r as f64 + momentum * s.f64()) as f32;
    }
}

/// The statistics normalisation uses: the batch's (`var` biased) or given ones, as means and
/// reciprocal standard deviations.
pub(crate) fn channel_stats<A: Accum>(mean: Vec<A>, var: &[A], eps: f64) -> NormStats<A> {
    let eps = A::c(eps);
    let rstd = var.iter().map(|v| A::one() / (*v + eps).sqrt()).collect();
    NormStats { mean, rstd }
}

/// `y = (x - mean) * rstd * w + b` per channel, rounded once; the weight and bias in
/// `E::Acc` (f32 parameters of an f16/bf16 input, as PyTorch's mixed batch norm).
pub(crate) fn forward<E: Precision>(
    x: &[E],
    s: DimSplit,
    st: &NormStats<E::Acc>,
    wa: Option<&[E::Acc]>,
    ba: Option<&[E::Acc]>,
) -> Vec<E> {
    let inner = s.inner;
    // Every run is stored.
    let mut out = super::alloc::take::<E>(x.len());
    par_rows(
        &mut out,
        inner,
        inner,
        #[inline(always)]
        |r0, chunk| {
            let mut buf = [E::Acc::default(); BUF];
            for (k, y) in chunk.chunks_mut(inner).enumerate() {
                let (r, c) = (r0 + k, (r0 + k) % s.dim);
                let scale = st.rstd[c] * wa.map_or(E::Acc::one(), |w| w[c]);
                let (mean, shift) = (st.mean[c], ba.map_or(E::Acc::zero(), |b| b[c]));
                for (xs, ys) in x[r * inner..(r + 1) * inner].chunks(BUF).zip(y.chunks_mut(BUF)) {
                    let bb = &mut buf[..xs.len()];
                    E::load(xs, bb);
                    for v in bb.iter_mut() {
                        *v = (*v - mean) * scale + shift;
                    }
                    E::store(bb, ys);
                }
            }
        },
    );
    out
}

/// Batch norm's gradients: the input's (always), the weight's (`Σ g·x̂`) and the bias's
/// (`Σ g`, both in `E::Acc`, the parameters' precision) when asked for. In training, `dx = w·rstd·(g - Σg/M - x̂·Σ(g·x̂)/M)` (`M = N·inner`);
/// in eval, `dx = w·rstd·g`.
#[allow(clippy::type_complexity)]
pub(crate) fn backward<E: Precision>(
    x: &[E],
    g: &[E],
    s: DimSplit,
    wa: Option<&[E::Acc]>,
    st: &NormStats<E::Acc>,
    (need_w, need_b): (bool, bool),
    training: bool,
) -> (Vec<E>, Option<Vec<E::Acc>>, Option<Vec<E::Acc>>) {
    let m = s.outer * s.inner;
    // Σg and Σ(g·x̂) per channel, needed by training's dx and by the parameter gradients.
    let sums: Vec<(E::Acc, E::Acc)> = if training || need_w || need_b {
        par_row_ranges(
            s.dim,
            2 * m,
            #[inline(always)]
            |cs| {
                cs.map(|c| {
                    let (mean, rstd) = (st.mean[c], st.rstd[c]);
                    let (mut sg, mut sgx) = (E::Acc::zero(), E::Acc::zero());
                    let (mut bx, mut bg) = ([E::Acc::default(); BUF], [E::Acc::default(); BUF]);
                    for n in 0..s.outer {
                        let at = (n * s.dim + c) * s.inner;
                        for (xs, gs) in x[at..at + s.inner].chunks(BUF).zip(g[at..at + s.inner].chunks(BUF)) {
                            let (bx, bg) = (&mut bx[..xs.len()], &mut bg[..xs.len()]);
                            E::load(xs, bx);
                            E::load(gs, bg);
                            sg += sum_buf(bg);
                            for (xv, gv) in bx.iter_mut().zip(bg.iter()) {
                                *xv = (*xv - mean) * rstd * *gv;
                            }
                            sgx += sum_buf(bx);
                        }
                    }
                    (sg, sgx)
                })
                .collect::<Vec<_>>()
            },
        )
        .into_iter()
        .flatten()
        .collect()
    } else {
        Vec::new()
    };
    let inv_m = E::Acc::c(1.0 / m as f64);
    let inner = s.inner;
    let mut gx = super::alloc::take::<E>(x.len()); // every run is stored
    par_rows(
        &mut gx,
        inner,
        inner,
        #[inline(always)]
        |r0, chunk| {
            let mut bx = [E::Acc::default(); BUF];
            let mut bg = [E::Acc::default(); BUF];
            for (k, out) in chunk.chunks_mut(inner).enumerate() {
                let (r, c) = (r0 + k, (r0 + k) % s.dim);
                let (mean, rstd) = (st.mean[c], st.rstd[c]);
                let scale = rstd * wa.map_or(E::Acc::one(), |w| w[c]);
                let span = r * inner..(r + 1) * inner;
                for ((xs, gs), os) in x[span.clone()].chunks(BUF).zip(g[span].chunks(BUF)).zip(out.chunks_mut(BUF)) {
                    let (bx, bg) = (&mut bx[..xs.len()], &mut bg[..xs.len()]);
                    E::load(gs, bg);
                    if training {
                        let (mg, mgx) = (sums[c].0 * inv_m, sums[c].1 * inv_m);
                        E::load(xs, bx);
                        for (xv, gv) in bx.iter_mut().zip(bg.iter()) {
                            *xv = scale * (*gv - mg - (*xv - mean) * rstd * mgx);
                        }
                    } else {
                        for (xv, gv) in bx.iter_mut().zip(bg.iter()) {
                            *xv = scale * *gv;
                        }
                    }
                    E::store(bx, os);
                }
            }
        },
    );
    let finish = |need: bool, pick: fn(&(E::Acc, E::Acc)) -> E::Acc| need.then(|| sums.iter().map(pick).collect());
    let gb = finish(need_b, |p| p.0);
    let gw = finish(need_w, |p| p.1);
    (gx, gw, gb)
}
