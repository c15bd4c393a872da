//! SGD with momentum, dampening, Nesterov momentum and weight decay (PyTorch's `torch.optim.SGD`).

use super::{Hyper, Optim, Rule, bad_hyper};
use crate::backend::{Device, Outcomes, SgdArgs};
use crate::error::Result;

/// SGD's hyperparameters (PyTorch's names and defaults: lr 1e-3, no momentum, no weight decay).
///
/// The update, per element and in f32, is PyTorch's `_single_tensor_sgd`:
/// `g += wd·p`; `buf = g` at the first step, else `buf = buf·momentum + (1 − dampening)·g`;
/// `g = g + momentum·buf` (Nesterov) or `g = buf`; `p −= lr·g`.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::optim::Sgd;
/// let opt = Sgd::new(0.1).momentum(0.9).nesterov(true).weight_decay(1e-4).build().unwrap();
/// # let _ = opt;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD, no state).
    pub momentum: f64,
    /// Dampening of the gradient in the momentum buffer.
    pub dampening: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        Sgd { lr, ..Default::default() }
    }
    /// Sets the momentum factor.
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }
    /// Sets the dampening.
    pub fn dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }
    /// Sets the weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Turns Nesterov momentum on or off.
    pub fn nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }
    /// The optimizer (validated).
    pub fn build(self) -> Result<Optim<Sgd>> {
        Optim::new(self)
    }
}

/// SGD's state for one parameter: the momentum buffer, created at its first step (absent
/// without momentum), a `Vec<f32>` on the CPU and in checkpoints (`V` is the device's
/// [`Device::StateVec`]). Other fields are refused when read, so another rule's state
/// (Adam's) does not pass for SGD's. Non-finite values are written as strings and read back
/// bit for bit ([`crate::checkpoint::floats`]).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(
    deny_unknown_fields,
    bound(serialize = "V: crate::checkpoint::floats::Floats", deserialize = "V: crate::checkpoint::floats::Floats")
)]
pub struct SgdState<V = Vec<f32>> {
    /// `momentum_buffer` in PyTorch.
    #[serde(with = "crate::checkpoint::floats", default)]
    pub momentum_buffer: Option<V>,
}

impl Rule for Sgd {
    type State = SgdState;
    type DeviceState<D: Device> = SgdState<D::StateVec>;
    fn name(&self) -> &'static str {
        "sgd"
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn weight_decay(&self) -> f64 {
        self.weight_decay
    }
    fn validate(&self) -> Result<()> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !ok(self.lr) {
            return Err(bad_hyper("SGD", format!("invalid learning rate: {}", self.lr)));
        }
        if !ok(self.momentum) {
            return Err(bad_hyper("SGD", format!("invalid momentum value: {}", self.momentum)));
        }
        if !ok(self.weight_decay) {
            return Err(bad_hyper("SGD", format!("invalid weight_decay value: {}", self.weight_decay)));
        }
        if !self.dampening.is_finite() {
            return Err(bad_hyper("SGD", format!("invalid dampening value: {}", self.dampening)));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(bad_hyper("SGD", "Nesterov momentum requires a momentum and zero dampening".into()));
        }
        Ok(())
    }
    fn init_state<D: Device>(&self, _dev: &D, _numel: usize) -> SgdState<D::StateVec> {
        SgdState { momentum_buffer: None }
    }
    fn state_fits<D: Device>(&self, dev: &D, state: &SgdState<D::StateVec>, numel: usize) -> bool {
        state.momentum_buffer.as_ref().is_none_or(|b| dev.state_len(b) == numel)
    }
    fn state_to_host<D: Device>(&self, dev: &D, state: &SgdState<D::StateVec>) -> SgdState {
        SgdState { momentum_buffer: state.momentum_buffer.as_ref().map(|b| dev.state_to_host(b)) }
    }
    fn state_from_host<D: Device>(&self, dev: &D, state: SgdState) -> SgdState<D::StateVec> {
        SgdState { momentum_buffer: state.momentum_buffer.map(|b| dev.state_from_host(b)) }
    }
    fn update<D: Device>(
        &self,
        dev: &D,
        hyper: Hyper,
        param: &mut D::Storage<f32>,
        grad: &D::Storage<f32>,
        state: &mut SgdState<D::StateVec>,
    ) {
        let first = state.momentum_buffer.is_none();
        let args = self.args(hyper, first);
        if self.momentum == 0.0 {
            dev.sgd_update(&[args], param, grad, None, None);
            return;
        }
        let buf = state.momentum_buffer.get_or_insert_with(|| dev.state_zeros(D::len(param)));
        dev.sgd_update(&[args], param, grad, Some(buf), None);
    }
    fn update_in_window<D: Device>(
        &self,
        dev: &D,
        hypers: &[Hyper],
        param: &mut D::Storage<f32>,
        grad: &D::Storage<f32>,
        state: &mut SgdState<D::StateVec>,
        outcomes: Outcomes<'_, D::Storage<f32>>,
        fresh: bool,
    ) {
        // A buffer that did not exist when the window opened is still PyTorch's `None` until
        // one of the window's steps is applied: the first applied step is row 0.
        let rows: Vec<SgdArgs> = hypers.iter().enumerate().map(|(k, &h)| self.args(h, fresh && k == 0)).collect();
        if self.momentum == 0.0 {
            dev.sgd_update(&rows, param, grad, None, Some(outcomes));
            return;
        }
        let buf = state.momentum_buffer.get_or_insert_with(|| dev.state_zeros(D::len(param)));
        dev.sgd_update(&rows, param, grad, Some(buf), Some(outcomes));
    }
    fn is_fresh<D: Device>(&self, state: &SgdState<D::StateVec>) -> bool {
        state.momentum_buffer.is_none()
    }
}

impl Sgd {
    /// The kernel's arguments at `hyper` (scalars rounded to f32 where PyTorch's kernels take
    /// them as f32); `first`: the momentum buffer's first step.
    fn args(&self, hyper: Hyper, first: bool) -> SgdArgs {
        SgdArgs {
            neg_lr: (-hyper.lr) as f32,
            weight_decay: (hyper.weight_decay != 0.0).then_some(hyper.weight_decay as f32),
            momentum: self.momentum as f32,
            keep: (1.0 - self.dampening) as f32,
            nesterov: self.nesterov,
            first: first && self.momentum != 0.0,
        }
    }
}
