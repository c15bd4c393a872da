//! The scaler's rules, one test per fact of `shared/reference/grad_scaler.md` ("facts that
//! tests should pin"), plus its options, validation, checkpoint format and the no-op scaler.

use amp_core::optim::{Optimizer, Sgd};
use amp_core::scaler::{GradScaler, GradScalerOptions, GradScalerState, LossScaler, NoScale, ScalerFor, StepReport};
use amp_core::{Error, Param, Params, Tensor, bf16, f16};

/// A one-parameter model whose gradient is `coef` (times the scale).
struct Probe {
    p: Param,
}

impl Params for Probe {
    fn named_params(&self) -> Vec<(String, &Param)> {
        vec![("p".into(), &self.p)]
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        vec![("p".into(), &mut self.p)]
    }
}

fn probe() -> Probe {
    Probe { p: Param::new(Tensor::from_vec(vec![1.0f32, -2.0, 0.5], &[3])) }
}

fn loss_of(p: &Param, coef: [f32; 3]) -> Tensor<f32> {
    p.tensor().mul(&Tensor::from_vec(coef.to_vec(), &[3])).sum_all()
}

const OK: [f32; 3] = [1.0, -0.5, 0.25];
const INF: [f32; 3] = [1.0, f32::INFINITY, 0.25];

/// One full iteration with a clean (`true`) or overflowing (`false`) gradient.
fn iteration<K: LossScaler>(scaler: &mut K, model: &mut Probe, opt: &mut impl Optimizer, ok: bool) -> StepReport {
    let loss = loss_of(&model.p, if ok { OK } else { INF });
    scaler.scale(loss).backward().unscale().step(opt, model).update().unwrap()
}

fn scaler_with(growth_interval: i32, init_scale: f32) -> GradScaler {
    GradScaler::with_options(GradScalerOptions { growth_interval, init_scale, ..Default::default() }).unwrap()
}

#[test]
fn defaults_are_pytorchs() {
    let o = GradScalerOptions::default();
    assert_eq!((o.init_scale, o.growth_factor, o.backoff_factor, o.growth_interval), (65536.0, 2.0, 0.5, 2000));
    assert!(o.enabled && o.min_scale.is_none() && o.max_scale.is_none() && !o.error_at_min_scale);
    assert_eq!(o.hysteresis, 1);
    let s = GradScaler::new();
    assert_eq!((s.get_scale(), s.growth_tracker()), (65536.0, 0));
}

#[test]
fn interval_3_grows_on_the_third_good_step() {
    let (mut s, mut m, mut opt) = (scaler_with(3, 65536.0), probe(), Sgd::new(0.1).build().unwrap());
    let r = iteration(&mut s, &mut m, &mut opt, true);
    assert_eq!((r.scale, r.growth_tracker), (65536.0, 1));
    let r = iteration(&mut s, &mut m, &mut opt, true);
    assert_eq!((r.scale, r.growth_tracker), (65536.0, 2));
    let r = iteration(&mut s, &mut m, &mut opt, true);
    assert_eq!((r.scale, r.growth_tracker), (131072.0, 0));
}

#[test]
fn overflow_backs_off_and_resets_the_tracker() {
    let (mut s, mut m, mut opt) = (scaler_with(3, 65536.0), probe(), Sgd::new(0.1).build().unwrap());
    iteration(&mut s, &mut m, &mut opt, true);
    iteration(&mut s, &mut m, &mut opt, true);
    let r = iteration(&mut s, &mut m, &mut opt, false);
    assert!(r.skipped);
    assert_eq!((r.scale_used, r.scale, r.growth_tracker), (65536.0, 32768.0, 0));
    for expected in [(32768.0, 1), (32768.0, 2), (65536.0, 0)] {
        let r = iteration(&mut s, &mut m, &mut opt, true);
        assert!(!r.skipped);
        assert_eq!((r.scale, r.growth_tracker), expected);
    }
}

#[test]
fn growth_to_a_non_finite_scale_is_refused_but_resets_the_tracker() {
    let top = 2f32.powi(127);
    let (mut s, mut m, mut opt) = (scaler_with(1, top), probe(), Sgd::new(0.1).build().unwrap());
    let r = iteration(&mut s, &mut m, &mut opt, true);
    assert!(!r.skipped, "2^127 × a small gradient is finite");
    assert_eq!((r.scale, r.growth_tracker), (top, 0));
}

