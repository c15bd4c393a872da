// The reduction kernels (src/kernels/reduce.cu), the gathering kernels (src/kernels/index.cu)
// and the cuBLAS path's attention helpers (src/kernels/attention.cu), included as they are, run
// on the host under cuda_emu.hpp, launched as amp-cuda's backend launches them (each case names
// the backend function it follows), and are checked against references:
// - sum_fwd / max_fwd over the last dim (a block a row) and over a middle dim (a thread an
//   output), and reduce_partial_fwd + reduce_parts_fwd where Cuda::reduce splits a long dim
//   (launch.hpp's reduce_parts, a mirror of src/launch.rs's);
//   max with NaN (NaN wins) and -inf; arg_reduce_fwd (arg max / arg min with the first NaN and the
//   first of ties winning, the CPU's loop) and scatter_dim_bwd, bit for bit.
// - gather_rows_fwd and cat_fwd bit for bit; scatter_add_rows_bwd bit for bit against the CPU's
//   order (rows by id, stably; summed in Acc<T> from zero, rounded once), ids repeated and unused.
// - attention_probs_fwd (the causal mask, log-sum-exps), attention_delta_bwd and
//   attention_grads_bwd for blocks of query rows after the first (q0 > 0), against f64.
//
// Usage: reduce_index. Prints one line per check and exits non-zero if any is over its tolerance.

#include "launch.hpp"

#include "attention.cu"
#include "index.cu"
#include "reduce.cu"

AMP_REDUCE_KERNELS(f32)
AMP_REDUCE_KERNELS(f64)
AMP_REDUCE_KERNELS(f16)
AMP_REDUCE_KERNELS(bf16)
AMP_INDEX_KERNELS(f32)
AMP_INDEX_KERNELS(f64)
AMP_INDEX_KERNELS(f16)
AMP_INDEX_KERNELS(bf16)
AMP_ATTENTION_KERNELS(f32)
AMP_ATTENTION_KERNELS(f64)
AMP_ATTENTION_KERNELS(f16)
AMP_ATTENTION_KERNELS(bf16)

template <typename T> struct K;
#define AMP_EMU_RI_ENTRIES(SUF)                                              \
    template <> struct K<amp_t_##SUF> {                                      \
        static constexpr auto sum = sum_fwd_##SUF;                           \
        static constexpr auto max = max_fwd_##SUF;                           \
        static constexpr auto partial = reduce_partial_fwd_##SUF;            \
        static constexpr auto parts = reduce_parts_fwd_##SUF;                \
        static constexpr auto arg = arg_reduce_fwd_##SUF;                    \
        static constexpr auto scatter_dim = scatter_dim_bwd_##SUF;           \
        static constexpr auto gather = gather_rows_fwd_##SUF;                \
        static constexpr auto scatter_add = scatter_add_rows_bwd_##SUF;      \
        static constexpr auto cat = cat_fwd_##SUF;                           \
        static constexpr auto probs = attention_probs_fwd_##SUF;             \
        static constexpr auto delta = attention_delta_bwd_##SUF;             \
        static constexpr auto grads = attention_grads_bwd_##SUF;             \
    };
AMP_EMU_RI_ENTRIES(f32)
AMP_EMU_RI_ENTRIES(f64)
AMP_EMU_RI_ENTRIES(f16)
AMP_EMU_RI_ENTRIES(bf16)

static Report report;


// ---- reductions: Cuda::reduce, Cuda::arg_reduce, Cuda::scatter_dim ---------------------------------

