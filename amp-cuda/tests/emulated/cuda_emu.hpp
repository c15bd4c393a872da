// A host emulation of the CUDA features amp-cuda's kernels use, so that kernel sources
// (src/kernels/*.cu, included as they are) run on a machine with no GPU and are checked against
// references (flash_attention.cpp, rows.cpp, amp_step.cpp, batch_norm.cpp, pool_conv.cpp,
// reduce_index.cpp).
//
// Design notes:
// - This header is the CUDA runtime and builtins, then the real prelude (src/kernels/
//   prelude.cuh: types, layouts, Pack16, block reductions), then what the prelude leaves to the
//   emulation under AMP_HOST_EMULATION: the f16/bf16 conversions (inline PTX on the GPU) and
//   `amp_mma` (mma.cuh on the GPU).
// - Every thread of a block is a fiber (a ucontext with a stack of its own) on the calling
//   thread; blocks run one after another, so `__shared__` arrays (function-local statics here)
//   are the block's. A fiber runs until it waits at a barrier, then hands the core to the next
//   (`amp_emu_yield`): `__syncthreads` is a barrier of the block (YieldBarrier),
//   `__syncthreads_or` a barrier with an OR, and the warp-collective operations
//   (`__shfl_xor_sync` on float and double, `amp_mma`) exchange values through the warp's
//   `Exchange`, one barrier of the warp each. Fibers replaced one OS thread per CUDA thread,
//   whose yielding spins were most of the emulation's time (5-6x its own work, in the kernel).
//   The per-thread builtins (`threadIdx`, the collectives' turn counters) are switched with
//   the fiber.
// - Dynamic shared memory: `extern __shared__ __align__(16) unsigned char amp_dyn[]` (rows.cu)
//   becomes, with `amp_dyn` defined below as `(*amp_emu_dyn())` and `extern` defined empty
//   around the include (`__shared__` is `static`, and `extern static` does not compile), a
//   redeclaration of `amp_emu_dyn`, a function returning the running block's buffer: exactly
//   the launch's size, 16-byte aligned, filled with 0xff bytes (a NaN in f32 and f64) before
//   each block so reads of unwritten memory show, and followed by a guard checked after each
//   block, so writes past the launch's size abort.
// - `amp_mma` rebuilds the warp's whole A (16 x 16) and B (16 x 8) from every lane's registers
//   by the PTX ISA's fragment table (the one src/kernels/mma.cuh documents) and adds A·B in
//   f32 into each lane's part of D; a layout misread in the kernels shows up as wrong values.
// - f16 is the compiler's _Float16 (round to nearest even); bf16 rounds to nearest even in
//   software (from double by rounding to odd in f32 first, one rounding overall); f32 and f64
//   math is the C library's. The `__*_rn` intrinsics are plain IEEE operations (`__fmaf_rn` is
//   fmaf): compile with -ffp-contract=off so the compiler fuses nothing either.
// - `uint4` is 16-byte aligned as on the GPU, so a misaligned 128-bit access may fault here too
//   (where the compiler emits an aligned move).
// - More lenient than a GPU: barriers count arrivals from any call site (a `__syncthreads` or
//   warp collective in divergent code passes), misaligned 32-bit accesses do not fault, static
//   shared arrays start zeroed and keep their values from block to block, blocks never overlap
//   (so races between blocks go unseen), threads of a block switch only at barriers, in thread
//   order in even blocks and in reverse order in odd ones (so a read of another thread's write
//   with no barrier between them sees the old value in one of the two, where the data make it
//   show: a missing barrier fails, a race that a barrier orders by luck does not), the limits
//   of the hardware (48 KiB of shared memory a block, registers, `__launch_bounds__`) are not
//   checked (tests/ptx.rs checks them on the compiled kernels), and the math is the C
//   library's, summed in order.
#pragma once

#include <math.h>  // the C++ <math.h>: float overloads of exp, log, sqrt... in the global namespace

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>

#define AMP_HOST_EMULATION 1

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(n)

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// ---- builtins ----------------------------------------------------------------------------------

