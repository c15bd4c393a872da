//! `#[autocast]` misuse is a compile error on the offending token (the item is still emitted);
//! complete programs using it compile and run in the suite's `ui_pass`
//! (`tests/ui/pass/autocast_*.rs`).

#[test]
fn ui_autocast() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/autocast/*.rs");
}
