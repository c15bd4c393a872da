//! Row-wise kernel helpers: parallel loops over rows of a `[rows, len]` view, lane-split sums
//! and a vectorisable `exp`, shared by softmax, the norms and the losses.
//!
//! Design notes:
//! - Rows are grouped into tasks of about [`CHUNK`] elements of work; the grouping depends only
//!   on the shape, never on the thread count, so per-task partial sums (weight gradients,
//!   losses) are added in task order and identical runs give bit-identical results.
//! - Sums use eight independent lanes so the compiler vectorises them.
//! - `exp` on f32 buffers is the branch-free polynomial in [`super::fastmath`], which the
//!   compiler vectorises (libm's `expf` is a call per element).

use std::ops::Range;

use rayon::prelude::*;

use super::CHUNK;
use super::reduce::{Reduce, combine};
use crate::precision::Accum;
use crate::simd::dispatch;

/// Below this much work (elements touched) a row kernel runs on the calling thread: row kernels
/// do several passes and transcendental calls, so they pay for threads sooner than copies do.
const ROW_PAR_MIN: usize = 32 * 1024;

/// Rows per task for rows of `work_row` elements of work.
fn rows_per_task(work_row: usize) -> usize {
    (CHUNK / work_row.max(1)).max(1)
}

/// Runs `f(first_row, rows_chunk)` over `out` split into whole rows of `out_row` elements,
/// grouped into tasks of about [`CHUNK`] elements of work (`work_row` per row), in parallel when
/// there is enough work. Returns each task's result in row order. Each task runs through
/// [`dispatch`], so pass `f` as `#[inline(always)] |r0, chunk| ...`.
pub(crate) fn par_rows<T: Send, R: Send>(
    out: &mut [T],
    out_row: usize,
    work_row: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync + Send,
) -> Vec<R> {
    if out.is_empty() || out_row == 0 {
        return Vec::new();
    }
    let rows = out.len() / out_row;
    let per = rows_per_task(work_row);
    let task = |i: usize, chunk: &mut [T]| {
        dispatch(
            #[inline(always)]
            || f(i * per, chunk),
        )
    };
    par_rows_dyn(out, per * out_row, rows * work_row >= ROW_PAR_MIN && rows > per, &task)
}

/// [`par_rows`]' walk behind a trait object: rayon's machinery is compiled once per element
/// and result type instead of once per kernel closure (one indirect call a task).
fn par_rows_dyn<T: Send, R: Send>(
    out: &mut [T],
    task_len: usize,
    parallel: bool,
    task: &(dyn Fn(usize, &mut [T]) -> R + Sync),
) -> Vec<R> {
    if parallel {
        out.par_chunks_mut(task_len).enumerate().map(|(i, c)| task(i, c)).collect()
    } else {
        out.chunks_mut(task_len).enumerate().map(|(i, c)| task(i, c)).collect()
    }
}

/// [`par_rows`] over two outputs split into the same rows (`a_row` and `b_row` elements a
/// row): `f(first_row, a_rows, b_rows)` for a kernel that writes two tensors row by row.
pub(crate) fn par_rows2<T: Send, U: Send>(
    (a, a_row): (&mut [T], usize),
    (b, b_row): (&mut [U], usize),
    work_row: usize,
    f: impl Fn(usize, &mut [T], &mut [U]) + Sync + Send,
) {
    if a.is_empty() || a_row == 0 || b_row == 0 {
        return;
    }
    assert_eq!(a.len() / a_row, b.len() / b_row, "par_rows2: row counts differ");
    let rows = a.len() / a_row;
    let per = rows_per_task(work_row);
    let task = |i: usize, ca: &mut [T], cb: &mut [U]| {
        dispatch(
            #[inline(always)]
            || f(i * per, ca, cb),
        )
    };
    let parallel = rows * work_row >= ROW_PAR_MIN && rows > per;
    par_rows2_dyn((a, per * a_row), (b, per * b_row), parallel, &task);
}

/// A [`par_rows2`] task: `(task index, a's rows, b's rows)`.
type Rows2Task<'a, T, U> = dyn Fn(usize, &mut [T], &mut [U]) + Sync + 'a;

