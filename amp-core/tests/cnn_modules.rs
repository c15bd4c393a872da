//! The CNN modules: BatchNorm2d's buffers (names, checkpoints, optimizer, train/eval), and
//! Conv2d / pooling shapes.

use std::path::PathBuf;

use amp_core::checkpoint::{load_weights, read_weights, save_weights};
use amp_core::nn::{AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv2d, MaxPool2d};
use amp_core::optim::{AdamW, Optimizer};
use amp_core::{Conv2dOptions, Params, Rng, Tensor};

#[derive(Params)]
struct Net {
    conv: Conv2d,
    bn: BatchNorm2d,
}

fn net() -> Net {
    let opts = Conv2dOptions { padding: (1, 1), ..Default::default() };
    Net { conv: Conv2d::new(2, 3, 3, opts, true, &mut Rng::seed(1)), bn: BatchNorm2d::new(3) }
}

fn input(seed: u64) -> Tensor<f32> {
    Tensor::<f32>::randn(&[4, 2, 5, 5], &mut Rng::seed(seed)).mul_scalar(2.0).add_scalar(0.5)
}

fn bits(t: &Tensor<f32>) -> Vec<u32> {
    t.to_vec().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn parameters_and_buffers_have_pytorch_names() {
    let m = net();
    let params: Vec<String> = m.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(params, ["conv.weight", "conv.bias", "bn.weight", "bn.bias"]);
    let buffers: Vec<String> = m.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(buffers, ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]);
    assert_eq!(m.conv.weight.shape(), &[3, 2, 3, 3]);
}

#[test]
fn eval_leaves_running_statistics_bit_identical_over_100_forwards() {
    let mut m = net();
    m.bn.forward(&m.conv.forward::<f32, f32>(&input(0))); // move them off their initial values
    m.eval();
    assert!(!m.bn.is_training(), "eval() on the parent reaches the batch norm");
    let before: Vec<Vec<u32>> = m.named_buffers().into_iter().map(|(_, b)| bits(b)).collect();
    let first = m.bn.forward(&m.conv.forward::<f32, f32>(&input(1)));
    for seed in 0..100 {
        let y = m.bn.forward(&m.conv.forward::<f32, f32>(&input(100 + seed)));
        assert_eq!(y.shape(), &[4, 3, 5, 5]);
    }
    let after: Vec<Vec<u32>> = m.named_buffers().into_iter().map(|(_, b)| bits(b)).collect();
    assert_eq!(before, after);
    // The same input gives the same output in eval mode (no batch statistics).
    assert_eq!(bits(&m.bn.forward(&m.conv.forward::<f32, f32>(&input(1)))), bits(&first));
    m.train();
    assert!(m.bn.is_training());
}

#[test]
fn training_moves_running_statistics_by_pytorchs_formula() {
    let mut bn = BatchNorm2d::new(3);
    let x = input(5)
        .narrow(1, 0, 1)
        .broadcast_to(&[4, 3, 5, 5])
        .contiguous()
        .mul(&Tensor::<f32>::from_vec(vec![1.0, 2.0, -3.0], &[1, 3, 1, 1]));
    let v = x.to_f64_vec();
    for step in 1..=3 {
        let (mean0, var0) = (bn.running_mean.to_f64_vec(), bn.running_var.to_f64_vec());
        bn.forward(&x);
        for c in 0..3 {
            let vals: Vec<f64> = (0..4).flat_map(|n| (0..25).map(move |i| n * 75 + c * 25 + i)).map(|i| v[i]).collect();
            let m = vals.iter().sum::<f64>() / 100.0;
            let unbiased = vals.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / 99.0;
            let want_mean = 0.9 * mean0[c] + 0.1 * m;
            let want_var = 0.9 * var0[c] + 0.1 * unbiased;
            let (got_mean, got_var) = (bn.running_mean.to_f64_vec()[c], bn.running_var.to_f64_vec()[c]);
            assert!(
                (got_mean - want_mean).abs() <= 1e-6 * want_mean.abs().max(1.0),
                "step {step} mean {c}: {got_mean} vs {want_mean}"
            );
            assert!(
                (got_var - want_var).abs() <= 1e-6 * want_var.abs().max(1.0),
                "step {step} var {c}: {got_var} vs {want_var}"
            );
        }
        assert_eq!(bn.num_batches_tracked.item(), step as f32);
    }
}

