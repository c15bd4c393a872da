//! Optimizers: SGD (momentum, Nesterov, weight decay), Adam and AdamW, with f32 state,
//! parameter groups and a learning-rate schedule.
//!
//! Design notes:
//! - An optimizer is [`Optim<R>`]: the bookkeeping (groups, schedule, applied-step count, state
//!   per parameter) is shared, and the update rule `R` ([`Sgd`], [`Adam`], [`AdamW`]) is one
//!   fused pass per parameter over its values, gradient and state, run by the parameter's
//!   device ([`crate::Device::sgd_update`], [`crate::Device::adam_update`]): no chain of
//!   tensor ops, no temporaries. The rule computes the scalars on the host (learning rate,
//!   bias corrections) and the device applies them.
//! - An optimizer is not tied to a device, as in PyTorch: each parameter's state is made on
//!   the parameter's device at its first step ([`Rule::DeviceState`]), and follows it if the
//!   model moves (`model.to_device(..)` then [`Optim::bind`]). [`Optim::state_dict`] copies
//!   it to the host; a loaded checkpoint moves to each parameter's device at its next step.
//! - The training step hands each optimizer its gradients' found-inf flag
//!   ([`Optimizer::step_unless_inf`]). On the CPU the flag is read (host memory) and a
//!   skipped step never reaches the optimizer. On another device [`Optim`] issues its
//!   kernels with the flag and goes on: they skip themselves, and the scalars that depend on
//!   how many recent steps were applied (the schedule's learning rate, Adam's bias
//!   corrections) come as one row per possible count, which the kernel picks from the flags.
//!   The host learns the counts every [`STEPS_PER_READ`] steps, when the set of parameters
//!   with gradients changes, or when asked (`steps()`, `lr()`, `state_dict()`): one read each
//!   (design notes in `optim/window.rs`). The result is the CPU's, bit for bit.
//! - The arithmetic is PyTorch's single-tensor (CPU default) path, operation for operation and
//!   in the same order, in f32 with the hyperparameters rounded to f32 where PyTorch rounds
//!   them (bias corrections and step sizes in f64, as Python floats). Where PyTorch's
//!   vectorised kernels use a fused multiply-add (`add_` with `alpha`, `lerp_`), so does this.
//! - State is keyed by the parameter's name ([`crate::Params`]), so it survives a restart and
//!   can be checkpointed as plain serde data ([`Optim::state_dict`]).
//! - A skipped step (gradient overflow) leaves the optimizer's state, its step count and
//!   therefore the learning-rate schedule exactly where they were.
//! - Parameters without a gradient are left alone and their state does not advance (PyTorch
//!   skips parameters whose `.grad` is `None`).
//! - An optimizer is bound to the parameters (by [`crate::TensorId`]) of its first step, or of
//!   [`Optim::bind`]: stepping it on another model (a copy with the same names included) is an
//!   error naming the parameter, so two models never share moments or step counts. A
//!   [`Grads`] is applied once: stepping twice with one set (or a clone of it) is an error.
//!
//! # Pure bf16 training
//!
//! Large models are often trained with bf16 weights and no f32 master copy (PyTorch users
//! write `model.to(torch.bfloat16)` with an optimizer that keeps f32 moments). Here that is a
//! bf16 model (`gpt.to_precision::<bf16>()`, a `Params<bf16>`) stepped by an [`Optim<R, bf16>`]
//! ([`Optim::for_bf16`]):
//! - The rule's state is unchanged: moments and step counts are f32, as for f32 weights. At a
//!   step the bf16 weight and its bf16 gradient are widened to f32, the rule's own f32 kernel
//!   runs on them (the same arithmetic as for f32 weights), and the result is written back to
//!   bf16 as [`Bf16Rounding`] says.
//! - The element type is a parameter of the optimizer type, not only of the trait: each
//!   `Optim<R, E>` has exactly one `Optimizer` impl, so `opt.step(&mut model, &grads)`,
//!   `opt.steps()` and the training step's `.step(&mut opt, &mut model)` infer `E` with no
//!   annotation, and an f32 optimizer handed a bf16 model is a compile error. The bf16 one
//!   carries its rounding and compensation, and its checkpoint is a [`Bf16OptimizerState`]
//!   ([`OptimizerState`] is unchanged).
//! - Plain round to nearest loses every update smaller than half a bf16 ulp of the weight (an
//!   update below 2⁻⁸ ≈ 0.0039 for a weight just above 1, 2⁻⁹ just below: the warmup's first
//!   steps, the end of a cosine schedule, and the decay term `lr·wd·w` always): the weight
//!   stalls. [`Bf16Rounding::Nearest`] is offered to show it.
//! - The default, [`Bf16Rounding::Kahan`], keeps a compensation buffer per parameter: the
//!   rounding error of each write is carried into the next update (Kahan summation), so small
//!   updates accumulate until they move the weight. The buffer is bf16, 2 bytes per value:
//!   weight and compensation then take 4 bytes, what an f32 master weight takes, but the
//!   gradients are bf16 (2 bytes instead of 4) and no bf16 copy of the weights is made each
//!   step. A bf16 compensation holds the lost part to 8 bits: updates down to about 2⁻¹⁷ of
//!   the weight's magnitude (a thousandth of its bf16 ulp) still accumulate, and the weight
//!   stays within about one bf16 ulp of the f32 trajectory (an f32 master keeps updates down to
//!   2⁻²⁴; an f32 compensation would too, but at 4 bytes, 6 in all, more than the master it
//!   replaces). It is part of [`Optim::state_dict`], so a resumed run continues bit for bit.
//! - [`Bf16Rounding::Stochastic`] rounds up or down with probability given by the distance
//!   (unbiased in expectation), with no buffer at all (2 bytes per weight). Its random bits
//!   are a hash of (seed, parameter name, applied step, element), counter-based, so a resumed
//!   run draws the same bits. It adds noise of up to one bf16 ulp per write where Kahan's error
//!   is bounded and deterministic, which is why Kahan is the default.
//!   `amp-core/tests/pure_bf16.rs` measures Kahan, stochastic rounding and round to nearest
//!   against f32 master weights on the addition task (figures in the README).
//! - As for f32 parameters, everything stays on the parameters' device: the f32 working
//!   copies, the moments and the compensation (made there at the first step, moved there
//!   with the model; [`Optim::state_dict`] copies them to the host).
//! - f16 parameters have no optimizer: [`Optimizer`] is implemented for f32 and bf16 only, so
//!   stepping a `Params<f16>` model does not compile (f16's 5-bit exponent needs the f32 master
//!   copy and loss scaling of mixed precision; pure f16 training is not supported).
//! - The binding and the one-step-per-`Grads` rule are the same for bf16 parameters, and so is
//!   the training step: `scaler.scale(loss).backward().unscale().step(&mut opt, &mut model)`
//!   with [`crate::scaler::NoScale`] (or a `GradScaler`); gradients of bf16 parameters are
//!   bf16, and clipping and unscaling handle them.

