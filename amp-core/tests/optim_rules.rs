//! Optimizers: PyTorch's update formulas (bit-exact against an op-by-op model of its
//! single-tensor path, and close to a textbook f64 reference), parameter groups, schedules,
//! checkpoints and validation.

use amp_core::optim::{
    Adam, AdamState, AdamW, LrSchedule, Optim, Optimizer, OptimizerState, ParamGroup, Sgd, WarmupCosine,
};
use amp_core::{Error, Grads, Param, Params, Rng, Tensor};

/// Named parameters for tests: `Vec<(name, Param)>`.
struct Named(Vec<(String, Param)>);

impl Params for Named {
    fn named_params(&self) -> Vec<(String, &Param)> {
        self.0.iter().map(|(n, p)| (n.clone(), p)).collect()
    }
    fn named_params_mut(&mut self) -> Vec<(String, &mut Param)> {
        self.0.iter_mut().map(|(n, p)| (n.clone(), p)).collect()
    }
}

fn one(values: &[f32]) -> Named {
    Named(vec![("p".into(), Param::new(Tensor::from_vec(values.to_vec(), &[values.len()])))])
}

/// Gradients `g` for every parameter of `m` (one vector per parameter, in order).
fn grads_for(m: &Named, g: &[Vec<f32>]) -> Grads {
    let mut grads = Grads::new();
    for ((_, p), g) in m.0.iter().zip(g) {
        grads.insert(p.id(), Tensor::from_vec(g.clone(), p.shape()).into());
    }
    grads
}

/// One optimizer step with gradients `g` (see [`grads_for`]).
fn step(opt: &mut dyn Optimizer, m: &mut Named, g: &[Vec<f32>]) -> amp_core::Result<()> {
    let grads = grads_for(m, g);
    opt.step(m, &grads)
}

