//! Replays the two traces recorded from PyTorch's `torch.amp.GradScaler`
//! (`tests/data/grad_scaler_traces.json`, a copy of `shared/reference/grad_scaler_traces.json`)
//! and matches every row exactly: the scale used, whether the step was skipped, the parameters
//! after the step (f32 bits), the scale and the growth tracker after the update.
//!
//! What PyTorch ran, read from the rows: a parameter `[1, -2, 0.5]`, a linear loss whose
//! gradient is the constant `[1, -0.5, 0.25]` (every good step moves the parameter by
//! `[-0.1, +0.05, -0.025]`), SGD with lr 0.1, and an injected `inf`, `-inf` or `nan` in the
//! gradient at the rows marked so. The config holds the scaler options that differ from
//! PyTorch's defaults.

use amp_core::optim::Sgd;
use amp_core::scaler::{GradScaler, GradScalerOptions};
use amp_core::{Param, Tensor};
use serde::Deserialize;

#[derive(Deserialize)]
struct Trace {
    config: Config,
    rows: Vec<Row>,
}

#[derive(Deserialize)]
struct Config {
    init_scale: Option<f64>,
    growth_interval: Option<i32>,
}

#[derive(Deserialize)]
struct Row {
    step: usize,
    event: String,
    scale_used: f64,
    skipped: bool,
    param_after: Vec<f64>,
    scale_after: f64,
    growth_tracker: i32,
}

/// The f32 a trace value stands for. The JSON holds f32 values widened to f64; serde_json's
/// default float parser may land one f64 ulp off the decimal, which is far below half an f32
/// ulp, so rounding to f32 recovers the value exactly. The assert checks it was an f32 value.
fn f32_of(v: f64) -> f32 {
    let f = v as f32;
    assert!(((f as f64) - v).abs() <= v.abs() * 1e-15, "{v} is not an f32 value");
    f
}

fn traces() -> Vec<Trace> {
    let text = include_str!("data/grad_scaler_traces.json");
    serde_json::from_str(text).expect("the trace file parses")
}

fn replay(trace: &Trace) {
    let mut opts = GradScalerOptions::default();
    if let Some(s) = trace.config.init_scale {
        opts.init_scale = f32_of(s);
    }
    if let Some(i) = trace.config.growth_interval {
        opts.growth_interval = i;
    }
    let mut scaler = GradScaler::with_options(opts).unwrap();
    let mut param = Param::new(Tensor::<f32>::from_vec(vec![1.0, -2.0, 0.5], &[3]));
    let mut opt = Sgd::new(0.1).build().unwrap();
    let base = [1.0f32, -0.5, 0.25];

    for (i, row) in trace.rows.iter().enumerate() {
        assert_eq!(row.step, i);
        let coef: Vec<f32> = match row.event.as_str() {
            "ok" => base.to_vec(),
            "inf" => base.iter().map(|c| c * f32::INFINITY).collect(),
            "-inf" => base.iter().map(|c| c * f32::NEG_INFINITY).collect(),
            "nan" => vec![f32::NAN; 3],
            other => panic!("unknown event {other}"),
        };
        let c = Tensor::from_vec(coef, &[3]);
        let loss = param.tensor().mul(&c).sum_all();

        let step = scaler.scale(loss);
        assert_eq!(step.scale_used(), f32_of(row.scale_used), "step {i}: scale used");
        let report = step.backward().unscale().step(&mut opt, &mut param).update().unwrap();

        assert_eq!(report.skipped, row.skipped, "step {i}: skipped");
        let got: Vec<u32> = param.to_vec().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = row.param_after.iter().map(|v| f32_of(*v).to_bits()).collect();
        assert_eq!(got, want, "step {i}: parameters after the step ({:?} vs {:?})", param.to_vec(), row.param_after);
        assert_eq!(report.scale, f32_of(row.scale_after), "step {i}: scale after");
        assert_eq!(scaler.get_scale(), f32_of(row.scale_after), "step {i}: scaler's scale");
        assert_eq!(report.growth_tracker, row.growth_tracker, "step {i}: growth tracker");
        assert_eq!(scaler.growth_tracker(), row.growth_tracker, "step {i}: scaler's tracker");
    }
}

#[test]
fn pytorch_trace_interval_3_from_default_scale() {
    let t = traces();
    assert_eq!(t[0].config.growth_interval, Some(3));
    assert_eq!(t[0].rows.len(), 60);
    replay(&t[0]);
}

#[test]
fn pytorch_trace_interval_1_from_scale_1() {
    let t = traces();
    assert_eq!(t[1].config.init_scale, Some(1.0));
    assert_eq!(t[1].rows.len(), 60);
    replay(&t[1]);
}

#[test]
fn every_trace_event_kind_is_exercised() {
    for t in traces() {
        for kind in ["ok", "inf", "-inf", "nan"] {
            assert!(t.rows.iter().any(|r| r.event == kind), "trace lacks {kind}");
        }
    }
}
