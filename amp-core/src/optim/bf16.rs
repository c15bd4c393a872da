//! The optimizer for pure-bf16 parameters: the rule's f32 update, written back to bf16 with
//! Kahan compensation, stochastic rounding or round to nearest (see the module notes of
//! [`crate::optim`]).

use std::any::Any;
use std::collections::BTreeMap;
use std::marker::PhantomData;

use half::bf16;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Optim, Optimizer, OptimizerState, Plan, Rule, state_on};
use crate::autograd::Grads;
use crate::backend::{Bf16Write, Cpu, Device};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::param::Params;
use crate::rng::splitmix64;

/// How an [`Optim<R, bf16>`](Optim::for_bf16) writes the rule's f32 result into a bf16
/// parameter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bf16Rounding {
    /// Kahan summation (the default): a bf16 compensation buffer per parameter (2 bytes per
    /// value) carries each write's rounding error into the next update, so updates far below
    /// the weight's bf16 resolution still accumulate. Per element, with `p` the bf16 weight,
    /// `c` its compensation and `w` the rule's f32 result for `p`:
    /// `y = (w − p) + c; p' = bf16(p + y); c' = bf16(y − (p' − p))`.
    #[default]
    Kahan,
    /// Stochastic rounding: `w` is rounded up or down to a neighbouring bf16 with probability
    /// proportional to its closeness (16 random bits added below bf16's last bit, then
    /// truncated), so the rounding is unbiased in expectation; no buffer. The bits are a hash
    /// of (`seed`, parameter name, applied step, element index): a resumed run draws the same.
    Stochastic {
        /// Seed of the rounding bits.
        seed: u64,
    },
    /// Round to nearest even, as PyTorch's in-place update of a bf16 parameter does: updates
    /// below half a bf16 ulp of the weight are lost. For comparison; not for training.
    Nearest,
}

/// The checkpoint of an [`Optim<R, bf16>`](Optim::for_bf16): the rule's state as for f32
/// parameters, the rounding, and the Kahan compensation of each parameter (bf16 values,
/// serialised as their bit patterns, so NaN and ±inf round-trip bit for bit too).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: DeserializeOwned"))]
pub struct Bf16OptimizerState<S> {
    /// Rule name, applied steps, per-parameter state (moments in f32).
    pub optimizer: OptimizerState<S>,
    /// How updates were written back (a checkpoint loads only into the same rounding).
    pub rounding: Bf16Rounding,
    /// Kahan compensation per parameter name (empty for the other roundings).
    pub compensation: BTreeMap<String, Vec<bf16>>,
}

impl<R: Rule> Optim<R> {
    /// This optimizer for pure-bf16 parameters (`Params<bf16>`, e.g. a
    /// `gpt.to_precision::<bf16>()`): the same rule, groups, schedule and state, with updates
    /// written back to bf16 as `rounding` says ([`Bf16Rounding::Kahan`] is the default choice;
    /// see the module notes). It binds afresh at its next step, and starts with no
    /// compensation.
    ///
    /// ```
    /// # extern crate amp_core as amp;
    /// use amp::optim::{AdamW, Bf16Rounding, Optimizer};
    /// use amp::{Param, Tensor, bf16};
    ///
    /// let mut w = Param::new(Tensor::<f32>::from_f32s(&[1.0, -2.0], &[2])).to_precision::<bf16>();
    /// let mut opt = AdamW::new(1e-3).build().unwrap().for_bf16(Bf16Rounding::Kahan);
    /// let grads = w.cast::<f32>().square().sum_all().backward(); // the gradient of w is bf16
    /// opt.step(&mut w, &grads).unwrap();
    /// assert_eq!(opt.steps(), 1);
    /// ```
    pub fn for_bf16(mut self, rounding: Bf16Rounding) -> Optim<R, bf16> {
        self.close_window();
        Optim {
            rule: self.rule,
            groups: self.groups,
            schedule: self.schedule,
            steps: self.steps,
            state: self.state,
            bound: None,
            rounding,
            compensation: BTreeMap::new(),
            window: None,
            _elem: PhantomData,
        }
    }
}

