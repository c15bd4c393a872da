//! The CPU's implementation of the backend trait: each method views its storage as a
//! contiguous slice (copying a strided view only where the kernel needs one) and runs the
//! loops of the sibling modules.

use std::sync::Arc;

use half::{bf16, f16};

use super::alloc::{self, PooledVec};
use super::{amp, attention, batch_norm, conv, dropout, index, loss, matmul, norm, optim, pool, reduce, softmax};
use crate::backend::Cpu;
use crate::backend::{
    AdamArgs, AttentionSpec, BatchNormStats, Bf16Write, BinaryOp, Conv2dSpec, CrossEntropySpec, Device, DimSplit,
    Outcomes, Pool2dSpec, ReduceOp, Scalar, ScaleRule, ScaleSlot, SgdArgs, UnaryOp, outcome_row,
};
use crate::layout::Layout;
use crate::precision::{Accum, DType, Precision, as_same, as_same_mut};

/// Times the enclosing backend call for [`crate::profile`] as `"<kernel>_<precision>"` (as the
/// CUDA kernels are named, so the two devices' tables line up); the name is formatted only
/// while a profile is recording. Also marks the op's start for the compute threads' spinning
/// ([`super::threads::busy`]).
macro_rules! profiled {
    ($e:ty, $($name:tt)+) => {
        super::threads::busy();
        let _profile =
            crate::profile::host_scope(|| format!("{}_{}", format_args!($($name)+), <$e as Precision>::DTYPE));
    };
}

/// A CPU storage: a shared buffer from the caching allocator.
pub type Storage<E> = Arc<PooledVec<E>>;

/// What the CPU's fused row kernels keep for their backward, in the accumulation type.
pub enum RowStats<A> {
    /// A norm's row means (zero for RMS norm) and reciprocal standard deviations.
    Norm(norm::NormStats<A>),
    /// Cross-entropy's row log-sum-exps.
    LogSumExp(Vec<A>),
    /// A batch norm's channel means and reciprocal standard deviations.
    Channels(norm::NormStats<A>),
}

/// A view's values as one contiguous slice: borrowed from the storage, or a copy of a strided
/// view whose buffer goes back to the caching allocator when dropped (a `Cow` would free it to
/// the system).
pub(crate) enum Contiguous<'a, E: Precision> {
    /// The view is contiguous: its storage, in place.
    Borrowed(&'a [E]),
    /// The view was gathered into a pooled buffer.
    Copied(PooledVec<E>),
}

impl<E: Precision> std::ops::Deref for Contiguous<'_, E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        match self {
            Contiguous::Borrowed(s) => s,
            Contiguous::Copied(v) => v,
        }
    }
}

/// The view `l` of `s` as a contiguous slice (copied only if it is strided).
pub(crate) fn view<'a, E: Precision>(s: &'a [E], l: &Layout) -> Contiguous<'a, E> {
    if l.is_contiguous() {
        Contiguous::Borrowed(&s[l.offset..l.offset + l.numel()])
    } else {
        Contiguous::Copied(PooledVec::from(super::gather(s, l)))
    }
}

/// The backward of an f32 norm whose output was f16 or bf16 (`layer_norm_to`), reading the
/// gradient `g` as it is (no cast pass): the input's gradient written into `gx`, or with
/// `ADD` added into it; returns the weight's and bias's gradients, or `None` (nothing done)
/// for any other pair of precisions.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn norm_backward_f32<E: Precision, O: Precision, const ADD: bool>(
    x: (&Storage<E>, &Layout),
    g: (&Storage<O>, &Layout),
    d: usize,
    weight: Option<(&Storage<E>, &Layout)>,
    stats: &RowStats<E::Acc>,
    needs: (bool, bool),
    rms: bool,
    gx: &mut [f32],
) -> Option<(Option<Storage<E>>, Option<Storage<E>>)> {
    let RowStats::Norm(st) = stats else { unreachable!("norm backward with cross-entropy statistics") };
    let (xs, gs, ws) = (view(x.0, x.1), view(g.0, g.1), view_opt(weight));
    let xf = as_same::<E, f32>(&xs)?;
    fn rows<O: Precision<Acc = f32>, const ADD: bool>(
        (x, g, d, w): (&[f32], &[O], usize, Option<&[f32]>),
        st: &norm::NormStats<f32>,
        needs: (bool, bool),
        rms: bool,
        gx: &mut [f32],
    ) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
        if rms {
            norm::backward::<f32, O, true, ADD>(x, g, d, w, st, needs, gx)
        } else {
            norm::backward::<f32, O, false, ADD>(x, g, d, w, st, needs, gx)
        }
    }
    let wf = ws.as_deref().map(|w| as_same::<E, f32>(w).expect("the weight is in the input's precision"));
    let st = st.to::<f32>();
    let into = if ADD { "_into" } else { "" };
    let (gw, gb) = if let Some(g) = as_same::<O, bf16>(&gs) {
        profiled!(f32, "{}_norm_to_bf16_bwd{into}", if rms { "rms" } else { "layer" });
        rows::<_, ADD>((xf, g, d, wf), &st, needs, rms, gx)
    } else if let Some(g) = as_same::<O, f16>(&gs) {
        profiled!(f32, "{}_norm_to_f16_bwd{into}", if rms { "rms" } else { "layer" });
        rows::<_, ADD>((xf, g, d, wf), &st, needs, rms, gx)
    } else {
        return None;
    };
    let back = |v: Vec<f32>| store(super::convert_par::<f32, E>(&v));
    Some((gw.map(back), gb.map(back)))
}

