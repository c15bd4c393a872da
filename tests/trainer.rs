//! The training job end to end on small runs: exact resume, skipped steps on NaN, a clear
//! stop when the loss scale collapses, bad options refused.

use std::path::{Path, PathBuf};

use amp::checkpoint::read_weights;
use amp::train_utils::read_metrics;
use amp::trainer::{ModelSize, RunPrecision, TrainConfig, run};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("amp-trainer-{name}-{}", std::process::id()));
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
    assert!(err.contains("training stopped at step"), "{err}");
    assert!(err.contains("loss scale collapsed"), "{err}");
    assert!(err.contains("bf16"), "the message suggests a way out: {err}");
}

#[test]
fn resume_refuses_a_different_configuration_and_a_missing_checkpoint() {
    let out = tmp("mismatch");
    let err = run(&TrainConfig { resume: true, ..small(&out, RunPrecision::F32) }).unwrap_err().to_string();
    assert!(err.contains("--resume given but there is no checkpoint here"), "{err}");
    run(&TrainConfig { stop_after: Some(2), ..small(&out, RunPrecision::F32) }).unwrap();
    let err = run(&TrainConfig { resume: true, lr: 1e-2, ..small(&out, RunPrecision::F32) }).unwrap_err().to_string();
    assert!(err.contains("different run configuration"), "{err}");
}

#[test]
fn bad_options_and_data_files_are_refused_with_the_option_named() {
    let out = tmp("bad");
    let err = run(&TrainConfig { batch_size: 0, ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
    assert!(err.contains("batch-size"), "{err}");
    let err = run(&TrainConfig { lr: -1.0, ..small(&out, RunPrecision::F16) }).unwrap_err().to_string();
    assert!(err.contains("`lr`"), "{err}");
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
    std::fs::write(&file, text).unwrap();
    let report =
        run(&TrainConfig { data: Some(file), steps: 30, lr: 1e-2, ..small(&out, RunPrecision::Bf16) }).unwrap();
    assert!(report.val_loss.unwrap().is_finite());
    assert!(report.last_loss < report.first_loss, "{} -> {}", report.first_loss, report.last_loss);
}
