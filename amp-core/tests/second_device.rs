//! A second device, implemented outside amp-core as `amp-cuda` implements `Cuda`: `Mirror`
//! keeps its own storage type and runs each kernel by handing its buffers to the CPU backend,
//! counting every call. The same forward and backward on `Mirror` and on `Cpu` must agree bit
//! for bit, and every op must have reached the device through the trait (a kernel that
//! bypassed it would not see `Mirror`'s storage at all). `#[autocast]` code (a model of the
//! user's own, amp's modules dispatched inside it, the weight cast cache) runs there too.

use std::sync::atomic::Ordering;

#[path = "common/mirror.rs"]
mod mirror;

use amp_core::__private::{CastStats, Region, cache_entries, cast, cast_stats, reset_cast_stats};
use amp_core::backend::{AdamArgs, AdamDecay, HostValue, Outcomes, SgdArgs};
use amp_core::nn::{Block, Gpt, GptConfig, LayerNorm, Linear};
use amp_core::param::ToDevice;
use amp_core::{
    BatchNormOptions, Conv2dOptions, Cpu, DType, Device, Indices, Mask, Param, Params, Precision, Rng, Tensor,
    autocast, bf16, f16,
};
use mirror::{CALLS, Mirror, host_reads};

/// A small GPT-like step touching every op family: embedding, cat, linear, matmul with a
/// transpose, causal mask, softmax, scaled masked softmax, fused causal attention, layer norm (and into bf16), RMS norm, gelu, dropout, casts to f16 and
/// bf16, reductions, max, where, log-softmax, cross-entropy and MSE. Returns the loss and
/// the gradients of the two leaves, all as f64.
fn step<D: Device>(dev: &D) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut rng = Rng::seed(11);
    let (v, t, c) = (13, 6, 8);
    let emb = Tensor::<f32>::randn(&[v, c], &mut rng).to_device(dev).requires_grad_();
    let w = Tensor::<f32>::randn(&[c, 2 * c], &mut rng).mul_scalar(0.3).to_device(dev).requires_grad_();
    let ids = Indices::from_vec((0..t as i64).map(|i| (i * 5) % v as i64).collect(), &[t]);
    let x = emb.embedding(&ids); // [t, c]
    let x2 = Tensor::cat(&[&x, &x.mul_scalar(0.5)], 1); // [t, 2c]
    let h = x2.linear(&w, None).gelu(); // [t, c]
    let h16 = h.cast::<f16>();
    let q = h16.matmul(&h16.t()).cast::<f32>().div_scalar((c as f64).sqrt()); // [t, t]
    let att = q.masked_fill(&Mask::causal(t), f64::NEG_INFINITY).softmax(1);
    let y = att.matmul(&h).layer_norm(None, None, 1e-5);
    let y = y.add(&y.layer_norm_to::<bf16>(None, None, 1e-5).cast::<f32>());
    let (hb, xb) = (h.cast::<bf16>(), x.cast::<bf16>());
    let y = y.add_cast(&hb.causal_attention(&xb, &hb));
    let y = y.add(&h16.matmul(&h16.t()).scaled_masked_softmax(0.3, &Mask::causal(t)).matmul(&h16).cast::<f32>());
    let y = y.cast::<bf16>().rms_norm(None, 1e-6).cast::<f32>();
    let y = y.dropout(0.25, true, &mut Rng::seed(3)).add(&h.tanh());
    let pick = Tensor::where_cond(
        &Mask::from_vec(vec![true, false], &[2, 1, 1]),
        &y.unsqueeze(0),
        &y.exp().unsqueeze(0).sub_scalar(1.0),
    );
    let logits = pick.sum(0, false).log_softmax(1).add(&y.max(1, true));
    let targets = Indices::from_vec((0..t as i64).map(|i| i % c as i64).collect(), &[t]);
    let ce = logits.cross_entropy(&targets);
    let mse = y.mse_loss(&h.sigmoid());
    let loss = ce.add(&mse.mul_scalar(0.1)).add(&y.powf(2.0).mean_all());
    let grads = loss.backward();
    let g = |p: &Tensor<f32, D>| grads.get(p).expect("a gradient for every leaf").to_f64_vec();
    (loss.to_f64_vec(), g(&emb), g(&w))
}

#[test]
fn a_device_defined_outside_the_crate_runs_every_op_and_its_backward_bit_for_bit() {
    let before = CALLS.load(Ordering::Relaxed);
    let (loss_m, g_emb_m, g_w_m) = step(&Mirror);
    let calls = CALLS.load(Ordering::Relaxed) - before;
    let (loss_c, g_emb_c, g_w_c) = step(&Cpu);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&loss_m), bits(&loss_c), "loss");
    assert_eq!(bits(&g_emb_m), bits(&g_emb_c), "embedding gradient");
    assert_eq!(bits(&g_w_m), bits(&g_w_c), "weight gradient");
    assert!(g_w_c.iter().any(|v| *v != 0.0), "the step has a non-trivial gradient");
    // Every forward op and every backward ran a Mirror kernel (dozens of calls, not a few).
    assert!(calls > 60, "only {calls} kernel calls reached the device");
}

/// A small CNN step over the convolution, pooling and batch-norm kernels: conv2d with bias,
/// stride, padding, dilation and groups; batch norm in training (running buffers updated) and
/// in eval; max, average and adaptive pooling; a bf16 convolution; flatten_dims and a linear
/// head. Returns the loss, every leaf's gradient and the running buffers, as f64.
fn cnn_step<D: Device>(dev: &D) -> Vec<Vec<f64>> {
    let mut rng = Rng::seed(21);
    let mut leaf =
        |shape: &[usize], k: f64| Tensor::<f32>::randn(shape, &mut rng).mul_scalar(k).to_device(dev).requires_grad_();
    let x = leaf(&[2, 4, 9, 9], 1.0);
    let (w1, b1) = (leaf(&[6, 2, 3, 3], 0.3), leaf(&[6], 0.1));
    let (gamma, beta) = (leaf(&[6], 1.0), leaf(&[6], 0.5));
    let w2 = leaf(&[8, 6, 2, 2], 0.2);
    let head = leaf(&[3, 48], 0.1);
    let mut mean = Tensor::<f32>::zeros(&[6]).to_device(dev);
    let mut var = Tensor::<f32>::ones(&[6]).to_device(dev);
    let opts = Conv2dOptions { stride: (2, 1), padding: (1, 2), dilation: (1, 2), groups: 2 };
    let h = x.conv2d(&w1, Some(&b1), opts); // [2, 6, 5, 9]
    let train = BatchNormOptions { training: true, ..Default::default() };
    let h = h.batch_norm(Some(&mut mean), Some(&mut var), Some(&gamma), Some(&beta), train).relu();
    let p = h.max_pool2d((3, 3), (2, 2), (1, 1)); // [2, 6, 3, 5]
    let q = p.cast::<bf16>().conv2d(&w2.cast::<bf16>(), None, Conv2dOptions::default()).cast::<f32>(); // [2, 8, 2, 4]
    let e = h.batch_norm(Some(&mut mean), Some(&mut var), Some(&gamma), None, BatchNormOptions::default());
    let a = e.avg_pool2d((2, 2), (1, 2), (1, 0)).mean_all();
    let z = q.adaptive_avg_pool2d((3, 2)).flatten_dims(1, 3).linear(&head, None); // [2, 3]
    let loss = z.cross_entropy(&Indices::from_vec(vec![2, 0], &[2])).add(&a);
    let grads = loss.backward();
    let mut out = vec![loss.to_f64_vec()];
    for p in [&x, &w1, &b1, &gamma, &beta, &w2, &head] {
        out.push(grads.get(p).expect("a gradient for every leaf").to_f64_vec());
    }
    out.extend([mean.to_f64_vec(), var.to_f64_vec()]);
    out
}

