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

mod step_state;

pub use step_state::{HostValue, Lazy, Scalar, ScaleRule, ScaleSlot, clip_coefficient, inv_scale, total_norm};

use crate::layout::Layout;
use crate::precision::{Accum, Precision};

/// [`Device::scaled_masked_softmax`] as PyTorch's chain, op by op: the scores times `scale`
/// (rounded into `E`), -inf where masked, the softmax in f32, and that cast into `E`.
pub(crate) fn scaled_masked_softmax_by_ops<D: Device, E: Precision>(
    dev: &D,
    (x, l): (&D::Storage<E>, &Layout),
    scale: f64,
    mask: (&[bool], &[usize]),
) -> (D::Storage<f32>, D::Storage<E>) {
    let shape = l.shape();
    let c = Layout::contiguous(shape);
    let scaled = dev.unary(crate::ops::unary::MulScalar(scale), x, l);
    let fill = dev.full(1, E::from_f64(f64::NEG_INFINITY));
    let masked = dev.select(mask, (&fill, &Layout::contiguous(&[])), (&scaled, &c), shape);
    let probs = dev.softmax_to_f32(&masked, &c, shape[shape.len() - 1], false);
    let out = dev.cast::<f32, E>(&probs, &c);
    (probs, out)
}

/// [`Device::scaled_masked_softmax_backward`] as the chain's backward, op by op: the cast's
/// (to f32), the f32 softmax's (rounded into `E`), the mask's (zeros) and the scale's.
pub(crate) fn scaled_masked_softmax_backward_by_ops<D: Device, E: Precision>(
    dev: &D,
    probs: (&D::Storage<f32>, &Layout),
    g: (&D::Storage<E>, &Layout),
    scale: f64,
    mask: (&[bool], &[usize]),
) -> D::Storage<E> {
    let shape = probs.1.shape();
    let c = Layout::contiguous(shape);
    let g32 = dev.cast::<E, f32>(g.0, g.1);
    let gs = dev.softmax_backward_from_f32::<E>(probs, (&g32, &c), shape[shape.len() - 1], false);
    let zero = dev.full(1, E::from_f64(0.0));
    let gm = dev.select(mask, (&zero, &Layout::contiguous(&[])), (&gs, &c), shape);
    dev.unary_backward(crate::ops::unary::MulScalar(scale), (&gm, &c), (&gm, &c), (&gm, &c))
}

/// [`Device::add_cast`] as the chain, op by op: `b` cast into `E`, then the add.
pub(crate) fn add_cast_by_ops<D: Device, E: Precision, O: Precision>(
    dev: &D,
    a: (&D::Storage<E>, &Layout),
    b: (&D::Storage<O>, &Layout),
    shape: &[usize],
) -> D::Storage<E> {
    let cast = dev.cast::<O, E>(b.0, b.1);
    dev.binary(crate::ops::binary::Add, a, (&cast, &Layout::contiguous(b.1.shape())), shape)
}

/// [`Device::norm_backward_into`] as two ops: the norm's backward, then its input gradient
/// added into `acc` ([`Device::write_into`]).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn norm_backward_into_by_ops<D: Device, E: Precision, O: Precision>(
    dev: &D,
    x: (&D::Storage<E>, &Layout),
    g: (&D::Storage<O>, &Layout),
    d: usize,
    weight: Option<(&D::Storage<E>, &Layout)>,
    stats: &D::RowStats<E>,
    needs: (bool, bool),
    rms: bool,
    acc: &mut D::Storage<E>,
) -> (Option<D::Storage<E>>, Option<D::Storage<E>>) {
    let (gx, gw, gb) = dev.norm_backward_from(x, g, d, weight, stats, needs, rms);
    let l = Layout::contiguous(x.1.shape());
    dev.write_into(acc, &l, &gx, &l, true);
    (gw, gb)
}

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
    /// Whether [`derivative`](Self::derivative) reads its `x` (GELU's does, `exp`'s does not).
    /// When false, a backward pass may skip loading `x` and pass any value in its place.
    const DERIVATIVE_READS_X: bool = true;
    /// Whether [`derivative`](Self::derivative) reads its `y` (`exp`'s does, GELU's does not).
    /// When false, a backward pass may skip loading `y` and pass any value in its place.
    const DERIVATIVE_READS_Y: bool = true;
    /// Whether the CPU backend evaluates this op on f16 and bf16 by table lookup: `forward`
    /// and `derivative` at each of the 65,536 values, computed once per process by those
    /// functions with the usual rounding (so the results are the same bits), then looked up,
    /// 16 values per AVX-512 gather. Worth it where `forward` costs more than a lookup (GELU's
    /// `erf`, `tanh`, `exp`): GELU ran 3x faster. The derivative is looked up where it reads
    /// `x` alone (GELU's); one of `y` is computed. Only for an op whose results depend on `x`,
    /// `y` and [`param`](Self::param) alone.
    const TABULATE: bool = false;
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