/// [`par_rows2`]' walk behind a trait object (as [`par_rows_dyn`]).
fn par_rows2_dyn<T: Send, U: Send>(
    (a, a_len): (&mut [T], usize),
    (b, b_len): (&mut [U], usize),
    parallel: bool,
    task: &Rows2Task<'_, T, U>,
) {
    if parallel {
        a.par_chunks_mut(a_len).zip(b.par_chunks_mut(b_len)).enumerate().for_each(|(i, (ca, cb))| task(i, ca, cb))
    } else {
        a.chunks_mut(a_len).zip(b.chunks_mut(b_len)).enumerate().for_each(|(i, (ca, cb))| task(i, ca, cb))
    }
}

/// Runs `f(rows)` over `0..n_rows` in tasks of about [`CHUNK`] elements of work, in parallel
/// when there is enough work; returns each task's result in row order (for kernels whose
/// output is not one slice per row, such as a loss). Tasks run through [`dispatch`], as in
/// [`par_rows`].
pub(crate) fn par_row_ranges<R: Send>(
    n_rows: usize,
    work_row: usize,
    f: impl Fn(Range<usize>) -> R + Sync + Send,
) -> Vec<R> {
    let per = rows_per_task(work_row);
    let tasks = n_rows.div_ceil(per);
    let task = |t: usize| {
        dispatch(
            #[inline(always)]
            || f(t * per..((t + 1) * per).min(n_rows)),
        )
    };
    par_tasks_dyn(tasks, n_rows * work_row >= ROW_PAR_MIN && tasks > 1, &task)
}

/// [`par_row_ranges`]' walk behind a trait object (as [`par_rows_dyn`]).
fn par_tasks_dyn<R: Send>(tasks: usize, parallel: bool, task: &(dyn Fn(usize) -> R + Sync)) -> Vec<R> {
    if parallel { (0..tasks).into_par_iter().map(task).collect() } else { (0..tasks).map(task).collect() }
}

/// Sum of `f(x[i])` with eight independent lanes (vectorisable).
#[inline(always)]
pub(crate) fn sum_map<A: Accum>(x: &[A], f: impl Fn(A) -> A) -> A {
    let mut lanes = [A::zero(); 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for i in 0..8 {
            lanes[i] += f(c[i]);
        }
    }
    let mut s = A::zero();
    for v in it.remainder() {
        s += f(*v);
    }
    super::combine_lanes(lanes, s)
}

/// [`sum_map`] of two buffers of one length at once: the same two sums, bit for bit, with
/// their two dependency chains interleaved (a row's sum is bound by its adds' latency, not
/// their throughput).
#[inline(always)]
pub(crate) fn sum_map2<A: Accum>(x: &[A], fx: impl Fn(A) -> A, y: &[A], fy: impl Fn(A) -> A) -> (A, A) {
    assert_eq!(x.len(), y.len());
    let (mut lx, mut ly) = ([A::zero(); 8], [A::zero(); 8]);
    let (mut ix, mut iy) = (x.chunks_exact(8), y.chunks_exact(8));
    for (cx, cy) in (&mut ix).zip(&mut iy) {
        for i in 0..8 {
            lx[i] += fx(cx[i]);
            ly[i] += fy(cy[i]);
        }
    }
    let (mut sx, mut sy) = (A::zero(), A::zero());
    for v in ix.remainder() {
        sx += fx(*v);
    }
    for v in iy.remainder() {
        sy += fy(*v);
    }
    (super::combine_lanes(lx, sx), super::combine_lanes(ly, sy))
}

/// `sum(a[i] * b[i])` with eight independent lanes (vectorisable).
#[inline(always)]
pub(crate) fn dot<A: Accum>(a: &[A], b: &[A]) -> A {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [A::zero(); 8];
    let (mut ia, mut ib) = (a.chunks_exact(8), b.chunks_exact(8));
    for (ca, cb) in (&mut ia).zip(&mut ib) {
        for i in 0..8 {
            lanes[i] += ca[i] * cb[i];
        }
    }
    let mut s = A::zero();
    for (x, y) in ia.remainder().iter().zip(ib.remainder()) {
        s += *x * *y;
    }
    super::combine_lanes(lanes, s)
}

