//! The CUDA C sources of every kernel, and the programs NVRTC compiles from them.
//!
//! Design notes:
//! - The sources are `.cu` files beside this one (`include_str!`), all header-free: the
//!   prelude (`prelude.cuh`) defines the f16/bf16 types and their conversions by inline PTX,
//!   the layout structs and the block reductions. Each family file defines templates and one
//!   macro per dtype that declares its `extern "C"` entry points. The fused attention family
//!   also starts with `mma.cuh` (tensor-core products by inline PTX). The host emulation
//!   (`tests/emulated/`) runs these sources as they are, replacing only `mma.cuh` and the
//!   prelude's inline-PTX conversions (guarded by `AMP_HOST_EMULATION`).
//! - A [`Program`] is the prelude, one family file and the macro lines for one (op, precision):
//!   what the backend compiles once per device and caches. Elementwise ops get their program
//!   from the op value: a struct `amp_op` whose `fwd` / `der` / `apply` return the op's CUDA C
//!   expressions ([`UnaryOp::CUDA_FORWARD`], [`UnaryOp::CUDA_DERIVATIVE`], [`BinaryOp::CUDA`])
//!   in `acc_t` (float, or double for f64).
//! - Kernel names are `<op>_<fwd|bwd>_<dtype>` (`gelu_bwd_bf16`, `softmax_fwd_f16`,
//!   `cast_to_f32_fwd_bf16`); each program lists the names it defines, and the PTX test checks
//!   that every one of them is an entry of the compiled PTX.
//! - [`catalog`] is every program the backend can ask for: each family at each precision, each
//!   cast pair, and each elementwise op value of amp-core at each precision.

use amp_core::DType;
use amp_core::backend::{BinaryOp, UnaryOp};
use amp_core::ops::{binary, loss, unary};

/// The shared-memory limits the row kernels are launched under (checked against ptxas's report
/// of each kernel in `tests/ptx.rs`).
pub use crate::launch::{BLOCK_SMEM, ROW_SMEM};

/// The prelude every program starts with.
pub const PRELUDE: &str = include_str!("prelude.cuh");
const MAP: &str = include_str!("map.cu");
const REDUCE: &str = include_str!("reduce.cu");
const ROWS: &str = include_str!("rows.cu");
const ATTENTION: &str = include_str!("attention.cu");
/// The tensor-core product helpers first: the fused attention kernels use them.
const ATTENTION_FLASH: &str = concat!(include_str!("mma.cuh"), include_str!("attention_flash.cu"));
const INDEX: &str = include_str!("index.cu");
const CONV: &str = include_str!("conv.cu");
const POOL: &str = include_str!("pool.cu");
const BATCH_NORM: &str = include_str!("batch_norm.cu");
const AMP: &str = include_str!("amp.cu");
const OPTIM: &str = include_str!("optim.cu");

/// Every precision a tensor can have, in kernel-name order.
pub const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// One NVRTC compilation unit: its source and the kernels it defines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    /// A name for NVRTC's messages and the cache (`relu_f16`, `softmax_bf16`).
    pub name: String,
    /// The full CUDA C source (prelude included).
    pub source: String,
    /// The `extern "C"` kernels it defines.
    pub kernels: Vec<String>,
}

/// The kernel families with fixed sources (everything except the elementwise op maps and the
/// casts, which are generated per op value and per precision pair).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Strided copy, fill, write into a view (copy or add), `where`.
    Copy,
    /// Sum and max over a dim, arg max / arg min, the selection's scatter.
    Reduce,
    /// Softmax and log-softmax, forward and backward.
    Softmax,
    /// Layer norm and RMS norm, forward and backward, with the weight and bias gradients.
    Norm,
    /// Cross-entropy forward and backward, the squared-error sum, the f64 mean.
    Loss,
    /// Causal attention's kernels between its cuBLAS products: the probabilities of a block
    /// of query rows, and in the backward g·out per row and the score gradients.
    Attention,
    /// Causal attention fused on tensor cores (f16 and bf16, heads of 32 or 64 values):
    /// the forward, and the backward's dQ and dK/dV kernels.
    AttentionFlash,
    /// The embedding gather and scatter-add, concatenation.
    Index,
    /// im2col, col2im, the bias fill and the per-channel bias gradient.
    Conv,
    /// Max and average pooling, forward and backward.
    Pool,
    /// Batch norm's statistics, running update, forward and backward.
    BatchNorm,
    /// The fused multi-tensor unscale and non-finite check, the sum of squares and norm,
    /// scale and clamp in place, dropout.
    Amp,
    /// The loss scaler's update and the clip scalars (f32 only: they work on a few scalars).
    Scaler,
    /// SGD and Adam/AdamW updates of f32 parameters, and the bf16 write-backs.
    Optim,
}

