//! Run-time SIMD dispatch: the CPU kernels run on the widest instruction set the CPU has,
//! whatever the crate was compiled for.
//!
//! Design notes:
//! - The crate builds for the target's baseline (x86-64: SSE2), which is what every crate that
//!   depends on amp gets. Hot loops are plain Rust that LLVM vectorises; `dispatch` runs a
//!   closure inside a function compiled with the widest [`Isa`] this CPU supports, chosen once
//!   and cached, so the loops inlined into that closure are vectorised for it.
//! - Only code inlined into the dispatched closure gets the wider instructions. Kernel task
//!   closures are marked `#[inline(always)]` where they are passed, and the helpers they call
//!   inside a task (`load`/`store`, the run walker, row sums, `exp`) are `#[inline(always)]`.
//! - Every level gives bit-identical results: LLVM does not reassociate or contract floating
//!   point, and `mul_add` is one fused multiply-add at every level (an FMA instruction, or
//!   libm's correctly rounded `fmaf`, which is slow: another reason to dispatch).
//! - The slice conversions of f16 and bf16 dispatch themselves (per slice) with explicit
//!   instructions (`vcvtph2ps` / `vcvtps2ph`), so they are fast in any context.
//! - `AMP_CPU_ISA=baseline|avx2|avx512` caps the level for the process (A/B benchmarks, tests);
//!   a level the CPU lacks is never chosen.

use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction-set level the CPU kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The target's baseline (SSE2 on x86-64): no run-time features used.
    Baseline,
    /// x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT.
    Avx2,
    /// x86-64-v4: the AVX2 level plus AVX-512 F, BW, CD, DQ and VL.
    Avx512,
}

impl Isa {
    /// The name `AMP_CPU_ISA` accepts and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Every level, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Baseline, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU can run code compiled for this level.
    pub fn supported(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                use std::arch::is_x86_feature_detected as has;
                has!("avx2") && has!("fma") && has!("f16c") && has!("bmi1") && has!("bmi2") && has!("lzcnt")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                use std::arch::is_x86_feature_detected as has;
                Isa::Avx2.supported()
                    && has!("avx512f")
                    && has!("avx512bw")
                    && has!("avx512cd")
                    && has!("avx512dq")
                    && has!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    fn from_u8(v: u8) -> Isa {
        match v {
            1 => Isa::Baseline,
            2 => Isa::Avx2,
            _ => Isa::Avx512,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Isa::Baseline => 1,
            Isa::Avx2 => 2,
            Isa::Avx512 => 3,
        }
    }
}

/// 0 until the first call of [`level`], then the chosen [`Isa`] (`Isa::to_u8`).
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The level the kernels run at: the widest this CPU supports, capped by `AMP_CPU_ISA`.
///
/// # Panics
/// When `AMP_CPU_ISA` is set to a name other than `baseline`, `avx2` or `avx512`.
#[inline]
pub fn level() -> Isa {
    match LEVEL.load(Ordering::Relaxed) {
        0 => choose(),
        v => Isa::from_u8(v),
    }
}

#[cold]
fn choose() -> Isa {
    let cap = match std::env::var("AMP_CPU_ISA") {
        Ok(name) => Isa::ALL
            .into_iter()
            .find(|i| i.name() == name)
            .unwrap_or_else(|| panic!("AMP_CPU_ISA={name:?}: expected one of baseline, avx2, avx512")),
        Err(_) => Isa::Avx512,
    };
    let best = Isa::ALL.into_iter().filter(|i| *i <= cap && i.supported()).max().unwrap_or(Isa::Baseline);
    LEVEL.store(best.to_u8(), Ordering::Relaxed);
    best
}

/// Sets the level for the rest of the process (tests comparing levels; benchmarks).
///
/// # Panics
/// When this CPU does not support `isa`.
#[doc(hidden)]
pub fn force(isa: Isa) {
    assert!(isa.supported(), "this CPU cannot run {} code", isa.name());
    LEVEL.store(isa.to_u8(), Ordering::Relaxed);
}

/// Runs `f` compiled for [`level`]. Pass `f` as `#[inline(always)] || ...` (and keep what it
/// calls inlinable) so its loops are compiled inside the feature-enabled function.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match level() {
        // SAFETY: `level` only returns a level whose features this CPU reported (`supported`).
        Isa::Avx512 => return unsafe { x86::avx512(f) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { x86::avx2(f) },
        Isa::Baseline => {}
    }
    f()
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! The feature-enabled trampolines and the explicit f16 conversions.

    use std::arch::x86_64::*;

