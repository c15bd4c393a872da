//! The main job: train a small GPT with mixed precision on the embedded addition task (or a
//! user's text file), with progress, metrics, a plot, checkpoints and exact resume.
//!
//! Design notes:
//! - The compute precision `L` and the loss scaler are types: f16 trains with a
//!   [`GradScaler`], bf16 and f32 with [`NoScale`]; [`run`] picks the instantiation once from
//!   the run-time option.
//! - Everything that makes a step depend on the past (weights, optimizer moments and step
//!   count, scaler scale and tracker, dropout RNG, data-loader position) is in the checkpoint,
//!   so N steps equal N/2 steps + resume + N/2 steps bit for bit.
//! - Non-finite gradients skip the step (the typestate's `step`), and the run goes on; if the
//!   scale collapses to its floor because every step overflows, the run stops with an error
//!   that says so instead of training on with a meaningless scale.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::checkpoint::{self, TrainingState};
use crate::data::{AdditionConfig, AdditionDataset, AdditionTask, CharTextDataset, DataLoader, TokenBatch};
use crate::nn::{Gpt, GptConfig};
use crate::optim::{AdamW, Optim, Optimizer, ParamGroup, WarmupCosine};
use crate::scaler::{GradScaler, GradScalerOptions, LossScaler, NoScale};
use crate::train_utils::{MetricsRow, MetricsWriter, Progress, format_table, plot_metrics};
use crate::{Error, Indices, Params, Precision, Result, Rng, Tensor, bf16, f16, no_grad};

/// The compute precision of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RunPrecision {
    /// Plain f32 training.
    F32,
    /// f16 autocast with dynamic loss scaling.
    F16,
    /// bf16 autocast (no loss scaling needed).
    Bf16,
}

/// Model sizes offered on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ModelSize {
    /// d 64, 2 layers, 4 heads.
    Tiny,
    /// d 128, 2 layers, 4 heads (the default).
    Small,
    /// d 256, 4 layers, 4 heads (W2's width).
    Medium,
}

impl ModelSize {
    fn dims(self) -> (usize, usize, usize) {
        match self {
            ModelSize::Tiny => (64, 2, 4),
            ModelSize::Small => (128, 2, 4),
            ModelSize::Medium => (256, 4, 4),
        }
    }
}

/// Everything a run is configured by.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainConfig {
    /// Compute precision.
    pub precision: RunPrecision,
    /// Optimizer steps in total (including those before a resume).
    pub steps: u64,
    /// Sequences per batch.
    pub batch_size: usize,
    /// Model size.
    pub model: ModelSize,
    /// Peak learning rate (AdamW, warmup then cosine).
    pub lr: f64,
    /// Seed of initialisation, data order and dropout.
    pub seed: u64,
    /// Train a character-level model on this text file instead of the addition task.
    pub data: Option<PathBuf>,
    /// Digits per operand of the addition task.
    pub digits: usize,
    /// Where metrics, plot and checkpoints go.
    pub out_dir: PathBuf,
    /// Continue from the checkpoint in `out_dir`.
    pub resume: bool,
    /// Save a checkpoint every this many steps (and at the end).
    pub checkpoint_every: u64,
    /// Dropout probability.
    pub dropout: f64,
    /// Clip the global gradient norm to this.
    pub clip_norm: f32,
    /// Stop with an error when the loss scale would fall below this (every step overflowing).
    pub min_scale: f32,
    /// Draw the progress bar.
    pub progress: bool,
    /// Steps (1-based) whose loss is made NaN, to exercise overflow handling.
    pub inject_nonfinite: Vec<u64>,
    /// Stop after this step even if `steps` is larger (to simulate an interrupted run).
    pub stop_after: Option<u64>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            precision: RunPrecision::F16,
            steps: 1500,
            batch_size: 64,
            model: ModelSize::Small,
            lr: 3e-3,
            seed: 0,
            data: None,
            digits: 2,
            out_dir: PathBuf::from("runs/train"),
            resume: false,
            checkpoint_every: 400,
            dropout: 0.0,
            clip_norm: 1.0,
            min_scale: 1.0,
            progress: true,
            inject_nonfinite: Vec::new(),
            stop_after: None,
        }
    }
}

