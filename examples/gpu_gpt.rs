//! A GPT at GPU scale (GPT-2 small's shape: d 768, 12 layers, 12 heads, sequences of 1024
//! tokens, a 50304-token vocabulary) trained with mixed precision on a GPU, in bf16 and in
//! f16 + GradScaler, with fused causal attention (`Tensor::causal_attention`: no `t × t`
//! scores stored), and measured: tokens/s, model TFLOP/s, peak device memory and blocking
//! host-device calls per step.
//!
//! ```text
//! cargo run --release --features cuda --example gpu_gpt                       # GPU 0, both precisions
//! cargo run --release --features cuda --example gpu_gpt -- --precision bf16 --batch 16
//! cargo run --release --example gpu_gpt -- --device cpu --tiny                # the same code, small, on the CPU
//! ```
//!
//! Each step is the whole AMP step, read back by nothing: forward, (scaled) backward, unscale,
//! clip_grad_norm(1.0), AdamW, scaler update. After `--warmup` steps (kernels compiled, the
//! allocator's cache filled), `--steps` steps are queued and then the last step's loss is read
//! (the one wait of the timed run); the tokens/s and TFLOP/s count the whole stretch. The
//! host's time to queue each step is printed beside the step time: close to it, the GPU was
//! waiting for the host. The model's FLOPs per token are `6 N + 12 L T d` (N parameters
//! without the position embeddings, L layers, T tokens, d width: PaLM's count, attention at
//! full `T × T`).
//!
//! On a GPU the batch defaults to what fills about 40 GiB by an estimate (16 bytes per parameter for
//! weights, gradients and Adam's moments; per token `60 d` bytes of activations per layer and
//! `8` per vocabulary entry for the logits and the loss, fitted to the peaks measured on an
//! H200: 16.9 GiB at batch 16, 29.2 GiB at batch 29); on the CPU it defaults to 8 sequences.
//! The measured peak is printed.
//! Data are synthetic (a fixed pattern of token ids: the loss falls as it is learned).

use std::time::Instant;

use amp::backend::HostValue;
use amp::nn::{Gpt, GptConfig};
use amp::optim::{AdamW, Optim};
use amp::param::ToDevice;
use amp::scaler::{GradScaler, LossScaler, NoScale};
use amp::{Device, Indices, Params, Precision, Rng, bf16, f16};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    Cuda,
    Cpu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PrecisionArg {
    Bf16,
    F16,
    Both,
}

/// Train a GPT-2-small-sized model with mixed precision and report its speed.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Where to train.
    #[arg(long, value_enum, default_value = "cuda")]
    device: DeviceArg,
    /// bf16 (no loss scaling), f16 with a GradScaler, or both one after the other.
    #[arg(long, value_enum, default_value = "both")]
    precision: PrecisionArg,
    /// Sequences per step (0: on a GPU, fill about 40 GiB by the estimate in the docs; on the
    /// CPU, 8).
    #[arg(long, default_value_t = 0)]
    batch: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// A small model (d 128, 2 layers, 4 heads, 128 tokens, vocabulary 512) for a quick run.
    #[arg(long)]
    tiny: bool,
    /// After the timed steps, this many more under `amp::profile`, printed as a table of time
    /// per kernel (on a GPU: device time from timing events, and the time it sat idle).
    #[arg(long, default_value_t = 0)]
    profile: usize,
}

/// Bytes the default batch may fill on a GPU.
const TARGET_BYTES: f64 = 40.0 * (1u64 << 30) as f64;
/// The default batch on the CPU.
const CPU_BATCH: usize = 8;

fn config(tiny: bool) -> GptConfig {
    if tiny {
        GptConfig { vocab_size: 512, block_size: 128, d_model: 128, n_layers: 2, n_heads: 4, dropout: 0.0 }
    } else {
        GptConfig { vocab_size: 50304, block_size: 1024, d_model: 768, n_layers: 12, n_heads: 12, dropout: 0.0 }
    }
}

/// The batch that fills about [`TARGET_BYTES`] by the estimate in the module docs.
fn default_batch(c: &GptConfig, params: usize) -> usize {
    let per_token = (60 * c.d_model * c.n_layers + 8 * c.vocab_size) as f64;
    let per_sequence = per_token * c.block_size as f64;
    (((TARGET_BYTES - 16.0 * params as f64) / per_sequence).floor() as usize).max(1)
}