template <typename T> void reduce_case(i64 outer, i64 d, i64 inner, unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 m = outer * inner, nx = outer * d * inner;
    std::mt19937 rng(seed);
    Buf<T> x(nx), sum(m), mx(m), vals(m), g(m), scat(nx);
    Buf<i64> idx(m);
    // Small integers (ties for the arg reductions), a NaN in output 1's walk, -inf in output 0's.
    for (i64 i = 0; i < nx; ++i) x[i] = from<T>((double)(rng() % 7) - 3 + (rng() % 4) * 0.25);
    auto at = [&](i64 oi, i64 j) { return (oi / inner) * d * inner + j * inner + oi % inner; };
    if (m > 1 && d > 2) x[at(1, d / 2)] = from<T>(NAN);
    x[at(0, 0)] = from<T>(-INFINITY);
    const double scale = 1.0 / (double)d;  // a mean
    size_t per = 0, parts = 0;
    const bool split = reduce_parts(m, d, inner, per, parts);
    auto run = [&](Buf<T>& out, bool max, double sc) {
        if (split) {
            Buf<A> partials(parts * m);
            launch(grid_cfg(parts * m), [&] { K<T>::partial(partials.p, x.p, outer, d, inner, per, parts, max); });
            launch(grid_cfg(m), [&] { K<T>::parts(out.p, partials.p, m, parts, sc, max); });
        } else {
            const Cfg cfg = inner == 1 ? rows_grid(outer, d, 0) : grid_cfg(m);
            launch(cfg, [&] { (max ? K<T>::max : K<T>::sum)(out.p, x.p, outer, d, inner, sc); });
        }
    };
    run(sum, false, scale);
    run(mx, true, 1.0);
    Err se, me;
    for (i64 oi = 0; oi < m; ++oi) {
        double s = 0, a = 0, big = -INFINITY;
        bool nan = false;
        for (i64 j = 0; j < d; ++j) {
            const double v = val(x[at(oi, j)]);
            s += v;
            a += std::fabs(v);
            nan = nan || std::isnan(v);
            big = std::max(big, v);
        }
        add_rounded<T>(se, val(sum[oi]), s * scale, a * scale);
        me.add(val(mx[oi]), nan ? NAN : big, 1);
    }
    char what[128];
    std::snprintf(what, sizeof what, "[%lld, %lld, %lld]%s", outer, d, inner,
                  split ? (", " + std::to_string(parts) + " parts of " + std::to_string(per)).c_str()
                        : inner == 1 ? ", a block a row" : ", a thread an output");
    const std::string dt = dtype_name<T>();
    report.check("sum_fwd " + dt, what, se.worst, 1);
    report.check("max_fwd " + dt, what, me.worst, 0);

    // Arg max / arg min (grid(m)), then the selection's backward into a zeroed tensor.
    for (int max : {1, 0}) {
        launch(grid_cfg(m), [&] { K<T>::arg(vals.p, idx.p, x.p, outer, d, inner, max); });
        bool ok = true;
        for (i64 oi = 0; oi < m; ++oi) {
            i64 best = 0;
            double bv = val(x[at(oi, 0)]);
            for (i64 j = 1; j < d && !std::isnan(bv); ++j) {
                const double v = val(x[at(oi, j)]);
                if (std::isnan(v) || (max && v > bv) || (!max && v < bv)) best = j, bv = v;
            }
            ok = ok && idx[oi] == best && bits_of(vals[oi]) == bits_of(x[at(oi, best)]);
        }
        report.check(std::string(max ? "arg_reduce_fwd max " : "arg_reduce_fwd min ") + dt, std::string(what) + " (exact)",
                     ok ? 0 : INFINITY, 0);
    }
    for (i64 oi = 0; oi < m; ++oi) g[oi] = from<T>((double)(oi + 1));
    for (i64 i = 0; i < nx; ++i) scat[i] = from<T>(0);  // Cuda::scatter_dim's zeros
    launch(grid_cfg(m), [&] { K<T>::scatter_dim(scat.p, g.p, idx.p, outer, d, inner); });
    bool ok = true;
    for (i64 oi = 0; oi < m; ++oi)
        for (i64 j = 0; j < d; ++j) ok = ok && bits_of(scat[at(oi, j)]) == bits_of(j == idx[oi] ? g[oi] : from<T>(0));
    report.check("scatter_dim_bwd " + dt, std::string(what) + " (exact)", ok ? 0 : INFINITY, 0);
}

// ---- Cuda::gather_rows, Cuda::scatter_add_rows, Cuda::cat ------------------------------------------

