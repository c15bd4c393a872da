//! The main job: train a small GPT with mixed precision on the embedded default task
//! (multi-digit addition, "12+34=" -> "64" written least-significant digit first), or on your
//! own text file, and report what happened.
//!
//! ```text
//! cargo run --release --example train                      # f16 + GradScaler, the default
//! cargo run --release --example train -- --precision bf16  # no loss scaling needed
//! cargo run --release --example train -- --data my.txt    # character-level LM on a file
//! cargo run --release --example train -- --resume          # continue from runs/train
//! cargo run --release --example train -- --overwrite       # start runs/train over
//! cargo run --release --features cuda --example train -- --device cuda   # on GPU 0
//! ```
//!
//! A checkpoint does not depend on the device: a run started on the GPU continues on the CPU
//! with `--resume` (and the other way round).
//!
//! A fresh run refuses an `--out` that holds another run (`--resume` it, or `--overwrite`), and
//! a second trainer on a directory in use. Ctrl-C (or SIGTERM) finishes the current step,
//! writes a checkpoint and exits with status 130 (a second Ctrl-C exits at once); `--resume`
//! continues from there. A run that cannot go on (every step skipped, weights gone inf/NaN)
//! exits with status 1 and says why.

use std::path::PathBuf;
use std::process::ExitCode;

use amp::trainer::{self, ModelSize, RunPrecision, TrainConfig};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PrecisionArg {
    F32,
    F16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ModelArg {
    Tiny,
    Small,
    Medium,
}

/// Train a small GPT with automatic mixed precision.
#[derive(Parser, Debug)]
// Negative numbers parse as values, so `--steps -5` is refused naming `--steps`.
#[command(version, about, allow_negative_numbers = true)]
struct Args {
    /// Compute precision: f16 uses dynamic loss scaling, bf16 and f32 need none.
    #[arg(long, value_enum, default_value = "f16")]
    precision: PrecisionArg,
    /// Device to train on.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// Optimizer steps in total.
    #[arg(long, default_value_t = 1500)]
    steps: u64,
    /// Sequences per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Model size: tiny (d 64), small (d 128), medium (d 256, 4 layers).
    #[arg(long, value_enum, default_value = "small")]
    model: ModelArg,
    /// Peak learning rate (AdamW with warmup and cosine decay).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of initialisation, data order and dropout.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train a character-level model on this text file instead of the addition task.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Digits per operand of the addition task (1 to 4).
    #[arg(long, default_value_t = 2)]
    digits: usize,
    /// Output directory (metrics.csv, loss.png, checkpoint/, model.safetensors, config.json, vocab.json).
    #[arg(long, default_value = "runs/train")]
    out: PathBuf,
    /// Continue from the checkpoint in the output directory.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Start a fresh run even if the output directory holds another run (deleting it).
    #[arg(long)]
    overwrite: bool,
    /// Save a checkpoint every this many steps (and at the end).
    #[arg(long, default_value_t = 400)]
    checkpoint_every: u64,
    /// Stop after this step with a checkpoint, as an interrupted run would (continue it with
    /// --resume, on either device).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Dropout probability.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Steps whose loss is made NaN, to watch the scaler skip them (e.g. --inject-nan 50,51).
    #[arg(long, value_delimiter = ',')]
    inject_nan: Vec<u64>,
    /// Stop as hopeless after this many skipped steps in a row (f16: with the loss scale at
    /// its floor; bf16/f32: any non-finite gradients).
    #[arg(long, default_value_t = 20)]
    collapse_after: u32,
    /// No progress bar (log lines only).
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    // Before any op: the main thread, which runs the training loop, is a compute thread.
    if let Err(e) = amp::cpu_threads::init(0) {
        eprintln!("warning: {e}");
    }
    let args = Args::parse();
    let cfg = TrainConfig {
        precision: match args.precision {
            PrecisionArg::F32 => RunPrecision::F32,
            PrecisionArg::F16 => RunPrecision::F16,
            PrecisionArg::Bf16 => RunPrecision::Bf16,
        },
        steps: args.steps,
        batch_size: args.batch_size,
        model: match args.model {
            ModelArg::Tiny => ModelSize::Tiny,
            ModelArg::Small => ModelSize::Small,
            ModelArg::Medium => ModelSize::Medium,
        },
        lr: args.lr,
        seed: args.seed,
        data: args.data,
        digits: args.digits,
        out_dir: args.out,
        resume: args.resume,
        checkpoint_every: args.checkpoint_every,
        stop_after: args.stop_after,
        dropout: args.dropout,
        progress: !args.quiet,
        inject_nonfinite: args.inject_nan,
        overwrite: args.overwrite,
        collapse_after: args.collapse_after,
        ..TrainConfig::default()
    };
    // Ctrl-C / SIGTERM: finish the step, write a checkpoint, exit (a second one exits at once).
    if let Err(e) = trainer::install_interrupt_handler() {
        eprintln!("warning: {e}; an interrupt will lose the steps since the last checkpoint");
    }
    let result = match args.device {
        DeviceArg::Cpu => trainer::run(&cfg),
        DeviceArg::Cuda => run_on_gpu(&cfg),
    };
    match result {
        Ok(report) if report.interrupted => {
            eprintln!(
                "interrupted after step {}: checkpoint saved in {}; continue with the same options and --resume",
                report.steps,
                report.checkpoint.display()
            );
            ExitCode::from(130)
        }
        Ok(report) => {
            println!("\n{}", trainer::summary(&cfg, &report));
            if let Some(sample) = &report.sample {
                println!(
                    "sample (the held-out text's first {} characters, then {} sampled at temperature {}):\n{sample}\n",
                    trainer::SAMPLE_PROMPT_CHARS,
                    trainer::SAMPLE_CHARS,
                    trainer::SAMPLE_TEMPERATURE
                );
            }
            println!("metrics:    {}", report.metrics.display());
            println!("plot:       {}", report.plot.display());
            println!("checkpoint: {}", report.checkpoint.display());
            println!("weights:    {} (safetensors, PyTorch names)", report.weights.display());
            println!("config:     {} (GptConfig)", report.config.display());
            println!("vocab:      {} (the character of each token id)", report.vocab.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Trains on GPU 0 (its driver and libraries are loaded at run time: a machine without them
/// gets an error naming what is missing).
#[cfg(feature = "cuda")]
fn run_on_gpu(cfg: &TrainConfig) -> amp::Result<trainer::TrainReport> {
    trainer::run_on(cfg, &amp::cuda::Cuda::new(0)?)
}

/// This build has no CUDA backend.
#[cfg(not(feature = "cuda"))]
fn run_on_gpu(_: &TrainConfig) -> amp::Result<trainer::TrainReport> {
    Err(amp::Error::InvalidArgument {
        op: "train",
        name: "device",
        detail: "this build has no CUDA backend: build the example with it, \
                 `cargo run --release --features cuda --example train -- --device cuda`"
            .into(),
    })
}
