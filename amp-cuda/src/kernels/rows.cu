// Fused row kernels over contiguous [rows, d] data: softmax and log-softmax, layer norm and
// RMS norm, cross-entropy, each one kernel per direction; the mean squared error; and the f64
// mean that the two losses finish with.
//
// Design notes:
// - One block per row (grid-stride over rows). When `cached` (the host checks that the row
//   fits the dynamic shared memory it passes), a row is read from global memory once into
//   shared memory in Acc<T> and every later pass reads it there: one read, one write per
//   element. Otherwise later passes read global memory again (rows too long for shared memory).
// - Each thread touches the same positions j = threadIdx.x + k·blockDim.x in every pass, so the
//   cached row needs no barrier between passes; block reductions have their own.
// - Statistics are those of the CPU backend: the max-subtracted log-sum-exp, the two-pass
//   variance, rstd = 1 / sqrt(var + eps); they are kept in Acc<T> for backward.
// - The norm's weight and bias gradients are sums over rows: partial sums over fixed groups of
//   rows (one thread per (group, column)), then the groups summed in order, so the result does
//   not depend on scheduling.

extern __shared__ __align__(16) unsigned char amp_dyn[];

// ---- softmax ---------------------------------------------------------------------------------

template <typename T, bool LOG> __device__ void amp_softmax_fwd(T* out, const T* x, i64 rows, i64 d, int cached) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    A* buf = reinterpret_cast<A*>(amp_dyn);
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * d;
        T* yr = out + row * d;
        A m = amp_neg_inf<A>();
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A v = load(xr[j]);
            if (cached) buf[j] = v;
            m = amp_max(m, v);
        }
        m = amp_block_max(m, red);
        A s = A(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A v = cached ? buf[j] : load(xr[j]);
            A e = exp(v - m);
            if (cached && !LOG) buf[j] = e;
            s += e;
        }
        s = amp_block_sum(s, red);
        if (LOG) {
            A lse = m + log(s);
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
                A v = cached ? buf[j] : load(xr[j]);
                yr[j] = store<T>(v - lse);
            }
        } else {
            A inv = A(1) / s;
            for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
                A e = cached ? buf[j] : exp(load(xr[j]) - m);
                yr[j] = store<T>(e * inv);
            }
        }
    }
}

// softmax: dx = y (g - Σ g y); log-softmax: dx = g - exp(y) Σ g.
template <typename T, bool LOG> __device__ void amp_softmax_bwd(T* out, const T* y, const T* g, i64 rows, i64 d) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* yr = y + row * d;
        const T* gr = g + row * d;
        T* o = out + row * d;
        A s = A(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A gv = load(gr[j]);
            s += LOG ? gv : gv * load(yr[j]);
        }
        s = amp_block_sum(s, red);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A gv = load(gr[j]), yv = load(yr[j]);
            o[j] = store<T>(LOG ? gv - exp(yv) * s : yv * (gv - s));
        }
    }
}

// ---- layer norm and RMS norm -------------------------------------------------------------------

template <typename T, bool RMS>
__device__ void amp_norm_fwd(T* out, typename Acc<T>::type* mean_out, typename Acc<T>::type* rstd_out, const T* x,
                             const T* w, const T* b, i64 rows, i64 d, double eps, int cached) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    A* buf = reinterpret_cast<A*>(amp_dyn);
    const A inv_d = (A)(1.0 / (double)d), ep = (A)eps;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * d;
        T* yr = out + row * d;
        A s = A(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A v = load(xr[j]);
            if (cached) buf[j] = v;
            s += v;
        }
        A mean = RMS ? A(0) : amp_block_sum(s, red) * inv_d;
        A ss = A(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A v = (cached ? buf[j] : load(xr[j])) - mean;
            ss += v * v;
        }
        A var = amp_block_sum(ss, red) * inv_d;
        A rstd = A(1) / sqrt(var + ep);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A v = ((cached ? buf[j] : load(xr[j])) - mean) * rstd;
            if (w) v = v * load(w[j]);
            if (b) v = v + load(b[j]);
            yr[j] = store<T>(v);
        }
        if (threadIdx.x == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
    }
}

