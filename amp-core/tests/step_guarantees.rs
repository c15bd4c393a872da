//! Run-time guarantees of the training step that types cannot give: a step is never dropped
//! silently, gradients are applied once, an optimizer steps the parameters it is bound to, a
//! cloned parameter is a new parameter, and the scaler fits the precision.

use amp_core::optim::{Optim, Optimizer, Sgd, SgdState};
use amp_core::scaler::{GradScaler, GradScalerOptions, LossScaler, NoScale};
use amp_core::{Param, Params, Rng, Tensor, f16};

#[derive(Clone, amp_core::Params)]
struct Model {
    w: Param,
}

fn model(seed: u64) -> Model {
    Model { w: Param::new(Tensor::<f32>::randn(&[4, 2], &mut Rng::seed(seed))) }
}

fn loss(m: &Model) -> Tensor<f32> {
    let x = Tensor::<f32>::from_f32s(&[0.5, -1.0, 0.25, 2.0], &[1, 4]);
    x.cast::<f16>().matmul(&m.w.cast::<f16>()).cast::<f32>().square().mean_all()
}

/// A GradScaler whose scale this model's f16 gradients never overflow at (the tests here are
/// about the step, not about backing off).
fn scaler() -> GradScaler {
    GradScaler::with_options(GradScalerOptions { init_scale: 256.0, ..Default::default() }).unwrap()
}

fn sgd() -> Optim<amp_core::optim::Sgd> {
    Sgd::new(0.1).build().unwrap()
}

// ---- a step is never dropped silently ------------------------------------------------------

#[test]
#[should_panic(expected = "a training step was dropped after `scaler.scale(loss)`, before `.backward()`")]
fn dropping_a_scaled_loss_panics() {
    let (m, mut s) = (model(0), scaler());
    let _step = s.scale(loss(&m));
}

#[test]
#[should_panic(expected = "keep one step and call `.accumulate(loss)`")]
fn a_line_by_line_port_of_pytorch_accumulation_panics_at_the_first_lost_micro_batch() {
    // for i, batch in enumerate(loader):
    //     scaler.scale(loss / 4).backward()
    //     if (i + 1) % 4 == 0: scaler.step(opt); scaler.update()
    let (mut m, mut s, mut opt) = (model(0), scaler(), sgd());
    for i in 0..8 {
        let grads = s.scale(loss(&m).div_scalar(4.0)).backward();
        if (i + 1) % 4 == 0 {
            grads.unscale().step(&mut opt, &mut m).update().unwrap();
        }
    }
}

#[test]
#[should_panic(expected = "after `.unscale()`, before `.step(&mut optimizer, &mut model)`")]
fn dropping_unscaled_gradients_panics() {
    let (m, mut s) = (model(0), scaler());
    let grads = s.scale(loss(&m)).backward().unscale();
    let _ = grads.found_inf();
}

#[test]
#[should_panic(expected = "after `.step(..)`, before `.update()`: the loss scale was not updated")]
fn binding_the_step_and_forgetting_update_panics() {
    let (mut m, mut s, mut opt) = (model(0), scaler(), sgd());
    for _ in 0..3 {
        let stepped = s.scale(loss(&m)).backward().unscale().step(&mut opt, &mut m);
        let _skipped = stepped.skipped();
    }
}

#[test]
fn abandon_discards_a_step_on_purpose_at_every_stage() {
    let (mut m, mut s, mut opt) = (model(0), scaler(), sgd());
    s.scale(loss(&m)).abandon();
    s.scale(loss(&m)).backward().abandon();
    s.scale(loss(&m)).backward().unscale().abandon();
    let before = (s.get_scale(), s.growth_tracker());
    s.scale(loss(&m)).backward().unscale().step(&mut opt, &mut m).abandon();
    assert_eq!((s.get_scale(), s.growth_tracker()), before, "an abandoned step does not update the scaler");
}

#[test]
fn a_failed_step_returns_its_error_without_a_drop_panic() {
    let (mut a, mut b, mut s, mut opt) = (model(0), model(1), scaler(), sgd());
    s.scale(loss(&a)).backward().unscale().step(&mut opt, &mut a).update().unwrap();
    // The optimizer is bound to `a`: stepping it on `b` errs, and the step ends with the error.
    let err = s.scale(loss(&b)).backward().unscale().try_step(&mut opt, &mut b).err().expect("refused");
    assert!(err.to_string().contains("`w` is not the parameter this optimizer is bound to"), "{err}");
}

// ---- gradients are applied once, to the parameters they belong to ------------------------

#[test]
fn a_plain_backward_is_applied_once() {
    let (mut m, mut opt) = (model(0), sgd());
    let grads = loss(&m).backward();
    let copy = grads.clone();
    opt.step(&mut m, &grads).unwrap();
    let after_one = m.w.to_vec();
    for again in [&grads, &copy] {
        let err = opt.step(&mut m, again).expect_err("the same gradients twice");
        assert!(err.to_string().contains("already applied"), "{err}");
    }
    assert_eq!(m.w.to_vec(), after_one, "a refused step changes nothing");
    assert_eq!(opt.steps(), 1);
    // A new backward pass is a new set.
    let g = loss(&m).backward();
    opt.step(&mut m, &g).unwrap();
    assert_eq!(opt.steps(), 2);
}