mod adam;
mod bf16;
mod schedule;
mod sgd;
mod window;

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use adam::{Adam, AdamState, AdamW};
pub use bf16::{Bf16OptimizerState, Bf16Rounding};
pub use schedule::{Constant, LrSchedule, WarmupCosine};
pub use sgd::{Sgd, SgdState};
pub use window::STEPS_PER_READ;

use window::{Member, Window, WindowOn};

use crate::autograd::{Grads, TensorId};
use crate::backend::{Cpu, Device, Outcomes};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::param::{Param, Params};
use crate::precision::Precision;
use crate::tensor::Tensor;

/// Anything that updates a model's parameters (of element type `E`, f32 by default) from
/// gradients. Object safe, so several optimizers can be stepped together
/// ([`crate::scaler::TrainStep::step_many`]). Implemented by [`Optim<R>`] for f32 parameters
/// and by [`Optim<R, bf16>`](Optim::for_bf16) for pure-bf16 ones; by nothing for f16.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not update parameters of element type `{E}`",
    label = "this optimizer cannot step `Param<{E}>` parameters",
    note = "`Optim::new(rule)` (or `rule.build()`) updates f32 master weights (`Param`, i.e. `Param<f32>`); `.for_bf16(Bf16Rounding::Kahan)` makes it an optimizer for pure-bf16 parameters (`Param<bf16>`)",
    note = "f16 parameters cannot be trained (pure f16 training is not supported): keep f32 master weights and autocast to f16 with a `GradScaler`"
)]
pub trait Optimizer<E: Precision = f32, D: Device = Cpu> {
    /// Updates every parameter of `params` that has a gradient in `grads`.
    ///
    /// In a training step `.step(..)` calls [`Optimizer::step_unless_inf`] on unscaled
    /// gradients, which calls this when they are finite; call it
    /// directly only for training without a loss scaler (`loss.backward()` on an unscaled
    /// loss gives a `Grads`; a scaled loss's gradients never leave the training step). Errs,
    /// changing nothing, if `params` are not the parameters this optimizer is bound to, if
    /// none of them has a gradient in a non-empty `grads`, if this `grads` (or a clone of it)
    /// was already applied to one of them (by any optimizer), or if its loss ran through f16
    /// ops unscaled (f16 gradients underflow without loss scaling: use a `GradScaler`).
    fn step(&mut self, params: &mut dyn Params<E, D>, grads: &Grads<D>) -> Result<()>;
    /// Whether [`Optimizer::step`] would refuse these parameters and gradients, changing
    /// nothing: the training step's `.step_many(..)` checks every optimizer before it steps
    /// any, so a refused pair leaves the others untouched too. The default checks nothing.
    fn check_step(&self, params: &dyn Params<E, D>, grads: &Grads<D>) -> Result<()> {
        let _ = (params, grads);
        Ok(())
    }
    /// The training step's call: [`Optimizer::step`] unless `found_inf` (one f32 on the
    /// parameters' device) is nonzero, in which case nothing changes and no step is counted.
    ///
    /// The default reads the flag on the host (on a GPU, a wait for the device) and then
    /// steps or not. [`Optim`] overrides it: off the CPU its kernels read the flag themselves,
    /// so the host goes on without waiting (see the module notes). The checks of
    /// [`Optimizer::step`] are made either way.
    fn step_unless_inf(
        &mut self,
        params: &mut dyn Params<E, D>,
        grads: &Grads<D>,
        found_inf: &D::Storage<f32>,
    ) -> Result<()> {
        step_if_finite(self, params, grads, found_inf)
    }
    /// The learning rate of the default group that the next step will use (after the schedule).
    fn lr(&self) -> f64;
    /// Steps applied so far (skipped steps are not counted).
    fn steps(&self) -> u64;
}

/// Reads `found_inf` on the host, then steps `opt` unless it is set (a wait for the device
/// off the CPU).
fn step_if_finite<E: Precision, D: Device, O: Optimizer<E, D> + ?Sized>(
    opt: &mut O,
    params: &mut dyn Params<E, D>,
    grads: &Grads<D>,
    found_inf: &D::Storage<f32>,
) -> Result<()> {
    let dev = params.named_params().first().map(|(_, p)| p.device().clone());
    match dev {
        Some(dev) if dev.to_host(found_inf, &Layout::contiguous(&[1]))[0] != 0.0 => Ok(()),
        _ => opt.step(params, grads),
    }
}

impl<E: Precision, D: Device, T: Optimizer<E, D> + ?Sized> Optimizer<E, D> for Box<T> {
    fn step(&mut self, params: &mut dyn Params<E, D>, grads: &Grads<D>) -> Result<()> {
        (**self).step(params, grads)
    }
    fn check_step(&self, params: &dyn Params<E, D>, grads: &Grads<D>) -> Result<()> {
        (**self).check_step(params, grads)
    }
    fn step_unless_inf(
        &mut self,
        params: &mut dyn Params<E, D>,
        grads: &Grads<D>,
        found_inf: &D::Storage<f32>,
    ) -> Result<()> {
        (**self).step_unless_inf(params, grads, found_inf)
    }
    fn lr(&self) -> f64 {
        (**self).lr()
    }
    fn steps(&self) -> u64 {
        (**self).steps()
    }
}

