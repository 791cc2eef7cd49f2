// scheduler.cuh -- which block a CTA works on: the grid's order over (batch, head, block), the
// query and key blocks it names, and the schedule by which a CTA comes to own them.
//
// The schedule is a compile-time choice (the variant selection decides it once, cuflash/_dispatch/select.py,
// and passes it as a template parameter):
//   SCHEDULE_ONE_A_BLOCK  one CTA a block: CTA blockIdx.x owns block blockIdx.x and nothing else.
//   SCHEDULE_STRIDE       a persistent grid (fewer CTAs than blocks, one an SM) whose CTA owns blocks
//                         blockIdx.x, + gridDim.x, ...: blocks of equal work.
//   SCHEDULE_QUEUE        a persistent grid whose CTA owns blockIdx.x first, then each index it takes
//                         from the host's zeroed counter FwdParams::block_queue with atomicAdd: blocks
//                         of unequal work (a causal band), each going to whichever CTA frees first.
// Split-KV (KeySplit: a block is a query block and a range of key tiles) and packed sequences
// (PackedBlock: a block of one sequence of a varlen batch, from the host's table) are further modes.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "tma.cuh"

enum Schedule { SCHEDULE_ONE_A_BLOCK = 0, SCHEDULE_STRIDE = 1, SCHEDULE_QUEUE = 2 };

// The block index read again (asm volatile: not the value ptxas already holds): an epilogue forms
// its block's coordinates anew (the 16-bit dK/dV kernel's) instead of holding them across the loop.
__device__ __forceinline__ int block_index_reread() {
    int block;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(block));
    return block;
}

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
// goes to DRAM (the Hopper dbias kernel: 7.8 GB of DRAM traffic; 1.9 GB with groups; benchmarks/tune_dbias.py).
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