#[test]
fn convolution_pooling_and_batch_norm_run_on_the_second_device_bit_for_bit() {
    let before = CALLS.load(Ordering::Relaxed);
    let on_mirror = cnn_step(&Mirror);
    let calls = CALLS.load(Ordering::Relaxed) - before;
    let on_cpu = cnn_step(&Cpu);
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let names = ["loss", "x", "w1", "b1", "gamma", "beta", "w2", "head", "running mean", "running var"];
    for ((m, c), name) in on_mirror.iter().zip(&on_cpu).zip(names) {
        assert_eq!(bits(m), bits(c), "{name}");
        assert!(c.iter().all(|v| v.is_finite()) && c.iter().any(|v| *v != 0.0), "{name} is non-trivial");
    }
    assert!(calls > 40, "only {calls} kernel calls reached the device");
}

#[test]
fn tensors_move_between_devices_and_keep_their_values() {
    let x = Tensor::<bf16>::from_f64s(&[1.5, -2.0, 3.25, 0.0], &[2, 2]);
    let m = x.t().to_device(&Mirror);
    assert_eq!(m.device().name(), "mirror");
    assert_eq!(m.to_vec(), x.t().to_vec());
    let back = m.to_device(&Cpu);
    assert_eq!(back.shape(), &[2, 2]);
    assert_eq!(back.to_vec(), x.t().contiguous().to_vec());
}

/// Loss and every parameter's gradient (by name) of a GPT step in precision `L`.
fn gpt_step<L: Precision, D: Device>(model: &Gpt<f32, D>) -> (Vec<u64>, Vec<(String, Vec<u64>)>) {
    let ids = Indices::from_vec((0..12).map(|i| (i * 7) % 17).collect(), &[2, 6]);
    let targets = Indices::from_vec((0..12).map(|i| (i * 3 + 1) % 17).collect(), &[2, 6]);
    let loss = model.loss::<L>(&ids, &targets, &mut Rng::seed(5));
    let grads = loss.backward();
    let bits = |t: &Tensor<f32, D>| t.to_vec().iter().map(|v| v.to_bits() as u64).collect::<Vec<_>>();
    let per_param = model
        .named_params()
        .into_iter()
        .map(|(name, p)| (name, bits(grads.get(p).expect("every parameter has a gradient"))))
        .collect();
    (bits(&loss), per_param)
}

#[test]
fn a_model_moves_to_another_device_in_one_call_and_trains_there_bit_for_bit() {
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.1 };
    let cpu = Gpt::new(config, &mut Rng::seed(1));
    let moved: Gpt<f32, Mirror> = cpu.to_device(&Mirror);
    assert_eq!(moved.named_params().len(), cpu.named_params().len());
    for ((n1, p1), (n2, p2)) in cpu.named_params().into_iter().zip(moved.named_params()) {
        assert_eq!(n1, n2);
        assert_eq!(p1.to_vec(), p2.to_vec(), "{n1} moved with its values");
        assert_ne!(p1.id(), p2.id(), "{n1}: a moved parameter is a new parameter");
    }
    assert_eq!(moved.config, cpu.config, "configs are cloned");
    assert_eq!(gpt_step::<f32, _>(&moved), gpt_step::<f32, _>(&cpu), "f32");
    assert_eq!(gpt_step::<f16, _>(&moved), gpt_step::<f16, _>(&cpu), "f16");
    assert_eq!(gpt_step::<bf16, _>(&moved), gpt_step::<bf16, _>(&cpu), "bf16");
    // And back: the round trip keeps every value.
    let back: Gpt = moved.to_device(&Cpu);
    assert_eq!(gpt_step::<f16, _>(&back), gpt_step::<f16, _>(&cpu));
}

#[test]
fn gradient_clipping_runs_on_the_gradients_device() {
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.0 };
    let cpu = Gpt::new(config, &mut Rng::seed(2));
    let moved: Gpt<f32, Mirror> = cpu.to_device(&Mirror);
    let ids = Indices::from_vec((0..8).map(|i| (i * 5) % 17).collect(), &[1, 8]);
    let targets = Indices::from_vec((0..8).map(|i| (i * 2 + 3) % 17).collect(), &[1, 8]);
    let mut g_cpu = cpu.loss::<bf16>(&ids, &targets, &mut Rng::seed(0)).backward();
    let mut g_mir = moved.loss::<bf16>(&ids, &targets, &mut Rng::seed(0)).backward();
    let before = CALLS.load(Ordering::Relaxed);
    let n_mir = amp_core::clip::clip_grad_norm(&mut g_mir, 0.05);
    amp_core::clip::clip_grad_value(&mut g_mir, 0.001);
    assert!(CALLS.load(Ordering::Relaxed) > before, "clipping ran Mirror kernels");
    let n_cpu = amp_core::clip::clip_grad_norm(&mut g_cpu, 0.05);
    amp_core::clip::clip_grad_value(&mut g_cpu, 0.001);
    assert_eq!(n_mir.get().to_bits(), n_cpu.to_bits());
    assert!(n_cpu > 0.05, "the norm was clipped: {n_cpu}");
    for ((_, pc), (_, pm)) in cpu.named_params().into_iter().zip(moved.named_params()) {
        let (a, b) = (g_cpu.get(pc).unwrap().to_vec(), g_mir.get(pm).unwrap().to_vec());
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

/// Per step (loss bits, skipped, scale bits); the final parameters' bits; the optimizer state.
type Trained = (Vec<(u32, bool, u32)>, Vec<Vec<u32>>, amp_core::optim::OptimizerState<amp_core::optim::AdamState>);

/// `steps` AMP iterations of the small GPT in precision `L` with `scaler`, AdamW (with
/// clipping), on the model's device: the losses, skipped flags and scales, and the final
/// parameters and optimizer state, as bits.
fn train_steps<L: Precision, K: amp_core::scaler::LossScaler, D: Device>(
    model: &mut Gpt<f32, D>,
    scaler: &mut K,
    steps: usize,
) -> Trained {
    let mut opt = amp_core::optim::AdamW::new(3e-3).weight_decay(0.1).build().unwrap();
    let mut log = Vec::new();
    for i in 0..steps {
        let ids = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 7) % 17).collect(), &[2, 6]);
        let targets = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 3 + 1) % 17).collect(), &[2, 6]);
        let loss = model.loss::<L>(&ids, &targets, &mut Rng::seed(i as u64));
        let value = loss.item().to_bits();
        let mut grads = scaler.scale(loss).backward().unscale();
        grads.clip_grad_norm(1.0);
        let report = grads.step(&mut opt, model).update().unwrap();
        log.push((value, report.skipped.get(), report.scale.get().to_bits()));
    }
    let params = model.named_params().iter().map(|(_, p)| p.to_vec().iter().map(|v| v.to_bits()).collect()).collect();
    (log, params, opt.state_dict())
}