/// The learning rate and weight decay one parameter is updated with at one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    /// Learning rate (the group's base rate times the schedule's factor).
    pub lr: f64,
    /// Weight decay.
    pub weight_decay: f64,
}

impl Hyper {
    /// These base hyperparameters at the schedule's `factor`.
    fn at(self, factor: f64) -> Hyper {
        Hyper { lr: self.lr * factor, ..self }
    }
}

/// An update rule: hyperparameters and the fused per-parameter kernel, run by the parameter's
/// device ([`Device::sgd_update`], [`Device::adam_update`]). Implemented by [`Sgd`], [`Adam`]
/// and [`AdamW`].
pub trait Rule: Clone + fmt::Debug + Send + Sync + 'static {
    /// Per-parameter state (moments, step count) on the host, plain `Vec<f32>`s: the
    /// checkpoint form, serialisable (and, for the CPU, the same type as `DeviceState<Cpu>`).
    type State: Clone + fmt::Debug + PartialEq + Serialize + DeserializeOwned + Send + Sync + 'static;
    /// The same state on device `D`, its vectors `D::StateVec`s.
    type DeviceState<D: Device>: Clone + fmt::Debug + Send + Sync + 'static;
    /// The rule's name, stored in checkpoints (`sgd`, `adam`, `adamw`).
    fn name(&self) -> &'static str;
    /// The default group's learning rate.
    fn lr(&self) -> f64;
    /// The default group's weight decay.
    fn weight_decay(&self) -> f64;
    /// Refuses out-of-range hyperparameters, as PyTorch's constructors do.
    fn validate(&self) -> Result<()>;
    /// Fresh state for a parameter of `numel` values on `dev`.
    fn init_state<D: Device>(&self, dev: &D, numel: usize) -> Self::DeviceState<D>;
    /// Whether `state` fits a parameter of `numel` values (checked before any update).
    fn state_fits<D: Device>(&self, dev: &D, state: &Self::DeviceState<D>, numel: usize) -> bool;
    /// The state's values on the host (for a checkpoint, or to move it to another device).
    fn state_to_host<D: Device>(&self, dev: &D, state: &Self::DeviceState<D>) -> Self::State;
    /// Host state (from a checkpoint, or another device) moved to `dev`.
    fn state_from_host<D: Device>(&self, dev: &D, state: Self::State) -> Self::DeviceState<D>;
    /// One update of the contiguous `param` from `grad` (same length), in one fused pass on
    /// `dev`.
    fn update<D: Device>(
        &self,
        dev: &D,
        hyper: Hyper,
        param: &mut D::Storage<f32>,
        grad: &D::Storage<f32>,
        state: &mut Self::DeviceState<D>,
    );
    /// The update as step `outcomes.at` of a window whose outcomes only the device knows
    /// (see the module notes): `hypers[k]` are the hyperparameters if `k` of the window's
    /// earlier steps were applied, and the device picks the row and skips the update when
    /// this step's flag is set. Counts in `state` stay as they were when the window opened
    /// ([`Rule::advance`] adds the applied steps when the host learns them); `fresh` says
    /// whether the parameter had never been stepped then ([`Rule::is_fresh`]).
    ///
    /// The default reads the flags on the host (a wait for the device) and calls
    /// [`Rule::update`]; [`Sgd`], [`Adam`] and [`AdamW`] decide on the device.
    #[allow(clippy::too_many_arguments)]
    fn update_in_window<D: Device>(
        &self,
        dev: &D,
        hypers: &[Hyper],
        param: &mut D::Storage<f32>,
        grad: &D::Storage<f32>,
        state: &mut Self::DeviceState<D>,
        outcomes: Outcomes<'_, D::Storage<f32>>,
        fresh: bool,
    ) {
        let _ = fresh;
        let flags = dev.to_host(outcomes.flags, &Layout::contiguous(&[D::len(outcomes.flags)]));
        if let Some(k) = crate::backend::outcome_row(&flags, outcomes.at) {
            self.update(dev, hypers[k], param, grad, state);
        }
    }
    /// Whether `state` belongs to a parameter that was never stepped (no moments, no step
    /// count, no momentum buffer): a window whose steps were all skipped returns it to this.
    fn is_fresh<D: Device>(&self, state: &Self::DeviceState<D>) -> bool {
        let _ = state;
        false
    }
    /// Counts `applied` more steps in `state` (Adam's step count); the window's updates
    /// left the counts alone. The default (a rule whose [`Rule::update_in_window`] counts
    /// itself, or that counts nothing) does nothing.
    fn advance<D: Device>(&self, state: &mut Self::DeviceState<D>, applied: u64) {
        let _ = (state, applied);
    }
}

