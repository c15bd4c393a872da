//! Primitive benchmarks (filled in below).
fn main() {}