#[test]
fn the_whole_amp_step_runs_on_the_second_device_bit_for_bit() {
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.1 };
    let init = Gpt::new(config, &mut Rng::seed(3));
    // f16 with a GradScaler whose first scale overflows (a skipped step), and bf16 without one.
    let scaler = || {
        amp_core::scaler::GradScaler::with_options(amp_core::scaler::GradScalerOptions {
            init_scale: 2f32.powi(22),
            ..Default::default()
        })
        .unwrap()
    };
    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    let before = CALLS.load(Ordering::Relaxed);
    let on_mirror = train_steps::<f16, _, _>(&mut mir, &mut scaler(), 6);
    assert!(CALLS.load(Ordering::Relaxed) > before);
    let on_cpu = train_steps::<f16, _, _>(&mut cpu, &mut scaler(), 6);
    assert!(on_cpu.0.iter().any(|s| s.1), "a step was skipped: {:?}", on_cpu.0);
    assert!(on_cpu.0.iter().any(|s| !s.1), "a step was applied");
    assert_eq!(on_mirror, on_cpu, "f16 + GradScaler");
    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    let ns = amp_core::scaler::NoScale::new;
    assert_eq!(
        train_steps::<bf16, _, _>(&mut mir, &mut ns(), 4),
        train_steps::<bf16, _, _>(&mut cpu, &mut ns(), 4),
        "bf16"
    );
}

/// Two parameter groups stepped by `step_many` with clipping, over steps where a leaf no
/// optimizer steps has a finite, then a NaN gradient: per step (skipped, scale bits), then
/// both groups' bits.
fn groups_with_a_frozen_leaf<D: Device>(dev: &D) -> (Vec<(bool, u32)>, Vec<Vec<u32>>) {
    let on = |v: &[f32]| Param::new(Tensor::<f32>::from_f32s(v, &[v.len()]).to_device(dev));
    let (mut a, mut b, frozen) = (on(&[1.0, -2.0, 0.5]), on(&[0.3, 0.7]), on(&[1.5]));
    let mut oa = amp_core::optim::Sgd::new(0.1).momentum(0.9).build().unwrap();
    let mut ob = amp_core::optim::AdamW::new(0.01).build().unwrap();
    let options = amp_core::scaler::GradScalerOptions { init_scale: 256.0, ..Default::default() };
    let mut scaler = amp_core::scaler::GradScaler::with_options(options).unwrap();
    let mut log = Vec::new();
    for i in 0..4 {
        let poison = if i == 2 { f64::NAN } else { 1.0 };
        let loss = a.cast::<f16>().square().cast::<f32>().sum_all().add(&b.square().sum_all());
        let loss = loss.add(&frozen.mul_scalar(poison).sum_all());
        let mut grads = scaler.scale(loss).backward().unscale();
        grads.clip_grad_norm(1.0);
        let r = grads.step_many(&mut [(&mut oa, &mut a), (&mut ob, &mut b)]).update().unwrap();
        log.push((r.skipped.get(), r.scale.get().to_bits()));
    }
    let bits = |p: &Param<f32, D>| p.to_vec().iter().map(|v| v.to_bits()).collect();
    (log, vec![bits(&a), bits(&b)])
}

#[test]
fn step_many_with_a_non_finite_clip_skips_every_group_on_the_device_as_on_the_cpu() {
    // On a device the skip is decided there: each pair's flag, the clip's, and their max for
    // the scaler (a max over several flags, which no single-pair step reached).
    let on_cpu = groups_with_a_frozen_leaf(&Cpu);
    assert_eq!(on_cpu.0.iter().map(|s| s.0).collect::<Vec<_>>(), vec![false, false, true, false]);
    assert_eq!(groups_with_a_frozen_leaf(&Mirror), on_cpu);
}

