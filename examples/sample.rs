//! Generate text with a model the `train` example wrote: its `model.safetensors`, `config.json`
//! and `vocab.json` rebuild the GPT, which extends a prompt (nanoGPT's `sample.py`).
//!
//! ```text
//! cargo run --release --example sample -- --prompt "12+34=" --chars 4 --temperature 0
//! cargo run --release --example sample -- --out runs/text --prompt "The " --chars 300
//! ```
//!
//! On the addition task the answer has one digit more than the operands and comes
//! least-significant digit first, then the end marker: `12+34=` -> `12+34=640$` (046);
//! `--temperature 0` picks the most likely token each time.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use amp::checkpoint;
use amp::nn::{Gpt, GptConfig, Sampling};
use amp::{Indices, Params, Rng, bf16, f16};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PrecisionArg {
    F32,
    F16,
    Bf16,
}

/// Extend a prompt with a GPT trained by the `train` example.
#[derive(Parser, Debug)]
#[command(version, about, allow_negative_numbers = true)]
struct Args {
    /// The training run's output directory (model.safetensors, config.json, vocab.json).
    #[arg(long, default_value = "runs/train")]
    out: PathBuf,
    /// The text to extend (every character must be in the run's vocabulary).
    #[arg(long)]
    prompt: String,
    /// Characters to generate.
    #[arg(long, default_value_t = 200)]
    chars: usize,
    /// Sampling temperature; 0 picks the most likely character each time.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely characters only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Seed of the samples.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Precision of the forward pass (the weights stay f32).
    #[arg(long, value_enum, default_value = "f32")]
    precision: PrecisionArg,
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e} (written by the train example)", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn sample(args: &Args) -> Result<String, String> {
    let config: GptConfig = read_json(&args.out.join("config.json"))?;
    let vocab: Vec<String> = read_json(&args.out.join("vocab.json"))?;
    if vocab.len() != config.vocab_size {
        return Err(format!("vocab.json has {} characters, config.json {} token ids", vocab.len(), config.vocab_size));
    }
    let mut model = Gpt::try_new(config, &mut Rng::seed(0)).map_err(|e| e.to_string())?;
    checkpoint::load_weights(args.out.join("model.safetensors"), &mut model).map_err(|e| e.to_string())?;
    model.eval();
    let ids = args
        .prompt
        .chars()
        .map(|c| {
            vocab
                .iter()
                .position(|s| *s == c.to_string())
                .map(|i| i as i64)
                .ok_or_else(|| format!("--prompt: {c:?} is not in the run's vocabulary ({})", vocab.concat()))
        })
        .collect::<Result<Vec<i64>, String>>()?;
    let prompt = Indices::try_from_vec(ids, &[1, args.prompt.chars().count()]).map_err(|e| e.to_string())?;
    let sampling = if args.temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::Random { temperature: args.temperature, top_k: args.top_k }
    };
    let mut rng = Rng::seed(args.seed);
    let out = match args.precision {
        PrecisionArg::F32 => model.try_generate::<f32>(&prompt, args.chars, sampling, &mut rng),
        PrecisionArg::F16 => model.try_generate::<f16>(&prompt, args.chars, sampling, &mut rng),
        PrecisionArg::Bf16 => model.try_generate::<bf16>(&prompt, args.chars, sampling, &mut rng),
    }
    .map_err(|e| e.to_string())?;
    Ok(out.as_slice().iter().map(|&i| vocab[i as usize].as_str()).collect())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match sample(&args) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
