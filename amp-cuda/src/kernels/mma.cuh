// Warp-level tensor-core products for the fused attention kernels (attention_flash.cu).
//
// Design notes:
// - One mma.sync m16n8k16 per call: D (16 x 8, f32) += A (16 x 16) · B (16 x 8) with A and B in
//   f16 or bf16 (the tag argument picks the instruction). The fragment layouts are the PTX
//   ISA's ("Matrix Fragments for mma.m16n8k16 with floating point type"), with
//   g = lane / 4 and c = 2 (lane % 4):
//     a[0] = A[g][c, c+1]      a[1] = A[g+8][c, c+1]   a[2] = A[g][c+8, c+9]   a[3] = A[g+8][c+8, c+9]
//     b[0] = B[c, c+1][g]      b[1] = B[c+8, c+9][g]
//     d[0], d[1] = D[g][c, c+1]                       d[2], d[3] = D[g+8][c, c+1]
//   each 32-bit register holding its first element in the low half.
// - The host emulation of the kernels (amp-cuda/tests/emulated/) defines the same function
//   from that table (with the prelude's f16/bf16 conversions, the only pieces that differ
//   between the two).

__device__ __forceinline__ void amp_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2], f16_t) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void amp_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2], bf16_t) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
