//! The README's snippets ("library in one screen", key-mapped loading, "pure bf16 training"),
//! compiled and run.

use std::path::Path;

use amp::checkpoint::{LoadReport, TensorFile, save_tensors};
use amp::nn::{Gpt, GptConfig, Linear};
use amp::prelude::*;

#[derive(Params)] // PyTorch state_dict names: fc1.weight, fc1.bias, ...
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    // Under #[autocast] (f16 by default): linear runs in f16 with f32 accumulation,
    // cross_entropy gets f32 inputs, the loss comes out f32.
    #[autocast]
    fn loss(&self, x: &Tensor<f32>, y: &Indices) -> Tensor<f32> {
        let h = x.linear(&self.fc1.weight, self.fc1.bias.as_ref()).gelu();
        h.linear(&self.fc2.weight, self.fc2.bias.as_ref()).cross_entropy(y)
    }
}

// `opt` is `AdamW::new(3e-4).weight_decay(0.1).build()?` (an `Optim<AdamW>`; a schedule:
// `.with_schedule(WarmupCosine::new(warmup, total)?)`, parameter groups: `.with_group(..)`).
fn train_step(model: &mut Mlp, opt: &mut Optim<AdamW>, scaler: &mut GradScaler, x: &Tensor<f32>, y: &Indices) {
    let loss = model.loss(x, y);
    let mut grads = scaler.scale(loss).backward().unscale(); // one fused pass: ×(1/S) and inf check
    grads.clip_grad_norm(1.0); // only exists on unscaled gradients
    let report = grads.step(opt, model).update().unwrap(); // skipped on overflow; S adapts
    let _ = report.skipped;
}

#[test]
fn readme_snippet_trains() {
    let mut rng = Rng::seed(0);
    let mut model = Mlp { fc1: Linear::new(8, 32, true, &mut rng), fc2: Linear::new(32, 3, true, &mut rng) };
    let names: Vec<String> = model.named_params().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
    let x = Tensor::<f32>::randn(&[64, 8], &mut rng);
    // A learnable labelling: the argmax of three fixed projections of x.
    let y = x.matmul(&Tensor::<f32>::randn(&[8, 3], &mut rng)).argmax(1, false);
    let mut opt = AdamW::new(1e-2).build().unwrap();
    let mut scaler = GradScaler::new();
    let before = model.loss(&x, &y).item();
    for _ in 0..100 {
        train_step(&mut model, &mut opt, &mut scaler, &x, &y);
    }
    let after = model.loss(&x, &y).item();
    assert!(after < 0.5 * before, "loss {before} -> {after}");
    assert_eq!(model.loss(&x, &y).dtype(), DType::F32);
}

/// The README's loading snippet, as it is there.
fn load_export(mut model: Mlp, export: &Path, train: &Path) -> amp::Result<(Mlp, LoadReport, Tensor<f32>, Indices)> {
    use amp::checkpoint::{LoadOptions, load_weights_with, read_tensors};

    // Strip the wrapper's prefix, rename whole name components, drop buffers; load what matches
    // and report the rest. Strict (the default) refuses any missing or unexpected tensor.
    let opts = LoadOptions::new()
        .strict(false)
        .strip_prefix("module.")
        .rename("fc_in", "fc1")
        .map_keys(|name| (!name.ends_with(".mask")).then(|| name.to_string()));
    let report = load_weights_with(export, &mut model, &opts)?;
    println!("{report}"); // loaded 3 tensors; missing 1 (`fc2.bias`); unexpected 1 (`module.extra`); dropped 1 (..)

    // Data and labels: f32 tensors, and integer ones (int64, int32, uint8, bool) as Indices.
    let data = read_tensors(train)?;
    let (x, y) = (data.tensor("x")?, data.indices("y")?);
    Ok((model, report, x, y))
}

