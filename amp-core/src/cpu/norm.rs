//! Fused layer norm and RMS norm over the last dim of a contiguous `[rows, d]` tensor.
//!
//! Forward loads each row once into `E::Acc`, computes the mean (two-pass variance, so large
//! offsets do not cancel) and `rstd = 1 / sqrt(var + eps)`, applies the optional affine, and
//! rounds once; the per-row mean and rstd are kept in `E::Acc` for backward. Backward computes
//! the input gradient row by row and the weight and bias gradients as per-task partial sums
//! added in task order (deterministic for any thread count).

use super::rows::{dot, par_rows, sum_and_dot, sum_map2};
use super::{acc_in, acc_out};
use crate::precision::{Accum, Precision};
use num_traits::{Float, One, Zero};

/// Per-row statistics saved by the forward pass, in the accumulation type.
pub struct NormStats<A> {
    /// Row means (all zero for RMS norm).
    pub(crate) mean: Vec<A>,
    /// Row reciprocal standard deviations (reciprocal root mean square for RMS norm).
    pub(crate) rstd: Vec<A>,
}

impl<A: Accum> NormStats<A> {
    /// The statistics in the accumulation type `B`, through f64: exact when `B` is `A` itself
    /// seen through a generic parameter (f32 as `E::Acc` for `E = f32`).
    pub(crate) fn to<B: Accum>(&self) -> NormStats<B> {
        let to = |v: &[A]| v.iter().map(|x| B::c(x.f64())).collect();
        NormStats { mean: to(&self.mean), rstd: to(&self.rstd) }
    }
}

fn load_opt<E: Precision>(v: Option<&[E]>) -> Option<Vec<E::Acc>> {
    v.map(|v| {
        let mut out = vec![E::Acc::default(); v.len()];
        E::load(v, &mut out);
        out
    })
}

/// `y = (x - mean) * rstd`, times `w` and plus `b` where given, for one row.
#[inline(always)]
fn normalize<A: Accum>(x: &[A], y: &mut [A], mean: A, rstd: A, w: Option<&[A]>, b: Option<&[A]>) {
    match (w, b) {
        (Some(w), Some(b)) => {
            for (((y, v), w), b) in y.iter_mut().zip(x).zip(w).zip(b) {
                *y = (*v - mean) * rstd * *w + *b;
            }
        }
        (Some(w), None) => {
            for ((y, v), w) in y.iter_mut().zip(x).zip(w) {
                *y = (*v - mean) * rstd * *w;
            }
        }
        (None, Some(b)) => {
            for ((y, v), b) in y.iter_mut().zip(x).zip(b) {
                *y = (*v - mean) * rstd + *b;
            }
        }
        (None, None) => {
            for (y, v) in y.iter_mut().zip(x) {
                *y = (*v - mean) * rstd;
            }
        }
    }
}

/// Normalises each row of `x` (`rows * d`) into `out`: layer norm `(x - mean) * rstd * w + b`, or with
/// `RMS`, `x * rstd * w` where `rstd = 1 / sqrt(mean(x²) + eps)`, rounded once into `O` (`E`
/// itself, or f16/bf16 for an f32 norm whose output a low-precision op reads: the norm and the
/// cast in one pass).
pub(crate) fn forward<E: Precision, O: Precision<Acc = E::Acc>, const RMS: bool>(
    x: &[E],
    d: usize,
    w: Option<&[E]>,
    b: Option<&[E]>,
    eps: f64,
    out: &mut [O],
) -> NormStats<E::Acc> {
    let (wa, ba) = (load_opt(w), load_opt(b));
    let eps = E::Acc::c(eps);
    let inv_d = E::Acc::c(1.0 / d as f64);
    assert_eq!(x.len(), out.len());
    let stats = par_rows(
        out,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            let [mut b0, mut b1, mut by] = std::array::from_fn(|_| vec![E::Acc::default(); d]);
            let mut st = Vec::with_capacity(chunk.len() / d);
            // Two rows at a time: their statistics' sums interleaved (`sum_map2`), the same
            // bits as one row at a time.
            for (k, ys) in chunk.chunks_mut(2 * d).enumerate() {
                let r = r0 + 2 * k;
                // f32 and f64 rows in place; f16 and bf16 rows through f32 scratch rows.
                let x0 = acc_in(&x[r * d..(r + 1) * d], &mut b0);
                // A task's odd last row pairs with itself; the zip below keeps one result.
                let x1 = if ys.len() == 2 * d { acc_in(&x[(r + 1) * d..(r + 2) * d], &mut b1) } else { x0 };
                let (m0, m1) = if RMS { (E::Acc::zero(), E::Acc::zero()) } else { sum_map2(x0, |v| v, x1, |v| v) };
                let (m0, m1) = (m0 * inv_d, m1 * inv_d);
                let (v0, v1) = sum_map2(x0, |v| (v - m0) * (v - m0), x1, |v| (v - m1) * (v - m1));
                for ((xa, y), (mean, var)) in [x0, x1].into_iter().zip(ys.chunks_mut(d)).zip([(m0, v0), (m1, v1)]) {
                    let rstd = E::Acc::one() / (var * inv_d + eps).sqrt();
                    st.push((mean, rstd));
                    acc_out(
                        y,
                        &mut by,
                        #[inline(always)]
                        |y| normalize(xa, y, mean, rstd, wa.as_deref(), ba.as_deref()),
                    );
                }
            }
            st
        },
    );
    let (mean, rstd) = stats.into_iter().flatten().unzip();
    NormStats { mean, rstd }
}

