//! The README's snippets ("library in one screen", "pure bf16 training"), compiled and run.

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
