//! Fused causal attention over `[n, t, d]` views (`n` = batch × heads), forward and backward,
//! in the accumulation type with one rounding per output.
//!
//! Design notes:
//! - One task per head (heads grouped into tasks by size, as in `rows`), walking its queries
//!   in blocks of [`QUERIES`] rows. A block's scores against the keys up to its last row are a
//!   small GEMM in the accumulation type (`matmul_into` on this thread), the softmax runs over
//!   each row's live keys (`j ≤ i`; the rest are zero), and the values are another GEMM. A task
//!   holds one block of scores, `QUERIES × t`: never a head's `t × t`.
//! - Backward: the probabilities are recomputed from the saved log-sum-exps, block by block;
//!   `dq` of a block, and the block's share of `dk` and `dv` (summed into the head's
//!   accumulators in block order), are GEMMs too. Every output is written by one task in a
//!   fixed order, so results do not depend on the thread count.
//! - The GEMMs cover a block's masked pairs (`i < j` within the block) too, and their
//!   probabilities are then set to zero. So a non-finite key or value at row `j` can reach an
//!   earlier row through `0 · inf` in a GEMM, as it does through the unfused ops (masked
//!   softmax, then matmul). Such a step's loss is non-finite anyway, since row `j` itself
//!   attends to them, and GradScaler skips it either way.
//! - The inputs are loaded into `E::Acc` once, whole, before the tasks start (a strided view
//!   is gathered at the same time).

use std::any::TypeId;

use super::matmul::matmul_into;
use super::rows::{dot, exp_in_place, max_buf, par_rows, sum_map};
use crate::backend::AttentionSpec;
use crate::layout::Layout;
use num_traits::{Float, One, Zero};

use crate::precision::{Accum, Precision};

/// Query rows per block.
const QUERIES: usize = 64;

/// `x` seen as `&[T]` when `A` is `T` (the accumulation types f32 and f64 are precisions too).
fn acc_as<A: Accum, T: Precision>(x: &[A]) -> Option<&[T]> {
    (TypeId::of::<A>() == TypeId::of::<T>()).then(|| {
        // SAFETY: A and T are the same type (same TypeId), so the slice is valid as `[T]`.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<T>(), x.len()) }
    })
}

/// `x` seen as `&mut [T]` when `A` is `T`.
fn acc_as_mut<A: Accum, T: Precision>(x: &mut [A]) -> Option<&mut [T]> {
    (TypeId::of::<A>() == TypeId::of::<T>()).then(|| {
        // SAFETY: as in `acc_as`.
        unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<T>(), x.len()) }
    })
}

/// `out = a · b` for 2-D views of accumulation-type buffers, on this thread (the tasks are
/// the parallelism).
fn product<A: Accum>(a: &[A], la: &Layout, b: &[A], lb: &Layout, out: &mut [A]) {
    fn run<T: Precision>(a: &[T], la: &Layout, b: &[T], lb: &Layout, out: &mut [T]) {
        matmul_into(a, la, b, lb, &[], out, false)
    }
    match (acc_as::<A, f32>(a), acc_as::<A, f32>(b), acc_as_mut::<A, f32>(out)) {
        (Some(a), Some(b), Some(out)) => run(a, la, b, lb, out),
        _ => {
            let (a, b) = (acc_as::<A, f64>(a), acc_as::<A, f64>(b));
            let out = acc_as_mut::<A, f64>(out);
            run(a.expect("f32 or f64"), la, b.expect("f32 or f64"), lb, out.expect("f32 or f64"))
        }
    }
}

/// A `[rows, cols]` view starting at `offset` with row stride `rs` and column stride `cs`.
fn view(rows: usize, cols: usize, offset: usize, (rs, cs): (usize, usize)) -> Layout {
    Layout { shape: vec![rows, cols], strides: vec![rs, cs], offset }
}

/// All of `x` in the accumulation type.
fn load_all<E: Precision>(x: &[E]) -> Vec<E::Acc> {
    let mut out = vec![E::Acc::default(); x.len()];
    E::load(x, &mut out);
    out
}

