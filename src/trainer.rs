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
//! - Non-finite gradients skip the step (the typestate's `step`), and the run goes on; if
//!   [`TrainConfig::collapse_after`] steps in a row are skipped with nothing left to try (f16:
//!   the scale already at its floor; bf16/f32: no scale at all), the run stops with an error
//!   that says so instead of training on with a meaningless scale.
//! - Options that overflow the f32 parameters (a learning rate beyond f32's range) are refused
//!   up front, and after every applied step the parameters and optimizer moments are checked:
//!   a non-finite value stops the run with an error before it reaches a checkpoint.
//! - Metrics rows are fsynced before each checkpoint, so after a crash and `--resume` the
//!   metrics hold exactly one row per step; rows past the checkpoint are dropped and redone.
//! - A run holds a lock file in its output directory (`train.lock`, with its pid; a lock whose
//!   process is gone is stale and taken over), and a fresh run refuses a directory that holds
//!   another run unless told [`TrainConfig::overwrite`].
//! - With [`install_interrupt_handler`], SIGINT/SIGTERM stop the run at the end of the current
//!   step with a checkpoint ([`TrainReport::interrupted`]); a second signal exits at once.
//! - [`run_on`] trains on any [`Device`] (the model, the optimizer state and the loss scale live
//!   there). A step's loss, skipped flag, scale and gradient norm are device values that the
//!   host reads later: on the CPU at once, on a device whose memory is not the host's every
//!   [`READ_EVERY`] steps, before each checkpoint and at the end, so the steps in between are
//!   queued without waiting for the device. The metrics rows are the same either way; the
//!   checks that stop a run (skipped steps in a row, non-finite weights) run at each read.
//! - The device is not part of a run's identity: a checkpoint written on one device resumes on
//!   another.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use serde::de::IgnoredAny;

use crate::backend::HostValue;
use crate::checkpoint::{self, TrainingState};
use crate::data::{
    AdditionConfig, AdditionDataset, AdditionTask, AdditionVocab, CharTextDataset, DataLoader, TokenBatch,
};
use crate::nn::{Gpt, GptConfig, Sampling};
use crate::optim::{AdamState, AdamW, Optim, OptimizerState, ParamGroup, WarmupCosine};
use crate::param::ToDevice;
use crate::scaler::{GradScaler, GradScalerOptions, LossScaler, NoScale, any_non_finite};
use crate::train_utils::{MetricsRow, MetricsWriter, Progress, format_table, plot_metrics};
use crate::{Cpu, Device, Error, Indices, Params, Precision, Result, Rng, bf16, f16, no_grad};

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

/// The most digits per operand of the addition task (the loader's order of all pairs, 8 bytes
/// each, is 0.8 GB at 4 digits and 80 GB at 5).
pub const MAX_DIGITS: usize = 4;

