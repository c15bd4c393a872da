// Fused causal attention on tensor cores (FlashAttention-2's algorithm) for f16 and bf16 heads
// of 32 or 64 values: amp_core::backend::Device::causal_attention and its backward over
// contiguous [n, t, d] tensors, with no score tile in memory. Other precisions and head sizes
// take the cuBLAS path of attention.cu.
//
// Design notes:
// - A block is 4 warps and owns 64 rows: queries in the forward and in dQ, keys in dK/dV.
//   Each warp owns 16 of them, held as tensor-core A fragments in registers, and walks the
//   other side in tiles of 64 rows staged in shared memory (mma.cuh has the layouts).
// - A product's f32 accumulator fragment is, element for element, half of the next product's
//   A fragment (amp_flash_pack), so probabilities and score gradients never leave registers.
// - The softmax is online and in base 2: scores are scaled by scale·log2(e) so each exp is one
//   exp2; the saved log-sum-exp is natural, as the cuBLAS path and the CPU save it.
// - Rounding, as on the cuBLAS path: probabilities rounded once to T for P·V (the forward's
//   are not yet normalised: the output is divided by the row's f32 sum of the unrounded ones)
//   and for Pᵀ·dO; score gradients dS rounded once to T for dS·K and dSᵀ·Q; sums in f32, one
//   rounding at the store.
// - The backward is two kernels and no atomics: dQ by query block (recomputing P and dP), dK
//   and dV by key block. Deterministic, as the rest of the backend.
// - Staged rows past t are zeros and never stored; keys after a query, and in dK/dV queries
//   past t, get probability 0. Every pointer is 16-byte aligned (128-bit staging loads): the
//   host checks, and takes the cuBLAS path otherwise.
// - Non-finite inputs: a masked entry is 0 in every product, and 0·inf is NaN, so an inf or NaN
//   in V (forward) or dO (dV) spreads to rows of the same 64-row tile that should not see it
//   (the cuBLAS path does the same within its blocks); dS is selected, not multiplied, to 0.

#define AMP_FLASH_ROWS 64
#define AMP_FLASH_THREADS 128

typedef unsigned short amp_u16;

// Two values rounded to T and packed as one register, `lo` in the low half.
template <typename T> __device__ __forceinline__ u32 amp_pack2(float lo, float hi) {
    return (u32)store<T>(lo).bits | ((u32)store<T>(hi).bits << 16);
}

// Rows [r0, r0 + 64) of a row-major [t, D] matrix into a shared tile whose rows have D + 8
// values (the pad spreads a warp's fragment reads over all 32 banks); rows past t are zeros.
template <int D>
__device__ __forceinline__ void amp_flash_stage(amp_u16 (*tile)[D + 8], const amp_u16* src, i64 r0, i64 t) {
    const int per_row = D / 8;  // 128-bit chunks per row
    for (int i = threadIdx.x; i < AMP_FLASH_ROWS * per_row; i += AMP_FLASH_THREADS) {
        const int r = i / per_row, j = (i - r * per_row) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < t) v = *(const uint4*)(src + (r0 + r) * D + j);
        *(uint4*)&tile[r][j] = v;
    }
}

// The A fragments of 16 rows from `row0` (every column) of a row-major [t, D] matrix in global
// memory; rows past t are zeros.
template <int D>
__device__ __forceinline__ void amp_flash_rows(u32 (&a)[D / 16][4], const amp_u16* src, i64 row0, i64 t) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
    const i64 lo = row0 + g, hi = row0 + g + 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int col = kk * 16 + c;
        a[kk][0] = lo < t ? *(const u32*)(src + lo * D + col) : 0u;
        a[kk][1] = hi < t ? *(const u32*)(src + hi * D + col) : 0u;
        a[kk][2] = lo < t ? *(const u32*)(src + lo * D + col + 8) : 0u;
        a[kk][3] = hi < t ? *(const u32*)(src + hi * D + col + 8) : 0u;
    }
}

// acc = a · tileᵀ: the warp's 16 rows against the 64 staged rows (acc[nt] holds columns
// nt·8 .. nt·8 + 7 of the 16 x 64 result), summed over the D columns.
template <typename T, int D>
__device__ __forceinline__ void amp_flash_abt(float (&acc)[8][4], const u32 (&a)[D / 16][4],
                                              const amp_u16 (*tile)[D + 8]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const u32 b[2] = {*(const u32*)&tile[nt * 8 + g][kk * 16 + c], *(const u32*)&tile[nt * 8 + g][kk * 16 + c + 8]};
            amp_mma(acc[nt], a[kk], b, T());
        }
    }
}

