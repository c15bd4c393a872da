// Gradient accumulation: several micro-batches before one unscale and one step.
use amp::optim::Sgd;
use amp::scaler::GradScaler;
use amp::{Param, Rng, Tensor};

pub fn main() {
    let mut rng = Rng::seed(2);
    let mut w = Param::new(Tensor::<f32>::randn(&[4, 1], &mut rng));
    let batches: Vec<Tensor<f32>> = (0..4).map(|_| Tensor::<f32>::randn(&[2, 4], &mut rng)).collect();
    let mut opt = Sgd::new(0.01).build().unwrap();
    let mut scaler = GradScaler::new();
    // PyTorch's accumulation loop, one step kept across the micro-batches.
    let loss_of = |x: &Tensor<f32>| x.matmul(&w).square().mean_all().div_scalar(4.0);
    let mut grads = scaler.scale(loss_of(&batches[0])).backward();
    for x in &batches[1..] {
        grads.accumulate(loss_of(x));
    }
    assert_eq!(grads.micro_batches(), 4);
    let report = grads.unscale().step(&mut opt, &mut w).update().unwrap();
    assert_eq!((report.micro_batches, report.growth_tracker), (4, 1));
    assert_eq!(opt.steps(), 1);
}