// dx = rstd (ĝ - mean(ĝ) - x̂ mean(ĝ x̂)) with x̂ = (x - mean) rstd, ĝ = g w (RMS: no mean(ĝ)).
template <typename T, bool RMS>
__device__ void amp_norm_bwd(T* dx, const T* x, const T* g, const T* w, const typename Acc<T>::type* mean_in,
                             const typename Acc<T>::type* rstd_in, i64 rows, i64 d, int cached) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    A* xh_buf = reinterpret_cast<A*>(amp_dyn);
    A* gh_buf = xh_buf + d;
    const A inv_d = (A)(1.0 / (double)d);
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * d;
        const T* gr = g + row * d;
        const A mean = mean_in[row], rstd = rstd_in[row];
        A s_gh = A(0), s_ghx = A(0);
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A xh = (load(xr[j]) - mean) * rstd;
            A gh = load(gr[j]);
            if (w) gh = gh * load(w[j]);
            if (cached) {
                xh_buf[j] = xh;
                gh_buf[j] = gh;
            }
            s_gh += gh;
            s_ghx += gh * xh;
        }
        A mean_gh = RMS ? A(0) : amp_block_sum(s_gh, red) * inv_d;
        A mean_ghx = amp_block_sum(s_ghx, red) * inv_d;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) {
            A xh, gh;
            if (cached) {
                xh = xh_buf[j];
                gh = gh_buf[j];
            } else {
                xh = (load(xr[j]) - mean) * rstd;
                gh = load(gr[j]);
                if (w) gh = gh * load(w[j]);
            }
            dx[row * d + j] = store<T>(rstd * (gh - mean_gh - xh * mean_ghx));
        }
    }
}

// Partial sums of g·x̂ (pw) and g (pb) over rows [part·per, (part+1)·per), one thread per
// (part, column); either output may be null.
template <typename T>
__device__ void amp_norm_params_partial(typename Acc<T>::type* pw, typename Acc<T>::type* pb, const T* x, const T* g,
                                        const typename Acc<T>::type* mean_in, const typename Acc<T>::type* rstd_in,
                                        i64 rows, i64 d, i64 per, i64 parts) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(pj, parts * d) {
        i64 part = pj / d, j = pj - part * d;
        i64 r0 = part * per, r1 = r0 + per < rows ? r0 + per : rows;
        A sw = A(0), sb = A(0);
        for (i64 r = r0; r < r1; ++r) {
            A gv = load(g[r * d + j]);
            if (pw) sw += gv * ((load(x[r * d + j]) - mean_in[r]) * rstd_in[r]);
            sb += gv;
        }
        if (pw) pw[pj] = sw;
        if (pb) pb[pj] = sb;
    }
}

// The partials summed over parts in order, rounded once.
template <typename T>
__device__ void amp_norm_params(T* gw, T* gb, const typename Acc<T>::type* pw, const typename Acc<T>::type* pb,
                                i64 parts, i64 d) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(j, d) {
        A sw = A(0), sb = A(0);
        for (i64 p = 0; p < parts; ++p) {
            if (gw) sw += pw[p * d + j];
            if (gb) sb += pb[p * d + j];
        }
        if (gw) gw[j] = store<T>(sw);
        if (gb) gb[j] = store<T>(sb);
    }
}


// ---- one warp per short row ----------------------------------------------------------------------
// Rows of d values where d is a multiple of V = 16 / sizeof(T) and every row starts 16-byte
// aligned, with at most NV 128-bit vectors per lane (the host picks NV, at most 32 values per
// lane): a warp holds its row in registers, moves it in 128-bit vectors, and reduces with
// shuffles only (no shared memory, no barriers). Same statistics and formulas as the block
// kernels above; AMP_WARP_ROWS rows per block of 32·AMP_WARP_ROWS threads, grid-stride.

#define AMP_WARP_ROWS 4

