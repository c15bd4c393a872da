//! A model written once with `#[autocast(P)]`, trained at f32, f16 and bf16 by a type argument.
use amp::nn::Linear;
use amp::prelude::*;

#[derive(Params)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    #[autocast(P)]
    fn loss<P: Precision>(&self, x: &Tensor<f32>, y: &Indices) -> Tensor<f32> {
        let h = x.linear(&self.fc1.weight, self.fc1.bias.as_ref()).gelu();
        h.linear(&self.fc2.weight, self.fc2.bias.as_ref()).cross_entropy(y)
    }

    /// The same forward with `amp::nn`'s own `forward` (no turbofish) and a residual.
    #[autocast(P)]
    fn residual<P: Precision>(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let h = self.fc1.forward(x).gelu();
        x + &h.linear(&self.fc1.weight.t(), None)
    }
}

pub fn main() {
    let mut rng = Rng::seed(0);
    let model = Mlp { fc1: Linear::new(4, 8, true, &mut rng), fc2: Linear::new(8, 2, true, &mut rng) };
    let x = Tensor::<f32>::randn(&[3, 4], &mut rng);
    let y = Indices::from_vec(vec![0, 1, 0], &[3]);
    let losses = [model.loss::<f32>(&x, &y), model.loss::<f16>(&x, &y), model.loss::<bf16>(&x, &y)];
    assert!(losses.iter().all(|l| l.dtype() == DType::F32));
    assert_eq!(model.residual::<bf16>(&x).dtype(), DType::F32);
}
