//! The scalers: [`GradScaler`] (PyTorch's dynamic loss scaling) and [`NoScale`] (bf16/f32).

use std::any::Any;
use std::fmt;

use serde::{Deserialize, Serialize};
use typenum::{B0, B1};

use super::step::{ScaledLoss, TrainStep};
use crate::backend::{Device, ScaleRule, ScaleSlot};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::precision::NeedsLossScaling;
use crate::tensor::Tensor;

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::GradScaler {}
    impl Sealed for super::NoScale {}
}

/// What a scaler does to gradients during `unscale()`.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnscaleMode {
    /// Multiply by the inverse of the scale on the device and check for inf/NaN (one fused
    /// pass).
    Unscale,
    /// Check for inf/NaN only (the scale is the constant 1): `NoScale`, and a disabled
    /// `GradScaler`, which skips a non-finite step as `NoScale` does (PyTorch's disabled
    /// scaler applies it).
    CheckOnly,
}

/// A loss scaler that can drive a [`TrainStep`]: [`GradScaler`] (dynamic, for f16) or
/// [`NoScale`] (the constant 1, for bf16 and f32). Sealed.
pub trait LossScaler: sealed::Sealed {
    /// What a checkpoint keeps: [`GradScalerState`] (PyTorch's keys) for a [`GradScaler`],
    /// `()` for [`NoScale`] (serialised as JSON `null`).
    type State: Clone + std::fmt::Debug + PartialEq + Serialize + serde::de::DeserializeOwned;
    /// The checkpoint (PyTorch's `scaler.state_dict()`).
    fn state_dict(&self) -> Self::State;
    /// Restores a checkpoint, refused with [`Error::State`] when a value is out of range.
    fn load_state_dict(&mut self, state: &Self::State) -> Result<()>;
    /// The scale the next `scale(loss)` multiplies the loss by.
    fn get_scale(&self) -> f32;
    /// Starts an iteration: the loss times the current scale. The loss is taken by value, so
    /// its forward graph is freed by `.backward()` and the step updates parameters in place.
    /// The returned step borrows the scaler until `.update()` ends the iteration. Errs if the
    /// loss was computed through f16 ops and this scaler does not scale ([`NoScale`], a
    /// disabled [`GradScaler`]): f16 gradients underflow without loss scaling.
    fn try_scale<'s, D: Device>(&'s mut self, loss: Tensor<f32, D>) -> Result<ScaledLoss<'s, Self, D>>
    where
        Self: Sized,
    {
        TrainStep::start(self, loss)
    }
    /// [`LossScaler::try_scale`], panicking with its error.
    #[track_caller]
    fn scale<'s, D: Device>(&'s mut self, loss: Tensor<f32, D>) -> ScaledLoss<'s, Self, D>
    where
        Self: Sized,
    {
        crate::error::or_panic(TrainStep::start(self, loss))
    }
    /// Whether this scaler multiplies the loss (an enabled [`GradScaler`]). Such a scaler
    /// refuses f16 gradients at `unscale` (as PyTorch's); one that does not refuses a loss
    /// computed through f16 ops at `scale`.
    #[doc(hidden)]
    fn scales_loss(&self) -> bool;
    #[doc(hidden)]
    fn unscale_mode(&self) -> UnscaleMode;
    /// The state vector on `dev` ([`ScaleSlot`]), moved there first if it is elsewhere;
    /// `None` for a scaler that does not scale.
    #[doc(hidden)]
    fn device_state<D: Device>(&mut self, dev: &D) -> Option<&D::Storage<f64>>;
    /// Applies the end-of-iteration rule on `dev`, the step counting as an overflow when an
    /// element of `found_inf` is nonzero; `Some(s)` sets the scale to `s` instead (PyTorch's
    /// `update(new_scale)`). Returns a copy of the state after the update (for the report).
    #[doc(hidden)]
    fn finish<D: Device>(
        &mut self,
        dev: &D,
        found_inf: &D::Storage<f32>,
        new_scale: Option<f32>,
    ) -> Result<Option<D::Storage<f64>>>;
}

// ---- GradScaler ---------------------------------------------------------------------------

