//! Fused softmax / log-softmax over the last dim of a contiguous `[rows, d]` tensor, forward
//! and backward. Each row is loaded once into an `E::Acc` scratch row (f32 for f16/bf16),
//! max-subtracted, exponentiated and normalised there, and rounded once on store.

use super::rows::{dot, exp_in_place, max_buf, par_rows, sum_map};
use super::{BUF, acc_in, acc_out};
use crate::precision::{Accum, Precision};

/// `log(sum(exp(row - m))) + m` for a row already in the accumulation type, where `m` is the
/// row's max: the log-sum-exp, exact for rows with a large max. Always inlined: called inside a
/// dispatched loop (cross-entropy's rows), a call would run code built for the baseline ISA.
#[inline(always)]
pub(crate) fn log_sum_exp<A: Accum>(row: &[A]) -> (A, A) {
    let m = max_buf(row);
    let mut tmp = [A::zero(); BUF];
    let mut s = A::zero();
    for c in row.chunks(BUF) {
        let t = &mut tmp[..c.len()];
        for (t, v) in t.iter_mut().zip(c) {
            *t = *v - m;
        }
        exp_in_place(t);
        s += sum_map(t, |v| v);
    }
    (m, m + s.ln())
}

/// Softmax (or, with `LOG`, log-softmax) of one row `x` into `y`, in the accumulation type.
#[inline(always)]
fn row<A: Accum, const LOG: bool>(x: &[A], y: &mut [A]) {
    if LOG {
        let (_, lse) = log_sum_exp(x);
        for (y, v) in y.iter_mut().zip(x) {
            *y = *v - lse;
        }
    } else {
        let m = max_buf(x);
        for (y, v) in y.iter_mut().zip(x) {
            *y = *v - m;
        }
        exp_in_place(y);
        let inv = A::one() / sum_map(y, |v| v);
        for v in y.iter_mut() {
            *v *= inv;
        }
    }
}

/// Softmax (or, with `LOG`, log-softmax) of each row of `x` (`rows * d` elements) into `out`,
/// in `O` (`E` itself, or f32 for an f16/bf16 input: the softmax that also casts, with no
/// pass of its own for the cast).
pub(crate) fn forward<E: Precision, O: Precision<Acc = E::Acc>, const LOG: bool>(x: &[E], d: usize, out: &mut [O]) {
    assert_eq!(x.len(), out.len());
    par_rows(
        out,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            // f32 and f64 rows in place; f16 and bf16 rows through f32 scratch rows.
            let (mut bx, mut by) = (vec![E::Acc::default(); d], vec![E::Acc::default(); d]);
            for (x, y) in x[r0 * d..r0 * d + chunk.len()].chunks(d).zip(chunk.chunks_mut(d)) {
                let x = acc_in(x, &mut bx);
                acc_out(
                    y,
                    &mut by,
                    #[inline(always)]
                    |y| row::<_, LOG>(x, y),
                );
            }
        },
    );
}

/// The input gradient of one row from its output `y` and output gradient `g`, into `gx`.
#[inline(always)]
fn row_backward<A: Accum, const LOG: bool>(y: &[A], g: &[A], gx: &mut [A]) {
    if LOG {
        let sg = sum_map(g, |v| v);
        for ((o, p), gv) in gx.iter_mut().zip(y).zip(g) {
            *o = *gv - p.vexp() * sg;
        }
    } else {
        let s = dot(g, y);
        for ((o, p), gv) in gx.iter_mut().zip(y).zip(g) {
            *o = *p * (*gv - s);
        }
    }
}

/// The input gradient from the output `y` and its gradient `g` (both `rows * d`):
/// softmax `y * (g - sum(g * y))`, log-softmax `g - exp(y) * sum(g)`, rounded once into the
/// input's precision `E` (`O` itself, or f16/bf16 for an f32 softmax of an f16/bf16 input).
pub(crate) fn backward<O: Precision, E: Precision<Acc = O::Acc>, const LOG: bool>(
    y: &[O],
    g: &[O],
    d: usize,
    out: &mut [E],
) {
    assert!(y.len() == out.len() && g.len() == out.len());
    par_rows(
        out,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            let r = r0 * d..r0 * d + chunk.len();
            // f32 and f64 rows in place; f16 and bf16 rows through f32 scratch rows.
            let mut by = vec![O::Acc::default(); d];
            let mut bg = vec![O::Acc::default(); d];
            let mut bo = vec![O::Acc::default(); d];
            for ((y, g), gx) in y[r.clone()].chunks(d).zip(g[r].chunks(d)).zip(chunk.chunks_mut(d)) {
                let (y, g) = (acc_in(y, &mut by), acc_in(g, &mut bg));
                acc_out(
                    gx,
                    &mut bo,
                    #[inline(always)]
                    |gx| row_backward::<_, LOG>(y, g, gx),
                );
            }
        },
    );
}
