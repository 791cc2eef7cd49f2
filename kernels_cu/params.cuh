// params.cuh -- what a kernel is told: tensor views, sizes, scale, mask parameters;
// and BlockInfo, which (batch, head, tile) a CTA owns.
//
// Every kernel takes one of these structs by value. cuflash/_params.py builds the
// same layout on the host; tests/test_params.py checks every offset against this
// file with offsetof, compiled by NVRTC.
#pragma once
#include "common.cuh"

// A rank-4 tensor seen as (batch, head, row, column), the column axis unit-stride.
// Strides are in elements and 64-bit; a stride of 0 broadcasts along that axis
// (how a bias shared by all heads arrives). Vectors such as lse (B, H, L) are
// views whose "row" is the query index (row_stride 1) and which have one column.
struct View {
    void* ptr;
    int64 batch_stride, head_stride, row_stride;

    template <typename T>
    __device__ __forceinline__ T* at(int batch, int head, int row) const {
        return static_cast<T*>(ptr) + (batch * batch_stride + head * head_stride + row * row_stride);
    }
};

// Sizes of one attention call. Query head h reads K/V head h / group.
struct AttnDims {
    int batch, heads_q, group;
    int lq, lk, d, dv;
};

// A (batch, head, row, col) tensor read through four strides (elements, 64-bit),
// 0 along every axis it broadcasts: how a bias, a boolean mask or a block layout
// arrives, never expanded in memory. A null ptr means "not given".
struct ScoreTensor {
    const void* ptr;
    int64 batch_stride, head_stride, row_stride, col_stride;

    template <typename T>
    __device__ __forceinline__ const T* at(int batch, int head, int row, int col) const {
        return static_cast<const T*>(ptr) + (batch * batch_stride + head * head_stride + row * row_stride
                                             + col * col_stride);
    }
};

// Block layout states (MaskParams::layout), per (query block, key block), as far
// as the boolean mask and block sparsity are concerned.
enum BlockState { BLOCK_OFF = 0, BLOCK_SOME = 1, BLOCK_ALL = 2 };

// Runtime parameters of the masking policy (score_mod.cuh). Which pieces are
// active is a compile-time choice (MaskFlags); unused fields are ignored.
struct MaskParams {
    int band_lo, band_hi;      // BAND: key j is visible to query i iff i + band_lo <= j <= i + band_hi
    int block_q, block_k;      // the layout's block size (query rows x keys)
    ScoreTensor bias;          // EXTRA: input dtype, added to the scaled scores (natural-log units)
    ScoreTensor mask;          // EXTRA: bool (one byte), false = does not attend
    ScoreTensor layout;        // EXTRA: int8 BlockState per (query block, key block); null = all BLOCK_ALL
    unsigned drop_threshold;   // EXTRA: dropout drops an element iff its Philox word < drop_threshold; 0 = off
    unsigned seed_lo, seed_hi;
    double keep_scale;         // 1 / (1 - dropout_p)
};

// Where the backward sums dS into dbias (bias_grad.cuh). acc has the bias's own
// broadcast shape (stride 0 along its broadcast axes) in the accumulator type.
// DBIAS_KERNEL: the tensor-core backward's own dbias kernel (flash_bwd_dbias.cu)
// forms it; the dK/dV kernels add nothing. DBIAS_KEY_MAJOR: the Hopper dK/dV kernel
// adds dS^T itself into a [key][query] fp32 accumulator (row stride 1, col stride the
// pitch; bias_grad_t.cuh).
enum DbiasMode { DBIAS_NONE = 0, DBIAS_ADD = 1, DBIAS_ATOMIC = 2, DBIAS_ORDERED = 3, DBIAS_KERNEL = 4,
                 DBIAS_KEY_MAJOR = 5 };
struct DbiasParams {
    ScoreTensor acc;
    int* order;                // DBIAS_ORDERED: contributions landed so far, per bias tile
    int mode;                  // DbiasMode
    int rows_broadcast;        // the bias has one query row: dS is summed over queries first
    int tiles_b, tiles_h, tiles_i;   // DBIAS_ORDERED: the bias tile grid (1 along broadcast axes)
    int splits;                // DBIAS_KERNEL: the walk over broadcast axes is cut into this many parts,
    int64 split_stride;        //   each adding into its own slice of acc, split_stride elements apart
};

struct FwdParams {
    View q, k, v;        // (B, Hq|Hk, L, D|Dv)
    View out;            // (B, Hq, Lq, Dv)
    View lse;            // (B, Hq, Lq): natural-log logsumexp of the scaled, masked scores
    AttnDims dims;
    MaskParams mask;
    double scale_log2;   // scale * log2(e), folded once on the host
    float scale_log2_f;  // scale_log2 in float (see acc_param)
    // A persistent Hopper grid's block counter, zero at the launch (the host's), from which its CTAs
    // take their next query block in turn; null: each CTA strides blockIdx.x, + gridDim.x, ...
    // (flash_fwd_wgmma.cu, BlockWalk). Last, so that the other kernels' field offsets stay as they were.
    int* block_queue;
};