/// One parameter's optimizer state, on whichever device the parameter lives on: the optimizer
/// is not tied to a device (as in PyTorch, its state is made where the parameter is), so
/// [`Optim`] keeps each parameter's state behind this trait and finds its device type again
/// at each step.
trait Slot<R: Rule>: Send + Sync {
    fn to_host(&self, rule: &R) -> R::State;
    fn fits(&self, rule: &R, numel: usize) -> bool;
    fn is_fresh(&self, rule: &R) -> bool;
    fn advance(&mut self, rule: &R, applied: u64);
    fn clone_box(&self) -> Box<dyn Slot<R>>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The state of one parameter on device `D`.
struct OnDevice<R: Rule, D: Device> {
    dev: D,
    state: R::DeviceState<D>,
}

impl<R: Rule, D: Device> Slot<R> for OnDevice<R, D> {
    fn to_host(&self, rule: &R) -> R::State {
        rule.state_to_host(&self.dev, &self.state)
    }
    fn fits(&self, rule: &R, numel: usize) -> bool {
        rule.state_fits(&self.dev, &self.state, numel)
    }
    fn is_fresh(&self, rule: &R) -> bool {
        rule.is_fresh::<D>(&self.state)
    }
    fn advance(&mut self, rule: &R, applied: u64) {
        rule.advance::<D>(&mut self.state, applied)
    }
    fn clone_box(&self) -> Box<dyn Slot<R>> {
        Box::new(OnDevice::<R, D> { dev: self.dev.clone(), state: self.state.clone() })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<R: Rule> Clone for Box<dyn Slot<R>> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// Host state as a slot (loaded from a checkpoint; moved to the parameter's device at its
/// first step).
fn host_slot<R: Rule>(rule: &R, state: R::State) -> Box<dyn Slot<R>> {
    Box::new(OnDevice::<R, Cpu> { dev: Cpu, state: rule.state_from_host(&Cpu, state) })
}

/// The state of the parameter `name` on `dev`, made fresh if it has none, moved there if it
/// is on another device (a model moved after some steps, or a loaded checkpoint).
fn state_on<'a, R: Rule, D: Device>(
    rule: &R,
    slots: &'a mut BTreeMap<String, Box<dyn Slot<R>>>,
    name: &str,
    dev: &D,
    numel: usize,
) -> &'a mut R::DeviceState<D> {
    let slot = slots
        .entry(name.to_string())
        .or_insert_with(|| Box::new(OnDevice::<R, D> { dev: dev.clone(), state: rule.init_state(dev, numel) }));
    if !slot.as_any().is::<OnDevice<R, D>>() {
        let host = slot.to_host(rule);
        *slot = Box::new(OnDevice::<R, D> { dev: dev.clone(), state: rule.state_from_host(dev, host) });
    }
    &mut slot.as_any_mut().downcast_mut::<OnDevice<R, D>>().expect("the slot was just made for this device").state
}

/// A parameter group: the parameters whose name matches a predicate, with their own learning
/// rate and/or weight decay (PyTorch's `param_groups`). Parameters go to the first group that
/// matches, the others to the default group (the rule's own `lr` and `weight_decay`).
///
/// [`Optim::with_group`] refuses a learning rate or weight decay that is negative or not
/// finite, and a step refuses a group that gets none of the model's parameters (a predicate
/// that matches no name, or only names an earlier group took): PyTorch's groups list their
/// parameters, so there a typo cannot leave, say, the biases decayed without a word.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::optim::ParamGroup;
/// let no_decay = ParamGroup::new("no_decay", |name| name.ends_with("bias") || name.contains("ln"))
///     .weight_decay(0.0);
/// assert!(no_decay.matches("head.bias"));
/// ```
#[derive(Clone)]
pub struct ParamGroup {
    name: String,
    matches: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    lr: Option<f64>,
    weight_decay: Option<f64>,
}

impl ParamGroup {
    /// A group of the parameters whose name satisfies `matches`; it inherits the rule's
    /// learning rate and weight decay until set.
    pub fn new(name: impl Into<String>, matches: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        ParamGroup { name: name.into(), matches: Arc::new(matches), lr: None, weight_decay: None }
    }
    /// This group's base learning rate (the schedule multiplies it like every other group's).
    pub fn lr(mut self, lr: f64) -> Self {
        self.lr = Some(lr);
        self
    }
    /// This group's weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = Some(weight_decay);
        self
    }
    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Whether a parameter with this name belongs to the group.
    pub fn matches(&self, param_name: &str) -> bool {
        (self.matches)(param_name)
    }
}

impl fmt::Debug for ParamGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParamGroup")
            .field("name", &self.name)
            .field("lr", &self.lr)
            .field("weight_decay", &self.weight_decay)
            .finish_non_exhaustive()
    }
}

/// An optimizer's checkpoint: the rule's name, the applied-step count (which drives the
/// schedule), each parameter's state by name, and the hyperparameters it was built with.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: DeserializeOwned"))]
pub struct OptimizerState<S> {
    /// `sgd`, `adam` or `adamw`.
    pub kind: String,
    /// Steps applied so far.
    pub steps: u64,
    /// State per parameter name.
    pub params: BTreeMap<String, S>,
    /// The rule's hyperparameters and the parameter groups the optimizer was built with, as
    /// their `Debug` forms print them (not the schedule, which may be a closure).
    /// [`Optim::load_state_dict`] refuses a checkpoint whose hyperparameters differ from the
    /// loading optimizer's: PyTorch's `load_state_dict` restores the saved learning rates and
    /// weight decays, here the optimizer is built with them, so a resume built with other
    /// values would silently train differently. Set it to `None` to resume with new
    /// hyperparameters on purpose; `None` in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyperparameters: Option<String>,
}

/// An optimizer: update rule `R` plus parameter groups, a learning-rate schedule and state per
/// parameter, for parameters of element type `E`: f32 master weights (the default, built by
/// [`Optim::new`]) or pure-bf16 weights ([`Optim::for_bf16`], see the module notes).
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::optim::{AdamW, Optim, ParamGroup, WarmupCosine};
/// let opt = Optim::new(AdamW::new(3e-4).weight_decay(0.1))
///     .unwrap()
///     .with_group(ParamGroup::new("no_decay", |n| n.ends_with("bias")).weight_decay(0.0))
///     .unwrap()
///     .with_schedule(WarmupCosine::new(100, 10_000).unwrap());
/// assert_eq!(opt.lr_at(0), 3e-4 / 100.0);
/// ```
#[derive(Clone)]
pub struct Optim<R: Rule, E: Precision = f32> {
    rule: R,
    groups: Vec<ParamGroup>,
    schedule: Option<Arc<dyn LrSchedule>>,
    steps: u64,
    /// Each stepped parameter's state by name, on the parameter's device.
    state: BTreeMap<String, Box<dyn Slot<R>>>,
    /// The parameters this optimizer steps, by name (set at the first step or by `bind`).
    bound: Option<BTreeMap<String, TensorId>>,
    /// How updates are written into bf16 parameters (read by `Optim<R, bf16>` only).
    rounding: Bf16Rounding,
    /// The Kahan compensation of each bf16 parameter by name (empty unless `E` is bf16 and
    /// `rounding` is Kahan).
    compensation: BTreeMap<String, Box<dyn bf16::CompensationSlot>>,
    /// The steps issued on a device whose outcomes the host has not read yet (see `window`).
    window: Option<Box<dyn Window>>,
    _elem: PhantomData<fn() -> E>,
}