template <typename To, typename From> inline To amp_emu_bits(From v) {
    static_assert(sizeof(To) == sizeof(From));
    To r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}
inline float __uint_as_float(unsigned v) { return amp_emu_bits<float>(v); }
inline float __int_as_float(int v) { return amp_emu_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return amp_emu_bits<unsigned>(v); }
inline double __longlong_as_double(long long v) { return amp_emu_bits<double>(v); }
inline long long __double_as_longlong(double v) { return amp_emu_bits<long long>(v); }

inline float __double2float_rn(double v) { return (float)v; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

// CUDA's integer min and max (reduce.cu's chunk ends).
inline int min(int a, int b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

[[noreturn]] inline void __trap() {
    std::fprintf(stderr, "emulated kernel: __trap() in block %u thread %u\n", blockIdx.x, threadIdx.x);
    std::abort();
}

// ---- blocks and warps ------------------------------------------------------------------------

// The running fiber's state that the builtins read as per-thread, kept while another runs.
struct AmpEmuFiber {
    ucontext_t ctx;
    unsigned thread;
    unsigned turn = 0, or_turn = 0;  // amp_emu_turn and amp_emu_or_turn (below)
    bool done = false;
};
thread_local ucontext_t amp_emu_scheduler;
thread_local AmpEmuFiber* amp_emu_fiber = nullptr;
// Barrier arrivals so far: a round of the scheduler that adds none, with threads still live,
// is a deadlock (a barrier that some thread never reaches), reported instead of spinning.
thread_local unsigned long long amp_emu_arrivals = 0;

// Hands the core back to the launch's scheduler, which resumes the next fiber.
inline void amp_emu_yield() { swapcontext(&amp_emu_fiber->ctx, &amp_emu_scheduler); }

// A reusable barrier of fibers: a waiter yields until the last arrival moves the phase on.
class YieldBarrier {
  public:
    explicit YieldBarrier(int count) : count_(count) {}
    void arrive_and_wait() {
        const unsigned phase = phase_;
        ++amp_emu_arrivals;
        if (++arrived_ == count_) {
            arrived_ = 0;
            phase_ = phase + 1;
        } else {
            while (phase_ == phase) amp_emu_yield();
        }
    }

  private:
    const int count_;
    // Plain counters: the fibers share one OS thread and switch only in `amp_emu_yield`.
    int arrived_ = 0;
    unsigned phase_ = 0;
};

// What the lanes of a warp exchange in one collective operation.
struct Exchange {
    unsigned long long v[32];  // a shuffled value's bits
    unsigned a[32][4], b[32][2];
};
// Two exchanges used in turn, so each collective needs one barrier: a lane writes exchange k + 2
// only after the barrier of collective k + 1, which every lane reaches after reading exchange k.
struct Warp {
    YieldBarrier bar{32};
    Exchange x[2];
};

// Bytes after a block's dynamic shared memory that must stay as they were.
#define AMP_EMU_GUARD 256

struct Block {
    Block(int threads, size_t dyn_bytes) : bar(threads), warps(threads / 32), dyn_bytes(dyn_bytes) {
        for (auto& w : warps) w = std::make_unique<Warp>();
        dyn.reset(new uint4[(dyn_bytes + AMP_EMU_GUARD) / 16 + 1]);
        refill();
    }
    // Before each block: unwritten memory reads as 0xff bytes, the guard as 0xa5.
    void refill() {
        unsigned char* p = reinterpret_cast<unsigned char*>(dyn.get());
        std::memset(p, 0xff, dyn_bytes);
        std::memset(p + dyn_bytes, 0xa5, AMP_EMU_GUARD);
        for (auto& o : ors) o = 0;
    }
    // After each block: nothing was written past the launch's dynamic shared memory.
    void check_guard() const {
        const unsigned char* p = reinterpret_cast<const unsigned char*>(dyn.get()) + dyn_bytes;
        for (int i = 0; i < AMP_EMU_GUARD; ++i) {
            if (p[i] != 0xa5) {
                std::fprintf(stderr, "emulated kernel: block (%u, %u) wrote byte %zu of a %zu-byte dynamic shared memory\n",
                             blockIdx.x, blockIdx.y, dyn_bytes + i, dyn_bytes);
                std::abort();
            }
        }
    }
    YieldBarrier bar;
    std::vector<std::unique_ptr<Warp>> warps;
    size_t dyn_bytes;
    std::unique_ptr<uint4[]> dyn;
    int ors[3];  // __syncthreads_or's slots, used in turn
};
thread_local Block* amp_emu_block = nullptr;

inline Warp& amp_emu_warp() { return *amp_emu_block->warps[threadIdx.x / 32]; }

// This lane's exchange for its next collective (every lane of a warp makes the same calls).
thread_local unsigned amp_emu_turn = 0;
inline Exchange& amp_emu_exchange() { return amp_emu_warp().x[amp_emu_turn++ & 1]; }

// The running block's dynamic shared memory (see the design notes: rows.cu's `amp_dyn`).
static inline unsigned char (*amp_emu_dyn())[] {
    return reinterpret_cast<unsigned char (*)[]>(amp_emu_block->dyn.get());
}
#define amp_dyn (*amp_emu_dyn())

inline void __syncthreads() { amp_emu_block->bar.arrive_and_wait(); }

// Call k ORs into slot k % 3 and reads it after the barrier; thread 0 clears slot (k + 2) % 3
// (call k - 1's, which every thread read before arriving) for call k + 2, which no thread
// reaches before thread 0 arrives at call k + 1's barrier.
thread_local unsigned amp_emu_or_turn = 0;
inline int __syncthreads_or(int p) {
    Block& b = *amp_emu_block;
    const unsigned k = amp_emu_or_turn++;
    if (p) b.ors[k % 3] = 1;
    b.bar.arrive_and_wait();
    const int r = b.ors[k % 3];
    if (threadIdx.x == 0) b.ors[(k + 2) % 3] = 0;
    return r;
}

template <typename V> inline V __shfl_xor_sync(unsigned, V v, int mask) {
    static_assert(sizeof(V) <= 8, "a shuffled value is at most 64 bits");
    Exchange& x = amp_emu_exchange();
    const int lane = threadIdx.x & 31;
    x.v[lane] = 0;
    std::memcpy(&x.v[lane], &v, sizeof v);
    amp_emu_warp().bar.arrive_and_wait();
    V r;
    std::memcpy(&r, &x.v[lane ^ mask], sizeof r);
    return r;
}

// Each fiber's stack, and the inaccessible page below it, so an overflow faults instead of
// writing into the next fiber's stack.
#define AMP_EMU_STACK (256 << 10)
#define AMP_EMU_STACK_GUARD 4096

// Stacks for `threads` fibers, reserved once per thread and reused by every launch (pages are
// committed only as a kernel's frames touch them).
inline char* amp_emu_stacks(unsigned threads) {
    thread_local char* stacks = nullptr;
    thread_local unsigned count = 0;
    if (threads > count) {
        if (stacks) munmap(stacks, (size_t)count * AMP_EMU_STACK);
        const size_t bytes = (size_t)threads * AMP_EMU_STACK;
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            std::perror("emulated launch: fiber stacks");
            std::abort();
        }
        stacks = static_cast<char*>(p);
        count = threads;
        for (unsigned i = 0; i < threads; ++i) mprotect(stacks + (size_t)i * AMP_EMU_STACK, AMP_EMU_STACK_GUARD, PROT_NONE);
    }
    return stacks;
}

// The kernel body the fibers of the running launch call.
thread_local void (*amp_emu_entry)(void*) = nullptr;
thread_local void* amp_emu_entry_arg = nullptr;
inline void amp_emu_fiber_main() {
    amp_emu_entry(amp_emu_entry_arg);
    amp_emu_fiber->done = true;  // returning resumes the scheduler (uc_link)
}

// Runs `body` as a kernel over `grid` blocks of `threads` threads (a multiple of 32) with
// `dyn_bytes` of dynamic shared memory: each block's threads as fibers, resumed in turn (in
// thread order in even blocks, reversed in odd ones) until every one has returned.
template <typename F> void amp_emu_launch(dim3 grid, unsigned threads, size_t dyn_bytes, F body) {
    if (threads == 0 || threads % 32 != 0 || threads > 1024) {
        std::fprintf(stderr, "emulated launch: %u threads a block\n", threads);
        std::abort();
    }
    char* stacks = amp_emu_stacks(threads);
    Block block((int)threads, dyn_bytes);
    blockDim = dim3{threads, 1, 1};
    gridDim = grid;
    amp_emu_block = &block;
    amp_emu_entry = [](void* f) { (*static_cast<F*>(f))(); };
    amp_emu_entry_arg = &body;
    std::vector<AmpEmuFiber> fibers(threads);
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = dim3{bx, by, 0};
            for (unsigned i = 0; i < threads; ++i) {
                AmpEmuFiber& f = fibers[i];
                f = AmpEmuFiber{};
                f.thread = i;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = stacks + (size_t)i * AMP_EMU_STACK + AMP_EMU_STACK_GUARD;
                f.ctx.uc_stack.ss_size = AMP_EMU_STACK - AMP_EMU_STACK_GUARD;
                f.ctx.uc_link = &amp_emu_scheduler;
                makecontext(&f.ctx, amp_emu_fiber_main, 0);
            }
            const bool reverse = (bx + by) % 2 == 1;
            for (unsigned live = threads; live > 0;) {
                const unsigned long long arrivals = amp_emu_arrivals;
                const unsigned live_before = live;
                for (unsigned j = 0; j < threads; ++j) {
                    AmpEmuFiber& f = fibers[reverse ? threads - 1 - j : j];
                    if (f.done) continue;
                    threadIdx = dim3{f.thread, 0, 0};
                    amp_emu_turn = f.turn;
                    amp_emu_or_turn = f.or_turn;
                    amp_emu_fiber = &f;
                    swapcontext(&amp_emu_scheduler, &f.ctx);
                    f.turn = amp_emu_turn;
                    f.or_turn = amp_emu_or_turn;
                    live -= f.done;
                }
                if (live == live_before && amp_emu_arrivals == arrivals) {
                    std::fprintf(stderr,
                                 "emulated kernel: block (%u, %u) deadlocks: %u of its %u threads wait at "
                                 "barriers that are never completed (one that some thread skips)\n",
                                 bx, by, live, threads);
                    std::abort();
                }
            }
            amp_emu_fiber = nullptr;
            block.check_guard();
            block.refill();
        }
}

