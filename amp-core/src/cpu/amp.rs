//! The CPU's AMP passes: the fused unscale + non-finite check (one pass over every gradient
//! element), the sum of squares that clipping measures, and the in-place scale and clamp.
//!
//! Design notes:
//! - PyTorch's `_amp_foreach_non_finite_check_and_unscale_` reads each value once, sets
//!   `found_inf` if it is not finite, and writes `value × inv` (the multiply is done for
//!   non-finite values too). This kernel does exactly that, in place.
//! - The inner loop is branch-free so it vectorises: the non-finite test is "all exponent bits
//!   set" on the value's bits, max-reduced into one accumulator and compared once per chunk.
//! - Work is split into `CHUNK` pieces across every gradient at once and run on rayon's pool,
//!   so many small tensors parallelise as well as one large one; each piece reports its own
//!   flag, so the result is one flag per tensor (several optimizers sharing a scaler skip on
//!   their own overflow, as in PyTorch).

use std::sync::atomic::{AtomicBool, Ordering};

use half::{bf16, f16};
use rayon::prelude::*;

use super::{BUF, CHUNK, PAR_MIN};
use crate::precision::{Accum, Precision, as_same, as_same_mut};
use crate::simd::dispatch;

/// f32 exponent bits: a value is inf or NaN exactly when all of them are set.
const EXP_MASK: u32 = 0x7f80_0000;

/// Multiplies every value of `data` by `inv` in place and says whether any value (before the
/// multiply) was inf or NaN. Parallel for large slices.
///
/// ```
/// # extern crate amp_core as amp;
/// let mut g = vec![2.0f32, f32::INFINITY, 4.0];
/// assert!(amp::scaler::unscale_in_place(&mut g, 0.5));
/// assert_eq!(g[0], 1.0);
/// ```
pub fn unscale_in_place(data: &mut [f32], inv: f32) -> bool {
    let mut one = [data];
    unscale_all(&mut one, inv)[0]
}

/// The fused pass over several gradients at once: every value is multiplied by `inv` in place,
/// and the result holds, per slice, whether any of its values was inf or NaN.
pub fn unscale_all(slices: &mut [&mut [f32]], inv: f32) -> Vec<bool> {
    flags_by_pieces(slices, move |c| unscale_serial(c, inv))
}

