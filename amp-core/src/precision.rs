//! Precision is the element type.
//!
//! Design notes:
//! - [`Precision`] is sealed: `f32`, `half::f16`, `half::bf16` and `f64` (for gradient checks).
//! - Format facts are `typenum` types ([`Precision::ExponentBits`], [`Precision::MantissaBits`]),
//!   so "needs loss scaling" ([`NeedsLossScaling`]) and promotion ([`Promoted`]) are computed by
//!   the type checker, not looked up at run time.
//! - Arithmetic never happens in f16/bf16: kernels load chunks into the accumulation type
//!   [`Precision::Acc`] (f32, or f64 for f64), compute, and round once on store.
//! - Conversions are slice-at-a-time ([`Precision::load`], [`Precision::store`]) so they
//!   vectorise (F16C through `half`, plain bit arithmetic for bf16), never a call per element
//!   through a trait object.

use std::fmt;

use crate::autograd::AnyTensor;
use crate::backend::Device;
use crate::tensor::Tensor;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use typenum::{B0, B1, Bit, IsGreaterOrEqual, IsLess, U5, U7, U8, U10, U11, U23, U52, Unsigned};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// The run-time mirror of a precision type, for messages, checkpoints and type-erased storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// IEEE half precision: 5 exponent bits, 10 mantissa bits.
    F16,
    /// bfloat16: 8 exponent bits, 7 mantissa bits.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision (gradient checks).
    F64,
}

