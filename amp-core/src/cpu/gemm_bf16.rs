//! Native bf16 GEMM on AVX-512 BF16 (`vdpbf16ps`): bf16 inputs, f32 accumulation, one
//! rounding of each output to bf16 at the end.
//!
//! Why: widening both operands to f32 and running an f32 GEMM costs two f32 copies and runs at
//! f32 speed; `vdpbf16ps` multiplies pairs of bf16 exactly (8-bit significands, so the product
//! fits f32) and adds them into f32 lanes, at twice the f32 FMA rate.
//!
//! Layout (BLIS-style): A is packed into panels of [`MR`] rows, B into panels of [`NR`] columns,
//! both with k taken in pairs (the two bf16 of a pair share one 32-bit lane, as `vdpbf16ps`
//! wants; an odd k is padded with a zero). Packing reads any strides, so transposed views cost
//! nothing extra. The microkernel keeps an MR×NR tile of f32 accumulators in zmm registers;
//! k is blocked by [`KC`] pairs so a B micro-panel stays in L1, columns by [`NC`] so the f32
//! tile buffer of a row block stays in L2. Row blocks run in parallel on rayon.
//!
//! Numerics differ from a scalar f32 loop in two ways that both stay within the contract:
//! the summation order (pairs, then k blocks), and `vdpbf16ps` treats denormal inputs as zero
//! and flushes denormal partial sums (magnitudes below 1.2e-38), which a bf16 model never
//! relies on.

use rayon::prelude::*;

use crate::precision::{DType, Precision};

/// Rows of the register tile.
const MR: usize = 8;
/// Columns of the register tile (two zmm of 16 f32 lanes).
const NR: usize = 32;
/// k pairs per cache block: a B micro-panel is KC·NR·4 bytes = 16 KiB, half of L1.
const KC: usize = 128;
/// Columns per block of the f32 accumulator buffer.
const NC: usize = 512;
/// Most rows per parallel task.
const MC: usize = 96;
/// Below this many flops the product runs on the calling thread.
const PAR_FLOPS: usize = 1 << 22;

/// One 2-D operand: `data[offset + i * rs + j * cs]` is element (i, j).
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a, E> {
    /// Storage the view reads.
    pub data: &'a [E],
    /// Index of element (0, 0).
    pub offset: usize,
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

/// Whether this CPU runs the native kernel.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out = round_bf16(a @ b + bias)` for `a: [m, k]`, `b: [k, n]`, `bias: [n]` (added into the
/// f32 accumulator), `out` contiguous `[m, n]`. Returns false, leaving `out` untouched, when
/// `E` is not bf16 or the CPU lacks AVX-512 BF16; the caller then takes the f32 path.
pub(crate) fn gemm<E: Precision>(
    (m, k, n): (usize, usize, usize),
    a: Operand<'_, E>,
    b: Operand<'_, E>,
    bias: Option<&[f32]>,
    out: &mut [E],
    parallel: bool,
) -> bool {
    if E::DTYPE != DType::BF16 || !available() {
        return false;
    }
    assert_eq!(out.len(), m * n);
    if m * n == 0 {
        return true;
    }
    if let Some(bias) = bias {
        assert_eq!(bias.len(), n);
    }
    assert_eq!(std::mem::size_of::<E>(), 2);
    // SAFETY: E is bf16 (checked above), a `repr(transparent)` u16, so both slices reinterpret
    // as u16 bit patterns of the same length; packing then moves bits instead of converting.
    let (a_bits, b_bits) = unsafe {
        (
            std::slice::from_raw_parts(a.data.as_ptr().cast::<u16>(), a.data.len()),
            std::slice::from_raw_parts(b.data.as_ptr().cast::<u16>(), b.data.len()),
        )
    };
    let a = Operand { data: a_bits, offset: a.offset, rs: a.rs, cs: a.cs };
    let b = Operand { data: b_bits, offset: b.offset, rs: b.rs, cs: b.cs };
    let kp = k.div_ceil(2);
    let big = parallel && 2 * m * n * k >= PAR_FLOPS;
    let pa = pack(m, k, MR, a, big);
    let pb = pack(n, k, NR, Operand { data: b.data, offset: b.offset, rs: b.cs, cs: b.rs }, big);
    // Rows per task: enough tasks for every thread when m allows, a multiple of MR.
    let threads = if big { rayon::current_num_threads() } else { 1 };
    let rows = (m.div_ceil(2 * threads).div_ceil(MR) * MR).clamp(MR, MC);
    let task = |t: usize, dst: &mut [E]| {
        let r0 = t * rows;
        let mc = dst.len() / n;
        let mc_pad = mc.div_ceil(MR) * MR;
        let mut c = vec![0f32; mc_pad * NC];
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            let nc_pad = nc.div_ceil(NR) * NR;
            let c = &mut c[..mc_pad * nc_pad];
            match bias {
                Some(bias) => c.chunks_mut(nc_pad).for_each(|row| row[..nc].copy_from_slice(&bias[jc..jc + nc])),
                None => c.fill(0.0),
            }
            for pc in (0..kp).step_by(KC) {
                let kc = KC.min(kp - pc);
                for jr in 0..nc_pad / NR {
                    let bp = &pb[((jc / NR + jr) * kp + pc) * NR..][..kc * NR];
                    for ir in 0..mc_pad / MR {
                        let ap = &pa[((r0 / MR + ir) * kp + pc) * MR..][..kc * MR];
                        let tile = &mut c[ir * MR * nc_pad + jr * NR..];
                        micro(kc, ap, bp, tile, nc_pad);
                    }
                }
            }
            for r in 0..mc {
                E::from_f32_slice(&c[r * nc_pad..r * nc_pad + nc], &mut dst[r * n + jc..r * n + jc + nc]);
            }
        }
    };
    if big {
        out.par_chunks_mut(rows * n).enumerate().for_each(|(t, dst)| task(t, dst));
    } else {
        out.chunks_mut(rows * n).enumerate().for_each(|(t, dst)| task(t, dst));
    }
    true
}

