//! # amp-core: typed mixed-precision tensors, autograd and training on the CPU
//!
//! Precision is the element type (`Tensor<f16>`, `Tensor<bf16>`, `Tensor<f32>`), so mixing
//! precisions by mistake does not compile, and [`Tensor::cast`] is the one (differentiable)
//! way to change it. Low-precision tensors store f16/bf16 but every kernel accumulates in f32
//! and rounds once.
//!
//! ```
//! use amp_core::{Param, Tensor, Rng};
//! use half::f16;
//!
//! let mut rng = Rng::seed(0);
//! let w = Param::new(Tensor::<f32>::randn(&[4, 3], &mut rng)); // f32 master weight
//! let x = Tensor::<f32>::randn(&[2, 4], &mut rng);
//! // The matmul runs in f16 (f32 accumulation); the loss is reduced in f32.
//! let y = x.cast::<f16>().matmul(&w.cast::<f16>());
//! let loss = y.cast::<f32>().square().mean_all();
//! let grads = loss.backward();
//! let gw: &Tensor<f32> = grads.get(&w).unwrap(); // the gradient comes back in f32
//! assert_eq!(gw.shape(), &[4, 3]);
//! ```

pub mod autograd;
pub mod checkpoint;
pub mod clip;
pub mod data;
pub mod nn;
pub mod optim;
pub mod policy;
pub mod scaler;
#[doc(hidden)]
pub mod __private;
pub(crate) mod cpu;
pub mod device;
pub mod error;
pub mod indices;
pub mod layout;
pub mod ops;
pub mod param;
pub mod precision;
pub mod rng;
pub mod tensor;

pub use autograd::{AnyTensor, Grads, NoGradGuard, TensorId, is_grad_enabled, no_grad};
pub use device::{Cpu, Device};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use indices::{Indices, Mask};
pub use ops::loss::CrossEntropyOptions;
pub use param::{Param, Params};
pub use precision::{DType, NeedsLossScaling, Precision, Promote, Promoted};
pub use rng::Rng;
pub use tensor::Tensor;

/// The names most programs need.
pub mod prelude {
    pub use crate::{DType, Grads, Indices, Mask, Param, Params, Precision, Rng, Tensor, bf16, f16, no_grad};
}
