//! Branch-free f32 `exp` and `erf` that inline into elementwise loops, so those loops
//! vectorise (a libm call per element keeps them scalar). [`crate::precision::Accum`] routes
//! the f32 accumulator's `vexp` / `erf` here; the f64 accumulator keeps libm.
//!
//! Design notes:
//! - No data-dependent branches: every path is computed and the result picked with a select,
//!   and no float-to-int conversion (its saturating semantics stop LLVM from vectorising).
//! - Polynomial coefficients were fitted for this file (relative-error minimax, Lawson's
//!   iteratively reweighted least squares against 30-digit mpmath values, then rounded to
//!   f32). Measured accuracy is in the tests below.
//! - Polynomial steps are `mul_add`: the hot loops run in functions compiled for AVX2 + FMA or
//!   AVX-512 ([`crate::simd`]), where it is one FMA instruction (GELU 1.4x faster than separate
//!   multiplies and adds on the Xeon with AMX). At the baseline level it is a call to libm's
//!   `fmaf`, slow but correctly rounded like the instruction, so every level gives the same
//!   bits (`tests/simd_levels.rs`).

/// `1.5 * 2^23`: adding it to a float in `[-2^22, 2^22]` rounds it to an integer and leaves
/// that integer in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `(e^r, n)` with `x = n ln2 + r`, `|r| <= ln2/2` (ln2 split in two so `n ln2` is exact) and
/// `e^r` from a degree-6 polynomial (Cephes `expf`), for `|x| <= 104`: the shared core of
/// [`exp_f32`] and [`exp_neg_f32`], which differ in how they scale by `2^n`.
#[inline(always)]
fn exp_reduced(x: f32) -> (f32, i32) {
    let t = x * std::f32::consts::LOG2_E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_2e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 0.166_666_65);
    p = p.mul_add(r, 0.5);
    let er = (p * r).mul_add(r, r) + 1.0;
    (er, (t.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32))
}

/// `e^x` for f32, within 1 ulp of the exact value over the whole range, subnormal results
/// included; `exp(-inf) = 0`, `exp(inf) = inf`, overflow (x > 88.72) gives inf, underflow
/// (x < -103.97) gives 0, NaN stays NaN.
///
/// [`exp_reduced`], then a scale by `2^n` applied as two factors `2^(n/2)`, each a valid
/// normal float, so results in the subnormal range and up to f32::MAX come out rounded once
/// instead of flushed or overflowed early.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    // Below -104 the result rounds to 0: such a lane (the -inf of a masked attention score)
    // computes from 0 instead and is selected to 0 at the end, because its last multiply
    // would underflow, and an underflowing multiply takes a microcode assist on Intel CPUs
    // that slows the whole vector (a softmax over causally masked scores ran 2.8x slower).
    // Only true subnormal results (-104 < x < -87.3) still pay it.
    let zero = x < -104.0;
    // Past 89 the result is inf anyway; clamping keeps n in -150..=129 so both half-scales
    // below are normal. NaN passes through clamp and poisons the result.
    let xc = if zero { 0.0 } else { x.clamp(-104.0, 89.0) };
    let (er, ni) = exp_reduced(xc);
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    if zero { 0.0 } else { er * s1 * s2 }
}

/// `e^x` for `x <= 0`, with every result below `e^-87.33` (the bottom of f32's normal range)
/// taken as 0: [`exp_f32`] with one scale by `2^n` instead of two and no overflow clamp (GELU
/// forward 0.85-0.89x its time with `exp_f32` on the Xeon with AMX, one thread). Equal to
/// [`exp_f32`] from -87.33 to 0; NaN stays NaN.
#[inline(always)]
fn exp_neg_f32(x: f32) -> f32 {
    let zero = x < -87.33;
    let xc = if zero { 0.0 } else { x };
    let (er, ni) = exp_reduced(xc);
    // n is in -126..=0 here, so 2^n is a normal float and er · 2^n rounds once, as in exp_f32.
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    if zero { 0.0 } else { er * scale }
}

/// Below this `|x|`, `erf(x) = x P(x²)`; from it on, `erf(x) = 1 - e^(-x²) Q(2 / (2 + |x|))`.
const ERF_SPLIT: f32 = 0.75;

/// `erf(x)` and `e^(-x²)` for f32, computed together because the erf needs the exponential
/// anyway (GELU's derivative uses both: `Φ(x)` and the density `φ(x)`).
///
/// erf is within 1.7 ulp of the exact value everywhere (the tests measure it); `erf(±inf) = ±1`,
/// `erf(±0) = ±0`, NaN stays NaN. The second value is [`exp_f32`]`(-x²)` where that is at
/// least `e^-87.33` (`|x| <= 9.345`) and 0 beyond, where it is subnormal or tiny: erf is ±1
/// there either way.
///
/// - `|x| < 0.75`: `x P(x²)`, P of degree 5 (relative error 1.4e-9), evaluated as
///   `x + x (P(x²) - 1)`.
/// - `|x| >= 0.75`: `erfc(x) e^(x²)` is smooth and slowly varying; as a polynomial of degree 7
///   in `t = 2/(2+|x|)` (Numerical Recipes' substitution) it has relative error 3e-9 on
///   [0.75, 4]. `t` is taken at `min(|x|, 4)`: beyond 4, `e^(-x²) Q < 2^-25` and the result
///   rounds to 1 whatever Q is.
#[inline(always)]
pub(crate) fn erf_exp_f32(x: f32) -> (f32, f32) {
    let a = x.abs();
    let x2 = a * a;
    let g = exp_neg_f32(-x2);

    // P(x²) - 1, so the leading term `2/√π - 1` rounds to f32 with a tiny relative error
    // (2/√π itself loses half an ulp) and the final `a + a d` rounds once at the end.
    let mut d = -6.749_515e-4f32;
    d = d.mul_add(x2, 5.114_346_3e-3);
    d = d.mul_add(x2, -2.683_462_6e-2);
    d = d.mul_add(x2, 0.112_833_77);
    d = d.mul_add(x2, -0.376_126_2);
    d = d.mul_add(x2, 0.128_379_17);
    let small = a + a * d;

    // `min` returns 4 for NaN; the NaN then comes through `g`.
    let t = 2.0 / (2.0 + a.min(4.0));
    let mut q = 0.119_022_24f32;
    q = q.mul_add(t, -0.470_026_25);
    q = q.mul_add(t, 0.561_473_37);
    q = q.mul_add(t, -0.102_096_05);
    q = q.mul_add(t, 0.347_039_85);
    q = q.mul_add(t, 0.259_916_72);
    q = q.mul_add(t, 0.284_874_56);
    q = q.mul_add(t, -1.515_049_4e-4);
    let large = 1.0 - g * q;

    let e = if a < ERF_SPLIT { small } else { large };
    (e.copysign(x), g)
}

