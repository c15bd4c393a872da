//! A small ResNet-style CNN trained with mixed precision on the generated shapes task
//! (`amp::data::ShapesTask`: discs, squares, triangles and crosses rendered from a seed, so
//! nothing is downloaded), first in f16 with a `GradScaler`, then in bf16 with no scaler.
//!
//! The model's forward is written once, `#[autocast(P)]` over the compute precision: the
//! convolutions and the head run in `P` with f32 accumulation, batch norm keeps f32 statistics
//! and f32 running buffers, the residual additions and the loss are f32. Batch norm normalises
//! with batch statistics in training and with its running statistics in evaluation
//! (`model.eval()`), which is how the held-out accuracy is measured.
//!
//! Run: `cargo run --release --example cnn [-- --epochs N]`.

use amp::Conv2dOptions;
use amp::data::{DataLoader, ShapesConfig, ShapesTask};
use amp::nn::{AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Linear};
use amp::optim::{AdamW, Optim, WarmupCosine};
use amp::scaler::{GradScaler, LossScaler, NoScale};
use amp::{Indices, Params, Precision, Promote, Rng, Tensor, autocast, bf16, f16, no_grad};

const BATCH: usize = 64;

/// A compute precision with the promotions `#[autocast(P)]` bodies use (f16, bf16 and f32 all
/// have them); a generic caller of an `#[autocast(P)]` function that promotes states them.
trait Promotes: Precision + Promote<f32, Output = f32> + Promote<Self, Output = Self> {}
impl<P: Precision + Promote<f32, Output = f32> + Promote<P, Output = P>> Promotes for P {}

/// `relu(x + bn(conv(relu(bn(conv(x))))))`, the residual stream in f32.
#[derive(Params)]
struct ResBlock {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    conv2: Conv2d,
    bn2: BatchNorm2d,
}

impl ResBlock {
    fn new(channels: usize, rng: &mut Rng) -> Self {
        let same = Conv2dOptions { padding: (1, 1), ..Default::default() };
        ResBlock {
            conv1: Conv2d::new(channels, channels, 3, same, false, rng),
            bn1: BatchNorm2d::new(channels),
            conv2: Conv2d::new(channels, channels, 3, same, false, rng),
            bn2: BatchNorm2d::new(channels),
        }
    }

    #[autocast(P)]
    fn forward<P: Precision>(&mut self, x: &Tensor<f32>) -> Tensor<f32> {
        let c = self.conv1.forward(x);
        let h = self.bn1.forward(&c).relu();
        let c = self.conv2.forward(&h);
        let h = self.bn2.forward(&c);
        x.add_cast(&h).relu()
    }
}

/// Stem, a residual block at 16 channels, a strided convolution to 32, another block, global
/// average pooling and a linear head: 4 classes.
#[derive(Params)]
struct Cnn {
    stem: Conv2d,
    bn_stem: BatchNorm2d,
    block1: ResBlock,
    down: Conv2d,
    bn_down: BatchNorm2d,
    block2: ResBlock,
    pool: AdaptiveAvgPool2d, // a module with no parameters, as Dropout: no `skip` needed
    head: Linear,
}

impl Cnn {
    fn new(classes: usize, rng: &mut Rng) -> Self {
        let same = Conv2dOptions { padding: (1, 1), ..Default::default() };
        let halve = Conv2dOptions { stride: (2, 2), padding: (1, 1), ..Default::default() };
        Cnn {
            stem: Conv2d::new(1, 16, 3, same, false, rng),
            bn_stem: BatchNorm2d::new(16),
            block1: ResBlock::new(16, rng),
            down: Conv2d::new(16, 32, 3, halve, false, rng),
            bn_down: BatchNorm2d::new(32),
            block2: ResBlock::new(32, rng),
            pool: AdaptiveAvgPool2d::new((1, 1)),
            head: Linear::new(32, classes, true, rng),
        }
    }

