//! Loss scaling as a typestate: the training step of mixed-precision training.
//!
//! ```
//! # extern crate amp_core as amp;
//! use amp::optim::{Optimizer, Sgd};
//! use amp::scaler::GradScaler;
//! use amp::{Param, Rng, Tensor, f16};
//!
//! let mut rng = Rng::seed(0);
//! let mut w = Param::new(Tensor::<f32>::randn(&[4, 2], &mut rng)); // f32 master weights
//! let x = Tensor::<f32>::randn(&[8, 4], &mut rng);
//! let mut opt = Sgd::new(0.1).build().unwrap();
//! let mut scaler = GradScaler::new();
//!
//! for _ in 0..10 {
//!     let loss = x.cast::<f16>().matmul(&w.cast::<f16>()).cast::<f32>().square().mean_all();
//!     let mut grads = scaler.scale(loss).backward().unscale(); // one fused pass: ÷S, inf check
//!     let norm = grads.clip_grad_norm(1.0); // only possible on unscaled gradients
//!     let report = grads.step(&mut opt, &mut w).update().unwrap();
//!     // At 65536 this model's f16 weight gradients overflow: such a step is skipped (nothing
//!     // changes but the scale, which backs off until the gradients fit).
//!     assert_eq!(report.skipped, !norm.is_finite());
//! }
//! assert!(opt.steps() > 0 && scaler.get_scale() < 65536.0);
//! ```
//!
//! # Design notes
//! - The chain is `scaler.scale(loss)` → [`ScaledLoss`] → `.backward()` → [`ScaledGrads`]
//!   (`.accumulate(loss)` per extra micro-batch) → `.unscale()` → [`UnscaledGrads`]
//!   (`.clip_grad_norm(..)` / `.clip_grad_value(..)`) → `.step(&mut opt, &mut model)` →
//!   [`Stepped`] → `.update()` → [`StepReport`]. These are one type, [`TrainStep`], at four
//!   [`stage`]s (zero-sized types). Each call consumes the step and exists only at the stage
//!   where it is allowed, through a capability bound whose `#[diagnostic::on_unimplemented]`
//!   message names the call that is missing. So clipping scaled gradients, stepping with scaled
//!   gradients, unscaling twice, stepping twice and updating without a step do not compile.
//! - A step must end: dropping it before `.update()` panics, naming the stage and the missing
//!   call ([`TrainStep::abandon`] discards one on purpose). `#[must_use]` alone only catches an
//!   unbound temporary; a bound step whose `.update()` is forgotten, or a PyTorch accumulation
//!   loop ported line by line (one step per micro-batch), would otherwise lose gradients or
//!   leave the scale un-updated without a sign.
//! - Scaled gradients never leave the step as a [`crate::Grads`]: [`ScaledGrads::scaled_grads`]
//!   and [`UnscaledGrads::grads`] are read-only [`GradsView`]s, and the seeded backward is
//!   private. So a `Grads` is always unscaled, and clipping it or stepping an optimizer with it
//!   (outside the chain) is sound.
//! - `scale(loss)` takes the loss by value and `.backward()` drops it, freeing the forward
//!   graph, so the step updates parameters in place rather than copying them.
//! - The step borrows its scaler mutably from `scale(loss)` to `.update()`. Two iterations
//!   cannot be in flight at once, a step cannot outlive the scale it was made with, and
//!   `accumulate` only takes a loss (it is backpropagated at this step's scale), and a loss
//!   computed before the last update of a parameter it uses is refused by the backward pass
//!   (see [`crate::autograd`]), so gradients of two iterations cannot be mixed.
//! - An optimizer skips when its own gradients had an inf or NaN, and every optimizer skips
//!   after a `clip_grad_norm` whose total norm was inf or NaN (its coefficient, 0 or NaN,
//!   reached every gradient). A `try_` call that errs leaves a step that drops quietly: the
//!   caller has the error.
//! - The scaler is chosen by type: [`GradScaler`] for f16, [`NoScale`] for bf16 and f32 (the
//!   constant 1, no arithmetic, but inf/NaN still skip the step); [`ScalerFor<P>`] picks one
//!   from a precision's exponent width.
//! - Unscaling is one fused, parallel, branch-free pass over all gradients (see
//!   [`unscale_in_place`]): multiply by PyTorch's f32 `inv = 1/scale` (computed in f64), check
//!   for inf/NaN, one flag per gradient. A skipped step changes no parameter, moment, step
//!   count or learning-rate schedule: bit-identical.
//! - On a device other than the CPU the step's scalars stay in device memory: the scaler's
//!   state (scale, growth tracker, hysteresis and overflow counts, f64) moves there at its
//!   first step, the backward seed is cast from it there, unscale reads the scale and writes
//!   the flags there, clipping computes the norm and its coefficient there, and `update()`
//!   applies the rules below there ([`crate::backend::ScaleRule`], one rule for every device).
//!   What the step hands back (`StepReport`'s fields, the clip norm) is a
//!   [`crate::Device::Value`]: the value itself on the CPU, a lazily read one elsewhere, so
//!   reading it is the synchronisation the caller asked for, made once. The collapse check
//!   (`error_at_min_scale`) reads the state back every [`COLLAPSE_CHECK_EVERY`] updates, not at
//!   every step, so `update()` reports a collapse up to that many updates late. The skip is
//!   decided there as well: each optimizer gets its gradients' flag on the device
//!   ([`crate::optim::Optimizer::step_unless_inf`]) and its kernels skip themselves, so a
//!   step waits for the device only where the caller reads a value (see `optim`'s notes on
//!   how the optimizer learns its step counts).
//!
//! # The update rules (PyTorch's, checked against its traces)
//! - overflow (any inf/NaN gradient): the step is skipped; `scale = f32(scale × backoff)`,
//!   `tracker = 0`. PyTorch has no floor: repeated overflow drives the scale towards 0; the
//!   `min_scale` and `error_at_min_scale` options stop that.
//! - otherwise `t = tracker + 1`; if `t == growth_interval`: `scale = f32(scale × growth)` if
//!   that is finite, and `tracker = 0` either way; else `tracker = t`.
//! - `update_to(s)` sets the scale and leaves the tracker alone.
//! - Several micro-batches accumulated before one step advance the tracker once.

mod grad_scaler;
mod step;

pub use crate::cpu::amp::{any_non_finite, unscale_all, unscale_in_place};
#[doc(hidden)]
pub use grad_scaler::UnscaleMode;
pub use grad_scaler::{
    COLLAPSE_CHECK_EVERY, GradScaler, GradScalerOptions, GradScalerState, LossScaler, NoScale, ScalerFor, SelectScaler,
};

pub use crate::backend::inv_scale;
pub use step::stage;
pub use step::{
    GradsView, MicroBatchLoss, OptimizerPair, ScaledGrads, ScaledLoss, StepReport, Stepped, TrainStep, UnscaledGrads,
};
