//! f16 products on AMX-BF16 tiles, exact: every f16 is split into a bf16 high part and a bf16
//! low part, and the tiles multiply the parts ([`super::gemm_half`]'s `run_amx_f16`).
//!
//! Design notes:
//! - Why: a Xeon with AMX-BF16 but no AMX-FP16 has no f16 product faster than widening to f32
//!   and running f32 FMAs (the widening kernel, about 300 GFLOP/s on two cores), while its
//!   tiles run bf16 pairs at about 3.7 TFLOP/s a core. Four tile products per f16 product
//!   still leave the tiles ahead.
//! - Exactness: `x = h + l` with `h = bf16(x)` (round to nearest even) and `l = x - h`. An f16
//!   has 11 significant bits and `h` keeps 8, so `l`, a multiple of x's last place and at most
//!   half of h's last place, has at most 3 and is exact in bf16. `l` is 0 or at least 2⁻²⁴ (f16's
//!   smallest step), far inside bf16's normal range. So `a·b = h_a·h_b + l_a·h_b + h_a·l_b +
//!   l_a·l_b` with each product of 8-bit significands exact in f32 and at least 2⁻⁴⁸ or 0: no
//!   input, product or sum is subnormal, so the tiles' flushing of subnormals changes
//!   nothing. The 4k products are summed in f32, as the widening kernel sums its k, in
//!   another order.
//! - Layout: A step t of a row holds the pair `(h, l)` of its k value t, in the bf16 kernel's
//!   tiled layout ([`super::gemm_half`]'s `pack_pair_tiles`: one u32 a step). B holds per
//!   group of 16 k values 16 steps of `(h, h)` and then 16 of `(l, l)`: a tile of A's 16
//!   steps times the high tile gives `h_a·h_b + l_a·h_b`, times the low tile `h_a·l_b +
//!   l_a·l_b`. The kernel loads A's tiles once for both ([`super::amx::Tiles::block`] with two
//!   B chunks per A chunk): 6 tile loads per 8 products. k is padded with zeros to whole
//!   groups of 16.
//! - Infinities and NaN: an infinity's low part is not 0 but NaN (`inf - inf`), and `inf · 0`
//!   in a split product is NaN where the widened product is ±inf. So the packs report
//!   whether every value was finite, and the caller runs the widening kernel when one is
//!   not (a step with overflowed f16 activations, which the scaler then skips).

use rayon::prelude::*;

use super::amx::{BLOCK_ROWS as W, PAIRS};
use super::gemm_half::{NR, Operand};
use crate::{bf16, f16};

/// Whether this CPU has every instruction the packs use (every CPU with AMX-BF16 does).
pub(crate) fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether an `m × k × n` product runs split on tiles rather than widened: the CPU has what
/// the packs use, and the product is large enough in each dimension to pay for them. With
/// fewer than 128 rows or columns the high and low copies of B (8 bytes a value) or of A
/// are used too few times, and a k under 32 is padded to 16s at 4 products a value: on the
/// Xeon with AMX (2 threads) 64 × 1024 × 64 took 166 µs split and 68 µs widened, 256 × 10 ×
/// 1024 102 µs against 69, and 1024 × 256 × 10 151 µs against 101, while 128 × 64 × 128 took
/// 10 µs against 15 and 2048 × 256 × 768 1.6 ms against 2.6.
pub(crate) fn worth_it((m, k, n): (usize, usize, usize)) -> bool {
    m >= 128 && n >= 128 && k >= 32 && supported()
}

/// A's steps per row for `k` values: k rounded up to whole chunks of 16.
pub(crate) fn steps(k: usize) -> usize {
    k.div_ceil(PAIRS) * PAIRS
}

/// `(h, l)` bits of one f16: `h = bf16(x)`, `l = bf16(x - h)`, with `x = h + l` exactly when
/// `x` is finite.
fn split(x: f16) -> (u16, u16) {
    let v = x.to_f32();
    let h = bf16::from_f32(v);
    (h.to_bits(), bf16::from_f32(v - h.to_f32()).to_bits())
}

/// Whether an f16 is an infinity or NaN (all exponent bits set).
fn non_finite(x: f16) -> bool {
    x.to_bits() & 0x7c00 == 0x7c00
}