#[test]
fn one_optimizer_on_two_models_is_an_error_naming_the_parameter() {
    let (mut a, mut b, mut opt) = (model(0), model(1), Sgd::new(0.1).momentum(0.9).build().unwrap());
    let g = loss(&a).backward();
    opt.step(&mut a, &g).unwrap();
    let b_before = b.w.to_vec();
    let g = loss(&b).backward();
    let err = opt.step(&mut b, &g).expect_err("bound to a");
    assert!(err.to_string().contains("`w`"), "{err}");
    assert_eq!(b.w.to_vec(), b_before);
    assert_eq!(opt.steps(), 1, "no shared step count");
    // Moving an optimizer on purpose: `bind`.
    opt.bind(&b);
    let g = loss(&b).backward();
    opt.step(&mut b, &g).unwrap();
}

#[test]
fn gradients_of_other_parameters_are_refused() {
    let (mut a, b, mut opt) = (model(0), model(0), sgd());
    let err = opt.step(&mut a, &loss(&b).backward()).expect_err("b's gradients");
    assert!(err.to_string().contains("belong to other parameters"), "{err}");
    let mut s = scaler();
    let err = s.scale(loss(&b)).backward().unscale().try_step(&mut opt, &mut a).err().expect("refused");
    assert!(err.to_string().contains("belong to other parameters"), "{err}");
}

#[test]
fn a_cloned_param_is_a_new_parameter() {
    let online = model(0);
    let mut target = online.clone(); // a frozen target network (DQN, EMA teacher)
    assert_ne!(online.w.id(), target.w.id());
    assert_eq!(online.w.to_vec(), target.w.to_vec());
    // A loss on the target gives the target's gradients, none of the online model's.
    let grads = loss(&target).backward();
    assert!(grads.get(&target.w).is_some());
    assert!(grads.get(&online.w).is_none(), "the copy's gradient never reaches the original");
    // Updating the copy leaves the original alone (copy on write).
    let before = online.w.to_vec();
    target.w.data_mut()[0] = 42.0;
    assert_eq!(online.w.to_vec(), before);
}

#[test]
fn resuming_rebinds_by_name() {
    let (mut m, mut opt) = (model(0), Sgd::new(0.1).momentum(0.9).build().unwrap());
    let g = loss(&m).backward();
    opt.step(&mut m, &g).unwrap();
    let state = opt.state_dict();
    // A restarted process: a new model (new ids, same names) and a new optimizer.
    let mut m2 = m.clone();
    let mut opt2 = Sgd::new(0.1).momentum(0.9).build().unwrap();
    opt2.load_state_dict(state).unwrap();
    let g = loss(&m2).backward();
    opt2.step(&mut m2, &g).unwrap();
    let g = loss(&m).backward();
    opt.step(&mut m, &g).unwrap();
    assert_eq!(m.w.to_vec(), m2.w.to_vec(), "resumed moments give the same step");
    let st: &SgdState = opt2.param_state("w").unwrap();
    assert_eq!(st, opt.param_state("w").unwrap());
}

// ---- legitimate patterns keep working ------------------------------------------------------

#[test]
fn parameter_groups_over_two_optimizers_with_step_many() {
    #[derive(amp_core::Params)]
    struct Two {
        body: Model,
        head: Model,
    }
    let mut net = Two { body: model(0), head: model(1) };
    let (mut ob, mut oh) = (sgd(), Sgd::new(0.01).build().unwrap());
    let mut s = scaler();
    for _ in 0..3 {
        let l = loss(&net.body).add(&loss(&net.head));
        let grads = s.scale(l).backward().unscale();
        let Two { body, head } = &mut net;
        grads.step_many(&mut [(&mut ob, body), (&mut oh, head)]).update().unwrap();
    }
    assert_eq!((ob.steps(), oh.steps()), (3, 3));
}

#[test]
fn two_scalers_gan_style() {
    let (mut g, mut d) = (model(0), model(1));
    let (mut og, mut od) = (sgd(), sgd());
    let (mut sg, mut sd) = (scaler(), scaler());
    for _ in 0..3 {
        sd.scale(loss(&d)).backward().unscale().step(&mut od, &mut d).update().unwrap();
        sg.scale(loss(&g)).backward().unscale().step(&mut og, &mut g).update().unwrap();
    }
    assert_eq!((og.steps(), od.steps()), (3, 3));
}

#[test]
fn bf16_with_no_scale_trains() {
    let (mut m, mut s, mut opt) = (model(0), NoScale, sgd());
    let x = Tensor::<f32>::from_f32s(&[0.5, -1.0, 0.25, 2.0], &[1, 4]);
    for _ in 0..3 {
        let l = x.cast::<amp_core::bf16>().matmul(&m.w.cast::<amp_core::bf16>()).cast::<f32>().square().mean_all();
        let r = s.scale(l).backward().unscale().step(&mut opt, &mut m).update().unwrap();
        assert!(!r.skipped);
    }
    assert_eq!(opt.steps(), 3);
    assert_eq!(m.num_params(), 8);
}

#[test]
fn f16_under_no_scale_is_refused_naming_grad_scaler() {
    let (m, mut s) = (model(0), NoScale);
    let err = s.try_scale(loss(&m)).err().expect("f16 graph without scaling");
    assert!(err.to_string().contains("GradScaler::new()"), "{err}");
}
