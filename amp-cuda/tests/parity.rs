//! The CPU backend is the oracle: every op forward and backward at f32, f16 and bf16 on both
//! devices, compared element by element with per-precision tolerances; the AMP passes and the
//! optimizer kernels through the trait; and 20 AMP steps of the small GPT (f16 + GradScaler,
//! bf16 + NoScale) comparing losses, skipped steps and gradient norms.
//!
//! Without a GPU every test prints `SKIPPED: no CUDA device (...)` and checks nothing. With
//! one, each comparison prints `PARITY <case> <dtype> <output> worst abs <a> rel <r>` (the GPU
//! bundle's table reads these lines).

mod common;

use amp_core::backend::{AdamArgs, AdamDecay, Bf16Write, HostValue, Outcomes, ScaleRule, SgdArgs};
use amp_core::layout::Layout;
use amp_core::nn::{Gpt, GptConfig};
use amp_core::param::ToDevice;
use amp_core::{
    BatchNormOptions, Conv2dOptions, CrossEntropyOptions, Device, Grads, Indices, Mask, Precision, Rng, Tensor, bf16,
    f16,
};
use amp_core::{Cpu, DType};
use amp_cuda::Cuda;
use common::cuda_or_skip;

type Outputs = Vec<(String, Vec<f64>)>;

/// (absolute, relative) tolerance per precision: about 2^-17 of f32 noise from a different
/// summation order and transcendental implementations, and a few units in the last place of
/// f16 (2^-11) and bf16 (2^-8) for a value rounded once from a slightly different f32.
fn tolerance(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (2e-5, 2e-4),
        DType::F16 => (2e-3, 4e-3),
        DType::BF16 => (1.6e-2, 3.2e-2),
        DType::F64 => (1e-12, 1e-10),
    }
}

/// Compares every output of `case` at precision `dtype`; prints the worst errors; fails with
/// every output that is out of tolerance.
fn check(case: &str, dtype: DType, cpu: Outputs, cuda: Outputs) {
    let (atol, rtol) = tolerance(dtype);
    assert_eq!(cpu.len(), cuda.len(), "{case} {dtype}: output count");
    let mut bad = Vec::new();
    for ((name, want), (name2, got)) in cpu.iter().zip(&cuda) {
        assert_eq!(name, name2);
        assert_eq!(want.len(), got.len(), "{case} {dtype} {name}: length");
        let (mut worst_abs, mut worst_rel, mut fails) = (0f64, 0f64, 0usize);
        for (w, g) in want.iter().zip(got) {
            if w.is_nan() && g.is_nan() || w == g {
                continue;
            }
            let err = (w - g).abs();
            worst_abs = worst_abs.max(err);
            worst_rel = worst_rel.max(err / w.abs().max(1e-30));
            if err.is_nan() || err > atol + rtol * w.abs() {
                fails += 1;
            }
        }
        println!("PARITY {case} {dtype} {name} worst abs {worst_abs:.3e} rel {worst_rel:.3e}");
        if fails > 0 {
            bad.push(format!("{name}: {fails} of {} out of tolerance (worst abs {worst_abs:.3e})", want.len()));
        }
    }
    assert!(bad.is_empty(), "{case} {dtype}:\n{}", bad.join("\n"));
}

/// A leaf input: standard normal values times `scale`, made on the CPU in f32 and rounded into
/// `E` there, so both devices get the same values.
fn input<E: Precision, D: Device>(dev: &D, shape: &[usize], seed: u64, scale: f64) -> Tensor<E, D> {
    Tensor::<f32>::randn(shape, &mut Rng::seed(seed)).mul_scalar(scale).cast::<E>().to_device(dev).requires_grad_()
}

/// A leaf input with values in [0.5, 1.5).
fn positive<E: Precision, D: Device>(dev: &D, shape: &[usize], seed: u64) -> Tensor<E, D> {
    Tensor::<f32>::rand(shape, &mut Rng::seed(seed)).add_scalar(0.5).cast::<E>().to_device(dev).requires_grad_()
}

/// Records `y` and the gradients of `leaves` of `Σ y·r` for a fixed random `r` (so every
/// gradient element is exercised).
fn record<E: Precision, D: Device>(out: &mut Outputs, label: &str, y: &Tensor<E, D>, leaves: &[&Tensor<E, D>]) {
    record_with::<E, E, D>(out, label, y, leaves, &[]);
}

