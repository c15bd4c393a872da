//! The row, AMP-step, optimizer, batch norm, pooling, convolution, reduction, gathering and
//! attention-helper kernels, and the generated elementwise maps, run on this machine, GPU or
//! not, under the host emulation of CUDA (`tests/emulated/cuda_emu.hpp`, with the real
//! prelude), launched as the backend launches them (variant, threads, grid, dynamic shared
//! memory; the runners name the backend function each case follows):
//! - `tests/emulated/rows.cpp`: softmax and log-softmax, layer norm and RMS norm (with the weight
//!   and bias gradients), cross-entropy and the squared-error loss (a broadcast target too),
//!   forward and backward, block-per-row and warp-per-row,
//!   vectorised and scalar, the row cached in dynamic shared memory or not (at the cache's edge:
//!   a row of exactly `ROW_SMEM` bytes and one value more), at f32, f16, bf16 and f64, against f64
//!   references with per-precision tolerances.
//! - `tests/emulated/amp_step.cpp`: the multi-tensor unscale and non-finite check, the gradient
//!   norm, scale and clamp, SGD and Adam/AdamW (bit for bit against the CPU optimizer's
//!   arithmetic, and a step with found-inf set changes nothing), the bf16 writes; and, from
//!   cases this test writes to its standard input, `update_scale` and `clip_coefficient`
//!   compared bit for bit with the CPU's [`ScaleRule::apply`] and [`clip_coefficient`], and
//!   dropout's mask bit for bit with the CPU's `Tensor::dropout` (three chunks of its generator,
//!   a transposed view, NaN and infinities; the launch from `launch::dropout_launch`).
//! - `tests/emulated/batch_norm.cpp`: batch norm's statistics (two-pass, in `Acc<T>`), the
//!   running update (f64 rounded once into f32, bit for bit as the CPU), eval statistics from
//!   strided running buffers, the forward with and without weight and bias (in `Acc<T>`), the
//!   backward's sums (the parameters' gradients) and input gradient in training and eval, at
//!   f32, f16, bf16 and f64, over shapes from two values a channel to 1200, and 257 channels.
//! - `tests/emulated/pool_conv.cpp`: max and average pooling forward and backward over fixed
//!   windows (stride, padding up to half the kernel, gaps between windows) and adaptive ones, max
//!   pooling's ties and NaNs bit for bit as the CPU's argmax; the convolution's im2col (bit for
//!   bit), col2im, bias fill and bias gradient with groups, stride, padding and dilation, for a
//!   chunk of samples after the first; at f32, f16, bf16 and f64.
//! - `tests/emulated/reduce_index.cpp`: sum and max over the last dim, a middle dim and a long
//!   middle dim split into parts (`launch::reduce_parts`, mirrored in `launch.hpp` and checked
//!   against it here with the other launch rules), NaN and -inf; arg max / arg min with NaNs
//!   and ties and the selection's scatter, bit for bit; the embedding gather, `cat` and the scatter-add (bit for bit in the
//!   CPU's order); the cuBLAS path's attention helpers (probabilities under the causal mask and
//!   log-sum-exps, g·out, score gradients) for blocks of query rows after the first; at f32,
//!   f16, bf16 and f64.
//! - `tests/emulated/maps.cpp` with `maps_generated.inc`, which this test generates from
//!   `amp_cuda::kernels::catalog()` (each map program's source minus the prelude, in a namespace
//!   of its own, and a table from kernel name to launcher): every unary op value forward and
//!   backward (powf at three exponents), every binary op, the twelve casts, copy, fill,
//!   write_into and where, at f32, f16, bf16 and f64, against amp-core's CPU backend (its
//!   `Device` methods on the same storages and layouts). Views: contiguous at offset 0 with a
//!   scalar tail (mode 2), at offset 1 (mode 1), transposed (mode 0), a backward with `g`
//!   laid out unlike `x` and `y`, binary and `where` operands broadcast as rows and columns
//!   beside transposes, a transposed destination of write_into (copy and add, from a broadcast
//!   source); the kernel arguments are `launch::views`' and the mode `launch::map_mode`'s, from
//!   the buffers' addresses. Inputs: zeros of both signs, ±1, the extremes, infinities, NaN and
//!   values from 2^-14 to 2^8 (log, sqrt and powf mostly positive); the casts also take random
//!   bit patterns. Bit for bit (NaN for NaN) except where the two sides compute transcendental
//!   functions with different implementations (the CPU's vectorised exp/tanh/erf/ln, the C
//!   library's here): gelu, gelu_tanh, tanh, sigmoid, silu, exp, log and powf forward, gelu,
//!   gelu_tanh, silu and powf backward, within 4 ulps of f32 or f64 and 1 ulp of f16 or bf16 at
//!   the size of the terms the formula cancels (`map_scale`: 1 + erf, 1 - tanh², 1 - σ).
//!   Changing the 1/√(2π) of GELU's CUDA derivative in its fourth digit fails gelu_bwd_f32
//!   (up to 974 ulps) and gelu_bwd_f64, naming them; at f16 and bf16 so small a change
//!   stays within the one ulp of rounding.
//!
//! Every kernel entry point of `src/kernels/*.cu` (69, besides the generated maps, which the maps
//! test takes from the catalog) is launched by one of these runners: a test reads the sources
//! and fails on a kernel without a case.
//!
//! What it cannot check: the hardware (real shared-memory and register limits are `tests/ptx.rs`'s,
//! real f16 conversions and transcendental functions, timing), and races that the emulation's
//! barriers and its one-block-at-a-time schedule hide (see the design notes of
//! `cuda_emu.hpp`); the parity suite runs the kernels on a GPU.
//!
//! It needs a C++20 compiler (`$CXX`, else `c++`); without one it prints `SKIPPED` and passes,
//! unless `AMP_CUDA_REQUIRE_CXX=1` (CI sets it): see `tests/emulated/mod.rs`.

mod emulated;

use amp_core::backend::{BinaryOp, ScaleRule, UnaryOp, clip_coefficient, total_norm};
use amp_core::layout::Layout;
use amp_core::{Cpu, DType, Device, Tensor, bf16, f16};
use amp_cuda::kernels::{self, Program};
use amp_cuda::launch;
use std::fmt::Write as _;