impl<R: Rule> Optim<R, bf16> {
    /// How updates are written back to the bf16 parameters.
    pub fn rounding(&self) -> Bf16Rounding {
        self.rounding
    }
    /// The Kahan compensation of the parameter called `name`, if it has been stepped with
    /// [`Bf16Rounding::Kahan`] on the CPU (a compensation on another device is read with
    /// [`Optim::state_dict`], which copies it to the host).
    pub fn compensation(&self, name: &str) -> Option<&[bf16]> {
        let on_cpu = self.compensation.get(name)?.as_any().downcast_ref::<CompensationOn<Cpu>>()?;
        Some(&on_cpu.buf[..])
    }
    /// The checkpoint: the rule's state, the rounding and the Kahan compensation (copied to
    /// the host from whichever device each parameter is on).
    pub fn state_dict(&self) -> Bf16OptimizerState<R::State> {
        let compensation = self.compensation.iter().map(|(n, c)| (n.clone(), c.to_host())).collect();
        Bf16OptimizerState { optimizer: self.base_state(), rounding: self.rounding, compensation }
    }
    /// Restores a checkpoint written by an optimizer with the same rule, hyperparameters
    /// ([`OptimizerState::hyperparameters`]) and rounding (Kahan
    /// compensation dropped, or a stochastic stream changed, would not continue the run).
    /// Shapes are checked at the next step (or now, with [`Optim::check_params`]).
    pub fn load_state_dict(&mut self, state: Bf16OptimizerState<R::State>) -> Result<()> {
        let bad = |detail: String| Err(Error::State { context: "Optim::load_state_dict".into(), detail });
        if state.rounding != self.rounding {
            return bad(format!(
                "the checkpoint was written with bf16 rounding {:?}, this optimizer uses {:?}",
                state.rounding, self.rounding
            ));
        }
        if self.rounding != Bf16Rounding::Kahan && !state.compensation.is_empty() {
            return bad(format!("the checkpoint has Kahan compensation but its rounding is {:?}", state.rounding));
        }
        self.load_base_state(state.optimizer)?;
        self.compensation = state.compensation.into_iter().map(|(n, c)| (n, host_compensation(c))).collect();
        Ok(())
    }
}

