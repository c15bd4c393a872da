//! The training step as a typestate: [`TrainStep`] and its stages.

use std::collections::HashSet;
use std::marker::PhantomData;

use super::grad_scaler::{LossScaler, UnscaleMode};
use crate::autograd::{AnyTensor, Grads, TensorId};
use crate::backend::{Cpu, Device, Lazy, ScaleSlot, read_back};
use crate::error::{Error, Result, or_panic};
use crate::layout::Layout;
use crate::optim::Optimizer;
use crate::param::{Param, Params};
use crate::precision::{DType, Precision};
use crate::tensor::Tensor;

/// The stages of a [`TrainStep`]: zero-sized types, plus the capability traits that say which
/// calls each stage allows (their messages name the call that is missing).
pub mod stage {
    mod sealed {
        pub trait Sealed {}
        impl Sealed for super::LossScaled {}
        impl Sealed for super::GradsScaled {}
        impl Sealed for super::GradsUnscaled {}
        impl Sealed for super::OptimizerStepped {}
    }

    /// The run-time mirror of a stage, for logs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
    pub enum StageKind {
        /// `scaler.scale(loss)` was called; no gradients yet.
        LossScaled,
        /// `.backward()` produced gradients multiplied by the scale.
        GradsScaled,
        /// `.unscale()` divided them back and checked them for inf/NaN.
        GradsUnscaled,
        /// `.step(..)` applied (or skipped) the optimizer step; `.update()` is next.
        OptimizerStepped,
    }

    /// A stage of a training step. Sealed.
    pub trait Stage: sealed::Sealed {
        /// The run-time mirror.
        const KIND: StageKind;
    }

    /// Stage after `scaler.scale(loss)`: the loss, waiting for `.backward()`.
    #[derive(Debug)]
    pub struct LossScaled;
    /// Stage after `.backward()`: gradients multiplied by the scale (micro-batches accumulate here).
    #[derive(Debug)]
    pub struct GradsScaled;
    /// Stage after `.unscale()`: true gradients, checked; clipping and `.step(..)` happen here.
    #[derive(Debug)]
    pub struct GradsUnscaled;
    /// Stage after `.step(..)`: the optimizer stepped or skipped; `.update()` ends the iteration.
    #[derive(Debug)]
    pub struct OptimizerStepped;

    impl Stage for LossScaled {
        const KIND: StageKind = StageKind::LossScaled;
    }
    impl Stage for GradsScaled {
        const KIND: StageKind = StageKind::GradsScaled;
    }
    impl Stage for GradsUnscaled {
        const KIND: StageKind = StageKind::GradsUnscaled;
    }
    impl Stage for OptimizerStepped {
        const KIND: StageKind = StageKind::OptimizerStepped;
    }

    /// Stages that allow `.backward()`: only [`LossScaled`].
    #[diagnostic::on_unimplemented(
        message = "`backward()` needs a scaled loss, but this training step is at stage `{Self}`",
        label = "`backward()` runs once per `scaler.scale(loss)`",
        note = "to add another micro-batch's gradients, call `.accumulate(loss)` on the `ScaledGrads` (before `.unscale()`)"
    )]
    pub trait CanBackward: Stage {}
    impl CanBackward for LossScaled {}

    /// Stages that allow `.accumulate(loss)`: only [`GradsScaled`].
    #[diagnostic::on_unimplemented(
        message = "micro-batches are accumulated into scaled gradients, but this training step is at stage `{Self}`",
        label = "`accumulate(loss)` needs the `ScaledGrads` returned by `.backward()`",
        note = "accumulate every micro-batch after `.backward()` and before `.unscale()`: `let mut grads = scaler.scale(loss0).backward(); grads.accumulate(loss1);`"
    )]
    pub trait CanAccumulate: Stage {}
    impl CanAccumulate for GradsScaled {}

    /// Stages that allow `.unscale()`: only [`GradsScaled`].
    #[diagnostic::on_unimplemented(
        message = "`unscale()` needs scaled gradients, but this training step is at stage `{Self}`",
        label = "`unscale()` runs exactly once per iteration, right after `.backward()`",
        note = "at `GradsUnscaled` the gradients are already unscaled: go on with `.clip_grad_norm(max_norm)` (optional) and `.step(&mut optimizer, &mut model)`",
        note = "at `OptimizerStepped` the step is done: finish the iteration with `.update()`",
        note = "at `LossScaled` there are no gradients yet: call `.backward()` first"
    )]
    pub trait CanUnscale: Stage {}
    impl CanUnscale for GradsScaled {}

    /// Stages that allow clipping: only [`GradsUnscaled`].
    #[diagnostic::on_unimplemented(
        message = "clipping needs unscaled gradients, but this training step is at stage `{Self}`",
        label = "call `.unscale()` before clipping",
        note = "clipping scaled gradients compares a norm S times too large with `max_norm` (PyTorch lets this through silently)",
        note = "the order is: `scaler.scale(loss)`, `.backward()`, `.unscale()`, `.clip_grad_norm(max_norm)`, `.step(&mut optimizer, &mut model)`, `.update()`"
    )]
    pub trait CanClip: Stage {}
    impl CanClip for GradsUnscaled {}

    /// Stages that allow `.step(..)`: only [`GradsUnscaled`].
    #[diagnostic::on_unimplemented(
        message = "`step(..)` needs unscaled gradients, but this training step is at stage `{Self}`",
        label = "`step(..)` comes once per iteration, right after `.unscale()` (and clipping)",
        note = "at `GradsScaled` the gradients are still multiplied by the loss scale: call `.unscale()` first",
        note = "at `OptimizerStepped` the optimizer has already stepped: finish the iteration with `.update()`, then start the next one with `scaler.scale(loss)`",
        note = "to step several optimizers on one set of gradients, use `.step_many(..)`"
    )]
    pub trait CanStep: Stage {}
    impl CanStep for GradsUnscaled {}

    /// Stages that allow `.update()`: only [`OptimizerStepped`].
    #[diagnostic::on_unimplemented(
        message = "`update()` ends an iteration after `step(..)`, but this training step is at stage `{Self}`",
        label = "call `.step(&mut optimizer, &mut model)` before `.update()`",
        note = "the scale is updated from the step's outcome (applied, or skipped on overflow): `.unscale()`, then `.step(&mut optimizer, &mut model)`, then `.update()`"
    )]
    pub trait CanUpdate: Stage {}
    impl CanUpdate for OptimizerStepped {}
}

