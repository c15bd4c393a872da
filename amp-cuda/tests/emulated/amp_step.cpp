// The AMP step's kernels (src/kernels/amp.cu) and the optimizer updates (src/kernels/optim.cu),
// included as they are, run on the host under cuda_emu.hpp, launched as amp-cuda's backend
// launches them (each case names the backend function it follows):
// - checked here: unscale_check over a multi-chunk table of several gradients (with and without
//   a scale, inf and NaN in some, one flag per gradient, flags set before left set), bit for bit;
//   sum_squares + norm_finish against an f64 norm; scale and clamp bit for bit; SGD (momentum,
//   Nesterov, L2 decay) and Adam / AdamW bit for bit against the CPU's arithmetic (the same
//   operations in the same order, written out here from amp-core's cpu optimizer) and within
//   tolerance of an f64 update; a step whose found-inf flag is set leaves parameters, moments and
//   buffers bit-identical; the bf16 writes (nearest, Kahan, stochastic) bit for bit.
// - update_scale, clip_coefficient and dropout: one case per line of standard input (protocol
//   below), answered on standard output in hex; the Rust test (tests/kernels_emulated.rs) holds
//   the CPU implementation (ScaleRule::apply, clip_coefficient, the CPU's dropout) as the oracle
//   and compares bit for bit.
//
// Protocol, one case per line, floats as the hex of their bits (f32: 8 digits, f64: 16):
//   scale GROWTH BACKOFF INTERVAL HAS_MIN MIN HAS_MAX MAX HYSTERESIS HAS_SET SET N F1..FN S0..S4
//     -> "scale S0 S1 S2 S3 S4" (the state vector after update_scale_fwd_f32)
//   clip MAX_NORM N NORM1..NORMN
//     -> "clip TOTAL COEF" (out[0], out[1] of clip_coefficient_fwd_f32)
//   dropout DTYPE N ROWS COLS TRANSPOSED GRID THREADS THR SCALE SEED X1..XN
//     -> "dropout Y1..YN" (dropout_fwd_DTYPE's output; values as the hex of their bits)

#include "launch.hpp"

#include "amp.cu"
#include "optim.cu"

#include <iostream>
#include <sstream>

AMP_AMP_KERNELS(f32)
AMP_AMP_KERNELS(f64)
AMP_AMP_KERNELS(f16)
AMP_AMP_KERNELS(bf16)
AMP_SCALER_KERNELS(f32)

template <typename T> struct K;
#define AMP_EMU_AMP_ENTRIES(SUF)                                      \
    template <> struct K<amp_t_##SUF> {                               \
        static constexpr auto unscale_check = unscale_check_fwd_##SUF; \
        static constexpr auto sum_squares = sum_squares_fwd_##SUF;    \
        static constexpr auto norm_finish = norm_finish_fwd_##SUF;    \
        static constexpr auto scale = scale_fwd_##SUF;                \
        static constexpr auto clamp = clamp_fwd_##SUF;                \
        static constexpr auto dropout = dropout_fwd_##SUF;            \
    };
AMP_EMU_AMP_ENTRIES(f32)
AMP_EMU_AMP_ENTRIES(f64)
AMP_EMU_AMP_ENTRIES(f16)
AMP_EMU_AMP_ENTRIES(bf16)

static Report report;

template <typename T> bool same_bits(const Buf<T>& a, const std::vector<T>& b) {
    for (size_t i = 0; i < b.size(); ++i)
        if (bits_of(a[i]) != bits_of(b[i])) return false;
    return true;
}

// ---- unscale_check: Cuda::unscale_check (UNSCALE_CHUNK 65536 values a chunk, one 256-thread
// block a chunk) -------------------------------------------------------------------------------------

