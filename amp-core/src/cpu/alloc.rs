//! The CPU caching allocator: large tensor buffers are kept when freed and handed out again on
//! the next request of their size class, instead of going back to the operating system.
//!
//! Design notes:
//! - Why: a training step allocates the same large buffers (activations, gradients, casts)
//!   every step and frees them by its end. glibc gives large freed blocks back to the kernel
//!   (`munmap`, or trimming the top of the heap), so the next step's buffer faults in fresh
//!   pages, each mapped and zeroed by the kernel on first touch: about 10,000 minor page
//!   faults (40 MB) per W2 bf16 step before this pool, 5 after. PyTorch's CUDA caching allocator is the model (there,
//!   `cudaMalloc` synchronises the device, so caching is what makes allocation affordable).
//! - One pool per element type (f16, bf16, f32, f64): a buffer is only ever handed out again
//!   as the type it was allocated as, so it is freed with the layout it was allocated with and
//!   never reinterpreted.
//! - Size classes: a request of `n` elements is rounded up to the next class, eight classes
//!   per octave (`m · 2^s` with `m` in 8..16), so a buffer wastes under 1/8 of its size and a
//!   cached buffer fits every request of its class. A buffer coming back is cached only if its
//!   capacity is a class size: every buffer the allocator made is; a `Vec` built elsewhere (a
//!   user's `from_vec` data, a `collect`) usually is not, and is freed. So the buffers of a
//!   class never outnumber the most that were live at once, and a loop that allocates the
//!   same way every step holds a flat amount of memory: the cache cannot creep up to its cap.
//! - Only buffers of at least [`POOL_MIN_BYTES`] are cached; malloc keeps smaller ones in its
//!   own free lists and reuses them for any size, without faults.
//! - A cap on cached bytes ([`CachingAllocator::set_cache_limit`]; 4 GiB by default for the
//!   process-wide allocator): a freed buffer that would exceed it first evicts buffers of its
//!   pool, least recently used class first, and is freed itself if that is not enough.
//! - Contents: [`CachingAllocator::take`] returns a buffer whose values are unspecified (stale
//!   values of an earlier use, always initialised `E`s, so reading them is safe but
//!   meaningless); kernels that write every element use it, and skip the zero-fill.
//!   [`CachingAllocator::zeroed`] is for kernels that accumulate or leave elements untouched.
//!   In debug builds `take` fills its buffer with NaN, so a kernel that reads an output
//!   element before writing it fails the tests instead of reading stale data in release.
//! - Accounting: `bytes_in_use` is the capacity of every live [`PooledVec`] (tensor storage
//!   of any size: PyTorch's `memory_allocated`), `bytes_cached` what the free lists hold.
//!   Counters are atomics; the free lists take one `Mutex` per pool, once per large
//!   allocation or free (microseconds, against the milliseconds of work on such a buffer).
//! - The process-wide allocator is [`global()`]; the public face is `crate::cpu_memory`.
//!   Tests build their own [`CachingAllocator`]s so their counts are not disturbed by other
//!   tests running in parallel.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use half::{bf16, f16};

use crate::precision::{DType, Precision};

/// Buffers smaller than this many bytes are not cached (malloc serves them without faults).
pub const POOL_MIN_BYTES: usize = 64 * 1024;

/// The process-wide allocator's default cap on cached bytes.
pub const DEFAULT_CACHE_LIMIT: usize = 4 << 30;

/// The smallest size class (in elements) that holds `n` elements.
pub(crate) fn class_of(n: usize) -> usize {
    if n < 16 {
        return n;
    }
    let shift = usize::BITS - 1 - n.leading_zeros() - 3;
    n.div_ceil(1 << shift) << shift
}

/// Whether `cap` elements is a size class (what every buffer the allocator makes has).
fn is_class(cap: usize) -> bool {
    class_of(cap) == cap
}

/// One size class's free buffers.
struct Bucket<E> {
    free: Vec<Vec<E>>,
    /// The allocator's clock when a buffer of this class was last taken or given back.
    last_use: u64,
}

/// The free lists of one element type, keyed by size class (elements).
struct Pool<E> {
    buckets: Mutex<BTreeMap<usize, Bucket<E>>>,
}