use stage::{
    CanAccumulate, CanBackward, CanClip, CanStep, CanUnscale, CanUpdate, GradsScaled, GradsUnscaled, LossScaled,
    OptimizerStepped, Stage, StageKind,
};

/// One training iteration in progress, at stage `S`, borrowing its scaler `K` until
/// `.update()`. Built by `scaler.scale(loss)`; every transition consumes the step, so calls
/// can only come in the right order (see the module docs).
///
/// A step must end with `.update()` (or [`TrainStep::abandon`], to discard it on purpose):
/// dropping it at any stage panics with a message naming the call that is missing, because a
/// dropped step loses its gradients or leaves the loss scale un-updated with no other sign.
#[must_use = "an unfinished training step: every iteration ends with `.update()`, which adapts the loss scale (the order is `.backward()`, `.unscale()`, `.step(&mut optimizer, &mut model)`, `.update()`); dropping it panics"]
pub struct TrainStep<'s, K: LossScaler, S: Stage, D: Device = Cpu> {
    /// `None` once the step has ended (moved to the next stage, updated, abandoned or failed).
    inner: Option<Inner<'s, K, D>>,
    _stage: PhantomData<S>,
}

impl<K: LossScaler, S: Stage, D: Device> std::fmt::Debug for TrainStep<'_, K, S, D> {
    /// The stage and whether the step is still live (not its tensors).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainStep")
            .field("stage", &std::any::type_name::<S>().rsplit("::").next().unwrap_or(""))
            .field("live", &self.inner.is_some())
            .finish()
    }
}

/// What a step carries from stage to stage.
struct Inner<'s, K: LossScaler, D: Device> {
    scaler: &'s mut K,
    /// The loss's device, where the whole step runs.
    dev: D,
    /// The scale this iteration uses, on the device, in the loss's shape: the backward seed
    /// (a copy of the scaler's scale made at `scale(loss)`, so later updates leave it alone).
    seed: Tensor<f32, D>,
    /// The loss, until `backward()` consumes it (freeing the forward graph).
    loss: Option<Tensor<f32, D>>,
    grads: Grads<D>,
    /// After `unscale()`: the gradients in the order of their flags, and the flags on the
    /// device (1 where the gradient had an inf or NaN). `None` when nothing was checked.
    flags: Option<(Vec<TensorId>, D::Storage<f32>)>,
    /// After `step`: whether any optimizer skipped its step, known on the host (the CPU, or
    /// no flags) or on the device (one f32, the max of the pairs' flags).
    found_inf: Outcome<D>,
    micro_batches: usize,
    grad_norm: Option<D::Value<f32>>,
    /// After a `clip_grad_norm` of a checked step: 1 (one f32 on the device) when the total
    /// norm was inf or NaN. Clipping multiplies every gradient by a coefficient made from it
    /// (0 or NaN then), so every optimizer skips, whichever gradient was not finite.
    clip_flag: Option<D::Storage<f32>>,
    /// The last `try_` call on `&mut self` returned an error: the caller has it, so dropping
    /// the step now does not panic (which would hide it behind the drop rule's message). The
    /// next call that succeeds clears it.
    failed: bool,
}

/// One optimizer and the model it steps, as [`TrainStep::step_many`] takes them.
pub type OptimizerPair<'a, E, D = Cpu> = (&'a mut dyn Optimizer<E, D>, &'a mut dyn Params<E, D>);

/// `scaler.scale(loss)`: the loss times the scale, waiting for `.backward()`.
pub type ScaledLoss<'s, K, D = Cpu> = TrainStep<'s, K, LossScaled, D>;
/// `.backward()`: gradients times the scale; more micro-batches can be accumulated.
pub type ScaledGrads<'s, K, D = Cpu> = TrainStep<'s, K, GradsScaled, D>;
/// `.unscale()`: true gradients, checked for inf/NaN; clip here, then `.step(..)`.
pub type UnscaledGrads<'s, K, D = Cpu> = TrainStep<'s, K, GradsUnscaled, D>;
/// `.step(..)`: the optimizer stepped or skipped; `.update()` ends the iteration.
pub type Stepped<'s, K, D = Cpu> = TrainStep<'s, K, OptimizerStepped, D>;

/// What one iteration did, returned by `.update()`.
///
/// The values computed on the device are [`Device::Value`]s: on the CPU the values themselves
/// (`bool`, `f32`, `i32`), on a GPU values read back only when asked
/// ([`crate::backend::HostValue::get`]), so a report costs no synchronisation until a field
/// is read.
#[derive(Clone, Debug)]
pub struct StepReport<D: Device = Cpu> {
    /// Whether the optimizer step was skipped because a gradient was inf or NaN.
    pub skipped: D::Value<bool>,
    /// The scale this iteration's loss was multiplied by.
    pub scale_used: D::Value<f32>,
    /// The scale after the update (what the next iteration uses).
    pub scale: D::Value<f32>,
    /// The scaler's growth tracker after the update.
    pub growth_tracker: D::Value<i32>,
    /// Micro-batches accumulated into this step (1 without accumulation).
    pub micro_batches: usize,
    /// The total gradient norm if `clip_grad_norm` was called (before clipping).
    pub grad_norm: Option<D::Value<f32>>,
}

