// The row kernels (src/kernels/rows.cu, included as it is) run on the host under cuda_emu.hpp,
// launched as amp-cuda's backend launches them (same kernel variant, threads, grid and dynamic
// shared memory: launch.hpp mirrors src/launch.rs, and each case names the backend function it
// follows), and are checked against f64 references computed from the same rounded inputs:
// softmax and log-softmax forward and backward, layer norm and RMS norm forward (output, mean,
// rstd) and backward (dx, and the weight and bias gradients of norm_params_partial_bwd /
// norm_params_bwd), cross-entropy forward (log-sum-exp, per-row loss, the f64 mean) and backward,
// the squared-error loss (mse_fwd + mean_f64_fwd) and its backward.
//
// Usage: rows [ROW_SMEM]. Prints one line per check and exits non-zero if any is over its
// tolerance. Errors are relative to the size of each row's reference (or of the terms that
// cancel in it, for backward passes), so rounding passes and an element read from the wrong
// place does not.

#include "launch.hpp"

#define extern  // rows.cu's `extern __shared__ ... amp_dyn[]`: see cuda_emu.hpp's design notes
#include "rows.cu"
#undef extern

AMP_SOFTMAX_KERNELS(f32)
AMP_SOFTMAX_KERNELS(f64)
AMP_SOFTMAX_KERNELS(f16)
AMP_SOFTMAX_KERNELS(bf16)
AMP_NORM_KERNELS(f32)
AMP_NORM_KERNELS(f64)
AMP_NORM_KERNELS(f16)
AMP_NORM_KERNELS(bf16)
AMP_LOSS_KERNELS(f32)
AMP_LOSS_KERNELS(f64)
AMP_LOSS_KERNELS(f16)
AMP_LOSS_KERNELS(bf16)

// The entry points of one dtype.
template <typename T> struct K;
#define AMP_EMU_ROW_ENTRIES(SUF)                                           \
    template <> struct K<amp_t_##SUF> {                                    \
        static constexpr auto softmax_fwd = softmax_fwd_##SUF;             \
        static constexpr auto log_softmax_fwd = log_softmax_fwd_##SUF;     \
        static constexpr auto softmax_bwd = softmax_bwd_##SUF;             \
        static constexpr auto log_softmax_bwd = log_softmax_bwd_##SUF;     \
        static constexpr auto softmax_warp_fwd = softmax_warp_fwd_##SUF;   \
        static constexpr auto log_softmax_warp_fwd = log_softmax_warp_fwd_##SUF; \
        static constexpr auto softmax_warp_bwd = softmax_warp_bwd_##SUF;   \
        static constexpr auto log_softmax_warp_bwd = log_softmax_warp_bwd_##SUF; \
        static constexpr auto layer_norm_fwd = layer_norm_fwd_##SUF;       \
        static constexpr auto rms_norm_fwd = rms_norm_fwd_##SUF;           \
        static constexpr auto layer_norm_bwd = layer_norm_bwd_##SUF;       \
        static constexpr auto rms_norm_bwd = rms_norm_bwd_##SUF;           \
        static constexpr auto layer_norm_warp_fwd = layer_norm_warp_fwd_##SUF; \
        static constexpr auto rms_norm_warp_fwd = rms_norm_warp_fwd_##SUF; \
        static constexpr auto layer_norm_warp_bwd = layer_norm_warp_bwd_##SUF; \
        static constexpr auto rms_norm_warp_bwd = rms_norm_warp_bwd_##SUF; \
        static constexpr auto norm_params_partial_bwd = norm_params_partial_bwd_##SUF; \
        static constexpr auto norm_params_bwd = norm_params_bwd_##SUF;     \
        static constexpr auto cross_entropy_fwd = cross_entropy_fwd_##SUF; \
        static constexpr auto cross_entropy_bwd = cross_entropy_bwd_##SUF; \
        static constexpr auto mean_f64_fwd = mean_f64_fwd_##SUF;           \
        static constexpr auto mse_fwd = mse_fwd_##SUF;                     \
        static constexpr auto mse_bwd = mse_bwd_##SUF;                     \
    };
AMP_EMU_ROW_ENTRIES(f32)
AMP_EMU_ROW_ENTRIES(f64)
AMP_EMU_ROW_ENTRIES(f16)
AMP_EMU_ROW_ENTRIES(bf16)

static Report report;

