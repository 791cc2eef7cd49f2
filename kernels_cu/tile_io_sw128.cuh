// tile_io_sw128.cuh -- global -> shared copies into the 128-byte swizzled layout
// that wgmma reads (wgmma.cuh describes it): 16-bit tiles of ROWS x COLS with COLS
// a multiple of 64, 16-byte cp.async chunks, zeros past rows_valid / cols_valid.
#pragma once
#include "common.cuh"
#include "tile_io.cuh"

// Byte offset of 16-byte chunk `chunk` (of COLS / 8) of row `row` in a swizzled
// ROWS x COLS tile: 64-column slabs of ROWS x 128 bytes, XOR of the chunk's
// position inside its 128-byte row with row % 8.
template <int ROWS>
__device__ __forceinline__ unsigned sw128_offset(int row, int chunk) {
    return (chunk / 8) * (ROWS * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// The caller guarantees 16-byte aligned rows and cols_valid a multiple of 8
// elements (the host's vec_loads_ok), commits the cp.async group and waits.
template <typename T, int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile_sw128(unsigned smem_base, const T* gmem, int64 row_stride, int rows_valid,
                                                int cols_valid) {
    static_assert(sizeof(T) == 2 && COLS % 64 == 0, "16-bit tiles of whole 128-byte rows");
    constexpr int CHUNKS = COLS / 8;   // per row
#pragma unroll
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += THREADS) {
        const int row = i / CHUNKS, chunk = i % CHUNKS;
        const bool valid = row < rows_valid && chunk * 8 < cols_valid;
        const T* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
        cp_async_16(smem_base + sw128_offset<ROWS>(row, chunk), src, valid);
    }
}
