use amp::prelude::*;

#[autocast(f32)]
fn forward(x: &Tensor<f32>) -> Tensor<f32> {
    x.exp()
}

fn main() {}
