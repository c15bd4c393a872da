//! Native half-precision GEMM: f16 or bf16 inputs, f32 accumulation, one rounding of each
//! output at the end.
//!
//! - **bf16** runs `vdpbf16ps` (AVX-512 BF16): it multiplies pairs of bf16 exactly (8-bit
//!   significands, so each product fits f32) and adds them into f32 lanes, at twice the f32
//!   FMA rate on Zen 4 (at the f32 FMA rate on a Xeon). Where the CPU has AMX-BF16 and the OS
//!   grants tile data, the same pairs run on AMX tiles instead ([`super::amx`];
//!   [`multiply_amx`]), at 3-8× the `vdpbf16ps` kernel's rate on a Xeon
//!   (`docs/performance.md`, Intel Xeon with AMX).
//! - **f16**: packing widens each f16 to f32 (exact) and the kernel runs f32 FMAs. Widening
//!   inside the pack, rather than into full f32 copies of both operands handed to an f32
//!   GEMM, saves two passes over memory and the f32 output buffer. (AVX-512 FP16 arithmetic
//!   rounds each sum to f16, so it is no use for an f32 accumulation.) Where the AMX kernel
//!   runs, f16 products of at least 128 rows and columns are split exactly into bf16 high
//!   and low parts and run on the tiles instead ([`super::amx_f16`]), 1.2-2× faster.
//!
//! Layout (BLIS-style): A is packed into panels of [`MR`] rows, B into panels of [`NR`]
//! columns, k taken in *steps* of 4-byte packed values: a pair of bf16 (the two share one
//! 32-bit lane, as `vdpbf16ps` wants; an odd k is padded with a zero) or one widened f16.
//! Packing reads any strides, so transposed views cost nothing extra; its loops run step by
//! step across the panel's rows, which reads every operand layout in cache-friendly order,
//! a panel whose rows are adjacent in memory (row stride 1) is packed from contiguous
//! runs, and a panel whose rows each hold their k values contiguously (B of `x Wᵀ`, A of a
//! row-major activation) is packed 8 rows × 8 steps at a time, transposed in registers.
//! bf16 skips packing A when its rows are contiguous and k is even: a pair is then two
//! adjacent elements, which the kernel broadcasts straight from the row. The microkernel
//! keeps an MR×NR tile of f32 accumulators in zmm registers; k is blocked by [`KC`] steps so
//! a B micro-panel stays in L1, columns by [`NC`] so the f32 tile buffer of a row block stays
//! in L2. Row blocks run in parallel on rayon.
//!
//! Numerics differ from a scalar f32 loop only in summation order (pairs, then k blocks);
//! `vdpbf16ps` also treats denormal inputs as zero and flushes denormal partial sums
//! (magnitudes below 1.2e-38), which a bf16 model never relies on.

use std::cell::RefCell;
use std::thread::LocalKey;

use rayon::prelude::*;

use super::amx::Start;
use crate::precision::{DType, Precision};
use crate::{bf16, f16};

/// Rows of the register tile.
const MR: usize = 8;
/// Columns of the register tile (two zmm of 16 f32 lanes), and of a packed B panel.
pub(super) const NR: usize = 32;
/// k steps per cache block: a B micro-panel is KC·NR·4 bytes = 16 KiB, half of L1.
const KC: usize = 128;
/// Columns per block of the f32 accumulator buffer.
const NC: usize = 512;
/// Most rows per parallel task. Small enough that the tasks split evenly between threads:
/// W2's 2048- and 1024-row products make 32 and 16 tasks (with 96, 22 and 11, one of them
/// short, so one thread idled at the end: 64 ran those products 3-5% faster on Zen 4).
const MC: usize = 64;
/// Below this many flops the product runs on the calling thread.
const PAR_FLOPS: usize = 1 << 22;