impl Family {
    /// Every family.
    pub const ALL: [Family; 14] = [
        Family::Copy,
        Family::Reduce,
        Family::Softmax,
        Family::Norm,
        Family::Loss,
        Family::Attention,
        Family::AttentionFlash,
        Family::Index,
        Family::Conv,
        Family::Pool,
        Family::BatchNorm,
        Family::Amp,
        Family::Scaler,
        Family::Optim,
    ];

    /// The family's name (its programs are `<name>_<dtype>`).
    pub fn name(self) -> &'static str {
        match self {
            Family::Copy => "copy",
            Family::Reduce => "reduce",
            Family::Softmax => "softmax",
            Family::Norm => "norm",
            Family::Loss => "loss",
            Family::Attention => "attention",
            Family::AttentionFlash => "attention_flash",
            Family::Index => "index",
            Family::Conv => "conv",
            Family::Pool => "pool",
            Family::BatchNorm => "batch_norm",
            Family::Amp => "amp",
            Family::Scaler => "scaler",
            Family::Optim => "optim",
        }
    }

    /// The precisions the family exists for.
    pub fn dtypes(self) -> &'static [DType] {
        match self {
            Family::Scaler | Family::Optim => &[DType::F32],
            Family::AttentionFlash => &[DType::F16, DType::BF16],
            _ => &DTYPES,
        }
    }

    fn source(self) -> &'static str {
        match self {
            Family::Copy => MAP,
            Family::Reduce => REDUCE,
            Family::Softmax | Family::Norm | Family::Loss => ROWS,
            Family::Attention => ATTENTION,
            Family::AttentionFlash => ATTENTION_FLASH,
            Family::Index => INDEX,
            Family::Conv => CONV,
            Family::Pool => POOL,
            Family::BatchNorm => BATCH_NORM,
            Family::Amp | Family::Scaler => AMP,
            Family::Optim => OPTIM,
        }
    }

    /// The macro that declares the family's kernels for one dtype (none: fixed kernels).
    fn instantiation(self) -> Option<&'static str> {
        Some(match self {
            Family::Copy => "AMP_COPY_KERNELS",
            Family::Reduce => "AMP_REDUCE_KERNELS",
            Family::Softmax => "AMP_SOFTMAX_KERNELS",
            Family::Norm => "AMP_NORM_KERNELS",
            Family::Loss => "AMP_LOSS_KERNELS",
            Family::Attention => "AMP_ATTENTION_KERNELS",
            Family::AttentionFlash => "AMP_FLASH_KERNELS",
            Family::Index => "AMP_INDEX_KERNELS",
            Family::Conv => "AMP_CONV_KERNELS",
            Family::Pool => "AMP_POOL_KERNELS",
            Family::BatchNorm => "AMP_BATCH_NORM_KERNELS",
            Family::Amp => "AMP_AMP_KERNELS",
            Family::Scaler => "AMP_SCALER_KERNELS",
            Family::Optim => return None,
        })
    }

    /// The family's kernels, without the dtype suffix.
    pub fn kernel_stems(self) -> &'static [&'static str] {
        match self {
            Family::Copy => &["copy_fwd", "fill_fwd", "write_into_fwd", "where_fwd"],
            Family::Reduce => {
                &["sum_fwd", "max_fwd", "reduce_partial_fwd", "reduce_parts_fwd", "arg_reduce_fwd", "scatter_dim_bwd"]
            }
            Family::Softmax => &[
                "softmax_fwd",
                "log_softmax_fwd",
                "softmax_bwd",
                "log_softmax_bwd",
                "softmax_warp_fwd",
                "log_softmax_warp_fwd",
                "softmax_warp_bwd",
                "log_softmax_warp_bwd",
            ],
            Family::Norm => &[
                "layer_norm_fwd",
                "rms_norm_fwd",
                "layer_norm_bwd",
                "rms_norm_bwd",
                "layer_norm_warp_fwd",
                "rms_norm_warp_fwd",
                "layer_norm_warp_bwd",
                "rms_norm_warp_bwd",
                "norm_params_partial_bwd",
                "norm_params_bwd",
            ],
            Family::Loss => &["cross_entropy_fwd", "cross_entropy_bwd", "mse_fwd", "mse_bwd", "mean_f64_fwd"],
            Family::Attention => &["attention_probs_fwd", "attention_delta_bwd", "attention_grads_bwd"],
            Family::AttentionFlash => &[
                "attention_flash_d32_fwd",
                "attention_flash_d32_dq_bwd",
                "attention_flash_d32_dkv_bwd",
                "attention_flash_d64_fwd",
                "attention_flash_d64_dq_bwd",
                "attention_flash_d64_dkv_bwd",
            ],
            Family::Index => &["gather_rows_fwd", "scatter_add_rows_bwd", "cat_fwd"],
            Family::Conv => &["im2col_fwd", "col2im_bwd", "bias_fill_fwd", "channel_sum_bwd"],
            Family::Pool => &["max_pool2d_fwd", "max_pool2d_bwd", "avg_pool2d_fwd", "avg_pool2d_bwd"],
            Family::BatchNorm => &[
                "batch_norm_stats_fwd",
                "batch_norm_running_fwd",
                "batch_norm_given_fwd",
                "batch_norm_fwd",
                "batch_norm_sums_bwd",
                "batch_norm_bwd",
            ],
            Family::Amp => {
                &["unscale_check_fwd", "sum_squares_fwd", "norm_finish_fwd", "scale_fwd", "clamp_fwd", "dropout_fwd"]
            }
            Family::Scaler => &["update_scale_fwd", "clip_coefficient_fwd"],
            Family::Optim => &[
                "sgd_update_fwd",
                "adam_update_fwd",
                "write_bf16_nearest_fwd",
                "write_bf16_kahan_fwd",
                "write_bf16_stochastic_fwd",
            ],
        }
    }
}

