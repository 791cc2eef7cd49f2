// combine.cuh -- merging a query row's split-KV partial results (scheduler.cuh, KeySplit) into out and
// lse, as cuflash.merge_attention does:
//     peak = max_s lse_s          (0 where every split saw nothing, so that the row stays 0 / -inf)
//     w_s = exp(lse_s - peak),    lse = peak + log(sum_s w_s),    out = sum_s (w_s / sum_s w_s) O_s
// A split that saw no key has lse_s = -inf and O_s = 0 (finish_row, epilogue.cuh): weight 0. A NaN
// in any split's O or lse reaches the row, as NaN inputs do in PyTorch. One warp a row: lane l holds
// columns l, l + 32, ... of the row, and the weights of splits l, l + 32, .... The partial buffers
// are in the accumulator type A (float, or double for float64), out in T. flash_fwd_combine.cu runs
// it a warp a row; the decoding kernel's last CTA of a query block runs it over the block's rows.
#pragma once
#include "common.cuh"
#include "params.cuh"

template <typename A>
__device__ __forceinline__ A exp_of(A x) {
    if constexpr (sizeof(A) == sizeof(double)) return exp(x);
    else return expf(x);
}
template <typename A>
__device__ __forceinline__ A log_of(A x) {
    if constexpr (sizeof(A) == sizeof(double)) return log(x);
    else return logf(x);
}

// The larger of a and b, NaN if either is (fmax, and so group_max, would drop a NaN).
template <typename A>
__device__ __forceinline__ A max_keeping_nan(A a, A b) {
    return (a != a || b != b) ? a + b : (a > b ? a : b);
}

template <typename A>
__device__ __forceinline__ A warp_max_keeping_nan(A x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = max_keeping_nan(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

// The most splits a call has (cuflash.options.MAX_SPLITS): a lane keeps the weights of splits
// lane, lane + 32, ... in registers.
constexpr int MAX_SPLITS = 256;
constexpr int SPLIT_CHUNKS = MAX_SPLITS / 32;
// Splits whose partial rows a lane loads before it adds any: independent loads in flight hide the
// latency that a load, then add, then load loop pays once a split.
constexpr int SPLITS_IN_FLIGHT = 8;

// Query row `row` of (batch, head) merged over its p.num_splits partials by one warp. L2: the partials
// are read at the L2 (ld.global.cg), for a reader in the kernel that wrote them (their lines may not
// be in this SM's L1, but nothing else is guaranteed).
template <typename T, int HEAD, bool L2 = false>
__device__ __forceinline__ void combine_row(const FwdParams& p, int batch, int head, int row, int lane) {
    typedef typename AccumOf<T>::type A;
    constexpr int COLS = HEAD / 32;   // columns a lane holds
    static_assert(HEAD % 32 == 0, "whole columns a lane");
    const AttnDims& dims = p.dims;
    const int splits = p.num_splits;
    auto load = [](const A* at) { return L2 ? __ldcg(at) : *at; };

    // weight[j]: split lane + 32 j's lse, then its weight exp(lse - shift) / total (0 past the last split)
    A weight[SPLIT_CHUNKS];
    A peak = neg_inf<A>();
#pragma unroll
    for (int j = 0; j < SPLIT_CHUNKS; ++j) {
        const int s = lane + 32 * j;
        weight[j] = s < splits ? load(p.lse_partial.at<const A>(s * dims.batch + batch, head, row)) : neg_inf<A>();
        peak = max_keeping_nan(peak, weight[j]);
    }
    peak = warp_max_keeping_nan(peak);
    const A shift = peak == neg_inf<A>() ? A(0) : peak;   // every split empty: weights exp(-inf) = 0
    A total = A(0);
#pragma unroll
    for (int j = 0; j < SPLIT_CHUNKS; ++j) {
        weight[j] = exp_of(weight[j] - shift);
        total += weight[j];
    }
    total = group_sum<32>(total);
    const A inv_total = total == A(0) ? A(0) : A(1) / total;   // NaN stays NaN

    A acc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[c] = A(0);
#pragma unroll
    for (int j = 0; j < SPLIT_CHUNKS; ++j) {
        const A lane_weight = weight[j] * inv_total;
#pragma unroll 1
        for (int t0 = 0; t0 < 32 && 32 * j + t0 < splits; t0 += SPLITS_IN_FLIGHT) {
            A part[SPLITS_IN_FLIGHT][COLS];
#pragma unroll
            for (int t = 0; t < SPLITS_IN_FLIGHT; ++t) {
                const int s = 32 * j + t0 + t;
                const A* o_row = p.out_partial.at<const A>(s * dims.batch + batch, head, row);
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    const int col = lane + 32 * c;
                    part[t][c] = (s < splits && col < dims.dv) ? load(o_row + col) : A(0);
                }
            }
#pragma unroll
            for (int t = 0; t < SPLITS_IN_FLIGHT; ++t) {
                const A w = __shfl_sync(0xffffffffu, lane_weight, t0 + t);
#pragma unroll
                for (int c = 0; c < COLS; ++c) acc[c] += w * part[t][c];
            }
        }
    }
    T* out_row = p.out.at<T>(batch, head, row);
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const int col = lane + 32 * c;
        if (col < dims.dv) out_row[col] = from_acc<T>(acc[c]);
    }
    if (lane == 0) *p.lse.at<A>(batch, head, row) = shift + log_of(total);
}
