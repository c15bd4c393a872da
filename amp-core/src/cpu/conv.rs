//! 2-D convolution on the GEMM path: im2col, then the batched strided matmul of
//! [`super::matmul`] (f32 accumulation and one rounding for f16 and bf16, on the native kernels
//! where the CPU has them).
//!
//! Design notes:
//! - The column matrix of group `g` has one row per weight tap `k = (c, i, j)` of the group
//!   (`K = C_g·kH·kW` rows, the weight's row order) and one column per output position of
//!   every sample. Forward lays it out `[G, K, N, L]` (`L = oH·oW`): as a matrix `[K, N·L]`
//!   per group, whose `N·L` columns the weight gradient contracts over in one GEMM, and, seen
//!   through strides as `[N, G, K, L]`, the right operand of a batched matmul whose output is
//!   `[N, G, C_out/G, L]`, the NCHW output itself with no transpose.
//! - The bias goes into the accumulator: each group's column matrix gets one more row of
//!   ones and each weight row its bias as one more column, so the GEMM adds it before its one
//!   rounding.
//! - The input gradient is `wᵀ · dY` per sample and group, kept in the accumulation type,
//!   then summed back onto the input positions (col2im) and rounded once; col2im runs plane
//!   by plane, each plane's sums in a fixed order (deterministic for any thread count).
//! - The weight gradient is one GEMM per group, `dY · colsᵀ`, over a copy of `dY` laid out
//!   `[C_out, N·L]`; the bias gradient is that copy's row sums.

use super::alloc::{self, PooledVec};
use super::matmul::{matmul, matmul_acc};
use super::reduce::{Reduce, reduce_dim};
use super::rows::par_rows;
use crate::backend::Conv2dSpec;
use crate::layout::Layout;
use crate::precision::{Accum, DType, Precision};

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

