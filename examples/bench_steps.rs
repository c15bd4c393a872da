//! Step time of the fixed workloads W1 (MLP) and W2 (GPT) from
//! `shared/reference/performance.md`, in f32, bf16 and f16 + GradScaler, printed as a table.
//!
//! Run: `cargo run --release --example bench_steps [-- --steps 5] [--only w1|w2] [--precision f32|bf16|f16] [--torch PYTHON] [--no-floor] [--fused-attention] [--caller-waits] [--profile]`
//! (`-- --help` lists them).
//! Cells left out by `--only` or `--precision` print as `-`. With `--torch PYTHON` (a Python
//! with PyTorch), PyTorch's step times are measured in the same run by
//! `tests/python/bench_steps.py` (the same workloads and step, on the same threads) and
//! printed beside ours with the ratios; without it the PyTorch columns print as `-`. Each
//! cell's PyTorch time is taken right after ours (a Python process per cell), so a drift of
//! the machine's speed during the run moves both sides of a ratio alike.
//! `--profile` adds, after each cell's timed steps, a table of where 3 more steps spent their
//! time, kernel by kernel (`amp::profile`), with the time outside any kernel, and a line with
//! the GEMMs' time a step and the time outside them (its share of the wall time).
//! The run starts by naming the CPU (model, the SIMD and AMX flags it reports) and the kernels
//! this build runs on it.
//! `--fused-attention` runs W2's attention as the fused kernel (`Gpt::with_fused_attention`)
//! instead of the separate ops of the workload's definition (scores, scale, mask, softmax,
//! values); PyTorch's side keeps the separate ops.
//! The main thread is made one of the compute threads first (`cpu_threads::init`), as a
//! training program should; `--caller-waits` leaves rayon's default pool instead, where the
//! main thread hands every parallel op to the pool and sleeps until it is done.
//! Each step is a full AMP step: forward, scaled backward, unscale, clip_grad_norm(1.0),
//! AdamW step, scaler update. Median of `--steps` timed steps after one warm-up step.
//! A second table gives the minor page faults per timed step (the kernel's count for this
//! process, from `/proc/self/stat`): a fault is a fresh page being mapped and zeroed, which is
//! what allocating and freeing large buffers every step costs, and what the CPU caching
//! allocator removes. It also gives the allocator's figures for each workload: its peak bytes
//! in use and the bytes it holds (in use plus cached) after the timed steps. Each workload
//! starts with an empty cache (`cpu_memory::empty_cache`), so none holds another's buffers.

use std::time::Instant;

use clap::{Parser, ValueEnum};

use amp::nn::{Gpt, GptConfig, Linear};
use amp::optim::{AdamW, Optim};
use amp::scaler::{GradScaler, LossScaler, NoScale};
use amp::{Indices, Params, Precision, Rng, Tensor, bf16, f16};

/// A workload of `shared/reference/performance.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    W1,
    W2,
}

/// A column of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PrecisionArg {
    F32,
    Bf16,
    F16,
}

/// Step time of the W1 (MLP) and W2 (GPT) workloads of `shared/reference/performance.md` in
/// f32, bf16 and f16 + GradScaler; with `--torch`, PyTorch's beside them.
#[derive(Parser, Debug)]
struct Args {
    /// Timed steps per cell (their median is reported), after one warm-up step.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Run one workload only.
    #[arg(long, value_enum)]
    only: Option<Workload>,
    /// Run one precision only.
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// A Python with PyTorch: measure PyTorch's step for each cell right after ours.
    #[arg(long, value_name = "PYTHON")]
    torch: Option<String>,
    /// Leave out W2's GEMMs timed alone (a floor under the step).
    #[arg(long)]
    no_floor: bool,
    /// Run W2's attention as the fused kernel instead of separate ops.
    #[arg(long)]
    fused_attention: bool,
    /// Leave rayon's default pool, the main thread waiting on it, instead of making the main
    /// thread a compute thread.
    #[arg(long)]
    caller_waits: bool,
    /// After each cell's timed steps, profile 3 more, kernel by kernel.
    #[arg(long)]
    profile: bool,
}

