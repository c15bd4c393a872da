//! 2-D convolution on the GEMM path: im2col, then the batched strided matmul of
//! [`super::matmul`] (f32 accumulation and one rounding for f16 and bf16, on the native kernels
//! where the CPU has them).
//!
//! Design notes:
//! - Work goes sample by sample: a sample's column matrix (`[G, K, L]`: per group one row per
//!   weight tap `k = (c, i, j)`, the weight's row order, `K = C_g·kH·kW`, and one column per
//!   output position, `L = oH·oW`) is built into a pooled buffer small enough to stay in
//!   cache and consumed at once by the GEMM, instead of one batch-sized matrix that would go
//!   through memory twice. Samples run in parallel, each on one thread, when there are at
//!   least as many as threads; otherwise one after another with each sample's loops and GEMMs
//!   parallel inside.
//! - Forward is, per sample and group, `W_g [C_out/G, K] · cols_g [K, L]`, written straight
//!   into the sample's NCHW output. The bias goes into the accumulator: each group's column
//!   matrix gets one more row of ones and each weight row its bias as one more column, so the
//!   GEMM adds it before its one rounding.
//! - The input gradient is `W_gᵀ · dY_g` per sample, kept in the accumulation type, then
//!   summed back onto the input positions (col2im) plane by plane and rounded once.
//! - The weight gradient is `cols_g · dY_gᵀ` per sample (the orientation that reads the
//!   columns in place), summed in the accumulation type within fixed blocks of samples and
//!   then over blocks in order (so the result does not depend on the thread count), and
//!   rounded once; the bias gradient sums `dY` per channel the same way.

use rayon::prelude::*;

use super::alloc::{self, PooledVec};
use super::matmul::{matmul_acc_into, matmul_into};
use super::rows::{par_row_ranges, par_rows};
use super::{BUF, PAR_MIN, sum_buf};
use crate::backend::Conv2dSpec;
use crate::layout::Layout;
use crate::precision::{Accum, DType, Precision};
use num_traits::Zero;

/// The sizes every kernel here works with.
#[derive(Clone, Copy)]
struct Dims {
    n: usize,
    c_in: usize,
    c_out: usize,
    g: usize,
    /// Input channels per group.
    cg: usize,
    /// Output channels per group.
    og: usize,
    /// Weight taps per group (`cg·kh·kw`): the column matrix's rows.
    k: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
}

impl Dims {
    fn of(s: &Conv2dSpec) -> Self {
        let (cg, og) = (s.group_in(), s.group_out());
        Dims {
            n: s.batch,
            c_in: s.in_channels,
            c_out: s.out_channels,
            g: s.groups,
            cg,
            og,
            k: cg * s.kernel.0 * s.kernel.1,
            h: s.input.0,
            w: s.input.1,
            kh: s.kernel.0,
            kw: s.kernel.1,
            oh: s.output.0,
            ow: s.output.1,
        }
    }
    /// Output positions per sample.
    fn l(&self) -> usize {
        self.oh * self.ow
    }
}

/// The output columns `ow` for which `ow·stride + off` lies in `0..w`: `lo..hi` (empty as
/// `lo == hi`).
fn valid_cols(off: isize, stride: usize, w: usize, ow: usize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if off >= 0 { 0 } else { ((-off + s - 1) / s) as usize };
    let hi = if (w as isize) <= off { 0 } else { ((w as isize - off + s - 1) / s) as usize };
    let hi = hi.min(ow);
    (lo.min(hi), hi)
}

/// Runs `f(block_index, block, parallel_inside)` over `out` cut into `blocks` equal blocks:
/// blocks in parallel (each on one thread) when there are enough of them for the threads and
/// `work` (elements touched in all) is large, one after another otherwise (each parallel
/// inside when `work` is large).
fn per_block<T: Send>(out: &mut [T], blocks: usize, work: usize, f: impl Fn(usize, &mut [T], bool) + Sync + Send) {
    if blocks == 0 || out.is_empty() {
        return;
    }
    let size = out.len() / blocks;
    let big = work >= PAR_MIN;
    if big && blocks >= 2 && blocks >= rayon::current_num_threads() {
        out.par_chunks_mut(size).enumerate().for_each(|(i, b)| f(i, b, false));
    } else {
        out.chunks_mut(size).enumerate().for_each(|(i, b)| f(i, b, big));
    }
}

