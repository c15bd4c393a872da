//! amp-core's tests that need a process to themselves, built as one test binary: each test
//! runs its body in a child process of its own (this binary again, filtered to that one test),
//! because what it checks is process-wide: the CPU allocator's counts (`cpu_memory`), rayon's
//! pool (`cpu_threads`), the profile (`profile`), the SIMD level (`simd_levels`). As separate
//! binaries each compiled its own copies of amp-core's generic ops (see `suite.rs`).

use std::process::Command;

#[path = "cpu_memory.rs"]
mod cpu_memory;
#[path = "cpu_threads.rs"]
mod cpu_threads;
#[path = "profile.rs"]
mod profile;
#[path = "simd_levels.rs"]
mod simd_levels;

/// Set in the child process.
const CHILD: &str = "AMP_ISOLATED_TEST_CHILD";

/// Runs `body` in a child process: this binary again, filtered to the test `name` of the
/// module `module` (pass `module_path!()`), with `CHILD` set; in the child, runs `body`. The
/// parent checks that the child ran that one test and passed, and prints its output.
pub fn in_child(module: &str, name: &str, body: impl FnOnce()) {
    if std::env::var_os(CHILD).is_some() {
        body();
        return;
    }
    // Test names leave out the crate: `cpu_threads::init_makes_the_caller_a_compute_thread`.
    let module = module.split_once("::").map_or("", |(_, m)| m);
    let test = if module.is_empty() { name.to_string() } else { format!("{module}::{name}") };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test.as_str(), "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .expect("run this test binary again");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child process for {test} failed:\n{text}");
    assert!(text.contains("1 passed"), "child process for {test} ran no test:\n{text}");
    print!("{text}");
}