impl Copy for StepReport<Cpu> {}

impl PartialEq for StepReport<Cpu> {
    fn eq(&self, o: &Self) -> bool {
        (self.skipped, self.scale_used, self.scale, self.growth_tracker, self.micro_batches, self.grad_norm)
            == (o.skipped, o.scale_used, o.scale, o.growth_tracker, o.micro_batches, o.grad_norm)
    }
}

/// A read-only view of a step's gradients, for logging and inspection: it is not a [`Grads`],
/// so it cannot be cloned into one, clipped or handed to an optimizer. At [`GradsScaled`] the
/// values are still multiplied by the loss scale ([`GradsView::is_scaled`]).
#[derive(Clone, Copy, Debug)]
pub struct GradsView<'a, D: Device = Cpu> {
    grads: &'a Grads<D>,
    scaled: bool,
}

impl<'a, D: Device> GradsView<'a, D> {
    /// The gradient of `t` (a parameter, or a leaf marked `requires_grad_()`), in `t`'s precision.
    pub fn get<E: Precision>(&self, t: &Tensor<E, D>) -> Option<&'a Tensor<E, D>> {
        self.grads.get(t)
    }
    /// The gradient of the tensor with this id.
    pub fn get_by_id(&self, id: TensorId) -> Option<&'a AnyTensor<D>> {
        self.grads.get_by_id(id)
    }
    /// Every (id, gradient), in id order.
    pub fn iter(&self) -> impl Iterator<Item = (TensorId, &'a AnyTensor<D>)> + use<'a, D> {
        self.grads.iter()
    }
    /// Number of gradients.
    pub fn len(&self) -> usize {
        self.grads.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }
    /// Whether the values are still multiplied by the loss scale (before `.unscale()`).
    pub fn is_scaled(&self) -> bool {
        self.scaled
    }
    /// The global L2 norm of these values, as `clip_grad_norm` measures it (times the scale
    /// when [`GradsView::is_scaled`]).
    pub fn global_norm(&self) -> D::Value<f32> {
        crate::clip::grad_norm(self.grads)
    }
}

mod loss_sealed {
    pub trait Sealed {}
    impl<D: crate::Device> Sealed for crate::Tensor<f32, D> {}
}

/// A micro-batch's loss, as [`TrainStep::accumulate`] takes it: an f32 scalar tensor, by value
/// (its forward graph is freed by the backward pass).
#[diagnostic::on_unimplemented(
    message = "`accumulate` takes another micro-batch's loss (`Tensor<f32>`, by value), not `{Self}`",
    label = "expected the loss of a micro-batch",
    note = "gradients from another `scaler.scale(..)` call belong to another iteration (possibly at another scale) and cannot be mixed in",
    note = "run the micro-batch's forward pass and pass its loss: `grads.accumulate(loss)`, before `.unscale()`"
)]
pub trait MicroBatchLoss<D: Device = Cpu>: loss_sealed::Sealed {
    /// The loss tensor.
    fn into_loss(self) -> Tensor<f32, D>;
}

impl<D: Device> MicroBatchLoss<D> for Tensor<f32, D> {
    fn into_loss(self) -> Tensor<f32, D> {
        self
    }
}

/// The panic message of a step dropped at `kind` (see [`TrainStep`]'s drop rule).
fn dropped_message(kind: StageKind, micro_batches: usize) -> String {
    let what = match kind {
        StageKind::LossScaled => {
            "after `scaler.scale(loss)`, before `.backward()`: nothing was trained this iteration".to_string()
        }
        StageKind::GradsScaled => format!(
            "with the scaled gradients of {micro_batches} micro-batch(es), before `.unscale()`: they were never applied. \
             To accumulate micro-batches (PyTorch's repeated `scaler.scale(loss).backward()`), keep one step and call \
             `.accumulate(loss)` on it for every further micro-batch, then `.unscale()`, `.step(..)`, `.update()`"
        ),
        StageKind::GradsUnscaled => "after `.unscale()`, before `.step(&mut optimizer, &mut model)`: the gradients were never applied".to_string(),
        StageKind::OptimizerStepped => "after `.step(..)`, before `.update()`: the loss scale was not updated (after an overflow it never backs off, so the following steps overflow and are skipped too)".to_string(),
    };
    format!(
        "a training step was dropped {what}. End every iteration with `.update()`, or call `.abandon()` to discard \
         it on purpose"
    )
}

impl<K: LossScaler, S: Stage, D: Device> Drop for TrainStep<'_, K, S, D> {
    fn drop(&mut self) {
        // Not while unwinding: a second panic would abort and hide the first.
        if let Some(inner) = &self.inner
            && !inner.failed
            && !std::thread::panicking()
        {
            panic!("{}", dropped_message(S::KIND, inner.micro_batches));
        }
    }
}

