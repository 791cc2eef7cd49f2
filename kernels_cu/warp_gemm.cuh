// warp_gemm.cuh -- warp-level tensor-core GEMMs on 16-row strips (fp16/bf16 in, fp32 out).
//
// Each call accumulates a 16 x N fp32 result held as N/8 C fragments (mma.cuh's
// layout) by one warp. Operands come from shared memory (row-major tiles with a
// row pitch in elements; pitches are padded so ldmatrix rows hit distinct banks, or B's rows
// are swizzled instead: SW_B)
// or, for the A operand, from fp32 C fragments already in registers.
//   warp_gemm_nt: acc += A B^T   A: 16 x K rows in smem, B: N x K rows in smem  (S = Q K^T)
//   warp_gemm_rn: acc += P B     P: 16 x K in registers, B: K x N rows in smem  (O += P V)
//   warp_gemm_strips_smem_t:     A stored transposed, K x 16 rows in smem       (dQ += dS K, dS^T stored)
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "tile_io.cuh"

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

//   The same A fragment of a strip stored transposed, as rows [k][m] (strip = its
//   first column): ldmatrix.trans of the four 8 x 8 blocks (k 0-7, m 0-7), (k 0-7,
//   m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15) gives a0..a3 (mma.cuh's A layout).
template <typename T, int PA>
__device__ __forceinline__ unsigned at_lane_addr(const T* strip, int lane) {
    return smem_addr(strip + ((lane / 16) * 8 + lane % 8) * PA + ((lane / 8) % 2) * 8);
}
template <typename T, int PA>
__device__ __forceinline__ void load_at_frag(unsigned (&a)[4], unsigned lane_addr, int k0) {
    ldmatrix_x4_trans(a, lane_addr + k0 * PA * int(sizeof(T)));
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

//   B in tile_io.cuh's swizzled rows (SWIZZLED copies: PB elements a row, no padding, 16-byte
//   chunk c of row r at chunk c ^ (r % 8)). A lane's ldmatrix row is 8-aligned plus lane % 8 in
//   every fragment, so its chunk's place is (tile chunk + the lane's chunk) ^ (lane % 8), and with
//   the tile chunk even that is tile chunk ^ swz, swz = lane chunk ^ (lane % 8): the lane keeps its
//   first row's address and swz, and a fragment adds the row offset and (tile chunk ^ swz) * 16.
struct SwizzledLane {
    unsigned row_addr;   // shared address of the lane's first row, chunk 0
    int swz;             // 0..7
};
template <typename T, int PB>
__device__ __forceinline__ SwizzledLane bt_lane_sw(const T* rows, int lane) {
    static_assert(PB % 64 == 0 && sizeof(T) == 2, "16-bit rows of whole groups of 8 chunks");
    return {smem_addr(rows + ((lane / 16) * 8 + lane % 8) * PB), ((lane / 8) % 2) ^ (lane % 8)};
}
template <typename T, int PB>
__device__ __forceinline__ void load_bt_frags_sw(unsigned (&b)[4], SwizzledLane lane, int n0, int k0) {
    ldmatrix_x4(b, lane.row_addr + n0 * PB * int(sizeof(T)) + (((k0 / 8) ^ lane.swz) * 16));
}
template <typename T, int PB>
__device__ __forceinline__ SwizzledLane b_lane_sw(const T* rows, int lane) {
    static_assert(PB % 64 == 0 && sizeof(T) == 2, "16-bit rows of whole groups of 8 chunks");
    return {smem_addr(rows + (((lane / 8) % 2) * 8 + lane % 8) * PB), (lane / 16) ^ (lane % 8)};
}
template <typename T, int PB>
__device__ __forceinline__ void load_b_frags_sw(unsigned (&b)[4], SwizzledLane lane, int n0, int k0) {
    ldmatrix_x4_trans(b, lane.row_addr + k0 * PB * int(sizeof(T)) + (((n0 / 8) ^ lane.swz) * 16));
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

// P in 16 bits, as the A operand takes it: p16[n][r] holds C-fragment elements
// 2r, 2r + 1 of n8 tile n (keys 8n + 2 (lane % 4) + {0, 1} of row lane/4 + 8r),
// rounded once. Two neighbouring tiles n, n + 1 are then one k16 A fragment.
template <typename T, int N>
__device__ __forceinline__ void pack_frags(unsigned (&p16)[N][2], const float (&p)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        p16[n][0] = pack2<T>(p[n][0], p[n][1]);
        p16[n][1] = pack2<T>(p[n][2], p[n][3]);
    }
}

// The one warp GEMM loop, over M row strips of 16 owned by one warp:
//     acc[m] (16 x N) += A_m (16 x K) B,   m < M.
// load_a(m, af, k0) yields strip m's k16 A fragment at depth k0 (from shared
// memory or from registers); B is in shared memory, stored as rows [k][n]
// (B_KN: read transposed by ldmatrix.trans) or as rows [n][k] (B^T row-major).
// Each B fragment is loaded once and used by all M strips: with M = 2 a warp
// issues 2 MMAs per ldmatrix of B instead of 1 (shared-memory bandwidth, not the
// tensor cores, bounds the 16-row loop; FlashAttention-2's reason for 32-row warps).
// SW_B: B in swizzled rows (SwizzledLane), `b` at an 8-row boundary of its tile.
template <typename T, int M, int N, int K, int PB, bool B_KN, bool SW_B = false, typename LoadA>
__device__ __forceinline__ void warp_gemm_strips(float (&acc)[M][N / 8][4], LoadA load_a, const T* b, int lane) {
    static_assert(N % 16 == 0 && K % 16 == 0, "mma tiles");
    const unsigned b_addr = SW_B ? 0u : B_KN ? b_lane_addr<T, PB>(b, lane) : bt_lane_addr<T, PB>(b, lane);
    SwizzledLane b_sw = {0u, 0};
    if constexpr (SW_B) b_sw = B_KN ? b_lane_sw<T, PB>(b, lane) : bt_lane_sw<T, PB>(b, lane);
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned af[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) load_a(m, af[m], k0);
#pragma unroll
        for (int n0 = 0; n0 < N; n0 += 16) {
            unsigned bf[4];
            if (SW_B && B_KN) load_b_frags_sw<T, PB>(bf, b_sw, n0, k0);
            else if (SW_B) load_bt_frags_sw<T, PB>(bf, b_sw, n0, k0);
            else if (B_KN) load_b_frags<T, PB>(bf, b_addr, n0, k0);
            else load_bt_frags<T, PB>(bf, b_addr, n0, k0);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                mma_16816<T>(acc[m][n0 / 8], af[m], bf[0], bf[1]);
                mma_16816<T>(acc[m][n0 / 8 + 1], af[m], bf[2], bf[3]);
            }
        }
    }
}

