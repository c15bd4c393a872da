//! `impl amp_core::Device for Cuda`: every kernel of the backend trait on the GPU.
//!
//! Design notes:
//! - Elementwise maps, casts, copies, `where`, dropout and the checks read strided and
//!   broadcast views in place (shape and strides go to the kernel); the fused row kernels,
//!   reductions, GEMM operands that are neither row- nor column-major, convolution, pooling,
//!   batch norm and the gathers take a contiguous copy of a strided input first, as the CPU
//!   backend does.
//! - Outputs come from the caching allocator uninitialised when the kernel writes every
//!   element, zeroed (an async memset) when it does not.
//! - Index data (targets, ids, masks, selection indices) lives on the host (`amp_core::Indices`)
//!   and is uploaded per call; results the trait returns to the host (arg-reduce indices, the
//!   non-finite flag, the sum of squares) are read back, which waits for the stream.
//! - In-place methods check that they own their storage alone, as the CPU backend does.

use std::any::TypeId;
use std::sync::Arc;

use amp_core::backend::{
    AdamArgs, AdamDecay, AttentionSpec, BatchNormStats, Bf16Write, BinaryOp, Conv2dSpec, CrossEntropySpec, Device,
    DimSplit, Lazy, Outcomes, Pool2dSpec, PoolWindow, ReduceOp, Scalar, ScaleRule, SgdArgs, UnaryOp,
};
use amp_core::layout::Layout;
use amp_core::optim::STEPS_PER_READ;
use amp_core::{DType, Precision};
use cudarc::driver::{DeviceRepr, LaunchConfig, result};

use crate::device::{Cuda, ModuleKey, State};
use crate::gemm::{self, Mat, as_operand, rm_gemm};
use crate::kernels::{self, Family};
use crate::launch::{
    broadcast_strides, dropout_launch, grid, launch, map_mode, reduce_parts, row_cache, rows_grid, vector_rows, view1,
    views, warp_rows_grid, warp_vectors,
};
use crate::profile::Span;
use crate::storage::{CudaRowStats, CudaStateVec, CudaStorage, RawVec, StatsKind};

/// Whether a GEMM operand (`r × c` matrices, batch dims broadcast to `batch`) goes to cuBLAS
/// as a contiguous copy: when its matrix strides do not fit ([`as_operand`]), or when its
/// products are not a uniform stride apart and a copy's would be (W2's `q`, a narrow of a
/// permuted `qkv`: one copy, then one strided-batched call instead of one call per product).
fn needs_copy(v: &Strided, r: usize, c: usize, batch: &[usize]) -> bool {
    let rank = v.shape.len();
    as_operand(r, c, v.strides[rank - 2], v.strides[rank - 1]).is_none()
        || (uniform_step(&batch_offsets(v, batch)).is_none()
            && uniform_step(&batch_offsets(&contiguous_view(v), batch)).is_some())
}

/// `v`'s shape, contiguous from offset 0: a copy's view.
fn contiguous_view(v: &Strided) -> Strided {
    Strided { shape: v.shape.clone(), strides: amp_core::layout::contiguous_strides(&v.shape), offset: 0 }
}

/// Where each product's matrix of a GEMM operand starts, in batch order (its batch dims
/// broadcast to `batch`, a broadcast dim at stride 0).
fn batch_offsets(v: &Strided, batch: &[usize]) -> Vec<usize> {
    let r = v.shape.len();
    let pad = batch.len() - (r - 2);
    let bstr: Vec<usize> =
        (0..batch.len()).map(|d| if d < pad || v.shape[d - pad] == 1 { 0 } else { v.strides[d - pad] }).collect();
    (0..batch.iter().product())
        .map(|i| {
            let (mut off, mut rest) = (v.offset, i);
            for d in (0..batch.len()).rev() {
                off += (rest % batch[d]) * bstr[d];
                rest /= batch[d];
            }
            off
        })
        .collect()
}

/// The one stride between consecutive offsets, if there is one (0 for a single product).
fn uniform_step(o: &[usize]) -> Option<usize> {
    let step = if o.len() > 1 { o[1].checked_sub(o[0])? } else { 0 };
    o.iter().enumerate().all(|(i, &x)| x == o[0] + i * step).then_some(step)
}

/// A strided view that need not be a [`Layout`] (a weight seen transposed, for GEMM).
#[derive(Clone, Debug)]
struct Strided {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

impl From<&Layout> for Strided {
    fn from(l: &Layout) -> Self {
        Strided { shape: l.shape().to_vec(), strides: l.strides().to_vec(), offset: l.offset() }
    }
}

/// Whether `strides` walk `shape` row-major contiguously (size-1 dims may have any stride).
fn dense(shape: &[usize], strides: &[usize]) -> bool {
    let mut expected = 1;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected *= d;
    }
    true
}

fn acc_dtype(d: DType) -> DType {
    if d == DType::F64 { DType::F64 } else { DType::F32 }
}

/// A chunk of the multi-tensor unscale pass (the kernel's `AmpChunk`).
#[repr(C)]
#[derive(Clone, Copy)]
struct AmpChunk {
    ptr: u64,
    len: i64,
    flag: i64,
}

/// The convolution's sizes (the kernel's `AmpConvGeom`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ConvGeom {
    n: i64,
    c_in: i64,
    c_out: i64,
    g: i64,
    cg: i64,
    og: i64,
    k: i64,
    h: i64,
    w: i64,
    kh: i64,
    kw: i64,
    oh: i64,
    ow: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    dh: i64,
    dw: i64,
}

impl ConvGeom {
    fn of(s: &Conv2dSpec) -> Self {
        let i = |v: usize| v as i64;
        ConvGeom {
            n: i(s.batch),
            c_in: i(s.in_channels),
            c_out: i(s.out_channels),
            g: i(s.groups),
            cg: i(s.group_in()),
            og: i(s.group_out()),
            k: i(s.group_in() * s.kernel.0 * s.kernel.1),
            h: i(s.input.0),
            w: i(s.input.1),
            kh: i(s.kernel.0),
            kw: i(s.kernel.1),
            oh: i(s.output.0),
            ow: i(s.output.1),
            sh: i(s.stride.0),
            sw: i(s.stride.1),
            ph: i(s.padding.0),
            pw: i(s.padding.1),
            dh: i(s.dilation.0),
            dw: i(s.dilation.1),
        }
    }
}

/// The pooling geometry (the kernel's `AmpPoolGeom`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PoolGeom {
    planes: i64,
    h: i64,
    w: i64,
    oh: i64,
    ow: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    adaptive: i32,
    pad: i32,
}

impl PoolGeom {
    fn of(s: &Pool2dSpec) -> Self {
        let i = |v: usize| v as i64;
        let (k, st, p, adaptive) = match s.window {
            PoolWindow::Fixed { kernel, stride, padding } => (kernel, stride, padding, 0),
            PoolWindow::Adaptive => ((0, 0), (1, 1), (0, 0), 1),
        };
        PoolGeom {
            planes: i(s.planes),
            h: i(s.input.0),
            w: i(s.input.1),
            oh: i(s.output.0),
            ow: i(s.output.1),
            kh: i(k.0),
            kw: i(k.1),
            sh: i(st.0),
            sw: i(st.1),
            ph: i(p.0),
            pw: i(p.1),
            adaptive,
            pad: 0,
        }
    }
}

/// The step-dependent SGD scalars of every row (the kernel's `AmpSgdRows`; see
/// `amp_core::backend::Outcomes`): one per count of applied steps a window can be at.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SgdRows {
    neg_lr: [f32; STEPS_PER_READ],
    first: [i32; STEPS_PER_READ],
}

/// The step-dependent Adam scalars of every row (the kernel's `AmpAdamRows`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AdamRows {
    neg_step_size: [f32; STEPS_PER_READ],
    bc2_sqrt: [f32; STEPS_PER_READ],
    decay_mul: [f32; STEPS_PER_READ],
}

/// Checks the rows an optimizer update was given: 1 to `STEPS_PER_READ` of them, differing only
/// where the kernel reads a row (everything else is taken from the first).
fn check_rows<T: PartialEq + std::fmt::Debug>(rows: &[T], same: impl Fn(&T) -> T) {
    assert!(
        (1..=STEPS_PER_READ).contains(&rows.len()),
        "backend invariant: an optimizer update with {} argument rows (1 to {STEPS_PER_READ})",
        rows.len()
    );
    let first = same(&rows[0]);
    assert!(rows.iter().all(|r| same(r) == first), "backend invariant: optimizer rows differ outside their row fields");
}

impl SgdRows {
    fn of(rows: &[SgdArgs]) -> Self {
        check_rows(rows, |r| SgdArgs { neg_lr: 0.0, first: false, ..*r });
        let mut t = SgdRows { neg_lr: [0.0; STEPS_PER_READ], first: [0; STEPS_PER_READ] };
        for (i, r) in rows.iter().enumerate() {
            (t.neg_lr[i], t.first[i]) = (r.neg_lr, r.first as i32);
        }
        t
    }
}

impl AdamRows {
    fn of(rows: &[AdamArgs]) -> Self {
        let decay_kind = |d: AdamDecay| match d {
            AdamDecay::Decoupled(_) => AdamDecay::Decoupled(0.0),
            other => other,
        };
        check_rows(rows, |r| AdamArgs {
            neg_step_size: 0.0,
            bias_correction2_sqrt: 0.0,
            decay: decay_kind(r.decay),
            ..*r
        });
        let mut t = AdamRows {
            neg_step_size: [0.0; STEPS_PER_READ],
            bc2_sqrt: [0.0; STEPS_PER_READ],
            decay_mul: [1.0; STEPS_PER_READ],
        };
        for (i, r) in rows.iter().enumerate() {
            t.neg_step_size[i] = r.neg_step_size;
            t.bc2_sqrt[i] = r.bias_correction2_sqrt;
            if let AdamDecay::Decoupled(m) = r.decay {
                t.decay_mul[i] = m;
            }
        }
        t
    }
}

// SAFETY: all three are `#[repr(C)]` structs of plain integers whose field order, types and
// padding match the kernels' structs of the same names; they are passed by value.
unsafe impl DeviceRepr for AmpChunk {}
// SAFETY: `#[repr(C)]` arrays of f32 and i32 of `STEPS_PER_READ` elements, the layout of the
// kernel's `AmpSgdRows` (no padding: both are 4-byte types), passed by value; the kernel's
// `AMP_STEP_ROWS` is checked to equal `STEPS_PER_READ` by a test.
unsafe impl DeviceRepr for SgdRows {}
// SAFETY: as above, three f32 arrays, the kernel's `AmpAdamRows`.
unsafe impl DeviceRepr for AdamRows {}
// SAFETY: as above.
unsafe impl DeviceRepr for ConvGeom {}
// SAFETY: as above.
unsafe impl DeviceRepr for PoolGeom {}

/// Column matrices of at most this many bytes are built at a time by the convolution.
const CONV_COLS_BYTES: usize = 256 << 20;

/// Elements per chunk of the multi-tensor unscale pass (one block each).
const UNSCALE_CHUNK: usize = 64 * 1024;

impl Cuda {
    fn st(&self) -> &Arc<State> {
        let st = self.state();
        st.enter();
        st
    }