/// A kernel's full name: `<stem>_<dtype>`.
pub fn kernel_name(stem: &str, dtype: DType) -> String {
    format!("{stem}_{}", dtype.name())
}

fn assemble(name: String, body: &str, tail: &str, kernels: Vec<String>) -> Program {
    let source = format!("{PRELUDE}\n// ---- {name}\n{body}\n{tail}\n");
    Program { name, source, kernels }
}

/// The program of a fixed family at one precision.
///
/// # Panics
/// If the family does not exist at `dtype` (the scaler's and the optimizers' kernels are f32
/// only).
pub fn family(f: Family, dtype: DType) -> Program {
    assert!(f.dtypes().contains(&dtype), "kernel family {} has no {dtype} kernels", f.name());
    let kernels = f.kernel_stems().iter().map(|s| kernel_name(s, dtype)).collect();
    let tail = f.instantiation().map(|m| format!("{m}({})", dtype.name())).unwrap_or_default();
    assemble(format!("{}_{}", f.name(), dtype.name()), f.source(), &tail, kernels)
}

/// The name of the cast kernel from `src` to `dst`: `cast_to_<dst>_fwd_<src>`.
pub fn cast_kernel(src: DType, dst: DType) -> String {
    kernel_name(&format!("cast_to_{}_fwd", dst.name()), src)
}

