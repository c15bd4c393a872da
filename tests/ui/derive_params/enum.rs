// Enums are refused: which parameters exist would depend on the variant.
use amp::{Param, Params};

#[derive(Params)]
enum Layer {
    A(Param),
    B,
}

fn main() {}