    fn uninit<E: Precision>(&self, n: usize) -> CudaStorage<E> {
        CudaStorage::uninit(self.state(), n)
    }

    fn memset_zero(&self, ptr: u64, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let st = self.st();
        let span = Span::begin(st);
        // SAFETY: `ptr` addresses a live block of at least `bytes` bytes on this device; the
        // memset is ordered on the device's stream after every earlier use.
        let r = unsafe { result::memset_d8_async(ptr, 0, bytes, st.stream.cu_stream()) };
        st.check("cuMemsetD8Async", r);
        span.end(st, || "memset".into());
    }

    fn zeros<E: Precision>(&self, n: usize) -> CudaStorage<E> {
        let s = self.uninit::<E>(n);
        self.memset_zero(s.ptr(), n * E::DTYPE.size_in_bytes());
        s
    }

    /// Copies host data into a fresh device vector (elements of `size_of::<T>()` bytes).
    fn upload<T: Copy>(&self, data: &[T]) -> RawVec {
        let st = self.st();
        let v = RawVec::new(st, data.len(), size_of::<T>());
        if !data.is_empty() {
            let span = Span::begin(st);
            // SAFETY: the block holds `size_of_val(data)` bytes; the copy from pageable host
            // memory returns once `data` has been staged, so it may be dropped afterwards.
            let r = unsafe { result::memcpy_htod_async(v.ptr(), data, st.stream.cu_stream()) };
            st.check("cuMemcpyHtoDAsync", r);
            span.end(st, || "memcpy_htod".into());
        }
        v
    }

    /// Reads `n` elements at `ptr` back to the host (waits for the stream).
    fn download<T: Copy + Default>(&self, ptr: u64, n: usize) -> Vec<T> {
        let mut out = vec![T::default(); n];
        if n == 0 {
            return out;
        }
        let st = self.st();
        st.waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `ptr` addresses at least `n` initialised elements of `T` written by earlier
        // work on this stream; `out` is valid for `n` writes and lives until the stream is
        // synchronised below.
        let r = unsafe { result::memcpy_dtoh_async(&mut out, ptr, st.stream.cu_stream()) };
        st.check("cuMemcpyDtoHAsync", r);
        st.check("cuStreamSynchronize", st.stream.synchronize());
        out
    }

    fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let st = self.st();
        let span = Span::begin(st);
        // SAFETY: both addresses are in live blocks with `bytes` bytes from them; ordered on
        // the device's stream.
        let r = unsafe { result::memcpy_dtod_async(dst, src, bytes, st.stream.cu_stream()) };
        st.check("cuMemcpyDtoDAsync", r);
        span.end(st, || "memcpy_dtod".into());
    }

    /// A contiguous copy of a strided view.
    fn copy_strided<E: Precision>(&self, s: &CudaStorage<E>, v: &Strided) -> CudaStorage<E> {
        let n: usize = v.shape.iter().product();
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        if dense(&v.shape, &v.strides) {
            self.copy_dtod(out.ptr(), s.ptr_at(v.offset), n * E::DTYPE.size_in_bytes());
            return out;
        }
        let st = self.st();
        let (shape, vs) = views("contiguous", &v.shape, &[(v.offset, v.strides.clone())]);
        let f = st.family_fn(Family::Copy, E::DTYPE, "copy_fwd");
        launch!(st, f, grid(n); out.ptr(), s.ptr(), shape, vs[0], n as i64);
        out
    }

    /// The view as contiguous data: `(storage, element offset)`, copied only when strided.
    fn contig<E: Precision>(&self, s: &CudaStorage<E>, l: &Layout) -> (CudaStorage<E>, usize) {
        if l.is_contiguous() { (s.clone(), l.offset()) } else { (self.copy_strided(s, &l.into()), 0) }
    }

    /// The address of a contiguous copy of the view (kept alive in `keep`).
    fn contig_ptr<E: Precision>(&self, v: (&CudaStorage<E>, &Layout), keep: &mut Vec<CudaStorage<E>>) -> u64 {
        let (s, off) = self.contig(v.0, v.1);
        let p = s.ptr_at(off);
        keep.push(s);
        p
    }

    /// `n` elements at `ptr` of precision `src` rounded into `T` (a new storage).
    fn cast_ptr<T: Precision>(&self, ptr: u64, src: DType, n: usize) -> CudaStorage<T> {
        let out = self.uninit::<T>(n);
        if n == 0 {
            return out;
        }
        if src == T::DTYPE {
            self.copy_dtod(out.ptr(), ptr, n * src.size_in_bytes());
            return out;
        }
        let st = self.st();
        let (shape, vs) = views("cast", &[n], &[(0, vec![1])]);
        let f = st.function(
            ModuleKey::Cast(src, T::DTYPE),
            || kernels::cast(src, T::DTYPE),
            &kernels::cast_kernel(src, T::DTYPE),
        );
        launch!(st, f, grid(n); out.ptr(), ptr, shape, vs[0], n as i64, 1i32);
        out
    }

    /// Row-major batched `C = A·B` into `out` (contiguous `[batch…, m, n]` of precision
    /// `out_dtype`, `beta` times what it holds added), the operands strided views of precision
    /// `E` with broadcast batch dims.
    #[allow(clippy::too_many_arguments)]
    fn matmul_into<E: Precision>(
        &self,
        a: (&CudaStorage<E>, &Strided),
        b: (&CudaStorage<E>, &Strided),
        batch: &[usize],
        out: u64,
        out_dtype: DType,
        beta: f64,
    ) {
        let st = self.st();
        let (ra, rb) = (a.1.shape.len(), b.1.shape.len());
        let (m, k, n) = (a.1.shape[ra - 2], a.1.shape[ra - 1], b.1.shape[rb - 1]);
        let nb: usize = batch.iter().product();
        if m * n * nb == 0 {
            return;
        }
        if k == 0 {
            if beta == 0.0 {
                self.memset_zero(out, nb * m * n * out_dtype.size_in_bytes());
            }
            return;
        }
        // Operands cuBLAS cannot take as they are become contiguous copies.
        let fit = |s: &CudaStorage<E>, v: &Strided, r: usize, c: usize| -> (CudaStorage<E>, Strided) {
            if needs_copy(v, r, c, batch) {
                let copy = self.copy_strided(s, v);
                (copy, contiguous_view(v))
            } else {
                (s.clone(), v.clone())
            }
        };
        let (sa, va) = fit(a.0, a.1, m, k);
        let (sb, vb) = fit(b.0, b.1, k, n);
        let (ta, lda) = as_operand(m, k, va.strides[ra - 2], va.strides[ra - 1]).expect("fits after the copy");
        let (tb, ldb) = as_operand(k, n, vb.strides[rb - 2], vb.strides[rb - 1]).expect("fits after the copy");
        let (oa, ob) = (batch_offsets(&va, batch), batch_offsets(&vb, batch));
        let os = out_dtype.size_in_bytes();
        // Cᵀ (n × m) = Bᵀ (n × k) · Aᵀ (k × m), column-major.
        let call = |a_off: usize, b_off: usize, c_off: usize, count: usize, sa_: usize, sb_: usize| {
            let am = Mat { ptr: sb.ptr_at(b_off), ld: ldb, trans: tb, stride: sb_ };
            let bm = Mat { ptr: sa.ptr_at(a_off), ld: lda, trans: ta, stride: sa_ };
            let cm = Mat { ptr: out + (c_off * os) as u64, ld: n, trans: false, stride: m * n };
            gemm::gemm(st, E::DTYPE, out_dtype, (n, m, k), am, bm, cm, count, beta);
        };
        match (uniform_step(&oa), uniform_step(&ob)) {
            (Some(s_a), Some(s_b)) => call(oa[0], ob[0], 0, nb, s_a, s_b),
            _ => {
                for i in 0..nb {
                    call(oa[i], ob[i], i * m * n, 1, 0, 0);
                }
            }
        }
    }

    /// The norm forward for either kind.
    #[allow(clippy::too_many_arguments)]
    fn norm_impl<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        d: usize,
        weight: Option<(&CudaStorage<E>, &Layout)>,
        bias: Option<(&CudaStorage<E>, &Layout)>,
        eps: f64,
        rms: bool,
    ) -> (CudaStorage<E>, CudaRowStats<E>) {
        let st = self.st();
        let n = x.1.numel();
        let rows = n.checked_div(d).unwrap_or(0);
        let mut keep = Vec::new();
        let px = self.contig_ptr(x, &mut keep);
        let pw = weight.map_or(0, |w| self.contig_ptr(w, &mut keep));
        let pb = bias.map_or(0, |b| self.contig_ptr(b, &mut keep));
        let acc = acc_dtype(E::DTYPE).size_in_bytes();
        let (mean, rstd) = (RawVec::new(st, rows, acc), RawVec::new(st, rows, acc));
        let out = self.uninit::<E>(n);
        if rows > 0 {
            if let Some(nv) = warp_vectors(d, E::DTYPE.size_in_bytes(), &[px, pw, pb, out.ptr()]) {
                let f =
                    st.family_fn(Family::Norm, E::DTYPE, if rms { "rms_norm_warp_fwd" } else { "layer_norm_warp_fwd" });
                launch!(st, f, warp_rows_grid(rows);
                    out.ptr(), mean.ptr(), rstd.ptr(), px, pw, pb, rows as i64, d as i64, eps, nv);
            } else {
                let (smem, cached) = row_cache(d * acc);
                let f = st.family_fn(Family::Norm, E::DTYPE, if rms { "rms_norm_fwd" } else { "layer_norm_fwd" });
                launch!(st, f, rows_grid(rows, d, smem);
                    out.ptr(), mean.ptr(), rstd.ptr(), px, pw, pb, rows as i64, d as i64, eps, cached);
            }
        }
        (out, CudaRowStats::new(StatsKind::Norm, mean, rstd))
    }
}

