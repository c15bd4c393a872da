//! Batched matmul on the `gemm` crate in f32 and f64. f16 and bf16 run the native kernels of
//! [`super::gemm_half`] (f32 accumulation, one rounding per output) where the CPU has them
//! (AVX-512; bf16 also needs AVX-512 BF16); elsewhere they widen their inputs to f32 (exact),
//! multiply on gemm's f32 kernel and round each output once.
//!
//! Why not gemm's own f16 kernel: it rounds the output to f16 after every k-block of `kc`
//! (reading it back for the next block), and its matrix-vector paths accumulate in f16 at
//! every step of k (a sum of 4096 ones sticks at 2048).
//!
//! Operands may be strided views (a transpose is just swapped strides): gemm takes row and
//! column strides, so backward's `a^T` and `b^T` cost no copy. Batch dims broadcast with
//! stride 0.

use rayon::prelude::*;

use super::alloc::PooledVec;
use super::gather;
use super::gemm_half::{self, Operand};
use crate::layout::Layout;
use crate::precision::{DType, Precision, as_same, as_same_mut};

/// Per-batch work below which batches run in parallel rather than each GEMM.
const SMALL_GEMM_FLOPS: usize = 1 << 24;

/// `a @ b` for `a: [..., m, k]`, `b: [..., k, n]` with broadcast batch dims already
/// resolved into `batch` (the output's batch shape). Returns contiguous `[batch..., m, n]`.
pub(crate) fn matmul<E: Precision>(a: &[E], la: &Layout, b: &[E], lb: &Layout, batch: &[usize]) -> Vec<E> {
    matmul_with(a, la, b, lb, batch, true)
}

/// [`matmul`], with `native = false` forcing the widen-to-f32 path for f16 and bf16 (tests
/// compare the two).
pub(crate) fn matmul_with<E: Precision>(
    a: &[E],
    la: &Layout,
    b: &[E],
    lb: &Layout,
    batch: &[usize],
    native: bool,
) -> Vec<E> {
    let (ra, rb) = (la.shape.len(), lb.shape.len());
    let (m, n) = (la.shape[ra - 2], lb.shape[rb - 1]);
    // Every output is written (the k == 0 case writes zeros).
    let mut out = super::alloc::take::<E>(batch.iter().product::<usize>() * m * n);
    matmul_into_with(a, la, b, lb, batch, &mut out, true, native);
    out
}

/// [`matmul`] into `out` (contiguous `[batch..., m, n]`, every element written), on this
/// thread alone unless `parallel` (for a caller that runs products in parallel itself).
pub(crate) fn matmul_into<E: Precision>(
    a: &[E],
    la: &Layout,
    b: &[E],
    lb: &Layout,
    batch: &[usize],
    out: &mut [E],
    parallel: bool,
) {
    matmul_into_with(a, la, b, lb, batch, out, parallel, true)
}

