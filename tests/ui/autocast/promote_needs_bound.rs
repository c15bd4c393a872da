use amp::prelude::*;

// Promotion of a generic precision is computed by the types: without `E: Promote<f32>` the
// pair is not known to promote, the operands are left as they are, and the mismatch shows.
#[autocast]
fn forward<E: Precision>(x: &Tensor<E>, b: &Param) -> Tensor<f32> {
    x.add(b)
}

fn main() {}