impl<'s, K: LossScaler, S: Stage, D: Device> TrainStep<'s, K, S, D> {
    fn st(&self) -> &Inner<'s, K, D> {
        self.inner.as_ref().expect("a live TrainStep holds its state")
    }
    fn st_mut(&mut self) -> &mut Inner<'s, K, D> {
        self.inner.as_mut().expect("a live TrainStep holds its state")
    }
    fn into_stage<T: Stage>(mut self) -> TrainStep<'s, K, T, D> {
        // A step that went on after an error is live again: the drop rule applies.
        if let Some(st) = &mut self.inner {
            st.failed = false;
        }
        TrainStep { inner: self.inner.take(), _stage: PhantomData }
    }
    /// Ends the step with `e` (nothing to finish: the error says what went wrong).
    fn fail<T>(mut self, e: Error) -> Result<T> {
        self.inner = None;
        Err(e)
    }
    /// The stage, at run time (for logs).
    pub fn stage(&self) -> StageKind {
        S::KIND
    }
    /// The scale this iteration multiplies its loss by (fixed when `scale(loss)` was called).
    pub fn scale_used(&self) -> D::Value<f32> {
        let st = self.st();
        read_seed(&st.dev, &st.seed)
    }
    /// Micro-batches whose gradients are in this step so far.
    pub fn micro_batches(&self) -> usize {
        self.st().micro_batches
    }
    /// Discards this iteration on purpose: its gradients are dropped and the scaler is not
    /// updated (at [`OptimizerStepped`] the optimizer has already applied or skipped its step).
    /// Dropping a step without this or `.update()` panics.
    pub fn abandon(mut self) {
        self.inner = None;
    }

    /// Runs `backward()` on the scaled loss (gradients come out multiplied by the scale). The
    /// loss and its forward graph are freed here, so the step can update parameters in place.
    pub fn try_backward(mut self) -> Result<ScaledGrads<'s, K, D>>
    where
        S: CanBackward,
    {
        let st = self.st_mut();
        let loss = st.loss.take().expect("a LossScaled step holds its loss");
        match scaled_backward(&loss, &st.seed) {
            Ok(grads) => {
                st.grads = grads;
                st.micro_batches = 1;
                drop(loss);
                Ok(self.into_stage())
            }
            Err(e) => self.fail(e),
        }
    }
    /// Runs `backward()` on the scaled loss. Panics if the loss is not a scalar that depends on
    /// a parameter (see [`TrainStep::try_backward`]).
    #[track_caller]
    pub fn backward(self) -> ScaledGrads<'s, K, D>
    where
        S: CanBackward,
    {
        or_panic(self.try_backward())
    }

    /// Adds another micro-batch's gradients, scaled by this iteration's scale, to this step
    /// (PyTorch's repeated `scaler.scale(loss).backward()` before one `step`). Divide each
    /// micro-batch's loss by the number of micro-batches if you want their mean. The loss is
    /// taken by value: its graph is freed by the backward pass.
    pub fn try_accumulate<L: MicroBatchLoss<D>>(&mut self, loss: L) -> Result<&mut Self>
    where
        S: CanAccumulate,
    {
        let loss = loss.into_loss();
        let st = self.st_mut();
        let more = check_precision_fits(&*st.scaler, &loss).and_then(|()| scaled_backward(&loss, &st.seed));
        drop(loss);
        st.failed = more.is_err();
        st.grads.accumulate(more?);
        st.micro_batches += 1;
        Ok(self)
    }
    /// Adds another micro-batch's gradients; panics where [`TrainStep::try_accumulate`] errs.
    #[track_caller]
    pub fn accumulate<L: MicroBatchLoss<D>>(&mut self, loss: L) -> &mut Self
    where
        S: CanAccumulate,
    {
        or_panic(self.try_accumulate(loss).map(|_| ()));
        self
    }

    /// Divides every gradient by the scale (multiplying by PyTorch's f32 `inv`) and checks it
    /// for inf/NaN, in one fused pass over all gradients. A [`crate::scaler::GradScaler`]
    /// refuses f16 gradients, as PyTorch does: master parameters and their gradients are f32.
    pub fn try_unscale(mut self) -> Result<UnscaledGrads<'s, K, D>>
    where
        S: CanUnscale,
    {
        let st = self.st_mut();
        let mode = st.scaler.unscale_mode();
        let f16_grad = st.grads.iter().find(|(_, g)| g.dtype() == DType::F16).map(|(id, _)| id);
        if st.scaler.scales_loss()
            && let Some(id) = f16_grad
        {
            let e = Error::State {
                context: "unscale".into(),
                detail: format!(
                    "the gradient of tensor {id:?} is f16: GradScaler does not unscale f16 gradients \
                         (PyTorch: \"Attempting to unscale FP16 gradients\"). Keep master parameters in f32 \
                         (`Param<f32>`) and cast them to f16 inside the forward pass"
                ),
            };
            return self.fail(e);
        }
        if st.scaler.scales_loss() {
            st.grads.mark_scaled();
        }
        let scale = match mode {
            UnscaleMode::Unscale => st.scaler.device_state(&st.dev),
            UnscaleMode::CheckOnly => None,
        };
        st.flags = unscale_grads(&st.dev, &mut st.grads, scale);
        Ok(self.into_stage())
    }
    /// Unscales and checks the gradients; panics where [`TrainStep::try_unscale`] errs.
    #[track_caller]
    pub fn unscale(self) -> UnscaledGrads<'s, K, D>
    where
        S: CanUnscale,
    {
        or_panic(self.try_unscale())
    }

    /// Scales all gradients so their global L2 norm is at most `max_norm` (PyTorch's
    /// `clip_grad_norm_`), returning the norm before clipping. See [`crate::clip`].
    ///
    /// The norm and the coefficient are computed on the device and stay there: the norm is a
    /// [`Device::Value`] (an `f32` on the CPU; on a GPU read back when asked). Every gradient
    /// of the step takes part, also those of leaves no optimizer steps; if the norm is inf or
    /// NaN, clipping has made every gradient 0 or NaN, so every optimizer skips this step and
    /// the scale backs off (PyTorch, whose skip reads only the flags of each optimizer's own
    /// gradients, would apply such a step to the optimizers whose gradients were finite).
    pub fn try_clip_grad_norm(&mut self, max_norm: f32) -> Result<D::Value<f32>>
    where
        S: CanClip,
    {
        let st = self.st_mut();
        let scalars = crate::clip::clip_in_place(&mut st.grads, max_norm);
        st.failed = scalars.is_err();
        let scalars = scalars?;
        let Some((dev, mut scalars)) = scalars else {
            let norm = st.dev.value(|| 0.0);
            st.grad_norm = Some(norm.clone());
            return Ok(norm);
        };
        if st.flags.is_some() {
            // The unscale pass's check (it only reads without a scale), on [total, coefficient]:
            // set when the total is not finite.
            let mut flag = dev.full(1, 0f32);
            dev.unscale_check(&mut [&mut scalars], None, &mut flag, 0);
            st.clip_flag = Some(match st.clip_flag.take() {
                Some(earlier) => max_of(&dev, &[earlier, flag]),
                None => flag,
            });
        }
        let norm = read_back(&dev, scalars, 0, |v: f32| v);
        st.grad_norm = Some(norm.clone());
        Ok(norm)
    }
    /// Clips by global L2 norm, returning the norm before clipping; panics if `max_norm` is
    /// not positive.
    #[track_caller]
    pub fn clip_grad_norm(&mut self, max_norm: f32) -> D::Value<f32>
    where
        S: CanClip,
    {
        or_panic(self.try_clip_grad_norm(max_norm))
    }
    /// Clamps every gradient value to `[-clip_value, clip_value]` (PyTorch's `clip_grad_value_`).
    pub fn try_clip_grad_value(&mut self, clip_value: f32) -> Result<()>
    where
        S: CanClip,
    {
        let st = self.st_mut();
        let clipped = crate::clip::try_clip_grad_value(&mut st.grads, clip_value);
        st.failed = clipped.is_err();
        clipped
    }
    /// Clamps every gradient value; panics if `clip_value` is negative or NaN.
    #[track_caller]
    pub fn clip_grad_value(&mut self, clip_value: f32)
    where
        S: CanClip,
    {
        or_panic(self.try_clip_grad_value(clip_value))
    }

    /// Applies `optimizer` to `model`'s parameters, or skips it (leaving parameters and
    /// optimizer state bit-identical) if any of their gradients was inf or NaN. Parameters are
    /// updated in place (the forward graph was freed by `.backward()`).
    ///
    /// The model's parameters are of element type `E`: f32 master weights with an
    /// [`crate::optim::Optim`], or pure-bf16 weights with an `Optim<R, bf16>`
    /// ([`crate::optim::Optim::for_bf16`]); an optimizer for another element type does not
    /// compile.
    pub fn try_step<O, M, E>(self, optimizer: &mut O, model: &mut M) -> Result<Stepped<'s, K, D>>
    where
        S: CanStep,
        E: Precision,
        O: Optimizer<E, D> + ?Sized,
        M: Params<E, D> + ?Sized,
    {
        let mut pairs: [OptimizerPair<'_, E, D>; 1] = [(&mut DynOptimizer(optimizer), &mut DynParams(model))];
        self.try_step_many(&mut pairs)
    }
    /// Applies or skips the optimizer step; panics where [`TrainStep::try_step`] errs (a
    /// gradient or optimizer state whose shape does not match its parameter, an optimizer
    /// bound to another model's parameters).
    #[track_caller]
    pub fn step<O, M, E>(self, optimizer: &mut O, model: &mut M) -> Stepped<'s, K, D>
    where
        S: CanStep,
        E: Precision,
        O: Optimizer<E, D> + ?Sized,
        M: Params<E, D> + ?Sized,
    {
        or_panic(self.try_step(optimizer, model))
    }
    /// Steps several optimizers, each over its own parameters, on this step's gradients. Each
    /// skips on its own overflow (an inf/NaN among its parameters' gradients), and all of them
    /// after a clip whose norm was inf or NaN; the scale backs off once in `.update()` however
    /// many skipped, as in PyTorch. A pair whose parameters have no gradient at all is left
    /// alone (its optimizer does not count a step). Every pair has parameters of one element
    /// type `E` (f32, or bf16 for pure-bf16 models). Every pair is checked before any steps
    /// (each optimizer's [`Optimizer::check_step`]), so an error leaves every model and
    /// optimizer as it was.
    pub fn try_step_many<E: Precision>(mut self, pairs: &mut [OptimizerPair<'_, E, D>]) -> Result<Stepped<'s, K, D>>
    where
        S: CanStep,
    {
        if let Err(e) = check_pairs(pairs, &self.st().grads) {
            return self.fail(e);
        }
        let st = self.st_mut();
        let grads = std::mem::replace(&mut st.grads, Grads::empty());
        let mut any_stepped = false;
        // Off the CPU each pair's flag (the max of its gradients' flags, and of the clip's)
        // goes to its optimizer, which skips on the device: nothing is read back. On the CPU
        // the flags are host memory: read them, and step the pairs whose gradients are finite.
        let flags = st.flags.take();
        let clip_flag = st.clip_flag.take();
        let on_device = flags.as_ref().filter(|_| !D::HOST_MEMORY);
        let (non_finite, clip_overflow) = if on_device.is_none() {
            let clip = clip_flag.as_ref().is_some_and(|f| st.dev.to_host(f, &Layout::contiguous(&[1]))[0] != 0.0);
            (read_non_finite(&st.dev, &flags), clip)
        } else {
            (HashSet::new(), false)
        };
        let mut pair_flags = Vec::new();
        for (opt, model) in pairs.iter_mut() {
            let named = model.named_params();
            if !named.iter().any(|(_, p)| grads.get_by_id(p.id()).is_some()) {
                continue;
            }
            any_stepped = true;
            let stepped = match on_device {
                Some((ids, flags)) => {
                    let mut flag = pair_flag(&st.dev, ids, flags, named.iter().map(|(_, p)| p.id()));
                    if let Some(clip) = &clip_flag {
                        flag = max_of(&st.dev, &[flag, clip.clone()]);
                    }
                    drop(named);
                    let stepped = opt.step_unless_inf(&mut **model, &grads, &flag);
                    pair_flags.push(flag);
                    stepped
                }
                None => {
                    let overflow = clip_overflow
                        || (!non_finite.is_empty() && named.iter().any(|(_, p)| non_finite.contains(&p.id())));
                    drop(named);
                    if overflow {
                        st.found_inf = Outcome::Host(true);
                        Ok(())
                    } else {
                        opt.step(&mut **model, &grads)
                    }
                }
            };
            if let Err(e) = stepped {
                return self.fail(e);
            }
        }
        if !pair_flags.is_empty() {
            st.found_inf = Outcome::OnDevice(max_of(&st.dev, &pair_flags));
        }
        if !any_stepped && !grads.is_empty() {
            let e = Error::State {
                context: "step".into(),
                detail: "none of the models passed to `.step(..)` has a parameter with a gradient in this step: \
                         the gradients belong to other parameters (a copy of the model, or another model)"
                    .into(),
            };
            return self.fail(e);
        }
        Ok(self.into_stage())
    }
    /// Steps several optimizers; panics where [`TrainStep::try_step_many`] errs.
    #[track_caller]
    pub fn step_many<E: Precision>(self, pairs: &mut [OptimizerPair<'_, E, D>]) -> Stepped<'s, K, D>
    where
        S: CanStep,
    {
        or_panic(self.try_step_many(pairs))
    }

    /// Ends the iteration: the scaler backs off after an overflow, grows after
    /// `growth_interval` good steps (rules in the module docs). Errs only when the scaler was
    /// built with `error_at_min_scale` and the scale collapsed to its floor.
    pub fn update(self) -> Result<StepReport<D>>
    where
        S: CanUpdate,
    {
        self.finish(None)
    }
    /// Ends the iteration setting the scale to `new_scale` (PyTorch's `update(new_scale)`: the
    /// growth tracker is left as it is).
    pub fn update_to(self, new_scale: f32) -> Result<StepReport<D>>
    where
        S: CanUpdate,
    {
        self.finish(Some(new_scale))
    }
    fn finish(mut self, new_scale: Option<f32>) -> Result<StepReport<D>> {
        let st = self.inner.take().expect("a live TrainStep holds its state");
        let dev = st.dev.clone();
        let found_inf = match &st.found_inf {
            Outcome::Host(skipped) => dev.from_host(vec![if *skipped { 1.0f32 } else { 0.0 }]),
            Outcome::OnDevice(flag) => flag.clone(),
        };
        let after = st.scaler.finish(&dev, &found_inf, new_scale)?;
        let (scale, growth_tracker) = match after {
            Some(state) => {
                // One copy of the state serves both fields: reading both is one read.
                let reader = dev.clone();
                let copy = Lazy::new(move || {
                    let v = reader.to_host(&state, &Layout::contiguous(&[ScaleSlot::LEN]));
                    (v[ScaleSlot::Scale as usize] as f32, v[ScaleSlot::GrowthTracker as usize] as i32)
                });
                let scale_of = copy.clone();
                (dev.value(move || scale_of.force().0), dev.value(move || copy.force().1))
            }
            None => (dev.value(|| 1.0), dev.value(|| 0)),
        };
        Ok(StepReport {
            skipped: st.found_inf.value(&dev),
            scale_used: read_seed(&dev, &st.seed),
            scale,
            growth_tracker,
            micro_batches: st.micro_batches,
            grad_norm: st.grad_norm,
        })
    }
}

impl<'s, K: LossScaler, D: Device> TrainStep<'s, K, LossScaled, D> {
    /// Starts a step: refuses a loss computed in f16 when `scaler` does not scale (f16
    /// gradients underflow to zero without loss scaling).
    pub(crate) fn start(scaler: &'s mut K, loss: Tensor<f32, D>) -> Result<Self> {
        check_precision_fits(&*scaler, &loss)?;
        let dev = loss.device().clone();
        // A loss that is not a scalar is refused by `backward()`, which says so.
        let shape = if loss.numel() == 1 { loss.shape().to_vec() } else { vec![1] };
        let seed = match scaler.device_state(&dev) {
            Some(state) => {
                let scale = dev.cast::<f64, f32>(state, &Layout::contiguous(&[1]));
                Tensor::from_storage(&dev, scale, &shape)
            }
            None => Tensor::from_storage(&dev, dev.full(1, 1.0f32), &shape),
        };
        Ok(TrainStep {
            inner: Some(Inner {
                scaler,
                dev,
                seed,
                loss: Some(loss),
                grads: Grads::empty(),
                flags: None,
                found_inf: Outcome::Host(false),
                micro_batches: 0,
                grad_norm: None,
                clip_flag: None,
                failed: false,
            }),
            _stage: PhantomData,
        })
    }
    /// The loss as given (not scaled).
    pub fn loss(&self) -> &Tensor<f32, D> {
        self.st().loss.as_ref().expect("a LossScaled step holds its loss")
    }
    /// The scaled loss, `loss × scale` computed in f32 (detached: `backward()` is the way to
    /// differentiate it).
    pub fn scaled_value(&self) -> Tensor<f32, D> {
        let loss = self.loss().detach();
        crate::no_grad(|| loss.mul(&self.st().seed))
    }
}

impl<K: LossScaler, D: Device> TrainStep<'_, K, GradsScaled, D> {
    /// The gradients, still multiplied by the scale (a read-only view: scaled gradients are
    /// never a [`Grads`] that could be clipped or stepped).
    pub fn scaled_grads(&self) -> GradsView<'_, D> {
        GradsView { grads: &self.st().grads, scaled: true }
    }
}

impl<K: LossScaler, D: Device> TrainStep<'_, K, GradsUnscaled, D> {
    /// The unscaled gradients (a read-only view: the step applies them, once).
    pub fn grads(&self) -> GradsView<'_, D> {
        GradsView { grads: &self.st().grads, scaled: false }
    }
    /// Whether any gradient is inf or NaN (the step will be skipped for the optimizers whose
    /// parameters they belong to), or a `clip_grad_norm`'s total norm was (every optimizer
    /// will skip).
    pub fn found_inf(&self) -> D::Value<bool> {
        let st = self.st();
        let parts: Vec<D::Storage<f32>> = st.flags.iter().map(|(_, f)| f.clone()).chain(st.clip_flag.clone()).collect();
        let reader = st.dev.clone();
        st.dev.value(move || {
            parts.iter().any(|f| reader.to_host(f, &Layout::contiguous(&[D::len(f)])).iter().any(|&v| v != 0.0))
        })
    }
    /// The global L2 norm of the gradients (as `clip_grad_norm` measures it), without clipping.
    pub fn grad_norm(&self) -> D::Value<f32> {
        crate::clip::grad_norm(&self.st().grads)
    }
}

