// PyTorch habit: read the gradients between backward and step, and step an optimizer by hand.
// Scaled gradients are a read-only view, never a `Grads`, so they cannot reach an optimizer.
use amp::optim::{Optimizer, Sgd};
use amp::scaler::GradScaler;
use amp::{Grads, Param, Tensor};

fn main() {
    let mut w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut opt = Sgd::new(0.1).build().unwrap();
    let mut scaler = GradScaler::new();
    let grads = scaler.scale(w.square().sum_all()).backward();
    let copy: Grads = grads.scaled_grads().clone();
    opt.step(&mut w, grads.scaled_grads()).unwrap();
    grads.abandon();
    let _ = copy;
}