#[test]
fn seventeen_overflows_take_65536_to_one_half_with_no_floor() {
    let (mut s, mut m, mut opt) = (GradScaler::new(), probe(), Sgd::new(0.1).build().unwrap());
    for _ in 0..17 {
        assert!(iteration(&mut s, &mut m, &mut opt, false).skipped);
    }
    assert_eq!(s.get_scale(), 0.5);
    // PyTorch has no floor: the scale keeps collapsing towards 0.
    for _ in 0..200 {
        iteration(&mut s, &mut m, &mut opt, false);
    }
    assert_eq!(s.get_scale(), 0.0);
    assert_eq!(m.p.to_vec(), vec![1.0, -2.0, 0.5], "no overflowing step was applied");
}

#[test]
fn micro_batches_advance_the_tracker_once() {
    let (mut s, mut m, mut opt) = (scaler_with(3, 1024.0), probe(), Sgd::new(0.1).build().unwrap());
    let mut losses = (0..4).map(|_| loss_of(&m.p, OK));
    let mut grads = s.scale(losses.next().unwrap()).backward();
    grads.accumulate(losses.next().unwrap()).accumulate(losses.next().unwrap());
    grads.accumulate(losses.next().unwrap());
    assert_eq!(grads.micro_batches(), 4);
    // Accumulated before unscale: the sum of four scaled gradients, then one unscale.
    assert_eq!(grads.scaled_grads().get(&m.p).unwrap().to_vec(), vec![4096.0, -2048.0, 1024.0]);
    let unscaled = grads.unscale();
    assert_eq!(unscaled.grads().get(&m.p).unwrap().to_vec(), vec![4.0, -2.0, 1.0]);
    let r = unscaled.step(&mut opt, &mut m).update().unwrap();
    assert_eq!((r.micro_batches, r.growth_tracker, r.scale), (4, 1, 1024.0));
    assert_eq!(opt.steps(), 1);
}

#[test]
fn an_overflow_in_any_micro_batch_skips_the_step() {
    let (mut s, mut m, mut opt) = (GradScaler::new(), probe(), Sgd::new(0.1).build().unwrap());
    let (a, b) = (loss_of(&m.p, OK), loss_of(&m.p, INF));
    let mut grads = s.scale(a).backward();
    grads.accumulate(b);
    let r = grads.unscale().step(&mut opt, &mut m).update().unwrap();
    assert!(r.skipped);
    assert_eq!((r.scale, opt.steps()), (32768.0, 0));
}

#[test]
fn several_optimizers_skip_on_their_own_overflow_and_back_off_once() {
    let mut s = GradScaler::new();
    let (mut enc, mut dec) = (probe(), probe());
    let mut opt_enc = Sgd::new(0.1).build().unwrap();
    let mut opt_dec = Sgd::new(0.1).build().unwrap();
    // Only the decoder's gradient overflows.
    let loss = loss_of(&enc.p, OK).add(&loss_of(&dec.p, INF));
    let stepped =
        s.scale(loss).backward().unscale().step_many(&mut [(&mut opt_enc, &mut enc), (&mut opt_dec, &mut dec)]);
    assert!(stepped.skipped());
    let r = stepped.update().unwrap();
    assert_eq!((opt_enc.steps(), opt_dec.steps()), (1, 0));
    assert_eq!(enc.p.to_vec(), vec![0.9, -1.95, 0.475]);
    assert_eq!(dec.p.to_vec(), vec![1.0, -2.0, 0.5]);
    assert_eq!(r.scale, 32768.0, "one backoff however many optimizers overflowed");

    // Both overflow: still a single backoff.
    let loss = loss_of(&enc.p, INF).add(&loss_of(&dec.p, INF));
    let r = s
        .scale(loss)
        .backward()
        .unscale()
        .step_many(&mut [(&mut opt_enc, &mut enc), (&mut opt_dec, &mut dec)])
        .update()
        .unwrap();
    assert!(r.skipped);
    assert_eq!(r.scale, 16384.0);
}

