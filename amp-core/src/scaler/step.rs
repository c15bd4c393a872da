//! The training step as a typestate: [`TrainStep`] and its stages.

use std::collections::HashSet;
use std::marker::PhantomData;

use super::grad_scaler::{LossScaler, UnscaleMode};
use super::kernel;
use crate::autograd::{AnyTensor, Grads, TensorId};
use crate::cpu::BUF;
use crate::error::{Error, Result, or_panic};
use crate::optim::Optimizer;
use crate::param::{Param, Params};
use crate::precision::{Accum, DType, Precision};
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
        /// `scaler.scale(&loss)` was called; no gradients yet.
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

    /// Stage after `scaler.scale(&loss)`: the loss, waiting for `.backward()`.
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
        label = "`backward()` runs once per `scaler.scale(&loss)`",
        note = "to add another micro-batch's gradients, call `.accumulate(&loss)` on the `ScaledGrads` (before `.unscale()`)"
    )]
    pub trait CanBackward: Stage {}
    impl CanBackward for LossScaled {}

    /// Stages that allow `.accumulate(&loss)`: only [`GradsScaled`].
    #[diagnostic::on_unimplemented(
        message = "micro-batches are accumulated into scaled gradients, but this training step is at stage `{Self}`",
        label = "`accumulate(&loss)` needs the `ScaledGrads` returned by `.backward()`",
        note = "accumulate every micro-batch after `.backward()` and before `.unscale()`: `let mut grads = scaler.scale(&loss0).backward(); grads.accumulate(&loss1);`"
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
        note = "the order is: `scaler.scale(&loss)`, `.backward()`, `.unscale()`, `.clip_grad_norm(max_norm)`, `.step(&mut optimizer, &mut model)`, `.update()`"
    )]
    pub trait CanClip: Stage {}
    impl CanClip for GradsUnscaled {}

    /// Stages that allow `.step(..)`: only [`GradsUnscaled`].
    #[diagnostic::on_unimplemented(
        message = "`step(..)` needs unscaled gradients, but this training step is at stage `{Self}`",
        label = "`step(..)` comes once per iteration, right after `.unscale()` (and clipping)",
        note = "at `GradsScaled` the gradients are still multiplied by the loss scale: call `.unscale()` first",
        note = "at `OptimizerStepped` the optimizer has already stepped: finish the iteration with `.update()`, then start the next one with `scaler.scale(&loss)`",
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
/// `.update()`. Built by `scaler.scale(&loss)`; every transition consumes the step, so calls
/// can only come in the right order (see the module docs).
#[must_use = "an unfinished training step: every iteration ends with `.update()`, which adapts the loss scale (the order is `.backward()`, `.unscale()`, `.step(&mut optimizer, &mut model)`, `.update()`)"]
pub struct TrainStep<'s, K: LossScaler, S: Stage> {
    scaler: &'s mut K,
    /// The scale this iteration uses (fixed at `scale(&loss)`).
    scale: f32,
    loss: Option<Tensor<f32>>,
    grads: Grads,
    /// Gradients found inf/NaN by `unscale()`.
    non_finite: HashSet<TensorId>,
    /// After `step`: whether any optimizer skipped its step.
    found_inf: bool,
    micro_batches: usize,
    grad_norm: Option<f32>,
    _stage: PhantomData<S>,
}

/// `scaler.scale(&loss)`: the loss times the scale, waiting for `.backward()`.
pub type ScaledLoss<'s, K> = TrainStep<'s, K, LossScaled>;
/// `.backward()`: gradients times the scale; more micro-batches can be accumulated.
pub type ScaledGrads<'s, K> = TrainStep<'s, K, GradsScaled>;
/// `.unscale()`: true gradients, checked for inf/NaN; clip here, then `.step(..)`.
pub type UnscaledGrads<'s, K> = TrainStep<'s, K, GradsUnscaled>;
/// `.step(..)`: the optimizer stepped or skipped; `.update()` ends the iteration.
pub type Stepped<'s, K> = TrainStep<'s, K, OptimizerStepped>;

/// What one iteration did, returned by `.update()`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Whether the optimizer step was skipped because a gradient was inf or NaN.
    pub skipped: bool,
    /// The scale this iteration's loss was multiplied by.
    pub scale_used: f32,
    /// The scale after the update (what the next iteration uses).
    pub scale: f32,
    /// The scaler's growth tracker after the update.
    pub growth_tracker: i32,
    /// Micro-batches accumulated into this step (1 without accumulation).
    pub micro_batches: usize,
    /// The total gradient norm if `clip_grad_norm` was called (before clipping).
    pub grad_norm: Option<f32>,
}

mod loss_sealed {
    pub trait Sealed {}
    impl Sealed for crate::Tensor<f32> {}
}

