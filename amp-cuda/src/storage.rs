//! Tensor storage in device memory, and what the fused row kernels keep for backward.
//!
//! Design notes:
//! - A [`CudaStorage`] is a shared handle (`Arc`) to one block of the device's caching
//!   allocator plus its element count; cloning shares the block, dropping the last handle gives
//!   the block back to the allocator (no synchronisation: see `crate::alloc`). The element type
//!   is a marker: the block is plain bytes on the device.
//! - A storage keeps its device's state alive, so a block always goes back to the allocator
//!   that made it.
//! - [`CudaRowStats`] holds device vectors in the accumulation type (f32, or f64 for f64).

use std::marker::PhantomData;
use std::sync::Arc;

use amp_core::Precision;

use crate::alloc::Block;
use crate::device::State;

/// A device block owned by a storage (or by a kernel's scratch space).
pub(crate) struct DeviceBuffer {
    block: Option<Block>,
    state: Arc<State>,
}

impl DeviceBuffer {
    /// A block of at least `bytes` bytes (contents unspecified).
    pub(crate) fn new(state: &Arc<State>, bytes: usize) -> Self {
        DeviceBuffer { block: Some(state.take(bytes)), state: state.clone() }
    }
    /// The device address (0 for an empty buffer).
    pub(crate) fn ptr(&self) -> u64 {
        self.block.as_ref().map_or(0, |b| b.ptr)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            self.state.alloc.give(b);
        }
    }
}

/// The storage of a `Tensor<E, Cuda>`: `len` elements of `E` in device memory.
pub struct CudaStorage<E> {
    pub(crate) buf: Arc<DeviceBuffer>,
    pub(crate) len: usize,
    _e: PhantomData<fn() -> E>,
}

impl<E: amp_core::Precision> std::fmt::Debug for CudaStorage<E> {
    /// The element type and count (not the device memory's contents: reading them would wait).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage<{}>[{}]", E::DTYPE.name(), self.len)
    }
}

impl<E> Clone for CudaStorage<E> {
    fn clone(&self) -> Self {
        CudaStorage { buf: self.buf.clone(), len: self.len, _e: PhantomData }
    }
}

impl<E: Precision> CudaStorage<E> {
    /// `len` elements, contents unspecified (for kernels that write every element).
    pub(crate) fn uninit(state: &Arc<State>, len: usize) -> Self {
        let bytes = len * E::DTYPE.size_in_bytes();
        CudaStorage { buf: Arc::new(DeviceBuffer::new(state, bytes)), len, _e: PhantomData }
    }
    /// The device address of element 0.
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr()
    }
    /// The device address of element `offset`.
    pub(crate) fn ptr_at(&self, offset: usize) -> u64 {
        self.buf.ptr() + (offset * E::DTYPE.size_in_bytes()) as u64
    }
    /// The same block seen as precision `T`, which must be `E` itself (for code generic over
    /// two precision parameters that turn out equal).
    pub(crate) fn retype<T: Precision>(self) -> CudaStorage<T> {
        assert_eq!(E::DTYPE, T::DTYPE, "retype between different precisions");
        CudaStorage { buf: self.buf, len: self.len, _e: PhantomData }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the storage holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A device vector of raw elements of `size` bytes each (the accumulation type of the row
/// statistics, the f64 partial sums of the losses, index arrays).
pub(crate) struct RawVec {
    pub(crate) buf: DeviceBuffer,
}

impl RawVec {
    pub(crate) fn new(state: &Arc<State>, len: usize, size: usize) -> Self {
        RawVec { buf: DeviceBuffer::new(state, len * size) }
    }
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr()
    }
}

/// What a fused row kernel keeps for its backward, in device memory in `E`'s accumulation type.
pub struct CudaRowStats<E> {
    pub(crate) kind: StatsKind,
    /// Norms: row (or channel) means; cross-entropy: row log-sum-exps.
    pub(crate) a: RawVec,
    /// Norms: reciprocal standard deviations; cross-entropy: unused (empty).
    pub(crate) b: RawVec,
    _e: PhantomData<fn() -> E>,
}

/// Which kernel made a [`CudaRowStats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StatsKind {
    Norm,
    LogSumExp,
    Channels,
}

impl<E> CudaRowStats<E> {
    pub(crate) fn new(kind: StatsKind, a: RawVec, b: RawVec) -> Self {
        CudaRowStats { kind, a, b, _e: PhantomData }
    }
}

/// An f32 optimizer-state vector (moments, momentum buffers) in device memory.
///
/// Unlike a tensor storage, cloning it copies the values (a device-to-device copy on the
/// stream): the CPU's state is a `Vec<f32>`, and an optimizer that clones its state must not
/// see the copy change under later in-place updates.
pub struct CudaStateVec(pub(crate) CudaStorage<f32>);

impl Clone for CudaStateVec {
    fn clone(&self) -> Self {
        let state = &self.0.buf.state;
        state.enter();
        let copy = CudaStorage::<f32>::uninit(state, self.0.len);
        if self.0.len > 0 {
            // SAFETY: both blocks hold `len` f32s; the copy is ordered on the device's stream
            // after every earlier write of the source.
            let r = unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    copy.ptr(),
                    self.0.ptr(),
                    self.0.len * 4,
                    state.stream.cu_stream(),
                )
            };
            state.check("cuMemcpyDtoDAsync", r);
        }
        CudaStateVec(copy)
    }
}

impl std::fmt::Debug for CudaStateVec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStateVec({} f32 on {})", self.0.len, self.0.buf.state.name())
    }
}