/// One 2-D operand: `data[offset + i * rs + j * cs]` is element (i, j).
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a, E> {
    /// Storage the view reads.
    pub data: &'a [E],
    /// Index of element (0, 0).
    pub offset: usize,
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

/// Whether this CPU runs the native kernel for `E` (f16 or bf16).
pub(crate) fn available<E: Precision>() -> bool {
    match E::DTYPE {
        DType::BF16 => Bf16Pairs::available(),
        DType::F16 => F16Widened::available(),
        _ => false,
    }
}

/// `out = round(a @ b + bias)` for `a: [m, k]`, `b: [k, n]`, `bias: [n]` (added into the f32
/// accumulator), `out` contiguous `[m, n]`. Returns false, leaving `out` untouched, when `E`
/// is not f16 or bf16 or the CPU lacks the kernel's features; the caller then takes its own
/// path.
pub(crate) fn gemm<E: Precision>(
    dims: (usize, usize, usize),
    a: Operand<'_, E>,
    b: Operand<'_, E>,
    bias: Option<&[f32]>,
    out: &mut [E],
    parallel: bool,
) -> bool {
    gemm_into(dims, a, b, bias, out, parallel)
}

/// [`gemm`] with the output rounded once into `O` instead of `E`: with `O = f32`, the f32
/// accumulators as they are, for a caller that sums them further before its one rounding
/// (the convolution's col2im).
pub(crate) fn gemm_into<E: Precision, O: Precision>(
    dims: (usize, usize, usize),
    a: Operand<'_, E>,
    b: Operand<'_, E>,
    bias: Option<&[f32]>,
    out: &mut [O],
    parallel: bool,
) -> bool {
    match E::DTYPE {
        DType::BF16 if use_amx() => {
            run_amx::<O>(dims, retype(a), retype(b), bias, out, parallel);
            true
        }
        DType::BF16 if Bf16Pairs::available() => {
            run::<O, Bf16Pairs>(dims, retype(a), retype(b), bias, out, parallel);
            true
        }
        DType::F16 if use_amx() && super::amx_f16::worth_it(dims) && F16Widened::available() => {
            let (a, b) = (retype(a), retype(b));
            if !run_amx_f16::<O>(dims, a, b, bias, out, parallel) {
                run::<O, F16Widened>(dims, a, b, bias, out, parallel);
            }
            true
        }
        DType::F16 if F16Widened::available() => {
            run::<O, F16Widened>(dims, retype(a), retype(b), bias, out, parallel);
            true
        }
        _ => false,
    }
}

/// The same operand seen as `T`, which the caller has checked is `E` itself (by `DTYPE`).
fn retype<E: Precision, T: Precision>(x: Operand<'_, E>) -> Operand<'_, T> {
    assert!(E::DTYPE == T::DTYPE && std::mem::size_of::<E>() == std::mem::size_of::<T>());
    // SAFETY: `Precision` is sealed and each DTYPE belongs to exactly one type, so `E` and `T`
    // are the same type: same size, alignment and valid bit patterns.
    let data = unsafe { std::slice::from_raw_parts(x.data.as_ptr().cast::<T>(), x.data.len()) };
    Operand { data, offset: x.offset, rs: x.rs, cs: x.cs }
}

/// One way to pack and multiply: what a packed step holds, and the microkernel over it.
trait Kernel {
    /// The input element type.
    type In: Precision;
    /// One packed 4-byte step of one row.
    type Packed: Copy + Send + Sync + 'static;
    /// The packed value of a zero step.
    const ZERO: Self::Packed;
    /// k values per step.
    const K_STEP: usize;
    /// Whether this CPU runs the microkernel.
    fn available() -> bool;
    /// Step `s` of a row whose k values are `x[first + j * cs]` for `j < k`.
    fn pack_one(x: &[Self::In], first: usize, cs: usize, s: usize, k: usize) -> Self::Packed;
    /// One step of a panel's rows held in contiguous runs: `lo` holds the step's first k of
    /// each row, `hi` the second (pairs only; `None` past an odd k).
    fn pack_run(lo: &[Self::In], hi: Option<&[Self::In]>, dst: &mut [Self::Packed]);
    /// Every step of one contiguous row (all its k values) into `dst[s * w]`.
    fn pack_row(row: &[Self::In], dst: &mut [Self::Packed], w: usize);
    /// A whole panel of `w` rows whose k values are contiguous (row r at
    /// `x[first + r·rs..][..k]`) into `panel[s·w + r]`, where this kernel has a faster way
    /// than [`Kernel::pack_row`] row by row; returns whether it packed.
    fn pack_rows(x: &[Self::In], first: usize, rs: usize, k: usize, w: usize, panel: &mut [Self::Packed]) -> bool;
    /// This kernel's per-thread pack buffers for A and B, kept between products so the hot
    /// path neither allocates nor zero-fills them.
    fn pack_buffers() -> &'static LocalKey<RefCell<[Vec<Self::Packed>; 2]>>;
    /// `tile[r * ldc + j] = start(r, j) + Σ_s a[s·MR + r] · b[s·NR + j]` over `kc` steps,
    /// where `start` is the tile as it is, zero, or a bias row ([`Start`]).
    fn micro(kc: usize, a: &[Self::Packed], b: &[Self::Packed], tile: &mut [f32], ldc: usize, start: Start);
    /// Whether [`Kernel::micro_rows`] exists: a step of a row can be read in place when the
    /// row's k values are contiguous (a bf16 pair is two adjacent elements; an f16 must be
    /// widened, so f16 always packs A).
    const READS_A_ROWS: bool;
    /// [`Kernel::micro`] reading A in place: step s of row r is at `a[first + r * rs + s * K_STEP]`.
    /// Only called when [`Kernel::READS_A_ROWS`] is true.
    #[allow(clippy::too_many_arguments)] // `micro`'s arguments plus A's first element and row stride
    fn micro_rows(
        kc: usize,
        a: &[Self::In],
        first: usize,
        rs: usize,
        b: &[Self::Packed],
        tile: &mut [f32],
        ldc: usize,
        start: Start,
    );
}

/// bf16 pairs for `vdpbf16ps`: element (r, 2s) in the low half of the lane, (r, 2s + 1) in
/// the high half.
struct Bf16Pairs;

impl Kernel for Bf16Pairs {
    type In = bf16;
    type Packed = u32;
    const ZERO: u32 = 0;
    const K_STEP: usize = 2;
    fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    #[inline(always)]
    fn pack_one(x: &[bf16], first: usize, cs: usize, s: usize, k: usize) -> u32 {
        let lo = x[first + 2 * s * cs].to_bits() as u32;
        let hi = if 2 * s + 1 < k { x[first + (2 * s + 1) * cs].to_bits() as u32 } else { 0 };
        lo | hi << 16
    }
    #[inline(always)]
    fn pack_run(lo: &[bf16], hi: Option<&[bf16]>, dst: &mut [u32]) {
        match hi {
            Some(hi) => interleave_pairs(lo, hi, dst),
            None => {
                for (d, l) in dst.iter_mut().zip(lo) {
                    *d = l.to_bits() as u32;
                }
            }
        }
    }
    fn pack_buffers() -> &'static LocalKey<RefCell<[Vec<u32>; 2]>> {
        thread_local!(static BUFFERS: RefCell<[Vec<u32>; 2]> = const { RefCell::new([Vec::new(), Vec::new()]) });
        &BUFFERS
    }
    #[inline(always)]
    fn pack_row(row: &[bf16], dst: &mut [u32], w: usize) {
        let pairs = row.chunks_exact(2);
        let odd = pairs.remainder().first().map(|x| x.to_bits() as u32);
        let mut slots = dst.iter_mut().step_by(w);
        // Data first in each zip: a zip that ends on the data side takes no slot.
        for (pair, d) in pairs.zip(slots.by_ref()) {
            *d = pair[0].to_bits() as u32 | (pair[1].to_bits() as u32) << 16;
        }
        if let (Some(d), Some(odd)) = (slots.next(), odd) {
            *d = odd;
        }
    }
    fn pack_rows(x: &[bf16], first: usize, rs: usize, k: usize, w: usize, panel: &mut [u32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if w.is_multiple_of(8) && k > 0 && is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked); the function asserts its bounds.
            unsafe { pack_rows_bf16_avx2(x, first, rs, k, w, panel) };
            return true;
        }
        let _ = (x, first, rs, k, w, panel);
        false
    }
    fn micro(kc: usize, a: &[u32], b: &[u32], tile: &mut [f32], ldc: usize, start: Start) {
        assert!(a.len() >= kc * MR && b.len() >= kc * NR && tile.len() >= (MR - 1) * ldc + NR);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm` only runs this kernel after `available()` saw avx512f and avx512bf16
        // on this CPU, and the assert above covers every index the kernel reads and writes:
        // step s of row r at byte 4·(s·MR + r); a bias start holds 32 floats (its contract).
        unsafe {
            micro_bf16(kc, a.as_ptr().cast(), 4, 4 * MR, b.as_ptr(), tile.as_mut_ptr(), ldc, start)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("the native GEMM runs only where available() is true")
    }
    const READS_A_ROWS: bool = true;
    fn micro_rows(
        kc: usize,
        a: &[bf16],
        first: usize,
        rs: usize,
        b: &[u32],
        tile: &mut [f32],
        ldc: usize,
        start: Start,
    ) {
        assert!(kc > 0 && first + (MR - 1) * rs + 2 * kc <= a.len());
        assert!(b.len() >= kc * NR && tile.len() >= (MR - 1) * ldc + NR);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `micro`; the assert above covers the last pair the kernel reads, the
        // two bf16 at `first + (MR - 1)·rs + 2(kc - 1)`, read as one unaligned u32.
        unsafe {
            micro_bf16(kc, a.as_ptr().add(first).cast(), 2 * rs, 4, b.as_ptr(), tile.as_mut_ptr(), ldc, start)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("the native GEMM runs only where available() is true")
    }
}

/// `dst[i] = lo[i] | hi[i] << 16` (as bits): one step of bf16 pairs from two contiguous runs.
/// Packing runs this once per step of every panel (a panel of A read transposed is 8 wide, so
/// the loop is short and the compiler left it scalar, a fifth of a transposed-A product's
/// time): SSE2's word unpack interleaves 8 pairs per instruction pair, at every SIMD level.
#[inline(always)]
fn interleave_pairs(lo: &[bf16], hi: &[bf16], dst: &mut [u32]) {
    let n = dst.len().min(lo.len()).min(hi.len());
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, so the 16-byte reads of lo[i..i + 8] and hi[i..i + 8] and the
            // 32-byte write of dst[i..i + 8] are in bounds; unaligned loads and stores have no
            // alignment requirement, and SSE2 is part of x86_64.
            unsafe {
                let l = _mm_loadu_si128(lo.as_ptr().add(i).cast());
                let h = _mm_loadu_si128(hi.as_ptr().add(i).cast());
                let d = dst.as_mut_ptr().add(i).cast::<__m128i>();
                _mm_storeu_si128(d, _mm_unpacklo_epi16(l, h));
                _mm_storeu_si128(d.add(1), _mm_unpackhi_epi16(l, h));
            }
            i += 8;
        }
    }
    for ((d, l), h) in dst[i..n].iter_mut().zip(&lo[i..n]).zip(&hi[i..n]) {
        *d = l.to_bits() as u32 | (h.to_bits() as u32) << 16;
    }
}

/// f16 widened to f32, one k per step.
struct F16Widened;

impl Kernel for F16Widened {
    type In = f16;
    type Packed = f32;
    const ZERO: f32 = 0.0;
    const K_STEP: usize = 1;
    fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    #[inline(always)]
    fn pack_one(x: &[f16], first: usize, cs: usize, s: usize, _k: usize) -> f32 {
        x[first + s * cs].to_f32()
    }
    #[inline(always)]
    fn pack_run(lo: &[f16], _hi: Option<&[f16]>, dst: &mut [f32]) {
        assert_eq!(lo.len(), dst.len());
        // A run is one panel's width (8 or 32): convert in place with F16C rather than through
        // the self-dispatching slice conversion, whose call and tail handling per 8 values
        // took 5% of an f16 W2 step.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: packing runs only where `available()` saw avx512f (which implies avx) and
        // f16c; the lengths are equal (asserted above); f16 is a plain wrapper of u16.
        unsafe {
            crate::simd::x86::f16_to_f32_f16c(half::slice::HalfFloatSliceExt::reinterpret_cast(lo), dst)
        }
        #[cfg(not(target_arch = "x86_64"))]
        <f16 as Precision>::to_f32_slice(lo, dst);
    }
    fn pack_buffers() -> &'static LocalKey<RefCell<[Vec<f32>; 2]>> {
        thread_local!(static BUFFERS: RefCell<[Vec<f32>; 2]> = const { RefCell::new([Vec::new(), Vec::new()]) });
        &BUFFERS
    }
    #[inline(always)]
    fn pack_row(row: &[f16], dst: &mut [f32], w: usize) {
        // Widen a chunk at a time with SIMD, then spread it down the panel.
        let mut slots = dst.iter_mut().step_by(w);
        let mut wide = [0f32; 64];
        for chunk in row.chunks(64) {
            let wide = &mut wide[..chunk.len()];
            <f16 as Precision>::to_f32_slice(chunk, wide);
            // Data first in the zip: one that ends on the data side takes no slot.
            for (&v, d) in wide.iter().zip(slots.by_ref()) {
                *d = v;
            }
        }
    }
    fn pack_rows(x: &[f16], first: usize, rs: usize, k: usize, w: usize, panel: &mut [f32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if w.is_multiple_of(8) && k > 0 && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            // SAFETY: AVX2 and F16C are present (checked); the function asserts its bounds.
            unsafe { pack_rows_f16_avx2(x, first, rs, k, w, panel) };
            return true;
        }
        let _ = (x, first, rs, k, w, panel);
        false
    }
    fn micro(kc: usize, a: &[f32], b: &[f32], tile: &mut [f32], ldc: usize, start: Start) {
        assert!(a.len() >= kc * MR && b.len() >= kc * NR && tile.len() >= (MR - 1) * ldc + NR);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm` only runs this kernel after `available()` saw avx512f on this CPU, and
        // the assert above covers every index the kernel reads and writes; a bias start holds
        // 32 floats (its contract).
        unsafe {
            micro_f32(kc, a.as_ptr(), b.as_ptr(), tile.as_mut_ptr(), ldc, start)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("the native GEMM runs only where available() is true")
    }
    const READS_A_ROWS: bool = false;
    fn micro_rows(_: usize, _: &[f16], _: usize, _: usize, _: &[f32], _: &mut [f32], _: usize, _: Start) {
        unreachable!("f16 always packs A (READS_A_ROWS is false)")
    }
}

thread_local! {
    /// Each thread's f32 tile buffer, kept between products so the hot path allocates nothing.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Byte alignment of every buffer the kernels load from: a cache line. AMX tile loads from
/// rows that straddle two lines ran 6× slower (3 against 17 ns a tile on a Xeon with AMX).
const ALIGN: usize = 64;

/// The front of `v`, from its first [`ALIGN`]ed element, `len` long; `v` grows (filled with
/// `zero`) so that this fits. [`aligned`] finds the same front again while `v` is not grown.
pub(super) fn aligned_front<T: Copy>(v: &mut Vec<T>, len: usize, zero: T) -> &mut [T] {
    let extra = ALIGN / std::mem::size_of::<T>();
    if v.len() < len + extra {
        v.resize(len + extra, zero);
    }
    let start = v.as_ptr().align_offset(ALIGN);
    assert!(start < extra, "cannot align a buffer of {}", std::any::type_name::<T>());
    &mut v[start..start + len]
}

/// `v` from its first [`ALIGN`]ed element: what [`aligned_front`] last filled.
pub(super) fn aligned<T>(v: &[T]) -> &[T] {
    &v[v.as_ptr().align_offset(ALIGN).min(v.len())..]
}

/// Runs `f` on a buffer of `len` f32 (contents unspecified): the thread's kept buffer, or a
/// fresh one if that is in use further up this thread's stack (rayon may run a task inside a
/// wait).
fn with_tile<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    TILE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => f(aligned_front(&mut buf, len, 0.0)),
        Err(_) => f(aligned_front(&mut Vec::new(), len, 0.0)),
    })
}

/// Runs `f` on a 64-byte-aligned buffer of `len` values (contents unspecified) for a task's
/// packed A ([`AmxA::PerTask`]): the thread's kept buffer, or a fresh one if that is in use
/// further up this thread's stack.
fn with_a_tiles<R>(len: usize, f: impl FnOnce(&mut [u32]) -> R) -> R {
    thread_local!(static A_TILES: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) });
    A_TILES.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => f(aligned_front(&mut buf, len, 0)),
        Err(_) => f(aligned_front(&mut Vec::new(), len, 0)),
    })
}

/// The blocked product for one kernel on the thread's kept pack buffers (fresh ones if those
/// are in use further up this thread's stack).
fn run<E: Precision, K: Kernel>(
    dims: (usize, usize, usize),
    a: Operand<'_, K::In>,
    b: Operand<'_, K::In>,
    bias: Option<&[f32]>,
    out: &mut [E],
    parallel: bool,
) {
    K::pack_buffers().with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffers) => {
            let [pa, pb] = &mut *buffers;
            multiply::<E, K>(dims, a, b, bias, out, parallel, pa, pb)
        }
        Err(_) => multiply::<E, K>(dims, a, b, bias, out, parallel, &mut Vec::new(), &mut Vec::new()),
    })
}