impl<R: Rule, E: Precision> fmt::Debug for Optim<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Optim");
        d.field("rule", &self.rule)
            .field("params", &E::DTYPE)
            .field("groups", &self.groups)
            .field("steps", &self.steps)
            .field("params_with_state", &self.state.len())
            .field("steps_not_read", &self.window.as_ref().map_or(0, |w| w.issued()));
        if E::DTYPE == crate::DType::BF16 {
            d.field("rounding", &self.rounding);
        }
        d.finish_non_exhaustive()
    }
}

impl<R: Rule> Optim<R> {
    /// An optimizer with `rule`'s hyperparameters, refused with [`Error::State`] if one is out
    /// of range (a negative learning rate, a beta outside `[0, 1)`, Nesterov without momentum).
    pub fn new(rule: R) -> Result<Self> {
        rule.validate()?;
        Ok(Optim {
            rule,
            groups: Vec::new(),
            schedule: None,
            steps: 0,
            state: BTreeMap::new(),
            bound: None,
            rounding: Bf16Rounding::default(),
            compensation: BTreeMap::new(),
            window: None,
            _elem: PhantomData,
        })
    }

    /// The checkpoint: rule name, applied steps, state per parameter (on the host, from
    /// whichever device each parameter's state is on).
    pub fn state_dict(&self) -> OptimizerState<R::State> {
        self.base_state()
    }
    /// Restores a checkpoint written by an optimizer with the same rule and hyperparameters
    /// ([`OptimizerState::hyperparameters`]: another learning rate or weight decay is refused
    /// unless that record is cleared). Shapes are checked
    /// against the parameters at the next step (or now, with [`Optim::check_params`]); each
    /// parameter's state moves to its device at its next step, so a checkpoint written on one
    /// device resumes on another.
    pub fn load_state_dict(&mut self, state: OptimizerState<R::State>) -> Result<()> {
        self.load_base_state(state)
    }
}

impl<R: Rule, E: Precision> Optim<R, E> {
    /// Adds a parameter group (checked before the groups added after it), refused with
    /// [`Error::State`] if its learning rate or weight decay is negative or not finite.
    pub fn with_group(mut self, group: ParamGroup) -> Result<Self> {
        for (what, v) in [("learning rate", group.lr), ("weight_decay value", group.weight_decay)] {
            if let Some(v) = v
                && !(v.is_finite() && v >= 0.0)
            {
                return Err(bad_hyper(
                    self.rule.name(),
                    format!("parameter group `{}`: invalid {what}: {v}", group.name),
                ));
            }
        }
        self.groups.push(group);
        Ok(self)
    }
    /// Sets the learning-rate schedule: at the `t`-th applied step (from 0) every group uses its
    /// base rate times `schedule.factor(t)`. Skipped steps do not advance `t`. A step whose
    /// factor is negative or not finite (a closure's NaN) is refused before anything changes.
    pub fn with_schedule(mut self, schedule: impl LrSchedule + 'static) -> Self {
        self.schedule = Some(Arc::new(schedule));
        self
    }
    /// The update rule and its hyperparameters.
    pub fn rule(&self) -> &R {
        &self.rule
    }
    /// The parameter groups.
    pub fn groups(&self) -> &[ParamGroup] {
        &self.groups
    }
    /// The schedule's factor at applied step `t` (1 without a schedule).
    pub fn lr_factor(&self, t: u64) -> f64 {
        self.schedule.as_ref().map_or(1.0, |s| s.factor(t))
    }
    /// The default group's learning rate at applied step `t`.
    pub fn lr_at(&self, t: u64) -> f64 {
        self.rule.lr() * self.lr_factor(t)
    }
    /// The hyperparameters the parameter called `name` gets at applied step `t`.
    pub fn hyper_for(&self, name: &str, t: u64) -> Hyper {
        self.group_hyper(name).at(self.lr_factor(t))
    }
    /// The group's base learning rate and weight decay for the parameter called `name`.
    fn group_hyper(&self, name: &str) -> Hyper {
        let group = self.groups.iter().find(|g| g.matches(name));
        let lr = group.and_then(|g| g.lr).unwrap_or(self.rule.lr());
        let weight_decay = group.and_then(|g| g.weight_decay).unwrap_or(self.rule.weight_decay());
        Hyper { lr, weight_decay }
    }
    /// The state of the parameter called `name`, if it has been stepped on the CPU (state on
    /// another device is read with [`Optim::state_dict`], which copies it to the host).
    pub fn param_state(&self, name: &str) -> Option<&R::State> {
        let on_cpu = self.state.get(name)?.as_any().downcast_ref::<OnDevice<R, Cpu>>()?;
        // The rule's CPU state is its host state (`Vec<f32>`s): the same type.
        (&on_cpu.state as &dyn Any).downcast_ref::<R::State>()
    }
    /// The learning rate of the default group that the next step will use (after the schedule).
    /// Off the CPU, after steps whose outcomes the host has not read, this reads them (a wait
    /// for the device; see the module notes).
    pub fn lr(&self) -> f64 {
        self.lr_at(self.steps())
    }
    /// Steps applied so far (skipped steps are not counted). Off the CPU, after steps whose
    /// outcomes the host has not read, this reads them (a wait for the device).
    pub fn steps(&self) -> u64 {
        self.steps + self.window.as_ref().map_or(0, |w| w.applied())
    }