/// Options of a [`GradScaler`]. [`Default`] is PyTorch's `torch.amp.GradScaler()`; the last four
/// options come from Apex, DeepSpeed and Megatron and are off by default.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::scaler::{GradScaler, GradScalerOptions};
/// let scaler = GradScaler::with_options(GradScalerOptions {
///     growth_interval: 1000,
///     min_scale: Some(1.0),
///     error_at_min_scale: true,
///     ..Default::default()
/// })
/// .unwrap();
/// assert_eq!(scaler.get_scale(), 65536.0);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScalerOptions {
    /// Initial scale (PyTorch: 2^16). Finite and positive.
    pub init_scale: f32,
    /// Factor applied after `growth_interval` steps in a row without overflow (PyTorch: 2). > 1.
    pub growth_factor: f64,
    /// Factor applied after an overflow (PyTorch: 0.5). In (0, 1).
    pub backoff_factor: f64,
    /// Steps in a row without overflow before the scale grows (PyTorch: 2000). >= 1.
    pub growth_interval: i32,
    /// When false, `scale` leaves the loss as is, `get_scale()` is 1 and `unscale` only checks
    /// for inf/NaN: a step with one is skipped, as with `NoScale` (PyTorch's `enabled=False`
    /// takes it), and the scale stays 1.
    pub enabled: bool,
    /// Floor: backing off never takes the scale below this (DeepSpeed and Megatron use 1.0).
    pub min_scale: Option<f32>,
    /// Ceiling: growing never takes the scale above this (Apex uses 2^24).
    pub max_scale: Option<f32>,
    /// Overflows tolerated before backing off (DeepSpeed and Megatron default to 2; 1 is
    /// PyTorch's behaviour). The count is reset when the scale grows, as in Megatron. Every
    /// overflowing step is still skipped.
    pub hysteresis: i32,
    /// With `min_scale`: [`GradScalerOptions::collapse_after`] overflows in a row while the
    /// scale is already at the floor make `update()` return an error instead of continuing
    /// with a collapsed scale (DeepSpeed's `raise_error_at_min_scale`, which errs at the first).
    pub error_at_min_scale: bool,
    /// With `error_at_min_scale`: how many overflowing steps in a row at the floor count as a
    /// collapse (default 20). A good step resets the count, so overflows scattered among good
    /// steps (a few bad batches) never stop a run; only a scale that stays at its floor with
    /// every step overflowing does. 1 errs at the first overflow at the floor, as DeepSpeed.
    /// At least 1. The count is not checkpointed: a resumed run starts it at 0.
    #[serde(default = "default_collapse_after")]
    pub collapse_after: u32,
}

fn default_collapse_after() -> u32 {
    20
}

impl Default for GradScalerOptions {
    fn default() -> Self {
        GradScalerOptions {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
            min_scale: None,
            max_scale: None,
            hysteresis: 1,
            error_at_min_scale: false,
            collapse_after: default_collapse_after(),
        }
    }
}

impl GradScalerOptions {
    fn validate(&self) -> Result<()> {
        let bad = |detail: String| Err(Error::State { context: "GradScaler options".into(), detail });
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(format!("init_scale must be finite and positive, got {}", self.init_scale));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(format!("growth_factor must be finite and greater than 1, got {}", self.growth_factor));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(format!("backoff_factor must be between 0 and 1 (exclusive), got {}", self.backoff_factor));
        }
        if self.growth_interval < 1 {
            return bad(format!("growth_interval must be at least 1, got {}", self.growth_interval));
        }
        if self.hysteresis < 1 {
            return bad(format!(
                "hysteresis must be at least 1 (1 backs off at every overflow), got {}",
                self.hysteresis
            ));
        }
        for (name, v) in [("min_scale", self.min_scale), ("max_scale", self.max_scale)] {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return bad(format!("{name} must be finite and positive, got {v}"));
            }
        }
        if let (Some(lo), Some(hi)) = (self.min_scale, self.max_scale)
            && lo > hi
        {
            return bad(format!("min_scale {lo} is above max_scale {hi}"));
        }
        if self.collapse_after < 1 {
            return bad("collapse_after must be at least 1 (1 errs at the first overflow at the floor)".into());
        }
        if self.error_at_min_scale && self.min_scale.is_none() {
            return bad("error_at_min_scale needs a floor: set min_scale too".into());
        }
        Ok(())
    }
    fn check_in_range(&self, scale: f32, what: &str) -> Result<()> {
        let out = self.min_scale.is_some_and(|lo| scale < lo) || self.max_scale.is_some_and(|hi| scale > hi);
        if out {
            return Err(Error::State {
                context: "GradScaler".into(),
                detail: format!(
                    "{what} {scale} is outside [min_scale, max_scale] = [{:?}, {:?}]",
                    self.min_scale, self.max_scale
                ),
            });
        }
        Ok(())
    }
}

