// swizzle_f64.cuh -- an fp64 shared-memory tile layout that two fragment patterns
// read without bank conflicts, and its global -> shared loads.
//
// The fp64 backward reads Q, dO and K both ways of warp_gemm_f64.cuh's header:
//   "row g, column k0 + t"       (the A / B^T operand of S^T = K Q^T, dP^T = V dO^T)
//   "row k0 + 2t + s, column g"  (the B operand of dV += P^T dO, dK += dS^T Q, dQ += dS K)
// and no row padding suits both (pitch 4 mod 8 for one, 2 mod 4 for the other).
// Instead rows are unpadded (COLS doubles, COLS a multiple of 16) and each row's
// 16-byte chunks are permuted: element (r, c) lives at r * COLS + (c ^ swz_xor(r)),
// swz_xor(r) = 4 h(r mod 8). XOR by a multiple of 4 moves whole chunk pairs and
// keeps every 16-byte chunk (c even, c + 1) whole, so cp.async still copies chunks.
//
// Why it is conflict-free. A half-warp (g = 0..3 or 4..7, t = 0..3) must hit 16
// different 8-byte bank pairs, i.e. 16 offsets distinct mod 16; with COLS = 0
// (mod 16) only (c ^ 4h) mod 16 matters. In both patterns the half-warp reads 4
// rows and, per row, columns 4j + {0..3} of one aligned group of 4 (j fixed):
// (4j + e) ^ 4h = 4 (j ^ h) + e, so the 4 rows land in 4 different groups exactly
// when their h differ. The 4 rows are {4a, .., 4a + 3} (row g or row k0 + t) or
// {s, s + 2, s + 4, s + 6} (row 2t + s), mod 8. With r = (b2 b1 b0) in binary,
// h(r) = (b1, b0 ^ b2) is one-to-one on both kinds of set: fixing b2 it maps
// (b1, b0) one-to-one, fixing b0 it maps (b2, b1) one-to-one. Each pattern then
// takes two passes per warp, the least 256 bytes need.
// The same layout holds the dK/dV kernel's dS tile ([query][key]): written from
// S^T fragments (row 2t + i, column g) and read as an A operand (row g, column t).
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "tile_io.cuh"

__device__ __forceinline__ int swz_xor(int row) {
    const int r = row & 7;
    return 4 * ((r & 2) | ((r ^ (r >> 2)) & 1));
}

template <int COLS>
__device__ __forceinline__ int swz_offset(int row, int col) {
    static_assert(COLS % 16 == 0, "the XOR permutes columns inside aligned groups of 16");
    return row * COLS + (col ^ swz_xor(row));
}

// ROWS x COLS elements of a row-major global matrix into a swizzled tile; zeros
// outside (rows_valid, cols_valid) as load_tile. VEC: 16-byte cp.async chunks
// (rows 16-byte aligned, cols_valid even); else element by element.
template <int ROWS, int COLS, int THREADS, bool VEC>
__device__ __forceinline__ void load_tile_swz(double* smem, const double* gmem, int64 row_stride, int rows_valid,
                                              int cols_valid) {
    if (VEC) {
        constexpr int CHUNKS_PER_ROW = COLS / 2;
#pragma unroll 2
        for (int i = threadIdx.x; i < ROWS * CHUNKS_PER_ROW; i += THREADS) {
            const int row = i / CHUNKS_PER_ROW, col = (i % CHUNKS_PER_ROW) * 2;
            const bool valid = row < rows_valid && col < cols_valid;
            cp_async_16(smem + swz_offset<COLS>(row, col), valid ? gmem + row * row_stride + col : gmem, valid);
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
            const int row = i / COLS, col = i % COLS;
            smem[swz_offset<COLS>(row, col)] = row < rows_valid && col < cols_valid ? gmem[row * row_stride + col] : 0.0;
        }
    }
}

// Rows [row0, row0 + ROWS) of one (batch, head) from two views (Q and dO, or K and V).
template <int ROWS, int COLS, int THREADS, bool VEC>
__device__ __forceinline__ void load_row_tiles_swz(double* a_s, const View& a, int a_cols, double* b_s, const View& b,
                                                   int b_cols, int batch, int head, int row0, int rows_valid) {
    load_tile_swz<ROWS, COLS, THREADS, VEC>(a_s, a.at<const double>(batch, head, row0), a.row_stride, rows_valid,
                                            a_cols);
    load_tile_swz<ROWS, COLS, THREADS, VEC>(b_s, b.at<const double>(batch, head, row0), b.row_stride, rows_valid,
                                            b_cols);
}