/// The column matrix of one sample `x` (contiguous `[C_in, H, W]`) into `cols`, laid out
/// `[G, rows, L]`, where `rows` is `K`, or `K + 1` with `ones` (a last row of ones per
/// group, which multiplies the bias). Rows in parallel when `parallel`.
fn im2col<E: Precision>(x: &[E], s: &Conv2dSpec, ones: bool, cols: &mut [E], parallel: bool) {
    let d = Dims::of(s);
    let (l, rows) = (d.l(), d.k + usize::from(ones));
    let (sh, sw) = s.stride;
    let (ph, pw) = s.padding;
    let (dh, dw) = s.dilation;
    let (zero, one) = (E::default(), E::from_f64(1.0));
    // Every element of every row is written (a copy, a zero or a one).
    let fill = |r0: usize, chunk: &mut [E]| {
        for (rr, row) in chunk.chunks_mut(l).enumerate() {
            let (g, k) = ((r0 + rr) / rows, (r0 + rr) % rows);
            if k == d.k {
                row.fill(one);
                continue;
            }
            let (c, i, j) = (k / (d.kh * d.kw), (k / d.kw) % d.kh, k % d.kw);
            let plane = &x[(g * d.cg + c) * d.h * d.w..][..d.h * d.w];
            let off = (j * dw) as isize - pw as isize;
            let (lo, hi) = valid_cols(off, sw, d.w, d.ow);
            for oh in 0..d.oh {
                let dst = &mut row[oh * d.ow..][..d.ow];
                let ih = (oh * sh + i * dh) as isize - ph as isize;
                if ih < 0 || ih >= d.h as isize || lo == hi {
                    dst.fill(zero);
                    continue;
                }
                let src = &plane[ih as usize * d.w..][..d.w];
                dst[..lo].fill(zero);
                dst[hi..].fill(zero);
                let first = (lo as isize * sw as isize + off) as usize;
                if sw == 1 {
                    dst[lo..hi].copy_from_slice(&src[first..first + (hi - lo)]);
                } else {
                    for (t, v) in dst[lo..hi].iter_mut().enumerate() {
                        *v = src[first + t * sw];
                    }
                }
            }
        }
    };
    if parallel {
        par_rows(
            cols,
            l,
            l,
            #[inline(always)]
            |r0, chunk| fill(r0, chunk),
        );
    } else {
        fill(0, cols);
    }
}

/// One sample's input gradient `dx` (contiguous `[C_in, H, W]`, every element written) from
/// its column gradients `cols` (`[G, K, L]`, in the accumulation type `A`): every input
/// position sums the entries of the taps that read it, plane by plane in `A`, rounded once.
/// Planes in parallel when `parallel`.
fn col2im<E: Precision, A: Precision>(cols: &[A], s: &Conv2dSpec, dx: &mut [E], parallel: bool) {
    let d = Dims::of(s);
    let (l, hw) = (d.l(), d.h * d.w);
    let (sh, sw) = s.stride;
    let (ph, pw) = s.padding;
    let (dh, dw) = s.dilation;
    let planes = |c0: usize, chunk: &mut [E]| {
        let mut acc = vec![A::Acc::default(); hw];
        for (cc, plane) in chunk.chunks_mut(hw).enumerate() {
            let ci = c0 + cc;
            let (g, c) = (ci / d.cg, ci % d.cg);
            acc.fill(A::Acc::default());
            for i in 0..d.kh {
                for j in 0..d.kw {
                    let k = (c * d.kh + i) * d.kw + j;
                    let row = &cols[(g * d.k + k) * l..][..l];
                    let off = (j * dw) as isize - pw as isize;
                    let (lo, hi) = valid_cols(off, sw, d.w, d.ow);
                    if lo == hi {
                        continue;
                    }
                    let first = (lo as isize * sw as isize + off) as usize;
                    for oh in 0..d.oh {
                        let ih = (oh * sh + i * dh) as isize - ph as isize;
                        if ih < 0 || ih >= d.h as isize {
                            continue;
                        }
                        let dst = &mut acc[ih as usize * d.w..][..d.w];
                        for (t, v) in row[oh * d.ow + lo..oh * d.ow + hi].iter().enumerate() {
                            dst[first + t * sw] += v.to_acc();
                        }
                    }
                }
            }
            for (o, a) in plane.iter_mut().zip(&acc) {
                *o = E::from_f64(a.f64());
            }
        }
    };
    if parallel {
        par_rows(
            dx,
            hw,
            d.kh * d.kw * l,
            #[inline(always)]
            |c0, chunk| planes(c0, chunk),
        );
    } else {
        planes(0, dx);
    }
}

