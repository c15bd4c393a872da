// Reductions over one dim of a contiguous tensor viewed as [outer, d, inner]: sum (times a
// scale, before the one rounding) and max (NaN wins), the arg max / arg min with its values,
// and the scatter that is a selection's backward.
//
// Design notes:
// - inner == 1 (reducing the last dim): one block per row, a strided loop per thread and a
//   block reduction, so long rows use the whole block. inner > 1: one thread per output,
//   walking d with stride inner, so neighbouring threads read neighbouring elements.
// - inner > 1 with few outputs and a long d (a bias gradient: 768 sums over 16384 rows) would
//   leave most of the GPU idle and each thread walking d alone, so the host splits d into
//   parts instead: one thread per (part, output) reduces its chunk into Acc<T> partials, and
//   a second kernel combines each output's partials in part order (deterministic).
// - The accumulation is in Acc<T>; the summation order differs from the CPU's (tolerances
//   in the parity suite account for it); max and arg max are exact.

template <typename T, bool MAX>
__device__ void amp_reduce(T* out, const T* x, i64 outer, i64 d, i64 inner, double scale) {
    typedef typename Acc<T>::type A;
    const A sc = (A)scale;
    if (inner == 1) {
        __shared__ A red[AMP_RED_SLOTS];
        for (i64 row = blockIdx.x; row < outer; row += gridDim.x) {
            const T* xr = x + row * d;
            A acc = MAX ? amp_neg_inf<A>() : A(0);
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
                A v = load(xr[j]);
                acc = MAX ? amp_max(acc, v) : acc + v;
            }
            acc = MAX ? amp_block_max(acc, red) : amp_block_sum(acc, red);
            if (threadIdx.x == 0) out[row] = store<T>(acc * sc);
        }
    } else {
        AMP_GRID_LOOP(oi, outer * inner) {
            i64 o = oi / inner, i = oi - o * inner;
            const T* xr = x + o * d * inner + i;
            A acc = MAX ? amp_neg_inf<A>() : A(0);
            for (i64 j = 0; j < d; ++j) {
                A v = load(xr[j * inner]);
                acc = MAX ? amp_max(acc, v) : acc + v;
            }
            out[oi] = store<T>(acc * sc);
        }
    }
}

// partials[p·m + oi] = the reduction of chunk p (d-indices [p·per, (p+1)·per) ∩ [0, d)) of
// output oi, m = outer·inner.
template <typename T>
__device__ void amp_reduce_partial(typename Acc<T>::type* partials, const T* x, i64 outer, i64 d, i64 inner, i64 per,
                                   i64 parts, int max) {
    typedef typename Acc<T>::type A;
    const i64 m = outer * inner;
    AMP_GRID_LOOP(pi, parts * m) {
        const i64 p = pi / m, oi = pi - p * m;
        const i64 o = oi / inner, i = oi - o * inner;
        const T* xr = x + o * d * inner + i;
        const i64 j1 = min((p + 1) * per, d);
        A acc = max ? amp_neg_inf<A>() : A(0);
        for (i64 j = p * per; j < j1; ++j) {
            A v = load(xr[j * inner]);
            acc = max ? amp_max(acc, v) : acc + v;
        }
        partials[pi] = acc;
    }
}

// out[oi] = the partials of output oi combined in part order, times `scale`, rounded once.
template <typename T>
__device__ void amp_reduce_parts(T* out, const typename Acc<T>::type* partials, i64 m, i64 parts, double scale, int max) {
    typedef typename Acc<T>::type A;
    const A sc = (A)scale;
    AMP_GRID_LOOP(oi, m) {
        A acc = max ? amp_neg_inf<A>() : A(0);
        for (i64 p = 0; p < parts; ++p) {
            A v = partials[p * m + oi];
            acc = max ? amp_max(acc, v) : acc + v;
        }
        out[oi] = store<T>(acc * sc);
    }
}

// The index along d of the max (or min) of every [outer, inner] position: the first
// occurrence, and the first NaN wins (the CPU's loop, step for step), with the value.
template <typename T>
__device__ void amp_arg_reduce(T* vals, i64* idx, const T* x, i64 outer, i64 d, i64 inner, int max) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(oi, outer * inner) {
        i64 o = oi / inner, i = oi - o * inner;
        const T* xr = x + o * d * inner + i;
        i64 best = 0;
        A bv = load(xr[0]);
        for (i64 j = 1; j < d; ++j) {
            if (amp_isnan(bv)) break;
            A v = load(xr[j * inner]);
            if (amp_isnan(v) || (max && v > bv) || (!max && v < bv)) {
                best = j;
                bv = v;
            }
        }
        idx[oi] = best;
        vals[oi] = xr[best * inner];
    }
}

// out (zeroed [outer, d, inner]) gets g[oi] at index idx[oi] of the dim.
template <typename T> __device__ void amp_scatter_dim(T* out, const T* g, const i64* idx, i64 outer, i64 d, i64 inner) {
    AMP_GRID_LOOP(oi, outer * inner) {
        i64 o = oi / inner, i = oi - o * inner;
        out[o * d * inner + idx[oi] * inner + i] = g[oi];
    }
}

#define AMP_REDUCE_KERNELS(SUF)                                                                            \
    extern "C" __global__ void sum_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, i64 outer, i64 d,     \
                                             i64 inner, double scale) {                                    \
        amp_reduce<amp_t_##SUF, false>(out, x, outer, d, inner, scale);                                    \
    }                                                                                                      \
    extern "C" __global__ void max_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, i64 outer, i64 d,     \
                                             i64 inner, double scale) {                                    \
        amp_reduce<amp_t_##SUF, true>(out, x, outer, d, inner, scale);                                     \
    }                                                                                                      \
    extern "C" __global__ void reduce_partial_fwd_##SUF(Acc<amp_t_##SUF>::type* partials, const amp_t_##SUF* x, \
                                                        i64 outer, i64 d, i64 inner, i64 per, i64 parts,   \
                                                        int max) {                                         \
        amp_reduce_partial<amp_t_##SUF>(partials, x, outer, d, inner, per, parts, max);                    \
    }                                                                                                      \
    extern "C" __global__ void reduce_parts_fwd_##SUF(amp_t_##SUF* out, const Acc<amp_t_##SUF>::type* partials, \
                                                      i64 m, i64 parts, double scale, int max) {           \
        amp_reduce_parts<amp_t_##SUF>(out, partials, m, parts, scale, max);                                \
    }                                                                                                      \
    extern "C" __global__ void arg_reduce_fwd_##SUF(amp_t_##SUF* vals, i64* idx, const amp_t_##SUF* x,     \
                                                    i64 outer, i64 d, i64 inner, int max) {                \
        amp_arg_reduce<amp_t_##SUF>(vals, idx, x, outer, d, inner, max);                                   \
    }                                                                                                      \
    extern "C" __global__ void scatter_dim_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* g, const i64* idx, \
                                                     i64 outer, i64 d, i64 inner) {                        \
        amp_scatter_dim<amp_t_##SUF>(out, g, idx, outer, d, inner);                                        \
    }
