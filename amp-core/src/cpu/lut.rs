//! Unary ops on f16 and bf16 by table lookup ([`UnaryOp::TABULATE`]).
//!
//! Design notes:
//! - A 16-bit input takes one of 65,536 values, so an op costlier than a memory lookup (GELU's
//!   `erf`, `tanh`, `exp`) is evaluated once per process at every one of them and looked up
//!   afterwards. The tables are computed by the op's own `forward` and `derivative` with the
//!   computed path's loads and rounding ([`super::map_unary`]), so a lookup returns that path's
//!   bits exactly (the tests compare every value of every tabulated op).
//! - Per (op, its parameter, dtype): the forward's rounded results (65,536 values and one pad:
//!   128 KiB) and, where the derivative reads `x` alone (GELU's `Φ(x) + x φ(x)`, which
//!   recomputes the `erf`), the derivative in f32 (256 KiB). A derivative of `y` (`1 - y²` for
//!   `tanh`) is a multiply or two, cheaper computed than gathered. Built on first use, on the calling
//!   thread (a rayon task waiting inside the build could otherwise re-enter it), and kept for
//!   the process: a few hundred KiB per op and dtype in use.
//! - The hot part of a table is small (activations span a few dozen exponents: a few KiB of
//!   each), so lookups hit L1. With AVX-512 (at the [`crate::simd`] level in force) 16 values
//!   are gathered per instruction; elsewhere a scalar loop looks them up four at a time. GELU
//!   over 2M bf16 on the Xeon with AMX, 2 threads: forward 0.26-0.31 ms against 0.98-1.2
//!   computed, backward 0.50-0.54 against 1.07-1.16.
//! - Except the forward's u16 lookups on AMD CPUs, whose `vpgatherdd` is slow (microcoded on
//!   Zen 4): four scalar lookups into one 8-byte store beat it there (one core of the Zen 4
//!   VM, 1M lookups: 258 us against 400; W2 bf16's GELU forward 28% faster). The backward's
//!   f32 lookups stay gathered (scalar ones, faster alone, made its pass 25% slower in W2),
//!   in one pass ([`gather_times_g`]): each 16 derivatives are gathered, multiplied by `g`
//!   and rounded in registers; through f32 buffers (derivatives, `g`, products) the pass
//!   took about twice as long.
//! - Only contiguous operands of one shape are looked up; the backend copies a strided input
//!   first (as the computed path does) and computes the rare broadcast backward.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::Mutex;

use crate::backend::UnaryOp;
use crate::precision::{Accum, DType, Precision};

use super::{BUF, CHUNK, acc_in, acc_out, alloc, par_chunks_mut};

/// Values of a 16-bit type.
const VALUES: usize = 1 << 16;

/// One op's tables for one dtype.
struct Tables {
    /// `forward[b]`: the bits of `round(f(value with bits b))`; one more zero entry, so the
    /// 4-byte gather of the last value stays inside.
    forward: Vec<u16>,
    /// `derivative[b]`: `f'` at the `x` with bits `b`, in f32 (the accumulation type of f16
    /// and bf16); empty unless [`derivative_tabulated`].
    derivative: Vec<f32>,
}

/// (The op's type, its parameter's bits, the dtype).
type Key = (TypeId, u64, DType);

static TABLES: Mutex<Option<HashMap<Key, &'static Tables>>> = Mutex::new(None);

/// Whether `E`'s values are 16-bit patterns a table can index.
fn sixteen_bit<E: Precision>() -> bool {
    matches!(E::DTYPE, DType::F16 | DType::BF16) && std::mem::size_of::<E>() == 2
}

/// The bits of f16 or bf16 values.
fn bits<E: Precision>(x: &[E]) -> &[u16] {
    assert!(sixteen_bit::<E>());
    // SAFETY: E is f16 or bf16 (checked by DTYPE; `Precision` is sealed, one type per DTYPE),
    // each a `repr(transparent)` wrapper of u16: same size and alignment, every bit pattern valid
    // both ways.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u16>(), x.len()) }
}

/// [`bits`], writable.
fn bits_mut<E: Precision>(x: &mut [E]) -> &mut [u16] {
    assert!(sixteen_bit::<E>());
    // SAFETY: as in `bits`; the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u16>(), x.len()) }
}

/// Whether the op's backward looks its derivative up: it reads `x` alone.
fn derivative_tabulated<O: UnaryOp>() -> bool {
    O::DERIVATIVE_READS_X && !O::DERIVATIVE_READS_Y
}