/// A fused causal attention's sizes: `q`, `k`, `v` and the output are `[n, t, d]` (`n` =
/// batch × heads, `t` positions, `d` features per head), the scores scaled by `scale`
/// (`1/√d` for GPT's attention).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Batch × heads.
    pub n: usize,
    /// Positions (queries and keys).
    pub t: usize,
    /// Features per head.
    pub d: usize,
    /// The factor of the scores `q·k`.
    pub scale: f64,
}

/// A 2-D convolution with every size resolved (the op checks them): input
/// `[batch, in_channels, input.0, input.1]`, weight
/// `[out_channels, in_channels / groups, kernel.0, kernel.1]`, output
/// `[batch, out_channels, output.0, output.1]`. Pairs are (height, width); the input is
/// zero-padded by `padding` on each side, as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dSpec {
    /// N.
    pub batch: usize,
    /// C_in.
    pub in_channels: usize,
    /// C_out.
    pub out_channels: usize,
    /// Channel groups: output channels of group `g` see input channels of group `g` only.
    pub groups: usize,
    /// The input's (H, W).
    pub input: (usize, usize),
    /// The weight's (kH, kW).
    pub kernel: (usize, usize),
    /// The output's (oH, oW): `(H + 2 padding - dilation (k - 1) - 1) / stride + 1` per dim.
    pub output: (usize, usize),
    /// Steps between windows.
    pub stride: (usize, usize),
    /// Zeros added on each side.
    pub padding: (usize, usize),
    /// Steps between the taps of a window.
    pub dilation: (usize, usize),
}

impl Conv2dSpec {
    /// The output size along one dim, or `None` when the dilated kernel does not fit the
    /// padded input (or the stride is 0).
    pub fn output_size(input: usize, kernel: usize, stride: usize, padding: usize, dilation: usize) -> Option<usize> {
        let span = dilation.checked_mul(kernel.checked_sub(1)?)?.checked_add(1)?;
        let padded = input.checked_add(2usize.checked_mul(padding)?)?;
        (stride > 0 && padded >= span).then(|| (padded - span) / stride + 1)
    }
    /// Input channels per group (the weight's dim 1).
    pub fn group_in(&self) -> usize {
        self.in_channels / self.groups
    }
    /// Output channels per group.
    pub fn group_out(&self) -> usize {
        self.out_channels / self.groups
    }
}

/// Where the windows of a 2-D pooling lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolWindow {
    /// Windows of `kernel` every `stride` over the input padded by `padding` on each side
    /// (pairs are (height, width)). Padding counts as -inf for a max and as 0 for an average,
    /// whose divisor is always `kernel.0 * kernel.1` (PyTorch's `count_include_pad=True`).
    Fixed {
        /// The window's (kH, kW).
        kernel: (usize, usize),
        /// Steps between windows.
        stride: (usize, usize),
        /// Padding on each side.
        padding: (usize, usize),
    },
    /// PyTorch's adaptive windows: along a dim of input size `n` and output size `m`, output
    /// `i` covers `[floor(i n / m), ceil((i + 1) n / m))`, and an average divides by the
    /// window's size.
    Adaptive,
}

/// A 2-D pooling with every size resolved: `planes` planes of `input` (every leading dim of
/// an `[N, C, H, W]` tensor, `N·C`) pooled into planes of `output`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dSpec {
    /// Number of (H, W) planes.
    pub planes: usize,
    /// The input's (H, W).
    pub input: (usize, usize),
    /// The output's (oH, oW).
    pub output: (usize, usize),
    /// Where the windows lie.
    pub window: PoolWindow,
}

impl Pool2dSpec {
    /// The input range `[start, end)` that output index `o` pools along `axis` (0: rows,
    /// 1: columns), clipped to the input, and the window's full size along that axis (the
    /// factor of an average's divisor: the kernel size for fixed windows, padding included).
    pub fn window(&self, axis: usize, o: usize) -> (usize, usize, usize) {
        let pick = |p: (usize, usize)| if axis == 0 { p.0 } else { p.1 };
        let (n, m) = (pick(self.input), pick(self.output));
        match self.window {
            PoolWindow::Fixed { kernel, stride, padding } => {
                let (k, s, p) = (pick(kernel), pick(stride), pick(padding));
                let start = (o * s) as isize - p as isize;
                let end = start + k as isize;
                (start.clamp(0, n as isize) as usize, end.clamp(0, n as isize) as usize, k)
            }
            PoolWindow::Adaptive => {
                let (start, end) = (o * n / m, ((o + 1) * n).div_ceil(m));
                (start, end, end - start)
            }
        }
    }
}

