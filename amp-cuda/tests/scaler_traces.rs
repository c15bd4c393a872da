//! PyTorch's `GradScaler` traces replayed on the GPU: the scale and growth tracker live on the
//! device and `update_scale` applies PyTorch's rule there (its `_amp_update_scale_`), the
//! optimizer skips in its kernel on found-inf; every row must match PyTorch's exactly, as on
//! the CPU (`amp-core/tests/scaler_traces.rs`, whose replay this runs).

mod common;
#[path = "../../amp-core/tests/support/scaler_replay.rs"]
mod scaler_replay;

use common::cuda_or_skip;
use scaler_replay::{replay, traces};

#[test]
fn pytorch_grad_scaler_traces_replay_bit_for_bit_on_the_gpu() {
    let Some(gpu) = cuda_or_skip("pytorch_grad_scaler_traces_replay_bit_for_bit_on_the_gpu") else { return };
    for (i, trace) in traces().iter().enumerate() {
        replay(trace, &gpu);
        println!("trace {i}: {} rows match PyTorch's", trace.rows.len());
    }
}
