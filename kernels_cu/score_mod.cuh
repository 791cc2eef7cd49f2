// score_mod.cuh -- THE masking policy: which tiles a CTA visits, which of them
// need per-element work, and what happens to each score.
//
// Scores enter as raw dot products q.k and leave in log2 units,
//     x = s * scale * log2(e)            (scale * log2(e) folded once, on the host)
// with x = -inf where query `row` may not attend key `col`. Every kernel, forward
// and backward, tensor-core and FMA, goes through this header:
//   per tile:    key_tiles(rows)   the key tiles a block of query rows must visit
//                query_tiles(cols) the query tiles a block of keys must visit (dK/dV)
//                tile_is_partial   whether any element of the tile is masked; fully
//                                  visible tiles skip the per-element test
//   per element: score(dot, row, col, partial)
// in (batch, head, row, col) coordinates: a ScoreMod is bound to one (batch,
// query head), rows and columns are absolute query and key indices.
// Today the policy holds the sequence end (col < lk) and causal masking in both
// alignments. A bias, a boolean mask, a window, dropout or block sparsity is one
// more MaskFlags bit, a field of MaskParams and a line in score() or the ranges;
// the GEMMs and the online softmax never change.
#pragma once
#include "common.cuh"
#include "params.cuh"

template <bool CAUSAL_>
struct MaskFlags {
    static constexpr bool CAUSAL = CAUSAL_;
};

struct TileRange {
    int begin, end;   // tiles [begin, end); empty when begin >= end
};

template <typename Flags, typename A>
struct ScoreMod {
    int lq, lk, causal_offset;
    A scale_log2;
    int batch, head;   // whose scores these are (the bias and dropout pieces will read them)

    __device__ __forceinline__ ScoreMod(const MaskParams& m, const AttnDims& dims, double scale_log2_,
                                        int batch_, int head_)
        : lq(dims.lq), lk(dims.lk), causal_offset(m.causal_offset), scale_log2(A(scale_log2_)),
          batch(batch_), head(head_) {}

    __device__ __forceinline__ bool allowed(int row, int col) const {
        return col < lk && (!Flags::CAUSAL || col <= row + causal_offset);
    }

    // Key tiles of width block_n that any of the query rows [row0, row0 + rows) may see.
    __device__ __forceinline__ TileRange key_tiles(int row0, int rows, int block_n) const {
        int end = ceil_div(lk, block_n);
        if (Flags::CAUSAL) {
            const int last_key = row0 + rows - 1 + causal_offset;
            end = last_key < 0 ? 0 : imin(end, last_key / block_n + 1);
        }
        return {0, end};
    }

    // Query tiles of height block_m in which some row may see a key of [col0, ...).
    // Under a causal mask the first row that sees key col0 is col0 - causal_offset.
    __device__ __forceinline__ TileRange query_tiles(int col0, int block_m) const {
        const int begin = Flags::CAUSAL ? imax(0, col0 - causal_offset) / block_m : 0;
        return {begin, ceil_div(lq, block_m)};
    }

    // Does some element of the tile (rows [row0, row0 + rows), keys [col0, col0 + cols))
    // fail allowed()? Only such tiles pay for the per-element test.
    __device__ __forceinline__ bool tile_is_partial(int row0, int rows, int col0, int cols) const {
        (void)rows;   // causal: the tile's first row sees the fewest keys
        return col0 + cols > lk || (Flags::CAUSAL && col0 + cols - 1 > row0 + causal_offset);
    }

    // x = s * scale * log2(e), or -inf where masked.
    __device__ __forceinline__ A score(A dot, int row, int col, bool partial) const {
        return (!partial || allowed(row, col)) ? dot * scale_log2 : neg_inf<A>();
    }
};

// score() over a register tile s[I][J]; coord(i, j, row, col) names the element's
// absolute query row and key column (each kernel's fragment layout differs).
// A fully visible tile only scales: no coordinates, no comparisons.
template <typename Mod, typename A, int I, int J, typename Coord>
__device__ __forceinline__ void apply_score_mod(A (&s)[I][J], const Mod& mod, bool partial, Coord coord) {
    if (!partial) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int j = 0; j < J; ++j) s[i][j] = mod.score(s[i][j], 0, 0, false);
        return;
    }
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int j = 0; j < J; ++j) {
            int row, col;
            coord(i, j, row, col);
            s[i][j] = mod.score(s[i][j], row, col, true);
        }
}