/// Whether [`backward`] looks up this op's derivative for `E` (else it returns `None`): the
/// backend asks first, so an operand it would only have copied for the lookup is not copied.
pub(crate) fn looks_up_backward<E: Precision, O: UnaryOp>() -> bool {
    O::TABULATE && sixteen_bit::<E>() && derivative_tabulated::<O>()
}

/// This op's tables for `E`, built on first use; `None` when the op is not tabulated or `E`
/// is not a 16-bit type.
fn tables<E: Precision, O: UnaryOp>(op: O) -> Option<&'static Tables> {
    if !(O::TABULATE && sixteen_bit::<E>()) {
        return None;
    }
    let key = (TypeId::of::<O>(), op.param().to_bits(), E::DTYPE);
    let lock = || TABLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = lock().get_or_insert_with(HashMap::new).get(&key) {
        return Some(t);
    }
    // Built outside the lock (two threads may both build; the first stored is kept).
    let built = build::<E, O>(op);
    Some(*lock().get_or_insert_with(HashMap::new).entry(key).or_insert_with(|| Box::leak(Box::new(built))))
}

/// Evaluates the op at every value of `E`, on this thread.
fn build<E: Precision, O: UnaryOp>(op: O) -> Tables {
    assert!(sixteen_bit::<E>());
    let all: Vec<u16> = (0..=u16::MAX).collect();
    // SAFETY: as in `bits`: E is f16 or bf16 (asserted).
    let values: &[E] = unsafe { std::slice::from_raw_parts(all.as_ptr().cast::<E>(), all.len()) };
    let mut forward = vec![0u16; VALUES + 1];
    let mut derivative = vec![0f32; if derivative_tabulated::<O>() { VALUES } else { 0 }];
    let mut out = vec![E::default(); VALUES];
    super::dispatch(
        #[inline(always)]
        || {
            let mut bx = [E::Acc::default(); BUF];
            let mut by = [E::Acc::default(); BUF];
            for (c, (x, o)) in values.chunks(BUF).zip(out.chunks_mut(BUF)).enumerate() {
                let n = x.len();
                let x = acc_in(x, &mut bx[..n]);
                acc_out(
                    o,
                    &mut by[..n],
                    #[inline(always)]
                    |o| {
                        for (o, v) in o.iter_mut().zip(x) {
                            *o = op.forward(*v);
                        }
                    },
                );
                // `x` for the derivative's `y` too, which it does not read.
                for (d, v) in derivative.iter_mut().skip(c * BUF).take(n).zip(x) {
                    *d = op.derivative(*v, *v).f64() as f32;
                }
            }
        },
    );
    forward[..VALUES].copy_from_slice(bits(&out));
    Tables { forward, derivative }
}

/// `f(x)` by lookup, or `None` (the caller computes it) when the op has no table for `E`.
pub(crate) fn forward<E: Precision, O: UnaryOp>(op: O, x: &[E]) -> Option<Vec<E>> {
    let t = tables::<E, O>(op)?;
    let mut out = alloc::take::<E>(x.len());
    let xb = bits(x);
    let ob = bits_mut(&mut out);
    par_chunks_mut(
        ob,
        #[inline(always)]
        |ci, o| lookup_u16(&xb[ci * CHUNK..][..o.len()], &t.forward, o),
    );
    Some(out)
}

/// `g · f'(x)` by lookup (`x` and `g` contiguous, of one length), or `None` when the op has no
/// table of its derivative for `E`: the caller computes it.
pub(crate) fn backward<E: Precision, O: UnaryOp>(op: O, x: &[E], g: &[E]) -> Option<Vec<E>> {
    assert_eq!(x.len(), g.len());
    if !looks_up_backward::<E, O>() {
        return None;
    }
    let t = tables::<E, O>(op)?;
    let mut out = alloc::take::<E>(g.len());
    let vb = bits(x);
    #[cfg(target_arch = "x86_64")]
    if gathers() {
        par_chunks_mut(
            &mut out,
            #[inline(always)]
            |ci, o| {
                let s = ci * CHUNK;
                // SAFETY: the level in force is AVX-512 (F and BW among its features); the
                // three slices have o's length.
                unsafe { gather_times_g(&vb[s..][..o.len()], &g[s..][..o.len()], &t.derivative, o) }
            },
        );
        return Some(out);
    }
    par_chunks_mut(
        &mut out,
        #[inline(always)]
        |ci, chunk| {
            let start = ci * CHUNK;
            let mut bd = [0f32; BUF];
            let mut bg = [E::Acc::default(); BUF];
            let mut bo = [E::Acc::default(); BUF];
            for (j, o) in chunk.chunks_mut(BUF).enumerate() {
                let s = start + j * BUF;
                let n = o.len();
                lookup_scalar(&vb[s..s + n], &t.derivative, &mut bd[..n]);
                let g = acc_in(&g[s..s + n], &mut bg[..n]);
                let d = &bd[..n];
                acc_out(
                    o,
                    &mut bo[..n],
                    #[inline(always)]
                    |o| {
                        for ((o, g), d) in o.iter_mut().zip(g).zip(d) {
                            // `c` of an f32 is the f32 itself: the computed path's `g · f'`.
                            *o = *g * E::Acc::c(f64::from(*d));
                        }
                    },
                );
            }
        },
    );
    Some(out)
}