/// A scaler checkpoint with exactly PyTorch's keys (`scale`, `growth_factor`,
/// `backoff_factor`, `growth_interval`, `_growth_tracker`), so it reads and writes the same
/// JSON as `torch.amp.GradScaler.state_dict()`. The hysteresis count is written only when the
/// `hysteresis` option is above 1 (key `_hysteresis_tracker`). Non-finite values are written
/// as strings and read back bit for bit ([`crate::checkpoint::floats`]), so such a state
/// saves and loads and [`GradScaler::load_state_dict`] refuses it for what it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    /// The current scale.
    #[serde(with = "crate::checkpoint::floats")]
    pub scale: f32,
    /// The growth factor.
    #[serde(with = "crate::checkpoint::floats")]
    pub growth_factor: f64,
    /// The backoff factor.
    #[serde(with = "crate::checkpoint::floats")]
    pub backoff_factor: f64,
    /// The growth interval.
    pub growth_interval: i32,
    /// Steps in a row without overflow since the last growth or overflow.
    #[serde(rename = "_growth_tracker")]
    pub growth_tracker: i32,
    /// Overflows still tolerated before backing off (only with `hysteresis` > 1).
    #[serde(rename = "_hysteresis_tracker", default, skip_serializing_if = "Option::is_none")]
    pub hysteresis_tracker: Option<i32>,
}

/// How often (in updates) a scaler on a device whose memory is not the host's reads its state
/// back to check for a collapsed scale (`error_at_min_scale`): a read waits for the device, so
/// it is not done at every step. On the CPU the check runs at every update.
pub const COLLAPSE_CHECK_EVERY: u32 = 32;

/// Dynamic loss scaling, exactly as PyTorch's `torch.amp.GradScaler` (rules in the module docs),
/// with optional floor, ceiling and hysteresis and an error on collapse.
///
/// The scale and its trackers live on the device the scaler steps on (moved there at the
/// first `scale(loss)` on it, as PyTorch keeps `_scale` on the gradients' device), and are
/// updated there: [`GradScaler::get_scale`], [`GradScaler::growth_tracker`] and
/// [`GradScaler::state_dict`] read them back, which on a GPU waits for the queued work.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::scaler::GradScaler;
/// let scaler = GradScaler::new();
/// assert_eq!(scaler.get_scale(), 65536.0);
/// ```
pub struct GradScaler {
    opts: GradScalerOptions,
    /// The state ([`ScaleSlot`]) while it is on no device (before the first step, after a
    /// load).
    host: [f64; ScaleSlot::LEN],
    /// The state on the device of the last step, if any.
    on_device: Option<OnDevice>,
}

/// A scaler's state on some device `D` (a [`DeviceState<D>`] behind `Any`), with the function
/// that reads it back.
struct OnDevice {
    state: Box<dyn Any + Send + Sync>,
    read: fn(&(dyn Any + Send + Sync)) -> [f64; ScaleSlot::LEN],
}

struct DeviceState<D: Device> {
    dev: D,
    /// The device's name, to tell two devices of one type apart.
    name: String,
    state: D::Storage<f64>,
    /// Updates since the collapse check last read the state.
    unchecked: u32,
}

fn read_state<D: Device>(any: &(dyn Any + Send + Sync)) -> [f64; ScaleSlot::LEN] {
    let st = any.downcast_ref::<DeviceState<D>>().expect("the reader matches the state's device type");
    let v = st.dev.to_host(&st.state, &Layout::contiguous(&[ScaleSlot::LEN]));
    std::array::from_fn(|i| v[i])
}

impl Clone for GradScaler {
    /// A scaler with the same options and state, on no device (reads the state back).
    fn clone(&self) -> Self {
        GradScaler { opts: self.opts.clone(), host: self.snapshot(), on_device: None }
    }
}

impl fmt::Debug for GradScaler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("GradScaler");
        d.field("opts", &self.opts);
        match &self.on_device {
            // Printing does not wait for a device.
            Some(_) => d.field("state", &"<on the device>"),
            None => d
                .field("scale", &self.host[ScaleSlot::Scale as usize])
                .field("growth_tracker", &self.host[ScaleSlot::GrowthTracker as usize]),
        };
        d.finish()
    }
}

