//! Reductions over one dim of a contiguous tensor viewed as `[outer, d, inner]`.
//! Accumulation is in `E::Acc` (f32 for f16/bf16) and the result is rounded once.

use rayon::prelude::*;

use super::{BUF, PAR_MIN, sum_buf};
use crate::precision::{Accum, DType, Precision};
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

/// Rows per group of a reduction over `d` with `inner > 1`: each group of rows is reduced on
/// its own (in parallel) and the groups are combined in order. Without groups a sum over the
/// rows of `[2048, 256]` (a bias gradient) was one task, and took 2.2x PyTorch's time. A
/// constant, not a share of the threads, so results do not depend on the thread count.
const GROUP_ROWS: usize = 128;

/// The most columns one task of a reduction over groups of rows accumulates (8 KiB of f32
/// accumulators, in L1).
const PIECE_COLS: usize = 2048;

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
    // inner > 1: accumulate whole rows of `inner` in blocks of BUF columns; over more than
    // GROUP_ROWS rows, per group of rows, each group's accumulators kept apart and combined in
    // group order.
    let blocks = inner.div_ceil(BUF);
    let groups = d.div_ceil(GROUP_ROWS).max(1);
    if groups == 1 {
        let block = |(ob, y): (usize, &mut [E])| {
            dispatch(
                #[inline(always)]
                || {
                    let (o, bi) = (ob / blocks, ob % blocks);
                    let n = y.len();
                    let mut acc = [identity::<E::Acc>(kind); BUF];
                    accumulate(x, (d, inner), kind, o, 0..d, bi * BUF, &mut acc[..n]);
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
        return out;
    }
    // Accumulators: per (outer, group), `inner` of them. A task takes one group's rows across
    // up to PIECE_COLS columns, row after row, so it streams through memory (split by blocks
    // of BUF columns, a task read 1 KiB of each row and jumped to the next: in a W2 step the
    // bias gradient of `[2048, 1024]` ran at 12 GB/s).
    let chunks = inner.div_ceil(PIECE_COLS);
    let mut acc = vec![identity::<E::Acc>(kind); outer * groups * inner];
    let group = |(piece, y): (usize, &mut [E::Acc])| {
        dispatch(
            #[inline(always)]
            || {
                let (og, ci) = (piece / chunks, piece % chunks);
                let (o, g) = (og / groups, og % groups);
                accumulate(x, (d, inner), kind, o, g * GROUP_ROWS..d.min((g + 1) * GROUP_ROWS), ci * PIECE_COLS, y);
            },
        )
    };
    let pieces = acc.chunks_mut(inner).flat_map(|r| r.chunks_mut(PIECE_COLS)).enumerate();
    if big {
        pieces.collect::<Vec<_>>().into_par_iter().for_each(group);
    } else {
        pieces.for_each(group);
    }
    // Each output: its groups' accumulators in order, scaled, rounded once.
    let finish = |(o, y): (usize, &mut [E])| {
        dispatch(
            #[inline(always)]
            || {
                let mut buf = [E::Acc::default(); BUF];
                for (bi, y) in y.chunks_mut(BUF).enumerate() {
                    let (i0, n) = (bi * BUF, y.len());
                    let b = &mut buf[..n];
                    b.copy_from_slice(&acc[o * groups * inner + i0..][..n]);
                    for g in 1..groups {
                        for (a, v) in b.iter_mut().zip(&acc[(o * groups + g) * inner + i0..][..n]) {
                            *a = combine(kind, *a, *v);
                        }
                    }
                    for a in b.iter_mut() {
                        *a *= scale;
                    }
                    E::store(b, y);
                }
            },
        )
    };
    if big {
        out.par_chunks_mut(inner).enumerate().for_each(finish);
    } else {
        out.chunks_mut(inner).enumerate().for_each(finish);
    }
    out
}

/// Combines rows `rows` of `x` viewed as `[outer, d, inner]`, at outer index `o` and columns
/// `i0..i0 + y.len()`, into `y` (one accumulator per column), row after row.
#[inline(always)]
fn accumulate<E: Precision>(
    x: &[E],
    (d, inner): (usize, usize),
    kind: Reduce,
    o: usize,
    rows: std::ops::Range<usize>,
    i0: usize,
    y: &mut [E::Acc],
) {
    let n = y.len();
    // A sum converts each value inline where that is cheap (bf16 is a shift): one loop that
    // reads the row and adds, in half the time of converting the row into a scratch buffer
    // first and adding that (a bias gradient of `[2048, 1024]` bf16, one thread: 406 ->
    // 160-200 us). f16's conversion is only fast over a slice (F16C), so f16 and max keep
    // the buffer.
    let inline = kind == Reduce::Sum && E::DTYPE != DType::F16;
    let row = |j: usize| &x[o * d * inner + j * inner + i0..][..n];
    if inline {
        // Four rows per pass over the accumulators, added in row order (the same bits as one
        // row at a time) with one load and store of each accumulator instead of four: the
        // bias gradient of `[2048, 1024]` bf16, 2 threads on Zen 4, 51-68 -> 43-44 us.
        let mut j = rows.start;
        while j + 4 <= rows.end {
            let (r0, r1, r2, r3) = (row(j), row(j + 1), row(j + 2), row(j + 3));
            for ((((a, v0), v1), v2), v3) in y.iter_mut().zip(r0).zip(r1).zip(r2).zip(r3) {
                *a = *a + v0.to_acc() + v1.to_acc() + v2.to_acc() + v3.to_acc();
            }
            j += 4;
        }
        for j in j..rows.end {
            y.iter_mut().zip(row(j)).for_each(|(a, v)| *a += v.to_acc());
        }
        return;
    }
    let mut buf = [E::Acc::default(); BUF];
    for j in rows {
        let row = row(j);
        for (c, ys) in row.chunks(BUF).zip(y.chunks_mut(BUF)) {
            let b = &mut buf[..c.len()];
            E::load(c, b);
            // The kind is matched outside the column loop so the sum's loop vectorizes.
            match kind {
                Reduce::Sum => ys.iter_mut().zip(b.iter()).for_each(|(a, v)| *a += *v),
                Reduce::Max => ys.iter_mut().zip(b.iter()).for_each(|(a, v)| *a = combine(kind, *a, *v)),
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// `reduce_dim` against an f64 loop, on shapes whose `d` spans one, several and a ragged
    /// last group of rows, with `outer > 1` and `inner` past one block of columns and past
    /// one task's columns; in bf16 (sums converted inline), f16 (through the scratch buffer)
    /// and f32; max with a NaN in one group only.
    #[test]
    fn reductions_over_groups_of_rows_match_an_f64_loop() {
        check_against_f64::<bf16>(4e-3);
        check_against_f64::<half::f16>(5e-4);
        check_against_f64::<f32>(1e-5);
    }

    fn check_against_f64<E: Precision>(tol: f64) {
        let shapes = [(1, 2048, 256), (3, 300, 5), (2, 129, 513), (2, 7, 600), (1, 128, 1000), (2, 260, 4100)];
        for (outer, d, inner) in shapes {
            let n = outer * d * inner;
            let x: Vec<E> = (0..n).map(|i| E::from_f64(((i * 7919) % 1000) as f64 / 250.0 - 2.0)).collect();
            let at = |o: usize, j: usize, i: usize| x[(o * d + j) * inner + i].to_f64();
            let mean = reduce_dim(&x, (outer, d, inner), Reduce::Sum, 1.0 / d as f64);
            let max = reduce_dim(&x, (outer, d, inner), Reduce::Max, 1.0);
            for o in 0..outer {
                for i in 0..inner {
                    let want = (0..d).map(|j| at(o, j, i)).sum::<f64>() / d as f64;
                    let got = mean[o * inner + i].to_f64();
                    assert!(
                        (got - want).abs() <= tol * want.abs().max(1e-2),
                        "{} mean {outer}x{d}x{inner} at ({o}, {i}): {got} vs {want}",
                        E::DTYPE
                    );
                    let want = (0..d).map(|j| at(o, j, i)).fold(f64::NEG_INFINITY, f64::max);
                    assert_eq!(max[o * inner + i].to_f64(), want, "{} max {outer}x{d}x{inner} at ({o}, {i})", E::DTYPE);
                }
            }
        }
    }

    /// A sum over rows is, per column, each group of [`GROUP_ROWS`] rows added row after row
    /// in f32 from zero, the groups' sums added in order, then scaled and rounded once: bit
    /// for bit, for row counts that are and are not multiples of the four rows the inline sum
    /// takes per pass, one group or several.
    #[test]
    fn sums_over_rows_add_each_group_row_by_row_bit_for_bit() {
        fn check<E: Precision<Acc = f32>>() {
            for (d, inner) in [(7, 33), (128, 40), (131, 17), (300, 64), (2, 5)] {
                // Magnitudes spread over 2^-12..2^12, so a different order of the adds would
                // round differently.
                let x: Vec<E> = (0..d * inner)
                    .map(|i| {
                        let k = (i * 7919 + 13) % 10007;
                        E::from_f64((k as f64 / 10007.0 - 0.4) * 2f64.powi((k % 25) as i32 - 12))
                    })
                    .collect();
                let got = reduce_dim(&x, (1, d, inner), Reduce::Sum, 0.5);
                for i in 0..inner {
                    let mut total = 0f32;
                    for (g, rows) in (0..d).collect::<Vec<_>>().chunks(GROUP_ROWS).enumerate() {
                        let group = rows.iter().fold(0f32, |a, &j| a + x[j * inner + i].to_acc());
                        total = if g == 0 { group } else { total + group };
                    }
                    let want = E::from_acc(total * 0.5);
                    assert_eq!(
                        got[i].to_f64().to_bits(),
                        want.to_f64().to_bits(),
                        "{} {d}x{inner} column {i}",
                        E::DTYPE
                    );
                }
            }
        }
        check::<bf16>();
        check::<f32>();
    }

    /// A NaN in the third group of rows wins the max of its column, and only there.
    #[test]
    fn a_nan_wins_the_max_of_its_column_only() {
        let (d, inner) = (300, 3);
        let mut x = vec![bf16::ONE; d * inner];
        x[260 * inner + 1] = bf16::NAN;
        let max = reduce_dim(&x, (1, d, inner), Reduce::Max, 1.0);
        assert!(max[0] == bf16::ONE && max[1].is_nan() && max[2] == bf16::ONE);
    }
}