/// `(sum(a), dot(a, b))` in one loop: the bits of [`sum_map`] and [`dot`], their dependency
/// chains interleaved.
#[inline(always)]
pub(crate) fn sum_and_dot<A: Accum>(a: &[A], b: &[A]) -> (A, A) {
    debug_assert_eq!(a.len(), b.len());
    let (mut ls, mut ld) = ([A::zero(); 8], [A::zero(); 8]);
    let (mut ia, mut ib) = (a.chunks_exact(8), b.chunks_exact(8));
    for (ca, cb) in (&mut ia).zip(&mut ib) {
        for i in 0..8 {
            ls[i] += ca[i];
            ld[i] += ca[i] * cb[i];
        }
    }
    let (mut ss, mut sd) = (A::zero(), A::zero());
    for (x, y) in ia.remainder().iter().zip(ib.remainder()) {
        ss += *x;
        sd += *x * *y;
    }
    (super::combine_lanes(ls, ss), super::combine_lanes(ld, sd))
}

/// Max of a buffer (NaN wins, as in PyTorch), with eight lanes; `-inf` for an empty buffer.
#[inline(always)]
pub(crate) fn max_buf<A: Accum>(x: &[A]) -> A {
    let mut lanes = [A::neg_infinity(); 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for i in 0..8 {
            lanes[i] = combine(Reduce::Max, lanes[i], c[i]);
        }
    }
    let m = it.remainder().iter().fold(A::neg_infinity(), |m, v| combine(Reduce::Max, m, *v));
    lanes.iter().fold(m, |m, v| combine(Reduce::Max, m, *v))
}

/// `x[i] = exp(x[i])` over a buffer, through [`Accum::vexp`] (vectorised for f32).
#[inline(always)]
pub(crate) fn exp_in_place<A: Accum>(x: &mut [A]) {
    for v in x.iter_mut() {
        *v = v.vexp();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_sums_are_the_separate_sums_bit_for_bit() {
        // Lengths with and without a remainder past the 8 lanes; magnitudes that round.
        for n in [0, 5, 8, 37, 256] {
            let x: Vec<f32> =
                (0..n).map(|i| ((i * 7919) % 97) as f32 * 1.37e-3 - 0.05 + (i as f32).sin() * 1e4).collect();
            let y: Vec<f32> = (0..n).map(|i| ((i * 104729) % 89) as f32 * -2.9e-2 + 1e-7 * i as f32).collect();
            let (f, g) = (|v: f32| (v - 0.3) * (v - 0.3), |v: f32| v * 3.1);
            let (a, b) = sum_map2(&x, f, &y, g);
            assert_eq!((a.to_bits(), b.to_bits()), (sum_map(&x, f).to_bits(), sum_map(&y, g).to_bits()), "n = {n}");
            let (s, d) = sum_and_dot(&x, &y);
            assert_eq!((s.to_bits(), d.to_bits()), (sum_map(&x, |v| v).to_bits(), dot(&x, &y).to_bits()), "n = {n}");
        }
    }

    #[test]
    fn lane_sums_and_max() {
        let x: Vec<f64> = (0..37).map(|i| i as f64 * 0.5 - 3.0).collect();
        assert_eq!(sum_map(&x, |v| v * v), x.iter().map(|v| v * v).sum::<f64>());
        assert_eq!(dot(&x, &x), x.iter().map(|v| v * v).sum::<f64>());
        assert_eq!(max_buf(&x), 15.0);
        assert!(max_buf(&[1.0, f64::NAN, 3.0]).is_nan());
        assert_eq!(max_buf::<f32>(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn row_tasks_cover_every_row_once_in_order() {
        let mut out = vec![0usize; 7 * 100_000];
        let firsts = par_rows(&mut out, 7, 7, |r0, chunk| {
            for (k, row) in chunk.chunks_mut(7).enumerate() {
                row.fill(r0 + k);
            }
            r0
        });
        assert!(firsts.windows(2).all(|w| w[0] < w[1]));
        assert!(out.chunks(7).enumerate().all(|(r, row)| row.iter().all(|&v| v == r)));
        let ranges = par_row_ranges(1000, 100, |r| r);
        assert_eq!(ranges.first().unwrap().start, 0);
        assert_eq!(ranges.last().unwrap().end, 1000);
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
    }
}
