//! The backend trait: what a device must provide for every op, autograd and the AMP passes.
//!
//! Design notes:
//! - [`Device`] is the one trait a device implements (the CPU in `crate::cpu`, CUDA in
//!   `amp-cuda`). `Tensor<E, D = Cpu>` carries its device as a type, like its precision, and
//!   every op in `crate::ops` is written once against this trait: the op checks shapes, calls
//!   the device's kernel and records the backward; it never touches memory itself.
//! - Kernels take storage with a [`Layout`] (shape, strides, offset), so a transposed,
//!   narrowed or broadcast view goes in as it is; each returns a new contiguous storage.
//!   Outputs come from the device's caching allocator.
//! - Elementwise ops are values ([`UnaryOp`], [`BinaryOp`]): a unit struct with its Rust
//!   expression (run by the CPU in the accumulation type) and its CUDA C expression side by
//!   side, so a device runs any of them through one generic map kernel.
//! - Index tensors ([`crate::Indices`], [`crate::Mask`]) live on the host: kernels that read
//!   them take host slices.
//! - The methods are grouped below by kind; each group's comment says what it is for.

use std::fmt;

use crate::layout::Layout;
use crate::precision::{Accum, Precision};

/// An elementwise function of one input and its derivative: the op's value carries both
/// halves, the Rust expression (CPU, in the accumulation type `A`) and the CUDA C expression.
///
/// The CUDA expressions are in terms of `x` (the input), `y` (the output, for the
/// derivative) and `p` (the op's parameter, [`UnaryOp::param`]), all of the accumulation type
/// `acc_t` (`float` for f16/bf16/f32, `double` for f64); CUDA's overloaded math functions
/// (`exp`, `erf`, `tanh`...) pick the precision from it.
pub trait UnaryOp: Copy + Send + Sync + 'static {
    /// The op's name (in errors, the autograd graph and CUDA kernel names).
    const NAME: &'static str;
    /// `y = f(x)` as a CUDA C expression.
    const CUDA_FORWARD: &'static str;
    /// `dy/dx` as a CUDA C expression of `x` and `y`.
    const CUDA_DERIVATIVE: &'static str;
    /// The op's constant (the exponent of `powf`, the `c` of `x * c`), 0 when it has none.
    fn param(&self) -> f64 {
        0.0
    }
    /// `y = f(x)`.
    fn forward<A: Accum>(&self, x: A) -> A;
    /// `dy/dx`, given the input `x` and the output `y`.
    fn derivative<A: Accum>(&self, x: A, y: A) -> A;
}

/// An elementwise function of two inputs, broadcast together: its Rust expression and its
/// CUDA C expression (in terms of `a`, `b` and the parameter `p`, of type `acc_t`).
pub trait BinaryOp: Copy + Send + Sync + 'static {
    /// The op's name.
    const NAME: &'static str;
    /// `f(a, b)` as a CUDA C expression.
    const CUDA: &'static str;
    /// The op's constant, 0 when it has none.
    fn param(&self) -> f64 {
        0.0
    }
    /// `f(a, b)`.
    fn apply<A: Accum>(&self, a: A, b: A) -> A;
}

/// What a dim reduction computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum, times a scale applied before the one rounding (`1/d` for a mean).
    Sum,
    /// The maximum (NaN wins, as in PyTorch).
    Max,
}

/// A tensor viewed as `[outer, d, inner]` around the dim an op works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DimSplit {
    /// Product of the dims before.
    pub outer: usize,
    /// The dim itself.
    pub dim: usize,
    /// Product of the dims after.
    pub inner: usize,
}

impl DimSplit {
    /// `shape` split around `dim`.
    pub fn of(shape: &[usize], dim: usize) -> Self {
        let (outer, d, inner) = crate::layout::outer_dim_inner(shape, dim);
        DimSplit { outer, dim: d, inner }
    }
}

