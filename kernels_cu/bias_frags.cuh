// bias_frags.cuh -- a float32 bias read from global memory straight into a warp's m16n8 C-fragment
// positions, for a kernel with no shared memory left to stage it: the float32 Hopper forward
// (flash_fwd_wgmma_tf32.cu, 225 KB of tiles of the 227 KB an SM has).
//
// Lane 4 g + t holds rows g and g + 8, keys 8 n + 2 t + {0, 1} of n8 tile n: per row and tile two
// neighbouring floats, one 8-byte load. A warp's load instruction then reads 8 rows x 32 contiguous
// bytes (one 32-byte sector a row where the rows are 32-byte aligned, e.g. a key count that is a
// multiple of 8; two half-used ones otherwise), nothing fetched twice. The host passes only biases
// whose rows are 16-byte chunks (unit key stride, 16-byte aligned start and strides, 0 included:
// cuflash/_dispatch/masking.py, rows_in_chunks), so every pair is 8-byte aligned. A caller issues the loads
// before a GEMM whose latency hides theirs and adds them (scale_add_bias_regs) once the GEMM is done.
#pragma once
#include "common.cuh"
#include "params.cuh"

// b = the bias of one warp's 16 rows (row_g: the lane's row g, absolute) and keys [col0, col0 + 8 N)
// of (batch, head), in C-fragment order. Rows past lq and keys past lk read nothing (0): their
// scores are never written (rows) or masked (keys, partial tiles), and a pair cut by the sequence
// end reads its first float alone (the bias's last row ends there).
template <int N>
__device__ __forceinline__ void load_bias_frags(float (&b)[N][4], const ScoreTensor& bias, int batch, int head,
                                                int row_g, int col0, int lq, int lk, int lane) {
    const int col = col0 + 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_g + 8 * r;
        const int keys_left = row < lq ? lk - col : 0;   // keys of this row from the lane's first one
        const float* at = bias.at<float>(batch, head, row < lq ? row : 0, col);
#pragma unroll
        for (int n = 0; n < N; ++n) {
            float2 pair = make_float2(0.0f, 0.0f);
            if (8 * n + 1 < keys_left) pair = __ldg(reinterpret_cast<const float2*>(at + 8 * n));
            else if (8 * n < keys_left) pair.x = __ldg(at + 8 * n);
            b[n][2 * r] = pair.x;
            b[n][2 * r + 1] = pair.y;
        }
    }
}

// x = s * scale + bias * log2(e) on C fragments, the bias from load_bias_frags.
template <int N>
__device__ __forceinline__ void scale_add_bias_regs(float (&s)[N][4], const float (&b)[N][4], float scale) {
    const float log2e = float(LOG2E);
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] = s[n][i] * scale + b[n][i] * log2e;
}
