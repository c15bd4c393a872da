//! Gradient clipping: PyTorch's `clip_grad_norm_` and `clip_grad_value_`.
//!
//! Design notes:
//! - In a training step these are reached through [`crate::scaler::UnscaledGrads`] only
//!   (`clip_grad_norm` / `clip_grad_value`), so clipping gradients that are still scaled does
//!   not compile. The functions here work on a plain [`Grads`] (or on slices, for benchmarks)
//!   for training without a scaler.
//! - The global L2 norm is computed as PyTorch does: the norm of each gradient, then the norm
//!   of those norms, in f32. Each per-gradient sum of squares runs in parallel chunks with 16
//!   f32 lanes (fused multiply-add), and the chunk sums are added in a fixed order, so the
//!   result does not depend on the number of threads.
//! - The coefficient is PyTorch's, operation for operation: `max_norm / (total + 1e-6)` (which
//!   PyTorch evaluates as a reciprocal times `max_norm`) clamped to 1, and every gradient is
//!   multiplied by it, even when it is 1. A NaN norm gives NaN gradients, as in PyTorch (the
//!   scaler has already marked such a step as skipped).
//! - Every number stays on the gradients' device: the per-gradient norms
//!   ([`Device::norm_into`]), the total and the coefficient ([`Device::clip_coefficient`]) are
//!   device memory, and each gradient is scaled by the coefficient read there
//!   ([`Device::scale_in_place`]). So clipping on a GPU waits for nothing; the norm it returns
//!   is a [`crate::Device::Value`], read when (and if) the caller asks.

use crate::autograd::{AnyTensor, Grads};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::precision::Precision;

pub use crate::backend::clip_coefficient;
pub use crate::cpu::amp::{clamp_in_place, scale_in_place, sum_of_squares};

/// The L2 norm of several gradients together, as PyTorch computes it: the norm of the
/// per-gradient norms, in f32.
///
/// ```
/// # extern crate amp_core as amp;
/// let n = amp::clip::global_norm(&[&[3.0f32][..], &[4.0f32][..]]);
/// assert_eq!(n, 5.0);
/// ```
pub fn global_norm(slices: &[&[f32]]) -> f32 {
    let norms: Vec<f32> = slices.iter().map(|s| sum_of_squares(s).sqrt()).collect();
    crate::backend::total_norm(&norms)
}

/// The global L2 norm of every gradient in `grads` (the norm of the per-gradient norms, in
/// f32), as [`try_clip_grad_norm`] measures it. Computed on the gradients' device; on the CPU
/// the value itself, on another device a value read when asked ([`crate::Device::Value`]).
pub fn grad_norm<D: Device>(grads: &Grads<D>) -> D::Value<f32> {
    match clip_scalars(grads, 1.0) {
        Some((dev, scalars)) => read_f32(&dev, scalars, 0),
        None => D::default().value(|| 0.0),
    }
}

/// Scales all gradients so that their global L2 norm is at most `max_norm` (PyTorch's
/// `clip_grad_norm_` with `norm_type=2`), returning the norm before clipping.
///
/// Every gradient in `grads` takes part (in a training step those are the gradients of the
/// model's parameters and of any other leaf marked with `requires_grad_()`). Gradients that
/// are not f32 are measured and scaled in their own accumulation type. The norm and the
/// coefficient are computed on the gradients' device and never leave it: the norm comes back
/// as a [`crate::Device::Value`] (an `f32` on the CPU), read on another device only when asked.
pub fn try_clip_grad_norm<D: Device>(grads: &mut Grads<D>, max_norm: f32) -> Result<D::Value<f32>> {
    Ok(match clip_in_place(grads, max_norm)? {
        Some((dev, scalars)) => read_f32(&dev, scalars, 0),
        None => D::default().value(|| 0.0),
    })
}