    /// Logits `[N, classes]` in f32 for images `[N, 1, H, W]`.
    #[autocast(P)]
    fn forward<P>(&mut self, x: &Tensor<f32>) -> Tensor<f32>
    where
        P: Promotes,
        f32: Promote<P, Output = f32>,
    {
        let n = x.shape()[0];
        let c = self.stem.forward(x);
        let h = self.bn_stem.forward(&c).relu().cast::<f32>();
        let h = self.block1.forward::<P>(&h);
        let c = self.down.forward(&h);
        let h = self.bn_down.forward(&c).relu().cast::<f32>();
        let h = self.block2.forward::<P>(&h);
        let h = self.pool.forward(&h).reshape(&[n, 32]);
        self.head.forward(&h).cast::<f32>()
    }
}

/// Held-out accuracy in evaluation mode (running statistics, no batch-statistic updates).
fn accuracy<P>(model: &mut Cnn, images: &Tensor<f32>, labels: &Indices) -> f64
where
    P: Promotes,
    f32: Promote<P, Output = f32>,
{
    model.eval();
    let n = images.shape()[0];
    let mut correct = 0;
    for start in (0..n).step_by(256) {
        let len = 256.min(n - start);
        let pred = no_grad(|| model.forward::<P>(&images.narrow(0, start, len).contiguous())).argmax(1, false);
        let truth = &labels.as_slice()[start..start + len];
        correct += pred.as_slice().iter().zip(truth).filter(|(a, b)| a == b).count();
    }
    model.train();
    correct as f64 / n as f64
}

fn run<P, K: LossScaler>(label: &str, task: &ShapesTask, epochs: usize, scaler: &mut K) -> amp::Result<f64>
where
    P: Promotes,
    f32: Promote<P, Output = f32>,
{
    let mut rng = Rng::seed(0);
    let mut model = Cnn::new(task.classes(), &mut rng);
    let steps = (epochs * task.train_set().tensors().0.shape()[0] / BATCH) as u64;
    let mut optimizer: Optim<AdamW> =
        AdamW::new(3e-3).weight_decay(1e-4).build()?.with_schedule(WarmupCosine::with_min(20, steps, 0.05)?);
    let mut loader = DataLoader::new(task.train_set(), BATCH, 1)?;
    let (test_x, test_y) = task.test_set().into_tensors();
    println!("\n{label}: {} parameters, {steps} steps of {BATCH} images", model.num_params());
    println!("epoch | train loss | skipped | loss scale | held-out accuracy | seconds");
    println!("------+------------+---------+------------+-------------------+--------");
    let mut acc = 0.0;
    for epoch in 1..=epochs {
        let start = std::time::Instant::now();
        let (mut loss_sum, mut counted, mut skipped) = (0.0, 0usize, 0usize);
        for batch in loader.epoch_batches() {
            let (x, y) = batch?;
            let loss = model.forward::<P>(&x).cross_entropy(&y);
            let value = loss.item() as f64;
            let mut grads = scaler.scale(loss).backward().unscale();
            grads.clip_grad_norm(5.0);
            let report = grads.step(&mut optimizer, &mut model).update()?;
            if report.skipped {
                skipped += 1;
            } else {
                loss_sum += value;
                counted += 1;
            }
        }
        acc = accuracy::<P>(&mut model, &test_x, &test_y);
        println!(
            "{epoch:>5} | {:>10.4} | {skipped:>7} | {:>10} | {:>16.1}% | {:>6.1}",
            loss_sum / counted.max(1) as f64,
            scaler.get_scale(),
            100.0 * acc,
            start.elapsed().as_secs_f64()
        );
    }
    Ok(acc)
}

/// A small ResNet on the generated shapes task, in f16 + GradScaler, then in bf16.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Passes over the training set, for each precision.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    epochs: u32,
}

fn main() -> amp::Result<()> {
    let epochs = <Args as clap::Parser>::parse().epochs as usize;
    let task = ShapesTask::new(ShapesConfig::default())?;
    let c = task.config();
    println!("shapes task: {} training and {} held-out {}x{} images, 4 classes", c.train, c.test, c.size, c.size);
    let f16_acc = run::<f16, _>("f16 autocast + GradScaler", &task, epochs, &mut GradScaler::new())?;
    let bf16_acc = run::<bf16, _>("bf16 autocast, no scaler", &task, epochs, &mut NoScale)?;
    println!("\nheld-out accuracy: f16 {:.1}%, bf16 {:.1}%", 100.0 * f16_acc, 100.0 * bf16_acc);
    Ok(())
}
