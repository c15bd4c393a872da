//! What the training step keeps on the device: the loss scale's state and its update rule, and
//! the values the host reads back only when asked ([`Lazy`]).
//!
//! Design notes:
//! - A GPU runs ahead of the host; every read of device memory by the host waits for all
//!   work queued before it. So the step keeps its scalars where the gradients are: the
//!   scale, the growth and hysteresis trackers live in one f64 vector on the device
//!   ([`ScaleSlot`] says what each element holds; f64 holds an f32 scale and every i32
//!   tracker exactly), the unscale pass reads the scale from there, and
//!   [`ScaleRule::apply`] (PyTorch's `_amp_update_scale_`) runs on the device too.
//! - Values the host may want (was the step skipped, the scale, the gradient norm) come back
//!   as [`crate::Device::Value`]s: on the CPU the value itself (`bool`, `f32`: reading the
//!   host's own memory is free), on another device a [`Lazy`] that reads on its first
//!   [`HostValue::get`], the one synchronisation the caller asked for.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

/// The elements of a loss scaler's state vector on the device (f64, [`ScaleSlot::LEN`] of
/// them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleSlot {
    /// The scale (an f32 value).
    Scale = 0,
    /// Good steps in a row since the last growth or overflow (PyTorch's `_growth_tracker`).
    GrowthTracker = 1,
    /// Overflows still tolerated before backing off (with hysteresis above 1).
    HysteresisTracker = 2,
    /// Overflowing steps in a row.
    OverflowsInARow = 3,
    /// Of those, the ones that overflowed with the scale already at its floor.
    OverflowsAtFloor = 4,
}

impl ScaleSlot {
    /// The length of the state vector.
    pub const LEN: usize = 5;
}

/// The end-of-iteration rule of a dynamic loss scaler, as [`crate::Device::update_scale`]
/// applies it on the device: PyTorch's `_amp_update_scale_`, plus the optional floor,
/// ceiling and hysteresis of Apex, DeepSpeed and Megatron.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleRule {
    /// The factor after `growth_interval` good steps in a row.
    pub growth_factor: f64,
    /// The factor after an overflow.
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows.
    pub growth_interval: i32,
    /// Backing off never goes below this.
    pub min_scale: Option<f32>,
    /// Growing never goes above this.
    pub max_scale: Option<f32>,
    /// Overflows tolerated before backing off (1: back off at every one).
    pub hysteresis: i32,
    /// PyTorch's `update(new_scale)`: the scale becomes this and nothing else changes.
    pub set_scale: Option<f32>,
}

impl ScaleRule {
    /// The rule, in place on a state vector ([`ScaleSlot`]), given whether the step
    /// overflowed. This is the definition every device follows (the CPU runs it as is; the
    /// CUDA kernel `update_scale_fwd_f32` is the same operations in C):
    /// - `set_scale`: the scale becomes it, the trackers stay.
    /// - overflow: `growth_tracker = 0`, one more overflow in a row, the hysteresis tracker
    ///   goes down by one (not below 0); while it is still above 0 nothing else changes.
    ///   Otherwise an overflow at the floor is counted, and `scale = f32(scale × backoff)`
    ///   (f32 times f64, rounded once), raised to the floor if there is one.
    /// - a good step: the overflow counts return to 0; `t = growth_tracker + 1`; at
    ///   `t == growth_interval` the scale becomes `f32(scale × growth)` if that is finite
    ///   (lowered to the ceiling if there is one), and the trackers restart (`growth_tracker
    ///   = 0`, hysteresis full); otherwise `growth_tracker = t`.
    pub fn apply(&self, state: &mut [f64], overflow: bool) {
        use ScaleSlot::*;
        if let Some(s) = self.set_scale {
            state[Scale as usize] = s as f64;
            return;
        }
        let scale = state[Scale as usize] as f32;
        if overflow {
            state[OverflowsInARow as usize] += 1.0;
            state[GrowthTracker as usize] = 0.0;
            let hysteresis = (state[HysteresisTracker as usize] - 1.0).max(0.0);
            state[HysteresisTracker as usize] = hysteresis;
            if hysteresis > 0.0 {
                return;
            }
            if let Some(floor) = self.min_scale
                && scale <= floor
            {
                state[OverflowsAtFloor as usize] += 1.0;
            }
            let backed_off = (scale as f64 * self.backoff_factor) as f32;
            let scale = match self.min_scale {
                Some(floor) => backed_off.max(floor),
                None => backed_off,
            };
            state[Scale as usize] = scale as f64;
        } else {
            state[OverflowsInARow as usize] = 0.0;
            state[OverflowsAtFloor as usize] = 0.0;
            let successful = state[GrowthTracker as usize] + 1.0;
            if successful == self.growth_interval as f64 {
                let grown = (scale as f64 * self.growth_factor) as f32;
                if grown.is_finite() {
                    let scale = match self.max_scale {
                        Some(ceiling) => grown.min(ceiling),
                        None => grown,
                    };
                    state[Scale as usize] = scale as f64;
                }
                state[GrowthTracker as usize] = 0.0;
                state[HysteresisTracker as usize] = self.hysteresis as f64;
            } else {
                state[GrowthTracker as usize] = successful;
            }
        }
    }
}