/// Packs `rows × k` of `x` into panels of `w` rows: panel i, pair p, row r at
/// `[(i * kp + p) * w + r]`, holding elements (r, 2p) in the low and (r, 2p + 1) in the high
/// half. Rows past `rows` and the pad of an odd k are zero.
fn pack(rows: usize, k: usize, w: usize, x: Operand<'_, u16>, parallel: bool) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let mut out = vec![0u32; rows.div_ceil(w) * w * kp];
    if kp == 0 {
        return out;
    }
    let last = x.offset + (rows - 1) * x.rs + (k - 1) * x.cs;
    assert!(last < x.data.len(), "gemm_bf16 operand out of bounds");
    let fill = |i: usize, panel: &mut [u32]| {
        for r in 0..w.min(rows - i * w) {
            let row = x.offset + (i * w + r) * x.rs;
            for p in 0..k / 2 {
                let lo = x.data[row + 2 * p * x.cs] as u32;
                let hi = x.data[row + (2 * p + 1) * x.cs] as u32;
                panel[p * w + r] = lo | hi << 16;
            }
            if k % 2 == 1 {
                panel[(kp - 1) * w + r] = x.data[row + (k - 1) * x.cs] as u32;
            }
        }
    };
    if parallel {
        out.par_chunks_mut(kp * w).enumerate().for_each(|(i, p)| fill(i, p));
    } else {
        out.chunks_mut(kp * w).enumerate().for_each(|(i, p)| fill(i, p));
    }
    out
}

