//! The row kernels run on this machine, GPU or not, under the host
//! emulation of CUDA (`tests/emulated/cuda_emu.hpp`, with the real prelude), launched as the
//! backend launches them (variant, threads, grid, dynamic shared memory; the runners name the
//! backend function each case follows):
//! - `tests/emulated/rows.cpp`: softmax and log-softmax, layer norm and RMS norm (with the weight
//!   and bias gradients), cross-entropy, forward and backward, block-per-row and warp-per-row,
//!   vectorised and scalar, the row cached in dynamic shared memory or not (at the cache's edge:
//!   a row of exactly `ROW_SMEM` bytes and one value more), at f32, f16, bf16 and f64, against f64
//!   references with per-precision tolerances.
//!
//! What it cannot check: the hardware (real shared-memory and register limits are `tests/ptx.rs`'s,
//! real f16 conversions and transcendental functions, timing), and races that the emulation's
//! barriers and its one-block-at-a-time schedule hide (see the design notes of
//! `cuda_emu.hpp`); the parity suite runs the kernels on a GPU.
//!
//! It needs a C++20 compiler (`$CXX`, else `c++`); without one it prints `SKIPPED` and passes,
//! unless `AMP_CUDA_REQUIRE_CXX=1` (CI sets it): see `tests/emulated/mod.rs`.

mod emulated;

#[test]
fn the_row_kernels_match_f64_references_when_emulated_on_the_host() {
    let args = [amp_cuda::kernels::ROW_SMEM.to_string()];
    let Some(run) = emulated::run("rows.cpp", &args, "") else { return };
    println!("{}", run.stdout);
    assert!(
        run.success && run.stdout.contains("\n0 of "),
        "the emulated row kernels disagree with their references (FAIL lines above):\n{}",
        run.stderr
    );
}