impl DType {
    /// Lower-case name, as PyTorch and safetensors spell it (`f16`, `bf16`, `f32`, `f64`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The type kernels compute in: f32 for f16/bf16/f32, f64 for f64.
pub trait Accum:
    num_traits::Float
    + num_traits::FromPrimitive
    + Default
    + Send
    + Sync
    + fmt::Debug
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::MulAssign
    + 'static
{
    /// From an f64 constant.
    fn c(v: f64) -> Self;
    /// To f64.
    fn f64(self) -> f64;
    /// The error function: branch-free and inlined for f32 (so elementwise loops over it
    /// vectorise, within 1.7 ulp), libm for f64.
    fn erf(self) -> Self;
    /// `e^self`: branch-free and inlined for f32 (so elementwise loops over it vectorise,
    /// within 1 ulp), libm for f64. Use it instead of `Float::exp`, which is a libm call per
    /// element for f32.
    fn vexp(self) -> Self;
    /// `(erf(self), e^(-self²))`: for f32 the erf computes that exponential anyway, so a
    /// caller needing both (GELU's derivative: `Φ` and the density `φ`) pays for one.
    fn erf_gauss(self) -> (Self, Self);
    /// `tanh(self)`: branch-free and inlined for f32 (within 2 ulp), libm for f64. Use it
    /// instead of `Float::tanh`, a libm call per element for f32.
    fn vtanh(self) -> Self;
    /// `ln(self)`: branch-free and inlined for f32 (within 1 ulp), libm for f64. Use it
    /// instead of `Float::ln`, a libm call per element for f32.
    fn vln(self) -> Self;
}

impl Accum for f32 {
    #[inline(always)]
    fn c(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn erf(self) -> Self {
        crate::fastmath::erf_f32(self)
    }
    #[inline(always)]
    fn vexp(self) -> Self {
        crate::fastmath::exp_f32(self)
    }
    #[inline(always)]
    fn erf_gauss(self) -> (Self, Self) {
        crate::fastmath::erf_exp_f32(self)
    }
    #[inline(always)]
    fn vtanh(self) -> Self {
        crate::fastmath::tanh_f32(self)
    }
    #[inline(always)]
    fn vln(self) -> Self {
        crate::fastmath::ln_f32(self)
    }
}

impl Accum for f64 {
    #[inline(always)]
    fn c(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erf(self)
    }
    #[inline(always)]
    fn vexp(self) -> Self {
        self.exp()
    }
    #[inline(always)]
    fn erf_gauss(self) -> (Self, Self) {
        (libm::erf(self), (-(self * self)).exp())
    }
    #[inline(always)]
    fn vtanh(self) -> Self {
        self.tanh()
    }
    #[inline(always)]
    fn vln(self) -> Self {
        self.ln()
    }
}

/// A floating-point element type a tensor can hold. Sealed: `f16`, `bf16`, `f32`, `f64`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tensor precision",
    note = "tensors hold f32, half::f16, half::bf16 or f64"
)]
pub trait Precision:
    sealed::Sealed + Copy + Default + PartialEq + PartialOrd + Send + Sync + fmt::Debug + fmt::Display + 'static
{
    /// Exponent bits of the format, as a type.
    type ExponentBits: Unsigned + IsLess<U8, Output: Bit>;
    /// Explicit mantissa (fraction) bits of the format, as a type.
    type MantissaBits: Unsigned;
    /// The type arithmetic on this precision is carried out in, itself a precision (f32 or
    /// f64): what batch norm's weight and bias are in, as PyTorch's mixed batch norm keeps them.
    type Acc: Accum + Precision;
    /// The run-time mirror.
    const DTYPE: DType;
    /// Whether gradients in this format underflow without loss scaling (exponent narrower
    /// than f32's 8 bits), derived from [`Precision::ExponentBits`].
    const NEEDS_LOSS_SCALING: bool = <NeedsLossScaling<Self> as Bit>::BOOL;
    /// Largest finite value.
    const MAX_FINITE: f64;
    /// Smallest positive normal value.
    const MIN_POSITIVE_NORMAL: f64;

    /// One value to the accumulation type.
    fn to_acc(self) -> Self::Acc;
    /// One value from the accumulation type (round to nearest even; overflow gives inf).
    fn from_acc(v: Self::Acc) -> Self;
    /// To f64 (exact).
    fn to_f64(self) -> f64;
    /// From f64, rounded once.
    fn from_f64(v: f64) -> Self;
    /// Converts a slice to the accumulation type.
    fn load(src: &[Self], dst: &mut [Self::Acc]);
    /// Rounds a slice of accumulation values into this format.
    fn store(src: &[Self::Acc], dst: &mut [Self]);
    /// The slice itself when this format is its own accumulation type (f32, f64), so a kernel
    /// reads it in place rather than copying it into a scratch buffer with [`Precision::load`];
    /// `None` for f16 and bf16.
    #[inline(always)]
    fn as_acc(src: &[Self]) -> Option<&[Self::Acc]> {
        let _ = src;
        None
    }
    /// [`Precision::as_acc`] for an output: a kernel writes accumulation values straight into
    /// it rather than through [`Precision::store`].
    #[inline(always)]
    fn as_acc_mut(dst: &mut [Self]) -> Option<&mut [Self::Acc]> {
        let _ = dst;
        None
    }
    /// Converts a slice to f32 (f64 rounds).
    fn to_f32_slice(src: &[Self], dst: &mut [f32]);
    /// Rounds a slice of f32 into this format.
    fn from_f32_slice(src: &[f32], dst: &mut [Self]);

    /// Wraps a tensor of this precision into the type-erased [`AnyTensor`].
    fn into_any<D: Device>(t: Tensor<Self, D>) -> AnyTensor<D>;
    /// The tensor inside `any` if it has this precision.
    fn from_any<D: Device>(any: AnyTensor<D>) -> Result<Tensor<Self, D>, AnyTensor<D>>;
    /// Borrows the tensor inside `any` if it has this precision.
    fn any_ref<D: Device>(any: &AnyTensor<D>) -> Option<&Tensor<Self, D>>;
    /// Mutably borrows the tensor inside `any` if it has this precision.
    fn any_mut<D: Device>(any: &mut AnyTensor<D>) -> Option<&mut Tensor<Self, D>>;
}

