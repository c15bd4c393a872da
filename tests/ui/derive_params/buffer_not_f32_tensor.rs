// A buffer is an f32 tensor (running statistics are kept in f32 whatever the model's precision);
// a bf16 tensor or a plain Vec is refused on the field, and a buffer cannot also be skipped.
use amp::{Param, Params, Tensor, bf16};

#[derive(Params)]
struct Norm {
    weight: Param,
    #[param(buffer)]
    running_mean: Tensor<bf16>,
    #[param(buffer)]
    history: Vec<f32>,
}

#[derive(Params)]
struct Both {
    weight: Param,
    #[param(buffer, skip)]
    running_var: Tensor<f32>,
}

fn main() {}
