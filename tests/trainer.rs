//! The training job end to end on small runs: exact resume, skipped steps on NaN, a clear
//! stop when the loss scale collapses, bad options refused, metrics that survive a SIGKILL,
//! interrupts that save, runs that do not overwrite each other.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use amp::checkpoint::{TrainingState, checkpoint_exists, read_checkpoint_state, read_weights};
use amp::optim::{AdamState, OptimizerState};
use amp::train_utils::read_metrics;
use amp::trainer::{LOCK_FILE, ModelSize, READ_EVERY, RunPrecision, TrainConfig, run, run_on};

// The second device of amp-core's tests: its own storage, every kernel through the backend
// trait, host reads counted.
#[path = "../amp-core/tests/common/mirror.rs"]
mod mirror;
use mirror::Mirror;

/// A fresh run folder for one test, under cargo's per-target scratch dir (as amp-core's tests
/// keep theirs): emptied when the test starts, overwritten by the next run, never piling up
/// in the system's temp dir.
fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("trainer").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn small(out: &Path, precision: RunPrecision) -> TrainConfig {
    TrainConfig {
        precision,
        steps: 12,
        batch_size: 8,
        model: ModelSize::Tiny,
        out_dir: out.to_path_buf(),
        checkpoint_every: 100,
        dropout: 0.1, // exercises the RNG state in the checkpoint
        progress: false,
        ..TrainConfig::default()
    }
}

/// The step of the checkpoint in `dir`.
fn checkpoint_step(dir: &Path) -> amp::Result<u64> {
    let (state, _): (TrainingState, _) = read_checkpoint_state(dir)?;
    Ok(state.step)
}

fn weights_bits(out: &Path) -> Vec<(String, Vec<u32>)> {
    read_weights(out.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(name, t)| (name, t.to_tensor().to_vec().iter().map(|v| v.to_bits()).collect()))
        .collect()
}

#[test]
fn n_steps_equal_half_plus_resume_plus_half_bit_for_bit() {
    for precision in [RunPrecision::F16, RunPrecision::Bf16] {
        let straight = tmp(&format!("straight-{precision:?}"));
        run(&small(&straight, precision)).unwrap();

        let resumed = tmp(&format!("resumed-{precision:?}"));
        run(&TrainConfig { stop_after: Some(6), ..small(&resumed, precision) }).unwrap();
        run(&TrainConfig { resume: true, ..small(&resumed, precision) }).unwrap();

        let (a, b) = (weights_bits(&straight), weights_bits(&resumed));
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(va == vb, "{precision:?}: parameter {na} differs after resume");
        }
        // The metrics of the resumed run continue the same rows.
        let (ma, mb) =
            (read_metrics(straight.join("metrics.csv")).unwrap(), read_metrics(resumed.join("metrics.csv")).unwrap());
        assert_eq!(ma.len(), 12);
        assert_eq!(mb.len(), 12);
        for (x, y) in ma.iter().zip(&mb) {
            assert_eq!((x.step, x.loss.to_bits(), x.scale), (y.step, y.loss.to_bits(), y.scale));
        }
    }
}

#[test]
fn nan_steps_are_skipped_and_training_continues() {
    let out = tmp("nan");
    let report = run(&TrainConfig { inject_nonfinite: vec![3, 4], ..small(&out, RunPrecision::F16) }).unwrap();
    assert_eq!(report.skipped, 2);
    let rows = read_metrics(out.join("metrics.csv")).unwrap();
    assert_eq!(rows.len(), 12, "the run went on to the end");
    assert!(rows[2].skipped && rows[3].skipped && !rows[4].skipped);
    assert_eq!((rows[2].scale, rows[3].scale, rows[4].scale), (65536.0, 32768.0, 16384.0));
    assert!(report.last_loss.is_finite());
}

