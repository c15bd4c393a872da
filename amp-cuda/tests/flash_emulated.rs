//! The fused attention kernels (`src/kernels/attention_flash.cu`) run on this machine, GPU or
//! not: `tests/emulated/cuda_emu.hpp` emulates the CUDA features they use (threads, barriers,
//! warp shuffles, the tensor-core product by the PTX ISA's fragment layouts), and
//! `tests/emulated/flash_attention.cpp` includes the kernel source as it is and checks the
//! forward and both backward kernels against causal attention in f64, at f16 and bf16, heads of
//! 32 and 64, lengths from 1 to 200. What it cannot check is the hardware: the real `mma.sync`,
//! timing and races the emulation's barriers hide; the parity suite does on a GPU.
//!
//! It needs a C++20 compiler (`$CXX`, else `c++`); without one it prints `SKIPPED` and passes,
//! unless `AMP_CUDA_REQUIRE_CXX=1` (CI sets it).

use std::path::Path;
use std::process::Command;

#[test]
fn the_fused_attention_kernels_match_f64_attention_when_emulated_on_the_host() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let required = std::env::var("AMP_CUDA_REQUIRE_CXX").as_deref() == Ok("1");
    if !dir.join("tests/emulated/flash_attention.cpp").exists() {
        // A test binary carried away from its source tree (the GPU bundle): the GPU runs the
        // kernels themselves there.
        assert!(!required, "the emulation's sources are not at {}", dir.display());
        println!("SKIPPED: the emulation's sources are not at {}", dir.display());
        return;
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flash_attention_emulated");
    let compiled = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-pthread", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas", "-Werror"])
        .arg("-I")
        .arg(dir.join("tests/emulated"))
        .arg("-I")
        .arg(dir.join("src/kernels"))
        .arg(dir.join("tests/emulated/flash_attention.cpp"))
        .arg("-o")
        .arg(&exe)
        .output();
    let compiled = match compiled {
        Ok(out) => out,
        Err(e) => {
            assert!(!required, "a C++ compiler is required here ({cxx}: {e})");
            println!("SKIPPED: no C++ compiler ({cxx}: {e})");
            return;
        }
    };
    if !compiled.status.success() {
        // A compiler without C++20 or `_Float16` (g++ before 12) as well as a broken source:
        // CI, which requires the check, tells them apart.
        let stderr = String::from_utf8_lossy(&compiled.stderr);
        assert!(!required, "{cxx} failed:\n{stderr}");
        println!("SKIPPED: {cxx} could not build the emulation (AMP_CUDA_REQUIRE_CXX=1 makes this fail):\n{stderr}");
        return;
    }
    let run = Command::new(&exe).output().expect("the emulation runs");
    let report = String::from_utf8_lossy(&run.stdout);
    println!("{report}");
    assert!(run.status.success(), "the emulated kernels disagree with the reference:\n{report}");
    assert!(report.contains("0 case(s) failed"), "{report}");
}