/// Queries of the runner's launch rules (`tests/emulated/launch.hpp`) and what
/// `amp_cuda::launch` answers, one line each, in the runner's answer format.
fn launch_queries() -> Vec<(String, String)> {
    use amp_cuda::launch;
    let cfg =
        |c: cudarc::driver::LaunchConfig| format!("launch {} {} {}", c.grid_dim.0, c.block_dim.0, c.shared_mem_bytes);
    let lengths = [1usize, 7, 8, 16, 31, 32, 33, 64, 100, 255, 256, 257, 511, 512, 513, 1000, 1024, 1025, 4096, 6016];
    let lengths = lengths.into_iter().chain([6017, 12032, 12033, 100_000]);
    let rows = [1usize, 3, 4, 5, 255, 256, 257, 65_535, 65_536, 65_537, 1 << 20, 1 << 30];
    let mut q = Vec::new();
    for r in rows {
        q.push((format!("grid {r}"), cfg(launch::grid(r))));
        q.push((format!("warp_rows_grid {r}"), cfg(launch::warp_rows_grid(r))));
    }
    for (m, dim, inner) in [(3072, 16384, 3072), (768, 16384, 768), (5, 64, 5), (7, 1000, 7), (96, 4096, 96)]
        .into_iter()
        .chain([(10, 5000, 1), (1 << 17, 5000, 64), ((1 << 17) - 1, 5000, 64), (100, 63, 100), (100, 64, 100)])
    {
        let want = launch::reduce_parts(m, dim, inner)
            .map_or("launch none".into(), |(per, parts)| format!("launch {per} {parts}"));
        q.push((format!("reduce_parts {m} {dim} {inner}"), want));
    }
    for elem in [2usize, 4, 8] {
        for dense in [false, true] {
            for ptr in [4096u64, 4096 + 2, 4096 + 8] {
                let want = launch::map_mode(elem, dense, &[ptr]);
                q.push((format!("map_mode {elem} {} {ptr}", dense as i32), format!("launch {want}")));
            }
        }
    }
    for d in lengths {
        q.push((format!("rows_grid 3 {d} 4096"), cfg(launch::rows_grid(3, d, 4096))));
        for elem in [2usize, 4, 8] {
            let (smem, cached) = launch::row_cache(d * elem);
            q.push((format!("row_cache {}", d * elem), format!("launch {smem} {cached}")));
            for (aligned, ptr) in [(1, 4096u64), (0, 4096 + elem as u64)] {
                let nv = launch::warp_vectors(d, elem, &[ptr]).unwrap_or(0);
                q.push((format!("warp_vectors {d} {elem} {aligned}"), format!("launch {nv}")));
            }
        }
    }
    q
}

#[test]
fn the_row_kernels_match_f64_references_when_emulated_on_the_host() {
    let args = [amp_cuda::kernels::ROW_SMEM.to_string()];
    let queries = launch_queries();
    let input: String = queries.iter().map(|(q, _)| format!("{q}\n")).collect();
    let Some(run) = emulated::run("rows.cpp", &args, &input) else { return };
    // The runners launch by the backend's rules: launch.hpp mirrors src/launch.rs.
    let answers: Vec<&str> = run.stdout.lines().filter(|l| l.starts_with("launch ")).collect();
    assert_eq!(answers.len(), queries.len(), "the runner answered {} of the launch queries", answers.len());
    let drift: Vec<String> = queries
        .iter()
        .zip(&answers)
        .filter(|((_, want), got)| want != *got)
        .map(|((q, want), got)| format!("{q}: launch.rs says `{want}`, launch.hpp `{got}`"))
        .collect();
    assert!(drift.is_empty(), "tests/emulated/launch.hpp no longer follows src/launch.rs:\n{}", drift.join("\n"));
    println!("{}", run.stdout.lines().filter(|l| !l.starts_with("launch ")).collect::<Vec<_>>().join("\n"));
    assert!(
        run.success && run.stdout.contains("\n0 of "),
        "the emulated row kernels disagree with their references (FAIL lines above):\n{}",
        run.stderr
    );
}

/// A small deterministic generator (splitmix64) for the oracle's cases.
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// One `update_scale` case: the rule, the flags and the state before.
struct ScaleCase {
    rule: ScaleRule,
    flags: Vec<f32>,
    state: [f64; 5],
}

fn scale_cases() -> Vec<ScaleCase> {
    let mut g = Gen(42);
    let scales = [65536.0f32, 1.0, 2.0f32.powi(-24), 3.0e38, f32::MAX, 1.0e-38, 1.5, 0.75, 2.0f32.powi(24), 1234.567];
    let mut cases = Vec::new();
    for i in 0..400 {
        let interval = g.pick(&[1, 2, 3, 5, 2000]);
        let hysteresis = g.pick(&[1, 1, 2, 3]);
        let scale = g.pick(&scales);
        let rule = ScaleRule {
            growth_factor: g.pick(&[2.0, 2.0, 1.5, 1.0000001, 3.7, 1.0]),
            backoff_factor: g.pick(&[0.5, 0.5, 0.25, 0.9999, 0.1]),
            growth_interval: interval,
            // Floors and ceilings at, around and away from the scale.
            min_scale: g.pick(&[None, None, Some(1.0), Some(scale), Some(scale * 0.75), Some(2.0f32.powi(-20))]),
            max_scale: g.pick(&[None, None, Some(65536.0), Some(scale), Some(scale * 1.5), Some(2.0f32.powi(24))]),
            hysteresis,
            set_scale: if i % 17 == 0 { Some(g.pick(&[8.0f32, 0.5, 123.25])) } else { None },
        };
        let n = g.pick(&[1usize, 2, 5]);
        let mut flags = vec![0.0f32; n];
        if g.below(2) == 0 {
            let k = g.below(n as u64) as usize;
            flags[k] = 1.0;
        }
        // Growth trackers at the interval's edge (one short of it, two short) and elsewhere.
        let tracker = match g.below(4) {
            0 => (interval - 1) as f64,
            1 => (interval - 2).max(0) as f64,
            2 => 0.0,
            _ => g.below(interval as u64) as f64,
        };
        let hyst = g.below(hysteresis as u64 + 1) as f64;
        let state = [scale as f64, tracker, hyst, g.below(4) as f64, g.below(3) as f64];
        cases.push(ScaleCase { rule, flags, state });
    }
    cases
}

fn clip_cases() -> Vec<(f32, Vec<f32>)> {
    let mut g = Gen(7);
    let values = [0.0f32, 1.0, 3.0, 4.0, 0.5, 1e-7, 1e-20, 1e19, 3.0e38, 123.456, 0.999_999, f32::INFINITY, f32::NAN];
    let mut cases = Vec::new();
    for _ in 0..200 {
        let n = 1 + g.below(5) as usize;
        let norms = (0..n)
            .map(|_| if g.below(3) == 0 { g.pick(&values) } else { (g.next() >> 40) as f32 / (1u64 << 20) as f32 })
            .collect();
        cases.push((g.pick(&[1.0f32, 0.5, 5.0, 1e-3, 100.0]), norms));
    }
    cases
}

/// One dropout case: its input line, what the CPU backend's dropout gives (the expected bits in
/// logical order) and a label.
struct DropoutCase {
    line: String,
    want: Vec<u64>,
    label: String,
}