/// The attention output (`[n, t, d]`, rounded into `E`) and each row's log-sum-exp.
pub(crate) fn forward<E: Precision>(q: &[E], k: &[E], v: &[E], spec: AttentionSpec) -> (Vec<E>, Vec<E::Acc>) {
    let AttentionSpec { n, t, d, scale } = spec;
    let (q, k, v) = (load_all(q), load_all(k), load_all(v));
    let scale = E::Acc::c(scale);
    let head = t * d;
    let mut out = super::alloc::take::<E>(n * head); // every row is stored
    let lse_parts = par_rows(
        &mut out,
        head,
        t * head,
        #[inline(always)]
        |h0, chunk| {
            let mut s = vec![E::Acc::zero(); QUERIES.min(t) * t];
            let mut o = vec![E::Acc::zero(); QUERIES.min(t) * d];
            let mut lse = Vec::with_capacity(chunk.len() / d.max(1));
            for (h, y) in (h0..).zip(chunk.chunks_mut(head)) {
                for i0 in (0..t).step_by(QUERIES) {
                    // Queries i0..i1 against keys 0..i1.
                    let (i1, base) = ((i0 + QUERIES).min(t), h * head);
                    let (rows, keys) = (i1 - i0, i1);
                    let s = &mut s[..rows * keys];
                    let q_blk = view(rows, d, base + i0 * d, (d, 1));
                    product(&q, &q_blk, &k, &view(d, keys, base, (1, d)), s);
                    for (i, row) in (i0..).zip(s.chunks_mut(keys)) {
                        let (live, masked) = row.split_at_mut(i + 1);
                        for x in live.iter_mut() {
                            *x *= scale;
                        }
                        // A NaN max propagates through every probability of the row.
                        let m = max_buf(live);
                        for x in live.iter_mut() {
                            *x = *x - m;
                        }
                        exp_in_place(live);
                        let l = sum_map(live, |p| p);
                        let inv = E::Acc::one() / l;
                        for x in live.iter_mut() {
                            *x *= inv;
                        }
                        masked.fill(E::Acc::zero());
                        lse.push(m + l.ln());
                    }
                    let o = &mut o[..rows * d];
                    product(s, &view(rows, keys, 0, (keys, 1)), &v, &view(keys, d, base, (d, 1)), o);
                    E::store(o, &mut y[i0 * d..i1 * d]);
                }
            }
            lse
        },
    );
    (out, lse_parts.concat())
}

