// The batch norm kernels (src/kernels/batch_norm.cu, included as it is) run on the host under
// cuda_emu.hpp, launched as amp-cuda's backend launches them (Cuda::batch_norm and
// Cuda::batch_norm_backward: the same kernels, grids, threads and arguments, in the same order),
// and are checked against f64 references computed from the same rounded inputs:
// - training: batch_norm_stats_fwd (mean, rstd, unbiased variance: two passes, so a large offset
//   does not cancel), batch_norm_running_fwd (PyTorch's update in f64 rounded once into f32:
//   bit for bit against that formula on the kernel's statistics, and against the f64 reference);
// - eval: batch_norm_given_fwd from strided views of the running buffers (offset and stride
//   as the backend passes them), untouched slots between them NaN;
// - batch_norm_fwd with and without weight and bias, which are in Acc<T> (f32 parameters of an
//   f16/bf16 input, never rounded to T);
// - batch_norm_sums_bwd (Σg and Σg·x̂: the bias and weight gradients, in Acc<T>) and
//   batch_norm_bwd, training (through the batch statistics) and eval (a fixed affine map), with
//   the sums left NaN (unwritten, as the backend's RawVec) where the backend does not compute them.
//
// Outputs rounded into T are checked in units of half an ulp of T at the reference plus Acc<T>'s
// noise at the channel's scale (launch.hpp's add_rounded, tolerance 1); statistics and sums kept
// in Acc<T> relative to their reference's scale. An element of the wrong channel, a misread
// stride or a parameter rounded into T fails.
//
// Usage: batch_norm. Prints one line per check and exits non-zero if any is over its tolerance.

#include "launch.hpp"

#include "batch_norm.cu"

AMP_BATCH_NORM_KERNELS(f32)
AMP_BATCH_NORM_KERNELS(f64)
AMP_BATCH_NORM_KERNELS(f16)
AMP_BATCH_NORM_KERNELS(bf16)

template <typename T> struct K;
#define AMP_EMU_BN_ENTRIES(SUF)                                          \
    template <> struct K<amp_t_##SUF> {                                  \
        static constexpr auto stats = batch_norm_stats_fwd_##SUF;        \
        static constexpr auto running = batch_norm_running_fwd_##SUF;    \
        static constexpr auto given = batch_norm_given_fwd_##SUF;        \
        static constexpr auto fwd = batch_norm_fwd_##SUF;                \
        static constexpr auto sums = batch_norm_sums_bwd_##SUF;          \
        static constexpr auto bwd = batch_norm_bwd_##SUF;                \
    };
AMP_EMU_BN_ENTRIES(f32)
AMP_EMU_BN_ENTRIES(f64)
AMP_EMU_BN_ENTRIES(f16)
AMP_EMU_BN_ENTRIES(bf16)

static Report report;

// Statistics and sums kept in Acc<T>, relative to their reference's scale.
template <typename T> double acc_tol() { return std::is_same_v<T, double> ? 1e-13 : 4e-6; }

struct Case {
    i64 n, ch, inner;
    bool training;
    bool running;  // training: update running buffers; eval: always given
    bool weight, bias;
    bool need_w, need_b;  // the parameters' gradients asked for
    double offset;        // the inputs' mean (a large one tests the two-pass variance)
    i64 stride;           // eval: the running buffers' stride (their offset is stride - 1)
};