/// [`record`] with leaves of a second precision `P` too (batch norm's f32 parameters of an
/// f16 input), their gradients numbered after the others'.
fn record_with<E: Precision, P: Precision, D: Device>(
    out: &mut Outputs,
    label: &str,
    y: &Tensor<E, D>,
    leaves: &[&Tensor<E, D>],
    params: &[&Tensor<P, D>],
) {
    out.push((format!("{label}.y"), y.to_f64_vec()));
    let r = Tensor::<f32>::randn(y.shape(), &mut Rng::seed(99)).to_device(y.device());
    let grads: Grads<D> = y.cast::<f32>().mul(&r).sum_all().backward();
    let leaf_grads = leaves.iter().map(|x| grads.get(x).map(|g| g.to_f64_vec()));
    let param_grads = params.iter().map(|p| grads.get(p).map(|g| g.to_f64_vec()));
    for (i, g) in leaf_grads.chain(param_grads).enumerate() {
        out.push((format!("{label}.grad{i}"), g.unwrap_or_default()));
    }
}

/// One `#[test]` running `body` on the CPU and on the GPU at f32, f16 and bf16.
macro_rules! parity {
    ($name:ident, |$dev:ident, $e:ident| $body:block) => {
        #[test]
        fn $name() {
            fn body<$e: Precision, D: Device>($dev: &D) -> Outputs $body
            let Some(cuda) = cuda_or_skip(stringify!($name)) else { return };
            check(stringify!($name), DType::F32, body::<f32, Cpu>(&Cpu), body::<f32, Cuda>(&cuda));
            check(stringify!($name), DType::F16, body::<f16, Cpu>(&Cpu), body::<f16, Cuda>(&cuda));
            check(stringify!($name), DType::BF16, body::<bf16, Cpu>(&Cpu), body::<bf16, Cuda>(&cuda));
        }
    };
}

parity!(unary_ops_forward_and_backward, |dev, E| {
    let mut out = Vec::new();
    let x = input::<E, D>(dev, &[5, 37], 1, 1.5);
    let p = positive::<E, D>(dev, &[5, 37], 2);
    record(&mut out, "neg", &x.neg(), &[&x]);
    record(&mut out, "relu", &x.relu(), &[&x]);
    record(&mut out, "gelu", &x.gelu(), &[&x]);
    record(&mut out, "gelu_tanh", &x.gelu_tanh(), &[&x]);
    record(&mut out, "tanh", &x.tanh(), &[&x]);
    record(&mut out, "sigmoid", &x.sigmoid(), &[&x]);
    record(&mut out, "silu", &x.silu(), &[&x]);
    record(&mut out, "exp", &x.exp(), &[&x]);
    record(&mut out, "log", &p.log(), &[&p]);
    record(&mut out, "sqrt", &p.sqrt(), &[&p]);
    record(&mut out, "powf", &p.powf(1.7), &[&p]);
    record(&mut out, "add_scalar", &x.add_scalar(0.3), &[&x]);
    record(&mut out, "mul_scalar", &x.mul_scalar(-1.5), &[&x]);
    record(&mut out, "div_scalar", &x.div_scalar(3.0), &[&x]);
    record(&mut out, "rdiv_scalar", &p.rdiv_scalar(2.0), &[&p]);
    // Strided inputs: a transpose and a narrowed view go to the kernels as they are.
    record(&mut out, "gelu_of_transpose", &x.t().gelu(), &[&x]);
    record(&mut out, "tanh_of_narrow", &x.narrow(1, 3, 20).tanh(), &[&x]);
    out
});

parity!(binary_ops_with_broadcasting, |dev, E| {
    let mut out = Vec::new();
    let a = input::<E, D>(dev, &[3, 1, 5], 3, 1.0);
    let b = input::<E, D>(dev, &[4, 5], 4, 1.0);
    let bp = positive::<E, D>(dev, &[4, 5], 5);
    record(&mut out, "add", &a.add(&b), &[&a, &b]);
    record(&mut out, "sub", &a.sub(&b), &[&a, &b]);
    record(&mut out, "mul", &a.mul(&b), &[&a, &b]);
    record(&mut out, "div", &a.div(&bp), &[&a, &bp]);
    let c = input::<E, D>(dev, &[5, 4], 6, 1.0);
    record(&mut out, "mul_transposed", &c.t().mul(&b), &[&c, &b]);
    // Large and contiguous: the 128-bit path, with a tail.
    let (x, y) = (input::<E, D>(dev, &[1000, 13], 7, 1.0), input::<E, D>(dev, &[1000, 13], 8, 1.0));
    record(&mut out, "add_contiguous", &x.add(&y), &[&x, &y]);
    record(&mut out, "mse", &x.mse_loss(&y), &[&x, &y]);
    out
});

