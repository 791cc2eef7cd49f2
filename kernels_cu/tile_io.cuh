// tile_io.cuh -- global <-> shared tile copies with predicated edges.
//
// A tile is ROWS x COLS elements of a row-major global matrix (row stride in
// elements, unit column stride) copied into shared memory with row pitch PITCH.
// Elements outside (rows_valid, cols_valid) are written as zeros, so padded
// head-dim columns and rows past the sequence end contribute nothing to the
// dot products.
#pragma once
#include "common.cuh"
#include "params.cuh"

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    // src-size 0 makes cp.async fill the 16 bytes with zeros without reading.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// VEC: 16-byte cp.async chunks. The caller guarantees 16-byte aligned rows and
// cols_valid a multiple of the chunk. Otherwise element by element.
template <typename T, int ROWS, int COLS, int PITCH, int THREADS, bool VEC>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64 row_stride,
                                          int rows_valid, int cols_valid) {
    if (VEC) {
        constexpr int CHUNK = 16 / sizeof(T);
        constexpr int CHUNKS_PER_ROW = COLS / CHUNK;
        // Unrolled by 2, not 4: four chunks' addresses live at once spilled the
        // head-dim-128 two-strip forward on sm_90 (255 registers).
#pragma unroll 2
        for (int i = threadIdx.x; i < ROWS * CHUNKS_PER_ROW; i += THREADS) {
            const int row = i / CHUNKS_PER_ROW;
            const int col = (i % CHUNKS_PER_ROW) * CHUNK;
            const bool valid = row < rows_valid && col < cols_valid;
            const T* src = valid ? gmem + row * row_stride + col : gmem;
            cp_async_16(smem + row * PITCH + col, src, valid);
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
            const int row = i / COLS;
            const int col = i % COLS;
            smem[row * PITCH + col] = (row < rows_valid && col < cols_valid)
                                          ? gmem[row * row_stride + col] : zero_value<T>();
        }
    }
}

// Two tiles of the same ROWS rows [row0, row0 + ROWS) of one (batch, head) from
// two views: Q and dO, or K and V. Rows past rows_valid and columns past each
// view's own width (a_cols, b_cols) are zeros.
template <typename T, int ROWS, int COLS, int PITCH, int THREADS, bool VEC>
__device__ __forceinline__ void load_row_tiles(T* a_s, const View& a, int a_cols, T* b_s, const View& b, int b_cols,
                                               int batch, int head, int row0, int rows_valid) {
    load_tile<T, ROWS, COLS, PITCH, THREADS, VEC>(a_s, a.at<const T>(batch, head, row0), a.row_stride, rows_valid, a_cols);
    load_tile<T, ROWS, COLS, PITCH, THREADS, VEC>(b_s, b.at<const T>(batch, head, row0), b.row_stride, rows_valid, b_cols);
}