fn values(m: &Named, i: usize) -> Vec<f32> {
    m.0[i].1.to_vec()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn sgd_plain_momentum_nesterov_and_weight_decay() {
    let g = vec![vec![1.0f32]];
    // Plain: p -= lr * g.
    let mut m = one(&[1.0]);
    let mut opt = Sgd::new(0.1).build().unwrap();
    step(&mut opt, &mut m, &g).unwrap();
    assert_eq!(values(&m, 0), vec![1.0f32 - 0.1f32]);

    // Momentum 0.9: buffers 1, 1.9, 2.71 (f32 arithmetic).
    let mut m = one(&[0.0]);
    let mut opt = Sgd::new(0.1).momentum(0.9).build().unwrap();
    let (mut p, mut buf) = (0f32, 0f32);
    for t in 0..3 {
        step(&mut opt, &mut m, &g).unwrap();
        buf = if t == 0 { 1.0 } else { 1.0f32.mul_add(1.0, buf * 0.9f32) };
        p = buf.mul_add(-0.1f32, p);
        assert_eq!(values(&m, 0), vec![p], "step {t}");
    }
    assert!((buf - 2.71).abs() < 1e-6);
    assert_eq!(opt.param_state("p").unwrap().momentum_buffer.as_deref(), Some(&[buf][..]));

    // Nesterov: the step is g + momentum * buf.
    let mut m = one(&[0.0]);
    let mut opt = Sgd::new(0.1).momentum(0.9).nesterov(true).build().unwrap();
    let (mut p, mut buf) = (0f32, 0f32);
    for t in 0..3 {
        step(&mut opt, &mut m, &g).unwrap();
        buf = if t == 0 { 1.0 } else { 1.0f32.mul_add(1.0, buf * 0.9f32) };
        p = buf.mul_add(0.9f32, 1.0).mul_add(-0.1f32, p);
        assert_eq!(values(&m, 0), vec![p], "step {t}");
    }

    // Weight decay adds wd * p to the gradient; dampening scales the gradient in the buffer.
    let mut m = one(&[2.0]);
    let mut opt = Sgd::new(0.5).weight_decay(0.25).build().unwrap();
    step(&mut opt, &mut m, &[vec![0.0]]).unwrap();
    assert_eq!(values(&m, 0), vec![2.0 - 0.5 * 0.5]);
    let mut m = one(&[0.0]);
    let mut opt = Sgd::new(1.0).momentum(0.5).dampening(0.5).build().unwrap();
    for _ in 0..2 {
        step(&mut opt, &mut m, &g).unwrap();
    }
    // buf: 1, then 0.5 * 1 + 0.5 * 1 = 1; p = -1 - 1.
    assert_eq!(values(&m, 0), vec![-2.0]);
}

/// PyTorch's `_single_tensor_adam`, one torch op at a time on one element (f32 values, f64
/// Python scalars; `add_`/`lerp_` as the fused multiply-adds of its vectorised kernels).
fn torch_adam_element(
    p: &mut f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    step: u64,
    (lr, b1, b2, eps, wd): (f64, f64, f64, f64, f64),
    decoupled: bool,
) {
    let mut g = g;
    if decoupled {
        *p *= (1.0 - lr * wd) as f32; // param.mul_(1 - lr * weight_decay)
    } else if wd != 0.0 {
        g = p.mul_add(wd as f32, g); // grad = grad.add(param, alpha=weight_decay)
    }
    let w = (1.0 - b1) as f32;
    *m = w.mul_add(g - *m, *m); // exp_avg.lerp_(grad, 1 - beta1)
    *v *= b2 as f32; // exp_avg_sq.mul_(beta2)
    *v += ((1.0 - b2) as f32 * g) * g; // .addcmul_(grad, grad, value=1 - beta2)
    let bc1 = 1.0 - b1.powf(step as f64);
    let bc2 = 1.0 - b2.powf(step as f64);
    let step_size = lr / bc1;
    let denom = v.sqrt() / (bc2.sqrt() as f32) + eps as f32; // (sqrt / bc2_sqrt).add_(eps)
    *p += ((-step_size) as f32 * *m) / denom; // param.addcdiv_(exp_avg, denom, value=-step_size)
}

fn adam_matches_op_by_op_model(decoupled: bool) {
    // Large enough for the parallel path (several chunks), with an odd tail.
    let n = 300_007;
    let mut rng = Rng::seed(3);
    let init: Vec<f32> = Tensor::<f32>::randn(&[n], &mut rng).to_vec();
    let mut m = Named(vec![("p".into(), Param::new(Tensor::from_vec(init.clone(), &[n])))]);
    let (lr, b1, b2, eps, wd) = (3e-3, 0.9, 0.95, 1e-8, 0.1);
    let mut opt: Box<dyn Optimizer> = if decoupled {
        Box::new(AdamW::new(lr).betas(b1, b2).eps(eps).weight_decay(wd).build().unwrap())
    } else {
        Box::new(Adam::new(lr).betas(b1, b2).eps(eps).weight_decay(wd).build().unwrap())
    };
    let (mut p, mut mm, mut vv) = (init.clone(), vec![0f32; n], vec![0f32; n]);
    let mut exact: Vec<f64> = init.iter().map(|x| *x as f64).collect();
    let (mut m64, mut v64) = (vec![0f64; n], vec![0f64; n]);
    for t in 1..=8u64 {
        let g: Vec<f32> = Tensor::<f32>::randn(&[n], &mut rng).to_vec();
        step(&mut opt, &mut m, std::slice::from_ref(&g)).unwrap();
        for i in 0..n {
            torch_adam_element(&mut p[i], g[i], &mut mm[i], &mut vv[i], t, (lr, b1, b2, eps, wd), decoupled);
            // Textbook Adam / AdamW in f64.
            let mut gi = g[i] as f64;
            if decoupled {
                exact[i] *= 1.0 - lr * wd;
            } else {
                gi += wd * exact[i];
            }
            m64[i] = b1 * m64[i] + (1.0 - b1) * gi;
            v64[i] = b2 * v64[i] + (1.0 - b2) * gi * gi;
            let mhat = m64[i] / (1.0 - b1.powi(t as i32));
            let vhat = v64[i] / (1.0 - b2.powi(t as i32));
            exact[i] -= lr * mhat / (vhat.sqrt() + eps);
        }
        assert_eq!(bits(&values(&m, 0)), bits(&p), "step {t}: fused kernel vs op-by-op model");
    }
    let worst = values(&m, 0).iter().zip(&exact).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-5, "f32 Adam drifted {worst} from the f64 reference");
}