fn store<E: Precision>(v: Vec<E>) -> Storage<E> {
    Arc::new(PooledVec::from(v))
}

fn view_opt<'a, E: Precision>(v: Option<(&'a Storage<E>, &Layout)>) -> Option<Contiguous<'a, E>> {
    v.map(|(s, l)| view(s, l))
}

/// The buffer of an exclusively held storage, for the in-place passes.
fn exclusive<E: Precision>(s: &mut Storage<E>) -> &mut [E] {
    Arc::get_mut(s).expect("backend invariant: in-place pass on a shared storage").as_mut_slice()
}

impl Cpu {
    /// Which CPU kernels this process runs, for benchmark reports: the GEMM kernel per
    /// precision and the SIMD level of the elementwise, row, conversion, optimizer and scaler
    /// loops, all chosen at run time from the CPU's features ([`crate::simd`]).
    pub fn kernel_report(&self) -> String {
        // The native kernel's description only when it runs: without it the operands are
        // widened to f32 and the f32 GEMM runs.
        let gemm = |native: bool, how: &str| {
            if native { format!("native ({how}, f32 accumulation)") } else { "widened to f32 (the f32 GEMM)".into() }
        };
        let simd = match crate::simd::level() {
            crate::simd::Isa::Avx512 => "AVX-512 (x86-64-v4)",
            crate::simd::Isa::Avx2 => "AVX2 + FMA + F16C (x86-64-v3)",
            crate::simd::Isa::Baseline => "the target's baseline (x86-64: SSE2)",
        };
        format!(
            "GEMM f32: gemm crate (run-time dispatch); bf16: {}; f16: {}; elementwise/rows/optimizer loops: run-time \
             dispatch, running {simd}",
            gemm(
                super::gemm_half::available::<bf16>(),
                &match super::amx::status() {
                    None => "AMX-BF16 tiles, AVX-512 BF16 vdpbf16ps for k tails".to_string(),
                    Some(why) => format!("AVX-512 BF16 vdpbf16ps; AMX {why}"),
                }
            ),
            gemm(super::gemm_half::available::<half::f16>(), "AVX-512F, f16 widened by F16C in the pack")
        )
    }
}

impl Device for Cpu {
    type Storage<E: Precision> = Storage<E>;
    type RowStats<E: Precision> = RowStats<E::Acc>;

    fn name(&self) -> String {
        "cpu".into()
    }

    // ---- allocation and copies

    fn from_host<E: Precision>(&self, data: Vec<E>) -> Storage<E> {
        profiled!(E, "from_host");
        store(data)
    }
    fn full<E: Precision>(&self, n: usize, value: E) -> Storage<E> {
        profiled!(E, "full");
        store(alloc::global().filled(n, value))
    }
    fn scratch<E: Precision>(&self, n: usize) -> Storage<E> {
        store(alloc::take::<E>(n)) // a pooled buffer, left as it is
    }
    fn to_host<E: Precision>(&self, s: &Storage<E>, l: &Layout) -> Vec<E> {
        profiled!(E, "to_host");
        super::gather(s, l)
    }
    fn contiguous<E: Precision>(&self, s: &Storage<E>, l: &Layout) -> Storage<E> {
        profiled!(E, "contiguous");
        store(super::gather(s, l))
    }
    fn len<E: Precision>(s: &Storage<E>) -> usize {
        s.len()
    }
    fn is_exclusive<E: Precision>(s: &Storage<E>) -> bool {
        Arc::strong_count(s) == 1 && Arc::weak_count(s) == 0
    }
    fn storage_id<E: Precision>(s: &Storage<E>) -> usize {
        Arc::as_ptr(s) as *const () as usize
    }
    fn write_into<E: Precision>(&self, dst: &mut Storage<E>, dl: &Layout, src: &Storage<E>, sl: &Layout, add: bool) {
        profiled!(E, "{}", if add { "add_into" } else { "write_into" });
        let src = view(src, sl);
        super::write_into(exclusive(dst), dl, &src, add);
    }

    // ---- casts

    fn cast<E: Precision, T: Precision>(&self, s: &Storage<E>, l: &Layout) -> Storage<T> {
        profiled!(E, "cast_to_{}", T::DTYPE);
        store(super::convert_par(&view(s, l)))
    }
    fn cast_into<E: Precision, T: Precision>(&self, s: &Storage<E>, l: &Layout, dst: &mut Storage<T>) {
        profiled!(E, "cast_into_{}", T::DTYPE);
        super::convert_par_into(&view(s, l), exclusive(dst));
    }

    // ---- elementwise maps

