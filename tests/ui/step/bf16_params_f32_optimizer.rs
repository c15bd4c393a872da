// A pure-bf16 model needs an optimizer for bf16 parameters (`.for_bf16(..)`): the f32 one
// cannot write its updates into bf16 weights.
use amp::nn::Linear;
use amp::optim::AdamW;
use amp::scaler::NoScale;
use amp::{Rng, Tensor, bf16};

fn main() {
    let mut rng = Rng::seed(0);
    let mut model = Linear::new(4, 2, true, &mut rng).to_precision::<bf16>();
    let mut opt = AdamW::new(1e-3).build().unwrap();
    let x = Tensor::<f32>::randn(&[8, 4], &mut rng);
    let loss = model.forward::<bf16, f32>(&x).cast::<f32>().square().mean_all();
    NoScale.scale(loss).backward().unscale().step(&mut opt, &mut model).update().unwrap();
}