/// Dropout at `E` as the CPU computes it (`Tensor::dropout` with a seeded `Rng`: the seed is the
/// generator's first draw) and as the kernel is launched (`launch::dropout_launch`): three
/// chunks of 16,384 values contiguous, and a transposed view; NaN and infinities among the
/// values (a multiply: NaN stays NaN when dropped).
fn dropout_cases<E: amp_core::Precision>(g: &mut Gen, cases: &mut Vec<DropoutCase>) {
    for (n, rows, transposed, p, seed) in
        [(40_000usize, 0usize, false, 0.1f64, 7u64), (2_000, 0, false, 0.5, 8), (1_000, 25, true, 0.9, 9)]
    {
        let cols = if transposed { n / rows } else { 0 };
        let mut xs: Vec<E> =
            (0..n).map(|_| E::from_f64(((g.next() >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 8.0)).collect();
        xs[3] = E::from_f64(f64::NAN);
        xs[5] = E::from_f64(f64::INFINITY);
        xs[n - 1] = E::from_f64(-0.0);
        // The storage is [cols, rows] for the transposed view [rows, cols].
        let x = if transposed {
            Tensor::<E>::from_vec(xs.clone(), &[cols, rows]).t()
        } else {
            Tensor::from_vec(xs.clone(), &[n])
        };
        let y = x.dropout(p, true, &mut amp_core::Rng::seed(seed));
        let want = y.to_vec().into_iter().map(bits_of).collect();
        let (cfg, thr, scale) = launch::dropout_launch(n, p);
        let kernel_seed = amp_core::Rng::seed(seed).next_u64();
        let mut line = format!(
            "dropout {} {n:x} {rows:x} {cols:x} {:x} {:x} {:x} {thr:x} {:016x} {kernel_seed:x}",
            E::DTYPE,
            transposed as i32,
            cfg.grid_dim.0,
            cfg.block_dim.0,
            scale.to_bits()
        );
        for v in &xs {
            write!(line, " {:x}", bits_of(*v)).unwrap();
        }
        let view = if transposed { format!("transposed [{rows}, {cols}]") } else { format!("[{n}]") };
        cases.push(DropoutCase { line, want, label: format!("dropout_fwd_{} {view} p {p}", E::DTYPE) });
    }
}

#[test]
fn the_amp_step_and_optimizer_kernels_match_the_cpu_when_emulated_on_the_host() {
    let scale = scale_cases();
    let clip = clip_cases();
    let mut input = String::new();
    for c in &scale {
        let r = &c.rule;
        let f32h = |v: Option<f32>| format!("{} {:08x}", v.is_some() as i32, v.unwrap_or(0.0).to_bits());
        write!(
            input,
            "scale {:016x} {:016x} {:x} {} {} {:x} {:x} {:08x} {:x}",
            r.growth_factor.to_bits(),
            r.backoff_factor.to_bits(),
            r.growth_interval,
            f32h(r.min_scale),
            f32h(r.max_scale),
            r.hysteresis,
            r.set_scale.is_some() as i32,
            r.set_scale.unwrap_or(0.0).to_bits(),
            c.flags.len()
        )
        .unwrap();
        for f in &c.flags {
            write!(input, " {:08x}", f.to_bits()).unwrap();
        }
        for s in &c.state {
            write!(input, " {:016x}", s.to_bits()).unwrap();
        }
        input.push('\n');
    }
    for (max_norm, norms) in &clip {
        write!(input, "clip {:08x} {:x}", max_norm.to_bits(), norms.len()).unwrap();
        for n in norms {
            write!(input, " {:08x}", n.to_bits()).unwrap();
        }
        input.push('\n');
    }
    let mut dropout = Vec::new();
    let mut g = Gen(11);
    dropout_cases::<f32>(&mut g, &mut dropout);
    dropout_cases::<f16>(&mut g, &mut dropout);
    dropout_cases::<bf16>(&mut g, &mut dropout);
    dropout_cases::<f64>(&mut g, &mut dropout);
    for c in &dropout {
        input.push_str(&c.line);
        input.push('\n');
    }
    let Some(run) = emulated::run("amp_step.cpp", &[], &input) else { return };
    let mut answers = run.stdout.lines().filter(|l| l.starts_with("scale ") || l.starts_with("clip "));
    let mut wrong = Vec::new();
    let hex = |s: &str| u64::from_str_radix(s, 16).expect("a hex answer");
    for c in &scale {
        let Some(line) = answers.next() else { break };
        let got: Vec<u64> = line.split_whitespace().skip(1).map(hex).collect();
        let mut want = c.state;
        c.rule.apply(&mut want, c.flags.iter().any(|&f| f != 0.0));
        let want: Vec<u64> = want.iter().map(|v| v.to_bits()).collect();
        if got != want {
            let show = |v: &[u64]| v.iter().map(|&b| f64::from_bits(b)).collect::<Vec<_>>();
            wrong.push(format!(
                "update_scale {:?}, flags {:?}, state {:?}: kernel {:?}, cpu {:?}",
                c.rule,
                c.flags,
                c.state,
                show(&got),
                show(&want)
            ));
        }
    }
    for (max_norm, norms) in &clip {
        let Some(line) = answers.next() else { break };
        let got: Vec<u32> = line.split_whitespace().skip(1).map(|s| hex(s) as u32).collect();
        let total = total_norm(norms);
        let want = [total.to_bits(), clip_coefficient(total, *max_norm).to_bits()];
        if got != want {
            wrong.push(format!(
                "clip_coefficient norms {norms:?}, max_norm {max_norm}: kernel {:?}, cpu [{total}, {}]",
                got.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>(),
                clip_coefficient(total, *max_norm)
            ));
        }
    }
    // Dropout: the kernel's mask is the CPU's, bit for bit (backward regenerates it from the
    // seed on either device).
    let dropout_answers: Vec<&str> = run.stdout.lines().filter(|l| l.starts_with("dropout ")).collect();
    for (c, line) in dropout.iter().zip(&dropout_answers) {
        let got: Vec<u64> = line.split_whitespace().skip(1).map(hex).collect();
        let differ = got.iter().zip(&c.want).filter(|(a, b)| a != b).count();
        if got.len() != c.want.len() || differ > 0 {
            let at = got.iter().zip(&c.want).position(|(a, b)| a != b).unwrap_or(0);
            wrong.push(format!(
                "{}: {differ} of {} values differ from the CPU's (first at {at}: kernel {:x}, cpu {:x})",
                c.label,
                c.want.len(),
                got.get(at).copied().unwrap_or(0),
                c.want.get(at).copied().unwrap_or(0)
            ));
        }
    }
    assert_eq!(
        dropout_answers.len(),
        dropout.len(),
        "the runner answered {} of the dropout cases",
        dropout_answers.len()
    );
    println!(
        "{}",
        run.stdout
            .lines()
            .filter(|l| !l.starts_with("scale ") && !l.starts_with("clip ") && !l.starts_with("dropout "))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let answered = run.stdout.lines().filter(|l| l.starts_with("scale ") || l.starts_with("clip ")).count();
    assert_eq!(
        answered,
        scale.len() + clip.len(),
        "the runner answered {answered} of the oracle's cases:\n{}",
        run.stderr
    );
    assert!(
        wrong.is_empty(),
        "{} of {} scaler and dropout case(s) differ from the CPU bit for bit:\n{}",
        wrong.len(),
        answered + dropout.len(),
        wrong.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
    println!(
        "update_scale and clip_coefficient: {answered} case(s), dropout: {} case(s), bit for bit as the CPU",
        dropout.len()
    );
    assert!(
        run.success && run.stdout.contains("\n0 of "),
        "the emulated AMP-step kernels disagree with their references (FAIL lines above):\n{}",
        run.stderr
    );
}

/// Every kernel entry point of `src/kernels/*.cu` is launched by some runner here (named in a
/// runner's source), so a kernel added without an emulated case fails this test; the generated
/// elementwise maps (`NAME##_fwd`, `cast_to_##DST..`) are checked by the maps test against the
/// catalog instead. Reads sources only: no C++ compiler needed.
#[test]
fn every_kernel_entry_point_has_an_emulated_case() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let read_dir = |sub: &str, ext: &str| -> Vec<(String, String)> {
        let Ok(entries) = std::fs::read_dir(dir.join(sub)) else { return Vec::new() };
        let mut files: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == ext))
            .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap()))
            .collect();
        files.sort();
        files
    };
    let kernels = read_dir("src/kernels", "cu");
    if kernels.is_empty() {
        println!("SKIPPED: the kernel sources are not at {}", dir.display());
        return;
    }
    let runners: String = read_dir("tests/emulated", "cpp").into_iter().map(|(_, text)| text).collect();
    // The maps test (this file) generates the cases of map.cu's kernels, the copy family's too.
    let maps_test = include_str!("kernels_emulated.rs");
    let mut missing = Vec::new();
    let mut entries = 0;
    for (file, text) in &kernels {
        for decl in text.split("__global__ void ").skip(1) {
            let decl = decl.trim_start();
            // `__launch_bounds__(N) name(..)`: the name after the bound.
            let decl = match decl.strip_prefix("__launch_bounds__(") {
                Some(rest) => rest.split_once(')').map_or("", |(_, r)| r).trim_start(),
                None => decl,
            };
            let name = decl.split('(').next().unwrap_or("").trim();
            let stem = name.strip_suffix("_##SUF").unwrap_or(name);
            if file == "map.cu" && stem.contains("##") {
                continue; // generated per op value or cast pair: the maps test checks the catalog's
            }
            // A name built from more macro parameters (`attention_flash_d##D##_fwd`): the runner
            // calls the template the entry point calls (`amp_flash_fwd<T, D>`) instead.
            let body = decl.split_once('{').map_or("", |(_, b)| b);
            let callee = body.split(|c: char| !(c.is_alphanumeric() || c == '_')).find(|w| w.starts_with("amp_"));
            let named = if stem.contains("##") {
                callee.is_some_and(|c| runners.contains(c))
            } else {
                // Launched through a kernel table (`= softmax_fwd_##SUF;`) or called by a full
                // name (`update_scale_fwd_f32(..)`), not merely mentioned in a comment.
                let launched = if name.ends_with("_##SUF") {
                    runners.contains(&format!("{stem}_##SUF"))
                        || ["f32", "f16", "bf16", "f64"].iter().any(|d| runners.contains(&format!("{stem}_{d}(")))
                } else {
                    runners.contains(&format!("{name}("))
                };
                launched || (file == "map.cu" && maps_test.contains(stem))
            };
            entries += 1;
            if !named {
                missing.push(format!("{file}: {stem}"));
            }
        }
    }
    assert!(entries > 40, "found only {entries} kernel entry points: is the parsing still right?");
    assert!(missing.is_empty(), "kernels with no emulated case (tests/emulated/*.cpp):\n{}", missing.join("\n"));
    println!("{entries} kernel entry points, each launched by an emulated case");
}