/// W1: 1024 → 4096 → 4096 → 1024 → 10 with GELU between layers.
#[derive(amp::Params)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(rng: &mut Rng) -> Self {
        let dims = [1024, 4096, 4096, 1024, 10];
        Mlp { layers: dims.windows(2).map(|w| Linear::new(w[0], w[1], true, rng)).collect() }
    }
    fn loss<L: Precision>(&self, x: &Tensor<f32>, y: &Indices) -> Tensor<f32> {
        let mut h: Tensor<L> = self.layers[0].forward::<L, f32>(x);
        for layer in &self.layers[1..] {
            h = layer.forward::<L, L>(&h.gelu());
        }
        h.cast::<f32>().cross_entropy(y)
    }
}

/// This process's minor page faults so far (field 10 of `/proc/self/stat`); `None` where that
/// file does not exist (not Linux).
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at field 3, in parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(7)?.parse().ok()
}

/// One workload's figures: median step seconds, minor page faults per timed step, and the
/// CPU allocator's peak bytes in use and bytes reserved (in use plus cached) at the end.
#[derive(Clone, Copy)]
struct Timing {
    secs: f64,
    faults: f64,
    peak_bytes: usize,
    reserved_bytes: usize,
}

impl Timing {
    const SKIPPED: Timing = Timing { secs: f64::NAN, faults: f64::NAN, peak_bytes: 0, reserved_bytes: 0 };
}

/// The profile rows that are GEMMs (`matmul_bf16`, `linear_f32`, ...): what the time outside
/// the GEMMs leaves out.
const GEMM_KERNELS: [&str; 2] = ["matmul_", "linear_"];