/// Whether the lookups gather with AVX-512 here (the SIMD level in force allows it).
fn gathers() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::simd::level() == crate::simd::Isa::Avx512
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this is an AMD CPU (see the module notes).
fn amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AMD.get_or_init(|| {
            // SAFETY: `cpuid` exists on every x86_64 CPU (recent Rust makes the intrinsic safe;
            // the block keeps the crate building on its minimum version, 1.89).
            #[allow(unused_unsafe)]
            let id = unsafe { std::arch::x86_64::__cpuid(0) };
            [id.ebx, id.edx, id.ecx] == [0x6874_7541, 0x6974_6E65, 0x444D_4163] // "AuthenticAMD"
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[i] = table[idx[i]]`, `table` holding 65,537 entries (the last a pad).
fn lookup_u16(idx: &[u16], table: &[u16], out: &mut [u16]) {
    assert!(table.len() > VALUES && out.len() == idx.len());
    #[cfg(target_arch = "x86_64")]
    if gathers() && !amd() {
        // SAFETY: the level in force is AVX-512 (F and BW among its features); lengths and the
        // table's pad checked above.
        return unsafe { gather_u16(idx, table, out) };
    }
    lookup_u16_scalar(idx, table, out)
}

/// [`lookup_u16`] without gathers: four lookups a step, written with one 8-byte store.
fn lookup_u16_scalar(idx: &[u16], table: &[u16], out: &mut [u16]) {
    let mut outs = out.chunks_exact_mut(4);
    let mut ids = idx.chunks_exact(4);
    for (o, i) in (&mut outs).zip(&mut ids) {
        let v = i.iter().rev().fold(0u64, |v, &i| v << 16 | u64::from(table[usize::from(i)]));
        o.copy_from_slice(&[v as u16, (v >> 16) as u16, (v >> 32) as u16, (v >> 48) as u16]);
    }
    lookup_scalar(ids.remainder(), table, outs.into_remainder())
}

/// `out[i] = table[idx[i]]`, four a step (unrolled: fewer loop branches and index loads).
fn lookup_scalar<T: Copy>(idx: &[u16], table: &[T], out: &mut [T]) {
    let mut outs = out.chunks_exact_mut(4);
    let mut ids = idx.chunks_exact(4);
    for (o, i) in (&mut outs).zip(&mut ids) {
        for (o, &i) in o.iter_mut().zip(i) {
            *o = table[usize::from(i)];
        }
    }
    for (o, &i) in outs.into_remainder().iter_mut().zip(ids.remainder()) {
        *o = table[usize::from(i)];
    }
}

/// [`lookup_u16`] 16 at a time: each gather reads 4 bytes from `table[i]` (hence the pad)
/// and keeps the low 16 bits.
///
/// # Safety
/// The CPU must support avx512f and avx512bw; `table` must hold more than 65,536 entries and
/// `out` as many as `idx`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn gather_u16(idx: &[u16], table: &[u16], out: &mut [u16]) {
    use std::arch::x86_64::*;
    let whole = idx.len() / 16 * 16;
    // SAFETY: each load reads idx[i..i + 16] and each store writes out[i..i + 16], i + 16 <=
    // whole <= both lengths; every gathered address is table + 2·i for an index i <= 65,535,
    // whose 4 bytes lie inside the table's 65,537 entries.
    unsafe {
        for i in (0..whole).step_by(16) {
            let at = _mm512_cvtepu16_epi32(_mm256_loadu_si256(idx.as_ptr().add(i).cast()));
            let v = _mm512_i32gather_epi32::<2>(at, table.as_ptr().cast());
            _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi16(v));
        }
    }
    lookup_scalar(&idx[whole..], table, &mut out[whole..])
}

/// The backward's `round(g · table[x])` in one pass, 16 values at a time, for f16 or bf16:
/// the derivative gathered, `g` widened, the product rounded to nearest even as
/// [`Precision::store`] does (bf16: the same integer rounding, NaN kept quiet; f16:
/// `vcvtps2ph`). Writing the gathered derivatives to a buffer, and `g` and the products
/// through f32 buffers, took about twice as long: 2M bf16 values on the 2-core Zen 4 VM (both
/// threads, operands out of cache), 890-1020 us before, 450-640 us after.
///
/// # Safety
/// The CPU must support AVX-512F and BW; `idx`, `g` and `out` must have one length and `table`
/// 65,536 entries.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn gather_times_g<E: Precision>(idx: &[u16], g: &[E], table: &[f32], out: &mut [E]) {
    use std::arch::x86_64::*;
    assert!(table.len() >= VALUES && g.len() == idx.len() && out.len() == idx.len());
    let whole = idx.len() / 16 * 16;
    let half = E::DTYPE == DType::F16;
    let (gb, ob) = (bits(g), bits_mut(out));
    // SAFETY: each load reads idx[i..i + 16] and g[i..i + 16] and each store writes
    // out[i..i + 16], i + 16 <= whole <= the three lengths; every gathered address is
    // table + 4·i for an index i <= 65,535.
    unsafe {
        let (one, round, quiet) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7FFF), _mm512_set1_epi32(0x40));
        for i in (0..whole).step_by(16) {
            let at = _mm512_cvtepu16_epi32(_mm256_loadu_si256(idx.as_ptr().add(i).cast()));
            let d = _mm512_i32gather_ps::<4>(at, table.as_ptr().cast());
            let gh = _mm256_loadu_si256(gb.as_ptr().add(i).cast());
            let rounded = if half {
                let p = _mm512_mul_ps(_mm512_cvtph_ps(gh), d);
                _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p)
            } else {
                let p = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(gh))), d);
                // f32_to_bf16_bits: (b + 0x7FFF + lsb) >> 16, or a NaN's top half quieted.
                let b = _mm512_castps_si512(p);
                let hi = _mm512_srli_epi32::<16>(b);
                let r =
                    _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(round, _mm512_and_si512(hi, one))));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(p, p);
                _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, quiet)))
            };
            _mm256_storeu_si256(ob.as_mut_ptr().add(i).cast(), rounded);
        }
    }
    // The last few values as the scalar path computes them.
    for ((o, &x), gv) in out[whole..].iter_mut().zip(&idx[whole..]).zip(&g[whole..]) {
        *o = E::from_acc(gv.to_acc() * E::Acc::c(f64::from(table[usize::from(x)])));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;
    use crate::ops::unary::{Exp, Gelu, GeluTanh, Log, Powf, Relu, Sigmoid, Silu, Tanh};
    use half::{bf16, f16};

    /// Every value of `E`, in bit order.
    fn every<E: Precision>() -> Vec<E> {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        assert!(sixteen_bit::<E>());
        // SAFETY: as in `bits`: E is f16 or bf16 (asserted).
        unsafe { std::slice::from_raw_parts(all.as_ptr().cast::<E>(), all.len()) }.to_vec()
    }

    /// The first index where two results' bits differ, NaN payloads aside (with two NaN
    /// operands, which one a multiply returns depends on the order the compiler gave them).
    fn first_difference<E: Precision>(a: &[E], b: &[E]) -> Option<usize> {
        assert_eq!(a.len(), b.len());
        let nan = |v: &E| v.to_f64().is_nan();
        (0..a.len()).find(|&i| bits(a)[i] != bits(b)[i] && !(nan(&a[i]) && nan(&b[i])))
    }

    /// The lookups return the computed path's bits at every input value, forward and (where
    /// looked up) backward, against a gradient that takes every value too.
    fn same_bits<E: Precision, O: UnaryOp>(op: O) {
        let x = every::<E>();
        let n = x.len();
        let looked = forward(op, &x).expect("a tabulated op on a 16-bit type has tables");
        let computed = super::super::map_unary(&x, |v| op.forward(v));
        if let Some(i) = first_difference(&looked, &computed) {
            panic!(
                "{} {} forward at bits {i:#06x}: {:?} looked up, {:?} computed",
                O::NAME,
                E::DTYPE,
                looked[i],
                computed[i]
            );
        }
        // Reversed and offset, so each x meets a different gradient, specials included.
        let g: Vec<E> = x.iter().rev().cycle().skip(12_345).take(n).copied().collect();
        let Some(looked) = backward(op, &x, &g) else {
            assert!(!derivative_tabulated::<O>(), "{}", O::NAME);
            return;
        };
        let l = Layout::contiguous(&[n]);
        let computed = super::super::map_binary(&x, &l, &g, &l, &[n], |v, g| g * op.derivative(v, v));
        if let Some(i) = first_difference(&looked, &computed) {
            panic!(
                "{} {} backward at bits {i:#06x}: {:?} looked up, {:?} computed",
                O::NAME,
                E::DTYPE,
                looked[i],
                computed[i]
            );
        }
        // Lengths that are not a multiple of 16 (the vector loop's last values go one at a
        // time), over ordinary values (the top of the bit range is NaN, which the comparison
        // lets through).
        for (a, len) in [(0x3F00, 53), (0xBF00, 7)] {
            let tail = backward(op, &x[a..a + len], &g[a..a + len]).expect("looked up above");
            if let Some(i) = first_difference(&tail, &computed[a..a + len]) {
                panic!("{} {} backward of {len} values from bits {a:#06x}, at {i}", O::NAME, E::DTYPE);
            }
        }
    }

    fn same_bits_both<O: UnaryOp>(op: O) {
        same_bits::<bf16, O>(op);
        same_bits::<f16, O>(op);
    }

    #[test]
    fn lookups_equal_the_computed_ops_at_every_value() {
        same_bits_both(Gelu);
        same_bits_both(GeluTanh);
        same_bits_both(Tanh);
        same_bits_both(Sigmoid);
        same_bits_both(Silu);
        same_bits_both(Exp);
        same_bits_both(Log);
        same_bits_both(Powf(0.5));
        same_bits_both(Powf(3.0));
    }

    #[test]
    fn a_parameter_gets_its_own_table() {
        let x = vec![bf16::from_f32(2.0); 3];
        let cube = forward(Powf(3.0), &x).unwrap();
        let root = forward(Powf(0.5), &x).unwrap();
        assert_eq!(cube[0].to_f32(), 8.0);
        assert_eq!(root[0], bf16::from_f32(2f32.sqrt()));
    }

    #[test]
    fn untabulated_ops_and_wider_types_are_computed() {
        assert!(forward(Relu, &[bf16::ONE]).is_none());
        assert!(forward(Gelu, &[1.0f32]).is_none());
        assert!(backward(Tanh, &[bf16::ONE], &[bf16::ONE]).is_none(), "tanh's derivative reads y");
    }

    #[test]
    fn gathers_equal_scalar_lookups_at_every_length() {
        let table16: Vec<u16> = (0..=VALUES as u32).map(|i| (i.wrapping_mul(40_503) >> 3) as u16).collect();
        let table32: Vec<f32> = (0..VALUES).map(|i| i as f32 * 0.5 - 7.0).collect();
        for len in [0, 1, 2, 3, 6, 15, 16, 17, 100, 512] {
            // Both ends of the index range, and a spread between.
            let idx: Vec<u16> = (0..len)
                .map(|i| match i % 3 {
                    0 => u16::MAX - i as u16,
                    1 => i as u16,
                    _ => (i as u16).wrapping_mul(9_973),
                })
                .collect();
            let want16: Vec<u16> = idx.iter().map(|&i| table16[usize::from(i)]).collect();
            let want32: Vec<f32> = idx.iter().map(|&i| table32[usize::from(i)]).collect();
            let (mut got16, mut got32) = (vec![0; len], vec![0.0; len]);
            lookup_scalar(&idx, &table16, &mut got16);
            lookup_scalar(&idx, &table32, &mut got32);
            assert_eq!(got16, want16, "scalar, len {len}");
            assert_eq!(got32, want32, "scalar, len {len}");
            got16.fill(0);
            lookup_u16_scalar(&idx, &table16, &mut got16);
            assert_eq!(got16, want16, "scalar u16 by fours, len {len}");
            // The paths this CPU takes (gathers, or below AVX-512 and for u16 on AMD the scalar
            // loops).
            lookup_u16(&idx, &table16, &mut got16);
            assert_eq!(got16, want16, "len {len}");
            #[cfg(target_arch = "x86_64")]
            if crate::simd::Isa::Avx512.supported() {
                // SAFETY: the CPU has AVX-512 F and BW (checked); lengths and pad as required.
                unsafe { gather_u16(&idx, &table16, &mut got16) };
                assert_eq!(got16, want16, "gather, len {len}");
            } else {
                eprintln!("SKIPPED: gathers (no AVX-512 on this CPU)");
            }
        }
    }
}