struct BwdParams {
    View q, k, v, out, dout, lse;   // the forward's inputs and results, and dL/dout
    View dsum;                      // (B, Hq, Lq) workspace: Dsum = rowsum(dO * O), accumulator type
    View dq_acc;                    // (B, Hq, Lq, D) workspace: dQ summed with atomics, accumulator type
    View dq, dk, dv;                // the gradients, input dtype
    AttnDims dims;
    MaskParams mask;
    DbiasParams dbias;
    double scale, scale_log2;
    float scale_log2_f;             // scale_log2 in float (see acc_param)
};

// A scale in the accumulator's precision. The host writes each scale as double
// and as float, so a float kernel reads its copy straight from the parameter
// bank: converting the double in the kernel put an F2F.F32.F64 inside the key
// loop (ptxas re-reads the parameter rather than hold a register).
template <typename A>
__device__ __forceinline__ A acc_param(double as_double, float as_float) {
    if constexpr (sizeof(A) == sizeof(double)) return as_double;
    else return as_float;
}

// A kernel's compile-time tile configuration, exactly as the variant table
// (cuflash/_variants.py) chose it: head-dim bucket, BM query rows x BN keys per
// tile, warps, pipeline stages, and MIN_CTAS, the CTAs per SM the register
// budget must allow (__launch_bounds__). THREADS and SMEM_BYTES are what the
// launch will use (computed on the host); each kernel static_asserts that they
// match its own layout, so the table and the kernels cannot drift apart.
template <int HEAD_, int BM_, int BN_, int WARPS_, int STAGES_, int MIN_CTAS_, int THREADS_, int SMEM_BYTES_>
struct TileCfg {
    static constexpr int HEAD = HEAD_, BM = BM_, BN = BN_, WARPS = WARPS_, STAGES = STAGES_;
    static constexpr int MIN_CTAS = MIN_CTAS_, THREADS = THREADS_, SMEM_BYTES = SMEM_BYTES_;
};

// Which (tile, head, batch) this CTA owns. The grid is one-dimensional
// (gridDim.x up to 2^31 - 1), so batch x heads has no 65535 limit. Tiles vary
// fastest: consecutive CTAs share one head's K/V (or Q/dO) in L2. With
// REVERSE the tile order runs last to first, so that under a causal mask the
// longest query blocks start first and the short ones fill in at the end.
struct BlockInfo {
    int tile, head, batch;

    // head_group 0: tiles vary fastest, then heads, then batches. head_group G > 0: the (batch,
    // head) pairs in groups of G, each group's CTAs tile by tile with its G pairs side by side
    // (the last group may be smaller), so that the CTAs that add into one tile of an accumulator
    // shared across heads run together (shared_scores_head_group below). For a fixed
    // tile, blockIdx still grows with (batch, head) in both orders.
    template <bool REVERSE>
    __device__ __forceinline__ static BlockInfo from_grid(int n_tiles, int heads, int head_group = 0) {
        return from_index<REVERSE>(blockIdx.x, n_tiles, gridDim.x / n_tiles, heads, head_group);
    }

    // The block of index `idx` of n_tiles x `pairs` (a persistent CTA walks several).
    template <bool REVERSE>
    __device__ __forceinline__ static BlockInfo from_index(int idx, int n_tiles, int pairs, int heads,
                                                           int head_group = 0) {
        int tile, pair;
        if (head_group > 0) {
            const int span = n_tiles * head_group;
            const int group = idx / span, in_group = idx % span;
            const int size = imin(head_group, pairs - group * head_group);
            tile = in_group / size;
            pair = group * head_group + in_group % size;
        } else {
            tile = idx % n_tiles;
            pair = idx / n_tiles;
        }
        BlockInfo b;
        b.tile = REVERSE ? n_tiles - 1 - tile : tile;
        b.head = pair % heads;
        b.batch = pair / heads;
        return b;
    }
};

// The (batch, head) groups (BlockInfo's head_group) of a grid whose CTAs share a tensor across
// batches or heads: a bias or boolean mask that has rows ((1, 1, Lq, Lk), (B, 1, Lq, Lk), ...), whose
// slice for one tile index (query rows, or keys) every (batch, head) reads, or a dbias accumulator
// they all add into (`adds_shared_dbias`: the key-major one, bias_grad_t.cuh). With tiles fastest a
// wave spans every tile of a few heads and walks the whole tensor once per head: a (1, 1, 4096,
// 4096) fp32 bias or accumulator is 64 MB, above the H100's 50 MB L2, so each (batch, head) pass
// went to DRAM (ncu, eleventh session: 7.8 GB in the Hopper dbias kernel; 1.9 GB with groups).
// 16 heads side by side read or add each slice once per group.
constexpr int SHARED_SCORES_HEAD_GROUP = 16;