impl Default for GradScaler {
    fn default() -> Self {
        Self::new()
    }
}

impl GradScaler {
    /// PyTorch's defaults: scale 65536, growth 2 every 2000 good steps, backoff 0.5.
    pub fn new() -> Self {
        Self::with_options(GradScalerOptions::default()).expect("the default options are valid")
    }
    /// A scaler with `opts`, refused with [`Error::State`] if an option is out of its range
    /// (for example `growth_factor <= 1` or `backoff_factor >= 1`).
    pub fn with_options(opts: GradScalerOptions) -> Result<Self> {
        opts.validate()?;
        opts.check_in_range(opts.init_scale, "init_scale")?;
        let mut host = [0.0; ScaleSlot::LEN];
        host[ScaleSlot::Scale as usize] = opts.init_scale as f64;
        host[ScaleSlot::HysteresisTracker as usize] = opts.hysteresis as f64;
        Ok(GradScaler { host, on_device: None, opts })
    }
    /// A disabled scaler (PyTorch's `enabled=False`): no scaling, and, like [`NoScale`], a
    /// step whose gradients hold an inf or NaN is skipped (PyTorch's disabled scaler applies
    /// it, writing NaN into the weights). Its scale stays 1.
    pub fn disabled() -> Self {
        Self::with_options(GradScalerOptions { enabled: false, ..Default::default() }).expect("valid")
    }
    /// The options this scaler was built with.
    pub fn options(&self) -> &GradScalerOptions {
        &self.opts
    }
    /// Whether scaling is on.
    pub fn is_enabled(&self) -> bool {
        self.opts.enabled
    }
    /// The state vector, read back from the device it is on.
    fn snapshot(&self) -> [f64; ScaleSlot::LEN] {
        match &self.on_device {
            Some(d) => (d.read)(&*d.state),
            None => self.host,
        }
    }
    /// The current scale (1.0 when disabled, as PyTorch's `get_scale()`). Reads it from the
    /// device the scaler steps on.
    pub fn get_scale(&self) -> f32 {
        if self.opts.enabled { self.snapshot()[ScaleSlot::Scale as usize] as f32 } else { 1.0 }
    }
    /// Steps in a row without overflow since the last growth or overflow (read from the
    /// device).
    pub fn growth_tracker(&self) -> i32 {
        self.snapshot()[ScaleSlot::GrowthTracker as usize] as i32
    }
    /// Starts an iteration: the loss (taken by value, so its graph is freed by `.backward()`)
    /// times the current scale (see [`TrainStep`]). A disabled scaler refuses a loss computed
    /// through f16 ops; see [`LossScaler::try_scale`].
    #[track_caller]
    pub fn scale<D: Device>(&mut self, loss: Tensor<f32, D>) -> ScaledLoss<'_, GradScaler, D> {
        LossScaler::scale(self, loss)
    }
    /// The checkpoint (PyTorch's keys), read from the device.
    pub fn state_dict(&self) -> GradScalerState {
        let s = self.snapshot();
        GradScalerState {
            scale: s[ScaleSlot::Scale as usize] as f32,
            growth_factor: self.opts.growth_factor,
            backoff_factor: self.opts.backoff_factor,
            growth_interval: self.opts.growth_interval,
            growth_tracker: s[ScaleSlot::GrowthTracker as usize] as i32,
            hysteresis_tracker: (self.opts.hysteresis > 1).then_some(s[ScaleSlot::HysteresisTracker as usize] as i32),
        }
    }
    /// Restores a checkpoint (also before the first step: the next `scale()` uses the loaded
    /// scale and tracker). The factors and interval are validated like the options.
    pub fn load_state_dict(&mut self, state: &GradScalerState) -> Result<()> {
        let opts = GradScalerOptions {
            init_scale: state.scale,
            growth_factor: state.growth_factor,
            backoff_factor: state.backoff_factor,
            growth_interval: state.growth_interval,
            ..self.opts.clone()
        };
        opts.validate().map_err(|e| match e {
            Error::State { detail, .. } => Error::State { context: "GradScaler::load_state_dict".into(), detail },
            other => other,
        })?;
        opts.check_in_range(state.scale, "the checkpoint's scale")?;
        if state.growth_tracker < 0 {
            return Err(Error::State {
                context: "GradScaler::load_state_dict".into(),
                detail: format!("_growth_tracker must not be negative, got {}", state.growth_tracker),
            });
        }
        // The tracker returns to 0 when it reaches the interval, so it is always below it.
        if state.growth_tracker >= state.growth_interval {
            return Err(Error::State {
                context: "GradScaler::load_state_dict".into(),
                detail: format!(
                    "_growth_tracker {} must be below growth_interval {} (it restarts at 0 when it reaches it)",
                    state.growth_tracker, state.growth_interval
                ),
            });
        }
        if let Some(h) = state.hysteresis_tracker
            && !(0..=self.opts.hysteresis).contains(&h)
        {
            return Err(Error::State {
                context: "GradScaler::load_state_dict".into(),
                detail: format!(
                    "_hysteresis_tracker {h} is outside 0..={}, the hysteresis option",
                    self.opts.hysteresis
                ),
            });
        }
        self.opts.growth_factor = state.growth_factor;
        self.opts.backoff_factor = state.backoff_factor;
        self.opts.growth_interval = state.growth_interval;
        let mut host = [0.0; ScaleSlot::LEN];
        host[ScaleSlot::Scale as usize] = state.scale as f64;
        host[ScaleSlot::GrowthTracker as usize] = state.growth_tracker as f64;
        host[ScaleSlot::HysteresisTracker as usize] = state.hysteresis_tracker.unwrap_or(self.opts.hysteresis) as f64;
        // The next step uploads it to its device.
        self.host = host;
        self.on_device = None;
        Ok(())
    }

    fn rule(&self, set_scale: Option<f32>) -> ScaleRule {
        ScaleRule {
            growth_factor: self.opts.growth_factor,
            backoff_factor: self.opts.backoff_factor,
            growth_interval: self.opts.growth_interval,
            min_scale: self.opts.min_scale,
            max_scale: self.opts.max_scale,
            hysteresis: self.opts.hysteresis,
            set_scale,
        }
    }

    /// The state on `dev`: moved there (read back from another device first) if it is not.
    fn state_on<D: Device>(&mut self, dev: &D) -> &mut DeviceState<D> {
        let here = self
            .on_device
            .as_ref()
            .and_then(|d| d.state.downcast_ref::<DeviceState<D>>())
            .is_some_and(|st| st.name == dev.name());
        if !here {
            let host = self.snapshot();
            let state =
                DeviceState { dev: dev.clone(), name: dev.name(), state: dev.from_host(host.to_vec()), unchecked: 0 };
            self.on_device = Some(OnDevice { state: Box::new(state), read: read_state::<D> });
        }
        let d = self.on_device.as_mut().expect("just placed");
        d.state.downcast_mut::<DeviceState<D>>().expect("the state is on this device")
    }

    /// The collapse error, when `error_at_min_scale` is set and the state shows
    /// `collapse_after` overflows in a row at the floor.
    fn check_collapse(&self, s: &[f64; ScaleSlot::LEN]) -> Result<()> {
        let at_floor = s[ScaleSlot::OverflowsAtFloor as usize];
        match self.opts.min_scale {
            Some(floor) if self.opts.error_at_min_scale && at_floor >= self.opts.collapse_after as f64 => {
                Err(Error::State {
                    context: "GradScaler::update".into(),
                    detail: format!(
                        "the loss scale collapsed: {at_floor} steps in a row overflowed with the scale already at its \
                         floor min_scale = {floor} (collapse_after = {}; {} overflowing steps in a row in all, \
                         every one skipped, so the weights did not change). The gradients are inf or NaN \
                         whatever the scale: look for NaN/inf in the input data or the loss, lower the \
                         learning rate, or train in bf16, whose range does not overflow",
                        self.opts.collapse_after,
                        s[ScaleSlot::OverflowsInARow as usize]
                    ),
                })
            }
            _ => Ok(()),
        }
    }
}

