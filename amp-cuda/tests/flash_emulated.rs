//! The fused attention kernels (`src/kernels/attention_flash.cu`) run on this machine, GPU or
//! not: `tests/emulated/cuda_emu.hpp` emulates the CUDA features they use (threads, barriers,
//! warp shuffles, the tensor-core product by the PTX ISA's fragment layouts) under the real
//! prelude, and `tests/emulated/flash_attention.cpp` includes the kernel source as it is and
//! checks the forward and both backward kernels against causal attention in f64, at f16 and
//! bf16, heads of 32 and 64, lengths from 1 to 200. What it cannot check is the hardware: the
//! real `mma.sync`, timing and races the emulation's barriers hide; the parity suite does on a
//! GPU.
//!
//! It needs a C++20 compiler (`$CXX`, else `c++`); without one it prints `SKIPPED` and passes,
//! unless `AMP_CUDA_REQUIRE_CXX=1` (CI sets it): see `tests/emulated/mod.rs`.

mod emulated;

#[test]
fn the_fused_attention_kernels_match_f64_attention_when_emulated_on_the_host() {
    let Some(run) = emulated::run("flash_attention.cpp", &[], "") else { return };
    println!("{}", run.stdout);
    assert!(run.success, "the emulated kernels disagree with the reference:\n{}{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("0 case(s) failed"), "{}", run.stdout);
}