#[test]
fn a_collapsing_scale_stops_training_with_an_explanation() {
    let out = tmp("collapse");
    let cfg = TrainConfig {
        inject_nonfinite: (1..=40).collect(),
        steps: 40,
        min_scale: 1024.0,
        ..small(&out, RunPrecision::F16)
    };
    let err = run(&cfg).unwrap_err().to_string();
    // 65536 -> 1024 takes 6 overflows; then 20 in a row at the floor (steps 7..=26).
    assert!(err.contains("training stopped at step 26"), "{err}");
    assert!(err.contains("loss scale collapsed"), "{err}");
    assert!(err.contains("20 steps in a row overflowed"), "{err}");
    assert!(err.contains("26 overflowing steps in a row"), "{err}");
    assert!(err.contains("bf16"), "the message suggests a way out: {err}");
}

#[test]
fn scattered_overflows_at_the_floor_do_not_stop_an_f16_run() {
    // 65536 -> 16384 after two overflows; every later one is at the floor, but good steps
    // come between them.
    let out = tmp("scattered");
    let cfg = TrainConfig {
        inject_nonfinite: (1..=8).map(|i| 5 * i).collect(),
        steps: 40,
        min_scale: 16384.0,
        ..small(&out, RunPrecision::F16)
    };
    let report = run(&cfg).unwrap();
    assert_eq!((report.steps, report.skipped), (40, 8));
    assert_eq!(report.final_scale, 16384.0);
}

#[test]
fn every_step_skipped_stops_bf16_and_f32_too() {
    for precision in [RunPrecision::Bf16, RunPrecision::F32] {
        let out = tmp(&format!("all-nan-{precision:?}"));
        let cfg = TrainConfig {
            inject_nonfinite: (1..=30).collect(),
            steps: 30,
            checkpoint_every: 5,
            ..small(&out, precision)
        };
        let err = run(&cfg).unwrap_err().to_string();
        assert!(err.contains("training stopped at step 20"), "{precision:?}: {err}");
        assert!(err.contains("20 steps all had non-finite"), "{precision:?}: {err}");
        assert!(err.contains("--lr"), "the message gives advice: {err}");
    }
}

#[test]
fn a_learning_rate_beyond_f32_is_refused_up_front() {
    let out = tmp("lr-f32");
    for precision in [RunPrecision::Bf16, RunPrecision::F32, RunPrecision::F16] {
        let err = run(&TrainConfig { lr: 1e300, ..small(&out, precision) }).unwrap_err().to_string();
        assert!(err.contains("`lr`") && err.contains("f32"), "{err}");
    }
    let err = run(&TrainConfig { lr: 1e-50, ..small(&out, RunPrecision::F32) }).unwrap_err().to_string();
    assert!(err.contains("`lr`"), "a rate that rounds to 0 in f32 is refused too: {err}");
    assert!(!out.join("metrics.csv").exists(), "nothing was written");
}

#[test]
fn non_finite_weights_stop_the_run_before_a_checkpoint() {
    // 1e38 is finite in f32, but Adam's first step size, lr × warmup factor (1/2 with 2
    // steps) / (1 - beta1), is not.
    let out = tmp("lr-overflow");
    let cfg = TrainConfig { lr: 1e38, steps: 2, checkpoint_every: 1, ..small(&out, RunPrecision::F32) };
    let err = run(&cfg).unwrap_err().to_string();
    assert!(err.contains("training stopped at step 1"), "{err}");
    assert!(err.contains("inf or NaN") && err.contains("Lower --lr"), "{err}");
    assert!(!checkpoint_exists(out.join("checkpoint")), "the non-finite state was not checkpointed");
    assert!(!out.join("model.safetensors").exists());
}

#[test]
fn a_fresh_run_refuses_to_replace_another_unless_told() {
    let out = tmp("overwrite");
    run(&small(&out, RunPrecision::F32)).unwrap();
    let err = run(&small(&out, RunPrecision::F32)).unwrap_err().to_string();
    assert!(err.contains("--resume") && err.contains("--overwrite"), "{err}");
    assert_eq!(read_metrics(out.join("metrics.csv")).unwrap().len(), 12, "the first run's metrics are intact");
    assert_eq!(checkpoint_step(&out.join("checkpoint")).unwrap(), 12);

    let report = run(&TrainConfig { overwrite: true, stop_after: Some(3), ..small(&out, RunPrecision::F32) }).unwrap();
    assert_eq!(report.steps, 3);
    assert_eq!(read_metrics(out.join("metrics.csv")).unwrap().len(), 3);
    assert_eq!(checkpoint_step(&out.join("checkpoint")).unwrap(), 3);
    assert!(!out.join(LOCK_FILE).exists(), "the lock is released at the end");
}

