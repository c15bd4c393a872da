//! The seed's `train_one_epoch_amp`, written with amp's typed training step.
//!
//! PyTorch's loop, for reference:
//!
//! ```python
//! def train_one_epoch_amp(model, loader, optimizer, scaler, max_norm=1.0):
//!     for x, y in loader:
//!         optimizer.zero_grad(set_to_none=True)
//!         with torch.autocast("cuda", dtype=torch.float16):
//!             loss = F.cross_entropy(model(x), y)
//!         scaler.scale(loss).backward()
//!         scaler.unscale_(optimizer)
//!         torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
//!         scaler.step(optimizer)
//!         scaler.update()
//! ```
//!
//! Here the same five calls are one chain whose order the compiler checks (clipping before
//! `unscale()` or stepping twice does not compile), `zero_grad` disappears (each backward
//! returns fresh gradients), and the scaler is chosen by the compute precision's type:
//! a dynamic `GradScaler` for f16, the no-op `NoScale` for bf16. A two-layer MLP learns a
//! synthetic 4-class problem; one batch of the third epoch is corrupted with NaN to show that
//! a bad batch is skipped, not written into the weights.
//!
//! Run: `cargo run --release --example seed_loop`.

use amp::optim::{AdamW, Optim, WarmupCosine};
use amp::scaler::{GradScaler, GradScalerOptions, LossScaler, NoScale};
use amp::{Indices, Param, Params, Precision, Rng, Tensor, bf16, f16, no_grad};

const IN: usize = 32;
const HIDDEN: usize = 128;
const CLASSES: usize = 4;
const SAMPLES: usize = 8192;
const BATCH: usize = 128;
const EPOCHS: usize = 6;

/// A linear layer with PyTorch's parameter names (`weight`, `bias`); the weight is stored
/// `[in, out]` so the forward pass is `x @ W + b`.
#[derive(Params)]
struct Linear {
    weight: Param,
    bias: Param,
}

impl Linear {
    fn new(i: usize, o: usize, rng: &mut Rng) -> Self {
        let bound = 1.0 / (i as f64).sqrt();
        let w = Tensor::<f32>::rand(&[i, o], rng).mul_scalar(2.0 * bound).sub_scalar(bound);
        Linear { weight: Param::new(w), bias: Param::new(Tensor::zeros(&[o])) }
    }
    /// `x @ W + b` computed in precision `P` from the f32 master weights (what `#[autocast]`
    /// generates for a matmul: cast the operands, run in P, accumulate in f32 inside).
    fn forward<P: Precision>(&self, x: &Tensor<P>) -> Tensor<P> {
        x.matmul(&self.weight.cast::<P>()).add(&self.bias.cast::<P>())
    }
}

#[derive(Params)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    /// Logits in f32 (the loss is computed in f32, as under autocast).
    fn forward<P: Precision>(&self, x: &Tensor<f32>) -> Tensor<f32> {
        let h = self.fc1.forward(&x.cast::<P>()).relu();
        self.fc2.forward(&h).cast::<f32>()
    }
}

/// A synthetic task: Gaussian inputs labelled by a fixed random "teacher" layer.
struct Data {
    x: Tensor<f32>,
    y: Vec<i64>,
}

fn make_data(rng: &mut Rng) -> Data {
    let x = Tensor::<f32>::randn(&[SAMPLES, IN], rng);
    let teacher = Tensor::<f32>::randn(&[IN, CLASSES], rng);
    let scores = x.matmul(&teacher);
    let y = scores.argmax(1, false).to_vec();
    Data { x, y }
}

fn batch(data: &Data, i: usize) -> (Tensor<f32>, Indices) {
    let x = data.x.narrow(0, i * BATCH, BATCH).contiguous();
    let y = Indices::from_vec(data.y[i * BATCH..(i + 1) * BATCH].to_vec(), &[BATCH]);
    (x, y)
}

struct Epoch {
    loss: f64,
    skipped: usize,
    scale: f32,
    grad_norm: f32,
}