macro_rules! any_conversions {
    ($variant:ident) => {
        fn into_any<D: Device>(t: Tensor<Self, D>) -> AnyTensor<D> {
            AnyTensor::$variant(t)
        }
        fn from_any<D: Device>(any: AnyTensor<D>) -> Result<Tensor<Self, D>, AnyTensor<D>> {
            match any {
                AnyTensor::$variant(t) => Ok(t),
                other => Err(other),
            }
        }
        fn any_ref<D: Device>(any: &AnyTensor<D>) -> Option<&Tensor<Self, D>> {
            match any {
                AnyTensor::$variant(t) => Some(t),
                _ => None,
            }
        }
        fn any_mut<D: Device>(any: &mut AnyTensor<D>) -> Option<&mut Tensor<Self, D>> {
            match any {
                AnyTensor::$variant(t) => Some(t),
                _ => None,
            }
        }
    };
}

/// `B1` when `E` needs loss scaling (exponent narrower than 8 bits), else `B0`.
pub type NeedsLossScaling<E> = <<E as Precision>::ExponentBits as IsLess<U8>>::Output;

impl Precision for f32 {
    any_conversions!(F32);
    type ExponentBits = U8;
    type MantissaBits = U23;
    type Acc = f32;
    const DTYPE: DType = DType::F32;
    const MAX_FINITE: f64 = f32::MAX as f64;
    const MIN_POSITIVE_NORMAL: f64 = f32::MIN_POSITIVE as f64;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline]
    fn load(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline]
    fn store(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn as_acc(src: &[Self]) -> Option<&[f32]> {
        Some(src)
    }
    #[inline(always)]
    fn as_acc_mut(dst: &mut [Self]) -> Option<&mut [f32]> {
        Some(dst)
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
}

impl Precision for f64 {
    any_conversions!(F64);
    type ExponentBits = U11;
    type MantissaBits = U52;
    type Acc = f64;
    const DTYPE: DType = DType::F64;
    const MAX_FINITE: f64 = f64::MAX;
    const MIN_POSITIVE_NORMAL: f64 = f64::MIN_POSITIVE;
    #[inline(always)]
    fn to_acc(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_acc(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline]
    fn load(src: &[Self], dst: &mut [f64]) {
        dst.copy_from_slice(src)
    }
    #[inline]
    fn store(src: &[f64], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn as_acc(src: &[Self]) -> Option<&[f64]> {
        Some(src)
    }
    #[inline(always)]
    fn as_acc_mut(dst: &mut [Self]) -> Option<&mut [f64]> {
        Some(dst)
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s as f32;
        }
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s as f64;
        }
    }
}

impl Precision for f16 {
    any_conversions!(F16);
    type ExponentBits = U5;
    type MantissaBits = U10;
    type Acc = f32;
    const DTYPE: DType = DType::F16;
    const MAX_FINITE: f64 = 65504.0;
    const MIN_POSITIVE_NORMAL: f64 = 6.103515625e-5;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    #[inline]
    fn load(src: &[Self], dst: &mut [f32]) {
        f16_to_f32_slice(src, dst)
    }
    #[inline]
    fn store(src: &[f32], dst: &mut [Self]) {
        f32_to_f16_slice(src, dst)
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        f16_to_f32_slice(src, dst)
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        f32_to_f16_slice(src, dst)
    }
}

impl Precision for bf16 {
    any_conversions!(BF16);
    type ExponentBits = U8;
    type MantissaBits = U7;
    type Acc = f32;
    const DTYPE: DType = DType::BF16;
    const MAX_FINITE: f64 = 3.3895313892515355e38;
    const MIN_POSITIVE_NORMAL: f64 = 1.1754943508222875e-38;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_acc(v: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(v))
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    #[inline]
    fn load(src: &[Self], dst: &mut [f32]) {
        bf16_to_f32_slice(src, dst)
    }
    #[inline]
    fn store(src: &[f32], dst: &mut [Self]) {
        f32_to_bf16_slice(src, dst)
    }
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        bf16_to_f32_slice(src, dst)
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        f32_to_bf16_slice(src, dst)
    }
}

/// f32 to bf16 bits, round to nearest even; overflow rounds to inf, NaN stays NaN (quieted).
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if v.is_nan() { nan } else { rounded }
}

#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

