use amp::prelude::*;

#[autocast(fp16)]
fn forward(x: &Tensor<f32>, w: &Param) -> Tensor<f32> {
    x.matmul(w)
}

fn main() {
    // The function is still emitted: the only error is the attribute's.
    let w = Param::new(Tensor::zeros(&[2, 2]));
    let _ = forward(&Tensor::ones(&[1, 2]), &w);
}
