// The pooling kernels (src/kernels/pool.cu) and the convolution's data-movement kernels
// (src/kernels/conv.cu), included as they are, run on the host under cuda_emu.hpp, launched as
// amp-cuda's backend launches them (each case names the backend function it follows), and are
// checked against references written from amp-core's definitions:
// - max_pool2d_fwd / _bwd, avg_pool2d_fwd / _bwd over fixed windows (kernel, stride, padding up
//   to half the kernel, floor mode: Pool2dSpec's sizes) and adaptive ones (avg), windows as
//   Pool2dSpec::window places them; max pooling with ties and NaNs (the first NaN, else the first
//   of equal maxima, as the CPU's argmax) bit for bit, gradients summed over overlapping windows.
// - im2col_fwd bit for bit, col2im_bwd against an f64 scatter of the columns, for a chunk of
//   samples after the first (n0 > 0, as the backend's loop over chunks) with groups, stride,
//   padding and dilation; bias_fill_fwd (conv2d's and linear's) bit for bit; channel_sum_bwd
//   (the bias gradient) against an f64 sum.
//
// Sums rounded into T are checked in units of half an ulp of T plus Acc<T>'s noise at the size
// of their terms (launch.hpp's add_rounded, tolerance 1).
//
// Usage: pool_conv. Prints one line per check and exits non-zero if any is over its tolerance.

#include "launch.hpp"

#include "conv.cu"
#include "pool.cu"

AMP_POOL_KERNELS(f32)
AMP_POOL_KERNELS(f64)
AMP_POOL_KERNELS(f16)
AMP_POOL_KERNELS(bf16)
AMP_CONV_KERNELS(f32)
AMP_CONV_KERNELS(f64)
AMP_CONV_KERNELS(f16)
AMP_CONV_KERNELS(bf16)

template <typename T> struct K;
#define AMP_EMU_PC_ENTRIES(SUF)                                            \
    template <> struct K<amp_t_##SUF> {                                    \
        static constexpr auto max_fwd = max_pool2d_fwd_##SUF;              \
        static constexpr auto max_bwd = max_pool2d_bwd_##SUF;              \
        static constexpr auto avg_fwd = avg_pool2d_fwd_##SUF;              \
        static constexpr auto avg_bwd = avg_pool2d_bwd_##SUF;              \
        static constexpr auto im2col = im2col_fwd_##SUF;                   \
        static constexpr auto col2im = col2im_bwd_##SUF;                   \
        static constexpr auto bias_fill = bias_fill_fwd_##SUF;             \
        static constexpr auto channel_sum = channel_sum_bwd_##SUF;         \
    };
AMP_EMU_PC_ENTRIES(f32)
AMP_EMU_PC_ENTRIES(f64)
AMP_EMU_PC_ENTRIES(f16)
AMP_EMU_PC_ENTRIES(bf16)

static Report report;


// ---- pooling: Cuda::pool_fwd (max_pool2d, avg_pool2d), max_pool2d_backward, avg_pool2d_backward --

struct Pool {
    i64 planes, h, w;
    bool adaptive;
    i64 kh, kw, sh, sw, ph, pw;  // fixed windows
    i64 oh, ow;                  // adaptive: the output size asked for; fixed: computed
};

// Pool2dSpec::window along one axis: [start, end) clipped, and the divisor's factor.
static void window(const Pool& p, int axis, i64 o, i64& start, i64& end, i64& size) {
    const i64 n = axis ? p.w : p.h, m = axis ? p.ow : p.oh;
    if (p.adaptive) {
        start = o * n / m;
        end = ((o + 1) * n + m - 1) / m;
        size = end - start;
    } else {
        const i64 k = axis ? p.kw : p.kh, s = axis ? p.sw : p.sh, pad = axis ? p.pw : p.ph;
        const i64 a = o * s - pad;
        start = std::clamp<i64>(a, 0, n);
        end = std::clamp<i64>(a + k, 0, n);
        size = k;
    }
}

