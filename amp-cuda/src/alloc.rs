//! The per-device caching allocator: freed device blocks are kept in size-classed free lists
//! and handed out again, instead of going back to the driver.
//!
//! Design notes:
//! - Why: `cuMemAlloc` and `cuMemFree` synchronise the device, and a training step allocates
//!   and frees the same blocks every step. PyTorch's CUDA caching allocator is the model (the
//!   CPU backend's allocator, `amp_core::cpu_memory`, follows it too).
//! - Blocks are untyped bytes: a request is rounded up to a size class (at least 512 bytes,
//!   then eight classes per octave, so under 1/8 is wasted) and a free block serves any later
//!   request of its class, whatever the element type.
//! - Stream order makes reuse safe without events: a device has one stream, every kernel and
//!   copy runs on it, so the next user of a block is ordered after every earlier use. Blocks
//!   go back to the driver only from [`CachingAllocator::empty_cache`], after the stream is
//!   synchronised.
//! - When the driver is out of memory, the cache is emptied and the allocation tried once more.
//! - A cap on cached bytes (none by default): a freed block that would exceed it is freed.
//! - Accounting (PyTorch's names): `bytes_in_use` is the class bytes of live blocks
//!   (`memory_allocated`), `bytes_cached` what the free lists hold, the peak of in-use bytes,
//!   hits and misses. Counters are atomics; the free lists take one mutex per allocation.
//! - The allocator is generic over [`RawMemory`], the driver calls, so its bookkeeping is
//!   tested on machines without a GPU.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

pub use amp_core::cpu_memory::MemoryStats;

/// The smallest block the allocator hands out (PyTorch rounds to 512 bytes too).
pub const MIN_BLOCK: usize = 512;

/// The size class (bytes) that holds `bytes`: a multiple of [`MIN_BLOCK`], eight classes per
/// octave above 4 KiB.
pub fn class_of(bytes: usize) -> usize {
    let b = bytes.max(1).div_ceil(MIN_BLOCK) * MIN_BLOCK;
    if b <= 8 * MIN_BLOCK {
        return b;
    }
    let shift = usize::BITS - 1 - b.leading_zeros() - 3;
    b.div_ceil(1 << shift) << shift
}

/// The driver calls the allocator makes.
pub trait RawMemory: Send + Sync {
    /// A driver error.
    type Error: std::fmt::Debug;
    /// A fresh device block of `bytes` bytes.
    fn alloc(&self, bytes: usize) -> Result<u64, Self::Error>;
    /// Frees a block the allocator made (the stream has been synchronised).
    fn free(&self, ptr: u64);
    /// Waits for every queued kernel and copy.
    fn synchronize(&self);
    /// Whether an allocation error means the device is out of memory.
    fn is_out_of_memory(e: &Self::Error) -> bool;
}

/// A device block: its address and its class size in bytes. A zero-byte block has address 0.
#[derive(Debug, PartialEq, Eq)]
pub struct Block {
    /// The device address.
    pub ptr: u64,
    /// The class size in bytes.
    pub bytes: usize,
}

