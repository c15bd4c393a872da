// Unscaling twice in one iteration (PyTorch raises at run time).
use amp::optim::Sgd;
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let mut w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut opt = Sgd::new(0.1).build().unwrap();
    let mut scaler = GradScaler::new();
    let loss = w.square().sum_all();
    let grads = scaler.scale(loss).backward().unscale();
    let _ = grads.unscale().step(&mut opt, &mut w).update();
}