template <typename T> void unscale_case(bool with_scale, double scale_value) {
    typedef typename Acc<T>::type A;
    const size_t chunk = 64 * 1024;
    const std::vector<size_t> lens = {1, 70000, 300, 140000, 33};
    const i64 first_flag = 2;  // flags 0 and 1 belong to another precision's gradients
    std::mt19937 rng(7 + (unsigned)sizeof(T) + (with_scale ? 100 : 0));
    std::normal_distribution<double> normal(0, 100);
    std::vector<Buf<T>> grads;
    std::vector<std::vector<T>> before;
    for (size_t g = 0; g < lens.size(); ++g) {
        grads.emplace_back(lens[g]);
        for (size_t i = 0; i < lens[g]; ++i) grads[g][i] = from<T>(normal(rng));
    }
    // Gradient 1: an inf in its second chunk; 3: a NaN in its first, an inf in its last; 4: -inf
    // at its end. 0 and 2 are finite.
    grads[1][chunk + 5] = from<T>(INFINITY);
    grads[3][17] = from<T>(NAN);
    grads[3][lens[3] - 1] = from<T>(INFINITY);
    grads[4][32] = from<T>(-INFINITY);
    const std::vector<float> expect_flags = {0, 1, 0, 1, 0, 1, 1};
    for (auto& g : grads) before.emplace_back(g.p, g.p + g.n);
    std::vector<AmpChunk> table;
    for (size_t g = 0; g < lens.size(); ++g)
        for (size_t start = 0; start < lens[g]; start += chunk)
            table.push_back(AmpChunk{(u64)(uintptr_t)(grads[g].p + start), (i64)std::min(chunk, lens[g] - start),
                                     first_flag + (i64)g});
    Buf<double> scale(1);
    scale[0] = scale_value;
    Buf<float> flags(first_flag + lens.size());
    for (size_t i = 0; i < flags.n; ++i) flags[i] = 0.0f;
    flags[1] = 1.0f;  // set by an earlier launch: never cleared
    const Cfg cfg{dim3{(unsigned)std::min<size_t>(table.size(), 1 << 16), 1, 1}, 256, 0};
    launch(cfg, [&] { K<T>::unscale_check(table.data(), (i64)table.size(), with_scale ? scale.p : nullptr, flags.p); });
    bool flags_ok = true;
    for (size_t i = 0; i < flags.n; ++i) flags_ok = flags_ok && flags[i] == expect_flags[i];
    const A inv = with_scale ? (A)(float)(1.0 / scale_value) : A(1);
    size_t wrong = 0;
    for (size_t g = 0; g < lens.size(); ++g)
        for (size_t i = 0; i < lens[g]; ++i) {
            const T want = with_scale ? store<T>(load(before[g][i]) * inv) : before[g][i];
            wrong += bits_of(grads[g][i]) != bits_of(want);
        }
    char what[96];
    std::snprintf(what, sizeof what, "%zu chunks of 5 gradients, %s", table.size(),
                  with_scale ? (scale_value == 65536 ? "scale 65536" : "scale 3") : "no scale (check only)");
    report.check(std::string("unscale_check flags ") + dtype_name<T>(), what, flags_ok ? 0 : 1, 0);
    report.check(std::string("unscale_check values ") + dtype_name<T>(), what, (double)wrong, 0);
}

// ---- sum_squares + norm_finish: Cuda::norm_into (grid(n), then one 256-thread block) ---------------

template <typename T> void norm_case(i64 rows, i64 cols, bool transposed, unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 n = rows * cols;
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0, 3);
    Buf<T> x(n + 3);
    for (i64 i = 0; i < n + 3; ++i) x[i] = from<T>(normal(rng));
    // The view: [rows, cols] at offset 3, contiguous or the transpose of a [cols, rows] block.
    const auto [s, v] = flat_or_transposed(rows, cols, transposed, 3);
    const Cfg cfg = grid_cfg(n);
    Buf<A> parts(cfg.grid.x);
    Buf<float> out(2);
    launch(cfg, [&] { K<T>::sum_squares(parts.p, x.p, s, v, n); });
    launch(Cfg{dim3{1, 1, 1}, 256, 0}, [&] { K<T>::norm_finish(out.p + 1, parts.p, (i64)cfg.grid.x); });
    double ss = 0;
    for (i64 i = 0; i < n; ++i) ss += val(x[3 + i]) * val(x[3 + i]);
    const double ref = std::sqrt(ss);
    Err e;
    e.add(out[1], ref, ref);
    char what[96];
    std::snprintf(what, sizeof what, "%lld values%s, %u block(s)", n, transposed ? " (a transposed view)" : "", cfg.grid.x);
    // f32 sums of a few thousand squares (an f64 sum for f64, rounded to f32 at the end).
    report.check(std::string("sum_squares+norm_finish ") + dtype_name<T>(), what, e.worst,
                 std::is_same_v<T, double> ? 1e-7 : 2e-6);
}