// The lane's vectors of a row (`nvec` vectors of V values) in registers; absent ones are `fill`.
template <typename T, int NV>
__device__ __forceinline__ void amp_row_load(typename Acc<T>::type* r, const T* row, int nvec,
                                             typename Acc<T>::type fill) {
    const int V = 16 / sizeof(T), lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        if (lane + 32 * k < nvec) {
            Pack16<T> p;
            p.raw = reinterpret_cast<const uint4*>(row)[lane + 32 * k];
#pragma unroll
            for (int e = 0; e < V; ++e) r[k * V + e] = load(p.v[e]);
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) r[k * V + e] = fill;
        }
    }
}

// Rounds the lane's present vectors into `row`.
template <typename T, int NV>
__device__ __forceinline__ void amp_row_store(T* row, const typename Acc<T>::type* r, int nvec) {
    const int V = 16 / sizeof(T), lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        if (lane + 32 * k < nvec) {
            Pack16<T> p;
#pragma unroll
            for (int e = 0; e < V; ++e) p.v[e] = store<T>(r[k * V + e]);
            reinterpret_cast<uint4*>(row)[lane + 32 * k] = p.raw;
        }
    }
}

// Whether slot i of the lane's registers holds a value of the row.
#define AMP_SLOT_LIVE(i) (((int)(threadIdx.x & 31) + 32 * ((i) / (16 / (int)sizeof(T)))) < nvec)

// The warp's first row and the step between rows of one lane's warp.
#define AMP_WARP_ROW_LOOP(row, rows)                                                             \
    for (i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < (rows);              \
         row += ((i64)gridDim.x * blockDim.x) >> 5)

template <typename T, bool LOG, int NV> __device__ void amp_softmax_warp_fwd(T* out, const T* x, i64 rows, i64 d) {
    typedef typename Acc<T>::type A;
    const int V = 16 / sizeof(T), nvec = (int)(d / V);
    AMP_WARP_ROW_LOOP(row, rows) {
        A r[NV * V];
        amp_row_load<T, NV>(r, x + row * d, nvec, amp_neg_inf<A>());
        A m = amp_neg_inf<A>();
#pragma unroll
        for (int i = 0; i < NV * V; ++i) m = amp_max(m, r[i]);
        m = amp_warp_max(m);
        A s = A(0);
#pragma unroll
        for (int i = 0; i < NV * V; ++i) {
            if (AMP_SLOT_LIVE(i)) {
                A e = exp(r[i] - m);
                if (!LOG) r[i] = e;
                s += e;
            }
        }
        s = amp_warp_sum(s);
        const A lse = m + log(s), inv = A(1) / s;
#pragma unroll
        for (int i = 0; i < NV * V; ++i) r[i] = LOG ? r[i] - lse : r[i] * inv;
        amp_row_store<T, NV>(out + row * d, r, nvec);
    }
}

template <typename T, bool LOG, int NV>
__device__ void amp_softmax_warp_bwd(T* out, const T* y, const T* g, i64 rows, i64 d) {
    typedef typename Acc<T>::type A;
    const int V = 16 / sizeof(T), nvec = (int)(d / V);
    AMP_WARP_ROW_LOOP(row, rows) {
        A yr[NV * V], gr[NV * V];
        amp_row_load<T, NV>(yr, y + row * d, nvec, A(0));
        amp_row_load<T, NV>(gr, g + row * d, nvec, A(0));
        A s = A(0);
#pragma unroll
        for (int i = 0; i < NV * V; ++i) s += LOG ? gr[i] : gr[i] * yr[i];
        s = amp_warp_sum(s);
#pragma unroll
        for (int i = 0; i < NV * V; ++i) gr[i] = LOG ? gr[i] - exp(yr[i]) * s : yr[i] * (gr[i] - s);
        amp_row_store<T, NV>(out + row * d, gr, nvec);
    }
}