__device__ __forceinline__ bool shared_with_rows(const ScoreTensor& t) {
    return t.ptr != nullptr && t.row_stride != 0 && (t.batch_stride == 0 || t.head_stride == 0);
}

template <bool EXTRA>
__device__ __forceinline__ int shared_scores_head_group(const MaskParams& m, bool adds_shared_dbias = false) {
    if constexpr (EXTRA) {
        if (adds_shared_dbias || shared_with_rows(m.bias) || shared_with_rows(m.mask)) return SHARED_SCORES_HEAD_GROUP;
    }
    return 0;
}

// What a query-major CTA owns (forward, deterministic dQ, the row-wise kernels):
// query rows [m0, m0 + rows) of query head `head`, which reads K/V head kv_head.
// Grid: ceil(Lq / BM) x Hq x B (or fewer CTAs, each walking several blocks: from_index).
struct QueryBlock {
    int batch, head, kv_head;
    int m0, rows;   // rows <= BM: the block's rows inside the sequence

    // head_group: BlockInfo's, over (batch, query head) pairs.
    template <int BM, bool REVERSE = true>
    __device__ __forceinline__ static QueryBlock from_grid(const AttnDims& dims, int head_group = 0) {
        const BlockInfo b = BlockInfo::from_grid<REVERSE>(ceil_div(dims.lq, BM), dims.heads_q, head_group);
        return at(dims, b, BM);
    }

    // Block `idx` of count<BM>(dims), in from_grid's order: a persistent grid (fewer CTAs than
    // blocks) walks idx = blockIdx.x, blockIdx.x + gridDim.x, ...
    template <int BM, bool REVERSE = true>
    __device__ __forceinline__ static QueryBlock from_index(const AttnDims& dims, int idx, int head_group = 0) {
        const BlockInfo b = BlockInfo::from_index<REVERSE>(idx, ceil_div(dims.lq, BM), dims.batch * dims.heads_q,
                                                           dims.heads_q, head_group);
        return at(dims, b, BM);
    }

    template <int BM>
    __device__ __forceinline__ static int count(const AttnDims& dims) {
        return ceil_div(dims.lq, BM) * dims.heads_q * dims.batch;
    }

    __device__ __forceinline__ static QueryBlock at(const AttnDims& dims, const BlockInfo& b, int bm) {
        const int m0 = b.tile * bm;
        return {b.batch, b.head, b.head / dims.group, m0, imin(bm, dims.lq - m0)};
    }
};

// A query block parked in shared memory (park4, common.cuh): the forward's K/V copies and
// epilogue read it back instead of holding its fields, and the K/V row pointers ptxas derives
// from them, through the loop. rows is not stored: min(BM, lq - m0) is recomputed.
__device__ __forceinline__ void park_query_block(unsigned slot_addr, const QueryBlock& blk) {
    park4(slot_addr, {blk.batch, blk.head, blk.kv_head, blk.m0});
}
template <int BM>
__device__ __forceinline__ QueryBlock unpark_query_block(unsigned slot_addr, const AttnDims& dims) {
    const Parked4 v = unpark4(slot_addr);
    return {v.a, v.b, v.c, v.d, imin(BM, dims.lq - v.d)};
}

// What a key-major CTA owns (dK/dV): keys [n0, n0 + keys) of K/V head kv_head,
// read by query heads [kv_head * group, (kv_head + 1) * group).
// Grid: ceil(Lk / BN) x Hk x B, key block 0 (the most causal work) first.
struct KeyBlock {
    int batch, kv_head;
    int n0, keys;   // keys <= BN: the block's keys inside the sequence
    int first_head, end_head;

    // head_group: BlockInfo's, over (batch, K/V head) pairs.
    template <int BN>
    __device__ __forceinline__ static KeyBlock from_grid(const AttnDims& dims, int head_group = 0) {
        return from_index<BN>(dims, blockIdx.x, head_group);
    }
    // Of CTA `idx` of the grid: from_grid's block, formed again where a kernel's loop would otherwise hold
    // it (idx from block_index_reread: the compiler cannot reuse the first one's registers).
    template <int BN>
    __device__ __forceinline__ static KeyBlock from_index(const AttnDims& dims, int idx, int head_group = 0) {
        const int n_tiles = ceil_div(dims.lk, BN);
        const BlockInfo b = BlockInfo::from_index<false>(idx, n_tiles, gridDim.x / n_tiles, dims.heads_q / dims.group,
                                                         head_group);
        const int n0 = b.tile * BN;
        return {b.batch, b.head, n0, imin(BN, dims.lk - n0), b.head * dims.group, (b.head + 1) * dims.group};
    }
};
