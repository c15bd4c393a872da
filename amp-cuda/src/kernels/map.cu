// Elementwise maps over strided, broadcasting layouts: copies, fills, writes into views, casts,
// the unary ops (forward and backward), the binary ops and `where`.
//
// Design notes:
// - One output element per loop step, output contiguous. `mode` (set by the host): 2 when every
//   operand is contiguous and 16-byte aligned (128-bit loads and stores, 16/sizeof(T) elements
//   per step, then a scalar tail), 1 when contiguous but not aligned, 0 for strided views (the
//   multi-index is decoded once per element and applied to each operand's strides).
// - An op's expressions come from its Rust value (`UnaryOp::CUDA_FORWARD`...): the host
//   generates a struct `amp_op` with `fwd`, `der` or `apply` in terms of `acc_t`, and the
//   wrapper macros below instantiate the templates for it.

// out[i] = x[view(i)]
template <typename T> __device__ void amp_copy(T* out, const T* x, AmpShape s, AmpView vx, i64 n) {
    AMP_GRID_LOOP(i, n) out[i] = x[amp_offset(s, vx, i)];
}

// out[i] = value
template <typename T> __device__ void amp_fill(T* out, u64 bits, i64 n) {
    T v = from_bits<T>(bits);
    AMP_GRID_LOOP(i, n) out[i] = v;
}

// dst[view_d(i)] = src[view_s(i)], or += in the accumulation type (one rounding) when `add`.
template <typename T>
__device__ void amp_write_into(T* dst, const T* src, AmpShape s, AmpView vd, AmpView vs, i64 n, int add) {
    AMP_GRID_LOOP(i, n) {
        i64 idx[AMP_MAX_RANK];
        amp_index(s, i, idx);
        i64 od = amp_at(s, vd, idx), os = amp_at(s, vs, idx);
        if (add) {
            dst[od] = store<T>(load(dst[od]) + load(src[os]));
        } else {
            dst[od] = src[os];
        }
    }
}

// out[i] = x[view(i)] rounded once into D.
template <typename S, typename D> __device__ void amp_cast(D* out, const S* x, AmpShape s, AmpView vx, i64 n, int mode) {
    if (mode != 0) {
        const S* xs = x + vx.offset;
        AMP_GRID_LOOP(i, n) out[i] = convert<S, D>(xs[i]);
    } else {
        AMP_GRID_LOOP(i, n) out[i] = convert<S, D>(x[amp_offset(s, vx, i)]);
    }
}

// out[i] = Op::fwd(x[view(i)], p)
template <typename T, typename Op>
__device__ void amp_unary_fwd(T* out, const T* x, AmpShape s, AmpView vx, i64 n, double p, int mode) {
    typedef typename Acc<T>::type A;
    const A pp = (A)p;
    if (mode == 2) {
        const int V = 16 / sizeof(T);
        const i64 nv = n / V;
        const uint4* xv = reinterpret_cast<const uint4*>(x + vx.offset);
        uint4* ov = reinterpret_cast<uint4*>(out);
        AMP_GRID_LOOP(i, nv) {
            Pack16<T> in, o;
            in.raw = xv[i];
#pragma unroll
            for (int k = 0; k < V; ++k) o.v[k] = store<T>(Op::fwd(load(in.v[k]), pp));
            ov[i] = o.raw;
        }
        const T* xs = x + vx.offset;
        AMP_GRID_LOOP(t, n - nv * V) {
            i64 j = nv * V + t;
            out[j] = store<T>(Op::fwd(load(xs[j]), pp));
        }
    } else if (mode == 1) {
        const T* xs = x + vx.offset;
        AMP_GRID_LOOP(i, n) out[i] = store<T>(Op::fwd(load(xs[i]), pp));
    } else {
        AMP_GRID_LOOP(i, n) out[i] = store<T>(Op::fwd(load(x[amp_offset(s, vx, i)]), pp));
    }
}

// out[i] = g[i] * Op::der(x[i], y[i], p) over three views of one shape; `mode` as for the
// forward (an operand the derivative does not read is never loaded: the compiler drops it).
template <typename T, typename Op>
__device__ void amp_unary_bwd(T* out, const T* x, const T* y, const T* g, AmpShape s, AmpView vx, AmpView vy,
                              AmpView vg, i64 n, double p, int mode) {
    typedef typename Acc<T>::type A;
    const A pp = (A)p;
    if (mode != 0) {
        const T* xs = x + vx.offset;
        const T* ys = y + vy.offset;
        const T* gs = g + vg.offset;
        i64 done = 0;
        if (mode == 2) {
            const int V = 16 / sizeof(T);
            const i64 nv = n / V;
            const uint4* xv = reinterpret_cast<const uint4*>(xs);
            const uint4* yv = reinterpret_cast<const uint4*>(ys);
            const uint4* gv = reinterpret_cast<const uint4*>(gs);
            uint4* ov = reinterpret_cast<uint4*>(out);
            AMP_GRID_LOOP(i, nv) {
                Pack16<T> a, b, c, o;
                a.raw = xv[i];
                b.raw = yv[i];
                c.raw = gv[i];
#pragma unroll
                for (int k = 0; k < V; ++k) o.v[k] = store<T>(load(c.v[k]) * Op::der(load(a.v[k]), load(b.v[k]), pp));
                ov[i] = o.raw;
            }
            done = nv * V;
        }
        AMP_GRID_LOOP(t, n - done) {
            const i64 j = done + t;
            out[j] = store<T>(load(gs[j]) * Op::der(load(xs[j]), load(ys[j]), pp));
        }
    } else {
        AMP_GRID_LOOP(i, n) {
            i64 idx[AMP_MAX_RANK];
            amp_index(s, i, idx);
            A xv = load(x[amp_at(s, vx, idx)]), yv = load(y[amp_at(s, vy, idx)]), gv = load(g[amp_at(s, vg, idx)]);
            out[i] = store<T>(gv * Op::der(xv, yv, pp));
        }
    }
}

