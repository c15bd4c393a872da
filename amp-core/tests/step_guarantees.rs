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

/// The same loss in f32, for the plain path (`backward()` then `Optimizer::step`), which
/// refuses the gradients of an f16 graph.
fn f32_loss(m: &Model) -> Tensor<f32> {
    let x = Tensor::<f32>::from_f32s(&[0.5, -1.0, 0.25, 2.0], &[1, 4]);
    x.matmul(&m.w).square().mean_all()
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
    let err = s.scale(loss(&b)).backward().unscale().try_step(&mut opt, &mut b).expect_err("refused");
    assert!(err.to_string().contains("`w` is not the parameter this optimizer is bound to"), "{err}");
}

// ---- gradients are applied once, to the parameters they belong to ------------------------

#[test]
fn a_plain_backward_is_applied_once() {
    let (mut m, mut opt) = (model(0), sgd());
    let grads = f32_loss(&m).backward();
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
    let g = f32_loss(&m).backward();
    opt.step(&mut m, &g).unwrap();
    assert_eq!(opt.steps(), 2);
}

#[test]
fn one_optimizer_on_two_models_is_an_error_naming_the_parameter() {
    let (mut a, mut b, mut opt) = (model(0), model(1), Sgd::new(0.1).momentum(0.9).build().unwrap());
    let g = f32_loss(&a).backward();
    opt.step(&mut a, &g).unwrap();
    let b_before = b.w.to_vec();
    let g = f32_loss(&b).backward();
    let err = opt.step(&mut b, &g).expect_err("bound to a");
    assert!(err.to_string().contains("`w`"), "{err}");
    assert_eq!(b.w.to_vec(), b_before);
    assert_eq!(opt.steps(), 1, "no shared step count");
    // Moving an optimizer on purpose: `bind`.
    opt.bind(&b);
    let g = f32_loss(&b).backward();
    opt.step(&mut b, &g).unwrap();
}

#[test]
fn gradients_of_other_parameters_are_refused() {
    let (mut a, b, mut opt) = (model(0), model(0), sgd());
    let err = opt.step(&mut a, &f32_loss(&b).backward()).expect_err("b's gradients");
    assert!(err.to_string().contains("belong to other parameters"), "{err}");
    let mut s = scaler();
    let err = s.scale(f32_loss(&b)).backward().unscale().try_step(&mut opt, &mut a).expect_err("refused");
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
    let g = f32_loss(&m).backward();
    opt.step(&mut m, &g).unwrap();
    let state = opt.state_dict();
    // A restarted process: a new model (new ids, same names) and a new optimizer.
    let mut m2 = m.clone();
    let mut opt2 = Sgd::new(0.1).momentum(0.9).build().unwrap();
    opt2.load_state_dict(state).unwrap();
    let g = f32_loss(&m2).backward();
    opt2.step(&mut m2, &g).unwrap();
    let g = f32_loss(&m).backward();
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
    let err = s.try_scale(loss(&m)).expect_err("f16 graph without scaling");
    assert!(err.to_string().contains("GradScaler::new()"), "{err}");
}

// ---- PyTorch habits that went around the guarantees (found by an audit) --------------------

/// A model's loss with a leaf no optimizer steps (a frozen `Param`, say) added in, whose
/// gradient is `scale_frozen` (through an f16 cast, so a large one overflows when scaled).
fn loss_with_frozen(m: &Model, frozen: &Param, scale_frozen: f64) -> Tensor<f32> {
    loss(m).add(&frozen.cast::<f16>().cast::<f32>().mul_scalar(scale_frozen).sum_all())
}

#[test]
fn a_non_finite_clip_norm_skips_every_optimizer_and_backs_off() {
    // One gradient no optimizer steps overflows: the norm is inf, the clip coefficient 0, and
    // every gradient of the step is 0 or NaN after clipping. PyTorch's skip reads only each
    // optimizer's own flags and would apply the rest; here every optimizer skips.
    let frozen = Param::new(Tensor::<f32>::ones(&[3]));
    let (mut m, mut s, mut opt) = (model(0), scaler(), sgd());
    let before = m.w.to_vec();
    let mut grads = s.scale(loss_with_frozen(&m, &frozen, 1e3)).backward().unscale();
    assert!(grads.found_inf(), "the frozen leaf's f16 gradient overflowed");
    assert!(grads.clip_grad_norm(1.0).is_infinite());
    let r = grads.step(&mut opt, &mut m).update().unwrap();
    assert!(r.skipped, "the model's gradients were zeroed by the clip");
    assert_eq!(m.w.to_vec(), before);
    assert_eq!((opt.steps(), r.scale), (0, 128.0), "skipped, and the scale backed off");
    // The same without clipping: the model's own gradients are finite and its step is taken.
    let r = s.scale(loss_with_frozen(&m, &frozen, 1e3)).backward().unscale().step(&mut opt, &mut m).update().unwrap();
    assert!(!r.skipped);
    assert_eq!(opt.steps(), 1);
}