impl LossScaler for GradScaler {
    type State = GradScalerState;
    fn state_dict(&self) -> GradScalerState {
        GradScaler::state_dict(self)
    }
    fn load_state_dict(&mut self, state: &GradScalerState) -> Result<()> {
        GradScaler::load_state_dict(self, state)
    }
    fn get_scale(&self) -> f32 {
        GradScaler::get_scale(self)
    }
    fn unscale_mode(&self) -> UnscaleMode {
        if self.opts.enabled { UnscaleMode::Unscale } else { UnscaleMode::CheckOnly }
    }
    fn scales_loss(&self) -> bool {
        self.opts.enabled
    }
    fn device_state<D: Device>(&mut self, dev: &D) -> Option<&D::Storage<f64>> {
        if !self.opts.enabled {
            return None;
        }
        Some(&self.state_on(dev).state)
    }
    fn finish<D: Device>(
        &mut self,
        dev: &D,
        found_inf: &D::Storage<f32>,
        new_scale: Option<f32>,
    ) -> Result<Option<D::Storage<f64>>> {
        if !self.opts.enabled {
            return Ok(None);
        }
        if let Some(s) = new_scale
            && !(s.is_finite() && s > 0.0)
        {
            return Err(Error::State {
                context: "update_to".into(),
                detail: format!("the new scale must be finite and positive, got {s}"),
            });
        }
        let rule = self.rule(new_scale);
        let check = self.opts.error_at_min_scale && new_scale.is_none();
        let st = self.state_on(dev);
        dev.update_scale(&mut st.state, found_inf, &rule);
        let copy = dev.contiguous(&st.state, &Layout::contiguous(&[ScaleSlot::LEN]));
        st.unchecked += 1;
        if check && (D::HOST_MEMORY || st.unchecked >= COLLAPSE_CHECK_EVERY) {
            st.unchecked = 0;
            let s = self.snapshot();
            self.check_collapse(&s)?;
        }
        Ok(Some(copy))
    }
}

