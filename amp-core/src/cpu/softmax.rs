//! Fused softmax / log-softmax over the last dim of a contiguous `[rows, d]` tensor, forward
//! and backward. Each row is loaded once into an `E::Acc` scratch row (f32 for f16/bf16),
//! max-subtracted, exponentiated and normalised there, and rounded once on store.
//!
//! The scaled, masked softmax of attention scores ([`scaled_masked_forward`]) fuses PyTorch's
//! unfused chain (`mul_scalar`, `masked_fill`, the f32 softmax, the cast back) into one pass
//! each way, rounding where the chain rounds so that its bits are the chain's.

use super::rows::{dot, exp_in_place, max_buf, par_rows, par_rows2, sum_map};
use super::{BUF, acc_in, acc_out};
use crate::precision::{Accum, DType, Precision};

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

/// A boolean mask broadcast over the rows of a `[rows, d]` view of a tensor of `shape`: the
/// mask's shape is right-aligned with `shape` and each of its dims is 1 or equal (NumPy rules,
/// as `masked_fill` broadcasts it).
pub(crate) struct RowMask<'a> {
    data: &'a [bool],
    /// Whether the mask varies along a row (its last dim is the rows' length, not 1).
    varies: bool,
    /// Where each row's mask starts in `data`.
    offsets: Vec<usize>,
    /// How many of each row's values the softmax computes (see [`RowMask::kept`]).
    kept: Vec<usize>,
}

impl<'a> RowMask<'a> {
    /// `mask` (data and shape) over a tensor of `shape` (rank 1 or more); the caller has
    /// checked that the mask broadcasts to `shape`.
    pub(crate) fn new(mask: (&'a [bool], &[usize]), shape: &[usize]) -> Self {
        let (data, mshape) = mask;
        let (n, d) = (shape.len(), shape[shape.len() - 1]);
        // The mask's strides aligned to `shape`'s dims, 0 where it is missing or 1.
        let mut strides = vec![0; n];
        let mut s = 1;
        for (i, &m) in mshape.iter().enumerate().rev() {
            strides[n - (mshape.len() - i)] = if m == 1 { 0 } else { s };
            s *= m;
        }
        let varies = strides[n - 1] == 1;
        // Each row's offset, by an odometer over the leading dims.
        let rows: usize = shape[..n - 1].iter().product();
        let (mut offsets, mut index, mut off) = (Vec::with_capacity(rows), vec![0; n - 1], 0);
        for _ in 0..rows {
            offsets.push(off);
            for k in (0..n - 1).rev() {
                index[k] += 1;
                off += strides[k];
                if index[k] < shape[k] {
                    break;
                }
                off -= strides[k] * shape[k];
                index[k] = 0;
            }
        }
        // One past each mask row's last unmasked value: from there on all is masked (a causal
        // mask's row `i` ends at `i + 1`). Once per row of the mask, which many rows share.
        let kept = if d == 0 {
            vec![0; rows] // empty rows: nothing to compute
        } else if varies {
            let ends: Vec<usize> =
                data.chunks(d).map(|m| m.iter().rposition(|&hidden| !hidden).map_or(0, |j| j + 1)).collect();
            offsets.iter().map(|&off| Self::kept_of(ends[off / d], d)).collect()
        } else {
            offsets.iter().map(|&off| Self::kept_of(if data[off] { 0 } else { d }, d)).collect()
        };
        RowMask { data, varies, offsets, kept }
    }

    /// How many of a row's `d` values the softmax must compute when those from `end` on are
    /// masked: all but a masked tail, with the same bits as computing them all, because the
    /// kept length `l` is a multiple of the 8 lanes of `max_buf`, `sum_map` and `dot` (or
    /// `d`): the lanes then see the same values plus, in the whole row, the tail's -inf (max)
    /// and exact zeros (sums), which change no lane. `d` when nothing is masked at the end, or
    /// everything is (a NaN row).
    fn kept_of(end: usize, d: usize) -> usize {
        match end.div_ceil(8) * 8 {
            0 => d,
            l if l <= d - d % 8 => l,
            _ => d,
        }
    }

    /// Row `r`'s mask.
    #[inline(always)]
    fn row(&self, r: usize) -> MaskRow<'a> {
        let off = self.offsets[r];
        if self.varies { MaskRow::Each(&self.data[off..]) } else { MaskRow::Whole(self.data[off]) }
    }

    /// How many of row `r`'s values the softmax computes ([`RowMask::kept_of`]).
    #[inline(always)]
    fn kept(&self, r: usize) -> usize {
        self.kept[r]
    }
}

/// One row's mask: one flag for the whole row, or one per value.
#[derive(Clone, Copy)]
enum MaskRow<'a> {
    Whole(bool),
    Each(&'a [bool]),
}

impl MaskRow<'_> {
    /// `fill` where masked, the value itself elsewhere, written as selects (no branch) so the
    /// loop vectorises.
    #[inline(always)]
    fn fill(self, row: &mut [f32], fill: f32) {
        match self {
            MaskRow::Whole(true) => row.fill(fill),
            MaskRow::Whole(false) => {}
            MaskRow::Each(m) => {
                let m = &m[..row.len()];
                for (v, &hidden) in row.iter_mut().zip(m) {
                    *v = if hidden { fill } else { *v };
                }
            }
        }
    }
}

