//! Launch plumbing: the layout structs kernels take by value, launch configurations, and small
//! host <-> device copies. Public so the host emulation's tests (`tests/kernels_emulated.rs`)
//! can check that their runners launch kernels by these rules.
//!
//! Design notes:
//! - [`AmpShape`] and [`AmpView`] mirror the prelude's structs field for field (`#[repr(C)]`).
//!   Before a strided kernel, dims that every operand walks contiguously are merged and size-1
//!   dims dropped ([`collapse`], the CPU backend's rule), so most views reach the kernel with
//!   rank 1 or 2; at most [`MAX_RANK`] dims remain, or the call panics naming the op.
//! - Elementwise kernels use grid-stride loops: 256 threads a block, enough blocks to fill the
//!   GPU and no more ([`grid`]). Row kernels use one block per row ([`rows_grid`]).

use amp_core::layout::Layout;
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// The prelude's `AMP_MAX_RANK`.
pub const MAX_RANK: usize = 12;

/// A shape for a kernel (the prelude's `AmpShape`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AmpShape {
    rank: i32,
    pad: i32,
    dims: [i64; MAX_RANK],
}

/// One operand's offset and strides for a kernel (the prelude's `AmpView`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AmpView {
    offset: i64,
    strides: [i64; MAX_RANK],
}

impl AmpShape {
    /// The dims (`rank` of them).
    pub fn dims(&self) -> &[i64] {
        &self.dims[..self.rank as usize]
    }
}

impl AmpView {
    /// The offset of the view's first element, in elements.
    pub fn offset(&self) -> i64 {
        self.offset
    }
    /// The strides of the first `rank` dims, in elements.
    pub fn strides(&self, rank: usize) -> &[i64] {
        &self.strides[..rank]
    }
}

// SAFETY: both are `#[repr(C)]` structs of plain integers with the field order, types and
// padding of the prelude's structs, passed by value as kernel parameters.
unsafe impl DeviceRepr for AmpShape {}
// SAFETY: as above.
unsafe impl DeviceRepr for AmpView {}

/// Strides of `l` seen through broadcasting to `shape` (broadcast dims get stride 0).
pub fn broadcast_strides(l: &Layout, shape: &[usize]) -> Vec<usize> {
    let pad = shape.len() - l.shape().len();
    let mut strides = vec![0; shape.len()];
    for (i, (&d, &s)) in l.shape().iter().zip(l.strides()).enumerate() {
        strides[pad + i] = if d == 1 { 0 } else { s };
    }
    strides
}

/// Merges dims every operand walks contiguously and drops size-1 dims (the CPU backend's
/// `collapse`): the same walk with fewer dims.
pub fn collapse(shape: &[usize], strides: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let k = strides.len();
    let mut out_shape: Vec<usize> = Vec::new();
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); k];
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        let mergeable = !out_shape.is_empty() && (0..k).all(|i| *out[i].last().unwrap() == strides[i][d] * shape[d]);
        if mergeable {
            *out_shape.last_mut().unwrap() *= shape[d];
            for i in 0..k {
                *out[i].last_mut().unwrap() = strides[i][d];
            }
        } else {
            out_shape.push(shape[d]);
            for i in 0..k {
                out[i].push(strides[i][d]);
            }
        }
    }
    (out_shape, out)
}

/// The kernel arguments for views `(offset, strides)` over one `shape`, collapsed.
///
/// # Panics
/// When more than [`MAX_RANK`] dims remain after merging (names `op`).
pub fn views(op: &str, shape: &[usize], operands: &[(usize, Vec<usize>)]) -> (AmpShape, Vec<AmpView>) {
    let strides: Vec<Vec<usize>> = operands.iter().map(|o| o.1.clone()).collect();
    let (cs, cst) = collapse(shape, &strides);
    assert!(
        cs.len() <= MAX_RANK,
        "cuda: {op}: a view with {} dims that do not merge is not supported (at most {MAX_RANK}); make it contiguous first",
        cs.len()
    );
    let mut s = AmpShape { rank: cs.len() as i32, ..Default::default() };
    for (i, &d) in cs.iter().enumerate() {
        s.dims[i] = d as i64;
    }
    let vs = operands
        .iter()
        .zip(&cst)
        .map(|((off, _), st)| {
            let mut v = AmpView { offset: *off as i64, ..Default::default() };
            for (i, &x) in st.iter().enumerate() {
                v.strides[i] = x as i64;
            }
            v
        })
        .collect();
    (s, vs)
}

/// The arguments for one view over its own shape.
pub fn view1(op: &str, l: &Layout) -> (AmpShape, AmpView) {
    let (s, v) = views(op, l.shape(), &[(l.offset(), l.strides().to_vec())]);
    (s, v[0])
}

