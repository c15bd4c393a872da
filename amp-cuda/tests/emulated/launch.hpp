// What the emulated runners share: launch configurations as amp-cuda's backend computes them
// (src/launch.rs, mirrored here), aligned buffers, and error bookkeeping.
#pragma once

#include "cuda_emu.hpp"

#include <initializer_list>
#include <map>
#include <random>
#include <string>
#include <type_traits>

// ---- src/launch.rs ------------------------------------------------------------------------------

// launch::ROW_SMEM: the Rust test passes amp_cuda::kernels::ROW_SMEM as the first argument.
inline size_t amp_row_smem = 47 * 1024;

struct Cfg {
    dim3 grid;
    unsigned threads;
    size_t smem;
};

template <typename F> void launch(Cfg c, F body) { amp_emu_launch(c.grid, c.threads, c.smem, body); }

inline size_t next_power_of_two(size_t n) {
    size_t p = 1;
    while (p < n) p <<= 1;
    return p;
}
// launch::grid: a grid-stride launch of 256-thread blocks over n items.
inline Cfg grid_cfg(size_t n) {
    const size_t blocks = std::clamp<size_t>((n + 255) / 256, 1, 1 << 16);
    return Cfg{dim3{(unsigned)blocks, 1, 1}, 256, 0};
}
// launch::rows_grid: one block per row, threads d rounded up to a power of two in [32, 512].
inline Cfg rows_grid(size_t rows, size_t d, size_t smem) {
    const size_t threads = std::clamp<size_t>(next_power_of_two(d), 32, 512);
    const size_t blocks = std::clamp<size_t>(rows, 1, 1 << 16);
    return Cfg{dim3{(unsigned)blocks, 1, 1}, (unsigned)threads, smem};
}
// launch::warp_rows_grid: one warp per row, WARP_ROWS (4) rows a block.
inline Cfg warp_rows_grid(size_t rows) {
    const size_t blocks = std::clamp<size_t>((rows + 3) / 4, 1, 1 << 16);
    return Cfg{dim3{(unsigned)blocks, 1, 1}, 128, 0};
}
// launch::vector_rows: whole 128-bit vectors per row at 16-byte-aligned addresses.
inline bool vector_rows(size_t d, size_t elem_bytes, bool aligned) {
    return d > 0 && d % (16 / elem_bytes) == 0 && aligned;
}
// launch::warp_vectors: the vectors per lane of the warp kernels, 0 for the block kernels.
inline int warp_vectors(size_t d, size_t elem_bytes, bool aligned) {
    if (!vector_rows(d, elem_bytes, aligned)) return 0;
    const size_t per_vector = 16 / elem_bytes, per_lane = (d / per_vector + 31) / 32;
    for (int nv : {1, 2, 4, 8})
        if (per_lane <= (size_t)nv && nv * per_vector <= 32) return nv;
    return 0;
}
// launch::row_cache: (dynamic shared memory, cached) for a row of per_row bytes.
inline std::pair<size_t, int> row_cache(size_t per_row) {
    return per_row <= amp_row_smem ? std::make_pair(per_row, 1) : std::make_pair((size_t)0, 0);
}

// launch::map_mode: the map kernels' mode, 2 (dense, every address 16-byte aligned), 1 (dense)
// or 0 (strided).
inline int map_mode(size_t elem_bytes, bool dense_all, std::initializer_list<u64> ptrs) {
    if (!dense_all) return 0;
    for (u64 p : ptrs)
        if (p % 16 != 0) return 1;
    return elem_bytes <= 16 ? 2 : 1;
}

// launch::reduce_parts: (rows per part, parts) when a reduction over a middle dim has few
// outputs (m) and a long dim; false for the rest.
inline bool reduce_parts(size_t m, size_t dim, size_t inner, size_t& per, size_t& parts) {
    if (inner == 1 || m >= (size_t)1 << 17 || dim < 64) return false;
    parts = std::clamp<size_t>(((size_t)1 << 18) / m + (((size_t)1 << 18) % m != 0), 2, dim / 16);
    per = (dim + parts - 1) / parts;
    parts = (dim + per - 1) / per;
    return true;
}