#[test]
fn an_optimizer_step_trains_parameters_and_leaves_buffers_alone() {
    let mut m = net();
    let y = m.bn.forward(&m.conv.forward::<f32, f32>(&input(2)));
    let grads = y.square().mean_all().backward();
    assert_eq!(grads.len(), 4, "conv.weight, conv.bias, bn.weight, bn.bias: no buffer gets a gradient");
    let buffers: Vec<Vec<u32>> = m.named_buffers().into_iter().map(|(_, b)| bits(b)).collect();
    let weight = bits(&m.bn.weight);
    let mut opt = AdamW::new(0.1).build().unwrap();
    opt.step(&mut m, &grads).unwrap();
    assert_eq!(buffers, m.named_buffers().into_iter().map(|(_, b)| bits(b)).collect::<Vec<_>>());
    assert_ne!(weight, bits(&m.bn.weight), "the parameters moved");
}

#[test]
fn checkpoints_hold_the_buffers_under_pytorch_names() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cnn_modules");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("net.safetensors");
    let mut m = net();
    m.bn.forward(&m.conv.forward::<f32, f32>(&input(3)));
    save_weights(&file, &m).unwrap();
    let names: Vec<String> = read_weights(&file).unwrap().into_keys().collect();
    assert_eq!(
        names,
        [
            "bn.bias",
            "bn.num_batches_tracked",
            "bn.running_mean",
            "bn.running_var",
            "bn.weight",
            "conv.bias",
            "conv.weight"
        ]
    );
    let mut fresh = net();
    load_weights(&file, &mut fresh).unwrap();
    assert_eq!(bits(&fresh.bn.running_var), bits(&m.bn.running_var));
    assert_eq!(fresh.bn.num_batches_tracked.item(), 1.0);
}

#[test]
fn pooling_modules_shape_and_autocast_precision() {
    let x = Tensor::<f32>::randn(&[2, 3, 8, 8], &mut Rng::seed(4));
    assert_eq!(MaxPool2d::new(2).forward(&x).shape(), &[2, 3, 4, 4]);
    assert_eq!(AvgPool2d::new(4).forward(&x).shape(), &[2, 3, 2, 2]);
    assert_eq!(AdaptiveAvgPool2d::new((1, 1)).forward(&x).shape(), &[2, 3, 1, 1]);
    let conv = Conv2d::new(3, 4, 3, Conv2dOptions { stride: (2, 2), ..Default::default() }, false, &mut Rng::seed(5));
    let y = conv.forward::<amp_core::bf16, f32>(&x);
    assert_eq!((y.shape(), y.dtype()), (&[2usize, 4, 3, 3][..], amp_core::DType::BF16));
}

#[test]
fn a_cloned_batch_norm_keeps_its_own_running_statistics() {
    // A PyTorch user's `copy.deepcopy(model)` (a target network, an EMA copy): training the
    // original must not move the clone's buffers, and the other way round.
    let mut bn = BatchNorm2d::new(2);
    let frozen = bn.clone();
    let before = (bits(&frozen.running_mean), bits(&frozen.running_var));
    bn.forward(&Tensor::<f32>::randn(&[4, 2, 3, 3], &mut Rng::seed(8)).add_scalar(1.0));
    assert_eq!((bits(&frozen.running_mean), bits(&frozen.running_var)), before);
    assert_ne!(bits(&bn.running_mean), before.0, "the trained copy moved");
    assert_eq!(frozen.num_batches_tracked.item(), 0.0);
}

#[test]
#[should_panic(expected = "BatchNorm2d::forward: expected a 4-D input [N, C, H, W] (shapes [[8, 3]])")]
fn batch_norm_2d_refuses_an_input_that_is_not_an_image_batch() {
    // A flattened batch reaching the 2-D module is a porting mistake (PyTorch: "expected 4D
    // input (got 2D input)"); the op itself takes [N, C, ...] of any rank.
    BatchNorm2d::new(3).forward(&Tensor::<f32>::zeros(&[8, 3]));
}

#[test]
#[should_panic(expected = "Dropout::new: invalid argument `p`: must be in [0, 1), got 1.5")]
fn dropout_checks_its_probability_when_built() {
    amp_core::nn::Dropout::new(1.5);
}

#[test]
#[should_panic(expected = "Conv2d::new: invalid argument `kernel`: the kernel size must be at least 1, got 0")]
fn conv2d_refuses_an_empty_kernel_when_built() {
    Conv2d::new(1, 1, 0, Conv2dOptions::default(), true, &mut Rng::seed(0));
}

