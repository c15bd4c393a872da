//! SGD with momentum, dampening, Nesterov momentum and weight decay (PyTorch's `torch.optim.SGD`).

use super::{Hyper, Optim, Rule, bad_hyper, for_chunks};
use crate::error::Result;

/// SGD's hyperparameters (PyTorch's names and defaults: lr 1e-3, no momentum, no weight decay).
///
/// The update, per element and in f32, is PyTorch's `_single_tensor_sgd`:
/// `g += wd·p`; `buf = g` at the first step, else `buf = buf·momentum + (1 − dampening)·g`;
/// `g = g + momentum·buf` (Nesterov) or `g = buf`; `p −= lr·g`.
///
/// ```
/// use amp_core::optim::Sgd;
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
/// without momentum). Other fields are refused when read, so another rule's state (Adam's)
/// does not pass for SGD's.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SgdState {
    /// `momentum_buffer` in PyTorch.
    pub momentum_buffer: Option<Vec<f32>>,
}

impl Rule for Sgd {
    type State = SgdState;
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
    fn init_state(&self, _numel: usize) -> SgdState {
        SgdState { momentum_buffer: None }
    }
    fn state_fits(&self, state: &SgdState, numel: usize) -> bool {
        state.momentum_buffer.as_ref().is_none_or(|b| b.len() == numel)
    }
    fn update(&self, hyper: Hyper, param: &mut [f32], grad: &[f32], state: &mut SgdState) {
        // Scalars rounded to f32 where PyTorch's kernels take them as f32.
        let wd = hyper.weight_decay as f32;
        let neg_lr = (-hyper.lr) as f32;
        let decay = hyper.weight_decay != 0.0;
        if self.momentum == 0.0 {
            for_chunks(param, grad, &mut [], &mut [], |p, g, _, _| {
                for (p, &g) in p.iter_mut().zip(g) {
                    // grad.add(param, alpha=wd): fmadd(param, wd, grad)
                    let g = if decay { p.mul_add(wd, g) } else { g };
                    // param.add_(grad, alpha=-lr): fmadd(grad, -lr, param)
                    *p = g.mul_add(neg_lr, *p);
                }
            });
            return;
        }
        let m = self.momentum as f32;
        let keep = (1.0 - self.dampening) as f32;
        let nesterov = self.nesterov;
        let first = state.momentum_buffer.is_none();
        let buf = state.momentum_buffer.get_or_insert_with(|| vec![0.0; param.len()]);
        for_chunks(param, grad, buf, &mut [], |p, g, buf, _| {
            for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
                let g = if decay { p.mul_add(wd, g) } else { g };
                // First step: buf = clone(grad); then buf.mul_(momentum).add_(grad, alpha=1-dampening).
                *b = if first { g } else { g.mul_add(keep, *b * m) };
                // Nesterov: grad.add(buf, alpha=momentum); otherwise grad = buf.
                let d = if nesterov { b.mul_add(m, g) } else { *b };
                *p = d.mul_add(neg_lr, *p);
            }
        });
    }
}