#[test]
fn readme_loading_snippet_runs() {
    let dir = std::env::temp_dir().join(format!("amp-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Rng::seed(1);
    // A PyTorch-style export: other names, a prefix, a mask buffer, an extra tensor, no fc2.bias.
    let (w1, b1, w2) =
        (Tensor::<f32>::randn(&[32, 8], &mut rng), Tensor::randn(&[32], &mut rng), Tensor::randn(&[3, 32], &mut rng));
    let mut file = TensorFile::new();
    file.insert("module.fc_in.weight", &w1);
    file.insert("module.fc_in.bias", &b1);
    file.insert("module.fc2.weight", &w2);
    file.insert("module.extra", Tensor::<f32>::zeros(&[2]));
    file.insert("module.attn.mask", Indices::from_vec(vec![0, 1, 0, 0], &[2, 2]));
    let export = dir.join("export.safetensors");
    save_tensors(&export, &file).unwrap();
    let mut data = TensorFile::new();
    data.insert("x", Tensor::<f32>::randn(&[4, 8], &mut rng));
    data.insert("y", Indices::from_vec(vec![0, 2, 1, 2], &[4]));
    let train = dir.join("train.safetensors");
    save_tensors(&train, &data).unwrap();

    let model = Mlp { fc1: Linear::new(8, 32, true, &mut rng), fc2: Linear::new(32, 3, true, &mut rng) };
    let bias_before = model.fc2.bias.as_ref().unwrap().to_vec();
    let (model, report, x, y) = load_export(model, &export, &train).unwrap();
    assert_eq!(
        report.to_string(),
        "loaded 3 tensors; missing 1 (`fc2.bias`); unexpected 1 (`module.extra`); dropped 1 (`module.attn.mask`)"
    );
    assert_eq!(model.fc1.weight.to_vec(), w1.to_vec());
    assert_eq!(model.fc1.bias.as_ref().unwrap().to_vec(), b1.to_vec());
    assert_eq!(model.fc2.weight.to_vec(), w2.to_vec());
    assert_eq!(model.fc2.bias.as_ref().unwrap().to_vec(), bias_before);
    assert_eq!((x.shape(), y.as_slice()), (&[4, 8][..], &[0, 2, 1, 2][..]));
    let _ = std::fs::remove_dir_all(&dir);
}

// bf16 weights from the f32 initialisation, rounded once; no f32 copy is kept. AdamW keeps its
// moments in f32 and writes each update back to bf16 with Kahan compensation.
fn pure_bf16(config: GptConfig, rng: &mut Rng) -> (Gpt<bf16>, Optim<AdamW, bf16>) {
    let model = Gpt::new(config, rng).to_precision::<bf16>();
    let opt = AdamW::new(3e-3).weight_decay(0.1).build().unwrap().for_bf16(Bf16Rounding::Kahan);
    (model, opt)
}

fn bf16_train_step(model: &mut Gpt<bf16>, opt: &mut Optim<AdamW, bf16>, ids: &Indices, targets: &Indices) -> f32 {
    let loss = model.loss::<bf16>(ids, targets, &mut Rng::seed(0)); // bf16 compute, f32 loss
    let value = loss.item();
    let mut scaler = NoScale; // bf16 has f32's exponent range: no loss scale
    let mut grads = scaler.scale(loss).backward().unscale(); // bf16 gradients
    grads.clip_grad_norm(1.0);
    grads.step(opt, model).update().unwrap(); // widen, f32 AdamW update, Kahan write-back
    value
}

#[test]
fn readme_pure_bf16_snippet_trains() {
    let config = GptConfig { vocab_size: 10, block_size: 8, d_model: 32, n_layers: 1, n_heads: 2, dropout: 0.0 };
    let (mut model, mut opt) = pure_bf16(config, &mut Rng::seed(0));
    // Learn to copy a fixed sequence shifted by one.
    let seq: Vec<i64> = (0..9).map(|i| (i * 7 + 3) % 10).collect();
    let ids = Indices::from_vec(seq[..8].to_vec(), &[1, 8]);
    let targets = Indices::from_vec(seq[1..].to_vec(), &[1, 8]);
    let first = bf16_train_step(&mut model, &mut opt, &ids, &targets);
    let mut last = first;
    for _ in 0..60 {
        last = bf16_train_step(&mut model, &mut opt, &ids, &targets);
    }
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    assert!(model.named_params().iter().all(|(_, p)| p.dtype() == DType::BF16));
}