#[test]
fn optimizer_state_follows_a_model_to_another_device() {
    // Three SGD-with-momentum steps on the CPU, then three more: once on the CPU, once with the
    // model (and the same optimizer) moved to `Mirror`. The state moves with the parameters.
    let run = |switch: bool| {
        let mut w: amp_core::Param = amp_core::Param::new(Tensor::<f32>::from_f32s(&[1.0, -2.0, 0.5], &[3]));
        let mut opt = amp_core::optim::Sgd::new(0.1).momentum(0.9).build().unwrap();
        let x = Tensor::<f32>::from_f32s(&[0.3, 0.2, -0.7], &[3]);
        for _ in 0..3 {
            let g = w.mul(&x).square().sum_all().backward();
            amp_core::optim::Optimizer::step(&mut opt, &mut w, &g).unwrap();
        }
        if switch {
            let mut m = w.to_device(&Mirror);
            opt.bind(&m);
            let xm = x.to_device(&Mirror);
            for _ in 0..3 {
                let g = m.mul(&xm).square().sum_all().backward();
                amp_core::optim::Optimizer::step(&mut opt, &mut m, &g).unwrap();
            }
            assert!(opt.param_state("").is_none(), "the state is on Mirror now");
            (m.to_vec(), opt.state_dict())
        } else {
            for _ in 0..3 {
                let g = w.mul(&x).square().sum_all().backward();
                amp_core::optim::Optimizer::step(&mut opt, &mut w, &g).unwrap();
            }
            (w.to_vec(), opt.state_dict())
        }
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn update_kernels_leave_everything_untouched_when_found_inf_is_set() {
    let dev = Cpu;
    let p0: Vec<f32> = vec![1.0, -2.0, 0.5, 4.0];
    let g = dev.from_host(vec![0.1f32, 0.2, -0.3, 0.4]);
    let adam = AdamArgs {
        neg_step_size: -0.01,
        bias_correction2_sqrt: 0.5,
        lerp_weight: 0.1,
        beta2: 0.999,
        one_minus_beta2: 0.001,
        eps: 1e-8,
        decay: AdamDecay::Decoupled(0.999),
    };
    let sgd =
        SgdArgs { neg_lr: -0.1, weight_decay: Some(0.01), momentum: 0.9, keep: 1.0, nesterov: true, first: false };
    for flag in [0.0f32, 1.0] {
        let found_inf = dev.from_host(vec![flag]);
        let mut p = dev.from_host(p0.clone());
        let (mut m, mut v) = (vec![0.5f32; 4], vec![0.25f32; 4]);
        let outcomes = Some(Outcomes { flags: &found_inf, at: 0 });
        dev.adam_update(&[adam], &mut p, &g, &mut m, &mut v, outcomes);
        let mut buf = vec![0.5f32; 4];
        dev.sgd_update(&[sgd], &mut p, &g, Some(&mut buf), outcomes);
        let untouched = p.to_vec() == p0 && m == [0.5; 4] && v == [0.25; 4] && buf == [0.5; 4];
        assert_eq!(untouched, flag != 0.0, "found_inf = {flag}");
    }
}

#[test]
fn weights_are_saved_from_and_loaded_into_a_model_on_the_second_device() {
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.0 };
    let cpu = Gpt::new(config.clone(), &mut Rng::seed(4));
    let moved: Gpt<f32, Mirror> = cpu.to_device(&Mirror);
    let bytes = amp_core::checkpoint::weights_to_bytes(&moved).unwrap();
    assert_eq!(bytes, amp_core::checkpoint::weights_to_bytes(&cpu).unwrap(), "the same file from either device");
    let dir = std::env::temp_dir().join(format!("amp-second-device-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.safetensors");
    amp_core::checkpoint::save_weights(&path, &moved).unwrap();
    let mut other: Gpt<f32, Mirror> = Gpt::new(config, &mut Rng::seed(5)).to_device(&Mirror);
    amp_core::checkpoint::load_weights(&path, &mut other).unwrap();
    for ((n, a), (_, b)) in cpu.named_params().into_iter().zip(other.named_params()) {
        assert_eq!(a.to_vec(), b.to_vec(), "{n} loaded onto the second device");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pure-bf16 GPT (bf16 weights, `Optim::for_bf16`) trained `steps` steps without loss
/// scaling: each step's loss bits.
fn pure_bf16_steps<D: Device>(
    model: &mut Gpt<bf16, D>,
    opt: &mut amp_core::optim::Optim<amp_core::optim::AdamW, bf16>,
    from: usize,
    steps: usize,
) -> Vec<u32> {
    let mut scaler = amp_core::scaler::NoScale::new();
    (from..from + steps)
        .map(|i| {
            let ids = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 5) % 17).collect(), &[2, 6]);
            let targets = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 3 + 2) % 17).collect(), &[2, 6]);
            let loss = model.loss::<bf16>(&ids, &targets, &mut Rng::seed(i as u64));
            let value = loss.item().to_bits();
            let mut grads = scaler.scale(loss).backward().unscale();
            grads.clip_grad_norm(1.0);
            grads.step(opt, model).update().unwrap();
            value
        })
        .collect()
}

fn bf16_bits<D: Device>(model: &Gpt<bf16, D>) -> Vec<(String, Vec<u16>)> {
    model.named_params().into_iter().map(|(n, p)| (n, p.to_vec().iter().map(|v| v.to_bits()).collect())).collect()
}

#[test]
fn a_pure_bf16_model_trains_on_the_second_device_bit_for_bit_and_moves_mid_run() {
    use amp_core::optim::Bf16Rounding;
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.1 };
    let init = Gpt::new(config, &mut Rng::seed(6)).to_precision::<bf16>();
    // A large learning rate, so every rounding changes weights in a few steps.
    let optimizer = |rounding| amp_core::optim::AdamW::new(1e-2).build().unwrap().for_bf16(rounding);
    for rounding in [Bf16Rounding::Kahan, Bf16Rounding::Stochastic { seed: 3 }, Bf16Rounding::Nearest] {
        // Six steps on the CPU.
        let (mut cpu, mut opt_cpu) = (init.clone(), optimizer(rounding));
        let losses_cpu = pure_bf16_steps(&mut cpu, &mut opt_cpu, 0, 6);
        // The same six on `Mirror`.
        let (mut mir, mut opt_mir): (Gpt<bf16, Mirror>, _) = (init.to_device(&Mirror), optimizer(rounding));
        let before = CALLS.load(Ordering::Relaxed);
        assert_eq!(pure_bf16_steps(&mut mir, &mut opt_mir, 0, 6), losses_cpu, "{rounding:?}: losses");
        assert!(CALLS.load(Ordering::Relaxed) > before);
        assert_eq!(bf16_bits(&mir), bf16_bits(&cpu), "{rounding:?}: weights");
        assert_eq!(opt_mir.state_dict(), opt_cpu.state_dict(), "{rounding:?}: moments and compensation");
        // Three on the CPU, then the model (and its optimizer) moves to `Mirror` for three more:
        // the moments and the Kahan compensation follow it.
        let (mut half, mut opt_half) = (init.clone(), optimizer(rounding));
        let mut losses = pure_bf16_steps(&mut half, &mut opt_half, 0, 3);
        let mut moved: Gpt<bf16, Mirror> = half.to_device(&Mirror);
        opt_half.bind(&moved);
        losses.extend(pure_bf16_steps(&mut moved, &mut opt_half, 3, 3));
        assert_eq!(losses, losses_cpu, "{rounding:?}: moved mid-run");
        assert_eq!(bf16_bits(&moved), bf16_bits(&cpu), "{rounding:?}: weights after the move");
        assert_eq!(opt_half.state_dict(), opt_cpu.state_dict(), "{rounding:?}: state after the move");
        let kahan = rounding == Bf16Rounding::Kahan;
        assert_eq!(opt_cpu.compensation("head.weight").is_some(), kahan, "on the CPU");
        assert!(opt_half.compensation("head.weight").is_none(), "on Mirror it is read through state_dict");
        assert_eq!(opt_half.state_dict().compensation.len(), if kahan { bf16_bits(&cpu).len() } else { 0 });
    }
}

