//! The steps an optimizer has issued on a device whose outcomes (applied, or skipped on an
//! overflow) the host has not read yet.
//!
//! Design notes:
//! - Off the CPU the training step decides a skip on the device (from the unscale pass's
//!   flags), and reading that decision back would make the host wait for every kernel queued
//!   before it. So [`super::Optim`] issues its updates without knowing the outcomes of its
//!   recent steps: a window of up to [`STEPS_PER_READ`] steps, each step's flag in one device
//!   vector. The learning rate (the schedule at the applied-step count) and Adam's bias
//!   corrections (at the parameter's step count) depend on how many of the window's earlier
//!   steps were applied, so the host computes one row of arguments per possible count and
//!   the kernel picks its row from the flags ([`crate::backend::outcome_row`]): the arithmetic
//!   is the CPU's, bit for bit.
//! - Every step of a window updates the same parameters (by name), so one count serves them
//!   all. A step with another set (a parameter without a gradient this time), on another
//!   device, or after [`STEPS_PER_READ`] steps first closes the window: the host reads its
//!   flags (the one wait), adds the applied steps to the counts and opens a new window. So a
//!   steady training loop waits for the device once every [`STEPS_PER_READ`] steps.
//! - Reading a count (`steps()`, `lr()`, `state_dict()`) reads the flags (kept until the next
//!   step) and leaves the window open.
//! - A parameter first stepped in a window whose steps were all skipped goes back to having no
//!   state, as on the CPU, where a skipped step never reaches the optimizer.

use std::any::Any;
use std::sync::OnceLock;

use crate::backend::Device;
use crate::layout::Layout;

/// The most steps an optimizer issues on a device before it reads their outcomes (once per
/// window: see `optim`'s notes on devices).
pub const STEPS_PER_READ: usize = 32;

/// A parameter every step of a window updates.
#[derive(Clone, Debug)]
pub(super) struct Member {
    pub name: String,
    pub numel: usize,
    /// It had state when the window opened.
    pub existed: bool,
    /// It had never been stepped when the window opened.
    pub fresh: bool,
}

/// A window on any device (see the module notes).
pub(super) trait Window: Send + Sync {
    fn members(&self) -> &[Member];
    fn issued(&self) -> usize;
    /// Whether each issued step was skipped: read from the device on the first call after a
    /// step, then kept.
    fn skipped(&self) -> &[bool];
    fn clone_box(&self) -> Box<dyn Window>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// How many of the issued steps were applied (reads the flags, see [`Window::skipped`]).
    fn applied(&self) -> u64 {
        self.skipped().iter().filter(|&&s| !s).count() as u64
    }
}

impl Clone for Box<dyn Window> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// A window on device `D`: the flags of its steps, `flags[i]` nonzero where step `i` was
/// skipped.
pub(super) struct WindowOn<D: Device> {
    pub dev: D,
    pub flags: D::Storage<f32>,
    pub issued: usize,
    pub members: Vec<Member>,
    read: OnceLock<Vec<bool>>,
}

impl<D: Device> WindowOn<D> {
    pub fn new(dev: D, members: Vec<Member>) -> Self {
        let flags = dev.full(STEPS_PER_READ, 0f32);
        WindowOn { dev, flags, issued: 0, members, read: OnceLock::new() }
    }
    /// Records the next step's flag (one f32 on the device); returns its place in the window.
    pub fn push(&mut self, found_inf: &D::Storage<f32>) -> usize {
        assert!(self.issued < STEPS_PER_READ, "a full window is closed before another step");
        let at = self.issued;
        let slot = Layout { shape: vec![1], strides: vec![1], offset: at };
        self.dev.write_into(&mut self.flags, &slot, found_inf, &Layout::contiguous(&[1]), false);
        self.issued += 1;
        self.read = OnceLock::new();
        at
    }
}

impl<D: Device> Window for WindowOn<D> {
    fn members(&self) -> &[Member] {
        &self.members
    }
    fn issued(&self) -> usize {
        self.issued
    }
    fn skipped(&self) -> &[bool] {
        self.read.get_or_init(|| {
            let flags = self.dev.to_host(&self.flags, &Layout::contiguous(&[STEPS_PER_READ]));
            flags[..self.issued].iter().map(|&f| f != 0.0).collect()
        })
    }
    fn clone_box(&self) -> Box<dyn Window> {
        // A copy of the flags on the device: each window writes its own.
        let whole = Layout::contiguous(&[STEPS_PER_READ]);
        let mut flags = self.dev.full(STEPS_PER_READ, 0f32);
        self.dev.write_into(&mut flags, &whole, &self.flags, &whole, false);
        Box::new(WindowOn::<D> {
            dev: self.dev.clone(),
            flags,
            issued: self.issued,
            members: self.members.clone(),
            read: self.read.clone(),
        })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