/// Packs `rows × k` of `x` into the front of `out` (grown if short) as A of the split product:
/// block i of 32 rows, chunk q, row r, step p at `[((i·chunks + q)·32 + r)·16 + p]` holds
/// `h | l << 16` of `x[32 i + r][16 q + p]`; rows past `rows` and steps past k are zero.
/// Returns false if some value is not finite (the pack is then incomplete).
pub(crate) fn pack_a(rows: usize, k: usize, x: Operand<'_, f16>, parallel: bool, out: &mut Vec<u32>) -> bool {
    let steps = steps(k);
    let chunks = steps / PAIRS;
    let block = chunks * W * PAIRS;
    let out = super::gemm_half::aligned_front(out, rows.div_ceil(W) * block, 0);
    if rows == 0 || k == 0 {
        return true;
    }
    let last = x.offset + (rows - 1) * x.rs + (k - 1) * x.cs;
    assert!(last < x.data.len(), "native GEMM operand out of bounds");
    let fill = |i: usize, panel: &mut [u32]| -> bool {
        let live = W.min(rows - i * W);
        let first = x.offset + i * W * x.rs;
        let at = |r: usize, t: usize| (t / PAIRS * W + r) * PAIRS + t % PAIRS;
        #[cfg(target_arch = "x86_64")]
        if supported() && (x.cs == 1 || (x.rs == 1 && live == W)) {
            // The SIMD paths write every step of the live rows, k's pad included.
            if live < W {
                panel.fill(0);
            }
            // SAFETY: the CPU has what `supported()` checks; the function checks its bounds.
            return unsafe { simd::fill_a(x, first, live, k, panel) };
        }
        panel.fill(0);
        let mut finite = true;
        for r in 0..live {
            for t in 0..k {
                let v = x.data[first + r * x.rs + t * x.cs];
                finite &= !non_finite(v);
                let (h, l) = split(v);
                panel[at(r, t)] = h as u32 | (l as u32) << 16;
            }
        }
        finite
    };
    if parallel {
        out.par_chunks_mut(block).enumerate().all(|(i, panel)| fill(i, panel))
    } else {
        out.chunks_mut(block).enumerate().all(|(i, panel)| fill(i, panel))
    }
}