impl<E> Pool<E> {
    const fn new() -> Self {
        Pool { buckets: Mutex::new(BTreeMap::new()) }
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Bucket<E>>> {
        // A panic while the lock was held left the map consistent (every change is one
        // insert or remove), so a poisoned lock is still usable.
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A caching allocator for CPU tensor buffers: size-classed free lists per element type, a cap
/// on what they hold, and the statistics. The process-wide one is [`global()`].
pub(crate) struct CachingAllocator {
    f16: Pool<f16>,
    bf16: Pool<bf16>,
    f32: Pool<f32>,
    f64: Pool<f64>,
    in_use: AtomicUsize,
    peak: AtomicUsize,
    cached: AtomicUsize,
    limit: AtomicUsize,
    hits: AtomicU64,
    misses: AtomicU64,
    clock: AtomicU64,
}

/// A snapshot of an allocator's statistics (`crate::cpu_memory::memory_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held by live tensor buffers (their capacity), small ones included: PyTorch's
    /// `memory_allocated`.
    pub bytes_in_use: usize,
    /// Bytes of freed buffers kept for reuse.
    pub bytes_cached: usize,
    /// The highest `bytes_in_use` since the start or the last reset of the peak: PyTorch's
    /// `max_memory_allocated`.
    pub peak_bytes_in_use: usize,
    /// Large allocations served from the cache.
    pub hits: u64,
    /// Large allocations the cache had no buffer for (allocated fresh).
    pub misses: u64,
    /// The cap on `bytes_cached`.
    pub cache_limit: usize,
}

impl MemoryStats {
    /// Everything the allocator holds: `bytes_in_use + bytes_cached` (PyTorch's
    /// `memory_reserved`).
    pub fn bytes_reserved(&self) -> usize {
        self.bytes_in_use + self.bytes_cached
    }
}

static GLOBAL: CachingAllocator = CachingAllocator::new(DEFAULT_CACHE_LIMIT);

/// The process-wide allocator every CPU tensor's storage comes from.
pub(crate) fn global() -> &'static CachingAllocator {
    &GLOBAL
}

fn bytes_of<E>(elements: usize) -> usize {
    elements * size_of::<E>()
}

impl CachingAllocator {
    /// An allocator with empty caches holding at most `cache_limit` bytes.
    pub(crate) const fn new(cache_limit: usize) -> Self {
        CachingAllocator {
            f16: Pool::new(),
            bf16: Pool::new(),
            f32: Pool::new(),
            f64: Pool::new(),
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            cached: AtomicUsize::new(0),
            limit: AtomicUsize::new(cache_limit),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            clock: AtomicU64::new(0),
        }
    }

    /// The pool of element type `E`.
    fn pool<E: Precision>(&self) -> &Pool<E> {
        let pool: &dyn Any = match E::DTYPE {
            DType::F16 => &self.f16,
            DType::BF16 => &self.bf16,
            DType::F32 => &self.f32,
            DType::F64 => &self.f64,
        };
        pool.downcast_ref().expect("each precision has its own pool")
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// A buffer of `n` elements and whether its values are known to be zero (a fresh one).
    fn take_raw<E: Precision>(&self, n: usize) -> (Vec<E>, bool) {
        if bytes_of::<E>(n) < POOL_MIN_BYTES {
            return (crate::precision::zeroed(n), true);
        }
        let class = class_of(n);
        let reused = {
            let mut buckets = self.pool::<E>().lock();
            let bucket = buckets.get_mut(&class);
            bucket.and_then(|b| {
                b.last_use = self.tick();
                b.free.pop()
            })
        };
        match reused {
            Some(mut v) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                self.cached.fetch_sub(bytes_of::<E>(v.capacity()), Ordering::Relaxed);
                // Elements up to the old length keep their (initialised) stale values.
                v.truncate(n);
                v.resize(n, E::default());
                (v, false)
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                // calloc'd: the kernel maps zero pages lazily, no fill pass.
                let mut v = crate::precision::zeroed::<E>(class);
                v.truncate(n);
                (v, true)
            }
        }
    }