template <typename T> void bn_case(const Case& k, unsigned seed) {
    typedef typename Acc<T>::type A;
    const double eps = 1e-5, momentum = 0.1;
    const i64 n = k.n, ch = k.ch, inner = k.inner, total = n * ch * inner, m = n * inner;
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0, 1);
    Buf<T> x(total), y(total), g(total), dx(total);
    for (i64 i = 0; i < total; ++i) x[i] = from<T>(k.offset + 2.0 * normal(rng));
    for (i64 i = 0; i < total; ++i) g[i] = from<T>(normal(rng));
    // The parameters in Acc<T>, at full precision (not representable in T).
    Buf<A> w(ch), b(ch), mean(ch), rstd(ch), unbiased(ch), sg(ch), sgx(ch);
    for (i64 c = 0; c < ch; ++c) w[c] = (A)(1.0 + 0.5 * normal(rng));
    for (i64 c = 0; c < ch; ++c) b[c] = (A)(0.5 * normal(rng));
    // Running buffers (f32): contiguous in training; in eval at offset stride - 1, stride apart.
    const i64 rs_ = k.training ? 1 : k.stride, roff = rs_ - 1;
    Buf<float> rm(roff + ch * rs_), rv(roff + ch * rs_);
    std::vector<float> rm0(ch), rv0(ch);
    for (i64 c = 0; c < ch; ++c) {
        rm0[c] = (float)(k.offset + normal(rng));
        rv0[c] = (float)std::exp(normal(rng));
        rm[roff + c * rs_] = rm0[c];
        rv[roff + c * rs_] = rv0[c];
    }
    const A* pw = k.weight ? w.p : nullptr;
    const A* pb = k.bias ? b.p : nullptr;

    // ---- the f64 reference statistics
    std::vector<double> rmean(ch), rvar(ch), rub(ch), rrstd(ch), absx(ch, 0);
    auto at = [&](i64 s, i64 c, i64 t) { return (s * ch + c) * inner + t; };
    for (i64 c = 0; c < ch; ++c) {
        double s = 0, ss = 0;
        for (i64 i = 0; i < n; ++i)
            for (i64 t = 0; t < inner; ++t) {
                s += val(x[at(i, c, t)]);
                absx[c] = std::max(absx[c], std::fabs(val(x[at(i, c, t)])));
            }
        rmean[c] = s / m;
        for (i64 i = 0; i < n; ++i)
            for (i64 t = 0; t < inner; ++t) ss += (val(x[at(i, c, t)]) - rmean[c]) * (val(x[at(i, c, t)]) - rmean[c]);
        rvar[c] = ss / m;
        rub[c] = m > 1 ? ss / (m - 1) : INFINITY;
        rrstd[c] = 1 / std::sqrt(rvar[c] + eps);
    }

    char shape[160];
    std::snprintf(shape, sizeof shape, "[%lld, %lld, %lld] %s%s%s%s", n, ch, inner, k.training ? "train" : "eval",
                  k.training && k.running ? "+running" : (!k.training && k.stride > 1 ? " strided" : ""),
                  k.weight ? " w" : "", k.bias ? " b" : "");
    const std::string what = shape, dt = dtype_name<T>();

    // ---- forward: Cuda::batch_norm
    std::vector<double> smean(ch), srstd(ch);  // the statistics the reference normalises with
    if (k.training) {
        launch(rows_grid(ch, m, 0), [&] { K<T>::stats(mean.p, rstd.p, unbiased.p, x.p, n, ch, inner, eps); });
        Err me, re, ue;
        for (i64 c = 0; c < ch; ++c) {
            me.add((double)mean[c], rmean[c], std::max(absx[c], 1e-30));
            re.add((double)rstd[c], rrstd[c], rrstd[c]);
            ue.add((double)unbiased[c], rub[c], rub[c]);
        }
        report.check("batch_norm_stats_fwd " + dt, what, std::max({me.worst, re.worst, ue.worst}), acc_tol<T>());
        if (k.running) {
            launch(grid_cfg(ch), [&] { K<T>::running(rm.p, rv.p, mean.p, unbiased.p, ch, momentum); });
            // Bit for bit: the CPU's update_running on the kernel's statistics.
            bool exact = true;
            Err ne;
            for (i64 c = 0; c < ch; ++c) {
                const float em = (float)((1.0 - momentum) * (double)rm0[c] + momentum * (double)mean[c]);
                const float ev = (float)((1.0 - momentum) * (double)rv0[c] + momentum * (double)unbiased[c]);
                exact = exact && amp_emu_bits<unsigned>(em) == amp_emu_bits<unsigned>(rm[c]) &&
                        amp_emu_bits<unsigned>(ev) == amp_emu_bits<unsigned>(rv[c]);
                const double fm = (1.0 - momentum) * rm0[c] + momentum * rmean[c];
                const double fv = (1.0 - momentum) * rv0[c] + momentum * rub[c];
                ne.add(rm[c], fm, std::max(std::fabs((double)rm0[c]), absx[c]));
                ne.add(rv[c], fv, fv);
            }
            report.check("batch_norm_running_fwd " + dt, what + " (as the CPU, bit for bit)", exact ? 0 : INFINITY, 0);
            // The running buffers are f32 whatever T is.
            report.check("batch_norm_running_fwd " + dt, what + " (f64 reference)", ne.worst, acc_tol<float>());
        }
        smean = rmean;
        srstd = rrstd;
    } else {
        launch(grid_cfg(ch), [&] { K<T>::given(mean.p, rstd.p, rm.p, roff, rs_, rv.p, roff, rs_, ch, eps); });
        Err ge;
        for (i64 c = 0; c < ch; ++c) {
            smean[c] = rm0[c];
            srstd[c] = 1 / std::sqrt((double)rv0[c] + eps);
            ge.add((double)mean[c], smean[c], std::max(std::fabs(smean[c]), 1e-30));
            ge.add((double)rstd[c], srstd[c], srstd[c]);
        }
        report.check("batch_norm_given_fwd " + dt, what, ge.worst, acc_tol<T>());
    }
    launch(grid_cfg(total), [&] { K<T>::fwd(y.p, x.p, mean.p, rstd.p, pw, pb, total, ch, inner); });
    Err ye;
    for (i64 c = 0; c < ch; ++c) {
        const double wv = pw ? (double)w[c] : 1, bv = pb ? (double)b[c] : 0;
        // The terms' size: the centred input (before the cancellation of x - mean), scaled.
        const double scale = (absx[c] + std::fabs(smean[c])) * srstd[c] * std::fabs(wv) + std::fabs(bv);
        for (i64 i = 0; i < n; ++i)
            for (i64 t = 0; t < inner; ++t) {
                const i64 e = at(i, c, t);
                add_rounded<T>(ye, val(y[e]), (val(x[e]) - smean[c]) * srstd[c] * wv + bv, scale);
            }
    }
    report.check("batch_norm_fwd " + dt, what, ye.worst, 1);

    // ---- backward: Cuda::batch_norm_backward, with the forward's statistics (the kernel's)
    const bool sums = k.training || k.need_w || k.need_b;
    if (sums) launch(rows_grid(ch, m, 0), [&] { K<T>::sums(sg.p, sgx.p, x.p, g.p, mean.p, rstd.p, n, ch, inner); });
    launch(grid_cfg(total), [&] {
        K<T>::bwd(dx.p, x.p, g.p, mean.p, rstd.p, pw, sg.p, sgx.p, total, ch, inner, k.training ? 1 : 0, 1.0 / (double)m);
    });
    Err se, de;
    for (i64 c = 0; c < ch; ++c) {
        double rsg = 0, rsgx = 0, asg = 1e-30, asgx = 1e-30;
        for (i64 i = 0; i < n; ++i)
            for (i64 t = 0; t < inner; ++t) {
                const i64 e = at(i, c, t);
                const double gv = val(g[e]), xh = (val(x[e]) - smean[c]) * srstd[c];
                rsg += gv;
                rsgx += gv * xh;
                asg += std::fabs(gv);
                // Σg·x̂'s terms before x - mean cancels
                asgx += std::fabs(gv) * (std::fabs(val(x[e])) + std::fabs(smean[c])) * srstd[c];
            }
        if (sums) {
            // The gradients the backend returns: gw = Σg·x̂ (sgx), gb = Σg (sg), in Acc<T>.
            se.add((double)sg[c], rsg, asg);
            se.add((double)sgx[c], rsgx, asgx);
        }
        const double wv = pw ? (double)w[c] : 1, mg = rsg / m, mgx = rsgx / m;
        double scale = 0;
        for (i64 i = 0; i < n; ++i)
            for (i64 t = 0; t < inner; ++t) {
                const i64 e = at(i, c, t);
                const double xh = (absx[c] + std::fabs(smean[c])) * srstd[c];
                scale = std::max(scale, std::fabs(wv) * srstd[c] *
                                            (std::fabs(val(g[e])) + (k.training ? std::fabs(mg) + xh * std::fabs(mgx) : 0)));
            }
        for (i64 i = 0; i < n; ++i)
            for (i64 t = 0; t < inner; ++t) {
                const i64 e = at(i, c, t);
                const double gv = val(g[e]), xh = (val(x[e]) - smean[c]) * srstd[c];
                const double ref = k.training ? wv * srstd[c] * (gv - mg - xh * mgx) : wv * srstd[c] * gv;
                add_rounded<T>(de, val(dx[e]), ref, scale);
            }
    }
    if (sums) report.check("batch_norm_sums_bwd " + dt, what, se.worst, acc_tol<T>());
    report.check("batch_norm_bwd " + dt, what + (sums && !k.training ? ", sums" : ""), de.worst, 1);
}