/// `train_one_epoch_amp`: one pass over the batches, each one scaled backward, unscaled,
/// clipped, stepped (or skipped on overflow) and the scale updated.
fn train_one_epoch_amp<P: Precision, K: LossScaler>(
    model: &mut Mlp,
    data: &Data,
    optimizer: &mut Optim<AdamW>,
    scaler: &mut K,
    max_norm: f32,
    corrupt_batch: Option<usize>,
) -> amp::Result<Epoch> {
    let batches = SAMPLES / BATCH;
    let (mut loss_sum, mut counted, mut skipped, mut norm_sum) = (0.0, 0, 0, 0.0f32);
    for i in 0..batches {
        let (mut x, y) = batch(data, i);
        if corrupt_batch == Some(i) {
            // A corrupted input: NaN in one sample, as a bad record in a real loader.
            let mut v = x.to_vec();
            v[0] = f32::NAN;
            x = Tensor::from_vec(v, &[BATCH, IN]);
        }
        let loss = model.forward::<P>(&x).cross_entropy(&y);
        let value = loss.item() as f64;
        let mut grads = scaler.scale(loss).backward().unscale();
        let norm = grads.clip_grad_norm(max_norm);
        let report = grads.step(optimizer, model).update()?;
        if report.skipped {
            skipped += 1;
        } else {
            loss_sum += value;
            counted += 1;
            norm_sum += norm;
        }
    }
    Ok(Epoch {
        loss: loss_sum / counted.max(1) as f64,
        skipped,
        scale: scaler.get_scale(),
        grad_norm: norm_sum / counted.max(1) as f32,
    })
}

fn accuracy<P: Precision>(model: &Mlp, data: &Data) -> f64 {
    no_grad(|| {
        let pred = model.forward::<P>(&data.x).argmax(1, false).to_vec();
        pred.iter().zip(&data.y).filter(|(a, b)| a == b).count() as f64 / SAMPLES as f64
    })
}

fn run<P: Precision, K: LossScaler>(label: &str, scaler: &mut K) -> amp::Result<()> {
    let mut rng = Rng::seed(0);
    let data = make_data(&mut rng);
    let mut model = Mlp { fc1: Linear::new(IN, HIDDEN, &mut rng), fc2: Linear::new(HIDDEN, CLASSES, &mut rng) };
    let steps = (EPOCHS * SAMPLES / BATCH) as u64;
    let mut optimizer = AdamW::new(3e-3).build()?.with_schedule(WarmupCosine::with_min(20, steps, 0.1)?);
    println!("\n{label}: {} parameters, {} steps", model.num_params(), steps);
    println!("epoch | train loss | skipped | loss scale | mean grad norm | accuracy");
    println!("------+------------+---------+------------+----------------+---------");
    for epoch in 1..=EPOCHS {
        let corrupt = (epoch == 3).then_some(10);
        let e = train_one_epoch_amp::<P, K>(&mut model, &data, &mut optimizer, scaler, 1.0, corrupt)?;
        println!(
            "{epoch:>5} | {:>10.4} | {:>7} | {:>10} | {:>14.3} | {:>7.1}%",
            e.loss,
            e.skipped,
            e.scale,
            e.grad_norm,
            100.0 * accuracy::<P>(&model, &data)
        );
    }
    Ok(())
}

fn main() -> amp::Result<()> {
    let start = std::time::Instant::now();
    // f16: a dynamic scaler. PyTorch grows the scale every 2000 good steps; every 25 here, so
    // that this short run shows the whole cycle: the scale grows until the f16 gradients
    // overflow, those steps are skipped, and it backs off.
    let mut scaler = GradScaler::with_options(GradScalerOptions { growth_interval: 25, ..Default::default() })?;
    run::<f16, _>("f16 autocast + GradScaler (growth_interval 25)", &mut scaler)?;
    // bf16: f32's exponent range, no scaling; the NaN batch is still caught and skipped.
    run::<bf16, _>("bf16 autocast, no scaler", &mut NoScale)?;
    println!("\ndone in {:.2?}", start.elapsed());
    Ok(())
}
