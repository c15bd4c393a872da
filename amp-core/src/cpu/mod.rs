//! The CPU backend: [`crate::Device`] for [`crate::Cpu`] ([`backend`]), its caching allocator
//! ([`memory`]) and the loops every kernel is built on.
//!
//! Design notes:
//! - Work is split into chunks of `CHUNK` output elements run on rayon's pool when there are
//!   enough of them (`PAR_MIN`); small tensors stay on the calling thread.
//! - Inside a chunk, data moves in runs along the innermost dim: each run is loaded into a
//!   stack buffer of the accumulation type (f32, or f64 for f64), computed there, and rounded
//!   once on store. That is how f16/bf16 get f32 arithmetic with vectorised conversions.
//! - Strided (transposed, broadcast, narrowed) inputs are handled by `for_each_run`, which
//!   walks the output in row-major order and tracks each input's offset with an odometer.
//! - Output buffers come from the caching allocator (`alloc`): `alloc::take` (values
//!   unspecified) where the kernel writes every element, `alloc::zeroed` where it does not.

pub(crate) mod alloc;
pub mod amp;
pub(crate) mod amx;
pub(crate) mod amx_f16;
pub(crate) mod attention;
pub mod backend;
pub(crate) mod batch_norm;
pub(crate) mod conv;
pub(crate) mod dropout;
pub(crate) mod gemm_half;
pub(crate) mod index;
pub(crate) mod loss;
pub(crate) mod lut;
pub(crate) mod matmul;
pub mod memory;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod pool;
pub(crate) mod reduce;
pub(crate) mod rows;
pub(crate) mod softmax;
mod tensor;
pub mod threads;

use rayon::prelude::*;

use crate::layout::Layout;
use crate::precision::{Accum, Precision};
use crate::simd::dispatch;

/// Output elements per parallel work item.
pub(crate) const CHUNK: usize = 16 * 1024;
/// Below this many elements a kernel runs on the calling thread.
pub(crate) const PAR_MIN: usize = 64 * 1024;
/// Elements per conversion buffer (fits L1 with three buffers of f64).
pub(crate) const BUF: usize = 512;

/// Runs `f(chunk_index, chunk)` over `out` in chunks, in parallel when it is large.
/// Each chunk runs through [`dispatch`], so pass `f` as `#[inline(always)] |i, chunk| ...`.
pub(crate) fn par_chunks_mut<T: Send>(out: &mut [T], f: impl Fn(usize, &mut [T]) + Sync + Send) {
    let task = |i: usize, c: &mut [T]| {
        dispatch(
            #[inline(always)]
            || f(i, c),
        )
    };
    par_chunks_dyn(out, &task);
}

/// [`par_chunks_mut`]'s walk over the chunks, behind a trait object: rayon's machinery is
/// compiled once per element type instead of once per kernel closure (one indirect call a
/// chunk).
fn par_chunks_dyn<T: Send>(out: &mut [T], task: &(dyn Fn(usize, &mut [T]) + Sync)) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| task(i, c));
    } else {
        out.chunks_mut(CHUNK).enumerate().for_each(|(i, c)| task(i, c));
    }
}

/// A new buffer holding `src` rounded into precision `B`, converted in parallel chunks
/// through the vectorised slice conversions.
pub(crate) fn convert_par<A: Precision, B: Precision>(src: &[A]) -> Vec<B> {
    let mut out = alloc::take::<B>(src.len());
    convert_par_into(src, &mut out);
    out
}

/// Rounds `src` into `dst` (same length) in parallel chunks.
pub(crate) fn convert_par_into<A: Precision, B: Precision>(src: &[A], dst: &mut [B]) {
    assert_eq!(src.len(), dst.len(), "convert_par_into: length mismatch");
    par_chunks_mut(
        dst,
        #[inline(always)]
        |ci, chunk| {
            let s = ci * CHUNK;
            crate::precision::convert_slice(&src[s..s + chunk.len()], chunk);
        },
    );
}