#[test]
fn a_nan_clip_norm_skips_every_pair_of_step_many() {
    let frozen = Param::new(Tensor::<f32>::from_f32s(&[1.0, f32::NAN], &[2]));
    let (mut a, mut b, mut s) = (model(0), model(1), scaler());
    let (mut oa, mut ob) = (sgd(), sgd());
    let (a0, b0) = (a.w.to_vec(), b.w.to_vec());
    let l = loss(&a).add(&loss(&b)).add(&frozen.mul(&frozen).sum_all());
    let mut grads = s.scale(l).backward().unscale();
    assert!(grads.clip_grad_norm(1.0).is_nan());
    let r = grads.step_many(&mut [(&mut oa, &mut a), (&mut ob, &mut b)]).update().unwrap();
    assert!(r.skipped);
    assert_eq!((a.w.to_vec(), b.w.to_vec()), (a0, b0), "no NaN written into either model");
    assert_eq!((oa.steps(), ob.steps()), (0, 0));
}

#[test]
fn a_loss_computed_before_a_step_is_refused_after_it() {
    // PyTorch: "one of the variables needed for gradient computation has been modified by an
    // inplace operation". A micro-batch's loss left over from the last iteration would
    // otherwise bring the old weights' gradients into this one.
    let (mut m, mut s, mut opt) = (model(0), scaler(), sgd());
    let (first, left_over) = (loss(&m), loss(&m));
    s.scale(first).backward().unscale().step(&mut opt, &mut m).update().unwrap();
    let mut grads = s.scale(loss(&m)).backward();
    let err = grads.try_accumulate(left_over).expect_err("a graph of the old weights");
    assert!(err.to_string().contains("updated in place"), "{err}");
    // The step itself is still whole: its own micro-batch goes on.
    grads.accumulate(loss(&m));
    grads.unscale().step(&mut opt, &mut m).update().unwrap();
    // The plain path, and an update by `Param::set`.
    let stale = loss(&m).mul_scalar(1.0);
    m.w.set(&Tensor::<f32>::zeros(&[4, 2]));
    assert!(stale.try_backward().expect_err("after set").to_string().contains("updated in place"));
    assert!(loss(&m).try_backward().is_ok(), "a loss computed after the update is fine");
}

#[test]
fn plain_gradients_of_an_f16_graph_are_refused_by_the_optimizer() {
    // The PyTorch habit `loss.backward(); opt.step()` with an f16 forward: no loss scaling,
    // so f16 gradients underflow. NoScale refuses this graph at `scale`; the plain path at
    // the optimizer, naming the fix.
    let (mut m, mut opt) = (model(0), sgd());
    let grads = loss(&m).backward();
    let before = m.w.to_vec();
    let err = opt.step(&mut m, &grads).expect_err("f16 without a scaler");
    assert!(err.to_string().contains("f16") && err.to_string().contains("GradScaler"), "{err}");
    assert_eq!((m.w.to_vec(), opt.steps()), (before, 0));
    // Through a GradScaler the same graph trains.
    scaler().scale(loss(&m)).backward().unscale().step(&mut opt, &mut m).update().unwrap();
    assert_eq!(opt.steps(), 1);
}

#[test]
fn a_try_error_mid_step_comes_back_through_question_mark() {
    // `?` on a `try_` call that takes `&mut self` drops the step on the way out: the caller
    // gets the error, not the drop rule's panic.
    fn train_step(m: &mut Model, opt: &mut Optim<Sgd>, s: &mut GradScaler, max_norm: f32) -> amp_core::Result<bool> {
        let mut grads = s.try_scale(loss(m))?.try_backward()?.try_unscale()?;
        grads.try_clip_grad_norm(max_norm)?;
        Ok(grads.try_step(opt, m)?.update()?.skipped)
    }
    let (mut m, mut s, mut opt) = (model(0), scaler(), sgd());
    let err = train_step(&mut m, &mut opt, &mut s, 0.0).expect_err("max_norm 0");
    assert!(err.to_string().contains("max_norm"), "{err}");
    assert!(!train_step(&mut m, &mut opt, &mut s, 1.0).unwrap());
    // The same for clip_grad_value and accumulate.
    let mut grads = s.scale(loss(&m)).backward().unscale();
    assert!(grads.try_clip_grad_value(f32::NAN).is_err());
    drop(grads);
    let mut grads = s.scale(loss(&m)).backward();
    assert!(grads.try_accumulate(Tensor::<f32>::zeros(&[2])).is_err(), "not a scalar");
    drop(grads);
}