#[test]
fn adam_matches_pytorchs_op_sequence_bit_for_bit() {
    adam_matches_op_by_op_model(false);
}

#[test]
fn adamw_matches_pytorchs_op_sequence_bit_for_bit() {
    adam_matches_op_by_op_model(true);
}

#[test]
fn adam_defaults_are_pytorchs() {
    let a = Adam::default();
    assert_eq!((a.lr, a.betas, a.eps, a.weight_decay), (1e-3, (0.9, 0.999), 1e-8, 0.0));
    let w = AdamW::default();
    assert_eq!((w.lr, w.betas, w.eps, w.weight_decay), (1e-3, (0.9, 0.999), 1e-8, 0.01));
}

#[test]
fn adam_first_step_moves_each_weight_by_about_lr() {
    let mut m = one(&[1.0, -1.0, 0.5]);
    let mut opt = Adam::new(0.01).build().unwrap();
    step(&mut opt, &mut m, &[vec![3.0, -0.001, 100.0]]).unwrap();
    let moved: Vec<f32> = values(&m, 0).iter().zip([1.0f32, -1.0, 0.5]).map(|(a, b)| a - b).collect();
    for (d, sign) in moved.iter().zip([-1.0f32, 1.0, -1.0]) {
        assert!((d - sign * 0.01).abs() < 1e-6, "{moved:?}");
    }
    assert_eq!(opt.param_state("p").unwrap().step, 1);
}

#[test]
fn adamw_decays_weights_without_gradient_signal() {
    let mut m = one(&[1.0, -4.0]);
    let mut opt = AdamW::new(0.1).weight_decay(0.5).build().unwrap();
    let mut p = [1.0f32, -4.0];
    for _ in 0..5 {
        step(&mut opt, &mut m, &[vec![0.0, 0.0]]).unwrap();
        for x in p.iter_mut() {
            *x *= (1.0f64 - 0.1 * 0.5) as f32;
        }
        assert_eq!(values(&m, 0), p.to_vec());
    }
}

#[test]
fn parameter_groups_get_their_own_rates() {
    let mut m = Named(vec![
        ("layer.weight".into(), Param::new(Tensor::from_vec(vec![1.0f32], &[1]))),
        ("layer.bias".into(), Param::new(Tensor::from_vec(vec![1.0f32], &[1]))),
        ("head.bias".into(), Param::new(Tensor::from_vec(vec![1.0f32], &[1]))),
    ]);
    let mut opt = Sgd::new(0.5)
        .weight_decay(1.0)
        .build()
        .unwrap()
        .with_group(ParamGroup::new("head", |n| n.starts_with("head")).lr(0.25))
        .unwrap()
        .with_group(ParamGroup::new("biases", |n| n.ends_with("bias")).lr(0.125).weight_decay(0.0))
        .unwrap();
    step(&mut opt, &mut m, &[vec![1.0], vec![1.0], vec![1.0]]).unwrap();
    // weight: default group, g = 1 + 1·1 = 2, lr 0.5. layer.bias: "biases", g = 1, lr 0.125.
    // head.bias: the first matching group ("head"): lr 0.25 and the default weight decay.
    assert_eq!(values(&m, 0), vec![0.0]);
    assert_eq!(values(&m, 1), vec![0.875]);
    assert_eq!(values(&m, 2), vec![0.5]);
    assert_eq!(opt.hyper_for("head.bias", 0).weight_decay, 1.0);
}