// ---- the real prelude ------------------------------------------------------------------------

#include "prelude.cuh"

// ---- what the prelude leaves to the emulation: conversions ---------------------------------

inline float load(f16_t v) { return (float)amp_emu_bits<_Float16>(v.bits); }
template <> inline f16_t store<f16_t>(float v) { return f16_t{amp_emu_bits<unsigned short>((_Float16)v)}; }
template <> inline f16_t narrow<f16_t>(double v) { return f16_t{amp_emu_bits<unsigned short>((_Float16)v)}; }

template <> inline bf16_t store<bf16_t>(float v) {
    unsigned u = __float_as_uint(v);
    if (std::isnan(v)) return bf16_t{(unsigned short)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return bf16_t{(unsigned short)(u >> 16)};
}
// Rounded to odd in f32 (truncated, the last bit set if anything was dropped), then to
// nearest even in bf16: one correct rounding, as cvt.rn.bf16.f64.
template <> inline bf16_t narrow<bf16_t>(double v) {
    if (std::isnan(v)) return store<bf16_t>((float)v);
    float f = (float)v;
    if ((double)f != v) {
        if (std::fabs((double)f) > std::fabs(v)) f = std::nextafter(f, 0.0f);
        f = __uint_as_float(__float_as_uint(f) | 1u);
    }
    return store<bf16_t>(f);
}

// ---- what the prelude leaves to the emulation: mma.cuh ------------------------------------

template <typename T> inline float amp_emu_half(unsigned r, int hi) {
    return load(T{(unsigned short)(hi ? r >> 16 : r & 0xffffu)});
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D += A·B over the warp (see mma.cuh).
template <typename T>
inline void amp_emu_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
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