/// The blocked product for one kernel; see the module notes.
#[allow(clippy::too_many_arguments)] // the product's operands plus its two scratch buffers
fn multiply<E: Precision, K: Kernel>(
    (m, k, n): (usize, usize, usize),
    a: Operand<'_, K::In>,
    b: Operand<'_, K::In>,
    bias: Option<&[f32]>,
    out: &mut [E],
    parallel: bool,
    pa: &mut Vec<K::Packed>,
    pb: &mut Vec<K::Packed>,
) {
    assert_eq!(out.len(), m * n);
    if m * n == 0 {
        return;
    }
    if let Some(bias) = bias {
        assert_eq!(bias.len(), n);
    }
    let steps = k.div_ceil(K::K_STEP);
    let big = parallel && 2 * m * n * k >= PAR_FLOPS;
    // A's full panels are read in place when the kernel can and A's rows hold whole steps
    // contiguously (row-major activations, the usual case); `pa` then holds only the panel of
    // the last m % MR rows, zero-padded.
    let in_place = K::READS_A_ROWS && a.cs == 1 && k.is_multiple_of(K::K_STEP);
    let full = if in_place { m / MR * MR } else { 0 };
    pack::<K, MR>(m - full, k, Operand { offset: a.offset + full * a.rs, ..a }, big, pa);
    pack::<K, NR>(n, k, Operand { data: b.data, offset: b.offset, rs: b.cs, cs: b.rs }, big, pb);
    let (pa, pb) = (aligned(pa), aligned(pb));
    // Rows per task: enough tasks for every thread when m allows, a multiple of MR.
    let threads = if big { rayon::current_num_threads() } else { 1 };
    let rows = (m.div_ceil(2 * threads).div_ceil(MR) * MR).clamp(MR, MC);
    let nc_max = NC.min(n.div_ceil(NR) * NR);
    // Each MR × NR tile of C is rounded into the output right after its last k block, while
    // its f32 sums are in L1 ([`round_block`]), rather than in a pass over the task's f32
    // block (in L2) at the end: that pass was 8% of a [2048, 256]·[256, 1024] product on Zen 4,
    // bound by writing the output, which the tiles' stores now spread over the kernel's time.
    // A bf16 output needs every sum last written by `vdpbf16ps` (which flushes subnormal
    // results, as `vcvtne2ps2bf16` flushes subnormal inputs): a bf16 kernel. With k = 0 no
    // kernel runs, and the pass at the end rounds the bias (or zero).
    let direct = (steps > 0
        && match E::DTYPE {
            DType::BF16 => K::In::DTYPE == DType::BF16,
            DType::F16 => true,
            _ => false,
        })
    .then(RoundBlock::new)
    .flatten();
    // The first k block's tiles start from the bias (or zero) in registers.
    let mut bias_copy = Vec::new();
    let bias_pad = bias.map(|bias| padded_bias(bias, &mut bias_copy));
    let task = |t: usize, dst: &mut [E]| {
        let r0 = t * rows;
        let mc = dst.len() / n;
        let mc_pad = mc.div_ceil(MR) * MR;
        with_tile(mc_pad * nc_max, |c| {
            for jc in (0..n).step_by(NC) {
                let nc = NC.min(n - jc);
                let nc_pad = nc.div_ceil(NR) * NR;
                let c = &mut c[..mc_pad * nc_pad];
                if steps == 0 {
                    match bias {
                        Some(bias) => {
                            c.chunks_mut(nc_pad).for_each(|row| row[..nc].copy_from_slice(&bias[jc..jc + nc]))
                        }
                        None => c.fill(0.0),
                    }
                }
                for pc in (0..steps).step_by(KC) {
                    let kc = KC.min(steps - pc);
                    let last = pc + kc == steps;
                    for jr in 0..nc_pad / NR {
                        let bp = &pb[((jc / NR + jr) * steps + pc) * NR..][..kc * NR];
                        let start = block_start(bias_pad, jc + jr * NR, pc > 0);
                        for ir in 0..mc_pad / MR {
                            let (row, tile) = (r0 + ir * MR, &mut c[ir * MR * nc_pad + jr * NR..]);
                            if row < full {
                                let first = a.offset + row * a.rs + pc * K::K_STEP;
                                K::micro_rows(kc, a.data, first, a.rs, bp, tile, nc_pad, start);
                            } else {
                                let ap = &pa[(((row - full) / MR) * steps + pc) * MR..][..kc * MR];
                                K::micro(kc, ap, bp, tile, nc_pad, start);
                            }
                            if let Some(rb) = direct.filter(|_| last) {
                                let (rows, cols) = (MR.min(mc - ir * MR), NR.min(nc - jr * NR));
                                round_tile(rb, tile, nc_pad, &mut dst[ir * MR * n + jc + jr * NR..], n, rows, cols);
                            }
                        }
                    }
                }
                if direct.is_none() {
                    for r in 0..mc {
                        E::from_f32_slice(&c[r * nc_pad..r * nc_pad + nc], &mut dst[r * n + jc..r * n + jc + nc]);
                    }
                }
            }
        })
    };
    if big {
        out.par_chunks_mut(rows * n).enumerate().for_each(|(t, dst)| task(t, dst));
    } else {
        out.chunks_mut(rows * n).enumerate().for_each(|(t, dst)| task(t, dst));
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: turn the AMX kernel off on this thread, to test the `vdpbf16ps` kernel on a CPU
    /// with AMX (the choice is made on the calling thread, before any parallel task).
    static NO_AMX: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether bf16 products run on AMX tiles ([`super::amx`]).
fn use_amx() -> bool {
    #[cfg(test)]
    if NO_AMX.with(|c| c.get()) {
        return false;
    }
    super::amx::available()
}

/// k pairs per cache block of the AMX kernel: a B panel is 256·32·4 bytes = 32 KiB.
const KC_AMX: usize = 256;
/// Floats between the rows of the AMX kernel's f32 block of C beyond its width: a row
/// stride of a power of two (2 KiB for 512 columns) puts a tile's 16 rows in the same few
/// L1 sets.
const C_PAD: usize = 16;
/// Most rows per parallel task of the AMX kernel (a multiple of its 32-row block).
const MC_AMX: usize = 128;

/// [`run`] for bf16 on AMX tiles: B packed into the kept buffer of the `vdpbf16ps` kernel (the
/// two share B's layout), A packed by each task for its own rows ([`AmxA::PerTask`]).
fn run_amx<E: Precision>(
    dims: (usize, usize, usize),
    a: Operand<'_, bf16>,
    b: Operand<'_, bf16>,
    bias: Option<&[f32]>,
    out: &mut [E],
    parallel: bool,
) {
    let (m, k, n) = dims;
    let big = parallel && 2 * m * n * k >= PAR_FLOPS;
    with_amx_buffers(|_, pb| {
        pack::<Bf16Pairs, NR>(n, k, Operand { data: b.data, offset: b.offset, rs: b.cs, cs: b.rs }, big, pb);
        let pack_a = |first: usize, blocks: &mut [u32]| pack_pair_tiles(m, k, a, first, blocks);
        let packed = AmxPacked { a: AmxA::PerTask(&pack_a), b: aligned(pb), steps: k.div_ceil(2), b_per_a: 1 };
        multiply_amx::<E>(dims, packed, bias, out, big)
    })
}

/// f16 on AMX tiles, each value split into bf16 high and low parts ([`super::amx_f16`]).
/// Returns false, leaving `out` untouched, when an operand holds an infinity or NaN: the
/// caller then runs the widening kernel, whose products keep IEEE semantics there.
fn run_amx_f16<E: Precision>(
    dims: (usize, usize, usize),
    a: Operand<'_, f16>,
    b: Operand<'_, f16>,
    bias: Option<&[f32]>,
    out: &mut [E],
    parallel: bool,
) -> bool {
    let (m, k, n) = dims;
    let big = parallel && 2 * m * n * k >= PAR_FLOPS;
    with_amx_buffers(|pa, pb| {
        let bt = Operand { data: b.data, offset: b.offset, rs: b.cs, cs: b.rs };
        if !(super::amx_f16::pack_a(m, k, a, big, pa) && super::amx_f16::pack_b(n, k, bt, big, pb)) {
            return false;
        }
        let steps = super::amx_f16::steps(k);
        let packed = AmxPacked { a: AmxA::Packed(aligned(pa)), b: aligned(pb), steps, b_per_a: 2 };
        multiply_amx::<E>(dims, packed, bias, out, big);
        true
    })
}

/// Runs `f` on this thread's kept pack buffers of the AMX kernels (fresh ones if those are in
/// use further up this thread's stack).
fn with_amx_buffers<R>(f: impl FnOnce(&mut Vec<u32>, &mut Vec<u32>) -> R) -> R {
    Bf16Pairs::pack_buffers().with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffers) => {
            let [pa, pb] = &mut *buffers;
            f(pa, pb)
        }
        Err(_) => f(&mut Vec::new(), &mut Vec::new()),
    })
}

/// A of an AMX product, in [`pack_pair_tiles`]' tiled layout (32-row blocks of 16-step
/// chunks).
enum AmxA<'a> {
    /// All of A, packed before the product.
    Packed(&'a [u32]),
    /// Packed by each task for its own rows, into a buffer of its thread, just before it
    /// multiplies them: `pack(first, out)` fills `out` with the blocks from `first` on. The
    /// packed rows are then read from L2 instead of from memory (a whole packed A of W2's
    /// shapes is 1-4 MiB, written out and read back by a separate pass).
    PerTask(&'a (dyn Fn(usize, &mut [u32]) + Sync)),
}

/// The packed operands of an AMX product and how they hold k.
struct AmxPacked<'a> {
    /// A, packed or to be packed.
    a: AmxA<'a>,
    /// B as panels of [`NR`] columns, `steps · b_per_a` steps each.
    b: &'a [u32],
    /// A's steps per row: bf16's k / 2 pairs (rounded up), or the f16 split's k rounded up to
    /// whole chunks.
    steps: usize,
    /// B's steps per step of A: 1 for bf16, 2 for the f16 split (a chunk of high parts and
    /// one of low parts per chunk of A).
    b_per_a: usize,
}

