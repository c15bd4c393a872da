// 2-D max and average pooling over the (H, W) planes of a contiguous [planes, H, W] tensor,
// windows as `Pool2dSpec::window` places them (fixed, with padding; or adaptive).
//
// Design notes:
// - Forward: one thread per output. Backward: one thread per input element, which visits the
//   windows that hold it in row-major window order (the CPU's order) and sums their
//   contributions in Acc<T>: no atomics, deterministic. Max pooling's backward recomputes each
//   window's argmax from the input (first NaN, else the first of equal maxima), as the CPU does.

struct AmpPoolGeom {
    i64 planes, h, w, oh, ow;
    i64 kh, kw, sh, sw, ph, pw;
    int adaptive;
    int pad;
};

// The window of output `o` along one axis (n input, m output, kernel k, stride s, padding p):
// [start, end) clipped to the input, and the window's full size (an average's divisor factor).
__device__ __forceinline__ void amp_window(const AmpPoolGeom& g, int axis, i64 o, i64& start, i64& end, i64& size) {
    i64 n = axis == 0 ? g.h : g.w, m = axis == 0 ? g.oh : g.ow;
    if (g.adaptive) {
        start = o * n / m;
        end = ((o + 1) * n + m - 1) / m;
        size = end - start;
    } else {
        i64 k = axis == 0 ? g.kh : g.kw, s = axis == 0 ? g.sh : g.sw, p = axis == 0 ? g.ph : g.pw;
        i64 a = o * s - p, b = a + k;
        start = a < 0 ? 0 : (a > n ? n : a);
        end = b < 0 ? 0 : (b > n ? n : b);
        size = k;
    }
}

// The range of outputs along one axis whose windows may hold input position `x` (a superset;
// callers check membership).
__device__ __forceinline__ void amp_candidates(const AmpPoolGeom& g, int axis, i64 x, i64& lo, i64& hi) {
    i64 n = axis == 0 ? g.h : g.w, m = axis == 0 ? g.oh : g.ow;
    if (g.adaptive) {
        lo = x * m / n - 1;
        hi = (x + 1) * m / n + 1;
    } else {
        i64 k = axis == 0 ? g.kh : g.kw, s = axis == 0 ? g.sh : g.sw, p = axis == 0 ? g.ph : g.pw;
        i64 t = x + p - k + 1;  // o·s >= t
        lo = t <= 0 ? 0 : (t + s - 1) / s;
        hi = (x + p) / s;
    }
    if (lo < 0) lo = 0;
    if (hi > m - 1) hi = m - 1;
}

template <typename T> __device__ i64 amp_argmax(const T* plane, i64 w, i64 h0, i64 h1, i64 w0, i64 w1) {
    typedef typename Acc<T>::type A;
    i64 best = h0 * w + w0;
    A bv = load(plane[best]);
    for (i64 y = h0; y < h1; ++y) {
        for (i64 x = w0; x < w1; ++x) {
            if (amp_isnan(bv)) return best;
            A v = load(plane[y * w + x]);
            if (v > bv || amp_isnan(v)) {
                best = y * w + x;
                bv = v;
            }
        }
    }
    return best;
}

template <typename T> __device__ void amp_max_pool_fwd(T* out, const T* x, AmpPoolGeom g) {
    AMP_GRID_LOOP(e, g.planes * g.oh * g.ow) {
        i64 p = e / (g.oh * g.ow), o = e - p * g.oh * g.ow, oy = o / g.ow, ox = o - oy * g.ow;
        i64 h0, h1, kh, w0, w1, kw;
        amp_window(g, 0, oy, h0, h1, kh);
        amp_window(g, 1, ox, w0, w1, kw);
        const T* plane = x + p * g.h * g.w;
        out[e] = plane[amp_argmax(plane, g.w, h0, h1, w0, w1)];
    }
}

