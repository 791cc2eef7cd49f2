// params.cuh -- what a kernel is told: tensor views, sizes, scale, mask parameters, and the
// variant table's tile configuration. Which block a CTA works on is scheduler.cuh's.
//
// Every kernel takes one of these structs by value. cuflash/_runtime/params.py builds the
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
    // block_q and block_k as a multiply and a shift (fast_div, common.cuh): the per-element layout lookup
    // divides without an integer division's ~25 instructions
    unsigned block_q_mul, block_k_mul;
    int block_q_shift, block_k_shift;
    ScoreTensor bias;          // EXTRA: input dtype, added to the scaled scores (natural-log units)
    ScoreTensor mask;          // EXTRA: bool (one byte), false = does not attend
    ScoreTensor layout;        // EXTRA: int8 BlockState per (query block, key block); null = all BLOCK_ALL
    // EXTRA with a layout: its spans, int32 pairs (first, last) of the blocks not BLOCK_OFF (first > last:
    // none), per query block along the key blocks (layout_rows, "row" = query block) and per key block along
    // the query blocks (layout_cols, "row" = key block); null = not given (the kernels walk the layout)
    ScoreTensor layout_rows, layout_cols;
    unsigned drop_threshold;   // EXTRA: dropout drops an element iff its Philox word < drop_threshold; 0 = off
    unsigned seed_lo, seed_hi;
    // EXTRA: the (row, key) the call's element (0, 0) has in the dropout mask's coordinates (a slice of a
    // longer sequence, e.g. a ring step's block, draws its own part of the whole mask); drop_col0 % 4 == 0:
    // a Philox draw's four keys stay one draw
    int drop_row0, drop_col0;
    double keep_scale;         // 1 / (1 - dropout_p)
    const int* key_lengths;    // split-KV forwards (ScoreMod's PER_SEQ): each batch entry's key count; null = Lk
    // A paged KV cache (the 16-bit split forward, flash_fwd_mma's PER_SEQ path): key j of batch entry b
    // is row j % page_size of page page_table[b * pages_per_seq + j / page_size], the K / V views' batch
    // stride stepping from page to page; null = no pages. page_size is a power of two; page indices are
    // clamped to [0, num_pages).
    const int* page_table;
    int page_size, pages_per_seq, num_pages;
    // Packed sequences (a forward's PACKED; cuflash.varlen): the block table, 8 int32 a block
    // (scheduler.cuh, PackedBlock); null = not packed. band_from_end: the band, computed on the host for
    // a diagonal through (0, 0), moves by each sequence's key count minus its query count
    // (causal="bottom_right").
    const int* packed_blocks;
    int band_from_end;
    // The table's entries x heads: the blocks a persistent packed grid (the Hopper forward's walk) takes.
    int packed_count;
    // Packed GQA rows under a band (the decoding kernel): a block's rows are its K/V head's query heads,
    // band_period positions each, and the band reads row % band_period; 0 = a row is its position.
    int band_period;
    // User modifications (EXTRA; cuflash.mods, user_mod.cuh): their parameters, a word each (a number's
    // bits, an array's address), in the order the generated source reads them.
    unsigned long long mod_args[16];
};

// The block-state kernel of mask modifications (mask_mod_states.cu).
struct MaskStatesParams {
    signed char* states;           // (batches, heads, q_blocks, k_blocks), row-major
    unsigned long long args[16];   // the modifications' parameter words (MaskParams::mod_args)
    long long first;               // this launch's first block (a launch is at most 2^30 CTAs)
    int heads, q_blocks, k_blocks;
    int lq, lk, block_q, block_k;
};

// The spans kernel of a block layout (layout_spans.cu): states (pairs, q_blocks, k_blocks), row-major, of a
// call with call_q_blocks x call_k_blocks blocks (an axis of one block may be broadcast); rows (pairs,
// q_blocks, 2) and cols (pairs, k_blocks, 2) int32, the first and last block not BLOCK_OFF.
struct LayoutSpansParams {
    const signed char* states;
    int* rows;
    int* cols;
    int pairs, q_blocks, k_blocks;
    int call_q_blocks, call_k_blocks;
};

// A 4-D array of any strides (elements, 64-bit), read or written element by element.
struct Strided4 {
    void* ptr;
    int64 strides[4];
};

// The KV-cache call's append (kv_append.cu): k_new / v_new (batch, heads, n_new, d / dv) written into the
// caches at positions lengths[b] + t of sequence b; total (batch,) int32 receives lengths[b] + n_new.
// lengths null: every sequence holds `length` keys. page_table null: a contiguous cache of `cap`
// positions a sequence; else (batch, pages_per_seq) int32 entries over num_pages pages of page_size
// positions, the caches' batch stride stepping from page to page.
struct KvAppendParams {
    Strided4 k_new, v_new, k_cache, v_cache;
    const int* lengths;
    const int* page_table;
    int* total;
    int length, batch, heads, n_new, d, dv, cap;
    int page_size, pages_per_seq, num_pages;
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
    // Split-KV (scheduler.cuh, KeySplit): num_splits partial results, split s over key tiles
    // [s * split_tiles, (s + 1) * split_tiles) of the variant's block_n, written in the accumulator
    // type as batch s * B + b of out_partial (S * B, Hq, Lq, >= Dv rounded up to even) and
    // lse_partial (S * B, Hq, Lq); the combine kernel (flash_fwd_combine.cu) merges them into out and lse.
    // The decoding kernel over one split without partial buffers (out_partial.ptr null) writes out and lse.
    int num_splits, split_tiles;
    View out_partial, lse_partial;
    // SCHEDULE_QUEUE (scheduler.cuh): the host's block counter, zero at the launch, from which the
    // persistent grid's CTAs take their next query block in turn; unread by every other schedule.
    // Last: the other kernels' field offsets do not depend on it.
    int* block_queue;
    // The decoding kernel's combine in its last CTA (flash_fwd_decode.cu): a counter a query block
    // (batch, head, block), zero at the launch and left zero by the block's last split; null = the
    // combine kernel merges the partials.
    int* split_counters;
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
// (cuflash/_dispatch/tables.py) chose it: head-dim bucket, BM query rows x BN keys per
// tile, warps, pipeline stages, and MIN_CTAS, the CTAs per SM the register
// budget must allow (__launch_bounds__). THREADS and SMEM_BYTES are what the
// launch will use (computed on the host); each kernel static_asserts that they
// match its own layout, so the table and the kernels cannot drift apart.
template <int HEAD_, int BM_, int BN_, int WARPS_, int STAGES_, int MIN_CTAS_, int THREADS_, int SMEM_BYTES_>
struct TileCfg {
    static constexpr int HEAD = HEAD_, BM = BM_, BN = BN_, WARPS = WARPS_, STAGES = STAGES_;
    static constexpr int MIN_CTAS = MIN_CTAS_, THREADS = THREADS_, SMEM_BYTES = SMEM_BYTES_;
};