/// Merges adjacent dims that every layout walks contiguously, so runs get as long as possible.
pub(crate) fn collapse<const K: usize>(shape: &[usize], strides: [&[usize]; K]) -> (Vec<usize>, [Vec<usize>; K]) {
    let mut out_shape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut out_strides: [Vec<usize>; K] = std::array::from_fn(|_| Vec::new());
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        let mergeable = !out_shape.is_empty()
            && (0..K).all(|k| {
                let prev = *out_strides[k].last().unwrap();
                prev == strides[k][d] * shape[d]
            });
        if mergeable {
            *out_shape.last_mut().unwrap() *= shape[d];
            for k in 0..K {
                *out_strides[k].last_mut().unwrap() = strides[k][d];
            }
        } else {
            out_shape.push(shape[d]);
            for k in 0..K {
                out_strides[k].push(strides[k][d]);
            }
        }
    }
    (out_shape, out_strides)
}

/// Calls `f(out_pos, input_offsets, last_strides, len)` for each run of the row-major walk over
/// flat output positions `start..end`. Inputs are described by strides over `shape` and base
/// offsets; `last_strides[k]` is input k's stride along the run. Inside a dispatched loop, pass
/// `f` as `#[inline(always)] |...| ...`: it is called from two places, so the compiler may keep
/// it a call, and a called closure runs code built for the baseline ISA (SSE2 on x86-64).
#[inline(always)]
pub(crate) fn for_each_run<const K: usize>(
    shape: &[usize],
    strides: &[Vec<usize>; K],
    offsets: [usize; K],
    start: usize,
    end: usize,
    mut f: impl FnMut(usize, [usize; K], [usize; K], usize),
) {
    let rank = shape.len();
    if rank == 0 {
        if start < end {
            f(0, offsets, [0; K], 1);
        }
        return;
    }
    let n = shape[rank - 1];
    if n == 0 || start >= end {
        return;
    }
    let last: [usize; K] = std::array::from_fn(|k| strides[k][rank - 1]);
    // Multi-index of the starting row over the outer dims, and each input's row base.
    let mut idx = vec![0usize; rank - 1];
    let mut row = start / n;
    let mut base = offsets;
    for d in (0..rank - 1).rev() {
        idx[d] = row % shape[d];
        row /= shape[d];
        for k in 0..K {
            base[k] += idx[d] * strides[k][d];
        }
    }
    let mut pos = start;
    let mut col = start % n;
    while pos < end {
        let len = (n - col).min(end - pos);
        let offs: [usize; K] = std::array::from_fn(|k| base[k] + col * last[k]);
        f(pos, offs, last, len);
        pos += len;
        col = 0;
        // Advance the odometer over the outer dims.
        for d in (0..rank - 1).rev() {
            idx[d] += 1;
            for k in 0..K {
                base[k] += strides[k][d];
            }
            if idx[d] < shape[d] {
                break;
            }
            for k in 0..K {
                base[k] -= strides[k][d] * shape[d];
            }
            idx[d] = 0;
        }
    }
}

/// Loads `dst.len()` elements of `src` starting at `off` with `stride` into the buffer.
#[inline(always)]
pub(crate) fn load_strided<E: Precision>(src: &[E], off: usize, stride: usize, dst: &mut [E::Acc]) {
    let len = dst.len();
    match stride {
        1 => E::load(&src[off..off + len], dst),
        0 => dst.fill(src[off].to_acc()),
        s => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = src[off + i * s].to_acc();
            }
        }
    }
}

/// `src` in the accumulation type: the slice itself for f32 and f64 (no copy), else converted
/// into `buf` (as long as `src`).
#[inline(always)]
pub(crate) fn acc_in<'a, E: Precision>(src: &'a [E], buf: &'a mut [E::Acc]) -> &'a [E::Acc] {
    match E::as_acc(src) {
        Some(src) => src,
        None => {
            E::load(src, buf);
            buf
        }
    }
}

