//! Shared by the tests that run kernel sources on the host (`tests/emulated/*.cpp` under
//! `cuda_emu.hpp`): build a runner with the C++ compiler and run it, or say why not.
//!
//! A runner needs a C++20 compiler with `_Float16` (`$CXX`, else `c++`; g++ 12 or later).
//! Without one, or where the sources are absent (a test binary carried away from its source
//! tree, as in the GPU bundle, where the GPU runs the kernels themselves), [`run`] prints
//! `SKIPPED: ...` and returns `None`, unless `AMP_CUDA_REQUIRE_CXX=1` (CI sets it): then it
//! panics.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// What a runner printed, and whether it exited with 0.
pub struct Run {
    /// Seconds the compiler took, and the runner.
    #[allow(dead_code)]
    pub compile_s: f64,
    #[allow(dead_code)]
    pub run_s: f64,
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Builds `tests/emulated/<source>` (with `src/kernels` on the include path) and runs it with
/// `args`, writing `stdin` to it; `None` when skipped (see the module docs).
pub fn run(source: &str, args: &[String], stdin: &str) -> Option<Run> {
    run_generated(source, &[], args, stdin)
}

/// [`run`], with files the test generated (`(name, text)`) written to a directory of their own
/// in the build directory, which goes on the include path first (the runner `#include`s them).
pub fn run_generated(source: &str, generated: &[(&str, String)], args: &[String], stdin: &str) -> Option<Run> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let required = std::env::var("AMP_CUDA_REQUIRE_CXX").as_deref() == Ok("1");
    let src = dir.join("tests/emulated").join(source);
    if !src.exists() {
        assert!(!required, "the emulation's sources are not at {}", dir.display());
        println!("SKIPPED: the emulation's sources are not at {}", dir.display());
        return None;
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{}_emulated", source.trim_end_matches(".cpp")));
    // -ffp-contract=off: the kernels' `__*_rn` intrinsics are plain operations here, and the
    // references' arithmetic is as written; neither may be fused into FMAs. -O1: building the
    // runners is most of their time (kernels_emulated on 2 cores, runs on OS threads then: 74 s
    // at -O2, 57 s at -O1; on fibers 19 s at -O1, of which rows.cpp's build 7.6 s).
    let gen_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{}_generated", source.trim_end_matches(".cpp")));
    std::fs::create_dir_all(&gen_dir).expect("a directory for the generated sources");
    for (name, text) in generated {
        std::fs::write(gen_dir.join(name), text).expect("the generated source is written");
    }
    let started = std::time::Instant::now();
    let compiled = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-fno-strict-aliasing", "-ffp-contract=off"])
        .args(["-Wall", "-Wno-unknown-pragmas", "-Werror"])
        .arg("-I")
        .arg(&gen_dir)
        .arg("-I")
        .arg(dir.join("tests/emulated"))
        .arg("-I")
        .arg(dir.join("src/kernels"))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output();
    let compiled = match compiled {
        Ok(out) => out,
        Err(e) => {
            assert!(!required, "a C++ compiler is required here ({cxx}: {e})");
            println!("SKIPPED: no C++ compiler ({cxx}: {e})");
            return None;
        }
    };
    if !compiled.status.success() {
        // A compiler without C++20 or `_Float16` (g++ before 12) as well as a broken source:
        // CI, which requires the check, tells them apart.
        let stderr = String::from_utf8_lossy(&compiled.stderr);
        assert!(!required, "{cxx} failed on {source}:\n{stderr}");
        println!("SKIPPED: {cxx} could not build {source} (AMP_CUDA_REQUIRE_CXX=1 makes this fail):\n{stderr}");
        return None;
    }
    let compile_s = started.elapsed().as_secs_f64();
    let started = std::time::Instant::now();
    let mut child = Command::new(&exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the emulation runs");
    let mut input = child.stdin.take().expect("a pipe to the runner");
    let text = stdin.to_string();
    // Written from a thread: the runner answers while it reads, and a full pipe would stall both.
    let writer = std::thread::spawn(move || input.write_all(text.as_bytes()));
    let out = child.wait_with_output().expect("the emulation runs");
    writer.join().expect("the writer thread").expect("the runner reads its cases");
    Some(Run {
        compile_s,
        run_s: started.elapsed().as_secs_f64(),
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}
