//! Fused causal attention over `[n, t, d]` views (`n` = batch × heads), forward and backward,
//! in the accumulation type with one rounding per output.
//!
//! Design notes:
//! - Forward: each query row walks its keys `0..=i` in blocks of [`KEYS`], scoring a block,
//!   then rescaling its running max, sum and output accumulator once per block (the online
//!   softmax). A task holds one block of scores and one row: never `t × t` scores.
//! - Backward: the probabilities are recomputed from the saved log-sum-exps. `dq` is computed
//!   per query row (over `j ≤ i`), `dk` and `dv` per key row (over `i ≥ j`), so every output
//!   row is written by one task, and the tasks (grouped by shape, as in `rows`) sum in a fixed
//!   order: results do not depend on the thread count.
//! - The inputs are loaded into `E::Acc` once, whole, before the tasks start (a strided view
//!   is gathered at the same time).

use super::rows::{dot, exp_in_place, max_buf, par_rows};
use crate::backend::AttentionSpec;
use num_traits::{Float, One, Zero};

use crate::precision::{Accum, Precision};

/// Keys (forward, and `dq`) or queries (`dk`, `dv`) scored at a time.
const KEYS: usize = 64;

/// All of `x` in the accumulation type.
fn load_all<E: Precision>(x: &[E]) -> Vec<E::Acc> {
    let mut out = vec![E::Acc::default(); x.len()];
    E::load(x, &mut out);
    out
}

/// `y += a x`.
#[inline(always)]
fn axpy<A: Accum>(y: &mut [A], a: A, x: &[A]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * *x;
    }
}

