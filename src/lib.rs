//! # amp: typed mixed-precision training for Rust
//!
//! One name for the whole library: [`amp_core`] (tensors, autograd, training),
//! [`amp_macros`] (`#[autocast]`), and with feature `cuda`, `amp_cuda`. Feature `trainer` adds
//! the `trainer` and `train_utils` modules (the runs behind `cargo run --example train`, with
//! a progress bar and a loss plot); without it a dependent builds the library alone.
//!
//! ```
//! use amp::prelude::*;
//! let x = Tensor::<f32>::ones(&[2, 2]).cast::<f16>();
//! assert_eq!(x.dtype(), DType::F16);
//! ```

pub use amp_core;
pub use amp_core::*;
#[cfg(feature = "cuda")]
pub use amp_cuda;

/// The CUDA backend (feature `cuda`): the [`cuda::Cuda`] device and its storage types, the
/// `amp_cuda` crate under a short name.
#[cfg(feature = "cuda")]
pub mod cuda {
    pub use amp_cuda::*;
}
pub use amp_macros;

#[cfg(feature = "trainer")]
pub mod train_utils;
#[cfg(feature = "trainer")]
pub mod trainer;

/// The names most programs need.
pub mod prelude {
    pub use amp_core::prelude::*;
}
