// The f16 chain with a dynamic loss scaler: scale, backward, unscale, clip, step, update.
use amp::optim::AdamW;
use amp::scaler::GradScaler;
use amp::{Param, Rng, Tensor, f16};

pub fn main() {
    let mut rng = Rng::seed(0);
    let mut w = Param::new(Tensor::<f32>::randn(&[4, 2], &mut rng));
    let x = Tensor::<f32>::randn(&[8, 4], &mut rng);
    let mut opt = AdamW::new(1e-3).build().unwrap();
    let mut scaler = GradScaler::new();
    let mut skipped = 0;
    for _ in 0..10 {
        let loss = x.cast::<f16>().matmul(&w.cast::<f16>()).cast::<f32>().square().mean_all();
        let mut grads = scaler.scale(loss).backward().unscale();
        let norm: f32 = grads.clip_grad_norm(1.0);
        let stepped = grads.step(&mut opt, &mut w);
        let report = stepped.update().unwrap();
        // At 65536 the f16 gradients of the matmul overflow: those steps are skipped and
        // the scale backs off until they fit.
        assert_eq!(report.skipped, !norm.is_finite());
        skipped += usize::from(report.skipped);
    }
    assert!(opt.steps() > 0);
    assert_eq!(opt.steps() as usize + skipped, 10);
    assert!(scaler.get_scale() < 65536.0);
}