/// [`row`]'s softmax of a row whose values from `l` on are -inf (masked), computing the first
/// `l` only, with `l` from [`RowMask::kept`]: the same bits as the whole row.
#[inline(always)]
fn softmax_kept(x: &[f32], l: usize, y: &mut [f32]) {
    if l == x.len() {
        return row::<f32, false>(x, y);
    }
    let (x, (y, tail)) = (&x[..l], y.split_at_mut(l));
    let m = max_buf(x);
    for (y, v) in y.iter_mut().zip(x) {
        *y = *v - m;
    }
    exp_in_place(y);
    let inv = 1.0 / sum_map(y, |v| v);
    for v in y.iter_mut() {
        *v *= inv;
    }
    // What the whole row computes for a -inf value: 0, or NaN in a NaN row.
    tail.fill((f32::NEG_INFINITY - m).vexp() * inv);
}

/// Whether every value of a masked tail is finite: where one is not, the row's backward is
/// computed whole (see [`softmax_backward_kept`]). A fold, not `all`: a loop with an early
/// exit does not vectorise. Inlined into the dispatched row loops (the `amp` checks would
/// dispatch and split into tasks again, for a row's tail).
#[inline(always)]
fn all_finite<E: Precision<Acc = f32>>(tail: &[E]) -> bool {
    tail.iter().fold(true, |ok, v| ok & v.to_acc().is_finite())
}

/// [`row_backward`] of a softmax row `y` from [`softmax_kept`], computing the first `l` values
/// only: the whole row's `sum(g * y)` gets exact zeros from the tail (`y` is 0 there) unless
/// `g` is infinite or NaN there, when the whole row is computed. (`y`'s tail is NaN only in a
/// row whose kept values are NaN too: the sum is NaN either way.) The tail's gradient is left
/// 0: the caller zeroes masked values anyway.
#[inline(always)]
fn softmax_backward_kept(y: &[f32], g: &[f32], l: usize, gx: &mut [f32]) {
    if l == y.len() || !all_finite(&g[l..]) {
        return row_backward::<f32, false>(y, g, gx);
    }
    row_backward::<f32, false>(&y[..l], &g[..l], &mut gx[..l]);
    gx[l..].fill(0.0);
}

/// Rounds each of `s` into `E` and back (`E::store` into the scratch `t`, then `E::load`), so
/// `s` holds what a chain that stores an `E` tensor there reads back: nothing to do for f32,
/// F16C's slice conversions for f16. (bf16's callers round in their own loops instead: a bf16
/// round trip is a bit operation on the f32, with no narrowing and widening passes; W2's
/// softmax 8-15% faster each way on Zen 4.)
#[inline(always)]
fn round_through<E: Precision<Acc = f32>>(s: &mut [f32], t: &mut [E]) {
    if E::DTYPE != DType::F32 {
        E::store(s, t);
        E::load(t, s);
    }
}

/// About how many values the scaled, masked softmax converts per call (whole rows): enough to
/// pay for a conversion call's dispatch, few enough for the f32 scratch rows to stay in L1
/// (and small enough that the allocator never returns them to the system between tasks).
const GROUP_VALUES: usize = 2048;

/// The scores of the rows from `r0` as PyTorch's unfused chain has them before its softmax, in
/// f32 in `s`: `x * scale` rounded into `E` (the `mul_scalar`), then -inf where masked (the
/// `masked_fill`); `t` is a scratch buffer in `E`. A group of rows at once, so that each
/// conversion is one call over many rows.
#[inline(always)]
fn scaled_masked_rows<E: Precision<Acc = f32>>(
    x: &[E],
    d: usize,
    r0: usize,
    scale: f32,
    mask: &RowMask<'_>,
    t: &mut [E],
    s: &mut [f32],
) {
    match E::DTYPE {
        // Loaded, scaled and rounded in registers, one pass (a bf16 load is a shift).
        DType::BF16 => s.iter_mut().zip(x).for_each(|(v, x)| *v = E::from_acc(x.to_acc() * scale).to_acc()),
        _ => {
            E::load(x, s);
            for v in s.iter_mut() {
                *v *= scale;
            }
            round_through(s, t);
        }
    }
    for (i, row) in s.chunks_mut(d).enumerate() {
        mask.row(r0 + i).fill(row, f32::NEG_INFINITY);
    }
}