impl TrainConfig {
    /// Refuses settings that cannot make a run, naming the option.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, detail: String| Err(Error::InvalidArgument { op: "train", name, detail });
        if self.steps == 0 {
            return bad("steps", "must be at least 1".into());
        }
        if self.batch_size == 0 {
            return bad("batch-size", "must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", format!("must be a positive number, got {}", self.lr));
        }
        if !(1..=6).contains(&self.digits) {
            return bad("digits", format!("must be between 1 and 6, got {}", self.digits));
        }
        if self.checkpoint_every == 0 {
            return bad("checkpoint-every", "must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("dropout", format!("must be in [0, 1), got {}", self.dropout));
        }
        if !(self.clip_norm.is_finite() && self.clip_norm > 0.0) {
            return bad("clip-norm", format!("must be a positive number, got {}", self.clip_norm));
        }
        if !(self.min_scale.is_finite() && self.min_scale > 0.0) {
            return bad("min-scale", format!("must be a positive number, got {}", self.min_scale));
        }
        Ok(())
    }
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// Steps taken in total.
    pub steps: u64,
    /// Mean loss of the first 20 steps of this invocation (NaN if none).
    pub first_loss: f64,
    /// Mean loss of the last 20 steps.
    pub last_loss: f64,
    /// Steps skipped because of non-finite gradients (this invocation).
    pub skipped: u64,
    /// Loss scale at the end.
    pub final_scale: f32,
    /// Held-out exact-match accuracy (addition) or `None` (text).
    pub accuracy: Option<f64>,
    /// Held-out loss (text) or `None`.
    pub val_loss: Option<f64>,
    /// Training tokens per second.
    pub tokens_per_s: f64,
    /// Metrics CSV.
    pub metrics: PathBuf,
    /// Loss and scale plot.
    pub plot: PathBuf,
    /// Checkpoint directory.
    pub checkpoint: PathBuf,
    /// Final weights with a fixed name (safetensors, PyTorch names).
    pub weights: PathBuf,
}

// ---- scalers, chosen by type ----------------------------------------------------------------

/// How a run's scaler is made and checkpointed.
trait RunScaler: LossScaler + Sized {
    fn make(min_scale: f32) -> Result<Self>;
    fn save(&self) -> serde_json::Value;
    fn load(&mut self, v: &serde_json::Value) -> Result<()>;
}

impl RunScaler for GradScaler {
    fn make(min_scale: f32) -> Result<Self> {
        GradScaler::with_options(GradScalerOptions {
            min_scale: Some(min_scale),
            error_at_min_scale: true,
            ..Default::default()
        })
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(self.state_dict()).expect("scaler state serialises")
    }
    fn load(&mut self, v: &serde_json::Value) -> Result<()> {
        let state = serde_json::from_value(v.clone())
            .map_err(|e| Error::State { context: "checkpoint scaler state".into(), detail: e.to_string() })?;
        self.load_state_dict(&state)
    }
}