parity!(where_and_masked_fill, |dev, E| {
    let mut out = Vec::new();
    let a = input::<E, D>(dev, &[2, 4, 5], 9, 1.0);
    let b = input::<E, D>(dev, &[4, 5], 10, 1.0);
    let mask = Mask::from_vec((0..10).map(|i| i % 3 == 0).collect(), &[2, 1, 5]);
    record(&mut out, "where", &Tensor::where_cond(&mask, &a, &b), &[&a, &b]);
    let s = input::<E, D>(dev, &[6, 6], 11, 1.0);
    record(&mut out, "masked_fill", &s.masked_fill(&Mask::causal(6), -1e4), &[&s]);
    out
});

parity!(reductions, |dev, E| {
    let mut out = Vec::new();
    let x = input::<E, D>(dev, &[4, 6, 5], 12, 1.0);
    record(&mut out, "sum_dim1", &x.sum(1, false), &[&x]);
    record(&mut out, "sum_last", &x.sum(2, true), &[&x]);
    record(&mut out, "mean_dim0", &x.mean(0, true), &[&x]);
    record(&mut out, "max_dim1", &x.max(1, false), &[&x]);
    record(&mut out, "min_dim2", &x.min(2, false), &[&x]);
    record(&mut out, "sum_all", &x.sum_all(), &[&x]);
    record(&mut out, "mean_all_transposed", &x.transpose(0, 2).mean_all(), &[&x]);
    let long = input::<E, D>(dev, &[3, 5000], 13, 1.0);
    record(&mut out, "sum_long_rows", &long.sum(1, false), &[&long]);
    // Few outputs over a long dim (a bias gradient): partial sums over parts, then combined.
    let tall = input::<E, D>(dev, &[3000, 96], 48, 1.0);
    record(&mut out, "sum_tall_dim0", &tall.sum(0, false), &[&tall]);
    record(&mut out, "max_tall_dim0", &tall.max(0, true), &[&tall]);
    let mid = input::<E, D>(dev, &[2, 700, 40], 49, 1.0);
    record(&mut out, "mean_middle_dim", &mid.mean(1, false), &[&mid]);
    out
});

parity!(matmul_and_linear, |dev, E| {
    let mut out = Vec::new();
    let a = input::<E, D>(dev, &[2, 3, 4, 5], 14, 0.5);
    let b = input::<E, D>(dev, &[5, 6], 15, 0.5);
    record(&mut out, "matmul_batched", &a.matmul(&b), &[&a, &b]);
    let c = input::<E, D>(dev, &[3, 1, 4, 5], 16, 0.5);
    let d = input::<E, D>(dev, &[2, 5, 6], 17, 0.5);
    record(&mut out, "matmul_broadcast_batch", &c.matmul(&d), &[&c, &d]);
    let e = input::<E, D>(dev, &[5, 4], 18, 0.5);
    let f = input::<E, D>(dev, &[6, 5], 19, 0.5);
    record(&mut out, "matmul_transposes", &e.t().matmul(&f.t()), &[&e, &f]);
    let x = input::<E, D>(dev, &[7, 5], 20, 1.0);
    let w = input::<E, D>(dev, &[6, 5], 21, 0.5);
    let bias = input::<E, D>(dev, &[6], 22, 0.5);
    record(&mut out, "linear_bias", &x.linear(&w, Some(&bias)), &[&x, &w, &bias]);
    record(&mut out, "linear", &x.linear(&w, None), &[&x, &w]);
    let xt = input::<E, D>(dev, &[5, 7], 23, 1.0);
    record(&mut out, "linear_strided_input", &xt.t().linear(&w, Some(&bias)), &[&xt, &w, &bias]);
    let big_a = input::<E, D>(dev, &[64, 256], 24, 0.1);
    let big_b = input::<E, D>(dev, &[256, 48], 25, 0.1);
    record(&mut out, "matmul_k256", &big_a.matmul(&big_b), &[&big_a, &big_b]);
    out
});

parity!(causal_attention, |dev, E| {
    let mut out = Vec::new();
    // Several query blocks of 128 rows with a short last one (150, 300), one block (70, 40),
    // head sizes from 8 to 160, and a t below one warp. In f16 and bf16, heads of 32 and 64
    // take the fused tensor-core kernels (blocks of 64 rows: 130 is two and a ragged one).
    for (i, (n, t, d)) in [(2, 150, 16), (3, 70, 64), (1, 40, 128), (2, 5, 8), (2, 300, 64), (1, 33, 160), (2, 130, 32)]
        .into_iter()
        .enumerate()
    {
        let s = 300 + 3 * i as u64;
        let q = input::<E, D>(dev, &[n, t, d], s, 1.0);
        let k = input::<E, D>(dev, &[n, t, d], s + 1, 1.0);
        let v = input::<E, D>(dev, &[n, t, d], s + 2, 1.0);
        record(&mut out, &format!("causal_attention {n}x{t}x{d}"), &q.causal_attention(&k, &v), &[&q, &k, &v]);
    }
    out
});

