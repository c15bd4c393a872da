// Keeping one iteration's gradients across the next `scale()`: the step borrows its scaler
// until `.update()`, so two iterations cannot be in flight at once.
use amp::optim::Sgd;
use amp::scaler::GradScaler;
use amp::{Param, Tensor};

fn main() {
    let mut w = Param::new(Tensor::<f32>::ones(&[3]));
    let mut opt = Sgd::new(0.1).build().unwrap();
    let mut scaler = GradScaler::new();
    let loss = w.square().sum_all();
    let old = scaler.scale(loss).backward();
    let loss2 = w.sum_all();
    let new = scaler.scale(loss2).backward();
    let _ = old.unscale().step(&mut opt, &mut w).update();
    let _ = new.unscale().step(&mut opt, &mut w).update();
}