// Plain loops over bits, vectorised by the compiler for the dispatched level (half has no SIMD
// path for bf16). The instruction `vcvtneps2bf16` is not used: it flushes subnormals to zero.
// One copy, called per slice: inlined into every dispatched kernel it would be copied three
// times into each of their three copies.
#[inline(never)]
fn f32_to_bf16_slice(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len(), "bf16 store: length mismatch");
    let dst: &mut [u16] = dst.reinterpret_cast_mut();
    crate::simd::dispatch(
        #[inline(always)]
        || {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = f32_to_bf16_bits(*s);
            }
        },
    )
}

// One copy, called per slice: inlined into every dispatched kernel it would be copied three
// times into each of their three copies.
#[inline(never)]
fn bf16_to_f32_slice(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "bf16 load: length mismatch");
    let src: &[u16] = src.reinterpret_cast();
    crate::simd::dispatch(
        #[inline(always)]
        || {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = bf16_bits_to_f32(*s);
            }
        },
    )
}

// f16 through the conversion instructions of the dispatched level (`half` detects F16C per
// call, 8 values per call, and falls back to software without it).
// One copy, called per slice: inlined into every dispatched kernel it would be copied three
// times into each of their three copies.
#[inline(never)]
fn f16_to_f32_slice(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16 load: length mismatch");
    #[cfg(target_arch = "x86_64")]
    {
        use crate::simd::{Isa, level, x86};
        let bits: &[u16] = src.reinterpret_cast();
        match level() {
            // SAFETY: the level's features include AVX-512F and F16C; lengths are equal.
            Isa::Avx512 => return unsafe { x86::f16_to_f32_avx512(bits, dst) },
            // SAFETY: the level's features include AVX and F16C; lengths are equal.
            Isa::Avx2 => return unsafe { x86::f16_to_f32_f16c(bits, dst) },
            Isa::Baseline => {}
        }
    }
    src.convert_to_f32_slice(dst)
}

// One copy, called per slice: inlined into every dispatched kernel it would be copied three
// times into each of their three copies.
#[inline(never)]
fn f32_to_f16_slice(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "f16 store: length mismatch");
    #[cfg(target_arch = "x86_64")]
    {
        use crate::simd::{Isa, level, x86};
        let bits: &mut [u16] = dst.reinterpret_cast_mut();
        match level() {
            // SAFETY: the level's features include AVX-512F and F16C; lengths are equal.
            Isa::Avx512 => return unsafe { x86::f32_to_f16_avx512(src, bits) },
            // SAFETY: the level's features include AVX and F16C; lengths are equal.
            Isa::Avx2 => return unsafe { x86::f32_to_f16_f16c(src, bits) },
            Isa::Baseline => {}
        }
    }
    dst.convert_from_f32_slice(src)
}

/// Converts a slice between any two precisions with one rounding.
///
/// Routes through the vectorised f32 paths when one side is f32, and through f64 otherwise
/// (exact for every pair, since f64 holds every f16/bf16/f32 value).
pub fn convert_slice<A: Precision, B: Precision>(src: &[A], dst: &mut [B]) {
    assert_eq!(src.len(), dst.len(), "convert_slice: length mismatch");
    if let Some(s) = as_same::<A, B>(src) {
        dst.copy_from_slice(s);
    } else if A::DTYPE == DType::F32 {
        B::from_f32_slice(as_f32(src), dst)
    } else if B::DTYPE == DType::F32 {
        A::to_f32_slice(src, as_f32_mut(dst))
    } else if A::DTYPE != DType::F64 && B::DTYPE != DType::F64 {
        // f16 <-> bf16: widen to f32 (exact), then round once.
        let mut buf = [0f32; 1024];
        for (s, d) in src.chunks(1024).zip(dst.chunks_mut(1024)) {
            let b = &mut buf[..s.len()];
            A::to_f32_slice(s, b);
            B::from_f32_slice(b, d);
        }
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = B::from_f64(s.to_f64());
        }
    }
}

