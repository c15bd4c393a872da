//! amp-core's integration tests, built as one test binary.
//!
//! Each file here is a module of this binary rather than a binary of its own: the tests use
//! amp-core's generic ops, and every test binary compiled its own copies of them (at the
//! workspace's `opt-level` generic code is not shared between crates), so 21 binaries spent
//! most of a cold `cargo test --workspace` compiling the same code again. Tests of
//! process-wide state are the second binary, `isolated.rs`, each run in a child process of its
//! own. Run one file's tests with a filter: `cargo test -p amp-core --test suite precision::`.

// Shared helpers (and the `for_each_precision!` macro) for the modules below.
#[macro_use]
mod common;

#[path = "buffers.rs"]
mod buffers;
#[path = "checkpoint_files.rs"]
mod checkpoint_files;
#[path = "cnn_modules.rs"]
mod cnn_modules;
#[path = "cnn_parity.rs"]
mod cnn_parity;
#[path = "data_addition.rs"]
mod data_addition;
#[path = "data_loader.rs"]
mod data_loader;
#[path = "data_text.rs"]
mod data_text;
#[path = "edge_cases.rs"]
mod edge_cases;
#[path = "errors.rs"]
mod errors;
#[path = "gradcheck.rs"]
mod gradcheck;
#[path = "nn_modules.rs"]
mod nn_modules;
#[path = "optim_rules.rs"]
mod optim_rules;
#[path = "policy.rs"]
mod policy;
#[path = "precision.rs"]
mod precision;
#[path = "pure_bf16.rs"]
mod pure_bf16;
#[path = "scaler_rules.rs"]
mod scaler_rules;
#[path = "scaler_skip.rs"]
mod scaler_skip;
#[path = "scaler_traces.rs"]
mod scaler_traces;
#[path = "second_device.rs"]
mod second_device;
#[path = "step_guarantees.rs"]
mod step_guarantees;
#[path = "tensor_dataset.rs"]
mod tensor_dataset;
