//! The compile-fail cases' passing counterparts (`tests/ui/pass/*.rs`): whole programs that use
//! the API as intended, built as modules of this suite and run. They were trybuild `pass` cases;
//! one `pass` case makes trybuild build its project's dependencies again with code generation
//! (about 90 s of a cold `cargo test --workspace` on 2 cores), where compile-fail cases alone
//! need `cargo check`.

#[path = "ui/pass/autocast_forward.rs"]
mod autocast_forward;
#[path = "ui/pass/autocast_generic.rs"]
mod autocast_generic;
#[path = "ui/pass/step_accumulation.rs"]
mod step_accumulation;
#[path = "ui/pass/step_bf16_no_scale.rs"]
mod step_bf16_no_scale;
#[path = "ui/pass/step_f16_scaler.rs"]
mod step_f16_scaler;
#[path = "ui/pass/step_pure_bf16.rs"]
mod step_pure_bf16;

#[test]
fn autocast_forward_runs() {
    autocast_forward::main();
}

#[test]
fn autocast_generic_runs() {
    autocast_generic::main();
}

#[test]
fn step_accumulation_runs() {
    step_accumulation::main();
}

#[test]
fn step_bf16_no_scale_runs() {
    step_bf16_no_scale::main();
}

#[test]
fn step_f16_scaler_runs() {
    step_f16_scaler::main();
}

#[test]
fn step_pure_bf16_runs() {
    step_pure_bf16::main();
}
