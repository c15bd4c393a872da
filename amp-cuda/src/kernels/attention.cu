// Causal attention over contiguous [n, t, d] tensors (n = batch x heads), forward and backward
// (amp_core::backend::Device::causal_attention and causal_attention_backward): the products
// run on cuBLAS (tensor cores for f16 and bf16) one block of query rows at a time, and these
// kernels do the rest of each block.
//
// Design notes:
// - The host walks blocks of `rows` query rows starting at `q0`; the block's keys are
//   [0, kt) with kt = q0 + rows (the causal limit of its last row). Its raw scores q·k are a
//   [n, rows, kt] tile in Acc<T> written by a GEMM; nothing of size t x t exists at once.
// - Probabilities are exp(scale·s - lse), zero above the diagonal, rounded once into T for the
//   next GEMM (as FlashAttention rounds them for its tensor-core product); the log-sum-exp of
//   every row is kept in Acc<T> for the backward.
// - The backward recomputes the probabilities from the scores and the saved log-sum-exps, and
//   forms dS = P (dP - delta) scale with delta = g·out per row (the same formula as the CPU's).
// - One block per row of the tile (grid-stride over rows); each thread keeps the same columns
//   in every pass, and the block reductions have their own barriers.

// Probabilities and log-sum-exps of a block of query rows from their raw scores.
template <typename T>
__device__ void amp_att_probs(T* p, typename Acc<T>::type* lse, const typename Acc<T>::type* s, i64 tile_rows,
                              i64 rows, i64 kt, i64 q0, i64 t, double scale_) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    const A scale = (A)scale_;
    for (i64 r = blockIdx.x; r < tile_rows; r += gridDim.x) {
        const i64 head = r / rows, qi = q0 + (r - head * rows), live = qi + 1;
        const A* sr = s + r * kt;
        T* pr = p + r * kt;
        A m = amp_neg_inf<A>();
        for (i64 j = threadIdx.x; j < live; j += blockDim.x) m = amp_max(m, sr[j] * scale);
        m = amp_block_max(m, red);
        A sum = A(0);
        for (i64 j = threadIdx.x; j < live; j += blockDim.x) sum += exp(sr[j] * scale - m);
        sum = amp_block_sum(sum, red);
        const A l = m + log(sum);
        for (i64 j = threadIdx.x; j < kt; j += blockDim.x) pr[j] = store<T>(j < live ? exp(sr[j] * scale - l) : A(0));
        if (threadIdx.x == 0) lse[head * t + qi] = l;
    }
}

// delta[r] = g[r]·out[r] over rows of d values.
template <typename T>
__device__ void amp_att_delta(typename Acc<T>::type* delta, const T* out, const T* g, i64 rows, i64 d) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        A acc = A(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) acc += load(out[r * d + j]) * load(g[r * d + j]);
        acc = amp_block_sum(acc, red);
        if (threadIdx.x == 0) delta[r] = acc;
    }
}

// For a block of query rows: the probabilities P (rounded into T, for dV = Pᵀ g) and the
// score gradients dS = P (dP - delta) scale (rounded into T, for dQ = dS k and dK = dSᵀ q),
// from the raw scores and dP = g vᵀ.
template <typename T>
__device__ void amp_att_grads(T* p, T* ds, const typename Acc<T>::type* s, const typename Acc<T>::type* dp,
                              const typename Acc<T>::type* lse, const typename Acc<T>::type* delta, i64 tile_rows,
                              i64 rows, i64 kt, i64 q0, i64 t, double scale_) {
    typedef typename Acc<T>::type A;
    const A scale = (A)scale_;
    for (i64 r = blockIdx.x; r < tile_rows; r += gridDim.x) {
        const i64 head = r / rows, qi = q0 + (r - head * rows);
        const A l = lse[head * t + qi], dl = delta[head * t + qi];
        for (i64 j = threadIdx.x; j < kt; j += blockDim.x) {
            const i64 e = r * kt + j;
            A pv = A(0), dv = A(0);
            if (j <= qi) {
                pv = exp(s[e] * scale - l);
                dv = pv * (dp[e] - dl) * scale;
            }
            p[e] = store<T>(pv);
            ds[e] = store<T>(dv);
        }
    }
}

#define AMP_ATT_ACC(SUF) Acc<amp_t_##SUF>::type

#define AMP_ATTENTION_KERNELS(SUF)                                                                          \
    extern "C" __global__ void attention_probs_fwd_##SUF(amp_t_##SUF* p, AMP_ATT_ACC(SUF) * lse,             \
                                                         const AMP_ATT_ACC(SUF) * s, i64 tile_rows, i64 rows, \
                                                         i64 kt, i64 q0, i64 t, double scale) {              \
        amp_att_probs<amp_t_##SUF>(p, lse, s, tile_rows, rows, kt, q0, t, scale);                           \
    }                                                                                                       \
    extern "C" __global__ void attention_delta_bwd_##SUF(AMP_ATT_ACC(SUF) * delta, const amp_t_##SUF* out,   \
                                                         const amp_t_##SUF* g, i64 rows, i64 d) {            \
        amp_att_delta<amp_t_##SUF>(delta, out, g, rows, d);                                                 \
    }                                                                                                       \
    extern "C" __global__ void attention_grads_bwd_##SUF(                                                   \
        amp_t_##SUF* p, amp_t_##SUF* ds, const AMP_ATT_ACC(SUF) * s, const AMP_ATT_ACC(SUF) * dp,           \
        const AMP_ATT_ACC(SUF) * lse, const AMP_ATT_ACC(SUF) * delta, i64 tile_rows, i64 rows, i64 kt, i64 q0, \
        i64 t, double scale) {                                                                              \
        amp_att_grads<amp_t_##SUF>(p, ds, s, dp, lse, delta, tile_rows, rows, kt, q0, t, scale);            \
    }