template <typename T, bool RMS, int NV>
__device__ void amp_norm_warp_fwd(T* out, typename Acc<T>::type* mean_out, typename Acc<T>::type* rstd_out, const T* x,
                                  const T* w, const T* b, i64 rows, i64 d, double eps) {
    typedef typename Acc<T>::type A;
    const int V = 16 / sizeof(T), nvec = (int)(d / V);
    const A inv_d = (A)(1.0 / (double)d), ep = (A)eps;
    A wr[NV * V], br[NV * V];
    amp_row_load<T, NV>(wr, w ? w : x, w ? nvec : 0, A(1));
    amp_row_load<T, NV>(br, b ? b : x, b ? nvec : 0, A(0));
    AMP_WARP_ROW_LOOP(row, rows) {
        A r[NV * V];
        amp_row_load<T, NV>(r, x + row * d, nvec, A(0));
        A s = A(0);
#pragma unroll
        for (int i = 0; i < NV * V; ++i) s += r[i];
        const A mean = RMS ? A(0) : amp_warp_sum(s) * inv_d;
        A ss = A(0);
#pragma unroll
        for (int i = 0; i < NV * V; ++i) {
            if (AMP_SLOT_LIVE(i)) {
                A c = r[i] - mean;
                ss += c * c;
            }
        }
        const A rstd = A(1) / sqrt(amp_warp_sum(ss) * inv_d + ep);
#pragma unroll
        for (int i = 0; i < NV * V; ++i) {
            A v = (r[i] - mean) * rstd;
            if (w) v = v * wr[i];
            if (b) v = v + br[i];
            r[i] = v;
        }
        amp_row_store<T, NV>(out + row * d, r, nvec);
        if ((threadIdx.x & 31) == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
    }
}

template <typename T, bool RMS, int NV>
__device__ void amp_norm_warp_bwd(T* dx, const T* x, const T* g, const T* w, const typename Acc<T>::type* mean_in,
                                  const typename Acc<T>::type* rstd_in, i64 rows, i64 d) {
    typedef typename Acc<T>::type A;
    const int V = 16 / sizeof(T), nvec = (int)(d / V);
    const A inv_d = (A)(1.0 / (double)d);
    A wr[NV * V];
    amp_row_load<T, NV>(wr, w ? w : x, w ? nvec : 0, A(1));
    AMP_WARP_ROW_LOOP(row, rows) {
        A xh[NV * V], gh[NV * V];
        amp_row_load<T, NV>(xh, x + row * d, nvec, A(0));
        amp_row_load<T, NV>(gh, g + row * d, nvec, A(0));
        const A mean = mean_in[row], rstd = rstd_in[row];
        A s_gh = A(0), s_ghx = A(0);
#pragma unroll
        for (int i = 0; i < NV * V; ++i) {
            xh[i] = (xh[i] - mean) * rstd;
            gh[i] = gh[i] * wr[i];
            s_gh += gh[i];
            s_ghx += gh[i] * xh[i];
        }
        const A mean_gh = RMS ? A(0) : amp_warp_sum(s_gh) * inv_d;
        const A mean_ghx = amp_warp_sum(s_ghx) * inv_d;
#pragma unroll
        for (int i = 0; i < NV * V; ++i) gh[i] = rstd * (gh[i] - mean_gh - xh[i] * mean_ghx);
        amp_row_store<T, NV>(dx + row * d, gh, nvec);
    }
}

// The most 128-bit vectors per lane the host picks for rows of T (`warp_vectors` in
// launch.rs: at most 32 values a lane): 4 for f16 and bf16, 8 for f32 and f64.
template <typename T> __device__ constexpr int amp_nv_max() { return sizeof(T) == 2 ? 4 : 8; }

// Runs CALL (an expression in parentheses that names the constant NVc) with NVc the host's
// `nv`: 1, 2, 4 or amp_nv_max<T>() vectors per lane. A kernel takes the registers of its
// largest instantiation, and an 8-vector one the host never launches made the 16-bit norm
// kernels take 222-255 registers a thread (122-130 without it); an `nv` above T's most traps
// instead of running with too few vectors.
#define AMP_NV_SWITCH(T, nv, CALL)                                            \
    switch (nv) {                                                             \
    case 1: { constexpr int NVc = 1; CALL; break; }                           \
    case 2: { constexpr int NVc = 2; CALL; break; }                           \
    case 4: { constexpr int NVc = 4; CALL; break; }                           \
    default: {                                                                \
        constexpr int NVc = amp_nv_max<T>();                                  \
        if (nv != NVc) __trap();                                              \
        CALL;                                                                 \
        break;                                                                \
    }                                                                         \
    }

// ---- cross-entropy -------------------------------------------------------------------------------

// The online log-sum-exp state (running max m and sum s of exp(v - m)) after one more value.
template <typename A> __device__ __forceinline__ void amp_lse_push(A& m, A& s, A v) {
    if (v > m) {
        s = s * exp(m - v) + A(1);
        m = v;
    } else if (v != amp_neg_inf<A>()) {
        s += exp(v - m); // NaN in v (or m) makes s NaN, as in the two-pass form
    }
}

// Calls BODY(j, v) for each element of a row of c values of T, the block's threads striding
// over it: in 128-bit vectors when `vec` (c a multiple of 16 / sizeof(T), the row 16-byte
// aligned), else one by one.
#define AMP_ROW_FOR_EACH(row_ptr, c, vec, BODY)                                               \
    if (vec) {                                                                                \
        const int V = 16 / sizeof(T);                                                         \
        for (i64 vi = threadIdx.x; vi < (c) / V; vi += blockDim.x) {                          \
            Pack16<T> p;                                                                      \
            p.raw = reinterpret_cast<const uint4*>(row_ptr)[vi];                              \
            _Pragma("unroll") for (int e = 0; e < V; ++e) {                                   \
                const i64 j = vi * V + e;                                                     \
                const A v = load(p.v[e]);                                                     \
                BODY;                                                                         \
            }                                                                                 \
        }                                                                                     \
    } else {                                                                                  \
        for (i64 j = threadIdx.x; j < (c); j += blockDim.x) {                                 \
            const A v = load((row_ptr)[j]);                                                   \
            BODY;                                                                             \
        }                                                                                     \
    }

// Per row: the log-sum-exp (kept for backward) and the row's loss in f64
// (-(1 - s)·logp[t] - (s / c)·Σ logp); ignored rows get 0 for both. One read of the row: each
// thread keeps an online log-sum-exp, and the block combines them at the row's max.
template <typename T>
__device__ void amp_ce_fwd(typename Acc<T>::type* lse_out, double* loss_out, const T* x, const i64* targets, i64 rows,
                           i64 c, int has_ignore, i64 ignore, double smoothing, int vec) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    const A s_ = (A)smoothing, per_class = (A)(smoothing / (double)c);
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 t = targets[row];
        if (has_ignore && t == ignore) {
            if (threadIdx.x == 0) {
                lse_out[row] = A(0);
                loss_out[row] = 0.0;
            }
            continue;
        }
        const T* xr = x + row * c;
        A m = amp_neg_inf<A>(), se = A(0), sx = A(0);
        AMP_ROW_FOR_EACH(xr, c, vec, {
            (void)j;
            amp_lse_push(m, se, v);
            sx += v;
        })
        const A mm = amp_block_max(m, red);
        se = amp_block_sum(m == amp_neg_inf<A>() ? A(0) : se * exp(m - mm), red);
        if (smoothing != 0.0) sx = amp_block_sum(sx, red);
        if (threadIdx.x == 0) {
            A lse = mm + log(se);
            A l = -(A(1) - s_) * (load(xr[t]) - lse);
            if (smoothing != 0.0) l = l - per_class * (sx - (A)c * lse);
            lse_out[row] = lse;
            loss_out[row] = (double)l;
        }
    }
}