impl<K: LossScaler, D: Device> TrainStep<'_, K, OptimizerStepped, D> {
    /// Whether the optimizer step was skipped (a gradient was inf or NaN).
    pub fn skipped(&self) -> D::Value<bool> {
        self.st().found_inf.value(&self.st().dev)
    }
}

/// Refuses a loss whose graph runs through f16 ops when `scaler` does not scale it: their
/// gradients underflow (35.7% of the nonzero f16 gradients of a small GPT flush to zero). The
/// graph is walked only then, so an f16 run with a `GradScaler` pays nothing.
fn check_precision_fits<K: LossScaler, D: Device>(scaler: &K, loss: &Tensor<f32, D>) -> Result<()> {
    if scaler.scales_loss() {
        return Ok(());
    }
    if let Some(op) = crate::autograd::first_node_of(loss, DType::F16) {
        return Err(Error::State {
            context: "scale".into(),
            detail: format!(
                "the loss was computed through f16 ops (`{op}`), but this scaler does not scale the loss \
                 (`NoScale`, or a `GradScaler` built disabled): f16 gradients underflow to zero without loss \
                 scaling. Use `GradScaler::new()` (`ScalerFor<f16>`) for f16; `NoScale` is for bf16 and f32"
            ),
        });
    }
    Ok(())
}

