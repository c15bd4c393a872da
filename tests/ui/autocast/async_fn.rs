use amp::prelude::*;

#[autocast]
async fn forward(x: &Tensor<f32>) -> Tensor<f32> {
    x.matmul(x)
}

fn main() {}
