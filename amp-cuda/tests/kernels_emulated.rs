//! The row, AMP-step, optimizer, batch norm, pooling, convolution, reduction, gathering and
//! attention-helper kernels run on this machine, GPU or not, under the host
//! emulation of CUDA (`tests/emulated/cuda_emu.hpp`, with the real prelude), launched as the
//! backend launches them (variant, threads, grid, dynamic shared memory; the runners name the
//! backend function each case follows):
//! - `tests/emulated/rows.cpp`: softmax and log-softmax, layer norm and RMS norm (with the weight
//!   and bias gradients), cross-entropy, forward and backward, block-per-row and warp-per-row,
//!   vectorised and scalar, the row cached in dynamic shared memory or not (at the cache's edge:
//!   a row of exactly `ROW_SMEM` bytes and one value more), at f32, f16, bf16 and f64, against f64
//!   references with per-precision tolerances.
//! - `tests/emulated/amp_step.cpp`: the multi-tensor unscale and non-finite check, the gradient
//!   norm, scale and clamp, SGD and Adam/AdamW (bit for bit against the CPU optimizer's
//!   arithmetic, and a step with found-inf set changes nothing), the bf16 writes; and, from
//!   cases this test writes to its standard input, `update_scale` and `clip_coefficient`
//!   compared bit for bit with the CPU's [`ScaleRule::apply`] and [`clip_coefficient`].
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
//!   against it here with the other launch rules), NaN and -inf; arg max / arg min with NaNs and ties and the selection's
//!   scatter, bit for bit; the embedding gather, `cat` and the scatter-add (bit for bit in the
//!   CPU's order); the cuBLAS path's attention helpers (probabilities under the causal mask and
//!   log-sum-exps, g·out, score gradients) for blocks of query rows after the first; at f32,
//!   f16, bf16 and f64.
//!
//! What it cannot check: the hardware (real shared-memory and register limits are `tests/ptx.rs`'s,
//! real f16 conversions and transcendental functions, timing), and races that the emulation's
//! barriers and its one-block-at-a-time schedule hide (see the design notes of
//! `cuda_emu.hpp`); the parity suite runs the kernels on a GPU.
//!
//! It needs a C++20 compiler (`$CXX`, else `c++`); without one it prints `SKIPPED` and passes,
//! unless `AMP_CUDA_REQUIRE_CXX=1` (CI sets it): see `tests/emulated/mod.rs`.

mod emulated;

use amp_core::backend::{ScaleRule, clip_coefficient, total_norm};
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
    println!(
        "{}",
        run.stdout
            .lines()
            .filter(|l| !l.starts_with("scale ") && !l.starts_with("clip "))
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
        "{} of {} scaler case(s) differ from the CPU bit for bit:\n{}",
        wrong.len(),
        answered,
        wrong.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
    println!("update_scale and clip_coefficient: {answered} case(s), bit for bit as the CPU");
    assert!(
        run.success && run.stdout.contains("\n0 of "),
        "the emulated AMP-step kernels disagree with their references (FAIL lines above):\n{}",
        run.stderr
    );
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
