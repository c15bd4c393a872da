// One module's parameters share one element type: a bf16 module (it names `bf16`) with an f32
// parameter, or a submodule of another precision, is an error on that field.
use amp::nn::Linear;
use amp::{Param, Params, bf16};

#[derive(Params)]
struct Mixed {
    scale: Param,
    shift: Param<bf16>,
}

#[derive(Params)]
struct Tower {
    low: Linear<bf16>,
    high: Linear,
}

fn main() {}