/// `mode` of the elementwise map kernels (`map.cu`) for values of `elem_bytes` bytes: 2 when
/// every view is dense (`dense_all`) and every address in `ptrs` (the views' first elements
/// and the output) is 16-byte aligned (128-bit loads and stores), 1 when dense, 0 for strided.
pub fn map_mode(elem_bytes: usize, dense_all: bool, ptrs: &[u64]) -> i32 {
    if !dense_all {
        0
    } else if ptrs.iter().all(|p| p.is_multiple_of(16)) && elem_bytes <= 16 {
        2
    } else {
        1
    }
}

/// Threads per block of the elementwise kernels.
pub const THREADS: u32 = 256;

/// A grid-stride launch over `n` work items (`n > 0`).
pub fn grid(n: usize) -> LaunchConfig {
    // 132 SMs × 2048 threads on an H200, a few times over: more blocks than that only loop.
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row for `rows` rows of `d` elements, with `smem` bytes of dynamic shared memory.
pub fn rows_grid(rows: usize, d: usize, smem: u32) -> LaunchConfig {
    let threads = d.next_power_of_two().clamp(32, 512) as u32;
    let blocks = rows.clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem }
}

/// Rows per block of the warp-per-row kernels (`AMP_WARP_ROWS` in `rows.cu`; a test checks).
pub const WARP_ROWS: usize = 4;

/// One warp per row, [`WARP_ROWS`] rows per block, for `rows` rows.
pub fn warp_rows_grid(rows: usize) -> LaunchConfig {
    let blocks = rows.div_ceil(WARP_ROWS).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * WARP_ROWS as u32, 1, 1), shared_mem_bytes: 0 }
}

/// Whether rows of `d` values of `E` at every address in `ptrs` (0: an absent operand) can
/// move in 128-bit vectors: `d` a multiple of `16 / size_of(E)` and each address 16-byte
/// aligned (so every row is).
pub fn vector_rows(d: usize, elem_bytes: usize, ptrs: &[u64]) -> bool {
    d > 0 && d.is_multiple_of(16 / elem_bytes) && ptrs.iter().all(|&p| p.is_multiple_of(16))
}

/// The 128-bit vectors per lane (1, 2, 4 or 8) of the warp-per-row kernels for rows of `d`
/// values of `elem_bytes` bytes at `ptrs`, when they qualify: [`vector_rows`], and at most 32
/// values per lane (a row of up to 1024 values in f32, f16 and bf16, 512 in f64).
pub fn warp_vectors(d: usize, elem_bytes: usize, ptrs: &[u64]) -> Option<i32> {
    if !vector_rows(d, elem_bytes, ptrs) {
        return None;
    }
    let per_vector = 16 / elem_bytes;
    let per_lane = (d / per_vector).div_ceil(32);
    [1, 2, 4, 8].into_iter().find(|&nv| per_lane <= nv && nv * per_vector <= 32).map(|nv| nv as i32)
}

/// Dynamic shared memory a row kernel may cache its row in: without opting in
/// (`cuFuncSetAttribute`), a block's static and dynamic shared memory together get 48 KiB, and
/// the row kernels' own reduction arrays take up to 272 bytes (f64), so 1 KiB is left for them.
/// At the full 48 KiB, rows of 12,253-12,288 f32 values (6,127-6,144 in a norm's backward)
/// failed to launch. `tests/ptx.rs` checks every row kernel's static shared memory fits.
pub const ROW_SMEM: usize = 47 * 1024;

/// The shared memory a block gets without opting in to more.
pub const BLOCK_SMEM: usize = 48 * 1024;

/// The shared memory to cache `per_row` bytes of a row in, and whether it fits.
pub fn row_cache(per_row: usize) -> (u32, i32) {
    if per_row <= ROW_SMEM { (per_row as u32, 1) } else { (0, 0) }
}