/// The convolution of `x` (contiguous NCHW) with `w` (contiguous `[C_out, C_g, kH, kW]`)
/// plus `bias`: per sample, its column matrix (kept in cache) times the weight, one GEMM per
/// group. Contiguous `[N, C_out, oH, oW]`.
pub(crate) fn forward<E: Precision>(x: &[E], w: &[E], bias: Option<&[E]>, s: &Conv2dSpec) -> Vec<E> {
    let d = Dims::of(s);
    let (l, chw) = (d.l(), d.c_in * d.h * d.w);
    let rows = d.k + usize::from(bias.is_some());
    // The weight with each row's bias appended (the ones row of the columns multiplies it).
    let widened;
    let w = match bias {
        None => w,
        Some(b) => {
            let mut v = alloc::take::<E>(d.c_out * rows);
            for (o, dst) in v.chunks_mut(rows).enumerate() {
                dst[..d.k].copy_from_slice(&w[o * d.k..(o + 1) * d.k]);
                dst[d.k] = b[o];
            }
            widened = PooledVec::from(v);
            &widened[..]
        }
    };
    let lw = Layout { shape: vec![d.g, d.og, rows], strides: vec![d.og * rows, rows, 1], offset: 0 };
    let lc = Layout::contiguous(&[d.g, rows, l]);
    // Every sample's block is one batched GEMM's output.
    let mut out = alloc::take::<E>(d.n * d.c_out * l);
    per_block(&mut out, d.n, d.n * d.g * rows * l, |n, dst, par| {
        let mut cols = PooledVec::from(alloc::take::<E>(d.g * rows * l));
        im2col(&x[n * chw..(n + 1) * chw], s, bias.is_some(), &mut cols, par);
        matmul_into(w, &lw, &cols, &lc, &[d.g], dst, par);
    });
    out
}

/// The input gradient from `g` (contiguous `[N, C_out, oH, oW]`) and `w` (contiguous): per
/// sample, `wᵀ · g` per group in the accumulation type, then col2im.
pub(crate) fn backward_input<E: Precision>(g: &[E], w: &[E], s: &Conv2dSpec) -> Vec<E> {
    match E::DTYPE {
        DType::F64 => backward_input_in::<E, f64>(g, w, s),
        _ => backward_input_in::<E, f32>(g, w, s),
    }
}

fn backward_input_in<E: Precision, A: Precision>(g: &[E], w: &[E], s: &Conv2dSpec) -> Vec<E> {
    let d = Dims::of(s);
    let (l, chw) = (d.l(), d.c_in * d.h * d.w);
    let lw = Layout { shape: vec![d.g, d.k, d.og], strides: vec![d.og * d.k, 1, d.k], offset: 0 };
    let lg = Layout::contiguous(&[d.g, d.og, l]);
    // Every sample's planes are stored whole.
    let mut dx = alloc::take::<E>(d.n * chw);
    per_block(&mut dx, d.n, d.n * d.g * d.k * l, |n, dst, par| {
        let mut cols = PooledVec::from(alloc::take::<A>(d.g * d.k * l));
        matmul_acc_into::<E, A>(w, &lw, &g[n * d.c_out * l..(n + 1) * d.c_out * l], &lg, &[d.g], &mut cols, par);
        col2im::<E, A>(&cols, s, dst, par);
    });
    dx
}