// ---- scale and clamp: Cuda::scale_in_place and Cuda::clamp_in_place (grid(n)) ----------------------

template <typename T> void scale_clamp_case(i64 n, float k, float c) {
    typedef typename Acc<T>::type A;
    std::mt19937 rng(n + 11);
    std::normal_distribution<double> normal(0, 4);
    Buf<T> x(n), y(n);
    for (i64 i = 0; i < n; ++i) x[i] = y[i] = from<T>(normal(rng));
    x[0] = y[0] = from<T>(NAN);
    if (n > 2) x[2] = y[2] = from<T>(-INFINITY);
    std::vector<T> x0(x.p, x.p + n), y0(y.p, y.p + n);
    Buf<float> kk(2);
    kk[1] = k;
    launch(grid_cfg(n), [&] { K<T>::scale(x.p, n, kk.p + 1); });
    launch(grid_cfg(n), [&] { K<T>::clamp(y.p, n, c); });
    size_t wrong_s = 0, wrong_c = 0;
    for (i64 i = 0; i < n; ++i) {
        wrong_s += bits_of(x[i]) != bits_of(store<T>(load(x0[i]) * (A)k));
        const A v = load(y0[i]), cc = (A)c;
        const T want = std::isnan((double)v) ? y0[i] : store<T>(std::min(std::max(v, -cc), cc));
        wrong_c += bits_of(y[i]) != bits_of(want);
    }
    char what[64];
    std::snprintf(what, sizeof what, "%lld values, %u block(s)", n, grid_cfg(n).grid.x);
    report.check(std::string("scale ") + dtype_name<T>(), what, (double)wrong_s, 0);
    report.check(std::string("clamp ") + dtype_name<T>(), what, (double)wrong_c, 0);
}

// ---- optimizers: Cuda::sgd_update, Cuda::adam_update and Cuda::write_bf16 (grid(n)) -----------------

// amp-core's cpu optimizer (src/cpu/optim.rs) operation for operation, one value.
static void cpu_sgd(float& p, float g, float* buf, float neg_lr, bool decay, float wd, float m, float keep,
                    bool nesterov, bool first) {
    if (decay) g = std::fma(p, wd, g);
    float d = g;
    if (buf) {
        const float b = first ? g : std::fma(g, keep, *buf * m);
        *buf = b;
        d = nesterov ? std::fma(b, m, g) : b;
    }
    p = std::fma(d, neg_lr, p);
}
static void cpu_adam(float& p, float g, float& m, float& v, float neg_step_size, float bc2_sqrt, float decay_mul,
                     float w, float b2, float omb2, float eps, bool l2, float wd, bool decoupled) {
    if (decoupled) p = p * decay_mul;
    if (l2) g = std::fma(p, wd, g);
    const float diff = g - m;
    m = std::fabs(w) < 0.5f ? std::fma(w, diff, m) : std::fma(w - 1.0f, diff, g);
    v = v * b2 + (omb2 * g) * g;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    p = p + (neg_step_size * m) / denom;
}

// A window of outcomes: step `at` of flags, row k = zeros in flags[0..at).
struct Window {
    std::vector<float> flags;
    int at;
    int row() const {
        if (flags[at] != 0) return -1;
        int k = 0;
        for (int i = 0; i < at; ++i) k += flags[i] == 0;
        return k;
    }
};