/// Dropout's launch over `n` values with drop probability `p`: one 256-thread block per chunk of
/// 16,384 values (`AMP_DROPOUT_CHUNK` in `amp.cu`, the CPU's chunk; grid-stride past 2^16
/// chunks), the keep threshold on a draw's 32 bits (`p · 2^32`, rounded) and the scale of a kept
/// value, `1 / (1 - p)`.
pub fn dropout_launch(n: usize, p: f64) -> (LaunchConfig, u32, f64) {
    let chunks = n.div_ceil(16384).clamp(1, 1 << 16) as u32;
    let cfg = LaunchConfig { grid_dim: (chunks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let thr = (p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32;
    (cfg, thr, 1.0 / (1.0 - p))
}

/// How to split a reduction over `dim` into parts, for `m` outputs `inner` apart: `(rows per
/// part, parts)` when one thread per output would leave the GPU mostly idle (fewer than 2^17
/// outputs) walking a long dim (at least 64), so that about 2^18 threads share the work with
/// at least 16 rows each; `None` for reductions over the last dim (one block per row) and
/// the rest.
pub fn reduce_parts(m: usize, dim: usize, inner: usize) -> Option<(usize, usize)> {
    if inner == 1 || m >= 1 << 17 || dim < 64 {
        return None;
    }
    let parts = (1usize << 18).div_ceil(m).clamp(2, dim / 16);
    let per = dim.div_ceil(parts);
    Some((per, dim.div_ceil(per)))
}

/// Launches `func` on the state's stream with the given arguments (each bound to a local so it
/// outlives the launch), panicking with the kernel's name on a launch error.
macro_rules! launch {
    ($st:expr, $func:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let st: &crate::device::State = $st;
        let kernel: crate::device::Kernel = $func;
        let cfg: cudarc::driver::LaunchConfig = $cfg;
        let mut builder = st.stream.launch_builder(&kernel.function);
        $(
            let arg = $arg;
            builder.arg(&arg);
        )*
        let span = crate::profile::Span::begin(st);
        // SAFETY: the arguments are the kernel's parameters in order and type (the prelude's
        // structs are mirrored by `AmpShape`/`AmpView`, pointers are u64 device addresses of
        // live blocks sized for the kernel's indexing), and they live until the launch returns.
        let r = unsafe { builder.launch(cfg) };
        st.check(&format!("launching {}", kernel.name), r);
        span.end(st, || kernel.name.clone());
    }};
}
pub(crate) use launch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_column_sums_are_split_into_parts_that_cover_the_dim() {
        // A bias gradient of GPT-2's MLP: 3072 sums over 16384 rows -> 86 parts of 191 rows.
        assert_eq!(reduce_parts(3072, 16384, 3072), Some((191, 86)));
        for (m, dim) in [(768, 16384), (50304, 16384), (5, 64), (96, 4096), (7, 1000)] {
            let (per, parts) = reduce_parts(m, dim, m).unwrap();
            assert!(per * parts >= dim && per * (parts - 1) < dim, "{m} x {dim}: {per} x {parts}");
            assert!(per >= 16);
        }
        // Rows (inner 1), many outputs, short dims: one thread (or block) per output.
        assert_eq!(reduce_parts(10, 5000, 1), None);
        assert_eq!(reduce_parts(1 << 17, 5000, 64), None);
        assert_eq!(reduce_parts(100, 63, 100), None);
    }

    #[test]
    fn the_warp_rows_match_the_kernels_constant() {
        let define = format!("#define AMP_WARP_ROWS {WARP_ROWS}\n");
        assert!(include_str!("kernels/rows.cu").contains(&define), "rows.cu must say {define:?}");
    }

    #[test]
    fn short_aligned_rows_go_to_a_warp_with_at_most_32_values_per_lane() {
        // bf16: 8 values per vector; GPT-2's 768 features are 96 vectors, 3 per lane -> 4.
        assert_eq!(warp_vectors(768, 2, &[0x1000, 0]), Some(4));
        assert_eq!(warp_vectors(1024, 2, &[0x1000]), Some(4));
        assert_eq!(warp_vectors(1032, 2, &[0x1000]), None); // 33 values per lane
        assert_eq!(warp_vectors(1024, 4, &[0x1000]), Some(8));
        assert_eq!(warp_vectors(512, 8, &[0x1000]), Some(8));
        assert_eq!(warp_vectors(8, 2, &[0x1000]), Some(1));
        assert_eq!(warp_vectors(12, 2, &[0x1000]), None); // not a whole vector
        assert_eq!(warp_vectors(16, 2, &[0x1008]), None); // misaligned
        assert!(vector_rows(50304, 2, &[0x1000]) && !vector_rows(50303, 2, &[0x1000]));
    }

    #[test]
    fn the_vectors_per_lane_never_exceed_what_the_kernels_instantiate() {
        // rows.cu's amp_nv_max: 4 for 16-bit values, 8 otherwise (a larger nv traps there).
        let most = include_str!("kernels/rows.cu");
        assert!(most.contains("return sizeof(T) == 2 ? 4 : 8;"), "rows.cu's amp_nv_max changed");
        for (bytes, max) in [(2, 4), (4, 8), (8, 8)] {
            for d in 1..=2048 {
                if let Some(nv) = warp_vectors(d, bytes, &[0x1000]) {
                    assert!(nv <= max, "{d} values of {bytes} bytes: {nv} vectors a lane");
                }
            }
        }
    }
}
