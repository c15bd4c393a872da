// Reductions over one dim of a contiguous tensor viewed as [outer, d, inner]: sum (times a
// scale, before the one rounding) and max (NaN wins), the arg max / arg min with its values,
// and the scatter that is a selection's backward.
//
// Design notes:
// - inner == 1 (reducing the last dim): one block per row, a strided loop per thread and a
//   block reduction, so long rows use the whole block. inner > 1: one thread per output,
//   walking d with stride inner, so neighbouring threads read neighbouring elements.
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
    extern "C" __global__ void arg_reduce_fwd_##SUF(amp_t_##SUF* vals, i64* idx, const amp_t_##SUF* x,     \
                                                    i64 outer, i64 d, i64 inner, int max) {                \
        amp_arg_reduce<amp_t_##SUF>(vals, idx, x, outer, d, inner, max);                                   \
    }                                                                                                      \
    extern "C" __global__ void scatter_dim_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* g, const i64* idx, \
                                                     i64 outer, i64 d, i64 inner) {                        \
        amp_scatter_dim<amp_t_##SUF>(out, g, idx, outer, d, inner);                                        \
    }