/// Cross-entropy's inputs besides the logits: one target class per row (host data), the
/// ignored class and label smoothing.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropySpec<'a> {
    /// One class index per row (already checked to be in range or ignored).
    pub targets: &'a [i64],
    /// Rows whose target equals this contribute nothing and are not counted.
    pub ignore: Option<i64>,
    /// Label smoothing in `[0, 1]`.
    pub smoothing: f64,
}

/// The CPU: storage is a shared buffer from the caching allocator ([`crate::cpu_memory`]),
/// kernels run on rayon's thread pool. Its [`Device`] implementation is in `crate::cpu`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cpu;

/// A device a tensor can live on, and every kernel the library runs there.
///
/// A storage handle is cheap to clone (a reference count); kernels never write into an input.
/// The few in-place methods take `&mut Storage` that the caller owns alone
/// ([`Device::is_exclusive`]).
pub trait Device: Clone + Send + Sync + fmt::Debug + Default + 'static {
    /// The storage of a tensor of precision `E` on this device.
    type Storage<E: Precision>: Clone + Send + Sync + 'static;
    /// What a fused row kernel keeps for its backward (a norm's row means and reciprocal
    /// standard deviations, cross-entropy's row log-sum-exps), in the accumulation type.
    type RowStats<E: Precision>: Send + Sync + 'static;

    /// The device's name in messages (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    // ---- allocation and copies ---------------------------------------------------------------
    // Host data in and out, fills, contiguous copies of views, and the ownership test that
    // in-place writes rely on.

    /// A storage holding `data` (moved to the device).
    fn from_host<E: Precision>(&self, data: Vec<E>) -> Self::Storage<E>;
    /// `n` elements equal to `value`.
    fn full<E: Precision>(&self, n: usize, value: E) -> Self::Storage<E>;
    /// The view's values in row-major order, on the host.
    fn to_host<E: Precision>(&self, s: &Self::Storage<E>, l: &Layout) -> Vec<E>;
    /// A contiguous copy of the view.
    fn contiguous<E: Precision>(&self, s: &Self::Storage<E>, l: &Layout) -> Self::Storage<E>;
    /// Number of elements in the storage (not the view).
    fn len<E: Precision>(s: &Self::Storage<E>) -> usize;
    /// Whether nothing else holds this storage, so writing into it changes nothing anyone
    /// else can see.
    fn is_exclusive<E: Precision>(s: &Self::Storage<E>) -> bool;
    /// Writes the view `src` (`sl`) into the view `dl` of `dst` (same shape), adding to what
    /// is there when `add` (in `E::Acc`, one rounding per element) or copying otherwise.
    /// `dst` is owned alone.
    fn write_into<E: Precision>(
        &self,
        dst: &mut Self::Storage<E>,
        dl: &Layout,
        src: &Self::Storage<E>,
        sl: &Layout,
        add: bool,
    );

    // ---- casts ------------------------------------------------------------------------------

    /// The view's values rounded once into `T` (contiguous).
    fn cast<E: Precision, T: Precision>(&self, s: &Self::Storage<E>, l: &Layout) -> Self::Storage<T>;
    /// The view's values rounded once into `dst` (contiguous, whole, owned alone, same length).
    fn cast_into<E: Precision, T: Precision>(&self, s: &Self::Storage<E>, l: &Layout, dst: &mut Self::Storage<T>);

    // ---- elementwise maps over strided, broadcasting layouts -----------------------------------

    /// `op(x)` elementwise.
    fn unary<E: Precision, O: UnaryOp>(&self, op: O, x: &Self::Storage<E>, l: &Layout) -> Self::Storage<E>;
    /// `g * op'(x, y)` elementwise over three views of one shape (the unary op's backward).
    fn unary_backward<E: Precision, O: UnaryOp>(
        &self,
        op: O,
        x: (&Self::Storage<E>, &Layout),
        y: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<E>, &Layout),
    ) -> Self::Storage<E>;
    /// `op(a, b)` with both broadcast (by their layouts) to `shape`.
    fn binary<E: Precision, O: BinaryOp>(
        &self,
        op: O,
        a: (&Self::Storage<E>, &Layout),
        b: (&Self::Storage<E>, &Layout),
        shape: &[usize],
    ) -> Self::Storage<E>;
    /// `mask ? a : b` with the host mask (contiguous, of shape `mask_shape`) and both
    /// operands broadcast to `shape` (the ternary map).
    fn select<E: Precision>(
        &self,
        mask: (&[bool], &[usize]),
        a: (&Self::Storage<E>, &Layout),
        b: (&Self::Storage<E>, &Layout),
        shape: &[usize],
    ) -> Self::Storage<E>;

    // ---- reductions over a dim ---------------------------------------------------------------

    /// Reduces the view over `split.dim` into `[outer, inner]`, multiplying by `scale` before
    /// the one rounding.
    fn reduce<E: Precision>(
        &self,
        x: &Self::Storage<E>,
        l: &Layout,
        split: DimSplit,
        op: ReduceOp,
        scale: f64,
    ) -> Self::Storage<E>;
    /// The index along `split.dim` of the max (or min) of every `[outer, inner]` position
    /// (first occurrence; NaN wins), on the host, with the selected values.
    fn arg_reduce<E: Precision>(
        &self,
        x: &Self::Storage<E>,
        l: &Layout,
        split: DimSplit,
        max: bool,
    ) -> (Self::Storage<E>, Vec<usize>);
    /// The backward of a selection along a dim: zeros of `[outer, dim, inner]` with `g[i]`
    /// written at index `idx[i]` of the dim.
    fn scatter_dim<E: Precision>(
        &self,
        g: &Self::Storage<E>,
        l: &Layout,
        idx: &[usize],
        split: DimSplit,
    ) -> Self::Storage<E>;

    // ---- batched strided GEMM (f32 accumulation for f16 and bf16, one rounding) ----------------

    /// `a @ b` for `a: [..., m, k]`, `b: [..., k, n]` with broadcast batch dims resolved into
    /// `batch`; transposes are strides, not copies. Contiguous `[batch..., m, n]`.
    fn matmul<E: Precision>(
        &self,
        a: (&Self::Storage<E>, &Layout),
        b: (&Self::Storage<E>, &Layout),
        batch: &[usize],
    ) -> Self::Storage<E>;
    /// `x wᵀ + bias` for `x: [rows, in]`, `w: [out, in]`, with the bias (contiguous `[out]`)
    /// added in the accumulator.
    fn linear<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        w: (&Self::Storage<E>, &Layout),
        bias: Option<(&Self::Storage<E>, &Layout)>,
    ) -> Self::Storage<E>;

    // ---- fused rows: softmax, norms, cross-entropy (statistics in E::Acc, one rounding) -------

    /// Softmax (or log-softmax with `log`) of every row of `d` elements of the view.
    fn softmax<E: Precision>(&self, x: &Self::Storage<E>, l: &Layout, d: usize, log: bool) -> Self::Storage<E>;
    /// Softmax's backward from its output `y` and the gradient `g` (views of one shape).
    fn softmax_backward<E: Precision>(
        &self,
        y: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<E>, &Layout),
        d: usize,
        log: bool,
    ) -> Self::Storage<E>;
    /// Layer norm (or RMS norm with `rms`) of every row of `d` elements, with the optional
    /// weight and bias (contiguous `[d]`); returns the output and what backward needs.
    #[allow(clippy::too_many_arguments)]
    fn norm<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        d: usize,
        weight: Option<(&Self::Storage<E>, &Layout)>,
        bias: Option<(&Self::Storage<E>, &Layout)>,
        eps: f64,
        rms: bool,
    ) -> (Self::Storage<E>, Self::RowStats<E>);
    /// The norm's backward: gradients of the input, and of the weight and bias where `needs`
    /// asks for them.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn norm_backward<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<E>, &Layout),
        d: usize,
        weight: Option<(&Self::Storage<E>, &Layout)>,
        stats: &Self::RowStats<E>,
        needs: (bool, bool),
        rms: bool,
    ) -> (Self::Storage<E>, Option<Self::Storage<E>>, Option<Self::Storage<E>>);
    /// Cross-entropy of logits `[rows, c]`: the mean loss over counted rows (0-dim, rounded
    /// once into `E`), the row statistics for backward, and the number of counted rows.
    fn cross_entropy<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
    ) -> (Self::Storage<E>, Self::RowStats<E>, usize);
    /// Cross-entropy's backward with the upstream gradient divided by the counted rows
    /// (`scale`).
    fn cross_entropy_backward<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
        stats: &Self::RowStats<E>,
        scale: f64,
    ) -> Self::Storage<E>;
    /// `mean((a - b)²)` over two views of one shape, as a 0-dim storage rounded once into `E`.
    fn mse<E: Precision>(&self, a: (&Self::Storage<E>, &Layout), b: (&Self::Storage<E>, &Layout)) -> Self::Storage<E>;

    // ---- gather, scatter-add, embedding, cat --------------------------------------------------

    /// `out[r] = w[ids[r]]` for rows of `d` elements (ids bounds-checked by the caller).
    fn gather_rows<E: Precision>(&self, w: (&Self::Storage<E>, &Layout), ids: &[i64], d: usize) -> Self::Storage<E>;
    /// The embedding backward: `out[v] = Σ_{r: ids[r] = v} g[r]` for `v` in `0..vocab`, in
    /// `E::Acc` in a fixed order, rounded once.
    fn scatter_add_rows<E: Precision>(
        &self,
        g: (&Self::Storage<E>, &Layout),
        ids: &[i64],
        vocab: usize,
        d: usize,
    ) -> Self::Storage<E>;
    /// Concatenates views (each `[outer, d_i, inner]`, `d_i` given) along the middle dim.
    fn cat<E: Precision>(
        &self,
        parts: &[(&Self::Storage<E>, &Layout, usize)],
        outer: usize,
        inner: usize,
    ) -> Self::Storage<E>;

    // ---- random numbers from a counter-based generator ------------------------------------------

    /// Dropout: `x * keep / (1 - p)` with the keep mask a pure function of `(seed, element
    /// index)`, so backward regenerates it and every device draws the same mask.
    fn dropout<E: Precision>(&self, x: &Self::Storage<E>, l: &Layout, p: f64, seed: u64) -> Self::Storage<E>;

    // ---- the AMP passes ---------------------------------------------------------------------
    // In place on gradients the caller owns alone (contiguous, whole).

    /// The fused unscale and non-finite check over several f32 gradients: every value is
    /// multiplied by `inv` (`1/scale` rounded to f32; non-finite values too, as PyTorch does)
    /// and `found_inf[i]` is set to 1 when gradient `i` had an inf or NaN (left as it was
    /// otherwise). `found_inf` has one element per gradient.
    fn unscale_check(&self, grads: &mut [&mut Self::Storage<f32>], inv: f32, found_inf: &mut Self::Storage<f32>);
    /// Whether the view holds an inf or NaN.
    fn any_non_finite<E: Precision>(&self, x: &Self::Storage<E>, l: &Layout) -> bool;
    /// `Σ x²` over the view, in `E::Acc` (f32 for f16/bf16/f32), widened to f64.
    fn sum_squares<E: Precision>(&self, x: &Self::Storage<E>, l: &Layout) -> f64;
    /// Multiplies every element by `k` in place (one rounding).
    fn scale_in_place<E: Precision>(&self, x: &mut Self::Storage<E>, k: f32);
    /// Clamps every element to `[-c, c]` in place (NaN kept).
    fn clamp_in_place<E: Precision>(&self, x: &mut Self::Storage<E>, c: f32);
}
