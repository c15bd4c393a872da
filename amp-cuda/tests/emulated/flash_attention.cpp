// The fused attention kernels (src/kernels/attention_flash.cu) run on the host under
// cuda_emu.hpp, checked against causal attention computed in f64 from the same rounded inputs:
// the output and log-sum-exp of the forward, and dQ, dK, dV of the backward (with delta = g·out
// per row from the kernel's own output, as the backend computes it). Prints one line per case
// and exits non-zero if any error is over its tolerance.
//
// The tolerances are relative to the largest magnitude of each reference (of dV for dQ and dK): the kernels round
// probabilities and score gradients once to f16/bf16 (2^-11 / 2^-8 relative), so errors of a
// few of those units pass and an indexing or masking mistake (errors of order 1) does not.

#include "cuda_emu.hpp"  // the CUDA runtime, the real prelude, and amp_mma for mma.cuh
#include "attention_flash.cu"

#include <cstdio>
#include <random>

struct Errors {
    double out = 0, lse = 0, dq = 0, dk = 0, dv = 0;
    bool finite = true;
};

// max |x - ref| / max(max |ref|, floor) over a tensor.
template <typename T>
double rel_error(const std::vector<T>& x, const std::vector<double>& ref, bool& finite, double floor = 1e-30) {
    double err = 0, scale = floor;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double v = load(x[i]);
        finite = finite && std::isfinite(v);
        err = std::max(err, std::fabs(v - ref[i]));
        scale = std::max(scale, std::fabs(ref[i]));
    }
    return err / scale;
}

template <typename T, int D> Errors run_case(int n, i64 t, float spread, unsigned seed) {
    const size_t len = (size_t)n * t * D;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<T> q(len), k(len), v(len), g(len);
    for (size_t i = 0; i < len; ++i) {
        q[i] = store<T>(normal(rng) * spread);
        k[i] = store<T>(normal(rng) * spread);
        v[i] = store<T>(normal(rng));
        g[i] = store<T>(normal(rng));
    }
    const float scale = 1.f / std::sqrt((float)D);
    const unsigned blocks = (unsigned)((t + AMP_FLASH_ROWS - 1) / AMP_FLASH_ROWS);
    const dim3 grid{(unsigned)n, blocks, 1};

    std::vector<T> out(len), dq(len), dk(len), dv(len);
    std::vector<float> lse(n * t), delta(n * t);
    amp_emu_launch(grid, AMP_FLASH_THREADS, 0,
                   [&] { amp_flash_fwd<T, D>(out.data(), lse.data(), q.data(), k.data(), v.data(), t, scale); });
    for (i64 r = 0; r < n * t; ++r) {  // attention_delta_bwd: g·out per row, in f32
        float acc = 0.f;
        for (int j = 0; j < D; ++j) acc += load(out[r * D + j]) * load(g[r * D + j]);
        delta[r] = acc;
    }
    amp_emu_launch(grid, AMP_FLASH_THREADS, 0, [&] {
        amp_flash_dq<T, D>(dq.data(), q.data(), k.data(), v.data(), g.data(), lse.data(), delta.data(), t, scale);
    });
    amp_emu_launch(grid, AMP_FLASH_THREADS, 0, [&] {
        amp_flash_dkv<T, D>(dk.data(), dv.data(), q.data(), k.data(), v.data(), g.data(), lse.data(), delta.data(), t,
                            scale);
    });

    // The reference, in f64.
    std::vector<double> r_out(len, 0), r_lse(n * t), r_dq(len, 0), r_dk(len, 0), r_dv(len, 0);
    std::vector<double> p(t), dp(t);
    auto at = [&](const std::vector<T>& x, int h, i64 row, int j) { return (double)load(x[((size_t)h * t + row) * D + j]); };
    for (int h = 0; h < n; ++h)
        for (i64 i = 0; i < t; ++i) {
            double m = -INFINITY;
            for (i64 j = 0; j <= i; ++j) {
                double s = 0;
                for (int e = 0; e < D; ++e) s += at(q, h, i, e) * at(k, h, j, e);
                p[j] = s * scale;
                m = std::max(m, p[j]);
            }
            double sum = 0;
            for (i64 j = 0; j <= i; ++j) sum += std::exp(p[j] - m);
            const double l = m + std::log(sum);
            r_lse[h * t + i] = l;
            double dl = 0;
            for (i64 j = 0; j <= i; ++j) {
                p[j] = std::exp(p[j] - l);
                dp[j] = 0;
                for (int e = 0; e < D; ++e) dp[j] += at(g, h, i, e) * at(v, h, j, e);
                dl += p[j] * dp[j];
            }
            for (i64 j = 0; j <= i; ++j) {
                const double ds = p[j] * (dp[j] - dl) * scale;
                for (int e = 0; e < D; ++e) {
                    const size_t oi = ((size_t)h * t + i) * D + e, oj = ((size_t)h * t + j) * D + e;
                    r_out[oi] += p[j] * at(v, h, j, e);
                    r_dq[oi] += ds * at(k, h, j, e);
                    r_dk[oj] += ds * at(q, h, i, e);
                    r_dv[oj] += p[j] * at(g, h, i, e);
                }
            }
        }
    Errors e;
    e.out = rel_error(out, r_out, e.finite);
    for (i64 r = 0; r < n * t; ++r) {
        e.finite = e.finite && std::isfinite(lse[r]);
        e.lse = std::max(e.lse, std::fabs(lse[r] - r_lse[r]));
    }
    // dQ and dK cancel (exactly 0 for a single key, where the kernels leave rounding noise):
    // they are measured against the size of dV, which does not cancel.
    double dv_size = 0;
    for (double x : r_dv) dv_size = std::max(dv_size, std::fabs(x));
    e.dq = rel_error(dq, r_dq, e.finite, dv_size);
    e.dk = rel_error(dk, r_dk, e.finite, dv_size);
    e.dv = rel_error(dv, r_dv, e.finite);
    return e;
}

