//! The CUDA backend for amp, on `cudarc` (cuBLAS GEMM with f32 compute, NVRTC kernels).
//!
//! Not yet implemented: this crate currently holds only its skeleton. Its own issue adds
//! device storage, kernels and the fused scaler and optimizer passes.