template <typename T> void pool_case(Pool p, bool max, unsigned seed) {
    if (!p.adaptive) {  // floor mode, as Tensor::pool_spec
        p.oh = (p.h + 2 * p.ph - p.kh) / p.sh + 1;
        p.ow = (p.w + 2 * p.pw - p.kw) / p.sw + 1;
    }
    const AmpPoolGeom geo{p.planes, p.h, p.w, p.oh, p.ow, p.adaptive ? 0 : p.kh, p.adaptive ? 0 : p.kw,
                          p.adaptive ? 1 : p.sh, p.adaptive ? 1 : p.sw, p.adaptive ? 0 : p.ph,
                          p.adaptive ? 0 : p.pw, p.adaptive ? 1 : 0, 0};
    const i64 nin = p.planes * p.h * p.w, nout = p.planes * p.oh * p.ow;
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0, 1);
    Buf<T> x(nin), y(nout), g(nout), dx(nin);
    // Max pooling: small integers, so windows hold ties; a NaN in the second plane (and a second
    // one after it in the same window, where it fits).
    for (i64 i = 0; i < nin; ++i) x[i] = from<T>(max ? (double)(rng() % 5) - 2 : 3 * normal(rng));
    if (max && p.planes > 1) {
        const i64 at = p.h * p.w + std::min<i64>(1, p.h - 1) * p.w + std::min<i64>(1, p.w - 1);
        x[at] = from<T>(NAN);
        if (p.w > 2) x[at + 1] = from<T>(-NAN);  // a later NaN, told apart by its sign
    }
    for (i64 i = 0; i < nout; ++i) g[i] = from<T>(normal(rng));
    launch(grid_cfg(nout), [&] { (max ? K<T>::max_fwd : K<T>::avg_fwd)(y.p, x.p, geo); });
    if (max) launch(grid_cfg(nin), [&] { K<T>::max_bwd(dx.p, x.p, g.p, geo); });
    else launch(grid_cfg(nin), [&] { K<T>::avg_bwd(dx.p, g.p, geo); });

    // References: each output's window, its value, and its gradient routed back.
    std::vector<double> rdx(nin, 0), adx(nin, 0);
    bool exact = true;
    Err fe, be;
    for (i64 pl = 0; pl < p.planes; ++pl)
        for (i64 oy = 0; oy < p.oh; ++oy)
            for (i64 ox = 0; ox < p.ow; ++ox) {
                i64 h0, h1, kh, w0, w1, kw;
                window(p, 0, oy, h0, h1, kh);
                window(p, 1, ox, w0, w1, kw);
                const i64 o = (pl * p.oh + oy) * p.ow + ox, base = pl * p.h * p.w;
                const double gv = val(g[o]);
                if (max) {
                    // The CPU's argmax: the first NaN, else the first of equal maxima.
                    i64 best = -1;
                    for (i64 yy = h0; yy < h1 && !(best >= 0 && std::isnan(val(x[best]))); ++yy)
                        for (i64 xx = w0; xx < w1; ++xx) {
                            const i64 at = base + yy * p.w + xx;
                            if (best < 0 || val(x[at]) > val(x[best]) || std::isnan(val(x[at]))) best = at;
                            if (std::isnan(val(x[best]))) break;
                        }
                    exact = exact && bits_of(y[o]) == bits_of(x[best]);
                    rdx[best] += gv;
                    adx[best] += std::fabs(gv);
                } else {
                    double s = 0, a = 0;
                    for (i64 yy = h0; yy < h1; ++yy)
                        for (i64 xx = w0; xx < w1; ++xx) {
                            s += val(x[base + yy * p.w + xx]);
                            a += std::fabs(val(x[base + yy * p.w + xx]));
                            rdx[base + yy * p.w + xx] += gv / (double)(kh * kw);
                            adx[base + yy * p.w + xx] += std::fabs(gv) / (double)(kh * kw);
                        }
                    add_rounded<T>(fe, val(y[o]), s / (double)(kh * kw), a / (double)(kh * kw));
                }
            }
    for (i64 i = 0; i < nin; ++i) add_rounded<T>(be, val(dx[i]), rdx[i], adx[i]);
    char what[128];
    if (p.adaptive)
        std::snprintf(what, sizeof what, "%lld x %lldx%lld -> %lldx%lld adaptive", p.planes, p.h, p.w, p.oh, p.ow);
    else
        std::snprintf(what, sizeof what, "%lld x %lldx%lld k %lldx%lld s %lldx%lld p %lldx%lld -> %lldx%lld", p.planes,
                      p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, p.oh, p.ow);
    const std::string dt = dtype_name<T>();
    if (max) report.check("max_pool2d_fwd " + dt, std::string(what) + " (bit for bit)", exact ? 0 : INFINITY, 0);
    else report.check("avg_pool2d_fwd " + dt, what, fe.worst, 1);
    report.check(std::string(max ? "max_pool2d_bwd " : "avg_pool2d_bwd ") + dt, what, be.worst, 1);
}

// ---- convolution: Cuda::conv2d, conv2d_backward_input, conv2d_backward_weight, linear ---------

struct Conv {
    i64 n, c_in, c_out, groups, h, w, kh, kw, sh, sw, ph, pw, dh, dw;
};