/// `(dq, dk, dv)` of [`forward`] from the upstream gradient `g` of its output `out`.
pub(crate) fn backward<E: Precision>(
    (q, k, v): (&[E], &[E], &[E]),
    out: &[E],
    g: &[E],
    lse: &[E::Acc],
    spec: AttentionSpec,
) -> (Vec<E>, Vec<E>, Vec<E>) {
    let AttentionSpec { n, t, d, scale } = spec;
    let (q, k, v, g) = (load_all(q), load_all(k), load_all(v), load_all(g));
    let out = load_all(out);
    let scale = E::Acc::c(scale);
    let (rows, head) = (n * t, t * d);
    // D_i = g_i · out_i: the softmax backward's row term.
    let delta: Vec<E::Acc> = (0..rows).map(|r| dot(&g[r * d..(r + 1) * d], &out[r * d..(r + 1) * d])).collect();
    drop(out);

    // Per head, [dq | dk | dv] side by side in one buffer, so one task writes all three.
    let mut grads = super::alloc::take::<E>(n * 3 * head);
    par_rows(
        &mut grads,
        3 * head,
        2 * t * head,
        #[inline(always)]
        |h0, chunk| {
            let zero = E::Acc::zero();
            let (mut p, mut ds) = (vec![zero; QUERIES.min(t) * t], vec![zero; QUERIES.min(t) * t]);
            let mut dq = vec![zero; QUERIES.min(t) * d];
            let (mut dk, mut dv, mut part) = (vec![zero; head], vec![zero; head], vec![zero; head]);
            for (h, y) in (h0..).zip(chunk.chunks_mut(3 * head)) {
                let base = h * head;
                dk.fill(zero);
                dv.fill(zero);
                for i0 in (0..t).step_by(QUERIES) {
                    let i1 = (i0 + QUERIES).min(t);
                    let (rows, keys) = (i1 - i0, i1);
                    let (p, ds) = (&mut p[..rows * keys], &mut ds[..rows * keys]);
                    let blk = view(rows, d, base + i0 * d, (d, 1));
                    // p_ij = exp(q_i·k_j scale − lse_i) for j ≤ i, zero past the diagonal.
                    product(&q, &blk, &k, &view(d, keys, base, (1, d)), p);
                    // dp_ij = g_i · v_j, then ds_ij = p_ij (dp_ij − D_i).
                    product(&g, &blk, &v, &view(d, keys, base, (1, d)), ds);
                    for (i, (pr, dr)) in (i0..).zip(p.chunks_mut(keys).zip(ds.chunks_mut(keys))) {
                        let r = h * t + i;
                        let (live, masked) = pr.split_at_mut(i + 1);
                        for x in live.iter_mut() {
                            *x = *x * scale - lse[r];
                        }
                        exp_in_place(live);
                        masked.fill(zero);
                        let (dlive, dmasked) = dr.split_at_mut(i + 1);
                        for (x, &pij) in dlive.iter_mut().zip(live.iter()) {
                            *x = pij * (*x - delta[r]);
                        }
                        dmasked.fill(zero);
                    }
                    let by_rows = view(rows, keys, 0, (keys, 1));
                    let by_keys = view(keys, rows, 0, (1, keys));
                    // dq_i = scale Σ_j ds_ij k_j.
                    let dq = &mut dq[..rows * d];
                    product(ds, &by_rows, &k, &view(keys, d, base, (d, 1)), dq);
                    for x in dq.iter_mut() {
                        *x *= scale;
                    }
                    E::store(dq, &mut y[i0 * d..i1 * d]);
                    // The block's share of dv_j = Σ_i p_ij g_i and dk_j = scale Σ_i ds_ij q_i.
                    let part = &mut part[..keys * d];
                    product(p, &by_keys, &g, &blk, part);
                    for (a, b) in dv.iter_mut().zip(part.iter()) {
                        *a += *b;
                    }
                    product(ds, &by_keys, &q, &blk, part);
                    for (a, b) in dk.iter_mut().zip(part.iter()) {
                        *a += *b;
                    }
                }
                for x in dk.iter_mut() {
                    *x *= scale;
                }
                let (_, kv) = y.split_at_mut(head);
                let (yk, yv) = kv.split_at_mut(head);
                E::store(&dk, yk);
                E::store(&dv, yv);
            }
        },
    );
    let (mut dq, mut dk, mut dv) =
        (super::alloc::take::<E>(rows * d), super::alloc::take::<E>(rows * d), super::alloc::take::<E>(rows * d));
    for (((hd, yq), yk), yv) in
        grads.chunks(3 * head).zip(dq.chunks_mut(head)).zip(dk.chunks_mut(head)).zip(dv.chunks_mut(head))
    {
        yq.copy_from_slice(&hd[..head]);
        yk.copy_from_slice(&hd[head..2 * head]);
        yv.copy_from_slice(&hd[2 * head..]);
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-2, 2) from a fixed LCG.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// Forward and backward outputs as bits, on a pool of `threads` threads.
    fn run(threads: usize, spec: AttentionSpec) -> Vec<Vec<u32>> {
        let len = spec.n * spec.t * spec.d;
        let (q, k, v, g) = (values(len, 1), values(len, 2), values(len, 3), values(len, 4));
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let (out, lse) = forward(&q, &k, &v, spec);
            let (dq, dk, dv) = backward((&q, &k, &v), &out, &g, &lse, spec);
            [out, lse, dq, dk, dv].iter().map(|x| x.iter().map(|v| v.to_bits()).collect()).collect()
        })
    }

    /// Heads split across tasks differently with the thread count; every head's blocks run in
    /// the same order in every split, so the bits do not change. 9 heads of 150 rows (three
    /// query blocks, the last ragged) take the parallel path.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let spec = AttentionSpec { n: 9, t: 150, d: 24, scale: 0.2 };
        let one = run(1, spec);
        for threads in [2, 3, 8] {
            assert!(run(threads, spec) == one, "{threads} threads differ from one");
        }
    }
}