static void sgd_case(i64 n, bool momentum, bool nesterov, bool decay, bool first, const Window& win) {
    std::mt19937 rng(n * 3 + momentum + 2 * nesterov + 4 * decay);
    std::normal_distribution<double> normal(0, 1);
    Buf<float> p(n), g(n), buf(n), f(win.flags.size());
    for (i64 i = 0; i < n; ++i) {
        p[i] = (float)normal(rng);
        g[i] = (float)normal(rng) * 0.1f;
        buf[i] = (float)normal(rng) * 0.1f;
    }
    for (size_t i = 0; i < win.flags.size(); ++i) f[i] = win.flags[i];
    AmpSgdRows rows{};
    for (int r = 0; r < AMP_STEP_ROWS; ++r) {
        rows.neg_lr[r] = -0.01f * (float)(r + 1);
        rows.first[r] = first && r == 0;
    }
    const float wd = 1e-2f, m = momentum ? 0.9f : 0.0f, keep = 0.75f;
    std::vector<float> p0(p.p, p.p + n), g0(g.p, g.p + n), b0(buf.p, buf.p + n);
    float* pbuf = momentum ? buf.p : nullptr;
    launch(grid_cfg(n), [&] {
        sgd_update_fwd_f32(p.p, g.p, pbuf, n, rows, decay, wd, m, keep, nesterov, f.p, win.at);
    });
    const int r = win.row();
    std::vector<float> pe = p0, be = b0;
    double ferr = 0;
    if (r >= 0)
        for (i64 i = 0; i < n; ++i) {
            cpu_sgd(pe[i], g0[i], momentum ? &be[i] : nullptr, rows.neg_lr[r], decay, wd, m, keep, nesterov, rows.first[r]);
            // f64: the same update without rounding.
            double gd = decay ? (double)g0[i] + (double)p0[i] * wd : g0[i], d = gd;
            if (momentum) {
                const double b = rows.first[r] ? gd : (double)b0[i] * m + gd * keep;
                d = nesterov ? gd + b * m : b;
            }
            const double pref = p0[i] + d * rows.neg_lr[r];
            ferr = std::max(ferr, std::fabs(p[i] - pref) / std::max(std::fabs(pref), 1e-3));
        }
    const bool bits = same_bits(p, pe) && same_bits(buf, be) && same_bits(g, g0);
    char what[96];
    std::snprintf(what, sizeof what, "%lld values%s%s%s%s, step %d of [%s]", n, momentum ? ", momentum" : "",
                  nesterov ? ", nesterov" : "", decay ? ", L2" : "", first ? ", first" : "", win.at,
                  [&] { std::string s; for (float x : win.flags) s += x != 0 ? "inf " : "ok "; if (!s.empty()) s.pop_back(); return s; }().c_str());
    report.check(r < 0 ? "sgd_update skipped: bits kept" : "sgd_update: cpu bits", what, bits ? 0 : 1, 0);
    if (r >= 0) report.check("sgd_update vs f64", what, ferr, 1e-6);
}

