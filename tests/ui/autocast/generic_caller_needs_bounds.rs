use amp::prelude::*;

// A forward that promotes (`x + &h`) gets `#[autocast(P)]`'s `Promote` bounds; a generic caller
// passing its own `P` must state them too.
#[autocast(P)]
fn residual<P: Precision>(x: &Tensor<f32>, w: &Param) -> Tensor<f32> {
    x + &x.matmul(w)
}

fn train<P: Precision>(x: &Tensor<f32>, w: &Param) -> Tensor<f32> {
    residual::<P>(x, w)
}

fn main() {
    let w = Param::new(Tensor::zeros(&[2, 2]));
    let _ = train::<bf16>(&Tensor::ones(&[1, 2]), &w);
}