// dx = scale·softmax(x) - scale·s/c, minus scale·(1 - s) at the target; 0 for ignored rows.
// `vec` as in AMP_ROW_FOR_EACH (dx then aligned too).
template <typename T>
__device__ void amp_ce_bwd(T* dx, const T* x, const i64* targets, const typename Acc<T>::type* lse_in, i64 rows, i64 c,
                           int has_ignore, i64 ignore, double smoothing, const T* g, double counted, int vec) {
    typedef typename Acc<T>::type A;
    // The upstream gradient (the loss scale under a scaler) is read here, not by the host.
    const A sc = (A)((double)load(g[0]) / counted);
    const A hit = (A)(1.0 - smoothing) * sc, base = (A)(smoothing / (double)c) * sc;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 t = targets[row];
        T* o = dx + row * c;
        const bool ignored = has_ignore && t == ignore;
        const T* xr = x + row * c;
        const A lse = ignored ? A(0) : lse_in[row];
        auto grad = [&](i64 j, A v) -> A {
            if (ignored) return A(0);
            A r = exp(v - lse) * sc - base;
            return j == t ? r - hit : r;
        };
        if (vec) {
            const int V = 16 / sizeof(T);
            for (i64 vi = threadIdx.x; vi < c / V; vi += blockDim.x) {
                Pack16<T> in, out;
                in.raw = reinterpret_cast<const uint4*>(xr)[vi];
#pragma unroll
                for (int e = 0; e < V; ++e) out.v[e] = store<T>(grad(vi * V + e, load(in.v[e])));
                reinterpret_cast<uint4*>(o)[vi] = out.raw;
            }
        } else {
            for (i64 j = threadIdx.x; j < c; j += blockDim.x) o[j] = store<T>(grad(j, load(xr[j])));
        }
    }
}