// Tolerances, relative: values rounded to T (half an ulp of 2^-11 in f16, 2^-8 in bf16, with
// room for the f32 sums before), and statistics kept in Acc<T>.
template <typename T> double tol() {
    if constexpr (std::is_same_v<T, double>) return 1e-13;
    else if constexpr (std::is_same_v<T, float>) return 2e-6;
    else if constexpr (std::is_same_v<T, f16_t>) return 1e-3;
    else return 8e-3;
}
template <typename T> double acc_tol() { return std::is_same_v<T, double> ? 1e-13 : 2e-6; }

static std::string describe(i64 d, int nv, int cached, bool aligned) {
    char s[96];
    if (nv) std::snprintf(s, sizeof s, "d %-5lld warp, %d vector(s) a lane", d, nv);
    else std::snprintf(s, sizeof s, "d %-5lld block%s%s", d, cached ? ", row in shared memory" : "",
                       aligned ? "" : ", misaligned");
    return s;
}

template <typename T> void fill_normal(Buf<T>& b, std::mt19937& rng, double spread, double mean = 0) {
    std::normal_distribution<double> normal(mean, spread);
    for (size_t i = 0; i < b.n; ++i) b[i] = from<T>(normal(rng));
}

// ---- softmax: Cuda::softmax and Cuda::softmax_backward ----------------------------------------------

template <typename T> void softmax_case(i64 d, bool aligned, bool log, unsigned seed) {
    typedef typename Acc<T>::type A;
    const int nv = warp_vectors(d, sizeof(T), aligned);
    const i64 rows = nv ? 5 : 2;  // warp: two blocks, the second with idle warps; block: two blocks
    const size_t n = rows * d, off = aligned ? 0 : 1;
    std::mt19937 rng(seed);
    Buf<T> x(n, off), y(n, off), g(n, off), dx(n, off);
    fill_normal(x, rng, 3.0);
    fill_normal(g, rng, 1.0);
    int cached = 0;
    if (nv) {
        launch(warp_rows_grid(rows), [&] {
            (log ? K<T>::log_softmax_warp_fwd : K<T>::softmax_warp_fwd)(y.p, x.p, rows, d, nv);
        });
    } else {
        auto [smem, c] = row_cache(d * sizeof(A));
        cached = c;
        launch(rows_grid(rows, d, smem), [&] { (log ? K<T>::log_softmax_fwd : K<T>::softmax_fwd)(y.p, x.p, rows, d, c); });
    }
    Err fe;
    for (i64 r = 0; r < rows; ++r) {
        double m = -INFINITY, s = 0, big = 0;
        for (i64 j = 0; j < d; ++j) m = std::max(m, val(x[r * d + j]));
        for (i64 j = 0; j < d; ++j) s += std::exp(val(x[r * d + j]) - m);
        std::vector<double> ref(d);
        for (i64 j = 0; j < d; ++j) {
            const double v = val(x[r * d + j]) - m;
            ref[j] = log ? v - std::log(s) : std::exp(v) / s;
            big = std::max(big, std::fabs(ref[j]));
        }
        for (i64 j = 0; j < d; ++j) fe.add(val(y[r * d + j]), ref[j], std::max(big, 1e-30));
    }
    const std::string name = log ? "log_softmax" : "softmax";
    report.check(name + "_fwd " + dtype_name<T>(), describe(d, nv, cached, aligned), fe.worst, tol<T>());

    // Backward from the kernel's own output, as autograd passes it.
    if (nv) {
        launch(warp_rows_grid(rows), [&] {
            (log ? K<T>::log_softmax_warp_bwd : K<T>::softmax_warp_bwd)(dx.p, y.p, g.p, rows, d, nv);
        });
    } else {
        launch(rows_grid(rows, d, 0), [&] { (log ? K<T>::log_softmax_bwd : K<T>::softmax_bwd)(dx.p, y.p, g.p, rows, d); });
    }
    Err be;
    for (i64 r = 0; r < rows; ++r) {
        double s = 0, scale = 1e-30;
        for (i64 j = 0; j < d; ++j) s += log ? val(g[r * d + j]) : val(g[r * d + j]) * val(y[r * d + j]);
        for (i64 j = 0; j < d; ++j) {
            const double yv = val(y[r * d + j]), gv = val(g[r * d + j]);
            scale = std::max(scale, log ? std::fabs(gv) + std::exp(yv) * std::fabs(s) : std::fabs(yv) * (std::fabs(gv) + std::fabs(s)));
        }
        for (i64 j = 0; j < d; ++j) {
            const double yv = val(y[r * d + j]), gv = val(g[r * d + j]);
            be.add(val(dx[r * d + j]), log ? gv - std::exp(yv) * s : yv * (gv - s), scale);
        }
    }
    report.check(name + "_bwd " + dtype_name<T>(), describe(d, nv, 0, aligned), be.worst, tol<T>());
}

