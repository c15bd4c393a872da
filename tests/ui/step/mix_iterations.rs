// Mixing two iterations' gradients: gradients from another `scale()` call (possibly at
// another scale) cannot be accumulated into this one.
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut scaler = GradScaler::new();
    let first = w.square().sum_all();
    let second = w.sum_all();
    let mut grads = scaler.scale(first).backward();
    let other = scaler.scale(second).backward();
    grads.accumulate(other);
}
