//! The CPU caching allocator's statistics and controls, named after PyTorch's
//! `torch.cuda.memory_allocated`, `memory_reserved`, `max_memory_allocated`, `empty_cache` and
//! `reset_peak_memory_stats`.
//!
//! Every CPU tensor's storage comes from one process-wide caching allocator: a freed buffer of
//! at least [`POOL_MIN_BYTES`] is kept in a free list of its element type and size class
//! (eight classes per octave, so under 1/8 is wasted) and handed out again for the next
//! request of that class, instead of going back to the operating system. A training step
//! allocates the same buffers every step, so from the second step on they come from the
//! cache: no page faults, no zero-filling of fresh pages. The cache holds at most
//! [`cache_limit`] bytes ([`DEFAULT_CACHE_LIMIT`] unless [`set_cache_limit`] says otherwise).
//!
//! ```
//! # extern crate amp_core as amp;
//! use amp::{Tensor, cpu_memory};
//!
//! let before = cpu_memory::memory_allocated();
//! let t = Tensor::<f32>::zeros(&[1024, 1024]); // 4 MiB
//! assert!(cpu_memory::memory_allocated() >= before + (4 << 20));
//! drop(t); // the buffer goes to the cache, not back to the system
//! assert!(cpu_memory::memory_reserved() >= cpu_memory::memory_allocated());
//! cpu_memory::empty_cache(); // now it goes back
//! ```

use crate::cpu::alloc::global;
pub use crate::cpu::alloc::{DEFAULT_CACHE_LIMIT, MemoryStats, POOL_MIN_BYTES, PooledVec};

/// All the statistics at once (in use, cached, peak, cache hits and misses, the cap).
pub fn memory_stats() -> MemoryStats {
    global().stats()
}

/// Bytes held by live CPU tensor buffers (PyTorch's `memory_allocated`). Buffers that are not
/// tensor storage, such as optimizer state (plain vectors allocated once), are not counted.
pub fn memory_allocated() -> usize {
    global().stats().bytes_in_use
}

/// Bytes the allocator holds: in use plus cached (PyTorch's `memory_reserved`).
pub fn memory_reserved() -> usize {
    global().stats().bytes_reserved()
}

/// The highest [`memory_allocated`] since the start or the last [`reset_peak_memory_stats`]
/// (PyTorch's `max_memory_allocated`).
pub fn max_memory_allocated() -> usize {
    global().stats().peak_bytes_in_use
}

/// Starts the peak over from what is in use now (PyTorch's `reset_peak_memory_stats`).
pub fn reset_peak_memory_stats() {
    global().reset_peak()
}

/// Frees every cached buffer (buffers in use are untouched); returns the bytes released
/// (PyTorch's `empty_cache`).
pub fn empty_cache() -> usize {
    global().empty_cache()
}

/// The cap on cached bytes.
pub fn cache_limit() -> usize {
    global().stats().cache_limit
}

/// Sets the cap on cached bytes (0 turns caching off); a cache holding more is emptied.
pub fn set_cache_limit(bytes: usize) {
    global().set_cache_limit(bytes)
}
