// The optimizer updates: SGD (momentum, Nesterov, L2 decay), Adam and AdamW, and the write-back
// of f32 results into bf16 parameters (nearest, Kahan-compensated, stochastic).
//
// Design notes:
// - Each kernel is one fused pass over a parameter, its gradient and its state, and mirrors the
//   CPU backend's arithmetic operation for operation with explicitly rounded intrinsics
//   (__fmaf_rn where the CPU calls mul_add, __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn /
//   __fsqrt_rn elsewhere), so the compiler cannot contract or reorder anything: the same inputs
//   give the CPU's bits.
// - `flags`, `at` (amp_core::backend::Outcomes; null flags: always applied, row 0): the update
//   is step `at` of a window whose outcomes only the device knows. When `flags[at]` is nonzero
//   every thread returns before touching anything, so a skipped step changes nothing and needs
//   no host round trip; otherwise the step's step-dependent scalars are row k of the rows
//   passed by value, k the number of zeros in `flags[0..at)` (amp_core::backend::outcome_row).

// One row per count of applied steps a window can be at: amp_core::optim::STEPS_PER_READ (a
// test checks they agree, and the Rust structs' sizes follow from it).
#define AMP_STEP_ROWS 32

struct AmpSgdRows {
    float neg_lr[AMP_STEP_ROWS];
    int first[AMP_STEP_ROWS];
};

struct AmpAdamRows {
    float neg_step_size[AMP_STEP_ROWS];
    float bc2_sqrt[AMP_STEP_ROWS];
    float decay_mul[AMP_STEP_ROWS];
};

// The row this step's update uses, or -1 when it is skipped.
__device__ __forceinline__ int amp_row(const float* flags, int at) {
    if (!flags) return 0;
    if (flags[at] != 0.0f) return -1;
    int k = 0;
    for (int i = 0; i < at; ++i) k += flags[i] == 0.0f;
    return k;
}

extern "C" __global__ void sgd_update_fwd_f32(float* param, const float* grad, float* buf, i64 n, AmpSgdRows rows,
                                              int decay, float wd, float m, float keep, int nesterov,
                                              const float* flags, int at) {
    const int r = amp_row(flags, at);
    if (r < 0) return;
    const float neg_lr = rows.neg_lr[r];
    const int first = rows.first[r];
    AMP_GRID_LOOP(i, n) {
        float p = param[i], g = grad[i];
        if (decay) g = __fmaf_rn(p, wd, g);
        float d = g;
        if (buf) {
            float b = first ? g : __fmaf_rn(g, keep, __fmul_rn(buf[i], m));
            buf[i] = b;
            d = nesterov ? __fmaf_rn(b, m, g) : b;
        }
        param[i] = __fmaf_rn(d, neg_lr, p);
    }
}

extern "C" __global__ void adam_update_fwd_f32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                                               i64 n, AmpAdamRows rows, float w, float b2, float one_minus_beta2,
                                               float eps, int l2, float wd, int decoupled, const float* flags,
                                               int at) {
    const int r = amp_row(flags, at);
    if (r < 0) return;
    const float neg_step_size = rows.neg_step_size[r], bc2_sqrt = rows.bc2_sqrt[r], decay_mul = rows.decay_mul[r];
    const bool small = fabsf(w) < 0.5f;
    AMP_GRID_LOOP(i, n) {
        float p = param[i], g = grad[i], m = exp_avg[i], v = exp_avg_sq[i];
        if (decoupled) p = __fmul_rn(p, decay_mul);
        if (l2) g = __fmaf_rn(p, wd, g);
        float diff = __fsub_rn(g, m);
        m = small ? __fmaf_rn(w, diff, m) : __fmaf_rn(__fsub_rn(w, 1.0f), diff, g);
        v = __fadd_rn(__fmul_rn(v, b2), __fmul_rn(__fmul_rn(one_minus_beta2, g), g));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2_sqrt), eps);
        p = __fadd_rn(p, __fdiv_rn(__fmul_rn(neg_step_size, m), denom));
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

extern "C" __global__ void write_bf16_nearest_fwd_f32(bf16_t* param, const float* updated, i64 n) {
    AMP_GRID_LOOP(i, n) param[i] = store<bf16_t>(updated[i]);
}

extern "C" __global__ void write_bf16_kahan_fwd_f32(bf16_t* param, bf16_t* comp, const float* updated, i64 n) {
    AMP_GRID_LOOP(i, n) {
        float old = load(param[i]);
        float y = __fadd_rn(__fsub_rn(updated[i], old), load(comp[i]));
        bf16_t nw = store<bf16_t>(__fadd_rn(old, y));
        comp[i] = store<bf16_t>(__fsub_rn(y, __fsub_rn(load(nw), old)));
        param[i] = nw;
    }
}

__device__ __forceinline__ u64 amp_splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void write_bf16_stochastic_fwd_f32(bf16_t* param, const float* updated, i64 n, u64 key) {
    AMP_GRID_LOOP(i, n) {
        float w = updated[i];
        if (amp_finite(w)) {
            u32 r = (u32)(amp_splitmix64(key ^ ((u64)i * 0x9E3779B97F4A7C15ull)) & 0xFFFFull);
            bf16_t b;
            b.bits = (unsigned short)((__float_as_uint(w) + r) >> 16);
            param[i] = b;
        } else {
            param[i] = store<bf16_t>(w);
        }
    }
}