#[test]
fn a_checkpoint_loads_into_a_model_on_either_device() {
    use amp_core::checkpoint::{TrainingState, load_checkpoint, save_checkpoint};
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.0 };
    let cpu = Gpt::new(config.clone(), &mut Rng::seed(7));
    let moved: Gpt<f32, Mirror> = cpu.to_device(&Mirror);
    let dir = std::env::temp_dir().join(format!("amp-second-device-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let state = TrainingState::with_parts(12, 1u32, 2u32, "run".to_string());
    save_checkpoint(&dir, &moved, &state).unwrap();
    // Written on `Mirror`: loads into a model on `Mirror` and into one on the CPU, as the
    // documented `load_checkpoint::<O, S, X, _>`.
    let mut on_mirror: Gpt<f32, Mirror> = Gpt::new(config.clone(), &mut Rng::seed(8)).to_device(&Mirror);
    assert_eq!(load_checkpoint::<u32, u32, String, _>(&dir, &mut on_mirror).unwrap(), state);
    let mut on_cpu: Gpt = Gpt::new(config.clone(), &mut Rng::seed(8));
    assert_eq!(load_checkpoint::<u32, u32, String, _>(&dir, &mut on_cpu).unwrap(), state);
    for (((n, a), (_, b)), (_, c)) in
        cpu.named_params().into_iter().zip(on_mirror.named_params()).zip(on_cpu.named_params())
    {
        assert_eq!(a.to_vec(), b.to_vec(), "{n} on Mirror");
        assert_eq!(a.to_vec(), c.to_vec(), "{n} on the CPU");
    }
    // A refused load leaves the model on the device untouched.
    let mut small: Gpt<f32, Mirror> =
        Gpt::new(GptConfig { d_model: 8, ..config }, &mut Rng::seed(9)).to_device(&Mirror);
    let before = small.named_params().iter().map(|(_, p)| p.to_vec()).collect::<Vec<_>>();
    let err = load_checkpoint::<u32, u32, String, _>(&dir, &mut small).unwrap_err().to_string();
    assert!(err.contains("shape"), "{err}");
    assert_eq!(small.named_params().iter().map(|(_, p)| p.to_vec()).collect::<Vec<_>>(), before);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- `#[autocast]` on the second device ------------------------------------------------------

/// A submodule of the user's own whose compute precision is left to the caller: inside a
/// region, the call's value fixes it to the region's type.
#[derive(Params)]
struct Proj<D: Device = Cpu> {
    w: Param<f32, D>,
}

impl<D: Device> Proj<D> {
    #[autocast(P)]
    fn forward<P: Precision>(&self, x: &Tensor<f32, D>) -> Tensor<P, D> {
        // The weight twice, transposed: one conversion of its storage, then a cache hit.
        x.matmul(&self.w.t()).add(&x.matmul(&self.w.t()))
    }
}

/// A model of the user's own on any device: amp's `Linear`, `LayerNorm` and `Block` (their
/// methods dispatched by the macro, no turbofish), a submodule of its own and a raw parameter.
#[derive(Params)]
struct Net<D: Device = Cpu> {
    fc1: Linear<f32, D>,
    ln: LayerNorm<f32, D>,
    block: Block<f32, D>,
    proj: Proj<D>,
    gamma: Param<f32, D>,
}

impl Net {
    fn new(rng: &mut Rng) -> Self {
        Net {
            fc1: Linear::new(8, 8, true, rng),
            ln: LayerNorm::new(8),
            block: Block::new(8, 2, 0.0, rng),
            proj: Proj { w: Param::new(Tensor::<f32>::randn(&[8, 8], rng).mul_scalar(0.3)) },
            gamma: Param::new(Tensor::<f32>::randn(&[8], rng).add_scalar(1.0)),
        }
    }
}

impl<D: Device> Net<D> {
    #[autocast(f16)]
    fn forward(&self, x: &Tensor<f32, D>, rng: &mut Rng) -> Tensor<f32, D> {
        let h = self.fc1.forward(x);
        assert_eq!(h.dtype(), DType::F16, "Linear runs in the region's type");
        let h = self.ln.forward(&h.gelu());
        assert_eq!(h.dtype(), DType::F32, "LayerNorm gives f32");
        let h = self.block.forward(&h.reshape(&[1, 4, 8]), rng).reshape(&[4, 8]);
        let p = self.proj.forward(&h);
        assert_eq!(p.dtype(), DType::F16, "the submodule's open precision became the region's");
        let n = h.matmul(&self.proj.w).layer_norm(Some(&self.gamma), None, 1e-5);
        assert_eq!(n.dtype(), DType::F32, "layer_norm runs in f32");
        let c = Tensor::cat(&[&p, &n], 1);
        assert_eq!(c.dtype(), DType::F32, "cat promotes");
        let k = Tensor::<f64>::from_f64s(&[0.5, 2.0], &[1, 2]).to_device(x.device());
        let k = k.matmul(&k.t());
        assert_eq!(k.dtype(), DType::F64, "f64 is untouched");
        c.mul(&c).mean_all().mul_scalar(k.to_f64_vec()[0])
    }
}

/// A GPT's loss in bf16 with the model's own method dispatched (no turbofish), plus two
/// products of its weights, each weight used twice: one conversion each, then cache hits.
#[autocast(bf16)]
fn gpt_loss<D: Device>(gpt: &Gpt<f32, D>, ids: &Indices, targets: &Indices, rng: &mut Rng) -> Tensor<f32, D> {
    let a = gpt.tok_emb.weight.matmul(&gpt.head.weight.t());
    let b = gpt.head.weight.matmul(&gpt.tok_emb.weight.t());
    assert_eq!(a.dtype(), DType::BF16);
    gpt.loss(ids, targets, rng).add(&a.add(&b).mean_all().mul_scalar(0.01))
}

/// The value of a device-generic `#[autocast]` function whose tail builds a tensor on the
/// device from the declared type.
#[autocast(f16)]
fn filled<D: Device>(like: &Tensor<f32, D>) -> Tensor<f32, D> {
    Tensor::full_on(like.device(), like.shape(), 0.5)
}

/// Loss bits, every parameter's gradient bits by name, and the casts done, of the f16 model
/// and the bf16 GPT on their device.
type AutocastRun = (Vec<u32>, Vec<(String, Vec<u32>)>, CastStats);

fn autocast_run<D: Device>(net: &Net<D>, gpt: &Gpt<f32, D>) -> AutocastRun {
    let dev = gpt.head.weight.device().clone();
    let x = Tensor::<f32>::randn(&[4, 8], &mut Rng::seed(9)).to_device(&dev);
    let ids = Indices::from_vec((0..12).map(|i| (i * 7) % 17).collect(), &[2, 6]);
    let targets = Indices::from_vec((0..12).map(|i| (i * 3 + 1) % 17).collect(), &[2, 6]);
    reset_cast_stats();
    let a = net.forward(&x, &mut Rng::seed(4));
    let b = gpt_loss(gpt, &ids, &targets, &mut Rng::seed(5));
    let stats = cast_stats();
    assert_eq!(cache_entries(), 0, "the cache is emptied when the outermost region exits");
    assert_eq!(filled(&x).to_vec(), vec![0.5; 32]);
    let loss = a.add(&b);
    let grads = loss.backward();
    let bits = |t: &Tensor<f32, D>| t.to_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut per_param = Vec::new();
    for (name, p) in net.named_params().into_iter().chain(gpt.named_params()) {
        per_param.push((name, bits(grads.get(p).expect("every parameter has a gradient"))));
    }
    (bits(&loss), per_param, stats)
}

#[test]
fn autocast_code_runs_on_the_second_device_bit_for_bit_with_the_weight_cast_cache() {
    let mut rng = Rng::seed(12);
    let net = Net::new(&mut rng);
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.1 };
    let gpt = Gpt::new(config, &mut rng);
    let (net_m, gpt_m): (Net<Mirror>, Gpt<f32, Mirror>) = (net.to_device(&Mirror), gpt.to_device(&Mirror));
    let before = CALLS.load(Ordering::Relaxed);
    let on_mirror = autocast_run(&net_m, &gpt_m);
    let calls = CALLS.load(Ordering::Relaxed) - before;
    let on_cpu = autocast_run(&net, &gpt);
    assert_eq!(on_mirror.0, on_cpu.0, "loss");
    for ((n1, g1), (n2, g2)) in on_mirror.1.iter().zip(&on_cpu.1) {
        assert_eq!(n1, n2);
        assert_eq!(g1, g2, "{n1}'s gradient");
    }
    assert_eq!(on_mirror.1.len(), net.named_params().len() + gpt.named_params().len());
    assert!(on_cpu.1.iter().any(|(_, g)| g.iter().any(|b| f32::from_bits(*b) != 0.0)), "non-trivial gradients");
    // The same casts on both devices, with the weight cast cache hit: proj.w converted once
    // to f16 and served twice more (its second use in `Proj::forward`, then in `Net::forward`),
    // the GPT's two weights converted once each to bf16 and served once each.
    assert_eq!(on_mirror.2, on_cpu.2, "casts and cache hits");
    assert_eq!(on_cpu.2.cache_hits, 4, "{:?}", on_cpu.2);
    assert!(calls > 100, "only {calls} kernel calls reached the device");
}

#[test]
fn the_weight_cast_cache_keeps_its_invariants_on_the_second_device() {
    reset_cast_stats();
    let cpu_w = Param::new(Tensor::<f32>::from_f32s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]));
    let mut w: Param<f32, Mirror> = cpu_w.to_device(&Mirror);
    let v: Param<f32, Mirror> = Param::new(Tensor::<f32>::ones(&[2]).to_device(&Mirror));
    let outer = Region::enter::<f16>(true, true, "test");
    let a: Tensor<f16, Mirror> = cast(w.tensor());
    let b: Tensor<f16, Mirror> = cast(&w.t());
    assert_eq!(cast_stats(), CastStats { casts: 1, cache_hits: 1 }, "a view of it is served from its conversion");
    assert_eq!((a.to_vec(), b.to_vec()), (w.cast::<f16>().to_vec(), w.t().cast::<f16>().to_vec()));
    // The CPU parameter with the same values is another entry: entries are per device.
    let _: Tensor<f16> = cast(cpu_w.tensor());
    assert_eq!((cast_stats().casts, cache_entries()), (2, 2));
    for step in 0..5 {
        {
            let _inner = Region::enter::<f16>(true, false, "test");
            let c: Tensor<f16, Mirror> = cast(w.tensor());
            assert_eq!(c.to_f32_vec()[0], 1.0 + step as f32, "an update inside the region is seen");
            let _: Tensor<f16, Mirror> = cast(v.tensor());
        }
        assert_eq!(cache_entries(), 3, "step {step}: one entry per live storage");
        // In place on Mirror: copies on write while the cache holds the old storage, whose
        // entry is stale from here on and goes at the next insert or region exit.
        w.set(&Tensor::<f32>::from_f32s(&[2.0 + step as f32, 2.0, 3.0, 4.0], &[2, 2]).to_device(&Mirror));
    }
    drop(outer);
    assert_eq!(cache_entries(), 0);
}