/// Gradients of a norm: the input's (always, into `gx`) and the weight's and bias's sums over rows when
/// asked for. With `x̂ = (x - mean) * rstd` and `ĝ = g * w`:
/// layer norm `dx = rstd * (ĝ - mean(ĝ) - x̂ * mean(ĝ * x̂))`, RMS norm
/// `dx = rstd * (ĝ - x̂ * mean(ĝ * x̂))`; `dw = sum_rows(g * x̂)`, `db = sum_rows(g)`. The output
/// gradient `g` is in the forward's output precision `O`, read as it is (no cast pass); the
/// input's gradient goes into `gx`, or with `ADD` is added into it (f32 and f64: each element
/// `gx + dx` rounded once, as a separate add would, without its pass over memory).
pub(crate) fn backward<E: Precision, O: Precision<Acc = E::Acc>, const RMS: bool, const ADD: bool>(
    x: &[E],
    g: &[O],
    d: usize,
    w: Option<&[E]>,
    stats: &NormStats<E::Acc>,
    (need_w, need_b): (bool, bool),
    gx: &mut [E],
) -> (Option<Vec<E>>, Option<Vec<E>>) {
    assert_eq!(x.len(), gx.len());
    // Adding reads `gx` in place: only where it is in the accumulation type.
    assert!(!ADD || E::as_acc(gx).is_some(), "a norm backward adds into f32 or f64 only");
    let wa = load_opt(w);
    let inv_d = E::Acc::c(1.0 / d as f64);
    let partials = par_rows(
        gx,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            // Scratch rows: the loaded input, x̂, the loaded gradient, g * w and the output.
            let [mut bl, mut bx, mut bg, mut bh, mut bo] = std::array::from_fn(|_| vec![E::Acc::default(); d]);
            let mut pw = if need_w { vec![E::Acc::zero(); d] } else { Vec::new() };
            let mut pb = if need_b { vec![E::Acc::zero(); d] } else { Vec::new() };
            for (k, out) in chunk.chunks_mut(d).enumerate() {
                let r = r0 + k;
                let (mean, rstd) = (stats.mean[r], stats.rstd[r]);
                // f32 and f64 rows are read and written in place; f16 and bf16 rows go through
                // f32 scratch rows.
                let xa = acc_in(&x[r * d..(r + 1) * d], &mut bl);
                for (h, v) in bx.iter_mut().zip(xa) {
                    *h = (*v - mean) * rstd; // x̂
                }
                let ga = acc_in(&g[r * d..(r + 1) * d], &mut bg);
                if need_w {
                    for ((p, gv), h) in pw.iter_mut().zip(ga).zip(&bx) {
                        *p += *gv * *h;
                    }
                }
                if need_b {
                    for (p, gv) in pb.iter_mut().zip(ga) {
                        *p += *gv;
                    }
                }
                match &wa {
                    Some(w) => {
                        for ((h, gv), w) in bh.iter_mut().zip(ga).zip(w) {
                            *h = *gv * *w;
                        }
                    }
                    None => bh.copy_from_slice(ga),
                }
                let (mean_gh, mean_ghx) = if RMS {
                    (E::Acc::zero(), dot(&bh, &bx) * inv_d)
                } else {
                    let (s, sx) = sum_and_dot(&bh, &bx);
                    (s * inv_d, sx * inv_d)
                };
                acc_out(
                    out,
                    &mut bo,
                    #[inline(always)]
                    |o| {
                        for ((o, h), xh) in o.iter_mut().zip(&bh).zip(&bx) {
                            let v = rstd * (*h - mean_gh - *xh * mean_ghx);
                            *o = if ADD { *o + v } else { v };
                        }
                    },
                );
            }
            (pw, pb)
        },
    );
    // Sum the per-task partials in task order, then round once.
    let (pw, pb): (Vec<_>, Vec<_>) = partials.into_iter().unzip();
    let finish = |need: bool, parts: &[Vec<E::Acc>]| {
        need.then(|| {
            let mut acc = vec![E::Acc::zero(); d];
            for p in parts {
                for (a, v) in acc.iter_mut().zip(p) {
                    *a += *v;
                }
            }
            let mut out = super::alloc::take::<E>(d);
            E::store(&acc, &mut out);
            out
        })
    };
    (finish(need_w, &pw), finish(need_b, &pb))
}