#[test]
fn the_schedule_scales_every_group_by_applied_steps() {
    let schedule = WarmupCosine::new(4, 20).unwrap();
    let expected: Vec<f64> = (0..25).map(|t| schedule.factor(t)).collect();
    assert_eq!(&expected[..4], &[0.25, 0.5, 0.75, 1.0]);
    assert_eq!(expected[4], 1.0);
    assert!(expected[5..20].windows(2).all(|w| w[1] < w[0]), "cosine decays monotonically");
    assert_eq!(expected[20], 0.0);

    let mut m = one(&[0.0]);
    let mut opt = Sgd::new(1.0).build().unwrap().with_schedule(schedule);
    let mut p = 0f32;
    for t in 0..25u64 {
        assert_eq!(opt.lr(), expected[t as usize]);
        step(&mut opt, &mut m, &[vec![1.0]]).unwrap();
        p = 1.0f32.mul_add(-(expected[t as usize] as f32), p);
        assert_eq!(values(&m, 0), vec![p], "step {t}");
    }
    // A closure is a schedule too.
    let opt = Sgd::new(2.0).build().unwrap().with_schedule(|t: u64| 1.0 / (t + 1) as f64);
    assert_eq!((opt.lr_at(0), opt.lr_at(3)), (2.0, 0.5));
    assert!(WarmupCosine::new(10, 5).is_err() && WarmupCosine::with_min(0, 5, 2.0).is_err());
}

#[test]
fn parameters_without_gradients_are_left_alone() {
    let mut m = Named(vec![
        ("a".into(), Param::new(Tensor::from_vec(vec![1.0f32], &[1]))),
        ("b".into(), Param::new(Tensor::from_vec(vec![1.0f32], &[1]))),
    ]);
    let mut grads = Grads::new();
    grads.insert(m.0[0].1.id(), Tensor::from_vec(vec![1.0f32], &[1]).into());
    let mut opt = Adam::new(0.1).build().unwrap();
    opt.step(&mut m, &grads).unwrap();
    assert_ne!(values(&m, 0), vec![1.0]);
    assert_eq!(values(&m, 1), vec![1.0]);
    assert!(opt.param_state("b").is_none());
}

#[test]
fn checkpoints_round_trip_through_json_and_resume_bit_identically() {
    let mut rng = Rng::seed(11);
    let init = Tensor::<f32>::randn(&[5, 3], &mut rng);
    let grads_seq: Vec<Vec<f32>> = (0..20).map(|_| Tensor::<f32>::randn(&[15], &mut rng).to_vec()).collect();
    let make = || {
        AdamW::new(1e-2)
            .build()
            .unwrap()
            .with_schedule(WarmupCosine::new(3, 30).unwrap())
            .with_group(ParamGroup::new("w", |n| n == "w").weight_decay(0.0))
            .unwrap()
    };
    let model = || Named(vec![("w".into(), Param::new(init.clone()))]);

    let mut straight = model();
    let mut opt = make();
    for g in &grads_seq {
        step(&mut opt, &mut straight, std::slice::from_ref(g)).unwrap();
    }

    let mut first = model();
    let mut opt1 = make();
    for g in &grads_seq[..10] {
        step(&mut opt1, &mut first, std::slice::from_ref(g)).unwrap();
    }
    let json = serde_json::to_string(&opt1.state_dict()).unwrap();
    let mut resumed = Named(vec![("w".into(), Param::new(first.0[0].1.tensor().clone()))]);
    let mut opt2 = make();
    let state: OptimizerState<AdamState> = serde_json::from_str(&json).unwrap();
    opt2.load_state_dict(state).unwrap();
    opt2.check_params(&resumed).unwrap();
    assert_eq!((opt2.steps(), opt2.lr()), (10, opt1.lr()));
    for g in &grads_seq[10..] {
        step(&mut opt2, &mut resumed, std::slice::from_ref(g)).unwrap();
    }
    assert_eq!(bits(&values(&resumed, 0)), bits(&values(&straight, 0)));
    assert_eq!(opt2.state_dict(), opt.state_dict());
}

