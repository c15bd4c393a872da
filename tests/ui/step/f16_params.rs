// Pure f16 training (PyTorch's `model.half()` with its optimizer): no optimizer updates f16
// parameters, so stepping one does not compile; the message says what to use instead.
use amp::optim::Sgd;
use amp::scaler::GradScaler;
use amp::{Param, Tensor, f16};

fn main() {
    let mut w = Param::new(Tensor::<f32>::ones(&[3])).to_precision::<f16>();
    let mut opt = Sgd::new(0.1).build().unwrap();
    let mut scaler = GradScaler::new();
    let loss = w.cast::<f32>().square().sum_all();
    scaler.scale(loss).backward().unscale().step(&mut opt, &mut w).update().unwrap();
}
