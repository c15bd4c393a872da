//! Selection and gathering kernels: `where` with broadcasting, concatenation along a dim, and
//! the embedding gather with its scatter-add backward. Pure data movement, except the
//! scatter-add, which accumulates in `E::Acc` and rounds once.

use super::rows::par_rows;
use super::{CHUNK, collapse, for_each_run, par_chunks_mut};
use crate::layout::Layout;
use crate::precision::Precision;
use num_traits::Zero;

/// `out[i] = if mask[i] { a[i] } else { b[i] }` with the mask and both operands broadcast
/// (by their layouts) to `out_shape`.
pub(crate) fn select<E: Precision>(
    mask: &[bool],
    lm: &Layout,
    a: &[E],
    la: &Layout,
    b: &[E],
    lb: &Layout,
    out_shape: &[usize],
) -> Vec<E> {
    let n: usize = out_shape.iter().product();
    let (lm, la, lb) = (lm.broadcast_to(out_shape), la.broadcast_to(out_shape), lb.broadcast_to(out_shape));
    let (shape, strides) = collapse(out_shape, [&lm.strides, &la.strides, &lb.strides]);
    let mut out = super::alloc::take::<E>(n); // every position of the walk is written
    par_chunks_mut(
        &mut out,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            for_each_run(
                &shape,
                &strides,
                [lm.offset, la.offset, lb.offset],
                start,
                start + chunk.len(),
                #[inline(always)]
                |pos, [om, oa, ob], [sm, sa, sb], len| {
                    let dst = &mut chunk[pos - start..pos - start + len];
                    // The common shapes get loops the compiler can vectorise: contiguous mask and
                    // value with a scalar fill (masked_fill), or everything contiguous.
                    match (sm, sa, sb) {
                        (1, 0, 1) => {
                            let (m, fa, vb) = (&mask[om..om + len], a[oa], &b[ob..ob + len]);
                            for ((d, &m), &v) in dst.iter_mut().zip(m).zip(vb) {
                                *d = if m { fa } else { v };
                            }
                        }
                        (1, 1, 1) => {
                            let (m, va, vb) = (&mask[om..om + len], &a[oa..oa + len], &b[ob..ob + len]);
                            for (((d, &m), &x), &y) in dst.iter_mut().zip(m).zip(va).zip(vb) {
                                *d = if m { x } else { y };
                            }
                        }
                        _ => {
                            for (i, d) in dst.iter_mut().enumerate() {
                                *d = if mask[om + i * sm] { a[oa + i * sa] } else { b[ob + i * sb] };
                            }
                        }
                    }
                },
            );
        },
    );
    out
}