// ---- NoScale ------------------------------------------------------------------------------

/// The scaler for bf16 (and f32) training: the scale is the constant 1 and no arithmetic is
/// done on the loss or the gradients, but `unscale()` still checks them for inf/NaN, and a
/// step whose gradients are not finite is skipped (a departure from PyTorch, which has no
/// scaler for bf16 and would write the NaN into the weights).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoScale;

impl NoScale {
    /// The no-op scaler.
    pub fn new() -> Self {
        NoScale
    }
    /// Always 1.
    pub fn get_scale(&self) -> f32 {
        1.0
    }
    /// Starts an iteration (the loss, taken by value, is used as is; see [`TrainStep`]).
    /// Panics if the loss was computed through f16 ops: f16 needs a [`GradScaler`].
    #[track_caller]
    pub fn scale<D: Device>(&mut self, loss: Tensor<f32, D>) -> ScaledLoss<'_, NoScale, D> {
        LossScaler::scale(self, loss)
    }
}

impl LossScaler for NoScale {
    /// Nothing to keep: the scale is the constant 1.
    type State = ();
    fn state_dict(&self) {}
    fn load_state_dict(&mut self, _: &()) -> Result<()> {
        Ok(())
    }
    fn get_scale(&self) -> f32 {
        1.0
    }
    fn unscale_mode(&self) -> UnscaleMode {
        UnscaleMode::CheckOnly
    }
    fn scales_loss(&self) -> bool {
        false
    }
    fn device_state<D: Device>(&mut self, _dev: &D) -> Option<&D::Storage<f64>> {
        None
    }
    fn finish<D: Device>(&mut self, _: &D, _: &D::Storage<f32>, _: Option<f32>) -> Result<Option<D::Storage<f64>>> {
        Ok(None)
    }
}

// ---- choosing by precision ----------------------------------------------------------------

/// Maps "needs loss scaling" (a type-level bit) to a scaler type.
pub trait SelectScaler {
    /// The scaler for that answer.
    type Scaler: LossScaler + Default;
}
impl SelectScaler for B1 {
    type Scaler = GradScaler;
}
impl SelectScaler for B0 {
    type Scaler = NoScale;
}

/// The scaler a model computing in precision `P` needs, chosen by type from `P`'s exponent
/// width: [`GradScaler`] for f16, [`NoScale`] for bf16 and f32.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::scaler::{GradScaler, NoScale, ScalerFor};
/// use amp::{bf16, f16};
/// let a: GradScaler = ScalerFor::<f16>::default();
/// let b: NoScale = ScalerFor::<bf16>::default();
/// assert_eq!((a.get_scale(), b.get_scale()), (65536.0, 1.0));
/// ```
pub type ScalerFor<P> = <NeedsLossScaling<P> as SelectScaler>::Scaler;
