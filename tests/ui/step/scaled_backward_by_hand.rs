// Differentiating the scaled loss by hand, outside the step, to get scaled `Grads`: the seeded
// backward is not public, and the scaled value the step shows is detached.
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut scaler = GradScaler::new();
    let loss = w.square().sum_all();
    let _grads = loss.try_backward_with_seed(scaler.get_scale() as f64);
    let _ = scaler;
}