#[test]
fn a_live_lock_refuses_a_second_trainer_and_a_stale_one_is_taken_over() {
    let out = tmp("lock");
    std::fs::create_dir_all(&out).unwrap();
    // This process is alive: as if another trainer held the directory.
    std::fs::write(out.join(LOCK_FILE), format!("{}\n", std::process::id())).unwrap();
    let err = run(&small(&out, RunPrecision::F32)).unwrap_err().to_string();
    assert!(err.contains("another trainer") && err.contains(&std::process::id().to_string()), "{err}");
    assert!(!out.join("metrics.csv").exists(), "the refused run wrote nothing");
    assert!(out.join(LOCK_FILE).exists(), "and left the other's lock alone");

    // A process that has exited: its lock is stale.
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    std::fs::write(out.join(LOCK_FILE), format!("{pid}\n")).unwrap();
    run(&small(&out, RunPrecision::F32)).unwrap();
    assert!(!out.join(LOCK_FILE).exists());
}

// ---- in a child process: SIGKILL and SIGTERM ----------------------------------------------

const CHILD_CONFIG: &str = "AMP_TRAINER_TEST_CHILD_CONFIG";

/// Not a test: the body of the child processes below (this test binary, re-run with
/// `--ignored --exact`), which trains with the configuration in the environment.
#[test]
#[ignore = "the child process of the SIGKILL and SIGTERM tests, run by them"]
fn child_process_training_run() {
    let cfg = std::env::var(CHILD_CONFIG).expect("only the SIGKILL/SIGTERM tests run this, with a configuration");
    let cfg: TrainConfig = serde_json::from_str(&cfg).unwrap();
    amp::trainer::install_interrupt_handler().unwrap();
    let report = run(&cfg).unwrap();
    std::process::exit(if report.interrupted { 3 } else { 0 });
}