static void adam_case(i64 n, int decay_kind, bool large_w, const Window& win) {
    std::mt19937 rng(n * 5 + decay_kind);
    std::normal_distribution<double> normal(0, 1);
    Buf<float> p(n), g(n), m(n), v(n), f(win.flags.size());
    for (i64 i = 0; i < n; ++i) {
        p[i] = (float)normal(rng);
        g[i] = (float)normal(rng) * 0.1f;
        m[i] = (float)normal(rng) * 0.01f;
        v[i] = (float)std::fabs(normal(rng)) * 1e-4f;
    }
    g[n / 2] = 0.0f;
    for (size_t i = 0; i < win.flags.size(); ++i) f[i] = win.flags[i];
    AmpAdamRows rows{};
    const double lr = 1e-3, b1 = large_w ? 0.1 : 0.9, b2d = 0.999, wdd = 0.01;
    for (int r = 0; r < AMP_STEP_ROWS; ++r) {
        const int step = r + 3;
        rows.neg_step_size[r] = (float)(-(lr / (1 - std::pow(b1, step))));
        rows.bc2_sqrt[r] = (float)std::sqrt(1 - std::pow(b2d, step));
        rows.decay_mul[r] = decay_kind == 2 ? (float)(1 - lr * wdd) : 1.0f;
    }
    const float w = (float)(1 - b1), b2 = (float)b2d, omb2 = (float)(1 - b2d), eps = 1e-8f, wd = (float)wdd;
    const bool l2 = decay_kind == 1, decoupled = decay_kind == 2;
    std::vector<float> p0(p.p, p.p + n), g0(g.p, g.p + n), m0(m.p, m.p + n), v0(v.p, v.p + n);
    launch(grid_cfg(n), [&] {
        adam_update_fwd_f32(p.p, g.p, m.p, v.p, n, rows, w, b2, omb2, eps, l2, l2 ? wd : 0.0f, decoupled, f.p, win.at);
    });
    const int r = win.row();
    std::vector<float> pe = p0, me = m0, ve = v0;
    double ferr = 0;
    if (r >= 0)
        for (i64 i = 0; i < n; ++i) {
            cpu_adam(pe[i], g0[i], me[i], ve[i], rows.neg_step_size[r], rows.bc2_sqrt[r], rows.decay_mul[r], w, b2, omb2,
                     eps, l2, l2 ? wd : 0.0f, decoupled);
            double pd = decoupled ? (double)p0[i] * rows.decay_mul[r] : p0[i];
            const double gd = l2 ? (double)g0[i] + pd * wd : g0[i];
            const double md = m0[i] + (double)w * (gd - m0[i]), vd = (double)v0[i] * b2 + (double)omb2 * gd * gd;
            pd += rows.neg_step_size[r] * md / (std::sqrt(vd) / rows.bc2_sqrt[r] + eps);
            ferr = std::max(ferr, std::fabs(p[i] - pd) / std::max(std::fabs(pd), 1e-3));
        }
    const bool bits = same_bits(p, pe) && same_bits(m, me) && same_bits(v, ve) && same_bits(g, g0);
    char what[96];
    std::snprintf(what, sizeof what, "%lld values, %s%s, step %d (row %d)", n,
                  decay_kind == 0 ? "no decay" : decay_kind == 1 ? "L2" : "decoupled", large_w ? ", 1 - beta1 >= 0.5" : "",
                  win.at, r);
    report.check(r < 0 ? "adam_update skipped: bits kept" : "adam_update: cpu bits", what, bits ? 0 : 1, 0);
    if (r >= 0) report.check("adam_update vs f64", what, ferr, 1e-5);
}

