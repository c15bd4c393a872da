use amp::prelude::*;

#[autocast]
struct Mlp {
    w: Param,
}

fn main() {
    let _ = Mlp { w: Param::new(Tensor::zeros(&[2, 2])) }.w;
}
