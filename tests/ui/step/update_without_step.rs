// Updating the scale without a step (PyTorch raises at run time).
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut scaler = GradScaler::new();
    let loss = w.square().sum_all();
    let _ = scaler.scale(loss).backward().unscale().update();
}