/// The most distinct characters a `--data` text may have (the output layer, and the logits of
/// every batch, grow with the vocabulary).
pub const MAX_TEXT_VOCAB: usize = 1024;

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
    /// Start a fresh run even if `out_dir` holds another run's metrics or checkpoint (they are
    /// deleted). Without it such a directory is refused: `--resume` it or pick another.
    pub overwrite: bool,
    /// Skipped steps in a row after which the run stops as hopeless: with f16, overflows with
    /// the loss scale already at `min_scale` ([`GradScalerOptions::collapse_after`]); with bf16
    /// and f32, any non-finite gradients (there is no scale to lower). Scattered bad batches
    /// below this count are skipped and the run goes on.
    pub collapse_after: u32,
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
            overwrite: false,
            collapse_after: 20,
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
        // Parameters and moments are f32 whatever the compute precision: a rate that f32
        // cannot hold would write inf (or 0) into every weight at the first step.
        let lr32 = self.lr as f32;
        if !(lr32.is_finite() && lr32 > 0.0) {
            return bad(
                "lr",
                format!(
                    "{:e} is outside the range of the f32 parameters ({:e} to {:e}): it would become {lr32} \
                     in the update",
                    self.lr,
                    f32::from_bits(1),
                    f32::MAX
                ),
            );
        }
        if !(1..=MAX_DIGITS).contains(&self.digits) {
            // Checked before anything is allocated: the loader's order is one index per pair.
            let gb = |d: usize| 10f64.powi(2 * d as i32) * std::mem::size_of::<usize>() as f64 / 1e9;
            return bad(
                "digits",
                format!(
                    "must be between 1 and {MAX_DIGITS}, got {}: the data loader keeps a shuffled order of all \
                     10^(2 x digits) operand pairs in memory, {:.1} GB at {MAX_DIGITS} digits{}",
                    self.digits,
                    gb(MAX_DIGITS),
                    if self.digits > MAX_DIGITS && self.digits < 10 {
                        format!(" and {:.0} GB at {}", gb(self.digits), self.digits)
                    } else {
                        String::new()
                    }
                ),
            );
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
        if self.collapse_after == 0 {
            return bad("collapse-after", "must be at least 1".into());
        }
        if self.stop_after == Some(0) {
            return bad("stop-after", "must be at least 1 (steps count from 1)".into());
        }
        // A step the run never takes would inject nothing, silently.
        if let Some(step) = self.inject_nonfinite.iter().find(|&&s| s == 0 || s > self.steps) {
            return bad("inject-nan", format!("step {step} is outside this run's steps 1..={}", self.steps));
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
    /// Text only: [`SAMPLE_CHARS`] characters generated after the held-out text's first
    /// [`SAMPLE_PROMPT_CHARS`] (the prompt included), at temperature [`SAMPLE_TEMPERATURE`],
    /// seeded by the run's seed.
    pub sample: Option<String>,
    /// Training tokens per second.
    pub tokens_per_s: f64,
    /// Metrics CSV.
    pub metrics: PathBuf,
    /// Loss and scale plot.
    pub plot: PathBuf,
    /// Checkpoint directory.
    pub checkpoint: PathBuf,
    /// Final weights with a fixed name (safetensors, PyTorch names); not written when the run
    /// was interrupted.
    pub weights: PathBuf,
    /// The model's [`GptConfig`] as JSON, written with the weights: with them, `Gpt::new` and
    /// `checkpoint::load_weights` rebuild the trained model (Hugging Face's `config.json`).
    pub config: PathBuf,
    /// The token ids' characters as a JSON array (id = index; nanoGPT's `meta.pkl`), written
    /// with the weights, to encode prompts and decode what the model generates.
    pub vocab: PathBuf,
    /// Whether SIGINT/SIGTERM stopped the run early (after `steps`, with a checkpoint there;
    /// no evaluation, no final weights). Continue it with `resume`.
    pub interrupted: bool,
    /// The device it trained on ([`Device::name`]).
    pub device: String,
}

/// How many steps a run on a device whose memory is not the host's queues before the host
/// reads their losses, skipped flags, scales and gradient norms (each read waits for the
/// device). On the CPU they are read at every step.
pub const READ_EVERY: usize = 32;

// ---- interrupts -----------------------------------------------------------------------------

/// SIGINT/SIGTERM received since the handler was installed (or the last run started).
static INTERRUPTS: AtomicU32 = AtomicU32::new(0);

#[cfg(unix)]
extern "C" fn on_interrupt(_signal: libc::c_int) {
    // Only async-signal-safe work here: an atomic add, and `_exit` on the second signal.
    if INTERRUPTS.fetch_add(1, Ordering::SeqCst) >= 1 {
        // SAFETY: `_exit` is async-signal-safe and takes no pointers; it ends the process at
        // once, which is what a second interrupt asks for.
        unsafe { libc::_exit(130) }
    }
}

/// Makes SIGINT (Ctrl-C) and SIGTERM stop a [`run`] at the end of the current step, with a
/// checkpoint, instead of killing the process; a second signal exits at once (status 130).
/// For programs (the `train` example calls it); a library user who handles signals itself
/// need not. A no-op where there are no POSIX signals.
pub fn install_interrupt_handler() -> Result<()> {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let handler: extern "C" fn(libc::c_int) = on_interrupt;
        // SAFETY: `signal` installs a handler that does only async-signal-safe work (see
        // `on_interrupt`); `sig` is a valid signal number.
        let previous = unsafe { libc::signal(sig, handler as libc::sighandler_t) };
        if previous == libc::SIG_ERR {
            return Err(Error::State {
                context: "install_interrupt_handler".into(),
                detail: format!("cannot install a handler for signal {sig}: {}", std::io::Error::last_os_error()),
            });
        }
    }
    Ok(())
}

fn interrupted() -> bool {
    INTERRUPTS.load(Ordering::SeqCst) > 0
}

// ---- the lock on an output directory ---------------------------------------------------------

/// The lock file a run holds in its output directory.
pub const LOCK_FILE: &str = "train.lock";

/// A held `train.lock` (removed on drop). The file holds the owner's pid; it is created whole
/// (written under a temp name, then hard-linked into place, which fails if the lock exists).
struct RunLock {
    path: PathBuf,
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path); // a lock left behind is stale: its pid is gone
    }
}