/// Where a batch norm's statistics come from.
#[derive(Debug)]
pub enum BatchNormStats<'a, S> {
    /// Training: each channel is normalised with its batch mean and biased variance. With
    /// `running` (mean and variance, contiguous `[C]` f32 storages owned alone), each
    /// becomes `(1 - momentum) * running + momentum * stat` with the batch mean and the
    /// unbiased variance, computed in f64 and rounded once into f32 (PyTorch's update).
    Batch {
        /// The running mean and variance to update in place.
        running: Option<(&'a mut S, &'a mut S)>,
        /// The weight of the new statistic.
        momentum: f64,
    },
    /// Eval: each channel is normalised with the given mean and variance (`[C]` f32 views,
    /// left as they are).
    Given {
        /// The running mean.
        mean: (&'a S, &'a Layout),
        /// The running variance.
        var: (&'a S, &'a Layout),
    },
}

/// One SGD update's arguments (PyTorch's single-tensor `sgd`), as [`Device::sgd_update`] takes
/// them: the hyperparameters already rounded to f32 where PyTorch's kernels take f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdArgs {
    /// `-lr`.
    pub neg_lr: f32,
    /// L2 weight decay added to the gradient (`g + wd·p`, fused), if any.
    pub weight_decay: Option<f32>,
    /// Momentum; 0 for plain SGD, which has no buffer.
    pub momentum: f32,
    /// `1 - dampening`.
    pub keep: f32,
    /// Nesterov momentum (`g + momentum·buf` instead of `buf`).
    pub nesterov: bool,
    /// The momentum buffer's first step: it becomes the (decayed) gradient, as PyTorch's
    /// `clone` of it, instead of `momentum·buf + keep·g`.
    pub first: bool,
}

/// How Adam applies weight decay ([`AdamArgs::decay`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AdamDecay {
    /// None.
    None,
    /// Adam's L2 decay: `g + wd·p` (fused), with this `wd`.
    L2(f32),
    /// AdamW's decoupled decay: `p ·= (1 - lr·wd)`, with this factor, before the moments.
    Decoupled(f32),
}

/// One Adam / AdamW update's arguments (PyTorch's single-tensor `adam`), as
/// [`Device::adam_update`] takes them. The step-dependent bias corrections are computed on the
/// host in f64, as Python floats, and rounded where PyTorch rounds them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamArgs {
    /// `-(lr / (1 - beta1^step))`.
    pub neg_step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bias_correction2_sqrt: f32,
    /// The weight of `exp_avg.lerp_(g, 1 - beta1)`: `1 - beta1`.
    pub lerp_weight: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// The weight decay.
    pub decay: AdamDecay,
}