#[test]
fn update_to_sets_the_scale_and_leaves_the_tracker() {
    let (mut s, mut m, mut opt) = (scaler_with(10, 65536.0), probe(), Sgd::new(0.1).build().unwrap());
    iteration(&mut s, &mut m, &mut opt, true);
    iteration(&mut s, &mut m, &mut opt, true);
    let loss = loss_of(&m.p, OK);
    let r = s.scale(loss).backward().unscale().step(&mut opt, &mut m).update_to(8.0).unwrap();
    assert_eq!((r.scale, r.growth_tracker), (8.0, 2));
    let loss = loss_of(&m.p, OK);
    let bad = s.scale(loss).backward().unscale().step(&mut opt, &mut m).update_to(f32::NAN);
    assert!(matches!(bad, Err(Error::State { .. })));
}

#[test]
fn options_are_validated_with_clear_errors() {
    let cases: Vec<(GradScalerOptions, &str)> = vec![
        (GradScalerOptions { growth_factor: 1.0, ..Default::default() }, "growth_factor"),
        (GradScalerOptions { backoff_factor: 1.0, ..Default::default() }, "backoff_factor"),
        (GradScalerOptions { backoff_factor: 0.0, ..Default::default() }, "backoff_factor"),
        (GradScalerOptions { growth_interval: 0, ..Default::default() }, "growth_interval"),
        (GradScalerOptions { init_scale: f32::INFINITY, ..Default::default() }, "init_scale"),
        (GradScalerOptions { init_scale: -1.0, ..Default::default() }, "init_scale"),
        (GradScalerOptions { hysteresis: 0, ..Default::default() }, "hysteresis"),
        (GradScalerOptions { error_at_min_scale: true, ..Default::default() }, "min_scale"),
        (GradScalerOptions { min_scale: Some(4.0), max_scale: Some(2.0), ..Default::default() }, "min_scale"),
        (GradScalerOptions { max_scale: Some(1024.0), ..Default::default() }, "init_scale"),
    ];
    for (opts, word) in cases {
        let err = GradScaler::with_options(opts.clone()).unwrap_err();
        assert!(matches!(err, Error::State { .. }), "{opts:?}");
        assert!(err.to_string().contains(word), "{err} should mention {word}");
    }
}

#[test]
fn state_dict_has_pytorchs_keys_and_round_trips_through_json() {
    let (mut s, mut m, mut opt) = (scaler_with(5, 65536.0), probe(), Sgd::new(0.1).build().unwrap());
    iteration(&mut s, &mut m, &mut opt, true);
    iteration(&mut s, &mut m, &mut opt, false);
    iteration(&mut s, &mut m, &mut opt, true);
    let json = serde_json::to_value(s.state_dict()).unwrap();
    let mut keys: Vec<&str> = json.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["_growth_tracker", "backoff_factor", "growth_factor", "growth_interval", "scale"]);
    assert_eq!(json["scale"], 32768.0);
    assert_eq!(json["_growth_tracker"], 1);
    let back: GradScalerState = serde_json::from_value(json).unwrap();
    assert_eq!(back, s.state_dict());
}

#[test]
fn loading_pytorch_state_before_the_first_step_is_used_by_it() {
    // What `json.dumps(torch.amp.GradScaler().state_dict())` gives after some training.
    let text =
        r#"{"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 2}"#;
    let state: GradScalerState = serde_json::from_str(text).unwrap();
    let (mut s, mut m, mut opt) = (GradScaler::new(), probe(), Sgd::new(0.1).build().unwrap());
    s.load_state_dict(&state).unwrap();
    let r = iteration(&mut s, &mut m, &mut opt, true);
    assert_eq!(r.scale_used, 256.0);
    assert_eq!((r.scale, r.growth_tracker), (512.0, 0), "the loaded tracker was at 2 of 3");

    let corrupt: GradScalerState = serde_json::from_str(
        r#"{"scale": 1.0, "growth_factor": 0.5, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 0}"#,
    )
    .unwrap();
    let err = s.load_state_dict(&corrupt).unwrap_err();
    assert!(err.to_string().contains("growth_factor"), "{err}");
    assert_eq!(s.get_scale(), 512.0, "a refused checkpoint changes nothing");
    // The tracker restarts at 0 when it reaches the interval: 3 of 3 cannot be saved.
    let past: GradScalerState = serde_json::from_str(
        r#"{"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 3}"#,
    )
    .unwrap();
    let err = s.load_state_dict(&past).unwrap_err();
    assert!(err.to_string().contains("_growth_tracker 3 must be below growth_interval 3"), "{err}");
    assert_eq!(s.get_scale(), 512.0);
}