// ---- layer norm and RMS norm: Cuda::norm_impl and Cuda::norm_backward --------------------------------

template <typename T> void norm_case(i64 d, bool aligned, bool rms, bool affine, unsigned seed) {
    typedef typename Acc<T>::type A;
    const double eps = 1e-5;
    const int nv = warp_vectors(d, sizeof(T), aligned);  // px, pw, pb, out: the same alignment here
    const i64 rows = nv ? 5 : 2;
    const size_t n = rows * d, off = aligned ? 0 : 1;
    std::mt19937 rng(seed);
    Buf<T> x(n, off), y(n, off), g(n, off), dx(n, off), w(d, off), b(d, off);
    Buf<A> mean(rows), rstd(rows);
    fill_normal(x, rng, 2.0, 0.5);
    fill_normal(g, rng, 1.0);
    fill_normal(w, rng, 1.0, 1.0);
    fill_normal(b, rng, 1.0);
    const T* pw = affine ? w.p : nullptr;
    const T* pb = affine && !rms ? b.p : nullptr;
    int cached = 0;
    if (nv) {
        launch(warp_rows_grid(rows), [&] {
            (rms ? K<T>::rms_norm_warp_fwd : K<T>::layer_norm_warp_fwd)(y.p, mean.p, rstd.p, x.p, pw, pb, rows, d, eps, nv);
        });
    } else {
        auto [smem, c] = row_cache(d * sizeof(A));
        cached = c;
        launch(rows_grid(rows, d, smem), [&] {
            (rms ? K<T>::rms_norm_fwd : K<T>::layer_norm_fwd)(y.p, mean.p, rstd.p, x.p, pw, pb, rows, d, eps, c);
        });
    }
    Err ye, me, re;
    for (i64 r = 0; r < rows; ++r) {
        double mu = 0, var = 0, big = 1e-30, scale = 1e-30;
        for (i64 j = 0; j < d; ++j) mu += val(x[r * d + j]);
        mu = rms ? 0 : mu / d;
        for (i64 j = 0; j < d; ++j) {
            const double c = val(x[r * d + j]) - mu;
            var += c * c;
            big = std::max(big, std::fabs(val(x[r * d + j])));
        }
        const double rs = 1 / std::sqrt(var / d + eps);
        me.add(val(mean[r]), mu, big);
        re.add(val(rstd[r]), rs, rs);
        for (i64 j = 0; j < d; ++j) {
            const double xh = (val(x[r * d + j]) - mu) * rs, wv = pw ? val(w[j]) : 1, bv = pb ? val(b[j]) : 0;
            scale = std::max(scale, std::fabs(xh * wv) + std::fabs(bv));
        }
        for (i64 j = 0; j < d; ++j) {
            const double xh = (val(x[r * d + j]) - mu) * rs, wv = pw ? val(w[j]) : 1, bv = pb ? val(b[j]) : 0;
            ye.add(val(y[r * d + j]), xh * wv + bv, scale);
        }
    }
    const std::string name = std::string(rms ? "rms_norm" : "layer_norm");
    const std::string what = describe(d, nv, cached, aligned) + (affine ? "" : ", no affine");
    report.check(name + "_fwd " + dtype_name<T>(), what, ye.worst, tol<T>());
    report.check(name + "_fwd stats " + dtype_name<T>(), what, std::max(me.worst, re.worst), acc_tol<T>());

    // Backward with the kernel's statistics, as the backend passes them.
    int bcached = 0;
    if (nv) {
        launch(warp_rows_grid(rows), [&] {
            (rms ? K<T>::rms_norm_warp_bwd : K<T>::layer_norm_warp_bwd)(dx.p, x.p, g.p, pw, mean.p, rstd.p, rows, d, nv);
        });
    } else {
        auto [smem, c] = row_cache(2 * d * sizeof(A));
        bcached = c;
        launch(rows_grid(rows, d, smem), [&] {
            (rms ? K<T>::rms_norm_bwd : K<T>::layer_norm_bwd)(dx.p, x.p, g.p, pw, mean.p, rstd.p, rows, d, c);
        });
    }
    Err de;
    for (i64 r = 0; r < rows; ++r) {
        const double mu = val(mean[r]), rs = val(rstd[r]);
        std::vector<double> xh(d), gh(d);
        double mgh = 0, mghx = 0, scale = 1e-30;
        for (i64 j = 0; j < d; ++j) {
            xh[j] = (val(x[r * d + j]) - mu) * rs;
            gh[j] = val(g[r * d + j]) * (pw ? val(w[j]) : 1);
            mgh += gh[j];
            mghx += gh[j] * xh[j];
        }
        mgh = rms ? 0 : mgh / d;
        mghx /= d;
        for (i64 j = 0; j < d; ++j)
            scale = std::max(scale, rs * (std::fabs(gh[j]) + std::fabs(mgh) + std::fabs(xh[j] * mghx)));
        for (i64 j = 0; j < d; ++j) de.add(val(dx[r * d + j]), rs * (gh[j] - mgh - xh[j] * mghx), scale);
    }
    report.check(name + "_bwd " + dtype_name<T>(), describe(d, nv, bcached, aligned) + (affine ? "" : ", no affine"),
                 de.worst, tol<T>());
}

