//! WIP
pub mod kernels;
pub mod nvrtc;