/// The column matrix of `x` (contiguous NCHW) laid out `[G, rows, N, L]`, where `rows` is `K`,
/// or `K + 1` with `ones` (a last row of ones per group, which multiplies the bias).
fn im2col<E: Precision>(x: &[E], s: &Conv2dSpec, ones: bool) -> PooledVec<E> {
    let d = Dims::of(s);
    let (l, rows) = (d.l(), d.k + usize::from(ones));
    let nl = d.n * l;
    let (sh, sw) = s.stride;
    let (ph, pw) = s.padding;
    let (dh, dw) = s.dilation;
    let (zero, one) = (E::default(), E::from_f64(1.0));
    // Every element of every row is written (a copy, a zero or a one).
    let mut cols = alloc::take::<E>(d.g * rows * nl);
    par_rows(&mut cols, nl, nl, |r0, chunk| {
        for (rr, row) in chunk.chunks_mut(nl).enumerate() {
            let (g, k) = ((r0 + rr) / rows, (r0 + rr) % rows);
            if k == d.k {
                row.fill(one);
                continue;
            }
            let (c, i, j) = (k / (d.kh * d.kw), (k / d.kw) % d.kh, k % d.kw);
            let ci = g * d.cg + c;
            let off = (j * dw) as isize - pw as isize;
            let (lo, hi) = valid_cols(off, sw, d.w, d.ow);
            for n in 0..d.n {
                let plane = &x[(n * d.c_in + ci) * d.h * d.w..][..d.h * d.w];
                for oh in 0..d.oh {
                    let dst = &mut row[n * l + oh * d.ow..][..d.ow];
                    let ih = (oh * sh + i * dh) as isize - ph as isize;
                    if ih < 0 || ih >= d.h as isize {
                        dst.fill(zero);
                        continue;
                    }
                    let src = &plane[ih as usize * d.w..][..d.w];
                    dst[..lo].fill(zero);
                    dst[hi..].fill(zero);
                    if lo == hi {
                        continue;
                    }
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
        }
    });
    PooledVec::from(cols)
}

/// The input gradient from column gradients laid out `[N, G, K, L]` (in the accumulation type
/// `A`): every input position sums the entries of the taps that read it, plane by plane in
/// `A`, rounded once into `E`. Contiguous NCHW.
fn col2im<E: Precision, A: Precision>(cols: &[A], s: &Conv2dSpec) -> Vec<E> {
    let d = Dims::of(s);
    let (l, hw) = (d.l(), d.h * d.w);
    let (sh, sw) = s.stride;
    let (ph, pw) = s.padding;
    let (dh, dw) = s.dilation;
    // Every plane is stored whole.
    let mut out = alloc::take::<E>(d.n * d.c_in * hw);
    par_rows(&mut out, hw, d.kh * d.kw * l, |p0, chunk| {
        let mut acc = vec![A::Acc::default(); hw];
        for (pp, plane) in chunk.chunks_mut(hw).enumerate() {
            let (n, ci) = ((p0 + pp) / d.c_in, (p0 + pp) % d.c_in);
            let (g, c) = (ci / d.cg, ci % d.cg);
            acc.fill(A::Acc::default());
            for i in 0..d.kh {
                for j in 0..d.kw {
                    let k = (c * d.kh + i) * d.kw + j;
                    let row = &cols[((n * d.g + g) * d.k + k) * l..][..l];
                    let off = (j * dw) as isize - pw as isize;
                    let (lo, hi) = valid_cols(off, sw, d.w, d.ow);
                    for oh in 0..d.oh {
                        let ih = (oh * sh + i * dh) as isize - ph as isize;
                        if ih < 0 || ih >= d.h as isize {
                            continue;
                        }
                        let dst = &mut acc[ih as usize * d.w..][..d.w];
                        let src = &row[oh * d.ow..][..d.ow];
                        let first = (lo as isize * sw as isize + off) as usize;
                        for (t, v) in src[lo..hi].iter().enumerate() {
                            dst[first + t * sw] += v.to_acc();
                        }
                    }
                }
            }
            for (o, a) in plane.iter_mut().zip(&acc) {
                *o = E::from_f64(a.f64());
            }
        }
    });
    out
}

/// The convolution of `x` (contiguous NCHW) with `w` (contiguous `[C_out, C_g, kH, kW]`)
/// plus `bias`, in one batched GEMM. Contiguous `[N, C_out, oH, oW]`.
pub(crate) fn forward<E: Precision>(x: &[E], w: &[E], bias: Option<&[E]>, s: &Conv2dSpec) -> Vec<E> {
    let d = Dims::of(s);
    let l = d.l();
    let cols = im2col(x, s, bias.is_some());
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
    let lw = Layout { shape: vec![d.n, d.g, d.og, rows], strides: vec![0, d.og * rows, rows, 1], offset: 0 };
    let lc = Layout { shape: vec![d.n, d.g, rows, l], strides: vec![l, rows * d.n * l, d.n * l, 1], offset: 0 };
    matmul(w, &lw, &cols, &lc, &[d.n, d.g])
}

/// The input gradient from `g` (contiguous `[N, C_out, oH, oW]`) and `w` (contiguous):
/// `wᵀ · g` per sample and group in the accumulation type, then col2im.
pub(crate) fn backward_input<E: Precision>(g: &[E], w: &[E], s: &Conv2dSpec) -> Vec<E> {
    match E::DTYPE {
        DType::F64 => backward_input_in::<E, f64>(g, w, s),
        _ => backward_input_in::<E, f32>(g, w, s),
    }
}

fn backward_input_in<E: Precision, A: Precision>(g: &[E], w: &[E], s: &Conv2dSpec) -> Vec<E> {
    let d = Dims::of(s);
    let l = d.l();
    let lw = Layout { shape: vec![d.n, d.g, d.k, d.og], strides: vec![0, d.og * d.k, 1, d.k], offset: 0 };
    let lg = Layout { shape: vec![d.n, d.g, d.og, l], strides: vec![d.c_out * l, d.og * l, l, 1], offset: 0 };
    let dcols = PooledVec::from(matmul_acc::<E, A>(w, &lw, g, &lg, &[d.n, d.g]));
    col2im::<E, A>(&dcols, s)
}

/// The weight gradient (`[C_out, C_g, kH, kW]`) when the input `x` (contiguous NCHW) is
/// given and the bias gradient (`[C_out]`) when `need_b`, from `g` (contiguous
/// `[N, C_out, oH, oW]`).
pub(crate) fn backward_weight<E: Precision>(
    x: Option<&[E]>,
    g: &[E],
    s: &Conv2dSpec,
    need_b: bool,
) -> (Option<Vec<E>>, Option<Vec<E>>) {
    let d = Dims::of(s);
    let nl = d.n * d.l();
    // dY as [C_out, N·L]: each output channel's gradients in one row.
    let by_channel = Layout { shape: vec![d.c_out, d.n, d.l()], strides: vec![d.l(), d.c_out * d.l(), 1], offset: 0 };
    let gc = PooledVec::from(super::gather(g, &by_channel));
    let gw = x.map(|x| {
        let cols = im2col(x, s, false);
        let lg = Layout { shape: vec![d.g, d.og, nl], strides: vec![d.og * nl, nl, 1], offset: 0 };
        let lc = Layout { shape: vec![d.g, nl, d.k], strides: vec![d.k * nl, 1, nl], offset: 0 };
        matmul(&gc, &lg, &cols, &lc, &[d.g])
    });
    let gb = need_b.then(|| reduce_dim(&gc, (d.c_out, nl, 1), Reduce::Sum, 1.0));
    (gw, gb)
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
