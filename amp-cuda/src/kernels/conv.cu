// The data movement around the convolution's GEMMs (which run on cuBLAS): im2col, col2im,
// the bias broadcast into the GEMM's output, and the bias gradient.
//
// Design notes:
// - Column matrices are [samples, G, K, L]: per group one row per weight tap k = (c, i, j)
//   (the weight's row order, K = C_g·kH·kW) and one column per output position (L = oH·oW),
//   as on the CPU; the host builds them for a bounded number of samples at a time.
// - col2im is a gather, not a scatter: each input element sums the column entries of the taps
//   that read it, in tap order (i, then j: the CPU's order), in Acc<T>, rounded once; no atomics.
// - The bias goes into the accumulator: `bias_fill` copies it into the GEMM's output, in the
//   output's own precision, and the GEMM adds its product with beta = 1. cuBLAS adds C to the
//   product in f32 (an f16 or bf16 value widens exactly) and rounds the sum to the output's
//   type at the end: the values an f32 scratch filled with the widened bias and a cast
//   afterwards gave, with 6 bytes of traffic an element for f16/bf16 instead of 18.

struct AmpConvGeom {
    i64 n, c_in, c_out, g, cg, og, k, h, w, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw;
};

// cols[n - n0, g, k, l] for samples n0..n0 + nb of x (contiguous [N, C_in, H, W]).
template <typename T> __device__ void amp_im2col(T* cols, const T* x, i64 n0, i64 nb, AmpConvGeom c) {
    const i64 l_n = c.oh * c.ow;
    AMP_GRID_LOOP(e, nb * c.g * c.k * l_n) {
        i64 l = e % l_n, rest = e / l_n;
        i64 k = rest % c.k;
        rest /= c.k;
        i64 g = rest % c.g, n = rest / c.g;
        i64 ci = k / (c.kh * c.kw), i = (k / c.kw) % c.kh, j = k % c.kw;
        i64 oy = l / c.ow, ox = l - oy * c.ow;
        i64 ih = oy * c.sh + i * c.dh - c.ph, iw = ox * c.sw + j * c.dw - c.pw;
        T v = store<T>((typename Acc<T>::type)0);
        if (ih >= 0 && ih < c.h && iw >= 0 && iw < c.w) {
            v = x[(((n0 + n) * c.c_in + g * c.cg + ci) * c.h + ih) * c.w + iw];
        }
        cols[e] = v;
    }
}

// dx[n0 + n] (contiguous [C_in, H, W] per sample) from the column gradients (Acc<T>).
template <typename T>
__device__ void amp_col2im(T* dx, const typename Acc<T>::type* cols, i64 n0, i64 nb, AmpConvGeom c) {
    typedef typename Acc<T>::type A;
    const i64 l_n = c.oh * c.ow;
    AMP_GRID_LOOP(e, nb * c.c_in * c.h * c.w) {
        i64 x_ = e % c.w, rest = e / c.w;
        i64 y_ = rest % c.h;
        rest /= c.h;
        i64 ch = rest % c.c_in, n = rest / c.c_in;
        i64 g = ch / c.cg, cl = ch - g * c.cg;
        A acc = A(0);
        for (i64 i = 0; i < c.kh; ++i) {
            i64 ty = y_ + c.ph - i * c.dh;
            if (ty < 0 || ty % c.sh != 0) continue;
            i64 oy = ty / c.sh;
            if (oy >= c.oh) continue;
            for (i64 j = 0; j < c.kw; ++j) {
                i64 tx = x_ + c.pw - j * c.dw;
                if (tx < 0 || tx % c.sw != 0) continue;
                i64 ox = tx / c.sw;
                if (ox >= c.ow) continue;
                i64 k = (cl * c.kh + i) * c.kw + j;
                acc += cols[((n * c.g + g) * c.k + k) * l_n + oy * c.ow + ox];
            }
        }
        dx[n0 * c.c_in * c.h * c.w + e] = store<T>(acc);
    }
}

// dst[i] = bias[(i / inner) % count], widened: the accumulator's starting value.
template <typename T> __device__ void amp_bias_fill(T* dst, const T* bias, i64 n, i64 inner, i64 count) {
    AMP_GRID_LOOP(i, n) dst[i] = bias[(i / inner) % count];
}

// gb[o] = Σ_{n, l} g[n, o, l] (g contiguous [N, C, L]), one block per channel.
template <typename T> __device__ void amp_channel_sum(T* gb, const T* g, i64 n, i64 ch, i64 l) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    for (i64 o = blockIdx.x; o < ch; o += gridDim.x) {
        A acc = A(0);
        for (i64 s = 0; s < n; ++s) {
            const T* row = g + (s * ch + o) * l;
            for (i64 t = threadIdx.x; t < l; t += blockDim.x) acc += load(row[t]);
        }
        acc = amp_block_sum(acc, red);
        if (threadIdx.x == 0) gb[o] = store<T>(acc);
    }
}

#define AMP_CONV_KERNELS(SUF)                                                                              \
    extern "C" __global__ void im2col_fwd_##SUF(amp_t_##SUF* cols, const amp_t_##SUF* x, i64 n0, i64 nb,   \
                                                AmpConvGeom c) {                                           \
        amp_im2col<amp_t_##SUF>(cols, x, n0, nb, c);                                                       \
    }                                                                                                      \
    extern "C" __global__ void col2im_bwd_##SUF(amp_t_##SUF* dx, const Acc<amp_t_##SUF>::type* cols, i64 n0, \
                                                i64 nb, AmpConvGeom c) {                                   \
        amp_col2im<amp_t_##SUF>(dx, cols, n0, nb, c);                                                      \
    }                                                                                                      \
    extern "C" __global__ void bias_fill_fwd_##SUF(amp_t_##SUF* dst, const amp_t_##SUF* bias,              \
                                                   i64 n, i64 inner, i64 count) {                          \
        amp_bias_fill<amp_t_##SUF>(dst, bias, n, inner, count);                                            \
    }                                                                                                      \
    extern "C" __global__ void channel_sum_bwd_##SUF(amp_t_##SUF* gb, const amp_t_##SUF* g, i64 n, i64 ch,  \
                                                     i64 l) {                                              \
        amp_channel_sum<amp_t_##SUF>(gb, g, n, ch, l);                                                     \
    }