    /// The checkpoint of the rule's state, with an open window's outcomes counted in (read
    /// from the device) without closing it.
    fn base_state(&self) -> OptimizerState<R::State> {
        let (applied, members) = match &self.window {
            Some(w) => (w.applied(), w.members()),
            None => (0, &[][..]),
        };
        let mut params = BTreeMap::new();
        for (name, slot) in &self.state {
            let host = match members.iter().find(|m| &m.name == name) {
                None => slot.to_host(&self.rule),
                Some(m) if applied == 0 && m.fresh => {
                    if !m.existed {
                        continue;
                    }
                    self.rule.state_to_host(&Cpu, &self.rule.init_state(&Cpu, m.numel))
                }
                Some(_) => {
                    let mut st = self.rule.state_from_host(&Cpu, slot.to_host(&self.rule));
                    self.rule.advance::<Cpu>(&mut st, applied);
                    self.rule.state_to_host(&Cpu, &st)
                }
            };
            params.insert(name.clone(), host);
        }
        OptimizerState {
            kind: self.rule.name().to_string(),
            steps: self.steps + applied,
            params,
            hyperparameters: Some(self.hyperparameters()),
        }
    }
    /// The rule and the groups, as a checkpoint records them ([`OptimizerState::hyperparameters`]).
    fn hyperparameters(&self) -> String {
        format!("{:?}; groups {:?}", self.rule, self.groups)
    }
    /// Closes the open window, if any: reads its outcomes (a wait for the device, unless they
    /// were read already) and counts its applied steps.
    fn close_window(&mut self) {
        let Some(w) = self.window.take() else { return };
        let applied = w.applied();
        for m in w.members() {
            if applied == 0 && m.fresh {
                // Never stepped after all: back to no state, as if the window had not been.
                if m.existed {
                    let fresh = self.rule.state_to_host(&Cpu, &self.rule.init_state(&Cpu, m.numel));
                    self.state.insert(m.name.clone(), host_slot(&self.rule, fresh));
                } else {
                    self.state.remove(&m.name);
                }
            } else if let Some(slot) = self.state.get_mut(&m.name) {
                slot.advance(&self.rule, applied);
            }
        }
        self.steps += applied;
    }
    fn load_base_state(&mut self, state: OptimizerState<R::State>) -> Result<()> {
        if state.kind != self.rule.name() {
            return Err(Error::State {
                context: "Optim::load_state_dict".into(),
                detail: format!("the checkpoint is for optimizer `{}`, this one is `{}`", state.kind, self.rule.name()),
            });
        }
        if let Some(then) = &state.hyperparameters
            && *then != self.hyperparameters()
        {
            return Err(Error::State {
                context: "Optim::load_state_dict".into(),
                detail: format!(
                    "the checkpoint's optimizer was built with {then}, this one with {}: build it with the \
                     checkpoint's hyperparameters (PyTorch's load_state_dict restores them), or set the state's \
                     `hyperparameters` to None to resume with these on purpose",
                    self.hyperparameters()
                ),
            });
        }
        self.steps = state.steps;
        self.state = state.params.into_iter().map(|(n, s)| (n, host_slot(&self.rule, s))).collect();
        // Steps not read yet belong to the run the checkpoint replaces.
        self.window = None;
        // State is keyed by name: the next step (or `bind`) binds the loaded model's parameters.
        self.bound = None;
        Ok(())
    }
    /// Binds this optimizer to `params` (replacing any binding): from now on it steps exactly
    /// these parameters. Without a call, the first step binds. Use it to move an optimizer to
    /// a model on purpose (its state follows the parameter names).
    pub fn bind<D: Device>(&mut self, params: &dyn Params<E, D>) {
        self.bound = Some(params.named_params().into_iter().map(|(n, p)| (n, p.id())).collect());
    }
    /// Checks that `params` are the bound parameters (or binds them, on the first step).
    fn check_bound<D: Device>(&self, params: &[(&str, &Param<E, D>)]) -> Result<()> {
        let Some(bound) = &self.bound else { return Ok(()) };
        let bad = |detail: String| Err(Error::State { context: "optimizer step".into(), detail });
        for (name, p) in params {
            let name = *name;
            match bound.get(name) {
                Some(id) if *id == p.id() => {}
                Some(_) => {
                    return bad(format!(
                        "{} is not the parameter this optimizer is bound to (it has the same name but is \
                         another tensor: a clone of the model, or another model). One optimizer steps one set \
                         of parameters: build one optimizer per model, or `bind` it to this one on purpose",
                        shown(name)
                    ));
                }
                None => {
                    return bad(format!(
                        "{} is not one of the {} parameters this optimizer is bound to (bound at its first \
                         step or by `bind`)",
                        shown(name),
                        bound.len()
                    ));
                }
            }
        }
        // Every name of `params` is bound (above), so a bound name is missing only when there
        // are more bound names than parameters.
        if bound.len() > params.len()
            && let Some(missing) = bound.keys().find(|n| !params.iter().any(|(m, _)| m == *n))
        {
            return bad(format!(
                "this optimizer is bound to a parameter `{missing}` that the model passed to it does not have \
                 (another model?)"
            ));
        }
        Ok(())
    }
    /// Checks that every stored state belongs to a parameter of `params` and fits its size, so a
    /// mismatched checkpoint is refused before training resumes.
    pub fn check_params<D: Device>(&self, params: &dyn Params<E, D>) -> Result<()> {
        let named = params.named_params();
        for (name, st) in &self.state {
            let Some((_, p)) = named.iter().find(|(n, _)| n == name) else {
                return Err(Error::State {
                    context: "optimizer state".into(),
                    detail: format!("state for `{name}`, which is not a parameter of the model"),
                });
            };
            if !st.fits(&self.rule, p.numel()) {
                return Err(Error::State {
                    context: "optimizer state".into(),
                    detail: format!("state for `{name}` does not fit its {} values (shape {:?})", p.numel(), p.shape()),
                });
            }
        }
        for (name, c) in &self.compensation {
            match named.iter().find(|(n, _)| n == name) {
                None => {
                    return Err(Error::State {
                        context: "optimizer state".into(),
                        detail: format!("a Kahan compensation for `{name}`, which is not a parameter of the model"),
                    });
                }
                Some((_, p)) if p.numel() != c.len() => {
                    return Err(Error::State {
                        context: "optimizer state".into(),
                        detail: format!(
                            "the Kahan compensation of `{name}` has {} values, its parameter {} (shape {:?})",
                            c.len(),
                            p.numel(),
                            p.shape()
                        ),
                    });
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Checks a step before anything changes, so an error leaves parameters and state
    /// untouched: the gradients are not those of an unscaled f16 graph, none of them was
    /// already applied to its parameter, `named` are this optimizer's bound parameters, and
    /// each parameter with a gradient has a gradient of its own precision and shape, and state
    /// that fits.
    fn check<D: Device>(&self, named: &[(&str, &Param<E, D>)], grads: &Grads<D>) -> Result<()> {
        let bad = |detail: String| Err(Error::State { context: "optimizer step".into(), detail });
        if let Some(op) = grads.unscaled_f16() {
            return bad(format!(
                "these gradients come from a loss computed through f16 ops (`{op}`) without a GradScaler: f16 \
                 gradients underflow to zero unscaled. Step through one: `scaler.scale(loss).backward()\
                 .unscale().step(&mut optimizer, &mut model).update()` (PyTorch's `torch.amp.GradScaler`; a \
                 scale that never grows: `GradScalerOptions {{ init_scale, growth_interval: i32::MAX, .. }}`). \
                 A loss scaled by hand is not seen as scaled"
            ));
        }
        self.check_bound(named)?;
        self.check_groups(named.iter().map(|(n, _)| *n))?;
        self.check_schedule()?;
        let with_grad: Vec<&(&str, &Param<E, D>)> =
            named.iter().filter(|(_, p)| grads.get_by_id(p.id()).is_some()).collect();
        if !grads.is_empty() && with_grad.is_empty() {
            return bad(format!(
                "none of the {} parameters passed to the optimizer has a gradient in these gradients: they \
                 belong to other parameters (a copy of the model, or another model)",
                named.len()
            ));
        }
        if let Some(id) = grads.first_applied(with_grad.iter().map(|(_, p)| p.id())) {
            let name = with_grad.iter().find(|(_, p)| p.id() == id).map_or("", |(n, _)| *n);
            return bad(format!(
                "these gradients (or a clone of them) were already applied to {}: one backward pass, one step",
                shown(name)
            ));
        }
        if let Some((name, _)) = with_grad.iter().find(|(_, p)| p.updated_at() > grads.made_at()) {
            return bad(format!(
                "these gradients were computed before the last update of {} (a step, `Param::set` or a weight \
                 load): they are for values it no longer has. One backward pass, one step: compute the loss \
                 again",
                shown(name)
            ));
        }
        for (name, param) in with_grad {
            let any = grads.get_by_id(param.id()).expect("filtered on having a gradient");
            let Some(grad) = any.as_tensor::<E>() else {
                return Err(Error::GradPrecision { op: "optimizer step", expected: E::DTYPE, found: any.dtype() });
            };
            if grad.shape() != param.shape() {
                return Err(Error::Shape {
                    op: "optimizer step",
                    detail: format!("the gradient of {} does not have its parameter's shape", shown(name)),
                    shapes: vec![param.shape().to_vec(), grad.shape().to_vec()],
                });
            }
            if let Some(st) = self.state.get(*name)
                && !st.fits(&self.rule, param.numel())
            {
                return bad(format!("the state of {} does not fit its shape {:?}", shown(name), param.shape()));
            }
            if let Some(c) = self.compensation.get(*name)
                && c.len() != param.numel()
            {
                return bad(format!(
                    "the Kahan compensation of {} does not fit its shape {:?}",
                    shown(name),
                    param.shape()
                ));
            }
        }
        Ok(())
    }

    /// Checks that every parameter group gets at least one of the parameters called `names`.
    fn check_groups<'n>(&self, names: impl Iterator<Item = &'n str> + Clone) -> Result<()> {
        if self.groups.is_empty() {
            return Ok(());
        }
        // The group each parameter goes to (the first that matches), computed once.
        let owners: Vec<Option<usize>> = names.clone().map(|n| self.groups.iter().position(|g| g.matches(n))).collect();
        for (i, group) in self.groups.iter().enumerate() {
            if owners.contains(&Some(i)) {
                continue;
            }
            let shadowed_by = names.clone().zip(&owners).find(|(n, _)| group.matches(n)).and_then(|(_, o)| *o);
            let why = match shadowed_by {
                Some(j) => format!("every parameter it matches goes to the earlier group `{}`", self.groups[j].name),
                None => {
                    let some: Vec<&str> = names.clone().take(6).collect();
                    let more = if owners.len() > some.len() { ", ..." } else { "" };
                    format!(
                        "its predicate matches none of the {} parameter names ({}{more})",
                        owners.len(),
                        some.join(", ")
                    )
                }
            };
            return Err(Error::State {
                context: "optimizer step".into(),
                detail: format!(
                    "parameter group `{}` gets no parameter: {why}. Fix its predicate, or drop the group",
                    group.name
                ),
            });
        }
        Ok(())
    }
    /// Checks the schedule's factor at every applied-step count the next step may run at (the
    /// steps already applied, plus any issued on a device and not yet read).
    fn check_schedule(&self) -> Result<()> {
        let Some(schedule) = &self.schedule else { return Ok(()) };
        let pending = self.window.as_ref().map_or(0, |w| w.issued()) as u64;
        let top_lr = self.groups.iter().filter_map(|g| g.lr).fold(self.rule.lr(), f64::max);
        for t in self.steps..=self.steps + pending {
            let f = schedule.factor(t);
            if !(f.is_finite() && f >= 0.0 && (f * top_lr).is_finite()) {
                return Err(Error::State {
                    context: "optimizer step".into(),
                    detail: format!(
                        "the learning-rate schedule gives factor {f} at applied step {t}: a factor must be finite \
                         and at least 0 (and times the learning rate {top_lr}, finite)"
                    ),
                });
            }
        }
        Ok(())
    }

    /// [`Optim::check`] on a model's parameters.
    fn check_params_of<D: Device>(&self, params: &dyn Params<E, D>, grads: &Grads<D>) -> Result<()> {
        let named = params.named_params();
        let view: Vec<(&str, &Param<E, D>)> = named.iter().map(|(n, p)| (n.as_str(), *p)).collect();
        self.check(&view, grads)
    }

    /// [`Optim::check`]s a step and returns the parameters with a gradient, with their
    /// gradients, and the binding to make if this is the first step.
    fn plan<'a, D: Device>(
        &self,
        named: Vec<(String, &'a mut Param<E, D>)>,
        grads: &'a Grads<D>,
    ) -> Result<Plan<'a, E, D>> {
        let view: Vec<(&str, &Param<E, D>)> = named.iter().map(|(n, p)| (n.as_str(), &**p)).collect();
        self.check(&view, grads)?;
        drop(view);
        // The first step binds (later steps were checked against the binding above).
        let binding: Option<BTreeMap<String, TensorId>> =
            self.bound.is_none().then(|| named.iter().map(|(n, p)| (n.clone(), p.id())).collect());
        let mut work = Vec::new();
        for (name, param) in named {
            let Some(grad) = grads.get_by_id(param.id()).and_then(|g| g.as_tensor::<E>()) else { continue };
            work.push((name, param, grad));
        }
        let ids = work.iter().map(|(_, p, _)| p.id()).collect();
        Ok(Plan { work, binding, ids })
    }

    /// Ends an applied step: counts it, binds on the first one, marks `grads` as applied to
    /// the parameters it updated.
    fn finish_step<D: Device>(
        &mut self,
        binding: Option<BTreeMap<String, TensorId>>,
        grads: &Grads<D>,
        ids: Vec<TensorId>,
    ) {
        self.steps += 1;
        if binding.is_some() {
            self.bound = binding;
        }
        grads.mark_applied(ids);
    }
}

/// One parameter a step updates: its name, the parameter and its gradient.
type Work<'a, E, D> = (String, &'a mut Param<E, D>, &'a Tensor<E, D>);

/// What a checked step will update (from [`Optim::plan`]).
struct Plan<'a, E: Precision, D: Device> {
    /// Each parameter with a gradient, by name, with its gradient.
    work: Vec<Work<'a, E, D>>,
    /// The binding to make at the end of the step (the first step only).
    binding: Option<BTreeMap<String, TensorId>>,
    /// The ids of the parameters in `work`.
    ids: Vec<TensorId>,
}

/// A parameter's name for a message (`` `fc1.weight` ``; a bare `Param` has none).
fn shown(name: &str) -> String {
    if name.is_empty() { "this parameter".to_string() } else { format!("`{name}`") }
}

impl<R: Rule, D: Device> Optimizer<f32, D> for Optim<R> {
    fn check_step(&self, params: &dyn Params<f32, D>, grads: &Grads<D>) -> Result<()> {
        self.check_params_of(params, grads)
    }
    fn step(&mut self, params: &mut dyn Params<f32, D>, grads: &Grads<D>) -> Result<()> {
        self.close_window();
        let t = self.steps;
        let Plan { work, binding, ids } = self.plan(params.named_params_mut(), grads)?;
        for (name, param, grad) in work {
            let hyper = self.hyper_for(&name, t);
            let numel = param.numel();
            let dev = param.device().clone();
            let g = grad.contiguous_storage();
            let state = state_on(&self.rule, &mut self.state, &name, &dev, numel);
            self.rule.update(&dev, hyper, param.storage_mut(), &g, state);
        }
        self.finish_step(binding, grads, ids);
        Ok(())
    }
    /// On the CPU the flag is read (host memory: free) and the step is [`Optimizer::step`].
    /// Elsewhere the updates are issued with the flag and the host goes on: the kernels skip
    /// on the device, and the counts are learnt later (see the module notes).
    fn step_unless_inf(
        &mut self,
        params: &mut dyn Params<f32, D>,
        grads: &Grads<D>,
        found_inf: &D::Storage<f32>,
    ) -> Result<()> {
        if D::HOST_MEMORY {
            return step_if_finite(self, params, grads, found_inf);
        }
        let Plan { work, binding, ids } = self.plan(params.named_params_mut(), grads)?;
        let Some(dev) = work.first().map(|(_, p, _)| p.device().clone()) else {
            // No parameter has a gradient: nothing for the device to decide.
            drop(work);
            return self.step(params, grads);
        };
        let joins = self.window.as_ref().is_some_and(|w| {
            w.as_any().is::<WindowOn<D>>()
                && w.issued() < STEPS_PER_READ
                && w.members().iter().map(|m| m.name.as_str()).eq(work.iter().map(|(n, _, _)| n.as_str()))
        });
        if !joins {
            self.close_window();
            let members = work
                .iter()
                .map(|(name, p, _)| {
                    let slot = self.state.get(name);
                    Member {
                        name: name.clone(),
                        numel: p.numel(),
                        existed: slot.is_some(),
                        fresh: slot.is_none_or(|s| s.is_fresh(&self.rule)),
                    }
                })
                .collect();
            self.window = Some(Box::new(WindowOn::new(dev.clone(), members)));
        }
        let mut window = self.window.take().expect("a window is open");
        let w = window.as_any_mut().downcast_mut::<WindowOn<D>>().expect("the window is on this device");
        let at = w.push(found_inf);
        // Row k: k of the window's earlier steps applied, so the schedule is at `steps + k`.
        let factors: Vec<f64> = (0..=at as u64).map(|k| self.lr_factor(self.steps + k)).collect();
        for ((name, param, grad), member) in work.into_iter().zip(&w.members) {
            let base = self.group_hyper(&name);
            let hypers: Vec<Hyper> = factors.iter().map(|&f| base.at(f)).collect();
            let numel = param.numel();
            let g = grad.contiguous_storage();
            let state = state_on(&self.rule, &mut self.state, &name, &dev, numel);
            let outcomes = Outcomes { flags: &w.flags, at };
            self.rule.update_in_window(&dev, &hypers, param.storage_mut(), &g, state, outcomes, member.fresh);
        }
        self.window = Some(window);
        // Bound and these gradients used, as by `step`; the count waits for the window.
        if binding.is_some() {
            self.bound = binding;
        }
        grads.mark_applied(ids);
        Ok(())
    }
    fn lr(&self) -> f64 {
        Optim::lr(self)
    }
    fn steps(&self) -> u64 {
        Optim::steps(self)
    }
}

/// A refused hyperparameter.
pub(crate) fn bad_hyper(rule: &str, detail: String) -> Error {
    Error::State { context: format!("{rule} options"), detail }
}