#[allow(clippy::too_many_arguments)] // matmul_into's operands, plus the test switch
fn matmul_into_with<E: Precision>(
    a: &[E],
    la: &Layout,
    b: &[E],
    lb: &Layout,
    batch: &[usize],
    out: &mut [E],
    parallel: bool,
    native: bool,
) {
    let native = native && gemm_half::available::<E>();
    if matches!(E::DTYPE, DType::BF16 | DType::F16) && !native {
        let (a32, la32) = to_f32(a, la);
        let (b32, lb32) = to_f32(b, lb);
        let mut out32 = PooledVec::from(super::alloc::take::<f32>(out.len()));
        matmul_into(&a32, &la32, &b32, &lb32, batch, &mut out32, parallel);
        return super::convert_par_into(&out32, out);
    }
    let (ra, rb) = (la.shape.len(), lb.shape.len());
    let (m, k, n) = (la.shape[ra - 2], la.shape[ra - 1], lb.shape[rb - 1]);
    assert_eq!(out.len(), batch.iter().product::<usize>() * m * n, "matmul_into: output size");
    let (a_rs, a_cs) = (la.strides[ra - 2] as isize, la.strides[ra - 1] as isize);
    let (b_rs, b_cs) = (lb.strides[rb - 2] as isize, lb.strides[rb - 1] as isize);
    for_each_batch(la, lb, batch, out, parallel, |oa, ob, dst, par| {
        if native {
            let opa = Operand { data: a, offset: oa, rs: a_rs as usize, cs: a_cs as usize };
            let opb = Operand { data: b, offset: ob, rs: b_rs as usize, cs: b_cs as usize };
            let parallel = !matches!(par, gemm::Parallelism::None);
            assert!(gemm_half::gemm((m, k, n), opa, opb, None, dst, parallel));
            return;
        }
        if k == 0 {
            dst.fill(E::default()); // an empty sum
            return;
        }
        // Bounds: the last element each operand touches must be in its slice.
        assert!(oa + (m - 1) * a_rs as usize + (k - 1) * (a_cs as usize) < a.len());
        assert!(ob + (k - 1) * b_rs as usize + (n - 1) * (b_cs as usize) < b.len());
        // SAFETY: E is f32 or f64 (f16 and bf16 returned above or took the native path), which gemm dispatches on by
        // TypeId; the asserts above keep every read inside `a` and `b`, `dst` holds exactly
        // m * n elements written with row stride n, and read_dst = false so its contents are
        // not read.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr().add(oa),
                a_cs,
                a_rs,
                b.as_ptr().add(ob),
                b_cs,
                b_rs,
                E::default(),
                E::from_f64(1.0),
                false,
                false,
                false,
                par,
            )
        }
    });
}

/// [`matmul`] written into the view `dst` of `out` (shape `[batch..., m, n]`, every element of
/// it written, nothing else): autograd's products writing an operand's gradient straight into
/// a narrowed tensor's gradient buffer (W2's `q`, `k` and `v`: rows `3 d` apart). Each product
/// goes into a pooled scratch block (for W2's small products, 16 KiB, still in cache), and its
/// rows are copied into the view at once: the same stores the product's own output would take. A view whose rows are not
/// runs, or that could reach one element twice, takes the product and a strided copy instead.
pub(crate) fn matmul_into_view<E: Precision>(
    a: &[E],
    la: &Layout,
    b: &[E],
    lb: &Layout,
    batch: &[usize],
    out: &mut [E],
    dst: &Layout,
) {
    let r = dst.shape.len();
    let (m, n) = (dst.shape[r - 2], dst.shape[r - 1]);
    let (ra, rb) = (la.shape.len(), lb.shape.len());
    let k = la.shape[ra - 1];
    assert!(
        dst.shape[..r - 2] == *batch && la.shape[ra - 2] == m && lb.shape[rb - 1] == n && lb.shape[rb - 2] == k,
        "matmul_into_view: shapes"
    );
    let reach = one_to_one_reach(dst);
    let fits = reach.is_some_and(|reach| dst.numel() == 0 || dst.offset + reach < out.len());
    if !fits || (n > 1 && dst.strides[r - 1] != 1) {
        let c = matmul(a, la, b, lb, batch);
        return super::write_into(out, dst, &c, false);
    }
    if m * n == 0 {
        return;
    }
    let ld = dst.strides[r - 2];
    let nb: usize = batch.iter().product();
    let offsets = batch_offsets(la, lb, batch);
    // Where batch `i`'s matrix starts in `out`.
    let base = |i: usize| batch_offset(batch, &dst.strides, dst.offset, i);
    let out = SharedOut(out.as_mut_ptr());
    let one = |i: usize, parallel: bool| {
        let (oa, ob) = offsets(i);
        let la1 = Layout { shape: vec![m, k], strides: la.strides[ra - 2..].to_vec(), offset: oa };
        let lb1 = Layout { shape: vec![k, n], strides: lb.strides[rb - 2..].to_vec(), offset: ob };
        let mut c = PooledVec::from(super::alloc::take::<E>(m * n)); // every element written
        matmul_into(a, &la1, b, &lb1, &[], &mut c, parallel);
        let at = base(i);
        for (row, src) in c.chunks(n).enumerate() {
            // SAFETY: `dst` reaches no element twice and its last one is inside `out` (both
            // checked above), so this row's `n` elements (unit stride) are inside `out` and no
            // other row of any batch, on any thread, writes them; `out` is borrowed
            // exclusively for this whole call, and nothing reads it meanwhile.
            unsafe { out.at(at + row * ld).copy_from_nonoverlapping(src.as_ptr(), n) };
        }
    };
    if nb > 1 && 2 * m * n * k < SMALL_GEMM_FLOPS {
        (0..nb).into_par_iter().for_each(|i| one(i, false));
    } else {
        (0..nb).for_each(|i| one(i, true));
    }
}