/// The program of the cast from `src` to `dst` (one rounding).
pub fn cast(src: DType, dst: DType) -> Program {
    let tail = format!("AMP_CAST_KERNEL({}, {})", src.name(), dst.name());
    assemble(format!("cast_{}_to_{}", src.name(), dst.name()), MAP, &tail, vec![cast_kernel(src, dst)])
}

fn acc_type(dtype: DType) -> &'static str {
    if dtype == DType::F64 { "double" } else { "float" }
}

/// Panics unless `name` can be pasted into a C identifier.
fn check_identifier(name: &str) {
    assert!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
        "op name {name:?} cannot name a CUDA kernel (letters, digits and '_' only)"
    );
}

/// The program of a unary op from its name and CUDA C expressions (`fwd` of `x` and `p`,
/// `der` of `x`, `y` and `p`, in `acc_t`): kernels `<name>_fwd_<dtype>` and
/// `<name>_bwd_<dtype>`.
pub fn unary_source(name: &str, fwd: &str, der: &str, dtype: DType) -> Program {
    check_identifier(name);
    let acc = acc_type(dtype);
    let tail = format!(
        "struct amp_op {{\n    typedef {acc} acc_t;\n    \
         static __device__ __forceinline__ acc_t fwd(acc_t x, acc_t p) {{ return ({fwd}); }}\n    \
         static __device__ __forceinline__ acc_t der(acc_t x, acc_t y, acc_t p) {{ return ({der}); }}\n}};\n\
         AMP_UNARY_KERNELS({name}, {})",
        dtype.name()
    );
    let kernels = vec![kernel_name(&format!("{name}_fwd"), dtype), kernel_name(&format!("{name}_bwd"), dtype)];
    assemble(format!("{name}_{}", dtype.name()), MAP, &tail, kernels)
}

/// The program of a unary op value at one precision.
pub fn unary<O: UnaryOp>(dtype: DType) -> Program {
    unary_source(O::NAME, O::CUDA_FORWARD, O::CUDA_DERIVATIVE, dtype)
}

/// The program of a binary op from its name and CUDA C expression (of `a`, `b` and `p`, in
/// `acc_t`): kernel `<name>_fwd_<dtype>`.
pub fn binary_source(name: &str, expr: &str, dtype: DType) -> Program {
    check_identifier(name);
    let acc = acc_type(dtype);
    let tail = format!(
        "struct amp_op {{\n    typedef {acc} acc_t;\n    \
         static __device__ __forceinline__ acc_t apply(acc_t a, acc_t b, acc_t p) {{ return ({expr}); }}\n}};\n\
         AMP_BINARY_KERNEL({name}, {})",
        dtype.name()
    );
    assemble(format!("{name}_{}", dtype.name()), MAP, &tail, vec![kernel_name(&format!("{name}_fwd"), dtype)])
}

/// The program of a binary op value at one precision.
pub fn binary<O: BinaryOp>(dtype: DType) -> Program {
    binary_source(O::NAME, O::CUDA, dtype)
}

/// A unary op value's name and CUDA C halves, type-erased (for the catalogue).
#[derive(Clone, Copy, Debug)]
pub struct UnarySpec {
    /// [`UnaryOp::NAME`].
    pub name: &'static str,
    /// [`UnaryOp::CUDA_FORWARD`].
    pub forward: &'static str,
    /// [`UnaryOp::CUDA_DERIVATIVE`].
    pub derivative: &'static str,
}

fn unary_spec<O: UnaryOp>() -> UnarySpec {
    UnarySpec { name: O::NAME, forward: O::CUDA_FORWARD, derivative: O::CUDA_DERIVATIVE }
}