/// A micro-batch's loss, as [`TrainStep::accumulate`] takes it: an f32 scalar tensor.
#[diagnostic::on_unimplemented(
    message = "`accumulate` takes another micro-batch's loss (`&Tensor<f32>`), not `{Self}`",
    label = "expected the loss of a micro-batch",
    note = "gradients from another `scaler.scale(..)` call belong to another iteration (possibly at another scale) and cannot be mixed in",
    note = "run the micro-batch's forward pass and pass its loss: `grads.accumulate(&loss)`, before `.unscale()`"
)]
pub trait MicroBatchLoss: loss_sealed::Sealed {
    /// The loss tensor.
    fn as_loss(&self) -> &Tensor<f32>;
}

impl MicroBatchLoss for Tensor<f32> {
    fn as_loss(&self) -> &Tensor<f32> {
        self
    }
}

impl<'s, K: LossScaler, S: Stage> TrainStep<'s, K, S> {
    fn into_stage<T: Stage>(self) -> TrainStep<'s, K, T> {
        TrainStep {
            scaler: self.scaler,
            scale: self.scale,
            loss: self.loss,
            grads: self.grads,
            non_finite: self.non_finite,
            found_inf: self.found_inf,
            micro_batches: self.micro_batches,
            grad_norm: self.grad_norm,
            _stage: PhantomData,
        }
    }
    /// The stage, at run time (for logs).
    pub fn stage(&self) -> StageKind {
        S::KIND
    }
    /// The scale this iteration multiplies its loss by (fixed when `scale(&loss)` was called).
    pub fn scale_used(&self) -> f32 {
        self.scale
    }
    /// Micro-batches whose gradients are in this step so far.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Runs `backward()` on the scaled loss (gradients come out multiplied by the scale).
    pub fn try_backward(mut self) -> Result<ScaledGrads<'s, K>>
    where
        S: CanBackward,
    {
        let loss = self.loss.take().expect("a LossScaled step holds its loss");
        self.grads = scaled_backward(&loss, self.scale)?;
        self.micro_batches = 1;
        Ok(self.into_stage())
    }
    /// Runs `backward()` on the scaled loss. Panics if the loss is not a scalar that depends on
    /// a parameter (see [`TrainStep::try_backward`]).
    #[track_caller]
    pub fn backward(self) -> ScaledGrads<'s, K>
    where
        S: CanBackward,
    {
        or_panic(self.try_backward())
    }

    /// Adds another micro-batch's gradients, scaled by this iteration's scale, to this step
    /// (PyTorch's repeated `scaler.scale(loss).backward()` before one `step`). Divide each
    /// micro-batch's loss by the number of micro-batches if you want their mean.
    pub fn try_accumulate<L: MicroBatchLoss + ?Sized>(&mut self, loss: &L) -> Result<&mut Self>
    where
        S: CanAccumulate,
    {
        let more = scaled_backward(loss.as_loss(), self.scale)?;
        self.grads.accumulate(more);
        self.micro_batches += 1;
        Ok(self)
    }
    /// Adds another micro-batch's gradients; panics where [`TrainStep::try_accumulate`] errs.
    #[track_caller]
    pub fn accumulate<L: MicroBatchLoss + ?Sized>(&mut self, loss: &L) -> &mut Self
    where
        S: CanAccumulate,
    {
        or_panic(self.try_accumulate(loss).map(|_| ()));
        self
    }

    /// Divides every gradient by the scale (multiplying by PyTorch's f32 `inv`) and checks it
    /// for inf/NaN, in one fused pass over all gradients. A [`crate::scaler::GradScaler`]
    /// refuses f16 gradients, as PyTorch does: master parameters and their gradients are f32.
    pub fn try_unscale(mut self) -> Result<UnscaledGrads<'s, K>>
    where
        S: CanUnscale,
    {
        let mode = self.scaler.unscale_mode();
        if self.scaler.refuses_f16_grads()
            && let Some((id, _)) = self.grads.iter().find(|(_, g)| g.dtype() == DType::F16)
        {
            return Err(Error::State {
                context: "unscale".into(),
                detail: format!(
                    "the gradient of tensor {id:?} is f16: GradScaler does not unscale f16 gradients \
                         (PyTorch: \"Attempting to unscale FP16 gradients\"). Keep master parameters in f32 \
                         (`Param<f32>`) and cast them to f16 inside the forward pass"
                ),
            });
        }
        self.non_finite = unscale_grads(&mut self.grads, mode);
        Ok(self.into_stage())
    }
    /// Unscales and checks the gradients; panics where [`TrainStep::try_unscale`] errs.
    #[track_caller]
    pub fn unscale(self) -> UnscaledGrads<'s, K>
    where
        S: CanUnscale,
    {
        or_panic(self.try_unscale())
    }

    /// Scales all gradients so their global L2 norm is at most `max_norm` (PyTorch's
    /// `clip_grad_norm_`), returning the norm before clipping. See [`crate::clip`].
    pub fn try_clip_grad_norm(&mut self, max_norm: f32) -> Result<f32>
    where
        S: CanClip,
    {
        let norm = crate::clip::try_clip_grad_norm(&mut self.grads, max_norm)?;
        self.grad_norm = Some(norm);
        Ok(norm)
    }
    /// Clips by global L2 norm, returning the norm before clipping; panics if `max_norm` is
    /// not positive.
    #[track_caller]
    pub fn clip_grad_norm(&mut self, max_norm: f32) -> f32
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
        crate::clip::try_clip_grad_value(&mut self.grads, clip_value)
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
    /// optimizer state bit-identical) if any of their gradients was inf or NaN.
    ///
    /// Parameters are updated in place when nothing else holds their storage; a forward graph
    /// that is still alive (a `loss` tensor in scope) makes each update copy its parameter
    /// first, so drop it before stepping in hot loops.
    pub fn try_step<O, M>(self, optimizer: &mut O, model: &mut M) -> Result<Stepped<'s, K>>
    where
        S: CanStep,
        O: Optimizer + ?Sized,
        M: Params + ?Sized,
    {
        let mut pairs: [(&mut dyn Optimizer, &mut dyn Params); 1] =
            [(&mut DynOptimizer(optimizer), &mut DynParams(model))];
        self.try_step_many(&mut pairs)
    }
    /// Applies or skips the optimizer step; panics where [`TrainStep::try_step`] errs (a
    /// gradient or optimizer state whose shape does not match its parameter).
    #[track_caller]
    pub fn step<O, M>(self, optimizer: &mut O, model: &mut M) -> Stepped<'s, K>
    where
        S: CanStep,
        O: Optimizer + ?Sized,
        M: Params + ?Sized,
    {
        or_panic(self.try_step(optimizer, model))
    }
    /// Steps several optimizers, each over its own parameters, on this step's gradients. Each
    /// skips on its own overflow (an inf/NaN among its parameters' gradients); the scale backs
    /// off once in `.update()` however many skipped, as in PyTorch.
    pub fn try_step_many(mut self, pairs: &mut [(&mut dyn Optimizer, &mut dyn Params)]) -> Result<Stepped<'s, K>>
    where
        S: CanStep,
    {
        let grads = std::mem::take(&mut self.grads);
        for (opt, model) in pairs.iter_mut() {
            let overflow = !self.non_finite.is_empty()
                && model.named_params().iter().any(|(_, p)| self.non_finite.contains(&p.id()));
            if overflow {
                self.found_inf = true;
            } else {
                opt.step(&mut **model, &grads)?;
            }
        }
        Ok(self.into_stage())
    }
    /// Steps several optimizers; panics where [`TrainStep::try_step_many`] errs.
    #[track_caller]
    pub fn step_many(self, pairs: &mut [(&mut dyn Optimizer, &mut dyn Params)]) -> Stepped<'s, K>
    where
        S: CanStep,
    {
        or_panic(self.try_step_many(pairs))
    }

    /// Ends the iteration: the scaler backs off after an overflow, grows after
    /// `growth_interval` good steps (rules in the module docs). Errs only when the scaler was
    /// built with `error_at_min_scale` and the scale collapsed to its floor.
    pub fn update(self) -> Result<StepReport>
    where
        S: CanUpdate,
    {
        self.finish(None)
    }
    /// Ends the iteration setting the scale to `new_scale` (PyTorch's `update(new_scale)`: the
    /// growth tracker is left as it is).
    pub fn update_to(self, new_scale: f32) -> Result<StepReport>
    where
        S: CanUpdate,
    {
        self.finish(Some(new_scale))
    }
    fn finish(self, new_scale: Option<f32>) -> Result<StepReport> {
        self.scaler.finish(self.found_inf, new_scale)?;
        Ok(StepReport {
            skipped: self.found_inf,
            scale_used: self.scale,
            scale: self.scaler.get_scale(),
            growth_tracker: self.scaler.growth_tracker_value(),
            micro_batches: self.micro_batches,
            grad_norm: self.grad_norm,
        })
    }
}

