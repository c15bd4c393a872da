//! Replaying PyTorch's `GradScaler` traces on any device, shared by amp-core's
//! `scaler_traces` test (the CPU) and amp-cuda's (the GPU): the same rows, the same exact
//! checks. See `amp-core/tests/scaler_traces.rs` for what PyTorch ran.
#![allow(dead_code)]

use amp_core::backend::HostValue;
use amp_core::optim::Sgd;
use amp_core::scaler::{GradScaler, GradScalerOptions};
use amp_core::{Device, Param, Tensor};
use serde::Deserialize;

#[derive(Deserialize)]
pub struct Trace {
    pub config: Config,
    pub rows: Vec<Row>,
}

#[derive(Deserialize)]
pub struct Config {
    pub init_scale: Option<f64>,
    pub growth_interval: Option<i32>,
}

#[derive(Deserialize)]
pub struct Row {
    pub step: usize,
    pub event: String,
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

/// The two traces (a copy of `shared/reference/grad_scaler_traces.json`).
pub fn traces() -> Vec<Trace> {
    let text = include_str!("../data/grad_scaler_traces.json");
    serde_json::from_str(text).expect("the trace file parses")
}

/// Replays `trace` with the parameter on `dev`: every row's scale used, skip, parameters
/// (f32 bits), scale and growth tracker must match exactly.
pub fn replay<D: Device>(trace: &Trace, dev: &D) {
    let mut opts = GradScalerOptions::default();
    if let Some(s) = trace.config.init_scale {
        opts.init_scale = f32_of(s);
    }
    if let Some(i) = trace.config.growth_interval {
        opts.growth_interval = i;
    }
    let mut scaler = GradScaler::with_options(opts).unwrap();
    let mut param = Param::new(Tensor::<f32>::from_vec(vec![1.0, -2.0, 0.5], &[3]).to_device(dev));
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
        let c = Tensor::from_vec(coef, &[3]).to_device(dev);
        let loss = param.tensor().mul(&c).sum_all();

        let step = scaler.scale(loss);
        assert_eq!(step.scale_used().get(), f32_of(row.scale_used), "step {i}: scale used");
        let report = step.backward().unscale().step(&mut opt, &mut param).update().unwrap();

        assert_eq!(report.skipped.get(), row.skipped, "step {i}: skipped");
        let got: Vec<u32> = param.to_vec().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = row.param_after.iter().map(|v| f32_of(*v).to_bits()).collect();
        assert_eq!(got, want, "step {i}: parameters after the step ({:?} vs {:?})", param.to_vec(), row.param_after);
        assert_eq!(report.scale.get(), f32_of(row.scale_after), "step {i}: scale after");
        assert_eq!(scaler.get_scale(), f32_of(row.scale_after), "step {i}: scaler's scale");
        assert_eq!(report.growth_tracker.get(), row.growth_tracker, "step {i}: growth tracker");
        assert_eq!(scaler.growth_tracker(), row.growth_tracker, "step {i}: scaler's tracker");
    }
}
