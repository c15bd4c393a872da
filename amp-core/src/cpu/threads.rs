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
//! // First thing in `main`, on the thread that will run the training loop.
//! let threads = amp_core::cpu_threads::init(0)?; // 0: one per logical CPU
//! assert!(threads >= 1);
//! # Ok::<(), amp_core::Error>(())
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

use crate::error::{Error, Result};

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
    Ok(threads)
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
