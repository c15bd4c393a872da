//! Adam and AdamW (PyTorch's `torch.optim.Adam` / `AdamW`, `amsgrad=False`).

use super::{Hyper, Optim, Rule, bad_hyper};
use crate::backend::{AdamArgs, AdamDecay, Device, Outcomes};
use crate::error::Result;

/// Adam's hyperparameters (PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight
/// decay 0, added to the gradient as L2).
///
/// The update is PyTorch's `_single_tensor_adam`, in this order: `step += 1`; `g += wd·p`;
/// `m.lerp_(g, 1 − β1)`; `v = v·β2 + (1 − β2)·g·g`; with `bc1 = 1 − β1^step`,
/// `bc2 = 1 − β2^step` (f64), `denom = sqrt(v) / sqrt(bc2) + eps`; `p += (−lr/bc1)·m / denom`.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::optim::Adam;
/// let opt = Adam::new(1e-3).betas(0.9, 0.95).build().unwrap();
/// # let _ = opt;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Adam {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
}

impl Default for Adam {
    fn default() -> Self {
        Adam { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0 }
    }
}

/// AdamW's hyperparameters (PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight
/// decay 0.01, decoupled).
///
/// As [`Adam`], except that weight decay is decoupled: `p *= 1 − lr·wd` (computed in f64,
/// then rounded) before the moments, and the gradient is left alone.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 1e-2 }
    }
}

macro_rules! builder {
    ($t:ident) => {
        impl $t {
            /// Defaults with learning rate `lr`.
            pub fn new(lr: f64) -> Self {
                $t { lr, ..Default::default() }
            }
            /// Sets the moment decay rates.
            pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
                self.betas = (beta1, beta2);
                self
            }
            /// Sets eps.
            pub fn eps(mut self, eps: f64) -> Self {
                self.eps = eps;
                self
            }
            /// Sets the weight decay.
            pub fn weight_decay(mut self, weight_decay: f64) -> Self {
                self.weight_decay = weight_decay;
                self
            }
            /// The optimizer (validated).
            pub fn build(self) -> Result<Optim<$t>> {
                Optim::new(self)
            }
        }
    };
}
builder!(Adam);
builder!(AdamW);

/// Adam's state for one parameter (PyTorch's `step`, `exp_avg`, `exp_avg_sq`), the moments
/// `Vec<f32>`s on the CPU and in checkpoints (`V` is the device's [`Device::StateVec`]).
/// Other fields are refused when read, so another rule's state (SGD's) does not pass for
/// Adam's. Non-finite moments (an infinite gradient fed to Adam outside a scaler's checks)
/// are written as strings and read back bit for bit ([`crate::checkpoint::floats`]).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(
    deny_unknown_fields,
    bound(serialize = "V: crate::checkpoint::floats::Floats", deserialize = "V: crate::checkpoint::floats::Floats")
)]
pub struct AdamState<V = Vec<f32>> {
    /// Steps this parameter has taken.
    pub step: u64,
    /// First moment.
    #[serde(with = "crate::checkpoint::floats")]
    pub exp_avg: V,
    /// Second moment.
    #[serde(with = "crate::checkpoint::floats")]
    pub exp_avg_sq: V,
}

fn validate(name: &str, lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) -> Result<()> {
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    if !ok(lr) {
        return Err(bad_hyper(name, format!("invalid learning rate: {lr}")));
    }
    if !ok(eps) {
        return Err(bad_hyper(name, format!("invalid epsilon value: {eps}")));
    }
    if !(0.0..1.0).contains(&betas.0) {
        return Err(bad_hyper(name, format!("invalid beta parameter at index 0: {}", betas.0)));
    }
    if !(0.0..1.0).contains(&betas.1) {
        return Err(bad_hyper(name, format!("invalid beta parameter at index 1: {}", betas.1)));
    }
    if !ok(weight_decay) {
        return Err(bad_hyper(name, format!("invalid weight_decay value: {weight_decay}")));
    }
    Ok(())
}