parity!(softmax_and_norms, |dev, E| {
    let mut out = Vec::new();
    let x = input::<E, D>(dev, &[6, 40], 26, 2.0);
    record(&mut out, "softmax", &x.softmax(1), &[&x]);
    record(&mut out, "log_softmax", &x.log_softmax(1), &[&x]);
    record(&mut out, "softmax_dim0", &x.softmax(0), &[&x]);
    // Rows too long for the shared-memory row cache take the re-reading path.
    let long = input::<E, D>(dev, &[2, 20000], 27, 1.0);
    record(&mut out, "softmax_long", &long.softmax(1), &[&long]);
    let y = input::<E, D>(dev, &[9, 48], 28, 1.0).add_scalar(3.0).detach().requires_grad_();
    let w = input::<E, D>(dev, &[48], 29, 1.0);
    let b = input::<E, D>(dev, &[48], 30, 1.0);
    record(&mut out, "layer_norm", &y.layer_norm(Some(&w), Some(&b), 1e-5), &[&y, &w, &b]);
    record(&mut out, "layer_norm_plain", &y.layer_norm(None, None, 1e-5), &[&y]);
    record(&mut out, "rms_norm", &y.rms_norm(Some(&w), 1e-6), &[&y, &w]);
    let ln = input::<E, D>(dev, &[2, 13000], 31, 1.0);
    record(&mut out, "layer_norm_long", &ln.layer_norm(None, None, 1e-5), &[&ln]);
    // At the row cache's edge (f32 sums: 12,032 values a row forward, 6,016 in a norm's
    // backward), and just past it where rows of 12,253-12,288 once failed to launch.
    for (i, d) in [6016usize, 6144, 12032, 12288].into_iter().enumerate() {
        let r = input::<E, D>(dev, &[2, d], 60 + i as u64, 1.0);
        record(&mut out, &format!("softmax_{d}"), &r.softmax(1), &[&r]);
        record(&mut out, &format!("layer_norm_{d}"), &r.layer_norm(None, None, 1e-5), &[&r]);
        record(&mut out, &format!("rms_norm_{d}"), &r.rms_norm(None, 1e-6), &[&r]);
    }
    // GPT-sized rows: one warp per row, in 128-bit vectors (768 and 1024 values).
    let wide = input::<E, D>(dev, &[5, 1024], 50, 2.0);
    record(&mut out, "softmax_1024", &wide.softmax(1), &[&wide]);
    record(&mut out, "log_softmax_1024", &wide.log_softmax(1), &[&wide]);
    let h = input::<E, D>(dev, &[7, 768], 51, 1.0).add_scalar(0.5).detach().requires_grad_();
    let (hw, hb) = (input::<E, D>(dev, &[768], 52, 1.0), input::<E, D>(dev, &[768], 53, 1.0));
    record(&mut out, "layer_norm_768", &h.layer_norm(Some(&hw), Some(&hb), 1e-5), &[&h, &hw, &hb]);
    record(&mut out, "rms_norm_768", &h.rms_norm(Some(&hw), 1e-6), &[&h, &hw]);
    let many = input::<E, D>(dev, &[600, 8], 32, 1.0);
    let wm = input::<E, D>(dev, &[8], 33, 1.0);
    record(&mut out, "rms_norm_many_rows", &many.rms_norm(Some(&wm), 1e-6), &[&many, &wm]);
    out
});

parity!(losses, |dev, E| {
    let mut out = Vec::new();
    let logits = input::<E, D>(dev, &[8, 11], 34, 2.0);
    let t = Indices::from_vec(vec![1, 4, -100, 10, 0, 3, 3, -100], &[8]);
    let opts = CrossEntropyOptions { ignore_index: Some(-100), label_smoothing: 0.1 };
    record(&mut out, "cross_entropy_smoothed", &logits.cross_entropy_with(&t, opts), &[&logits]);
    let t2 = Indices::from_vec(vec![1, 4, 2, 10, 0, 3, 3, 7], &[8]);
    record(&mut out, "cross_entropy", &logits.cross_entropy(&t2), &[&logits]);
    let wide = input::<E, D>(dev, &[3, 30000], 35, 1.0);
    record(&mut out, "cross_entropy_wide", &wide.cross_entropy(&Indices::from_vec(vec![5, 29999, 0], &[3])), &[&wide]);
    // A GPT-2 vocabulary: 128-bit vectors, an ignored row.
    let vocab = input::<E, D>(dev, &[4, 50304], 54, 2.0);
    let t = Indices::from_vec(vec![50303, -100, 0, 777], &[4]);
    let opts = CrossEntropyOptions { ignore_index: Some(-100), label_smoothing: 0.05 };
    record(&mut out, "cross_entropy_vocab", &vocab.cross_entropy_with(&t, opts), &[&vocab]);
    out
});

