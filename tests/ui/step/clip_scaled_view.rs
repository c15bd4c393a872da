// The free clipping functions take a `Grads`, which scaled gradients never are.
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut scaler = GradScaler::new();
    let grads = scaler.scale(w.square().sum_all()).backward();
    amp::clip::clip_grad_norm(&mut grads.scaled_grads(), 1.0);
    grads.abandon();
}