/// `tile[r * ldc + j] += Σ_p a[p·MR + r] · b[p·NR + j]` over `kc` pairs, for an MR×NR tile.
fn micro(kc: usize, a: &[u32], b: &[u32], tile: &mut [f32], ldc: usize) {
    assert!(a.len() >= kc * MR && b.len() >= kc * NR && tile.len() >= (MR - 1) * ldc + NR);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `gemm` only runs after `available()` saw avx512f and avx512bf16 on this CPU, and
    // the assert above covers every index the kernel reads and writes.
    unsafe {
        micro_avx512(kc, a.as_ptr(), b.as_ptr(), tile.as_mut_ptr(), ldc)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("gemm_bf16 runs only where available() is true")
}

/// The register-blocked kernel: 2·MR zmm accumulators, two B vectors per pair, A pairs
/// broadcast from memory.
///
/// # Safety
/// The CPU must support avx512f and avx512bf16; `a` must be readable for `kc * MR` u32, `b`
/// for `kc * NR`, and `c` readable and writable at `r * ldc + j` for r < MR, j < NR.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_avx512(kc: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for (r, acc) in acc.iter_mut().enumerate() {
        // SAFETY: row r < MR of the tile, columns 0..32, inside `c` per the contract.
        unsafe {
            acc[0] = _mm512_loadu_ps(c.add(r * ldc));
            acc[1] = _mm512_loadu_ps(c.add(r * ldc + 16));
        }
    }
    for p in 0..kc {
        // SAFETY: p < kc, so p·NR + 32 ≤ kc·NR and p·MR + MR ≤ kc·MR stay inside `b` and `a`;
        // __m512i and __m512bh are both 64-byte vectors for which every bit pattern is valid.
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(p * MR + r) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: as for the loads above.
        unsafe {
            _mm512_storeu_ps(c.add(r * ldc), acc[0]);
            _mm512_storeu_ps(c.add(r * ldc + 16), acc[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16;
    use crate::layout::Layout;

    /// Random bf16 values in [-2, 2) from a fixed LCG, so every case is reproducible.
    fn values(len: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                bf16::from_f64(((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0)
            })
            .collect()
    }

    fn ulp(x: f64) -> f64 {
        let b = bf16::from_f64(x).to_f64().abs().max(f64::MIN_POSITIVE);
        // One bf16 ulp at |x|: 2^(exponent - 7).
        2f64.powi(b.log2().floor() as i32 - 7)
    }

    /// Checks `a @ b` (+ bias) through both paths for one shape and layout. `ta`/`tb` store
    /// the operand transposed (column-major), so packing reads strided views.
    fn case(m: usize, k: usize, n: usize, ta: bool, tb: bool, with_bias: bool) {
        let a = values(m * k + 3, (m * 31 + k * 7 + n) as u64);
        let b = values(k * n + 5, (m + k * 13 + n * 17) as u64);
        let bias = values(n, 99);
        let (a_rs, a_cs) = if ta { (1, m) } else { (k, 1) };
        let (b_rs, b_cs) = if tb { (1, k) } else { (n, 1) };
        // An offset of 2 into A and 1 into B, so offsets are exercised too.
        let a_at = |i: usize, p: usize| a[2 + i * a_rs + p * a_cs].to_f64();
        let b_at = |p: usize, j: usize| b[1 + p * b_rs + j * b_cs].to_f64();
        let mut want64 = vec![0f64; m * n];
        let mut want32 = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let (mut s64, mut s32) = if with_bias { (bias[j].to_f64(), bias[j].to_f32()) } else { (0.0, 0.0) };
                for p in 0..k {
                    s64 += a_at(i, p) * b_at(p, j);
                    s32 += (a_at(i, p) * b_at(p, j)) as f32;
                }
                want64[i * n + j] = s64;
                want32[i * n + j] = s32;
            }
        }
        let la = Layout { shape: vec![m, k], strides: vec![a_rs, a_cs], offset: 2 };
        let lb = Layout { shape: vec![k, n], strides: vec![b_rs, b_cs], offset: 1 };
        let wt = Layout { shape: vec![n, k], strides: vec![b_cs, b_rs], offset: 1 };
        let run = |native: bool| {
            if with_bias {
                super::super::matmul::linear_with(&a, &la, &b, &wt, Some(&bias), native)
            } else {
                super::super::matmul::matmul_with(&a, &la, &b, &lb, &[], native)
            }
        };
        let mut paths = vec![("fallback", run(false))];
        if available() {
            paths.push(("native", run(true)));
        }
        for (name, got) in paths {
            assert_eq!(got.len(), m * n);
            for (idx, g) in got.iter().enumerate() {
                let (g, w64, w32) = (g.to_f64(), want64[idx], want32[idx] as f64);
                // f32 accumulation in any order errs by at most k·2⁻²⁴·Σ|a·b| (+ the bias).
                let mag: f64 = (0..k).map(|p| (a_at(idx / n, p) * b_at(p, idx % n)).abs()).sum::<f64>() + 2.0;
                let f32_err = (k as f64 + 1.0) * 2f64.powi(-24) * mag;
                assert!(
                    (g - w64).abs() <= 0.5 * ulp(w64) + f32_err + 1e-30,
                    "{name} {m}x{k}x{n} ta={ta} tb={tb} bias={with_bias} [{idx}]: {g} vs f64 {w64}"
                );
                // And equal to one f32 accumulate-then-round within one bf16 ulp.
                let r32 = bf16::from_f32(w32 as f32).to_f64();
                assert!(
                    (g - r32).abs() <= ulp(r32) + f32_err,
                    "{name} {m}x{k}x{n} [{idx}]: {g} vs f32-then-round {r32}"
                );
            }
        }
    }

    #[test]
    fn shapes_layouts_and_bias_match_reference() {
        let shapes = [
            (1, 1, 1),
            (1, 0, 1),
            (4, 0, 3),
            (3, 1000, 5),
            (7, 3, 9),
            (9, 33, 31),
            (8, 2, 32),
            (17, 1, 65),
            (257, 129, 67),
            (1, 300, 600),
            (100, 257, 1),
        ];
        for &(m, k, n) in &shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                case(m, k, n, ta, tb, false);
            }
            case(m, k, n, false, true, true);
            case(m, k, n, true, false, true);
        }
    }

    /// Large enough to take the parallel path, several k and column blocks, ragged edges.
    #[test]
    fn blocked_parallel_product() {
        case(203, 600, 1100, false, false, false);
        case(130, 301, 520, true, true, true);
    }

    /// Batched, broadcast matmul through the native path matches the fallback per batch.
    #[test]
    fn batched_native_matches_fallback() {
        let a = values(3 * 5 * 7, 1);
        let b = values(7 * 4, 2);
        let la = Layout::contiguous(&[3, 5, 7]);
        let lb = Layout { shape: vec![1, 7, 4], strides: vec![0, 1, 7], offset: 0 };
        let native = super::super::matmul::matmul_with(&a, &la, &b, &lb, &[3], true);
        let fallback = super::super::matmul::matmul_with(&a, &la, &b, &lb, &[3], false);
        assert_eq!(native.len(), 3 * 5 * 4);
        for (x, y) in native.iter().zip(&fallback) {
            let (x, y) = (x.to_f64(), y.to_f64());
            assert!((x - y).abs() <= ulp(y) * 1.01, "{x} vs {y}");
        }
    }

    /// Non-bf16 element types are refused, so the caller keeps its own path.
    #[test]
    fn refuses_other_types() {
        let x = [1f32; 4];
        let op = Operand { data: &x[..], offset: 0, rs: 2, cs: 1 };
        let mut out = [0f32; 4];
        assert!(!gemm((2, 2, 2), op, op, None, &mut out, false));
        assert_eq!(out, [0.0; 4]);
    }
}