/// Steps `--profile` times after the timed ones.
const PROFILED_STEPS: usize = 3;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `--steps` full AMP steps after one warm-up step; returns the median seconds and the
/// page faults per timed step. With `--profile`, [`PROFILED_STEPS`] more steps follow under
/// `amp::profile`, and their table is printed under `label`.
fn time_steps<M: Params, K: LossScaler>(
    label: &str,
    model: &mut M,
    scaler: &mut K,
    args: &Args,
    mut loss: impl FnMut(&M) -> Tensor<f32>,
) -> Timing {
    let steps = args.steps as usize;
    let mut opt: Optim<AdamW> = AdamW::default().build().expect("valid AdamW");
    let mut times = Vec::new();
    let mut faults_before = None;
    let mut step = |model: &mut M| {
        let l = loss(model);
        let scaled = scaler.scale(l);
        let mut grads = scaled.backward().unscale();
        grads.clip_grad_norm(1.0);
        grads.step(&mut opt, model).update().expect("scaler update");
    };
    for i in 0..=steps {
        if i == 1 {
            faults_before = minor_faults();
        }
        let t = Instant::now();
        step(model);
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let faults = match (faults_before, minor_faults()) {
        (Some(a), Some(b)) => (b - a) as f64 / steps as f64,
        _ => f64::NAN,
    };
    if args.profile {
        amp::profile::start();
        for _ in 0..PROFILED_STEPS {
            step(model);
        }
        let table = amp::profile::stop();
        println!("\nProfile of {label}: {PROFILED_STEPS} more steps (times are totals over them)\n{table}");
        // Issue 13's measure: the GEMM kernels' share of the wall time, and the rest.
        let gemms: f64 =
            table.rows.iter().filter(|r| GEMM_KERNELS.iter().any(|k| r.name.starts_with(k))).map(|r| r.seconds).sum();
        let (wall, per) = (table.wall_seconds, 1e3 / PROFILED_STEPS as f64);
        println!(
            "GEMMs {:.1} ms a step; outside the GEMMs {:.1} ms a step ({:.1}% of the wall time)\n",
            gemms * per,
            (wall - gemms) * per,
            100.0 * (wall - gemms) / wall
        );
    }
    let memory = amp::cpu_memory::memory_stats();
    Timing {
        secs: median(times),
        faults,
        peak_bytes: memory.peak_bytes_in_use,
        reserved_bytes: memory.bytes_reserved(),
    }
}

fn w1<L: Precision, K: LossScaler>(scaler: &mut K, args: &Args) -> Timing {
    let mut rng = Rng::seed(0);
    let mut model = Mlp::new(&mut rng);
    let x = Tensor::<f32>::randn(&[256, 1024], &mut rng);
    let y = Indices::from_vec((0..256).map(|_| rng.below(10) as i64).collect(), &[256]);
    time_steps(&format!("W1 {}", L::DTYPE), &mut model, scaler, args, |m| m.loss::<L>(&x, &y))
}

fn w2<L: Precision, K: LossScaler>(scaler: &mut K, args: &Args) -> Timing {
    let mut rng = Rng::seed(0);
    let config = GptConfig { vocab_size: 128, block_size: 128, d_model: 256, n_layers: 4, n_heads: 4, dropout: 0.0 };
    let mut model =
        Gpt::new(config, &mut rng).with_fused_attention(args.fused_attention).expect("W2 has no attention dropout");
    let ids = Indices::from_vec((0..16 * 128).map(|_| rng.below(128) as i64).collect(), &[16, 128]);
    let targets = Indices::from_vec((0..16 * 128).map(|_| rng.below(128) as i64).collect(), &[16, 128]);
    let mut drop_rng = Rng::seed(1);
    time_steps(&format!("W2 {}", L::DTYPE), &mut model, scaler, args, |m| m.loss::<L>(&ids, &targets, &mut drop_rng))
}

/// The GEMMs of one W2 step, alone: every forward product `y = a b` of the model (batch, m,
/// k, n) with its two backward products `dy bᵀ` and `aᵀ dy`, on transposed views as autograd
/// runs them. Their time is a floor under the step; returns (median seconds, GFLOP).
fn w2_gemms<L: Precision>(steps: usize) -> (f64, f64) {
    let (tokens, d, heads, t, hd, vocab) = (16 * 128, 256, 4, 128, 64, 128);
    let bh = 16 * heads;
    let mut shapes = Vec::new();
    for _ in 0..4 {
        shapes.extend([
            (1, tokens, d, 3 * d), // qkv
            (bh, t, hd, t),        // q kᵀ
            (bh, t, t, hd),        // p v
            (1, tokens, d, d),     // proj
            (1, tokens, d, 4 * d), // fc
            (1, tokens, 4 * d, d), // fc2
        ]);
    }
    shapes.push((1, tokens, d, vocab)); // head
    let mut rng = Rng::seed(2);
    let operands: Vec<_> = shapes
        .iter()
        .map(|&(b, m, k, n)| {
            let randn = |s: &[usize], rng: &mut Rng| Tensor::<f32>::randn(s, rng).cast::<L>();
            (randn(&[b, m, k], &mut rng), randn(&[b, k, n], &mut rng), randn(&[b, m, n], &mut rng))
        })
        .collect();
    let flops: usize = shapes.iter().map(|&(b, m, k, n)| 3 * 2 * b * m * k * n).sum();
    let mut times = Vec::new();
    for i in 0..=steps {
        let start = Instant::now();
        for (a, b, dy) in &operands {
            std::hint::black_box((a.matmul(b), dy.matmul(&b.transpose(1, 2)), a.transpose(1, 2).matmul(dy)));
        }
        if i > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    (median(times), flops as f64 / 1e9)
}

/// The CPU's model name and the flags that decide which kernels run (from `/proc/cpuinfo`).
fn cpu_description() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    // The first processor's value of the key `name` exactly ("model" is not "model name").
    let field = |name: &str| {
        let value = info.lines().filter_map(|l| l.split_once(':')).find(|(key, _)| key.trim() == name);
        value.map_or("", |(_, v)| v.trim()).to_string()
    };
    let flags = field("flags");
    let wanted = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"];
    let present: Vec<&str> = wanted.iter().copied().filter(|w| flags.split_whitespace().any(|f| f == *w)).collect();
    let missing: Vec<&str> = wanted.iter().copied().filter(|w| !present.contains(w)).collect();
    let (family, model) = (field("cpu family"), field("model"));
    let core = family.parse().ok().zip(model.parse().ok()).and_then(|(f, m)| core_name(&field("vendor_id"), f, m));
    let core = core.map(|c| format!(": {c}")).unwrap_or_default();
    format!(
        "CPU: {}, family {family} model {model}{core} (has {}; lacks {})",
        field("model name"),
        present.join(" "),
        missing.join(" ")
    )
}

/// The core generation of the x86 CPUs these figures come from, by vendor, family and model,
/// where it is one of those: a VM's model name is often just "AMD EPYC", which covers Zen 4
/// and Zen 5, and the two rank our kernels differently (Zen 4 runs a 512-bit operation in
/// two 256-bit halves, Zen 5 whole: W2's bf16 GEMMs take about half the time on Zen 5).
fn core_name(vendor: &str, family: u32, model: u32) -> Option<&'static str> {
    match (vendor, family, model) {
        ("AuthenticAMD", 25, 0x10..=0x1f | 0x60..=0x7f | 0xa0..=0xaf) => Some("Zen 4"),
        ("AuthenticAMD", 25, 0x00..=0x0f | 0x20..=0x2f | 0x40..=0x5f) => Some("Zen 3"),
        ("AuthenticAMD", 26, _) => Some("Zen 5"),
        ("GenuineIntel", 6, 0x8f) => Some("Sapphire Rapids"),
        ("GenuineIntel", 6, 0xcf) => Some("Emerald Rapids"),
        ("GenuineIntel", 6, 0xad | 0xae) => Some("Granite Rapids"),
        _ => None,
    }
}