#[test]
fn mismatched_checkpoints_and_gradients_are_refused_before_any_change() {
    let mut m = one(&[1.0, 2.0]);
    let mut opt = Adam::new(0.1).build().unwrap();
    step(&mut opt, &mut m, &[vec![1.0, 1.0]]).unwrap();
    let state = opt.state_dict();

    let mut sgd = Sgd::new(0.1).build().unwrap();
    let wrong_kind =
        OptimizerState { kind: state.kind.clone(), steps: 1, params: Default::default(), hyperparameters: None };
    assert!(sgd.load_state_dict(wrong_kind).unwrap_err().to_string().contains("adam"));

    let mut other = one(&[1.0, 2.0, 3.0]);
    let mut opt2 = Adam::new(0.1).build().unwrap();
    opt2.load_state_dict(state.clone()).unwrap();
    let err = opt2.check_params(&other).unwrap_err();
    assert!(matches!(err, Error::State { .. }) && err.to_string().contains("`p`"), "{err}");
    let before = values(&other, 0);
    assert!(step(&mut opt2, &mut other, &[vec![1.0; 3]]).is_err());
    assert_eq!(values(&other, 0), before);
    assert_eq!(opt2.state_dict(), state, "a refused step changes no state");

    let renamed = Named(vec![("q".into(), Param::new(Tensor::from_vec(vec![1.0f32, 2.0], &[2])))]);
    assert!(opt2.check_params(&renamed).unwrap_err().to_string().contains("not a parameter"));

    // A gradient of the wrong shape.
    let mut grads = Grads::new();
    grads.insert(m.0[0].1.id(), Tensor::from_vec(vec![1.0f32, 1.0], &[2, 1]).into());
    assert!(matches!(opt.step(&mut m, &grads), Err(Error::Shape { .. })));
}

#[test]
fn hyperparameters_are_validated() {
    let errs = [
        Sgd::new(-0.1).build().err(),
        Sgd::new(0.1).nesterov(true).build().err(),
        Sgd::new(0.1).momentum(0.9).dampening(0.1).nesterov(true).build().err(),
        Sgd::new(0.1).weight_decay(f64::NAN).build().err(),
        Adam::new(0.1).betas(1.0, 0.999).build().err(),
        Adam::new(0.1).betas(0.9, -0.1).build().err(),
        AdamW::new(0.1).eps(-1.0).build().err(),
        AdamW::new(f64::INFINITY).build().err(),
    ];
    for e in errs {
        let e = e.expect("refused");
        assert!(matches!(e, Error::State { .. }), "{e}");
    }
    let nesterov = Sgd::new(0.1).nesterov(true).build().unwrap_err().to_string();
    assert!(nesterov.contains("Nesterov momentum requires a momentum and zero dampening"), "{nesterov}");
}

#[test]
fn optimizers_work_behind_trait_objects() {
    let mut m = one(&[1.0]);
    let mut opts: Vec<Box<dyn Optimizer>> = vec![
        Box::new(Sgd::new(0.1).build().unwrap()),
        Box::new(Adam::new(0.1).build().unwrap()),
        Box::new(AdamW::new(0.1).build().unwrap()),
    ];
    for opt in opts.iter_mut() {
        step(opt.as_mut(), &mut m, &[vec![1.0]]).unwrap();
        assert_eq!(opt.steps(), 1);
    }
    assert!(values(&m, 0)[0] < 0.8);
    let _: &Optim<Sgd> = &Sgd::new(0.1).build().unwrap();
}

#[test]
fn a_checkpoint_refuses_an_optimizer_built_with_other_hyperparameters() {
    // PyTorch's `opt.load_state_dict` restores the saved learning rates and weight decays; here
    // the optimizer is built with them, so a resume built with others would silently train
    // differently (found porting a fine-tuning loop). Refused, unless asked for.
    use amp_core::optim::ParamGroup;
    let make = |lr: f64, no_decay_wd: f64| {
        AdamW::new(lr)
            .weight_decay(0.1)
            .build()
            .unwrap()
            .with_group(ParamGroup::new("no_decay", |n| n == "p").weight_decay(no_decay_wd))
            .unwrap()
    };
    let mut m = one(&[1.0, 2.0]);
    let mut opt = make(3e-4, 0.0);
    step(&mut opt, &mut m, &[vec![1.0, 1.0]]).unwrap();
    let state = opt.state_dict();
    let json = serde_json::to_string(&state).unwrap();
    assert!(json.contains("\"hyperparameters\""), "{json}");

    make(3e-4, 0.0).load_state_dict(state.clone()).unwrap();
    for (mut other, what) in [(make(1e-3, 0.0), "lr: 0.001"), (make(3e-4, 0.01), "weight_decay: Some(0.01)")] {
        let err = other.load_state_dict(state.clone()).unwrap_err().to_string();
        assert!(err.contains("built with") && err.contains(what), "{err}");
        assert_eq!(other.steps(), 0, "a refused checkpoint changes nothing");
    }
    // On purpose: clear the record.
    let mut new_lr = make(1e-3, 0.0);
    new_lr.load_state_dict(OptimizerState { hyperparameters: None, ..state.clone() }).unwrap();
    assert_eq!(new_lr.steps(), 1);
    // A checkpoint written before the record was kept loads as before.
    let old_json =
        json.replace(&format!(",\"hyperparameters\":{}", serde_json::to_string(&state.hyperparameters).unwrap()), "");
    assert!(!old_json.contains("hyperparameters"));
    let old: OptimizerState<AdamState> = serde_json::from_str(&old_json).unwrap();
    make(1e-3, 0.0).load_state_dict(old).unwrap();
}