/// How [`Device::write_bf16`] rounds an optimizer's f32 results into bf16 parameters
/// (pure-bf16 training; see `amp::optim::Bf16Rounding`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Write {
    /// Round to nearest even.
    Nearest,
    /// Kahan-compensated, with a bf16 compensation per value: with `p` the weight, `c` its
    /// compensation and `w` the f32 result, `y = (w − p) + c; p' = bf16(p + y);
    /// c' = bf16(y − (p' − p))`.
    Kahan,
    /// Stochastic rounding: element `i` of a finite `w` adds the low 16 bits of
    /// `splitmix64(key ^ i·0x9E3779B97F4A7C15)` to `w`'s bit pattern and keeps its top 16 bits;
    /// inf and NaN round to nearest.
    Stochastic {
        /// The parameter's key at this step.
        key: u64,
    },
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
    /// standard deviations, a batch norm's channel ones, cross-entropy's row log-sum-exps),
    /// in the accumulation type.
    type RowStats<E: Precision>: Send + Sync + 'static;

    /// The device's name in messages (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    // ---- allocation and copies ---------------------------------------------------------------
    // Host data in and out, fills, contiguous copies of views, the ownership test that
    // in-place writes rely on, and the storage identity the weight cast cache keys by.

    /// A storage holding `data` (moved to the device).
    // The device itself makes the storage (a CUDA device copies onto its own GPU), so the
    // method takes it: not the `Self::from_*` constructor the lint expects.
    #[allow(clippy::wrong_self_convention)]
    fn from_host<E: Precision>(&self, data: Vec<E>) -> Self::Storage<E>;
    /// `n` elements equal to `value`.
    fn full<E: Precision>(&self, n: usize, value: E) -> Self::Storage<E>;
    /// `n` elements whose values are unspecified, for a caller that writes every one before
    /// reading any (autograd's buffer for narrows' gradients written in place). Zeros unless a
    /// backend can skip the fill.
    fn scratch<E: Precision>(&self, n: usize) -> Self::Storage<E> {
        self.full(n, E::default())
    }
    /// The view's values in row-major order, on the host.
    fn to_host<E: Precision>(&self, s: &Self::Storage<E>, l: &Layout) -> Vec<E>;
    /// A contiguous copy of the view.
    fn contiguous<E: Precision>(&self, s: &Self::Storage<E>, l: &Layout) -> Self::Storage<E>;
    /// Number of elements in the storage (not the view).
    fn len<E: Precision>(s: &Self::Storage<E>) -> usize;
    /// Whether nothing else holds this storage, so writing into it changes nothing anyone
    /// else can see.
    fn is_exclusive<E: Precision>(s: &Self::Storage<E>) -> bool;
    /// The identity of the storage `s` is a handle to: the same for every clone of the handle,
    /// and different from that of every other storage of this device type (on any instance of
    /// it) alive at the same time, so a live handle keeps its id from being reused (on the CPU,
    /// the address of the shared buffer). The weight cast cache of `#[autocast]` keys its
    /// entries by it, each entry holding a clone of the handle.
    fn storage_id<E: Precision>(s: &Self::Storage<E>) -> usize;
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
    /// `a + b.cast::<E>()` with both broadcast to `shape`, the values of the cast then the
    /// add: autocast's residual add of a low-precision branch into an f32 stream. This
    /// default casts and adds (`add_cast_by_ops`); a backend reads `b` as it is where the
    /// cast is exact (the CPU does, for f16/bf16 into f32).
    fn add_cast<E: Precision, O: Precision>(
        &self,
        a: (&Self::Storage<E>, &Layout),
        b: (&Self::Storage<O>, &Layout),
        shape: &[usize],
    ) -> Self::Storage<E> {
        add_cast_by_ops(self, a, b, shape)
    }
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
    /// [`Device::matmul`] written into the view `dst` of `out` (shape `[batch..., m, n]`;
    /// every element of it written, nothing else touched): autograd's products writing an
    /// operand's gradient straight into a narrowed tensor's gradient buffer. The product, then
    /// a copy into the view, unless a backend writes the view directly.
    fn matmul_into_view<E: Precision>(
        &self,
        a: (&Self::Storage<E>, &Layout),
        b: (&Self::Storage<E>, &Layout),
        batch: &[usize],
        out: &mut Self::Storage<E>,
        dst: &Layout,
    ) {
        let c = self.matmul(a, b, batch);
        self.write_into(out, dst, &c, &Layout::contiguous(&dst.shape), false);
    }
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
    /// [`Device::softmax`] of a view in `E`, computed and written in f32: the values of
    /// casting to f32 first (PyTorch's `softmax(x, dim, dtype=torch.float32)`, autocast's
    /// softmax of an f16 or bf16 input). This default is that cast and the f32 softmax; a
    /// backend overrides it to skip the cast's pass over memory (the CPU does).
    fn softmax_to_f32<E: Precision>(
        &self,
        x: &Self::Storage<E>,
        l: &Layout,
        d: usize,
        log: bool,
    ) -> Self::Storage<f32> {
        let x32 = self.cast::<E, f32>(x, l);
        self.softmax(&x32, &Layout::contiguous(l.shape()), d, log)
    }
    /// [`Device::softmax_to_f32`]'s backward: the f32 input gradient from the output `y` and
    /// the gradient `g`, rounded once into the input's precision `E`. This default is the
    /// f32 backward and a cast.
    fn softmax_backward_from_f32<E: Precision>(
        &self,
        y: (&Self::Storage<f32>, &Layout),
        g: (&Self::Storage<f32>, &Layout),
        d: usize,
        log: bool,
    ) -> Self::Storage<E> {
        let gx = self.softmax_backward(y, g, d, log);
        self.cast::<f32, E>(&gx, &Layout::contiguous(y.1.shape()))
    }
    /// The attention probabilities of the scores `x` over the last dim, in f32 and rounded
    /// into `E`: the values of `x.mul_scalar(scale).masked_fill(mask, -inf).softmax_f32(last)`
    /// and of its `.cast::<E>()`, PyTorch's unfused attention under autocast (`mask` is the
    /// host mask's data and shape, broadcast to `x`'s). The f32 probabilities are what the
    /// backward reads. This default runs that chain, op by op; a backend overrides it with one
    /// pass that keeps the scaled scores in registers or cache (the CPU does).
    fn scaled_masked_softmax<E: Precision>(
        &self,
        x: &Self::Storage<E>,
        l: &Layout,
        scale: f64,
        mask: (&[bool], &[usize]),
    ) -> (Self::Storage<f32>, Self::Storage<E>) {
        scaled_masked_softmax_by_ops(self, (x, l), scale, mask)
    }
    /// [`Device::scaled_masked_softmax`]'s backward from its f32 probabilities and their
    /// gradient `g` in `E` (views of one shape): the chain's backward, bit for bit (the f32
    /// softmax's backward rounded into `E`, zero where masked, times `scale`). This default
    /// runs it op by op.
    fn scaled_masked_softmax_backward<E: Precision>(
        &self,
        probs: (&Self::Storage<f32>, &Layout),
        g: (&Self::Storage<E>, &Layout),
        scale: f64,
        mask: (&[bool], &[usize]),
    ) -> Self::Storage<E> {
        scaled_masked_softmax_backward_by_ops(self, probs, g, scale, mask)
    }
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
    /// [`Device::norm`] with its output rounded into `O`: the values of the norm then a cast
    /// (autocast's f32 layer norm feeding a low-precision matmul). This default is that norm
    /// and cast; a backend overrides it to skip the cast's pass over memory (the CPU does for
    /// an f32 input and an f16 or bf16 output).
    #[allow(clippy::too_many_arguments)]
    fn norm_to<E: Precision, O: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        d: usize,
        weight: Option<(&Self::Storage<E>, &Layout)>,
        bias: Option<(&Self::Storage<E>, &Layout)>,
        eps: f64,
        rms: bool,
    ) -> (Self::Storage<O>, Self::RowStats<E>) {
        let (y, stats) = self.norm(x, d, weight, bias, eps, rms);
        (self.cast::<E, O>(&y, &Layout::contiguous(x.1.shape())), stats)
    }
    /// [`Device::norm_to`]'s backward: [`Device::norm_backward`] from the output gradient in
    /// `O`, as the cast's backward (a cast into `E`) then the norm's would give. This default
    /// is that cast and backward.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn norm_backward_from<E: Precision, O: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<O>, &Layout),
        d: usize,
        weight: Option<(&Self::Storage<E>, &Layout)>,
        stats: &Self::RowStats<E>,
        needs: (bool, bool),
        rms: bool,
    ) -> (Self::Storage<E>, Option<Self::Storage<E>>, Option<Self::Storage<E>>) {
        let ge = self.cast::<O, E>(g.0, g.1);
        self.norm_backward(x, (&ge, &Layout::contiguous(g.1.shape())), d, weight, stats, needs, rms)
    }
    /// [`Device::norm_backward_from`] with the input's gradient added into `acc` (the input's
    /// gradient so far: contiguous, of the input's shape, owned alone), each element rounded
    /// once as the separate add would; returns the weight's and bias's gradients. The norm of
    /// a residual stream, whose gradient the skip connection has already delivered. This
    /// default computes the gradient and adds it (`norm_backward_into_by_ops`); a backend
    /// adds as it writes (the CPU does where it fuses `norm_backward_from`).
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn norm_backward_into<E: Precision, O: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<O>, &Layout),
        d: usize,
        weight: Option<(&Self::Storage<E>, &Layout)>,
        stats: &Self::RowStats<E>,
        needs: (bool, bool),
        rms: bool,
        acc: &mut Self::Storage<E>,
    ) -> (Option<Self::Storage<E>>, Option<Self::Storage<E>>) {
        norm_backward_into_by_ops(self, x, g, d, weight, stats, needs, rms, acc)
    }
    /// Cross-entropy of logits `[rows, c]`: the mean loss over counted rows (0-dim, rounded
    /// once into `E`), the row statistics for backward, and the number of counted rows.
    fn cross_entropy<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
    ) -> (Self::Storage<E>, Self::RowStats<E>, usize);
    /// Cross-entropy's backward, scaled by the upstream gradient `g` (a 0-dim view, read on
    /// the device: under a loss scaler it holds the scale) divided by the `counted` rows.
    fn cross_entropy_backward<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
        stats: &Self::RowStats<E>,
        g: (&Self::Storage<E>, &Layout),
        counted: usize,
    ) -> Self::Storage<E>;
    /// Causal self-attention of the `[n, t, d]` views `q`, `k`, `v` ([`AttentionSpec`]): row
    /// `i` of each head's output is `Σ_{j ≤ i} p_ij v_j` with `p_ij = softmax_j(scale q_i·k_j)`,
    /// in `E::Acc`, the softmax taken online over blocks of keys so no `t × t` scores are
    /// stored, and rounded once into `E` (`[n, t, d]`, contiguous). The stats are each row's
    /// log-sum-exp of its scaled scores, for the backward.
    fn causal_attention<E: Precision>(
        &self,
        q: (&Self::Storage<E>, &Layout),
        k: (&Self::Storage<E>, &Layout),
        v: (&Self::Storage<E>, &Layout),
        spec: AttentionSpec,
    ) -> (Self::Storage<E>, Self::RowStats<E>);
    /// [`Device::causal_attention`]'s backward from `g`, the gradient of its output `out`:
    /// `(dq, dk, dv)`, `[n, t, d]` each, in `E::Acc` with one rounding, the probabilities
    /// recomputed from the stats (`dq_i = scale Σ_j p_ij (g_i·v_j − g_i·out_i) k_j`, `dk_j`
    /// likewise over `i ≥ j` with `q_i`, `dv_j = Σ_{i ≥ j} p_ij g_i`).
    #[allow(clippy::too_many_arguments)]
    fn causal_attention_backward<E: Precision>(
        &self,
        q: (&Self::Storage<E>, &Layout),
        k: (&Self::Storage<E>, &Layout),
        v: (&Self::Storage<E>, &Layout),
        out: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<E>, &Layout),
        stats: &Self::RowStats<E>,
        spec: AttentionSpec,
    ) -> (Self::Storage<E>, Self::Storage<E>, Self::Storage<E>);
    /// `mean((a - b)²)` over two views of one shape, as a 0-dim storage rounded once into `E`.
    fn mse<E: Precision>(&self, a: (&Self::Storage<E>, &Layout), b: (&Self::Storage<E>, &Layout)) -> Self::Storage<E>;
    /// The mean squared error's backward for `a`: `(a - b) * (2 g / n)` over two views of one
    /// shape, contiguous, with the upstream gradient `g` (a 0-dim view) read on the device,
    /// `n` the element count, and one rounding into `E`, so a scaled f16 gradient does not
    /// underflow on the way.
    fn mse_backward<E: Precision>(
        &self,
        a: (&Self::Storage<E>, &Layout),
        b: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<E>, &Layout),
    ) -> Self::Storage<E>;

    // ---- convolution, pooling and batch norm over [N, C, H, W] (E::Acc inside, one rounding) --
    // Convolution runs as GEMM (the CPU: im2col and the batched strided matmul; a GPU: its
    // convolution library), so f16 and bf16 accumulate in f32. Pooling works on the (H, W)
    // planes of every leading index. Batch norm keeps its statistics per channel (dim 1) in
    // E::Acc, with running buffers in f32 whatever the input's precision.

    /// The convolution `out[n, o] = bias[o] + Σ_{c, i, j} w[o, c, i, j] · x[n, g·C_g + c,
    /// h·sh + i·dh - ph, w·sw + j·dw - pw]` (zero outside the input; `g` the group of `o`,
    /// `C_g` the input channels per group) as `spec` describes, the bias added in the
    /// accumulator. Contiguous `[N, C_out, oH, oW]`.
    fn conv2d<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        w: (&Self::Storage<E>, &Layout),
        bias: Option<(&Self::Storage<E>, &Layout)>,
        spec: &Conv2dSpec,
    ) -> Self::Storage<E>;
    /// The convolution's input gradient from the output gradient `g` (`[N, C_out, oH, oW]`):
    /// every input position sums `w · g` over the outputs its taps reach (col2im of `wᵀ g`),
    /// in E::Acc, rounded once. Contiguous `[N, C_in, H, W]`.
    fn conv2d_backward_input<E: Precision>(
        &self,
        g: (&Self::Storage<E>, &Layout),
        w: (&Self::Storage<E>, &Layout),
        spec: &Conv2dSpec,
    ) -> Self::Storage<E>;
    /// The convolution's weight gradient (`g · colsᵀ` summed over the batch, `[C_out, C_in /
    /// groups, kH, kW]`) when the input `x` is given, and its bias gradient (`g` summed over
    /// N, H and W, `[C_out]`) when `bias`; each summed in E::Acc and rounded once.
    #[allow(clippy::type_complexity)]
    fn conv2d_backward_weight<E: Precision>(
        &self,
        x: Option<(&Self::Storage<E>, &Layout)>,
        g: (&Self::Storage<E>, &Layout),
        spec: &Conv2dSpec,
        bias: bool,
    ) -> (Option<Self::Storage<E>>, Option<Self::Storage<E>>);
    /// The max of every window (NaN wins; padding counts as -inf, and every window holds an
    /// input element), the selected value itself. Contiguous `[planes, oH, oW]`.
    fn max_pool2d<E: Precision>(&self, x: &Self::Storage<E>, l: &Layout, spec: &Pool2dSpec) -> Self::Storage<E>;
    /// Max pooling's backward: each output's gradient goes to its window's max (the first in
    /// row-major order among equal values; the first NaN), recomputed from the input `x`;
    /// gradients meeting at one input (overlapping windows) are summed in E::Acc, rounded
    /// once. Contiguous `[planes, H, W]`.
    fn max_pool2d_backward<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<E>, &Layout),
        spec: &Pool2dSpec,
    ) -> Self::Storage<E>;
    /// The average of every window: the sum of its input elements over the divisor of
    /// [`PoolWindow`], in E::Acc, rounded once. Contiguous `[planes, oH, oW]`.
    fn avg_pool2d<E: Precision>(&self, x: &Self::Storage<E>, l: &Layout, spec: &Pool2dSpec) -> Self::Storage<E>;
    /// Average pooling's backward: each input element sums `g / divisor` over the windows
    /// that hold it, in E::Acc, rounded once. Contiguous `[planes, H, W]`.
    fn avg_pool2d_backward<E: Precision>(
        &self,
        g: &Self::Storage<E>,
        l: &Layout,
        spec: &Pool2dSpec,
    ) -> Self::Storage<E>;
    /// Batch norm of `x` (`[N, C, ...]`, channels on dim 1): `y = (x - mean) / sqrt(var +
    /// eps) * weight + bias` per channel with the statistics `stats` says (updating the
    /// running buffers in training when given), the optional weight and bias of shape `[C]` in
    /// `E::Acc` (f32 parameters of an f16/bf16 input, unrounded); returns the output and the channel means and reciprocal standard deviations for
    /// backward.
    fn batch_norm<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        weight: Option<(&Self::Storage<E::Acc>, &Layout)>,
        bias: Option<(&Self::Storage<E::Acc>, &Layout)>,
        stats: BatchNormStats<'_, Self::Storage<f32>>,
        eps: f64,
    ) -> (Self::Storage<E>, Self::RowStats<E>);
    /// Batch norm's backward: the input gradient (through the batch statistics when
    /// `training`, `dx = w·rstd·(g - mean(g) - x̂·mean(g·x̂))` per channel; as a fixed affine
    /// `dx = w·rstd·g` otherwise), and the weight (`Σ g·x̂`) and bias (`Σ g`) gradients in
    /// `E::Acc`, the parameters' precision, where `needs` asks for them.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn batch_norm_backward<E: Precision>(
        &self,
        x: (&Self::Storage<E>, &Layout),
        g: (&Self::Storage<E>, &Layout),
        weight: Option<(&Self::Storage<E::Acc>, &Layout)>,
        stats: &Self::RowStats<E>,
        needs: (bool, bool),
        training: bool,
    ) -> (Self::Storage<E>, Option<Self::Storage<E::Acc>>, Option<Self::Storage<E::Acc>>);

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

    // ---- the AMP passes ----------------------------------------------------------------------
    // In place on gradients the caller owns alone (contiguous, whole). Nothing here returns a
    // value to the host: flags, norms and the scale stay on the device, so a training step
    // queues its work without waiting for the device (see `ScaleSlot`).

    /// The fused multi-tensor unscale and non-finite check: with `scale` (a loss scaler's
    /// state vector, [`ScaleSlot`]), every value is multiplied by `inv = f32(1 / f64(scale))`
    /// in `E::Acc` with one rounding (non-finite values too, as PyTorch does); without it the
    /// values are only checked. `found_inf[first_flag + i]` is set to 1 when gradient `i` had
    /// an inf or NaN (left as it was otherwise).
    fn unscale_check<E: Precision>(
        &self,
        grads: &mut [&mut Self::Storage<E>],
        scale: Option<&Self::Storage<f64>>,
        found_inf: &mut Self::Storage<f32>,
        first_flag: usize,
    );
    /// The loss scaler's update in place on its state vector: [`ScaleRule::apply`], the step
    /// counting as an overflow when any element of `found_inf` is nonzero.
    fn update_scale(&self, state: &mut Self::Storage<f64>, found_inf: &Self::Storage<f32>, rule: &ScaleRule);
    /// The L2 norm of the view into `out[at]`, in f32: `sqrt(f32(Σ x²))` with the sum in
    /// `E::Acc` (for f64, the square root in f64, then rounded).
    fn norm_into<E: Precision>(&self, x: &Self::Storage<E>, l: &Layout, out: &mut Self::Storage<f32>, at: usize);
    /// PyTorch's `clip_grad_norm_` scalars from the per-gradient norms (all of `norms`):
    /// `out[0] = total = sqrt(Σ norms[i]²)` (f32, summed in order) and `out[1] =
    /// min(1, (1 / (total + 1e-6)) × max_norm)`, NaN kept.
    fn clip_coefficient(&self, norms: &Self::Storage<f32>, max_norm: f32, out: &mut Self::Storage<f32>);
    /// Multiplies every element by `k[at]` in place (in `E::Acc`, one rounding).
    fn scale_in_place<E: Precision>(&self, x: &mut Self::Storage<E>, k: &Self::Storage<f32>, at: usize);
    /// Clamps every element to `[-c, c]` in place (NaN kept).
    fn clamp_in_place<E: Precision>(&self, x: &mut Self::Storage<E>, c: f32);

    // ---- values for the host --------------------------------------------------------------------

    /// A scalar the host may read later (a step's skipped flag, its scale, a gradient norm):
    /// on the CPU the value itself, elsewhere a [`Lazy`] that reads when asked.
    type Value<T: Scalar>: Clone + fmt::Debug + Send + Sync + HostValue<T>;
    /// Wraps `read` (which reads device memory) as a [`Device::Value`]: the CPU calls it now,
    /// another device on the first [`HostValue::get`].
    fn value<T: Scalar>(&self, read: impl FnOnce() -> T + Send + 'static) -> Self::Value<T>;
    /// Whether the device's memory is the host's (the CPU), so reading it back costs nothing
    /// and checks that elsewhere run every few steps (the loss scale's collapse) run at every
    /// step.
    const HOST_MEMORY: bool = false;

    // ---- optimizer updates ---------------------------------------------------------------------
    // One fused pass per f32 parameter over its values, gradient and state, PyTorch's
    // single-tensor arithmetic operation for operation (fused multiply-adds where its
    // vectorised kernels fuse). With `outcomes` ([`Outcomes`]) the kernel decides on the
    // device: it changes nothing when this step's flag is set (parameter and state
    // bit-identical), and otherwise takes its scalars from the row of `rows` that matches the
    // steps applied before it, so a training step needs no host round trip.

    /// An f32 optimizer-state vector (moments, momentum buffers); `Vec<f32>` on the CPU.
    type StateVec: Clone + fmt::Debug + Send + Sync + 'static;
    /// A state vector of `n` zeros.
    fn state_zeros(&self, n: usize) -> Self::StateVec;
    /// A state vector holding `v` (from a checkpoint).
    #[allow(clippy::wrong_self_convention)]
    fn state_from_host(&self, v: Vec<f32>) -> Self::StateVec;
    /// The state vector's values on the host (for a checkpoint).
    fn state_to_host(&self, v: &Self::StateVec) -> Vec<f32>;
    /// The state vector's length.
    fn state_len(&self, v: &Self::StateVec) -> usize;
    /// One SGD step of the contiguous `param` from `grad` (same length) with the arguments
    /// `rows[outcome_row(..)]` (`rows[0]` without `outcomes`; the rows differ in `neg_lr` and
    /// `first` only); `momentum_buffer` is given exactly when `momentum` is nonzero (zeros or
    /// garbage when `first`).
    fn sgd_update(
        &self,
        rows: &[SgdArgs],
        param: &mut Self::Storage<f32>,
        grad: &Self::Storage<f32>,
        momentum_buffer: Option<&mut Self::StateVec>,
        outcomes: Option<Outcomes<'_, Self::Storage<f32>>>,
    );
    /// Writes the f32 `updated` values into the contiguous bf16 `param` (same length) as `mode`
    /// says: the write-back of a pure-bf16 optimizer. `compensation` (same length) is given
    /// exactly for [`Bf16Write::Kahan`].
    fn write_bf16(
        &self,
        updated: &Self::Storage<f32>,
        param: &mut Self::Storage<half::bf16>,
        mode: Bf16Write,
        compensation: Option<&mut Self::Storage<half::bf16>>,
    );
    /// One Adam / AdamW step of the contiguous `param` from `grad`, with its moments (all the
    /// same length), with the arguments `rows[outcome_row(..)]` (`rows[0]` without `outcomes`;
    /// the rows differ in `neg_step_size`, `bias_correction2_sqrt` and the decoupled decay's
    /// factor only).
    fn adam_update(
        &self,
        rows: &[AdamArgs],
        param: &mut Self::Storage<f32>,
        grad: &Self::Storage<f32>,
        exp_avg: &mut Self::StateVec,
        exp_avg_sq: &mut Self::StateVec,
        outcomes: Option<Outcomes<'_, Self::Storage<f32>>>,
    );
}