    /// Runs `f` with the AVX-512 level's features enabled.
    ///
    /// # Safety
    /// The CPU must support [`super::Isa::Avx512`].
    #[target_feature(enable = "avx,avx2,fma,f16c,bmi1,bmi2,lzcnt,popcnt,avx512f,avx512bw,avx512cd,avx512dq,avx512vl")]
    #[inline]
    pub(crate) unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// Runs `f` with the AVX2 level's features enabled.
    ///
    /// # Safety
    /// The CPU must support [`super::Isa::Avx2`].
    #[target_feature(enable = "avx,avx2,fma,f16c,bmi1,bmi2,lzcnt,popcnt")]
    #[inline]
    pub(crate) unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// f16 bits to f32, 16 at a time (`vcvtph2ps` zmm).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f,f16c")]
    pub(crate) unsafe fn f16_to_f32_avx512(src: &[u16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= len of both slices; unaligned loads and stores.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        // SAFETY: same CPU requirement; the tail is shorter than 16.
        unsafe { f16_to_f32_f16c(&src[n..], &mut dst[n..]) }
    }

    /// f32 to f16 bits, round to nearest even, 16 at a time (`vcvtps2ph` zmm).
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f,f16c")]
    pub(crate) unsafe fn f32_to_f16_avx512(src: &[f32], dst: &mut [u16]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n <= len of both slices; unaligned loads and stores.
            unsafe {
                let v = _mm512_loadu_ps(src.as_ptr().add(i));
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
            }
        }
        // SAFETY: same CPU requirement; the tail is shorter than 16.
        unsafe { f32_to_f16_f16c(&src[n..], &mut dst[n..]) }
    }

    /// f16 bits to f32, 8 at a time, then one at a time (F16C).
    ///
    /// # Safety
    /// The CPU must support F16C and AVX; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(crate) unsafe fn f16_to_f32_f16c(src: &[u16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= len of both slices; unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(*s as i32)));
        }
    }

    /// f32 to f16 bits, round to nearest even, 8 at a time, then one at a time (F16C).
    ///
    /// # Safety
    /// The CPU must support F16C and AVX; `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(crate) unsafe fn f32_to_f16_f16c(src: &[f32], dst: &mut [u16]) {
        const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n <= len of both slices; unaligned loads and stores.
            unsafe {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), _mm256_cvtps_ph::<RNE>(v));
            }
        }
        for (d, s) in dst[n..].iter_mut().zip(&src[n..]) {
            *d = _mm_extract_epi16::<0>(_mm_cvtps_ph::<RNE>(_mm_set_ss(*s))) as u16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_levels_are_ordered() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_u8(isa.to_u8()), isa);
        }
        assert!(Isa::Baseline < Isa::Avx2 && Isa::Avx2 < Isa::Avx512);
        assert!(Isa::Baseline.supported());
        assert!(level().supported());
    }

    /// The explicit f16 conversions of every level this CPU has agree with `half`'s scalar
    /// conversions: every f16 bit pattern widened, and f32 values around every rounding case
    /// narrowed (lengths that leave tails for both vector widths).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_conversions_match_half_at_every_level() {
        use half::f16;
        let all: Vec<u16> = (0..=u16::MAX).chain(0..13).collect();
        let expect: Vec<u32> = all.iter().map(|b| f16::from_bits(*b).to_f32().to_bits()).collect();
        let mut narrow: Vec<f32> = all.iter().map(|b| f16::from_bits(*b).to_f32()).collect();
        // Halfway points and neighbours between adjacent f16 values, and values past the range.
        for b in 0..0x7bffu16 {
            let (lo, hi) = (f16::from_bits(b).to_f32(), f16::from_bits(b + 1).to_f32());
            let mid = (lo + hi) / 2.0;
            narrow.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1), -mid]);
        }
        narrow.extend([65520.0, 65519.99, 1e9, -1e9, f32::from_bits(1), 2.98e-8, 2.99e-8]);
        let expect_narrow: Vec<u16> = narrow.iter().map(|v| f16::from_f32(*v).to_bits()).collect();
        let mut ran = Vec::new();
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !isa.supported() {
                println!("SKIPPED: {} f16 conversions (this CPU lacks the level)", isa.name());
                continue;
            }
            let mut wide = vec![0f32; all.len()];
            let mut bits = vec![0u16; narrow.len()];
            // SAFETY: the level is supported (checked above); lengths are equal.
            unsafe {
                match isa {
                    Isa::Avx512 => {
                        x86::f16_to_f32_avx512(&all, &mut wide);
                        x86::f32_to_f16_avx512(&narrow, &mut bits);
                    }
                    _ => {
                        x86::f16_to_f32_f16c(&all, &mut wide);
                        x86::f32_to_f16_f16c(&narrow, &mut bits);
                    }
                }
            }
            let wide: Vec<u32> = wide.iter().map(|v| v.to_bits()).collect();
            assert!(wide == expect, "{}: f16 -> f32 differs from half", isa.name());
            for (i, (g, e)) in bits.iter().zip(&expect_narrow).enumerate() {
                assert_eq!(g, e, "{}: f32 {:e} -> f16", isa.name(), narrow[i]);
            }
            ran.push(isa.name());
        }
        println!("f16 conversions checked at: {ran:?}");
    }

    #[test]
    fn dispatch_runs_the_closure_once() {
        let mut calls = 0;
        assert_eq!(
            dispatch(|| {
                calls += 1;
                7
            }),
            7
        );
        assert_eq!(calls, 1);
    }
}
