//! Adam and AdamW (PyTorch's `torch.optim.Adam` / `AdamW`, `amsgrad=False`).

use super::{Hyper, Optim, Rule, bad_hyper, for_chunks};
use crate::error::Result;

/// Adam's hyperparameters (PyTorch's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight
/// decay 0, added to the gradient as L2).
///
/// The update is PyTorch's `_single_tensor_adam`, in this order: `step += 1`; `g += wd·p`;
/// `m.lerp_(g, 1 − β1)`; `v = v·β2 + (1 − β2)·g·g`; with `bc1 = 1 − β1^step`,
/// `bc2 = 1 − β2^step` (f64), `denom = sqrt(v) / sqrt(bc2) + eps`; `p += (−lr/bc1)·m / denom`.
///
/// ```
/// use amp_core::optim::Adam;
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

/// Adam's state for one parameter (PyTorch's `step`, `exp_avg`, `exp_avg_sq`). Other fields
/// are refused when read, so another rule's state (SGD's) does not pass for Adam's.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamState {
    /// Steps this parameter has taken.
    pub step: u64,
    /// First moment.
    pub exp_avg: Vec<f32>,
    /// Second moment.
    pub exp_avg_sq: Vec<f32>,
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

/// The shared fused kernel; `decoupled` selects AdamW's weight decay.
fn adam_update(
    hyper: Hyper,
    (beta1, beta2): (f64, f64),
    eps: f64,
    decoupled: bool,
    param: &mut [f32],
    grad: &[f32],
    st: &mut AdamState,
) {
    if st.exp_avg.is_empty() && !param.is_empty() {
        st.exp_avg = vec![0.0; param.len()];
        st.exp_avg_sq = vec![0.0; param.len()];
    }
    st.step += 1;
    let step = st.step as f64;
    // Python floats (f64), as PyTorch computes them; powf, not powi, like Python's `**`.
    let bias_correction1 = 1.0 - beta1.powf(step);
    let bias_correction2 = 1.0 - beta2.powf(step);
    let neg_step_size = (-(hyper.lr / bias_correction1)) as f32;
    let bc2_sqrt = bias_correction2.sqrt() as f32;
    let decay_l2 = !decoupled && hyper.weight_decay != 0.0;
    let wd = hyper.weight_decay as f32;
    let decay_mul = (1.0 - hyper.lr * hyper.weight_decay) as f32;
    let decay_decoupled = decoupled && hyper.weight_decay != 0.0;
    // lerp_(grad, 1 - beta1): the weight is rounded to f32; PyTorch's vectorised lerp uses
    // fmadd(w, end - start, start) for |w| < 0.5, else fmadd(w - 1, end - start, end).
    let w = (1.0 - beta1) as f32;
    let small = w.abs() < 0.5;
    let b2 = beta2 as f32;
    let one_minus_b2 = (1.0 - beta2) as f32;
    let eps = eps as f32;
    for_chunks(param, grad, &mut st.exp_avg, &mut st.exp_avg_sq, |p, g, m, v| {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            if decay_decoupled {
                // param.mul_(1 - lr * weight_decay)
                *p *= decay_mul;
            }
            // grad.add(param, alpha=weight_decay)
            let g = if decay_l2 { p.mul_add(wd, g) } else { g };
            let diff = g - *m;
            *m = if small { w.mul_add(diff, *m) } else { (w - 1.0).mul_add(diff, g) };
            // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2): self + (value*g)*g.
            *v = *v * b2 + one_minus_b2 * g * g;
            // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            let denom = v.sqrt() / bc2_sqrt + eps;
            // param.addcdiv_(exp_avg, denom, value=-step_size): self + (value*m)/denom.
            *p += neg_step_size * *m / denom;
        }
    });
}

macro_rules! adam_rule {
    ($t:ident, $name:literal, $decoupled:expr) => {
        impl Rule for $t {
            type State = AdamState;
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
            fn init_state(&self, _numel: usize) -> AdamState {
                AdamState::default()
            }
            fn state_fits(&self, st: &AdamState, numel: usize) -> bool {
                (st.exp_avg.len() == numel && st.exp_avg_sq.len() == numel)
                    || (st.step == 0 && st.exp_avg.is_empty() && st.exp_avg_sq.is_empty())
            }
            fn update(&self, hyper: Hyper, param: &mut [f32], grad: &[f32], st: &mut AdamState) {
                adam_update(hyper, self.betas, self.eps, $decoupled, param, grad, st)
            }
        }
    };
}
adam_rule!(Adam, "adam", false);
adam_rule!(AdamW, "adamw", true);