parity!(convolution, |dev, E| {
    let mut out = Vec::new();
    let x = input::<E, D>(dev, &[2, 4, 9, 9], 36, 1.0);
    let w = input::<E, D>(dev, &[6, 2, 3, 3], 37, 0.3);
    let b = input::<E, D>(dev, &[6], 38, 0.1);
    let opts = Conv2dOptions { stride: (2, 1), padding: (1, 2), dilation: (1, 2), groups: 2 };
    record(&mut out, "conv_groups_bias", &x.conv2d(&w, Some(&b), opts), &[&x, &w, &b]);
    let w1 = input::<E, D>(dev, &[5, 4, 2, 2], 39, 0.3);
    record(&mut out, "conv_plain", &x.conv2d(&w1, None, Conv2dOptions::default()), &[&x, &w1]);
    out
});

parity!(pooling, |dev, E| {
    let mut out = Vec::new();
    let x = input::<E, D>(dev, &[2, 3, 7, 8], 40, 1.0);
    record(&mut out, "max_pool", &x.max_pool2d((3, 3), (2, 2), (1, 1)), &[&x]);
    record(&mut out, "avg_pool", &x.avg_pool2d((2, 2), (1, 2), (1, 0)), &[&x]);
    record(&mut out, "adaptive_avg_pool", &x.adaptive_avg_pool2d((3, 2)), &[&x]);
    out
});

parity!(batch_norm, |dev, E| {
    let mut out = Vec::new();
    let x = input::<E, D>(dev, &[3, 4, 5, 2], 41, 1.0);
    // The weight and bias in E::Acc: f32 parameters of an f16/bf16 input, as PyTorch's.
    let g = input::<E::Acc, D>(dev, &[4], 42, 1.0);
    let b = input::<E::Acc, D>(dev, &[4], 43, 1.0);
    let mut mean = Tensor::<f32>::zeros(&[4]).to_device(dev);
    let mut var = Tensor::<f32>::ones(&[4]).to_device(dev);
    let train = BatchNormOptions { training: true, ..Default::default() };
    let y = x.batch_norm(Some(&mut mean), Some(&mut var), Some(&g), Some(&b), train);
    record_with(&mut out, "batch_norm_train", &y, &[&x], &[&g, &b]);
    out.push(("running_mean".into(), mean.to_f64_vec()));
    out.push(("running_var".into(), var.to_f64_vec()));
    let e = x.batch_norm(Some(&mut mean), Some(&mut var), Some(&g), None, BatchNormOptions::default());
    record_with(&mut out, "batch_norm_eval", &e, &[&x], &[&g]);
    out
});

parity!(embedding_cat_dropout_casts, |dev, E| {
    let mut out = Vec::new();
    let w = input::<E, D>(dev, &[13, 6], 44, 1.0);
    let ids = Indices::from_vec(vec![3, 0, 12, 3, 3, 7, 0, 1, 12, 5], &[10]);
    record(&mut out, "embedding", &w.embedding(&ids), &[&w]);
    let a = input::<E, D>(dev, &[3, 2, 4], 45, 1.0);
    let b = input::<E, D>(dev, &[3, 5, 4], 46, 1.0);
    record(&mut out, "cat_dim1", &Tensor::cat(&[&a, &b], 1), &[&a, &b]);
    record(
        &mut out,
        "cat_dim0_strided",
        &Tensor::cat(&[&a.transpose(1, 2), &b.narrow(1, 0, 2).transpose(1, 2)], 0),
        &[&a, &b],
    );
    let x = input::<E, D>(dev, &[70, 600], 47, 1.0); // 42000 elements: three dropout chunks
    record(&mut out, "dropout", &x.dropout(0.3, true, &mut Rng::seed(5)), &[&x]);
    record(&mut out, "cast_f32", &x.cast::<f32>().cast::<E>(), &[&x]);
    record(&mut out, "cast_f16", &x.cast::<f16>().cast::<E>(), &[&x]);
    record(&mut out, "cast_bf16", &x.cast::<bf16>().cast::<E>(), &[&x]);
    record(&mut out, "cast_f64", &x.cast::<f64>().mul_scalar(1.25).cast::<E>(), &[&x]);
    out
});