impl RunScaler for NoScale {
    fn make(_: f32) -> Result<Self> {
        Ok(NoScale)
    }
    fn save(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn load(&mut self, _: &serde_json::Value) -> Result<()> {
        Ok(())
    }
}

// ---- tasks ----------------------------------------------------------------------------------

enum Task {
    Addition { task: AdditionTask, loader: DataLoader<AdditionDataset> },
    Text { loader: DataLoader<CharTextDataset>, val: CharTextDataset },
}

impl Task {
    fn new(cfg: &TrainConfig) -> Result<Self> {
        match &cfg.data {
            None => {
                let task = AdditionTask::new(AdditionConfig {
                    digits: cfg.digits,
                    seed: cfg.seed,
                    ..AdditionConfig::default()
                })?;
                let loader = DataLoader::new(task.train_set(), cfg.batch_size, cfg.seed)?;
                Ok(Task::Addition { task, loader })
            }
            Some(path) => {
                let ds = CharTextDataset::from_file(path, 64)?;
                let (train, val) = ds.split(0.1)?;
                let loader = DataLoader::new(train, cfg.batch_size, cfg.seed)?;
                Ok(Task::Text { loader, val })
            }
        }
    }
    fn vocab_size(&self) -> usize {
        match self {
            Task::Addition { task, .. } => task.vocab_size(),
            Task::Text { val, .. } => val.vocab().len(),
        }
    }
    fn block_size(&self) -> usize {
        match self {
            Task::Addition { task, .. } => task.seq_len(),
            Task::Text { val, .. } => val.block_size(),
        }
    }
    fn next_batch(&mut self) -> Result<TokenBatch> {
        match self {
            Task::Addition { loader, .. } => loader.next_token_batch(),
            Task::Text { loader, .. } => loader.next_token_batch(),
        }
    }
    fn position(&self) -> crate::data::LoaderPosition {
        match self {
            Task::Addition { loader, .. } => loader.position(),
            Task::Text { loader, .. } => loader.position(),
        }
    }
    fn restore(&mut self, p: &crate::data::LoaderPosition) -> Result<()> {
        match self {
            Task::Addition { loader, .. } => loader.restore(p),
            Task::Text { loader, .. } => loader.restore(p),
        }
    }
    fn name(&self) -> String {
        match self {
            Task::Addition { task, .. } => format!("{}-digit addition", task.config().digits),
            Task::Text { val, .. } => format!("character LM on {}", val.source()),
        }
    }
}

/// Greedy decoding of `n` tokens after `prompts: [B, P]`.
fn greedy<L: Precision>(model: &Gpt, prompts: &Indices, n: usize) -> Result<Indices> {
    let (b, p) = (prompts.shape()[0], prompts.shape()[1]);
    let mut seqs: Vec<Vec<i64>> = prompts.as_slice().chunks(p).map(|r| r.to_vec()).collect();
    let mut rng = Rng::seed(0); // unused in eval mode
    for _ in 0..n {
        let t = seqs[0].len();
        let ids = Indices::try_from_vec(seqs.concat(), &[b, t])?;
        let logits = model.forward::<L>(&ids, &mut rng).narrow(1, t - 1, 1).reshape(&[b, model.config.vocab_size]);
        let next = logits.argmax(1, false);
        for (s, &tok) in seqs.iter_mut().zip(next.as_slice()) {
            s.push(tok);
        }
    }
    let out: Vec<i64> = seqs.iter().flat_map(|s| s[p..].to_vec()).collect();
    Indices::try_from_vec(out, &[b, n])
}

// ---- the run --------------------------------------------------------------------------------

/// Trains as `cfg` says, printing progress to stderr, and returns the report.
pub fn run(cfg: &TrainConfig) -> Result<TrainReport> {
    cfg.validate()?;
    match cfg.precision {
        RunPrecision::F32 => train::<f32, NoScale>(cfg),
        RunPrecision::Bf16 => train::<bf16, NoScale>(cfg),
        RunPrecision::F16 => train::<f16, GradScaler>(cfg),
    }
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), detail: e.to_string() }
}