/// Whether process `pid` is alive (a zombie counts as dead). Where this cannot be told (no
/// `/proc`), every recorded process counts as alive.
fn pid_alive(pid: u32) -> bool {
    let stat = Path::new("/proc").join(pid.to_string()).join("stat");
    match std::fs::read_to_string(&stat) {
        // Field 3, after the parenthesised command name: R, S, D, ... or Z (zombie), X (dead).
        Ok(text) => {
            !matches!(text.rsplit(')').next().map(str::trim_start).and_then(|r| r.chars().next()), Some('Z' | 'X'))
        }
        Err(_) => !Path::new("/proc/self").exists(),
    }
}

fn lock_out_dir(out_dir: &Path) -> Result<RunLock> {
    let path = out_dir.join(LOCK_FILE);
    let tmp = out_dir.join(format!(".{LOCK_FILE}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, format!("{}\n", std::process::id())).map_err(|e| io(&tmp, e))?;
    let result = (|| {
        for _ in 0..3 {
            match std::fs::hard_link(&tmp, &path) {
                Ok(()) => return Ok(RunLock { path: path.clone() }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    match text.trim().parse::<u32>() {
                        Ok(pid) if pid_alive(pid) => {
                            return Err(Error::State {
                                context: out_dir.display().to_string(),
                                detail: format!(
                                    "another trainer (pid {pid}) is using this output directory (lock file {}); \
                                     wait for it to finish or pick another --out. If no such process is training, \
                                     delete the lock file",
                                    path.display()
                                ),
                            });
                        }
                        // Stale: its process is gone (killed), or the file is not a lock.
                        _ => {
                            let _ = std::fs::remove_file(&path); // a failure shows at the next link
                        }
                    }
                }
                Err(e) => return Err(io(&path, e)),
            }
        }
        Err(Error::State {
            context: out_dir.display().to_string(),
            detail: format!("cannot take the lock file {}: it keeps reappearing", path.display()),
        })
    })();
    let _ = std::fs::remove_file(&tmp); // the temp name only carried the content
    result
}

// ---- scalers, chosen by type ----------------------------------------------------------------

/// How a run's scaler is made (it is checkpointed as its `LossScaler::State`).
trait RunScaler: LossScaler + Sized {
    /// Whether the scaler itself stops a run whose steps keep overflowing (f16's floor rule).
    const STOPS_ON_COLLAPSE: bool;
    fn make(min_scale: f32, collapse_after: u32) -> Result<Self>;
}

/// What must match for a checkpoint to continue a run (the checkpoint's `extra`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct RunIdentity {
    model: GptConfig,
    precision: RunPrecision,
    steps: u64,
    lr: f64,
    batch_size: usize,
    task: String,
    seed: u64,
    /// The text itself, not just its path (`--data` runs only): the same file name with
    /// other content would resume into another data order (or fail on a vocabulary of the
    /// same size but other characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data_hash: Option<String>,
}

/// A run's checkpointed state: AdamW's, the scaler's, and the run's identity.
type RunState<K> = TrainingState<OptimizerState<AdamState>, <K as LossScaler>::State, RunIdentity>;

/// As JSON, for messages.
fn to_json(v: &impl serde::Serialize) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("<not serialisable: {e}>"))
}

impl RunScaler for GradScaler {
    const STOPS_ON_COLLAPSE: bool = true;
    fn make(min_scale: f32, collapse_after: u32) -> Result<Self> {
        GradScaler::with_options(GradScalerOptions {
            min_scale: Some(min_scale),
            error_at_min_scale: true,
            collapse_after,
            ..Default::default()
        })
    }
}