// M strips with A from shared memory: strip m is rows [16 m, 16 m + 16) of `a` (pitch PA).
template <typename T, int M, int N, int K, int PA, int PB, bool B_KN, bool SW_B = false>
__device__ __forceinline__ void warp_gemm_strips_smem(float (&acc)[M][N / 8][4], const T* a, const T* b, int lane) {
    const unsigned a_addr = a_lane_addr<T, PA>(a, lane);
    warp_gemm_strips<T, M, N, K, PB, B_KN, SW_B>(acc, [&](int m, unsigned (&af)[4], int k0) {
        load_a_frag<T, PA>(af, a_addr + m * 16 * PA * int(sizeof(T)), k0);
    }, b, lane);
}

// M strips with A stored transposed in shared memory, as rows [k][m] (pitch PA):
// strip m is columns [16 m, 16 m + 16) of `at` (the dK/dV kernel's dS^T, stored
// key-major with 32-bit stores straight from its fragments, is dQ's A operand).
template <typename T, int M, int N, int K, int PA, int PB, bool B_KN>
__device__ __forceinline__ void warp_gemm_strips_smem_t(float (&acc)[M][N / 8][4], const T* at, const T* b, int lane) {
    const unsigned a_addr = at_lane_addr<T, PA>(at, lane);
    warp_gemm_strips<T, M, N, K, PB, B_KN>(acc, [&](int m, unsigned (&af)[4], int k0) {
        load_at_frag<T, PA>(af, a_addr + m * 16 * int(sizeof(T)), k0);
    }, b, lane);
}