/// `n` zeros, allocated zeroed: the allocator's fresh pages come zeroed from the OS, so a
/// kernel's output buffer is written once (by the kernel), not twice (memset, then kernel).
/// All-zero bits are +0.0 in every precision.
pub(crate) fn zeroed<E: Precision>(n: usize) -> Vec<E> {
    match E::DTYPE {
        DType::F32 => reinterpret_vec(vec![0f32; n]),
        DType::F64 => reinterpret_vec(vec![0f64; n]),
        DType::F16 | DType::BF16 => reinterpret_vec(vec![0u16; n]),
    }
}

fn reinterpret_vec<T, E>(v: Vec<T>) -> Vec<E> {
    assert!(size_of::<T>() == size_of::<E>() && align_of::<T>() == align_of::<E>());
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: T and E have the same size and alignment (checked above), so the allocation's
    // layout is unchanged; every T here is an all-zero bit pattern, a valid E (+0.0); the
    // original Vec is not dropped (ManuallyDrop), so the buffer has one owner.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut E, v.len(), v.capacity()) }
}

/// Reinterprets `&[A]` as `&[B]` when A and B are the same type.
pub(crate) fn as_same<A: Precision, B: Precision>(s: &[A]) -> Option<&[B]> {
    (A::DTYPE == B::DTYPE).then(|| {
        // SAFETY: DTYPE is unique per sealed precision type, so A and B are the same type.
        unsafe { std::slice::from_raw_parts(s.as_ptr() as *const B, s.len()) }
    })
}

/// Reinterprets `&mut [A]` as `&mut [B]` when A and B are the same type.
pub(crate) fn as_same_mut<A: Precision, B: Precision>(s: &mut [A]) -> Option<&mut [B]> {
    (A::DTYPE == B::DTYPE).then(|| {
        // SAFETY: DTYPE is unique per sealed precision type, so A and B are the same type.
        unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut B, s.len()) }
    })
}

fn as_f32<A: Precision>(s: &[A]) -> &[f32] {
    assert_eq!(A::DTYPE, DType::F32);
    // SAFETY: checked above that A is f32.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len()) }
}

fn as_f32_mut<A: Precision>(s: &mut [A]) -> &mut [f32] {
    assert_eq!(A::DTYPE, DType::F32);
    // SAFETY: checked above that A is f32.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut f32, s.len()) }
}

// ---- promotion, computed from the format facts ------------------------------------------

/// The type two precisions promote to: the one that covers the other in both exponent and
/// mantissa bits, or f32 when neither does (f16 with bf16), as PyTorch promotes.
#[diagnostic::on_unimplemented(
    message = "no promotion of `{Self}` with `{R}` is known here",
    label = "generic code has to state the promotions it uses",
    note = "state the bound `{Self}: Promote<{R}>` (with the `Output` the callee asks for): every pair of \
            concrete precisions has one, a bare type parameter does not",
    note = "a function generic over its autocast type `P` that promotes gets `P: Promote<f32, Output = f32> + \
            Promote<P, Output = P>, f32: Promote<P, Output = f32>` from `#[autocast(P)]`; a generic caller \
            passing its own `P` states the same bounds"
)]
pub trait Promote<R: Precision>: Precision {
    /// The promoted precision.
    type Output: Precision;
}

/// `Promoted<A, B>`: the precision an op mixing `A` and `B` runs in under autocast's
/// "promote" category.
pub type Promoted<A, B> = <A as Promote<B>>::Output;

type Covers<A, B> = <(
    <<A as Precision>::ExponentBits as IsGreaterOrEqual<<B as Precision>::ExponentBits>>::Output,
    <<A as Precision>::MantissaBits as IsGreaterOrEqual<<B as Precision>::MantissaBits>>::Output,
) as BothBits>::Output;

/// Type-level `and` of a pair of bits.
#[doc(hidden)]
pub trait BothBits {
    type Output: Bit;
}
impl BothBits for (B1, B1) {
    type Output = B1;
}
impl BothBits for (B1, B0) {
    type Output = B0;
}
impl BothBits for (B0, B1) {
    type Output = B0;
}
impl BothBits for (B0, B0) {
    type Output = B0;
}