template <typename T, int D> int check(const char* dtype, int n, i64 t, float spread, unsigned seed, double tol) {
    const Errors e = run_case<T, D>(n, t, spread, seed);
    const double worst = std::max({e.out, e.dq, e.dk, e.dv, e.lse});
    const bool ok = e.finite && worst <= tol;
    std::printf("%s %-4s d %3d  n %d  t %4lld  spread %.0f: out %.1e  lse %.1e  dq %.1e  dk %.1e  dv %.1e (tolerance %.0e)\n",
                ok ? "ok  " : "FAIL", dtype, D, n, t, spread, e.out, e.lse, e.dq, e.dk, e.dv, tol);
    return ok ? 0 : 1;
}

int main() {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines before an abort (a failed guard, a trap) reach the test
    int failures = 0;
    // Lengths: one query; inside one tile; one past a tile; several tiles with a ragged end.
    // Spread 3 makes scores of a few tens, so each row's running max moves.
    const i64 lengths[] = {1, 5, 65, 130};
    for (i64 t : lengths) {
        failures += check<bf16_t, 64>("bf16", 2, t, 1.f, 1 + (unsigned)t, 2e-2);
        failures += check<f16_t, 64>("f16", 2, t, 1.f, 2 + (unsigned)t, 4e-3);
        failures += check<bf16_t, 32>("bf16", 2, t, 1.f, 3 + (unsigned)t, 2e-2);
        failures += check<f16_t, 32>("f16", 2, t, 1.f, 4 + (unsigned)t, 4e-3);
    }
    failures += check<bf16_t, 64>("bf16", 2, 192, 3.f, 11, 2e-2);
    failures += check<f16_t, 64>("f16", 1, 200, 3.f, 12, 4e-3);
    std::printf("%d case(s) failed\n", failures);
    return failures == 0 ? 0 : 1;
}