// M strips with A from registers: the fp32 C fragments of P, packed to 16 bits on the fly.
template <typename T, int M, int N, int K, int PB>
__device__ __forceinline__ void warp_gemm_strips_rn(float (&acc)[M][N / 8][4], const float (&p)[M][K / 8][4],
                                                    const T* b, int lane) {
    warp_gemm_strips<T, M, N, K, PB, true>(acc, [&](int m, unsigned (&af)[4], int k0) {
        pack_a_frag<T, K>(af, p[m], k0);
    }, b, lane);
}

// M strips with A from registers already packed to 16 bits (pack_frags' layout):
// 2 registers per 8 columns of P instead of 4, from the softmax to the last MMA.
template <typename T, int M, int N, int K, int PB, bool SW_B = false>
__device__ __forceinline__ void warp_gemm_strips_rn16(float (&acc)[M][N / 8][4], const unsigned (&p16)[M][K / 8][2],
                                                      const T* b, int lane) {
    warp_gemm_strips<T, M, N, K, PB, true, SW_B>(acc, [&](int m, unsigned (&af)[4], int k0) {
        const int t = k0 / 8;
        af[0] = p16[m][t][0];
        af[1] = p16[m][t][1];
        af[2] = p16[m][t + 1][0];
        af[3] = p16[m][t + 1][1];
    }, b, lane);
}

// One strip (the backward kernels): the same loops with M = 1.
template <int N>
__device__ __forceinline__ float (&one_strip(float (&acc)[N][4]))[1][N][4] {
    return reinterpret_cast<float (&)[1][N][4]>(acc);
}

template <typename T, int N, int K, int PA, int PB>
__device__ __forceinline__ void warp_gemm_nt(float (&acc)[N / 8][4], const T* a, const T* b, int lane) {
    warp_gemm_strips_smem<T, 1, N, K, PA, PB, false>(one_strip(acc), a, b, lane);
}

template <typename T, int N, int K, int PB>
__device__ __forceinline__ void warp_gemm_rn(float (&acc)[N / 8][4], const float (&p)[K / 8][4], const T* b, int lane) {
    warp_gemm_strips_rn<T, 1, N, K, PB>(one_strip(acc), reinterpret_cast<const float (&)[1][K / 8][4]>(p), b, lane);
}

// s = s * scale + bias * log2(e) for the two n8 tiles 2g, 2g + 1 of column group g, from
// the four registers of one ldmatrix.x4 of the bias (layout below).
template <typename T, int N>
__device__ __forceinline__ void scale_add_bias_group(float (&s)[N / 8][4], int g, const unsigned (&r)[4], float scale) {
    const float log2e = float(LOG2E);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            s[2 * g + h][i] = s[2 * g + h][i] * scale + unpack_half<T>(r[2 * h + i / 2], i % 2) * log2e;
}

// s = s * scale + bias * log2(e) on one warp's 16 x N fp32 C fragments, the bias a
// 16 x N tile of 16-bit values, row-major in shared memory with pitch P, read
// straight into fragment positions: one ldmatrix.x4 per 16 columns (4 registers
// live) instead of one 2-byte load per element. After ldmatrix.x4 at column group
// g, r[2h + i / 2] holds elements i, i + 1 (i even) of n8 tile 2g + h. TRANS: the
// tile is stored transposed, [column][row] (a [query][key] bias read for the S^T
// fragments of the dK/dV kernel, whose rows are keys): ldmatrix.trans.
template <typename T, int N, int P, bool TRANS>
__device__ __forceinline__ void scale_add_bias_frags(float (&s)[N / 8][4], const T* tile, int lane, float scale) {
    static_assert(N % 16 == 0, "whole 16-column groups");
    const unsigned addr = TRANS ? bt_lane_addr<T, P>(tile, lane) : a_lane_addr<T, P>(tile, lane);
#pragma unroll
    for (int g = 0; g < N / 16; ++g) {
        unsigned r[4];
        if (TRANS) ldmatrix_x4_trans(r, addr + g * 16 * P * int(sizeof(T)));
        else ldmatrix_x4(r, addr + g * 16 * int(sizeof(T)));
        scale_add_bias_group<T, N>(s, g, r, scale);
    }
}

