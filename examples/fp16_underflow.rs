//! FP16 underflow, made visible: why mixed-precision training scales the loss.
//!
//! A two-layer network runs forward and backward in f16 (f32 accumulation inside each kernel,
//! the loss reduced in f32, as autocast does). Its activations are small (~1e-3, as deep in a
//! network) and the loss is a mean over 32768 outputs, so its gradients are ~1e-6..1e-8: in f16
//! that is the subnormal range and below. One backward without scaling and one with the
//! default loss scale 65536 are compared, element by element, with the same computation in f32.
//!
//! Run: `cargo run --release --example fp16_underflow`

use amp::{Rng, Tensor, f16};

/// f16 facts (IEEE binary16: 5 exponent bits, 10 mantissa bits).
const F16_MAX: f64 = 65504.0;
const F16_MIN_NORMAL: f64 = 6.103_515_625e-5; // 2^-14
const F16_MIN_SUBNORMAL: f64 = 5.960_464_477_539_063e-8; // 2^-24
const SCALE: f64 = 65536.0; // PyTorch's GradScaler default init_scale, 2^16

const BATCH: usize = 512;
const D_IN: usize = 64;
const HIDDEN: usize = 256;
const D_OUT: usize = 64;

struct Run {
    /// Gradients of w1 and w2, as f32, unscaled.
    grads: [Vec<f64>; 2],
    /// Largest |gradient| as it was stored in f16 (scaled, if scaled).
    max_stored: f64,
}

/// Forward and backward with weights of precision `E`: `loss = mean((relu(x w1) w2 - t)^2)`,
/// the loss in f32; the loss is multiplied by `scale` before backward, the gradients divided
/// by it after (in f32, as `GradScaler::unscale_` does).
fn run<E: amp::Precision>(x: &Tensor<f32>, t: &Tensor<f32>, w1: &Tensor<f32>, w2: &Tensor<f32>, scale: f64) -> Run {
    let w1 = w1.cast::<E>().detach().requires_grad_();
    let w2 = w2.cast::<E>().detach().requires_grad_();
    let y = x.cast::<E>().matmul(&w1).relu().matmul(&w2);
    let loss = y.cast::<f32>().sub(t).square().mean_all();
    let grads = loss.mul_scalar(scale).backward();
    let mut max_stored: f64 = 0.0;
    let grads = [&w1, &w2].map(|w| {
        let g = grads.get(w).expect("a gradient for every weight");
        let stored = g.to_f64_vec();
        max_stored = stored.iter().fold(max_stored, |m, v| m.max(v.abs()));
        g.cast::<f32>().div_scalar(scale).to_f64_vec()
    });
    Run { grads, max_stored }
}

fn percent(n: usize, of: usize) -> String {
    format!("{:5.1}%", 100.0 * n as f64 / of.max(1) as f64)
}