    /// A buffer of `n` elements whose values are unspecified (NaN in debug builds): for
    /// kernels that write every element. From the cache when it holds one of the class.
    pub(crate) fn take<E: Precision>(&self, n: usize) -> Vec<E> {
        let (mut v, _) = self.take_raw::<E>(n);
        if cfg!(debug_assertions) {
            v.fill(E::from_f64(f64::NAN));
        }
        v
    }

    /// A buffer of `n` zeros, from the cache when it holds one of the class.
    pub(crate) fn zeroed<E: Precision>(&self, n: usize) -> Vec<E> {
        let (mut v, zero) = self.take_raw::<E>(n);
        if !zero {
            v.fill(E::default());
        }
        v
    }

    /// A buffer of `n` copies of `value`, from the cache when it holds one of the class.
    pub(crate) fn filled<E: Precision>(&self, n: usize, value: E) -> Vec<E> {
        let (mut v, _) = self.take_raw::<E>(n);
        v.fill(value);
        v
    }

    /// A copy of `src`, in a buffer from the cache when it holds one of the class.
    pub(crate) fn copy_of<E: Precision>(&self, src: &[E]) -> Vec<E> {
        let (mut v, _) = self.take_raw::<E>(src.len());
        v.copy_from_slice(src);
        v
    }

    /// Takes `v` into the cache (or frees it: small, not of a class size, over the cap).
    fn give<E: Precision>(&self, v: Vec<E>) {
        let (class, bytes) = (v.capacity(), bytes_of::<E>(v.capacity()));
        if bytes < POOL_MIN_BYTES || !is_class(class) {
            return;
        }
        if bytes > self.limit.load(Ordering::Relaxed) {
            return; // would never fit: evicting others for it would only empty the cache
        }
        let mut evicted = Vec::new();
        let mut buckets = self.pool::<E>().lock();
        // Reserve room under the cap, evicting least recently used classes of this pool.
        let reserved = loop {
            let limit = self.limit.load(Ordering::Relaxed);
            let fits = self.cached.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                c.checked_add(bytes).filter(|&after| after <= limit)
            });
            if fits.is_ok() {
                break true;
            }
            let oldest = buckets.iter().filter(|(_, b)| !b.free.is_empty()).min_by_key(|(_, b)| b.last_use);
            let Some(key) = oldest.map(|(k, _)| *k) else { break false };
            let buf = buckets.get_mut(&key).and_then(|b| b.free.pop()).expect("non-empty bucket");
            self.cached.fetch_sub(bytes_of::<E>(buf.capacity()), Ordering::Relaxed);
            evicted.push(buf);
        };
        if reserved {
            let last_use = self.tick();
            let bucket = buckets.entry(class).or_insert_with(|| Bucket { free: Vec::new(), last_use });
            bucket.last_use = last_use;
            bucket.free.push(v);
        } else {
            evicted.push(v);
        }
        // Free outside the lock: returning large blocks to the OS takes a system call.
        drop(buckets);
        drop(evicted);
    }

    /// Frees every cached buffer of type `E`; returns the bytes released.
    fn empty_pool<E: Precision>(&self) -> usize {
        let freed: Vec<Vec<E>> =
            std::mem::take(&mut *self.pool::<E>().lock()).into_values().flat_map(|b| b.free).collect();
        let bytes = freed.iter().map(|v| bytes_of::<E>(v.capacity())).sum();
        self.cached.fetch_sub(bytes, Ordering::Relaxed);
        bytes
    }

    /// Frees every cached buffer (buffers in use are not touched); returns the bytes released.
    /// PyTorch's `torch.cuda.empty_cache`.
    pub(crate) fn empty_cache(&self) -> usize {
        self.empty_pool::<f16>() + self.empty_pool::<bf16>() + self.empty_pool::<f32>() + self.empty_pool::<f64>()
    }

    /// Sets the cap on cached bytes; if the cache holds more, it is emptied.
    pub(crate) fn set_cache_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
        if self.cached.load(Ordering::Relaxed) > bytes {
            self.empty_cache();
        }
    }

    /// The statistics now.
    pub(crate) fn stats(&self) -> MemoryStats {
        MemoryStats {
            bytes_in_use: self.in_use.load(Ordering::Relaxed),
            bytes_cached: self.cached.load(Ordering::Relaxed),
            peak_bytes_in_use: self.peak.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            cache_limit: self.limit.load(Ordering::Relaxed),
        }
    }

    /// Starts the peak over from the bytes in use now (PyTorch's `reset_peak_memory_stats`).
    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.in_use.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Wraps `v` as a buffer of this allocator: counted in use until dropped, then cached.
    pub(crate) fn adopt<E: Precision>(&'static self, v: Vec<E>) -> PooledVec<E> {
        let bytes = bytes_of::<E>(v.capacity());
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        PooledVec { buf: v, home: self }
    }
}