/// The attention output (`[n, t, d]`, rounded into `E`) and each row's log-sum-exp.
pub(crate) fn forward<E: Precision>(q: &[E], k: &[E], v: &[E], spec: AttentionSpec) -> (Vec<E>, Vec<E::Acc>) {
    let AttentionSpec { n, t, d, scale } = spec;
    let (q, k, v) = (load_all(q), load_all(k), load_all(v));
    let scale = E::Acc::c(scale);
    let mut out = super::alloc::take::<E>(n * t * d); // every row is stored
    let lse_parts = par_rows(
        &mut out,
        d,
        (t / 2).max(1) * d,
        #[inline(always)]
        |r0, chunk| {
            let mut acc = vec![E::Acc::zero(); d];
            let mut s = [E::Acc::zero(); KEYS];
            let mut lse = Vec::with_capacity(chunk.len() / d.max(1));
            for (r, y) in (r0..).zip(chunk.chunks_mut(d)) {
                let (h, i) = (r / t, r % t);
                let qi = &q[r * d..(r + 1) * d];
                let (kh, vh) = (&k[h * t * d..(h + 1) * t * d], &v[h * t * d..(h + 1) * t * d]);
                acc.fill(E::Acc::zero());
                let (mut m, mut l) = (E::Acc::neg_infinity(), E::Acc::zero());
                for j0 in (0..=i).step_by(KEYS) {
                    let j1 = (j0 + KEYS).min(i + 1);
                    let s = &mut s[..j1 - j0];
                    for (sj, j) in s.iter_mut().zip(j0..j1) {
                        *sj = dot(qi, &kh[j * d..(j + 1) * d]) * scale;
                    }
                    let m_new = m.max(max_buf(s));
                    if m_new > m {
                        // exp(-inf) = 0 clears the empty start; a NaN max propagates below.
                        let c = (m - m_new).exp();
                        l *= c;
                        for a in acc.iter_mut() {
                            *a *= c;
                        }
                        m = m_new;
                    }
                    for sj in s.iter_mut() {
                        *sj = *sj - m;
                    }
                    exp_in_place(s);
                    for (p, j) in s.iter().zip(j0..j1) {
                        l += *p;
                        axpy(&mut acc, *p, &vh[j * d..(j + 1) * d]);
                    }
                }
                let inv = E::Acc::one() / l;
                for a in acc.iter_mut() {
                    *a *= inv;
                }
                E::store(&acc, y);
                lse.push(m + l.ln());
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
    let rows = n * t;
    // D_i = g_i · out_i: the softmax backward's row term.
    let delta: Vec<E::Acc> = (0..rows).map(|r| dot(&g[r * d..(r + 1) * d], &out[r * d..(r + 1) * d])).collect();
    drop(out);
    // p_ij = exp(q_i·k_j scale − lse_i) for one block of pairs at a time, so the exponentials
    // run through the same vectorised `exp_in_place` as the forward pass (one libm call per
    // pair took most of the backward's time).
    // Pair `x` of a block is query row `r0 + x·dr` with key row `j0 + x·dj`.
    let probs = |ps: &mut [E::Acc], (r0, dr): (usize, usize), (j0, dj): (usize, usize)| {
        for (x, pij) in ps.iter_mut().enumerate() {
            let (r, j) = (r0 + x * dr, j0 + x * dj);
            *pij = dot(&q[r * d..(r + 1) * d], &k[j * d..(j + 1) * d]) * scale - lse[r];
        }
        exp_in_place(ps);
    };

    // dq_i = scale Σ_{j ≤ i} p_ij (g_i·v_j − D_i) k_j
    let mut dq = super::alloc::take::<E>(rows * d);
    par_rows(
        &mut dq,
        d,
        (t / 2).max(1) * 2 * d,
        #[inline(always)]
        |r0, chunk| {
            let mut acc = vec![E::Acc::zero(); d];
            let mut ps = [E::Acc::zero(); KEYS];
            for (r, y) in (r0..).zip(chunk.chunks_mut(d)) {
                let (h, i) = (r / t, r % t);
                let gi = &g[r * d..(r + 1) * d];
                acc.fill(E::Acc::zero());
                for j0 in (0..=i).step_by(KEYS) {
                    let j1 = (j0 + KEYS).min(i + 1);
                    let ps = &mut ps[..j1 - j0];
                    probs(ps, (r, 0), (h * t + j0, 1));
                    for (pij, j) in ps.iter().zip(j0..j1) {
                        let hj = (h * t + j) * d;
                        let kj = &k[hj..hj + d];
                        let ds = *pij * (dot(gi, &v[hj..hj + d]) - delta[r]);
                        axpy(&mut acc, ds, kj);
                    }
                }
                for a in acc.iter_mut() {
                    *a *= scale;
                }
                E::store(&acc, y);
            }
        },
    );

    // dk_j = scale Σ_{i ≥ j} p_ij (g_i·v_j − D_i) q_i and dv_j = Σ_{i ≥ j} p_ij g_i, side by
    // side in one [rows, 2d] buffer so one task writes both rows of a key.
    let mut dkv = super::alloc::take::<E>(rows * 2 * d);
    par_rows(
        &mut dkv,
        2 * d,
        (t / 2).max(1) * 2 * d,
        #[inline(always)]
        |r0, chunk| {
            let (mut dk, mut dv) = (vec![E::Acc::zero(); d], vec![E::Acc::zero(); d]);
            let mut ps = [E::Acc::zero(); KEYS];
            for (rj, y) in (r0..).zip(chunk.chunks_mut(2 * d)) {
                let (h, j) = (rj / t, rj % t);
                let vj = &v[rj * d..(rj + 1) * d];
                dk.fill(E::Acc::zero());
                dv.fill(E::Acc::zero());
                for i0 in (j..t).step_by(KEYS) {
                    let i1 = (i0 + KEYS).min(t);
                    let ps = &mut ps[..i1 - i0];
                    probs(ps, (h * t + i0, 1), (rj, 0));
                    for (pij, i) in ps.iter().zip(i0..i1) {
                        let r = h * t + i;
                        let gi = &g[r * d..(r + 1) * d];
                        axpy(&mut dv, *pij, gi);
                        axpy(&mut dk, *pij * (dot(gi, vj) - delta[r]), &q[r * d..(r + 1) * d]);
                    }
                }
                for a in dk.iter_mut() {
                    *a *= scale;
                }
                let (yk, yv) = y.split_at_mut(d);
                E::store(&dk, yk);
                E::store(&dv, yv);
            }
        },
    );
    let (mut dk, mut dv) = (super::alloc::take::<E>(rows * d), super::alloc::take::<E>(rows * d));
    for ((row, yk), yv) in dkv.chunks(2 * d).zip(dk.chunks_mut(d)).zip(dv.chunks_mut(d)) {
        yk.copy_from_slice(&row[..d]);
        yv.copy_from_slice(&row[d..]);
    }
    (dq, dk, dv)
}