/// The blocked product on AMX tiles from packed operands: [`multiply`]'s blocking with 32-row
/// blocks of C computed by [`super::amx::Tiles::block`] over whole tiles of 16 steps of A, and
/// the last `steps % 16` pairs of a k block (bf16 only; the f16 split has whole chunks) by
/// the `vdpbf16ps` kernel on the same f32 block of C. A is always packed
/// ([`pack_pair_tiles`], [`super::amx_f16::pack_a`]): tile loads need cache-line-aligned
/// rows to run at speed, which a tensor's rows rarely are; the pack costs one pass over A
/// per product, kept in L2 where each task packs its own rows.
fn multiply_amx<E: Precision>(
    (m, _k, n): (usize, usize, usize),
    packed: AmxPacked<'_>,
    bias: Option<&[f32]>,
    out: &mut [E],
    big: bool,
) {
    use super::amx::{BLOCK_ROWS, PAIRS};
    assert_eq!(out.len(), m * n);
    if m * n == 0 {
        return;
    }
    if let Some(bias) = bias {
        assert_eq!(bias.len(), n);
    }
    let AmxPacked { a, b: pb, steps, b_per_a } = packed;
    assert!(b_per_a == 1 || steps.is_multiple_of(PAIRS), "only bf16 has a tail of pairs");
    let chunks_all = steps.div_ceil(PAIRS);
    // Steps of A per cache block: B's part of a block stays KC_AMX steps (32 KiB).
    let kc_max = KC_AMX / b_per_a;
    let threads = if big { rayon::current_num_threads() } else { 1 };
    // As few tasks as keep every thread busy, each at most MC_AMX rows: every task reads all
    // of packed B, so fewer tasks read it fewer times (W2's weight gradient `dyᵀ x` at m = 256
    // read its 4 MiB of B four times with twice the tasks, and ran 1.1x slower).
    let tasks = threads * m.div_ceil(threads * MC_AMX);
    let rows = m.div_ceil(tasks).div_ceil(BLOCK_ROWS) * BLOCK_ROWS;
    let nc_max = NC.min(n.div_ceil(NR) * NR);
    // With a whole chunk of k, the first k block's tiles start from zero or from the bias
    // (loaded into every row of a tile at once, from a copy padded to whole 32-column panels
    // and aligned); otherwise the f32 block of C is filled with the bias or zero first.
    let tiles_start = steps >= PAIRS;
    let mut bias_pad = Vec::new();
    let bias_tiles = bias.filter(|_| tiles_start).map(|bias| padded_bias(bias, &mut bias_pad));
    // With a whole chunk, every output was last written by `tdpbf16ps` or `vdpbf16ps`, which
    // flush subnormal results: no output is subnormal.
    let ftz = steps >= PAIRS;
    // A bf16 or f16 output whose k fits one block of whole chunks: each 32 × 32 block of C is
    // done after one call of the tile kernel, so it is stored into a 4 KiB f32 block that
    // stays in L1 and rounded into the output at once ([`round_block`]), instead of into an
    // f32 copy of the task's C (in L2, where a tile store first reads each line) and rounded
    // in a second pass.
    let direct = tiles_start
        && steps <= kc_max
        && steps.is_multiple_of(PAIRS)
        && matches!(E::DTYPE, DType::BF16 | DType::F16)
        && round_block_available();
    let block_len = chunks_all * BLOCK_ROWS * PAIRS;
    let task = |t: usize, dst: &mut [E]| {
        let r0 = t * rows;
        let mc = dst.len() / n;
        let mc_pad = mc.div_ceil(BLOCK_ROWS) * BLOCK_ROWS;
        let a_len = if matches!(a, AmxA::PerTask(_)) { mc_pad / BLOCK_ROWS * block_len } else { 0 };
        with_a_tiles(a_len, |buf| {
            // The task's blocks of A, from its first (packed here into `buf`, or earlier).
            let pa: &[u32] = match a {
                AmxA::Packed(pa) => &pa[r0 / BLOCK_ROWS * block_len..],
                AmxA::PerTask(pack) => {
                    pack(r0 / BLOCK_ROWS, buf);
                    buf
                }
            };
            // SAFETY: `use_amx` saw `amx::available()` on this process before choosing this path,
            // and the guard lives only within this task, which runs no other task inside it.
            let tiles = unsafe { super::amx::Tiles::configure() };
            #[cfg(target_arch = "x86_64")]
            if direct {
                // SAFETY: E is bf16 or f16 (checked by DTYPE; `Precision` is sealed, one type per
                // DTYPE), each a plain wrapper of u16.
                let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u16>(), dst.len()) };
                let f16_out = E::DTYPE == DType::F16;
                with_tile(BLOCK_ROWS * NR, |c| {
                    // Row blocks outermost, so each output row is written left to right; and the
                    // next block's output lines are fetched for writing while this block's tiles
                    // run. Inside a training step the output is usually out of cache (other ops
                    // ran since it was last used): without both, these products ran 1.05-1.2x
                    // slower there than the two-pass path, though faster in a loop.
                    let panels = n.div_ceil(NR);
                    for ir in 0..mc_pad / BLOCK_ROWS {
                        let a_tiles = &pa[ir * block_len..];
                        assert!(a_tiles.len() >= chunks_all * BLOCK_ROWS * PAIRS);
                        let block_rows = BLOCK_ROWS.min(mc - ir * BLOCK_ROWS);
                        for jr in 0..panels {
                            let bp = &pb[jr * steps * b_per_a * NR..][..steps * b_per_a * NR];
                            let cols = NR.min(n - jr * NR);
                            let start = block_start(bias_tiles, jr * NR, false);
                            let at = ir * BLOCK_ROWS * n + jr * NR;
                            assert!(at + (block_rows - 1) * n + cols <= out.len());
                            let next = if jr + 1 < panels { at + NR } else { (ir + 1) * BLOCK_ROWS * n };
                            prefetch_rows_for_write(out, next, n, BLOCK_ROWS);
                            // SAFETY: `a_tiles` holds the block's whole chunks (asserted), `bp`
                            // its panel's steps, `c` 32 rows of 32 floats (ldc 32); the block's
                            // rows and columns lie inside `out` (asserted); the CPU has what
                            // `round_block` needs (`round_block_available`, checked for
                            // `direct`).
                            unsafe {
                                tiles.block(
                                    chunks_all,
                                    b_per_a,
                                    a_tiles.as_ptr().cast(),
                                    bp.as_ptr(),
                                    c.as_mut_ptr(),
                                    NR,
                                    start,
                                );
                                round_block(c, NR, &mut out[at..], n, block_rows, cols, f16_out);
                            }
                        }
                    }
                });
                drop(tiles);
                return;
            }
            with_tile(mc_pad * (nc_max + C_PAD), |c| {
                for jc in (0..n).step_by(NC) {
                    let nc = NC.min(n - jc);
                    let nc_pad = nc.div_ceil(NR) * NR;
                    let ldc = nc_pad + C_PAD;
                    let c = &mut c[..mc_pad * ldc];
                    match bias {
                        _ if tiles_start => {}
                        Some(bias) => c.chunks_mut(ldc).for_each(|row| row[..nc].copy_from_slice(&bias[jc..jc + nc])),
                        None => c.fill(0.0),
                    }
                    for pc in (0..steps).step_by(kc_max) {
                        let kc = kc_max.min(steps - pc);
                        let chunks = kc / PAIRS;
                        let tail = kc % PAIRS;
                        for jr in 0..nc_pad / NR {
                            let bp = &pb[((jc / NR + jr) * steps + pc) * b_per_a * NR..][..kc * b_per_a * NR];
                            for ir in 0..mc_pad / BLOCK_ROWS {
                                // Chunk pc / 16 of A's block on: rows 64 bytes apart, chunks 2 KiB.
                                let a_tiles = &pa[(ir * chunks_all + pc / PAIRS) * BLOCK_ROWS * PAIRS..];
                                assert!(a_tiles.len() >= kc.div_ceil(PAIRS) * BLOCK_ROWS * PAIRS);
                                let tile = &mut c[ir * BLOCK_ROWS * ldc + jr * NR..];
                                assert!(tile.len() >= (BLOCK_ROWS - 1) * ldc + NR);
                                #[cfg(target_arch = "x86_64")]
                                // SAFETY: `a_tiles` holds the kc steps of the block's 32 rows in
                                // whole chunks (asserted); bp holds kc·b_per_a·32 steps; the tile's 32 rows
                                // of 32 floats are inside `c` (asserted). The tail kernel needs
                                // AVX-512 BF16, which `amx::available()` checked.
                                unsafe {
                                    if chunks > 0 {
                                        let start = block_start(bias_tiles, jc + jr * NR, pc > 0);
                                        tiles.block(
                                            chunks,
                                            b_per_a,
                                            a_tiles.as_ptr().cast(),
                                            bp.as_ptr(),
                                            tile.as_mut_ptr(),
                                            ldc,
                                            start,
                                        );
                                    }
                                    if tail > 0 {
                                        let done = chunks * PAIRS;
                                        for g in 0..BLOCK_ROWS / MR {
                                            micro_bf16(
                                                tail,
                                                a_tiles[(chunks * BLOCK_ROWS + g * MR) * PAIRS..].as_ptr().cast(),
                                                4 * PAIRS,
                                                4,
                                                bp[done * NR..].as_ptr(),
                                                tile.as_mut_ptr().add(g * MR * ldc),
                                                ldc,
                                                Start::Sums,
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                    for r in 0..mc {
                        round_ftz_output(&c[r * ldc..r * ldc + nc], &mut dst[r * n + jc..r * n + jc + nc], ftz);
                    }
                }
            });
            drop(tiles);
        });
    };
    if big {
        out.par_chunks_mut(rows * n).enumerate().for_each(|(t, dst)| task(t, dst));
    } else {
        out.chunks_mut(rows * n).enumerate().for_each(|(t, dst)| task(t, dst));
    }
}

/// `dst = round(src)` into `E`, where `ftz` says no value of `src` is subnormal: bf16 then
/// rounds with `vcvtne2ps2bf16` (32 values an instruction), whose result equals the software
/// rounding except that it flushes subnormal inputs, which `ftz` rules out.
fn round_ftz_output<E: Precision>(src: &[f32], dst: &mut [E], ftz: bool) {
    #[cfg(target_arch = "x86_64")]
    if ftz && E::DTYPE == DType::BF16 && Bf16Pairs::available() {
        assert_eq!(src.len(), dst.len());
        // SAFETY: E is bf16 (checked by DTYPE; `Precision` is sealed, one type per DTYPE),
        // a plain wrapper of u16; the CPU has AVX-512 BF16 (checked); lengths are equal.
        unsafe {
            let bits = std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u16>(), dst.len());
            let done = f32_to_bf16_cvtne(src, bits);
            E::from_f32_slice(&src[done..], &mut dst[done..]);
        }
        return;
    }
    let _ = ftz;
    E::from_f32_slice(src, dst)
}

/// `bias` copied into `buf`, 64-byte aligned and zero-padded to whole NR-column panels: a
/// tile's [`Start::Bias`] reads NR values, past the bias's end in the last panel.
fn padded_bias<'a>(bias: &[f32], buf: &'a mut Vec<f32>) -> &'a [f32] {
    let padded = aligned_front(buf, bias.len().div_ceil(NR) * NR, 0.0);
    padded[..bias.len()].copy_from_slice(bias);
    padded
}

/// What the tile kernel's sums start from for the block of C at column `col`: the f32 block
/// as it is after an earlier k block (`later_k_block`), else the bias's 32 values from `col`
/// (from the padded, aligned copy) or zero.
fn block_start(bias_tiles: Option<&[f32]>, col: usize, later_k_block: bool) -> super::amx::Start {
    use super::amx::Start;
    match bias_tiles {
        _ if later_k_block => Start::Sums,
        Some(b) => Start::Bias(b[col..][..NR].as_ptr()),
        None => Start::Zero,
    }
}

/// Asks for the cache lines where `rows` rows start, `ld` apart from `dst[at]`, in a
/// writable state (`prefetchw`), for the rows inside `dst`. Written as `asm!`: the intrinsic
/// `_mm_prefetch::<_MM_HINT_ET0>` compiles to a plain `prefetcht0` unless the build enables
/// the `prfchw` target feature, which a dependent crate's default build does not.
#[cfg(target_arch = "x86_64")]
fn prefetch_rows_for_write(dst: &[u16], at: usize, ld: usize, rows: usize) {
    for i in (at..dst.len()).step_by(ld).take(rows) {
        // SAFETY: a prefetch only hints the cache, never faults and changes no register or
        // memory; the address is inside `dst`.
        unsafe {
            std::arch::asm!("prefetchw [{p}]", p = in(reg) dst.as_ptr().add(i), options(nostack, readonly, preserves_flags))
        };
    }
}

/// Proof that [`round_block`] runs on this CPU ([`round_block_available`]), checked once per
/// product rather than once per tile (a feature check per 8 × 32 tile was 0.2% of a W2 step).
#[derive(Clone, Copy)]
struct RoundBlock(());

impl RoundBlock {
    fn new() -> Option<Self> {
        round_block_available().then_some(RoundBlock(()))
    }
}

/// [`round_block`] on bf16 or f16 `dst` (for bf16 the caller checked that no value of the tile
/// is subnormal).
fn round_tile<E: Precision>(
    _: RoundBlock,
    tile: &[f32],
    ldc: usize,
    dst: &mut [E],
    ld: usize,
    rows: usize,
    cols: usize,
) {
    assert!(matches!(E::DTYPE, DType::BF16 | DType::F16));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: E is bf16 or f16 (checked by DTYPE; `Precision` is sealed, one type per DTYPE),
    // each a plain wrapper of u16; the CPU has what `round_block` needs (a `RoundBlock` exists
    // only where `round_block_available` said so), and `round_block` asserts its own bounds.
    unsafe {
        let bits = std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u16>(), dst.len());
        round_block(tile, ldc, bits, ld, rows, cols, E::DTYPE == DType::F16)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("round_block_available() is false off x86-64")
}

/// Whether [`round_block`] runs here.
fn round_block_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        Bf16Pairs::available() && is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rounds the `rows × cols` corner (at most 32 × 32) of an f32 block (rows `src_ld` floats
/// apart, 32 floats readable in each) into `dst` as bf16 or (`f16`) f16 bits, rows `ld`
/// apart, one masked 64-byte store a row. bf16 rounds with `vcvtne2ps2bf16` (as
/// [`f32_to_bf16_cvtne`]: subnormal inputs flushed, which the callers rule out), f16 with
/// `vcvtps2ph` to nearest even (as the f16 conversions of [`crate::simd`], so the bits are
/// those of `from_f32_slice`).
///
/// # Safety
/// The CPU must support avx512f, avx512bw and avx512bf16; `src` must hold
/// `(rows - 1)·src_ld + 32` floats, and `dst` `(rows - 1)·ld + cols` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn round_block(src: &[f32], src_ld: usize, dst: &mut [u16], ld: usize, rows: usize, cols: usize, f16: bool) {
    use std::arch::x86_64::*;
    assert!(rows <= 32 && cols <= 32);
    assert!(rows == 0 || ((rows - 1) * src_ld + 32 <= src.len() && (rows - 1) * ld + cols <= dst.len()));
    let mask: __mmask32 = if cols == 32 { !0 } else { (1u32 << cols) - 1 };
    // SAFETY: each load reads 32 floats of row r < rows of `src`, and each masked store writes
    // `cols` u16 from `dst[r·ld]`, inside both (asserted); __m512bh is a 64-byte vector for
    // which every bit pattern is a valid __m512i.
    unsafe {
        for r in 0..rows {
            let lo = _mm512_loadu_ps(src.as_ptr().add(src_ld * r));
            let hi = _mm512_loadu_ps(src.as_ptr().add(src_ld * r + 16));
            let v: __m512i = if f16 {
                const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                let l = _mm512_castsi256_si512(_mm512_cvtps_ph::<RNE>(lo));
                _mm512_inserti64x4::<1>(l, _mm512_cvtps_ph::<RNE>(hi))
            } else {
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
            };
            _mm512_mask_storeu_epi16(dst.as_mut_ptr().add(r * ld).cast(), mask, v);
        }
    }
}

/// Rounds the first multiple of 16 values of `src` into `dst` with `vcvtne2ps2bf16` /
/// `vcvtneps2bf16` (round to nearest even, NaN quieted as `(bits >> 16) | 0x40`, subnormal
/// inputs flushed); returns how many it rounded.
///
/// # Safety
/// The CPU must support avx512f and avx512bf16; `dst` must be as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn f32_to_bf16_cvtne(src: &[f32], dst: &mut [u16]) -> usize {
    use std::arch::x86_64::*;
    let n = src.len();
    let mut i = 0;
    // SAFETY: every load reads src[i..i + 16 or 32] and every store writes dst[i..] of the
    // same length, inside both slices (i + width <= n = dst.len()); __m512bh / __m256bh are
    // 64- / 32-byte vectors for which every bit pattern is valid.
    unsafe {
        while i + 32 <= n {
            let lo = _mm512_loadu_ps(src.as_ptr().add(i));
            let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
            let r: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), r);
            i += 32;
        }
        if i + 16 <= n {
            let r: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(src.as_ptr().add(i))));
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), r);
            i += 16;
        }
    }
    i
}

