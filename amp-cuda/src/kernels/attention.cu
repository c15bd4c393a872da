// Fused causal attention over contiguous [n, t, d] tensors (n = batch x heads), forward and
// backward: amp_core::backend::Device::causal_attention and causal_attention_backward.
//
// One thread per row (a query row forward and for dq, a key row for dk and dv), AMP_ATT_ROWS
// rows per block and blockIdx.y the head. The block walks the other side in tiles of
// AMP_ATT_TILE rows staged in shared memory (in the accumulation type), so each loaded key,
// value, query or gradient row serves every thread of the block. A thread keeps its own row
// and its accumulators in registers: MAXD (32, 64 or 128, the smallest that holds d) sizes
// them. The scores and probabilities exist only as scalars in registers: nothing of size
// t x t is stored. The softmax is online (running max and sum, the accumulator rescaled when
// the max grows); the backward recomputes the probabilities from the saved log-sum-exps.

extern __shared__ __align__(16) unsigned char amp_dyn[];

#define AMP_ATT_ROWS 64
#define AMP_ATT_TILE 16

// Stages rows [r0, r0 + AMP_ATT_TILE) of up to two [t, d] matrices (cut at t) into `a`, `b`.
template <typename T, typename A>
__device__ __forceinline__ void amp_att_stage(A* a, A* b, const T* x, const T* y, i64 r0, i64 t, i64 d) {
    for (i64 e = threadIdx.x; e < AMP_ATT_TILE * d; e += blockDim.x) {
        i64 r = r0 + e / d;
        a[e] = r < t ? load(x[r * d + e % d]) : A(0);
        if (y) b[e] = r < t ? load(y[r * d + e % d]) : A(0);
    }
}

template <typename T, int MAXD>
__device__ void amp_att_fwd(T* out, typename Acc<T>::type* lse, const T* q, const T* k, const T* v, i64 t, i64 d,
                            double scale_) {
    typedef typename Acc<T>::type A;
    A* ks = reinterpret_cast<A*>(amp_dyn);
    A* vs = ks + AMP_ATT_TILE * d;
    const i64 h = blockIdx.y, base = h * t * d;
    const i64 i = (i64)blockIdx.x * AMP_ATT_ROWS + threadIdx.x;
    const i64 last = min((i64)(blockIdx.x + 1) * AMP_ATT_ROWS, t) - 1; // the block's last row
    const A scale = (A)scale_;
    A qr[MAXD], acc[MAXD];
#pragma unroll
    for (int c = 0; c < MAXD; ++c) {
        qr[c] = (i < t && c < d) ? load(q[base + i * d + c]) : A(0);
        acc[c] = A(0);
    }
    A m = amp_neg_inf<A>(), l = A(0);
    for (i64 j0 = 0; j0 <= last; j0 += AMP_ATT_TILE) {
        __syncthreads();
        amp_att_stage<T, A>(ks, vs, k + base, v + base, j0, t, d);
        __syncthreads();
        if (i >= t) continue;
        for (int jj = 0; jj < AMP_ATT_TILE && j0 + jj <= i; ++jj) {
            const A* kj = ks + jj * d;
            const A* vj = vs + jj * d;
            A s = A(0);
#pragma unroll
            for (int c = 0; c < MAXD; ++c)
                if (c < d) s += qr[c] * kj[c];
            s *= scale;
            if (s > m) { // exp(-inf) = 0 clears the empty start; NaN propagates through p
                A corr = exp(m - s);
                l *= corr;
#pragma unroll
                for (int c = 0; c < MAXD; ++c) acc[c] *= corr;
                m = s;
            }
            A p = exp(s - m);
            l += p;
#pragma unroll
            for (int c = 0; c < MAXD; ++c)
                if (c < d) acc[c] += p * vj[c];
        }
    }
    if (i >= t) return;
    A inv = A(1) / l;
#pragma unroll
    for (int c = 0; c < MAXD; ++c)
        if (c < d) out[base + i * d + c] = store<T>(acc[c] * inv);
    lse[h * t + i] = m + log(l);
}

// dq_i = scale sum_{j <= i} p_ij (g_i.v_j - D_i) k_j, with D_i = g_i.out_i (written to delta).
template <typename T, int MAXD>
__device__ void amp_att_dq(T* dq, typename Acc<T>::type* delta, const T* q, const T* k, const T* v, const T* out,
                           const T* g, const typename Acc<T>::type* lse, i64 t, i64 d, double scale_) {
    typedef typename Acc<T>::type A;
    A* ks = reinterpret_cast<A*>(amp_dyn);
    A* vs = ks + AMP_ATT_TILE * d;
    const i64 h = blockIdx.y, base = h * t * d;
    const i64 i = (i64)blockIdx.x * AMP_ATT_ROWS + threadIdx.x;
    const i64 last = min((i64)(blockIdx.x + 1) * AMP_ATT_ROWS, t) - 1;
    const A scale = (A)scale_;
    A qr[MAXD], gr[MAXD], acc[MAXD];
    A di = A(0);
#pragma unroll
    for (int c = 0; c < MAXD; ++c) {
        bool in = i < t && c < d;
        qr[c] = in ? load(q[base + i * d + c]) : A(0);
        gr[c] = in ? load(g[base + i * d + c]) : A(0);
        if (in) di += gr[c] * load(out[base + i * d + c]);
        acc[c] = A(0);
    }
    const A li = i < t ? lse[h * t + i] : A(0);
    for (i64 j0 = 0; j0 <= last; j0 += AMP_ATT_TILE) {
        __syncthreads();
        amp_att_stage<T, A>(ks, vs, k + base, v + base, j0, t, d);
        __syncthreads();
        if (i >= t) continue;
        for (int jj = 0; jj < AMP_ATT_TILE && j0 + jj <= i; ++jj) {
            const A* kj = ks + jj * d;
            const A* vj = vs + jj * d;
            A s = A(0), dp = A(0);
#pragma unroll
            for (int c = 0; c < MAXD; ++c)
                if (c < d) {
                    s += qr[c] * kj[c];
                    dp += gr[c] * vj[c];
                }
            A ds = exp(s * scale - li) * (dp - di);
#pragma unroll
            for (int c = 0; c < MAXD; ++c)
                if (c < d) acc[c] += ds * kj[c];
        }
    }
    if (i >= t) return;
#pragma unroll
    for (int c = 0; c < MAXD; ++c)
        if (c < d) dq[base + i * d + c] = store<T>(acc[c] * scale);
    delta[h * t + i] = di;
}

