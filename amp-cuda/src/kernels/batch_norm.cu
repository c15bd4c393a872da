// Batch norm over dim 1 of a contiguous [N, C, inner] tensor: per-channel statistics in
// Acc<T> (two-pass variance), the running-buffer update in f64 rounded into f32, the
// elementwise forward, and backward's per-channel sums and input gradient.
//
// Design notes:
// - A channel's elements are N runs of `inner` contiguous values, C·inner apart. Statistics
//   and backward's sums run one block per channel; the elementwise passes one thread per
//   element. Formulas and their order of operations are the CPU backend's.

template <typename T>
__device__ void amp_bn_stats(typename Acc<T>::type* mean_out, typename Acc<T>::type* rstd_out,
                             typename Acc<T>::type* unbiased_out, const T* x, i64 n, i64 ch, i64 inner, double eps) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    const i64 m = n * inner;
    for (i64 c = blockIdx.x; c < ch; c += gridDim.x) {
        A s = A(0);
        for (i64 e = threadIdx.x; e < m; e += blockDim.x) {
            i64 s_ = e / inner, t = e - s_ * inner;
            s += load(x[(s_ * ch + c) * inner + t]);
        }
        A mean = amp_block_sum(s, red) / (A)m;
        A ss = A(0);
        for (i64 e = threadIdx.x; e < m; e += blockDim.x) {
            i64 s_ = e / inner, t = e - s_ * inner;
            A d = load(x[(s_ * ch + c) * inner + t]) - mean;
            ss += d * d;
        }
        ss = amp_block_sum(ss, red);
        if (threadIdx.x == 0) {
            A var = ss / (A)m;
            mean_out[c] = mean;
            rstd_out[c] = A(1) / sqrt(var + (A)eps);
            unbiased_out[c] = ss / (A)(m > 0 ? m - 1 : 0);
        }
    }
}

// running = (1 - momentum)·running + momentum·stat, in f64, rounded into f32.
template <typename T>
__device__ void amp_bn_running(float* run_mean, float* run_var, const typename Acc<T>::type* mean,
                               const typename Acc<T>::type* unbiased, i64 ch, double momentum) {
    AMP_GRID_LOOP(c, ch) {
        run_mean[c] = (float)((1.0 - momentum) * (double)run_mean[c] + momentum * (double)mean[c]);
        run_var[c] = (float)((1.0 - momentum) * (double)run_var[c] + momentum * (double)unbiased[c]);
    }
}

// Eval statistics from the given f32 mean and variance views ([C], `stride` apart).
template <typename T>
__device__ void amp_bn_given(typename Acc<T>::type* mean_out, typename Acc<T>::type* rstd_out, const float* mean,
                             i64 mean_off, i64 mean_stride, const float* var, i64 var_off, i64 var_stride, i64 ch,
                             double eps) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(c, ch) {
        mean_out[c] = (A)mean[mean_off + c * mean_stride];
        rstd_out[c] = A(1) / sqrt((A)var[var_off + c * var_stride] + (A)eps);
    }
}

template <typename T>
__device__ void amp_bn_fwd(T* y, const T* x, const typename Acc<T>::type* mean, const typename Acc<T>::type* rstd,
                           const typename Acc<T>::type* w, const typename Acc<T>::type* b, i64 total, i64 ch,
                           i64 inner) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(e, total) {
        i64 c = (e / inner) % ch;
        A scale = rstd[c];
        if (w) scale = scale * load(w[c]);
        A shift = b ? load(b[c]) : A(0);
        y[e] = store<T>((load(x[e]) - mean[c]) * scale + shift);
    }
}

// Per channel: Σ g and Σ g·x̂ (x̂ = (x - mean)·rstd).
template <typename T>
__device__ void amp_bn_sums(typename Acc<T>::type* sg_out, typename Acc<T>::type* sgx_out, const T* x, const T* g,
                            const typename Acc<T>::type* mean, const typename Acc<T>::type* rstd, i64 n, i64 ch,
                            i64 inner) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    const i64 m = n * inner;
    for (i64 c = blockIdx.x; c < ch; c += gridDim.x) {
        A sg = A(0), sgx = A(0);
        const A mu = mean[c], rs = rstd[c];
        for (i64 e = threadIdx.x; e < m; e += blockDim.x) {
            i64 s_ = e / inner, t = e - s_ * inner;
            i64 at = (s_ * ch + c) * inner + t;
            A gv = load(g[at]);
            sg += gv;
            sgx += (load(x[at]) - mu) * rs * gv;
        }
        sg = amp_block_sum(sg, red);
        sgx = amp_block_sum(sgx, red);
        if (threadIdx.x == 0) {
            sg_out[c] = sg;
            sgx_out[c] = sgx;
        }
    }
}