// The weight and bias gradients: the second half of Cuda::norm_backward (PER = 256 rows a part,
// grid(parts * d), then grid(d)), over statistics computed here.
template <typename T> void norm_params_case(i64 rows, i64 d, bool need_w, bool need_b, unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 per = 256, parts = (rows + per - 1) / per;
    std::mt19937 rng(seed);
    Buf<T> x(rows * d), g(rows * d), gw(d), gb(d);
    Buf<A> mean(rows), rstd(rows), pw(parts * d), pb(parts * d);
    fill_normal(x, rng, 2.0, 0.5);
    fill_normal(g, rng, 1.0);
    std::normal_distribution<double> normal(0, 1);
    for (i64 r = 0; r < rows; ++r) {
        mean[r] = (A)normal(rng);
        rstd[r] = (A)std::exp(normal(rng));
    }
    A* ppw = need_w ? pw.p : nullptr;
    A* ppb = need_b ? pb.p : nullptr;
    launch(grid_cfg(parts * d), [&] { K<T>::norm_params_partial_bwd(ppw, ppb, x.p, g.p, mean.p, rstd.p, rows, d, per, parts); });
    launch(grid_cfg(d), [&] { K<T>::norm_params_bwd(need_w ? gw.p : nullptr, need_b ? gb.p : nullptr, ppw, ppb, parts, d); });
    Err we, be;
    for (i64 j = 0; j < d; ++j) {
        double sw = 0, sb = 0, aw = 1e-30, ab = 1e-30;
        for (i64 r = 0; r < rows; ++r) {
            const double gv = val(g[r * d + j]), t = gv * ((val(x[r * d + j]) - (double)mean[r]) * (double)rstd[r]);
            sw += t;
            sb += gv;
            aw += std::fabs(t);
            ab += std::fabs(gv);
        }
        if (need_w) we.add(val(gw[j]), sw, aw);
        if (need_b) be.add(val(gb[j]), sb, ab);
    }
    char what[96];
    std::snprintf(what, sizeof what, "d %-5lld rows %lld (%lld parts)%s%s", d, rows, parts, need_w ? ", weight" : "",
                  need_b ? ", bias" : "");
    report.check(std::string("norm_params_bwd ") + dtype_name<T>(), what, std::max(we.worst, be.worst), tol<T>());
}

// ---- cross-entropy: Cuda::cross_entropy and Cuda::cross_entropy_backward -----------------------------