impl RunScaler for NoScale {
    const STOPS_ON_COLLAPSE: bool = false;
    fn make(_: f32, _: u32) -> Result<Self> {
        Ok(NoScale)
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
    /// The character of each token id, in id order.
    fn chars(&self) -> Vec<char> {
        match self {
            Task::Addition { .. } => (0..AdditionVocab::SIZE as i64).map(AdditionVocab::char_of).collect(),
            Task::Text { val, .. } => val.vocab().chars().to_vec(),
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

/// Greedy decoding of `n` tokens after `prompts: [B, P]` (the new tokens only, `[B, n]`).
fn greedy<L: Precision, D: Device>(model: &Gpt<f32, D>, prompts: &Indices, n: usize) -> Result<Indices> {
    let (b, p) = (prompts.shape()[0], prompts.shape()[1]);
    let full = model.try_generate::<L>(prompts, n, Sampling::Greedy, &mut Rng::seed(0))?;
    let out: Vec<i64> = full.as_slice().chunks(p + n).flat_map(|s| s[p..].to_vec()).collect();
    Indices::try_from_vec(out, &[b, n])
}

/// Characters of held-out text that start the sample a text run prints.
pub const SAMPLE_PROMPT_CHARS: usize = 16;
/// Characters the sample adds to its prompt.
pub const SAMPLE_CHARS: usize = 200;
/// The sample's temperature (nanoGPT's `sample.py` default).
pub const SAMPLE_TEMPERATURE: f64 = 0.8;

// ---- the run --------------------------------------------------------------------------------

/// Trains on the CPU as `cfg` says, printing progress to stderr, and returns the report.
pub fn run(cfg: &TrainConfig) -> Result<TrainReport> {
    run_on(cfg, &Cpu)
}

/// Trains on `device` as `cfg` says (the model is built on the CPU, from the seed, and moved
/// there), printing progress to stderr, and returns the report. Off the CPU the host reads the
/// steps' results every [`READ_EVERY`] steps (see the module notes); the metrics, the
/// checkpoints and the weights are the same files as on the CPU, and a checkpoint resumes on
/// either device.
pub fn run_on<D: Device>(cfg: &TrainConfig, device: &D) -> Result<TrainReport> {
    cfg.validate()?;
    match cfg.precision {
        RunPrecision::F32 => train::<f32, NoScale, D>(cfg, device),
        RunPrecision::Bf16 => train::<bf16, NoScale, D>(cfg, device),
        RunPrecision::F16 => train::<f16, GradScaler, D>(cfg, device),
    }
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), detail: e.to_string() }
}

fn train<L: Precision, K: RunScaler, D: Device>(cfg: &TrainConfig, device: &D) -> Result<TrainReport> {
    std::fs::create_dir_all(&cfg.out_dir).map_err(|e| io(&cfg.out_dir, e))?;
    let _lock = lock_out_dir(&cfg.out_dir)?;
    INTERRUPTS.store(0, Ordering::SeqCst);
    let ckpt_dir = cfg.out_dir.join("checkpoint");
    let metrics_path = cfg.out_dir.join("metrics.csv");
    let plot_path = cfg.out_dir.join("loss.png");
    let weights = cfg.out_dir.join("model.safetensors");
    let (config_path, vocab_path) = (cfg.out_dir.join("config.json"), cfg.out_dir.join("vocab.json"));
    if !cfg.resume {
        let existing: Vec<&Path> = [metrics_path.as_path(), weights.as_path(), ckpt_dir.as_path()]
            .into_iter()
            .filter(|p| p.exists())
            .collect();
        if !existing.is_empty() && !cfg.overwrite {
            let names: Vec<String> = existing.iter().map(|p| p.display().to_string()).collect();
            return Err(Error::State {
                context: cfg.out_dir.display().to_string(),
                detail: format!(
                    "this output directory already holds a run ({}): continue it with --resume, start over \
                     with --overwrite (which deletes it), or pick another --out",
                    names.join(", ")
                ),
            });
        }
        if cfg.overwrite {
            // The old checkpoint must go too: a later --resume would continue it with these metrics.
            if ckpt_dir.exists() {
                std::fs::remove_dir_all(&ckpt_dir).map_err(|e| io(&ckpt_dir, e))?;
            }
            for p in [&metrics_path, &weights, &plot_path, &config_path, &vocab_path] {
                if p.exists() {
                    std::fs::remove_file(p).map_err(|e| io(p, e))?;
                }
            }
        }
    }

    let mut task = Task::new(cfg)?;
    if let (Some(path), true) = (&cfg.data, task.vocab_size() > MAX_TEXT_VOCAB) {
        return Err(Error::InvalidArgument {
            op: "train",
            name: "data",
            detail: format!(
                "{} has {} distinct characters; a character model here takes at most {MAX_TEXT_VOCAB} (its output \
                 layer and logits grow with the vocabulary): use a text written in fewer characters",
                path.display(),
                task.vocab_size()
            ),
        });
    }
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
    // Built on the CPU from the seed, then moved: the same initial weights on every device.
    let mut model = Gpt::try_new(model_cfg.clone(), &mut init_rng)?.to_device(device);
    let mut opt = Optim::new(AdamW::new(cfg.lr).weight_decay(0.1))?
        .with_group(ParamGroup::new("no_decay", |n| n.ends_with("bias") || n.contains("ln")).weight_decay(0.0))?
        .with_schedule(WarmupCosine::with_min(cfg.steps.min(100), cfg.steps, 0.1)?);
    let mut scaler = K::make(cfg.min_scale, cfg.collapse_after)?;
    let mut rng = Rng::seed(cfg.seed ^ 0x5EED);
    let data_hash = match &cfg.data {
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
            Some(format!("fnv1a64:{:016x}", fnv1a64(&bytes)))
        }
        None => None,
    };
    let identity = RunIdentity {
        model: model_cfg,
        precision: cfg.precision,
        steps: cfg.steps,
        lr: cfg.lr,
        batch_size: cfg.batch_size,
        task: task.name(),
        seed: cfg.seed,
        data_hash,
    };

    let mut start = 0;
    if cfg.resume {
        if !checkpoint::checkpoint_exists(&ckpt_dir) {
            return Err(Error::State {
                context: ckpt_dir.display().to_string(),
                detail: "--resume given but there is no checkpoint here".into(),
            });
        }
        // The identity first, the rest unread: a checkpoint of another configuration (another
        // precision keeps another scaler state) is refused as such, not as a state of the
        // wrong type.
        let (then, _) = checkpoint::read_checkpoint_state::<IgnoredAny, IgnoredAny, RunIdentity>(&ckpt_dir)?;
        if let (Some(path), Some(hash_then), Some(hash_now)) = (&cfg.data, &then.extra.data_hash, &identity.data_hash)
            && hash_then != hash_now
        {
            return Err(Error::State {
                context: ckpt_dir.display().to_string(),
                detail: format!(
                    "{} is not the text this checkpoint was trained on (content hash {hash_then} then, {hash_now} \
                     now): resume with the original file, or start a new run (--overwrite, or another --out)",
                    path.display(),
                ),
            });
        }
        if then.extra != identity {
            return Err(Error::State {
                context: ckpt_dir.display().to_string(),
                detail: format!(
                    "the checkpoint belongs to a different run configuration:\n  checkpoint: {}\n  this run:   {}",
                    to_json(&then.extra),
                    to_json(&identity)
                ),
            });
        }
        let state: RunState<K> = checkpoint::load_checkpoint(&ckpt_dir, &mut model)?;
        // Every refusal names the state file; the errors of the parts name the tensor.
        let state_file = ckpt_dir.join(checkpoint::STATE_FILE);
        let bad = |what: &str, e: String| Error::State {
            context: state_file.display().to_string(),
            detail: format!("{what}: {e}"),
        };
        let detail = |e: Error| match e {
            Error::State { detail, .. } => detail,
            other => other.to_string(),
        };
        opt.load_state_dict(state.optimizer).map_err(|e| bad("optimizer state", detail(e)))?;
        opt.check_params(&model).map_err(|e| bad("optimizer state", detail(e)))?;
        check_optimizer_state(&opt, state.step).map_err(|e| bad("optimizer state", e))?;
        if let Some(what) = non_finite_state(&model, &opt) {
            return Err(bad("weights", format!("{what} is inf or NaN in the checkpoint")));
        }
        scaler.load_state_dict(&state.scaler).map_err(|e| bad("scaler state", detail(e)))?;
        rng = state.rng.ok_or_else(|| bad("rng", "missing".into()))?;
        let position = state.loader.as_ref().ok_or_else(|| bad("data loader position", "missing".into()))?;
        task.restore(position).map_err(|e| bad("data loader position", detail(e)))?;
        start = state.step;
    }
    let end = cfg.stop_after.map_or(cfg.steps, |s| s.min(cfg.steps));
    if start >= end && end < cfg.steps {
        let detail = format!("the checkpoint is at step {start}, past --stop-after {end}: nothing to train");
        return Err(Error::State { context: ckpt_dir.display().to_string(), detail });
    }
    // A checkpoint at the last step (a finished run, or one interrupted in its last step, which
    // wrote no weights): no step to take, but the run's end still runs, writing the weights and
    // evaluating them.
    let finished = start >= cfg.steps;
    let metrics =
        if start > 0 { MetricsWriter::resume(&metrics_path, start)? } else { MetricsWriter::create(&metrics_path)? };

    let progress = if cfg.progress { Progress::new(cfg.steps, start) } else { Progress::hidden(cfg.steps, start) };
    let steps = if finished {
        format!(
            "nothing left to train: the checkpoint is at the last step, {start}; writing the weights and evaluating"
        )
    } else {
        format!("steps {}..={end}", start + 1)
    };
    progress.println(format!(
        "training a {}-parameter GPT (d {d}, {n_layers} layers, {n_heads} heads) on {} in {} {} on {}, {steps}",
        model.num_params(),
        task.name(),
        L::DTYPE,
        if L::DTYPE == crate::DType::F16 { "with dynamic loss scaling" } else { "without loss scaling" },
        device.name(),
    ));
    model.train();
    let mut ledger = Ledger {
        metrics,
        progress,
        t0: Instant::now(),
        tokens: 0,
        skipped: 0,
        skipped_in_a_row: 0,
        applied: opt.steps(),
        losses: Vec::new(),
    };
    let read_every = if D::HOST_MEMORY { 1 } else { READ_EVERY };
    let mut pending: Vec<Pending<D>> = Vec::with_capacity(read_every);
    let mut interrupted_at = None;
    let save = |model: &Gpt<f32, D>, opt: &Optim<AdamW>, scaler: &K, rng: &Rng, task: &Task, step: u64| -> Result<()> {
        let state: RunState<K> = TrainingState {
            step,
            loader: Some(task.position()),
            rng: Some(rng.clone()),
            optimizer: opt.state_dict(),
            scaler: scaler.state_dict(),
            extra: identity.clone(),
        };
        checkpoint::save_checkpoint(&ckpt_dir, model, &state).map(|_| ())
    };
    for step in start + 1..=end {
        let batch = task.next_batch()?;
        let mut loss = model.loss::<L>(&batch.inputs, &batch.targets, &mut rng);
        if cfg.inject_nonfinite.contains(&step) {
            loss = loss.mul_scalar(f64::NAN);
        }
        let loss_value = {
            let loss = loss.detach();
            device.value(move || loss.item())
        };
        // The loss moves into the step: its graph is freed by `backward`, so `step` updates the
        // parameters in place instead of copying them.
        let mut grads = scaler.scale(loss).backward().unscale();
        let grad_norm = grads.clip_grad_norm(cfg.clip_norm);
        let report = match grads.step(&mut opt, &mut model).update() {
            Ok(r) => r,
            Err(e) => {
                // The steps before this one first: their rows show how it came to this.
                ledger.read(&mut pending, &model, &opt, cfg, L::DTYPE, K::STOPS_ON_COLLAPSE)?;
                ledger.metrics.sync()?;
                return Err(Error::State {
                    context: format!("training stopped at step {step}"),
                    detail: format!(
                        "{e}. Check the data for NaN/inf, lower the learning rate (now --lr {:e}), or train in \
                         bf16 (--precision bf16), which needs no loss scaling. The last checkpoint is untouched",
                        cfg.lr
                    ),
                });
            }
        };
        pending.push(Pending {
            step,
            loss: loss_value,
            skipped: report.skipped,
            scale_used: report.scale_used,
            scale: report.scale,
            grad_norm,
            tokens: batch.inputs.numel(),
            time_s: ledger.t0.elapsed().as_secs_f64(),
        });
        let stop = interrupted();
        let save_now = step % cfg.checkpoint_every == 0 || step == end || stop;
        if pending.len() >= read_every || save_now {
            ledger.read(&mut pending, &model, &opt, cfg, L::DTYPE, K::STOPS_ON_COLLAPSE)?;
        }
        if save_now {
            ledger.metrics.sync()?; // rows up to the checkpoint are on disk before it is
            save(&model, &opt, &scaler, &rng, &task, step)?;
        }
        if stop {
            // The caller says so (`TrainReport::interrupted`): the example prints one line.
            interrupted_at = Some(step);
            break;
        }
    }
    let Ledger { mut metrics, progress, t0, tokens, skipped, losses, .. } = ledger;
    progress.finish();
    metrics.sync()?;
    let elapsed = t0.elapsed().as_secs_f64();
    if !metrics.rows().is_empty() {
        plot_metrics(&plot_path, metrics.rows(), &format!("GPT on {} ({})", task.name(), L::DTYPE))?;
    }
    let mean = |v: &[f64]| if v.is_empty() { f64::NAN } else { v.iter().sum::<f64>() / v.len() as f64 };
    let finite: Vec<f64> = losses.iter().copied().filter(|l| l.is_finite()).collect();
    let kf = finite.len().min(20);
    let mut report = TrainReport {
        steps: end,
        first_loss: mean(&finite[..kf]),
        last_loss: mean(&finite[finite.len() - kf..]),
        skipped,
        final_scale: scaler.get_scale(),
        accuracy: None,
        val_loss: None,
        sample: None,
        tokens_per_s: tokens as f64 / elapsed,
        metrics: metrics_path,
        plot: plot_path,
        checkpoint: ckpt_dir,
        weights,
        config: config_path,
        vocab: vocab_path,
        interrupted: false,
        device: device.name(),
    };
    if let Some(step) = interrupted_at {
        return Ok(TrainReport { steps: step, interrupted: true, ..report });
    }
    checkpoint::save_weights(&report.weights, &model)?;
    // Plain data (numbers, strings): serialising cannot fail.
    let config = serde_json::to_string_pretty(&model.config).expect("a GptConfig serialises") + "\n";
    checkpoint::write_atomic(&report.config, config.as_bytes())?;
    let chars: Vec<String> = task.chars().iter().map(char::to_string).collect();
    let vocab = serde_json::to_string(&chars).expect("strings serialise") + "\n";
    checkpoint::write_atomic(&report.vocab, vocab.as_bytes())?;

    model.eval();
    match &task {
        Task::Addition { task, .. } => {
            let acc = no_grad(|| {
                task.exact_match_accuracy(&task.test_set(), 250, None, |p, n| greedy::<L, D>(&model, p, n))
            })?;
            report.accuracy = Some(acc.fraction());
        }
        Task::Text { val, .. } => {
            let mut loader = DataLoader::new(val.clone(), cfg.batch_size, 0)?.shuffle(false);
            let batches = loader.batches_per_epoch().min(10);
            let mut total = 0.0;
            for _ in 0..batches {
                let b = loader.next_token_batch()?;
                total += no_grad(|| model.loss::<L>(&b.inputs, &b.targets, &mut rng)).item() as f64;
            }
            report.val_loss = Some(total / batches.max(1) as f64);
            let prompt = &val.tokens()[..SAMPLE_PROMPT_CHARS.min(val.tokens().len())];
            let sampling = Sampling::Random { temperature: SAMPLE_TEMPERATURE, top_k: None };
            let ids = Indices::try_from_vec(prompt.to_vec(), &[1, prompt.len()])?;
            let text = model.try_generate::<L>(&ids, SAMPLE_CHARS, sampling, &mut Rng::seed(cfg.seed))?;
            report.sample = Some(val.vocab().decode(text.as_slice()));
        }
    }
    Ok(report)
}

/// A step's results that the host has not read yet (device values; on the CPU already read).
struct Pending<D: Device> {
    step: u64,
    loss: D::Value<f32>,
    skipped: D::Value<bool>,
    scale_used: D::Value<f32>,
    scale: D::Value<f32>,
    grad_norm: D::Value<f32>,
    tokens: usize,
    /// Seconds since the start when the step was queued.
    time_s: f64,
}

/// What the host knows of a run: the metrics written so far and the counts behind the checks
/// that stop it.
struct Ledger {
    metrics: MetricsWriter,
    progress: Progress,
    t0: Instant,
    tokens: usize,
    skipped: u64,
    skipped_in_a_row: u32,
    /// Optimizer steps applied before the next pending step (its learning rate's index).
    applied: u64,
    losses: Vec<f64>,
}

impl Ledger {
    /// Reads the pending steps' results (a wait for the device), writes their metrics rows in
    /// order, and runs the checks that stop a run: too many skipped steps in a row (where no
    /// scale can be lowered), and weights or moments gone inf or NaN after an applied step.
    fn read<D: Device>(
        &mut self,
        pending: &mut Vec<Pending<D>>,
        model: &Gpt<f32, D>,
        opt: &Optim<AdamW>,
        cfg: &TrainConfig,
        dtype: crate::DType,
        stops_on_collapse: bool,
    ) -> Result<()> {
        let mut applied_steps = None;
        for p in pending.drain(..) {
            let skipped = p.skipped.get();
            let row = MetricsRow {
                step: p.step,
                loss: p.loss.get() as f64,
                scale: p.scale_used.get() as f64,
                skipped,
                grad_norm: p.grad_norm.get() as f64,
                lr: opt.lr_at(self.applied),
                time_s: p.time_s,
            };
            self.metrics.write(&row)?;
            self.tokens += p.tokens;
            self.skipped += skipped as u64;
            self.losses.push(row.loss);
            self.progress.update(&row, self.skipped, self.tokens as f64 / self.t0.elapsed().as_secs_f64());
            if skipped {
                self.skipped_in_a_row += 1;
                self.progress.println(format!(
                    "step {}: non-finite gradients, step skipped, scale now {}",
                    p.step,
                    p.scale.get()
                ));
                if !stops_on_collapse && self.skipped_in_a_row >= cfg.collapse_after {
                    self.metrics.sync()?;
                    return Err(Error::State {
                        context: format!("training stopped at step {}", p.step),
                        detail: format!(
                            "the last {} steps all had non-finite (inf or NaN) gradients and were skipped, so the \
                             weights stopped changing (collapse-after = {}). In {dtype} there is no loss scale to \
                             lower: look for NaN/inf in the data or the loss, or lower the learning rate (now --lr \
                             {:e}). The last checkpoint is untouched",
                            self.skipped_in_a_row, cfg.collapse_after, cfg.lr
                        ),
                    });
                }
            } else {
                self.skipped_in_a_row = 0;
                self.applied += 1;
                let first = applied_steps.map_or(p.step, |(first, _, _)| first);
                applied_steps = Some((first, p.step, row.lr));
            }
        }
        // The gradients were finite, but an update may still overflow the f32 weights or
        // moments (a huge learning rate): stop before such a state reaches a checkpoint.
        if let Some((first, last, lr)) = applied_steps
            && let Some(what) = non_finite_state(model, opt)
        {
            self.metrics.sync()?;
            let when = if first == last { format!("at step {last}") } else { format!("in steps {first}..={last}") };
            return Err(Error::State {
                context: format!("training stopped at step {last}"),
                detail: format!(
                    "the update made {what} inf or NaN, although the gradients were finite: the learning rate is \
                     too large for the f32 weights (now --lr {:e}, {lr:e} {when}). Lower --lr; the last checkpoint \
                     is untouched and none was written with this state",
                    cfg.lr
                ),
            });
        }
        Ok(())
    }
}

/// FNV-1a, 64 bits: a content fingerprint of the training text (not a cryptographic hash).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Refuses loaded Adam state that no run of this optimizer can produce: more applied steps
/// than steps, a parameter stepped more often than the optimizer, moments that are not finite
/// or a negative second moment (a running mean of squares).
fn check_optimizer_state(opt: &Optim<AdamW>, step: u64) -> std::result::Result<(), String> {
    if opt.steps() > step {
        return Err(format!("{} applied steps, more than the checkpoint's {step} steps", opt.steps()));
    }
    let state = opt.state_dict();
    for (name, st) in &state.params {
        if st.step > opt.steps() {
            return Err(format!("`{name}` took {} steps, more than the optimizer's {}", st.step, opt.steps()));
        }
        if any_non_finite(&st.exp_avg) || any_non_finite(&st.exp_avg_sq) {
            return Err(format!("the Adam moments of `{name}` hold inf or NaN"));
        }
        if let Some(i) = st.exp_avg_sq.iter().position(|v| *v < 0.0) {
            return Err(format!(
                "exp_avg_sq of `{name}` is negative at element {i} ({}): a mean of squares cannot be",
                st.exp_avg_sq[i]
            ));
        }
    }
    Ok(())
}

/// Names the first parameter or Adam moment holding an inf or NaN, if any. On the CPU the
/// parameters and moments are read in place; on another device they are copied (the
/// optimizer state in one copy).
fn non_finite_state<D: Device>(model: &Gpt<f32, D>, opt: &Optim<AdamW>) -> Option<String> {
    let copied = (!D::HOST_MEMORY).then(|| opt.state_dict());
    for (name, p) in model.named_params() {
        // In place on the CPU (this runs after every step there); a copy from another device.
        let in_place = (p as &dyn std::any::Any).downcast_ref::<crate::Param<f32, Cpu>>();
        let bad = match in_place {
            Some(p) => any_non_finite(p.data()),
            None => any_non_finite(&p.to_vec()),
        };
        if bad {
            return Some(format!("parameter `{name}`"));
        }
        let st = match &copied {
            Some(state) => state.params.get(&name),
            None => opt.param_state(&name),
        };
        if let Some(st) = st {
            if any_non_finite(&st.exp_avg) {
                return Some(format!("the first Adam moment (exp_avg) of `{name}`"));
            }
            if any_non_finite(&st.exp_avg_sq) {
                return Some(format!("the second Adam moment (exp_avg_sq) of `{name}`"));
            }
        }
    }
    None
}

/// The end-of-run summary as a table.
pub fn summary(cfg: &TrainConfig, r: &TrainReport) -> String {
    let shown = |present: bool, text: String| if present { text } else { "-".to_string() };
    let mut rows = vec![
        vec!["precision".into(), format!("{:?}", cfg.precision).to_lowercase()],
        vec!["device".into(), r.device.clone()],
        vec!["steps".into(), r.steps.to_string()],
        // No step ran in this invocation (a resume at the last step): no losses, no rate.
        vec!["loss (first 20 steps)".into(), shown(!r.first_loss.is_nan(), format!("{:.4}", r.first_loss))],
        vec!["loss (last 20 steps)".into(), shown(!r.last_loss.is_nan(), format!("{:.4}", r.last_loss))],
        vec!["skipped steps".into(), r.skipped.to_string()],
        vec!["final loss scale".into(), format!("{}", r.final_scale)],
        vec!["tokens/s".into(), shown(r.tokens_per_s > 0.0, format!("{:.0}", r.tokens_per_s))],
    ];
    if let Some(a) = r.accuracy {
        rows.push(vec!["held-out accuracy".into(), format!("{:.1}%", 100.0 * a)]);
    }
    if let Some(v) = r.val_loss {
        rows.push(vec!["held-out loss".into(), format!("{v:.4}")]);
    }
    format_table(&["", "value"], &rows)
}