/// Runs a runner that checks kernels against references on its own (no input, one line per
/// check, `N of M check(s) failed` last) and fails on any failed check.
fn run_checked(source: &str, family: &str) {
    let Some(run) = emulated::run(source, &[], "") else { return };
    println!("{}", run.stdout);
    assert!(
        run.success && run.stdout.contains("\n0 of "),
        "the emulated {family} kernels disagree with their references (FAIL lines above):\n{}",
        run.stderr
    );
}

#[test]
fn the_batch_norm_kernels_match_f64_references_when_emulated_on_the_host() {
    run_checked("batch_norm.cpp", "batch norm");
}

#[test]
fn the_pooling_and_convolution_kernels_match_references_when_emulated_on_the_host() {
    run_checked("pool_conv.cpp", "pooling and convolution");
}

#[test]
fn the_reduction_gathering_and_attention_helper_kernels_match_references_when_emulated_on_the_host() {
    run_checked("reduce_index.cpp", "reduction, gathering and attention helper");
}

// ---- the generated elementwise maps, against the CPU backend ----------------------------------

/// How a kernel's output is checked against the CPU's.
#[derive(Clone, Copy, Debug)]
enum Tol {
    /// Bit for bit (NaN where the CPU has NaN, any payload; the sign of zero checked).
    Exact,
    /// Within this many units in the last place of the output's precision, at the larger of
    /// the CPU's value and the size of the terms the op's formula cancels (see `map_scale`).
    Ulps(f64),
}

/// One launch of a map kernel and what the CPU says it must write.
struct MapCase {
    kernel: String,
    /// What the case is, for messages: the view and the op's parameter.
    what: String,
    /// The runner's input line.
    line: String,
    out: DType,
    want: Vec<f64>,
    /// Per element: the size of the terms the formula cancels (0: the value's own size).
    scale: Vec<f64>,
    /// Per element, for messages: the op's input (`x`, and `g` for a backward), where known.
    inputs: Vec<String>,
    tol: Tol,
}

/// The bits of a value of `E`, as the runner reads them.
fn bits_of<E: amp_core::Precision>(v: E) -> u64 {
    let f = v.to_f64();
    match E::DTYPE {
        DType::F32 => (f as f32).to_bits() as u64,
        DType::F16 => half::f16::from_f64(f).to_bits() as u64,
        DType::BF16 => half::bf16::from_f64(f).to_bits() as u64,
        DType::F64 => f.to_bits(),
    }
}

fn value_of(d: DType, bits: u64) -> f64 {
    match d {
        DType::F32 => f32::from_bits(bits as u32) as f64,
        DType::F16 => half::f16::from_bits(bits as u16).to_f64(),
        DType::BF16 => half::bf16::from_bits(bits as u16).to_f64(),
        DType::F64 => f64::from_bits(bits),
    }
}

/// A unit in the last place of `d` at `v` (the smallest subnormal's near 0).
fn ulp(d: DType, v: f64) -> f64 {
    let (mant, emin) = match d {
        DType::F64 => (52, -1022),
        DType::F32 => (23, -126),
        DType::F16 => (10, -14),
        DType::BF16 => (7, -126),
    };
    let e = if v == 0.0 || !v.is_finite() { emin } else { (v.abs().log2().floor() as i32).max(emin) };
    2f64.powi(e - mant)
}

/// The runner's text for a case: kernel, flag, n, p bits, the shape, views and buffers.
fn case_line(kernel: &str, flag: i32, n: usize, p: u64, shape: &launch_views::Shape, bufs: &[Vec<u64>]) -> String {
    let mut s = format!("case {kernel} {flag:x} {n:x} {p:x} {:x}", shape.dims.len());
    for d in &shape.dims {
        write!(s, " {d:x}").unwrap();
    }
    write!(s, " {:x}", shape.views.len()).unwrap();
    for (off, strides) in &shape.views {
        write!(s, " {off:x}").unwrap();
        for st in strides {
            write!(s, " {st:x}").unwrap();
        }
    }
    write!(s, " {:x}", bufs.len()).unwrap();
    for b in bufs {
        write!(s, " {:x}", b.len()).unwrap();
        for v in b {
            write!(s, " {v:x}").unwrap();
        }
    }
    s
}

