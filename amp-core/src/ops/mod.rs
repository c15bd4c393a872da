//! Tensor ops, one file per op family. See `README.md` in this folder for how to add one.
//!
//! Every op has a `try_` form returning [`crate::Error`] (naming the op and the shapes) and a
//! plain form that panics with the same message. Ops are methods on `Tensor<E, D>` for every
//! device `D`: an op checks its arguments, calls its kernel through the backend trait
//! ([`crate::Device`]) and records its backward. Nothing here touches memory; the CPU kernels
//! are in `crate::cpu`, the CUDA ones in `amp-cuda`.

pub mod attention;
pub mod batch_norm;
pub mod binary;
pub mod conv;
pub mod dropout;
pub mod embedding;
pub mod index;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod pool;
pub mod reduce;
pub mod softmax;
pub mod unary;