/// Packs 32-row blocks `first..` of A (`rows × k` of `x`), as many as `out` holds whole,
/// into `out`, on this thread, in the AMX kernel's tiled layout: per block of 32 rows, per
/// chunk of 16 k pairs, the 32 rows' 16 pairs contiguous (block i, chunk q, row r, pair p at
/// `[((i·chunks + q)·32 + r)·16 + p]`, i counted from `first`), so each tile of A loads 1 KiB
/// at a 64-byte stride, free of the cache-set conflicts a row stride of a power of two bytes
/// causes. Rows past `rows`, pairs past k / 2 and an odd k's last pad are zero.
fn pack_pair_tiles(rows: usize, k: usize, x: Operand<'_, bf16>, first: usize, out: &mut [u32]) {
    use super::amx::{BLOCK_ROWS as W, PAIRS};
    let steps = k.div_ceil(2);
    let block = steps.div_ceil(PAIRS) * W * PAIRS;
    if rows == 0 || steps == 0 {
        return;
    }
    let last = x.offset + (rows - 1) * x.rs + (k - 1) * x.cs;
    assert!(last < x.data.len(), "native GEMM operand out of bounds");
    let fill = |i: usize, panel: &mut [u32]| {
        crate::simd::dispatch(
            #[inline(always)]
            || {
                let live = W.min(rows - i * W);
                let first = x.offset + i * W * x.rs;
                let at = |r: usize, s: usize| (s / PAIRS * W + r) * PAIRS + s % PAIRS;
                if live < W || !steps.is_multiple_of(PAIRS) {
                    panel.fill(0);
                }
                if x.cs == 1 {
                    // Each row's k values are contiguous: 16 pairs (32 values) per chunk row,
                    // a pair being two adjacent values. On a little-endian CPU a whole chunk's
                    // 32 values are its 16 pairs' bytes in order: 64 bytes copied as they are,
                    // chunk by chunk so the stores run through the buffer in order. (Row by
                    // row, each row's stores 2 KiB apart, 128 rows of k = 768 took 9.3 us from
                    // L2 against 5.8, and 11.3 against 8.9 from L3.)
                    let whole = if cfg!(target_endian = "little") { k / (2 * PAIRS) } else { 0 };
                    for q in 0..whole {
                        for r in 0..live {
                            let src = &x.data[first + r * x.rs + 2 * PAIRS * q..][..2 * PAIRS];
                            let dst = &mut panel[at(r, q * PAIRS)..][..PAIRS];
                            // SAFETY: both slices hold 64 bytes (32 bf16, each a plain u16; 16
                            // u32) and do not overlap (one is borrowed mutably).
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    src.as_ptr().cast::<u8>(),
                                    dst.as_mut_ptr().cast::<u8>(),
                                    64,
                                )
                            };
                        }
                    }
                    // The last, partial chunk of each row.
                    for r in 0..live {
                        let row = &x.data[first + r * x.rs..][..k];
                        for (q, part) in row.chunks(2 * PAIRS).enumerate().skip(whole) {
                            let dst = &mut panel[at(r, q * PAIRS)..][..PAIRS];
                            for (d, pair) in dst.iter_mut().zip(part.chunks_exact(2)) {
                                *d = pair[0].to_bits() as u32 | (pair[1].to_bits() as u32) << 16;
                            }
                            if part.len() % 2 == 1 {
                                dst[part.len() / 2] = part[part.len() - 1].to_bits() as u32;
                            }
                        }
                    }
                } else if x.rs == 1 {
                    // Rows adjacent in memory (a transposed view, the weight gradient's dyᵀ).
                    // Whole chunks of a full block: interleave the 32 rows' pairs of each of
                    // the chunk's 16 steps, then transpose the 16 × 32 pairs in registers.
                    // (`transposed_chunks` packs those after this, across a task's blocks.)
                    let whole = if live == W { k / (2 * PAIRS) } else { 0 };
                    // The rest step by step: 16 rows' pairs of one step, spread across the rows.
                    let mut pairs = [0u32; 16];
                    for r0 in (0..live).step_by(16) {
                        let w = 16.min(live - r0);
                        for s in whole * PAIRS..steps {
                            let lo = &x.data[first + r0 + 2 * s * x.cs..][..w];
                            let pairs = &mut pairs[..w];
                            if 2 * s + 1 < k {
                                interleave_pairs(lo, &x.data[first + r0 + (2 * s + 1) * x.cs..][..w], pairs);
                            } else {
                                Bf16Pairs::pack_run(lo, None, pairs);
                            }
                            for (r, &p) in pairs.iter().enumerate() {
                                panel[at(r0 + r, s)] = p;
                            }
                        }
                    }
                } else {
                    for r in 0..live {
                        for s in 0..steps {
                            panel[at(r, s)] = Bf16Pairs::pack_one(x.data, first + r * x.rs, x.cs, s, k);
                        }
                    }
                }
            },
        )
    };
    // The whole chunks of the full blocks of a transposed view (row stride 1: the weight
    // gradient's dyᵀ): per chunk, interleave the 32 rows' pairs of each of its 16 steps, then
    // transpose the 16 × 32 pairs in registers. A task walks k outermost across all its
    // blocks, so each step reads one run of the task's width from the source row: block by
    // block it read 64 bytes of each row, rows 2 KiB apart, a pattern the hardware prefetcher
    // does not follow.
    let transposed_chunks = |i0: usize, panels: &mut [u32]| {
        let whole = if x.rs == 1 && x.cs != 1 { k / (2 * PAIRS) } else { 0 };
        crate::simd::dispatch(
            #[inline(always)]
            || {
                let mut by_step = [[0u32; W]; PAIRS];
                for q in 0..whole {
                    for (ii, panel) in panels.chunks_mut(block).enumerate() {
                        let i = i0 + ii;
                        if rows - i * W < W {
                            continue;
                        }
                        let first = x.offset + i * W;
                        for (p, dst) in by_step.iter_mut().enumerate() {
                            let j = 2 * (q * PAIRS + p);
                            let lo = &x.data[first + j * x.cs..][..W];
                            interleave_pairs(lo, &x.data[first + (j + 1) * x.cs..][..W], dst);
                        }
                        transpose_pairs(&by_step, &mut panel[q * W * PAIRS..][..W * PAIRS]);
                    }
                }
            },
        )
    };
    let whole = out.len() / block * block;
    let panels = &mut out[..whole];
    for (ii, panel) in panels.chunks_mut(block).enumerate() {
        fill(first + ii, panel);
    }
    transposed_chunks(first, panels);
}