/// `out`'s pointer, shared by the tasks of [`matmul_into_view`], which write disjoint elements.
struct SharedOut<E>(*mut E);

impl<E> SharedOut<E> {
    /// Where element `i` is (not checked: the caller keeps `i` inside the buffer).
    fn at(&self, i: usize) -> *mut E {
        self.0.wrapping_add(i)
    }
}
// SAFETY: the tasks write disjoint elements of a buffer the caller borrows exclusively for the
// duration (see `matmul_into_view`), and `E` (a float) is `Send`.
unsafe impl<E: Send> Sync for SharedOut<E> {}

/// The largest offset a view reaches past its first element, if it reaches no element twice:
/// with its dims sorted by stride, each stride beyond everything the smaller ones reach (a
/// sufficient test, which every dense view and every narrow or permutation of one passes).
fn one_to_one_reach(l: &Layout) -> Option<usize> {
    let mut dims: Vec<(usize, usize)> =
        l.shape.iter().zip(&l.strides).filter(|&(&d, _)| d > 1).map(|(&d, &s)| (s, d)).collect();
    dims.sort_unstable();
    let mut reach = 0;
    for (stride, size) in dims {
        if stride <= reach {
            return None;
        }
        reach += stride * (size - 1);
    }
    Some(reach)
}

/// The offsets of batch `i`'s matrices in `a` and `b` of a batched `a @ b` whose output's
/// batch shape is `batch` (broadcast dims at stride 0).
fn batch_offsets(la: &Layout, lb: &Layout, batch: &[usize]) -> impl Fn(usize) -> (usize, usize) + Sync + use<> {
    let (ra, rb) = (la.shape.len(), lb.shape.len());
    let mut bshape = batch.to_vec();
    bshape.extend(&la.shape[ra - 2..]);
    let la_b = la.broadcast_to(&bshape);
    bshape.truncate(batch.len());
    bshape.extend(&lb.shape[rb - 2..]);
    let lb_b = lb.broadcast_to(&bshape);
    let batch = batch.to_vec();
    move |i: usize| {
        (batch_offset(&batch, &la_b.strides, la_b.offset, i), batch_offset(&batch, &lb_b.strides, lb_b.offset, i))
    }
}

/// Where matrix `i` (row-major over the batch dims of shape `batch`) of a view with these
/// strides (the batch dims' first) and offset starts.
fn batch_offset(batch: &[usize], strides: &[usize], offset: usize, i: usize) -> usize {
    let (mut at, mut rest) = (offset, i);
    for d in (0..batch.len()).rev() {
        at += (rest % batch[d]) * strides[d];
        rest /= batch[d];
    }
    at
}

