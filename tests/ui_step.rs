//! Compile-time checks of the training step's typestate: each misuse of the loss-scaling chain
//! is a compile error whose message names the missing call (`tests/ui/step/`), and the correct
//! chains compile and run (`tests/ui/pass/step_*.rs`, in the suite's `ui_pass`).

#[test]
fn ui_step() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/step/*.rs");
}
