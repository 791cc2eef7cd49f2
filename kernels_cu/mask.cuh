// mask.cuh -- everything that edits a score tile before the softmax.
//
// Scores arrive as raw dot products q.k; they leave in log2 units
// (s * scale * log2(e)) with disallowed entries set to -inf. Allowed means:
// the key exists (col < lk) and, when causal, col <= row + causal_offset
// (offset 0: top-left aligned; lk - lq: bottom-right aligned).
#pragma once
#include "common.cuh"

template <bool CAUSAL>
struct ScoreMask {
    int lk;
    int causal_offset;
    __device__ __forceinline__ bool allowed(int row, int col) const {
        return col < lk && (!CAUSAL || col <= row + causal_offset);
    }
    // Does the key tile [col0, col0 + cols) need per-element masking for the
    // query rows [row0, row0 + rows)? Interior tiles skip the test.
    __device__ __forceinline__ bool tile_needs_mask(int row0, int col0, int cols) const {
        return col0 + cols > lk || (CAUSAL && col0 + cols - 1 > row0 + causal_offset);
    }
    // One past the last key tile any of the query rows [row0, row0 + rows) can see.
    __device__ __forceinline__ int key_tile_end(int row0, int rows, int block_n) const {
        int end = ceil_div(lk, block_n);
        if (CAUSAL) {
            const int last_key = row0 + rows - 1 + causal_offset;
            end = last_key < 0 ? 0 : imin(end, last_key / block_n + 1);
        }
        return end;
    }
};

// Scale and mask an mma accumulator tile: N_TILES fragments of 16x8 (mma.cuh's C layout)
// covering rows row0..row0+15 and keys col0..col0+8*N_TILES-1.
template <int N_TILES, bool CAUSAL>
__device__ __forceinline__ void scale_mask_mma_tile(float (&s)[N_TILES][4], float scale_log2,
                                                    const ScoreMask<CAUSAL>& mask, bool needs_mask,
                                                    int row0, int col0, int lane) {
#pragma unroll
    for (int n = 0; n < N_TILES; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + lane / 4 + 8 * (i / 2);         // C-fragment layout (mma.cuh)
            const int col = col0 + n * 8 + 2 * (lane % 4) + (i % 2);
            s[n][i] = (!needs_mask || mask.allowed(row, col)) ? s[n][i] * scale_log2 : neg_inf<float>();
        }
    }
}

// The same for the SIMT layout: TM rows (row0 + i) by TN keys (col0 + j * col_step).
template <int TM, int TN, bool CAUSAL, typename A>
__device__ __forceinline__ void scale_mask_simt_tile(A (&s)[TM][TN], A scale_log2,
                                                     const ScoreMask<CAUSAL>& mask, bool needs_mask,
                                                     int row0, int col0, int col_step) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const bool ok = !needs_mask || mask.allowed(row0 + i, col0 + j * col_step);
            s[i][j] = ok ? s[i][j] * scale_log2 : neg_inf<A>();
        }
    }
}