#[test]
fn one_set_of_gradients_reaches_a_parameter_once_whatever_applies_it() {
    // One set, then a second computed after the step, then the first again.
    let (mut m, mut opt) = (model(0), sgd());
    let ga = f32_loss(&m).backward();
    opt.step(&mut m, &ga).unwrap();
    let gb = f32_loss(&m).backward();
    opt.step(&mut m, &gb).unwrap();
    let err = opt.step(&mut m, &ga).expect_err("ga again");
    assert!(err.to_string().contains("already applied"), "{err}");
    // Summed into a newer set, an applied set is still applied (`new.accumulate(old)`: the
    // running sum of PyTorch's forgotten `zero_grad`).
    let mut gc = f32_loss(&m).backward();
    gc.accumulate(gb.clone());
    let err = opt.step(&mut m, &gc).expect_err("gb inside gc");
    assert!(err.to_string().contains("already applied"), "{err}");
    // A clone of the optimizer, made before the first step.
    let g = f32_loss(&m).backward();
    let mut twin = opt.clone();
    opt.step(&mut m, &g).unwrap();
    let err = twin.step(&mut m, &g).expect_err("the clone applies it again");
    assert!(err.to_string().contains("already applied"), "{err}");
    assert_eq!((opt.steps(), twin.steps()), (3, 2));
}

#[test]
fn step_many_checks_every_pair_before_stepping_any() {
    let (mut a, mut b, elsewhere, mut s) = (model(0), model(1), model(2), scaler());
    let (mut oa, mut ob) = (sgd(), sgd());
    ob.bind(&elsewhere);
    let (a0, b0) = (a.w.to_vec(), b.w.to_vec());
    let l = loss(&a).add(&loss(&b));
    let err = s.scale(l).backward().unscale().try_step_many(&mut [(&mut oa, &mut a), (&mut ob, &mut b)]);
    let err = err.expect_err("the second optimizer is bound elsewhere");
    assert!(err.to_string().contains("bound to"), "{err}");
    assert_eq!((a.w.to_vec(), b.w.to_vec(), oa.steps()), (a0, b0, 0), "the first pair did not step");
    assert_eq!(s.get_scale(), 256.0, "nor was the scale updated");
}

#[test]
fn a_bare_param_is_named_as_such_in_errors() {
    // A `Param` stepped on its own has no name (`named_params` gives ""): messages say so
    // instead of printing an empty name.
    let (mut a, b) = (Param::new(Tensor::<f32>::ones(&[2])), Param::new(Tensor::<f32>::ones(&[2])));
    let mut opt = sgd();
    opt.bind(&b);
    let g = a.square().sum_all().backward();
    let err = opt.step(&mut a, &g).expect_err("bound to b");
    assert!(err.to_string().contains("this parameter is not the parameter this optimizer is bound to"), "{err}");
}

#[test]
fn gradients_computed_before_a_step_are_refused_after_it() {
    // The left-over micro-batch again, its backward run before the step this time: the set
    // remembers when it was made, and a parameter updated since refuses it.
    let (mut m, mut opt) = (model(0), sgd());
    let (now, left_over) = (f32_loss(&m).backward(), f32_loss(&m).backward());
    opt.step(&mut m, &now).unwrap();
    let mut next = f32_loss(&m).backward();
    next.accumulate(left_over);
    let before = m.w.to_vec();
    let err = opt.step(&mut m, &next).expect_err("old weights' gradients mixed in");
    assert!(err.to_string().contains("computed before the last update of `w`"), "{err}");
    assert_eq!(m.w.to_vec(), before);
    // Micro-batches all computed before one step are one iteration: accepted.
    let (g1, g2) = (f32_loss(&m).backward(), f32_loss(&m).backward());
    let mut sum = g1;
    sum.accumulate(g2);
    opt.step(&mut m, &sum).unwrap();
}

#[test]
fn step_many_leaves_a_model_without_gradients_alone() {
    // Multi-task heads used on alternate batches: a pair whose model the loss did not use is
    // skipped (its optimizer counts no step), not refused.
    let (mut a, mut b, mut s) = (model(0), model(1), scaler());
    let (mut oa, mut ob) = (sgd(), sgd());
    let b0 = b.w.to_vec();
    s.scale(loss(&a)).backward().unscale().step_many(&mut [(&mut oa, &mut a), (&mut ob, &mut b)]).update().unwrap();
    assert_eq!((oa.steps(), ob.steps(), b.w.to_vec()), (1, 0, b0));
}

#[test]
fn a_step_that_goes_on_after_an_error_is_under_the_drop_rule_again() {
    // Log the error and carry on: the next call makes the step live again, so forgetting
    // `.update()` still panics.
    let result = std::panic::catch_unwind(|| {
        let (mut m, mut s, mut opt) = (model(0), scaler(), sgd());
        let mut grads = s.scale(loss(&m)).backward().unscale();
        assert!(grads.try_clip_grad_norm(0.0).is_err());
        drop(grads.step(&mut opt, &mut m)); // no `.update()`
    });
    let msg = result.expect_err("the drop rule").downcast::<String>().map(|b| *b).unwrap_or_default();
    assert!(msg.contains("after `.step(..)`, before `.update()`"), "{msg}");
}
