// Stepping with gradients that are still multiplied by the loss scale.
use amp::optim::Sgd;
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let mut w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut opt = Sgd::new(0.1).build().unwrap();
    let mut scaler = GradScaler::new();
    let loss = w.square().sum_all();
    let _ = scaler.scale(loss).backward().step(&mut opt, &mut w).update();
}
