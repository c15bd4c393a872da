// The AMP passes and dropout: the fused multi-tensor unscale + non-finite check, the sum of
// squares and the clip scalars that clipping computes, the in-place scale and clamp, the loss
// scale's update, and dropout's counter-based mask.
//
// Design notes:
// - Nothing here hands a value to the host: flags, norms, the clip coefficient and the loss
//   scale stay in device memory and the next kernels read them there, so a training step
//   queues its work without waiting (the host reads only when a user asks for a value).
// - unscale_check is one launch over every gradient of one precision: the host uploads a table
//   of chunks (pointer, length, flag index), one block per chunk. With a scale (the scaler's
//   f64 state vector, element 0), each value is multiplied by inv = f32(1 / f64(scale))
//   (non-finite ones too, as PyTorch does); without one the values are only checked. A block
//   that saw an inf or NaN writes 1 into that gradient's flag. Concurrent writers write the
//   same value, and a flag is never cleared here, so the races are benign.
// - update_scale and clip_coefficient are one thread each (a handful of scalars), with
//   explicitly rounded intrinsics, so they give the CPU's values bit for bit: the rule is
//   amp_core::backend::ScaleRule::apply, operation for operation.
// - Dropout draws exactly the CPU backend's mask: element i belongs to chunk i / 16384, whose
//   generator is xoshiro256** seeded by splitmix64 from `seed ^ chunk·0x9E3779B97F4A7C15`;
//   draw k of a chunk decides its elements 2k (low 32 bits) and 2k + 1 (high 32 bits). The
//   generator is sequential, so one thread per block makes a round of draws into shared memory
//   and the block applies them; this keeps every device's mask identical (backward regenerates
//   it from the seed) at the cost of a serial generator per chunk.

struct AmpChunk {
    u64 ptr;
    i64 len;
    i64 flag;
};

template <typename T>
__device__ void amp_unscale_check(const AmpChunk* chunks, i64 n_chunks, const double* scale, float* found_inf) {
    typedef typename Acc<T>::type A;
    const bool unscale = scale != nullptr;
    const A inv = unscale ? (A)__double2float_rn(__ddiv_rn(1.0, scale[0])) : A(1);
    for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        AmpChunk ch = chunks[c];
        T* data = reinterpret_cast<T*>(ch.ptr);
        int bad = 0;
        for (i64 i = threadIdx.x; i < ch.len; i += blockDim.x) {
            A v = load(data[i]);
            bad |= amp_finite(v) ? 0 : 1;
            if (unscale) data[i] = store<T>(v * inv);
        }
        if (__syncthreads_or(bad) && threadIdx.x == 0) found_inf[ch.flag] = 1.0f;
    }
}

// The norm from the block partials of sum_squares: one block, `out[0] = sqrt(f32(sum))`
// (for f64, the square root in f64, then rounded).
template <typename T> __device__ void amp_norm_finish(float* out, const typename Acc<T>::type* parts, i64 n) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    A acc = A(0);
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) acc += parts[i];
    acc = amp_block_sum(acc, red);
    if (threadIdx.x == 0) out[0] = sizeof(A) == 8 ? (float)sqrt((double)acc) : __fsqrt_rn((float)acc);
}

template <typename T>
__device__ void amp_sum_squares(typename Acc<T>::type* parts, const T* x, AmpShape s, AmpView vx, i64 n) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    A acc = A(0);
    AMP_GRID_LOOP(i, n) {
        A v = load(x[amp_offset(s, vx, i)]);
        acc += v * v;
    }
    acc = amp_block_sum(acc, red);
    if (threadIdx.x == 0) parts[blockIdx.x] = acc;
}

template <typename T> __device__ void amp_scale(T* x, i64 n, const float* k) {
    typedef typename Acc<T>::type A;
    const A kk = (A)k[0];
    AMP_GRID_LOOP(i, n) x[i] = store<T>(load(x[i]) * kk);
}