impl Device for Cuda {
    type Storage<E: Precision> = CudaStorage<E>;
    type RowStats<E: Precision> = CudaRowStats<E>;
    type StateVec = CudaStateVec;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal())
    }

    // ---- allocation and copies

    fn from_host<E: Precision>(&self, data: Vec<E>) -> CudaStorage<E> {
        let st = self.st();
        let s = self.uninit::<E>(data.len());
        if !data.is_empty() {
            let span = Span::begin(st);
            // SAFETY: the block holds `data.len()` elements of E; the copy from pageable
            // memory has staged `data` when it returns.
            let r = unsafe { result::memcpy_htod_async(s.ptr(), &data, st.stream.cu_stream()) };
            st.check("cuMemcpyHtoDAsync", r);
            span.end(st, || "memcpy_htod".into());
        }
        s
    }
    fn full<E: Precision>(&self, n: usize, value: E) -> CudaStorage<E> {
        let v = value.to_f64();
        let bits: u64 = match E::DTYPE {
            DType::F16 => half::f16::from_f64(v).to_bits() as u64,
            DType::BF16 => half::bf16::from_f64(v).to_bits() as u64,
            DType::F32 => (v as f32).to_bits() as u64,
            DType::F64 => v.to_bits(),
        };
        if bits == 0 {
            return self.zeros(n);
        }
        let st = self.st();
        let out = self.uninit::<E>(n);
        if n > 0 {
            let f = st.family_fn(Family::Copy, E::DTYPE, "fill_fwd");
            launch!(st, f, grid(n); out.ptr(), bits, n as i64);
        }
        out
    }
    fn to_host<E: Precision>(&self, s: &CudaStorage<E>, l: &Layout) -> Vec<E> {
        let (c, off) = self.contig(s, l);
        self.download::<E>(c.ptr_at(off), l.numel())
    }
    fn contiguous<E: Precision>(&self, s: &CudaStorage<E>, l: &Layout) -> CudaStorage<E> {
        self.copy_strided(s, &l.into())
    }
    fn len<E: Precision>(s: &CudaStorage<E>) -> usize {
        s.len
    }
    fn is_exclusive<E: Precision>(s: &CudaStorage<E>) -> bool {
        Arc::strong_count(&s.buf) == 1 && Arc::weak_count(&s.buf) == 0
    }
    fn storage_id<E: Precision>(s: &CudaStorage<E>) -> usize {
        // The shared handle's address: the same for every clone, unique while one lives.
        Arc::as_ptr(&s.buf) as *const () as usize
    }
    fn write_into<E: Precision>(
        &self,
        dst: &mut CudaStorage<E>,
        dl: &Layout,
        src: &CudaStorage<E>,
        sl: &Layout,
        add: bool,
    ) {
        assert!(Self::is_exclusive(dst), "backend invariant: write_into a shared storage");
        let n = dl.numel();
        if n == 0 {
            return;
        }
        if !add && dl.is_contiguous() && sl.is_contiguous() {
            let bytes = n * E::DTYPE.size_in_bytes();
            return self.copy_dtod(dst.ptr_at(dl.offset()), src.ptr_at(sl.offset()), bytes);
        }
        let st = self.st();
        let (shape, vs) = views(
            "write_into",
            dl.shape(),
            &[(dl.offset(), dl.strides().to_vec()), (sl.offset(), sl.strides().to_vec())],
        );
        let f = st.family_fn(Family::Copy, E::DTYPE, "write_into_fwd");
        launch!(st, f, grid(n); dst.ptr(), src.ptr(), shape, vs[0], vs[1], n as i64, add as i32);
    }

    // ---- casts

    fn cast<E: Precision, T: Precision>(&self, s: &CudaStorage<E>, l: &Layout) -> CudaStorage<T> {
        if E::DTYPE == T::DTYPE {
            return self.contiguous(s, l).retype();
        }
        let out = self.uninit::<T>(l.numel());
        self.cast_into(s, l, &mut out.clone());
        out
    }
    fn cast_into<E: Precision, T: Precision>(&self, s: &CudaStorage<E>, l: &Layout, dst: &mut CudaStorage<T>) {
        let n = l.numel();
        assert_eq!(dst.len, n, "backend invariant: cast_into a storage of another length");
        if n == 0 {
            return;
        }
        if E::DTYPE == T::DTYPE {
            // One copy: a contiguous view is copied from where it is, not through a temporary.
            let (c, offset) = self.contig(s, l);
            return self.copy_dtod(dst.ptr(), c.ptr_at(offset), n * E::DTYPE.size_in_bytes());
        }
        let st = self.st();
        let (shape, v) = view1("cast", l);
        let mode = l.is_contiguous() as i32;
        let f = st.function(
            ModuleKey::Cast(E::DTYPE, T::DTYPE),
            || kernels::cast(E::DTYPE, T::DTYPE),
            &kernels::cast_kernel(E::DTYPE, T::DTYPE),
        );
        launch!(st, f, grid(n); dst.ptr(), s.ptr(), shape, v, n as i64, mode);
    }

    // ---- elementwise maps

    fn unary<E: Precision, O: UnaryOp>(&self, op: O, x: &CudaStorage<E>, l: &Layout) -> CudaStorage<E> {
        let st = self.st();
        let n = l.numel();
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let (shape, v) = view1(O::NAME, l);
        let mode = map_mode(E::DTYPE.size_in_bytes(), l.is_contiguous(), &[x.ptr_at(l.offset()), out.ptr()]);
        let f = st.function(
            ModuleKey::Op(TypeId::of::<O>(), E::DTYPE),
            || kernels::unary::<O>(E::DTYPE),
            &kernels::kernel_name(&format!("{}_fwd", O::NAME), E::DTYPE),
        );
        launch!(st, f, grid(n); out.ptr(), x.ptr(), shape, v, n as i64, op.param(), mode);
        out
    }
    fn unary_backward<E: Precision, O: UnaryOp>(
        &self,
        op: O,
        x: (&CudaStorage<E>, &Layout),
        y: (&CudaStorage<E>, &Layout),
        g: (&CudaStorage<E>, &Layout),
    ) -> CudaStorage<E> {
        let st = self.st();
        let shape_v = x.1.shape();
        let n = x.1.numel();
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let op_of = |l: &Layout| (l.offset(), broadcast_strides(l, shape_v));
        let (shape, vs) = views(O::NAME, shape_v, &[op_of(x.1), op_of(y.1), op_of(g.1)]);
        let all_dense = [x.1, y.1, g.1].iter().all(|l| l.shape() == shape_v && l.is_contiguous());
        let ptrs = [x.0.ptr_at(x.1.offset()), y.0.ptr_at(y.1.offset()), g.0.ptr_at(g.1.offset()), out.ptr()];
        let mode = map_mode(E::DTYPE.size_in_bytes(), all_dense, &ptrs);
        let f = st.function(
            ModuleKey::Op(TypeId::of::<O>(), E::DTYPE),
            || kernels::unary::<O>(E::DTYPE),
            &kernels::kernel_name(&format!("{}_bwd", O::NAME), E::DTYPE),
        );
        launch!(st, f, grid(n);
            out.ptr(), x.0.ptr(), y.0.ptr(), g.0.ptr(), shape, vs[0], vs[1], vs[2], n as i64, op.param(), mode);
        out
    }
    fn binary<E: Precision, O: BinaryOp>(
        &self,
        op: O,
        a: (&CudaStorage<E>, &Layout),
        b: (&CudaStorage<E>, &Layout),
        shape: &[usize],
    ) -> CudaStorage<E> {
        let st = self.st();
        let n: usize = shape.iter().product();
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let (sa, sb) = (broadcast_strides(a.1, shape), broadcast_strides(b.1, shape));
        let all_dense = a.1.shape() == shape && b.1.shape() == shape && dense(shape, &sa) && dense(shape, &sb);
        let mode = map_mode(
            E::DTYPE.size_in_bytes(),
            all_dense,
            &[a.0.ptr_at(a.1.offset()), b.0.ptr_at(b.1.offset()), out.ptr()],
        );
        let (sh, vs) = views(O::NAME, shape, &[(a.1.offset(), sa), (b.1.offset(), sb)]);
        let f = st.function(
            ModuleKey::Op(TypeId::of::<O>(), E::DTYPE),
            || kernels::binary::<O>(E::DTYPE),
            &kernels::kernel_name(&format!("{}_fwd", O::NAME), E::DTYPE),
        );
        launch!(st, f, grid(n); out.ptr(), a.0.ptr(), b.0.ptr(), sh, vs[0], vs[1], n as i64, op.param(), mode);
        out
    }
    fn select<E: Precision>(
        &self,
        mask: (&[bool], &[usize]),
        a: (&CudaStorage<E>, &Layout),
        b: (&CudaStorage<E>, &Layout),
        shape: &[usize],
    ) -> CudaStorage<E> {
        let st = self.st();
        let n: usize = shape.iter().product();
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let bytes: Vec<u8> = mask.0.iter().map(|&m| m as u8).collect();
        let m = self.upload(&bytes);
        let lm = Layout::contiguous(mask.1);
        let (sh, vs) = views(
            "where",
            shape,
            &[
                (0, broadcast_strides(&lm, shape)),
                (a.1.offset(), broadcast_strides(a.1, shape)),
                (b.1.offset(), broadcast_strides(b.1, shape)),
            ],
        );
        let f = st.family_fn(Family::Copy, E::DTYPE, "where_fwd");
        launch!(st, f, grid(n); out.ptr(), m.ptr(), a.0.ptr(), b.0.ptr(), sh, vs[0], vs[1], vs[2], n as i64);
        out
    }

    // ---- reductions

    fn reduce<E: Precision>(
        &self,
        x: &CudaStorage<E>,
        l: &Layout,
        split: DimSplit,
        op: ReduceOp,
        scale: f64,
    ) -> CudaStorage<E> {
        let st = self.st();
        let DimSplit { outer, dim, inner } = split;
        let out = self.uninit::<E>(outer * inner);
        if outer * inner == 0 {
            return out;
        }
        let (c, off) = self.contig(x, l);
        let max = matches!(op, ReduceOp::Max) as i32;
        if let Some((per, parts)) = reduce_parts(outer * inner, dim, inner) {
            // Few outputs, long walks: partials over chunks of the dim, then combined in order.
            let m = outer * inner;
            let partials = RawVec::new(st, parts * m, acc_dtype(E::DTYPE).size_in_bytes());
            let f = st.family_fn(Family::Reduce, E::DTYPE, "reduce_partial_fwd");
            launch!(st, f, grid(parts * m);
                partials.ptr(), c.ptr_at(off), outer as i64, dim as i64, inner as i64, per as i64, parts as i64, max);
            let f = st.family_fn(Family::Reduce, E::DTYPE, "reduce_parts_fwd");
            launch!(st, f, grid(m); out.ptr(), partials.ptr(), m as i64, parts as i64, scale, max);
            return out;
        }
        let stem = match op {
            ReduceOp::Sum => "sum_fwd",
            ReduceOp::Max => "max_fwd",
        };
        let cfg = if inner == 1 { rows_grid(outer, dim, 0) } else { grid(outer * inner) };
        let f = st.family_fn(Family::Reduce, E::DTYPE, stem);
        launch!(st, f, cfg; out.ptr(), c.ptr_at(off), outer as i64, dim as i64, inner as i64, scale);
        out
    }
    fn arg_reduce<E: Precision>(
        &self,
        x: &CudaStorage<E>,
        l: &Layout,
        split: DimSplit,
        max: bool,
    ) -> (CudaStorage<E>, Vec<usize>) {
        let st = self.st();
        let DimSplit { outer, dim, inner } = split;
        let m = outer * inner;
        let vals = self.uninit::<E>(m);
        if m == 0 {
            return (vals, Vec::new());
        }
        let (c, off) = self.contig(x, l);
        let idx = RawVec::new(st, m, 8);
        let f = st.family_fn(Family::Reduce, E::DTYPE, "arg_reduce_fwd");
        launch!(st, f, grid(m); vals.ptr(), idx.ptr(), c.ptr_at(off), outer as i64, dim as i64, inner as i64, max as i32);
        let host: Vec<i64> = self.download(idx.ptr(), m);
        (vals, host.into_iter().map(|i| i as usize).collect())
    }
    fn scatter_dim<E: Precision>(
        &self,
        g: &CudaStorage<E>,
        l: &Layout,
        idx: &[usize],
        split: DimSplit,
    ) -> CudaStorage<E> {
        let st = self.st();
        let DimSplit { outer, dim, inner } = split;
        let out = self.zeros::<E>(outer * dim * inner);
        if outer * inner == 0 {
            return out;
        }
        let (c, off) = self.contig(g, l);
        let ids: Vec<i64> = idx.iter().map(|&i| i as i64).collect();
        let dev = self.upload(&ids);
        let f = st.family_fn(Family::Reduce, E::DTYPE, "scatter_dim_bwd");
        launch!(st, f, grid(outer * inner); out.ptr(), c.ptr_at(off), dev.ptr(), outer as i64, dim as i64, inner as i64);
        out
    }

    // ---- GEMM

    fn matmul<E: Precision>(
        &self,
        a: (&CudaStorage<E>, &Layout),
        b: (&CudaStorage<E>, &Layout),
        batch: &[usize],
    ) -> CudaStorage<E> {
        let (ra, rb) = (a.1.shape().len(), b.1.shape().len());
        let (m, n) = (a.1.shape()[ra - 2], b.1.shape()[rb - 1]);
        let out = self.uninit::<E>(batch.iter().product::<usize>() * m * n);
        self.matmul_into((a.0, &a.1.into()), (b.0, &b.1.into()), batch, out.ptr(), E::DTYPE, 0.0);
        out
    }
    fn linear<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        w: (&CudaStorage<E>, &Layout),
        bias: Option<(&CudaStorage<E>, &Layout)>,
    ) -> CudaStorage<E> {
        let (rows, out_f) = (x.1.shape()[0], w.1.shape()[0]);
        let wl = w.1;
        let wt = Strided {
            shape: vec![wl.shape()[1], out_f],
            strides: vec![wl.strides()[1], wl.strides()[0]],
            offset: wl.offset(),
        };
        let out = self.uninit::<E>(rows * out_f);
        let Some(bias) = bias else {
            self.matmul_into((x.0, &x.1.into()), (w.0, &wt), &[], out.ptr(), E::DTYPE, 0.0);
            return out;
        };
        // The bias starts the accumulator: copied into the output, which the GEMM adds its
        // product to with beta = 1 (in f32 for every precision but f64, rounded once).
        let st = self.st();
        let n = rows * out_f;
        if n > 0 {
            let mut keep = Vec::new();
            let pb = self.contig_ptr(bias, &mut keep);
            let f = st.family_fn(Family::Conv, E::DTYPE, "bias_fill_fwd");
            launch!(st, f, grid(n); out.ptr(), pb, n as i64, 1i64, out_f as i64);
        }
        self.matmul_into((x.0, &x.1.into()), (w.0, &wt), &[], out.ptr(), E::DTYPE, 1.0);
        out
    }

    // ---- fused rows

    fn softmax<E: Precision>(&self, x: &CudaStorage<E>, l: &Layout, d: usize, log: bool) -> CudaStorage<E> {
        let st = self.st();
        let n = l.numel();
        let out = self.uninit::<E>(n);
        if n == 0 || d == 0 {
            return out;
        }
        let (c, off) = self.contig(x, l);
        let (rows, px) = (n / d, c.ptr_at(off));
        if let Some(nv) = warp_vectors(d, E::DTYPE.size_in_bytes(), &[px, out.ptr()]) {
            let f =
                st.family_fn(Family::Softmax, E::DTYPE, if log { "log_softmax_warp_fwd" } else { "softmax_warp_fwd" });
            launch!(st, f, warp_rows_grid(rows); out.ptr(), px, rows as i64, d as i64, nv);
            return out;
        }
        let (smem, cached) = row_cache(d * acc_dtype(E::DTYPE).size_in_bytes());
        let f = st.family_fn(Family::Softmax, E::DTYPE, if log { "log_softmax_fwd" } else { "softmax_fwd" });
        launch!(st, f, rows_grid(rows, d, smem); out.ptr(), px, rows as i64, d as i64, cached);
        out
    }
    fn softmax_backward<E: Precision>(
        &self,
        y: (&CudaStorage<E>, &Layout),
        g: (&CudaStorage<E>, &Layout),
        d: usize,
        log: bool,
    ) -> CudaStorage<E> {
        let st = self.st();
        let n = y.1.numel();
        let out = self.uninit::<E>(n);
        if n == 0 || d == 0 {
            return out;
        }
        let mut keep = Vec::new();
        let (py, pg) = (self.contig_ptr(y, &mut keep), self.contig_ptr(g, &mut keep));
        let rows = n / d;
        if let Some(nv) = warp_vectors(d, E::DTYPE.size_in_bytes(), &[py, pg, out.ptr()]) {
            let f =
                st.family_fn(Family::Softmax, E::DTYPE, if log { "log_softmax_warp_bwd" } else { "softmax_warp_bwd" });
            launch!(st, f, warp_rows_grid(rows); out.ptr(), py, pg, rows as i64, d as i64, nv);
            return out;
        }
        let f = st.family_fn(Family::Softmax, E::DTYPE, if log { "log_softmax_bwd" } else { "softmax_bwd" });
        launch!(st, f, rows_grid(rows, d, 0); out.ptr(), py, pg, rows as i64, d as i64);
        out
    }
    fn norm<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        d: usize,
        weight: Option<(&CudaStorage<E>, &Layout)>,
        bias: Option<(&CudaStorage<E>, &Layout)>,
        eps: f64,
        rms: bool,
    ) -> (CudaStorage<E>, CudaRowStats<E>) {
        self.norm_impl(x, d, weight, bias, eps, rms)
    }
    fn norm_backward<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        g: (&CudaStorage<E>, &Layout),
        d: usize,
        weight: Option<(&CudaStorage<E>, &Layout)>,
        stats: &CudaRowStats<E>,
        needs: (bool, bool),
        rms: bool,
    ) -> (CudaStorage<E>, Option<CudaStorage<E>>, Option<CudaStorage<E>>) {
        assert_eq!(stats.kind, StatsKind::Norm, "norm backward with other statistics");
        let st = self.st();
        let n = x.1.numel();
        let rows = n.checked_div(d).unwrap_or(0);
        let mut keep = Vec::new();
        let (px, pg) = (self.contig_ptr(x, &mut keep), self.contig_ptr(g, &mut keep));
        let pw = weight.map_or(0, |w| self.contig_ptr(w, &mut keep));
        let acc = acc_dtype(E::DTYPE).size_in_bytes();
        let dx = self.uninit::<E>(n);
        if rows > 0 {
            if let Some(nv) = warp_vectors(d, E::DTYPE.size_in_bytes(), &[px, pg, pw, dx.ptr()]) {
                let f =
                    st.family_fn(Family::Norm, E::DTYPE, if rms { "rms_norm_warp_bwd" } else { "layer_norm_warp_bwd" });
                launch!(st, f, warp_rows_grid(rows);
                    dx.ptr(), px, pg, pw, stats.a.ptr(), stats.b.ptr(), rows as i64, d as i64, nv);
            } else {
                let (smem, cached) = row_cache(2 * d * acc);
                let f = st.family_fn(Family::Norm, E::DTYPE, if rms { "rms_norm_bwd" } else { "layer_norm_bwd" });
                launch!(st, f, rows_grid(rows, d, smem);
                    dx.ptr(), px, pg, pw, stats.a.ptr(), stats.b.ptr(), rows as i64, d as i64, cached);
            }
        }
        let (gw, gb) = (needs.0.then(|| self.zeros::<E>(d)), needs.1.then(|| self.zeros::<E>(d)));
        if (needs.0 || needs.1) && rows > 0 && d > 0 {
            const PER: usize = 256;
            let parts = rows.div_ceil(PER);
            let pw_part = needs.0.then(|| RawVec::new(st, parts * d, acc));
            let pb_part = needs.1.then(|| RawVec::new(st, parts * d, acc));
            let (ppw, ppb) = (pw_part.as_ref().map_or(0, RawVec::ptr), pb_part.as_ref().map_or(0, RawVec::ptr));
            let f = st.family_fn(Family::Norm, E::DTYPE, "norm_params_partial_bwd");
            launch!(st, f, grid(parts * d);
                ppw, ppb, px, pg, stats.a.ptr(), stats.b.ptr(), rows as i64, d as i64, PER as i64, parts as i64);
            let f = st.family_fn(Family::Norm, E::DTYPE, "norm_params_bwd");
            let (ow, ob) = (gw.as_ref().map_or(0, |s| s.ptr()), gb.as_ref().map_or(0, |s| s.ptr()));
            launch!(st, f, grid(d); ow, ob, ppw, ppb, parts as i64, d as i64);
        }
        (dx, gw, gb)
    }
    fn causal_attention<E: Precision>(
        &self,
        q: (&CudaStorage<E>, &Layout),
        k: (&CudaStorage<E>, &Layout),
        v: (&CudaStorage<E>, &Layout),
        spec: AttentionSpec,
    ) -> (CudaStorage<E>, CudaRowStats<E>) {
        let st = self.st();
        let AttentionSpec { n, t, d, scale } = spec;
        let acc = acc_dtype(E::DTYPE);
        let ab = acc.size_in_bytes();
        let out = self.uninit::<E>(n * t * d);
        let lse = RawVec::new(st, n * t, ab);
        if n * t * d == 0 {
            return (out, CudaRowStats::new(StatsKind::LogSumExp, lse, RawVec::new(st, 0, ab)));
        }
        let mut keep = Vec::new();
        let (pq, pk, pv) =
            (self.contig_ptr(q, &mut keep), self.contig_ptr(k, &mut keep), self.contig_ptr(v, &mut keep));
        let ptrs = [pq, pk, pv, out.ptr()];
        let flash = if self.flash_attention() { flash_kernels(E::DTYPE, n, t, d, &ptrs) } else { None };
        if let Some([fwd, _, _]) = flash {
            let f = st.family_fn(Family::AttentionFlash, E::DTYPE, fwd);
            launch!(st, f, flash_grid(n, t); out.ptr(), lse.ptr(), pq, pk, pv, t as i64, scale as f32);
            return (out, CudaRowStats::new(StatsKind::LogSumExp, lse, RawVec::new(st, 0, ab)));
        }
        let es = E::DTYPE.size_in_bytes() as u64;
        let block = attention_block(n, t, ab);
        let scores = RawVec::new(st, n * block * t, ab);
        let probs = self.uninit::<E>(n * block * t);
        let f = st.family_fn(Family::Attention, E::DTYPE, "attention_probs_fwd");
        let heads = |ptr: u64, row: usize| Mat { ptr: ptr + (row * d) as u64 * es, ld: d, trans: false, stride: t * d };
        for q0 in (0..t).step_by(block) {
            let (rows, kt) = (block.min(t - q0), q0 + block.min(t - q0));
            let tile = |ptr: u64, trans: bool| Mat { ptr, ld: kt, trans, stride: rows * kt };
            // scores = q[q0..kt] · k[..kt]ᵀ, then the probabilities (and each row's lse).
            let keys = Mat { trans: true, ..heads(pk, 0) };
            rm_gemm(st, E::DTYPE, acc, (rows, kt, d), heads(pq, q0), keys, tile(scores.ptr(), false), n, 0.0);
            launch!(st, f.clone(), rows_grid(n * rows, kt, 0);
                probs.ptr(), lse.ptr(), scores.ptr(), (n * rows) as i64, rows as i64, kt as i64, q0 as i64, t as i64, scale);
            // out[q0..kt] = probs · v[..kt]: f32 accumulation, one rounding.
            let o = heads(out.ptr(), q0);
            rm_gemm(st, E::DTYPE, E::DTYPE, (rows, d, kt), tile(probs.ptr(), false), heads(pv, 0), o, n, 0.0);
        }
        (out, CudaRowStats::new(StatsKind::LogSumExp, lse, RawVec::new(st, 0, ab)))
    }
    fn causal_attention_backward<E: Precision>(
        &self,
        q: (&CudaStorage<E>, &Layout),
        k: (&CudaStorage<E>, &Layout),
        v: (&CudaStorage<E>, &Layout),
        out: (&CudaStorage<E>, &Layout),
        g: (&CudaStorage<E>, &Layout),
        stats: &CudaRowStats<E>,
        spec: AttentionSpec,
    ) -> (CudaStorage<E>, CudaStorage<E>, CudaStorage<E>) {
        assert_eq!(stats.kind, StatsKind::LogSumExp, "attention backward with other statistics");
        let st = self.st();
        let AttentionSpec { n, t, d, scale } = spec;
        let acc = acc_dtype(E::DTYPE);
        let ab = acc.size_in_bytes();
        let (dq, dk, dv) = (self.uninit::<E>(n * t * d), self.uninit::<E>(n * t * d), self.uninit::<E>(n * t * d));
        if n * t * d == 0 {
            return (dq, dk, dv);
        }
        let mut keep = Vec::new();
        let (pq, pk, pv) =
            (self.contig_ptr(q, &mut keep), self.contig_ptr(k, &mut keep), self.contig_ptr(v, &mut keep));
        let (po, pg) = (self.contig_ptr(out, &mut keep), self.contig_ptr(g, &mut keep));
        let es = E::DTYPE.size_in_bytes() as u64;
        // delta = g·out per row.
        let delta = RawVec::new(st, n * t, ab);
        let f = st.family_fn(Family::Attention, E::DTYPE, "attention_delta_bwd");
        launch!(st, f, rows_grid(n * t, d, 0); delta.ptr(), po, pg, (n * t) as i64, d as i64);
        let ptrs = [pq, pk, pv, pg, dq.ptr(), dk.ptr(), dv.ptr()];
        let flash = if self.flash_attention() { flash_kernels(E::DTYPE, n, t, d, &ptrs) } else { None };
        if let Some([_, dq_stem, dkv_stem]) = flash {
            let (lse, sc) = (stats.a.ptr(), scale as f32);
            let f = st.family_fn(Family::AttentionFlash, E::DTYPE, dq_stem);
            launch!(st, f, flash_grid(n, t); dq.ptr(), pq, pk, pv, pg, lse, delta.ptr(), t as i64, sc);
            let f = st.family_fn(Family::AttentionFlash, E::DTYPE, dkv_stem);
            launch!(st, f, flash_grid(n, t); dk.ptr(), dv.ptr(), pq, pk, pv, pg, lse, delta.ptr(), t as i64, sc);
            return (dq, dk, dv);
        }
        // dk and dv sum over query blocks in the accumulation type (in place for f32 and f64).
        let sums = (acc != E::DTYPE).then(|| (RawVec::new(st, n * t * d, ab), RawVec::new(st, n * t * d, ab)));
        let (pdk, pdv) = sums.as_ref().map_or((dk.ptr(), dv.ptr()), |(a, b)| (a.ptr(), b.ptr()));
        let block = attention_block(n, t, ab);
        let (scores, dprobs) = (RawVec::new(st, n * block * t, ab), RawVec::new(st, n * block * t, ab));
        let (probs, dscores) = (self.uninit::<E>(n * block * t), self.uninit::<E>(n * block * t));
        let f = st.family_fn(Family::Attention, E::DTYPE, "attention_grads_bwd");
        let heads = |ptr: u64, row: usize| Mat { ptr: ptr + (row * d) as u64 * es, ld: d, trans: false, stride: t * d };
        let sum_heads = |ptr: u64| Mat { ptr, ld: d, trans: false, stride: t * d };
        // The last block first: its keys are all of them, so it starts the sums (beta 0).
        let starts: Vec<usize> = (0..t).step_by(block).collect();
        for (i, &q0) in starts.iter().rev().enumerate() {
            let (rows, kt) = (block.min(t - q0), q0 + block.min(t - q0));
            let beta = if i == 0 { 0.0 } else { 1.0 };
            let tile = |ptr: u64, trans: bool| Mat { ptr, ld: kt, trans, stride: rows * kt };
            let keys = Mat { trans: true, ..heads(pk, 0) };
            let values = Mat { trans: true, ..heads(pv, 0) };
            // Raw scores and dP = g[q0..kt] · v[..kt]ᵀ, then P and dS.
            rm_gemm(st, E::DTYPE, acc, (rows, kt, d), heads(pq, q0), keys, tile(scores.ptr(), false), n, 0.0);
            rm_gemm(st, E::DTYPE, acc, (rows, kt, d), heads(pg, q0), values, tile(dprobs.ptr(), false), n, 0.0);
            launch!(st, f.clone(), rows_grid(n * rows, kt, 0);
                probs.ptr(), dscores.ptr(), scores.ptr(), dprobs.ptr(), stats.a.ptr(), delta.ptr(),
                (n * rows) as i64, rows as i64, kt as i64, q0 as i64, t as i64, scale);
            // dv[..kt] += Pᵀ · g[q0..kt]; dk[..kt] += dSᵀ · q[q0..kt]; dq[q0..kt] = dS · k[..kt].
            rm_gemm(st, E::DTYPE, acc, (kt, d, rows), tile(probs.ptr(), true), heads(pg, q0), sum_heads(pdv), n, beta);
            rm_gemm(
                st,
                E::DTYPE,
                acc,
                (kt, d, rows),
                tile(dscores.ptr(), true),
                heads(pq, q0),
                sum_heads(pdk),
                n,
                beta,
            );
            let dq_rows = heads(dq.ptr(), q0);
            rm_gemm(st, E::DTYPE, E::DTYPE, (rows, d, kt), tile(dscores.ptr(), false), heads(pk, 0), dq_rows, n, 0.0);
        }
        match sums {
            None => (dq, dk, dv),
            Some((a, b)) => {
                (dq, self.cast_ptr::<E>(a.ptr(), acc, n * t * d), self.cast_ptr::<E>(b.ptr(), acc, n * t * d))
            }
        }
    }
    fn cross_entropy<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
    ) -> (CudaStorage<E>, CudaRowStats<E>, usize) {
        let st = self.st();
        let rows = spec.targets.len();
        let acc = acc_dtype(E::DTYPE).size_in_bytes();
        let lse = RawVec::new(st, rows, acc);
        let losses = RawVec::new(st, rows, 8);
        let counted = spec.targets.iter().filter(|&&t| Some(t) != spec.ignore).count();
        let mut keep = Vec::new();
        let px = self.contig_ptr(x, &mut keep);
        let targets = self.upload(spec.targets);
        let (has_ignore, ignore) = (spec.ignore.is_some() as i32, spec.ignore.unwrap_or(0));
        if rows > 0 && c > 0 {
            let vec = vector_rows(c, E::DTYPE.size_in_bytes(), &[px]) as i32;
            let f = st.family_fn(Family::Loss, E::DTYPE, "cross_entropy_fwd");
            launch!(st, f, rows_grid(rows, c, 0);
                lse.ptr(), losses.ptr(), px, targets.ptr(), rows as i64, c as i64, has_ignore, ignore, spec.smoothing, vec);
        }
        let out = self.uninit::<E>(1);
        let f = st.family_fn(Family::Loss, E::DTYPE, "mean_f64_fwd");
        launch!(st, f, rows_grid(1, rows.max(32), 0); out.ptr(), losses.ptr(), rows as i64, counted as f64);
        (out, CudaRowStats::new(StatsKind::LogSumExp, lse, RawVec::new(st, 0, acc)), counted)
    }
    fn cross_entropy_backward<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
        stats: &CudaRowStats<E>,
        g: (&CudaStorage<E>, &Layout),
        counted: usize,
    ) -> CudaStorage<E> {
        assert_eq!(stats.kind, StatsKind::LogSumExp, "cross-entropy backward with other statistics");
        let st = self.st();
        let rows = spec.targets.len();
        let out = self.uninit::<E>(rows * c);
        if rows * c == 0 {
            return out;
        }
        let mut keep = Vec::new();
        let px = self.contig_ptr(x, &mut keep);
        let targets = self.upload(spec.targets);
        let (has_ignore, ignore) = (spec.ignore.is_some() as i32, spec.ignore.unwrap_or(0));
        let vec = vector_rows(c, E::DTYPE.size_in_bytes(), &[px, out.ptr()]) as i32;
        let f = st.family_fn(Family::Loss, E::DTYPE, "cross_entropy_bwd");
        launch!(st, f, rows_grid(rows, c, 0);
            out.ptr(), px, targets.ptr(), stats.a.ptr(), rows as i64, c as i64, has_ignore, ignore, spec.smoothing,
            g.0.ptr_at(g.1.offset()), counted as f64, vec);
        out
    }
    fn mse<E: Precision>(&self, a: (&CudaStorage<E>, &Layout), b: (&CudaStorage<E>, &Layout)) -> CudaStorage<E> {
        let st = self.st();
        let shape = a.1.shape();
        let n = a.1.numel();
        let cfg = grid(n);
        let blocks = if n == 0 { 0 } else { cfg.grid_dim.0 as usize };
        let parts = RawVec::new(st, blocks, 8);
        if n > 0 {
            let (sh, vs) = views(
                "mse",
                shape,
                &[(a.1.offset(), broadcast_strides(a.1, shape)), (b.1.offset(), broadcast_strides(b.1, shape))],
            );
            let f = st.family_fn(Family::Loss, E::DTYPE, "mse_fwd");
            launch!(st, f, cfg; parts.ptr(), a.0.ptr(), b.0.ptr(), sh, vs[0], vs[1], n as i64);
        }
        let out = self.uninit::<E>(1);
        let f = st.family_fn(Family::Loss, E::DTYPE, "mean_f64_fwd");
        launch!(st, f, rows_grid(1, blocks.max(32), 0); out.ptr(), parts.ptr(), blocks as i64, n as f64);
        out
    }
    fn mse_backward<E: Precision>(
        &self,
        a: (&CudaStorage<E>, &Layout),
        b: (&CudaStorage<E>, &Layout),
        g: (&CudaStorage<E>, &Layout),
    ) -> CudaStorage<E> {
        let st = self.st();
        let shape = a.1.shape();
        let n = a.1.numel();
        let out = self.uninit::<E>(n);
        if n > 0 {
            let (sh, vs) = views(
                "mse_backward",
                shape,
                &[(a.1.offset(), broadcast_strides(a.1, shape)), (b.1.offset(), broadcast_strides(b.1, shape))],
            );
            let f = st.family_fn(Family::Loss, E::DTYPE, "mse_bwd");
            launch!(st, f, grid(n); out.ptr(), a.0.ptr(), b.0.ptr(), g.0.ptr_at(g.1.offset()), sh, vs[0], vs[1], n as i64);
        }
        out
    }

    // ---- convolution, pooling and batch norm

    fn conv2d<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        w: (&CudaStorage<E>, &Layout),
        bias: Option<(&CudaStorage<E>, &Layout)>,
        spec: &Conv2dSpec,
    ) -> CudaStorage<E> {
        let st = self.st();
        let geo = ConvGeom::of(spec);
        let (nb_all, c_out, l, k, g, og) = (
            spec.batch,
            spec.out_channels,
            spec.output.0 * spec.output.1,
            geo.k as usize,
            spec.groups,
            spec.group_out(),
        );
        let total = nb_all * c_out * l;
        let out = self.uninit::<E>(total);
        if total == 0 {
            return out;
        }
        let mut keep = Vec::new();
        let (px, pw) = (self.contig_ptr(x, &mut keep), self.contig_ptr(w, &mut keep));
        // With a bias the GEMM accumulates onto it: copied into the output first, the product
        // added with beta = 1 (in f32 for every precision but f64, rounded once).
        let beta = if let Some(b) = bias {
            let pb = self.contig_ptr(b, &mut keep);
            let f = st.family_fn(Family::Conv, E::DTYPE, "bias_fill_fwd");
            launch!(st, f, grid(total); out.ptr(), pb, total as i64, l as i64, c_out as i64);
            1.0
        } else {
            0.0
        };
        let es = E::DTYPE.size_in_bytes();
        let per_sample = g * k * l * es;
        let chunk = (CONV_COLS_BYTES / per_sample.max(1)).clamp(1, nb_all);
        let cols = CudaStorage::<E>::uninit(st, chunk * g * k * l);
        let mut n0 = 0;
        while n0 < nb_all {
            let nb = chunk.min(nb_all - n0);
            let f = st.family_fn(Family::Conv, E::DTYPE, "im2col_fwd");
            launch!(st, f, grid(nb * g * k * l); cols.ptr(), px, n0 as i64, nb as i64, geo);
            for gi in 0..g {
                // outᵀ [L, og] = colsᵀ [L, K] · W_gᵀ [K, og] (column-major), per sample.
                let a = Mat { ptr: cols.ptr() + (gi * k * l * es) as u64, ld: l, trans: false, stride: g * k * l };
                let b = Mat { ptr: pw + (gi * og * k * es) as u64, ld: k, trans: false, stride: 0 };
                let c = Mat {
                    ptr: out.ptr() + ((n0 * c_out + gi * og) * l * es) as u64,
                    ld: l,
                    trans: false,
                    stride: c_out * l,
                };
                gemm::gemm(st, E::DTYPE, E::DTYPE, (l, og, k), a, b, c, nb, beta);
            }
            n0 += nb;
        }
        out
    }
    fn conv2d_backward_input<E: Precision>(
        &self,
        g: (&CudaStorage<E>, &Layout),
        w: (&CudaStorage<E>, &Layout),
        spec: &Conv2dSpec,
    ) -> CudaStorage<E> {
        let st = self.st();
        let geo = ConvGeom::of(spec);
        let (nb_all, c_out, l, k, groups, og) = (
            spec.batch,
            spec.out_channels,
            spec.output.0 * spec.output.1,
            geo.k as usize,
            spec.groups,
            spec.group_out(),
        );
        let dx = self.uninit::<E>(nb_all * spec.in_channels * spec.input.0 * spec.input.1);
        if dx.len == 0 {
            return dx;
        }
        if l == 0 {
            self.memset_zero(dx.ptr(), dx.len * E::DTYPE.size_in_bytes());
            return dx;
        }
        let mut keep = Vec::new();
        let (pg, pw) = (self.contig_ptr(g, &mut keep), self.contig_ptr(w, &mut keep));
        let acc = acc_dtype(E::DTYPE);
        let (es, acs) = (E::DTYPE.size_in_bytes(), acc.size_in_bytes());
        let per_sample = groups * k * l * acs;
        let chunk = (CONV_COLS_BYTES / per_sample.max(1)).clamp(1, nb_all);
        let cols = RawVec::new(st, chunk * groups * k * l, acs);
        let mut n0 = 0;
        while n0 < nb_all {
            let nb = chunk.min(nb_all - n0);
            for gi in 0..groups {
                // dcolsᵀ [L, K] = dYᵀ [L, og] · W_g [og, K] (column-major), per sample.
                let a =
                    Mat { ptr: pg + ((n0 * c_out + gi * og) * l * es) as u64, ld: l, trans: false, stride: c_out * l };
                let b = Mat { ptr: pw + (gi * og * k * es) as u64, ld: k, trans: true, stride: 0 };
                let c =
                    Mat { ptr: cols.ptr() + (gi * k * l * acs) as u64, ld: l, trans: false, stride: groups * k * l };
                gemm::gemm(st, E::DTYPE, acc, (l, k, og), a, b, c, nb, 0.0);
            }
            let n_el = nb * spec.in_channels * spec.input.0 * spec.input.1;
            let f = st.family_fn(Family::Conv, E::DTYPE, "col2im_bwd");
            launch!(st, f, grid(n_el); dx.ptr(), cols.ptr(), n0 as i64, nb as i64, geo);
            n0 += nb;
        }
        dx
    }
    fn conv2d_backward_weight<E: Precision>(
        &self,
        x: Option<(&CudaStorage<E>, &Layout)>,
        g: (&CudaStorage<E>, &Layout),
        spec: &Conv2dSpec,
        bias: bool,
    ) -> (Option<CudaStorage<E>>, Option<CudaStorage<E>>) {
        let st = self.st();
        let geo = ConvGeom::of(spec);
        let (nb_all, c_out, l, k, groups, og) = (
            spec.batch,
            spec.out_channels,
            spec.output.0 * spec.output.1,
            geo.k as usize,
            spec.groups,
            spec.group_out(),
        );
        let mut keep = Vec::new();
        let pg = self.contig_ptr(g, &mut keep);
        let acc = acc_dtype(E::DTYPE);
        let (es, acs) = (E::DTYPE.size_in_bytes(), acc.size_in_bytes());
        let gw = x.map(|x| {
            let px = self.contig_ptr(x, &mut keep);
            let n_w = c_out * k;
            let sums = RawVec::new(st, n_w, acs);
            if nb_all == 0 || l == 0 {
                self.memset_zero(sums.ptr(), n_w * acs);
            } else {
                let per_sample = groups * k * l * es;
                let chunk = (CONV_COLS_BYTES / per_sample.max(1)).clamp(1, nb_all);
                let cols = CudaStorage::<E>::uninit(st, chunk * groups * k * l);
                let mut n0 = 0;
                while n0 < nb_all {
                    let nb = chunk.min(nb_all - n0);
                    let f = st.family_fn(Family::Conv, E::DTYPE, "im2col_fwd");
                    launch!(st, f, grid(nb * groups * k * l); cols.ptr(), px, n0 as i64, nb as i64, geo);
                    for s in 0..nb {
                        for gi in 0..groups {
                            // dW_gᵀ [K, og] += cols [K, L] · dYᵀ... (column-major: colsᵀ transposed
                            // times dY_gᵀ), the samples summed in order in the accumulator.
                            let a = Mat {
                                ptr: cols.ptr() + (((s * groups + gi) * k * l) * es) as u64,
                                ld: l,
                                trans: true,
                                stride: 0,
                            };
                            let b = Mat {
                                ptr: pg + ((((n0 + s) * c_out) + gi * og) * l * es) as u64,
                                ld: l,
                                trans: false,
                                stride: 0,
                            };
                            let c =
                                Mat { ptr: sums.ptr() + (gi * og * k * acs) as u64, ld: k, trans: false, stride: 0 };
                            let beta = if n0 + s == 0 { 0.0 } else { 1.0 };
                            gemm::gemm(st, E::DTYPE, acc, (k, og, l), a, b, c, 1, beta);
                        }
                    }
                    n0 += nb;
                }
            }
            self.cast_ptr::<E>(sums.ptr(), acc, n_w)
        });
        let gb = bias.then(|| {
            let out = self.uninit::<E>(c_out);
            if c_out > 0 {
                let f = st.family_fn(Family::Conv, E::DTYPE, "channel_sum_bwd");
                launch!(st, f, rows_grid(c_out, nb_all * l, 0); out.ptr(), pg, nb_all as i64, c_out as i64, l as i64);
            }
            out
        });
        (gw, gb)
    }
    fn max_pool2d<E: Precision>(&self, x: &CudaStorage<E>, l: &Layout, spec: &Pool2dSpec) -> CudaStorage<E> {
        self.pool_fwd(x, l, spec, "max_pool2d_fwd")
    }
    fn max_pool2d_backward<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        g: (&CudaStorage<E>, &Layout),
        spec: &Pool2dSpec,
    ) -> CudaStorage<E> {
        let st = self.st();
        let n = spec.planes * spec.input.0 * spec.input.1;
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let mut keep = Vec::new();
        let (px, pg) = (self.contig_ptr(x, &mut keep), self.contig_ptr(g, &mut keep));
        let f = st.family_fn(Family::Pool, E::DTYPE, "max_pool2d_bwd");
        launch!(st, f, grid(n); out.ptr(), px, pg, PoolGeom::of(spec));
        out
    }
    fn avg_pool2d<E: Precision>(&self, x: &CudaStorage<E>, l: &Layout, spec: &Pool2dSpec) -> CudaStorage<E> {
        self.pool_fwd(x, l, spec, "avg_pool2d_fwd")
    }
    fn avg_pool2d_backward<E: Precision>(&self, g: &CudaStorage<E>, l: &Layout, spec: &Pool2dSpec) -> CudaStorage<E> {
        let st = self.st();
        let n = spec.planes * spec.input.0 * spec.input.1;
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let (c, off) = self.contig(g, l);
        let f = st.family_fn(Family::Pool, E::DTYPE, "avg_pool2d_bwd");
        launch!(st, f, grid(n); out.ptr(), c.ptr_at(off), PoolGeom::of(spec));
        out
    }
    fn batch_norm<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        weight: Option<(&CudaStorage<E::Acc>, &Layout)>,
        bias: Option<(&CudaStorage<E::Acc>, &Layout)>,
        stats: BatchNormStats<'_, CudaStorage<f32>>,
        eps: f64,
    ) -> (CudaStorage<E>, CudaRowStats<E>) {
        let st = self.st();
        let DimSplit { outer: n, dim: ch, inner } = DimSplit::of(x.1.shape(), 1);
        let total = x.1.numel();
        let acc = acc_dtype(E::DTYPE).size_in_bytes();
        let mut keep = Vec::new();
        let px = self.contig_ptr(x, &mut keep);
        let (mean, rstd) = (RawVec::new(st, ch, acc), RawVec::new(st, ch, acc));
        match stats {
            BatchNormStats::Batch { running, momentum } => {
                let unbiased = RawVec::new(st, ch, acc);
                if ch > 0 {
                    let f = st.family_fn(Family::BatchNorm, E::DTYPE, "batch_norm_stats_fwd");
                    launch!(st, f, rows_grid(ch, n * inner, 0);
                        mean.ptr(), rstd.ptr(), unbiased.ptr(), px, n as i64, ch as i64, inner as i64, eps);
                }
                if let Some((rm, rv)) = running {
                    assert!(
                        Self::is_exclusive(rm) && Self::is_exclusive(rv),
                        "backend invariant: running buffers shared"
                    );
                    if ch > 0 {
                        let f = st.family_fn(Family::BatchNorm, E::DTYPE, "batch_norm_running_fwd");
                        launch!(st, f, grid(ch); rm.ptr(), rv.ptr(), mean.ptr(), unbiased.ptr(), ch as i64, momentum);
                    }
                }
            }
            BatchNormStats::Given { mean: (ms, ml), var: (vs, vl) } => {
                if ch > 0 {
                    let f = st.family_fn(Family::BatchNorm, E::DTYPE, "batch_norm_given_fwd");
                    let stride = |l: &Layout| l.strides().first().copied().unwrap_or(1) as i64;
                    launch!(st, f, grid(ch);
                        mean.ptr(), rstd.ptr(), ms.ptr(), ml.offset() as i64, stride(ml), vs.ptr(), vl.offset() as i64, stride(vl), ch as i64, eps);
                }
            }
        }
        let mut keep_params = Vec::new(); // the parameters' contiguous copies, in E::Acc
        let pw = weight.map_or(0, |w| self.contig_ptr(w, &mut keep_params));
        let pb = bias.map_or(0, |b| self.contig_ptr(b, &mut keep_params));
        let y = self.uninit::<E>(total);
        if total > 0 {
            let f = st.family_fn(Family::BatchNorm, E::DTYPE, "batch_norm_fwd");
            launch!(st, f, grid(total);
                y.ptr(), px, mean.ptr(), rstd.ptr(), pw, pb, total as i64, ch as i64, inner as i64);
        }
        (y, CudaRowStats::new(StatsKind::Channels, mean, rstd))
    }
    fn batch_norm_backward<E: Precision>(
        &self,
        x: (&CudaStorage<E>, &Layout),
        g: (&CudaStorage<E>, &Layout),
        weight: Option<(&CudaStorage<E::Acc>, &Layout)>,
        stats: &CudaRowStats<E>,
        needs: (bool, bool),
        training: bool,
    ) -> (CudaStorage<E>, Option<CudaStorage<E::Acc>>, Option<CudaStorage<E::Acc>>) {
        assert_eq!(stats.kind, StatsKind::Channels, "batch norm backward with other statistics");
        let st = self.st();
        let DimSplit { outer: n, dim: ch, inner } = DimSplit::of(x.1.shape(), 1);
        let total = x.1.numel();
        let mut keep = Vec::new();
        let (px, pg) = (self.contig_ptr(x, &mut keep), self.contig_ptr(g, &mut keep));
        let mut keep_weight = Vec::new();
        let pw = weight.map_or(0, |w| self.contig_ptr(w, &mut keep_weight));
        // Σg and Σ(g·x̂) per channel, in E::Acc: the bias and weight gradients themselves.
        let (sg, sgx) = (self.uninit::<E::Acc>(ch), self.uninit::<E::Acc>(ch));
        if (training || needs.0 || needs.1) && ch > 0 {
            let f = st.family_fn(Family::BatchNorm, E::DTYPE, "batch_norm_sums_bwd");
            launch!(st, f, rows_grid(ch, n * inner, 0);
                sg.ptr(), sgx.ptr(), px, pg, stats.a.ptr(), stats.b.ptr(), n as i64, ch as i64, inner as i64);
        }
        let dx = self.uninit::<E>(total);
        if total > 0 {
            let inv_m = 1.0 / (n * inner) as f64;
            let f = st.family_fn(Family::BatchNorm, E::DTYPE, "batch_norm_bwd");
            launch!(st, f, grid(total);
                dx.ptr(), px, pg, stats.a.ptr(), stats.b.ptr(), pw, sg.ptr(), sgx.ptr(), total as i64, ch as i64,
                inner as i64, training as i32, inv_m);
        }
        (dx, needs.0.then_some(sgx), needs.1.then_some(sg))
    }

    // ---- gather, scatter-add, embedding, cat

    fn gather_rows<E: Precision>(&self, w: (&CudaStorage<E>, &Layout), ids: &[i64], d: usize) -> CudaStorage<E> {
        let st = self.st();
        let n = ids.len() * d;
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let mut keep = Vec::new();
        let pw = self.contig_ptr(w, &mut keep);
        let dev = self.upload(ids);
        let f = st.family_fn(Family::Index, E::DTYPE, "gather_rows_fwd");
        launch!(st, f, grid(n); out.ptr(), pw, dev.ptr(), ids.len() as i64, d as i64);
        out
    }
    fn scatter_add_rows<E: Precision>(
        &self,
        g: (&CudaStorage<E>, &Layout),
        ids: &[i64],
        vocab: usize,
        d: usize,
    ) -> CudaStorage<E> {
        let st = self.st();
        let n = vocab * d;
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        // Rows by id, ascending position within an id (a stable sort, the CPU's order).
        let mut order: Vec<i64> = (0..ids.len() as i64).collect();
        order.sort_by_key(|&r| ids[r as usize]);
        let mut starts = vec![0i64; vocab + 1];
        for &id in ids {
            starts[id as usize + 1] += 1;
        }
        for v in 0..vocab {
            starts[v + 1] += starts[v];
        }
        let mut keep = Vec::new();
        let pg = self.contig_ptr(g, &mut keep);
        let (order, starts) = (self.upload(&order), self.upload(&starts));
        let f = st.family_fn(Family::Index, E::DTYPE, "scatter_add_rows_bwd");
        launch!(st, f, grid(n); out.ptr(), pg, order.ptr(), starts.ptr(), vocab as i64, d as i64);
        out
    }
    fn cat<E: Precision>(
        &self,
        parts: &[(&CudaStorage<E>, &Layout, usize)],
        outer: usize,
        inner: usize,
    ) -> CudaStorage<E> {
        let st = self.st();
        let total: usize = parts.iter().map(|p| p.2).sum();
        let out = self.uninit::<E>(outer * total * inner);
        let out_row = total * inner;
        let mut at = 0;
        for (s, l, d) in parts {
            let part_row = d * inner;
            if outer * part_row > 0 {
                let (c, off) = self.contig(s, l);
                let f = st.family_fn(Family::Index, E::DTYPE, "cat_fwd");
                launch!(st, f, grid(outer * part_row);
                    out.ptr(), c.ptr_at(off), outer as i64, part_row as i64, out_row as i64, at as i64);
            }
            at += part_row;
        }
        out
    }

    // ---- random numbers

    fn dropout<E: Precision>(&self, x: &CudaStorage<E>, l: &Layout, p: f64, seed: u64) -> CudaStorage<E> {
        let st = self.st();
        let n = l.numel();
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let (cfg, thr, scale) = dropout_launch(n, p);
        let (sh, v) = view1("dropout", l);
        let f = st.family_fn(Family::Amp, E::DTYPE, "dropout_fwd");
        launch!(st, f, cfg; out.ptr(), x.ptr(), sh, v, n as i64, thr, scale, seed);
        out
    }

    // ---- the AMP passes

    fn unscale_check<E: Precision>(
        &self,
        grads: &mut [&mut CudaStorage<E>],
        scale: Option<&CudaStorage<f64>>,
        found_inf: &mut CudaStorage<f32>,
        first_flag: usize,
    ) {
        let st = self.st();
        assert!(Self::is_exclusive(found_inf), "backend invariant: found_inf is shared");
        let mut table = Vec::new();
        for (i, g) in grads.iter().enumerate() {
            assert!(Self::is_exclusive(g), "backend invariant: in-place pass on a shared storage");
            let mut start = 0;
            while start < g.len {
                let len = UNSCALE_CHUNK.min(g.len - start);
                table.push(AmpChunk { ptr: g.ptr_at(start), len: len as i64, flag: (first_flag + i) as i64 });
                start += len;
            }
        }
        if table.is_empty() {
            return;
        }
        let dev = self.upload(&table);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (table.len().min(1 << 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale_ptr: u64 = scale.map_or(0, |s| s.ptr());
        let f = st.family_fn(Family::Amp, E::DTYPE, "unscale_check_fwd");
        launch!(st, f, cfg; dev.ptr(), table.len() as i64, scale_ptr, found_inf.ptr());
    }
    fn update_scale(&self, state: &mut CudaStorage<f64>, found_inf: &CudaStorage<f32>, rule: &ScaleRule) {
        assert!(Self::is_exclusive(state), "backend invariant: in-place pass on a shared storage");
        let st = self.st();
        let f = st.family_fn(Family::Scaler, DType::F32, "update_scale_fwd");
        let one = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        launch!(st, f, one;
            state.ptr(), found_inf.ptr(), found_inf.len as i64,
            rule.growth_factor, rule.backoff_factor, rule.growth_interval as i64,
            rule.min_scale.is_some() as i32, rule.min_scale.unwrap_or(0.0),
            rule.max_scale.is_some() as i32, rule.max_scale.unwrap_or(0.0),
            rule.hysteresis as i64,
            rule.set_scale.is_some() as i32, rule.set_scale.unwrap_or(0.0));
    }
    fn norm_into<E: Precision>(&self, x: &CudaStorage<E>, l: &Layout, out: &mut CudaStorage<f32>, at: usize) {
        assert!(Self::is_exclusive(out), "backend invariant: in-place pass on a shared storage");
        let st = self.st();
        let n = l.numel();
        if n == 0 {
            self.memset_zero(out.ptr_at(at), 4);
            return;
        }
        let cfg = grid(n);
        let blocks = cfg.grid_dim.0 as usize;
        let parts = RawVec::new(st, blocks, acc_dtype(E::DTYPE).size_in_bytes());
        let (sh, v) = view1("norm_into", l);
        let f = st.family_fn(Family::Amp, E::DTYPE, "sum_squares_fwd");
        launch!(st, f, cfg; parts.ptr(), x.ptr(), sh, v, n as i64);
        let one_block =
            cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let f = st.family_fn(Family::Amp, E::DTYPE, "norm_finish_fwd");
        launch!(st, f, one_block; out.ptr_at(at), parts.ptr(), blocks as i64);
    }
    fn clip_coefficient(&self, norms: &CudaStorage<f32>, max_norm: f32, out: &mut CudaStorage<f32>) {
        assert!(Self::is_exclusive(out), "backend invariant: in-place pass on a shared storage");
        let st = self.st();
        let f = st.family_fn(Family::Scaler, DType::F32, "clip_coefficient_fwd");
        let one = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        launch!(st, f, one; out.ptr(), norms.ptr(), norms.len as i64, max_norm);
    }
    fn scale_in_place<E: Precision>(&self, x: &mut CudaStorage<E>, k: &CudaStorage<f32>, at: usize) {
        assert!(Self::is_exclusive(x), "backend invariant: in-place pass on a shared storage");
        let st = self.st();
        if x.len > 0 {
            let f = st.family_fn(Family::Amp, E::DTYPE, "scale_fwd");
            launch!(st, f, grid(x.len); x.ptr(), x.len as i64, k.ptr_at(at));
        }
    }
    fn clamp_in_place<E: Precision>(&self, x: &mut CudaStorage<E>, c: f32) {
        assert!(Self::is_exclusive(x), "backend invariant: in-place pass on a shared storage");
        let st = self.st();
        if x.len > 0 {
            let f = st.family_fn(Family::Amp, E::DTYPE, "clamp_fwd");
            launch!(st, f, grid(x.len); x.ptr(), x.len as i64, c);
        }
    }

    // ---- values for the host

    type Value<T: Scalar> = Lazy<T>;
    fn value<T: Scalar>(&self, read: impl FnOnce() -> T + Send + 'static) -> Lazy<T> {
        Lazy::new(read)
    }

    // ---- optimizer updates

    fn state_zeros(&self, n: usize) -> CudaStateVec {
        CudaStateVec(self.zeros::<f32>(n))
    }
    fn state_from_host(&self, v: Vec<f32>) -> CudaStateVec {
        CudaStateVec(self.from_host(v))
    }
    fn state_to_host(&self, v: &CudaStateVec) -> Vec<f32> {
        self.download(v.0.ptr(), v.0.len)
    }
    fn state_len(&self, v: &CudaStateVec) -> usize {
        v.0.len
    }
    fn sgd_update(
        &self,
        rows: &[SgdArgs],
        param: &mut CudaStorage<f32>,
        grad: &CudaStorage<f32>,
        momentum_buffer: Option<&mut CudaStateVec>,
        outcomes: Option<Outcomes<'_, CudaStorage<f32>>>,
    ) {
        assert!(Self::is_exclusive(param), "backend invariant: sgd_update on a shared parameter");
        let st = self.st();
        let n = param.len;
        if n == 0 {
            return;
        }
        let table = SgdRows::of(rows);
        let SgdArgs { weight_decay, momentum, keep, nesterov, .. } = rows[0];
        let buf = momentum_buffer.map_or(0, |b| b.0.ptr());
        let (flags, at) = outcomes.map_or((0, 0), |o| (o.flags.ptr(), o.at as i32));
        let f = st.family_fn(Family::Optim, DType::F32, "sgd_update_fwd");
        launch!(st, f, grid(n);
            param.ptr(), grad.ptr(), buf, n as i64, table, weight_decay.is_some() as i32, weight_decay.unwrap_or(0.0),
            momentum, keep, nesterov as i32, flags, at);
    }
    fn write_bf16(
        &self,
        updated: &CudaStorage<f32>,
        param: &mut CudaStorage<half::bf16>,
        mode: Bf16Write,
        compensation: Option<&mut CudaStorage<half::bf16>>,
    ) {
        assert!(Self::is_exclusive(param), "backend invariant: write_bf16 into a shared parameter");
        let st = self.st();
        let n = param.len;
        if n == 0 {
            return;
        }
        match (mode, compensation) {
            (Bf16Write::Nearest, None) => {
                let f = st.family_fn(Family::Optim, DType::F32, "write_bf16_nearest_fwd");
                launch!(st, f, grid(n); param.ptr(), updated.ptr(), n as i64);
            }
            (Bf16Write::Kahan, Some(c)) => {
                let f = st.family_fn(Family::Optim, DType::F32, "write_bf16_kahan_fwd");
                launch!(st, f, grid(n); param.ptr(), c.ptr(), updated.ptr(), n as i64);
            }
            (Bf16Write::Stochastic { key }, None) => {
                let f = st.family_fn(Family::Optim, DType::F32, "write_bf16_stochastic_fwd");
                launch!(st, f, grid(n); param.ptr(), updated.ptr(), n as i64, key);
            }
            (mode, c) => panic!("backend invariant: {mode:?} with compensation {}", c.is_some()),
        }
    }
    fn adam_update(
        &self,
        rows: &[AdamArgs],
        param: &mut CudaStorage<f32>,
        grad: &CudaStorage<f32>,
        exp_avg: &mut CudaStateVec,
        exp_avg_sq: &mut CudaStateVec,
        outcomes: Option<Outcomes<'_, CudaStorage<f32>>>,
    ) {
        assert!(Self::is_exclusive(param), "backend invariant: adam_update on a shared parameter");
        let st = self.st();
        let n = param.len;
        if n == 0 {
            return;
        }
        let table = AdamRows::of(rows);
        let AdamArgs { lerp_weight, beta2, one_minus_beta2, eps, decay, .. } = rows[0];
        let (l2, wd) = match decay {
            AdamDecay::L2(wd) => (1i32, wd),
            _ => (0, 0.0f32),
        };
        let decoupled = matches!(decay, AdamDecay::Decoupled(_)) as i32;
        let (flags, at) = outcomes.map_or((0, 0), |o| (o.flags.ptr(), o.at as i32));
        let f = st.family_fn(Family::Optim, DType::F32, "adam_update_fwd");
        launch!(st, f, grid(n);
            param.ptr(), grad.ptr(), exp_avg.0.ptr(), exp_avg_sq.0.ptr(), n as i64, table, lerp_weight, beta2,
            one_minus_beta2, eps, l2, wd, decoupled, flags, at);
    }
}

impl Cuda {
    fn pool_fwd<E: Precision>(&self, x: &CudaStorage<E>, l: &Layout, spec: &Pool2dSpec, stem: &str) -> CudaStorage<E> {
        let st = self.st();
        let n = spec.planes * spec.output.0 * spec.output.1;
        let out = self.uninit::<E>(n);
        if n == 0 {
            return out;
        }
        let (c, off) = self.contig(x, l);
        let f = st.family_fn(Family::Pool, E::DTYPE, stem);
        launch!(st, f, grid(n); out.ptr(), c.ptr_at(off), PoolGeom::of(spec));
        out
    }
}

/// Rows (queries, or keys in dK/dV) per block of the fused attention kernels, and their
/// threads (`AMP_FLASH_ROWS` and `AMP_FLASH_THREADS` in `attention_flash.cu`; a test checks).
const FLASH_ROWS: usize = 64;
const FLASH_THREADS: u32 = 128;

/// The fused tensor-core kernels (`attention_flash.cu`: forward, dQ, dK/dV) when causal attention
/// can take them: f16 or bf16, heads of 32 or 64 values, every operand 16-byte aligned (their
/// 128-bit loads), and a grid within CUDA's limits (heads in x, blocks of 64 rows in y).
/// Otherwise (`None`) the cuBLAS path, as when [`Cuda::set_flash_attention`] turned them off.
fn flash_kernels(dtype: DType, n: usize, t: usize, d: usize, ptrs: &[u64]) -> Option<[&'static str; 3]> {
    let stems = match d {
        32 => ["attention_flash_d32_fwd", "attention_flash_d32_dq_bwd", "attention_flash_d32_dkv_bwd"],
        64 => ["attention_flash_d64_fwd", "attention_flash_d64_dq_bwd", "attention_flash_d64_dkv_bwd"],
        _ => return None,
    };
    let fits = matches!(dtype, DType::F16 | DType::BF16)
        && n < 1 << 31
        && t.div_ceil(FLASH_ROWS) < 1 << 16
        && vector_rows(d, dtype.size_in_bytes(), ptrs);
    fits.then_some(stems)
}

/// The fused attention kernels' grid: a block per head (x) and per 64 rows (y).
fn flash_grid(n: usize, t: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, t.div_ceil(FLASH_ROWS) as u32, 1),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Query rows per block of causal attention: as many as keep its `[n, rows, t]` score tile in
/// the accumulation type (`acc` bytes) within [`ATTENTION_TILE_BYTES`], a multiple of 16
/// between 16 and 128, and at most `t`. Larger blocks mean fewer, larger GEMMs; the causal
/// product computes the upper half of each block's diagonal square and throws it away.
fn attention_block(n: usize, t: usize, acc: usize) -> usize {
    let fit = ATTENTION_TILE_BYTES / (n * t * acc).max(1);
    (fit / 16 * 16).clamp(16, 128).min(t.max(1))
}

/// The bytes one score tile of causal attention may take (the backward holds two, and two
/// more of half or equal size for the probabilities and their gradients).
const ATTENTION_TILE_BYTES: usize = 128 << 20;

#[cfg(test)]
mod tests {
    use super::{FLASH_ROWS, FLASH_THREADS, attention_block, flash_grid, flash_kernels};
    use amp_core::DType;

    #[test]
    fn gemm_operands_are_copied_only_to_fit_cublas_or_to_batch_in_one_call() {
        use super::{Strided, needs_copy};
        let v = |shape: &[usize], strides: &[usize]| Strided {
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset: 0,
        };
        // Contiguous, transposed and broadcast operands go as they are.
        assert!(!needs_copy(&v(&[4, 8, 16], &[128, 16, 1]), 8, 16, &[4]));
        assert!(!needs_copy(&v(&[4, 16, 8], &[128, 1, 16]), 16, 8, &[4]));
        assert!(!needs_copy(&v(&[8, 16], &[16, 1]), 8, 16, &[4]));
        // Both matrix strides > 1: copied.
        assert!(needs_copy(&v(&[4, 8, 16], &[256, 32, 2]), 8, 16, &[4]));
        // W2's q ([B, H, T, hd] of a [B, T, 3, H, hd] qkv): batch dims B and H do not merge,
        // its copy's do.
        assert!(needs_copy(&v(&[2, 4, 128, 64], &[128 * 768, 64, 768, 1]), 128, 64, &[2, 4]));
        // A [B, 1] broadcast against [B, H]: not uniform, and no copy would make it so.
        assert!(!needs_copy(&v(&[2, 1, 8, 16], &[128, 128, 16, 1]), 8, 16, &[2, 3]));
    }

    #[test]
    fn the_flash_constants_match_the_kernels_and_only_qualifying_heads_take_them() {
        let source = include_str!("kernels/attention_flash.cu");
        assert!(source.contains(&format!("#define AMP_FLASH_ROWS {FLASH_ROWS}\n")));
        assert!(source.contains(&format!("#define AMP_FLASH_THREADS {FLASH_THREADS}\n")));
        let aligned = [0x1000, 0x2000];
        let takes = |dtype, n, t, d, ptrs: &[u64]| flash_kernels(dtype, n, t, d, ptrs).map(|s| s[0]);
        assert_eq!(takes(DType::BF16, 192, 1024, 64, &aligned), Some("attention_flash_d64_fwd"));
        assert_eq!(takes(DType::F16, 1, 1, 32, &aligned), Some("attention_flash_d32_fwd"));
        assert_eq!(takes(DType::F32, 192, 1024, 64, &aligned), None); // no f32 tensor-core kernel
        assert_eq!(takes(DType::BF16, 192, 1024, 128, &aligned), None); // dK/dV would spill
        assert_eq!(takes(DType::BF16, 192, 1024, 64, &[0x1000, 0x2008]), None); // misaligned
        assert_eq!(takes(DType::BF16, 1, 64 << 16, 64, &aligned), None); // 65,536 blocks of rows
        assert_eq!(flash_grid(192, 1024).grid_dim, (192, 16, 1));
        assert_eq!(flash_grid(2, 65).grid_dim, (2, 2, 1));
    }

    #[test]
    fn attention_blocks_fit_the_tile_budget_in_multiples_of_16() {
        // GPT-2 small at batch 16: 192 heads of 1024 positions, f32 scores: 128 rows would
        // take 96 MiB, so 128 fits the 128 MiB budget.
        assert_eq!(attention_block(192, 1024, 4), 128);
        // Twice the batch: 80 rows (120 MiB).
        assert_eq!(attention_block(384, 1024, 4), 80);
        // Tiny problems: all rows at once; huge ones: at least 16 rows.
        assert_eq!(attention_block(2, 5, 4), 5);
        assert_eq!(attention_block(4096, 8192, 8), 16);
    }
}
