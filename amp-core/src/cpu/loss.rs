//! Fused loss kernels: cross-entropy on logits (log-softmax inside, never materialised) and
//! the mean squared error. Per-row or per-chunk partial losses are added in order in f64, so
//! the result does not depend on the thread count.

use super::rows::{exp_in_place, par_row_ranges, par_rows, sum_map};
use super::softmax::log_sum_exp;
use super::{BUF, CHUNK};
use crate::backend::CrossEntropySpec;
use crate::precision::{Accum, Precision};
use num_traits::Zero;
use rayon::prelude::*;

fn ignored(spec: &CrossEntropySpec<'_>, r: usize) -> bool {
    Some(spec.targets[r]) == spec.ignore
}

/// Cross-entropy forward over `x` (`rows * c` logits). Returns each row's log-sum-exp (kept
/// for backward), the summed loss over non-ignored rows, and how many rows were counted.
///
/// Row loss: `-(1 - s) * logp[t] - (s / c) * sum_j logp[j]` with `logp = x - lse`.
pub(crate) fn cross_entropy_forward<E: Precision>(
    x: &[E],
    c: usize,
    spec: CrossEntropySpec<'_>,
) -> (Vec<E::Acc>, f64, usize) {
    let rows = spec.targets.len();
    let s = E::Acc::c(spec.smoothing);
    let per_class = E::Acc::c(spec.smoothing / c as f64);
    let parts = par_row_ranges(
        rows,
        c,
        #[inline(always)]
        |range| {
            let mut buf = vec![E::Acc::default(); c];
            let mut lses = Vec::with_capacity(range.len());
            let (mut loss, mut counted) = (0f64, 0usize);
            for r in range {
                if ignored(&spec, r) {
                    lses.push(E::Acc::zero());
                    continue;
                }
                E::load(&x[r * c..(r + 1) * c], &mut buf);
                let (_, lse) = log_sum_exp(&buf);
                let t = spec.targets[r] as usize;
                let mut l = -(E::Acc::c(1.0) - s) * (buf[t] - lse);
                if spec.smoothing != 0.0 {
                    let sum_logp = sum_map(&buf, |v| v) - E::Acc::c(c as f64) * lse;
                    l = l - per_class * sum_logp;
                }
                loss += l.f64();
                counted += 1;
                lses.push(lse);
            }
            (lses, loss, counted)
        },
    );
    let mut lses = Vec::with_capacity(rows);
    let (mut loss, mut counted) = (0f64, 0usize);
    for (l, part, n) in parts {
        lses.extend(l);
        loss += part;
        counted += n;
    }
    (lses, loss, counted)
}

/// Cross-entropy backward: `dx[r, j] = scale * (softmax(x_r)_j - (1 - s) [j == t_r] - s / c)`
/// for counted rows, 0 for ignored ones (`scale` = upstream gradient / counted rows).
pub(crate) fn cross_entropy_backward<E: Precision>(
    x: &[E],
    c: usize,
    spec: CrossEntropySpec<'_>,
    lse: &[E::Acc],
    scale: f64,
) -> Vec<E> {
    let scale = E::Acc::c(scale);
    let hit = E::Acc::c(1.0 - spec.smoothing) * scale;
    let base = E::Acc::c(spec.smoothing / c as f64) * scale;
    let mut out = super::alloc::take::<E>(x.len()); // every row is stored
    par_rows(
        &mut out,
        c,
        c,
        #[inline(always)]
        |r0, chunk| {
            let mut buf = vec![E::Acc::default(); c];
            for (k, gx) in chunk.chunks_mut(c).enumerate() {
                let r = r0 + k;
                if ignored(&spec, r) {
                    gx.fill(E::default()); // no gradient
                    continue;
                }
                E::load(&x[r * c..(r + 1) * c], &mut buf);
                for v in buf.iter_mut() {
                    *v = *v - lse[r];
                }
                exp_in_place(&mut buf);
                for v in buf.iter_mut() {
                    *v = *v * scale - base;
                }
                buf[spec.targets[r] as usize] = buf[spec.targets[r] as usize] - hit;
                E::store(&buf, gx);
            }
        },
    );
    out
}

/// `sum((a - b)²)` over two contiguous slices of one length, in `E::Acc` per chunk and f64
/// across chunks (in order).
pub(crate) fn squared_error_sum<E: Precision>(a: &[E], b: &[E]) -> f64 {
    let chunk = |(ca, cb): (&[E], &[E])| {
        crate::simd::dispatch(
            #[inline(always)]
            || {
                let mut ba = [E::Acc::default(); BUF];
                let mut bb = [E::Acc::default(); BUF];
                let mut acc = E::Acc::zero();
                for (sa, sb) in ca.chunks(BUF).zip(cb.chunks(BUF)) {
                    let n = sa.len();
                    E::load(sa, &mut ba[..n]);
                    E::load(sb, &mut bb[..n]);
                    for i in 0..n {
                        ba[i] = ba[i] - bb[i];
                    }
                    acc += super::rows::dot(&ba[..n], &ba[..n]);
                }
                acc.f64()
            },
        )
    };
    let parts: Vec<f64> = if a.len() >= super::PAR_MIN {
        a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)).map(chunk).collect()
    } else {
        a.chunks(CHUNK).zip(b.chunks(CHUNK)).map(chunk).collect()
    };
    parts.into_iter().sum()
}
