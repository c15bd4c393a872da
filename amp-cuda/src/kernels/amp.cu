// The AMP passes and dropout: the fused multi-tensor unscale + non-finite check, the
// non-finite test, the sum of squares that clipping measures, the in-place scale and clamp,
// and dropout's counter-based mask.
//
// Design notes:
// - unscale_check is one launch over every gradient: the host uploads a table of chunks
//   (pointer, length, gradient index), one block per chunk. Each value is multiplied by `inv`
//   (non-finite ones too, as PyTorch does) and a block that saw an inf or NaN writes 1 into
//   that gradient's `found_inf` slot. Concurrent writers write the same value, and a flag is
//   never cleared here, so the races are benign.
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

__device__ __forceinline__ bool amp_bits_non_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}

extern "C" __global__ void unscale_check_fwd_f32(const AmpChunk* chunks, i64 n_chunks, float inv, float* found_inf) {
    for (i64 c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        AmpChunk ch = chunks[c];
        float* data = reinterpret_cast<float*>(ch.ptr);
        int bad = 0;
        for (i64 i = threadIdx.x; i < ch.len; i += blockDim.x) {
            float v = data[i];
            bad |= amp_bits_non_finite(v) ? 1 : 0;
            data[i] = v * inv;
        }
        if (__syncthreads_or(bad) && threadIdx.x == 0) found_inf[ch.flag] = 1.0f;
    }
}

template <typename T> __device__ void amp_non_finite(int* flag, const T* x, AmpShape s, AmpView vx, i64 n) {
    AMP_GRID_LOOP(i, n) {
        if (!amp_finite(load(x[amp_offset(s, vx, i)]))) *flag = 1;
    }
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

template <typename T> __device__ void amp_scale(T* x, i64 n, float k) {
    typedef typename Acc<T>::type A;
    const A kk = (A)k;
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
    extern "C" __global__ void non_finite_fwd_##SUF(int* flag, const amp_t_##SUF* x, AmpShape s, AmpView vx, \
                                                    i64 n) {                                               \
        amp_non_finite<amp_t_##SUF>(flag, x, s, vx, n);                                                    \
    }                                                                                                      \
    extern "C" __global__ void sum_squares_fwd_##SUF(Acc<amp_t_##SUF>::type* parts, const amp_t_##SUF* x,  \
                                                     AmpShape s, AmpView vx, i64 n) {                      \
        amp_sum_squares<amp_t_##SUF>(parts, x, s, vx, n);                                                  \
    }                                                                                                      \
    extern "C" __global__ void scale_fwd_##SUF(amp_t_##SUF* x, i64 n, float k) { amp_scale<amp_t_##SUF>(x, n, k); } \
    extern "C" __global__ void clamp_fwd_##SUF(amp_t_##SUF* x, i64 n, float c) { amp_clamp<amp_t_##SUF>(x, n, c); } \
    extern "C" __global__ void dropout_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, AmpShape s, AmpView vx, \
                                                 i64 n, u32 thr, double scale, u64 seed) {                 \
        amp_dropout<amp_t_##SUF>(out, x, s, vx, n, thr, scale, seed);                                      \
    }