template <typename T> void ce_case(i64 c, bool aligned, double smoothing, bool ignore, double upstream, unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 rows = 4, ignore_index = -100;
    const size_t off = aligned ? 0 : 1;
    std::mt19937 rng(seed);
    Buf<T> x(rows * c, off), dx(rows * c, off), loss(1), g(1);
    Buf<i64> targets(rows);
    Buf<A> lse(rows);
    Buf<double> losses(rows);
    fill_normal(x, rng, 3.0);
    for (i64 r = 0; r < rows; ++r) targets[r] = (i64)(rng() % (unsigned)c);
    if (ignore) targets[1] = ignore_index;
    i64 counted = 0;
    for (i64 r = 0; r < rows; ++r) counted += !(ignore && targets[r] == ignore_index);
    const int vec = vector_rows(c, sizeof(T), aligned);
    launch(rows_grid(rows, c, 0), [&] {
        K<T>::cross_entropy_fwd(lse.p, losses.p, x.p, targets.p, rows, c, ignore, ignore_index, smoothing, vec);
    });
    launch(rows_grid(1, std::max<i64>(rows, 32), 0), [&] { K<T>::mean_f64_fwd(loss.p, losses.p, rows, (double)counted); });
    Err le, re;
    double total = 0, total_scale = 1e-30;
    for (i64 r = 0; r < rows; ++r) {
        if (ignore && targets[r] == ignore_index) {
            le.add(val(lse[r]), 0, 1);
            re.add(losses[r], 0, 1);
            continue;
        }
        double m = -INFINITY, s = 0, sx = 0;
        for (i64 j = 0; j < c; ++j) m = std::max(m, val(x[r * c + j]));
        for (i64 j = 0; j < c; ++j) {
            s += std::exp(val(x[r * c + j]) - m);
            sx += val(x[r * c + j]);
        }
        const double l = m + std::log(s);
        const double hit = -(1 - smoothing) * (val(x[r * c + targets[r]]) - l), spread = -(smoothing / c) * (sx - c * l);
        le.add(val(lse[r]), l, std::max(std::fabs(l), 1.0));
        double terms = std::fabs(hit) + 1e-30;
        for (i64 j = 0; j < c; ++j) terms += (smoothing / c) * std::fabs(val(x[r * c + j]) - l);
        re.add(losses[r], hit + spread, terms);
        total += hit + spread;
        total_scale += terms;
    }
    Err me;
    me.add(val(loss[0]), total / counted, std::max(std::fabs(total / counted), total_scale / counted));
    char what[96];
    std::snprintf(what, sizeof what, "c %-5lld %s%s, smoothing %.1f%s", c, vec ? "vectors" : "scalars",
                  aligned ? "" : " (misaligned)", smoothing, ignore ? ", a row ignored" : "");
    report.check(std::string("cross_entropy_fwd ") + dtype_name<T>(), what, std::max(le.worst, re.worst), acc_tol<T>());
    report.check(std::string("cross_entropy_fwd mean ") + dtype_name<T>(), what, me.worst, tol<T>());

    // Backward with the kernel's log-sum-exp and an upstream gradient (the loss scale under a scaler).
    g[0] = from<T>(upstream);
    const int vec_b = vector_rows(c, sizeof(T), aligned);  // px and dx: the same alignment here
    launch(rows_grid(rows, c, 0), [&] {
        K<T>::cross_entropy_bwd(dx.p, x.p, targets.p, lse.p, rows, c, ignore, ignore_index, smoothing, g.p,
                                (double)counted, vec_b);
    });
    Err de;
    const double sc = val(g[0]) / counted;
    for (i64 r = 0; r < rows; ++r) {
        const bool ignored = ignore && targets[r] == ignore_index;
        for (i64 j = 0; j < c; ++j) {
            double ref = 0;
            if (!ignored) {
                ref = sc * std::exp(val(x[r * c + j]) - val(lse[r])) - sc * smoothing / c;
                if (j == targets[r]) ref -= sc * (1 - smoothing);
            }
            de.add(val(dx[r * c + j]), ref, std::fabs(sc));
        }
    }
    report.check(std::string("cross_entropy_bwd ") + dtype_name<T>(), what, de.worst, tol<T>());
}

