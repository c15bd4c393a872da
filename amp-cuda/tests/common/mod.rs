//! Shared by the tests that need a GPU: open device 0 or say why not.

use amp_cuda::Cuda;

/// Device 0, or `None` after printing `SKIPPED: no CUDA device (<reason>)` for `test`: such a
/// test then returns without checking anything, and does not count as a pass of the GPU code.
pub fn cuda_or_skip(test: &str) -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(c) => Some(c),
        Err(e) => {
            println!("SKIPPED: no CUDA device ({e}) [{test}]");
            None
        }
    }
}