// dk_j = scale sum_{i >= j} p_ij (g_i.v_j - D_i) q_i and dv_j = sum_{i >= j} p_ij g_i.
template <typename T, int MAXD>
__device__ void amp_att_dkv(T* dk, T* dv, const T* q, const T* k, const T* v, const T* g,
                            const typename Acc<T>::type* delta, const typename Acc<T>::type* lse, i64 t, i64 d,
                            double scale_) {
    typedef typename Acc<T>::type A;
    A* qs = reinterpret_cast<A*>(amp_dyn);
    A* gs = qs + AMP_ATT_TILE * d;
    const i64 h = blockIdx.y, base = h * t * d;
    const i64 first = (i64)blockIdx.x * AMP_ATT_ROWS; // the block's first key row
    const i64 j = first + threadIdx.x;
    const A scale = (A)scale_;
    A kr[MAXD], vr[MAXD], ak[MAXD], av[MAXD];
#pragma unroll
    for (int c = 0; c < MAXD; ++c) {
        bool in = j < t && c < d;
        kr[c] = in ? load(k[base + j * d + c]) : A(0);
        vr[c] = in ? load(v[base + j * d + c]) : A(0);
        ak[c] = A(0);
        av[c] = A(0);
    }
    for (i64 i0 = first; i0 < t; i0 += AMP_ATT_TILE) {
        __syncthreads();
        amp_att_stage<T, A>(qs, gs, q + base, g + base, i0, t, d);
        __syncthreads();
        if (j >= t) continue;
        for (int ii = 0; ii < AMP_ATT_TILE && i0 + ii < t; ++ii) {
            const i64 i = i0 + ii;
            if (i < j) continue;
            const A* qi = qs + ii * d;
            const A* gi = gs + ii * d;
            A s = A(0), dp = A(0);
#pragma unroll
            for (int c = 0; c < MAXD; ++c)
                if (c < d) {
                    s += qi[c] * kr[c];
                    dp += gi[c] * vr[c];
                }
            A p = exp(s * scale - lse[h * t + i]);
            A ds = p * (dp - delta[h * t + i]);
#pragma unroll
            for (int c = 0; c < MAXD; ++c)
                if (c < d) {
                    av[c] += p * gi[c];
                    ak[c] += ds * qi[c];
                }
        }
    }
    if (j >= t) return;
#pragma unroll
    for (int c = 0; c < MAXD; ++c)
        if (c < d) {
            dk[base + j * d + c] = store<T>(ak[c] * scale);
            dv[base + j * d + c] = store<T>(av[c]);
        }
}

// Calls FN<T, MAXD>(...) with the register arrays' size for d (the host refuses d > 128).
#define AMP_ATT_DISPATCH(FN, T, ...)  \
    if (d <= 32) {                    \
        FN<T, 32>(__VA_ARGS__);       \
    } else if (d <= 64) {             \
        FN<T, 64>(__VA_ARGS__);       \
    } else {                          \
        FN<T, 128>(__VA_ARGS__);      \
    }

#define AMP_ATT_ACC(SUF) Acc<amp_t_##SUF>::type

#define AMP_ATTENTION_KERNELS(SUF)                                                                            \
    extern "C" __global__ void causal_attention_fwd_##SUF(amp_t_##SUF* out, AMP_ATT_ACC(SUF) * lse,           \
                                                          const amp_t_##SUF* q, const amp_t_##SUF* k,          \
                                                          const amp_t_##SUF* v, i64 t, i64 d, double scale) {  \
        AMP_ATT_DISPATCH(amp_att_fwd, amp_t_##SUF, out, lse, q, k, v, t, d, scale)                            \
    }                                                                                                         \
    extern "C" __global__ void causal_attention_dq_bwd_##SUF(                                                 \
        amp_t_##SUF* dq, AMP_ATT_ACC(SUF) * delta, const amp_t_##SUF* q, const amp_t_##SUF* k,               \
        const amp_t_##SUF* v, const amp_t_##SUF* out, const amp_t_##SUF* g, const AMP_ATT_ACC(SUF) * lse,    \
        i64 t, i64 d, double scale) {                                                                         \
        AMP_ATT_DISPATCH(amp_att_dq, amp_t_##SUF, dq, delta, q, k, v, out, g, lse, t, d, scale)               \
    }                                                                                                         \
    extern "C" __global__ void causal_attention_bwd_##SUF(                                                    \
        amp_t_##SUF* dk, amp_t_##SUF* dv, const amp_t_##SUF* q, const amp_t_##SUF* k, const amp_t_##SUF* v,   \
        const amp_t_##SUF* g, const AMP_ATT_ACC(SUF) * delta, const AMP_ATT_ACC(SUF) * lse, i64 t, i64 d,     \
        double scale) {                                                                                       \
        AMP_ATT_DISPATCH(amp_att_dkv, amp_t_##SUF, dk, dv, q, k, v, g, delta, lse, t, d, scale)               \
    }
