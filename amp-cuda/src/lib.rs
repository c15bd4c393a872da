//! WIP
pub mod alloc;
mod backend;
mod device;
pub mod gemm;
pub mod kernels;
pub mod launch;
pub mod nvrtc;
mod storage;

pub use device::Cuda;
pub use storage::{CudaRowStats, CudaStateVec, CudaStorage};