/// Runs `f` on `dst` as accumulation values: on `dst` itself for f32 and f64, else on `buf`
/// (as long as `dst`), then rounded into `dst`. Pass `f` as `#[inline(always)]`: inside a
/// [`dispatch`]ed loop, code that is not inlined is compiled for the baseline ISA.
#[inline(always)]
pub(crate) fn acc_out<E: Precision>(dst: &mut [E], buf: &mut [E::Acc], f: impl FnOnce(&mut [E::Acc])) {
    let direct = E::as_acc(dst).is_some();
    f(match E::as_acc_mut(dst) {
        Some(d) => d,
        None => buf,
    });
    if !direct {
        E::store(buf, dst);
    }
}

/// `buf.len()` elements of `src` from `off` with `stride` in the accumulation type: in place
/// for a contiguous f32 or f64 run, else loaded into `buf` ([`load_strided`]).
#[inline(always)]
fn load_run<'a, E: Precision>(src: &'a [E], off: usize, stride: usize, buf: &'a mut [E::Acc]) -> &'a [E::Acc] {
    if stride == 1
        && let Some(run) = E::as_acc(&src[off..off + buf.len()])
    {
        return run;
    }
    load_strided(src, off, stride, buf);
    buf
}

/// A contiguous copy of a strided view.
pub(crate) fn gather<E: Precision>(src: &[E], layout: &Layout) -> Vec<E> {
    let n = layout.numel();
    if layout.is_contiguous() {
        return alloc::copy_of(&src[layout.offset..layout.offset + n]);
    }
    let (shape, [strides]) = collapse(&layout.shape, [&layout.strides]);
    let rank = shape.len();
    if rank >= 2 && strides[rank - 2] == 1 && strides[rank - 1] != 1 {
        return gather_transposed(src, &shape, &strides, layout.offset);
    }
    let strides = [strides];
    // Every position of the walk is written.
    let mut out = alloc::take::<E>(n);
    par_chunks_mut(
        &mut out,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            for_each_run(
                &shape,
                &strides,
                [layout.offset],
                start,
                start + chunk.len(),
                #[inline(always)]
                |pos, [o], [s], len| {
                    let dst = &mut chunk[pos - start..pos - start + len];
                    match s {
                        1 => dst.copy_from_slice(&src[o..o + len]),
                        0 => dst.fill(src[o]),
                        s => {
                            for (i, d) in dst.iter_mut().enumerate() {
                                *d = src[o + i * s];
                            }
                        }
                    }
                },
            );
        },
    );
    out
}

/// Side of the square tiles [`gather_transposed`] copies through.
const TRANSPOSE_TILE: usize = 32;