/// `out[r·16 + p] = by_step[p][r]`: one chunk of a 32-row block in the AMX tiled layout from
/// its pairs gathered step by step. AVX2 8 × 8 transposes of 32-bit lanes where the CPU has
/// AVX2 (every CPU with AMX does), a scalar loop elsewhere.
#[inline(always)]
pub(super) fn transpose_pairs(by_step: &[[u32; 32]; 16], out: &mut [u32]) {
    assert_eq!(out.len(), 32 * 16);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked); `out` holds 32 rows of 16 (asserted), the
        // kernel's only writes, and `by_step` is read within its 16 × 32 bounds.
        unsafe { transpose_pairs_avx2(by_step, out) };
        return;
    }
    for (r, row) in out.chunks_exact_mut(16).enumerate() {
        for (p, d) in row.iter_mut().enumerate() {
            *d = by_step[p][r];
        }
    }
}

/// [`transpose_pairs`] in 8 × 8 blocks of 32-bit lanes: unpack 32-bit, unpack 64-bit, swap
/// 128-bit halves.
///
/// # Safety
/// The CPU must support AVX2; `out` must hold 32 × 16 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_pairs_avx2(by_step: &[[u32; 32]; 16], out: &mut [u32]) {
    use std::arch::x86_64::*;
    for p0 in (0..16).step_by(8) {
        for r0 in (0..32).step_by(8) {
            // SAFETY: rows p0..p0 + 8 < 16 of `by_step`, lanes r0..r0 + 8 <= 32 of each; the
            // stores write rows r0..r0 + 8 < 32 of `out`, lanes p0..p0 + 8 <= 16 (the caller
            // guarantees 32 × 16 values).
            unsafe {
                let v: [__m256i; 8] =
                    std::array::from_fn(|i| _mm256_loadu_si256(by_step[p0 + i][r0..].as_ptr().cast()));
                let rows = transpose_8x8_epi32(v);
                for (i, row) in rows.into_iter().enumerate() {
                    _mm256_storeu_si256(out.as_mut_ptr().add((r0 + i) * 16 + p0).cast(), row);
                }
            }
        }
    }
}

/// The 8 × 8 transpose of 32-bit lanes: lane j of `v[i]` becomes lane i of the result's
/// vector j (unpack 32-bit, unpack 64-bit, swap 128-bit halves).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose_8x8_epi32(v: [std::arch::x86_64::__m256i; 8]) -> [std::arch::x86_64::__m256i; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    let t2 = _mm256_unpacklo_epi32(v[2], v[3]);
    let t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    let t4 = _mm256_unpacklo_epi32(v[4], v[5]);
    let t5 = _mm256_unpackhi_epi32(v[4], v[5]);
    let t6 = _mm256_unpacklo_epi32(v[6], v[7]);
    let t7 = _mm256_unpackhi_epi32(v[6], v[7]);
    let u0 = _mm256_unpacklo_epi64(t0, t2);
    let u1 = _mm256_unpackhi_epi64(t0, t2);
    let u2 = _mm256_unpacklo_epi64(t1, t3);
    let u3 = _mm256_unpackhi_epi64(t1, t3);
    let u4 = _mm256_unpacklo_epi64(t4, t6);
    let u5 = _mm256_unpackhi_epi64(t4, t6);
    let u6 = _mm256_unpacklo_epi64(t5, t7);
    let u7 = _mm256_unpackhi_epi64(t5, t7);
    [
        _mm256_permute2x128_si256(u0, u4, 0x20),
        _mm256_permute2x128_si256(u1, u5, 0x20),
        _mm256_permute2x128_si256(u2, u6, 0x20),
        _mm256_permute2x128_si256(u3, u7, 0x20),
        _mm256_permute2x128_si256(u0, u4, 0x31),
        _mm256_permute2x128_si256(u1, u5, 0x31),
        _mm256_permute2x128_si256(u2, u6, 0x31),
        _mm256_permute2x128_si256(u3, u7, 0x31),
    ]
}

/// The whole 8 × 8 blocks of a row-contiguous panel: for rows `r0..r0 + 8` and steps
/// `s0..s0 + 8` (`s0 < whole`, a multiple of 8), `load(r, s0)` gives row r's 8 steps from s0
/// as 32-bit lanes, and the transpose stores step s's 8 rows at `panel[s·w + r0..]`.
///
/// # Safety
/// The CPU must support AVX2, `panel` must hold `whole · w` values, and `load` must read
/// in bounds for every `r < w`, `s0 < whole`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn transpose_panel<T>(
    w: usize,
    whole: usize,
    panel: &mut [T],
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256i,
) {
    use std::arch::x86_64::*;
    assert!(std::mem::size_of::<T>() == 4 && w.is_multiple_of(8) && panel.len() >= whole * w);
    for r0 in (0..w).step_by(8) {
        for s0 in (0..whole).step_by(8) {
            // SAFETY: the stores write steps s0..s0 + 8 <= whole, rows r0..r0 + 8 <= w of
            // `panel` (asserted), 4-byte values; `load` and AVX2 are the caller's guarantee.
            unsafe {
                let v: [__m256i; 8] = std::array::from_fn(|i| load(r0 + i, s0));
                for (i, step) in transpose_8x8_epi32(v).into_iter().enumerate() {
                    _mm256_storeu_si256(panel.as_mut_ptr().add((s0 + i) * w + r0).cast(), step);
                }
            }
        }
    }
}

/// A panel of `w` rows (a multiple of 8) whose k values are contiguous (row r at
/// `x[first + r·rs..][..k]`) into pairs step by step, `panel[s·w + r]`: 8 rows × 8 pairs at
/// a time transposed in registers, the steps past the last whole 8 pair by pair. This is B
/// of `x Wᵀ` (every `linear`) and of `q kᵀ`; spreading it row by row, one pair a store, took
/// a quarter of an attention-score product's time on the Xeon with AMX.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_rows_bf16_avx2(x: &[bf16], first: usize, rs: usize, k: usize, w: usize, panel: &mut [u32]) {
    use std::arch::x86_64::*;
    let steps = k.div_ceil(2);
    // Steps in whole groups of 8 pairs (16 values of each row).
    let whole = k / 16 * 8;
    assert!(w.is_multiple_of(8) && panel.len() >= steps * w);
    assert!(k > 0 && first + (w - 1) * rs + k <= x.len());
    // SAFETY: row r < w reads values 2·s0..2·s0 + 16 <= 2·whole <= k of its k, inside `x`
    // (asserted); AVX2 is the caller's guarantee.
    unsafe {
        transpose_panel(w, whole, panel, |r, s0| _mm256_loadu_si256(x.as_ptr().add(first + r * rs + 2 * s0).cast()))
    };
    for r in 0..w {
        for s in whole..steps {
            panel[s * w + r] = Bf16Pairs::pack_one(x, first + r * rs, 1, s, k);
        }
    }
}

/// [`pack_rows_bf16_avx2`] for f16 widened to f32, one k per step: 8 values of each of 8
/// rows widened by F16C and transposed in registers, the k past the last whole 8 one by one.
/// This is A of every f16 product with row-major A (activations, `dy`) and B of `x Wᵀ` and
/// `q kᵀ`.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn pack_rows_f16_avx2(x: &[f16], first: usize, rs: usize, k: usize, w: usize, panel: &mut [f32]) {
    use std::arch::x86_64::*;
    let whole = k / 8 * 8;
    assert!(w.is_multiple_of(8) && panel.len() >= k * w);
    assert!(k > 0 && first + (w - 1) * rs + k <= x.len());
    // SAFETY: row r < w reads values s0..s0 + 8 <= whole <= k of its k, inside `x` (asserted;
    // f16 is a plain u16); AVX2 and F16C are the caller's guarantee.
    unsafe {
        transpose_panel(w, whole, panel, |r, s0| {
            let h = _mm_loadu_si128(x.as_ptr().add(first + r * rs + s0).cast());
            _mm256_castps_si256(_mm256_cvtph_ps(h))
        })
    };
    for r in 0..w {
        for s in whole..k {
            panel[s * w + r] = x[first + r * rs + s].to_f32();
        }
    }
}