/// The AMP passes through the trait: unscale + non-finite check (f32 and bf16, with the
/// scale on the device), the check alone, the norms and clip scalars, the scale update (an
/// overflow, a growth, a set scale), scale and clamp in place.
fn amp_passes<D: Device>(dev: &D) -> Outputs {
    let mut out = Vec::new();
    let vals = |seed: u64, n: usize| Tensor::<f32>::randn(&[n], &mut Rng::seed(seed)).mul_scalar(100.0).to_vec();
    let (mut a, mut b) = (vals(50, 70000), vals(51, 33));
    b[7] = f32::INFINITY;
    let mut ga = dev.from_host(a.clone());
    let mut gb = dev.from_host(b.clone());
    let mut hb = dev.cast::<f32, bf16>(&dev.from_host(vals(54, 300)), &Layout::contiguous(&[300]));
    let state = dev.from_host(vec![1024.0f64, 0.0, 1.0, 0.0, 0.0]);
    let mut found = dev.from_host(vec![0f32; 3]);
    dev.unscale_check(&mut [&mut ga, &mut gb], Some(&state), &mut found, 0);
    dev.unscale_check(&mut [&mut hb], Some(&state), &mut found, 2);
    let host = |s: &D::Storage<f32>, n: usize| dev.to_host(s, &Layout::contiguous(&[n]));
    let widen = |v: Vec<f32>| v.into_iter().map(|v| if v.is_finite() { v as f64 } else { 1e300 }).collect();
    out.push(("unscaled_a".into(), widen(host(&ga, a.len()))));
    out.push(("unscaled_b".into(), widen(host(&gb, b.len()))));
    let hb32 = dev.cast::<bf16, f32>(&hb, &Layout::contiguous(&[300]));
    out.push(("unscaled_bf16".into(), widen(host(&hb32, 300))));
    out.push(("found_inf".into(), widen(host(&found, 3))));
    a[3] = f32::NAN;
    let mut sa = dev.from_host(a.clone());
    let mut sb = dev.from_host(vals(52, 5000));
    let lb = Layout::contiguous(&[5000]);
    let mut checked = dev.from_host(vec![0f32; 2]);
    dev.unscale_check(&mut [&mut sa, &mut sb], None, &mut checked, 0);
    out.push(("check_only".into(), widen(host(&checked, 2))));
    out.push(("check_only_leaves_values".into(), widen(host(&sb, 5000))));
    let h = dev.cast::<f32, bf16>(&sb, &lb);
    let mut norms = dev.from_host(vec![0f32; 2]);
    dev.norm_into(&sb, &lb, &mut norms, 0);
    dev.norm_into(&h, &lb, &mut norms, 1);
    out.push(("norms".into(), widen(host(&norms, 2))));
    let mut clip = dev.from_host(vec![0f32; 2]);
    dev.clip_coefficient(&norms, 1.0, &mut clip);
    out.push(("clip_scalars".into(), widen(host(&clip, 2))));
    let rule = ScaleRule {
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2,
        min_scale: Some(1.0),
        max_scale: Some(4096.0),
        hysteresis: 1,
        set_scale: None,
    };
    let mut scale = dev.from_host(vec![1024.0f64, 1.0, 1.0, 0.0, 0.0]);
    let mut states = Vec::new();
    for (flag, set) in [(0f32, None), (1.0, None), (0.0, None), (0.0, None), (0.0, Some(3.0)), (1.0, None)] {
        let flags = dev.from_host(vec![0.0, flag]);
        dev.update_scale(&mut scale, &flags, &ScaleRule { set_scale: set, ..rule });
        states.extend(dev.to_host(&scale, &Layout::contiguous(&[5])));
    }
    out.push(("update_scale".into(), states));
    let mut s = dev.from_host(vals(53, 1000));
    let k = dev.from_host(vec![9.0f32, 0.37]);
    dev.scale_in_place(&mut s, &k, 1);
    dev.clamp_in_place(&mut s, 20.0);
    out.push(("scale_clamp".into(), widen(host(&s, 1000))));
    out
}

#[test]
fn amp_passes_match_the_cpu() {
    let Some(cuda) = cuda_or_skip("amp_passes_match_the_cpu") else { return };
    check("amp_passes", DType::F32, amp_passes(&Cpu), amp_passes(&cuda));
}

