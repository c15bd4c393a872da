// amp-cuda kernel prelude: element types, conversions, layouts, launch loops and block
// reductions, shared by every kernel source of this crate.
//
// Design notes:
// - No #include: a bare GPU machine has libnvrtc but maybe no CUDA headers, and NVRTC has no
//   include path of its own. f16 and bf16 are 16-bit structs here, converted by inline PTX
//   (`cvt.rn`: round to nearest even, the rounding of the CPU's `half` crate); the math
//   functions, warp shuffles and vector types are NVRTC builtins.
// - Arithmetic never happens in f16/bf16: `load` widens to the accumulation type (`Acc<T>`:
//   float for f16, bf16 and f32, double for f64) and `store<T>` rounds once.
// - Layouts travel by value: `AmpShape` (rank and dims) and one `AmpView` (offset and strides,
//   in elements) per operand, broadcast dims with stride 0, at most AMP_MAX_RANK dims (the host
//   merges dims that are contiguous together first).
// - Indices are 64-bit throughout: an H200 holds tensors of more than 2^31 elements.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

struct f16_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

// The dtype suffixes of kernel names, as types (`amp_t_f16` is `f16_t`...).
typedef f16_t amp_t_f16;
typedef bf16_t amp_t_bf16;
typedef float amp_t_f32;
typedef double amp_t_f64;

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

template <typename T> struct IsF64 { static const bool value = false; };
template <> struct IsF64<double> { static const bool value = true; };

// ---- conversions ---------------------------------------------------------------------------

// The host emulation of the kernels (amp-cuda/tests/emulated/cuda_emu.hpp) cannot compile
// inline PTX: it defines these f16/bf16 conversions in software instead.
#ifndef AMP_HOST_EMULATION
__device__ __forceinline__ float load(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
#endif
__device__ __forceinline__ float load(bf16_t v) { return __uint_as_float(((u32)v.bits) << 16); }
__device__ __forceinline__ float load(float v) { return v; }
__device__ __forceinline__ double load(double v) { return v; }

template <typename T> __device__ __forceinline__ T store(typename Acc<T>::type v);
#ifndef AMP_HOST_EMULATION  // inline PTX (see load above)
template <> __device__ __forceinline__ f16_t store<f16_t>(float v) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}
template <> __device__ __forceinline__ bf16_t store<bf16_t>(float v) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}
#endif
template <> __device__ __forceinline__ float store<float>(float v) { return v; }
template <> __device__ __forceinline__ double store<double>(double v) { return v; }

// One rounding from double (casts involving f64, and means computed in f64).
template <typename T> __device__ __forceinline__ T narrow(double v);
#ifndef AMP_HOST_EMULATION  // inline PTX (see load above)
template <> __device__ __forceinline__ f16_t narrow<f16_t>(double v) {
    f16_t r;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(r.bits) : "d"(v));
    return r;
}
template <> __device__ __forceinline__ bf16_t narrow<bf16_t>(double v) {
    bf16_t r;
    asm("cvt.rn.bf16.f64 %0, %1;" : "=h"(r.bits) : "d"(v));
    return r;
}
#endif
template <> __device__ __forceinline__ float narrow<float>(double v) { return __double2float_rn(v); }
template <> __device__ __forceinline__ double narrow<double>(double v) { return v; }

// `S` rounded once into `D`: through float (exact for f16 and bf16) unless f64 is involved,
// then through double.
template <typename S, typename D> __device__ __forceinline__ D convert(S v) {
    if constexpr (IsF64<S>::value || IsF64<D>::value) {
        return narrow<D>((double)load(v));
    } else {
        return store<D>((float)load(v));
    }
}

// A value of `T` from the low bytes of `bits` (fills pass their value this way).
template <typename T> __device__ __forceinline__ T from_bits(u64 bits) {
    union { u64 b; T v; } u;
    u.b = bits;
    return u.v;
}

__device__ __forceinline__ bool amp_isnan(float v) { return isnan(v); }
__device__ __forceinline__ bool amp_isnan(double v) { return isnan(v); }
__device__ __forceinline__ bool amp_finite(float v) { return !(isnan(v) || isinf(v)); }
__device__ __forceinline__ bool amp_finite(double v) { return !(isnan(v) || isinf(v)); }

template <typename A> __device__ __forceinline__ A amp_neg_inf();
template <> __device__ __forceinline__ float amp_neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double amp_neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ll);
}

// The max that NaN wins (PyTorch's, and the CPU backend's `combine`).
template <typename A> __device__ __forceinline__ A amp_max(A a, A b) { return (a > b || amp_isnan(a)) ? a : b; }

// ---- 128-bit packs for contiguous, aligned runs --------------------------------------------

template <typename T> union Pack16 {
    uint4 raw;
    T v[16 / sizeof(T)];
};

// ---- layouts ---------------------------------------------------------------------------------

#define AMP_MAX_RANK 12

struct AmpShape {
    int rank;
    int pad;
    i64 dims[AMP_MAX_RANK];
};

struct AmpView {
    i64 offset;
    i64 strides[AMP_MAX_RANK];
};

// The row-major multi-index of flat position `i` of `s`.
__device__ __forceinline__ void amp_index(const AmpShape& s, i64 i, i64 (&idx)[AMP_MAX_RANK]) {
#pragma unroll
    for (int d = AMP_MAX_RANK - 1; d >= 0; --d) {
        if (d < s.rank) {
            i64 n = s.dims[d];
            i64 q = i / n;
            idx[d] = i - q * n;
            i = q;
        } else {
            idx[d] = 0;
        }
    }
}

// The storage offset of a multi-index in a view.
__device__ __forceinline__ i64 amp_at(const AmpShape& s, const AmpView& v, const i64 (&idx)[AMP_MAX_RANK]) {
    i64 off = v.offset;
#pragma unroll
    for (int d = 0; d < AMP_MAX_RANK; ++d) {
        if (d < s.rank) off += idx[d] * v.strides[d];
    }
    return off;
}

// The storage offset of flat position `i` of `s` in a view.
__device__ __forceinline__ i64 amp_offset(const AmpShape& s, const AmpView& v, i64 i) {
    i64 idx[AMP_MAX_RANK];
    amp_index(s, i, idx);
    return amp_at(s, v, idx);
}

// Grid-stride loop over `0..n`.
#define AMP_GRID_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)blockDim.x * gridDim.x)

// ---- block reductions (blockDim.x a multiple of 32, at most 1024) -----------------------------

// Shared scratch for the reductions below: 32 warp partials and one broadcast slot.
#define AMP_RED_SLOTS 33

template <typename A> __device__ __forceinline__ A amp_warp_sum(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename A> __device__ __forceinline__ A amp_warp_max(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = amp_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum over the block of every thread's `v`, returned to every thread. `red` holds
// AMP_RED_SLOTS values; every thread of the block must call it.
template <typename A> __device__ A amp_block_sum(A v, A* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = amp_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        A w = lane < warps ? red[lane] : A(0);
        w = amp_warp_sum(w);
        if (lane == 0) red[32] = w;
    }
    __syncthreads();
    return red[32];
}

// The max (NaN wins) over the block, returned to every thread.
template <typename A> __device__ A amp_block_max(A v, A* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = amp_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        A w = lane < warps ? red[lane] : amp_neg_inf<A>();
        w = amp_warp_max(w);
        if (lane == 0) red[32] = w;
    }
    __syncthreads();
    return red[32];
}