template <typename T> __device__ void amp_clamp(T* x, i64 n, float c) {
    typedef typename Acc<T>::type A;
    const A cc = (A)c;
    AMP_GRID_LOOP(i, n) {
        A v = load(x[i]);
        x[i] = store<T>(v > cc ? cc : (v < -cc ? -cc : v));
    }
}

// ---- dropout ---------------------------------------------------------------------------------------

#define AMP_DROPOUT_CHUNK 16384
#define AMP_DROPOUT_DRAWS 256

__device__ __forceinline__ u64 amp_rotl(u64 x, int k) { return (x << k) | (x >> (64 - k)); }

struct AmpRng {
    u64 s[4];
    __device__ void seed(u64 x) {
        for (int i = 0; i < 4; ++i) {
            x += 0x9E3779B97F4A7C15ull;
            u64 z = x;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            s[i] = z ^ (z >> 31);
        }
    }
    __device__ u64 next() {
        u64 result = amp_rotl(s[1] * 5, 7) * 9;
        u64 t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = amp_rotl(s[3], 45);
        return result;
    }
};

// out[i] = x[view(i)] · (bits(i) >= thr ? scale : 0), in Acc<T> (a multiply, so NaN stays NaN).
template <typename T>
__device__ void amp_dropout(T* out, const T* x, AmpShape s, AmpView vx, i64 n, u32 thr, double scale, u64 seed) {
    typedef typename Acc<T>::type A;
    __shared__ u32 bits[2 * AMP_DROPOUT_DRAWS];
    __shared__ AmpRng rng;
    const A sc = (A)scale, zero = A(0);
    const i64 chunks = (n + AMP_DROPOUT_CHUNK - 1) / AMP_DROPOUT_CHUNK;
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        const i64 start = c * AMP_DROPOUT_CHUNK;
        const i64 len = n - start < AMP_DROPOUT_CHUNK ? n - start : AMP_DROPOUT_CHUNK;
        if (threadIdx.x == 0) rng.seed(seed ^ ((u64)c * 0x9E3779B97F4A7C15ull));
        for (i64 r = 0; r < len; r += 2 * AMP_DROPOUT_DRAWS) {
            __syncthreads();  // the previous round's bits are consumed (and the seed is set)
            if (threadIdx.x == 0) {
                for (int k = 0; k < AMP_DROPOUT_DRAWS; ++k) {
                    u64 v = rng.next();
                    bits[2 * k] = (u32)v;
                    bits[2 * k + 1] = (u32)(v >> 32);
                }
            }
            __syncthreads();
            for (i64 t = threadIdx.x; t < 2 * AMP_DROPOUT_DRAWS && r + t < len; t += blockDim.x) {
                i64 i = start + r + t;
                A v = load(x[amp_offset(s, vx, i)]);
                out[i] = store<T>(v * (bits[t] >= thr ? sc : zero));
            }
        }
        __syncthreads();  // rng and bits are reused by the next chunk
    }
}

#define AMP_AMP_KERNELS(SUF)                                                                               \
    extern "C" __global__ void unscale_check_fwd_##SUF(const AmpChunk* chunks, i64 n_chunks,               \
                                                       const double* scale, float* found_inf) {            \
        amp_unscale_check<amp_t_##SUF>(chunks, n_chunks, scale, found_inf);                                \
    }                                                                                                      \
    extern "C" __global__ void norm_finish_fwd_##SUF(float* out, const Acc<amp_t_##SUF>::type* parts,     \
                                                     i64 n) {                                              \
        amp_norm_finish<amp_t_##SUF>(out, parts, n);                                                       \
    }                                                                                                      \
    extern "C" __global__ void sum_squares_fwd_##SUF(Acc<amp_t_##SUF>::type* parts, const amp_t_##SUF* x,  \
                                                     AmpShape s, AmpView vx, i64 n) {                      \
        amp_sum_squares<amp_t_##SUF>(parts, x, s, vx, n);                                                  \
    }                                                                                                      \
    extern "C" __global__ void scale_fwd_##SUF(amp_t_##SUF* x, i64 n, const float* k) {                   \
        amp_scale<amp_t_##SUF>(x, n, k);                                                                   \
    }                                                                                                      \
    extern "C" __global__ void clamp_fwd_##SUF(amp_t_##SUF* x, i64 n, float c) { amp_clamp<amp_t_##SUF>(x, n, c); } \
    extern "C" __global__ void dropout_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, AmpShape s, AmpView vx, \
                                                 i64 n, u32 thr, double scale, u64 seed) {                 \
        amp_dropout<amp_t_##SUF>(out, x, s, vx, n, thr, scale, seed);                                      \
    }