/// SGD (momentum, Nesterov, decay), Adam, AdamW, the bf16 write-backs, and `found_inf` skips.
fn optimizer_kernels<D: Device>(dev: &D) -> Outputs {
    let mut out = Vec::new();
    let vals = |seed: u64| Tensor::<f32>::randn(&[3000], &mut Rng::seed(seed)).to_vec();
    let f32s = |v: Vec<f32>| v.into_iter().map(|x| x as f64).collect::<Vec<f64>>();
    let l = Layout::contiguous(&[3000]);
    let g = dev.from_host(vals(60));
    for (i, skip) in [0.0f32, 1.0].into_iter().enumerate() {
        let flag = dev.from_host(vec![skip]);
        let mut p = dev.from_host(vals(61));
        let mut buf = dev.state_from_host(vals(62));
        let sgd =
            SgdArgs { neg_lr: -0.1, weight_decay: Some(0.01), momentum: 0.9, keep: 0.9, nesterov: true, first: false };
        let outcomes = Some(Outcomes { flags: &flag, at: 0 });
        dev.sgd_update(&[sgd], &mut p, &g, Some(&mut buf), outcomes);
        let plain = SgdArgs { momentum: 0.0, weight_decay: None, nesterov: false, ..sgd };
        dev.sgd_update(&[plain], &mut p, &g, None, None);
        for (j, decay) in [AdamDecay::L2(0.01), AdamDecay::Decoupled(0.999), AdamDecay::None].into_iter().enumerate() {
            let (mut m, mut v) =
                (dev.state_from_host(vals(63)), dev.state_from_host(vals(64).iter().map(|x| x * x).collect()));
            let args = AdamArgs {
                neg_step_size: -1e-3,
                bias_correction2_sqrt: 0.3,
                lerp_weight: if j == 2 { 0.7 } else { 0.1 },
                beta2: 0.999,
                one_minus_beta2: 0.001,
                eps: 1e-8,
                decay,
            };
            dev.adam_update(&[args], &mut p, &g, &mut m, &mut v, Some(Outcomes { flags: &flag, at: 0 }));
            out.push((format!("adam{j}.m.{i}"), f32s(dev.state_to_host(&m))));
            out.push((format!("adam{j}.v.{i}"), f32s(dev.state_to_host(&v))));
        }
        out.push((format!("param.{i}"), f32s(dev.to_host(&p, &l))));
        out.push((format!("momentum.{i}"), f32s(dev.state_to_host(&buf))));
    }
    // A window: step 3 after an applied, a skipped and an applied step uses row 2; step 1
    // (skipped) changes nothing.
    let flags = dev.from_host(vec![0.0f32, 1.0, 0.0, 0.0]);
    for at in [3, 1] {
        let outcomes = Some(Outcomes { flags: &flags, at });
        let mut p = dev.from_host(vals(67));
        let mut buf = dev.state_from_host(vals(68));
        let sgd: Vec<SgdArgs> = (0..=at)
            .map(|k| SgdArgs {
                neg_lr: -0.1 / (k + 1) as f32,
                weight_decay: Some(0.01),
                momentum: 0.9,
                keep: 0.75,
                nesterov: false,
                first: k == 0,
            })
            .collect();
        dev.sgd_update(&sgd, &mut p, &g, Some(&mut buf), outcomes);
        let (mut m, mut v) =
            (dev.state_from_host(vals(63)), dev.state_from_host(vals(64).iter().map(|x| x * x).collect()));
        let adam: Vec<AdamArgs> = (0..=at)
            .map(|k| AdamArgs {
                neg_step_size: -1e-3 * (k + 1) as f32,
                bias_correction2_sqrt: 0.1 * (k + 1) as f32,
                lerp_weight: 0.1,
                beta2: 0.999,
                one_minus_beta2: 0.001,
                eps: 1e-8,
                decay: AdamDecay::Decoupled(1.0 - 1e-4 * (k + 1) as f32),
            })
            .collect();
        dev.adam_update(&adam, &mut p, &g, &mut m, &mut v, outcomes);
        out.push((format!("window{at}.param"), f32s(dev.to_host(&p, &l))));
        out.push((format!("window{at}.momentum"), f32s(dev.state_to_host(&buf))));
        out.push((format!("window{at}.m"), f32s(dev.state_to_host(&m))));
    }
    let updated = dev.from_host(vals(65));
    for (k, mode) in [Bf16Write::Nearest, Bf16Write::Kahan, Bf16Write::Stochastic { key: 77 }].into_iter().enumerate() {
        let mut p = dev.cast::<f32, bf16>(&dev.from_host(vals(66)), &l);
        let mut c = dev.full(3000, bf16::from_f32(0.001));
        dev.write_bf16(&updated, &mut p, mode, matches!(mode, Bf16Write::Kahan).then_some(&mut c));
        out.push((format!("bf16_write{k}"), dev.to_host(&p, &l).iter().map(|v| v.to_f64()).collect()));
        out.push((format!("bf16_comp{k}"), dev.to_host(&c, &l).iter().map(|v| v.to_f64()).collect()));
    }
    out
}

#[test]
fn optimizer_kernels_match_the_cpu() {
    let Some(cuda) = cuda_or_skip("optimizer_kernels_match_the_cpu") else { return };
    // Written with explicitly rounded intrinsics: expected to match bit for bit; the f32
    // tolerance is the check, the printed worst error shows whether it is exact.
    check("optimizer_kernels", DType::F32, optimizer_kernels(&Cpu), optimizer_kernels(&cuda));
}

