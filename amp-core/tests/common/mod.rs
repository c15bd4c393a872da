//! Shared test helpers: finite-difference gradient checks in f64 and per-precision tolerances.
#![allow(dead_code)]

use amp_core::{Precision, Rng, Tensor, bf16, f16};

/// Checks the analytic gradients of `f` (which must return a scalar) against central finite
/// differences, for every input, at every element.
#[track_caller]
pub fn gradcheck(inputs: &[Tensor<f64>], f: impl Fn(&[Tensor<f64>]) -> Tensor<f64>) {
    let leaves: Vec<Tensor<f64>> = inputs.iter().map(|t| t.detach().requires_grad_()).collect();
    let out = f(&leaves);
    assert_eq!(out.numel(), 1, "gradcheck: f must return a scalar");
    let grads = out.backward();
    let eps = 1e-6;
    for (i, leaf) in leaves.iter().enumerate() {
        let analytic = grads.get(leaf).map(|g| g.to_vec()).unwrap_or_else(|| vec![0.0; leaf.numel()]);
        let base = leaf.to_vec();
        for j in 0..base.len() {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let mut args: Vec<Tensor<f64>> = inputs.to_vec();
                args[i] = Tensor::from_vec(v, leaf.shape());
                f(&args).item()
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            let a = analytic[j];
            let tol = 1e-5 * (1.0 + numeric.abs().max(a.abs()));
            assert!((a - numeric).abs() <= tol, "gradcheck: input {i} element {j}: analytic {a} vs numeric {numeric}");
        }
    }
}

/// Relative tolerance for one op at precision `E` against an f64 reference.
pub fn tolerance<E: Precision>() -> f64 {
    match E::DTYPE {
        amp_core::DType::F64 => 1e-12,
        amp_core::DType::F32 => 1e-5,
        amp_core::DType::F16 => 2e-3,
        amp_core::DType::BF16 => 1.6e-2,
    }
}

/// Random f64 tensor.
pub fn randn(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::randn(shape, &mut Rng::seed(seed))
}

/// Asserts `got` (any precision) matches `want` (f64) within `E`'s tolerance, scaled by the
/// magnitude of the values involved.
#[track_caller]
pub fn assert_close<E: Precision>(got: &Tensor<E>, want: &Tensor<f64>, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let tol = tolerance::<E>();
    let w = want.to_vec();
    let scale = w.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.to_f64_vec().iter().zip(&w).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale || (g.is_nan() && w.is_nan()),
            "{what} ({}): element {i}: got {g}, want {w} (tol {})",
            E::DTYPE,
            tol * scale
        );
    }
}

/// Runs a test body at f32, f16 and bf16.
#[macro_export]
macro_rules! for_each_precision {
    ($body:ident) => {
        $body::<f32>();
        $body::<amp_core::f16>();
        $body::<amp_core::bf16>();
    };
}

pub fn _unused(_: f16, _: bf16) {}

/// The unit roundoff of `E` (half an ulp at 1): the largest relative error of one rounding.
pub fn unit_roundoff<E: Precision>() -> f64 {
    match E::DTYPE {
        amp_core::DType::F64 => f64::EPSILON / 2.0,
        amp_core::DType::F32 => 2f64.powi(-24),
        amp_core::DType::F16 => 2f64.powi(-11),
        amp_core::DType::BF16 => 2f64.powi(-8),
    }
}

/// Asserts each element of `got` is within `rel` unit roundoffs of `E` of the same element of
/// `want` (relative to that element), plus `abs` unit roundoffs of the largest `|want|`, plus
/// 256 f32 unit roundoffs of it for the f32 arithmetic inside kernels. An op that computes in
/// f32 and rounds once into f16/bf16 passes with `(1, 0)`; each further rounding can add one
/// to `rel`; results computed from rounded intermediates with cancellation need `abs`. NaN must
/// meet NaN and infinities must match exactly.
#[track_caller]
pub fn assert_close_ulps<E: Precision>(got: &Tensor<E>, want: &Tensor<f64>, (rel, abs): (f64, f64), what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what} ({}): shape", E::DTYPE);
    let w = want.to_vec();
    let scale = w.iter().filter(|v| v.is_finite()).fold(0f64, |m, v| m.max(v.abs()));
    let u = unit_roundoff::<E>();
    let floor = (abs * u + 256.0 * 2f64.powi(-24)) * scale;
    for (i, (g, w)) in got.to_f64_vec().iter().zip(&w).enumerate() {
        let tol = rel * u * w.abs() + floor;
        let ok = if w.is_finite() { (g - w).abs() <= tol } else { g == w || (g.is_nan() && w.is_nan()) };
        assert!(
            ok,
            "{what} ({}): element {i}: got {g}, want {w} (error {:.2} ulps of the element, {:.2} of the largest; allowed ({rel}, {abs}))",
            E::DTYPE,
            (g - w).abs() / (u * w.abs()),
            (g - w).abs() / (u * scale),
        );
    }
}