// The launch rules of launch.hpp, asked for by the Rust test (one query a line on standard
// input) and compared there with src/launch.rs, so the two cannot drift apart: each answer is
// `launch <grid x> <threads> <shared bytes>`, `launch <vectors a lane>`, `launch <bytes> <cached>`, `launch <mode>` or `launch <rows a part> <parts>`
// (`launch none`).
inline void answer_launch_queries() {
    char name[32];
    while (std::scanf("%31s", name) == 1) {
        unsigned long long a = 0, b = 0, c = 0;
        const std::string q = name;
        Cfg cfg;
        if (q == "grid" && std::scanf("%llu", &a) == 1) {
            cfg = grid_cfg(a);
        } else if (q == "rows_grid" && std::scanf("%llu %llu %llu", &a, &b, &c) == 3) {
            cfg = rows_grid(a, b, c);
        } else if (q == "warp_rows_grid" && std::scanf("%llu", &a) == 1) {
            cfg = warp_rows_grid(a);
        } else if (q == "warp_vectors" && std::scanf("%llu %llu %llu", &a, &b, &c) == 3) {
            std::printf("launch %d\n", warp_vectors(a, b, c != 0));
            continue;
        } else if (q == "reduce_parts" && std::scanf("%llu %llu %llu", &a, &b, &c) == 3) {
            size_t per = 0, parts = 0;
            if (reduce_parts(a, b, c, per, parts)) std::printf("launch %zu %zu\n", per, parts);
            else std::printf("launch none\n");
            continue;
        } else if (q == "map_mode" && std::scanf("%llu %llu %llu", &a, &b, &c) == 3) {
            std::printf("launch %d\n", map_mode(a, b != 0, {c}));
            continue;
        } else if (q == "row_cache" && std::scanf("%llu", &a) == 1) {
            const auto [smem, cached] = row_cache(a);
            std::printf("launch %zu %d\n", smem, cached);
            continue;
        } else {
            std::printf("launch ? %s\n", name);
            continue;
        }
        std::printf("launch %u %u %zu\n", cfg.grid.x, cfg.threads, cfg.smem);
    }
}

// ---- buffers -------------------------------------------------------------------------------------

// n values of T at element `off` of a 16-byte-aligned allocation (off 1: misaligned for 128-bit
// accesses, as a view at an odd offset), every byte 0xff (a NaN in each float type) until written.
template <typename T> struct Buf {
    std::vector<uint4> raw;
    T* p;
    size_t n;
    explicit Buf(size_t n, size_t off = 0) : raw(((n + off) * sizeof(T)) / 16 + 2), p(nullptr), n(n) {
        std::memset((void*)raw.data(), 0xff, raw.size() * sizeof(uint4));
        p = reinterpret_cast<T*>(raw.data()) + off;
    }
    T& operator[](size_t i) { return p[i]; }
    const T& operator[](size_t i) const { return p[i]; }
};

// The view of rows·cols values at `offset`: one contiguous dim, or transposed, [rows, cols]
// over a [cols, rows] block (what launch::views leaves of each after merging dims).
inline std::pair<AmpShape, AmpView> flat_or_transposed(i64 rows, i64 cols, bool transposed, i64 offset = 0) {
    AmpShape s{};
    AmpView v{};
    v.offset = offset;
    if (transposed) {
        s.rank = 2;
        s.dims[0] = rows;
        s.dims[1] = cols;
        v.strides[0] = 1;
        v.strides[1] = rows;
    } else {
        s.rank = 1;
        s.dims[0] = rows * cols;
        v.strides[0] = 1;
    }
    return {s, v};
}

// The bits of a value (of at most 8 bytes), for bit-for-bit comparisons and hex output.
template <typename T> u64 bits_of(const T& v) {
    static_assert(sizeof(T) <= 8);
    u64 b = 0;
    std::memcpy(&b, &v, sizeof v);
    return b;
}
template <typename T> double val(T v) { return (double)load(v); }
template <typename T> T from(double v) { return narrow<T>(v); }