static void write_bf16_case(i64 n) {
    std::mt19937 rng(n);
    std::normal_distribution<double> normal(0, 1);
    Buf<float> upd(n);
    Buf<bf16_t> p1(n), p2(n), comp(n), p3(n);
    for (i64 i = 0; i < n; ++i) {
        p2[i] = from<bf16_t>(normal(rng));
        comp[i] = from<bf16_t>(normal(rng) * 1e-3);
        upd[i] = (float)(val(p2[i]) + normal(rng) * 1e-3);
    }
    upd[1] = INFINITY;
    upd[2] = NAN;
    std::vector<bf16_t> p2_0(p2.p, p2.p + n), c0(comp.p, comp.p + n);
    const u64 key = 0x1234567890abcdefull;
    launch(grid_cfg(n), [&] { write_bf16_nearest_fwd_f32(p1.p, upd.p, n); });
    launch(grid_cfg(n), [&] { write_bf16_kahan_fwd_f32(p2.p, comp.p, upd.p, n); });
    launch(grid_cfg(n), [&] { write_bf16_stochastic_fwd_f32(p3.p, upd.p, n, key); });
    size_t wn = 0, wk = 0, ws = 0;
    for (i64 i = 0; i < n; ++i) {
        wn += bits_of(p1[i]) != bits_of(store<bf16_t>(upd[i]));
        // amp-core's cpu write_kahan: y = (w - p) + c; p' = bf16(p + y); c' = bf16(y - (p' - p)).
        const float old = val(p2_0[i]), y = (upd[i] - old) + (float)val(c0[i]);
        const bf16_t nw = store<bf16_t>(old + y);
        const bf16_t nc = store<bf16_t>(y - ((float)val(nw) - old));
        wk += bits_of(p2[i]) != bits_of(nw) || bits_of(comp[i]) != bits_of(nc);
        // write_stochastic: the low 16 bits of splitmix64(key ^ i·golden) added to the bits.
        bf16_t s;
        if (std::isfinite(upd[i])) {
            u64 z = key ^ ((u64)i * 0x9E3779B97F4A7C15ull);
            z += 0x9E3779B97F4A7C15ull;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            z ^= z >> 31;
            s.bits = (unsigned short)((__float_as_uint(upd[i]) + (u32)(z & 0xffff)) >> 16);
        } else {
            s = store<bf16_t>(upd[i]);
        }
        ws += bits_of(p3[i]) != bits_of(s);
    }
    char what[64];
    std::snprintf(what, sizeof what, "%lld values (inf and NaN among them)", n);
    report.check("write_bf16_nearest", what, (double)wn, 0);
    report.check("write_bf16_kahan", what, (double)wk, 0);
    report.check("write_bf16_stochastic", what, (double)ws, 0);
}

// ---- update_scale and clip_coefficient: cases from standard input ----------------------------------

static u64 hex(std::istream& in) {
    std::string s;
    in >> s;
    return std::stoull(s, nullptr, 16);
}
static float hf(std::istream& in) { return __uint_as_float((u32)hex(in)); }
static double hd(std::istream& in) { return __longlong_as_double((long long)hex(in)); }

// Cuda::dropout: x (N values of T, hex bits) seen as [N] or, transposed, as [ROWS, COLS] over
// storage [COLS, ROWS]; the launch (grid, threads), threshold and scale as launch::dropout_launch
// gives them (the Rust test sends them); prints the contiguous output's bits.
template <typename T>
static void dropout_case(std::istream& in, i64 n, i64 rows, i64 cols, bool transposed, unsigned grid, unsigned threads,
                         u32 thr, double scale, u64 seed) {
    Buf<T> x(n), out(n);
    for (i64 i = 0; i < n; ++i) {
        const u64 b = hex(in);
        std::memcpy((void*)&x[i], &b, sizeof(T));
    }
    const auto [sh, vx] = transposed ? flat_or_transposed(rows, cols, true) : flat_or_transposed(1, n, false);
    launch(Cfg{dim3{grid, 1, 1}, threads, 0}, [&] { K<T>::dropout(out.p, x.p, sh, vx, n, thr, scale, seed); });
    std::string line = "dropout";
    char h[24];
    for (i64 i = 0; i < n; ++i) {
        std::snprintf(h, sizeof h, " %llx", (unsigned long long)bits_of(out[i]));
        line += h;
    }
    std::puts(line.c_str());
}

