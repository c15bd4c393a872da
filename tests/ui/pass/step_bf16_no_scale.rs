// The bf16 chain: the same calls with the no-op scaler, chosen from the precision by type.
use amp::optim::Sgd;
use amp::scaler::{NoScale, ScalerFor, SelectScaler};
use amp::{NeedsLossScaling, Param, Precision, Rng, Tensor, bf16, f16};

fn train<P: Precision>(steps: usize) -> f32
where
    NeedsLossScaling<P>: SelectScaler,
{
    let mut rng = Rng::seed(1);
    let mut w = Param::new(Tensor::<f32>::randn(&[4, 2], &mut rng));
    let x = Tensor::<f32>::randn(&[8, 4], &mut rng);
    let mut opt = Sgd::new(0.1).momentum(0.9).build().unwrap();
    let mut scaler = ScalerFor::<P>::default();
    let mut last = 0.0;
    for _ in 0..steps {
        let loss = x.cast::<P>().matmul(&w.cast::<P>()).cast::<f32>().square().mean_all();
        last = loss.item();
        let report = amp::scaler::LossScaler::scale(&mut scaler, loss)
            .backward()
            .unscale()
            .step(&mut opt, &mut w)
            .update()
            .unwrap();
        // f16 steps may overflow at the initial scale (and are skipped); bf16 never does here.
        assert!(P::NEEDS_LOSS_SCALING || !report.skipped);
    }
    last
}

pub fn main() {
    let mut scaler: NoScale = ScalerFor::<bf16>::default();
    let w = Param::new(Tensor::<f32>::ones(&[2]));
    let loss = w.cast::<bf16>().cast::<f32>().sum_all();
    let grads = scaler.scale(loss).backward();
    assert_eq!(grads.scale_used(), 1.0);
    grads.abandon(); // a step is ended on purpose, never just dropped
    assert!(train::<bf16>(5).is_finite());
    assert!(train::<f16>(5).is_finite());
}
