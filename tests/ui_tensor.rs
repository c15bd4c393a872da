//! Compile-fail tests for the tensor type: precisions do not mix by accident.

#[test]
fn ui_tensor() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/tensor/*.rs");
}