/// [`gather`] of a view whose last two dims are transposed (collapsed `shape`, `strides`
/// with the second-last stride 1 and the last not: a gradient of `kᵀ` in attention). The
/// row-major walk would read one element per cache line; this copies each `[rows, cols]`
/// plane in tiles of 32 × 32, which read and write whole lines (`--bench ops
/// transpose_contiguous`, W2's `[64, 128, 64]` from `[64, 64, 128]` in bf16: about 2× faster).
fn gather_transposed<E: Precision>(src: &[E], shape: &[usize], strides: &[usize], offset: usize) -> Vec<E> {
    const T: usize = TRANSPOSE_TILE;
    let rank = shape.len();
    let (rows, cols, col_stride) = (shape[rank - 2], shape[rank - 1], strides[rank - 1]);
    let (outer, outer_strides) = (&shape[..rank - 2], &strides[..rank - 2]);
    let plane = rows * cols;
    let mut out = alloc::take::<E>(plane * outer.iter().product::<usize>());
    if plane == 0 {
        return out;
    }
    // The output in strips of T rows of one plane, each contiguous: (plane, first row, strip).
    // Tasks take about CHUNK elements of strips, so one large plane (a big matrix's
    // transpose) is split too.
    let copy = |&mut (plane_index, r0, ref mut dst): &mut (usize, usize, &mut [E])| {
        // The input offset of the plane: its multi-index over the outer dims.
        let (mut p, mut base) = (plane_index, offset);
        for d in (0..outer.len()).rev() {
            base += p % outer[d] * outer_strides[d];
            p /= outer[d];
        }
        let tile_rows = T.min(rows - r0);
        let mut tile = [[E::default(); T]; T];
        for c0 in (0..cols).step_by(T) {
            let tile_cols = T.min(cols - c0);
            // Columns c0.. of the strip's rows: each contiguous in the input.
            for (j, column) in tile.iter_mut().enumerate().take(tile_cols) {
                column[..tile_rows].copy_from_slice(&src[base + (c0 + j) * col_stride + r0..][..tile_rows]);
            }
            for r in 0..tile_rows {
                let row = &mut dst[r * cols + c0..][..tile_cols];
                for (j, v) in row.iter_mut().enumerate() {
                    *v = tile[j][r];
                }
            }
        }
    };
    let big = out.len() >= PAR_MIN;
    let mut strips: Vec<(usize, usize, &mut [E])> = out
        .chunks_mut(plane)
        .enumerate()
        .flat_map(|(p, plane)| plane.chunks_mut(T * cols).enumerate().map(move |(s, strip)| (p, s * T, strip)))
        .collect();
    if big {
        strips.par_chunks_mut((CHUNK / (T * cols)).max(1)).for_each(|group| group.iter_mut().for_each(copy));
    } else {
        strips.iter_mut().for_each(copy);
    }
    out
}

/// `out[i] = f(x[i])` over contiguous data, computed in the accumulation type.
pub(crate) fn map_unary<E: Precision>(x: &[E], f: impl Fn(E::Acc) -> E::Acc + Sync + Send) -> Vec<E> {
    let mut out = alloc::take::<E>(x.len());
    par_chunks_mut(
        &mut out,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            let mut bx = [E::Acc::default(); BUF];
            let mut by = [E::Acc::default(); BUF];
            for (j, o) in chunk.chunks_mut(BUF).enumerate() {
                let s = start + j * BUF;
                let n = o.len();
                let x = acc_in(&x[s..s + n], &mut bx[..n]);
                acc_out(
                    o,
                    &mut by[..n],
                    #[inline(always)]
                    |o| {
                        for (o, v) in o.iter_mut().zip(x) {
                            *o = f(*v);
                        }
                    },
                );
            }
        },
    );
    out
}

/// `out[i] = f(a[i], b[i], c[i])` over three contiguous slices of one length.
pub(crate) fn map_ternary<E: Precision>(
    a: &[E],
    b: &[E],
    c: &[E],
    f: impl Fn(E::Acc, E::Acc, E::Acc) -> E::Acc + Sync + Send,
) -> Vec<E> {
    let mut out = alloc::take::<E>(a.len());
    par_chunks_mut(
        &mut out,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            let mut ba = [E::Acc::default(); BUF];
            let mut bb = [E::Acc::default(); BUF];
            let mut bc = [E::Acc::default(); BUF];
            let mut bo = [E::Acc::default(); BUF];
            for (j, o) in chunk.chunks_mut(BUF).enumerate() {
                let s = start + j * BUF;
                let n = o.len();
                let a = acc_in(&a[s..s + n], &mut ba[..n]);
                let b = acc_in(&b[s..s + n], &mut bb[..n]);
                let c = acc_in(&c[s..s + n], &mut bc[..n]);
                acc_out(
                    o,
                    &mut bo[..n],
                    #[inline(always)]
                    |o| {
                        for (((o, x), y), z) in o.iter_mut().zip(a).zip(b).zip(c) {
                            *o = f(*x, *y, *z);
                        }
                    },
                );
            }
        },
    );
    out
}