static int oracle_cases() {
    std::string line;
    int answered = 0;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string op;
        in >> op;
        if (op == "scale") {
            // Cuda::update_scale: one block of 32 threads.
            const double growth = hd(in), backoff = hd(in);
            const i64 interval = (i64)hex(in);
            const int has_min = (int)hex(in);
            const float min_scale = hf(in);
            const int has_max = (int)hex(in);
            const float max_scale = hf(in);
            const i64 hysteresis = (i64)hex(in);
            const int has_set = (int)hex(in);
            const float set_scale = hf(in);
            const i64 n = (i64)hex(in);
            Buf<float> flags(n);
            for (i64 i = 0; i < n; ++i) flags[i] = hf(in);
            Buf<double> st(5);
            for (int i = 0; i < 5; ++i) st[i] = hd(in);
            launch(Cfg{dim3{1, 1, 1}, 32, 0}, [&] {
                update_scale_fwd_f32(st.p, flags.p, n, growth, backoff, interval, has_min, min_scale, has_max, max_scale,
                                     hysteresis, has_set, set_scale);
            });
            std::printf("scale");
            for (int i = 0; i < 5; ++i) std::printf(" %016llx", (unsigned long long)bits_of(st[i]));
            std::printf("\n");
        } else if (op == "clip") {
            // Cuda::clip_coefficient: one block of 32 threads.
            const float max_norm = hf(in);
            const i64 n = (i64)hex(in);
            Buf<float> norms(n), out(2);
            for (i64 i = 0; i < n; ++i) norms[i] = hf(in);
            launch(Cfg{dim3{1, 1, 1}, 32, 0}, [&] { clip_coefficient_fwd_f32(out.p, norms.p, n, max_norm); });
            std::printf("clip %08x %08x\n", __float_as_uint(out[0]), __float_as_uint(out[1]));
        } else if (op == "dropout") {
            std::string dtype;
            in >> dtype;
            const i64 n = (i64)hex(in), rows = (i64)hex(in), cols = (i64)hex(in);
            const bool transposed = hex(in) != 0;
            const unsigned grid = (unsigned)hex(in), threads = (unsigned)hex(in);
            const u32 thr = (u32)hex(in);
            const double scale = hd(in);
            const u64 seed = hex(in);
            if (dtype == "f32") dropout_case<float>(in, n, rows, cols, transposed, grid, threads, thr, scale, seed);
            else if (dtype == "f64") dropout_case<double>(in, n, rows, cols, transposed, grid, threads, thr, scale, seed);
            else if (dtype == "f16") dropout_case<f16_t>(in, n, rows, cols, transposed, grid, threads, thr, scale, seed);
            else if (dtype == "bf16") dropout_case<bf16_t>(in, n, rows, cols, transposed, grid, threads, thr, scale, seed);
            else {
                std::fprintf(stderr, "unknown dtype: %s\n", line.c_str());
                return -1;
            }
        } else if (!op.empty()) {
            std::fprintf(stderr, "unknown case: %s\n", line.c_str());
            return -1;
        }
        ++answered;
    }
    return answered;
}

int main() {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines before an abort (a failed guard, a trap) reach the test
    for (bool with_scale : {true, false}) {
        unscale_case<float>(with_scale, 65536.0);
        unscale_case<f16_t>(with_scale, 65536.0);
        unscale_case<bf16_t>(with_scale, 3.0);
        unscale_case<double>(with_scale, 3.0);
    }
    unscale_case<float>(true, 3.0);
    norm_case<float>(1, 1, false, 1);
    norm_case<float>(40, 50, false, 2);
    norm_case<float>(33, 47, true, 3);
    norm_case<f16_t>(40, 50, true, 4);
    norm_case<bf16_t>(7, 300, false, 5);
    norm_case<double>(33, 47, true, 6);
    for (i64 n : {1, 1000}) {
        scale_clamp_case<float>(n, 0.37f, 1.5f);
        scale_clamp_case<f16_t>(n, 3.1f, 2.0f);
        scale_clamp_case<bf16_t>(n, 1.0f / 65536, 0.25f);
        scale_clamp_case<double>(n, 0.37f, 1.5f);
    }
    const Window plain{{0}, 0}, third_ok{{0, 1, 0, 0}, 3}, skipped{{0, 0, 1}, 2}, first_skipped{{1}, 0};
    for (const Window* w : {&plain, &third_ok, &skipped, &first_skipped}) {
        sgd_case(777, false, false, false, false, *w);
        sgd_case(600, true, false, true, false, *w);
        sgd_case(600, true, true, false, false, *w);
        adam_case(777, 0, false, *w);
        adam_case(600, 1, false, *w);
        adam_case(600, 2, true, *w);
    }
    sgd_case(300, true, false, true, true, plain);
    write_bf16_case(1000);
    const int answered = oracle_cases();
    std::printf("%d oracle case(s) answered\n", answered);
    if (answered < 0) return 2;
    return report.finish();
}
