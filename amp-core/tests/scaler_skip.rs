//! A skipped step changes nothing but the scale.
//!
//! Over 1,000 iterations, inf, -inf and NaN are injected at random positions of the gradients
//! of random iterations. After every skipped step the parameters and the whole optimizer state
//! (moments, step counts, schedule position) must be bit-identical to before it, and the scale
//! must follow an independent model of PyTorch's rules written here. And since loss scaling by
//! a power of two is exact, the run must end bit-identical to a run that never saw the bad
//! iterations, trained without a scaler.

use amp_core::optim::{AdamState, AdamW, Optim, Optimizer, ParamGroup, Rule, Sgd, SgdState, WarmupCosine};
use amp_core::scaler::{GradScaler, GradScalerOptions};
use amp_core::{Param, Params, Rng, Tensor};

struct Net {
    w: Param,
    b: Param,
}

impl Params for Net {
    fn named_params(&self) -> Vec<(String, &Param)> {
        vec![("w".into(), &self.w), ("b".into(), &self.b)]
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        vec![("w".into(), &mut self.w), ("b".into(), &mut self.b)]
    }
}

fn net(rng: &mut Rng) -> Net {
    Net { w: Param::new(Tensor::randn(&[16, 8], rng).mul_scalar(0.3)), b: Param::new(Tensor::zeros(&[8])) }
}

/// Bits of everything an optimizer keeps.
trait StateBits {
    fn bits(&self) -> Vec<u64>;
}

impl StateBits for AdamState {
    fn bits(&self) -> Vec<u64> {
        let mut v = vec![self.step];
        v.extend(self.exp_avg.iter().chain(&self.exp_avg_sq).map(|x| x.to_bits() as u64));
        v
    }
}

impl StateBits for SgdState {
    fn bits(&self) -> Vec<u64> {
        self.momentum_buffer.iter().flatten().map(|x| x.to_bits() as u64).collect()
    }
}

fn snapshot<R: Rule>(model: &Net, opt: &Optim<R>) -> (Vec<u32>, Vec<u64>, u64, u64)
where
    R::State: StateBits,
{
    let params = model.named_params().iter().flat_map(|(_, p)| p.to_vec()).map(f32::to_bits).collect();
    let sd = opt.state_dict();
    let state = sd.params.values().flat_map(StateBits::bits).collect();
    (params, state, opt.steps(), opt.lr().to_bits())
}

/// PyTorch's scale rules, written independently of the library.
struct ScaleModel {
    scale: f32,
    tracker: i32,
    interval: i32,
}

impl ScaleModel {
    fn after(&mut self, overflow: bool) {
        if overflow {
            self.scale = (f64::from(self.scale) * 0.5) as f32;
            self.tracker = 0;
            return;
        }
        self.tracker += 1;
        if self.tracker == self.interval {
            let grown = (f64::from(self.scale) * 2.0) as f32;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.tracker = 0;
        }
    }
}

/// The loss: a least-squares fit plus `sum(w·zw) + sum(b·zb)`, whose gradient adds `zw`, `zb`:
/// zero on clean iterations, inf/-inf/NaN at random positions on bad ones.
fn loss(model: &Net, x: &Tensor<f32>, y: &Tensor<f32>, zw: &Tensor<f32>, zb: &Tensor<f32>) -> Tensor<f32> {
    let out = x.matmul(model.w.tensor()).add(model.b.tensor());
    let fit = out.sub(y).square().mean_all();
    fit.add(&model.w.tensor().mul(zw).sum_all()).add(&model.b.tensor().mul(zb).sum_all())
}

fn run<R: Rule>(make_opt: impl Fn() -> Optim<R>)
where
    R::State: StateBits,
{
    const STEPS: usize = 1000;
    let interval = 4;
    let mut rng = Rng::seed(7);
    let mut model = net(&mut rng);
    let mut reference = Net { w: Param::new(model.w.tensor().clone()), b: Param::new(model.b.tensor().clone()) };
    let mut opt = make_opt();
    let mut ref_opt = make_opt();
    let opts = GradScalerOptions { growth_interval: interval, ..Default::default() };
    let mut scaler = GradScaler::with_options(opts).unwrap();
    let mut expected = ScaleModel { scale: 65536.0, tracker: 0, interval };
    let (mut skipped, mut grown, mut min_scale, mut max_scale) = (0, 0, f32::INFINITY, 0f32);

    for i in 0..STEPS {
        let x = Tensor::<f32>::randn(&[4, 16], &mut rng);
        let y = Tensor::<f32>::randn(&[4, 8], &mut rng);
        let mut zw = vec![0f32; 128];
        let mut zb = vec![0f32; 8];
        let bad = rng.uniform() < 0.15;
        if bad {
            let poison = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
            for _ in 0..1 + rng.next_u64() % 3 {
                let v = poison[(rng.next_u64() % 3) as usize];
                let pos = (rng.next_u64() % 136) as usize;
                if pos < 128 { zw[pos] = v } else { zb[pos - 128] = v }
            }
        }
        let (zw, zb) = (Tensor::from_vec(zw, &[16, 8]), Tensor::from_vec(zb, &[8]));

        let before = snapshot(&model, &opt);
        assert_eq!(scaler.get_scale(), expected.scale, "iteration {i}: scale");
        let l = loss(&model, &x, &y, &zw, &zb);
        let unscaled = scaler.scale(l).backward().unscale();
        assert_eq!(unscaled.found_inf(), bad, "iteration {i}: overflow detection");
        let report = unscaled.step(&mut opt, &mut model).update().unwrap();
        assert_eq!(report.skipped, bad, "iteration {i}");
        let after = snapshot(&model, &opt);
        if bad {
            skipped += 1;
            assert!(before == after, "iteration {i}: a skipped step changed parameters or optimizer state");
        } else {
            assert_ne!(before.0, after.0, "iteration {i}: a clean step must move the parameters");
            // The same iteration without a scaler, on the reference model.
            let grads = loss(&reference, &x, &y, &zw, &zb).backward();
            ref_opt.step(&mut reference, &grads).unwrap();
        }
        let old = expected.scale;
        expected.after(bad);
        grown += usize::from(expected.scale > old);
        assert_eq!((report.scale, report.growth_tracker), (expected.scale, expected.tracker), "iteration {i}");
        min_scale = min_scale.min(report.scale);
        max_scale = max_scale.max(report.scale);
    }
    assert!(skipped > 100 && grown > 20, "the run exercises both rules: {skipped} skipped, {grown} growths");
    assert!(min_scale > 2f32.powi(-60) && max_scale < 2f32.powi(100), "scales stayed where scaling is exact");
    assert_eq!(opt.steps() as usize, STEPS - skipped, "skipped steps do not count (nor move the schedule)");
    assert!(
        snapshot(&model, &opt) == snapshot(&reference, &ref_opt),
        "the scaled run equals the clean run, bit for bit"
    );
}

#[test]
fn skipped_steps_leave_adamw_groups_and_schedule_untouched() {
    run(|| {
        AdamW::new(1e-2)
            .build()
            .unwrap()
            .with_group(ParamGroup::new("bias", |n| n == "b").lr(5e-3).weight_decay(0.0))
            .unwrap()
            .with_schedule(WarmupCosine::with_min(50, 900, 0.1).unwrap())
    });
}

#[test]
fn skipped_steps_leave_sgd_momentum_untouched() {
    run(|| Sgd::new(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3).build().unwrap());
}
