//! The `amp` facade's integration tests, built as one test binary: each file here is a
//! module (as in `amp-core/tests/suite.rs`, whose notes say why). The compile-fail tests
//! (`ui_autocast.rs`, `ui_step.rs`, `ui_tensor.rs`) stay binaries of their own; their passing
//! counterparts are the module `ui_pass`. Run one file's tests with a filter: `cargo test
//! --test suite trainer::`.

#[path = "autocast_grads.rs"]
mod autocast_grads;
#[path = "autocast_policy.rs"]
mod autocast_policy;
#[path = "autocast_reach.rs"]
mod autocast_reach;
#[path = "autocast_reach_check.rs"]
mod autocast_reach_check;
#[path = "autocast_semantics.rs"]
mod autocast_semantics;
#[path = "derive_params.rs"]
mod derive_params;
#[path = "readme.rs"]
mod readme;
#[path = "train_utils.rs"]
mod train_utils;
#[path = "trainer.rs"]
mod trainer;
#[path = "ui_pass.rs"]
mod ui_pass;