/// The unscale factor PyTorch uses: `1/scale` computed in f64, then rounded to f32.
///
/// Bit parity depends on it: the gradients are multiplied by this value, never divided by the
/// scale.
///
/// ```
/// # extern crate amp_core as amp;
/// assert_eq!(amp::scaler::inv_scale(65536.0), 1.0 / 65536.0);
/// ```
pub fn inv_scale(scale: f32) -> f32 {
    (1.0f64 / scale as f64) as f32
}

/// The global L2 norm from per-gradient norms, as PyTorch's `clip_grad_norm_` computes it: the
/// norm of the norms, in f32, summed in order.
pub fn total_norm(norms: &[f32]) -> f32 {
    norms.iter().map(|n| n * n).sum::<f32>().sqrt()
}

/// PyTorch's clip coefficient: `max_norm / (total_norm + 1e-6)`, clamped to at most 1.
///
/// PyTorch evaluates the division as `reciprocal(total + 1e-6) * max_norm` (a Python scalar
/// divided by a tensor), all in f32; so does this. NaN propagates.
///
/// ```
/// # extern crate amp_core as amp;
/// assert_eq!(amp::clip::clip_coefficient(0.5, 1.0), 1.0);
/// ```
pub fn clip_coefficient(total_norm: f32, max_norm: f32) -> f32 {
    let coef = (1.0 / (total_norm + 1e-6f32)) * max_norm;
    // torch.clamp(max=1.0): NaN stays NaN (f32::min would drop it).
    if coef > 1.0 { 1.0 } else { coef }
}

/// A value on the device that the host reads on its first [`HostValue::get`] (which waits
/// for the device), then keeps. Cloning shares it: one read serves every clone.
///
/// [`fmt::Debug`] shows the value only once it has been read, so printing a report never
/// waits for the device.
pub struct Lazy<T> {
    inner: Arc<LazyInner<T>>,
}

/// A read function that a device makes for one value.
type ReadFn<T> = Box<dyn FnOnce() -> T + Send>;

struct LazyInner<T> {
    value: OnceLock<T>,
    read: Mutex<Option<ReadFn<T>>>,
}

impl<T: Copy + Send + Sync + 'static> Lazy<T> {
    /// A value that `read` fetches when it is first asked for.
    pub fn new(read: impl FnOnce() -> T + Send + 'static) -> Self {
        Lazy { inner: Arc::new(LazyInner { value: OnceLock::new(), read: Mutex::new(Some(Box::new(read))) }) }
    }
    /// Whether the value has been read already (so [`HostValue::get`] will not wait).
    pub fn is_read(&self) -> bool {
        self.inner.value.get().is_some()
    }
    /// The value: read on the first call (waiting for the device), kept after.
    pub(crate) fn force(&self) -> T {
        *self.inner.value.get_or_init(|| {
            let read = self.inner.read.lock().unwrap_or_else(|e| e.into_inner()).take();
            read.expect("a Lazy value is read once, under its OnceLock")()
        })
    }
}

impl<T> Clone for Lazy<T> {
    fn clone(&self) -> Self {
        Lazy { inner: self.inner.clone() }
    }
}

impl<T: fmt::Debug> fmt::Debug for Lazy<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.inner.value.get() {
            Some(v) => write!(f, "{v:?}"),
            None => f.write_str("<on the device, not read yet>"),
        }
    }
}

/// The scalar types a device hands back to the host ([`crate::Device::Value`]).
pub trait Scalar: Copy + fmt::Debug + PartialEq + Send + Sync + 'static + sealed::Sealed {}
impl Scalar for bool {}
impl Scalar for f32 {}
impl Scalar for i32 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for bool {}
    impl Sealed for f32 {}
    impl Sealed for i32 {}
}

/// Reading a [`crate::Device::Value`] on the host, for code written for any device: the
/// value itself on the CPU, a read that waits for the device (once) for a [`Lazy`].
pub trait HostValue<T> {
    /// The value.
    fn get(&self) -> T;
}

impl<T: Scalar> HostValue<T> for T {
    fn get(&self) -> T {
        *self
    }
}

impl<T: Scalar> HostValue<T> for Lazy<T> {
    fn get(&self) -> T {
        self.force()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_lazy_value_is_read_once_on_first_get_and_shared_by_clones() {
        static READS: AtomicUsize = AtomicUsize::new(0);
        let v = Lazy::new(|| {
            READS.fetch_add(1, Ordering::SeqCst);
            2.5f32
        });
        let w = v.clone();
        assert_eq!(READS.load(Ordering::SeqCst), 0);
        assert!(!v.is_read() && format!("{w:?}").contains("not read"));
        assert_eq!((v.get(), w.get(), v.get()), (2.5, 2.5, 2.5));
        assert_eq!(READS.load(Ordering::SeqCst), 1);
        assert_eq!(format!("{w:?}"), "2.5");
        assert!(true.get() && 7i32.get() == 7);
    }

    #[test]
    fn hysteresis_does_not_go_below_zero() {
        let rule = ScaleRule {
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 10,
            min_scale: None,
            max_scale: None,
            hysteresis: 2,
            set_scale: None,
        };
        let mut s = [1024.0, 0.0, 2.0, 0.0, 0.0];
        for _ in 0..5 {
            rule.apply(&mut s, true);
        }
        // One tolerated overflow, then four backoffs; the tracker rests at 0.
        assert_eq!(s, [64.0, 0.0, 0.0, 5.0, 0.0]);
    }
}
