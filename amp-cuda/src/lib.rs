//! # amp-cuda: the CUDA backend of amp
//!
//! [`Cuda`] implements [`amp_core::Device`], so every op, autograd, the loss scaler, clipping
//! and the optimizers run on an NVIDIA GPU with `Tensor<E, Cuda>` for f32, f16, bf16 (and f64):
//! GEMMs on cuBLAS with f32 accumulation, every other kernel compiled at first use by NVRTC from
//! the CUDA C sources in this crate. The crate builds with no CUDA toolkit and no GPU (cudarc
//! loads libcuda, libcublas and libnvrtc at run time); without them [`Cuda::new`] returns an
//! error that says what is missing.
//!
//! ```no_run
//! use amp_core::{Rng, Tensor, f16};
//! use amp_cuda::Cuda;
//!
//! let gpu = Cuda::new(0)?; // an amp_core::Error when there is no driver or no GPU
//! let x = Tensor::<f32>::randn(&[64, 128], &mut Rng::seed(0)).to_device(&gpu).requires_grad_();
//! let w = Tensor::<f32>::randn(&[32, 128], &mut Rng::seed(1)).to_device(&gpu);
//! // f16 GEMM with f32 accumulation on cuBLAS, GELU from the op's CUDA C expression.
//! let y = x.cast::<f16>().linear(&w.cast::<f16>(), None).gelu();
//! let loss = y.cast::<f32>().square().mean_all();
//! let grads = loss.backward();
//! assert_eq!(grads.get(&x).unwrap().shape(), &[64, 128]);
//! println!("{:?}", gpu.memory_stats());
//! # Ok::<(), amp_core::Error>(())
//! ```
//!
//! Design notes:
//! - One state per GPU per process: a context, one stream (all work is stream-ordered, so the
//!   caching allocator reuses freed blocks at once), a cuBLAS handle, and the cache of compiled
//!   kernel modules, shared by every [`Cuda`] handle of that ordinal (`device`).
//! - Storage is a reference-counted block of the per-device caching allocator ([`alloc`]);
//!   kernels read strided and broadcast views in place where they can (`backend`).
//! - Kernel sources are header-free CUDA C ([`kernels`]), compiled for `compute_90` by
//!   [`nvrtc::compile_ptx`], the same function the tests use to compile every kernel without a
//!   GPU. Elementwise kernels are generated from the op values' CUDA C expressions
//!   (`UnaryOp::CUDA_FORWARD`, ...).
//! - The trait's kernel methods cannot return errors: a CUDA error inside one panics with the
//!   device, the op and the driver's message. Opening a device ([`Cuda::new`]) never panics.

pub mod alloc;
mod backend;
mod device;
mod gemm;
pub mod kernels;
pub mod launch;
pub mod nvrtc;
mod profile;
mod storage;

pub use alloc::MemoryStats;
pub use device::Cuda;
pub use storage::{CudaRowStats, CudaStateVec, CudaStorage};