// The same from a 16-bit tile in tile_io.cuh's swizzled layout (sw_chunk_offset: rows of
// N elements, chunk c of row r at chunk c ^ (r % 8)): `strip` is the shared address of
// the warp's first row, a multiple of 8 rows into the tile. ldmatrix.x4 at column
// group g reads chunk 2g + lane / 16 of row lane % 16, stored at chunk
// (2g + lane / 16) ^ (lane % 8) = 2g ^ y with y = (lane / 16) ^ (lane % 8) (2g is even,
// lane / 16 is bit 0): its byte offset in the row is (32 g) ^ (16 y), which repeats
// every 4 groups, 128 bytes on.
template <typename T, int N>
__device__ __forceinline__ void scale_add_bias_frags_sw(float (&s)[N / 8][4], unsigned strip, int lane, float scale) {
    static_assert(N % 64 == 0, "whole groups of 8 chunks a row");
    const unsigned row = strip + (lane % 16) * N * int(sizeof(T));
    const unsigned y16 = 16 * ((lane / 16) ^ (lane % 8));
#pragma unroll
    for (int g = 0; g < N / 16; ++g) {
        unsigned r[4];
        ldmatrix_x4(r, row + (((32 * g) % 128) ^ y16) + 128 * (g / 4));
        scale_add_bias_group<T, N>(s, g, r, scale);
    }
}

// The transposed form, for the Hopper dK/dV kernel's S^T (rows: a warp's 16 keys key0.., columns:
// N queries) with the bias tile [query][key] in the same swizzled layout (rows of KEYS elements):
// ldmatrix.x4.trans at query group g gives lane l's address to row (query) 16 g + 8 (l / 16) + l % 8,
// chunk key0 / 8 + (l / 8) % 2 (bt_lane_addr's order), stored at chunk ^ (l % 8): matrix j then holds
// queries 16 g + 8 (j / 2).., keys key0 + 8 (j % 2).., transposed into S^T's rows, which is
// scale_add_bias_group's register order (r[2h + i / 2]: n8 tile 2g + h, key row g + 8 (i / 2)).
// The 8 rows of one matrix are 8 rows of the tile at one chunk: 8 distinct 16-byte bank groups.
template <typename T, int N, int KEYS>
__device__ __forceinline__ void scale_add_bias_frags_sw_t(float (&s)[N / 8][4], unsigned tile, int key0, int lane,
                                                          float scale) {
    static_assert(N % 16 == 0 && KEYS % 64 == 0, "whole 16-query groups; whole groups of 8 chunks a row");
    const int row = 8 * (lane / 16) + lane % 8, chunk = key0 / 8 + (lane / 8) % 2;
    static_assert(sizeof(T) == 2, "16-bit tiles (sw_chunk_offset's rows)");
    const unsigned addr = tile + sw_chunk_offset<KEYS>(row, chunk);
#pragma unroll
    for (int g = 0; g < N / 16; ++g) {
        unsigned r[4];
        ldmatrix_x4_trans(r, addr + g * 16 * KEYS * int(sizeof(T)));   // 16 rows on: (row % 8) unchanged
        scale_add_bias_group<T, N>(s, g, r, scale);
    }
}

// Row and column (within the 16 x 8n strip) of C-fragment element i of tile n.
__device__ __forceinline__ int frag_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
__device__ __forceinline__ int frag_col(int lane, int n, int i) { return n * 8 + 2 * (lane % 4) + (i % 2); }