impl<'s, K: LossScaler> TrainStep<'s, K, LossScaled> {
    pub(crate) fn start(scaler: &'s mut K, loss: &Tensor<f32>) -> Self {
        TrainStep {
            scale: scaler.get_scale(),
            scaler,
            loss: Some(loss.clone()),
            grads: Grads::new(),
            non_finite: HashSet::new(),
            found_inf: false,
            micro_batches: 0,
            grad_norm: None,
            _stage: PhantomData,
        }
    }
    /// The loss as given (not scaled).
    pub fn loss(&self) -> &Tensor<f32> {
        self.loss.as_ref().expect("a LossScaled step holds its loss")
    }
    /// The scaled loss, `loss × scale` computed in f32 (detached: `backward()` is the way to
    /// differentiate it).
    pub fn scaled_value(&self) -> Tensor<f32> {
        let loss = self.loss().detach();
        if self.scale == 1.0 { loss } else { crate::no_grad(|| loss.mul_scalar(self.scale as f64)) }
    }
}

impl<K: LossScaler> TrainStep<'_, K, GradsScaled> {
    /// The gradients, still multiplied by the scale.
    pub fn scaled_grads(&self) -> &Grads {
        &self.grads
    }
}

impl<K: LossScaler> TrainStep<'_, K, GradsUnscaled> {
    /// The unscaled gradients (read-only: the step applies them).
    pub fn grads(&self) -> &Grads {
        &self.grads
    }
    /// Whether any gradient is inf or NaN (the step will be skipped for the optimizers whose
    /// parameters they belong to).
    pub fn found_inf(&self) -> bool {
        !self.non_finite.is_empty()
    }
    /// The global L2 norm of the gradients (as `clip_grad_norm` measures it), without clipping.
    pub fn grad_norm(&self) -> f32 {
        crate::clip::grad_norm(&self.grads)
    }
}

