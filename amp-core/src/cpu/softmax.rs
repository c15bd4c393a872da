//! Fused softmax / log-softmax over the last dim of a contiguous `[rows, d]` tensor, forward
//! and backward. Each row is loaded once into an `E::Acc` scratch row (f32 for f16/bf16),
//! max-subtracted, exponentiated and normalised there, and rounded once on store.

use super::BUF;
use super::rows::{dot, exp_in_place, max_buf, par_rows, sum_map};
use crate::precision::{Accum, Precision};
use num_traits::One;

/// `log(sum(exp(row - m))) + m` for a row already in the accumulation type, where `m` is the
/// row's max: the log-sum-exp, exact for rows with a large max.
#[inline]
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

/// Softmax (or, with `LOG`, log-softmax) of each row of `x` (`rows * d` elements).
pub(crate) fn forward<E: Precision, const LOG: bool>(x: &[E], d: usize) -> Vec<E> {
    let mut out = super::alloc::take::<E>(x.len()); // every row is stored
    par_rows(
        &mut out,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            let mut buf = vec![E::Acc::default(); d];
            for (k, y) in chunk.chunks_mut(d).enumerate() {
                let r = r0 + k;
                E::load(&x[r * d..(r + 1) * d], &mut buf);
                if LOG {
                    let (_, lse) = log_sum_exp(&buf);
                    for v in buf.iter_mut() {
                        *v = *v - lse;
                    }
                } else {
                    let m = max_buf(&buf);
                    for v in buf.iter_mut() {
                        *v = *v - m;
                    }
                    exp_in_place(&mut buf);
                    let inv = E::Acc::one() / sum_map(&buf, |v| v);
                    for v in buf.iter_mut() {
                        *v *= inv;
                    }
                }
                E::store(&buf, y);
            }
        },
    );
    out
}

/// The input gradient from the output `y` and its gradient `g` (both `rows * d`):
/// softmax `y * (g - sum(g * y))`, log-softmax `g - exp(y) * sum(g)`.
pub(crate) fn backward<E: Precision, const LOG: bool>(y: &[E], g: &[E], d: usize) -> Vec<E> {
    let mut out = super::alloc::take::<E>(y.len()); // every row is stored
    par_rows(
        &mut out,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            let mut by = vec![E::Acc::default(); d];
            let mut bg = vec![E::Acc::default(); d];
            for (k, gx) in chunk.chunks_mut(d).enumerate() {
                let r = r0 + k;
                E::load(&y[r * d..(r + 1) * d], &mut by);
                E::load(&g[r * d..(r + 1) * d], &mut bg);
                if LOG {
                    let sg = sum_map(&bg, |v| v);
                    exp_in_place(&mut by);
                    for (gv, p) in bg.iter_mut().zip(&by) {
                        *gv = *gv - *p * sg;
                    }
                } else {
                    let s = dot(&bg, &by);
                    for (gv, p) in bg.iter_mut().zip(&by) {
                        *gv = *p * (*gv - s);
                    }
                }
                E::store(&bg, gx);
            }
        },
    );
    out
}
