//! The fused unscale + non-finite check: one pass over every gradient element.
//!
//! Design notes:
//! - PyTorch's `_amp_foreach_non_finite_check_and_unscale_` reads each value once, sets
//!   `found_inf` if it is not finite, and writes `value × inv` (the multiply is done for
//!   non-finite values too). This kernel does exactly that, in place.
//! - The inner loop is branch-free so it vectorises: the non-finite test is "all exponent bits
//!   set" on the value's bits, max-reduced into one accumulator and compared once per chunk.
//! - Work is split into [`CHUNK`] pieces across every gradient at once and run on rayon's pool,
//!   so many small tensors parallelise as well as one large one; each piece reports its own
//!   flag, so the result is one flag per tensor (several optimizers sharing a scaler skip on
//!   their own overflow, as in PyTorch).

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::cpu::{CHUNK, PAR_MIN};

/// f32 exponent bits: a value is inf or NaN exactly when all of them are set.
const EXP_MASK: u32 = 0x7f80_0000;

/// The unscale factor PyTorch uses: `1/scale` computed in f64, then rounded to f32.
///
/// Bit parity depends on it: the gradients are multiplied by this value, never divided by the
/// scale.
///
/// ```
/// assert_eq!(amp_core::scaler::inv_scale(65536.0), 1.0 / 65536.0);
/// ```
pub fn inv_scale(scale: f32) -> f32 {
    (1.0f64 / scale as f64) as f32
}

/// Multiplies every value of `data` by `inv` in place and says whether any value (before the
/// multiply) was inf or NaN. Parallel for large slices.
///
/// ```
/// let mut g = vec![2.0f32, f32::INFINITY, 4.0];
/// assert!(amp_core::scaler::unscale_in_place(&mut g, 0.5));
/// assert_eq!(g[0], 1.0);
/// ```
pub fn unscale_in_place(data: &mut [f32], inv: f32) -> bool {
    let mut one = [data];
    unscale_all(&mut one, inv)[0]
}

/// The fused pass over several gradients at once: every value is multiplied by `inv` in place,
/// and the result holds, per slice, whether any of its values was inf or NaN.
pub fn unscale_all(slices: &mut [&mut [f32]], inv: f32) -> Vec<bool> {
    let total: usize = slices.iter().map(|s| s.len()).sum();
    if total < PAR_MIN {
        return slices.iter_mut().map(|s| unscale_serial(s, inv)).collect();
    }
    let flags: Vec<AtomicBool> = slices.iter().map(|_| AtomicBool::new(false)).collect();
    let pieces: Vec<(usize, &mut [f32])> =
        slices.iter_mut().enumerate().flat_map(|(i, s)| s.chunks_mut(CHUNK).map(move |c| (i, c))).collect();
    pieces.into_par_iter().for_each(|(i, c)| {
        if unscale_serial(c, inv) {
            flags[i].store(true, Ordering::Relaxed);
        }
    });
    flags.into_iter().map(AtomicBool::into_inner).collect()
}

/// One thread's share: multiply and check, with no branch in the loop. The exponent bits of
/// every value are max-reduced into one accumulator (a value is inf or NaN exactly when they
/// are all set). Written as a plain loop over the slice with one scalar accumulator: LLVM
/// vectorises that reduction (`vpmaxud` next to `vmulps`), whereas an explicit array of lane
/// accumulators was turned into gathers and scatters and ran ten times slower.
#[inline]
fn unscale_serial(data: &mut [f32], inv: f32) -> bool {
    let mut exp = 0u32;
    for v in data.iter_mut() {
        exp = exp.max(v.to_bits() & EXP_MASK);
        *v *= inv;
    }
    exp == EXP_MASK
}

/// The check alone, same reduction.
#[inline]
fn check_serial(data: &[f32]) -> bool {
    data.iter().fold(0u32, |exp, v| exp.max(v.to_bits() & EXP_MASK)) == EXP_MASK
}

/// Whether any value of `data` is inf or NaN (the check alone, for scalers that do not scale).
pub fn any_non_finite(data: &[f32]) -> bool {
    if data.len() < PAR_MIN { check_serial(data) } else { data.par_chunks(CHUNK).any(check_serial) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_exactly_the_non_finite_values_and_multiplies_everything() {
        for n in [0, 1, 15, 16, 17, 100, PAR_MIN + 33] {
            for bad in [None, Some(f32::INFINITY), Some(f32::NEG_INFINITY), Some(f32::NAN)] {
                let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - 7.0) * 1024.0).collect();
                if let (Some(b), true) = (bad, n > 0) {
                    v[n - 1] = b;
                }
                let expected: Vec<f32> = v.iter().map(|x| x * (1.0 / 1024.0)).collect();
                let found = unscale_in_place(&mut v, inv_scale(1024.0));
                assert_eq!(found, bad.is_some() && n > 0, "n {n} bad {bad:?}");
                for (a, b) in v.iter().zip(&expected) {
                    assert_eq!(a.to_bits(), b.to_bits());
                }
            }
        }
    }

    #[test]
    fn largest_finite_value_is_not_flagged() {
        let mut v = vec![f32::MAX, f32::MIN, f32::MIN_POSITIVE, -0.0, 1e-45];
        assert!(!unscale_in_place(&mut v, 1.0));
        assert!(!any_non_finite(&v));
    }

    #[test]
    fn per_slice_flags() {
        let mut a = vec![1.0f32; PAR_MIN];
        let mut b = vec![1.0f32; 3];
        let mut c = vec![1.0f32; CHUNK * 2 + 5];
        c[CHUNK + 1] = f32::NAN;
        let flags = unscale_all(&mut [&mut a, &mut b, &mut c], 0.5);
        assert_eq!(flags, vec![false, false, true]);
        assert_eq!(a[0], 0.5);
        assert!(any_non_finite(&c) && !any_non_finite(&a));
    }
}