#[test]
fn min_and_max_scale_clamp() {
    let opts = GradScalerOptions {
        init_scale: 4.0,
        growth_interval: 1,
        min_scale: Some(1.0),
        max_scale: Some(16.0),
        ..Default::default()
    };
    let (mut s, mut m, mut opt) = (GradScaler::with_options(opts).unwrap(), probe(), Sgd::new(0.1).build().unwrap());
    let scales: Vec<f32> = [false, false, false, true, true, true, true, true]
        .iter()
        .map(|ok| iteration(&mut s, &mut m, &mut opt, *ok).scale)
        .collect();
    assert_eq!(scales, vec![2.0, 1.0, 1.0, 2.0, 4.0, 8.0, 16.0, 16.0]);
}

#[test]
fn error_at_min_scale_stops_a_collapsed_run() {
    let opts = GradScalerOptions {
        init_scale: 4.0,
        min_scale: Some(1.0),
        error_at_min_scale: true,
        collapse_after: 1,
        ..Default::default()
    };
    let (mut s, mut m, mut opt) = (GradScaler::with_options(opts).unwrap(), probe(), Sgd::new(0.1).build().unwrap());
    for _ in 0..2 {
        iteration(&mut s, &mut m, &mut opt, false);
    }
    assert_eq!(s.get_scale(), 1.0);
    let loss = loss_of(&m.p, INF);
    let err = s.scale(loss).backward().unscale().step(&mut opt, &mut m).update().unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("collapsed") && msg.contains("min_scale = 1") && msg.contains("3 overflowing steps"), "{msg}");
}

#[test]
fn collapse_means_collapse_after_overflows_in_a_row_at_the_floor() {
    assert_eq!(GradScalerOptions::default().collapse_after, 20);
    let opts = GradScalerOptions {
        init_scale: 4.0,
        min_scale: Some(1.0),
        error_at_min_scale: true,
        collapse_after: 3,
        ..Default::default()
    };
    let (mut s, mut m, mut opt) = (GradScaler::with_options(opts).unwrap(), probe(), Sgd::new(0.1).build().unwrap());
    let attempt = |s: &mut GradScaler, m: &mut Probe, opt: &mut _, ok: bool| {
        let loss = loss_of(&m.p, if ok { OK } else { INF });
        s.scale(loss).backward().unscale().step(opt, m).update()
    };
    // Down to the floor (4 -> 2 -> 1), then overflows at the floor scattered among good steps:
    // each good step resets the count, so the run goes on.
    for ok in [false, false] {
        attempt(&mut s, &mut m, &mut opt, ok).unwrap();
    }
    for _ in 0..10 {
        for ok in [false, false, true] {
            let r = attempt(&mut s, &mut m, &mut opt, ok).unwrap();
            assert_eq!(r.skipped, !ok);
        }
    }
    // Three in a row at the floor: collapsed.
    attempt(&mut s, &mut m, &mut opt, false).unwrap();
    attempt(&mut s, &mut m, &mut opt, false).unwrap();
    let msg = attempt(&mut s, &mut m, &mut opt, false).unwrap_err().to_string();
    assert!(msg.contains("3 steps in a row overflowed") && msg.contains("collapse_after = 3"), "{msg}");
    let bad = GradScalerOptions { collapse_after: 0, ..Default::default() };
    assert!(GradScaler::with_options(bad).unwrap_err().to_string().contains("collapse_after"));
}

#[test]
fn hysteresis_tolerates_overflows_before_backing_off() {
    let opts = GradScalerOptions { hysteresis: 2, growth_interval: 2, ..Default::default() };
    let (mut s, mut m, mut opt) = (GradScaler::with_options(opts).unwrap(), probe(), Sgd::new(0.1).build().unwrap());
    let r = iteration(&mut s, &mut m, &mut opt, false);
    assert!(r.skipped, "a tolerated overflow still skips the step");
    assert_eq!(r.scale, 65536.0);
    assert_eq!(iteration(&mut s, &mut m, &mut opt, false).scale, 32768.0);
    assert_eq!(iteration(&mut s, &mut m, &mut opt, false).scale, 16384.0, "no tolerance left until growth");
    // Growth restores the tolerance (Megatron's rule).
    iteration(&mut s, &mut m, &mut opt, true);
    assert_eq!(iteration(&mut s, &mut m, &mut opt, true).scale, 32768.0);
    assert_eq!(iteration(&mut s, &mut m, &mut opt, false).scale, 32768.0);
    let json = serde_json::to_value(s.state_dict()).unwrap();
    assert_eq!(json["_hysteresis_tracker"], 1);
}