/// Packs `rows × k` of `x` into the front of `out` (grown if short; every element of the
/// front written, so stale contents do not matter) as panels of `W` rows: panel i, step s, row r at `[(i * steps + s) * W + r]`.
/// Rows past `rows` and the pad of a last odd pair are zero.
fn pack<K: Kernel, const W: usize>(
    rows: usize,
    k: usize,
    x: Operand<'_, K::In>,
    parallel: bool,
    out: &mut Vec<K::Packed>,
) {
    let steps = k.div_ceil(K::K_STEP);
    // Grow only: shrinking and regrowing would zero-fill the regrown part on every product
    // whose shapes alternate (training steps do).
    let len = rows.div_ceil(W) * W * steps;
    let out = aligned_front(out, len, K::ZERO);
    if rows == 0 || steps == 0 {
        return;
    }
    let last = x.offset + (rows - 1) * x.rs + (k - 1) * x.cs;
    assert!(last < x.data.len(), "native GEMM operand out of bounds");
    // The packing loops are compiled for the dispatched SIMD level.
    let fill = |i: usize, panel: &mut [K::Packed]| {
        crate::simd::dispatch(
            #[inline(always)]
            || {
                let live = W.min(rows - i * W);
                let first = x.offset + i * W * x.rs;
                if live < W {
                    for dst in panel.chunks_exact_mut(W) {
                        dst[live..].fill(K::ZERO);
                    }
                }
                if x.cs == 1 {
                    // Each row's k values are contiguous: a whole panel at once where the
                    // kernel can, else row by row.
                    if live == W && K::pack_rows(x.data, first, x.rs, k, W, panel) {
                        return;
                    }
                    for r in 0..live {
                        let row = &x.data[first + r * x.rs..][..k];
                        K::pack_row(row, &mut panel[r..], W);
                    }
                } else {
                    let firsts: [usize; W] = std::array::from_fn(|r| first + r.min(live - 1) * x.rs);
                    for (s, dst) in panel.chunks_exact_mut(W).enumerate() {
                        for (d, &f) in dst[..live].iter_mut().zip(&firsts) {
                            *d = K::pack_one(x.data, f, x.cs, s, k);
                        }
                    }
                }
            },
        )
    };
    // Panels whose rows are adjacent in memory (row stride 1: each k one contiguous run of W
    // elements; B of `x·W` and of `dyᵀ·h`, read as Bᵀ) are packed a group at a time, one group
    // per thread, the steps of all the group's panels block by block: each source row is then
    // read in runs of the group's width. (Panel by panel, a panel read 64 bytes of every row,
    // rows 2 KiB apart: W2's `h` [2048, 1024] took 370 us to pack, against 180.)
    let panels = rows.div_ceil(W);
    let full = rows / W;
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    let per_group = if x.rs == 1 { panels.div_ceil(threads) } else { 1 };
    let group = |g: usize, dst: &mut [K::Packed]| {
        let i0 = g * per_group;
        let in_group = dst.len() / (steps * W);
        let adjacent = if x.rs == 1 { full.saturating_sub(i0).min(in_group) } else { 0 };
        if adjacent > 0 {
            crate::simd::dispatch(
                #[inline(always)]
                || {
                    for s0 in (0..steps).step_by(STEP_BLOCK) {
                        for p in 0..adjacent {
                            let first = x.offset + (i0 + p) * W;
                            let run = |j: usize| &x.data[first + j * x.cs..][..W];
                            let panel = &mut dst[p * steps * W..][..steps * W];
                            for s in s0..steps.min(s0 + STEP_BLOCK) {
                                let j = s * K::K_STEP;
                                let hi = (K::K_STEP == 2 && j + 1 < k).then(|| run(j + 1));
                                K::pack_run(run(j), hi, &mut panel[s * W..][..W]);
                            }
                        }
                    }
                },
            );
        }
        for (p, panel) in dst.chunks_mut(steps * W).enumerate().skip(adjacent) {
            fill(i0 + p, panel);
        }
    };
    if parallel {
        out.par_chunks_mut(per_group * steps * W).enumerate().for_each(|(g, p)| group(g, p));
    } else {
        out.chunks_mut(per_group * steps * W).enumerate().for_each(|(g, p)| group(g, p));
    }
}

/// Steps per panel packed at a time in [`pack`]'s groups of panels: each panel's stores run
/// `STEP_BLOCK · W` values in order before the next panel's (W2's `h`: 8 steps, 1 KiB, packed
/// in 180 us against 205 step by step).
const STEP_BLOCK: usize = 8;

/// The accumulators of an MR × NR tile at their start: the tile's f32 values (`c`, rows `ldc`
/// apart), zero, or the same NR bias values in every row.
///
/// # Safety
/// The CPU must support avx512f; for [`Start::Sums`], `c` must be readable at `r * ldc + j`
/// for r < MR, j < NR; for [`Start::Bias`], its pointer for NR floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn start_tile(c: *const f32, ldc: usize, start: Start) -> [[std::arch::x86_64::__m512; 2]; MR] {
    use std::arch::x86_64::*;
    // SAFETY: every load is inside what the contract says is readable.
    unsafe {
        match start {
            Start::Zero => [[_mm512_setzero_ps(); 2]; MR],
            Start::Bias(bias) => [[_mm512_loadu_ps(bias), _mm512_loadu_ps(bias.add(16))]; MR],
            Start::Sums => {
                std::array::from_fn(|r| [_mm512_loadu_ps(c.add(r * ldc)), _mm512_loadu_ps(c.add(r * ldc + 16))])
            }
        }
    }
}

/// The bf16 register-blocked kernel: 2·MR zmm accumulators, two B vectors per pair, A pairs
/// broadcast from memory. The pair of step p, row r is the (possibly unaligned) u32 at byte
/// `r * a_row + p * a_step` of `a`: packed panels and rows read in place use the same code.
///
/// # Safety
/// The CPU must support avx512f and avx512bf16; `a` must be readable for 4 bytes at
/// `r * a_row + p * a_step` for r < MR, p < kc; `b` for `kc * NR` u32; `c` readable and
/// writable at `r * ldc + j` for r < MR, j < NR; and a [`Start::Bias`] readable for NR floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)] // the tile's operands, strides and start
unsafe fn micro_bf16(
    kc: usize,
    a: *const u8,
    a_row: usize,
    a_step: usize,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    start: Start,
) {
    use std::arch::x86_64::*;
    // SAFETY: per the contract.
    let mut acc = unsafe { start_tile(c, ldc, start) };
    for p in 0..kc {
        // SAFETY: p < kc, so p·NR + 32 ≤ kc·NR stays inside `b`, and each A pair is inside `a`
        // per the contract; __m512i and __m512bh are both 64-byte vectors for which every bit
        // pattern is valid.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = a.add(r * a_row + p * a_step).cast::<i32>().read_unaligned();
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: as for the loads above.
        unsafe {
            _mm512_storeu_ps(c.add(r * ldc), acc[0]);
            _mm512_storeu_ps(c.add(r * ldc + 16), acc[1]);
        }
    }
}