/// Runs `pass` over every slice in [`CHUNK`] pieces, the pieces of all slices together on
/// rayon's pool (a step's many small gradients then split as well as one large one; one
/// parallel op per gradient paid a fork-join each, and ran the small ones on one thread),
/// and returns per slice whether `pass` said so of any of its pieces.
fn flags_by_pieces<T: Send>(slices: &mut [&mut [T]], pass: impl Fn(&mut [T]) -> bool + Sync) -> Vec<bool> {
    let total: usize = slices.iter().map(|s| s.len()).sum();
    if total < PAR_MIN {
        return slices.iter_mut().map(|s| pass(s)).collect();
    }
    let flags: Vec<AtomicBool> = slices.iter().map(|_| AtomicBool::new(false)).collect();
    let pieces: Vec<(usize, &mut [T])> =
        slices.iter_mut().enumerate().flat_map(|(i, s)| s.chunks_mut(CHUNK).map(move |c| (i, c))).collect();
    pieces.into_par_iter().for_each(|(i, c)| {
        if pass(c) {
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
///
/// Every pass here runs through [`dispatch`], with a `move` closure where it reads a scalar:
/// read through a captured reference in a loop that stores through `data`, it would be
/// reloaded every iteration (see `cpu::optim::for_chunks`).
fn unscale_serial(data: &mut [f32], inv: f32) -> bool {
    dispatch(
        #[inline(always)]
        move || {
            let mut exp = 0u32;
            for v in data.iter_mut() {
                exp = exp.max(v.to_bits() & EXP_MASK);
                *v *= inv;
            }
            exp == EXP_MASK
        },
    )
}

/// The check alone, same reduction.
fn check_serial(data: &[f32]) -> bool {
    exponent_all_set(data, f32::to_bits, EXP_MASK)
}

/// Whether some value's exponent bits (`mask`) are all set: the max of `bits & mask` over the
/// values, a reduction LLVM vectorises.
fn exponent_all_set<T: Copy, B: Copy + Ord + Default + std::ops::BitAnd<Output = B>>(
    x: &[T],
    to_bits: impl Fn(T) -> B,
    mask: B,
) -> bool {
    dispatch(
        #[inline(always)]
        || x.iter().fold(B::default(), |exp, &v| exp.max(to_bits(v) & mask)) == mask,
    )
}

/// Whether any value of `data` is inf or NaN (the check alone, for scalers that do not scale).
pub fn any_non_finite(data: &[f32]) -> bool {
    if data.len() < PAR_MIN { check_serial(data) } else { data.par_chunks(CHUNK).any(check_serial) }
}

/// The check for any precision, serially: f32, f16 and bf16 by their exponent bits, f64 by
/// value.
fn check_serial_of<E: Precision>(x: &[E]) -> bool {
    if let Some(x) = as_same::<E, f32>(x) {
        check_serial(x)
    } else if let Some(x) = as_same::<E, bf16>(x) {
        exponent_all_set(x, bf16::to_bits, 0x7f80)
    } else if let Some(x) = as_same::<E, f16>(x) {
        exponent_all_set(x, f16::to_bits, 0x7c00)
    } else {
        x.iter().any(|v| !v.to_f64().is_finite())
    }
}

/// The unscale (`inv` given) or the check alone (`None`) over several gradients of one
/// precision, per slice whether any value was inf or NaN: the vectorised f32 passes for f32,
/// otherwise `v × inv` in `E::Acc` with one rounding.
pub(crate) fn unscale_all_of<E: Precision>(slices: &mut [&mut [E]], inv: Option<f32>) -> Vec<bool> {
    if let (Some(inv), crate::DType::F32) = (inv, E::DTYPE) {
        let mut f32s: Vec<&mut [f32]> =
            slices.iter_mut().map(|s| as_same_mut::<E, f32>(s).expect("E is f32")).collect();
        return unscale_all(&mut f32s, inv);
    }
    let flags = flags_by_pieces(slices, |c| check_serial_of(c));
    if let Some(inv) = inv {
        slices.iter_mut().for_each(|s| scale_of(s, inv));
    }
    flags
}

/// Lanes of the sum of squares: four AVX-512 registers of independent accumulators, so the
/// loop is bound by memory rather than by the latency of one add chain.
const LANES: usize = 64;

/// The sum of squares of `data` in f32 (parallel for large slices; deterministic).
pub fn sum_of_squares(data: &[f32]) -> f32 {
    if data.len() < PAR_MIN {
        return sum_sq_serial(data);
    }
    let partial: Vec<f32> = data.par_chunks(CHUNK).map(sum_sq_serial).collect();
    partial.iter().sum()
}

fn sum_sq_serial(data: &[f32]) -> f32 {
    dispatch(
        #[inline(always)]
        || sum_sq_lanes(data),
    )
}

#[inline(always)]
fn sum_sq_lanes(data: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut blocks = data.chunks_exact(LANES);
    for block in &mut blocks {
        for (a, v) in acc.iter_mut().zip(block) {
            *a = v.mul_add(*v, *a);
        }
    }
    let tail: f32 = blocks.remainder().iter().map(|v| v * v).sum();
    // Pairwise: keeps the rounding error of the lane sum small.
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0] + tail
}

/// `Σ x²` for any precision: the f32 kernel above for f32, otherwise in `E::Acc`, serially.
pub(crate) fn sum_squares_of<E: Precision>(data: &[E]) -> f64 {
    if let Some(d) = as_same::<E, f32>(data) {
        return sum_of_squares(d) as f64;
    }
    let mut buf = [E::Acc::default(); BUF];
    let mut acc = <E::Acc as num_traits::Zero>::zero();
    for c in data.chunks(BUF) {
        let b = &mut buf[..c.len()];
        E::load(c, b);
        acc = b.iter().fold(acc, |a, v| a + *v * *v);
    }
    acc.f64()
}

/// Multiplies every value by `c` in place (parallel for large slices).
pub fn scale_in_place(data: &mut [f32], c: f32) {
    let f = |chunk: &mut [f32]| {
        dispatch(
            #[inline(always)]
            move || chunk.iter_mut().for_each(|v| *v *= c),
        )
    };
    if data.len() < PAR_MIN { f(data) } else { data.par_chunks_mut(CHUNK).for_each(f) }
}

/// Clamps every value to `[-clip, clip]` in place; NaN stays NaN, as with `torch.clamp`.
pub fn clamp_in_place(data: &mut [f32], clip: f32) {
    let f = |chunk: &mut [f32]| {
        dispatch(
            #[inline(always)]
            move || chunk.iter_mut().for_each(|v| *v = clamp(*v, clip)),
        )
    };
    if data.len() < PAR_MIN { f(data) } else { data.par_chunks_mut(CHUNK).for_each(f) }
}

#[inline(always)]
fn clamp<A: Accum>(v: A, c: A) -> A {
    if v > c {
        c
    } else if v < -c {
        -c
    } else {
        v
    }
}

/// `f` over every value in `E::Acc` with one rounding, serially (non-f32 gradients).
fn map_in_place<E: Precision>(data: &mut [E], f: impl Fn(E::Acc) -> E::Acc) {
    let mut buf = [E::Acc::default(); BUF];
    for c in data.chunks_mut(BUF) {
        let b = &mut buf[..c.len()];
        E::load(c, b);
        b.iter_mut().for_each(|v| *v = f(*v));
        E::store(b, c);
    }
}

/// Multiplies every value by `k` for any precision (the f32 kernel for f32).
pub(crate) fn scale_of<E: Precision>(data: &mut [E], k: f32) {
    match as_same_mut::<E, f32>(data) {
        Some(d) => scale_in_place(d, k),
        None => map_in_place(data, |v| v * E::Acc::c(k as f64)),
    }
}

/// Clamps every value to `[-c, c]` for any precision (the f32 kernel for f32).
pub(crate) fn clamp_of<E: Precision>(data: &mut [E], c: f32) {
    match as_same_mut::<E, f32>(data) {
        Some(d) => clamp_in_place(d, c),
        None => map_in_place(data, |v| clamp(v, E::Acc::c(c as f64))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scaler::inv_scale;

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

    /// The check alone (`inv` = None) in every precision: per slice, over many small slices
    /// and large ones together (the pieces of all of them share the pool), nothing written.
    #[test]
    fn check_alone_flags_per_slice_in_every_precision() {
        fn run<E: Precision>(specials: &[f64], finite_extremes: &[f64]) {
            for &bad in specials {
                // Sizes: small ones (under CHUNK) and one over PAR_MIN, so the pass splits.
                let sizes = [3, 700, CHUNK + 9, 5, PAR_MIN + 17];
                for target in 0..sizes.len() {
                    let mut data: Vec<Vec<E>> = sizes
                        .iter()
                        .map(|&n| (0..n).map(|i| E::from_f64(((i % 13) as f64 - 6.0) * 0.25)).collect())
                        .collect();
                    // Every slice ends with the largest finite values and the smallest
                    // subnormal, which must not be flagged; only `target` holds `bad`.
                    for slice in &mut data {
                        for (v, x) in slice.iter_mut().rev().zip(finite_extremes) {
                            *v = E::from_f64(*x);
                        }
                    }
                    let last = data[target].len() - 1;
                    data[target][last / 2] = E::from_f64(bad);
                    let before: Vec<Vec<E>> = data.clone();
                    let mut slices: Vec<&mut [E]> = data.iter_mut().map(|v| v.as_mut_slice()).collect();
                    let flags = unscale_all_of(&mut slices, None);
                    let expected: Vec<bool> = (0..sizes.len()).map(|i| i == target).collect();
                    assert_eq!(flags, expected, "{:?}: {bad} in slice {target}", E::DTYPE);
                    assert!(
                        data.iter()
                            .zip(&before)
                            .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_f64().to_bits() == y.to_f64().to_bits()))
                    );
                }
            }
        }
        let specials = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN];
        run::<f32>(&specials, &[f32::MAX as f64, f32::MIN as f64, 1e-45]);
        run::<bf16>(&specials, &[bf16::MAX.to_f64(), bf16::MIN.to_f64(), bf16::MIN_POSITIVE_SUBNORMAL.to_f64()]);
        run::<f16>(&specials, &[65504.0, -65504.0, f16::MIN_POSITIVE_SUBNORMAL.to_f64()]);
        run::<f64>(&specials, &[f64::MAX, f64::MIN]);
    }
}
