//! Devices: where a tensor's storage lives.
//!
//! `Tensor<E, D = Cpu>` carries its device as a type, like its precision. The CPU backend is
//! here; `amp-cuda` adds `Cuda` with its own storage type.
//!
//! Each device has a caching allocator; the CPU's is in [`crate::cpu_memory`].

use std::sync::Arc;

use crate::cpu_memory::PooledVec;
use crate::precision::Precision;

/// A device a tensor can live on.
pub trait Device: Clone + Send + Sync + std::fmt::Debug + Default + 'static {
    /// The storage of a tensor of precision `E` on this device.
    type Storage<E: Precision>: Clone + Send + Sync;
    /// The device's name in messages (`cpu`, `cuda:0`).
    fn name(&self) -> String;
}

/// The CPU: storage is a shared buffer from the caching allocator ([`crate::cpu_memory`]),
/// kernels run on rayon's thread pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cpu;

impl Device for Cpu {
    type Storage<E: Precision> = Arc<PooledVec<E>>;
    fn name(&self) -> String {
        "cpu".into()
    }
}