/// The f32 register-blocked kernel over widened f16: 2·MR zmm accumulators, two B vectors
/// per k, A values broadcast from memory, one FMA each.
///
/// # Safety
/// The CPU must support avx512f; `a` must be readable for `kc * MR` f32, `b` for `kc * NR`,
/// `c` readable and writable at `r * ldc + j` for r < MR, j < NR; and a [`Start::Bias`]
/// readable for NR floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_f32(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, start: Start) {
    use std::arch::x86_64::*;
    // SAFETY: per the contract.
    let mut acc = unsafe { start_tile(c, ldc, start) };
    for p in 0..kc {
        // SAFETY: p < kc, so p·NR + 32 ≤ kc·NR and p·MR + MR ≤ kc·MR stay inside `b` and `a`.
        unsafe {
            let b0 = _mm512_loadu_ps(b.add(p * NR));
            let b1 = _mm512_loadu_ps(b.add(p * NR + 16));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(p * MR + r));
                acc[0] = _mm512_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(av, b1, acc[1]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: as for the loads above.
        unsafe {
            _mm512_storeu_ps(c.add(r * ldc), acc[0]);
            _mm512_storeu_ps(c.add(r * ldc + 16), acc[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;

    /// Random values in [-2, 2) from a fixed LCG, so every case is reproducible.
    fn values<E: Precision>(len: usize, seed: u64) -> Vec<E> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                E::from_f64(((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0)
            })
            .collect()
    }

    /// Stored significand bits (after the leading one) of `E`.
    fn mantissa_bits<E: Precision>() -> i32 {
        if E::DTYPE == DType::BF16 { 7 } else { 10 }
    }

    /// One unit in the last place of `E` at |x|.
    fn ulp<E: Precision>(x: f64) -> f64 {
        let b = E::from_f64(x).to_f64().abs().max(f64::MIN_POSITIVE);
        2f64.powi(b.log2().floor() as i32 - mantissa_bits::<E>())
    }

    /// Checks `a @ b` (+ bias) through both paths for one shape and layout. `ta`/`tb` store
    /// the operand transposed (column-major), so packing reads strided views.
    fn case<E: Precision>(m: usize, k: usize, n: usize, ta: bool, tb: bool, with_bias: bool) {
        let a = values::<E>(m * k + 3, (m * 31 + k * 7 + n) as u64);
        let b = values::<E>(k * n + 5, (m + k * 13 + n * 17) as u64);
        let bias = values::<E>(n, 99);
        let (a_rs, a_cs) = if ta { (1, m) } else { (k, 1) };
        let (b_rs, b_cs) = if tb { (1, k) } else { (n, 1) };
        // An offset of 2 into A and 1 into B, so offsets are exercised too.
        let a_at = |i: usize, p: usize| a[2 + i * a_rs + p * a_cs].to_f64();
        let b_at = |p: usize, j: usize| b[1 + p * b_rs + j * b_cs].to_f64();
        let mut want64 = vec![0f64; m * n];
        let mut want32 = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let (mut s64, mut s32) =
                    if with_bias { (bias[j].to_f64(), bias[j].to_f64() as f32) } else { (0.0, 0.0) };
                for p in 0..k {
                    s64 += a_at(i, p) * b_at(p, j);
                    s32 += (a_at(i, p) * b_at(p, j)) as f32;
                }
                want64[i * n + j] = s64;
                want32[i * n + j] = s32;
            }
        }
        let la = Layout { shape: vec![m, k], strides: vec![a_rs, a_cs], offset: 2 };
        let lb = Layout { shape: vec![k, n], strides: vec![b_rs, b_cs], offset: 1 };
        let wt = Layout { shape: vec![n, k], strides: vec![b_cs, b_rs], offset: 1 };
        let run = |native: bool| {
            if with_bias {
                super::super::matmul::linear_with(&a, &la, &b, &wt, Some(&bias), native)
            } else {
                super::super::matmul::matmul_with(&a, &la, &b, &lb, &[], native)
            }
        };
        let mut paths = vec![("fallback", run(false))];
        if available::<E>() {
            if super::super::amx::available() {
                paths.push(("amx", run(true)));
                NO_AMX.with(|c| c.set(true));
                paths.push(("avx512", run(true)));
                NO_AMX.with(|c| c.set(false));
            } else {
                paths.push(("native", run(true)));
            }
        }
        for (name, got) in paths {
            // The f16 split on AMX sums 4k exact products ([`super::super::amx_f16`]).
            let terms = if name == "amx" && E::DTYPE == DType::F16 { 4 * k } else { k };
            assert_eq!(got.len(), m * n);
            for (idx, g) in got.iter().enumerate() {
                let (g, w64, w32) = (g.to_f64(), want64[idx], want32[idx] as f64);
                // f32 accumulation in any order errs by at most k·2⁻²⁴·Σ|a·b| (+ the bias).
                let mag: f64 = (0..k).map(|p| (a_at(idx / n, p) * b_at(p, idx % n)).abs()).sum::<f64>() + 2.0;
                let f32_err = (terms as f64 + 1.0) * 2f64.powi(-24) * mag;
                let e = E::DTYPE;
                assert!(
                    (g - w64).abs() <= 0.5 * ulp::<E>(w64) + f32_err + 1e-30,
                    "{e} {name} {m}x{k}x{n} ta={ta} tb={tb} bias={with_bias} [{idx}]: {g} vs f64 {w64}"
                );
                // And equal to one f32 accumulate-then-round within one ulp.
                let r32 = E::from_f64(w32).to_f64();
                assert!(
                    (g - r32).abs() <= ulp::<E>(r32) + f32_err,
                    "{e} {name} {m}x{k}x{n} [{idx}]: {g} vs f32-then-round {r32}"
                );
            }
        }
    }

    fn shapes_layouts_and_bias<E: Precision>() {
        let shapes = [
            (1, 1, 1),
            (1, 0, 1),
            (4, 0, 3),
            (3, 1000, 5),
            (7, 3, 9),
            (9, 33, 31),
            (8, 2, 32),
            (17, 1, 65),
            (64, 5, 96),
            (64, 6, 96),
            (17, 40, 33),
            (257, 129, 67),
            (1, 300, 600),
            (100, 257, 1),
            // AMX: whole 32-row blocks, ragged ones, k with and without a tail of pairs
            // past the last 16, k past one cache block of 256 pairs.
            (64, 32, 32),
            (96, 66, 64),
            (33, 288, 40),
            (128, 576, 64),
            // The f16 split on AMX (at least 128 rows and columns, k at least 32): whole and
            // partial groups of 16 k values, k past one cache block of 128.
            (128, 32, 128),
            (160, 37, 129),
            (129, 130, 160),
        ];
        for &(m, k, n) in &shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                case::<E>(m, k, n, ta, tb, false);
            }
            case::<E>(m, k, n, false, true, true);
            case::<E>(m, k, n, true, false, true);
        }
    }

    /// Small and ragged shapes, every operand layout (the contiguous-run pack of a transposed
    /// operand; bf16's in-place rows of a row-major A with even k, with and without a ragged
    /// last panel), with and without bias.
    #[test]
    fn shapes_layouts_and_bias_match_reference() {
        shapes_layouts_and_bias::<bf16>();
        shapes_layouts_and_bias::<f16>();
    }

    /// Large enough to take the parallel path, several k and column blocks, ragged edges.
    #[test]
    fn blocked_parallel_product() {
        case::<bf16>(203, 600, 1100, false, false, false);
        case::<bf16>(130, 301, 520, true, true, true);
        // AMX: more tasks than threads, each packing its own rows of A, the last one ragged.
        case::<bf16>(600, 96, 100, false, false, true);
        case::<bf16>(600, 96, 100, true, false, false);
        case::<f16>(203, 300, 1100, false, false, false);
        case::<f16>(130, 301, 520, true, true, true);
    }

    /// Says which native kernels this CPU runs in these tests and which it skips.
    #[test]
    fn reports_the_kernels_tested_here() {
        let amx = super::super::amx::available();
        let bf16 = Bf16Pairs::available();
        let f16 = F16Widened::available();
        let split = amx && f16 && super::super::amx_f16::supported();
        for (name, runs) in [
            ("AMX-BF16 tiles", amx),
            ("AVX-512 BF16 vdpbf16ps", bf16),
            ("f16 widened, AVX-512F", f16),
            ("f16 split into bf16 parts on AMX tiles", split),
        ] {
            if runs {
                eprintln!("tested: {name}");
            } else {
                eprintln!("SKIPPED: {name} kernel (this CPU or OS does not offer it)");
            }
        }
        // A kernel the CPU reports is one the tests ran: AMX needs the vdpbf16ps tails.
        assert!(!amx || bf16);
    }

    /// Batched, broadcast matmul through the native path matches the fallback per batch.
    fn batched<E: Precision>() {
        let a = values::<E>(3 * 5 * 7, 1);
        let b = values::<E>(7 * 4, 2);
        let la = Layout::contiguous(&[3, 5, 7]);
        let lb = Layout { shape: vec![1, 7, 4], strides: vec![0, 1, 7], offset: 0 };
        let native = super::super::matmul::matmul_with(&a, &la, &b, &lb, &[3], true);
        let fallback = super::super::matmul::matmul_with(&a, &la, &b, &lb, &[3], false);
        assert_eq!(native.len(), 3 * 5 * 4);
        for (x, y) in native.iter().zip(&fallback) {
            let (x, y) = (x.to_f64(), y.to_f64());
            assert!((x - y).abs() <= ulp::<E>(y) * 1.01, "{}: {x} vs {y}", E::DTYPE);
        }
    }

    #[test]
    fn batched_native_matches_fallback() {
        batched::<bf16>();
        batched::<f16>();
    }

    /// f16 products keep f32 accumulation: 4096 ones sum to 4096, where an f16 accumulator
    /// sticks at 2048 (gemm's own f16 kernel did).
    #[test]
    fn f16_accumulates_in_f32() {
        let ones = vec![f16::ONE; 4096];
        let la = Layout::contiguous(&[1, 4096]);
        let lb = Layout::contiguous(&[4096, 1]);
        let got = super::super::matmul::matmul_with(&ones, &la, &ones, &lb, &[], true);
        assert_eq!(got[0].to_f64(), 4096.0);
    }

    /// An infinity or NaN in an f16 operand gives what IEEE f32 arithmetic gives (inf · 0 in
    /// the split products would make NaN of ±inf): the AMX split hands such products to the
    /// widening kernel. Also at every position of A and B, every layout.
    #[test]
    fn f16_non_finite_inputs_keep_ieee_results() {
        let (m, k, n) = (130, 40, 140);
        for bad in [f16::INFINITY, f16::NEG_INFINITY, f16::NAN] {
            for (in_a, at) in [(true, 0), (true, m * k - 1), (false, 7), (false, k * n - 1)] {
                let mut a = values::<f16>(m * k, 1);
                let mut b = values::<f16>(k * n, 2);
                // Zeros in B's and A's low parts: values exact in bf16.
                b.iter_mut().step_by(3).for_each(|v| *v = f16::from_f32(0.5));
                a.iter_mut().step_by(3).for_each(|v| *v = f16::from_f32(0.25));
                if in_a {
                    a[at] = bad
                } else {
                    b[at] = bad
                }
                for tb in [false, true] {
                    let la = Layout::contiguous(&[m, k]);
                    let lb = if tb {
                        Layout { shape: vec![k, n], strides: vec![1, k], offset: 0 }
                    } else {
                        Layout::contiguous(&[k, n])
                    };
                    let native = super::super::matmul::matmul_with(&a, &la, &b, &lb, &[], true);
                    let fallback = super::super::matmul::matmul_with(&a, &la, &b, &lb, &[], false);
                    for (i, (x, y)) in native.iter().zip(&fallback).enumerate() {
                        let (x, y) = (x.to_f64(), y.to_f64());
                        let same = if y.is_finite() {
                            (x - y).abs() <= ulp::<f16>(y) * 1.01
                        } else {
                            x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan()
                        };
                        assert!(
                            same,
                            "{bad} in {} at {at}, tb={tb}, out [{i}]: {x} vs {y}",
                            if in_a { "A" } else { "B" }
                        );
                    }
                }
            }
        }
    }

    /// The SIMD interleave and its scalar tail give the pairs of the definition at every length.
    #[test]
    fn interleave_pairs_matches_its_definition() {
        let lo = values::<bf16>(41, 11);
        let hi = values::<bf16>(41, 12);
        for n in 0..=41 {
            let mut got = vec![0u32; n];
            interleave_pairs(&lo[..n], &hi[..n], &mut got);
            let want: Vec<u32> = (0..n).map(|i| lo[i].to_bits() as u32 | (hi[i].to_bits() as u32) << 16).collect();
            assert_eq!(got, want, "{n} pairs");
        }
    }

    /// The instruction rounding of AMX outputs gives the software rounding's bits on every
    /// value that is not subnormal: ties both ways, values that round up to infinity,
    /// infinities, NaNs (quieted alike), zeros, random normals, every tail length.
    #[test]
    fn instruction_rounding_matches_software_off_subnormals() {
        if !Bf16Pairs::available() {
            eprintln!("SKIPPED: vcvtne2ps2bf16 rounding (no AVX-512 BF16 on this CPU)");
            return;
        }
        let mut src: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x3F80_8001),
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFFC1_2345),
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
        ];
        src.extend(values::<f32>(200, 5).iter().map(|x| x * 1e3));
        for len in [src.len(), 47, 32, 31, 16, 15, 0] {
            let src = &src[..len];
            let mut fast = vec![bf16::ZERO; len];
            let mut soft = vec![bf16::ZERO; len];
            round_ftz_output(src, &mut fast, true);
            <bf16 as Precision>::from_f32_slice(src, &mut soft);
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&soft), "{len} values");
        }
    }

    /// f32 and f64 are refused, so the caller keeps its own path.
    #[test]
    fn refuses_other_types() {
        let x = [1f32; 4];
        let op = Operand { data: &x[..], offset: 0, rs: 2, cs: 1 };
        let mut out = [0f32; 4];
        assert!(!gemm((2, 2, 2), op, op, None, &mut out, false));
        assert_eq!(out, [0.0; 4]);
    }
}