// training: dx = w·rstd·(g - Σg/M - x̂·Σ(g·x̂)/M); eval: dx = w·rstd·g.
template <typename T>
__device__ void amp_bn_bwd(T* dx, const T* x, const T* g, const typename Acc<T>::type* mean,
                           const typename Acc<T>::type* rstd, const typename Acc<T>::type* w,
                           const typename Acc<T>::type* sg,
                           const typename Acc<T>::type* sgx, i64 total, i64 ch, i64 inner, int training, double inv_m) {
    typedef typename Acc<T>::type A;
    const A im = (A)inv_m;
    AMP_GRID_LOOP(e, total) {
        i64 c = (e / inner) % ch;
        A rs = rstd[c];
        A scale = rs;
        if (w) scale = scale * load(w[c]);
        A gv = load(g[e]);
        if (training) {
            A mg = sg[c] * im, mgx = sgx[c] * im;
            dx[e] = store<T>(scale * (gv - mg - (load(x[e]) - mean[c]) * rs * mgx));
        } else {
            dx[e] = store<T>(scale * gv);
        }
    }
}

#define AMP_BN_ACC(SUF) Acc<amp_t_##SUF>::type

#define AMP_BATCH_NORM_KERNELS(SUF)                                                                        \
    extern "C" __global__ void batch_norm_stats_fwd_##SUF(AMP_BN_ACC(SUF) * mean, AMP_BN_ACC(SUF) * rstd,  \
                                                          AMP_BN_ACC(SUF) * unbiased, const amp_t_##SUF* x, \
                                                          i64 n, i64 ch, i64 inner, double eps) {          \
        amp_bn_stats<amp_t_##SUF>(mean, rstd, unbiased, x, n, ch, inner, eps);                             \
    }                                                                                                      \
    extern "C" __global__ void batch_norm_running_fwd_##SUF(float* run_mean, float* run_var,               \
                                                            const AMP_BN_ACC(SUF) * mean,                  \
                                                            const AMP_BN_ACC(SUF) * unbiased, i64 ch,      \
                                                            double momentum) {                             \
        amp_bn_running<amp_t_##SUF>(run_mean, run_var, mean, unbiased, ch, momentum);                      \
    }                                                                                                      \
    extern "C" __global__ void batch_norm_given_fwd_##SUF(AMP_BN_ACC(SUF) * mean_out, AMP_BN_ACC(SUF) * rstd_out, \
                                                          const float* mean, i64 mean_off, i64 mean_stride, \
                                                          const float* var, i64 var_off, i64 var_stride,   \
                                                          i64 ch, double eps) {                            \
        amp_bn_given<amp_t_##SUF>(mean_out, rstd_out, mean, mean_off, mean_stride, var, var_off, var_stride, ch, \
                                  eps);                                                                    \
    }                                                                                                      \
    extern "C" __global__ void batch_norm_fwd_##SUF(amp_t_##SUF* y, const amp_t_##SUF* x,                  \
                                                    const AMP_BN_ACC(SUF) * mean, const AMP_BN_ACC(SUF) * rstd, \
                                                    const AMP_BN_ACC(SUF) * w, const AMP_BN_ACC(SUF) * b, \
                                                    i64 total, i64 ch, i64 inner) {                        \
        amp_bn_fwd<amp_t_##SUF>(y, x, mean, rstd, w, b, total, ch, inner);                                 \
    }                                                                                                      \
    extern "C" __global__ void batch_norm_sums_bwd_##SUF(AMP_BN_ACC(SUF) * sg, AMP_BN_ACC(SUF) * sgx,      \
                                                         const amp_t_##SUF* x, const amp_t_##SUF* g,       \
                                                         const AMP_BN_ACC(SUF) * mean,                     \
                                                         const AMP_BN_ACC(SUF) * rstd, i64 n, i64 ch,      \
                                                         i64 inner) {                                      \
        amp_bn_sums<amp_t_##SUF>(sg, sgx, x, g, mean, rstd, n, ch, inner);                                 \
    }                                                                                                      \
    extern "C" __global__ void batch_norm_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* x, const amp_t_##SUF* g, \
                                                    const AMP_BN_ACC(SUF) * mean, const AMP_BN_ACC(SUF) * rstd, \
                                                    const AMP_BN_ACC(SUF) * w, const AMP_BN_ACC(SUF) * sg, \
                                                    const AMP_BN_ACC(SUF) * sgx, i64 total, i64 ch, i64 inner, \
                                                    int training, double inv_m) {                          \
        amp_bn_bwd<amp_t_##SUF>(dx, x, g, mean, rstd, w, sg, sgx, total, ch, inner, training, inv_m);      \
    }