template <typename T> void index_case(i64 vocab, i64 d, const std::vector<i64>& ids, unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 rows = (i64)ids.size();
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0, 1);
    Buf<T> w(vocab * d), out(rows * d), g(rows * d), gw(vocab * d);
    Buf<i64> dids(rows), order(rows), starts(vocab + 1);
    for (i64 i = 0; i < vocab * d; ++i) w[i] = from<T>(normal(rng));
    for (i64 i = 0; i < rows * d; ++i) g[i] = from<T>(normal(rng));
    for (i64 r = 0; r < rows; ++r) dids[r] = ids[r];
    launch(grid_cfg(rows * d), [&] { K<T>::gather(out.p, w.p, dids.p, rows, d); });
    bool ok = true;
    for (i64 r = 0; r < rows; ++r)
        for (i64 j = 0; j < d; ++j) ok = ok && bits_of(out[r * d + j]) == bits_of(w[ids[r] * d + j]);
    char what[96];
    std::snprintf(what, sizeof what, "vocab %lld, d %lld, %lld rows", vocab, d, rows);
    const std::string dt = dtype_name<T>();
    report.check("gather_rows_fwd " + dt, std::string(what) + " (bit for bit)", ok ? 0 : INFINITY, 0);

    // The host's order and starts, as Cuda::scatter_add_rows builds them (a stable sort by id).
    std::vector<i64> ord(rows);
    for (i64 r = 0; r < rows; ++r) ord[r] = r;
    std::stable_sort(ord.begin(), ord.end(), [&](i64 a, i64 b) { return ids[a] < ids[b]; });
    for (i64 r = 0; r < rows; ++r) order[r] = ord[r];
    for (i64 v = 0; v <= vocab; ++v) starts[v] = 0;
    for (i64 id : ids) starts[id + 1] += 1;
    for (i64 v = 0; v < vocab; ++v) starts[v + 1] += starts[v];
    launch(grid_cfg(vocab * d), [&] { K<T>::scatter_add(gw.p, g.p, order.p, starts.p, vocab, d); });
    // The CPU's scatter_add_rows: per id, rows in ascending position, summed in Acc<T> from zero.
    ok = true;
    Err e;
    for (i64 v = 0; v < vocab; ++v)
        for (i64 j = 0; j < d; ++j) {
            A acc = A(0);
            double s = 0, a = 0;
            for (i64 r = 0; r < rows; ++r)
                if (ids[r] == v) {
                    acc += load(g[r * d + j]);
                    s += val(g[r * d + j]);
                    a += std::fabs(val(g[r * d + j]));
                }
            ok = ok && bits_of(gw[v * d + j]) == bits_of(store<T>(acc));
            add_rounded<T>(e, val(gw[v * d + j]), s, a);
        }
    report.check("scatter_add_rows_bwd " + dt, std::string(what) + " (bit for bit as the CPU)", ok ? 0 : INFINITY, 0);
    report.check("scatter_add_rows_bwd " + dt, std::string(what) + " (f64)", e.worst, 1);

    // cat of three parts along a middle dim: [outer, d_i, inner] into [outer, Σd, inner].
    const i64 outer = 3, inner = d, ds[3] = {2, 1, 4}, total = 7;
    Buf<T> cat(outer * total * inner);
    std::vector<Buf<T>> parts;
    for (i64 d_i : ds) {
        parts.emplace_back(outer * d_i * inner);
        for (i64 i = 0; i < outer * d_i * inner; ++i) parts.back()[i] = from<T>(normal(rng));
    }
    i64 at = 0;
    for (int p = 0; p < 3; ++p) {
        const i64 part_row = ds[p] * inner;
        launch(grid_cfg(outer * part_row), [&] { K<T>::cat(cat.p, parts[p].p, outer, part_row, total * inner, at); });
        at += part_row;
    }
    ok = true;
    for (i64 o = 0; o < outer; ++o) {
        i64 c0 = 0;
        for (int p = 0; p < 3; ++p) {
            for (i64 t = 0; t < ds[p] * inner; ++t)
                ok = ok && bits_of(cat[o * total * inner + c0 + t]) == bits_of(parts[p][o * ds[p] * inner + t]);
            c0 += ds[p] * inner;
        }
    }
    std::snprintf(what, sizeof what, "[3, 2|1|4, %lld] (bit for bit)", inner);
    report.check("cat_fwd " + dt, what, ok ? 0 : INFINITY, 0);
}

// ---- attention: Cuda::causal_attention and causal_attention_backward's cuBLAS path ------------------

