//! Tensor ops, one file per op family. See `README.md` in this folder for how to add one.
//!
//! Every op has a `try_` form returning [`crate::Error`] (naming the op and the shapes) and a
//! plain form that panics with the same message. Ops are methods on `Tensor<E>`; their CPU
//! kernels are in `crate::cpu`, their CUDA halves in `amp-cuda/src/ops/<same name>.rs`.

pub mod binary;
pub mod matmul;
pub mod reduce;
pub mod unary;
// Filled in by the next commits (one per op family):
pub mod dropout;
pub mod embedding;
pub mod index;
pub mod loss;
pub mod norm;
pub mod softmax;
