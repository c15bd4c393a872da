use amp::nn::Block;
use amp::prelude::*;

// An `amp::nn` module's method called with the wrong arguments inside `#[autocast]`: the error
// is on the user's call and shows the method's parameters.
struct Model {
    block: Block,
}

impl Model {
    #[autocast(P)]
    fn forward<P: Precision>(&self, x: &Tensor<f32>) -> Tensor<f32> {
        self.block.forward(x)
    }
}

fn main() {}