/// `x.mul_scalar(scale).masked_fill(mask, -inf).softmax_f32(last)` of each row of `x` (`rows *
/// d` elements) into `probs`, and the same rounded into `E` (`.cast::<E>()`) into `out`, bit
/// for bit, in one pass: the scaled scores stay in f32 scratch rows.
pub(crate) fn scaled_masked_forward<E: Precision<Acc = f32>>(
    x: &[E],
    d: usize,
    scale: f64,
    mask: &RowMask<'_>,
    probs: &mut [f32],
    out: &mut [E],
) {
    assert!(x.len() == out.len() && probs.len() == out.len());
    let scale = f32::c(scale);
    par_rows2(
        (probs, d),
        (out, d),
        d,
        #[inline(always)]
        |r0, probs, out| {
            let group = GROUP_VALUES.div_ceil(d) * d;
            let (mut t, mut s) = (vec![E::from_acc(0.0); group], vec![0f32; group]);
            for (i, (y, out)) in probs.chunks_mut(group).zip(out.chunks_mut(group)).enumerate() {
                let (n, first) = (y.len(), r0 * d + i * group);
                let (t, s) = (&mut t[..n], &mut s[..n]);
                scaled_masked_rows(&x[first..first + n], d, first / d, scale, mask, t, s);
                for (j, (s, y)) in s.chunks(d).zip(y.chunks_mut(d)).enumerate() {
                    softmax_kept(s, mask.kept(first / d + j), y);
                }
                E::store(y, out);
            }
        },
    );
}

/// The input gradient of [`scaled_masked_forward`] from its f32 probabilities `probs` and their
/// gradient `g` (in `E`, the cast's), bit for bit the chain's: softmax's backward in f32 rounded
/// into `E`, zero where masked, times `scale` rounded into `E`.
pub(crate) fn scaled_masked_backward<E: Precision<Acc = f32>>(
    probs: &[f32],
    g: &[E],
    d: usize,
    scale: f64,
    mask: &RowMask<'_>,
    out: &mut [E],
) {
    assert!(probs.len() == out.len() && g.len() == out.len());
    let scale = f32::c(scale);
    par_rows(
        out,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            if E::DTYPE == DType::BF16 {
                return scaled_masked_backward_bf16_rows(probs, g, d, r0, scale, mask, chunk);
            }
            let group = GROUP_VALUES.div_ceil(d) * d;
            let (mut t, mut bg, mut gx) = (vec![E::from_acc(0.0); group], vec![0f32; group], vec![0f32; group]);
            for (i, out) in chunk.chunks_mut(group).enumerate() {
                let (n, first) = (out.len(), r0 * d + i * group);
                let (t, bg, gx) = (&mut t[..n], &mut bg[..n], &mut gx[..n]);
                E::load(&g[first..first + n], bg);
                let y = &probs[first..first + n];
                for (j, ((y, g), gx)) in y.chunks(d).zip(bg.chunks(d)).zip(gx.chunks_mut(d)).enumerate() {
                    softmax_backward_kept(y, g, mask.kept(first / d + j), gx);
                }
                // The softmax's gradient rounded into `E`, the mask's zeros, then the scale: a
                // masked value is `0 * scale` (-0 for a negative scale), so the scale can come
                // first, in the rounding's pass.
                round_through(gx, t);
                gx.iter_mut().for_each(|v| *v *= scale);
                for (j, row) in gx.chunks_mut(d).enumerate() {
                    mask.row(first / d + j).fill(row, 0.0 * scale);
                }
                E::store(gx, out);
            }
        },
    );
}

/// [`scaled_masked_backward`] for bf16, row by row, over each row's kept prefix only (unless
/// the masked tail's gradient holds an inf or a NaN, as in [`softmax_backward_kept`]): the
/// gradient loaded, and the softmax's gradient rounded and scaled, in registers; the masked
/// tail is `0 * scale` (the chain's rounded zero times the scale, then the mask's fill), and
/// of the tail only the gradient's bits are read, for that check. `out` is the rows from `r0`.
/// (W2's backward in a step on Zen 4: 0.60-0.83x the time of the groups of rows f16 keeps,
/// whose whole rows go through F16C's slice conversions; the forward done the same way was no
/// faster than its groups, bound by its exponentials, and was not kept.)
#[inline(always)]
fn scaled_masked_backward_bf16_rows<E: Precision<Acc = f32>>(
    probs: &[f32],
    g: &[E],
    d: usize,
    r0: usize,
    scale: f32,
    mask: &RowMask<'_>,
    out: &mut [E],
) {
    let (mut bg, mut gx) = (vec![0f32; d], vec![0f32; d]);
    let masked = E::from_acc(0.0 * scale);
    for (j, out) in out.chunks_mut(d).enumerate() {
        let (r, rows) = (r0 + j, (r0 + j) * d..(r0 + j + 1) * d);
        let (y, g) = (&probs[rows.clone()], &g[rows]);
        let kept = mask.kept(r);
        let l = if all_finite(&g[kept..]) { kept } else { d };
        let (bg, gx) = (&mut bg[..l], &mut gx[..l]);
        bg.iter_mut().zip(g).for_each(|(b, g)| *b = g.to_acc());
        row_backward::<f32, false>(&y[..l], bg, gx);
        gx.iter_mut().for_each(|v| *v = E::from_acc(*v).to_acc() * scale);
        mask.row(r).fill(gx, 0.0 * scale);
        let (head, tail) = out.split_at_mut(l);
        head.iter_mut().zip(gx.iter()).for_each(|(o, v)| *o = E::from_acc(*v));
        tail.fill(masked);
    }
}