/// A caching allocator over one device's memory.
pub struct CachingAllocator<M: RawMemory> {
    mem: M,
    free: Mutex<BTreeMap<usize, Vec<u64>>>,
    in_use: AtomicUsize,
    peak: AtomicUsize,
    cached: AtomicUsize,
    limit: AtomicUsize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl<M: RawMemory> CachingAllocator<M> {
    /// An allocator with an empty cache and no cap.
    pub fn new(mem: M) -> Self {
        CachingAllocator {
            mem,
            free: Mutex::new(BTreeMap::new()),
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            cached: AtomicUsize::new(0),
            limit: AtomicUsize::new(usize::MAX),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The driver calls underneath.
    pub fn raw(&self) -> &M {
        &self.mem
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Vec<u64>>> {
        // Every change to the map is one push or pop, so a poisoned lock left it consistent.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A block of at least `bytes` bytes (contents unspecified): from the cache when it holds
    /// one of the class, else fresh from the driver (after emptying the cache if the device is
    /// out of memory).
    pub fn take(&self, bytes: usize) -> Result<Block, M::Error> {
        if bytes == 0 {
            return Ok(Block { ptr: 0, bytes: 0 });
        }
        let class = class_of(bytes);
        let reused = self.lock().get_mut(&class).and_then(Vec::pop);
        let ptr = match reused {
            Some(ptr) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                self.cached.fetch_sub(class, Ordering::Relaxed);
                ptr
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                match self.mem.alloc(class) {
                    Ok(p) => p,
                    Err(e) if M::is_out_of_memory(&e) && self.cached.load(Ordering::Relaxed) > 0 => {
                        self.empty_cache();
                        self.mem.alloc(class)?
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let now = self.in_use.fetch_add(class, Ordering::Relaxed) + class;
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(Block { ptr, bytes: class })
    }

    /// Takes a block back: into the cache, or to the driver when the cache is at its cap.
    pub fn give(&self, block: Block) {
        if block.bytes == 0 {
            return;
        }
        self.in_use.fetch_sub(block.bytes, Ordering::Relaxed);
        let limit = self.limit.load(Ordering::Relaxed);
        let fits = self
            .cached
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_add(block.bytes).filter(|&a| a <= limit));
        if fits.is_ok() {
            self.lock().entry(block.bytes).or_default().push(block.ptr);
        } else {
            self.mem.synchronize();
            self.mem.free(block.ptr);
        }
    }

    /// Frees every cached block (blocks in use are untouched), after synchronising the
    /// stream; returns the bytes released (PyTorch's `empty_cache`).
    pub fn empty_cache(&self) -> usize {
        let blocks = std::mem::take(&mut *self.lock());
        if blocks.is_empty() {
            return 0;
        }
        self.mem.synchronize();
        let mut freed = 0;
        for (class, ptrs) in blocks {
            for p in ptrs {
                self.mem.free(p);
                freed += class;
            }
        }
        self.cached.fetch_sub(freed, Ordering::Relaxed);
        freed
    }

    /// Sets the cap on cached bytes (`usize::MAX`: none); a cache holding more is emptied.
    pub fn set_cache_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
        if self.cached.load(Ordering::Relaxed) > bytes {
            self.empty_cache();
        }
    }

    /// Starts the peak over from the bytes in use now.
    pub fn reset_peak(&self) {
        self.peak.store(self.in_use.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// The statistics now.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            bytes_in_use: self.in_use.load(Ordering::Relaxed),
            bytes_cached: self.cached.load(Ordering::Relaxed),
            peak_bytes_in_use: self.peak.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            cache_limit: self.limit.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Fake device memory: addresses count up, the calls are counted, and it can refuse once.
    #[derive(Default)]
    struct Fake {
        next: AtomicU64,
        allocs: AtomicUsize,
        frees: AtomicUsize,
        syncs: AtomicUsize,
        live: AtomicUsize,
        capacity: AtomicUsize,
        oom_once: AtomicBool,
    }

    impl RawMemory for Fake {
        type Error = &'static str;
        fn alloc(&self, bytes: usize) -> Result<u64, &'static str> {
            let cap = self.capacity.load(Ordering::Relaxed);
            if self.oom_once.swap(false, Ordering::Relaxed)
                || (cap > 0 && self.live.load(Ordering::Relaxed) + bytes > cap)
            {
                return Err("out of memory");
            }
            self.allocs.fetch_add(1, Ordering::Relaxed);
            self.live.fetch_add(bytes, Ordering::Relaxed);
            Ok(0x1000 + self.next.fetch_add(bytes as u64, Ordering::Relaxed))
        }
        fn free(&self, _ptr: u64) {
            self.frees.fetch_add(1, Ordering::Relaxed);
        }
        fn synchronize(&self) {
            self.syncs.fetch_add(1, Ordering::Relaxed);
        }
        fn is_out_of_memory(e: &&'static str) -> bool {
            *e == "out of memory"
        }
    }

    #[test]
    fn classes_round_up_by_less_than_an_eighth() {
        assert_eq!(class_of(1), 512);
        assert_eq!(class_of(512), 512);
        assert_eq!(class_of(513), 1024);
        assert_eq!(class_of(4096), 4096);
        for b in [5000usize, 65_537, 1 << 20, (1 << 30) + 7, 3_000_000_001] {
            let c = class_of(b);
            assert!(c >= b && (c - b) * 8 <= b, "{b} -> {c}");
            assert_eq!(class_of(c), c, "a class is its own class");
            assert_eq!(c % MIN_BLOCK, 0);
        }
    }

    #[test]
    fn freed_blocks_are_reused_by_their_class_and_counted() {
        let a = CachingAllocator::new(Fake::default());
        let b1 = a.take(1000).unwrap();
        assert_eq!(b1.bytes, 1024);
        let p1 = b1.ptr;
        assert_eq!(a.stats().bytes_in_use, 1024);
        a.give(b1);
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached, s.peak_bytes_in_use), (0, 1024, 1024));
        let b2 = a.take(700).unwrap(); // same class
        assert_eq!(b2.ptr, p1, "the cached block comes back");
        let b3 = a.take(700).unwrap(); // the cache is empty now
        assert_ne!(b3.ptr, p1);
        let s = a.stats();
        assert_eq!((s.hits, s.misses, s.bytes_in_use, s.peak_bytes_in_use), (1, 2, 2048, 2048));
        assert_eq!(a.raw().allocs.load(Ordering::Relaxed), 2);
        a.give(b2);
        a.give(b3);
        assert_eq!(a.empty_cache(), 2048);
        assert_eq!(a.raw().frees.load(Ordering::Relaxed), 2);
        assert!(a.raw().syncs.load(Ordering::Relaxed) >= 1, "blocks go back only after the stream is idle");
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0));
        a.reset_peak();
        assert_eq!(a.stats().peak_bytes_in_use, 0);
    }

    #[test]
    fn empty_requests_touch_no_memory() {
        let a = CachingAllocator::new(Fake::default());
        let b = a.take(0).unwrap();
        assert_eq!(b, Block { ptr: 0, bytes: 0 });
        a.give(b);
        assert_eq!(a.stats(), MemoryStats { cache_limit: usize::MAX, ..Default::default() });
    }

    #[test]
    fn out_of_memory_empties_the_cache_and_retries_once() {
        let a = CachingAllocator::new(Fake::default());
        let b = a.take(4096).unwrap();
        a.give(b);
        a.raw().oom_once.store(true, Ordering::Relaxed);
        let c = a.take(1 << 20).unwrap();
        assert_eq!(c.bytes, 1 << 20);
        assert_eq!(a.stats().bytes_cached, 0, "the cache was emptied to make room");
        assert_eq!(a.raw().frees.load(Ordering::Relaxed), 1);
        // A real shortage is still an error.
        a.raw().capacity.store(1, Ordering::Relaxed);
        assert_eq!(a.take(1 << 20), Err("out of memory"));
    }

    #[test]
    fn the_cap_frees_what_does_not_fit() {
        let a = CachingAllocator::new(Fake::default());
        let (x, y) = (a.take(2048).unwrap(), a.take(2048).unwrap());
        a.set_cache_limit(3000);
        a.give(x);
        a.give(y); // over the cap: freed
        assert_eq!(a.stats().bytes_cached, 2048);
        assert_eq!(a.raw().frees.load(Ordering::Relaxed), 1);
        a.set_cache_limit(0); // holds more than the new cap: emptied
        assert_eq!(a.stats().bytes_cached, 0);
    }
}