fn train<L: Precision, K: RunScaler>(cfg: &TrainConfig) -> Result<TrainReport> {
    std::fs::create_dir_all(&cfg.out_dir).map_err(|e| io(&cfg.out_dir, e))?;
    let ckpt_dir = cfg.out_dir.join("checkpoint");
    let metrics_path = cfg.out_dir.join("metrics.csv");
    let plot_path = cfg.out_dir.join("loss.png");

    let mut task = Task::new(cfg)?;
    let (d, n_layers, n_heads) = cfg.model.dims();
    let model_cfg = GptConfig {
        vocab_size: task.vocab_size(),
        block_size: task.block_size(),
        d_model: d,
        n_layers,
        n_heads,
        dropout: cfg.dropout,
    };
    let mut init_rng = Rng::seed(cfg.seed);
    let mut model = Gpt::try_new(model_cfg.clone(), &mut init_rng)?;
    let mut opt = Optim::new(AdamW::new(cfg.lr).weight_decay(0.1))?
        .with_group(ParamGroup::new("no_decay", |n| n.ends_with("bias") || n.contains("ln")).weight_decay(0.0))
        .with_schedule(WarmupCosine::with_min(cfg.steps.min(100), cfg.steps, 0.1)?);
    let mut scaler = K::make(cfg.min_scale)?;
    let mut rng = Rng::seed(cfg.seed ^ 0x5EED);
    // What must match for a checkpoint to continue this run.
    let identity = serde_json::json!({
        "model": model_cfg, "precision": cfg.precision, "steps": cfg.steps, "lr": cfg.lr,
        "batch_size": cfg.batch_size, "task": task.name(), "seed": cfg.seed,
    });

    let mut start = 0;
    if cfg.resume {
        if !checkpoint::checkpoint_exists(&ckpt_dir) {
            return Err(Error::State {
                context: ckpt_dir.display().to_string(),
                detail: "--resume given but there is no checkpoint here".into(),
            });
        }
        let state = checkpoint::load_checkpoint(&ckpt_dir, &mut model)?;
        if state.extra != identity {
            return Err(Error::State {
                context: ckpt_dir.display().to_string(),
                detail: format!(
                    "the checkpoint belongs to a different run configuration:\n  checkpoint: {}\n  this run:   {}",
                    state.extra, identity
                ),
            });
        }
        let bad = |what: &str, e: String| Error::State {
            context: ckpt_dir.display().to_string(),
            detail: format!("{what}: {e}"),
        };
        opt.load_state_dict(
            serde_json::from_value(state.optimizer.clone()).map_err(|e| bad("optimizer state", e.to_string()))?,
        )?;
        scaler.load(&state.scaler)?;
        rng = state.rng.clone().ok_or_else(|| bad("rng", "missing".into()))?;
        task.restore(state.loader.as_ref().ok_or_else(|| bad("data loader position", "missing".into()))?)?;
        start = state.step;
    }
    let mut metrics =
        if start > 0 { MetricsWriter::resume(&metrics_path, start)? } else { MetricsWriter::create(&metrics_path)? };

    let end = cfg.stop_after.map_or(cfg.steps, |s| s.min(cfg.steps));
    let progress = if cfg.progress { Progress::new(cfg.steps, start) } else { Progress::hidden(cfg.steps, start) };
    progress.println(format!(
        "training a {}-parameter GPT (d {d}, {n_layers} layers, {n_heads} heads) on {} in {} {}, steps {}..={}",
        model.num_params(),
        task.name(),
        L::DTYPE,
        if L::DTYPE == crate::DType::F16 { "with dynamic loss scaling" } else { "without loss scaling" },
        start + 1,
        end
    ));
    model.train();
    let t0 = Instant::now();
    let (mut tokens, mut skipped) = (0usize, 0u64);
    let mut losses = Vec::new();
    let save = |model: &Gpt, opt: &Optim<AdamW>, scaler: &K, rng: &Rng, task: &Task, step: u64| -> Result<()> {
        let state = TrainingState {
            step,
            loader: Some(task.position()),
            rng: Some(rng.clone()),
            optimizer: serde_json::to_value(opt.state_dict())
                .map_err(|e| Error::State { context: "optimizer state".into(), detail: e.to_string() })?,
            scaler: scaler.save(),
            extra: identity.clone(),
        };
        checkpoint::save_checkpoint(&ckpt_dir, model, &state).map(|_| ())
    };
    for step in start + 1..=end {
        let batch = task.next_batch()?;
        let mut loss = model.loss::<L>(&batch.inputs, &batch.targets, &mut rng);
        if cfg.inject_nonfinite.contains(&step) {
            loss = loss.mul(&Tensor::scalar(f64::NAN));
        }
        let lr = opt.lr_at(opt.steps());
        let loss_value = loss.item() as f64;
        // The loss moves into the step: its graph is freed by `backward`, so `step` updates the
        // parameters in place instead of copying them.
        let mut grads = scaler.scale(loss).backward().unscale();
        let grad_norm = grads.clip_grad_norm(cfg.clip_norm);
        let report = grads.step(&mut opt, &mut model).update().map_err(|e| Error::State {
            context: format!("training stopped at step {step}"),
            detail: format!(
                "{e}. The loss scale collapsed because the gradients overflowed at every step: \
                 check the data for NaN/inf, lower the learning rate (now {}), or train in bf16 \
                 (--precision bf16), which needs no loss scaling",
                cfg.lr
            ),
        })?;
        tokens += batch.inputs.numel();
        skipped += report.skipped as u64;
        losses.push(loss_value);
        let row = MetricsRow {
            step,
            loss: loss_value,
            scale: report.scale_used as f64,
            skipped: report.skipped,
            grad_norm: grad_norm as f64,
            lr,
            time_s: t0.elapsed().as_secs_f64(),
        };
        metrics.write(&row)?;
        progress.update(&row, skipped, tokens as f64 / t0.elapsed().as_secs_f64());
        if report.skipped {
            progress.println(format!("step {step}: non-finite gradients, step skipped, scale now {}", report.scale));
        }
        if step % cfg.checkpoint_every == 0 || step == end {
            save(&model, &opt, &scaler, &rng, &task, step)?;
        }
    }
    progress.finish();
    metrics.flush()?;
    let elapsed = t0.elapsed().as_secs_f64();
    plot_metrics(&plot_path, metrics.rows(), &format!("GPT on {} ({})", task.name(), L::DTYPE))?;
    let weights = cfg.out_dir.join("model.safetensors");
    checkpoint::save_weights(&weights, &model)?;

    model.eval();
    let (accuracy, val_loss) = match &task {
        Task::Addition { task, .. } => {
            let acc =
                no_grad(|| task.exact_match_accuracy(&task.test_set(), 250, None, |p, n| greedy::<L>(&model, p, n)))?;
            (Some(acc.fraction()), None)
        }
        Task::Text { val, .. } => {
            let mut loader = DataLoader::new(val.clone(), cfg.batch_size, 0)?.shuffle(false);
            let batches = loader.batches_per_epoch().min(10);
            let mut total = 0.0;
            for _ in 0..batches {
                let b = loader.next_token_batch()?;
                total += no_grad(|| model.loss::<L>(&b.inputs, &b.targets, &mut rng)).item() as f64;
            }
            (None, Some(total / batches.max(1) as f64))
        }
    };
    let mean = |v: &[f64]| if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 };
    let finite: Vec<f64> = losses.iter().copied().filter(|l| l.is_finite()).collect();
    let kf = finite.len().min(20);
    Ok(TrainReport {
        steps: end,
        first_loss: mean(&finite[..kf]),
        last_loss: mean(&finite[finite.len() - kf..]),
        skipped,
        final_scale: scaler.get_scale(),
        accuracy,
        val_loss,
        tokens_per_s: tokens as f64 / elapsed,
        metrics: metrics_path,
        plot: plot_path,
        checkpoint: ckpt_dir,
        weights,
    })
}

/// The end-of-run summary as a table.
pub fn summary(cfg: &TrainConfig, r: &TrainReport) -> String {
    let mut rows = vec![
        vec!["precision".into(), format!("{:?}", cfg.precision).to_lowercase()],
        vec!["steps".into(), r.steps.to_string()],
        vec!["loss (first 20 steps)".into(), format!("{:.4}", r.first_loss)],
        vec!["loss (last 20 steps)".into(), format!("{:.4}", r.last_loss)],
        vec!["skipped steps".into(), r.skipped.to_string()],
        vec!["final loss scale".into(), format!("{}", r.final_scale)],
        vec!["tokens/s".into(), format!("{:.0}", r.tokens_per_s)],
    ];
    if let Some(a) = r.accuracy {
        rows.push(vec!["held-out accuracy".into(), format!("{:.1}%", 100.0 * a)]);
    }
    if let Some(v) = r.val_loss {
        rows.push(vec!["held-out loss".into(), format!("{v:.4}")]);
    }
    format_table(&["", "value"], &rows)
}
