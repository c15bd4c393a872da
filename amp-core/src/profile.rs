//! Where a step's time goes: a table of time per kernel between [`start`] and [`stop`], as
//! `torch.profiler`'s `key_averages()` gives, for every device.
//!
//! ```
//! # extern crate amp_core as amp;
//! use amp::{Tensor, profile};
//! let a = Tensor::<f32>::ones(&[64, 64]);
//! profile::start();
//! let b = a.matmul(&a).gelu().sum(1, false);
//! let table = profile::stop();
//! assert!(table.rows.iter().any(|r| r.name == "matmul_f32"));
//! println!("{table}"); // kernel | calls | total ms | share of the wall time | mean µs
//! # let _ = b;
//! ```
//!
//! Design notes:
//! - Off by default. Each hook costs one relaxed atomic load when off, so the hooks stay in
//!   release builds and need no feature.
//! - The CPU backend's kernels are synchronous: each backend call is timed on the host and
//!   named after its kernel and precision (`"gelu_bwd_bf16"`, `"matmul_f32"`). Only the
//!   outermost call of a thread counts, so a kernel built on another is not counted twice.
//! - A device with a queue (CUDA) records a pair of timing events around each launch and
//!   hands them over unresolved ([`record_pending`]); [`stop`] resolves them, which waits for
//!   the device: that wait is the one synchronisation a profile costs.
//! - The wall time runs from [`start`] until every pending timing has resolved. What the rows
//!   do not cover is time outside any kernel: on the CPU the engine's own work (autograd,
//!   allocation, the op layer), on a GPU the time it sat waiting for the host to launch.
//!   Start after a read of a result (a loss's `item()`), so no earlier work is still queued.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

static RECORDING: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<Option<Recording>> = Mutex::new(None);

/// What is being collected between [`start`] and [`stop`].
struct Recording {
    started: Instant,
    totals: HashMap<String, (u64, f64)>,
    pending: Vec<Box<dyn PendingTime>>,
}

impl Recording {
    fn add(&mut self, name: String, seconds: f64) {
        let entry = self.totals.entry(name).or_insert((0, 0.0));
        entry.0 += 1;
        entry.1 += seconds;
    }
}

fn state() -> std::sync::MutexGuard<'static, Option<Recording>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Clears the table and starts recording, for every device (a recording already running
/// starts over).
pub fn start() {
    *state() = Some(Recording { started: Instant::now(), totals: HashMap::new(), pending: Vec::new() });
    RECORDING.store(true, Ordering::Release);
}

/// Stops recording and returns the table, heaviest kernel first. Resolves the devices'
/// pending timings, which waits for their queued work. Without a [`start`], the table is
/// empty.
pub fn stop() -> Profile {
    RECORDING.store(false, Ordering::Release);
    let Some(mut rec) = state().take() else {
        return Profile { wall_seconds: 0.0, rows: Vec::new() };
    };
    for p in std::mem::take(&mut rec.pending) {
        let (name, seconds) = p.resolve();
        rec.add(name, seconds);
    }
    let wall_seconds = rec.started.elapsed().as_secs_f64();
    let mut rows: Vec<ProfileRow> =
        rec.totals.into_iter().map(|(name, (calls, seconds))| ProfileRow { name, calls, seconds }).collect();
    rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| a.name.cmp(&b.name)));
    Profile { wall_seconds, rows }
}

/// Whether a recording is running (for backends: skip the timing work when not).
#[inline]
pub fn is_recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Adds one call of `name` that took `seconds`, if a recording is running.
pub fn record(name: String, seconds: f64) {
    if let Some(rec) = state().as_mut() {
        rec.add(name, seconds);
    }
}

/// A device's timing that is known only once its queued work has run (a pair of GPU events).
pub trait PendingTime: Send {
    /// Waits for the timed work and returns the kernel's name and its seconds.
    fn resolve(self: Box<Self>) -> (String, f64);
}

/// Hands over a timing to resolve at [`stop`], if a recording is running (else drops it).
pub fn record_pending(p: Box<dyn PendingTime>) {
    if let Some(rec) = state().as_mut() {
        rec.pending.push(p);
    }
}

thread_local! {
    /// Host scopes open on this thread: only the outermost one records.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Times a synchronous kernel call on the host until it is dropped; `name` is called only
/// when a recording is running. Nested scopes on one thread count once, as the outermost.
#[inline]
pub fn host_scope(name: impl FnOnce() -> String) -> Option<HostScope> {
    if !is_recording() {
        return None;
    }
    let outermost = DEPTH.with(|d| {
        d.set(d.get() + 1);
        d.get() == 1
    });
    Some(HostScope { timed: outermost.then(|| (name(), Instant::now())) })
}

/// An open host scope ([`host_scope`]).
#[derive(Debug)]
pub struct HostScope {
    timed: Option<(String, Instant)>,
}

impl Drop for HostScope {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get() - 1));
        if let Some((name, t0)) = self.timed.take() {
            record(name, t0.elapsed().as_secs_f64());
        }
    }
}

/// The table [`stop`] returns.
#[derive(Clone, Debug)]
pub struct Profile {
    /// Seconds from [`start`] until every timing had resolved.
    pub wall_seconds: f64,
    /// One row per kernel name, the largest total first.
    pub rows: Vec<ProfileRow>,
}

/// One kernel's calls and time.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRow {
    /// The kernel (`"<kernel>_<precision>"` on the CPU, the CUDA kernel's name on a GPU).
    pub name: String,
    /// Calls recorded.
    pub calls: u64,
    /// Their total time in seconds.
    pub seconds: f64,
}

impl Profile {
    /// The rows' total seconds.
    pub fn kernel_seconds(&self) -> f64 {
        self.rows.iter().map(|r| r.seconds).sum()
    }

    /// The rows whose name contains `pattern`, and their total seconds.
    pub fn seconds_matching(&self, pattern: &str) -> f64 {
        self.rows.iter().filter(|r| r.name.contains(pattern)).map(|r| r.seconds).sum()
    }
}

impl fmt::Display for Profile {
    /// A Markdown table: every row, then the time outside any kernel and the wall time.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let share = |s: f64| if self.wall_seconds > 0.0 { 100.0 * s / self.wall_seconds } else { 0.0 };
        writeln!(f, "| kernel | calls | total ms | % of wall | mean µs |")?;
        writeln!(f, "| --- | ---: | ---: | ---: | ---: |")?;
        for r in &self.rows {
            let mean_us = 1e6 * r.seconds / r.calls.max(1) as f64;
            writeln!(
                f,
                "| {} | {} | {:.3} | {:.1} | {:.1} |",
                r.name,
                r.calls,
                1e3 * r.seconds,
                share(r.seconds),
                mean_us
            )?;
        }
        let outside = self.wall_seconds - self.kernel_seconds();
        writeln!(f, "| (outside any kernel) | | {:.3} | {:.1} | |", 1e3 * outside, share(outside))?;
        write!(f, "| (wall) | | {:.3} | 100.0 | |", 1e3 * self.wall_seconds)
    }
}
