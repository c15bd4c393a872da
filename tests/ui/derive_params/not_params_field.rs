// A field that holds no parameters must be marked `#[param(skip)]`.
use amp::{Param, Params};

#[derive(Params)]
struct Dropout {
    weight: Param,
    rate: f32,
}

fn main() {}