// ---- the scaler's scalars (f32 family only) ----------------------------------------------------

__device__ __forceinline__ bool amp_bits_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// ScaleRule::apply on the state vector [scale, growth_tracker, hysteresis_tracker,
// overflows_in_a_row, overflows_at_floor]; the step overflowed when any flag is nonzero.
__device__ void amp_update_scale(double* st, const float* found_inf, i64 n_flags, double growth, double backoff,
                                 i64 interval, int has_min, float min_scale, int has_max, float max_scale,
                                 i64 hysteresis, int has_set, float set_scale) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (has_set) {
        st[0] = (double)set_scale;
        return;
    }
    bool overflow = false;
    for (i64 i = 0; i < n_flags; i++) overflow |= found_inf[i] != 0.0f;
    float scale = (float)st[0];
    if (overflow) {
        st[3] = st[3] + 1.0;
        st[1] = 0.0;
        double h = fmax(st[2] - 1.0, 0.0);
        st[2] = h;
        if (h > 0.0) return;
        if (has_min && scale <= min_scale) st[4] = st[4] + 1.0;
        float b = __double2float_rn(__dmul_rn((double)scale, backoff));
        if (has_min) b = fmaxf(b, min_scale);
        st[0] = (double)b;
    } else {
        st[3] = 0.0;
        st[4] = 0.0;
        double t = st[1] + 1.0;
        if (t == (double)interval) {
            float g = __double2float_rn(__dmul_rn((double)scale, growth));
            if (amp_bits_finite(g)) {
                if (has_max) g = fminf(g, max_scale);
                st[0] = (double)g;
            }
            st[1] = 0.0;
            st[2] = (double)hysteresis;
        } else {
            st[1] = t;
        }
    }
}

// PyTorch's clip scalars: out[0] = sqrt(sum of norms[i]^2, in order), out[1] = min(1,
// (1 / (total + 1e-6)) * max_norm), NaN kept.
__device__ void amp_clip_coefficient(float* out, const float* norms, i64 n, float max_norm) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    float acc = 0.0f;
    for (i64 i = 0; i < n; i++) acc = __fadd_rn(acc, __fmul_rn(norms[i], norms[i]));
    float total = __fsqrt_rn(acc);
    float coef = __fmul_rn(__fdiv_rn(1.0f, __fadd_rn(total, 1e-6f)), max_norm);
    if (coef > 1.0f) coef = 1.0f;
    out[0] = total;
    out[1] = coef;
}

#define AMP_SCALER_KERNELS(SUF)                                                                            \
    extern "C" __global__ void update_scale_fwd_##SUF(double* st, const float* found_inf, i64 n_flags,     \
                                                      double growth, double backoff, i64 interval,         \
                                                      int has_min, float min_scale, int has_max,           \
                                                      float max_scale, i64 hysteresis, int has_set,        \
                                                      float set_scale) {                                   \
        amp_update_scale(st, found_inf, n_flags, growth, backoff, interval, has_min, min_scale, has_max,  \
                         max_scale, hysteresis, has_set, set_scale);                                       \
    }                                                                                                      \
    extern "C" __global__ void clip_coefficient_fwd_##SUF(float* out, const float* norms, i64 n,           \
                                                          float max_norm) {                                \
        amp_clip_coefficient(out, norms, n, max_norm);                                                     \
    }
