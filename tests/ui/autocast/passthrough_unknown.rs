use amp::prelude::*;

#[autocast(passthrough = [sofmax])]
fn forward(x: &Tensor<f32>) -> Tensor<f32> {
    x.softmax(1)
}

fn main() {}