/// The most blocks of samples the weight gradient's partial sums are cut into: the blocks
/// depend only on the batch size, so the sums (added block by block in order) do not depend
/// on the thread count.
const WEIGHT_GRAD_BLOCKS: usize = 16;

/// The weight gradient (`[C_out, C_g, kH, kW]`) when the input `x` (contiguous NCHW) is
/// given, and the bias gradient (`[C_out]`) when `need_b`, from `g` (contiguous
/// `[N, C_out, oH, oW]`).
pub(crate) fn backward_weight<E: Precision>(
    x: Option<&[E]>,
    g: &[E],
    s: &Conv2dSpec,
    need_b: bool,
) -> (Option<Vec<E>>, Option<Vec<E>>) {
    let gw = x.map(|x| match E::DTYPE {
        DType::F64 => weight_grad::<E, f64>(x, g, s),
        _ => weight_grad::<E, f32>(x, g, s),
    });
    let gb = need_b.then(|| bias_grad(g, s));
    (gw, gb)
}

/// `Σ_n dY_n · cols_nᵀ` per group: each sample's `cols · dYᵀ` (`[G, K, C_out/G]`, the
/// orientation whose large operand, the columns, is read in place) in the accumulation type
/// `A`, summed over samples within fixed blocks, then over blocks in order, rounded once.
fn weight_grad<E: Precision, A: Precision>(x: &[E], g: &[E], s: &Conv2dSpec) -> Vec<E> {
    let d = Dims::of(s);
    let (l, chw, size) = (d.l(), d.c_in * d.h * d.w, d.g * d.k * d.og);
    let per = d.n.div_ceil(WEIGHT_GRAD_BLOCKS).max(1);
    let blocks = d.n.div_ceil(per).max(1);
    let lc = Layout::contiguous(&[d.g, d.k, l]);
    let lg = Layout { shape: vec![d.g, l, d.og], strides: vec![d.og * l, 1, l], offset: 0 };
    // Each block's sums start from zero.
    let mut partials = alloc::zeroed::<A>(blocks * size);
    per_block(&mut partials, blocks, d.n * d.g * d.k * l, |b, acc, par| {
        let mut cols = PooledVec::from(alloc::take::<E>(d.g * d.k * l));
        let mut prod = PooledVec::from(alloc::take::<A>(size));
        for n in b * per..((b + 1) * per).min(d.n) {
            im2col(&x[n * chw..(n + 1) * chw], s, false, &mut cols, par);
            let gn = &g[n * d.c_out * l..(n + 1) * d.c_out * l];
            matmul_acc_into::<E, A>(&cols, &lc, gn, &lg, &[d.g], &mut prod, par);
            for (a, p) in acc.iter_mut().zip(prod.iter()) {
                *a = A::from_acc(a.to_acc() + p.to_acc());
            }
        }
    });
    // Blocks in order, then [G, K, og] -> [G·og, K] and one rounding.
    let mut total = vec![A::Acc::default(); size];
    for part in partials.chunks(size.max(1)) {
        for (t, p) in total.iter_mut().zip(part) {
            *t += p.to_acc();
        }
    }
    let mut out = alloc::take::<E>(size);
    for gi in 0..d.g {
        for k in 0..d.k {
            for o in 0..d.og {
                out[(gi * d.og + o) * d.k + k] = E::from_f64(total[(gi * d.k + k) * d.og + o].f64());
            }
        }
    }
    out
}