    fn unary<E: Precision, O: UnaryOp>(&self, op: O, x: &Storage<E>, l: &Layout) -> Storage<E> {
        profiled!(E, "{}_fwd", O::NAME);
        let x = view(x, l);
        if let Some(y) = super::lut::forward(op, &x) {
            return store(y);
        }
        store(super::map_unary(
            &x,
            #[inline(always)]
            |v| op.forward(v),
        ))
    }
    fn unary_backward<E: Precision, O: UnaryOp>(
        &self,
        op: O,
        x: (&Storage<E>, &Layout),
        y: (&Storage<E>, &Layout),
        g: (&Storage<E>, &Layout),
    ) -> Storage<E> {
        profiled!(E, "{}_bwd", O::NAME);
        // Only what the derivative reads is loaded (GELU's backward needs no `y`, the scalar
        // ops' none of `x` and `y`); the unread argument gets a stand-in it ignores.
        match (O::DERIVATIVE_READS_X, O::DERIVATIVE_READS_Y) {
            (true, true) => {
                let (x, y, g) = (view(x.0, x.1), view(y.0, y.1), view(g.0, g.1));
                store(super::map_ternary(
                    &x,
                    &y,
                    &g,
                    #[inline(always)]
                    |x, y, g| g * op.derivative(x, y),
                ))
            }
            (true, false) | (false, true) => {
                let (v, lv) = if O::DERIVATIVE_READS_X { x } else { y };
                // A derivative of `x` alone by lookup on f16 and bf16 (GELU's; `lut`).
                if super::lut::looks_up_backward::<E, O>()
                    && lv.shape() == g.1.shape()
                    && let Some(gx) = super::lut::backward(op, &view(v, lv), &view(g.0, g.1))
                {
                    return store(gx);
                }
                store(super::map_binary(
                    v,
                    lv,
                    g.0,
                    g.1,
                    g.1.shape(),
                    #[inline(always)]
                    |v, g| g * op.derivative(v, v),
                ))
            }
            (false, false) => store(super::map_unary(
                &view(g.0, g.1),
                #[inline(always)]
                |g| g * op.derivative(g, g),
            )),
        }
    }
    fn binary<E: Precision, O: BinaryOp>(
        &self,
        op: O,
        a: (&Storage<E>, &Layout),
        b: (&Storage<E>, &Layout),
        shape: &[usize],
    ) -> Storage<E> {
        profiled!(E, "{}", O::NAME);
        store(super::map_binary(
            a.0,
            a.1,
            b.0,
            b.1,
            shape,
            #[inline(always)]
            |x, y| op.apply(x, y),
        ))
    }
    fn add_cast<E: Precision, O: Precision>(
        &self,
        a: (&Storage<E>, &Layout),
        b: (&Storage<O>, &Layout),
        shape: &[usize],
    ) -> Storage<E> {
        profiled!(E, "add_cast_{}", O::DTYPE);
        // f16 and bf16 widen into f32 exactly: the add reads them as they are, in one pass.
        fn add<O: Precision<Acc = f32>>(a: (&[f32], &Layout), b: (&[O], &Layout), shape: &[usize], o: &mut [f32]) {
            super::map_binary_into(
                a.0,
                a.1,
                b.0,
                b.1,
                shape,
                o,
                #[inline(always)]
                |x, y| x + y,
            );
        }
        let (Some(a32), true) = (as_same::<E, f32>(a.0), matches!(O::DTYPE, DType::F16 | DType::BF16)) else {
            return crate::backend::add_cast_by_ops(self, a, b, shape);
        };
        let mut out = alloc::take::<E>(shape.iter().product()); // every element is written
        let o = as_same_mut::<E, f32>(&mut out).expect("the receiver is f32");
        if let Some(b16) = as_same::<O, bf16>(b.0) {
            add((a32, a.1), (b16, b.1), shape, o);
        } else if let Some(h) = as_same::<O, f16>(b.0) {
            add((a32, a.1), (h, b.1), shape, o);
        } else {
            unreachable!("O is f16 or bf16 (checked above)");
        }
        store(out)
    }
    fn select<E: Precision>(
        &self,
        mask: (&[bool], &[usize]),
        a: (&Storage<E>, &Layout),
        b: (&Storage<E>, &Layout),
        shape: &[usize],
    ) -> Storage<E> {
        profiled!(E, "select");
        let lm = Layout::contiguous(mask.1);
        store(index::select(mask.0, &lm, a.0, a.1, b.0, b.1, shape))
    }

    // ---- reductions

    fn reduce<E: Precision>(
        &self,
        x: &Storage<E>,
        l: &Layout,
        split: DimSplit,
        op: ReduceOp,
        scale: f64,
    ) -> Storage<E> {
        profiled!(E, "reduce_{}", if matches!(op, ReduceOp::Sum) { "sum" } else { "max" });
        let kind = match op {
            ReduceOp::Sum => reduce::Reduce::Sum,
            ReduceOp::Max => reduce::Reduce::Max,
        };
        store(reduce::reduce_dim(&view(x, l), (split.outer, split.dim, split.inner), kind, scale))
    }
    fn arg_reduce<E: Precision>(
        &self,
        x: &Storage<E>,
        l: &Layout,
        split: DimSplit,
        max: bool,
    ) -> (Storage<E>, Vec<usize>) {
        profiled!(E, "arg_reduce");
        let x = view(x, l);
        let DimSplit { dim: d, inner, .. } = split;
        let idx = reduce::arg_reduce(&x, (split.outer, d, inner), max);
        let vals: Vec<E> =
            idx.iter().enumerate().map(|(oi, &j)| x[(oi / inner) * d * inner + j * inner + oi % inner]).collect();
        (store(vals), idx)
    }
    fn scatter_dim<E: Precision>(&self, g: &Storage<E>, l: &Layout, idx: &[usize], split: DimSplit) -> Storage<E> {
        profiled!(E, "scatter_dim");
        let g = view(g, l);
        let DimSplit { outer, dim: d, inner } = split;
        let mut full = alloc::zeroed::<E>(outer * d * inner);
        for (oi, &j) in idx.iter().enumerate() {
            full[(oi / inner) * d * inner + j * inner + oi % inner] = g[oi];
        }
        store(full)
    }

    // ---- GEMM