/// `out = f(a, b)` with a and b broadcast (by their layouts) to `out_shape`.
pub(crate) fn map_binary<E: Precision>(
    a: &[E],
    la: &Layout,
    b: &[E],
    lb: &Layout,
    out_shape: &[usize],
    f: impl Fn(E::Acc, E::Acc) -> E::Acc + Sync + Send,
) -> Vec<E> {
    let mut out = alloc::take::<E>(out_shape.iter().product());
    map_binary_into(a, la, b, lb, out_shape, &mut out, f);
    out
}

/// [`map_binary`] into `out` (every element written). `b` may be in another precision with
/// the same accumulation type (a bf16 `b` for an f32 `a`), read into it as it is.
pub(crate) fn map_binary_into<E: Precision, B: Precision<Acc = E::Acc>>(
    a: &[E],
    la: &Layout,
    b: &[B],
    lb: &Layout,
    out_shape: &[usize],
    out: &mut [E],
    f: impl Fn(E::Acc, E::Acc) -> E::Acc + Sync + Send,
) {
    let n: usize = out_shape.iter().product();
    assert_eq!(out.len(), n, "map_binary_into: output length");
    let la = la.broadcast_to(out_shape);
    let lb = lb.broadcast_to(out_shape);
    let (shape, strides) = collapse(out_shape, [&la.strides, &lb.strides]);
    par_chunks_mut(
        out,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            let mut ba = [E::Acc::default(); BUF];
            let mut bb = [E::Acc::default(); BUF];
            let mut bo = [E::Acc::default(); BUF];
            for_each_run(
                &shape,
                &strides,
                [la.offset, lb.offset],
                start,
                start + chunk.len(),
                #[inline(always)]
                |pos, [oa, ob], [sa, sb], len| {
                    let mut done = 0;
                    while done < len {
                        let m = (len - done).min(BUF);
                        let p = pos - start + done;
                        let xa = load_run(a, oa + done * sa, sa, &mut ba[..m]);
                        let xb = load_run(b, ob + done * sb, sb, &mut bb[..m]);
                        acc_out(
                            &mut chunk[p..p + m],
                            &mut bo[..m],
                            #[inline(always)]
                            |o| {
                                for ((o, x), y) in o.iter_mut().zip(xa).zip(xb) {
                                    *o = f(*x, *y);
                                }
                            },
                        );
                        done += m;
                    }
                },
            );
        },
    );
}