/// One bf16 parameter's Kahan compensation, on whichever device the parameter lives on (made
/// there at its first step, moved there if the model moved or the buffer came from a
/// checkpoint), like the rule's state (`Slot`).
pub(super) trait CompensationSlot: Send + Sync {
    fn to_host(&self) -> Vec<bf16>;
    fn len(&self) -> usize;
    fn clone_box(&self) -> Box<dyn CompensationSlot>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A compensation buffer on device `D`.
struct CompensationOn<D: Device> {
    dev: D,
    buf: D::Storage<bf16>,
}

impl<D: Device> CompensationSlot for CompensationOn<D> {
    fn to_host(&self) -> Vec<bf16> {
        self.dev.to_host(&self.buf, &Layout::contiguous(&[D::len(&self.buf)]))
    }
    fn len(&self) -> usize {
        D::len(&self.buf)
    }
    fn clone_box(&self) -> Box<dyn CompensationSlot> {
        Box::new(CompensationOn::<D> { dev: self.dev.clone(), buf: self.buf.clone() })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Clone for Box<dyn CompensationSlot> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// A compensation read from a checkpoint (on the host until its parameter's next step).
fn host_compensation(values: Vec<bf16>) -> Box<dyn CompensationSlot> {
    Box::new(CompensationOn::<Cpu> { dev: Cpu, buf: Cpu.from_host(values) })
}

/// The compensation of the parameter `name` on `dev`: zeros if it has none, moved there if it
/// is on another device.
fn compensation_on<'a, D: Device>(
    slots: &'a mut BTreeMap<String, Box<dyn CompensationSlot>>,
    name: &str,
    dev: &D,
    numel: usize,
) -> &'a mut D::Storage<bf16> {
    let slot = slots
        .entry(name.to_string())
        .or_insert_with(|| Box::new(CompensationOn::<D> { dev: dev.clone(), buf: dev.full(numel, bf16::ZERO) }));
    if !slot.as_any().is::<CompensationOn<D>>() {
        let host = slot.to_host();
        *slot = Box::new(CompensationOn::<D> { dev: dev.clone(), buf: dev.from_host(host) });
    }
    &mut slot.as_any_mut().downcast_mut::<CompensationOn<D>>().expect("the slot was just made for this device").buf
}

/// On any device: the working copies, the rule's state and the compensation live on the
/// parameter's device.
impl<R: Rule, D: Device> Optimizer<bf16, D> for Optim<R, bf16> {
    /// Widens each bf16 parameter and its bf16 gradient to f32, runs the rule's f32 update
    /// (f32 moments), and writes the result back as [`Optim::rounding`] says.
    fn check_step(&self, params: &dyn Params<bf16, D>, grads: &Grads<D>) -> Result<()> {
        self.check_params_of(params, grads)
    }
    fn step(&mut self, params: &mut dyn Params<bf16, D>, grads: &Grads<D>) -> Result<()> {
        let t = self.steps;
        let Plan { work, binding, ids } = self.plan(params.named_params_mut(), grads)?;
        for (name, param, grad) in work {
            let hyper = self.hyper_for(&name, t);
            let numel = param.numel();
            let dev = param.device().clone();
            // f32 working copies (from the device's caching allocator, so a large parameter's
            // widening does not fault in fresh pages every step).
            let whole = Layout::contiguous(&[numel]);
            let mut w = dev.cast::<bf16, f32>(param.storage_mut(), &whole);
            let g = dev.cast::<bf16, f32>(&grad.contiguous_storage(), &whole);
            let state = state_on(&self.rule, &mut self.state, &name, &dev, numel);
            self.rule.update(&dev, hyper, &mut w, &g, state);
            let (mode, comp) = match self.rounding {
                Bf16Rounding::Kahan => {
                    (Bf16Write::Kahan, Some(compensation_on(&mut self.compensation, &name, &dev, numel)))
                }
                Bf16Rounding::Stochastic { seed } => (Bf16Write::Stochastic { key: stream_key(seed, &name, t) }, None),
                Bf16Rounding::Nearest => (Bf16Write::Nearest, None),
            };
            dev.write_bf16(&w, param.storage_mut(), mode, comp);
        }
        self.finish_step(binding, grads, ids);
        Ok(())
    }
    fn lr(&self) -> f64 {
        Optim::lr(self)
    }
    fn steps(&self) -> u64 {
        Optim::steps(self)
    }
}

/// The key of one parameter's rounding bits at applied step `t`.
fn stream_key(seed: u64, name: &str, t: u64) -> u64 {
    // FNV-1a of the name: stable across runs and platforms.
    let name_hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    splitmix64(splitmix64(seed ^ name_hash).wrapping_add(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `w` written into `p` (and `c`, for Kahan) by the CPU's write-back kernel.
    fn write(rounding: Bf16Rounding, w: &[f32], p: &mut Vec<bf16>, c: &mut Vec<bf16>, name: &str, t: u64) {
        let dev = Cpu;
        let (mut ps, mut cs) = (dev.from_host(p.clone()), dev.from_host(c.clone()));
        let mode = match rounding {
            Bf16Rounding::Kahan => Bf16Write::Kahan,
            Bf16Rounding::Stochastic { seed } => Bf16Write::Stochastic { key: stream_key(seed, name, t) },
            Bf16Rounding::Nearest => Bf16Write::Nearest,
        };
        let kahan = mode == Bf16Write::Kahan;
        dev.write_bf16(&dev.from_host(w.to_vec()), &mut ps, mode, kahan.then_some(&mut cs));
        (*p, *c) = (ps.to_vec(), cs.to_vec());
    }

    /// `n` bf16 weights of `value` stepped `steps` times by `delta` each.
    fn accumulate(rounding: Bf16Rounding, value: f32, delta: f32, steps: u64) -> Vec<f32> {
        let n = 4096;
        let mut p = vec![bf16::from_f32(value); n];
        let mut c = vec![bf16::ZERO; n];
        for t in 0..steps {
            let w: Vec<f32> = p.iter().map(|v| v.to_f32() + delta).collect();
            write(rounding, &w, &mut p, &mut c, "w", t);
        }
        p.iter().map(|v| v.to_f32()).collect()
    }

    #[test]
    fn small_updates_accumulate_with_kahan_and_in_expectation_with_stochastic_rounding() {
        // 1e-4 is 1/39 of a bf16 ulp at 1 (2^-7): round to nearest loses every one of them.
        let (value, delta, steps) = (1.0f32, -1e-4f32, 1000u64);
        let exact = value as f64 + delta as f64 * steps as f64; // 0.9
        assert!(accumulate(Bf16Rounding::Nearest, value, delta, steps).iter().all(|&v| v == 1.0));
        let kahan = accumulate(Bf16Rounding::Kahan, value, delta, steps);
        // Kahan is deterministic: every element lands within one bf16 ulp at 0.9 (2^-8).
        assert!(kahan.iter().all(|&v| (v as f64 - exact).abs() <= 2f64.powi(-8)), "{:?}", &kahan[..4]);
        let sr = accumulate(Bf16Rounding::Stochastic { seed: 7 }, value, delta, steps);
        let mean = sr.iter().map(|&v| v as f64).sum::<f64>() / sr.len() as f64;
        assert!((mean - exact).abs() < 2e-3, "stochastic rounding mean {mean}, exact {exact}");
        assert!(sr.iter().any(|&v| v != sr[0]), "the rounding is random per element");
    }

    #[test]
    fn stochastic_rounding_is_reproducible_and_exact_on_representable_values() {
        let w: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 * 1e-5).collect();
        let (mut a, mut b) = (vec![bf16::ZERO; 1000], vec![bf16::ZERO; 1000]);
        write(Bf16Rounding::Stochastic { seed: 1 }, &w, &mut a, &mut vec![], "x", 5);
        write(Bf16Rounding::Stochastic { seed: 1 }, &w, &mut b, &mut vec![], "x", 5);
        assert_eq!(a, b);
        for (&w, r) in w.iter().zip(&a) {
            // One of the two bf16 neighbours of w.
            let (lo, hi) =
                (bf16::from_bits((w.to_bits() >> 16) as u16), bf16::from_bits((w.to_bits() >> 16) as u16 + 1));
            assert!(*r == lo || *r == hi, "{w} -> {r}");
        }
        let exact = [1.0f32, -0.5, 3.0, f32::INFINITY];
        let mut out = vec![bf16::ZERO; 4];
        write(Bf16Rounding::Stochastic { seed: 2 }, &exact, &mut out, &mut vec![], "y", 0);
        assert_eq!(out.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), exact);
    }
}
