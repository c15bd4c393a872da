// A PyTorch habit (`model.half()`): f16 parameters. No optimizer updates them; the message
// says to keep f32 master weights and autocast, instead of suggesting `#[param(skip)]`, which
// would freeze the weight. (bf16 parameters are allowed: pure-bf16 training.)
use amp::nn::Linear;
use amp::{Param, Params, f16};

#[derive(Params)]
struct Half {
    weight: Param<f16>,
    proj: Option<Linear<amp::f16>>,
}

fn main() {}