// ---- mean squared error and the f64 mean -----------------------------------------------------------

// parts[block] = Σ (a - b)² over this block's share of the two views (Acc<T>, stored as f64).
template <typename T> __device__ void amp_mse(double* parts, const T* a, const T* b, AmpShape s, AmpView va, AmpView vb, i64 n) {
    typedef typename Acc<T>::type A;
    __shared__ A red[AMP_RED_SLOTS];
    A acc = A(0);
    AMP_GRID_LOOP(i, n) {
        i64 idx[AMP_MAX_RANK];
        amp_index(s, i, idx);
        A dv = load(a[amp_at(s, va, idx)]) - load(b[amp_at(s, vb, idx)]);
        acc += dv * dv;
    }
    acc = amp_block_sum(acc, red);
    if (threadIdx.x == 0) parts[blockIdx.x] = (double)acc;
}

// dx = (a - b) * (2 g / n) over the two views, dx contiguous; g (the upstream gradient, the loss
// scale under a scaler) is read here, not by the host, and the factor is formed in f64 as the
// CPU does.
template <typename T>
__device__ void amp_mse_bwd(T* dx, const T* a, const T* b, const T* g, AmpShape s, AmpView va, AmpView vb, i64 n) {
    typedef typename Acc<T>::type A;
    const A k = (A)(2.0 * (double)load(g[0]) / (double)n);
    AMP_GRID_LOOP(i, n) {
        i64 idx[AMP_MAX_RANK];
        amp_index(s, i, idx);
        dx[i] = store<T>((load(a[amp_at(s, va, idx)]) - load(b[amp_at(s, vb, idx)])) * k);
    }
}

// out[0] = (Σ parts) / divisor, summed in f64 by one block and rounded once into T.
template <typename T> __device__ void amp_mean_f64(T* out, const double* parts, i64 n, double divisor) {
    __shared__ double red[AMP_RED_SLOTS];
    double acc = 0.0;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) acc += parts[i];
    acc = amp_block_sum(acc, red);
    if (threadIdx.x == 0) out[0] = narrow<T>(acc / divisor);
}

#define AMP_ACC(SUF) Acc<amp_t_##SUF>::type

#define AMP_SOFTMAX_KERNELS(SUF)                                                                           \
    extern "C" __global__ void softmax_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, i64 rows, i64 d,  \
                                                 int cached) {                                             \
        amp_softmax_fwd<amp_t_##SUF, false>(out, x, rows, d, cached);                                      \
    }                                                                                                      \
    extern "C" __global__ void log_softmax_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, i64 rows, i64 d, \
                                                     int cached) {                                         \
        amp_softmax_fwd<amp_t_##SUF, true>(out, x, rows, d, cached);                                       \
    }                                                                                                      \
    extern "C" __global__ void softmax_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* y, const amp_t_##SUF* g, \
                                                 i64 rows, i64 d) {                                        \
        amp_softmax_bwd<amp_t_##SUF, false>(out, y, g, rows, d);                                           \
    }                                                                                                      \
    extern "C" __global__ void log_softmax_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* y,               \
                                                     const amp_t_##SUF* g, i64 rows, i64 d) {              \
        amp_softmax_bwd<amp_t_##SUF, true>(out, y, g, rows, d);                                            \
    }                                                                                                      \
    extern "C" __global__ void softmax_warp_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, i64 rows, i64 d, \
                                                      int nv) {                                            \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_softmax_warp_fwd<amp_t_##SUF, false, NVc>(out, x, rows, d)))                \
    }                                                                                                      \
    extern "C" __global__ void log_softmax_warp_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, i64 rows,  \
                                                          i64 d, int nv) {                                 \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_softmax_warp_fwd<amp_t_##SUF, true, NVc>(out, x, rows, d)))                 \
    }                                                                                                      \
    extern "C" __global__ void softmax_warp_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* y,              \
                                                      const amp_t_##SUF* g, i64 rows, i64 d, int nv) {     \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_softmax_warp_bwd<amp_t_##SUF, false, NVc>(out, y, g, rows, d)))             \
    }                                                                                                      \
    extern "C" __global__ void log_softmax_warp_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* y,          \
                                                          const amp_t_##SUF* g, i64 rows, i64 d, int nv) { \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_softmax_warp_bwd<amp_t_##SUF, true, NVc>(out, y, g, rows, d)))              \
    }