/// What one run measured.
struct Measured {
    tokens_per_s: f64,
    /// Seconds per step the host took to queue the timed steps, and the wall time per step.
    host_step_s: f64,
    step_s: f64,
    tflops: f64,
    first_loss: f32,
    last_loss: f32,
    skipped: usize,
    blocking_per_step: Option<f64>,
    allocations_per_step: f64,
    peak_bytes: usize,
    profile: Option<amp::profile::Profile>,
}

/// The device-specific parts: counting blocking calls and peak memory.
trait Meter {
    /// Blocking host-device calls so far, where the device counts them.
    fn blocking_calls(&self) -> Option<u64>;
    /// Starts the peak-memory count over.
    fn reset_peak(&self);
    /// Peak bytes in use since the reset.
    fn peak_bytes(&self) -> usize;
    /// Buffers the caching allocator has had to get fresh (its misses) so far.
    fn allocations(&self) -> u64;
}

impl Meter for amp::Cpu {
    fn blocking_calls(&self) -> Option<u64> {
        None // the CPU's memory is the host's: nothing to wait for
    }
    fn reset_peak(&self) {
        amp::cpu_memory::reset_peak_memory_stats();
    }
    fn peak_bytes(&self) -> usize {
        amp::cpu_memory::max_memory_allocated()
    }
    fn allocations(&self) -> u64 {
        amp::cpu_memory::memory_stats().misses
    }
}

#[cfg(feature = "cuda")]
impl Meter for amp::cuda::Cuda {
    fn blocking_calls(&self) -> Option<u64> {
        Some(amp::cuda::Cuda::blocking_calls(self))
    }
    fn reset_peak(&self) {
        self.reset_peak_memory_stats();
    }
    fn peak_bytes(&self) -> usize {
        self.memory_stats().peak_bytes_in_use
    }
    fn allocations(&self) -> u64 {
        self.memory_stats().misses
    }
}

/// Token ids `[batch, T]` with a learnable pattern, and the next tokens as targets.
fn batch(c: &GptConfig, batch: usize, step: usize) -> (Indices, Indices) {
    let v = c.vocab_size as i64;
    let t = c.block_size;
    let token = |b: usize, i: usize| ((b * 31 + step * 7) as i64 + 13 * i as i64) % v;
    let ids = (0..batch).flat_map(|b| (0..t).map(move |i| token(b, i))).collect();
    let targets = (0..batch).flat_map(|b| (0..t).map(move |i| token(b, i + 1))).collect();
    (Indices::from_vec(ids, &[batch, t]), Indices::from_vec(targets, &[batch, t]))
}

fn run<L: Precision, K: LossScaler + Default, D: Device + Meter>(
    dev: &D,
    c: &GptConfig,
    b: usize,
    args: &Args,
) -> Measured {
    let mut model: Gpt<f32, D> =
        Gpt::new(c.clone(), &mut Rng::seed(0)).with_fused_attention(true).expect("dropout is 0").to_device(dev);
    let mut opt: Optim<AdamW> = AdamW::new(3e-4).weight_decay(0.1).build().expect("a valid rate");
    let mut scaler = K::default();
    let mut rng = Rng::seed(1);
    dev.reset_peak();
    let mut step = |i: usize, model: &mut Gpt<f32, D>| {
        let (ids, targets) = batch(c, b, i);
        let loss = model.loss::<L>(&ids, &targets, &mut rng);
        let value = loss.detach();
        let mut grads = scaler.scale(loss).backward().unscale();
        grads.clip_grad_norm(1.0);
        let report = grads.step(&mut opt, model).update().expect("no collapse check is set");
        (value, report.skipped)
    };
    let mut first_loss = None;
    for i in 0..args.warmup {
        let (loss, _) = step(i, &mut model);
        first_loss.get_or_insert_with(|| loss.item()); // reads once: the warm-up is not timed
    }
    let waits = dev.blocking_calls();
    let allocations = dev.allocations();
    let t0 = Instant::now();
    let mut results = Vec::with_capacity(args.steps);
    for i in 0..args.steps {
        results.push(step(args.warmup + i, &mut model));
    }
    // The host's time to queue the steps: near the wall time when the GPU waits for the host
    // (launch-bound), well below it when the host runs ahead.
    let queued = t0.elapsed().as_secs_f64();
    let waits = waits.zip(dev.blocking_calls()).map(|(a, b)| (b - a) as f64 / args.steps.max(1) as f64);
    let allocations = (dev.allocations() - allocations) as f64 / args.steps.max(1) as f64;
    let (last, _) = results.last().expect("at least one timed step");
    let last_loss = last.item(); // waits for every queued step
    let elapsed = t0.elapsed().as_secs_f64();
    let skipped = results.iter().filter(|(_, s)| s.get()).count();
    let tokens = (b * c.block_size * args.steps) as f64;
    let profile = (args.profile > 0).then(|| {
        amp::profile::start(); // after the read above: nothing of the timed steps is queued
        for i in 0..args.profile {
            step(args.warmup + args.steps + i, &mut model);
        }
        amp::profile::stop()
    });
    let n = model.num_params() - c.block_size * c.d_model; // without the position embeddings
    let flops_per_token = 6.0 * n as f64 + 12.0 * (c.n_layers * c.block_size * c.d_model) as f64;
    Measured {
        tokens_per_s: tokens / elapsed,
        host_step_s: queued / args.steps as f64,
        step_s: elapsed / args.steps as f64,
        tflops: tokens * flops_per_token / elapsed / 1e12,
        first_loss: first_loss.unwrap_or(f32::NAN),
        last_loss,
        skipped,
        blocking_per_step: waits,
        allocations_per_step: allocations,
        peak_bytes: dev.peak_bytes(),
        profile,
    }
}