/// Runs `one(a_offset, b_offset, dst, parallelism)` for every product of a batched `a @ b`
/// (`dst` its `[m, n]` block of `out`, the offsets those of its operands with broadcast batch
/// dims at stride 0): batches in parallel when each product is small, one after another with
/// each product parallel inside otherwise; all on this thread unless `parallel`.
fn for_each_batch<O: Send>(
    la: &Layout,
    lb: &Layout,
    batch: &[usize],
    out: &mut [O],
    parallel: bool,
    one: impl Fn(usize, usize, &mut [O], gemm::Parallelism) + Sync + Send,
) {
    let (ra, rb) = (la.shape.len(), lb.shape.len());
    let (m, k, n) = (la.shape[ra - 2], la.shape[ra - 1], lb.shape[rb - 1]);
    if m * n == 0 {
        return;
    }
    let offsets = batch_offsets(la, lb, batch);
    let nb: usize = batch.iter().product();
    let flops = 2 * m * n * k;
    if !parallel {
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            let (oa, ob) = offsets(i);
            one(oa, ob, dst, gemm::Parallelism::None);
        }
    } else if nb > 1 && flops < SMALL_GEMM_FLOPS {
        out.par_chunks_mut(m * n).enumerate().for_each(|(i, dst)| {
            let (oa, ob) = offsets(i);
            one(oa, ob, dst, gemm::Parallelism::None)
        });
    } else {
        let threads = rayon::current_num_threads();
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            let (oa, ob) = offsets(i);
            one(oa, ob, dst, gemm::Parallelism::Rayon(threads));
        }
    }
}

/// [`matmul_into`] with each product left in the accumulation type `A` (f32 for f16, bf16
/// and f32; f64 for f64) instead of rounded into `E`, for a kernel that sums the products
/// further and rounds once itself (the convolution's col2im and weight gradient).
pub(crate) fn matmul_acc_into<E: Precision, A: Precision>(
    a: &[E],
    la: &Layout,
    b: &[E],
    lb: &Layout,
    batch: &[usize],
    out: &mut [A],
    parallel: bool,
) {
    let acc = if E::DTYPE == DType::F64 { DType::F64 } else { DType::F32 };
    assert_eq!(A::DTYPE, acc, "matmul_acc_into: {} accumulates in {acc}", E::DTYPE);
    if let (Some(a), Some(b)) = (as_same::<E, A>(a), as_same::<E, A>(b)) {
        return matmul_into(a, la, b, lb, batch, out, parallel); // f32 or f64: the product is in A already
    }
    let out = as_same_mut::<A, f32>(out).expect("f16 and bf16 accumulate in f32");
    if !gemm_half::available::<E>() {
        let (a32, la32) = to_f32(a, la);
        let (b32, lb32) = to_f32(b, lb);
        return matmul_into(&a32, &la32, &b32, &lb32, batch, out, parallel);
    }
    let (ra, rb) = (la.shape.len(), lb.shape.len());
    let (m, k, n) = (la.shape[ra - 2], la.shape[ra - 1], lb.shape[rb - 1]);
    assert_eq!(out.len(), batch.iter().product::<usize>() * m * n, "matmul_acc_into: output size");
    let (a_rs, a_cs) = (la.strides[ra - 2], la.strides[ra - 1]);
    let (b_rs, b_cs) = (lb.strides[rb - 2], lb.strides[rb - 1]);
    // The native kernel writes every output, the k == 0 case included (zero accumulators).
    for_each_batch(la, lb, batch, out, parallel, |oa, ob, dst, par| {
        let opa = Operand { data: a, offset: oa, rs: a_rs, cs: a_cs };
        let opb = Operand { data: b, offset: ob, rs: b_rs, cs: b_cs };
        let parallel = !matches!(par, gemm::Parallelism::None);
        assert!(gemm_half::gemm_into((m, k, n), opa, opb, None, dst, parallel));
    });
}

/// Widens an operand to f32. A view that covers a dense block of storage in some order (a
/// contiguous tensor, or a transpose or permutation of one) is converted as one linear pass
/// and keeps its strides, so `wᵀ` and `aᵀ` in backward are never transposed element by
/// element; other views (narrowed, broadcast) are gathered first.
/// The copy is a pooled buffer, so a temporary widening returns to the cache when dropped.
fn to_f32<E: Precision>(x: &[E], l: &Layout) -> (PooledVec<f32>, Layout) {
    let numel = l.numel();
    let span = 1 + l.shape.iter().zip(&l.strides).map(|(&d, &s)| d.saturating_sub(1) * s).sum::<usize>();
    let gathered;
    let (src, layout): (&[E], Layout) = if numel > 0 && span == numel {
        (&x[l.offset..l.offset + span], Layout { offset: 0, ..l.clone() })
    } else {
        gathered = PooledVec::from(gather(x, l));
        (&gathered, Layout::contiguous(&l.shape))
    };
    (PooledVec::from(super::convert_par(src)), layout)
}