// out[i] = Op::apply(a[view_a(i)], b[view_b(i)], p), both broadcast to the output's shape.
template <typename T, typename Op>
__device__ void amp_binary(T* out, const T* a, const T* b, AmpShape s, AmpView va, AmpView vb, i64 n, double p,
                           int mode) {
    typedef typename Acc<T>::type A;
    const A pp = (A)p;
    if (mode == 2) {
        const int V = 16 / sizeof(T);
        const i64 nv = n / V;
        const uint4* av = reinterpret_cast<const uint4*>(a + va.offset);
        const uint4* bv = reinterpret_cast<const uint4*>(b + vb.offset);
        uint4* ov = reinterpret_cast<uint4*>(out);
        AMP_GRID_LOOP(i, nv) {
            Pack16<T> x, y, o;
            x.raw = av[i];
            y.raw = bv[i];
#pragma unroll
            for (int k = 0; k < V; ++k) o.v[k] = store<T>(Op::apply(load(x.v[k]), load(y.v[k]), pp));
            ov[i] = o.raw;
        }
        const T* as = a + va.offset;
        const T* bs = b + vb.offset;
        AMP_GRID_LOOP(t, n - nv * V) {
            i64 j = nv * V + t;
            out[j] = store<T>(Op::apply(load(as[j]), load(bs[j]), pp));
        }
    } else if (mode == 1) {
        const T* as = a + va.offset;
        const T* bs = b + vb.offset;
        AMP_GRID_LOOP(i, n) out[i] = store<T>(Op::apply(load(as[i]), load(bs[i]), pp));
    } else {
        AMP_GRID_LOOP(i, n) {
            i64 idx[AMP_MAX_RANK];
            amp_index(s, i, idx);
            out[i] = store<T>(Op::apply(load(a[amp_at(s, va, idx)]), load(b[amp_at(s, vb, idx)]), pp));
        }
    }
}

// out[i] = mask[i] ? a[i] : b[i], all three broadcast to the output's shape (mask: one byte each).
template <typename T>
__device__ void amp_where(T* out, const unsigned char* mask, const T* a, const T* b, AmpShape s, AmpView vm,
                          AmpView va, AmpView vb, i64 n) {
    AMP_GRID_LOOP(i, n) {
        i64 idx[AMP_MAX_RANK];
        amp_index(s, i, idx);
        out[i] = mask[amp_at(s, vm, idx)] ? a[amp_at(s, va, idx)] : b[amp_at(s, vb, idx)];
    }
}

// ---- entry points (kernel names `<op>_<fwd|bwd>_<dtype>`) ------------------------------------

#define AMP_COPY_KERNELS(SUF)                                                                              \
    extern "C" __global__ void copy_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, AmpShape s, AmpView vx, \
                                              i64 n) {                                                     \
        amp_copy<amp_t_##SUF>(out, x, s, vx, n);                                                           \
    }                                                                                                      \
    extern "C" __global__ void fill_fwd_##SUF(amp_t_##SUF* out, u64 bits, i64 n) {                         \
        amp_fill<amp_t_##SUF>(out, bits, n);                                                               \
    }                                                                                                      \
    extern "C" __global__ void write_into_fwd_##SUF(amp_t_##SUF* dst, const amp_t_##SUF* src, AmpShape s,  \
                                                    AmpView vd, AmpView vs, i64 n, int add) {              \
        amp_write_into<amp_t_##SUF>(dst, src, s, vd, vs, n, add);                                          \
    }                                                                                                      \
    extern "C" __global__ void where_fwd_##SUF(amp_t_##SUF* out, const unsigned char* mask,                \
                                               const amp_t_##SUF* a, const amp_t_##SUF* b, AmpShape s,     \
                                               AmpView vm, AmpView va, AmpView vb, i64 n) {                \
        amp_where<amp_t_##SUF>(out, mask, a, b, s, vm, va, vb, n);                                         \
    }

// Kernel `cast_to_<DST>_fwd_<SRC>`.
#define AMP_CAST_KERNEL(SRC, DST)                                                                          \
    extern "C" __global__ void cast_to_##DST##_fwd_##SRC(amp_t_##DST* out, const amp_t_##SRC* x, AmpShape s, \
                                                         AmpView vx, i64 n, int mode) {                    \
        amp_cast<amp_t_##SRC, amp_t_##DST>(out, x, s, vx, n, mode);                                        \
    }

#define AMP_UNARY_KERNELS(NAME, SUF)                                                                       \
    extern "C" __global__ void NAME##_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, AmpShape s,        \
                                                AmpView vx, i64 n, double p, int mode) {                   \
        amp_unary_fwd<amp_t_##SUF, amp_op>(out, x, s, vx, n, p, mode);                                     \
    }                                                                                                      \
    extern "C" __global__ void NAME##_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* x, const amp_t_##SUF* y, \
                                                const amp_t_##SUF* g, AmpShape s, AmpView vx, AmpView vy,  \
                                                AmpView vg, i64 n, double p, int mode) {                   \
        amp_unary_bwd<amp_t_##SUF, amp_op>(out, x, y, g, s, vx, vy, vg, n, p, mode);                       \
    }

#define AMP_BINARY_KERNEL(NAME, SUF)                                                                       \
    extern "C" __global__ void NAME##_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* a, const amp_t_##SUF* b, \
                                                AmpShape s, AmpView va, AmpView vb, i64 n, double p,       \
                                                int mode) {                                                \
        amp_binary<amp_t_##SUF, amp_op>(out, a, b, s, va, vb, n, p, mode);                                 \
    }