template <typename T> void conv_case(const Conv& c, unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 cg = c.c_in / c.groups, og = c.c_out / c.groups, k = cg * c.kh * c.kw;
    const i64 oh = (c.h + 2 * c.ph - (c.dh * (c.kh - 1) + 1)) / c.sh + 1;  // Conv2dSpec::output_size
    const i64 ow = (c.w + 2 * c.pw - (c.dw * (c.kw - 1) + 1)) / c.sw + 1;
    const i64 l = oh * ow;
    const AmpConvGeom geo{c.n, c.c_in, c.c_out, c.groups, cg, og, k, c.h, c.w, c.kh, c.kw, oh, ow, c.sh, c.sw,
                          c.ph, c.pw, c.dh, c.dw};
    // A chunk of samples after the first, as the backend's loop over chunks passes it.
    const i64 n0 = c.n > 1 ? 1 : 0, nb = c.n - n0;
    const i64 nx = c.n * c.c_in * c.h * c.w, ncols = nb * c.groups * k * l;
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0, 1);
    Buf<T> x(nx), cols(ncols), dx(nx), bias(c.c_out), gy(c.n * c.c_out * l), gb(c.c_out),
        filled(c.n * c.c_out * l);
    Buf<A> dcols(ncols);
    for (i64 i = 0; i < nx; ++i) x[i] = from<T>(normal(rng));
    for (i64 i = 0; i < ncols; ++i) dcols[i] = (A)normal(rng);
    for (i64 i = 0; i < c.c_out; ++i) bias[i] = from<T>(normal(rng));
    for (i64 i = 0; i < c.n * c.c_out * l; ++i) gy[i] = from<T>(normal(rng));

    // conv2d / conv2d_backward_weight: im2col_fwd over grid(nb·G·K·L).
    launch(grid_cfg(ncols), [&] { K<T>::im2col(cols.p, x.p, n0, nb, geo); });
    bool exact = true;
    for (i64 s = 0; s < nb; ++s)
        for (i64 gi = 0; gi < c.groups; ++gi)
            for (i64 kk = 0; kk < k; ++kk)
                for (i64 oy = 0; oy < oh; ++oy)
                    for (i64 ox = 0; ox < ow; ++ox) {
                        const i64 ci = kk / (c.kh * c.kw), i = kk / c.kw % c.kh, j = kk % c.kw;
                        const i64 iy = oy * c.sh + i * c.dh - c.ph, ix = ox * c.sw + j * c.dw - c.pw;
                        const bool in = iy >= 0 && iy < c.h && ix >= 0 && ix < c.w;
                        const T want = in ? x[(((n0 + s) * c.c_in + gi * cg + ci) * c.h + iy) * c.w + ix] : from<T>(0);
                        exact = exact && bits_of(cols[(((s * c.groups + gi) * k + kk) * l) + oy * ow + ox]) == bits_of(want);
                    }
    char what[160];
    std::snprintf(what, sizeof what, "n %lld (from %lld) %lld->%lld g %lld %lldx%lld k %lldx%lld s %lldx%lld p %lldx%lld d %lldx%lld",
                  nb, n0, c.c_in, c.c_out, c.groups, c.h, c.w, c.kh, c.kw, c.sh, c.sw, c.ph, c.pw, c.dh, c.dw);
    const std::string dt = dtype_name<T>();
    report.check("im2col_fwd " + dt, std::string(what) + " (bit for bit)", exact ? 0 : INFINITY, 0);

    // conv2d_backward_input: col2im_bwd over grid(nb·C_in·H·W), writing samples n0.. only.
    launch(grid_cfg(nb * c.c_in * c.h * c.w), [&] { K<T>::col2im(dx.p, dcols.p, n0, nb, geo); });
    std::vector<double> rdx(nx, 0), adx(nx, 0);
    for (i64 s = 0; s < nb; ++s)
        for (i64 gi = 0; gi < c.groups; ++gi)
            for (i64 kk = 0; kk < k; ++kk)
                for (i64 oy = 0; oy < oh; ++oy)
                    for (i64 ox = 0; ox < ow; ++ox) {
                        const i64 ci = kk / (c.kh * c.kw), i = kk / c.kw % c.kh, j = kk % c.kw;
                        const i64 iy = oy * c.sh + i * c.dh - c.ph, ix = ox * c.sw + j * c.dw - c.pw;
                        if (iy < 0 || iy >= c.h || ix < 0 || ix >= c.w) continue;
                        const i64 at = (((n0 + s) * c.c_in + gi * cg + ci) * c.h + iy) * c.w + ix;
                        const double v = (double)dcols[(((s * c.groups + gi) * k + kk) * l) + oy * ow + ox];
                        rdx[at] += v;
                        adx[at] += std::fabs(v);
                    }
    Err ce;
    bool untouched = true;  // the samples before n0 keep their 0xff bytes
    for (i64 i = 0; i < nx; ++i) {
        if (i < n0 * c.c_in * c.h * c.w) untouched = untouched && bits_of(dx[i]) == (sizeof(T) == 8 ? ~0ull : (1ull << (8 * sizeof(T))) - 1);
        else add_rounded<T>(ce, val(dx[i]), rdx[i], adx[i]);
    }
    report.check("col2im_bwd " + dt, what, untouched ? ce.worst : INFINITY, 1);

    // conv2d: bias_fill_fwd(dst, bias, N·C_out·L, L, C_out) over grid(total); linear: (rows·out, 1, out).
    const i64 total = c.n * c.c_out * l;
    bool filled_ok = true;
    for (i64 inner : {l, (i64)1}) {
        launch(grid_cfg(total), [&] { K<T>::bias_fill(filled.p, bias.p, total, inner, c.c_out); });
        for (i64 i = 0; i < total; ++i)
            filled_ok = filled_ok && bits_of(filled[i]) == bits_of(bias[(i / inner) % c.c_out]);
    }
    report.check("bias_fill_fwd " + dt, std::string(what) + " (bit for bit)", filled_ok ? 0 : INFINITY, 0);

    // conv2d_backward_weight's bias gradient: channel_sum_bwd over rows_grid(C_out, N·L, 0).
    launch(rows_grid(c.c_out, c.n * l, 0), [&] { K<T>::channel_sum(gb.p, gy.p, c.n, c.c_out, l); });
    Err se;
    for (i64 o = 0; o < c.c_out; ++o) {
        double s = 0, a = 0;
        for (i64 i = 0; i < c.n; ++i)
            for (i64 t = 0; t < l; ++t) {
                s += val(gy[(i * c.c_out + o) * l + t]);
                a += std::fabs(val(gy[(i * c.c_out + o) * l + t]));
            }
        add_rounded<T>(se, val(gb[o]), s, a);
    }
    report.check("channel_sum_bwd " + dt, what, se.worst, 1);
}