// One block of `rows` query rows from q0 of n heads of length t (keys [0, kt), kt = q0 + rows),
// with raw scores and dP drawn here (the GEMMs' outputs, in Acc<T>).
template <typename T> void attention_case(i64 n, i64 t, i64 q0, i64 rows, i64 d, unsigned seed) {
    typedef typename Acc<T>::type A;
    const i64 kt = q0 + rows, tile = n * rows;
    const double scale = 1 / std::sqrt((double)d);
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0, 1);
    Buf<A> s(tile * kt), dp(tile * kt), lse(n * t), delta(n * t);
    Buf<T> p(tile * kt), p2(tile * kt), ds(tile * kt), out(n * t * d), g(n * t * d);
    for (i64 i = 0; i < tile * kt; ++i) s[i] = (A)(4 * normal(rng));
    for (i64 i = 0; i < tile * kt; ++i) dp[i] = (A)normal(rng);
    for (i64 i = 0; i < n * t * d; ++i) out[i] = from<T>(normal(rng));
    for (i64 i = 0; i < n * t * d; ++i) g[i] = from<T>(normal(rng));
    launch(rows_grid(tile, kt, 0), [&] { K<T>::probs(p.p, lse.p, s.p, tile, rows, kt, q0, t, scale); });
    launch(rows_grid(n * t, d, 0), [&] { K<T>::delta(delta.p, out.p, g.p, n * t, d); });
    Err pe, le, de;
    for (i64 r = 0; r < tile; ++r) {
        const i64 head = r / rows, qi = q0 + r % rows;
        double mx = -INFINITY, sum = 0;
        for (i64 j = 0; j <= qi; ++j) mx = std::max(mx, (double)s[r * kt + j] * scale);
        for (i64 j = 0; j <= qi; ++j) sum += std::exp((double)s[r * kt + j] * scale - mx);
        const double l = mx + std::log(sum);
        le.add((double)lse[head * t + qi], l, std::max(1.0, std::fabs(l)));
        for (i64 j = 0; j < kt; ++j)
            add_rounded<T>(pe, val(p[r * kt + j]), j <= qi ? std::exp((double)s[r * kt + j] * scale - l) : 0, 1);
    }
    for (i64 r = 0; r < n * t; ++r) {
        double sum = 0, a = 0;
        for (i64 j = 0; j < d; ++j) {
            sum += val(out[r * d + j]) * val(g[r * d + j]);
            a += std::fabs(val(out[r * d + j]) * val(g[r * d + j]));
        }
        de.add((double)delta[r], sum, a);
    }
    const double acc_tol = std::is_same_v<T, double> ? 1e-13 : 4e-6;
    char what[96];
    std::snprintf(what, sizeof what, "%lld heads, t %lld, rows %lld..%lld, d %lld", n, t, q0, kt, d);
    const std::string dt = dtype_name<T>();
    report.check("attention_probs_fwd " + dt, what, pe.worst, 1);
    report.check("attention_probs_fwd lse " + dt, what, le.worst, acc_tol);
    report.check("attention_delta_bwd " + dt, what, de.worst, acc_tol);

    // The backward's block with the forward's log-sum-exps and these deltas.
    launch(rows_grid(tile, kt, 0), [&] {
        K<T>::grads(p2.p, ds.p, s.p, dp.p, lse.p, delta.p, tile, rows, kt, q0, t, scale);
    });
    Err ge;
    for (i64 r = 0; r < tile; ++r) {
        const i64 head = r / rows, qi = q0 + r % rows;
        const double l = (double)lse[head * t + qi], dl = (double)delta[head * t + qi];
        for (i64 j = 0; j < kt; ++j) {
            const i64 e = r * kt + j;
            const double pv = j <= qi ? std::exp((double)s[e] * scale - l) : 0;
            add_rounded<T>(ge, val(p2[e]), pv, 1);
            add_rounded<T>(ge, val(ds[e]), pv * ((double)dp[e] - dl) * scale,
                           pv * (std::fabs((double)dp[e]) + std::fabs(dl)) * scale);
        }
    }
    report.check("attention_grads_bwd " + dt, what, ge.worst, 1);
}

template <typename T> void family(unsigned seed) {
    // [outer, d, inner]
    reduce_case<T>(3, 1000, 1, seed++);  // a block a row, 1000 > 512 threads
    reduce_case<T>(4, 7, 1, seed++);
    reduce_case<T>(2, 5, 3, seed++);      // a thread an output
    reduce_case<T>(70, 9, 5, seed++);     // 350 outputs: two blocks
    reduce_case<T>(1, 700, 4, seed++);    // split: partials over parts of the dim
    reduce_case<T>(2, 64, 3, seed++);     // split at the edge (dim 64)
    index_case<T>(6, 5, {3, 0, 3, 5, 3, 0, 1}, seed++);  // ids repeated, 2 and 4 unused
    index_case<T>(40, 33, {7, 39, 7, 0, 12, 7, 39, 1, 2, 3, 7}, seed++);
    // Blocks of 16 query rows (attention_block's smallest): the first, and one after it.
    attention_case<T>(2, 40, 0, 16, 8, seed++);
    attention_case<T>(2, 40, 32, 8, 8, seed++);  // the last, short block: keys 0..40
    attention_case<T>(3, 5, 0, 5, 4, seed++);    // t 5: one block
}

int main() {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines before an abort (a trap) reach the test
    family<float>(100);
    family<f16_t>(200);
    family<bf16_t>(300);
    family<double>(400);
    return report.finish();
}