/// [`try_clip_grad_norm`]'s work: returns the device and its `[total norm, coefficient]`
/// (`None` when there are no gradients).
pub(crate) fn clip_in_place<D: Device>(grads: &mut Grads<D>, max_norm: f32) -> Result<Option<(D, D::Storage<f32>)>> {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return Err(Error::InvalidArgument {
            op: "clip_grad_norm",
            name: "max_norm",
            detail: format!("must be positive, got {max_norm}"),
        });
    }
    let Some((dev, scalars)) = clip_scalars(grads, max_norm) else {
        return Ok(None);
    };
    for (_, g) in grads.iter_mut() {
        crate::with_any!(g, t => {
            t.make_exclusive();
            dev.scale_in_place(&mut t.storage, &scalars, 1);
        });
    }
    Ok(Some((dev, scalars)))
}

/// Like [`try_clip_grad_norm`]; panics on an invalid `max_norm`.
#[track_caller]
pub fn clip_grad_norm<D: Device>(grads: &mut Grads<D>, max_norm: f32) -> D::Value<f32> {
    crate::error::or_panic(try_clip_grad_norm(grads, max_norm))
}

/// Clamps every gradient value to `[-clip_value, clip_value]` (PyTorch's `clip_grad_value_`).
pub fn try_clip_grad_value<D: Device>(grads: &mut Grads<D>, clip_value: f32) -> Result<()> {
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(Error::InvalidArgument {
            op: "clip_grad_value",
            name: "clip_value",
            detail: format!("must be zero or positive, got {clip_value}"),
        });
    }
    for (_, g) in grads.iter_mut() {
        fn typed<E: Precision, D: Device>(t: &mut crate::Tensor<E, D>, c: f32) {
            t.make_exclusive();
            let dev = t.device().clone();
            dev.clamp_in_place(&mut t.storage, c);
        }
        crate::with_any!(g, t => typed(t, clip_value));
    }
    Ok(())
}

/// Like [`try_clip_grad_value`]; panics on an invalid `clip_value`.
#[track_caller]
pub fn clip_grad_value<D: Device>(grads: &mut Grads<D>, clip_value: f32) {
    crate::error::or_panic(try_clip_grad_value(grads, clip_value))
}

/// The clip scalars of `grads` on their device: each gradient's norm, then `[total norm,
/// coefficient]` ([`Device::clip_coefficient`]). `None` when there are no gradients.
fn clip_scalars<D: Device>(grads: &Grads<D>, max_norm: f32) -> Option<(D, D::Storage<f32>)> {
    fn device_of<D: Device>(g: &AnyTensor<D>) -> D {
        crate::with_any!(g, t => t.device().clone())
    }
    let (_, first) = grads.iter().next()?;
    let dev = device_of(first);
    let mut norms = dev.full(grads.len(), 0f32);
    for (i, (_, g)) in grads.iter().enumerate() {
        crate::with_any!(g, t => dev.norm_into(&t.storage, &t.layout, &mut norms, i));
    }
    let mut scalars = dev.full(2, 0f32);
    dev.clip_coefficient(&norms, max_norm, &mut scalars);
    Some((dev, scalars))
}

fn read_f32<D: Device>(dev: &D, s: D::Storage<f32>, at: usize) -> D::Value<f32> {
    crate::backend::read_back(dev, s, at, |v| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_matches_f64_reference() {
        let n = 64 * 1024 * 3 + 77; // above the parallel threshold
        let v: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let exact: f64 = v.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>().sqrt();
        let got = global_norm(&[&v]) as f64;
        assert!((got - exact).abs() / exact < 1e-6, "{got} vs {exact}");
    }

    #[test]
    fn coefficient_is_clamped_and_propagates_nan() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(4.0, 1.0), (1.0 / (4.0f32 + 1e-6)) * 1.0);
        assert!(clip_coefficient(f32::NAN, 1.0).is_nan());
        assert_eq!(clip_coefficient(f32::INFINITY, 1.0), 0.0);
    }

    #[test]
    fn clamp_keeps_nan() {
        let mut v = vec![-3.0f32, 0.5, 3.0, f32::NAN];
        clamp_in_place(&mut v, 1.0);
        assert_eq!(&v[..3], &[-1.0, 0.5, 1.0]);
        assert!(v[3].is_nan());
    }
}