impl<K: LossScaler> TrainStep<'_, K, OptimizerStepped> {
    /// Whether the optimizer step was skipped (a gradient was inf or NaN).
    pub fn skipped(&self) -> bool {
        self.found_inf
    }
}

/// `loss.backward()` with every gradient multiplied by `scale` (the seed is the scale, which
/// is what PyTorch's backward of `loss * scale` gives: `1 × scale` exactly).
fn scaled_backward(loss: &Tensor<f32>, scale: f32) -> Result<Grads> {
    loss.try_backward_with_seed(scale as f64)
}

/// The fused unscale + check over every gradient; returns the ids of non-finite gradients.
fn unscale_grads(grads: &mut Grads, mode: UnscaleMode) -> HashSet<TensorId> {
    let mut bad = HashSet::new();
    match mode {
        UnscaleMode::Nothing => {}
        UnscaleMode::Unscale(inv) => {
            let mut ids = Vec::new();
            let mut f32s: Vec<&mut [f32]> = Vec::new();
            for (id, g) in grads.iter_mut() {
                match g {
                    AnyTensor::F32(t) => {
                        ids.push(id);
                        f32s.push(t.make_mut());
                    }
                    other => {
                        if crate::with_any!(other, t => unscale_generic(t.make_mut(), inv)) {
                            bad.insert(id);
                        }
                    }
                }
            }
            let flags = kernel::unscale_all(&mut f32s, inv);
            bad.extend(ids.into_iter().zip(flags).filter(|(_, f)| *f).map(|(id, _)| id));
        }
        UnscaleMode::CheckOnly => {
            for (id, g) in grads.iter() {
                let found = match g {
                    AnyTensor::F32(t) => kernel::any_non_finite(&t.contiguous_data()),
                    other => crate::with_any!(other, t => t.contiguous_data().iter().any(|v| !v.to_f64().is_finite())),
                };
                if found {
                    bad.insert(id);
                }
            }
        }
    }
    bad
}

/// Unscale for bf16/f64 gradients: `v × inv` in the accumulation type, one rounding.
fn unscale_generic<E: Precision>(data: &mut [E], inv: f32) -> bool {
    let inv = E::Acc::c(inv as f64);
    let mut buf = [E::Acc::default(); BUF];
    let mut found = false;
    for c in data.chunks_mut(BUF) {
        let b = &mut buf[..c.len()];
        E::load(c, b);
        for v in b.iter_mut() {
            found |= !num_traits::Float::is_finite(*v);
            *v *= inv;
        }
        E::store(b, c);
    }
    found
}

/// `&mut M` for any `M: Params + ?Sized`, as a sized `Params`.
struct DynParams<'a, M: Params + ?Sized>(&'a mut M);

impl<M: Params + ?Sized> Params for DynParams<'_, M> {
    fn named_params(&self) -> Vec<(String, &Param)> {
        self.0.named_params()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        self.0.named_params_mut()
    }
}

/// `&mut O` for any `O: Optimizer + ?Sized`, as a sized `Optimizer`.
struct DynOptimizer<'a, O: Optimizer + ?Sized>(&'a mut O);

impl<O: Optimizer + ?Sized> Optimizer for DynOptimizer<'_, O> {
    fn step(&mut self, params: &mut dyn Params, grads: &Grads) -> Result<()> {
        self.0.step(params, grads)
    }
    fn lr(&self) -> f64 {
        self.0.lr()
    }
    fn steps(&self) -> u64 {
        self.0.steps()
    }
}