/// Picks the promoted type from (left covers right, right covers left).
#[doc(hidden)]
pub trait PickWider<L, R> {
    type Output: Precision;
}
impl<L: Precision, R, X> PickWider<L, R> for (B1, X) {
    type Output = L;
}
impl<L, R: Precision> PickWider<L, R> for (B0, B1) {
    type Output = R;
}
impl<L, R> PickWider<L, R> for (B0, B0) {
    type Output = f32;
}

/// One impl per pair of precisions (not a blanket impl over the format bits, which a bare type
/// parameter cannot satisfy), each `Output` computed from the bits: so generic code missing a
/// `Promote` bound gets the message above, not the unmet `typenum` comparisons.
macro_rules! promote_with {
    ($l:ty => $($r:ty),+) => {$(
        impl Promote<$r> for $l {
            type Output = <(Covers<$l, $r>, Covers<$r, $l>) as PickWider<$l, $r>>::Output;
        }
    )+};
}
promote_with!(f16 => f16, bf16, f32, f64);
promote_with!(bf16 => f16, bf16, f32, f64);
promote_with!(f32 => f16, bf16, f32, f64);
promote_with!(f64 => f16, bf16, f32, f64);

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::TypeId;

    fn same<A: 'static, B: 'static>() -> bool {
        TypeId::of::<A>() == TypeId::of::<B>()
    }

    #[test]
    fn loss_scaling_is_computed_from_exponent_bits() {
        // Checked at compile time: a wrong answer fails the build, not just the test.
        const {
            assert!(<f16 as Precision>::NEEDS_LOSS_SCALING);
            assert!(!<bf16 as Precision>::NEEDS_LOSS_SCALING);
            assert!(!<f32 as Precision>::NEEDS_LOSS_SCALING);
            assert!(!<f64 as Precision>::NEEDS_LOSS_SCALING);
        }
        // And as a type: usable in bounds.
        assert!(same::<NeedsLossScaling<f16>, B1>());
        assert!(same::<NeedsLossScaling<bf16>, B0>());
    }

    #[test]
    fn promotion_is_computed_from_format_bits() {
        assert!(same::<Promoted<f16, f32>, f32>());
        assert!(same::<Promoted<f32, f16>, f32>());
        assert!(same::<Promoted<bf16, f32>, f32>());
        assert!(same::<Promoted<f16, bf16>, f32>());
        assert!(same::<Promoted<bf16, f16>, f32>());
        assert!(same::<Promoted<f16, f16>, f16>());
        assert!(same::<Promoted<bf16, bf16>, bf16>());
        assert!(same::<Promoted<f32, f64>, f64>());
    }

    #[test]
    fn overflowing_casts_give_inf_and_nan_propagates() {
        let src = [70000.0f32, -70000.0, 65504.0, f32::NAN, 1e-8];
        let mut h = [f16::ZERO; 5];
        convert_slice(&src, &mut h);
        assert!(h[0].is_infinite() && h[0].is_sign_positive());
        assert!(h[1].is_infinite() && h[1].is_sign_negative());
        assert_eq!(h[2].to_f32(), 65504.0);
        assert!(h[3].is_nan());
        let big = [3.39e38f32, f32::MAX, f32::NAN, -f32::INFINITY, 1.0 + 1.0 / 256.0];
        let mut b = [bf16::ZERO; 5];
        convert_slice(&big, &mut b);
        assert_eq!(b[0].to_f64(), bf16::MAX_FINITE);
        assert!(b[1].is_infinite(), "f32::MAX rounds up past bf16's max finite");
        assert!(b[2].is_nan());
        assert!(b[3].is_infinite() && b[3].is_sign_negative());
        // Ties go to even: 1 + 2^-8 sits halfway between 1 and 1 + 2^-7.
        assert_eq!(b[4].to_f32(), 1.0);
    }

    #[test]
    fn bf16_rounding_matches_half() {
        let mut x = 0x3f80_0000u32;
        for _ in 0..100_000 {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            let v = f32::from_bits(x);
            if v.is_nan() {
                continue;
            }
            assert_eq!(bf16::from_acc(v).to_bits(), bf16::from_f32(v).to_bits(), "{v}");
        }
    }
}
