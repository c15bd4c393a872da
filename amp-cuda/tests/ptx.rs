//! Every kernel program the backend can ask for compiles with NVRTC to PTX for `compute_90`,
//! through the same function the backend calls at run time, and also assembles for `sm_90`
//! (which checks the inline PTX). No GPU is needed: only libnvrtc on the library path
//! (`pip install nvidia-cuda-nvrtc`, then its `nvidia/cu13/lib` on `LD_LIBRARY_PATH`); without
//! it the compile test prints `SKIPPED: no NVRTC (<reason>)`, unless `AMP_CUDA_REQUIRE_NVRTC=1`
//! (CI sets it), which makes a missing NVRTC a failure.

use std::path::Path;

use amp_cuda::kernels::{self, BLOCK_SMEM, Family, ROW_SMEM};
use amp_cuda::nvrtc;

#[test]
fn every_kernel_compiles_to_ptx_for_compute_90_and_assembles_for_sm_90() {
    if let Err(e) = nvrtc::nvrtc_status() {
        assert!(std::env::var("AMP_CUDA_REQUIRE_NVRTC").as_deref() != Ok("1"), "NVRTC is required here: {e}");
        println!("SKIPPED: no NVRTC ({e})");
        return;
    }
    let all = kernels::catalog();
    // Two threads (the CI machines have two cores); each program is independent.
    let failures: Vec<String> = std::thread::scope(|s| {
        let halves: Vec<_> = all
            .chunks(all.len().div_ceil(2))
            .map(|part| {
                s.spawn(move || {
                    let mut failures = Vec::new();
                    for p in part {
                        match nvrtc::compile_ptx(p) {
                            Ok(ptx) => {
                                for k in &p.kernels {
                                    if !ptx.contains(&format!(".entry {k}(")) {
                                        failures.push(format!("{}: no entry {k} in the PTX", p.name));
                                    }
                                }
                            }
                            Err(e) => failures.push(e.to_string()),
                        }
                        match nvrtc::assemble_sm90(p) {
                            Ok(assembled) => failures.extend(resource_failures(p, &assembled)),
                            Err(e) => failures.push(e.to_string()),
                        }
                    }
                    failures
                })
            })
            .collect();
        halves.into_iter().flat_map(|h| h.join().expect("compile thread")).collect()
    });
    let kernels: usize = all.iter().map(|p| p.kernels.len()).sum();
    assert!(failures.is_empty(), "{} of {} programs failed:\n{}", failures.len(), all.len(), failures.join("\n"));
    let (major, minor) = nvrtc::nvrtc_status().unwrap();
    println!(
        "NVRTC {major}.{minor}: {} programs, {kernels} kernels compiled to PTX for {} and assembled for sm_90",
        all.len(),
        nvrtc::ARCH
    );
}

/// What ptxas reported that would fail or slow a launch on the GPU: a kernel it did not report,
/// spills to local memory, a row kernel whose static shared memory leaves less than
/// [`ROW_SMEM`] of the block's 48 KiB for the row it caches, and a warp-per-row kernel at
/// more than 168 registers a thread (its 128-thread blocks then fit 2 to an SM, 8 warps to
/// hide memory latency with; the 16-bit norm kernels were at 255 while the kernel switch
/// instantiated an 8-vector case the host never launches for them).
fn resource_failures(p: &kernels::Program, assembled: &nvrtc::Assembled) -> Vec<String> {
    let mut failures = Vec::new();
    for k in &p.kernels {
        let Some(r) = assembled.kernels.iter().find(|r| &r.name == k) else {
            failures.push(format!("{}: ptxas reported nothing for {k}", p.name));
            continue;
        };
        if r.spill_store_bytes > 0 {
            failures.push(format!("{}: {k} spills {} bytes of registers", p.name, r.spill_store_bytes));
        }
        let row_kernel = ["softmax_fwd", "log_softmax_fwd", "norm_fwd", "norm_bwd"].iter().any(|s| k.contains(s));
        if row_kernel && !k.contains("warp") && r.static_shared_bytes as usize + ROW_SMEM > BLOCK_SMEM {
            failures.push(format!(
                "{}: {k} has {} bytes of static shared memory, more than the {} ROW_SMEM leaves",
                p.name,
                r.static_shared_bytes,
                BLOCK_SMEM - ROW_SMEM
            ));
        }
        if k.contains("_warp_") && r.registers > 168 {
            failures.push(format!("{}: {k} takes {} registers a thread (at most 168)", p.name, r.registers));
        }
    }
    failures
}

/// Counts the op values defined in amp-core's op files (macro uses and hand-written impls).
fn count_ops(pattern_macro: &str, pattern_impl: &str) -> usize {
    let ops = Path::new(env!("CARGO_MANIFEST_DIR")).join("../amp-core/src/ops");
    let mut n = 0;
    for entry in std::fs::read_dir(ops).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        n += text.lines().filter(|l| l.trim_start().starts_with(pattern_macro)).count();
        n += text.lines().filter(|l| l.contains(pattern_impl) && !l.contains('$')).count();
    }
    n
}

#[test]
fn the_catalogue_has_every_op_value_of_amp_core() {
    assert_eq!(count_ops("unary_op!(", "impl UnaryOp for"), kernels::unary_ops().len(), "unary ops");
    assert_eq!(count_ops("binary_op!(", "impl BinaryOp for"), kernels::binary_ops().len(), "binary ops");
}

#[test]
fn every_kernel_the_backend_launches_is_in_its_program() {
    // The backend names family kernels as `family_fn(Family::X, dtype, "stem")`: each stem must
    // be one its family's program defines (a typo would only fail on a GPU otherwise).
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend.rs")).unwrap();
    let mut seen = 0;
    for (i, _) in src.match_indices("family_fn(Family::") {
        let call = &src[i + "family_fn(Family::".len()..];
        let family_name = &call[..call.find(',').unwrap()];
        let family = Family::ALL.iter().copied().find(|f| format!("{f:?}") == family_name).expect("a family");
        // A literal stem, or a variable whose values are literals checked below.
        for stem in call[..call.find(')').unwrap()].split('"').skip(1).step_by(2) {
            assert!(family.kernel_stems().contains(&stem), "{family:?} has no kernel {stem}");
            seen += 1;
        }
    }
    // Every literal that looks like a kernel stem names a kernel of some family.
    let all: Vec<&str> = Family::ALL.iter().flat_map(|f| f.kernel_stems().iter().copied()).collect();
    for lit in src.split('"').skip(1).step_by(2) {
        let stem_like = (lit.ends_with("_fwd") || lit.ends_with("_bwd"))
            && lit.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if stem_like {
            assert!(all.contains(&lit), "no family has a kernel {lit}");
        }
    }
    assert!(seen > 40, "found only {seen} launches");
}
