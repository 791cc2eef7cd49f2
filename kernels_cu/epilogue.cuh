// epilogue.cuh -- the forward's last step, once per query row (softmax.cuh's invariant):
//     O = acc_o / l          0 for a row that saw no key (l = 0); NaN in acc_o or l stays NaN, as in PyTorch
//     lse = (m + log2 l) ln 2   the natural-log logsumexp of the row's scaled scores; -inf with l = 0, NaN
//                               with l NaN
// and the writes of O and lse from each accumulator layout. Rows past lq and columns past dv are
// not written (with PAIRS, a pair that starts before dv is written whole). KV_SPLIT: the writes go
// to the split-KV partial buffers, T then the accumulator type.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "tile_io.cuh"

// A finished row: the normaliser 1 / l and the row's lse.
template <typename A>
struct FinishedRow {
    A inv_sum, lse;
};

// The row's statistics finished: row_sum is reduced over the GROUP consecutive lanes (STRIDE > 1: lanes
// STRIDE apart) that hold pieces of the row (they all call this), row_max is equal across them. A row
// that attended to nothing (l = 0) gets 1 / l = 0 and lse = -inf; a row that read a NaN score (l NaN)
// gets NaN for both, as PyTorch's softmax does.
template <int GROUP, int STRIDE = 1, typename A>
__device__ __forceinline__ FinishedRow<A> finish_row(A row_max, A row_sum) {
    const A total = group_sum<GROUP, STRIDE>(row_sum);
    const bool empty = total == A(0);
    FinishedRow<A> f;
    f.inv_sum = empty ? A(0) : A(1) / total;
    f.lse = empty ? neg_inf<A>() : (row_max + log2_of(total)) * A(LN2);
    return f;
}

// Where the epilogue writes: out and lse, or with KV_SPLIT the partial buffers (the block's batch
// then names its split's slice: KeySplit::partial_block, scheduler.cuh).
template <bool KV_SPLIT>
__device__ __forceinline__ const View& out_view(const FwdParams& p) {
    if constexpr (KV_SPLIT) return p.out_partial;
    else return p.out;
}
template <bool KV_SPLIT>
__device__ __forceinline__ const View& lse_view(const FwdParams& p) {
    if constexpr (KV_SPLIT) return p.lse_partial;
    else return p.lse;
}

// lse of the block's row first_row + row (0-based within the block). Kept as m0 + first_row + row:
// the other association changes the Hopper forward's register allocation.
template <typename A>
__device__ __forceinline__ void store_lse(const View& lse, const QueryBlock& blk, int row, A value, int first_row = 0) {
    *lse.at<A>(blk.batch, blk.head, blk.m0 + first_row + row) = value;
}

// O and lse of a warp's M strips of 16 rows held in m16n8 C fragments (mma.sync's layout, and a
// wgmma warp's): lane l holds rows l / 4 and l / 4 + 8 of each strip, columns 8 t + 2 (l % 4) and
// + 1 of n8 tile t. warp_row: the warp's first row within the block. PAIRS: store_out_pair's.
template <bool PAIRS, typename T, bool KV_SPLIT = false, int M, int O_TILES, typename A>
__device__ __forceinline__ void store_o_lse_c_frags(const FwdParams& p, const QueryBlock& blk, int warp_row, int lane,
                                                    const A (&acc_o)[M][O_TILES][4], const A (&row_max)[M][2],
                                                    const A (&row_sum)[M][2]) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const FinishedRow<A> f = finish_row<4>(row_max[m][r], row_sum[m][r]);
            const int row = warp_row + 16 * m + lane / 4 + 8 * r;
            if (row >= blk.rows) continue;
            T* out_row = out_view<KV_SPLIT>(p).template at<T>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
            for (int t = 0; t < O_TILES; ++t) {
                const int col = t * 8 + 2 * (lane % 4);
                store_out_pair<PAIRS>(out_row, col, p.dims.dv, acc_o[m][t][2 * r] * f.inv_sum,
                                      acc_o[m][t][2 * r + 1] * f.inv_sum);
            }
            if (lane % 4 == 0) store_lse(lse_view<KV_SPLIT>(p), blk, row, f.lse);
        }
}