/// Per step: the loss, whether it was skipped, the scale and the gradient norm (before
/// clipping), for 20 AMP steps of the small GPT in precision `L` with AdamW.
fn gpt_steps<L: Precision, K: amp_core::scaler::LossScaler, D: Device>(
    model: &mut Gpt<f32, D>,
    scaler: &mut K,
) -> Outputs {
    let mut opt = amp_core::optim::AdamW::new(3e-3).weight_decay(0.1).build().unwrap();
    let (mut losses, mut skipped, mut scales, mut norms) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..20 {
        let ids = Indices::from_vec((0..32).map(|j| ((i as i64 + j) * 7) % 29).collect(), &[4, 8]);
        let targets = Indices::from_vec((0..32).map(|j| ((i as i64 + j) * 3 + 1) % 29).collect(), &[4, 8]);
        let loss = model.loss::<L>(&ids, &targets, &mut Rng::seed(i as u64));
        losses.push(loss.item() as f64);
        let mut grads = scaler.scale(loss).backward().unscale();
        norms.push(grads.clip_grad_norm(1.0).get() as f64);
        let report = grads.step(&mut opt, model).update().unwrap();
        skipped.push(report.skipped.get() as u8 as f64);
        scales.push(report.scale.get() as f64);
    }
    // A skipped step's norm is inf or NaN on both devices; compare the finite ones.
    let norms = norms.into_iter().map(|n| if n.is_finite() { n } else { -1.0 }).collect();
    vec![("loss".into(), losses), ("skipped".into(), skipped), ("scale".into(), scales), ("grad_norm".into(), norms)]
}

#[test]
fn twenty_gpt_steps_match_the_cpu_in_f16_with_a_grad_scaler_and_in_bf16() {
    let Some(cuda) = cuda_or_skip("twenty_gpt_steps_match_the_cpu_in_f16_with_a_grad_scaler_and_in_bf16") else {
        return;
    };
    let config = GptConfig { vocab_size: 29, block_size: 8, d_model: 32, n_layers: 2, n_heads: 4, dropout: 0.1 };
    let init = Gpt::new(config, &mut Rng::seed(3));
    let scaler = || {
        amp_core::scaler::GradScaler::with_options(amp_core::scaler::GradScalerOptions {
            init_scale: 2f32.powi(20),
            ..Default::default()
        })
        .unwrap()
    };
    let (mut cpu, mut gpu): (Gpt, Gpt<f32, Cuda>) = (init.clone(), init.to_device(&cuda));
    let on_cpu = gpt_steps::<f16, _, _>(&mut cpu, &mut scaler());
    let on_gpu = gpt_steps::<f16, _, _>(&mut gpu, &mut scaler());
    // The trajectories drift apart slowly (different rounding each step): losses and norms
    // within the f16 tolerance, and the same steps skipped.
    assert_eq!(on_cpu[1], on_gpu[1], "the same steps are skipped");
    check("gpt_f16_grad_scaler", DType::F16, on_cpu, on_gpu);
    let (mut cpu, mut gpu): (Gpt, Gpt<f32, Cuda>) = (init.clone(), init.to_device(&cuda));
    let ns = amp_core::scaler::NoScale::new;
    check(
        "gpt_bf16",
        DType::BF16,
        gpt_steps::<bf16, _, _>(&mut cpu, &mut ns()),
        gpt_steps::<bf16, _, _>(&mut gpu, &mut ns()),
    );
}

#[test]
fn twenty_gpt_steps_with_fused_attention_match_the_cpu_in_bf16() {
    let Some(cuda) = cuda_or_skip("twenty_gpt_steps_with_fused_attention_match_the_cpu_in_bf16") else { return };
    // Dropout 0: the fused kernel has no attention dropout. Heads of 8 values take the cuBLAS
    // path; one head of 32 the tensor-core kernels (attention_flash.cu).
    for (heads, name) in [(4, "gpt_bf16_fused_attention"), (1, "gpt_bf16_fused_attention_tensor_cores")] {
        let config =
            GptConfig { vocab_size: 29, block_size: 8, d_model: 32, n_layers: 2, n_heads: heads, dropout: 0.0 };
        let init = Gpt::new(config, &mut Rng::seed(3)).with_fused_attention(true).unwrap();
        let (mut cpu, mut gpu): (Gpt, Gpt<f32, Cuda>) = (init.clone(), init.to_device(&cuda));
        let ns = amp_core::scaler::NoScale::new;
        check(
            name,
            DType::BF16,
            gpt_steps::<bf16, _, _>(&mut cpu, &mut ns()),
            gpt_steps::<bf16, _, _>(&mut gpu, &mut ns()),
        );
    }
}