// out += p · tile: the warp's 16 x 64 values `p` (packed A fragments) times the 64 staged rows
// (out[nt] holds columns nt·8 .. nt·8 + 7 of the 16 x D result).
template <typename T, int D>
__device__ __forceinline__ void amp_flash_ab(float (&out)[D / 8][4], const u32 (&p)[4][4], const amp_u16 (*tile)[D + 8]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = (lane & 3) * 2;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int r = kk * 16 + c;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int col = nt * 8 + g;
            const u32 b[2] = {(u32)tile[r][col] | ((u32)tile[r + 1][col] << 16),
                              (u32)tile[r + 8][col] | ((u32)tile[r + 9][col] << 16)};
            amp_mma(out[nt], p[kk], b, T());
        }
    }
}

// A 16 x 64 accumulator as the A fragments of a product over its 64 columns, rounded to T.
template <typename T> __device__ __forceinline__ void amp_flash_pack(u32 (&p)[4][4], const float (&v)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        p[kk][0] = amp_pack2<T>(v[2 * kk][0], v[2 * kk][1]);
        p[kk][1] = amp_pack2<T>(v[2 * kk][2], v[2 * kk][3]);
        p[kk][2] = amp_pack2<T>(v[2 * kk + 1][0], v[2 * kk + 1][1]);
        p[kk][3] = amp_pack2<T>(v[2 * kk + 1][2], v[2 * kk + 1][3]);
    }
}

// Row `half` (0: g, 1: g + 8) of a 16 x D accumulator, scaled by `by` and rounded to T, into
// row `row` of a row-major [t, D] matrix.
template <typename T, int D>
__device__ __forceinline__ void amp_flash_store(amp_u16* dst, const float (&acc)[D / 8][4], int half, i64 row, float by) {
    const int c = (threadIdx.x & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
        *(u32*)(dst + row * D + nt * 8 + c) = amp_pack2<T>(acc[nt][2 * half] * by, acc[nt][2 * half + 1] * by);
}

#define AMP_LOG2E 1.4426950408889634f
#define AMP_LN2 0.6931471805599453f

// out = softmax(scale · q kᵀ, causal) v and each row's natural log-sum-exp, for the 64 query
// rows of block (head blockIdx.x, query block gridDim.y - 1 - blockIdx.y: the longest first).
template <typename T, int D>
__device__ void amp_flash_fwd(T* out_, float* lse, const T* q_, const T* k_, const T* v_, i64 t, float scale) {
    __shared__ __align__(16) amp_u16 ks[AMP_FLASH_ROWS][D + 8];
    __shared__ __align__(16) amp_u16 vs[AMP_FLASH_ROWS][D + 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = (lane & 3) * 2;
    const i64 head = blockIdx.x, qb = (i64)gridDim.y - 1 - blockIdx.y, off = head * t * D;
    const amp_u16 *q = (const amp_u16*)q_ + off, *k = (const amp_u16*)k_ + off, *v = (const amp_u16*)v_ + off;
    amp_u16* out = (amp_u16*)out_ + off;
    const i64 row0 = qb * AMP_FLASH_ROWS + warp * 16;
    const float sl = scale * AMP_LOG2E;
    u32 qa[D / 16][4];
    amp_flash_rows<D>(qa, q, row0, t);
    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m[2] = {amp_neg_inf<float>(), amp_neg_inf<float>()}, l[2] = {0.f, 0.f};
    for (i64 kb = 0; kb <= qb; ++kb) {
        __syncthreads();  // every warp is done with the previous tiles
        amp_flash_stage<D>(ks, k, kb * AMP_FLASH_ROWS, t);
        amp_flash_stage<D>(vs, v, kb * AMP_FLASH_ROWS, t);
        __syncthreads();
        float s[8][4];
        amp_flash_abt<T, D>(s, qa, ks);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 row = row0 + g + 8 * h;
            float mx = amp_neg_inf<float>();
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const i64 key = kb * AMP_FLASH_ROWS + nt * 8 + c + j;
                    const float x = key > row ? amp_neg_inf<float>() : s[nt][2 * h + j] * sl;
                    s[nt][2 * h + j] = x;
                    mx = amp_max(mx, x);
                }
            mx = amp_max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = amp_max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = amp_max(m[h], mx);
            const float base = mnew == amp_neg_inf<float>() ? 0.f : mnew;  // no -inf - -inf
            const float corr = exp2f(m[h] - base);
            m[h] = mnew;
            l[h] *= corr;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                o[nt][2 * h] *= corr;
                o[nt][2 * h + 1] *= corr;
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    // Summed before P·V rounds it, so the saved lse is as exact as the cuBLAS
                    // path's (the backward recomputes P from it, whichever path wrote it).
                    const float p = exp2f(s[nt][2 * h + j] - base);
                    s[nt][2 * h + j] = p;
                    l[h] += p;
                }
        }
        u32 pa[4][4];
        amp_flash_pack<T>(pa, s);
        amp_flash_ab<T, D>(o, pa, vs);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const i64 row = row0 + g + 8 * h;
        if (row < t) {
            amp_flash_store<T, D>(out, o, h, row, 1.f / l[h]);
            if (c == 0) lse[head * t + row] = (m[h] + log2f(l[h])) * AMP_LN2;
        }
    }
}

