// Gathering kernels: the embedding gather, its scatter-add backward and concatenation.
//
// Design notes:
// - The scatter-add is deterministic without atomics: the host sorts the row positions by id
//   (stably, as the CPU backend does) into `order`, with `starts[v]..starts[v + 1]` the
//   positions of id v; one thread per (id, column) sums its rows in that order in Acc<T> and
//   rounds once. Ids with no row get zeros.
// - `cat` runs once per part, copying the part's [outer, d_i·inner] rows into their columns of
//   the output's [outer, Σd·inner] rows.

template <typename T> __device__ void amp_gather_rows(T* out, const T* w, const i64* ids, i64 rows, i64 d) {
    AMP_GRID_LOOP(i, rows * d) {
        i64 r = i / d, j = i - r * d;
        out[i] = w[ids[r] * d + j];
    }
}

template <typename T>
__device__ void amp_scatter_add_rows(T* out, const T* g, const i64* order, const i64* starts, i64 vocab, i64 d) {
    typedef typename Acc<T>::type A;
    AMP_GRID_LOOP(i, vocab * d) {
        i64 v = i / d, j = i - v * d;
        A acc = A(0);
        for (i64 k = starts[v]; k < starts[v + 1]; ++k) acc += load(g[order[k] * d + j]);
        out[i] = store<T>(acc);
    }
}

template <typename T> __device__ void amp_cat(T* out, const T* part, i64 outer, i64 part_row, i64 out_row, i64 at) {
    AMP_GRID_LOOP(i, outer * part_row) {
        i64 o = i / part_row, t = i - o * part_row;
        out[o * out_row + at + t] = part[i];
    }
}

#define AMP_INDEX_KERNELS(SUF)                                                                             \
    extern "C" __global__ void gather_rows_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* w, const i64* ids, \
                                                     i64 rows, i64 d) {                                    \
        amp_gather_rows<amp_t_##SUF>(out, w, ids, rows, d);                                                \
    }                                                                                                      \
    extern "C" __global__ void scatter_add_rows_bwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* g,          \
                                                          const i64* order, const i64* starts, i64 vocab,  \
                                                          i64 d) {                                         \
        amp_scatter_add_rows<amp_t_##SUF>(out, g, order, starts, vocab, d);                                \
    }                                                                                                      \
    extern "C" __global__ void cat_fwd_##SUF(amp_t_##SUF* out, const amp_t_##SUF* part, i64 outer,         \
                                             i64 part_row, i64 out_row, i64 at) {                          \
        amp_cat<amp_t_##SUF>(out, part, outer, part_row, out_row, at);                                     \
    }
