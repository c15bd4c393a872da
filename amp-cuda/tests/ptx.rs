//! Every kernel program compiles with NVRTC, by the function the backend uses at run time.
use amp_cuda::{kernels, nvrtc};

#[test]
fn every_kernel_compiles_to_ptx_for_compute_90() {
    if let Err(e) = nvrtc::nvrtc_status() {
        println!("SKIPPED: no NVRTC ({e})");
        return;
    }
    let mut failures = Vec::new();
    let all = kernels::catalog();
    for p in &all {
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
        if let Err(e) = nvrtc::assemble_sm90(p) {
            failures.push(e.to_string());
        }
    }
    assert!(failures.is_empty(), "{} of {} programs failed:\n{}", failures.len(), all.len(), failures.join("\n"));
    println!("{} programs, {} kernels", all.len(), all.iter().map(|p| p.kernels.len()).sum::<usize>());
}
