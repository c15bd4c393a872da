//! Reductions over one dim of a contiguous tensor viewed as `[outer, d, inner]`.
//! Accumulation is in `E::Acc` (f32 for f16/bf16) and the result is rounded once.

use rayon::prelude::*;

use super::{BUF, PAR_MIN, sum_buf};
use crate::precision::{Accum, Precision};
use crate::simd::dispatch;
use num_traits::Float;

/// What a reduction combines with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    Max,
}

/// Combines two values (NaN wins for max, as in PyTorch).
#[inline(always)]
pub(crate) fn combine<A: Accum>(kind: Reduce, a: A, b: A) -> A {
    match kind {
        Reduce::Sum => a + b,
        // NaN propagates, as in PyTorch.
        Reduce::Max => {
            if a > b || a.is_nan() {
                a
            } else {
                b
            }
        }
    }
}

fn identity<A: Accum>(kind: Reduce) -> A {
    match kind {
        Reduce::Sum => A::zero(),
        Reduce::Max => A::neg_infinity(),
    }
}

/// Reduces `x` (contiguous, `outer * d * inner` elements) over `d`, multiplying by `scale`
/// before the single rounding (mean passes `1/d`).
pub(crate) fn reduce_dim<E: Precision>(
    x: &[E],
    (outer, d, inner): (usize, usize, usize),
    kind: Reduce,
    scale: f64,
) -> Vec<E> {
    let scale = E::Acc::c(scale);
    // Both loops below write every output.
    let mut out = super::alloc::take::<E>(outer * inner);
    let big = x.len() >= PAR_MIN;
    if inner == 1 {
        let row = |(o, y): (usize, &mut E)| {
            dispatch(
                #[inline(always)]
                || {
                    let mut buf = [E::Acc::default(); BUF];
                    let mut acc = identity::<E::Acc>(kind);
                    for c in x[o * d..(o + 1) * d].chunks(BUF) {
                        let b = &mut buf[..c.len()];
                        E::load(c, b);
                        acc = match kind {
                            Reduce::Sum => acc + sum_buf(b),
                            _ => b.iter().fold(acc, |a, v| combine(kind, a, *v)),
                        };
                    }
                    *y = E::from_acc(acc * scale);
                },
            )
        };
        if big {
            out.par_iter_mut().enumerate().with_min_len(1).for_each(row);
        } else {
            out.iter_mut().enumerate().for_each(row);
        }
        return out;
    }
    // inner > 1: accumulate whole rows of `inner` in blocks of BUF.
    let blocks = inner.div_ceil(BUF);
    let block = |(ob, y): (usize, &mut [E])| {
        dispatch(
            #[inline(always)]
            || {
                let (o, bi) = (ob / blocks, ob % blocks);
                let i0 = bi * BUF;
                let n = y.len();
                let mut acc = [identity::<E::Acc>(kind); BUF];
                let mut buf = [E::Acc::default(); BUF];
                for j in 0..d {
                    let s = o * d * inner + j * inner + i0;
                    E::load(&x[s..s + n], &mut buf[..n]);
                    for i in 0..n {
                        acc[i] = combine(kind, acc[i], buf[i]);
                    }
                }
                for a in acc[..n].iter_mut() {
                    *a *= scale;
                }
                E::store(&acc[..n], y);
            },
        )
    };
    // Split `out` into (outer, block) pieces.
    let pieces = out.chunks_mut(inner).flat_map(|r| r.chunks_mut(BUF)).enumerate();
    if big {
        pieces.collect::<Vec<_>>().into_par_iter().for_each(block);
    } else {
        pieces.for_each(block);
    }
    out
}

/// Index of the max (or min) along `d`; the first NaN wins, as in PyTorch.
pub(crate) fn arg_reduce<E: Precision>(x: &[E], (outer, d, inner): (usize, usize, usize), max: bool) -> Vec<usize> {
    let mut out = vec![0usize; outer * inner];
    let f = |(oi, y): (usize, &mut usize)| {
        let (o, i) = (oi / inner, oi % inner);
        let mut best = 0;
        let mut bv = x[o * d * inner + i].to_acc();
        for j in 1..d {
            if bv.is_nan() {
                break;
            }
            let v = x[o * d * inner + j * inner + i].to_acc();
            if v.is_nan() || (max && v > bv) || (!max && v < bv) {
                best = j;
                bv = v;
            }
        }
        *y = best;
    };
    if x.len() >= PAR_MIN {
        out.par_iter_mut().enumerate().for_each(f);
    } else {
        out.iter_mut().enumerate().for_each(f);
    }
    out
}
