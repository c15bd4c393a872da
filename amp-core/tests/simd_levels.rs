//! Every SIMD level the CPU kernels dispatch to (`amp_core::simd`) computes bit-identical
//! results: conversions with special values and odd tails, elementwise, rows, reductions, and
//! whole AMP steps (f32, f16 + GradScaler with a skipped step, bf16) of a GPT large enough to
//! take the parallel paths. Levels this CPU lacks are skipped and named.
//!
//! One test function, in a process of its own (`crate::in_child`): the level is process-wide,
//! so nothing else may run beside it.

use amp_core::nn::{Gpt, GptConfig};
use amp_core::optim::AdamW;
use amp_core::scaler::{GradScaler, GradScalerOptions, LossScaler, NoScale};
use amp_core::simd::{self, Isa};
use amp_core::{Indices, Params, Precision, Rng, Tensor};
use half::{bf16, f16};

use crate::in_child;

fn bits<E: Precision>(t: &Tensor<E>) -> Vec<u64> {
    t.to_vec().iter().map(|v| v.to_f64().to_bits()).collect()
}

/// Values that exercise rounding: specials, subnormals of every precision, ties, and a long
/// random run whose length is not a multiple of any vector width.
fn awkward_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(1),  // smallest f32 subnormal
        5.96e-8,            // about the smallest f16 subnormal
        6.1e-5,             // near f16's smallest normal
        65504.0,            // f16 max
        65520.0,            // rounds to f16 inf
        1.0 + 1.0 / 256.0,  // bf16 tie
        1.0 + 1.0 / 2048.0, // f16 tie
        3.39e38,
    ];
    let mut rng = Rng::seed(11);
    let noise = Tensor::<f32>::randn(&[100_003], &mut rng).to_vec();
    v.extend(noise.iter().enumerate().map(|(i, x)| x * 10f32.powi((i % 13) as i32 - 6)));
    v
}

/// Op results at the current level, as bits, in a fixed order.
fn ops_at_this_level() -> Vec<Vec<u64>> {
    let vals = awkward_values();
    let n = vals.len();
    let x = Tensor::<f32>::from_vec(vals, &[n]);
    let mut out = vec![bits(&x.cast::<f16>()), bits(&x.cast::<bf16>()), bits(&x.cast::<f16>().cast::<bf16>())];
    // The vectorised tanh and ln on special values and subnormals (NaN payloads aside).
    let canonical_nan =
        |t: Tensor<f32>| bits(&t).into_iter().map(|b| if f64::from_bits(b).is_nan() { 0 } else { b }).collect();
    out.push(canonical_nan(x.tanh()));
    out.push(canonical_nan(x.log()));
    let mut rng = Rng::seed(3);
    // Rows of an odd length, large enough for the parallel row and chunk paths.
    let a = Tensor::<f32>::randn(&[301, 347], &mut rng);
    let b = Tensor::<f32>::randn(&[1, 347], &mut rng);
    fn per_precision<E: Precision>(a: &Tensor<f32>, b: &Tensor<f32>, out: &mut Vec<Vec<u64>>) {
        let (a, b) = (a.cast::<E>(), b.cast::<E>());
        out.push(bits(&a.gelu()));
        out.push(bits(&a.gelu_tanh()));
        out.push(bits(&a.tanh()));
        out.push(bits(&a.exp()));
        out.push(bits(&a.exp().log()));
        out.push(bits(&a.powf(2.0)));
        out.push(bits(&(&a + &b)));
        out.push(bits(&(&a * &a.t().contiguous().t())));
        out.push(bits(&a.softmax(1)));
        out.push(bits(&a.log_softmax(1)));
        out.push(bits(&a.sum(0, false)));
        out.push(bits(&a.sum(1, false)));
        out.push(bits(&a.max(0, false)));
        out.push(bits(&a.t().contiguous()));
        out.push(bits(&a.matmul(&a.t())));
    }
    per_precision::<f32>(&a, &b, &mut out);
    per_precision::<f16>(&a, &b, &mut out);
    per_precision::<bf16>(&a, &b, &mut out);
    out
}

/// `steps` AMP iterations of a GPT in precision `L`: loss, skipped flag and scale per step,
/// then every parameter, as bits.
fn train<L: Precision, K: LossScaler>(scaler: &mut K, steps: usize) -> Vec<Vec<u64>> {
    // d_model 144: the MLP weights (144 x 576) pass the kernels' parallel threshold.
    let config = GptConfig { vocab_size: 67, block_size: 24, d_model: 144, n_layers: 2, n_heads: 4, dropout: 0.1 };
    let mut model = Gpt::new(config, &mut Rng::seed(7));
    let mut opt = AdamW::new(3e-3).weight_decay(0.1).build().unwrap();
    let mut log = Vec::new();
    for i in 0..steps {
        let ids = Indices::from_vec((0..96).map(|j| ((i as i64 + j) * 7) % 67).collect(), &[4, 24]);
        let targets = Indices::from_vec((0..96).map(|j| ((i as i64 + j) * 3 + 1) % 67).collect(), &[4, 24]);
        let loss = model.loss::<L>(&ids, &targets, &mut Rng::seed(i as u64));
        let value = loss.item().to_bits() as u64;
        let mut grads = scaler.scale(loss).backward().unscale();
        let norm = grads.clip_grad_norm(1.0);
        let report = grads.step(&mut opt, &mut model).update().unwrap();
        log.push(vec![value, report.skipped as u64, report.scale.to_bits() as u64, norm.to_bits() as u64]);
    }
    log.extend(model.named_params().iter().map(|(_, p)| bits(p)));
    log
}

fn everything_at(isa: Isa) -> Vec<Vec<u64>> {
    simd::force(isa);
    assert_eq!(simd::level(), isa);
    let scaler =
        || GradScaler::with_options(GradScalerOptions { init_scale: 2f32.powi(24), ..Default::default() }).unwrap();
    let mut all = ops_at_this_level();
    all.extend(train::<f32, _>(&mut NoScale::new(), 2));
    let f16_run = train::<f16, _>(&mut scaler(), 3);
    assert_eq!(f16_run[0][1], 1, "the first f16 step overflows at 2^24 and is skipped");
    all.extend(f16_run);
    all.extend(train::<bf16, _>(&mut NoScale::new(), 2));
    all
}

#[test]
fn every_simd_level_computes_the_same_bits() {
    in_child(module_path!(), "every_simd_level_computes_the_same_bits", || {
        let (run, skipped): (Vec<Isa>, Vec<Isa>) = Isa::ALL.into_iter().partition(|i| i.supported());
        for isa in &skipped {
            println!("SKIPPED: level {} (this CPU lacks its features)", isa.name());
        }
        let reference = everything_at(Isa::Baseline);
        for isa in run.into_iter().filter(|i| *i != Isa::Baseline) {
            let got = everything_at(isa);
            assert_eq!(got.len(), reference.len());
            for (k, (g, r)) in got.iter().zip(&reference).enumerate() {
                assert!(g == r, "level {} differs from baseline in result {k}", isa.name());
            }
            println!("level {}: {} results bit-identical to baseline", isa.name(), got.len());
        }
    });
}