/// The kernel arguments `amp_cuda::launch::views` builds, read back for the runner.
mod launch_views {
    pub struct Shape {
        pub dims: Vec<i64>,
        pub views: Vec<(i64, Vec<i64>)>,
    }
    pub fn of(op: &str, shape: &[usize], operands: &[(usize, Vec<usize>)]) -> Shape {
        let (s, vs) = amp_cuda::launch::views(op, shape, operands);
        let dims = s.dims().to_vec();
        let views = vs.iter().map(|v| (v.offset(), v.strides(dims.len()).to_vec())).collect();
        Shape { dims, views }
    }
}

/// Values for an op's inputs: the special values (zeros, ±1, the extremes of `d`, infinities,
/// NaN) and random ones of every size from 2^-14 to 2^8, both signs; `positive` keeps most of
/// them positive (log, sqrt, powf).
fn map_values(g: &mut Gen, d: DType, n: usize, positive: bool) -> Vec<f64> {
    let max = match d {
        DType::F16 => 65504.0,
        DType::BF16 => 3.3895313892515355e38,
        DType::F32 => f32::MAX as f64,
        DType::F64 => f64::MAX,
    };
    let tiny = ulp(d, 0.0);
    let special = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, 1e-3, -1e-3, tiny, -tiny, max, -max];
    let special = special.into_iter().chain([f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 10.0, -10.0, -0.75, 0.75]);
    let mut out: Vec<f64> = special.collect();
    while out.len() < n {
        let mag = 2f64.powf(-14.0 + 22.0 * (g.next() >> 11) as f64 / (1u64 << 53) as f64);
        let neg = if positive { g.below(8) == 0 } else { g.below(2) == 0 };
        out.push(if neg { -mag } else { mag });
    }
    // Shuffled, so the special values land in vector, tail and strided positions alike.
    for i in (1..out.len()).rev() {
        let j = g.below(i as u64 + 1) as usize;
        out.swap(i, j);
    }
    out.truncate(n);
    out
}

fn store_of<E: amp_core::Precision>(v: &[f64]) -> Vec<E> {
    v.iter().map(|&x| E::from_f64(x)).collect()
}

fn bits_all<E: amp_core::Precision>(v: &[E]) -> Vec<u64> {
    v.iter().map(|&x| bits_of(x)).collect()
}