/// A tensor buffer that goes back to the caching allocator it came from when dropped: the
/// storage of a CPU tensor (`Arc<PooledVec<E>>`, see [`crate::cpu_memory`]). Reads and writes
/// as a slice; cloning (copy on write) takes the copy's buffer from the same allocator.
pub struct PooledVec<E: Precision> {
    buf: Vec<E>,
    home: &'static CachingAllocator,
}

impl<E: Precision> PooledVec<E> {
    /// The elements.
    pub fn as_slice(&self) -> &[E] {
        &self.buf
    }
    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [E] {
        &mut self.buf
    }
}

impl<E: Precision> From<Vec<E>> for PooledVec<E> {
    /// Adopts `v` into the process-wide allocator.
    fn from(v: Vec<E>) -> Self {
        global().adopt(v)
    }
}

impl<E: Precision> Drop for PooledVec<E> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.buf);
        self.home.in_use.fetch_sub(bytes_of::<E>(v.capacity()), Ordering::Relaxed);
        self.home.give(v);
    }
}

impl<E: Precision> Clone for PooledVec<E> {
    fn clone(&self) -> Self {
        self.home.adopt(self.home.copy_of(&self.buf))
    }
}

impl<E: Precision> Deref for PooledVec<E> {
    type Target = [E];
    fn deref(&self) -> &[E] {
        &self.buf
    }
}

impl<E: Precision> DerefMut for PooledVec<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        &mut self.buf
    }
}

impl<E: Precision> fmt::Debug for PooledVec<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.buf[..], f)
    }
}

impl fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingAllocator").field("stats", &self.stats()).finish()
    }
}

/// A buffer of `n` elements from the process-wide allocator, values unspecified (NaN in debug
/// builds): for kernels that write every element.
pub(crate) fn take<E: Precision>(n: usize) -> Vec<E> {
    global().take(n)
}

/// A buffer of `n` zeros from the process-wide allocator.
pub(crate) fn zeroed<E: Precision>(n: usize) -> Vec<E> {
    global().zeroed(n)
}