#[test]
fn batch_norm_2d_takes_its_f32_parameters_unrounded_for_a_bf16_input() {
    // PyTorch's mixed batch norm (cuDNN's, and autocast's for a bf16 activation) keeps the
    // parameters in f32: the output is the f32 computation rounded once, and the parameters'
    // gradients are f32 sums. Rounding the weight to bf16 first (what this did before) is off
    // by up to a unit of bf16 in the output and 2^-9 relative in the gradient.
    let (n, c, h, w) = (4, 3, 5, 5);
    let x = Tensor::<f32>::randn(&[n, c, h, w], &mut Rng::seed(11)).add_scalar(0.5).cast::<amp_core::bf16>();
    let mut bn = BatchNorm2d::new(c);
    // Weights and biases with bits bf16 has not (multiples of 2^-12 near 1).
    bn.weight =
        amp_core::Param::new(Tensor::from_vec(vec![1.0 + 3.0 / 4096.0, 0.75 + 5.0 / 4096.0, 1.5 - 7.0 / 4096.0], &[c]));
    bn.bias =
        amp_core::Param::new(Tensor::from_vec(vec![1.0 / 4096.0, -0.25 + 1.0 / 4096.0, 0.5 + 3.0 / 4096.0], &[c]));
    let y = bn.forward(&x);
    let r = Tensor::<f32>::randn(&[n, c, h, w], &mut Rng::seed(12));
    let grads = y.cast::<f32>().mul(&r).sum_all().backward();

    // The reference, in f64 from the same bf16 inputs and f32 parameters; the gradient reaching
    // the bf16 output is `r` rounded to bf16 (the cast's backward).
    let rs = r.cast::<amp_core::bf16>().to_f64_vec();
    let (xs, ys) = (x.to_f64_vec(), y.to_f64_vec());
    let (ws, bs) = (bn.weight.to_f64_vec(), bn.bias.to_f64_vec());
    let gw = grads.get(&bn.weight).expect("the weight's gradient").to_f64_vec();
    let at = |ni: usize, ci: usize, k: usize| (ni * c + ci) * h * w + k;
    for ci in 0..c {
        let idx: Vec<usize> = (0..n).flat_map(|ni| (0..h * w).map(move |k| at(ni, ci, k))).collect();
        let m = idx.len() as f64;
        let mean = idx.iter().map(|&i| xs[i]).sum::<f64>() / m;
        let var = idx.iter().map(|&i| (xs[i] - mean).powi(2)).sum::<f64>() / m;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        let mut dw = 0.0;
        for &i in &idx {
            let xhat = (xs[i] - mean) * rstd;
            let want = xhat * ws[ci] + bs[ci];
            // Correctly rounded to bf16 (half a unit of its last place), give or take f32's
            // statistics.
            let half_ulp = 2f64.powi(want.abs().log2().floor() as i32 - 8);
            assert!(
                (ys[i] - want).abs() <= half_ulp + 1e-5 * want.abs(),
                "channel {ci}, element {i}: {} against {want} (half a bf16 unit {half_ulp:e})",
                ys[i]
            );
            dw += rs[i] * xhat;
        }
        assert!(
            (gw[ci] - dw).abs() <= 1e-5 * dw.abs().max(1.0),
            "channel {ci}: weight gradient {} against {dw}",
            gw[ci]
        );
    }
}

#[test]
fn a_pure_bf16_cnn_trains_batch_norm_with_one_bf16_optimizer() {
    // `model.to(torch.bfloat16)` with batch norm inside: the weight and bias in bf16 beside the
    // convolution's, one optimizer over all of them; the running statistics stay f32.
    use amp_core::bf16;
    use amp_core::optim::{Bf16Rounding, Optim};

    #[derive(Params)]
    struct Bf16Net {
        conv: Conv2d<bf16>,
        bn: BatchNorm2d<bf16>,
    }
    let f32_net = net();
    let mut m = Bf16Net { conv: f32_net.conv.to_precision::<bf16>(), bn: f32_net.bn.to_precision::<bf16>() };
    let names: Vec<String> = m.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["conv.weight", "conv.bias", "bn.weight", "bn.bias"]);
    let mut opt: Optim<AdamW, bf16> = AdamW::new(0.1).build().unwrap().for_bf16(Bf16Rounding::Nearest);
    let before = (m.bn.weight.to_f64_vec(), m.bn.running_mean.to_vec());
    let x = input(2).cast::<bf16>();
    let y = m.bn.forward(&m.conv.forward::<bf16, bf16>(&x));
    assert_eq!(y.dtype(), amp_core::DType::BF16);
    let grads = y.cast::<f32>().square().mean_all().backward();
    let gw = grads.get(&m.bn.weight).expect("bn.weight has a gradient");
    assert_eq!(gw.dtype(), amp_core::DType::BF16, "in its parameter's precision");
    opt.step(&mut m, &grads).unwrap();
    assert_ne!(m.bn.weight.to_f64_vec(), before.0, "the optimizer moved the bf16 weight");
    assert_ne!(m.bn.running_mean.to_vec(), before.1, "the forward moved the f32 running mean");
    assert_eq!(m.bn.running_mean.dtype(), amp_core::DType::F32);
}
