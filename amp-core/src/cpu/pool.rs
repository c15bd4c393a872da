//! 2-D max and average pooling over the (H, W) planes of a contiguous tensor, windows as
//! [`Pool2dSpec::window`] places them.
//!
//! Work is split by planes (whole planes per task, [`par_rows`]). Max pooling selects an input
//! value (exact); its backward recomputes each window's argmax from the input rather than
//! keeping indices, and sums the gradients that meet at one input in E::Acc. Averages sum in
//! E::Acc and round once; their backward spreads `g / divisor` over each window the same way.

use super::alloc;
use super::rows::par_rows;
use crate::backend::Pool2dSpec;
use crate::precision::{Accum, Precision};
use num_traits::{Float, Zero};

/// Every window of one plane: `f(output_index, rows, cols, divisor)`.
fn for_each_window(s: &Pool2dSpec, mut f: impl FnMut(usize, (usize, usize), (usize, usize), usize)) {
    let (oh, ow) = s.output;
    for i in 0..oh {
        let (h0, h1, kh) = s.window(0, i);
        for j in 0..ow {
            let (w0, w1, kw) = s.window(1, j);
            f(i * ow + j, (h0, h1), (w0, w1), kh * kw);
        }
    }
}

/// The flat index in its plane of the max of a window (NaN wins: the first NaN; the first of
/// equal values otherwise). Windows are never empty.
fn argmax<E: Precision>(plane: &[E], w: usize, (h0, h1): (usize, usize), (w0, w1): (usize, usize)) -> usize {
    let mut best = h0 * w + w0;
    let mut bv = plane[best].to_acc();
    for h in h0..h1 {
        for (c, v) in plane[h * w + w0..h * w + w1].iter().enumerate() {
            if bv.is_nan() {
                return best;
            }
            let v = v.to_acc();
            if v > bv || v.is_nan() {
                (best, bv) = (h * w + w0 + c, v);
            }
        }
    }
    best
}

/// Work per plane, in elements touched.
fn work(s: &Pool2dSpec) -> usize {
    let (h, w) = s.input;
    let (oh, ow) = s.output;
    (h * w).max(oh * ow).max(1)
}

/// Max pooling of `x` (contiguous `[planes, H, W]`).
pub(crate) fn max_forward<E: Precision>(x: &[E], s: &Pool2dSpec) -> Vec<E> {
    let (hw, ohw) = (s.input.0 * s.input.1, s.output.0 * s.output.1);
    // Every output is one window's max.
    let mut out = alloc::take::<E>(s.planes * ohw);
    par_rows(
        &mut out,
        ohw,
        work(s),
        #[inline(always)]
        |p0, chunk| {
            for (pp, dst) in chunk.chunks_mut(ohw).enumerate() {
                let plane = &x[(p0 + pp) * hw..][..hw];
                for_each_window(s, |o, rows, cols, _| dst[o] = plane[argmax(plane, s.input.1, rows, cols)]);
            }
        },
    );
    out
}

/// Max pooling's backward: `g` (contiguous `[planes, oH, oW]`) routed to each window's argmax
/// in `x`.
pub(crate) fn max_backward<E: Precision>(x: &[E], g: &[E], s: &Pool2dSpec) -> Vec<E> {
    let (hw, ohw) = (s.input.0 * s.input.1, s.output.0 * s.output.1);
    // Every plane is stored whole.
    let mut out = alloc::take::<E>(s.planes * hw);
    par_rows(
        &mut out,
        hw,
        work(s),
        #[inline(always)]
        |p0, chunk| {
            let mut acc = vec![E::Acc::default(); hw];
            for (pp, dst) in chunk.chunks_mut(hw).enumerate() {
                let p = p0 + pp;
                let (plane, gp) = (&x[p * hw..][..hw], &g[p * ohw..][..ohw]);
                acc.fill(E::Acc::default());
                for_each_window(s, |o, rows, cols, _| acc[argmax(plane, s.input.1, rows, cols)] += gp[o].to_acc());
                E::store(&acc, dst);
            }
        },
    );
    out
}

/// Average pooling of `x` (contiguous `[planes, H, W]`).
pub(crate) fn avg_forward<E: Precision>(x: &[E], s: &Pool2dSpec) -> Vec<E> {
    let (hw, ohw, w) = (s.input.0 * s.input.1, s.output.0 * s.output.1, s.input.1);
    let mut out = alloc::take::<E>(s.planes * ohw);
    par_rows(
        &mut out,
        ohw,
        work(s),
        #[inline(always)]
        |p0, chunk| {
            let mut acc = vec![E::Acc::default(); ohw];
            for (pp, dst) in chunk.chunks_mut(ohw).enumerate() {
                let plane = &x[(p0 + pp) * hw..][..hw];
                for_each_window(s, |o, (h0, h1), (w0, w1), div| {
                    let mut sum = E::Acc::zero();
                    for h in h0..h1 {
                        for v in &plane[h * w + w0..h * w + w1] {
                            sum += v.to_acc();
                        }
                    }
                    acc[o] = sum / E::Acc::c(div as f64);
                });
                E::store(&acc, dst);
            }
        },
    );
    out
}

/// Average pooling's backward: `g` (contiguous `[planes, oH, oW]`) spread evenly over each
/// window.
pub(crate) fn avg_backward<E: Precision>(g: &[E], s: &Pool2dSpec) -> Vec<E> {
    let (hw, ohw, w) = (s.input.0 * s.input.1, s.output.0 * s.output.1, s.input.1);
    let mut out = alloc::take::<E>(s.planes * hw);
    par_rows(
        &mut out,
        hw,
        work(s),
        #[inline(always)]
        |p0, chunk| {
            let mut acc = vec![E::Acc::default(); hw];
            for (pp, dst) in chunk.chunks_mut(hw).enumerate() {
                let gp = &g[(p0 + pp) * ohw..][..ohw];
                acc.fill(E::Acc::default());
                for_each_window(s, |o, (h0, h1), (w0, w1), div| {
                    let v = gp[o].to_acc() / E::Acc::c(div as f64);
                    for h in h0..h1 {
                        for a in &mut acc[h * w + w0..h * w + w1] {
                            *a += v;
                        }
                    }
                });
                E::store(&acc, dst);
            }
        },
    );
    out
}