template <typename T> void family(unsigned seed) {
    const bool wide = !std::is_same_v<T, double>;
    std::vector<Case> cases = {
        // n, ch, inner, training, running, weight, bias, need_w, need_b, offset, stride
        {3, 4, 10, true, true, true, true, true, true, 0.5, 1},     // [3, 4, 5, 2]
        {3, 4, 10, true, false, true, false, true, false, 0.5, 1},  // weight only, no running buffers
        {3, 4, 10, true, true, false, true, false, true, 0.5, 1},   // bias only
        {3, 4, 10, true, false, false, false, false, false, 0.5, 1},
        {3, 4, 10, false, true, true, true, true, true, 0.5, 3},    // eval, strided running buffers
        {3, 4, 10, false, true, false, false, false, false, 0.5, 2},
        {2, 3, 1, true, true, true, true, true, true, 0.5, 1},      // [2, 3, 1, 1]: two values a channel
        {1, 3, 2, true, true, true, true, true, true, 0.5, 1},      // [1, 3, 2, 1]: one sample
        {1, 5, 1, false, true, true, true, true, true, 0.5, 2},     // eval, one value a channel
        {5, 7, 1, true, true, true, true, true, true, 0.5, 1},      // [5, 7]
        {4, 3, 300, true, true, true, true, true, true, 0.5, 1},    // [4, 3, 20, 15]: 1200 a channel
        {4, 3, 300, false, true, true, false, true, false, 0.5, 1},
        {3, 2, 700, true, true, true, true, true, true, wide ? 30.0 : 1000.0, 1},  // a large offset
        // 257 channels: more than a 256-thread block of the grid kernels (running, given, the
        // elementwise passes) and 257 blocks of the statistics and sums; once per precision
        // without the per-channel block kernels (each block of the emulation costs ~10 ms).
        {2, 257, 3, false, true, true, true, false, false, 0.5, 4},
    };
    // The per-channel blocks over 257 channels, in one precision (the kernels' indexing does not
    // depend on it).
    if (std::is_same_v<T, float>) cases.push_back({2, 257, 3, true, true, true, true, true, true, 0.5, 1});
    for (const Case& k : cases) bn_case<T>(k, seed++);
}

int main() {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines before an abort (a trap) reach the test
    family<float>(100);
    family<f16_t>(200);
    family<bf16_t>(300);
    family<double>(400);
    return report.finish();
}
