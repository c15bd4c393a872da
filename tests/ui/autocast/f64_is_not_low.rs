use amp::prelude::*;

// `f32` is accepted (autocast off in effect: tests/autocast_reach.rs); `f64` is not a low type
// (f64 tensors are always left as they are).
#[autocast(f64)]
fn forward(x: &Tensor<f32>) -> Tensor<f32> {
    x.exp()
}

fn main() {}
