// mma.cuh -- tensor-core wrappers: ldmatrix and mma.sync m16n8k16 (fp16/bf16 in, fp32 out);
// mma.sync m16n8k8 (tf32 in, fp32 out); mma.sync m8n8k4 (fp64 in, fp64 out).
//
// Fragment layouts (PTX ISA, "mma.m16n8k16"), lane = threadIdx.x % 32:
//   A (16x16, row-major): a0 = (row lane/4,     k 2*(lane%4)+{0,1})
//                         a1 = (row lane/4 + 8, same k)
//                         a2, a3 = the same rows at k + 8
//   B (16x8, "col"):      b0 = (k 2*(lane%4)+{0,1}, n lane/4), b1 = the same at k + 8
//   C (16x8, fp32):       c0,c1 = (row lane/4, n 2*(lane%4)+{0,1}); c2,c3 = row + 8
// and ("mma.m16n8k8" with .tf32; one 32-bit element a register), g = lane/4, t = lane%4:
//   A (16x8, row-major):  a0 = (row g, k t), a1 = (row g + 8, k t), a2, a3 = the same rows at k t + 4
//   B (8x8, "col"):       b0 = (k t, n g), b1 = (k t + 4, n g)
//   C (16x8, fp32):       as m16n8k16's
// and ("mma.m8n8k4" with .f64):
//   A (8x4, row-major):   a0 = (row g, k t)
//   B (4x8, "col"):       b0 = (k t, n g)
//   C (8x8, fp64):        c0,c1 = (row g, n 2t+{0,1})
// and ("mma.m16n8k4", "m16n8k8", "m16n8k16" with .f64, sm_90+), K = 4 K4, j < K4:
//   A (16xK, row-major):  a[2j] = (row g, k t + 4j), a[2j+1] = (row g + 8, k t + 4j)
//   B (Kx8, "col"):       b[j] = (k t + 4j, n g)
//   C (16x8, fp64):       c0,c1 = (row g, n 2t+{0,1}); c2,c3 = row g + 8
// i.e. m8n8k4's fragments stacked: two 8-row tiles in M, K4 of its k4 steps in K.
#pragma once
#include "common.cuh"

// Four 8x8 matrices of 16-bit values; lanes 8i..8i+7 give the row addresses of matrix i.
// Addresses are 32-bit shared-window addresses (smem_addr), so callers can form
// them with 32-bit adds from one base.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_addr));
}

// The same, each matrix transposed on the way (V is stored key-major but is the B operand).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row_addr));
}

// C += A B on one 16x8 tile.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// C += A B on one 8x8 fp64 tile, k = 4 (sm_80+: the fp64 tensor cores, DMMA).
__device__ __forceinline__ void mma_884_f64(double (&c)[2], double a, double b) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
                 : "+d"(c[0]), "+d"(c[1])
                 : "d"(a), "d"(b));
}

// C += A B on one 16x8 fp64 tile, k = 4 K4 (sm_90+: DMMA.16x8x4, 16x8x8, 16x8x16), in
// m8n8k4's fragments: c_top / c_bot are the C fragments of rows g / g + 8, a_top[j] / a_bot[j]
// the A fragments of those 8-row tiles at k step j, b[j] the B fragment at k step j. Why: on the
// H100 the m8n8k4 shape runs at half the fp64 tensor-core rate (benchmarks/dmma_rate.py), so a warp that holds 8-row tiles in pairs issues these instead.
template <int K4>
__device__ __forceinline__ void mma_16x8_f64(double (&c_top)[2], double (&c_bot)[2], const double (&a_top)[K4],
                                             const double (&a_bot)[K4], const double (&b)[K4]);

template <>
__device__ __forceinline__ void mma_16x8_f64<1>(double (&c_top)[2], double (&c_bot)[2], const double (&a_top)[1],
                                                const double (&a_bot)[1], const double (&b)[1]) {
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+d"(c_top[0]), "+d"(c_top[1]), "+d"(c_bot[0]), "+d"(c_bot[1])
                 : "d"(a_top[0]), "d"(a_bot[0]), "d"(b[0]));
}

template <>
__device__ __forceinline__ void mma_16x8_f64<2>(double (&c_top)[2], double (&c_bot)[2], const double (&a_top)[2],
                                                const double (&a_bot)[2], const double (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+d"(c_top[0]), "+d"(c_top[1]), "+d"(c_bot[0]), "+d"(c_bot[1])
                 : "d"(a_top[0]), "d"(a_bot[0]), "d"(a_top[1]), "d"(a_bot[1]), "d"(b[0]), "d"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16x8_f64<4>(double (&c_top)[2], double (&c_bot)[2], const double (&a_top)[4],
                                                const double (&a_bot)[4], const double (&b)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, {%0, %1, %2, %3};"
                 : "+d"(c_top[0]), "+d"(c_top[1]), "+d"(c_bot[0]), "+d"(c_bot[1])
                 : "d"(a_top[0]), "d"(a_bot[0]), "d"(a_top[1]), "d"(a_bot[1]), "d"(a_top[2]), "d"(a_bot[2]),
                   "d"(a_top[3]), "d"(a_bot[3]), "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

// C += A B on one 16x8 fp32 tile, k = 8, the operands' 32-bit registers read as TF32 (sm_80+).
// The tensor core reads the top 19 bits of each operand (sign, exponent, 10 mantissa bits: a
// plain fp32 value is truncated), and it adds the products and C truncating too (on an H100;
// warp_gemm_tf32.cuh says what that means for an accumulator).
__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