/// Every unary op value amp-core defines (keep in step with `amp_core::ops`: the PTX test
/// counts the op definitions in amp-core's sources and fails when one is missing here).
pub fn unary_ops() -> Vec<UnarySpec> {
    vec![
        unary_spec::<unary::Neg>(),
        unary_spec::<unary::Relu>(),
        unary_spec::<unary::Gelu>(),
        unary_spec::<unary::GeluTanh>(),
        unary_spec::<unary::Square>(),
        unary_spec::<unary::Tanh>(),
        unary_spec::<unary::Sigmoid>(),
        unary_spec::<unary::Silu>(),
        unary_spec::<unary::Exp>(),
        unary_spec::<unary::Log>(),
        unary_spec::<unary::Sqrt>(),
        unary_spec::<unary::Powf>(),
        unary_spec::<unary::AddScalar>(),
        unary_spec::<unary::MulScalar>(),
        unary_spec::<unary::DivScalar>(),
        unary_spec::<unary::ScalarDiv>(),
    ]
}

/// Every binary op value amp-core defines, as (name, CUDA C expression).
pub fn binary_ops() -> Vec<(&'static str, &'static str)> {
    fn spec<O: BinaryOp>() -> (&'static str, &'static str) {
        (O::NAME, O::CUDA)
    }
    vec![
        spec::<binary::Add>(),
        spec::<binary::Sub>(),
        spec::<binary::Mul>(),
        spec::<binary::Div>(),
        spec::<loss::ScaledDiff>(),
    ]
}

/// Every program the backend can compile: each family at each of its precisions, each cast
/// pair, and each elementwise op value at each precision.
pub fn catalog() -> Vec<Program> {
    let mut out = Vec::new();
    for f in Family::ALL {
        for &d in f.dtypes() {
            out.push(family(f, d));
        }
    }
    for s in DTYPES {
        for d in DTYPES {
            if s != d {
                out.push(cast(s, d));
            }
        }
    }
    for op in unary_ops() {
        for d in DTYPES {
            out.push(unary_source(op.name, op.forward, op.derivative, d));
        }
    }
    for (name, expr) in binary_ops() {
        for d in DTYPES {
            out.push(binary_source(name, expr, d));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_name_their_kernels_by_op_direction_and_dtype() {
        let p = unary::<unary::Gelu>(DType::BF16);
        assert_eq!(p.kernels, ["gelu_fwd_bf16", "gelu_bwd_bf16"]);
        assert!(p.source.contains("erf(x * acc_t(0.7071067811865476))"));
        assert!(p.source.contains("typedef float acc_t;"));
        let p = binary::<binary::Mul>(DType::F64);
        assert_eq!(p.kernels, ["mul_fwd_f64"]);
        assert!(p.source.contains("typedef double acc_t;"));
        assert_eq!(family(Family::Softmax, DType::F16).kernels[0], "softmax_fwd_f16");
        assert_eq!(cast_kernel(DType::BF16, DType::F32), "cast_to_f32_fwd_bf16");
        assert!(family(Family::Norm, DType::F32).source.ends_with("AMP_NORM_KERNELS(f32)\n"));
    }

    #[test]
    fn the_catalogue_has_every_program_once() {
        let all = catalog();
        let families: usize = Family::ALL.iter().map(|f| f.dtypes().len()).sum();
        assert_eq!(all.len(), families + 12 + 4 * (unary_ops().len() + binary_ops().len()));
        let mut names: Vec<_> = all.iter().map(|p| p.name.clone()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len(), "program names are unique");
        let mut kernels: Vec<_> = all.iter().flat_map(|p| p.kernels.clone()).collect();
        let n = kernels.len();
        kernels.sort();
        kernels.dedup();
        assert_eq!(kernels.len(), n, "kernel names are unique");
    }

    #[test]
    fn the_optimizer_kernels_take_one_row_per_step_of_a_window() {
        // The Rust row structs are `[_; STEPS_PER_READ]`; the kernel's are `[_; AMP_STEP_ROWS]`.
        let define = format!("#define AMP_STEP_ROWS {}\n", amp_core::optim::STEPS_PER_READ);
        assert!(OPTIM.contains(&define), "optim.cu must say {define:?}");
    }

    #[test]
    #[should_panic(expected = "cannot name a CUDA kernel")]
    fn an_op_name_that_is_not_an_identifier_is_refused() {
        unary_source("bad-name", "x", "acc_t(1)", DType::F32);
    }
}
