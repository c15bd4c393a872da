//! Learning-rate schedules: a factor of the base rate as a function of the applied-step count.

use crate::error::{Error, Result};

/// A learning-rate schedule: every group's base rate is multiplied by `factor(t)` at the
/// `t`-th applied step (from 0), like PyTorch's `LambdaLR`. The optimizer counts only steps it
/// applied, so a step skipped on overflow does not move the schedule.
///
/// Closures are schedules too: `opt.with_schedule(|t: u64| 0.95f64.powi(t as i32))`.
pub trait LrSchedule: Send + Sync {
    /// The multiplier of the base learning rate at applied step `t`.
    fn factor(&self, t: u64) -> f64;
}

impl<F: Fn(u64) -> f64 + Send + Sync> LrSchedule for F {
    fn factor(&self, t: u64) -> f64 {
        self(t)
    }
}

/// The constant factor 1.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Constant;

impl LrSchedule for Constant {
    fn factor(&self, _t: u64) -> f64 {
        1.0
    }
}

/// Linear warmup, then cosine decay to `min_factor` (the GPT recipe).
///
/// `factor(t) = (t + 1) / warmup_steps` for `t < warmup_steps` (the first step already learns);
/// then `min + (1 − min)·(1 + cos(π·p))/2` with `p = (t − warmup) / (total − warmup)`; and
/// `min_factor` from `total_steps` on.
///
/// ```
/// # extern crate amp_core as amp;
/// use amp::optim::{LrSchedule, WarmupCosine};
/// let s = WarmupCosine::new(10, 110).unwrap();
/// assert_eq!(s.factor(0), 0.1);
/// assert_eq!(s.factor(9), 1.0);
/// assert_eq!(s.factor(10), 1.0);
/// assert!((s.factor(60) - 0.5).abs() < 1e-12);
/// assert_eq!(s.factor(110), 0.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WarmupCosine {
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the decay reaches `min_factor`.
    pub total_steps: u64,
    /// The final factor (0 decays to a zero learning rate; 0.1 is common).
    pub min_factor: f64,
}

impl WarmupCosine {
    /// Warmup over `warmup_steps`, cosine decay to 0 at `total_steps`.
    pub fn new(warmup_steps: u64, total_steps: u64) -> Result<Self> {
        Self::with_min(warmup_steps, total_steps, 0.0)
    }
    /// Like [`WarmupCosine::new`], decaying to `min_factor` instead of 0.
    pub fn with_min(warmup_steps: u64, total_steps: u64, min_factor: f64) -> Result<Self> {
        if warmup_steps > total_steps || total_steps == 0 {
            return Err(Error::State {
                context: "WarmupCosine".into(),
                detail: format!(
                    "needs 0 < total_steps and warmup_steps <= total_steps, got warmup {warmup_steps}, total {total_steps}"
                ),
            });
        }
        if !(0.0..=1.0).contains(&min_factor) {
            return Err(Error::State {
                context: "WarmupCosine".into(),
                detail: format!("min_factor must be in [0, 1], got {min_factor}"),
            });
        }
        Ok(WarmupCosine { warmup_steps, total_steps, min_factor })
    }
}

impl LrSchedule for WarmupCosine {
    fn factor(&self, t: u64) -> f64 {
        if t < self.warmup_steps {
            return (t + 1) as f64 / self.warmup_steps as f64;
        }
        if t >= self.total_steps {
            return self.min_factor;
        }
        let progress = (t - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_factor + (1.0 - self.min_factor) * cosine
    }
}