template <typename T> void family(unsigned seed) {
    const std::vector<Pool> pools = {
        // planes, h, w, adaptive, kh, kw, sh, sw, ph, pw, (oh, ow)
        {3, 7, 9, false, 3, 3, 2, 2, 1, 1, 0, 0},    // overlapping windows, padding
        {2, 6, 5, false, 2, 3, 2, 1, 0, 1, 0, 0},
        {2, 5, 5, false, 1, 1, 2, 2, 0, 0, 0, 0},    // gaps: inputs in no window
        {2, 4, 10, false, 4, 4, 1, 3, 2, 2, 0, 0},   // padding of half the kernel
        {4, 17, 19, false, 3, 3, 2, 2, 1, 0, 0, 0},  // several 256-thread blocks
        {3, 7, 9, true, 0, 0, 0, 0, 0, 0, 3, 4},     // adaptive: uneven windows
        {2, 3, 3, true, 0, 0, 0, 0, 0, 0, 5, 5},     // adaptive, larger output: overlaps
        {2, 6, 7, true, 0, 0, 0, 0, 0, 0, 1, 1},     // global average
    };
    for (const Pool& p : pools) {
        if (!p.adaptive) pool_case<T>(p, true, seed++);
        pool_case<T>(p, false, seed++);
    }
    const std::vector<Conv> convs = {
        // n, c_in, c_out, groups, h, w, kh, kw, sh, sw, ph, pw, dh, dw
        {3, 4, 6, 2, 5, 6, 3, 2, 2, 1, 1, 1, 1, 2},
        {2, 3, 5, 1, 4, 4, 1, 1, 1, 1, 0, 0, 1, 1},    // 1x1
        {3, 3, 6, 3, 7, 8, 3, 3, 3, 2, 2, 1, 2, 1},    // depthwise, dilation, stride 3
        {1, 2, 4, 1, 6, 5, 3, 3, 1, 1, 1, 1, 1, 1},    // one sample
        {2, 2, 3, 1, 20, 20, 3, 3, 1, 1, 1, 1, 1, 1},  // N·L above a block of 512
    };
    for (const Conv& c : convs) conv_case<T>(c, seed++);
}

int main() {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines before an abort (a trap) reach the test
    family<float>(100);
    family<f16_t>(200);
    family<bf16_t>(300);
    family<double>(400);
    return report.finish();
}