template <typename T> const char* dtype_name();
template <> inline const char* dtype_name<float>() { return "f32"; }
template <> inline const char* dtype_name<double>() { return "f64"; }
template <> inline const char* dtype_name<f16_t>() { return "f16"; }
template <> inline const char* dtype_name<bf16_t>() { return "bf16"; }

// ---- errors --------------------------------------------------------------------------------------

// The largest |got - ref| / scale seen; a non-finite value where the reference is finite (or a
// finite one where it is not) counts as infinitely wrong.
struct Err {
    double worst = 0;
    void add(double got, double ref, double scale) {
        double e;
        if (std::isnan(ref)) e = std::isnan(got) ? 0 : INFINITY;
        else if (std::isinf(ref)) e = got == ref ? 0 : INFINITY;
        else e = std::fabs(got - ref) / scale;
        if (!(e <= 1e300)) e = INFINITY;
        worst = std::max(worst, e);
    }
};

struct Report {
    int failures = 0, cases = 0;
    std::map<std::string, std::pair<double, double>> worst;  // family -> (error, tolerance) of the worst ratio
    // One line per check; returns whether it passed.
    bool check(const std::string& family, const std::string& what, double err, double tol) {
        const bool ok = err <= tol;
        ++cases;
        if (!ok) ++failures;
        std::printf("%s %-28s %-52s error %.2e (tolerance %.0e)\n", ok ? "ok  " : "FAIL", family.c_str(), what.c_str(),
                    err, tol);
        // By the ratio to the tolerance (with tolerance 0: any error is infinitely over it).
        auto ratio = [](double e, double t) { return t > 0 ? e / t : (e > 0 ? INFINITY : 0); };
        auto [w, first] = worst.try_emplace(family, err, tol);
        if (!first && ratio(err, tol) > ratio(w->second.first, w->second.second)) w->second = {err, tol};
        return ok;
    }
    int finish() {
        std::printf("worst error per family (relative to its tolerance):\n");
        for (auto& [f, w] : worst) std::printf("  %-28s %.2e (tolerance %.0e)\n", f.c_str(), w.first, w.second);
        std::printf("%d of %d check(s) failed\n", failures, cases);
        return failures == 0 ? 0 : 1;
    }
};

// ---- rounding-aware errors ------------------------------------------------------------------------

// Half a unit in the last place of T at `v` (near 0: the smallest subnormal), for checks of values
// computed in Acc<T> and rounded once into T: such a value may be off by half an ulp of T from
// the reference, plus Acc<T>'s own rounding noise.
template <typename T> double half_ulp(double v) {
    int mant, emin;
    if constexpr (std::is_same_v<T, double>) mant = 52, emin = -1022;
    else if constexpr (std::is_same_v<T, float>) mant = 23, emin = -126;
    else if constexpr (std::is_same_v<T, f16_t>) mant = 10, emin = -14;
    else mant = 7, emin = -126;
    const int e = v == 0 || !std::isfinite(v) ? emin : std::max(std::ilogb(v), emin);
    return std::ldexp(1.0, std::max(e - mant - 1, emin - mant));  // at least the smallest subnormal
}
// Acc<T>'s rounding noise, relative to the size of the terms a value is computed from: a few
// hundred ulps of f32 (sums of a few thousand terms), a few hundred of f64.
template <typename T> double acc_noise() { return std::is_same_v<T, double> ? 1e-13 : 2e-6; }

// Adds `got` against `ref` in units of what a correct kernel may be off by: half an ulp of T at
// the reference plus Acc<T>'s noise at `scale` (the size of the terms). Checked with tolerance 1.
template <typename T> void add_rounded(Err& e, double got, double ref, double scale) {
    e.add(got, ref, half_ulp<T>(ref) + acc_noise<T>() * scale);
}