// Split-KV (a forward's KV_SPLIT; FwdParams::num_splits, split_tiles): the grid is num_splits copies
// of the query blocks' grid, copy s (the slowest index) taking the key tiles [s * split_tiles,
// (s + 1) * split_tiles) of each block's visible range, and writing its partial O and lse in the
// accumulator type as batch s * B + b of out_partial / lse_partial (flash_fwd_combine.cu merges them).
// Without KV_SPLIT each function is the plain grid's.
template <int BM, bool KV_SPLIT>
struct KeySplit {
    // This CTA's split, from the block index (0 without KV_SPLIT).
    __device__ __forceinline__ static int index(const AttnDims& dims) {
        if constexpr (KV_SPLIT) return int(blockIdx.x) / QueryBlock::count<BM>(dims);
        else return 0;
    }
    // The CTA's query block: QueryBlock::from_grid's within its split's copy of the grid.
    __device__ __forceinline__ static QueryBlock query_block(const AttnDims& dims, int head_group) {
        if constexpr (KV_SPLIT)
            return QueryBlock::from_index<BM>(dims, int(blockIdx.x) % QueryBlock::count<BM>(dims), head_group);
        else return QueryBlock::from_grid<BM>(dims, head_group);
    }
    // A block's visible key tiles (any {begin, end} range of tiles) cut to this CTA's split.
    template <typename Range>
    __device__ __forceinline__ static Range keys(Range r, const FwdParams& p) {
        if constexpr (KV_SPLIT) {
            const int s = index(p.dims);
            r.begin = imax(r.begin, s * p.split_tiles);
            r.end = imin(r.end, (s + 1) * p.split_tiles);
        }
        return r;
    }
    // The block as the epilogue addresses it: its split's slice of the partial buffers.
    __device__ __forceinline__ static QueryBlock partial_block(QueryBlock blk, const AttnDims& dims) {
        if constexpr (KV_SPLIT) blk.batch += index(dims) * dims.batch;
        return blk;
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


// Packed sequences (cuflash.varlen; MaskParams::packed_blocks): the blocks are (table entries) x (query
// heads; K/V heads for the key-major dK/dV kernel), MaskParams::packed_count of them. The host's table
// (cuflash/_dispatch/packed.py) lists each sequence's tiles together, longest sequence first; an entry
// is eight int32, two 16-byte loads: {q_start, k_start, first, lq, lk, seq, seq_entry, seq_tiles}. The
// blocks of a sequence of T tiles whose first entry is E are blocks heads x E .. heads x (E + T) - 1, a
// head's T tiles in a row (block E x heads + h x T + t: head h, entry E + t), so that CTAs that run
// together share one head's K / V (Q / dO for dK/dV) in L2, as a dense grid's tiles do. The views of q,
// out and lse (k and v) are given a batch stride of one row, so that a block whose batch index is its
// sequence's first row (q_start, or k_start for K and V) addresses its rows as a dense kernel does: rows
// first.., counted from the sequence's start.
struct PackedBlock {
    int q_start, k_start;   // the sequence's first row in the packed q (out, lse) and k (v)
    int first;              // the block's first query row (or key) within the sequence
    int lq, lk;             // the sequence's query and key counts
    int head;               // the block's query head (K/V head: key-major tables)

    // Block `idx`: entry idx / heads lies in the block's sequence (E <= idx / heads < E + T) and names
    // E and T; the block's own entry is E + (idx - heads x E) % T.
    __device__ __forceinline__ static PackedBlock at(const MaskParams& m, int idx, int heads) {
        const int4* table = reinterpret_cast<const int4*>(m.packed_blocks);
        const int4 seq = table[2 * (idx / heads) + 1];   // {lk, seq, seq_entry, seq_tiles}
        const int in_seq = idx - heads * seq.z;
        const int entry = seq.z + in_seq % seq.w;
        const int4 a = table[2 * entry];
        return {a.x, a.y, a.z, a.w, seq.x, in_seq / seq.w};
    }
    __device__ __forceinline__ static PackedBlock of_cta(const MaskParams& m, int heads) {
        return at(m, int(blockIdx.x), heads);
    }

    // The block's query rows (BM from `first`) of its query head, its batch index the row start.
    __device__ __forceinline__ QueryBlock query_block(const AttnDims& dims, int bm) const {
        return {q_start, head, head / dims.group, first, imin(bm, lq - first)};
    }

    // The block's keys (BN from `first`; a key-major table, heads = Hk) of its K/V head, its batch
    // index the sequence's first key (the query side's is q_start).
    __device__ __forceinline__ KeyBlock key_block(const AttnDims& dims, int bn) const {
        return {k_start, head, first, imin(bn, lk - first), head * dims.group, (head + 1) * dims.group};
    }
};

// Where a block's tiles lie in the coordinates of a Hopper kernel's tensor maps (row, batch): a dense
// block's rows of its batch entry, or a packed sequence's rows counted from the packed tensor's first,
// whose maps describe (total, H, D) as one batch entry (D, total, H, 1) (cuflash/_runtime/tma.py): the copy
// engine's bounds are the packed tensor's, not a sequence's.
struct TmaRows {
    int q0, k0;   // added to a query row (out's too) and to a key row within the block's sequence
    int batch;    // the batch coordinate

    __device__ __forceinline__ static TmaRows dense(int batch) { return {0, 0, batch}; }
    __device__ __forceinline__ static TmaRows packed(const PackedBlock& seq) { return {seq.q_start, seq.k_start, 0}; }
};

// The query blocks a persistent CTA (SCHEDULE_STRIDE or SCHEDULE_QUEUE) owns, in turn, and the ring
// through which a Hopper forward's producer thread hands each block index to its consumer warpgroups
// (`ring`: two 8-byte index slots, then their full and empty mbarriers, 48 bytes of shared memory),
// so that both walk the same blocks: the consumers learn the next block as soon as the producer takes
// it, about two tiles before they finish the current one. The producer hands over every index it
// takes, the first one at or past the block count included (no more blocks).
// (Held by value, addresses and all: a reference to a kernel's shared-memory struct put that struct
// on the stack.)
template <int SCHEDULE>
struct BlockWalk {
    static constexpr int RING_WORDS = 2 + 2 * 2;   // 8-byte words: two slots, two full, two empty
    unsigned ring;
    int round = 0;   // indices handed over so far

    __device__ __forceinline__ unsigned slot(int s) const { return ring + 8 * s; }
    __device__ __forceinline__ unsigned full(int s) const { return ring + 8 * (2 + s); }
    __device__ __forceinline__ unsigned empty(int s) const { return ring + 8 * (4 + s); }

    // The block after `idx`: SCHEDULE_QUEUE takes the next index from the host's counter `queue`
    // (FwdParams::block_queue, read from the parameter bank where used); SCHEDULE_STRIDE strides.
    // (A SCHEDULE_ONE_A_BLOCK loop ends after its first block and never gets here.)
    __device__ __forceinline__ static int next(int idx, int* queue) {
        if constexpr (SCHEDULE == SCHEDULE_QUEUE) return int(gridDim.x) + atomicAdd(queue, 1);
        else return idx + int(gridDim.x);
    }
    // Producer: hand `idx` to the consumers once they have read the slot's previous index.
    __device__ __forceinline__ void give(int idx) {
        const int s = round & 1;
        mbar_wait(empty(s), ((round >> 1) & 1) ^ 1);   // the round before this one
        st_shared_s32(slot(s), idx);
        mbar_arrive(full(s));                           // release: the index before it
        ++round;
    }
    // Consumer thread: the next index the producer gave.
    __device__ __forceinline__ int take() {
        const int s = round & 1;
        mbar_wait(full(s), (round >> 1) & 1);
        const int idx = ld_shared_s32(slot(s));
        mbar_arrive(empty(s));
        ++round;
        return idx;
    }
};