/// `loss.backward()` with every gradient multiplied by the scale: the seed is the scale
/// itself (what PyTorch's backward of `loss * scale` gives: `1 × scale` exactly), on the device.
fn scaled_backward<D: Device>(loss: &Tensor<f32, D>, seed: &Tensor<f32, D>) -> Result<Grads<D>> {
    loss.try_backward_with_seed(seed.clone())
}

/// The scale a step's seed holds, as a [`Device::Value`].
fn read_seed<D: Device>(dev: &D, seed: &Tensor<f32, D>) -> D::Value<f32> {
    read_back(dev, seed.storage.clone(), seed.layout.offset(), |v| v)
}

/// Whether a step skipped: decided on the host, or a flag on the device.
enum Outcome<D: Device> {
    Host(bool),
    OnDevice(D::Storage<f32>),
}

impl<D: Device> Outcome<D> {
    /// As a [`Device::Value`] (the flag read when asked).
    fn value(&self, dev: &D) -> D::Value<bool> {
        match self {
            Outcome::Host(skipped) => {
                let skipped = *skipped;
                dev.value(move || skipped)
            }
            Outcome::OnDevice(flag) => read_back(dev, flag.clone(), 0, |f: f32| f != 0.0),
        }
    }
}

/// One f32 on the device: the max of the flags of the gradients of `params` (those among
/// `ids`), 1 if any of them had an inf or NaN.
fn pair_flag<D: Device>(
    dev: &D,
    ids: &[TensorId],
    flags: &D::Storage<f32>,
    params: impl Iterator<Item = TensorId>,
) -> D::Storage<f32> {
    let params: HashSet<TensorId> = params.collect();
    let rows: Vec<i64> = ids.iter().enumerate().filter(|(_, id)| params.contains(id)).map(|(i, _)| i as i64).collect();
    if rows.len() == ids.len() {
        return max_of(dev, std::slice::from_ref(flags));
    }
    let picked = dev.gather_rows((flags, &Layout::contiguous(&[ids.len(), 1])), &rows, 1);
    max_of(dev, std::slice::from_ref(&picked))
}