// dQ = dS k with dS = P (dP - delta) scale, P = exp(scale · q kᵀ - lse) (causal) and
// dP = dO vᵀ, for the 64 query rows of block (head blockIdx.x, gridDim.y - 1 - blockIdx.y).
template <typename T, int D>
__device__ void amp_flash_dq(T* dq_, const T* q_, const T* k_, const T* v_, const T* g_, const float* lse,
                             const float* delta, i64 t, float scale) {
    __shared__ __align__(16) amp_u16 ks[AMP_FLASH_ROWS][D + 8];
    __shared__ __align__(16) amp_u16 vs[AMP_FLASH_ROWS][D + 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = (lane & 3) * 2;
    const i64 head = blockIdx.x, qb = (i64)gridDim.y - 1 - blockIdx.y, off = head * t * D;
    const amp_u16 *q = (const amp_u16*)q_ + off, *k = (const amp_u16*)k_ + off, *v = (const amp_u16*)v_ + off;
    const amp_u16* go = (const amp_u16*)g_ + off;
    const i64 row0 = qb * AMP_FLASH_ROWS + warp * 16;
    const float sl = scale * AMP_LOG2E;
    u32 qa[D / 16][4], ga[D / 16][4];
    amp_flash_rows<D>(qa, q, row0, t);
    amp_flash_rows<D>(ga, go, row0, t);
    float lr[2], dr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 row = row0 + g + 8 * h;
        lr[h] = row < t ? lse[head * t + row] * AMP_LOG2E : 0.f;
        dr[h] = row < t ? delta[head * t + row] : 0.f;
    }
    float dq[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;
    for (i64 kb = 0; kb <= qb; ++kb) {
        __syncthreads();
        amp_flash_stage<D>(ks, k, kb * AMP_FLASH_ROWS, t);
        amp_flash_stage<D>(vs, v, kb * AMP_FLASH_ROWS, t);
        __syncthreads();
        float s[8][4], dp[8][4];
        amp_flash_abt<T, D>(s, qa, ks);
        amp_flash_abt<T, D>(dp, ga, vs);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 row = row0 + g + 8 * h;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const i64 key = kb * AMP_FLASH_ROWS + nt * 8 + c + j;
                    // A select, not p = 0: dP of a masked key may be inf or NaN (0·inf).
                    const float p = key > row ? 0.f : exp2f(s[nt][2 * h + j] * sl - lr[h]);
                    s[nt][2 * h + j] = key > row ? 0.f : p * (dp[nt][2 * h + j] - dr[h]) * scale;
                }
        }
        u32 da[4][4];
        amp_flash_pack<T>(da, s);
        amp_flash_ab<T, D>(dq, da, ks);
    }
    amp_u16* out = (amp_u16*)dq_ + off;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 row = row0 + g + 8 * h;
        if (row < t) amp_flash_store<T, D>(out, dq, h, row, 1.f);
    }
}

