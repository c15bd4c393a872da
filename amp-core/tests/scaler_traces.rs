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

#[path = "support/scaler_replay.rs"]
mod scaler_replay;

use amp_core::Cpu;
use scaler_replay::{replay, traces};

#[test]
fn pytorch_trace_interval_3_from_default_scale() {
    let t = traces();
    assert_eq!(t[0].config.growth_interval, Some(3));
    assert_eq!(t[0].rows.len(), 60);
    replay(&t[0], &Cpu);
}

#[test]
fn pytorch_trace_interval_1_from_scale_1() {
    let t = traces();
    assert_eq!(t[1].config.init_scale, Some(1.0));
    assert_eq!(t[1].rows.len(), 60);
    replay(&t[1], &Cpu);
}

#[test]
fn every_trace_event_kind_is_exercised() {
    for t in traces() {
        for kind in ["ok", "inf", "-inf", "nan"] {
            assert!(t.rows.iter().any(|r| r.event == kind), "trace lacks {kind}");
        }
    }
}