fn report(dev: &str, precision: &str, b: usize, m: &Measured) {
    let blocking = m.blocking_per_step.map_or("n/a (host memory)".to_string(), |w| format!("{w:.2}"));
    println!(
        "{dev} {precision:<14} batch {b:>3}: {:>9.0} tokens/s  {:>7.3} TFLOP/s  peak {:>6.2} GiB  \
         blocking calls/step {blocking}  allocations/step {:.2}  loss {:.3} -> {:.3}  skipped {}  \
         step {:.1} ms (host queued it in {:.1} ms)",
        m.tokens_per_s,
        m.tflops,
        m.peak_bytes as f64 / (1u64 << 30) as f64,
        m.allocations_per_step,
        m.first_loss,
        m.last_loss,
        m.skipped,
        m.step_s * 1e3,
        m.host_step_s * 1e3
    );
    if let Some(table) = &m.profile {
        println!("Profile of {precision}, the --profile steps after the timed ones (totals over them):\n{table}\n");
    }
}

fn run_all<D: Device + Meter>(dev: &D, args: &Args) {
    let c = config(args.tiny);
    let params = Gpt::new(c.clone(), &mut Rng::seed(0)).num_params();
    // The 40 GiB target is a GPU's memory: on the CPU it would fill (and exhaust) the host's.
    let b = match args.batch {
        0 if D::HOST_MEMORY => CPU_BATCH,
        0 => default_batch(&c, params),
        b => b,
    };
    println!(
        "GPT: {params} parameters (d {}, {} layers, {} heads, {} tokens, vocabulary {}), fused causal attention, \
         AdamW, clip 1.0, on {}",
        c.d_model,
        c.n_layers,
        c.n_heads,
        c.block_size,
        c.vocab_size,
        dev.name()
    );
    if matches!(args.precision, PrecisionArg::Bf16 | PrecisionArg::Both) {
        report(&dev.name(), "bf16", b, &run::<bf16, NoScale, D>(dev, &c, b, args));
    }
    if matches!(args.precision, PrecisionArg::F16 | PrecisionArg::Both) {
        report(&dev.name(), "f16+GradScaler", b, &run::<f16, GradScaler, D>(dev, &c, b, args));
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.steps == 0 {
        eprintln!("error: --steps must be at least 1");
        return std::process::ExitCode::from(2);
    }
    match args.device {
        DeviceArg::Cpu => run_all(&amp::Cpu, &args),
        DeviceArg::Cuda => {
            #[cfg(feature = "cuda")]
            match amp::cuda::Cuda::new(0) {
                Ok(gpu) => {
                    println!("GPU 0: {}", gpu.device_name());
                    run_all(&gpu, &args)
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    return std::process::ExitCode::from(1);
                }
            }
            #[cfg(not(feature = "cuda"))]
            {
                eprintln!(
                    "error: this build has no CUDA backend: `cargo run --release --features cuda --example gpu_gpt` \
                     (or --device cpu)"
                );
                return std::process::ExitCode::from(1);
            }
        }
    }
    std::process::ExitCode::SUCCESS
}
