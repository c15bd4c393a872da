// Clipping scaled gradients: PyTorch lets this through silently (the norm is S times too large).
use amp::optim::Sgd;
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let mut w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut opt = Sgd::new(0.1).build().unwrap();
    let mut scaler = GradScaler::new();
    let loss = w.square().sum_all();
    let mut grads = scaler.scale(loss).backward();
    grads.clip_grad_norm(1.0);
    let _ = grads.unscale().step(&mut opt, &mut w).update();
}