fn main() {
    println!(
        "f16 limits: max finite {F16_MAX}, smallest normal {F16_MIN_NORMAL:.3e} (2^-14), smallest subnormal {F16_MIN_SUBNORMAL:.3e} (2^-24)"
    );
    println!("Values below half the smallest subnormal (~2.98e-8) round to zero in f16; between it and the");
    println!("smallest normal they keep fewer than 10 mantissa bits.\n");

    let mut rng = Rng::seed(0);
    // Small inputs (activations deep in a network are often ~1e-3) and targets the output
    // misses by ~0.1: dL/dy = 2 (y - t) / 32768 ~ 6e-6, and the weight gradients, sums of
    // products with 1e-3 activations, ~1e-7.
    let x = Tensor::<f32>::randn(&[BATCH, D_IN], &mut rng).mul_scalar(1e-3);
    let w1 = Tensor::<f32>::randn(&[D_IN, HIDDEN], &mut rng).mul_scalar(1.0 / (D_IN as f64).sqrt());
    let w2 = Tensor::<f32>::randn(&[HIDDEN, D_OUT], &mut rng).mul_scalar(1.0 / (HIDDEN as f64).sqrt());
    let t = Tensor::<f32>::randn(&[BATCH, D_OUT], &mut rng).mul_scalar(0.1);

    let reference = run::<f32>(&x, &t, &w1, &w2, 1.0);
    let all_ref: Vec<f64> = reference.grads.concat();
    println!("Reference gradients (f32), {} values, by magnitude:", all_ref.len());
    let bands = [(1e-4, f64::INFINITY), (1e-5, 1e-4), (1e-6, 1e-5), (1e-7, 1e-6), (1e-8, 1e-7), (0.0, 1e-8)];
    for (lo, hi) in bands {
        let n = all_ref.iter().filter(|v| v.abs() >= lo && v.abs() < hi && **v != 0.0).count();
        let label = if hi.is_infinite() {
            format!(">= {lo:.0e}")
        } else if lo == 0.0 {
            format!("< {hi:.0e}")
        } else {
            format!("{lo:.0e} .. {hi:.0e}")
        };
        println!("  {label:>16}  {}", percent(n, all_ref.len()));
    }
    println!();

    let unscaled = run::<f16>(&x, &t, &w1, &w2, 1.0);
    let scaled = run::<f16>(&x, &t, &w1, &w2, SCALE);
    println!(
        "{:<34} {:>16} {:>14} {:>16} {:>14}",
        "f16 backward", "flushed to zero", "subnormal", "median rel err", "max |stored|"
    );
    for (name, r, scale) in [("without loss scaling", &unscaled, 1.0), ("loss scale 65536 (2^16)", &scaled, SCALE)] {
        let got: Vec<f64> = r.grads.concat();
        let nonzero_ref = all_ref.iter().filter(|v| **v != 0.0).count();
        let flushed = got.iter().zip(&all_ref).filter(|(g, r)| **g == 0.0 && **r != 0.0).count();
        // Subnormal as stored in f16: the stored value is the unscaled one times the scale.
        let subnormal = got.iter().filter(|g| **g != 0.0 && (**g * scale).abs() < F16_MIN_NORMAL).count();
        let mut rel: Vec<f64> =
            got.iter().zip(&all_ref).filter(|(_, r)| **r != 0.0).map(|(g, r)| ((g - r) / r).abs()).collect();
        rel.sort_by(f64::total_cmp);
        let median = rel.get(rel.len() / 2).copied().unwrap_or(0.0);
        println!(
            "{name:<34} {:>16} {:>14} {:>16.2e} {:>14.3e}",
            percent(flushed, nonzero_ref),
            percent(subnormal, nonzero_ref),
            median,
            r.max_stored
        );
        for (i, (g, rf)) in r.grads.iter().zip(&reference.grads).enumerate() {
            let nz = rf.iter().filter(|v| **v != 0.0).count();
            let fl = g.iter().zip(rf).filter(|(g, r)| **g == 0.0 && **r != 0.0).count();
            println!("  {:<32} {:>16}", format!("w{} ({} values)", i + 1, g.len()), percent(fl, nz));
        }
    }
    let overflow = scaled.max_stored >= F16_MAX;
    println!();
    println!("Without scaling, gradients below ~3e-8 become exactly 0 in f16 and those below 6.1e-5 lose");
    println!("precision: the update for those weights is lost. Multiplying the loss by 65536 before backward");
    println!("shifts every gradient 16 binades up, into f16's normal range; dividing by 65536 in f32");
    println!(
        "afterwards (unscale) restores the true values. The largest scaled gradient is {:.3e}, {} the",
        scaled.max_stored,
        if overflow { "ABOVE" } else { "below" }
    );
    println!(
        "f16 max {F16_MAX}: {}",
        if overflow {
            "it overflowed to inf, so GradScaler would skip this step and halve the scale."
        } else {
            "no overflow, so GradScaler would apply this step (and grow the scale after 2000 such steps)."
        }
    );
}