/// Concatenates `parts` (each a view of its storage whose row-major walk is `[outer, d_i,
/// inner]`, `d_i` given) along the middle dim. A strided part whose walk has contiguous runs
/// is read in place, a run at a time (the gradient of a permuted `qkv` concatenates q, k and v
/// seen in `qkv`'s memory order: runs of one head's values); one without (a transposed part:
/// k's gradient there) is first gathered contiguous, by tiles (W2's bf16 `qkv` gradient:
/// 303–345 µs reading k in place one element at a time, 205–208 µs gathering it first).
pub(crate) fn cat<E: Precision>(parts: &[(&[E], &Layout, usize)], outer: usize, inner: usize) -> Vec<E> {
    let total: usize = parts.iter().map(|p| p.2).sum();
    let row = total * inner;
    // Each part's collapsed walk; a part whose innermost stride is not 1 is gathered first.
    let walks: Vec<_> = parts.iter().map(|(_, l, _)| collapse(&l.shape, [&l.strides])).collect();
    let gathered: Vec<Option<super::alloc::PooledVec<E>>> = parts
        .iter()
        .zip(&walks)
        .map(|((src, l, _), (_, [strides]))| {
            strides.last().is_some_and(|&s| s != 1).then(|| super::alloc::PooledVec::from(super::gather(src, l)))
        })
        .collect();
    let mut out = super::alloc::take::<E>(outer * row); // every row is filled by its parts
    par_rows(
        &mut out,
        row,
        row,
        #[inline(always)]
        |o0, chunk| {
            let rows = chunk.len() / row.max(1);
            let mut at = 0;
            for ((&(src, l, d), (shape, strides)), g) in parts.iter().zip(&walks).zip(&gathered) {
                let len = d * inner;
                // Whole rows from a dense source: a contiguous part, or a gathered one.
                let dense = match g {
                    Some(g) => Some((&g[..], 0)),
                    None => l.is_contiguous().then_some((src, l.offset)),
                };
                if let Some((src, offset)) = dense {
                    for (k, dst) in chunk.chunks_mut(row).enumerate() {
                        let o = o0 + k;
                        dst[at..at + len].copy_from_slice(&src[offset + o * len..offset + (o + 1) * len]);
                    }
                } else {
                    // The part's flat positions o0·len.. of these rows, run by run; a run may
                    // cross into the next row of the output.
                    let first = o0 * len;
                    for_each_run(
                        shape,
                        strides,
                        [l.offset],
                        first,
                        first + rows * len,
                        #[inline(always)]
                        |pos, [o], [st], n| {
                            let (mut pos, mut o, mut n) = (pos - first, o, n);
                            while n > 0 {
                                let (r, c) = (pos / len, pos % len);
                                let take = n.min(len - c);
                                let dst = &mut chunk[r * row + at + c..][..take];
                                if st == 1 {
                                    dst.copy_from_slice(&src[o..o + take]);
                                } else {
                                    for (i, v) in dst.iter_mut().enumerate() {
                                        *v = src[o + i * st];
                                    }
                                }
                                (pos, o, n) = (pos + take, o + take * st, n - take);
                            }
                        },
                    );
                }
                at += len;
            }
        },
    );
    out
}

/// `out[r] = w[ids[r]]` for rows of `d` elements (ids already bounds-checked).
pub(crate) fn gather_rows<E: Precision>(w: &[E], ids: &[i64], d: usize) -> Vec<E> {
    let mut out = super::alloc::take::<E>(ids.len() * d); // every row is copied
    par_rows(
        &mut out,
        d,
        d,
        #[inline(always)]
        |r0, chunk| {
            for (k, dst) in chunk.chunks_mut(d).enumerate() {
                let id = ids[r0 + k] as usize;
                dst.copy_from_slice(&w[id * d..(id + 1) * d]);
            }
        },
    );
    out
}

/// The embedding backward: `out[v] = sum over r with ids[r] == v of g[r]` for `v` in `0..vocab`,
/// accumulated in `E::Acc` and rounded once. Rows are visited in ascending position for each
/// id (a stable sort), so the result is the same for any thread count.
pub(crate) fn scatter_add_rows<E: Precision>(g: &[E], ids: &[i64], vocab: usize, d: usize) -> Vec<E> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&r| ids[r]);
    let mut out = super::alloc::take::<E>(vocab * d); // every block is stored or zeroed
    par_rows(
        &mut out,
        d,
        d,
        #[inline(always)]
        |v0, chunk| {
            let v1 = v0 + chunk.len() / d;
            let lo = order.partition_point(|&r| (ids[r] as usize) < v0);
            let hi = order.partition_point(|&r| (ids[r] as usize) < v1);
            if lo == hi {
                chunk.fill(E::default()); // no id in this block: zero gradient rows
                return;
            }
            let mut acc = vec![E::Acc::zero(); chunk.len()];
            let mut buf = vec![E::Acc::default(); d];
            for &r in &order[lo..hi] {
                let v = ids[r] as usize - v0;
                E::load(&g[r * d..(r + 1) * d], &mut buf);
                for (a, x) in acc[v * d..(v + 1) * d].iter_mut().zip(&buf) {
                    *a += *x;
                }
            }
            E::store(&acc, chunk);
        },
    );
    out
}
