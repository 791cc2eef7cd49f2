// softmax.cuh -- online-softmax state of one query row, in log2 units.
//
// Invariant after each key tile:   row_max = max over seen keys of s   (s = q.k * scale * log2 e)
//                                  row_sum = sum over seen keys of 2^(s - row_max)   (this thread's part)
//                                  acc_o   = sum over seen keys of 2^(s - row_max) * v
// so out = acc_o / row_sum and lse = (row_max + log2(row_sum)) * ln 2 at the end.
// GROUP consecutive lanes hold pieces of the same row; row_max is kept equal
// across them, row_sum is reduced only once, in finalize.
#pragma once
#include "common.cuh"

// Fold the tile's scores x (already scaled and masked) into the row state.
// x is overwritten with p = 2^(s - row_max_new). Returns the factor
// 2^(row_max_old - row_max_new) by which the caller rescales the row of acc_o.
template <int GROUP, int N, typename A>
__device__ __forceinline__ A softmax_update_row(A (&x)[N], A& row_max, A& row_sum) {
    A tile_max = x[0];
#pragma unroll
    for (int j = 1; j < N; ++j) tile_max = amax(tile_max, x[j]);
    tile_max = group_max<GROUP>(tile_max);
    const A new_max = amax(row_max, tile_max);
    // A row that has allowed nothing yet has max -inf; subtracting 0 instead
    // keeps every p at exactly 0 rather than NaN (-inf - -inf).
    const A ref = new_max == neg_inf<A>() ? A(0) : new_max;
    const A correction = fast_exp2(row_max - ref);
    A tile_sum = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        x[j] = fast_exp2(x[j] - ref);
        tile_sum += x[j];
    }
    row_sum = row_sum * correction + tile_sum;
    row_max = new_max;
    return correction;
}

// The row's 1/sum (0 for a row that attended to nothing) and its natural-log lse.
template <int GROUP, typename A>
__device__ __forceinline__ void softmax_finalize_row(A row_max, A row_sum, A& inv_sum, A& lse) {
    const A total = group_sum<GROUP>(row_sum);
    const A ln2 = A(0.6931471805599453094);
    inv_sum = total > A(0) ? A(1) / total : A(0);
    lse = total > A(0) ? (row_max + log2_of(total)) * ln2 : neg_inf<A>();
}