/// PyTorch's median step time for one cell (workload `w`, precision `p`), measured now by
/// `tests/python/bench_steps.py` under `python`, and the torch version.
fn torch_time(python: &str, steps: usize, w: &str, p: &str, threads: usize) -> (f64, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/bench_steps.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(script).args(["--steps", &steps.to_string(), "--threads", &threads.to_string()]);
    cmd.args(["--only", w, "--precision", p]);
    let out = cmd.output().unwrap_or_else(|e| panic!("--torch: cannot run `{python}`: {e}"));
    assert!(
        out.status.success(),
        "--torch: `{python} {script}` failed: {}",
        String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("--torch: the script printed no JSON result: {stdout}"));
    (json[w][p].as_f64().unwrap_or(f64::NAN), json["torch"].as_str().unwrap_or("?").to_string())
}

fn main() {
    let args = Args::parse();
    // Before any op: the main thread becomes one of the compute threads.
    let caller_waits = args.caller_waits;
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (threads, arrangement) = if caller_waits {
        (available, "rayon's default pool, the main thread waiting on it (--caller-waits)")
    } else {
        match amp::cpu_threads::init(0) {
            Ok(n) => (n, "the main thread one of them (cpu_threads::init)"),
            Err(e) => panic!("{e}"),
        }
    };
    let steps = args.steps as usize;
    // The workloads and precisions by the names the table and the PyTorch script use (their
    // names on the command line: `w1`, `bf16`).
    fn name(v: impl ValueEnum) -> String {
        v.to_possible_value().expect("every value has a name").get_name().to_string()
    }
    let only = args.only.map(name);
    let run = |w: &str| only.as_deref().is_none_or(|o| o == w);
    let precision = args.precision.map(name);
    let want = |p: &str| precision.as_deref().is_none_or(|q| q == p);
    let fused = args.fused_attention;
    // Runs `f` when precision `p` is selected; NaN marks a cell left out.
    // Each cell starts with an empty cache and a fresh peak, so its figures are its own.
    let cell = |p: &str, f: &dyn Fn() -> Timing| {
        if !want(p) {
            return Timing::SKIPPED;
        }
        amp::cpu_memory::empty_cache();
        amp::cpu_memory::reset_peak_memory_stats();
        f()
    };
    println!("{}", cpu_description());
    println!("Kernels: {}", amp::Cpu.kernel_report());
    let torch_python = args.torch.clone();
    println!(
        "W1 MLP ({} params) and W2 GPT ({} params), {threads} threads, {arrangement}, median of {steps} steps",
        { Mlp::new(&mut Rng::seed(0)).num_params() },
        {
            let c = GptConfig { vocab_size: 128, block_size: 128, d_model: 256, n_layers: 4, n_heads: 4, dropout: 0.0 };
            Gpt::new(c, &mut Rng::seed(0)).num_params()
        }
    );
    // PyTorch's time for one cell, measured right after ours, on the same threads (NaN
    // without `--torch` or for a cell left out); the first measurement names the version.
    let torch_version = std::cell::RefCell::new(None);
    let torch_cell = |w: &str, p: &str| match &torch_python {
        Some(py) if want(p) => {
            let (t, v) = torch_time(py, steps, w, p, threads);
            torch_version.borrow_mut().get_or_insert(v);
            t
        }
        _ => f64::NAN,
    };
    // Ours, then PyTorch's, for one cell.
    let pair = |w: &str, p: &str, f: &dyn Fn() -> Timing| (cell(p, f), torch_cell(w, p));
    let mut rows = Vec::new();
    if run("w1") {
        let cells = [
            pair("w1", "f32", &|| w1::<f32, _>(&mut NoScale, &args)),
            pair("w1", "bf16", &|| w1::<bf16, _>(&mut NoScale, &args)),
            pair("w1", "f16", &|| w1::<f16, _>(&mut GradScaler::new(), &args)),
        ];
        rows.push(("W1 MLP step", cells.map(|c| c.0), cells.map(|c| c.1)));
    }
    if run("w2") {
        let cells = [
            pair("w2", "f32", &|| w2::<f32, _>(&mut NoScale, &args)),
            pair("w2", "bf16", &|| w2::<bf16, _>(&mut NoScale, &args)),
            pair("w2", "f16", &|| w2::<f16, _>(&mut GradScaler::new(), &args)),
        ];
        let name = if fused { "W2 GPT step, fused attention" } else { "W2 GPT step" };
        rows.push((name, cells.map(|c| c.0), cells.map(|c| c.1)));
    }
    match torch_version.into_inner() {
        Some(v) => println!("PyTorch {v}, measured in this run, each cell right after ours"),
        None => println!("PyTorch not measured (pass --torch PYTHON)"),
    }
    println!();
    println!(
        "| workload | f32 (s) | bf16 (s) | f16 + GradScaler (s) | PyTorch f32 / bf16 / f16 (s) | ours / PyTorch's time: f32 / bf16 / f16 |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for &(name, ours, torch) in &rows {
        let ours = ours.map(|t| t.secs);
        let secs = |t: f64| if t.is_nan() { "-".to_string() } else { format!("{t:.3}") };
        let ratio = |r: f64, digits: usize| if r.is_nan() { "-".to_string() } else { format!("{r:.digits$}") };
        println!(
            "| {name} | {} | {} | {} | {} / {} / {} | {} / {} / {} |",
            secs(ours[0]),
            secs(ours[1]),
            secs(ours[2]),
            secs(torch[0]),
            secs(torch[1]),
            secs(torch[2]),
            ratio(ours[0] / torch[0], 2),
            ratio(ours[1] / torch[1], 2),
            ratio(ours[2] / torch[2], 2)
        );
    }
    println!();
    println!("Minor page faults per timed step; CPU allocator: peak in use / reserved after the steps (MiB)");
    println!();
    println!("| workload | f32 | bf16 | f16 + GradScaler |");
    println!("| --- | --- | --- | --- |");
    for (name, ours, _) in &rows {
        let cell = |t: &Timing| {
            if t.faults.is_nan() {
                return "-".to_string();
            }
            let mib = |b: usize| b as f64 / (1 << 20) as f64;
            format!("{:.0} faults; {:.0} / {:.0} MiB", t.faults, mib(t.peak_bytes), mib(t.reserved_bytes))
        };
        println!("| {name} | {} | {} | {} |", cell(&ours[0]), cell(&ours[1]), cell(&ours[2]));
    }
    // `--no-floor` leaves out the GEMM-only section (for profiling the steps alone).
    if run("w2") && !args.no_floor {
        println!();
        println!("W2's GEMMs alone (forward and backward, no other op): a floor under the step");
        for (name, p, gemms) in [
            ("f32", "f32", &(|| w2_gemms::<f32>(steps)) as &dyn Fn() -> (f64, f64)),
            ("bf16", "bf16", &|| w2_gemms::<bf16>(steps)),
            ("f16", "f16", &|| w2_gemms::<f16>(steps)),
        ] {
            if want(p) {
                amp::cpu_memory::empty_cache(); // the steps' buffers are not the products'
                let (secs, gflop) = gemms();
                println!("  {name}: {secs:.3} s for {gflop:.1} GFLOP ({:.0} GFLOP/s)", gflop / secs);
            }
        }
    }
}