template <typename T> __device__ void amp_max_pool_bwd(T* dx, const T* x, const T* gy, AmpPoolGeom g) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(e, g.planes * g.h * g.w) {
        i64 p = e / (g.h * g.w), pos = e - p * g.h * g.w, y = pos / g.w, xx = pos - y * g.w;
        const T* plane = x + p * g.h * g.w;
        const T* gp = gy + p * g.oh * g.ow;
        i64 ylo, yhi, xlo, xhi;
        amp_candidates(g, 0, y, ylo, yhi);
        amp_candidates(g, 1, xx, xlo, xhi);
        A acc = A(0);
        for (i64 oy = ylo; oy <= yhi; ++oy) {
            i64 h0, h1, kh;
            amp_window(g, 0, oy, h0, h1, kh);
            if (y < h0 || y >= h1) continue;
            for (i64 ox = xlo; ox <= xhi; ++ox) {
                i64 w0, w1, kw;
                amp_window(g, 1, ox, w0, w1, kw);
                if (xx < w0 || xx >= w1) continue;
                if (amp_argmax(plane, g.w, h0, h1, w0, w1) == pos) acc += load(gp[oy * g.ow + ox]);
            }
        }
        dx[e] = store<T>(acc);
    }
}

template <typename T> __device__ void amp_avg_pool_fwd(T* out, const T* x, AmpPoolGeom g) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(e, g.planes * g.oh * g.ow) {
        i64 p = e / (g.oh * g.ow), o = e - p * g.oh * g.ow, oy = o / g.ow, ox = o - oy * g.ow;
        i64 h0, h1, kh, w0, w1, kw;
        amp_window(g, 0, oy, h0, h1, kh);
        amp_window(g, 1, ox, w0, w1, kw);
        const T* plane = x + p * g.h * g.w;
        A s = A(0);
        for (i64 y = h0; y < h1; ++y)
            for (i64 xx = w0; xx < w1; ++xx) s += load(plane[y * g.w + xx]);
        out[e] = store<T>(s / (A)(kh * kw));
    }
}

template <typename T> __device__ void amp_avg_pool_bwd(T* dx, const T* gy, AmpPoolGeom g) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(e, g.planes * g.h * g.w) {
        i64 p = e / (g.h * g.w), pos = e - p * g.h * g.w, y = pos / g.w, xx = pos - y * g.w;
        const T* gp = gy + p * g.oh * g.ow;
        i64 ylo, yhi, xlo, xhi;
        amp_candidates(g, 0, y, ylo, yhi);
        amp_candidates(g, 1, xx, xlo, xhi);
        A acc = A(0);
        for (i64 oy = ylo; oy <= yhi; ++oy) {
            i64 h0, h1, kh;
            amp_window(g, 0, oy, h0, h1, kh);
            if (y < h0 || y >= h1) continue;
            for (i64 ox = xlo; ox <= xhi; ++ox) {
                i64 w0, w1, kw;
                amp_window(g, 1, ox, w0, w1, kw);
                if (xx < w0 || xx >= w1) continue;
                acc += load(gp[oy * g.ow + ox]) / (A)(kh * kw);
            }
        }
        dx[e] = store<T>(acc);
    }
}

#define AMP_POOL_KERNELS(SUF)                                                                              \
    extern "C" __global__ void max_pool2d_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, AmpPoolGeom g) { \
        amp_max_pool_fwd<amp_t_##SUF>(out, x, g);                                                          \
    }                                                                                                      \
    extern "C" __global__ void max_pool2d_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* x,                 \
                                                    const amp_t_##SUF* gy, AmpPoolGeom g) {                \
        amp_max_pool_bwd<amp_t_##SUF>(dx, x, gy, g);                                                       \
    }                                                                                                      \
    extern "C" __global__ void avg_pool2d_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, AmpPoolGeom g) { \
        amp_avg_pool_fwd<amp_t_##SUF>(out, x, g);                                                          \
    }                                                                                                      \
    extern "C" __global__ void avg_pool2d_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* gy, AmpPoolGeom g) { \
        amp_avg_pool_bwd<amp_t_##SUF>(dx, gy, g);                                                          \
    }
