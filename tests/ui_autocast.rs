//! `#[autocast]` misuse is a compile error on the offending token (the item is still emitted);
//! and complete programs using it compile and run.

#[test]
fn ui_autocast() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/autocast/*.rs");
    t.pass("tests/ui/pass/autocast_*.rs");
}