/// The update's arguments at this parameter's next step (PyTorch's scalars: bias corrections
/// and the step size in f64, as Python floats, then rounded to f32); `decoupled` selects
/// AdamW's weight decay.
fn adam_args(hyper: Hyper, (beta1, beta2): (f64, f64), eps: f64, decoupled: bool, step: u64) -> AdamArgs {
    let step = step as f64;
    // powf, not powi, like Python's `**`.
    let bias_correction1 = 1.0 - beta1.powf(step);
    let bias_correction2 = 1.0 - beta2.powf(step);
    let decay = match (hyper.weight_decay != 0.0, decoupled) {
        (false, _) => AdamDecay::None,
        (true, false) => AdamDecay::L2(hyper.weight_decay as f32),
        (true, true) => AdamDecay::Decoupled((1.0 - hyper.lr * hyper.weight_decay) as f32),
    };
    AdamArgs {
        neg_step_size: (-(hyper.lr / bias_correction1)) as f32,
        bias_correction2_sqrt: bias_correction2.sqrt() as f32,
        // lerp_(grad, 1 - beta1): the weight is rounded to f32.
        lerp_weight: (1.0 - beta1) as f32,
        beta2: beta2 as f32,
        one_minus_beta2: (1.0 - beta2) as f32,
        eps: eps as f32,
        decay,
    }
}

/// The moments, made at the first step.
fn make_moments<D: Device>(dev: &D, n: usize, st: &mut AdamState<D::StateVec>) {
    if dev.state_len(&st.exp_avg) == 0 && n != 0 {
        st.exp_avg = dev.state_zeros(n);
        st.exp_avg_sq = dev.state_zeros(n);
    }
}

macro_rules! adam_rule {
    ($t:ident, $name:literal, $decoupled:expr) => {
        impl Rule for $t {
            type State = AdamState;
            type DeviceState<D: Device> = AdamState<D::StateVec>;
            fn name(&self) -> &'static str {
                $name
            }
            fn lr(&self) -> f64 {
                self.lr
            }
            fn weight_decay(&self) -> f64 {
                self.weight_decay
            }
            fn validate(&self) -> Result<()> {
                validate(stringify!($t), self.lr, self.betas, self.eps, self.weight_decay)
            }
            fn init_state<D: Device>(&self, dev: &D, _numel: usize) -> AdamState<D::StateVec> {
                AdamState { step: 0, exp_avg: dev.state_zeros(0), exp_avg_sq: dev.state_zeros(0) }
            }
            fn state_fits<D: Device>(&self, dev: &D, st: &AdamState<D::StateVec>, numel: usize) -> bool {
                let (m, v) = (dev.state_len(&st.exp_avg), dev.state_len(&st.exp_avg_sq));
                (m == numel && v == numel) || (st.step == 0 && m == 0 && v == 0)
            }
            fn state_to_host<D: Device>(&self, dev: &D, st: &AdamState<D::StateVec>) -> AdamState {
                AdamState {
                    step: st.step,
                    exp_avg: dev.state_to_host(&st.exp_avg),
                    exp_avg_sq: dev.state_to_host(&st.exp_avg_sq),
                }
            }
            fn state_from_host<D: Device>(&self, dev: &D, st: AdamState) -> AdamState<D::StateVec> {
                AdamState {
                    step: st.step,
                    exp_avg: dev.state_from_host(st.exp_avg),
                    exp_avg_sq: dev.state_from_host(st.exp_avg_sq),
                }
            }
            fn update<D: Device>(
                &self,
                dev: &D,
                hyper: Hyper,
                param: &mut D::Storage<f32>,
                grad: &D::Storage<f32>,
                st: &mut AdamState<D::StateVec>,
            ) {
                make_moments(dev, D::len(param), st);
                st.step += 1;
                let args = adam_args(hyper, self.betas, self.eps, $decoupled, st.step);
                dev.adam_update(&[args], param, grad, &mut st.exp_avg, &mut st.exp_avg_sq, None);
            }
            fn update_in_window<D: Device>(
                &self,
                dev: &D,
                hypers: &[Hyper],
                param: &mut D::Storage<f32>,
                grad: &D::Storage<f32>,
                st: &mut AdamState<D::StateVec>,
                outcomes: Outcomes<'_, D::Storage<f32>>,
                _fresh: bool,
            ) {
                make_moments(dev, D::len(param), st);
                // Row k: k of the window's earlier steps applied, so this is step `step + k + 1`.
                let rows: Vec<AdamArgs> = (0u64..)
                    .zip(hypers)
                    .map(|(k, &h)| adam_args(h, self.betas, self.eps, $decoupled, st.step + k + 1))
                    .collect();
                dev.adam_update(&rows, param, grad, &mut st.exp_avg, &mut st.exp_avg_sq, Some(outcomes));
            }
            fn is_fresh<D: Device>(&self, st: &AdamState<D::StateVec>) -> bool {
                st.step == 0
            }
            fn advance<D: Device>(&self, st: &mut AdamState<D::StateVec>, applied: u64) {
                st.step += applied;
            }
        }
    };
}
adam_rule!(Adam, "adam", false);
adam_rule!(AdamW, "adamw", true);