/// `Σ_{n, h, w} dY` per output channel, in E::Acc, rounded once.
fn bias_grad<E: Precision>(g: &[E], s: &Conv2dSpec) -> Vec<E> {
    let d = Dims::of(s);
    let l = d.l();
    let sums: Vec<E::Acc> = par_row_ranges(
        d.c_out,
        d.n * l,
        #[inline(always)]
        |cs| {
            let mut buf = [E::Acc::default(); BUF];
            cs.map(|c| {
                let mut acc = E::Acc::zero();
                for n in 0..d.n {
                    for part in g[(n * d.c_out + c) * l..][..l].chunks(BUF) {
                        let b = &mut buf[..part.len()];
                        E::load(part, b);
                        acc += sum_buf(b);
                    }
                }
                acc
            })
            .collect::<Vec<_>>()
        },
    )
    .into_iter()
    .flatten()
    .collect();
    let mut out = alloc::take::<E>(d.c_out);
    E::store(&sums, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The direct definition of the convolution, in f64.
    fn direct(x: &[f64], w: &[f64], bias: Option<&[f64]>, s: &Conv2dSpec) -> Vec<f64> {
        let d = Dims::of(s);
        let mut out = vec![0.0; d.n * d.c_out * d.l()];
        for n in 0..d.n {
            for o in 0..d.c_out {
                let g = o / d.og;
                for oh in 0..d.oh {
                    for ow in 0..d.ow {
                        let mut acc = bias.map_or(0.0, |b| b[o]);
                        for c in 0..d.cg {
                            for i in 0..d.kh {
                                for j in 0..d.kw {
                                    let ih = (oh * s.stride.0 + i * s.dilation.0) as isize - s.padding.0 as isize;
                                    let iw = (ow * s.stride.1 + j * s.dilation.1) as isize - s.padding.1 as isize;
                                    if ih < 0 || iw < 0 || ih >= d.h as isize || iw >= d.w as isize {
                                        continue;
                                    }
                                    let xv = x[((n * d.c_in + g * d.cg + c) * d.h + ih as usize) * d.w + iw as usize];
                                    acc += w[((o * d.cg + c) * d.kh + i) * d.kw + j] * xv;
                                }
                            }
                        }
                        out[((n * d.c_out + o) * d.oh + oh) * d.ow + ow] = acc;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn gemm_path_matches_the_direct_definition() {
        let mut rng = crate::Rng::seed(4);
        for (stride, padding, dilation, groups) in
            [((1, 1), (0, 0), (1, 1), 1), ((2, 1), (1, 2), (1, 2), 2), ((3, 2), (2, 0), (2, 1), 3)]
        {
            let (n, c_in, c_out, h, w, kh, kw) = (2, 6, 12, 7, 8, 3, 2);
            let oh = Conv2dSpec::output_size(h, kh, stride.0, padding.0, dilation.0).unwrap();
            let ow = Conv2dSpec::output_size(w, kw, stride.1, padding.1, dilation.1).unwrap();
            let s = Conv2dSpec {
                batch: n,
                in_channels: c_in,
                out_channels: c_out,
                groups,
                input: (h, w),
                kernel: (kh, kw),
                output: (oh, ow),
                stride,
                padding,
                dilation,
            };
            let x: Vec<f64> = (0..n * c_in * h * w).map(|_| rng.normal()).collect();
            let wt: Vec<f64> = (0..c_out * (c_in / groups) * kh * kw).map(|_| rng.normal()).collect();
            let b: Vec<f64> = (0..c_out).map(|_| rng.normal()).collect();
            for bias in [None, Some(&b[..])] {
                let got = forward(&x, &wt, bias, &s);
                let want = direct(&x, &wt, bias, &s);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-12 * (1.0 + w.abs()), "{s:?}: {g} vs {w}");
                }
            }
        }
    }

    /// The gradients of `sum(conv(x, w) * g)` by the direct definition, in f64: `(dx, dw)`.
    fn direct_grads(x: &[f64], w: &[f64], g: &[f64], s: &Conv2dSpec) -> (Vec<f64>, Vec<f64>) {
        let d = Dims::of(s);
        let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; w.len()]);
        for n in 0..d.n {
            for o in 0..d.c_out {
                for oh in 0..d.oh {
                    for ow in 0..d.ow {
                        let gv = g[((n * d.c_out + o) * d.oh + oh) * d.ow + ow];
                        for c in 0..d.cg {
                            for i in 0..d.kh {
                                for j in 0..d.kw {
                                    let ih = (oh * s.stride.0 + i * s.dilation.0) as isize - s.padding.0 as isize;
                                    let iw = (ow * s.stride.1 + j * s.dilation.1) as isize - s.padding.1 as isize;
                                    if ih < 0 || iw < 0 || ih >= d.h as isize || iw >= d.w as isize {
                                        continue;
                                    }
                                    let xi =
                                        ((n * d.c_in + (o / d.og) * d.cg + c) * d.h + ih as usize) * d.w + iw as usize;
                                    let wi = ((o * d.cg + c) * d.kh + i) * d.kw + j;
                                    dx[xi] += w[wi] * gv;
                                    dw[wi] += x[xi] * gv;
                                }
                            }
                        }
                    }
                }
            }
        }
        (dx, dw)
    }

    /// Batches larger than the weight gradient's block count (several samples per block), and
    /// a large batch of one (one sample, its loops and GEMMs parallel inside).
    #[test]
    fn gradients_match_the_direct_definition() {
        let mut rng = crate::Rng::seed(5);
        for (n, h, w_) in [(37, 6, 7), (1, 80, 100)] {
            let (c_in, c_out, kh, kw) = (4, 6, 3, 3);
            let (stride, padding, dilation, groups) = ((2, 1), (1, 2), (1, 2), 2);
            let oh = Conv2dSpec::output_size(h, kh, stride.0, padding.0, dilation.0).unwrap();
            let ow = Conv2dSpec::output_size(w_, kw, stride.1, padding.1, dilation.1).unwrap();
            let s = Conv2dSpec {
                batch: n,
                in_channels: c_in,
                out_channels: c_out,
                groups,
                input: (h, w_),
                kernel: (kh, kw),
                output: (oh, ow),
                stride,
                padding,
                dilation,
            };
            let mut r = |len: usize| (0..len).map(|_| rng.normal()).collect::<Vec<f64>>();
            let (x, w, g) = (r(n * c_in * h * w_), r(c_out * (c_in / groups) * kh * kw), r(n * c_out * oh * ow));
            let (want_dx, want_dw) = direct_grads(&x, &w, &g, &s);
            let got_dx = backward_input(&g, &w, &s);
            let (got_dw, got_db) = backward_weight(Some(&x), &g, &s, true);
            let close = |got: &[f64], want: &[f64], what: &str| {
                assert_eq!(got.len(), want.len(), "{what}");
                for (a, b) in got.iter().zip(want) {
                    assert!((a - b).abs() < 1e-10 * (1.0 + b.abs()), "{what} (n = {n}): {a} vs {b}");
                }
            };
            close(&got_dx, &want_dx, "dx");
            close(&got_dw.unwrap(), &want_dw, "dw");
            let want_db: Vec<f64> =
                (0..c_out).map(|o| (0..n).flat_map(|b| &g[(b * c_out + o) * oh * ow..][..oh * ow]).sum()).collect();
            close(&got_db.unwrap(), &want_db, "db");
        }
    }

    #[test]
    fn valid_columns_cover_exactly_the_input() {
        for (off, stride, w, ow) in [(-3isize, 2, 5, 6), (0, 1, 4, 4), (2, 3, 4, 3), (5, 1, 4, 2), (-1, 1, 3, 5)] {
            let (lo, hi) = valid_cols(off, stride, w, ow);
            for o in 0..ow {
                let iw = o as isize * stride as isize + off;
                assert_eq!((lo..hi).contains(&o), iw >= 0 && iw < w as isize, "{off} {stride} {w} {ow}: {o}");
            }
        }
    }
}