/// `x wᵀ + bias` for `x: [rows, in]`, `w: [out, in]` (any strides), `bias: [out]`, rounded
/// once: the bias initialises the accumulator, as in PyTorch's `addmm`.
pub(crate) fn linear<E: Precision>(x: &[E], lx: &Layout, w: &[E], lw: &Layout, bias: Option<&[E]>) -> Vec<E> {
    linear_with(x, lx, w, lw, bias, true)
}

/// [`linear`], with `native = false` forcing the widen-to-f32 path for f16 and bf16.
pub(crate) fn linear_with<E: Precision>(
    x: &[E],
    lx: &Layout,
    w: &[E],
    lw: &Layout,
    bias: Option<&[E]>,
    native: bool,
) -> Vec<E> {
    let (rows, out_f) = (lx.shape[0], lw.shape[0]);
    let wt = Layout { shape: vec![lw.shape[1], out_f], strides: vec![lw.strides[1], lw.strides[0]], offset: lw.offset };
    let Some(bias) = bias else { return matmul_with(x, lx, w, &wt, &[], native) };
    if native && gemm_half::available::<E>() {
        let mut b32 = vec![0f32; bias.len()];
        E::to_f32_slice(bias, &mut b32);
        // The kernel writes every output (bias plus the product).
        let mut out = super::alloc::take::<E>(rows * out_f);
        let opx = Operand { data: x, offset: lx.offset, rs: lx.strides[0], cs: lx.strides[1] };
        let opw = Operand { data: w, offset: wt.offset, rs: wt.strides[0], cs: wt.strides[1] };
        assert!(gemm_half::gemm((rows, lx.shape[1], out_f), opx, opw, Some(&b32), &mut out, true));
        return out;
    }
    if matches!(E::DTYPE, DType::BF16 | DType::F16) {
        let (x32, lx32) = to_f32(x, lx);
        let (w32, lw32) = to_f32(w, lw);
        let mut b32 = vec![0f32; bias.len()];
        E::to_f32_slice(bias, &mut b32);
        return super::convert_par(&PooledVec::from(linear(&x32, &lx32, &w32, &lw32, Some(&b32))));
    }
    let mut out = super::alloc::take::<E>(rows * out_f);
    for row in out.chunks_exact_mut(out_f.max(1)) {
        row.copy_from_slice(bias);
    }
    let (in_f, threads) = (lx.shape[1], rayon::current_num_threads());
    if rows * out_f == 0 || in_f == 0 {
        return out;
    }
    let (x_rs, x_cs) = (lx.strides[0] as isize, lx.strides[1] as isize);
    let (w_rs, w_cs) = (wt.strides[0] as isize, wt.strides[1] as isize);
    assert!(lx.offset + (rows - 1) * (x_rs as usize) + (in_f - 1) * (x_cs as usize) < x.len());
    assert!(wt.offset + (in_f - 1) * (w_rs as usize) + (out_f - 1) * (w_cs as usize) < w.len());
    // SAFETY: E is f32 or f64 here (f16/bf16 widened above), which gemm dispatches on; the
    // asserts keep every read inside `x` and `w`; `out` holds rows * out_f elements written
    // with row stride out_f, and read_dst = true reads the bias rows it was filled with.
    unsafe {
        gemm::gemm(
            rows,
            out_f,
            in_f,
            out.as_mut_ptr(),
            1,
            out_f as isize,
            true,
            x.as_ptr().add(lx.offset),
            x_cs,
            x_rs,
            w.as_ptr().add(wt.offset),
            w_cs,
            w_rs,
            E::from_f64(1.0),
            E::from_f64(1.0),
            false,
            false,
            false,
            gemm::Parallelism::Rayon(threads),
        )
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::{Rng, Tensor, bf16, f16};

    /// Transposed (dense, strided) and narrowed (gathered) operands give the f64 product.
    fn strided_operands<E: crate::Precision>(tol: f64) {
        let mut rng = Rng::seed(3);
        let a = Tensor::<f64>::randn(&[5, 4], &mut rng);
        let b = Tensor::<f64>::randn(&[6, 5], &mut rng);
        let want = a.t().matmul(&b.t().narrow(1, 1, 4)).to_vec();
        let got = a.cast::<E>().t().matmul(&b.cast::<E>().t().narrow(1, 1, 4)).to_f64_vec();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{}: {g} vs {w}", E::DTYPE);
        }
    }

    /// `matmul_into_view` writes the view's elements, with `matmul`'s bits, and nothing else:
    /// rows interleaved with other products' (the layout of W2's `qkv` gradient, with gaps
    /// between the views), a broadcast operand, a transposed view (no unit column stride: the
    /// product and a strided copy), and a product big enough to run alone, each batch
    /// parallel inside.
    fn into_view<E: crate::Precision>() {
        use crate::layout::Layout;
        let mut rng = Rng::seed(4);
        let mut check =
            |(batch, m, k, n): (&[usize], usize, usize, usize), broadcast_b: bool, dst: Layout, len: usize| {
                let a_shape = [batch, &[m, k]].concat();
                let b_shape = if broadcast_b { vec![k, n] } else { [batch, &[k, n]].concat() };
                let a = Tensor::<f32>::randn(&a_shape, &mut rng).cast::<E>().to_vec();
                let b = Tensor::<f32>::randn(&b_shape, &mut rng).cast::<E>().to_vec();
                let (la, lb) = (Layout::contiguous(&a_shape), Layout::contiguous(&b_shape));
                let want = super::matmul(&a, &la, &b, &lb, batch);
                let sentinel = E::from_f64(7.0);
                let mut out = vec![sentinel; len];
                super::matmul_into_view(&a, &la, &b, &lb, batch, &mut out, &dst);
                let mut expected = vec![sentinel; len];
                crate::cpu::write_into(&mut expected, &dst, &want, false);
                let bits = |v: &[E]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&expected), "{} {:?} into {dst:?}", E::DTYPE, (batch, m, k, n));
            };
        // [2, 3, 5, 4] products as [B, H, T, hd] windows of a [2, 5, 2, 3, 4] buffer ([B, T,
        // part, H, hd]), at part 1: rows 24 apart, the other part's rows untouched.
        let qkv = Layout { shape: vec![2, 3, 5, 4], strides: vec![120, 4, 24, 1], offset: 12 };
        check((&[2, 3], 5, 6, 4), false, qkv.clone(), 240);
        check((&[2, 3], 5, 6, 4), true, qkv, 240);
        // The transpose of a contiguous [2, 3, 4, 5].
        let transposed = Layout { shape: vec![2, 3, 5, 4], strides: vec![60, 20, 1, 5], offset: 0 };
        check((&[2, 3], 5, 6, 4), false, transposed, 120);
        // 2·160³ flops: past SMALL_GEMM_FLOPS, so one product at a time; rows 2·160 apart.
        let wide = Layout { shape: vec![2, 160, 160], strides: vec![160, 320, 1], offset: 0 };
        check((&[2], 160, 160, 160), false, wide, 2 * 160 * 160);
    }

    #[test]
    fn into_view_in_every_precision() {
        into_view::<f32>();
        into_view::<f64>();
        into_view::<f16>();
        into_view::<bf16>();
    }

    #[test]
    fn strided_operands_in_every_precision() {
        strided_operands::<f32>(1e-6);
        strided_operands::<f16>(4e-3);
        strided_operands::<bf16>(3e-2);
    }
}