#[test]
fn disabled_scaler_steps_unscaled_and_skips_non_finite_steps_as_no_scale_does() {
    let (mut s, mut m, mut opt) = (GradScaler::disabled(), probe(), Sgd::new(0.1).build().unwrap());
    assert_eq!(s.get_scale(), 1.0);
    let loss = loss_of(&m.p, OK);
    let value = loss.item();
    let step = s.scale(loss);
    assert_eq!(step.scaled_value().item(), value);
    let r = step.backward().unscale().step(&mut opt, &mut m).update().unwrap();
    assert!(!r.skipped);
    assert_eq!(m.p.to_vec(), vec![0.9, -1.95, 0.475]);
    // PyTorch's enabled=False takes this step (inf in the weights); here it is skipped, as
    // with NoScale, and the scale stays 1.
    let before = m.p.to_vec();
    let r = iteration(&mut s, &mut m, &mut opt, false);
    assert!(r.skipped);
    assert_eq!(m.p.to_vec(), before);
    assert_eq!((r.scale, s.get_scale()), (1.0, 1.0));
}

#[test]
fn no_scale_does_no_arithmetic_but_skips_non_finite_steps() {
    let (mut s, mut m, mut opt) = (NoScale, probe(), Sgd::new(0.1).build().unwrap());
    let loss = loss_of(&m.p, OK);
    let grads = s.scale(loss).backward();
    assert_eq!(grads.scale_used(), 1.0);
    assert_eq!(grads.scaled_grads().get(&m.p).unwrap().to_vec(), vec![1.0, -0.5, 0.25]);
    let r = grads.unscale().step(&mut opt, &mut m).update().unwrap();
    assert_eq!((r.skipped, r.scale), (false, 1.0));
    let before = m.p.to_vec();
    let r = iteration(&mut s, &mut m, &mut opt, false);
    assert!(r.skipped);
    assert_eq!((m.p.to_vec(), r.scale), (before, 1.0));
}

#[test]
fn the_scaler_is_chosen_by_precision() {
    fn name<P: amp_core::Precision>() -> &'static str
    where
        amp_core::NeedsLossScaling<P>: amp_core::scaler::SelectScaler,
    {
        std::any::type_name::<ScalerFor<P>>()
    }
    assert!(name::<f16>().ends_with("GradScaler"));
    assert!(name::<bf16>().ends_with("NoScale"));
    assert!(name::<f32>().ends_with("NoScale"));
}

#[test]
fn f16_gradients_are_refused_like_pytorch() {
    let mut s = GradScaler::new();
    let leaf = Tensor::<f16>::from_f32s(&[1.0, 2.0], &[2]).requires_grad_();
    let loss = leaf.cast::<f32>().sum_all();
    let err = s.scale(loss).backward().try_unscale().expect_err("refused");
    assert!(err.to_string().contains("f16"), "{err}");
}

#[test]
fn a_loss_computed_in_f16_needs_a_scaler_that_scales() {
    let (mut m, x) = (probe(), Tensor::<f32>::from_f32s(&[1.0, 2.0, 3.0], &[3]));
    let f16_loss = |m: &Probe| x.cast::<f16>().mul(&m.p.cast::<f16>()).cast::<f32>().sum_all();
    // NoScale (bf16/f32 training) and a disabled GradScaler refuse it at `scale`, naming the fix.
    let mut none = NoScale;
    let err = none.try_scale(f16_loss(&m)).expect_err("NoScale refuses an f16 graph");
    let msg = err.to_string();
    assert!(msg.contains("`mul`") || msg.contains("`cast`"), "{msg}");
    assert!(msg.contains("GradScaler::new()"), "{msg}");
    let mut off = GradScaler::disabled();
    assert!(off.try_scale(f16_loss(&m)).is_err(), "a disabled GradScaler refuses it too");
    // An enabled GradScaler takes it (f32 master gradients), and so does NoScale in bf16.
    let mut opt = Sgd::new(0.1).build().unwrap();
    let r = scaler_with(2000, 1024.0).scale(f16_loss(&m)).backward().unscale().step(&mut opt, &mut m).update().unwrap();
    assert!(!r.skipped);
    let bf16_loss = x.cast::<bf16>().mul(&m.p.cast::<bf16>()).cast::<f32>().sum_all();
    let r = none.scale(bf16_loss).backward().unscale().step(&mut opt, &mut m).update().unwrap();
    assert!(!r.skipped);
}