// Cuda::mse (mse_fwd over grid(n): one f64 partial a block, then mean_f64_fwd in one block over
// rows_grid(1, max(blocks, 32))) and Cuda::mse_backward (mse_bwd over grid(n), the upstream
// gradient read on the device) for a [rows, cols] pair, b contiguous (the views merge into one
// dim, as launch::views merges them) or a broadcast row [cols] (stride 0 on dim 0).
template <typename T> void mse_case(i64 rows, i64 cols, bool broadcast, double upstream, unsigned seed) {
    const i64 n = rows * cols;
    std::mt19937 rng(seed);
    Buf<T> a(n), b(broadcast ? cols : n), loss(1), g(1), dx(n);
    fill_normal(a, rng, 1.0);
    fill_normal(b, rng, 1.0, 0.25);
    AmpShape sh{};
    AmpView va{}, vb{};
    if (broadcast) {
        sh.rank = 2;
        sh.dims[0] = rows;
        sh.dims[1] = cols;
        va.strides[0] = cols;
        va.strides[1] = 1;
        vb.strides[0] = 0;
        vb.strides[1] = 1;
    } else {
        sh.rank = 1;
        sh.dims[0] = n;
        va.strides[0] = vb.strides[0] = 1;
    }
    const Cfg cfg = grid_cfg(n);
    const i64 blocks = cfg.grid.x;
    Buf<double> parts(blocks);
    launch(cfg, [&] { K<T>::mse_fwd(parts.p, a.p, b.p, sh, va, vb, n); });
    launch(rows_grid(1, std::max<i64>(blocks, 32), 0), [&] { K<T>::mean_f64_fwd(loss.p, parts.p, blocks, (double)n); });
    auto bat = [&](i64 i) { return broadcast ? i % cols : i; };
    double sum = 0;
    for (i64 i = 0; i < n; ++i) sum += (val(a[i]) - val(b[bat(i)])) * (val(a[i]) - val(b[bat(i)]));
    Err fe;
    fe.add(val(loss[0]), sum / n, sum / n);
    char what[96];
    std::snprintf(what, sizeof what, "[%lld, %lld]%s, %lld block(s)", rows, cols, broadcast ? ", b a broadcast row" : "",
                  blocks);
    report.check(std::string("mse_fwd + mean_f64_fwd ") + dtype_name<T>(), what, fe.worst, tol<T>());

    g[0] = from<T>(upstream);
    launch(grid_cfg(n), [&] { K<T>::mse_bwd(dx.p, a.p, b.p, g.p, sh, va, vb, n); });
    Err be;
    const double k = 2.0 * val(g[0]) / n;
    for (i64 i = 0; i < n; ++i) {
        const double ref = (val(a[i]) - val(b[bat(i)])) * k;
        be.add(val(dx[i]), ref, std::max(std::fabs(ref), 1e-30));
    }
    report.check(std::string("mse_bwd ") + dtype_name<T>(), what, be.worst, tol<T>());
}

// ---- the cases ---------------------------------------------------------------------------------------

template <typename T> void family(const std::vector<i64>& lengths, unsigned seed) {
    for (i64 d : lengths) {
        // As laid out (aligned: the warp kernels where they qualify), and at an odd offset, which
        // sends a row the warp kernels would take to the block kernels.
        const bool warpable = warp_vectors(d, sizeof(T), true) != 0;
        for (bool aligned : {true, false}) {
            if (!aligned && (!warpable || d == 1000)) continue;
            for (bool log : {false, true}) softmax_case<T>(d, aligned, log, seed++);
            norm_case<T>(d, aligned, false, true, seed++);
            norm_case<T>(d, aligned, true, true, seed++);
            norm_case<T>(d, aligned, (d & 1) != 0, false, seed++);
            ce_case<T>(d, aligned, (d & 2) ? 0.1 : 0.0, (d & 1) != 0, aligned ? 1.0 : 1024.0, seed++);
        }
    }
}

// The row cache's edge: the longest row that fits in ROW_SMEM bytes of Acc<T>, and one more.
template <typename T> void cache_edge(unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 fwd = (i64)(amp_row_smem / sizeof(A)), bwd = (i64)(amp_row_smem / (2 * sizeof(A)));
    for (i64 d : {fwd, fwd + 1}) {
        softmax_case<T>(d, false, false, seed++);
        norm_case<T>(d, false, false, true, seed++);
    }
    for (i64 d : {bwd, bwd + 1}) norm_case<T>(d, false, true, true, seed++);
}

int main(int argc, char** argv) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines before an abort (a failed guard, a trap) reach the test
    if (argc > 1) amp_row_smem = (size_t)std::atoll(argv[1]);
    std::printf("ROW_SMEM %zu bytes\n", amp_row_smem);
    answer_launch_queries();
    const std::vector<i64> lengths = {1, 7, 32, 33, 1000, 1024, 1025};
    family<float>(lengths, 100);
    family<f16_t>(lengths, 200);
    family<bf16_t>(lengths, 300);
    family<double>({7, 512, 513}, 400);
    cache_edge<float>(500);
    cache_edge<bf16_t>(510);
    cache_edge<double>(520);
    for (i64 d : {1, 7, 33, 1000}) {
        norm_params_case<float>(300, d, true, true, 600 + (unsigned)d);
        norm_params_case<f16_t>(300, d, true, d != 7, 700 + (unsigned)d);
        norm_params_case<bf16_t>(300, d, d != 33, true, 800 + (unsigned)d);
    }
    norm_params_case<double>(257, 33, true, true, 900);
    for (bool broadcast : {false, true}) {
        mse_case<float>(70, 301, broadcast, 1.0, 950);
        mse_case<f16_t>(70, 301, broadcast, 1024.0, 951);
        mse_case<bf16_t>(3, 7, broadcast, 1.0, 952);
        mse_case<double>(70, 301, broadcast, 3.0, 953);
    }
    return report.finish();
}
