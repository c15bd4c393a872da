// A PyTorch habit (`model.half()`): an f16 parameter. Master weights are f32; the message says
// so instead of suggesting `#[param(skip)]`, which would freeze the weight.
use amp::{Param, Params, f16};

#[derive(Params)]
struct Half {
    weight: Param<f16>,
    bias: Option<Param<amp::bf16>>,
}

fn main() {}