/// Host reads of device memory made by `steps` training steps of the small GPT on `Mirror`
/// (f16 + GradScaler with clipping, or bf16 + NoScale), the reports and norms never read.
fn host_reads_per_step<L: Precision, K: amp_core::scaler::LossScaler>(scaler: &mut K, steps: usize) -> f64 {
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.1 };
    let mut model: Gpt<f32, Mirror> = Gpt::new(config, &mut Rng::seed(3)).to_device(&Mirror);
    let mut opt = amp_core::optim::AdamW::new(3e-3).weight_decay(0.1).build().unwrap();
    let mut reports = Vec::new();
    let mut reads = Vec::new();
    for i in 0..=steps {
        let ids = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 7) % 17).collect(), &[2, 6]);
        let targets = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 3 + 1) % 17).collect(), &[2, 6]);
        let before = host_reads();
        let loss = model.loss::<L>(&ids, &targets, &mut Rng::seed(i as u64));
        let mut grads = scaler.scale(loss).backward().unscale();
        let norm = grads.clip_grad_norm(1.0);
        let report = grads.step(&mut opt, &mut model).update().unwrap();
        reads.push(host_reads() - before);
        reports.push((norm, report));
    }
    // Reading a value is the synchronisation the caller asks for, and it reads once.
    let before = host_reads();
    let (norm, report) = &reports[steps];
    assert!(!norm.is_read() && norm.get().is_finite() && norm.get() == report.grad_norm.as_ref().unwrap().get());
    assert_eq!(host_reads() - before, 1, "one read per value, then kept");
    let before = host_reads();
    assert!(report.scale.get() > 0.0 && report.growth_tracker.get() >= 0 && report.scale.get() > 0.0);
    // NoScale's values are constants, read from nowhere.
    let expected = usize::from(scaler.scales_loss());
    assert_eq!(host_reads() - before, expected, "the scale and the growth tracker come from one copy of the state");
    // The first step moves the scaler's state to the device; count the others.
    reads[1..].iter().sum::<usize>() as f64 / steps as f64
}