    fn matmul<E: Precision>(
        &self,
        a: (&Storage<E>, &Layout),
        b: (&Storage<E>, &Layout),
        batch: &[usize],
    ) -> Storage<E> {
        profiled!(E, "matmul");
        store(matmul::matmul(a.0, a.1, b.0, b.1, batch))
    }
    fn matmul_into_view<E: Precision>(
        &self,
        a: (&Storage<E>, &Layout),
        b: (&Storage<E>, &Layout),
        batch: &[usize],
        out: &mut Storage<E>,
        dst: &Layout,
    ) {
        profiled!(E, "matmul");
        matmul::matmul_into_view(a.0, a.1, b.0, b.1, batch, exclusive(out), dst)
    }
    fn linear<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        w: (&Storage<E>, &Layout),
        bias: Option<(&Storage<E>, &Layout)>,
    ) -> Storage<E> {
        profiled!(E, "linear");
        let bias = view_opt(bias);
        store(matmul::linear(x.0, x.1, w.0, w.1, bias.as_deref()))
    }

    // ---- fused rows

    fn softmax<E: Precision>(&self, x: &Storage<E>, l: &Layout, d: usize, log: bool) -> Storage<E> {
        profiled!(E, "{}softmax_fwd", if log { "log_" } else { "" });
        let x = view(x, l);
        let mut out = alloc::take::<E>(x.len()); // every row is stored
        if log {
            softmax::forward::<E, E, true>(&x, d, &mut out)
        } else {
            softmax::forward::<E, E, false>(&x, d, &mut out)
        }
        store(out)
    }
    fn softmax_backward<E: Precision>(
        &self,
        y: (&Storage<E>, &Layout),
        g: (&Storage<E>, &Layout),
        d: usize,
        log: bool,
    ) -> Storage<E> {
        profiled!(E, "{}softmax_bwd", if log { "log_" } else { "" });
        let (y, g) = (view(y.0, y.1), view(g.0, g.1));
        let mut out = alloc::take::<E>(y.len()); // every row is stored
        if log {
            softmax::backward::<E, E, true>(&y, &g, d, &mut out)
        } else {
            softmax::backward::<E, E, false>(&y, &g, d, &mut out)
        }
        store(out)
    }
    fn softmax_to_f32<E: Precision>(&self, x: &Storage<E>, l: &Layout, d: usize, log: bool) -> Storage<f32> {
        profiled!(E, "{}softmax_to_f32_fwd", if log { "log_" } else { "" });
        let x = view(x, l);
        let mut out = alloc::take::<f32>(x.len()); // every row is stored
        // f16 and bf16 rows are read as they are (no cast pass); f32 is the plain softmax, and
        // f64 is rounded to f32 first, as a cast would.
        fn rows<E: Precision<Acc = f32>>(x: &[E], d: usize, log: bool, out: &mut [f32]) {
            if log { softmax::forward::<E, f32, true>(x, d, out) } else { softmax::forward::<E, f32, false>(x, d, out) }
        }
        if let Some(x) = as_same::<E, bf16>(&x) {
            rows(x, d, log, &mut out);
        } else if let Some(x) = as_same::<E, f16>(&x) {
            rows(x, d, log, &mut out);
        } else if let Some(x) = as_same::<E, f32>(&x) {
            rows(x, d, log, &mut out);
        } else {
            rows(&super::convert_par::<E, f32>(&x), d, log, &mut out);
        }
        store(out)
    }
    fn softmax_backward_from_f32<E: Precision>(
        &self,
        y: (&Storage<f32>, &Layout),
        g: (&Storage<f32>, &Layout),
        d: usize,
        log: bool,
    ) -> Storage<E> {
        profiled!(E, "{}softmax_to_f32_bwd", if log { "log_" } else { "" });
        let (y, g) = (view(y.0, y.1), view(g.0, g.1));
        let mut out = alloc::take::<E>(y.len()); // every row is stored
        // The f32 gradient rounded once into f16 or bf16 as each row is done (no cast pass);
        // f64 widens the f32 gradient, as a cast would.
        fn rows<E: Precision<Acc = f32>>(y: &[f32], g: &[f32], d: usize, log: bool, out: &mut [E]) {
            if log {
                softmax::backward::<f32, E, true>(y, g, d, out)
            } else {
                softmax::backward::<f32, E, false>(y, g, d, out)
            }
        }
        if let Some(out) = as_same_mut::<E, bf16>(&mut out) {
            rows(&y, &g, d, log, out);
        } else if let Some(out) = as_same_mut::<E, f16>(&mut out) {
            rows(&y, &g, d, log, out);
        } else if let Some(out) = as_same_mut::<E, f32>(&mut out) {
            rows(&y, &g, d, log, out);
        } else {
            let mut gx = alloc::take::<f32>(y.len());
            rows(&y, &g, d, log, &mut gx);
            super::convert_par_into(&gx, &mut out);
        }
        store(out)
    }
    fn scaled_masked_softmax<E: Precision>(
        &self,
        x: &Storage<E>,
        l: &Layout,
        scale: f64,
        mask: (&[bool], &[usize]),
    ) -> (Storage<f32>, Storage<E>) {
        profiled!(E, "scaled_masked_softmax_fwd");
        if E::DTYPE == DType::F64 {
            // f64's chain rounds to f32 for the softmax: op by op.
            return crate::backend::scaled_masked_softmax_by_ops(self, (x, l), scale, mask);
        }
        let (shape, x) = (l.shape(), view(x, l));
        let (rows, d) = (softmax::RowMask::new(mask, shape), shape[shape.len() - 1]);
        // Every row of both is stored.
        let (mut probs, mut out) = (alloc::take::<f32>(x.len()), alloc::take::<E>(x.len()));
        if let (Some(x), Some(o)) = (as_same::<E, bf16>(&x), as_same_mut::<E, bf16>(&mut out)) {
            softmax::scaled_masked_forward(x, d, scale, &rows, &mut probs, o);
        } else if let (Some(x), Some(o)) = (as_same::<E, f16>(&x), as_same_mut::<E, f16>(&mut out)) {
            softmax::scaled_masked_forward(x, d, scale, &rows, &mut probs, o);
        } else if let (Some(x), Some(o)) = (as_same::<E, f32>(&x), as_same_mut::<E, f32>(&mut out)) {
            softmax::scaled_masked_forward(x, d, scale, &rows, &mut probs, o);
        } else {
            unreachable!("f64 ran the chain above")
        }
        (store(probs), store(out))
    }
    fn scaled_masked_softmax_backward<E: Precision>(
        &self,
        probs: (&Storage<f32>, &Layout),
        g: (&Storage<E>, &Layout),
        scale: f64,
        mask: (&[bool], &[usize]),
    ) -> Storage<E> {
        profiled!(E, "scaled_masked_softmax_bwd");
        if E::DTYPE == DType::F64 {
            return crate::backend::scaled_masked_softmax_backward_by_ops(self, probs, g, scale, mask);
        }
        let shape = probs.1.shape();
        let (probs, g) = (view(probs.0, probs.1), view(g.0, g.1));
        let (rows, d) = (softmax::RowMask::new(mask, shape), shape[shape.len() - 1]);
        let mut out = alloc::take::<E>(probs.len()); // every row is stored
        if let (Some(g), Some(o)) = (as_same::<E, bf16>(&g), as_same_mut::<E, bf16>(&mut out)) {
            softmax::scaled_masked_backward(&probs, g, d, scale, &rows, o);
        } else if let (Some(g), Some(o)) = (as_same::<E, f16>(&g), as_same_mut::<E, f16>(&mut out)) {
            softmax::scaled_masked_backward(&probs, g, d, scale, &rows, o);
        } else if let (Some(g), Some(o)) = (as_same::<E, f32>(&g), as_same_mut::<E, f32>(&mut out)) {
            softmax::scaled_masked_backward(&probs, g, d, scale, &rows, o);
        } else {
            unreachable!("f64 ran the chain above")
        }
        store(out)
    }
    fn norm<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        d: usize,
        weight: Option<(&Storage<E>, &Layout)>,
        bias: Option<(&Storage<E>, &Layout)>,
        eps: f64,
        rms: bool,
    ) -> (Storage<E>, RowStats<E::Acc>) {
        profiled!(E, "{}_norm_fwd", if rms { "rms" } else { "layer" });
        let x = view(x.0, x.1);
        let (w, b) = (view_opt(weight), view_opt(bias));
        let mut y = alloc::take::<E>(x.len()); // every row is stored
        let stats = if rms {
            norm::forward::<E, E, true>(&x, d, w.as_deref(), b.as_deref(), eps, &mut y)
        } else {
            norm::forward::<E, E, false>(&x, d, w.as_deref(), b.as_deref(), eps, &mut y)
        };
        (store(y), RowStats::Norm(stats))
    }
    fn norm_backward<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        g: (&Storage<E>, &Layout),
        d: usize,
        weight: Option<(&Storage<E>, &Layout)>,
        stats: &RowStats<E::Acc>,
        needs: (bool, bool),
        rms: bool,
    ) -> (Storage<E>, Option<Storage<E>>, Option<Storage<E>>) {
        profiled!(E, "{}_norm_bwd", if rms { "rms" } else { "layer" });
        let RowStats::Norm(stats) = stats else { unreachable!("norm backward with cross-entropy statistics") };
        let (x, g, w) = (view(x.0, x.1), view(g.0, g.1), view_opt(weight));
        let mut gx = alloc::take::<E>(x.len()); // every row is stored
        let (gw, gb) = if rms {
            norm::backward::<E, E, true, false>(&x, &g, d, w.as_deref(), stats, needs, &mut gx)
        } else {
            norm::backward::<E, E, false, false>(&x, &g, d, w.as_deref(), stats, needs, &mut gx)
        };
        (store(gx), gw.map(store), gb.map(store))
    }
    fn norm_to<E: Precision, O: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        d: usize,
        weight: Option<(&Storage<E>, &Layout)>,
        bias: Option<(&Storage<E>, &Layout)>,
        eps: f64,
        rms: bool,
    ) -> (Storage<O>, RowStats<E::Acc>) {
        // An f32 norm written as f16 or bf16 in one pass; any other pair is the norm and a cast.
        let unfused = || {
            let (y, stats) = self.norm(x, d, weight, bias, eps, rms);
            (self.cast::<E, O>(&y, &Layout::contiguous(x.1.shape())), stats)
        };
        let (xs, ws, bs) = (view(x.0, x.1), view_opt(weight), view_opt(bias));
        let Some(xf) = as_same::<E, f32>(&xs) else { return unfused() };
        fn f32s<E: Precision>(v: &[E]) -> &[f32] {
            as_same::<E, f32>(v).expect("the weight and bias are in the input's precision")
        }
        let (wf, bf) = (ws.as_deref().map(f32s), bs.as_deref().map(f32s));
        type Affine<'a> = Option<&'a [f32]>;
        fn rows<O: Precision<Acc = f32>>(
            (x, d, w, b): (&[f32], usize, Affine<'_>, Affine<'_>),
            eps: f64,
            rms: bool,
            out: &mut [O],
        ) -> norm::NormStats<f32> {
            if rms {
                norm::forward::<f32, O, true>(x, d, w, b, eps, out)
            } else {
                norm::forward::<f32, O, false>(x, d, w, b, eps, out)
            }
        }
        let mut y = alloc::take::<O>(xs.len()); // every row is stored
        let args = (xf, d, wf, bf);
        let stats = if let Some(out) = as_same_mut::<O, bf16>(&mut y) {
            profiled!(f32, "{}_norm_to_bf16_fwd", if rms { "rms" } else { "layer" });
            rows(args, eps, rms, out)
        } else if let Some(out) = as_same_mut::<O, f16>(&mut y) {
            profiled!(f32, "{}_norm_to_f16_fwd", if rms { "rms" } else { "layer" });
            rows(args, eps, rms, out)
        } else {
            drop(y);
            return unfused();
        };
        (store(y), RowStats::Norm(stats.to::<E::Acc>()))
    }
    fn norm_backward_from<E: Precision, O: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        g: (&Storage<O>, &Layout),
        d: usize,
        weight: Option<(&Storage<E>, &Layout)>,
        stats: &RowStats<E::Acc>,
        needs: (bool, bool),
        rms: bool,
    ) -> (Storage<E>, Option<Storage<E>>, Option<Storage<E>>) {
        let mut gx = alloc::take::<E>(x.1.numel()); // every row is stored
        if let Some(gx32) = as_same_mut::<E, f32>(&mut gx)
            && let Some((gw, gb)) = norm_backward_f32::<E, O, false>(x, g, d, weight, stats, needs, rms, gx32)
        {
            return (store(gx), gw, gb);
        }
        drop(gx);
        let ge = self.cast::<O, E>(g.0, g.1);
        self.norm_backward(x, (&ge, &Layout::contiguous(g.1.shape())), d, weight, stats, needs, rms)
    }
    fn norm_backward_into<E: Precision, O: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        g: (&Storage<O>, &Layout),
        d: usize,
        weight: Option<(&Storage<E>, &Layout)>,
        stats: &RowStats<E::Acc>,
        needs: (bool, bool),
        rms: bool,
        acc: &mut Storage<E>,
    ) -> (Option<Storage<E>>, Option<Storage<E>>) {
        if let Some(acc32) = as_same_mut::<E, f32>(exclusive(acc))
            && let Some(grads) = norm_backward_f32::<E, O, true>(x, g, d, weight, stats, needs, rms, acc32)
        {
            return grads;
        }
        crate::backend::norm_backward_into_by_ops(self, x, g, d, weight, stats, needs, rms, acc)
    }
    fn causal_attention<E: Precision>(
        &self,
        q: (&Storage<E>, &Layout),
        k: (&Storage<E>, &Layout),
        v: (&Storage<E>, &Layout),
        spec: AttentionSpec,
    ) -> (Storage<E>, RowStats<E::Acc>) {
        profiled!(E, "attention_fwd");
        let (out, lse) = attention::forward(&view(q.0, q.1), &view(k.0, k.1), &view(v.0, v.1), spec);
        (store(out), RowStats::LogSumExp(lse))
    }
    fn causal_attention_backward<E: Precision>(
        &self,
        q: (&Storage<E>, &Layout),
        k: (&Storage<E>, &Layout),
        v: (&Storage<E>, &Layout),
        out: (&Storage<E>, &Layout),
        g: (&Storage<E>, &Layout),
        stats: &RowStats<E::Acc>,
        spec: AttentionSpec,
    ) -> (Storage<E>, Storage<E>, Storage<E>) {
        profiled!(E, "attention_bwd");
        let RowStats::LogSumExp(lse) = stats else {
            unreachable!("backend invariant: attention stats are log-sum-exps")
        };
        let (q, k, v) = (view(q.0, q.1), view(k.0, k.1), view(v.0, v.1));
        let (dq, dk, dv) = attention::backward((&q, &k, &v), &view(out.0, out.1), &view(g.0, g.1), lse, spec);
        (store(dq), store(dk), store(dv))
    }
    fn cross_entropy<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
    ) -> (Storage<E>, RowStats<E::Acc>, usize) {
        profiled!(E, "cross_entropy_fwd");
        let (lse, total, counted) = loss::cross_entropy_forward(&view(x.0, x.1), c, spec);
        (self.full(1, E::from_f64(total / counted as f64)), RowStats::LogSumExp(lse), counted)
    }
    fn cross_entropy_backward<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        c: usize,
        spec: CrossEntropySpec<'_>,
        stats: &RowStats<E::Acc>,
        g: (&Storage<E>, &Layout),
        counted: usize,
    ) -> Storage<E> {
        profiled!(E, "cross_entropy_bwd");
        let RowStats::LogSumExp(lse) = stats else { unreachable!("cross-entropy backward with norm statistics") };
        let scale = g.0[g.1.offset].to_f64() / counted as f64;
        store(loss::cross_entropy_backward(&view(x.0, x.1), c, spec, lse, scale))
    }
    fn mse<E: Precision>(&self, a: (&Storage<E>, &Layout), b: (&Storage<E>, &Layout)) -> Storage<E> {
        profiled!(E, "mse_fwd");
        let n = a.1.numel();
        let sum = loss::squared_error_sum(&view(a.0, a.1), &view(b.0, b.1));
        self.full(1, E::from_f64(sum / n as f64))
    }
    fn mse_backward<E: Precision>(
        &self,
        a: (&Storage<E>, &Layout),
        b: (&Storage<E>, &Layout),
        g: (&Storage<E>, &Layout),
    ) -> Storage<E> {
        profiled!(E, "mse_bwd");
        let k = 2.0 * g.0[g.1.offset].to_f64() / a.1.numel() as f64;
        self.binary(crate::ops::loss::ScaledDiff(k), a, b, a.1.shape())
    }

    // ---- convolution, pooling and batch norm

    fn conv2d<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        w: (&Storage<E>, &Layout),
        bias: Option<(&Storage<E>, &Layout)>,
        spec: &Conv2dSpec,
    ) -> Storage<E> {
        profiled!(E, "conv2d_fwd");
        let (x, w, b) = (view(x.0, x.1), view(w.0, w.1), view_opt(bias));
        store(conv::forward(&x, &w, b.as_deref(), spec))
    }
    fn conv2d_backward_input<E: Precision>(
        &self,
        g: (&Storage<E>, &Layout),
        w: (&Storage<E>, &Layout),
        spec: &Conv2dSpec,
    ) -> Storage<E> {
        profiled!(E, "conv2d_bwd_input");
        store(conv::backward_input(&view(g.0, g.1), &view(w.0, w.1), spec))
    }
    fn conv2d_backward_weight<E: Precision>(
        &self,
        x: Option<(&Storage<E>, &Layout)>,
        g: (&Storage<E>, &Layout),
        spec: &Conv2dSpec,
        bias: bool,
    ) -> (Option<Storage<E>>, Option<Storage<E>>) {
        profiled!(E, "conv2d_bwd_weight");
        let x = view_opt(x);
        let (gw, gb) = conv::backward_weight(x.as_deref(), &view(g.0, g.1), spec, bias);
        (gw.map(store), gb.map(store))
    }
    fn max_pool2d<E: Precision>(&self, x: &Storage<E>, l: &Layout, spec: &Pool2dSpec) -> Storage<E> {
        profiled!(E, "max_pool2d_fwd");
        store(pool::max_forward(&view(x, l), spec))
    }
    fn max_pool2d_backward<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        g: (&Storage<E>, &Layout),
        spec: &Pool2dSpec,
    ) -> Storage<E> {
        profiled!(E, "max_pool2d_bwd");
        store(pool::max_backward(&view(x.0, x.1), &view(g.0, g.1), spec))
    }
    fn avg_pool2d<E: Precision>(&self, x: &Storage<E>, l: &Layout, spec: &Pool2dSpec) -> Storage<E> {
        profiled!(E, "avg_pool2d_fwd");
        store(pool::avg_forward(&view(x, l), spec))
    }
    fn avg_pool2d_backward<E: Precision>(&self, g: &Storage<E>, l: &Layout, spec: &Pool2dSpec) -> Storage<E> {
        profiled!(E, "avg_pool2d_bwd");
        store(pool::avg_backward(&view(g, l), spec))
    }
    fn batch_norm<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        weight: Option<(&Storage<E::Acc>, &Layout)>,
        bias: Option<(&Storage<E::Acc>, &Layout)>,
        stats: BatchNormStats<'_, Storage<f32>>,
        eps: f64,
    ) -> (Storage<E>, RowStats<E::Acc>) {
        profiled!(E, "batch_norm_fwd");
        let split = DimSplit::of(&x.1.shape, 1);
        let x = view(x.0, x.1);
        let (w, b) = (view_opt(weight), view_opt(bias));
        let stats = match stats {
            BatchNormStats::Batch { running, momentum } => {
                let st = batch_norm::batch_stats(&x, split);
                if let Some((mean, var)) = running {
                    batch_norm::update_running(exclusive(mean), exclusive(var), &st, momentum);
                }
                batch_norm::channel_stats(st.mean, &st.var, eps)
            }
            BatchNormStats::Given { mean, var } => {
                let widen = |v: &[f32]| v.iter().map(|&v| E::Acc::c(v as f64)).collect::<Vec<_>>();
                let (mean, var) = (widen(&view(mean.0, mean.1)), widen(&view(var.0, var.1)));
                batch_norm::channel_stats(mean, &var, eps)
            }
        };
        let y = batch_norm::forward(&x, split, &stats, w.as_deref(), b.as_deref());
        (store(y), RowStats::Channels(stats))
    }
    fn batch_norm_backward<E: Precision>(
        &self,
        x: (&Storage<E>, &Layout),
        g: (&Storage<E>, &Layout),
        weight: Option<(&Storage<E::Acc>, &Layout)>,
        stats: &RowStats<E::Acc>,
        needs: (bool, bool),
        training: bool,
    ) -> (Storage<E>, Option<Storage<E::Acc>>, Option<Storage<E::Acc>>) {
        profiled!(E, "batch_norm_bwd");
        let RowStats::Channels(stats) = stats else { unreachable!("batch norm backward with other statistics") };
        let split = DimSplit::of(&x.1.shape, 1);
        let (x, g, w) = (view(x.0, x.1), view(g.0, g.1), view_opt(weight));
        let (gx, gw, gb) = batch_norm::backward(&x, &g, split, w.as_deref(), stats, needs, training);
        (store(gx), gw.map(store), gb.map(store))
    }

    // ---- gather, scatter-add, embedding, cat

    fn gather_rows<E: Precision>(&self, w: (&Storage<E>, &Layout), ids: &[i64], d: usize) -> Storage<E> {
        profiled!(E, "gather_rows");
        store(index::gather_rows(&view(w.0, w.1), ids, d))
    }
    fn scatter_add_rows<E: Precision>(
        &self,
        g: (&Storage<E>, &Layout),
        ids: &[i64],
        vocab: usize,
        d: usize,
    ) -> Storage<E> {
        profiled!(E, "scatter_add_rows");
        store(index::scatter_add_rows(&view(g.0, g.1), ids, vocab, d))
    }
    fn cat<E: Precision>(&self, parts: &[(&Storage<E>, &Layout, usize)], outer: usize, inner: usize) -> Storage<E> {
        profiled!(E, "cat");
        let parts: Vec<(&[E], &Layout, usize)> = parts.iter().map(|&(s, l, d)| (&s[..], l, d)).collect();
        store(index::cat(&parts, outer, inner))
    }

    // ---- random numbers

    fn dropout<E: Precision>(&self, x: &Storage<E>, l: &Layout, p: f64, seed: u64) -> Storage<E> {
        profiled!(E, "dropout");
        store(dropout::apply(&view(x, l), p, seed))
    }

    // ---- the AMP passes

    fn unscale_check<E: Precision>(
        &self,
        grads: &mut [&mut Storage<E>],
        scale: Option<&Storage<f64>>,
        found_inf: &mut Storage<f32>,
        first_flag: usize,
    ) {
        profiled!(E, "unscale_check");
        let inv = scale.map(|s| crate::backend::inv_scale(s[ScaleSlot::Scale as usize] as f32));
        let mut slices: Vec<&mut [E]> = grads.iter_mut().map(|g| exclusive(g)).collect();
        let flags = amp::unscale_all_of(&mut slices, inv);
        for (f, found) in exclusive(found_inf)[first_flag..].iter_mut().zip(flags) {
            if found {
                *f = 1.0;
            }
        }
    }
    fn update_scale(&self, state: &mut Storage<f64>, found_inf: &Storage<f32>, rule: &ScaleRule) {
        profiled!(f64, "update_scale");
        let overflow = found_inf.iter().any(|&f| f != 0.0);
        rule.apply(exclusive(state), overflow);
    }
    fn norm_into<E: Precision>(&self, x: &Storage<E>, l: &Layout, out: &mut Storage<f32>, at: usize) {
        profiled!(E, "grad_norm");
        let sum = amp::sum_squares_of(&view(x, l));
        exclusive(out)[at] = if E::DTYPE == crate::DType::F64 { sum.sqrt() as f32 } else { (sum as f32).sqrt() };
    }
    fn clip_coefficient(&self, norms: &Storage<f32>, max_norm: f32, out: &mut Storage<f32>) {
        profiled!(f32, "clip_coefficient");
        let total = crate::backend::total_norm(norms);
        let out = exclusive(out);
        out[0] = total;
        out[1] = crate::backend::clip_coefficient(total, max_norm);
    }
    fn scale_in_place<E: Precision>(&self, x: &mut Storage<E>, k: &Storage<f32>, at: usize) {
        profiled!(E, "scale_in_place");
        amp::scale_of(exclusive(x), k[at]);
    }
    fn clamp_in_place<E: Precision>(&self, x: &mut Storage<E>, c: f32) {
        profiled!(E, "clamp_in_place");
        amp::clamp_of(exclusive(x), c);
    }
    type Value<T: Scalar> = T;
    fn value<T: Scalar>(&self, read: impl FnOnce() -> T + Send + 'static) -> T {
        read()
    }
    const HOST_MEMORY: bool = true;
    type StateVec = Vec<f32>;
    fn state_zeros(&self, n: usize) -> Vec<f32> {
        vec![0.0; n]
    }
    fn state_from_host(&self, v: Vec<f32>) -> Vec<f32> {
        v
    }
    fn state_to_host(&self, v: &Vec<f32>) -> Vec<f32> {
        v.clone()
    }
    fn state_len(&self, v: &Vec<f32>) -> usize {
        v.len()
    }
    fn sgd_update(
        &self,
        rows: &[SgdArgs],
        param: &mut Storage<f32>,
        grad: &Storage<f32>,
        momentum_buffer: Option<&mut Vec<f32>>,
        outcomes: Option<Outcomes<'_, Storage<f32>>>,
    ) {
        profiled!(f32, "sgd_update");
        let Some(row) = row_of(rows.len(), outcomes) else { return };
        optim::sgd(&rows[row], exclusive(param), grad, momentum_buffer.map(|b| b.as_mut_slice()));
    }
    fn write_bf16(
        &self,
        updated: &Storage<f32>,
        param: &mut Storage<bf16>,
        mode: Bf16Write,
        compensation: Option<&mut Storage<bf16>>,
    ) {
        profiled!(bf16, "write_bf16");
        let param = exclusive(param);
        match (mode, compensation) {
            (Bf16Write::Kahan, Some(c)) => optim::write_kahan(updated, param, exclusive(c)),
            (Bf16Write::Nearest, None) => optim::write_nearest(updated, param),
            (Bf16Write::Stochastic { key }, None) => optim::write_stochastic(updated, param, key),
            (mode, c) => panic!("backend invariant: {mode:?} with compensation {}", c.is_some()),
        }
    }
    fn adam_update(
        &self,
        rows: &[AdamArgs],
        param: &mut Storage<f32>,
        grad: &Storage<f32>,
        exp_avg: &mut Vec<f32>,
        exp_avg_sq: &mut Vec<f32>,
        outcomes: Option<Outcomes<'_, Storage<f32>>>,
    ) {
        profiled!(f32, "adam_update");
        let Some(row) = row_of(rows.len(), outcomes) else { return };
        optim::adam(&rows[row], exclusive(param), grad, exp_avg, exp_avg_sq);
    }
}

/// The row of an optimizer update's arguments (`None`: the step is skipped), checked against
/// the rows given.
fn row_of(rows: usize, outcomes: Option<Outcomes<'_, Storage<f32>>>) -> Option<usize> {
    let row = match outcomes {
        None => 0,
        Some(Outcomes { flags, at }) => outcome_row(flags, at)?,
    };
    assert!(row < rows, "backend invariant: an optimizer update with {rows} argument rows needs row {row}");
    Some(row)
}