/// The max of every element of `parts` (each contiguous), as one f32 on the device.
fn max_of<D: Device>(dev: &D, parts: &[D::Storage<f32>]) -> D::Storage<f32> {
    let all = match parts {
        [one] if D::len(one) == 1 => return one.clone(),
        [one] => one.clone(),
        _ => {
            let whole: Vec<(Layout, usize)> =
                parts.iter().map(|p| (Layout::contiguous(&[D::len(p)]), D::len(p))).collect();
            let views: Vec<_> = parts.iter().zip(&whole).map(|(p, (l, n))| (p, l, *n)).collect();
            dev.cat(&views, 1, 1)
        }
    };
    let n = D::len(&all);
    if n == 0 {
        return dev.full(1, 0f32);
    }
    let split = crate::backend::DimSplit { outer: 1, dim: n, inner: 1 };
    dev.reduce(&all, &Layout::contiguous(&[n]), split, crate::backend::ReduceOp::Max, 1.0)
}

/// Checks every pair of a `step_many` that will step (its model has a gradient) with its
/// optimizer's own checks, before any steps.
fn check_pairs<E: Precision, D: Device>(pairs: &[OptimizerPair<'_, E, D>], grads: &Grads<D>) -> Result<()> {
    for (opt, model) in pairs {
        if model.named_params().iter().any(|(_, p)| grads.get_by_id(p.id()).is_some()) {
            opt.check_step(&**model, grads)?;
        }
    }
    Ok(())
}

/// The gradients whose flag is set: the step's one read of device memory.
fn read_non_finite<D: Device>(dev: &D, flags: &Option<(Vec<TensorId>, D::Storage<f32>)>) -> HashSet<TensorId> {
    let Some((ids, flags)) = flags else { return HashSet::new() };
    let values = dev.to_host(flags, &Layout::contiguous(&[ids.len()]));
    ids.iter().zip(values).filter(|(_, f)| *f != 0.0).map(|(id, _)| *id).collect()
}

/// The fused unscale + check over every gradient, on the device: one pass per precision
/// present, multiplying by the inverse of `scale` (the scaler's state on the device) when
/// there is one, and one flag per gradient. Nothing is read back.
fn unscale_grads<D: Device>(
    dev: &D,
    grads: &mut Grads<D>,
    scale: Option<&D::Storage<f64>>,
) -> Option<(Vec<TensorId>, D::Storage<f32>)> {
    if grads.is_empty() {
        return None;
    }
    /// One precision's gradients, in place.
    struct Group<'a, E: Precision, D: Device> {
        ids: Vec<TensorId>,
        storages: Vec<&'a mut D::Storage<E>>,
    }
    impl<'a, E: Precision, D: Device> Group<'a, E, D> {
        fn new() -> Self {
            Group { ids: Vec::new(), storages: Vec::new() }
        }
        fn push(&mut self, id: TensorId, t: &'a mut Tensor<E, D>) {
            t.make_exclusive();
            self.ids.push(id);
            self.storages.push(&mut t.storage);
        }
        fn run(
            mut self,
            dev: &D,
            scale: Option<&D::Storage<f64>>,
            flags: &mut D::Storage<f32>,
            ids: &mut Vec<TensorId>,
        ) {
            if !self.ids.is_empty() {
                dev.unscale_check(&mut self.storages, scale, flags, ids.len());
                ids.append(&mut self.ids);
            }
        }
    }
    let n = grads.len();
    let (mut g32, mut g16, mut gb16, mut g64) = (Group::new(), Group::new(), Group::new(), Group::new());
    for (id, g) in grads.iter_mut() {
        match g {
            AnyTensor::F32(t) => g32.push(id, t),
            AnyTensor::F16(t) => g16.push(id, t),
            AnyTensor::BF16(t) => gb16.push(id, t),
            AnyTensor::F64(t) => g64.push(id, t),
        }
    }
    let mut flags = dev.full(n, 0f32);
    let mut ids = Vec::with_capacity(n);
    g32.run(dev, scale, &mut flags, &mut ids);
    g16.run(dev, scale, &mut flags, &mut ids);
    gb16.run(dev, scale, &mut flags, &mut ids);
    g64.run(dev, scale, &mut flags, &mut ids);
    Some((ids, flags))
}