/// Sum of a buffer with eight independent lanes, so the compiler can vectorise it.
#[inline(always)]
pub(crate) fn sum_buf<A: Accum>(x: &[A]) -> A {
    let mut lanes = [A::zero(); 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    let mut s = A::zero();
    for v in it.remainder() {
        s += *v;
    }
    combine_lanes(lanes, s)
}

/// The total of eight lane sums and a tail sum, in the fixed order every lane reduction uses.
///
/// The lanes pass through `black_box` first. Without it LLVM's SLP vectoriser builds the
/// loop's vectors from this expression's pairs (lanes 0 and 4, 1 and 5, ...): the loop then
/// ran on four xmm registers of two lanes each, with a shuffle per pair every iteration
/// (layer norm's forward 129 µs a [2048, 256] f32 call; with it, one ymm add: 90 µs). The
/// order of the additions, hence every result, is unchanged.
#[inline(always)]
pub(crate) fn combine_lanes<A: Accum>(lanes: [A; 8], tail: A) -> A {
    let l = std::hint::black_box(lanes);
    ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + tail
}

/// `dst[view dl] = src` (or `+= src` in `E::Acc`, one rounding each, when `add`); `src` is
/// contiguous with the view's element count.
pub(crate) fn write_into<E: Precision>(dst: &mut [E], dl: &Layout, src: &[E], add: bool) {
    assert_eq!(src.len(), dl.numel(), "write_into: element count mismatch");
    let run = |d: &mut [E], s: &[E]| if add { add_assign(d, s) } else { d.copy_from_slice(s) };
    if dl.is_contiguous() {
        run(&mut dst[dl.offset..dl.offset + src.len()], src);
        return;
    }
    let (shape, [strides]) = collapse(&dl.shape, [&dl.strides]);
    for_each_run(&shape, &[strides], [dl.offset], 0, src.len(), |pos, [o], [st], len| {
        let s = &src[pos..pos + len];
        if st == 1 {
            run(&mut dst[o..o + len], s);
        } else {
            for (i, v) in s.iter().enumerate() {
                let d = &mut dst[o + i * st];
                *d = if add { E::from_acc(d.to_acc() + v.to_acc()) } else { *v };
            }
        }
    });
}

/// `dst += src` element-wise in `E::Acc`, rounded once per element, in parallel chunks.
fn add_assign<E: Precision>(dst: &mut [E], src: &[E]) {
    assert_eq!(dst.len(), src.len(), "add_assign: length mismatch");
    par_chunks_mut(
        dst,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            let src = &src[start..start + chunk.len()];
            let mut ba = [E::Acc::default(); BUF];
            let mut bb = [E::Acc::default(); BUF];
            for (d, s) in chunk.chunks_mut(BUF).zip(src.chunks(BUF)) {
                let (xa, xb) = (&mut ba[..d.len()], &mut bb[..d.len()]);
                E::load(d, xa);
                E::load(s, xb);
                for (x, y) in xa.iter_mut().zip(xb.iter()) {
                    *x += *y;
                }
                E::store(xa, d);
            }
        },
    );
}

/// Whether the environment variable `name` turns a feature off (`off` or `0`): the A/B
/// switches `AMP_CPU_AMX` and `AMP_CPU_SPIN`.
pub(crate) fn env_off(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "off" || v == "0")
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Element `(i_0, .., i_{r-1})` of a view, the definition `gather` must match.
    fn by_index<E: Precision>(src: &[E], layout: &Layout) -> Vec<E> {
        let n = layout.numel();
        (0..n)
            .map(|mut flat| {
                let mut at = layout.offset;
                for d in (0..layout.shape.len()).rev() {
                    at += flat % layout.shape[d] * layout.strides[d];
                    flat /= layout.shape[d];
                }
                src[at]
            })
            .collect()
    }

    /// Views whose last two dims are transposed take the tiled copy: planes smaller and
    /// larger than a tile and than a parallel task, rows and columns off the tile size,
    /// outer dims that do not merge, a start offset.
    #[test]
    fn gather_of_transposed_views_matches_the_definition() {
        let views: [(&[usize], &[usize], usize); 5] = [
            // [64, 64, 128] transposed from [64, 128, 64] (attention's kᵀ gradient, merged).
            (&[16, 4, 128, 64], &[32768, 8192, 1, 128], 0),
            (&[3, 5, 7], &[40, 1, 5], 3),
            (&[70, 33], &[1, 70], 0),
            (&[2, 3, 45, 40], &[9000, 2000, 1, 48], 11),
            (&[1, 300, 257], &[0, 1, 300], 7),
        ];
        for (shape, strides, offset) in views {
            let layout = Layout { shape: shape.to_vec(), strides: strides.to_vec(), offset };
            let len = offset + shape.iter().zip(strides).map(|(n, s)| (n - 1) * s).sum::<usize>() + 1;
            let src: Vec<f32> = (0..len).map(|i| i as f32).collect();
            assert_eq!(gather(&src, &layout), by_index(&src, &layout), "f32 {shape:?} {strides:?}");
            let src: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
            assert_eq!(gather(&src, &layout), by_index(&src, &layout), "bf16 {shape:?} {strides:?}");
        }
    }
}