#define AMP_NORM_KERNELS(SUF)                                                                              \
    extern "C" __global__ void layer_norm_fwd_##SUF(amp_t_##SUF* out, AMP_ACC(SUF) * mean, AMP_ACC(SUF) * rstd, \
                                                    const amp_t_##SUF* x, const amp_t_##SUF* w,            \
                                                    const amp_t_##SUF* b, i64 rows, i64 d, double eps,     \
                                                    int cached) {                                          \
        amp_norm_fwd<amp_t_##SUF, false>(out, mean, rstd, x, w, b, rows, d, eps, cached);                  \
    }                                                                                                      \
    extern "C" __global__ void rms_norm_fwd_##SUF(amp_t_##SUF* out, AMP_ACC(SUF) * mean, AMP_ACC(SUF) * rstd, \
                                                  const amp_t_##SUF* x, const amp_t_##SUF* w,              \
                                                  const amp_t_##SUF* b, i64 rows, i64 d, double eps,       \
                                                  int cached) {                                            \
        amp_norm_fwd<amp_t_##SUF, true>(out, mean, rstd, x, w, b, rows, d, eps, cached);                   \
    }                                                                                                      \
    extern "C" __global__ void layer_norm_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* x, const amp_t_##SUF* g, \
                                                    const amp_t_##SUF* w, const AMP_ACC(SUF) * mean,       \
                                                    const AMP_ACC(SUF) * rstd, i64 rows, i64 d, int cached) { \
        amp_norm_bwd<amp_t_##SUF, false>(dx, x, g, w, mean, rstd, rows, d, cached);                        \
    }                                                                                                      \
    extern "C" __global__ void rms_norm_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* x, const amp_t_##SUF* g, \
                                                  const amp_t_##SUF* w, const AMP_ACC(SUF) * mean,         \
                                                  const AMP_ACC(SUF) * rstd, i64 rows, i64 d, int cached) { \
        amp_norm_bwd<amp_t_##SUF, true>(dx, x, g, w, mean, rstd, rows, d, cached);                         \
    }                                                                                                      \
    extern "C" __global__ void layer_norm_warp_fwd_##SUF(amp_t_##SUF* out, AMP_ACC(SUF) * mean,            \
                                                         AMP_ACC(SUF) * rstd, const amp_t_##SUF* x,        \
                                                         const amp_t_##SUF* w, const amp_t_##SUF* b, i64 rows, \
                                                         i64 d, double eps, int nv) {                      \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_norm_warp_fwd<amp_t_##SUF, false, NVc>(out, mean, rstd, x, w, b, rows, d, eps))) \
    }                                                                                                      \
    extern "C" __global__ void rms_norm_warp_fwd_##SUF(amp_t_##SUF* out, AMP_ACC(SUF) * mean,              \
                                                       AMP_ACC(SUF) * rstd, const amp_t_##SUF* x,          \
                                                       const amp_t_##SUF* w, const amp_t_##SUF* b, i64 rows, \
                                                       i64 d, double eps, int nv) {                        \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_norm_warp_fwd<amp_t_##SUF, true, NVc>(out, mean, rstd, x, w, b, rows, d, eps))) \
    }                                                                                                      \
    extern "C" __global__ void layer_norm_warp_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* x,            \
                                                         const amp_t_##SUF* g, const amp_t_##SUF* w,       \
                                                         const AMP_ACC(SUF) * mean, const AMP_ACC(SUF) * rstd, \
                                                         i64 rows, i64 d, int nv) {                        \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_norm_warp_bwd<amp_t_##SUF, false, NVc>(dx, x, g, w, mean, rstd, rows, d)))  \
    }                                                                                                      \
    extern "C" __global__ void rms_norm_warp_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* x,              \
                                                       const amp_t_##SUF* g, const amp_t_##SUF* w,         \
                                                       const AMP_ACC(SUF) * mean, const AMP_ACC(SUF) * rstd, \
                                                       i64 rows, i64 d, int nv) {                          \
        AMP_NV_SWITCH(amp_t_##SUF, nv, (amp_norm_warp_bwd<amp_t_##SUF, true, NVc>(dx, x, g, w, mean, rstd, rows, d)))   \
    }                                                                                                      \
    extern "C" __global__ void norm_params_partial_bwd_##SUF(                                              \
        AMP_ACC(SUF) * pw, AMP_ACC(SUF) * pb, const amp_t_##SUF* x, const amp_t_##SUF* g,                  \
        const AMP_ACC(SUF) * mean, const AMP_ACC(SUF) * rstd, i64 rows, i64 d, i64 per, i64 parts) {       \
        amp_norm_params_partial<amp_t_##SUF>(pw, pb, x, g, mean, rstd, rows, d, per, parts);               \
    }                                                                                                      \
    extern "C" __global__ void norm_params_bwd_##SUF(amp_t_##SUF* gw, amp_t_##SUF* gb, const AMP_ACC(SUF) * pw, \
                                                     const AMP_ACC(SUF) * pb, i64 parts, i64 d) {          \
        amp_norm_params<amp_t_##SUF>(gw, gb, pw, pb, parts, d);                                            \
    }