#[test]
fn an_amp_step_reads_device_memory_once_to_decide_the_skip() {
    let mut scaler = amp_core::scaler::GradScaler::new();
    let f16_reads = host_reads_per_step::<f16, _>(&mut scaler, 10);
    let bf16_reads = host_reads_per_step::<bf16, _>(&mut amp_core::scaler::NoScale::new(), 10);
    // The unscale flags, the clip norm and coefficient, the loss scale and its update, and the
    // optimizer's skip all stay on the device: the optimizer's counts are read once every
    // STEPS_PER_READ steps, not within these 10.
    assert_eq!((f16_reads, bf16_reads), (0.0, 0.0));
}

/// What a long run did, as bits: per step (loss, skipped, scale); the optimizer's applied
/// steps and learning rate read mid-run and at the end; the final parameters and optimizer
/// state.
type LongRun<S> = (Vec<(u32, bool, u32)>, Vec<(u64, u64)>, Vec<Vec<u32>>, amp_core::optim::OptimizerState<S>);

/// `steps` f16 + GradScaler steps of the small GPT with `opt`, gradients made inf on the steps
/// in `overflow` (skipped on the device), a parameter left without a gradient on the steps in
/// `frozen`, counts read at the steps in `peek`; and the host reads made.
fn long_run<R: amp_core::optim::Rule, D: Device>(
    model: &mut Gpt<f32, D>,
    opt: &mut amp_core::optim::Optim<R>,
    steps: usize,
    overflow: &[usize],
    frozen: &[usize],
    peek: &[usize],
) -> (LongRun<R::State>, usize) {
    let mut scaler = amp_core::scaler::GradScaler::with_options(amp_core::scaler::GradScalerOptions {
        init_scale: 256.0,
        ..Default::default()
    })
    .unwrap();
    let (mut log, mut counts) = (Vec::new(), Vec::new());
    let reads = host_reads();
    for i in 0..steps {
        let ids = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 7) % 17).collect(), &[2, 6]);
        let targets = Indices::from_vec((0..12).map(|j| ((i as i64 + j) * 3 + 1) % 17).collect(), &[2, 6]);
        let mut loss = if frozen.contains(&i) {
            // Without the position embedding: it gets no gradient this step.
            let logits: Tensor<f32, D> = model.head.forward::<f32, f32>(&model.tok_emb.forward(&ids));
            logits.reshape(&[12, 17]).cross_entropy(&targets.reshape(&[12]))
        } else {
            model.loss::<f16>(&ids, &targets, &mut Rng::seed(i as u64))
        };
        if overflow.contains(&i) {
            loss = loss.mul_scalar(f64::INFINITY);
        }
        let value = loss.detach();
        let mut grads = scaler.scale(loss).backward().unscale();
        grads.clip_grad_norm(1.0);
        let report = grads.step(opt, model).update().unwrap();
        log.push((value, report));
        if peek.contains(&i) {
            counts.push((opt.steps(), opt.lr().to_bits()));
        }
    }
    let reads = host_reads() - reads;
    let log = log.into_iter().map(|(v, r)| (v.item().to_bits(), r.skipped.get(), r.scale.get().to_bits())).collect();
    counts.push((opt.steps(), opt.lr().to_bits()));
    let params = model.named_params().iter().map(|(_, p)| p.to_vec().iter().map(|v| v.to_bits()).collect()).collect();
    ((log, counts, params, opt.state_dict()), reads)
}

#[test]
fn a_window_of_skipped_steps_leaves_no_optimizer_state() {
    use amp_core::optim::{Optim, Rule, STEPS_PER_READ, Sgd};
    // Every step overflows for a while: on the CPU the optimizer never sees them; on the
    // device it issued them, and its state must read as if it had not (no momentum buffer,
    // no moments, zero steps), inside the window and after it closes.
    fn run<R: Rule, D: Device>(model: &mut Gpt<f32, D>, mut opt: Optim<R>) -> Vec<LongRun<R::State>> {
        let over: Vec<usize> = (0..STEPS_PER_READ + 3).collect();
        let mut out = Vec::new();
        // Inside the first window, then across its close into the next: the same optimizer.
        for steps in [3, STEPS_PER_READ + 3] {
            let (run, _) = long_run(model, &mut opt, steps, &over, &[], &[]);
            assert_eq!(run.1.last().unwrap().0, 0, "no step applied");
            assert!(run.3.params.is_empty(), "no state: {:?}", run.3.params.keys());
            out.push(run);
        }
        // Then applied steps, still the same optimizer: its first real step.
        out.push(long_run(model, &mut opt, 4, &[], &[], &[]).0);
        out
    }
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.0 };
    let init = Gpt::new(config, &mut Rng::seed(12));
    let sgd = || Sgd::new(0.05).momentum(0.9).dampening(0.5).build().unwrap();
    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    assert_eq!(run(&mut mir, sgd()), run(&mut cpu, sgd()));
    let adam = || amp_core::optim::Adam::new(1e-2).build().unwrap();
    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    assert_eq!(run(&mut mir, adam()), run(&mut cpu, adam()));
}

#[test]
fn an_optimizer_cloned_or_stepped_by_hand_inside_a_window_keeps_the_cpu_results() {
    use amp_core::optim::{AdamW, Optim, Optimizer, Rule};
    // Five training steps (one skipped) leave a window open; then the optimizer is cloned, the
    // original goes on with three more, and takes one step by hand (`Optimizer::step`, which
    // closes the window first). The clone keeps the state it was cloned with. Then, each with
    // a window open: a checkpoint is loaded (the window is dropped with the state it
    // replaces) and the optimizer is made a pure-bf16 one (the window's steps are counted).
    fn run<D: Device>(model: &mut Gpt<f32, D>) -> Vec<(u64, amp_core::optim::OptimizerState<<AdamW as Rule>::State>)> {
        let mut opt: Optim<AdamW> = AdamW::new(1e-2).build().unwrap();
        long_run(model, &mut opt, 5, &[1], &[], &[]);
        let copy = opt.clone();
        let at_clone = (copy.steps(), copy.state_dict());
        long_run(model, &mut opt, 3, &[], &[], &[]);
        let ids = Indices::from_vec((0..12).map(|j| (j * 5) % 17).collect(), &[2, 6]);
        let grads = model.loss::<f32>(&ids, &ids, &mut Rng::seed(1)).backward();
        opt.step(model, &grads).unwrap();
        let mut out = vec![at_clone, (copy.steps(), copy.state_dict()), (opt.steps(), opt.state_dict())];
        // A checkpoint loaded into an optimizer with an open window replaces it whole.
        long_run(model, &mut opt, 2, &[0], &[], &[]);
        opt.load_state_dict(out[0].1.clone()).unwrap();
        out.push((opt.steps(), opt.state_dict()));
        // Turned into a pure-bf16 optimizer with a window open, the window's steps count.
        long_run(model, &mut opt, 3, &[2], &[], &[]);
        out.push((opt.clone().for_bf16(amp_core::optim::Bf16Rounding::Kahan).steps(), opt.state_dict()));
        out
    }
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.0 };
    let init = Gpt::new(config, &mut Rng::seed(13));
    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    let on_mirror = run(&mut mir);
    assert_eq!(on_mirror, run(&mut cpu));
    assert_eq!((on_mirror[0].0, on_mirror[2].0), (4, 8), "one of the first five skipped, then four more");
    assert_eq!(on_mirror[0], on_mirror[1], "the clone is its own");
    assert_eq!(on_mirror[3], on_mirror[0], "a loaded checkpoint drops the open window");
    assert_eq!(on_mirror[4].0, 4 + 2, "for_bf16 counts the window's two applied steps");
}

