// A host emulation of the CUDA features the fused attention kernels use, so that the kernel
// source (src/kernels/attention_flash.cu, included as it is) runs on a machine with no GPU
// and its indexing, masking, online softmax and fragment handling are checked against a
// reference (flash_attention.cpp).
//
// Design notes:
// - Every thread of a block is a std::thread; blocks run one after another, so `__shared__`
//   arrays (function-local statics here) are the block's. `__syncthreads` is a barrier of the
//   block (its waiters yield: YieldBarrier), and the warp-collective operations
//   (`__shfl_xor_sync`, `amp_mma`) exchange values through the warp's `Exchange`, one barrier
//   of the warp each.
// - `amp_mma` rebuilds the warp's whole A (16 x 16) and B (16 x 8) from every lane's registers
//   by the PTX ISA's fragment table (the one src/kernels/mma.cuh documents) and adds A·B in
//   f32 into each lane's part of D; a layout misread in the kernels shows up as wrong values.
// - f16 is the compiler's _Float16 (round to nearest even); bf16 rounds to nearest even in
//   software; f32 math is the C library's.
// - `uint4` is 16-byte aligned as on the GPU, so a misaligned 128-bit access may fault here too
//   (where the compiler emits an aligned move).
// - More lenient than a GPU: barriers count arrivals from any call site (a `__syncthreads` or
//   warp collective in divergent code passes), misaligned 32-bit accesses do not fault, shared
//   arrays start zeroed and blocks never overlap (so reads of unwritten shared memory and races
//   between blocks go unseen), and the math is the C library's, summed in order in f32.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

struct f16_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };
typedef f16_t amp_t_f16;
typedef bf16_t amp_t_bf16;

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { u32 x, y, z, w; };
inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return uint4{x, y, z, w}; }

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// ---- conversions (the prelude's, in software) ------------------------------------------------

inline float load(f16_t v) {
    _Float16 h;
    std::memcpy(&h, &v.bits, 2);
    return (float)h;
}
inline float load(bf16_t v) {
    u32 u = (u32)v.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
template <typename T> T store(float v);
template <> inline f16_t store<f16_t>(float v) {
    _Float16 h = (_Float16)v;
    f16_t r;
    std::memcpy(&r.bits, &h, 2);
    return r;
}
template <> inline bf16_t store<bf16_t>(float v) {
    u32 u;
    std::memcpy(&u, &v, 4);
    bf16_t r;
    if (std::isnan(v)) {
        r.bits = (unsigned short)((u >> 16) | 0x40);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}
template <typename A> A amp_neg_inf() { return -INFINITY; }
template <typename A> A amp_max(A a, A b) { return (a > b || std::isnan(a)) ? a : b; }

// ---- blocks and warps ------------------------------------------------------------------------

// A reusable barrier whose waiters yield the core instead of sleeping: with 128 threads on a
// few cores, waking each sleeper through the kernel cost several times the emulation's work.
class YieldBarrier {
  public:
    explicit YieldBarrier(int count) : count_(count) {}
    void arrive_and_wait() {
        const unsigned phase = phase_.load(std::memory_order_acquire);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
            arrived_.store(0, std::memory_order_relaxed);
            phase_.store(phase + 1, std::memory_order_release);
        } else {
            while (phase_.load(std::memory_order_acquire) == phase) std::this_thread::yield();
        }
    }

  private:
    const int count_;
    std::atomic<int> arrived_{0};
    std::atomic<unsigned> phase_{0};
};

// What the lanes of a warp exchange in one collective operation.
struct Exchange {
    float f[32];
    u32 a[32][4], b[32][2];
};
// Two exchanges used in turn, so each collective needs one barrier: a lane writes exchange k + 2
// only after the barrier of collective k + 1, which every lane reaches after reading exchange k.
struct Warp {
    YieldBarrier bar{32};
    Exchange x[2];
};
struct Block {
    explicit Block(int threads) : bar(threads), warps(threads / 32) {
        for (auto& w : warps) w = std::make_unique<Warp>();
    }
    YieldBarrier bar;
    std::vector<std::unique_ptr<Warp>> warps;
};
thread_local Block* amp_emu_block = nullptr;

inline Warp& amp_emu_warp() { return *amp_emu_block->warps[threadIdx.x / 32]; }

// This lane's exchange for its next collective (every lane of a warp makes the same calls).
thread_local unsigned amp_emu_turn = 0;
inline Exchange& amp_emu_exchange() { return amp_emu_warp().x[amp_emu_turn++ & 1]; }

inline void __syncthreads() { amp_emu_block->bar.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int mask) {
    Exchange& x = amp_emu_exchange();
    const int lane = threadIdx.x & 31;
    x.f[lane] = v;
    amp_emu_warp().bar.arrive_and_wait();
    return x.f[lane ^ mask];
}

template <typename T> inline float amp_emu_half(u32 r, int hi) {
    T v;
    v.bits = (unsigned short)(hi ? r >> 16 : r & 0xffffu);
    return load(v);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D += A·B over the warp (see mma.cuh).
template <typename T> inline void amp_emu_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    Exchange& w = amp_emu_exchange();
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
    for (int i = 0; i < 2; ++i) w.b[lane][i] = b[i];
    amp_emu_warp().bar.arrive_and_wait();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, c = (l & 3) * 2;
        for (int e = 0; e < 2; ++e) {
            A[g][c + e] = amp_emu_half<T>(w.a[l][0], e);
            A[g + 8][c + e] = amp_emu_half<T>(w.a[l][1], e);
            A[g][c + 8 + e] = amp_emu_half<T>(w.a[l][2], e);
            A[g + 8][c + 8 + e] = amp_emu_half<T>(w.a[l][3], e);
            B[c + e][g] = amp_emu_half<T>(w.b[l][0], e);
            B[c + 8 + e][g] = amp_emu_half<T>(w.b[l][1], e);
        }
    }
    const int g = lane >> 2, c = (lane & 3) * 2;
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = c + (i & 1);
        float acc = 0.f;
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        d[i] += acc;
    }
}
inline void amp_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2], f16_t) { amp_emu_mma<f16_t>(d, a, b); }
inline void amp_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2], bf16_t) { amp_emu_mma<bf16_t>(d, a, b); }

// Runs `body` as a kernel over `grid` blocks of `threads` threads (a multiple of 32).
template <typename F> void amp_emu_launch(dim3 grid, unsigned threads, F body) {
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            Block block((int)threads);
            std::vector<std::thread> ts;
            for (unsigned i = 0; i < threads; ++i)
                ts.emplace_back([&, i] {
                    threadIdx = dim3{i, 0, 0};
                    blockIdx = dim3{bx, by, 0};
                    blockDim = dim3{threads, 1, 1};
                    gridDim = grid;
                    amp_emu_block = &block;
                    body();
                });
            for (auto& t : ts) t.join();
        }
}