/// A copy of `src` in a buffer from the process-wide allocator.
pub(crate) fn copy_of<E: Precision>(src: &[E]) -> Vec<E> {
    global().copy_of(src)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allocator of its own for each test (never freed: tests are short).
    fn fresh(limit: usize) -> &'static CachingAllocator {
        Box::leak(Box::new(CachingAllocator::new(limit)))
    }

    /// Elements of `E` in `bytes` bytes.
    fn elems<E>(bytes: usize) -> usize {
        bytes / size_of::<E>()
    }

    #[test]
    fn classes_hold_the_request_and_waste_under_an_eighth() {
        for n in (1..5000).chain([8191, 8192, 8193, 1 << 20, (1 << 20) + 1, 3_000_000]) {
            let c = class_of(n);
            assert!(c >= n && (c - n) * 8 <= n, "{n} -> {c}");
            assert!(is_class(c), "{n} -> {c}");
        }
        // Eight classes per octave.
        let classes: std::collections::BTreeSet<_> = (1024..2048).map(class_of).collect();
        assert_eq!(classes.len(), 8 + 1, "1024..2048 spans eight classes and reaches 2048");
    }

    #[test]
    fn a_freed_buffer_is_reused_for_a_request_of_its_class() {
        let a = fresh(1 << 30);
        let n = elems::<f32>(1 << 20);
        let first = a.adopt(a.take::<f32>(n));
        let ptr = first.as_ptr();
        drop(first);
        let s = a.stats();
        assert_eq!((s.hits, s.misses), (0, 1));
        assert_eq!(s.bytes_in_use, 0);
        assert_eq!(s.bytes_cached, bytes_of::<f32>(class_of(n)));
        // A slightly smaller request of the same class gets the same buffer.
        let again = a.adopt(a.take::<f32>(n - 3));
        assert_eq!(again.as_ptr(), ptr);
        assert_eq!(again.len(), n - 3);
        let s = a.stats();
        assert_eq!((s.hits, s.misses, s.bytes_cached), (1, 1, 0));
        // A request of another class does not.
        let other = a.adopt(a.take::<f32>(2 * n));
        assert_ne!(other.as_ptr(), ptr);
        assert_eq!(a.stats().misses, 2);
    }

    #[test]
    fn only_buffers_of_a_class_size_are_cached() {
        let a = fresh(1 << 30);
        let n = (1 << 20) + 1; // not a class size
        assert!(!is_class(n));
        drop(a.adopt(vec![1.0f32; n]));
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 0), "a foreign buffer is freed");
        drop(a.adopt(vec![1.0f32; 1 << 20]));
        assert_eq!(a.stats().bytes_cached, 4 << 20, "one whose capacity is a class is kept");
        // Every buffer the allocator makes has a class capacity, whatever the request.
        drop(a.adopt(a.take::<f32>(n)));
        assert_eq!(a.stats().bytes_cached, (4 << 20) + bytes_of::<f32>(class_of(n)));
    }

    #[test]
    fn in_use_cached_and_peak_move_with_allocations() {
        let a = fresh(1 << 30);
        let n = elems::<bf16>(256 << 10);
        let b1 = a.adopt(a.take::<bf16>(n));
        let b2 = a.adopt(a.zeroed::<bf16>(n));
        let one = bytes_of::<bf16>(class_of(n));
        assert_eq!(a.stats().bytes_in_use, 2 * one);
        assert_eq!(a.stats().peak_bytes_in_use, 2 * one);
        drop(b1);
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached, s.peak_bytes_in_use), (one, one, 2 * one));
        assert_eq!(s.bytes_reserved(), 2 * one);
        a.reset_peak();
        assert_eq!(a.stats().peak_bytes_in_use, one);
        drop(b2);
        let s = a.stats();
        assert_eq!((s.bytes_in_use, s.bytes_cached), (0, 2 * one));
        // Small buffers count in use but are never cached.
        let small = a.adopt(a.take::<f32>(10));
        assert_eq!(a.stats().bytes_in_use, 40);
        drop(small);
        assert_eq!(a.stats().bytes_cached, 2 * one);
    }

    #[test]
    fn reused_buffers_are_zeroed_or_filled_when_asked() {
        let a = fresh(1 << 30);
        let n = elems::<f32>(1 << 20);
        let mut v = a.adopt(a.take::<f32>(n));
        v.fill(7.0);
        drop(v);
        let z = a.adopt(a.zeroed::<f32>(n));
        assert_eq!(a.stats().hits, 1);
        assert!(z.iter().all(|&x| x == 0.0));
        drop(z);
        let f = a.adopt(a.filled::<f32>(n, 2.5));
        assert!(f.iter().all(|&x| x == 2.5));
        drop(f);
        // `take` in a debug build poisons the buffer so stale values cannot go unnoticed.
        let t = a.take::<f32>(n);
        if cfg!(debug_assertions) {
            assert!(t.iter().all(|x| x.is_nan()));
        }
    }

    #[test]
    fn empty_cache_releases_everything_cached() {
        let a = fresh(1 << 30);
        let n = elems::<f64>(1 << 20);
        let kept = a.adopt(a.take::<f64>(n));
        drop(a.adopt(a.take::<f64>(n)));
        drop(a.adopt(a.take::<f16>(n)));
        let cached = a.stats().bytes_cached;
        assert!(cached > 0);
        assert_eq!(a.empty_cache(), cached);
        let s = a.stats();
        assert_eq!(s.bytes_cached, 0);
        assert_eq!(s.bytes_in_use, bytes_of::<f64>(class_of(n)), "buffers in use are untouched");
        drop(kept);
        // After emptying, the next request allocates afresh.
        let misses = a.stats().misses;
        let _ = a.empty_cache();
        let _again = a.take::<f64>(n);
        assert_eq!(a.stats().misses, misses + 1);
    }

    #[test]
    fn the_cap_is_respected_evicting_the_least_recently_used_class() {
        let one = 1 << 20;
        let a = fresh(3 * one);
        let (n1, n2) = (elems::<f32>(one), elems::<f32>(one) + elems::<f32>(one) / 4);
        assert_ne!(class_of(n1), class_of(n2));
        let bufs: Vec<_> = (0..3).map(|_| a.adopt(a.take::<f32>(n1))).collect();
        drop(bufs);
        assert_eq!(a.stats().bytes_cached, 3 * one);
        // A buffer of another class evicts two of the older class to fit under the cap.
        drop(a.adopt(a.take::<f32>(n2)));
        let s = a.stats();
        assert!(s.bytes_cached <= 3 * one, "{s:?}");
        assert_eq!(s.bytes_cached, one + bytes_of::<f32>(class_of(n2)));
        // A buffer larger than the cap is never cached, and evicts nothing.
        let before = a.stats().bytes_cached;
        drop(a.adopt(a.take::<f32>(elems::<f32>(4 * one))));
        assert_eq!(a.stats().bytes_cached, before);
        // Lowering the cap below what is cached empties the cache.
        a.set_cache_limit(one / 2);
        assert_eq!(a.stats().bytes_cached, 0);
        drop(a.adopt(a.take::<f32>(n1)));
        assert_eq!(a.stats().bytes_cached, 0);
    }

    #[test]
    fn buffers_of_different_element_types_never_mix() {
        let a = fresh(1 << 30);
        // f16 and bf16 have the same size and alignment: the case a shared pool would mix.
        let n = elems::<f16>(1 << 20);
        let h = a.adopt(a.take::<f16>(n));
        let ptr = h.as_ptr() as usize;
        drop(h);
        let b = a.adopt(a.take::<bf16>(n));
        assert_ne!(b.as_ptr() as usize, ptr);
        assert_eq!(a.stats().hits, 0);
        let h2 = a.adopt(a.take::<f16>(n));
        assert_eq!(h2.as_ptr() as usize, ptr);
        assert_eq!(a.stats().hits, 1);
    }

    #[test]
    fn clones_come_from_the_pool_and_copy_the_values() {
        let a = fresh(1 << 30);
        let n = elems::<f32>(1 << 20);
        let mut v = a.adopt(a.take::<f32>(n));
        v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
        drop(a.adopt(a.take::<f32>(n)));
        let c = v.clone();
        assert_eq!(a.stats().hits, 1);
        assert_eq!(&c[..], &v[..]);
        assert_eq!(a.stats().bytes_in_use, 2 * bytes_of::<f32>(class_of(n)));
    }

    #[test]
    fn concurrent_use_from_threads_keeps_the_counts() {
        let a = fresh(1 << 30);
        // Element counts whose bf16 buffers are large enough to be cached too.
        let sizes = [elems::<bf16>(64 << 10), elems::<bf16>(200 << 10), elems::<bf16>(1 << 20)];
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for i in 0..200 {
                        let n = sizes[(i + t) % sizes.len()];
                        let mut v = a.adopt(a.take::<f32>(n));
                        v[0] = t as f32;
                        v[n - 1] = i as f32;
                        assert_eq!((v[0], v[n - 1]), (t as f32, i as f32));
                        let w = a.adopt(a.zeroed::<bf16>(n));
                        assert!(w.iter().all(|x| *x == bf16::ZERO));
                    }
                });
            }
        });
        let s = a.stats();
        assert_eq!(s.bytes_in_use, 0);
        assert_eq!(s.hits + s.misses, 4 * 200 * 2);
        // At most one buffer per class and thread is ever live at once, so the cache holds no more.
        let per_thread: usize =
            sizes.iter().map(|&n| bytes_of::<f32>(class_of(n)) + bytes_of::<bf16>(class_of(n))).sum();
        assert!(s.bytes_cached <= 4 * per_thread, "{s:?}");
        assert!(s.misses <= 4 * 2 * sizes.len() as u64, "{s:?}");
    }
}
