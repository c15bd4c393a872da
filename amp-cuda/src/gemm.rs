//! GEMM on cuBLAS: `cublasGemmStridedBatchedEx` for every precision, f32 compute for f16,
//! bf16 and f32 (`CUBLAS_COMPUTE_32F`; TF32 only when the device allows it), f64 for f64.
//!
//! Design notes:
//! - cuBLAS is column-major; a row-major `C = A·B` is computed as `Cᵀ = Bᵀ·Aᵀ`. A row-major
//!   view `[r, c]` with strides `(rs, cs)` is, untouched, either the column-major `Xᵀ`
//!   (`cs == 1`, leading dimension `rs`) or `X` to be transposed by the op flag (`rs == 1`,
//!   leading dimension `cs`), so transposed views cost no copy ([`as_operand`]); anything else
//!   (both strides > 1) is copied contiguous by the caller first.
//! - Batches with a uniform stride per operand (contiguous batch dims, or broadcast ones at
//!   stride 0) are one strided-batched call; other batch layouts fall back to one call per
//!   product.
//! - The handle's math mode disallows reduced-precision reductions (set when the device is
//!   opened), so f16 and bf16 products accumulate in f32 to the end and round once.
//! - `linear` and the convolution add their bias in the accumulator: the output is pre-filled
//!   with it and the GEMM runs with `beta = 1`. cuBLAS adds C to the product in f32 (an
//!   f16/bf16 C widens exactly) and rounds the sum to the output's type at the end, the values
//!   an f32 buffer and a cast afterwards gave, so f16/bf16 outputs need no f32 buffer.
//! - The output type can differ from the inputs' (f16 inputs into an f32 buffer): that is how
//!   col2im gets f32 column gradients.

use std::ffi::c_void;

use amp_core::DType;
use cudarc::cublas::sys::{self, cublasComputeType_t, cublasOperation_t, cudaDataType};

use crate::device::State;

/// One GEMM operand as cuBLAS sees it: address of its first element, leading dimension,
/// whether the op transposes it, and the stride (in elements) between batch members.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mat {
    pub(crate) ptr: u64,
    pub(crate) ld: usize,
    pub(crate) trans: bool,
    pub(crate) stride: usize,
}

/// How a row-major `[r, c]` view with strides `(rs, cs)` enters cuBLAS as `Xᵀ` (`c × r`,
/// column-major): `(transpose flag, leading dimension)`, or `None` when it needs a copy.
pub(crate) fn as_operand(r: usize, c: usize, rs: usize, cs: usize) -> Option<(bool, usize)> {
    if (cs == 1 || c == 1) && (r == 1 || rs >= c.max(1)) {
        return Some((false, if r == 1 { c.max(1) } else { rs }));
    }
    if (rs == 1 || r == 1) && (c == 1 || cs >= r.max(1)) {
        return Some((true, if c == 1 { r.max(1) } else { cs }));
    }
    None
}

fn data_type(d: DType) -> cudaDataType {
    match d {
        DType::F16 => cudaDataType::CUDA_R_16F,
        DType::BF16 => cudaDataType::CUDA_R_16BF,
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::F64 => cudaDataType::CUDA_R_64F,
    }
}

/// Column-major `C[m × n] = op(A)[m × k] · op(B)[k × n] + beta·C` for `batch` products, inputs
/// of precision `input`, output `c` of precision `output`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    st: &State,
    input: DType,
    output: DType,
    (m, n, k): (usize, usize, usize),
    a: Mat,
    b: Mat,
    c: Mat,
    batch: usize,
    beta: f64,
) {
    if m == 0 || n == 0 || batch == 0 {
        return;
    }
    let too_big = |v: usize| v > i32::MAX as usize;
    assert!(
        ![m, n, k, a.ld, b.ld, c.ld, batch].into_iter().any(too_big),
        "{}: matmul of {m}x{k} by {k}x{n} (batch {batch}) exceeds cuBLAS's 32-bit sizes",
        st.name()
    );
    let compute = match input {
        DType::F64 => cublasComputeType_t::CUBLAS_COMPUTE_64F,
        DType::F32 if st.tf32.load(std::sync::atomic::Ordering::Relaxed) => {
            cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        }
        _ => cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    let (alpha32, beta32, alpha64, beta64) = (1f32, beta as f32, 1f64, beta);
    let (alpha_p, beta_p): (*const c_void, *const c_void) = if input == DType::F64 {
        (&alpha64 as *const f64 as _, &beta64 as *const f64 as _)
    } else {
        (&alpha32 as *const f32 as _, &beta32 as *const f32 as _)
    };
    let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
    st.enter();
    let blas = st.blas.lock().unwrap_or_else(|e| e.into_inner());
    let span = crate::profile::Span::begin(st);
    // SAFETY: the handle is valid and bound to the device's stream; the caller passes device
    // addresses of live blocks holding every element the operands' shapes, leading dimensions
    // and batch strides reach; alpha and beta point to host scalars of the compute type
    // (f64 for f64, f32 otherwise) that outlive the call.
    let r = unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *blas.handle(),
            op(a.trans),
            op(b.trans),
            m as i32,
            n as i32,
            k as i32,
            alpha_p,
            a.ptr as *const c_void,
            data_type(input),
            a.ld as i32,
            a.stride as i64,
            b.ptr as *const c_void,
            data_type(input),
            b.ld as i32,
            b.stride as i64,
            beta_p,
            c.ptr as *mut c_void,
            data_type(output),
            c.ld as i32,
            c.stride as i64,
            batch as i32,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    drop(blas);
    st.check("cublasGemmStridedBatchedEx", r);
    span.end(st, || format!("gemm_{}_{}", input, output));
}

/// Row-major `C[m × n] = A[m × k] · B[k × n] + beta·C` for `batch` products over raw device
/// addresses: each [`Mat`] is a row-major operand with `ld` its row stride, `trans` when what
/// is stored is its transpose (`[k × m]` for `A`), `stride` the step between batch members.
/// As [`gemm`]'s column-major `Cᵀ = Bᵀ · Aᵀ`: the operands swap, the flags carry over.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rm_gemm(
    st: &State,
    input: DType,
    output: DType,
    (m, n, k): (usize, usize, usize),
    a: Mat,
    b: Mat,
    c: Mat,
    batch: usize,
    beta: f64,
) {
    gemm(st, input, output, (n, m, k), b, a, c, batch, beta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_enter_cublas_untransposed_or_by_flag_or_not_at_all() {
        // Row-major [3, 4]: its own transpose in column-major, leading dimension 4.
        assert_eq!(as_operand(3, 4, 4, 1), Some((false, 4)));
        // A narrowed row-major view keeps the parent's row stride.
        assert_eq!(as_operand(3, 2, 4, 1), Some((false, 4)));
        // The transpose of a row-major [4, 3] (strides (1, 3)): transposed by the flag.
        assert_eq!(as_operand(3, 4, 1, 3), Some((true, 3)));
        // Vectors: any stride in the size-1 dim.
        assert_eq!(as_operand(1, 5, 0, 1), Some((false, 5)));
        assert_eq!(as_operand(5, 1, 1, 0), Some((false, 1)));
        // Both strides > 1 (every other column of a matrix): needs a copy.
        assert_eq!(as_operand(3, 4, 8, 2), None);
        // Broadcast rows (stride 0) cannot be a leading dimension.
        assert_eq!(as_operand(3, 4, 0, 1), None);
    }
}
