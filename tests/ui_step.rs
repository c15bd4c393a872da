//! Compile-time checks of the training step's typestate: each misuse of the loss-scaling chain
//! is a compile error whose message names the missing call (`tests/ui/step/`), and the correct
//! chains compile (`tests/ui/pass/step_*.rs`).

#[test]
fn ui_step() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/step/*.rs");
    t.pass("tests/ui/pass/step_*.rs");
}