#[test]
fn optimizers_skip_on_the_device_and_learn_their_counts_every_window_bit_for_bit() {
    use amp_core::optim::{AdamW, ParamGroup, STEPS_PER_READ, Sgd, WarmupCosine};
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 1, n_heads: 2, dropout: 0.1 };
    let init = Gpt::new(config, &mut Rng::seed(11));
    let steps = 2 * STEPS_PER_READ + 6;
    // Skipped: the first step (state made in a window whose only step was skipped), steps in
    // the middle of windows, and the last step of the first window.
    let overflow = [0, 5, 6, STEPS_PER_READ - 1, STEPS_PER_READ + 3, 2 * STEPS_PER_READ + 2];
    let peek = [3, STEPS_PER_READ + 10];
    // A schedule and groups, so the learning rate depends on the count of applied steps.
    let schedule = || WarmupCosine::with_min(8, steps as u64, 0.1).unwrap();
    let adamw = || {
        AdamW::new(5e-3)
            .weight_decay(0.1)
            .build()
            .unwrap()
            .with_group(ParamGroup::new("no_decay", |n| n.ends_with("bias")).lr(2e-3).weight_decay(0.0))
            .unwrap()
            .with_schedule(schedule())
    };
    let sgd =
        || Sgd::new(0.05).momentum(0.9).dampening(0.25).weight_decay(1e-3).build().unwrap().with_schedule(schedule());
    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    let (on_mirror, reads) = long_run(&mut mir, &mut adamw(), steps, &overflow, &[], &peek);
    let (on_cpu, _) = long_run(&mut cpu, &mut adamw(), steps, &overflow, &[], &peek);
    assert_eq!(on_mirror, on_cpu, "AdamW");
    let skipped = on_cpu.0.iter().filter(|s| s.1).count();
    assert!(skipped >= overflow.len() && on_cpu.1.last().unwrap().0 == (steps - skipped) as u64, "{:?}", on_cpu.1);
    // Reads during the run: the two full windows closed, and one per peek (`steps()` reads
    // the open window's flags, kept for the `lr()` after it). Nothing else waited.
    assert_eq!(reads, 2 + peek.len(), "host reads");

    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    assert_eq!(
        long_run(&mut mir, &mut sgd(), steps, &overflow, &[], &peek).0,
        long_run(&mut cpu, &mut sgd(), steps, &overflow, &[], &peek).0,
        "SGD with momentum and dampening (its buffer's first step after a skipped one)"
    );

    // A parameter without a gradient on some steps: a window holds one set of parameters, so
    // a step with another set closes it first (a read), and the counts stay the CPU's.
    let frozen = [10, 11, 40];
    let (mut cpu, mut mir): (Gpt, Gpt<f32, Mirror>) = (init.clone(), init.to_device(&Mirror));
    let (on_mirror, reads) = long_run(&mut mir, &mut adamw(), 50, &overflow, &frozen, &[]);
    assert_eq!(on_mirror, long_run(&mut cpu, &mut adamw(), 50, &overflow, &frozen, &[]).0, "with frozen steps");
    // Windows [0, 10), [10, 12), [12, 40), [40, 41), [41, 50): four closed by a change of set.
    assert_eq!(reads, 4, "host reads");
}

#[test]
fn on_a_device_a_collapsed_scale_is_caught_at_the_next_state_read() {
    use amp_core::scaler::{COLLAPSE_CHECK_EVERY, GradScaler, GradScalerOptions};
    let opts = GradScalerOptions {
        init_scale: 4.0,
        min_scale: Some(1.0),
        error_at_min_scale: true,
        collapse_after: 1,
        ..Default::default()
    };
    let mut scaler = GradScaler::with_options(opts).unwrap();
    let mut model = Proj { w: Param::new(Tensor::<f32>::ones(&[2, 2]).to_device(&Mirror)) };
    let mut opt = amp_core::optim::Sgd::new(0.1).build().unwrap();
    // Every step overflows: the scale reaches its floor at the second, and from the third on
    // the run has collapsed. On the CPU the third update errs; on a device the state is read
    // back every COLLAPSE_CHECK_EVERY updates, so the error comes at that read, with the counts
    // it reads.
    let mut first_error = None;
    for i in 1..=2 * COLLAPSE_CHECK_EVERY {
        let loss = model.w.tensor().mul_scalar(f64::INFINITY).sum_all();
        let reads = host_reads();
        match scaler.scale(loss).backward().unscale().step(&mut opt, &mut model).update() {
            Ok(report) => assert!(report.skipped.get()),
            Err(e) => {
                first_error = Some((i, e.to_string()));
                break;
            }
        }
        assert!(host_reads() - reads <= 2, "step {i}: the flags and the skipped flag, no state read");
    }
    let (at, msg) = first_error.expect("the collapse is reported");
    assert_eq!(at, COLLAPSE_CHECK_EVERY);
    let overflows = format!("{COLLAPSE_CHECK_EVERY} overflowing steps");
    assert!(msg.contains("collapsed") && msg.contains("min_scale = 1") && msg.contains(&overflows), "{msg}");
    assert_eq!(scaler.get_scale(), 1.0);
    assert_eq!(opt.steps(), 0, "no step was taken");
}

#[test]
fn a_gpt_with_fused_attention_keeps_it_on_another_device_and_matches_the_cpu_bit_for_bit() {
    let config = GptConfig { vocab_size: 17, block_size: 8, d_model: 16, n_layers: 2, n_heads: 2, dropout: 0.0 };
    let cpu = Gpt::new(config, &mut Rng::seed(4)).with_fused_attention(true).unwrap();
    let dev = cpu.to_device(&Mirror);
    assert!(dev.blocks.iter().all(|b| b.attn.is_fused()), "moving the model keeps the fused attention");
    let (a, b) = (gpt_step::<bf16, Cpu>(&cpu), gpt_step::<bf16, Mirror>(&dev));
    assert_eq!(a, b);
}
