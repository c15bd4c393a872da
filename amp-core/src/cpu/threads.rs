//! The CPU compute threads: how many there are, and whether the thread that runs the training
//! loop is one of them.
//!
//! Every CPU op that splits its work runs it on rayon's global pool. Left to itself, rayon
//! starts one worker per logical CPU, and a thread outside the pool that starts an op hands
//! the op to the pool, sleeps, and is woken when it is done. A training step starts hundreds
//! of such ops, so it pays two thread wake-ups each: on a 2-core Xeon VM a W2 bf16 step made
//! about 1,750 context switches and took 0.110 s. [`init`] makes the calling thread one of
//! the compute threads, as PyTorch's OpenMP does for the thread that starts a parallel
//! region: an op started there begins at once on that thread, and the others take their
//! share from it. The same step then made about 350 context switches and took 0.096 s.
//!
//! ```
//! # extern crate amp_core as amp;
//! // First thing in `main`, on the thread that will run the training loop.
//! let threads = amp::cpu_threads::init(0)?; // 0: one per logical CPU
//! assert!(threads >= 1);
//! # Ok::<(), amp::Error>(())
//! ```
//!
//! Design notes:
//! - `init` builds rayon's global pool with the caller as worker 0
//!   (`ThreadPoolBuilder::use_current_thread`). That thread only runs pool jobs while it is
//!   inside a parallel op of its own; other threads' ops are run by the other workers. So a
//!   one-thread pool would never run another thread's op: with one thread, `init` starts a
//!   plain one-worker pool instead (the hand-off stays, there is nothing to share anyway).
//! - rayon starts its global pool on first use, so `init` must come before any op that runs
//!   in parallel (and before any other use of rayon's global pool); later, it returns an
//!   error and changes nothing: ops keep working, only without the saving.
//! - Without `init`, nothing changes: rayon's default pool, one worker per logical CPU
//!   (`RAYON_NUM_THREADS` overrides the count).
//! - The other workers spin for work between ops. rayon puts a worker to sleep
//!   after a few microseconds without work, and waking it takes tens: on the 2-core Xeon VM a
//!   fork-join of two 50 µs halves took 52 µs when the pool had been busy, 85 µs after 20 µs
//!   idle and 113-131 µs after 100 µs or more, one thread running both halves while the other
//!   woke. A step's ops are separated by serial work (autograd, the op layer, small ops) of
//!   about that length, so most parallel ops paid a wake-up. OpenMP, which PyTorch's CPU ops
//!   use, keeps its threads spinning for a while after each parallel region for the same
//!   reason (`GOMP_SPINCOUNT`, `KMP_BLOCKTIME`). After `init` with more than one thread, every
//!   backend op marks the time and, when none is running, starts one spin job per other
//!   worker: it runs the pool's jobs as they come (`rayon::yield_now`) and ends
//!   [`SPIN_WINDOW`] after the last op started, so an idle process sleeps. The caller's own
//!   thread never spins: it has the serial work. `AMP_CPU_SPIN=off` turns the spinning off
//!   (A/B benchmarks).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How long the other compute threads keep spinning for work after the last op started.
pub const SPIN_WINDOW: Duration = Duration::from_millis(2);

/// Set by [`init`] when the other workers spin between ops: the index of `init`'s thread in
/// the pool and how many others there are.
static SPIN: OnceLock<(usize, usize)> = OnceLock::new();
/// Spin jobs running (or queued).
static SPINNING: AtomicUsize = AtomicUsize::new(0);
/// When the last op started, in nanoseconds since [`epoch`].
static LAST_OP: AtomicU64 = AtomicU64::new(0);

/// The time origin of [`LAST_OP`].
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since [`epoch`].
fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// Starts the CPU compute threads with the calling thread as one of them, and returns how
/// many there are. `threads` is the count, the calling thread included; 0 means one per
/// logical CPU (`RAYON_NUM_THREADS` when set, as for rayon's default pool).
///
/// Call it first in `main`, from the thread that will run the training loop (see the module
/// docs for why). An `Error::State` if rayon's global pool is already running: an op that
/// ran in parallel, or other rayon use, came first.
pub fn init(threads: usize) -> Result<usize> {
    let threads = match threads {
        0 => default_threads(),
        n => n,
    };
    let builder = rayon::ThreadPoolBuilder::new().num_threads(threads);
    let builder = if threads > 1 { builder.use_current_thread() } else { builder };
    builder.build_global().map_err(|e| Error::State {
        context: "cpu_threads::init".into(),
        detail: format!(
            "{e}: call it first in main, before any op runs in parallel and before any other use \
             of rayon's global pool (ops still work, the calling thread just is not a compute thread)"
        ),
    })?;
    let spin_off = super::env_off("AMP_CPU_SPIN");
    if let (Some(index), false) = (rayon::current_thread_index(), spin_off) {
        epoch();
        let _ = SPIN.set((index, threads - 1));
    }
    Ok(threads)
}

/// Marks that an op is starting; after [`init`], starts the other workers' spin jobs if none
/// is running (module notes). Every CPU backend op calls it; it costs a clock read and two
/// atomic operations.
pub(crate) fn busy() {
    let Some(&(caller, others)) = SPIN.get() else { return };
    LAST_OP.store(now_ns(), Ordering::Relaxed);
    if SPINNING.load(Ordering::Relaxed) == 0
        && SPINNING.compare_exchange(0, others, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    {
        // One job per other worker, taken by whichever worker is free. The caller's thread,
        // if it takes one while waiting inside an op of its own, returns at once (it has the
        // serial work); that round then goes without one spinner. (A broadcast would queue a
        // job for the caller's thread that waits until it next enters the pool: forever, if
        // it never runs an op again.)
        for _ in 0..others {
            rayon::spawn(move || {
                if rayon::current_thread_index() != Some(caller) {
                    spin_for_work();
                }
                SPINNING.fetch_sub(1, Ordering::AcqRel);
            });
        }
    }
}

/// Runs the pool's jobs as they come until no op has started for [`SPIN_WINDOW`].
fn spin_for_work() {
    let window = SPIN_WINDOW.as_nanos() as u64;
    loop {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => {}
            Some(rayon::Yield::Idle) if now_ns().saturating_sub(LAST_OP.load(Ordering::Relaxed)) < window => {
                std::hint::spin_loop()
            }
            _ => return,
        }
    }
}

/// How many compute threads are spinning for work now (module notes): after [`init`] with
/// `n` threads, `n - 1` while ops keep starting, 0 once none has for [`SPIN_WINDOW`]; always
/// 0 without `init` or with `AMP_CPU_SPIN=off`.
pub fn spinning_threads() -> usize {
    SPINNING.load(Ordering::Acquire)
}

/// Whether the calling thread is one of the compute threads (after [`init`] on it, or on a
/// rayon worker): ops it starts then run without a hand-off.
pub fn is_compute_thread() -> bool {
    rayon::current_thread_index().is_some()
}

/// rayon's own default: `RAYON_NUM_THREADS` when it is a positive count, else the logical CPUs.
fn default_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