#[test]
fn bf16_with_a_grad_scaler_works() {
    let (mut m, mut s, mut opt) = (probe(), GradScaler::new(), Sgd::new(0.1).build().unwrap());
    let x = Tensor::<f32>::from_f32s(&[1.0, 2.0, 3.0], &[3]);
    let loss = x.cast::<bf16>().mul(&m.p.cast::<bf16>()).cast::<f32>().sum_all();
    let r = s.scale(loss).backward().unscale().step(&mut opt, &mut m).update().unwrap();
    assert!(!r.skipped);
    for (got, want) in m.p.to_vec().iter().zip([0.9, -2.2, 0.2]) {
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}

#[test]
fn bf16_and_f64_gradients_are_unscaled_in_their_precision() {
    let mut s = scaler_with(2000, 1024.0);
    let b = Tensor::<bf16>::from_f32s(&[0.5, -3.0], &[2]).requires_grad_();
    let d = Tensor::<f64>::from_vec(vec![0.25, 7.0], &[2]).requires_grad_();
    let loss = b.cast::<f32>().sum_all().add(&d.cast::<f32>().square().sum_all());
    let u = s.scale(loss).backward().unscale();
    assert_eq!(u.grads().get(&b).unwrap().to_f64_vec(), vec![1.0, 1.0]);
    assert_eq!(u.grads().get(&d).unwrap().to_vec(), vec![0.5, 14.0]);
    u.abandon();
}

#[test]
fn clipping_unscaled_gradients_follows_pytorch() {
    let (mut s, mut m) = (GradScaler::new(), probe());
    let loss = loss_of(&m.p, [3.0, 4.0, 0.0]);
    let mut u = s.scale(loss).backward().unscale();
    assert_eq!(u.grad_norm(), 5.0);
    let norm = u.clip_grad_norm(1.0);
    assert_eq!(norm, 5.0);
    let coef = (1.0f32 / (5.0 + 1e-6)) * 1.0;
    assert_eq!(u.grads().get(&m.p).unwrap().to_vec(), vec![3.0 * coef, 4.0 * coef, 0.0]);
    // A norm under max_norm leaves the gradients as they are (coefficient clamped to 1).
    let norm2 = u.clip_grad_norm(10.0);
    assert!((norm2 - 1.0).abs() < 1e-6);
    u.clip_grad_value(0.5);
    assert!(u.grads().get(&m.p).unwrap().to_vec().iter().all(|v| v.abs() <= 0.5));
    assert!(u.try_clip_grad_norm(0.0).is_err() && u.try_clip_grad_value(-1.0).is_err());
    let mut opt = Sgd::new(1.0).build().unwrap();
    let r = u.step(&mut opt, &mut m).update().unwrap();
    assert_eq!(r.grad_norm, Some(norm2));
}

#[test]
fn a_loss_that_cannot_backpropagate_is_an_error() {
    let mut s = GradScaler::new();
    let constant = Tensor::<f32>::scalar(1.0);
    assert!(s.scale(constant).try_backward().is_err());
    let vector = probe().p.tensor().clone();
    assert!(s.scale(vector).try_backward().is_err());
    assert_eq!(s.get_scale(), 65536.0, "an abandoned iteration leaves the scaler alone");
}

#[test]
fn both_scalers_checkpoint_through_the_trait() {
    fn round_trip<K: LossScaler>(from: &K, into: &mut K) -> String {
        let json = serde_json::to_string(&from.state_dict()).unwrap();
        into.load_state_dict(&serde_json::from_str(&json).unwrap()).unwrap();
        json
    }
    let (mut a, mut m, mut opt) = (scaler_with(2000, 1024.0), probe(), Sgd::new(0.1).build().unwrap());
    iteration(&mut a, &mut m, &mut opt, false); // back off once: scale 512
    let mut b = GradScaler::new();
    let json = round_trip(&a, &mut b);
    assert!(json.contains("\"_growth_tracker\":0") && json.contains("\"scale\":512.0"), "{json}");
    assert_eq!((b.get_scale(), b.growth_tracker()), (512.0, 0));
    assert_eq!(round_trip(&NoScale, &mut NoScale), "null");
}