/// `erf(x)` for f32; see [`erf_exp_f32`].
#[inline(always)]
pub(crate) fn erf_f32(x: f32) -> f32 {
    erf_exp_f32(x).0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `|got - want|` in units of the f32 spacing at `want` (2^-149 in the subnormal range).
    fn ulps(got: f32, want: f64) -> f64 {
        // Exact, both NaN, or both overflowing to the same infinity.
        if got as f64 == want || (got.is_nan() && want.is_nan()) || got == want as f32 && got.is_infinite() {
            return 0.0;
        }
        let a = want.abs();
        let spacing = if a < f32::MIN_POSITIVE as f64 {
            2f64.powi(-149)
        } else {
            let e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
            2f64.powi(e - 23)
        };
        (got as f64 - want).abs() / spacing
    }

    /// Inputs: a 1e-3 grid over `[lo, hi]`, plus a stride through every f32 bit pattern (huge,
    /// tiny and subnormal inputs of both signs).
    fn sweep(lo: f64, hi: f64) -> impl Iterator<Item = f32> {
        let n = ((hi - lo) * 1000.0).round() as i64;
        let grid = (0..=n).map(move |i| (lo + i as f64 * 1e-3) as f32);
        let bits = (0..u32::MAX / 4099).map(|i| f32::from_bits(i * 4099)).filter(|v| v.is_finite());
        grid.chain(bits)
    }

    fn worst(f: impl Fn(f32) -> f32, exact: impl Fn(f64) -> f64, inputs: impl Iterator<Item = f32>) -> (f64, f32) {
        inputs.map(|x| (ulps(f(x), exact(x as f64)), x)).fold((0.0, 0.0), |w, e| if e.0 > w.0 { e } else { w })
    }

    #[test]
    fn exp_f32_is_within_two_ulps_everywhere() {
        // Measured: 0.99 ulp max (at x = -81.39), subnormal results included.
        let (w, at) = worst(exp_f32, f64::exp, sweep(-110.0, 90.0));
        assert!(w <= 2.0, "exp_f32: worst error {w} ulp at x = {at}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(88.73), f32::INFINITY);
        assert_eq!(exp_f32(f32::MAX), f32::INFINITY);
        assert!(exp_f32(88.72).is_finite());
        assert_eq!(exp_f32(-104.0), 0.0);
        assert_eq!(exp_f32(f32::MIN), 0.0);
        assert_eq!(exp_f32(-103.0), (-103f64).exp() as f32, "subnormal result, rounded once");
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn erf_f32_is_within_two_ulps_everywhere() {
        // Measured: 1.69 ulp max (at x = -0.8036, just past the switch to the e^(-x²) form).
        let (w, at) = worst(erf_f32, libm::erf, sweep(-10.0, 10.0));
        assert!(w <= 2.0, "erf_f32: worst error {w} ulp at x = {at}");
        assert_eq!(erf_f32(f32::INFINITY), 1.0);
        assert_eq!(erf_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(erf_f32(4.0), 1.0);
        assert_eq!(erf_f32(f32::MAX), 1.0);
        assert_eq!(erf_f32(-f32::MAX), -1.0);
        assert!(erf_f32(0.0) == 0.0 && erf_f32(0.0).is_sign_positive());
        assert!(erf_f32(-0.0) == 0.0 && erf_f32(-0.0).is_sign_negative());
        let tiny = f32::from_bits(1);
        assert_eq!(erf_f32(tiny), (libm::erf(tiny as f64)) as f32);
        assert!(erf_f32(f32::NAN).is_nan());
    }

    #[test]
    fn erf_exp_gives_the_gaussian_too() {
        for x in [-30.0f32, -3.0, -0.5, 0.0, 0.3, 1.7, 9.0, 9.34, f32::INFINITY] {
            assert_eq!(erf_exp_f32(x).1, exp_f32(-x * x), "x = {x}");
        }
        // Every x on a 1e-4 grid whose e^(-x²) is normal gives exp_f32's bits.
        for i in 0..=93_450 {
            let x = i as f32 * 1e-4;
            assert_eq!(erf_exp_f32(x).1.to_bits(), exp_f32(-x * x).to_bits(), "x = {x}");
        }
        // Beyond |x| = 9.345, 0 where exp_f32 gives a subnormal.
        assert!(exp_f32(-9.5 * 9.5) > 0.0);
        assert_eq!(erf_exp_f32(9.5).1, 0.0);
        assert_eq!(erf_exp_f32(-13.0).1, 0.0);
        assert!(erf_exp_f32(f32::NAN).1.is_nan());
    }
}