#[test]
fn group_values_schedule_factors_and_groups_without_parameters_are_refused_before_any_change() {
    // Each of these wrote NaN into the weights, ascended the gradient or decayed the biases
    // without a word (found by a probe of PyTorch habits: `LambdaLR` closures, typo'd groups).
    let named = || {
        Named(vec![
            ("fc.weight".into(), Param::new(Tensor::from_vec(vec![1.0f32, 2.0], &[2]))),
            ("fc.bias".into(), Param::new(Tensor::from_vec(vec![1.0f32], &[1]))),
        ])
    };
    let bias = || ParamGroup::new("no_decay", |n| n.ends_with("bias"));
    for (group, what) in [
        (bias().lr(f64::NAN), "invalid learning rate: NaN"),
        (bias().lr(-1e-3), "invalid learning rate: -0.001"),
        (bias().weight_decay(f64::INFINITY), "invalid weight_decay value: inf"),
        (bias().weight_decay(-5.0), "invalid weight_decay value: -5"),
    ] {
        let err = AdamW::new(1e-3).build().unwrap().with_group(group).unwrap_err().to_string();
        assert!(err.contains("parameter group `no_decay`") && err.contains(what), "{err}");
    }

    let refused = |mut opt: Optim<Sgd>, what: &str| {
        let mut m = named();
        let err = step(&mut opt, &mut m, &[vec![0.5, 0.5], vec![0.5]]).unwrap_err().to_string();
        assert!(err.contains(what), "{err}");
        assert_eq!((values(&m, 0), values(&m, 1)), (vec![1.0, 2.0], vec![1.0]), "{what}");
        assert_eq!(opt.steps(), 0);
    };
    let sgd = || Sgd::new(0.1).weight_decay(0.1).build().unwrap();
    refused(sgd().with_schedule(|_t: u64| f64::NAN), "factor NaN at applied step 0");
    refused(sgd().with_schedule(|_t: u64| -1.0), "factor -1 at applied step 0");
    refused(sgd().with_schedule(|_t: u64| 1e308).with_group(bias().lr(10.0)).unwrap(), "times the learning rate 10");
    // The factor is checked at every step, not only the first.
    let mut opt = sgd().with_schedule(|t: u64| if t < 2 { 1.0 } else { f64::NAN });
    let mut m = named();
    for t in 0..3 {
        let r = step(&mut opt, &mut m, &[vec![0.5, 0.5], vec![0.5]]);
        assert_eq!(r.is_err(), t == 2, "step {t}: {r:?}");
    }
    assert!(values(&m, 0).iter().all(|v| v.is_finite()));

    refused(
        sgd().with_group(ParamGroup::new("no_decay", |n| n.ends_with(".b")).weight_decay(0.0)).unwrap(),
        "parameter group `no_decay` gets no parameter: its predicate matches none of the 2 parameter names \
         (fc.weight, fc.bias)",
    );
    refused(
        sgd().with_group(bias().lr(0.2)).unwrap().with_group(ParamGroup::new("b", |n| n == "fc.bias")).unwrap(),
        "parameter group `b` gets no parameter: every parameter it matches goes to the earlier group `no_decay`",
    );
    // A group that gets a parameter steps as before.
    let mut ok = sgd().with_group(bias().weight_decay(0.0)).unwrap();
    let mut m = named();
    step(&mut ok, &mut m, &[vec![0.5, 0.5], vec![0.5]]).unwrap();
    assert_eq!(values(&m, 1), vec![0.95]);
}