/// `&mut M` for any `M: Params<E> + ?Sized`, as a sized `Params<E>`.
struct DynParams<'a, M: ?Sized>(&'a mut M);

impl<E: Precision, D: Device, M: Params<E, D> + ?Sized> Params<E, D> for DynParams<'_, M> {
    fn named_params(&self) -> Vec<(String, &Param<E, D>)> {
        self.0.named_params()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param<E, D>)> {
        self.0.named_params_mut()
    }
}

/// `&mut O` for any `O: Optimizer<E> + ?Sized`, as a sized `Optimizer<E>`.
struct DynOptimizer<'a, O: ?Sized>(&'a mut O);

impl<E: Precision, D: Device, O: Optimizer<E, D> + ?Sized> Optimizer<E, D> for DynOptimizer<'_, O> {
    fn step(&mut self, params: &mut dyn Params<E, D>, grads: &Grads<D>) -> Result<()> {
        self.0.step(params, grads)
    }
    fn check_step(&self, params: &dyn Params<E, D>, grads: &Grads<D>) -> Result<()> {
        self.0.check_step(params, grads)
    }
    fn step_unless_inf(
        &mut self,
        params: &mut dyn Params<E, D>,
        grads: &Grads<D>,
        found_inf: &D::Storage<f32>,
    ) -> Result<()> {
        self.0.step_unless_inf(params, grads, found_inf)
    }
    fn lr(&self) -> f64 {
        self.0.lr()
    }
    fn steps(&self) -> u64 {
        self.0.steps()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::optim::Sgd;
    use crate::scaler::GradScaler;
    use crate::{Param, Tensor, f16};

    #[test]
    fn parameters_update_in_place_without_dropping_the_loss_by_hand() {
        let mut w = Param::new(Tensor::<f32>::from_f32s(&[1.0, -2.0, 0.5, 3.0], &[2, 2]));
        let x = Tensor::<f32>::from_f32s(&[0.5, 1.0], &[1, 2]);
        // A small scale, so no step overflows in f16 (and every one updates).
        let opts = crate::scaler::GradScalerOptions { init_scale: 256.0, ..Default::default() };
        let (mut s, mut opt) = (GradScaler::with_options(opts).unwrap(), Sgd::new(0.01).build().unwrap());
        let storage = |w: &Param| Arc::as_ptr(&w.tensor().storage) as usize;
        let before = storage(&w);
        for _ in 0..3 {
            let loss = x.cast::<f16>().matmul(&w.cast::<f16>()).cast::<f32>().square().sum_all();
            s.scale(loss).backward().unscale().step(&mut opt, &mut w).update().unwrap();
        }
        assert_eq!(storage(&w), before, "no step copied the parameter");
        assert_eq!(opt.steps(), 3);
    }
}