// dK = dSᵀ q and dV = Pᵀ dO for the 64 key rows of block (head blockIdx.x, key block
// blockIdx.y: the longest first), over the query blocks from its own to the last.
template <typename T, int D>
__device__ void amp_flash_dkv(T* dk_, T* dv_, const T* q_, const T* k_, const T* v_, const T* g_, const float* lse,
                              const float* delta, i64 t, float scale) {
    __shared__ __align__(16) amp_u16 qs[AMP_FLASH_ROWS][D + 8];
    __shared__ __align__(16) amp_u16 gs[AMP_FLASH_ROWS][D + 8];
    __shared__ float ls[AMP_FLASH_ROWS], ds[AMP_FLASH_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = (lane & 3) * 2;
    const i64 head = blockIdx.x, kb = blockIdx.y, blocks = gridDim.y, off = head * t * D;
    const amp_u16 *q = (const amp_u16*)q_ + off, *k = (const amp_u16*)k_ + off, *v = (const amp_u16*)v_ + off;
    const amp_u16* go = (const amp_u16*)g_ + off;
    const i64 row0 = kb * AMP_FLASH_ROWS + warp * 16;  // this warp's first key
    const float sl = scale * AMP_LOG2E;
    u32 ka[D / 16][4], va[D / 16][4];
    amp_flash_rows<D>(ka, k, row0, t);
    amp_flash_rows<D>(va, v, row0, t);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        dk[nt][0] = dk[nt][1] = dk[nt][2] = dk[nt][3] = 0.f;
        dv[nt][0] = dv[nt][1] = dv[nt][2] = dv[nt][3] = 0.f;
    }
    for (i64 qb = kb; qb < blocks; ++qb) {
        __syncthreads();
        amp_flash_stage<D>(qs, q, qb * AMP_FLASH_ROWS, t);
        amp_flash_stage<D>(gs, go, qb * AMP_FLASH_ROWS, t);
        for (int i = threadIdx.x; i < AMP_FLASH_ROWS; i += AMP_FLASH_THREADS) {
            const i64 query = qb * AMP_FLASH_ROWS + i;
            ls[i] = query < t ? lse[head * t + query] * AMP_LOG2E : 0.f;
            ds[i] = query < t ? delta[head * t + query] : 0.f;
        }
        __syncthreads();
        // Transposed scores and dP: rows are this warp's keys, columns the staged queries.
        float st[8][4], dpt[8][4];
        amp_flash_abt<T, D>(st, ka, qs);
        amp_flash_abt<T, D>(dpt, va, gs);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 key = row0 + g + 8 * h;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int qi = nt * 8 + c + j;
                    const i64 query = qb * AMP_FLASH_ROWS + qi;
                    const bool masked = query < key || query >= t;
                    const float p = masked ? 0.f : exp2f(st[nt][2 * h + j] * sl - ls[qi]);
                    st[nt][2 * h + j] = p;
                    dpt[nt][2 * h + j] = masked ? 0.f : p * (dpt[nt][2 * h + j] - ds[qi]) * scale;
                }
        }
        u32 pa[4][4];
        amp_flash_pack<T>(pa, st);
        amp_flash_ab<T, D>(dv, pa, gs);
        amp_flash_pack<T>(pa, dpt);
        amp_flash_ab<T, D>(dk, pa, qs);
    }
    amp_u16 *dko = (amp_u16*)dk_ + off, *dvo = (amp_u16*)dv_ + off;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const i64 key = row0 + g + 8 * h;
        if (key < t) {
            amp_flash_store<T, D>(dko, dk, h, key, 1.f);
            amp_flash_store<T, D>(dvo, dv, h, key, 1.f);
        }
    }
}

#define AMP_FLASH_HEAD(SUF, D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(AMP_FLASH_THREADS)                                             \
        attention_flash_d##D##_fwd_##SUF(amp_t_##SUF* out, float* lse, const amp_t_##SUF* q,                    \
                                         const amp_t_##SUF* k, const amp_t_##SUF* v, i64 t, float scale) {      \
        amp_flash_fwd<amp_t_##SUF, D>(out, lse, q, k, v, t, scale);                                             \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(AMP_FLASH_THREADS) attention_flash_d##D##_dq_bwd_##SUF(         \
        amp_t_##SUF* dq, const amp_t_##SUF* q, const amp_t_##SUF* k, const amp_t_##SUF* v,                      \
        const amp_t_##SUF* g, const float* lse, const float* delta, i64 t, float scale) {                       \
        amp_flash_dq<amp_t_##SUF, D>(dq, q, k, v, g, lse, delta, t, scale);                                     \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(AMP_FLASH_THREADS) attention_flash_d##D##_dkv_bwd_##SUF(        \
        amp_t_##SUF* dk, amp_t_##SUF* dv, const amp_t_##SUF* q, const amp_t_##SUF* k, const amp_t_##SUF* v,     \
        const amp_t_##SUF* g, const float* lse, const float* delta, i64 t, float scale) {                       \
        amp_flash_dkv<amp_t_##SUF, D>(dk, dv, q, k, v, g, lse, delta, t, scale);                                \
    }

// Heads of 128 values would need more than 255 registers a thread in dK/dV (ptxas spills).
#define AMP_FLASH_KERNELS(SUF) \
    AMP_FLASH_HEAD(SUF, 32)    \
    AMP_FLASH_HEAD(SUF, 64)