// The same from fp64 m8n8k4 C fragments (warp_gemm_f64.cuh): lane l holds row l / 4 of each 8-row
// strip, columns 8 t + 2 (l % 4) and + 1 of tile t.
template <bool PAIRS, typename T, bool KV_SPLIT = false, int M, int O_TILES, typename A>
__device__ __forceinline__ void store_o_lse_f64_frags(const FwdParams& p, const QueryBlock& blk, int warp_row,
                                                      int lane, const A (&acc_o)[M][O_TILES][2],
                                                      const A (&row_max)[M], const A (&row_sum)[M]) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const FinishedRow<A> f = finish_row<4>(row_max[m], row_sum[m]);
        const int row = warp_row + 8 * m + lane / 4;
        if (row >= blk.rows) continue;
        T* out_row = out_view<KV_SPLIT>(p).template at<T>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
        for (int t = 0; t < O_TILES; ++t) {
            const int col = 8 * t + 2 * (lane % 4);
            store_out_pair<PAIRS>(out_row, col, p.dims.dv, acc_o[m][t][0] * f.inv_sum, acc_o[m][t][1] * f.inv_sum);
        }
        if (lane % 4 == 0) store_lse(lse_view<KV_SPLIT>(p), blk, row, f.lse);
    }
}

// The same from a thread's own rows (the FMA kernel's layout): rows row0 .. row0 + TM - 1, each
// held by GROUP consecutive threads, thread tx (0..GROUP-1) holding columns tx + GROUP c.
template <int GROUP, typename T, bool KV_SPLIT = false, int TM, int TD, typename A>
__device__ __forceinline__ void store_o_lse_thread_rows(const FwdParams& p, const QueryBlock& blk, int row0, int tx,
                                                        const A (&acc_o)[TM][TD], const A (&row_max)[TM],
                                                        const A (&row_sum)[TM]) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const FinishedRow<A> f = finish_row<GROUP>(row_max[i], row_sum[i]);
        const int row = row0 + i;
        if (row >= blk.rows) continue;
        T* out_row = out_view<KV_SPLIT>(p).template at<T>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
        for (int c = 0; c < TD; ++c) {
            const int col = tx + GROUP * c;
            if (col < p.dims.dv) out_row[col] = acc_o[i][c] * f.inv_sum;
        }
        if (tx == 0) store_lse(lse_view<KV_SPLIT>(p), blk, row, f.lse);
    }
}

// A warp's 16 rows of O (m16n8 C fragments, 16-bit T) staged into a shared tile for a bulk tensor
// store, every row written (the tensor map clips rows past lq), pair (row, col) at byte
// offset(row, col) of `tile`; and their lse, rows of the block past blk.rows skipped. tile_row: the
// warp's first row within the tile; block_row: the tile's first row within the block.
template <typename T, int O_TILES, typename Offset>
__device__ __forceinline__ void stage_o_lse_c_frags(unsigned char* tile, Offset&& offset, const View& lse,
                                                    const QueryBlock& blk, int tile_row, int block_row, int lane,
                                                    const float (&acc_o)[1][O_TILES][4], const float (&row_max)[1][2],
                                                    const float (&row_sum)[1][2]) {
    static_assert(sizeof(T) == 2, "16-bit pairs");
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const FinishedRow<float> f = finish_row<4>(row_max[0][r], row_sum[0][r]);
        const int row = tile_row + lane / 4 + 8 * r;
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
            *reinterpret_cast<unsigned*>(tile + offset(row, n * 8 + 2 * (lane % 4))) =
                pack2<T>(acc_o[0][n][2 * r] * f.inv_sum, acc_o[0][n][2 * r + 1] * f.inv_sum);
        if (lane % 4 == 0 && block_row + row < blk.rows) store_lse(lse, blk, row, f.lse, block_row);
    }
}