#define AMP_LOSS_KERNELS(SUF)                                                                              \
    extern "C" __global__ void cross_entropy_fwd_##SUF(AMP_ACC(SUF) * lse, double* loss, const amp_t_##SUF* x, \
                                                       const i64* targets, i64 rows, i64 c, int has_ignore, \
                                                       i64 ignore, double smoothing, int vec) {            \
        amp_ce_fwd<amp_t_##SUF>(lse, loss, x, targets, rows, c, has_ignore, ignore, smoothing, vec);       \
    }                                                                                                      \
    extern "C" __global__ void cross_entropy_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* x, const i64* targets, \
                                                       const AMP_ACC(SUF) * lse, i64 rows, i64 c,          \
                                                       int has_ignore, i64 ignore, double smoothing,       \
                                                       const amp_t_##SUF* g, double counted, int vec) {    \
        amp_ce_bwd<amp_t_##SUF>(dx, x, targets, lse, rows, c, has_ignore, ignore, smoothing, g, counted, vec); \
    }                                                                                                      \
    extern "C" __global__ void mse_fwd_##SUF(double* parts, const amp_t_##SUF* a, const amp_t_##SUF* b,    \
                                             AmpShape s, AmpView va, AmpView vb, i64 n) {                  \
        amp_mse<amp_t_##SUF>(parts, a, b, s, va, vb, n);                                                   \
    }                                                                                                      \
    extern "C" __global__ void mse_bwd_##SUF(amp_t_##SUF* dx, const amp_t_##SUF* a, const amp_t_##SUF* b,  \
                                             const amp_t_##SUF* g, AmpShape s, AmpView va, AmpView vb,     \
                                             i64 n) {                                                      \
        amp_mse_bwd<amp_t_##SUF>(dx, a, b, g, s, va, vb, n);                                               \
    }                                                                                                      \
    extern "C" __global__ void mean_f64_fwd_##SUF(amp_t_##SUF* out, const double* parts, i64 n,            \
                                                  double divisor) {                                        \
        amp_mean_f64<amp_t_##SUF>(out, parts, n, divisor);                                                 \
    }
