// `scale` takes the loss by value, so the forward graph is freed by `backward()` and the step
// updates parameters in place (a borrowed loss kept its graph alive and made every update copy).
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut scaler = GradScaler::new();
    let loss = w.square().sum_all();
    scaler.scale(&loss).abandon();
}