/// The outcomes of an optimizer's recent steps, known to the device only: `flags[i]` is
/// nonzero when step `i` of the window was skipped (an inf or NaN among its gradients).
/// An update given `Outcomes { flags, at }` is step `at` of the window: it changes nothing
/// when `flags[at]` is set, and otherwise uses row [`outcome_row`] of its arguments, the
/// number of the window's earlier steps that were applied. The host computes one row for
/// every count the device could be at (learning rate and bias corrections depend on it), so
/// it never reads the flags to go on.
pub struct Outcomes<'a, S> {
    /// The window's flags (at least `at + 1` of them).
    pub flags: &'a S,
    /// This step's place in the window.
    pub at: usize,
}

impl<S> Clone for Outcomes<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for Outcomes<'_, S> {}

/// The row an update given [`Outcomes`] uses, from the window's flags as values: `None` when
/// step `at` is skipped, else how many of `flags[..at]` are zero (the steps applied before
/// it). The CPU's definition; the GPU kernels count the same way.
pub fn outcome_row(flags: &[f32], at: usize) -> Option<usize> {
    (flags[at] == 0.0).then(|| flags[..at].iter().filter(|&&f| f == 0.0).count())
}

/// Element `at` of a small storage as a [`Device::Value`], converted by `conv` (read on the
/// host when asked).
pub(crate) fn read_back<D: Device, P: Precision, T: Scalar>(
    dev: &D,
    s: D::Storage<P>,
    at: usize,
    conv: fn(P) -> T,
) -> D::Value<T> {
    let reader = dev.clone();
    dev.value(move || conv(reader.to_host(&s, &Layout::contiguous(&[D::len(&s)]))[at]))
}