fn f64s<E: amp_core::Precision>(v: &[E]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// A view made by tensor ops on a `base`-shaped tensor (its layout: shape, strides, offset).
fn view_of(base: &[usize], f: impl Fn(Tensor<f32>) -> Tensor<f32>) -> Layout {
    f(Tensor::zeros(base)).layout().clone()
}

/// The views a unary op runs on: (name, storage length, layout). A contiguous run at offset 0
/// whose length is not a whole number of vectors (mode 2 and its scalar tail), the same at
/// offset 1 (mode 1: contiguous, misaligned), and a transpose (mode 0: strided).
fn unary_views() -> Vec<(&'static str, usize, Layout)> {
    vec![
        ("contiguous [301]", 301, Layout::contiguous(&[301])),
        ("offset 1 [301]", 302, view_of(&[302], |t| t.narrow(0, 1, 301))),
        ("transposed [18, 17]", 306, view_of(&[17, 18], |t| t.transpose(0, 1))),
    ]
}

/// The size of the terms that cancel in an op's formula at `x` (with incoming gradient `g` for
/// a backward), in f64: rounding errors of a few ulps in those terms are what two correct
/// implementations may differ by. 0 where nothing cancels (the value's own size is used).
fn map_scale(op: &str, bwd: bool, x: f64, g: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    let scale = match (op, bwd) {
        // 0.5 x (1 + erf(x / √2)): 1 + erf cancels for negative x.
        ("gelu" | "gelu_tanh", false) => x.abs(),
        // Φ(x) + x φ(x): the two cancel near x = -0.75.
        ("gelu", true) => (x * (-0.5 * x * x).exp() * 0.398_942_280_401_432_7).abs().max(1.0),
        // (1 + t) / 2 + x (1 - t²) √(2/π) (1 + 0.134145 x²) / 2 with t = tanh(...): 1 + t and
        // 1 - t² cancel where t nears ±1 (|x| of 2 to 5), leaving the tanh's own error (an
        // ulp of 1) times the factor of 1 - t².
        ("gelu_tanh", true) => (0.5 * x * 0.797_884_560_802_865_4 * (1.0 + 0.134145 * x * x)).abs().max(1.0),
        // σ(x) (1 + x (1 - σ(x))): 1 - σ cancels for large x, and the sum near x = -1.28.
        ("silu", true) => s * x.abs().max(1.0),
        _ => 0.0,
    };
    if scale.is_finite() { scale * if bwd { g.abs() } else { 1.0 } } else { 0.0 }
}

/// The tolerance of a unary op at `d`, and why.
fn unary_tol(op: &str, bwd: bool, d: DType) -> Tol {
    // Exact: the same IEEE operations in the same order on both sides (the derivatives that
    // read `y` are given the same `y`), or correctly rounded functions (sqrt).
    let transcendental = matches!(
        (op, bwd),
        ("gelu" | "gelu_tanh" | "tanh" | "sigmoid" | "silu" | "exp" | "log" | "powf", false)
            | ("gelu" | "gelu_tanh" | "silu" | "powf", true)
    );
    if !transcendental {
        return Tol::Exact;
    }
    match d {
        // The CPU's vectorised exp/tanh/erf/ln are within 1-2 ulps of f32, the C library's
        // within 1: a few ulps apart at the size of the formula's terms.
        DType::F32 => Tol::Ulps(4.0),
        // Computed in f32 a few f32 ulps apart, rounded once: one ulp apart at most.
        DType::F16 | DType::BF16 => Tol::Ulps(1.0),
        DType::F64 => Tol::Ulps(4.0),
    }
}

fn unary_cases<E: amp_core::Precision, O: UnaryOp>(op: O, g: &mut Gen, cases: &mut Vec<MapCase>) {
    let d = E::DTYPE;
    let positive = matches!(O::NAME, "log" | "sqrt" | "powf");
    let cpu = Cpu;
    for (vname, len, l) in unary_views() {
        let n = l.numel();
        let what = format!("{vname} p={}", op.param());
        let full = Layout::contiguous(&[len]);
        let xv = store_of::<E>(&map_values(g, d, len, positive));
        let xs = cpu.from_host(xv.clone());
        // Forward.
        let want: Vec<E> = cpu.to_host(&cpu.unary(op, &xs, &l), &Layout::contiguous(&[n]));
        let sh = launch_views::of(O::NAME, l.shape(), &[(l.offset(), l.strides().to_vec())]);
        let kernel = kernels::kernel_name(&format!("{}_fwd", O::NAME), d);
        let line = case_line(&kernel, l.is_contiguous() as i32, n, op.param().to_bits(), &sh, &[bits_all(&xv)]);
        let xin: Vec<E> = cpu.to_host(&xs, &l);
        let scale = xin.iter().map(|x| map_scale(O::NAME, false, x.to_f64(), 1.0)).collect();
        let tol = unary_tol(O::NAME, false, d);
        let inputs = xin.iter().map(|x| format!("x {:e}", x.to_f64())).collect();
        cases.push(MapCase { kernel, what: what.clone(), line, out: d, want: f64s(&want), scale, inputs, tol });
        // Backward: y = the CPU's forward over the whole storage (so y[i] = f(x[i]) in every
        // view), g random; and once with g contiguous beside strided x and y.
        let ys = cpu.unary(op, &xs, &full);
        let yv: Vec<E> = cpu.to_host(&ys, &full);
        let gvals: Vec<f64> = (0..len).map(|_| (g.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0).collect();
        let gv = store_of::<E>(&gvals);
        let gs = cpu.from_host(gv.clone());
        let mut layouts = vec![(what.clone(), l.clone())];
        if !l.is_contiguous() {
            layouts.push((format!("{what}, g contiguous"), Layout::contiguous(l.shape())));
        }
        for (what, lg) in layouts {
            let want: Vec<E> =
                cpu.to_host(&cpu.unary_backward(op, (&xs, &l), (&ys, &l), (&gs, &lg)), &Layout::contiguous(&[n]));
            let shape = l.shape();
            let op_of = |l: &Layout| (l.offset(), launch::broadcast_strides(l, shape));
            let sh = launch_views::of(O::NAME, shape, &[op_of(&l), op_of(&l), op_of(&lg)]);
            let dense = [&l, &l, &lg].iter().all(|v| v.shape() == shape && v.is_contiguous());
            let kernel = kernels::kernel_name(&format!("{}_bwd", O::NAME), d);
            let bufs = [bits_all(&xv), bits_all(&yv), bits_all(&gv)];
            let line = case_line(&kernel, dense as i32, n, op.param().to_bits(), &sh, &bufs);
            let gin: Vec<E> = cpu.to_host(&gs, &lg);
            let scale = xin.iter().zip(&gin).map(|(x, gg)| map_scale(O::NAME, true, x.to_f64(), gg.to_f64())).collect();
            let tol = unary_tol(O::NAME, true, d);
            let inputs = xin.iter().zip(&gin).map(|(x, g)| format!("x {:e}, g {:e}", x.to_f64(), g.to_f64())).collect();
            cases.push(MapCase { kernel, what, line, out: d, want: f64s(&want), scale, inputs, tol });
        }
    }
}

fn binary_cases<E: amp_core::Precision, O: BinaryOp>(op: O, g: &mut Gen, cases: &mut Vec<MapCase>) {
    let d = E::DTYPE;
    let cpu = Cpu;
    let t = view_of(&[17, 18], |t| t.transpose(0, 1));
    // (what, (a's storage length, layout), (b's), the output's shape).
    let views = [
        ("both contiguous [301]", (301, Layout::contiguous(&[301])), (301, Layout::contiguous(&[301])), vec![301]),
        (
            "both at offset 1 [301]",
            (302, view_of(&[302], |t| t.narrow(0, 1, 301))),
            (302, view_of(&[302], |t| t.narrow(0, 1, 301))),
            vec![301],
        ),
        ("transposed [18, 17] + row [17]", (306, t.clone()), (17, Layout::contiguous(&[17])), vec![18, 17]),
        ("column [18, 1] + transposed [18, 17]", (18, Layout::contiguous(&[18, 1])), (306, t), vec![18, 17]),
    ];
    for (what, (la_len, la), (lb_len, lb), shape) in views {
        let n: usize = shape.iter().product();
        let av = store_of::<E>(&map_values(g, d, la_len, false));
        let bv = store_of::<E>(&map_values(g, d, lb_len, false));
        let (a, b) = (cpu.from_host(av.clone()), cpu.from_host(bv.clone()));
        let want: Vec<E> = cpu.to_host(&cpu.binary(op, (&a, &la), (&b, &lb), &shape), &Layout::contiguous(&[n]));
        let (sa, sb) = (launch::broadcast_strides(&la, &shape), launch::broadcast_strides(&lb, &shape));
        let dense = [&la, &lb].iter().all(|l| l.shape() == shape && l.is_contiguous());
        let sh = launch_views::of(O::NAME, &shape, &[(la.offset(), sa), (lb.offset(), sb)]);
        let kernel = kernels::kernel_name(&format!("{}_fwd", O::NAME), d);
        let line = case_line(&kernel, dense as i32, n, op.param().to_bits(), &sh, &[bits_all(&av), bits_all(&bv)]);
        // Exact: add, sub, mul, div and (a - b) * c are the same IEEE operations on both sides.
        let what = format!("{what} p={}", op.param());
        let (scale, inputs) = (vec![0.0; n], vec![]);
        cases.push(MapCase { kernel, what, line, out: d, want: f64s(&want), scale, inputs, tol: Tol::Exact });
    }
}

/// Values for a cast from `d`: random bit patterns (every NaN, infinity, subnormal and rounding
/// tie of a 16-bit type shows up), and for f32 and f64 values of every size around the f16 and
/// bf16 ranges, with random low bits (ties and overflow when narrowing).
fn cast_values(g: &mut Gen, d: DType, n: usize) -> Vec<f64> {
    let mut out = map_values(g, d, n / 4, false);
    while out.len() < n {
        let v = match d {
            DType::F16 => half::f16::from_bits(g.next() as u16).to_f64(),
            DType::BF16 => half::bf16::from_bits(g.next() as u16).to_f64(),
            _ => {
                let e = g.below(90) as i32 - 45;
                let m = 1.0 + (g.next() >> 11) as f64 / (1u64 << 53) as f64;
                let v = m * 2f64.powi(e) * if g.below(2) == 0 { -1.0 } else { 1.0 };
                if d == DType::F32 { v as f32 as f64 } else { v }
            }
        };
        out.push(v);
    }
    out
}

fn cast_cases<S: amp_core::Precision, D: amp_core::Precision>(g: &mut Gen, cases: &mut Vec<MapCase>) {
    let cpu = Cpu;
    for (vname, len, l) in unary_views() {
        let n = l.numel();
        let xv = store_of::<S>(&cast_values(g, S::DTYPE, len));
        let want: Vec<D> = cpu.to_host(&cpu.cast::<S, D>(&cpu.from_host(xv.clone()), &l), &Layout::contiguous(&[n]));
        let sh = launch_views::of("cast", l.shape(), &[(l.offset(), l.strides().to_vec())]);
        let kernel = kernels::cast_kernel(S::DTYPE, D::DTYPE);
        let line = case_line(&kernel, l.is_contiguous() as i32, n, 0, &sh, &[bits_all(&xv)]);
        // Exact: one correct rounding on both sides.
        let (what, scale) = (vname.to_string(), vec![0.0; n]);
        let inputs =
            cpu.to_host(&cpu.from_host(xv.clone()), &l).iter().map(|x| format!("x {:e}", x.to_f64())).collect();
        cases.push(MapCase { kernel, what, line, out: D::DTYPE, want: f64s(&want), scale, inputs, tol: Tol::Exact });
    }
}

/// copy (strided views only: the backend copies dense ones with a memcpy), fill, write_into
/// (copy and add, into a transposed view, from a contiguous and a broadcast source) and where
/// (the mask, a and b broadcast in turn).
fn copy_cases<E: amp_core::Precision>(g: &mut Gen, cases: &mut Vec<MapCase>) {
    let d = E::DTYPE;
    let cpu = Cpu;
    let exact = |kernel: String, what: &str, line: String, want: Vec<E>| MapCase {
        kernel,
        what: what.to_string(),
        line,
        out: d,
        scale: vec![0.0; want.len()],
        inputs: vec![],
        want: f64s(&want),
        tol: Tol::Exact,
    };
    let t = view_of(&[17, 18], |t| t.transpose(0, 1));
    let copies = [
        ("transposed [18, 17]", 306, t.clone()),
        ("broadcast row [17] to [18, 17]", 17, view_of(&[17], |t| t.broadcast_to(&[18, 17]))),
        ("narrowed transpose [9, 17]", 306, view_of(&[17, 18], |t| t.transpose(0, 1).narrow(0, 5, 9))),
    ];
    for (what, len, l) in copies {
        let xv = store_of::<E>(&map_values(g, d, len, false));
        let n = l.numel();
        let want: Vec<E> = cpu.to_host(&cpu.contiguous(&cpu.from_host(xv.clone()), &l), &Layout::contiguous(&[n]));
        let sh = launch_views::of("contiguous", l.shape(), &[(l.offset(), l.strides().to_vec())]);
        let kernel = kernels::kernel_name("copy_fwd", d);
        cases.push(exact(kernel.clone(), what, case_line(&kernel, 0, n, 0, &sh, &[bits_all(&xv)]), want));
    }
    for v in [1.5, -0.0, f64::NAN, f64::NEG_INFINITY, std::f64::consts::PI, 1e-40, 7e4] {
        let n = 300;
        let value = E::from_f64(v);
        let want: Vec<E> = cpu.to_host(&cpu.full(n, value), &Layout::contiguous(&[n]));
        let sh = launch_views::Shape { dims: vec![], views: vec![] };
        let kernel = kernels::kernel_name("fill_fwd", d);
        cases.push(exact(kernel.clone(), &format!("{v}"), case_line(&kernel, 0, n, bits_of(value), &sh, &[]), want));
    }
    let sources = [
        ("contiguous source", 306, Layout::contiguous(&[18, 17])),
        ("broadcast source", 17, view_of(&[17], |t| t.broadcast_to(&[18, 17]))),
    ];
    for add in [false, true] {
        for (sname, slen, sl) in &sources {
            let dv = store_of::<E>(&map_values(g, d, 306, false));
            let sv = store_of::<E>(&map_values(g, d, *slen, false));
            let mut dst = cpu.from_host(dv.clone());
            cpu.write_into(&mut dst, &t, &cpu.from_host(sv.clone()), sl, add);
            let want: Vec<E> = cpu.to_host(&dst, &Layout::contiguous(&[306]));
            let sh = launch_views::of(
                "write_into",
                t.shape(),
                &[(t.offset(), t.strides().to_vec()), (sl.offset(), sl.strides().to_vec())],
            );
            let kernel = kernels::kernel_name("write_into_fwd", d);
            let line = case_line(&kernel, add as i32, t.numel(), 0, &sh, &[bits_all(&dv), bits_all(&sv)]);
            let what = format!("into a transpose, {sname}, add {add}");
            cases.push(exact(kernel, &what, line, want));
        }
    }
    let shape = [18usize, 17];
    let wheres = [
        ("mask [18, 17], a transposed, b row [17]", vec![18, 17], (306, t.clone()), (17, Layout::contiguous(&[17]))),
        (
            "mask row [17], a [18, 17], b column [18, 1]",
            vec![17],
            (306, Layout::contiguous(&[18, 17])),
            (18, Layout::contiguous(&[18, 1])),
        ),
    ];
    for (what, mshape, (alen, la), (blen, lb)) in wheres {
        let mlen: usize = mshape.iter().product();
        let mask: Vec<bool> = (0..mlen).map(|_| g.below(2) == 0).collect();
        let av = store_of::<E>(&map_values(g, d, alen, false));
        let bv = store_of::<E>(&map_values(g, d, blen, false));
        let out =
            cpu.select((&mask, &mshape), (&cpu.from_host(av.clone()), &la), (&cpu.from_host(bv.clone()), &lb), &shape);
        let want: Vec<E> = cpu.to_host(&out, &Layout::contiguous(&[306]));
        let lm = Layout::contiguous(&mshape);
        let sh = launch_views::of(
            "where",
            &shape,
            &[
                (0, launch::broadcast_strides(&lm, &shape)),
                (la.offset(), launch::broadcast_strides(&la, &shape)),
                (lb.offset(), launch::broadcast_strides(&lb, &shape)),
            ],
        );
        let kernel = kernels::kernel_name("where_fwd", d);
        let bufs = [mask.iter().map(|&m| m as u64).collect(), bits_all(&av), bits_all(&bv)];
        cases.push(exact(kernel.clone(), what, case_line(&kernel, 0, 306, 0, &sh, &bufs), want));
    }
}

/// Every program the backend builds for the maps (as `kernels::catalog` lists them), with the
/// runner's launcher for each kernel.
fn map_programs() -> Vec<(Program, Vec<&'static str>)> {
    let mut out = Vec::new();
    for p in kernels::catalog() {
        let launchers: Vec<&'static str> = p
            .kernels
            .iter()
            .map(|k| {
                let stem = k.rsplit_once('_').unwrap().0;
                if stem.starts_with("cast_to_") {
                    "cast"
                } else if kernels::unary_ops().iter().any(|o| stem == format!("{}_fwd", o.name)) {
                    "unary_fwd"
                } else if kernels::unary_ops().iter().any(|o| stem == format!("{}_bwd", o.name)) {
                    "unary_bwd"
                } else if kernels::binary_ops().iter().any(|o| stem == format!("{}_fwd", o.0)) {
                    "binary"
                } else {
                    match stem {
                        "copy_fwd" => "copy",
                        "fill_fwd" => "fill",
                        "write_into_fwd" => "write_into",
                        "where_fwd" => "where",
                        _ => "",
                    }
                }
            })
            .collect();
        if launchers.iter().all(|l| !l.is_empty()) {
            out.push((p, launchers));
        }
    }
    out
}

/// The runner's generated part: each program minus the prelude in a namespace of its own, and
/// the table of launchers.
fn maps_generated(programs: &[(Program, Vec<&'static str>)]) -> String {
    let mut src = String::from("// Generated by tests/kernels_emulated.rs from amp_cuda::kernels: do not edit.\n");
    let mut table =
        String::from("inline std::vector<std::pair<std::string, Launcher>> amp_map_kernels() {\n    return {\n");
    for (p, launchers) in programs {
        let body =
            p.source.strip_prefix(kernels::PRELUDE).unwrap_or_else(|| panic!("{} starts with the prelude", p.name));
        writeln!(src, "namespace amp_prog_{} {{\n{body}\n}}  // namespace amp_prog_{}", p.name, p.name).unwrap();
        for (k, l) in p.kernels.iter().zip(launchers) {
            writeln!(table, "        {{\"{k}\", {l}(&amp_prog_{}::{k})}},", p.name).unwrap();
        }
    }
    table.push_str("    };\n}\n");
    src + &table
}

#[test]
fn the_elementwise_maps_match_the_cpu_backend_when_emulated_on_the_host() {
    use amp_core::ops::{binary as b, loss, unary as u};
    let programs = map_programs();
    let mut g = Gen(2024);
    let mut cases = Vec::new();
    macro_rules! each_dtype {
        ($f:ident($op:expr)) => {
            $f::<f32, _>($op, &mut g, &mut cases);
            $f::<f16, _>($op, &mut g, &mut cases);
            $f::<bf16, _>($op, &mut g, &mut cases);
            $f::<f64, _>($op, &mut g, &mut cases);
        };
    }
    each_dtype!(unary_cases(u::Neg));
    each_dtype!(unary_cases(u::Relu));
    each_dtype!(unary_cases(u::Gelu));
    each_dtype!(unary_cases(u::GeluTanh));
    each_dtype!(unary_cases(u::Square));
    each_dtype!(unary_cases(u::Tanh));
    each_dtype!(unary_cases(u::Sigmoid));
    each_dtype!(unary_cases(u::Silu));
    each_dtype!(unary_cases(u::Exp));
    each_dtype!(unary_cases(u::Log));
    each_dtype!(unary_cases(u::Sqrt));
    for p in [3.0, 0.5, -1.5] {
        each_dtype!(unary_cases(u::Powf(p)));
    }
    each_dtype!(unary_cases(u::AddScalar(0.1)));
    each_dtype!(unary_cases(u::MulScalar(-3.7)));
    each_dtype!(unary_cases(u::DivScalar(3.0)));
    each_dtype!(unary_cases(u::ScalarDiv(2.5)));
    each_dtype!(binary_cases(b::Add));
    each_dtype!(binary_cases(b::Sub));
    each_dtype!(binary_cases(b::Mul));
    each_dtype!(binary_cases(b::Div));
    each_dtype!(binary_cases(loss::ScaledDiff(0.37)));
    macro_rules! casts_from {
        ($s:ty) => {
            cast_cases::<$s, f32>(&mut g, &mut cases);
            cast_cases::<$s, f16>(&mut g, &mut cases);
            cast_cases::<$s, bf16>(&mut g, &mut cases);
            cast_cases::<$s, f64>(&mut g, &mut cases);
        };
    }
    let before = cases.len();
    casts_from!(f32);
    casts_from!(f16);
    casts_from!(bf16);
    casts_from!(f64);
    // Casts to the same precision are copies: the backend never launches a kernel for them.
    let all_kernels: Vec<&String> = programs.iter().flat_map(|p| &p.0.kernels).collect();
    let mut i = before;
    while i < cases.len() {
        if all_kernels.contains(&&cases[i].kernel) {
            i += 1
        } else {
            cases.remove(i);
        }
    }
    copy_cases::<f32>(&mut g, &mut cases);
    copy_cases::<f16>(&mut g, &mut cases);
    copy_cases::<bf16>(&mut g, &mut cases);
    copy_cases::<f64>(&mut g, &mut cases);
    // Every kernel of every map program gets a case.
    let untested: Vec<&&String> = all_kernels.iter().filter(|k| !cases.iter().any(|c| &c.kernel == **k)).collect();
    assert!(untested.is_empty(), "map kernels without a case: {untested:?}");

    let input: String = cases.iter().map(|c| format!("{}\n", c.line)).collect();
    let generated = [("maps_generated.inc", maps_generated(&programs))];
    let Some(run) = emulated::run_generated("maps.cpp", &generated, &[], &input) else { return };
    println!("compiled in {:.1} s, ran {} case(s) in {:.1} s", run.compile_s, cases.len(), run.run_s);
    assert!(run.success, "the maps runner failed:\n{}", run.stderr);
    let outs: Vec<&str> = run.stdout.lines().filter(|l| l.starts_with("out ") || l.starts_with("unknown ")).collect();
    assert_eq!(outs.len(), cases.len(), "the runner answered {} of {} cases:\n{}", outs.len(), cases.len(), run.stderr);
    // kernel -> (worst error, its tolerance, cases)
    let mut worst: std::collections::BTreeMap<String, (f64, Tol, usize)> = Default::default();
    let mut wrong = Vec::new();
    for (c, line) in cases.iter().zip(outs) {
        let mut words = line.split_whitespace();
        let tag = words.next().unwrap();
        assert_eq!((tag, words.next()), ("out", Some(c.kernel.as_str())), "the runner has no kernel {}", c.kernel);
        let got: Vec<f64> = words.skip(1).map(|w| value_of(c.out, u64::from_str_radix(w, 16).unwrap())).collect();
        assert_eq!(
            got.len(),
            c.want.len(),
            "{} ({}): {} values, the CPU {}",
            c.kernel,
            c.what,
            got.len(),
            c.want.len()
        );
        let mut bad = Vec::new();
        let mut case_worst = 0.0f64;
        for (i, ((&x, &w), &s)) in got.iter().zip(&c.want).zip(&c.scale).enumerate() {
            let err = if w.is_nan() || x.is_nan() {
                if w.is_nan() && x.is_nan() { 0.0 } else { f64::INFINITY }
            } else if matches!(c.tol, Tol::Exact) || !w.is_finite() || !x.is_finite() {
                if x.to_bits() == w.to_bits() { 0.0 } else { f64::INFINITY }
            } else {
                (x - w).abs() / ulp(c.out, w.abs().max(s))
            };
            let tol = match c.tol {
                Tol::Exact => 0.0,
                Tol::Ulps(u) => u,
            };
            case_worst = case_worst.max(err);
            if err > tol {
                let at = c.inputs.get(i).map(|s| format!(" at {s}")).unwrap_or_default();
                bad.push(format!("[{i}]{at}: kernel {x:e}, cpu {w:e} ({err:.1} ulps)"));
            }
        }
        let e = worst.entry(c.kernel.clone()).or_insert((0.0, c.tol, 0));
        e.0 = e.0.max(case_worst);
        e.2 += 1;
        if !bad.is_empty() {
            wrong.push(format!(
                "{} ({}, tolerance {:?}): {} of {} values differ from the CPU: {}",
                c.kernel,
                c.what,
                c.tol,
                bad.len(),
                got.len(),
                bad.iter().take(4).cloned().collect::<Vec<_>>().join("; ")
            ));
        }
    }
    for (k, (w, tol, n)) in &worst {
        println!("{k:<28} {n} case(s), worst {w:.2} ulps (tolerance {tol:?})");
    }
    assert!(
        wrong.is_empty(),
        "{} of {} map case(s) disagree with the CPU backend:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    println!("{} map kernel(s), {} case(s): as the CPU backend", worst.len(), cases.len());
}