/// Packs `cols × k` of `x` (B seen transposed: row j is B's column j) into the front of `out`
/// (grown if short) as B of the split product: panel j of 32 columns, group g of 16 k values,
/// part s (0 high, 1 low), step p, column c at `[((j·2·steps + 32 g + 16 s + p)·32 + c]`
/// holds `v | v << 16` for `v` the part of `x[32 j + c][16 g + p]`; columns past `cols` and
/// k values past k are zero. Returns false if some value is not finite (the pack is then
/// incomplete).
pub(crate) fn pack_b(cols: usize, k: usize, x: Operand<'_, f16>, parallel: bool, out: &mut Vec<u32>) -> bool {
    let steps = steps(k);
    let panel_len = 2 * steps * NR;
    let out = super::gemm_half::aligned_front(out, cols.div_ceil(NR) * panel_len, 0);
    if cols == 0 || k == 0 {
        return true;
    }
    let last = x.offset + (cols - 1) * x.rs + (k - 1) * x.cs;
    assert!(last < x.data.len(), "native GEMM operand out of bounds");
    let fill = |j: usize, panel: &mut [u32]| -> bool {
        let live = NR.min(cols - j * NR);
        let first = x.offset + j * NR * x.rs;
        #[cfg(target_arch = "x86_64")]
        if supported() && live == NR && (x.rs == 1 || x.cs == 1) {
            // SAFETY: the CPU has what `supported()` checks; the function checks its bounds.
            return unsafe { simd::fill_b(x, first, k, panel) };
        }
        panel.fill(0);
        let mut finite = true;
        for c in 0..live {
            for t in 0..k {
                let v = x.data[first + c * x.rs + t * x.cs];
                finite &= !non_finite(v);
                let (h, l) = split(v);
                let step = 2 * (t / PAIRS * PAIRS) + t % PAIRS;
                panel[step * NR + c] = h as u32 * 0x1_0001;
                panel[(step + PAIRS) * NR + c] = l as u32 * 0x1_0001;
            }
        }
        finite
    };
    if parallel {
        out.par_chunks_mut(panel_len).enumerate().all(|(j, p)| fill(j, p))
    } else {
        out.chunks_mut(panel_len).enumerate().all(|(j, p)| fill(j, p))
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    //! The packs' fast paths: 16 f16 at a time split with `vcvtph2ps` and `vcvtneps2bf16`.

    use std::arch::x86_64::*;

    use super::{NR, Operand, PAIRS, W};
    use crate::f16;

    /// Loads `len` (at most 16) f16 from `x[at..]`, zero past `len`.
    ///
    /// # Safety
    /// The CPU must support AVX2; `x[at..at + len]` must be in bounds (checked).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load16(x: &[f16], at: usize, len: usize) -> __m256i {
        let src = &x[at..at + len];
        if len == 16 {
            // SAFETY: `src` holds 16 f16 (32 bytes), read unaligned.
            unsafe { _mm256_loadu_si256(src.as_ptr().cast()) }
        } else {
            let mut buf = [0u16; 16];
            for (b, v) in buf.iter_mut().zip(src) {
                *b = v.to_bits();
            }
            // SAFETY: `buf` is 32 bytes.
            unsafe { _mm256_loadu_si256(buf.as_ptr().cast()) }
        }
    }

    /// The high and low bf16 parts of 16 f16 (bits), zero-extended into u32 lanes; `bad`
    /// gathers each value's magnitude bits (a value is not finite when they reach 0x7c00).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F, BW and BF16 and AVX2.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
    unsafe fn split16(bits: __m256i, bad: &mut __m256i) -> (__m512i, __m512i) {
        *bad = _mm256_max_epu16(*bad, _mm256_and_si256(bits, _mm256_set1_epi16(0x7fff)));
        let x = _mm512_cvtph_ps(bits);
        // SAFETY: __m256bh and __m256i are both 32 bytes, any bit pattern valid.
        let h: __m256i = unsafe { std::mem::transmute(_mm512_cvtneps_pbh(x)) };
        let h = _mm512_cvtepu16_epi32(h);
        let low = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
        // SAFETY: as above.
        let l: __m256i = unsafe { std::mem::transmute(_mm512_cvtneps_pbh(low)) };
        (h, _mm512_cvtepu16_epi32(l))
    }

    /// Whether every value [`split16`] saw was finite.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn all_finite(bad: __m256i) -> bool {
        let over = _mm256_cmpgt_epi16(bad, _mm256_set1_epi16(0x7bff));
        _mm256_testz_si256(over, over) == 1
    }

    /// One 32-row block of [`super::pack_a`] from rows with contiguous k (`x.cs == 1`, any
    /// `live`) or adjacent rows (`x.rs == 1`, `live == 32`): every step of the live rows is
    /// written (the rows past `live` are the caller's to zero).
    ///
    /// # Safety
    /// The CPU must have what [`super::supported`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,f16c")]
    pub(super) unsafe fn fill_a(x: Operand<'_, f16>, first: usize, live: usize, k: usize, panel: &mut [u32]) -> bool {
        let chunks = k.div_ceil(PAIRS);
        assert!(panel.len() >= chunks * W * PAIRS && live <= W);
        let mut bad = _mm256_setzero_si256();
        if x.cs == 1 {
            // Row by row: a chunk of 16 k values becomes one 64-byte row of a tile.
            for r in 0..live {
                for q in 0..chunks {
                    let len = PAIRS.min(k - q * PAIRS);
                    // SAFETY: load16 checks its bounds; the store writes the 16 u32 of row r
                    // of chunk q, inside `panel` (asserted); the features are the caller's.
                    unsafe {
                        let (h, l) = split16(load16(x.data, first + r * x.rs + q * PAIRS, len), &mut bad);
                        let pairs = _mm512_or_si512(h, _mm512_slli_epi32(l, 16));
                        _mm512_storeu_si512(panel.as_mut_ptr().add((q * W + r) * PAIRS).cast(), pairs);
                    }
                }
            }
        } else {
            assert!(x.rs == 1 && live == W);
            // Adjacent rows (a transposed view, the weight gradient's dyᵀ): a k value's 32
            // rows are one run; gather a chunk's 16 runs, then transpose them in registers.
            let mut by_step = [[0u32; W]; PAIRS];
            for q in 0..chunks {
                for (p, dst) in by_step.iter_mut().enumerate() {
                    let t = q * PAIRS + p;
                    if t >= k {
                        *dst = [0; W];
                        continue;
                    }
                    for half in 0..2 {
                        // SAFETY: load16 checks its bounds; the store writes 16 of the 32 u32
                        // of `dst`; the features are the caller's.
                        unsafe {
                            let (h, l) = split16(load16(x.data, first + t * x.cs + 16 * half, 16), &mut bad);
                            let pairs = _mm512_or_si512(h, _mm512_slli_epi32(l, 16));
                            _mm512_storeu_si512(dst[16 * half..].as_mut_ptr().cast(), pairs);
                        }
                    }
                }
                super::super::gemm_half::transpose_pairs(&by_step, &mut panel[q * W * PAIRS..][..W * PAIRS]);
            }
        }
        all_finite(bad)
    }

    /// One full panel (32 columns) of [`super::pack_b`] from columns adjacent in B's rows
    /// (`x.rs == 1`: B row-major) or with contiguous k (`x.cs == 1`: B = Wᵀ of a `linear`),
    /// every value of it written.
    ///
    /// # Safety
    /// The CPU must have what [`super::supported`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,f16c")]
    pub(super) unsafe fn fill_b(x: Operand<'_, f16>, first: usize, k: usize, panel: &mut [u32]) -> bool {
        let groups = k.div_ceil(PAIRS);
        assert!(panel.len() >= 2 * groups * PAIRS * NR);
        let mut bad = _mm256_setzero_si256();
        let dup = |v: __m512i| _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
        if x.rs == 1 {
            // A k value's 32 columns are one run: its high and low rows are stored directly,
            // and the steps of k's pad zeroed.
            for t in k..groups * PAIRS {
                let step = 2 * (t / PAIRS * PAIRS) + t % PAIRS;
                panel[step * NR..][..NR].fill(0);
                panel[(step + PAIRS) * NR..][..NR].fill(0);
            }
            for t in 0..k {
                let step = 2 * (t / PAIRS * PAIRS) + t % PAIRS;
                for half in 0..2 {
                    // SAFETY: load16 checks its bounds; the stores write 16 u32 of step rows
                    // `step` and `step + 16` (< 2·groups·16), inside `panel` (asserted).
                    unsafe {
                        let (h, l) = split16(load16(x.data, first + t * x.cs + 16 * half, 16), &mut bad);
                        let at = step * NR + 16 * half;
                        _mm512_storeu_si512(panel.as_mut_ptr().add(at).cast(), dup(h));
                        _mm512_storeu_si512(panel.as_mut_ptr().add(at + PAIRS * NR).cast(), dup(l));
                    }
                }
            }
        } else {
            assert_eq!(x.cs, 1);
            // Each column's k values are contiguous: split a group's 16 per column, then
            // transpose the 32 columns × 16 steps of each part in registers.
            let mut high = [[0u32; PAIRS]; NR];
            let mut low = [[0u32; PAIRS]; NR];
            for g in 0..groups {
                let len = PAIRS.min(k - g * PAIRS);
                for c in 0..NR {
                    // SAFETY: load16 checks its bounds; the stores write the 16 u32 of
                    // `high[c]` and `low[c]`.
                    unsafe {
                        let (h, l) = split16(load16(x.data, first + c * x.rs + g * PAIRS, len), &mut bad);
                        _mm512_storeu_si512(high[c].as_mut_ptr().cast(), dup(h));
                        _mm512_storeu_si512(low[c].as_mut_ptr().cast(), dup(l));
                    }
                }
                let part = |s: usize| 2 * g * PAIRS * NR + s * PAIRS * NR;
                for (s, rows) in [(0, &high), (1, &low)] {
                    let dst = &mut panel[part(s)..][..PAIRS * NR];
                    // SAFETY: `load` reads lanes s0..s0 + 8 <= 16 of row r < 32; AVX2 is
                    // the caller's guarantee; `dst` holds 16 steps of 32.
                    unsafe {
                        super::super::gemm_half::transpose_panel(NR, PAIRS, dst, |r, s0| {
                            _mm256_loadu_si256(rows[r][s0..].as_ptr().cast())
                        })
                    };
                }
            }
        }
        all_finite(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::super::gemm_half::aligned;
    use super::*;

    /// Every finite f16 is exactly its high plus its low part, and the low part is 0 or a
    /// normal bf16 no smaller than f16's smallest step.
    #[test]
    fn split_is_exact_for_every_finite_f16() {
        for bits in 0..=u16::MAX {
            let x = f16::from_bits(bits);
            if non_finite(x) {
                continue;
            }
            let (h, l) = split(x);
            let (h, l) = (bf16::from_bits(h).to_f64(), bf16::from_bits(l).to_f64());
            assert_eq!(h + l, x.to_f64(), "{x} ({bits:#06x})");
            assert!(l == 0.0 || l.abs() >= 2f64.powi(-24), "{x}: low part {l}");
        }
    }

    /// Values of every magnitude, some negative, zeros and subnormals among them.
    fn values(len: usize, seed: u32) -> Vec<f16> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let v = f16::from_bits((s >> 16) as u16 & 0x7bff | (s >> 15) as u16 & 0x8000);
                if s.is_multiple_of(7) { f16::ZERO } else { v }
            })
            .collect()
    }

    /// The SIMD paths lay out what the scalar definition does, for every operand layout, whole
    /// and ragged blocks and panels, k with and without a partial group.
    #[test]
    fn packs_match_their_definition() {
        if !(super::super::amx::available() && supported()) {
            eprintln!("SKIPPED: the f16 split packs' SIMD paths (no AMX-BF16 on this CPU)");
            return;
        }
        for (rows, k) in [(32, 16), (64, 37), (40, 5), (33, 48), (96, 100)] {
            let data = values(rows * k + 3, (rows * k) as u32);
            for (rs, cs) in [(k, 1), (1, rows)] {
                let x = Operand { data: &data, offset: 3, rs, cs };
                let at = |r: usize, t: usize| data[3 + r * rs + t * cs];
                // Stale values in the buffer, as a kept pack buffer holds: every packed value
                // must be written, zeros included.
                let mut buf = vec![0xdead_beef_u32; 1 << 16];
                assert!(pack_a(rows, k, x, false, &mut buf));
                let got = aligned(&buf);
                let steps = steps(k);
                for r in 0..rows.div_ceil(W) * W {
                    for t in 0..steps {
                        let want = if r < rows && t < k {
                            let (h, l) = split(at(r, t));
                            h as u32 | (l as u32) << 16
                        } else {
                            0
                        };
                        let idx = ((r / W * (steps / PAIRS) + t / PAIRS) * W + r % W) * PAIRS + t % PAIRS;
                        assert_eq!(got[idx], want, "A {rows}x{k} rs={rs} cs={cs} row {r} k {t}");
                    }
                }
                let mut buf = vec![0xdead_beef_u32; 1 << 16];
                assert!(pack_b(rows, k, x, true, &mut buf));
                let got = aligned(&buf);
                for c in 0..rows.div_ceil(NR) * NR {
                    for t in 0..steps {
                        let (h, l) = if c < rows && t < k { split(at(c, t)) } else { (0, 0) };
                        let step = (c / NR) * 2 * steps + 2 * (t / PAIRS * PAIRS) + t % PAIRS;
                        assert_eq!(got[step * NR + c % NR], h as u32 * 0x1_0001, "B high {rows}x{k} col {c} k {t}");
                        assert_eq!(
                            got[(step + PAIRS) * NR + c % NR],
                            l as u32 * 0x1_0001,
                            "B low {rows}x{k} col {c} k {t}"
                        );
                    }
                }
            }
        }
    }

    /// A non-finite value anywhere, on every path, makes the pack say so.
    #[test]
    fn packs_report_non_finite_values() {
        for bad in [f16::INFINITY, f16::NEG_INFINITY, f16::NAN] {
            for (rows, k) in [(32, 16), (40, 5), (64, 37)] {
                for (rs, cs) in [(k, 1), (1, rows), (2 * k, 2)] {
                    for at in [0, rows * k / 2, rows * k - 1] {
                        let mut data = values(2 * rows * k, 5);
                        let (r, t) = (at / k, at % k);
                        data[r * rs + t * cs] = bad;
                        let x = Operand { data: &data, offset: 0, rs, cs };
                        assert!(!pack_a(rows, k, x, false, &mut Vec::new()), "A {bad} at ({r}, {t}) rs={rs}");
                        assert!(!pack_b(rows, k, x, true, &mut Vec::new()), "B {bad} at ({r}, {t}) rs={rs}");
                    }
                }
            }
        }
    }
}
