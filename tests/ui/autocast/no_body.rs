use amp::prelude::*;

trait Forward {
    #[autocast]
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32>;
}

fn main() {}