fn spawn_child(cfg: &TrainConfig) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["trainer::child_process_training_run", "--exact", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(CHILD_CONFIG, serde_json::to_string(cfg).unwrap())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits (at most a minute) until the child has written a checkpoint at `min_step` or later.
fn wait_for_checkpoint(child: &mut Child, dir: &Path, min_step: u64) -> u64 {
    let t0 = Instant::now();
    loop {
        if let Ok(step) = checkpoint_step(dir)
            && step >= min_step
        {
            return step;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the child exited ({status}) before a checkpoint at step {min_step}");
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("no checkpoint at step {min_step} after a minute");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A run far too long to finish: the test stops it.
fn endless(out: &Path) -> TrainConfig {
    TrainConfig { steps: 1_000_000, checkpoint_every: 4, ..small(out, RunPrecision::F16) }
}

fn assert_one_row_per_step(out: &Path, last: u64) {
    let steps: Vec<u64> = read_metrics(out.join("metrics.csv")).unwrap().iter().map(|r| r.step).collect();
    assert_eq!(steps, (1..=last).collect::<Vec<_>>(), "one metrics row per step, 1..={last}");
}

#[test]
fn metrics_survive_a_sigkill_and_the_resumed_run_has_one_row_per_step() {
    let out = tmp("sigkill");
    let mut child = spawn_child(&endless(&out));
    let seen = wait_for_checkpoint(&mut child, &out.join("checkpoint"), 8);
    child.kill().unwrap(); // SIGKILL, right after a checkpoint or a few steps past it
    child.wait().unwrap();
    let at = checkpoint_step(&out.join("checkpoint")).unwrap();
    assert!(at >= seen);
    // The killed trainer's lock is stale; the resumed run takes it over, keeps the rows up to
    // the checkpoint and drops any past it.
    let report = run(&TrainConfig { resume: true, stop_after: Some(at + 5), ..endless(&out) }).unwrap();
    assert_eq!(report.steps, at + 5);
    assert_one_row_per_step(&out, at + 5);
}

#[cfg(unix)]
#[test]
fn sigterm_saves_a_checkpoint_at_the_end_of_the_step_and_exits_cleanly() {
    let out = tmp("sigterm");
    let mut child = spawn_child(&endless(&out));
    wait_for_checkpoint(&mut child, &out.join("checkpoint"), 4);
    // While it trains, a second trainer on its directory is refused by its lock.
    let err = run(&TrainConfig { resume: true, ..endless(&out) }).unwrap_err().to_string();
    assert!(err.contains(&format!("another trainer (pid {})", child.id())), "{err}");
    // SAFETY: `kill` takes a pid and a signal number, no pointers; the pid is our live child.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(3), "the child saw the interrupt and returned normally: {status}");
    let at = checkpoint_step(&out.join("checkpoint")).unwrap();
    assert_one_row_per_step(&out, at); // the checkpoint is at the last step taken
    assert!(!out.join(LOCK_FILE).exists(), "the lock was released");
    run(&TrainConfig { resume: true, stop_after: Some(at + 2), ..endless(&out) }).unwrap();
    assert_one_row_per_step(&out, at + 2);
}

#[test]
fn resume_refuses_a_different_configuration_and_a_missing_checkpoint() {
    let out = tmp("mismatch");
    let err = run(&TrainConfig { resume: true, ..small(&out, RunPrecision::F32) }).unwrap_err().to_string();
    assert!(err.contains("--resume given but there is no checkpoint here"), "{err}");
    run(&TrainConfig { stop_after: Some(2), ..small(&out, RunPrecision::F32) }).unwrap();
    let err = run(&TrainConfig { resume: true, lr: 1e-2, ..small(&out, RunPrecision::F32) }).unwrap_err().to_string();
    assert!(err.contains("different run configuration"), "{err}");
    // The checkpoint's parts are AdamW's state, NoScale's (none) and the run's identity.
    let (state, _) =
        read_checkpoint_state::<OptimizerState<AdamState>, (), serde_json::Value>(out.join("checkpoint")).unwrap();
    assert_eq!((state.step, state.optimizer.kind.as_str(), state.optimizer.steps), (2, "adamw", 2));
    assert_eq!(state.extra["precision"], "F32");
    // Another precision keeps another scaler state (f16: GradScaler's), but the refusal says
    // what differs rather than that the scaler state has the wrong type.
    let err = run(&TrainConfig { resume: true, ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
    assert!(err.contains("different run configuration") && err.contains(r#""precision":"F32""#), "{err}");
    // A stop before the checkpoint's step: nothing to train, refused.
    let err = run(&TrainConfig { resume: true, stop_after: Some(1), ..small(&out, RunPrecision::F32) })
        .unwrap_err()
        .to_string();
    assert!(err.contains("the checkpoint is at step 2, past --stop-after 1: nothing to train"), "{err}");
}

/// A resume whose checkpoint is at the last step takes no step but finishes the run: it writes
/// the weights (which a run interrupted in its last step has not) and evaluates them, with the
/// metrics and the checkpoint as they were, and reports no losses rather than NaN.
#[test]
fn a_resume_at_the_last_step_writes_the_weights_and_evaluates() {
    let out = tmp("resume-at-end");
    let first = run(&small(&out, RunPrecision::F32)).unwrap();
    let (metrics, weights) = (std::fs::read(out.join("metrics.csv")).unwrap(), weights_bits(&out));
    std::fs::remove_file(out.join("model.safetensors")).unwrap(); // as after an interrupt at step 12
    let again = run(&TrainConfig { resume: true, ..small(&out, RunPrecision::F32) }).unwrap();
    assert_eq!((again.steps, again.skipped, again.accuracy), (12, 0, first.accuracy));
    assert!(again.first_loss.is_nan() && again.last_loss.is_nan() && again.tokens_per_s == 0.0);
    assert_eq!(std::fs::read(out.join("metrics.csv")).unwrap(), metrics);
    assert_eq!(weights_bits(&out), weights);
    assert_eq!(checkpoint_step(&out.join("checkpoint")).unwrap(), 12);
    let table = amp::trainer::summary(&small(&out, RunPrecision::F32), &again);
    let row = |name: &str| {
        table.lines().find(|l| l.starts_with(name)).unwrap().split_whitespace().last().unwrap().to_string()
    };
    assert_eq!((row("loss (first"), row("loss (last"), row("tokens/s")), ("-".into(), "-".into(), "-".into()));
    assert!(!table.contains("NaN"), "{table}");
}

#[test]
fn bad_options_and_data_files_are_refused_with_the_option_named() {
    let out = tmp("bad");
    let err = run(&TrainConfig { batch_size: 0, ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
    assert!(err.contains("batch-size"), "{err}");
    let err = run(&TrainConfig { lr: -1.0, ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
    assert!(err.contains("`lr`"), "{err}");
    // Steps the run never takes: refused, not silently ignored.
    for steps in [vec![0], vec![3, 13]] {
        let err =
            run(&TrainConfig { inject_nonfinite: steps, ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
        assert!(err.contains("`inject-nan`") && err.contains("outside this run's steps 1..=12"), "{err}");
    }
    let err = run(&TrainConfig { stop_after: Some(0), ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
    assert!(err.contains("`stop-after`: must be at least 1"), "{err}");
    assert!(!out.exists(), "refused before the output folder was made");
    let missing = out.join("no-such-file.txt");
    let err =
        run(&TrainConfig { data: Some(missing.clone()), ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
    assert!(err.contains("no-such-file.txt"), "{err}");
}

#[test]
fn trains_a_character_model_on_a_text_file() {
    let out = tmp("text");
    std::fs::create_dir_all(&out).unwrap();
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(40);
    let file = out.join("corpus.txt");
    std::fs::write(&file, &text).unwrap();
    let report =
        run(&TrainConfig { data: Some(file), steps: 30, lr: 1e-2, ..small(&out, RunPrecision::Bf16) }).unwrap();
    assert!(report.val_loss.unwrap().is_finite());
    assert!(report.last_loss < report.first_loss, "{} -> {}", report.first_loss, report.last_loss);
    // A sample: the held-out text's first characters, then sampled ones from the corpus's set.
    let sample = report.sample.expect("a text run samples");
    let n = amp::trainer::SAMPLE_PROMPT_CHARS + amp::trainer::SAMPLE_CHARS;
    assert_eq!(sample.chars().count(), n, "{sample}");
    assert!(text.contains(&sample[..amp::trainer::SAMPLE_PROMPT_CHARS]), "{sample}");
    assert!(sample.chars().all(|c| text.contains(c)), "{sample}");

    // The files beside the weights rebuild the model, which generates the same sample.
    let config: amp::nn::GptConfig = serde_json::from_slice(&std::fs::read(&report.config).unwrap()).unwrap();
    let chars: Vec<String> = serde_json::from_slice(&std::fs::read(&report.vocab).unwrap()).unwrap();
    let mut model = amp::nn::Gpt::new(config, &mut amp::Rng::seed(99));
    amp::checkpoint::load_weights(&report.weights, &mut model).unwrap();
    amp::Params::eval(&mut model);
    let id = |c: char| chars.iter().position(|s| s == &c.to_string()).unwrap() as i64;
    let prompt: Vec<i64> = sample.chars().take(amp::trainer::SAMPLE_PROMPT_CHARS).map(id).collect();
    let sampling = amp::nn::Sampling::Random { temperature: amp::trainer::SAMPLE_TEMPERATURE, top_k: None };
    let p = amp::Indices::from_vec(prompt.clone(), &[1, prompt.len()]);
    let again = model.generate::<amp::bf16>(&p, amp::trainer::SAMPLE_CHARS, sampling, &mut amp::Rng::seed(0)); // the run's seed
    let decoded: String = again.as_slice().iter().map(|&i| chars[i as usize].as_str()).collect();
    assert_eq!(decoded, sample);
}

#[test]
fn resume_refuses_an_impossible_training_state_naming_the_file_and_tensor() {
    let out = tmp("bad-state");
    let cfg = small(&out, RunPrecision::F16);
    run(&TrainConfig { stop_after: Some(3), ..cfg.clone() }).unwrap();
    let state_path = out.join("checkpoint").join(amp::checkpoint::STATE_FILE);
    let good_bytes = std::fs::read(&state_path).unwrap();
    let good: serde_json::Value = serde_json::from_slice(&good_bytes).unwrap();
    let name = good["state"]["optimizer"]["params"].as_object().unwrap().keys().next().unwrap().clone();
    // An edited file keeping its checksum is refused as modified; these edits drop it (as in
    // files of versions before it) so that the checks of the values themselves are reached.
    let refused = |edit: &dyn Fn(&mut serde_json::Value), needles: &[&str]| {
        let mut v = good.clone();
        v.as_object_mut().unwrap().remove("checksum").expect("the state file has a checksum");
        edit(&mut v);
        std::fs::write(&state_path, serde_json::to_vec(&v).unwrap()).unwrap();
        let err = run(&TrainConfig { resume: true, ..cfg.clone() }).unwrap_err().to_string();
        assert!(err.contains(state_path.to_str().unwrap()), "the refusal names the file: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    };
    let param = |v: &mut serde_json::Value| v["state"]["optimizer"]["params"][&name].clone();
    // A first moment one element short.
    refused(
        &|v| {
            let mut p = param(v);
            p["exp_avg"].as_array_mut().unwrap().pop();
            v["state"]["optimizer"]["params"][&name] = p;
        },
        &[&format!("`{name}`"), "does not fit"],
    );
    // A negative second moment.
    refused(
        &|v| {
            let mut p = param(v);
            p["exp_avg_sq"][0] = serde_json::json!(-1.0);
            v["state"]["optimizer"]["params"][&name] = p;
        },
        &[&format!("exp_avg_sq of `{name}` is negative")],
    );
    // A growth tracker past its interval (2000).
    refused(&|v| v["state"]["scaler"]["_growth_tracker"] = serde_json::json!(5000), &["_growth_tracker 5000"]);
    // More applied optimizer steps than steps.
    refused(&|v| v["state"]["optimizer"]["steps"] = serde_json::json!(9), &["9 applied steps"]);
    // The same negative moment with the checksum kept: refused as modified.
    let mut v = good.clone();
    v["state"]["optimizer"]["params"][&name]["exp_avg_sq"][0] = serde_json::json!(-1.0);
    std::fs::write(&state_path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let err = run(&TrainConfig { resume: true, ..cfg.clone() }).unwrap_err().to_string();
    assert!(err.contains(state_path.to_str().unwrap()) && err.contains("was modified or corrupted"), "{err}");
    // The intact state resumes.
    std::fs::write(&state_path, &good_bytes).unwrap();
    run(&TrainConfig { resume: true, ..cfg }).unwrap();
}

#[test]
fn resume_refuses_a_data_file_whose_text_changed() {
    let out = tmp("text-changed");
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join("corpus.txt");
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(20);
    std::fs::write(&file, &text).unwrap();
    let cfg = TrainConfig { data: Some(file.clone()), steps: 10, ..small(&out, RunPrecision::Bf16) };
    run(&TrainConfig { stop_after: Some(3), ..cfg.clone() }).unwrap();
    // Same length and characters (so the same vocabulary and loader), other text.
    std::fs::write(&file, text.chars().rev().collect::<String>()).unwrap();
    let err = run(&TrainConfig { resume: true, ..cfg.clone() }).unwrap_err().to_string();
    assert!(err.contains("is not the text this checkpoint was trained on") && err.contains("corpus.txt"), "{err}");
    std::fs::write(&file, &text).unwrap();
    assert_eq!(run(&TrainConfig { resume: true, ..cfg }).unwrap().steps, 10);
}

#[test]
fn too_many_digits_and_too_large_a_vocabulary_are_refused_before_allocating() {
    let out = tmp("limits");
    for digits in [5, 6] {
        let err = run(&TrainConfig { digits, ..small(&out, RunPrecision::F32) }).unwrap_err().to_string();
        assert!(err.contains("`digits`") && err.contains("between 1 and 4") && err.contains("GB"), "{err}");
    }
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join("many-chars.txt");
    let text: String = (0..1100u32).map(|i| char::from_u32(0x4E00 + i).unwrap()).collect::<String>().repeat(3);
    std::fs::write(&file, text).unwrap();
    let err = run(&TrainConfig { data: Some(file), ..small(&out, RunPrecision::F32) }).unwrap_err().to_string();
    assert!(err.contains("1100 distinct characters") && err.contains("at most 1024"), "{err}");
    assert!(err.contains("many-chars.txt"), "{err}");
}

#[cfg(unix)]
#[test]
fn a_second_signal_exits_at_once() {
    let out = tmp("two-signals");
    let mut child = spawn_child(&endless(&out));
    wait_for_checkpoint(&mut child, &out.join("checkpoint"), 4);
    // Two different signals (two of the same could merge while pending), back to back: the
    // second arrives long before the step in progress ends.
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `kill` takes a pid and a signal number, no pointers; the pid is our live child.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "the second signal ended the process at once: {status}");
}

// ---- on another device ------------------------------------------------------------------------

/// Every column of every metrics row, floats as bits.
fn metrics_bits(out: &Path) -> Vec<(u64, u64, u64, bool, u64, u64)> {
    read_metrics(out.join("metrics.csv"))
        .unwrap()
        .iter()
        .map(|r| (r.step, r.loss.to_bits(), r.scale.to_bits(), r.skipped, r.grad_norm.to_bits(), r.lr.to_bits()))
        .collect()
}

/// The checkpoint's training state (optimizer, scaler, loader, RNG, identity) as JSON.
fn checkpoint_json(out: &Path) -> String {
    type Any = serde_json::Value;
    let (state, _): (TrainingState<Any, Any, Any>, _) = read_checkpoint_state(out.join("checkpoint")).unwrap();
    serde_json::to_string(&state).unwrap()
}

#[track_caller]
fn assert_same_run(a: &Path, b: &Path, what: &str) {
    assert_eq!(metrics_bits(a), metrics_bits(b), "{what}: metrics rows");
    assert!(weights_bits(a) == weights_bits(b), "{what}: final weights");
    assert_eq!(checkpoint_json(a), checkpoint_json(b), "{what}: checkpoint state");
}

#[test]
fn a_run_on_a_second_device_writes_the_cpu_runs_files_bit_for_bit() {
    // 40 steps: one full read window of READ_EVERY steps and a partial one; a NaN step in
    // the first window (skipped on the device, read later) and one in the second.
    const { assert!(READ_EVERY < 40) };
    for precision in [RunPrecision::F16, RunPrecision::Bf16, RunPrecision::F32] {
        let cfg = |out: &Path| TrainConfig {
            steps: 40,
            checkpoint_every: 25,
            inject_nonfinite: vec![5, 33],
            ..small(out, precision)
        };
        let (cpu, dev) = (tmp(&format!("dev-cpu-{precision:?}")), tmp(&format!("dev-mirror-{precision:?}")));
        let on_cpu = run(&cfg(&cpu)).unwrap();
        let on_dev = run_on(&cfg(&dev), &Mirror).unwrap();
        assert_eq!((on_cpu.device.as_str(), on_dev.device.as_str()), ("cpu", "mirror"));
        assert_same_run(&cpu, &dev, &format!("{precision:?}"));
        assert_eq!(on_dev.skipped, 2, "{precision:?}");
        assert_eq!(
            (on_cpu.first_loss.to_bits(), on_cpu.last_loss.to_bits(), on_cpu.final_scale, on_cpu.accuracy),
            (on_dev.first_loss.to_bits(), on_dev.last_loss.to_bits(), on_dev.final_scale, on_dev.accuracy),
            "{precision:?}: the report"
        );
    }
}

#[test]
fn a_checkpoint_resumes_on_the_other_device_bit_for_bit() {
    for precision in [RunPrecision::F16, RunPrecision::Bf16] {
        let straight = tmp(&format!("xdev-straight-{precision:?}"));
        run(&small(&straight, precision)).unwrap();
        // Half on the device, the rest on the CPU; then the other way round.
        let to_cpu = tmp(&format!("xdev-to-cpu-{precision:?}"));
        run_on(&TrainConfig { stop_after: Some(6), ..small(&to_cpu, precision) }, &Mirror).unwrap();
        run(&TrainConfig { resume: true, ..small(&to_cpu, precision) }).unwrap();
        assert_same_run(&straight, &to_cpu, &format!("{precision:?}, device then CPU"));
        let to_dev = tmp(&format!("xdev-to-dev-{precision:?}"));
        run(&TrainConfig { stop_after: Some(6), ..small(&to_dev, precision) }).unwrap();
        run_on(&TrainConfig { resume: true, ..small(&to_dev, precision) }, &Mirror).unwrap();
        assert_same_run(&straight, &to_dev, &format!("{precision:?}, CPU then device"));
    }
}

#[test]
fn a_run_on_a_device_waits_for_it_a_few_times_per_read_window_not_every_step() {
    // Waits (host reads with kernels queued since the last read) of whole runs, so the
    // difference of two lengths is what the extra steps cost: setup, checkpoint and
    // evaluation are the same in both.
    let waits = |steps: u64| {
        let out = tmp(&format!("waits-{steps}"));
        let before = mirror::syncs();
        run_on(&TrainConfig { steps, checkpoint_every: 1000, ..small(&out, RunPrecision::F16) }, &Mirror).unwrap();
        mirror::syncs() - before
    };
    let (short, long) = (waits(READ_EVERY as u64), waits(4 * READ_EVERY as u64));
    let per_step = (long - short) as f64 / (3 * READ_EVERY) as f64;
    println!("{short} waits in {READ_EVERY} steps, {long} in {}: {per_step:.3} per step", 4 * READ_EVERY);
    // Per window: the trainer's read of its rows, the optimizer's read of its skip flags and
    // the scaler's collapse check; reading every step would be at least 1 per step.
    assert!(per_step <= 3.0 / READ_EVERY as f64, "{per_step} waits per step");
}

#[test]
fn the_checks_that_stop_a_run_hold_on_a_device() {
    // Every step skipped in bf16: stops at the same step as on the CPU (each row is checked
    // as it is read), with the rows before it written.
    let out = tmp("dev-all-nan");
    let cfg = TrainConfig { inject_nonfinite: (1..=30).collect(), steps: 30, ..small(&out, RunPrecision::Bf16) };
    let err = run_on(&cfg, &Mirror).unwrap_err().to_string();
    assert!(err.contains("training stopped at step 20") && err.contains("20 steps all had non-finite"), "{err}");
    assert_eq!(read_metrics(out.join("metrics.csv")).unwrap().len(), 20);
    assert!(!checkpoint_exists(out.join("checkpoint")));

    // A collapsing f16 scale: the device checks it every few updates, so it stops at the
    // first check after the CPU's step 26, with every row before that step written.
    let out = tmp("dev-collapse");
    let cfg = TrainConfig {
        inject_nonfinite: (1..=40).collect(),
        steps: 40,
        min_scale: 1024.0,
        ..small(&out, RunPrecision::F16)
    };
    let err = run_on(&cfg, &Mirror).unwrap_err().to_string();
    let at = amp::scaler::COLLAPSE_CHECK_EVERY as usize;
    assert!(err.contains(&format!("training stopped at step {at}")), "{err}");
    assert!(err.contains("loss scale collapsed"), "{err}");
    assert_eq!(read_metrics(out.join("metrics.csv")).unwrap().len(), at - 1);

    // Weights gone non-finite: caught before the checkpoint that would hold them.
    let out = tmp("dev-lr-overflow");
    let cfg = TrainConfig { lr: 1e38, steps: 2, checkpoint_every: 1, ..small(&out, RunPrecision::F32) };
    let err = run_on(&cfg, &Mirror).unwrap_err().to_string();
    assert!(err.contains("training stopped at step 1") && err.contains("inf or NaN"), "{err}");
    assert!(!checkpoint_exists(out.join("checkpoint")));
    assert!(!out.join("model.safetensors").exists());
}
