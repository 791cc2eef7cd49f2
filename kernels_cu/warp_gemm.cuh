// warp_gemm.cuh -- warp-level tensor-core GEMMs on 16-row strips (fp16/bf16 in, fp32 out).
//
// Each call accumulates a 16 x N fp32 result held as N/8 C fragments (mma.cuh's
// layout) by one warp. Operands come from shared memory (row-major tiles with a
// row pitch in elements; pitches are padded so ldmatrix rows hit distinct banks)
// or, for the A operand, from fp32 C fragments already in registers.
//   warp_gemm_nt: acc += A B^T   A: 16 x K rows in smem, B: N x K rows in smem  (S = Q K^T)
//   warp_gemm_rn: acc += P B     P: 16 x K in registers, B: K x N rows in smem  (O += P V)
//   warp_gemm_nn: acc += A B     A: 16 x K rows in smem, B: K x N rows in smem  (dQ += dS K)
#pragma once
#include "common.cuh"
#include "mma.cuh"

template <int N>
__device__ __forceinline__ void zero_frags(float (&acc)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
}

// Fragment loads. Each takes the lane's 32-bit shared address of its first row
// (from the *_lane_addr helpers, computed once per GEMM) and adds the tile
// offset, a compile-time constant in the unrolled loops.
//   A (16 x 16 at column k0) of a row-major strip.
template <typename T, int PA>
__device__ __forceinline__ unsigned a_lane_addr(const T* strip, int lane) {
    return smem_addr(strip + (lane % 16) * PA + (lane / 16) * 8);
}
template <typename T, int PA>
__device__ __forceinline__ void load_a_frag(unsigned (&a)[4], unsigned lane_addr, int k0) {
    ldmatrix_x4(a, lane_addr + k0 * sizeof(T));
}

//   The two B fragments of columns n0..n0+15, depth k0..k0+15, for B^T stored as rows [n][k].
template <typename T, int PB>
__device__ __forceinline__ unsigned bt_lane_addr(const T* rows, int lane) {
    return smem_addr(rows + ((lane / 16) * 8 + lane % 8) * PB + ((lane / 8) % 2) * 8);
}
template <typename T, int PB>
__device__ __forceinline__ void load_bt_frags(unsigned (&b)[4], unsigned lane_addr, int n0, int k0) {
    ldmatrix_x4(b, lane_addr + (n0 * PB + k0) * sizeof(T));
}

//   The same for B stored as rows [k][n] (read transposed).
template <typename T, int PB>
__device__ __forceinline__ unsigned b_lane_addr(const T* rows, int lane) {
    return smem_addr(rows + (((lane / 8) % 2) * 8 + lane % 8) * PB + (lane / 16) * 8);
}
template <typename T, int PB>
__device__ __forceinline__ void load_b_frags(unsigned (&b)[4], unsigned lane_addr, int n0, int k0) {
    ldmatrix_x4_trans(b, lane_addr + (k0 * PB + n0) * sizeof(T));
}

// Two adjacent n8 C fragments of P (fp32) form one k16 A fragment (16-bit), no shared memory.
template <typename T, int K>
__device__ __forceinline__ void pack_a_frag(unsigned (&a)[4], const float (&p)[K / 8][4], int k0) {
    const int t = k0 / 8;
    a[0] = pack2<T>(p[t][0], p[t][1]);
    a[1] = pack2<T>(p[t][2], p[t][3]);
    a[2] = pack2<T>(p[t + 1][0], p[t + 1][1]);
    a[3] = pack2<T>(p[t + 1][2], p[t + 1][3]);
}

// The one warp GEMM loop: acc (16 x N) += A (16 x K) B. load_a(af, k0) yields A's
// k16 fragment at depth k0 (from shared memory or from registers); B is in shared
// memory, stored as rows [k][n] (B_KN: read transposed by ldmatrix.trans) or as
// rows [n][k] (B^T row-major).
template <typename T, int N, int K, int PB, bool B_KN, typename LoadA>
__device__ __forceinline__ void warp_gemm(float (&acc)[N / 8][4], LoadA load_a, const T* b, int lane) {
    static_assert(N % 16 == 0 && K % 16 == 0, "mma tiles");
    const unsigned b_addr = B_KN ? b_lane_addr<T, PB>(b, lane) : bt_lane_addr<T, PB>(b, lane);
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned af[4];
        load_a(af, k0);
#pragma unroll
        for (int n0 = 0; n0 < N; n0 += 16) {
            unsigned bf[4];
            if (B_KN) load_b_frags<T, PB>(bf, b_addr, n0, k0);
            else load_bt_frags<T, PB>(bf, b_addr, n0, k0);
            mma_16816<T>(acc[n0 / 8], af, bf[0], bf[1]);
            mma_16816<T>(acc[n0 / 8 + 1], af, bf[2], bf[3]);
        }
    }
}

// Both operands from shared memory (A: 16 x K rows with pitch PA).
template <typename T, int N, int K, int PA, int PB, bool B_KN>
__device__ __forceinline__ void warp_gemm_smem(float (&acc)[N / 8][4], const T* a, const T* b, int lane) {
    const unsigned a_addr = a_lane_addr<T, PA>(a, lane);
    warp_gemm<T, N, K, PB, B_KN>(acc, [&](unsigned (&af)[4], int k0) { load_a_frag<T, PA>(af, a_addr, k0); }, b, lane);
}

template <typename T, int N, int K, int PA, int PB>
__device__ __forceinline__ void warp_gemm_nt(float (&acc)[N / 8][4], const T* a, const T* b, int lane) {
    warp_gemm_smem<T, N, K, PA, PB, false>(acc, a, b, lane);
}

template <typename T, int N, int K, int PA, int PB>
__device__ __forceinline__ void warp_gemm_nn(float (&acc)[N / 8][4], const T* a, const T* b, int lane) {
    warp_gemm_smem<T, N, K, PA, PB, true>(acc, a, b, lane);
}

// A from registers: the fp32 C fragments of P (or dS), packed to 16 bits on the fly.
template <typename T, int N, int K, int PB>
__device__ __forceinline__ void warp_gemm_rn(float (&acc)[N / 8][4], const float (&p)[K / 8][4], const T* b, int lane) {
    warp_gemm<T, N, K, PB, true>(acc, [&](unsigned (&af)[4], int k0) { pack_a_frag<T, K>(af, p, k0); }, b, lane);
}

// Row and column (within the 16 x 8n strip) of C-fragment element i of tile n.
__device__ __forceinline__ int frag_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
__device__ __forceinline__ int frag_col(int lane, int n, int i) { return n * 8 + 2 * (lane % 4) + (i % 2); }
