// score_mod.cuh -- THE masking policy: which tiles a CTA visits, which of them
// need per-element work, and what happens to each score and probability.
//
// Scores enter as raw dot products q.k and leave in log2 units,
//     x = (s * scale + bias) * log2(e)   (scale * log2(e) folded once, on the host)
// with x = -inf where query `row` may not attend key `col` (the tensor-core kernels
// may leave the factor scale * log2(e) to the softmax's FFMA: scores_stay_raw).
// Every kernel, forward and backward, tensor-core and FMA, goes through this header:
//   per tile:    key_tiles(rows)    the key tiles a block of query rows must visit
//                query_tiles(cols)  the query tiles a block of keys must visit (dK/dV)
//                classify           TILE_SKIP (nothing visible: never loaded),
//                                   TILE_PARTIAL (per-element test) or TILE_FULL
//   per element: score(dot, row, col, partial), keep(row, col) (dropout)
// in (batch, head, row, col) coordinates: a ScoreMod is bound to one (batch,
// query head); rows and columns are absolute query and key indices.
//
// The pieces, each off at compile time unless its MaskFlags bit is set:
//   always  the sequence end, col < lk
//   BAND    causal (either alignment) and sliding windows: key j is visible to
//           query i iff i + band_lo <= j <= i + band_hi. Key/query tile ranges
//           shrink to the band; only tiles crossing its edges are partial.
//   EXTRA   whatever of these the call has (runtime: a null pointer / zero
//           threshold turns a piece off, a uniform branch):
//           bias    added to every score (needs the coordinates of every element)
//           mask    per element, in partial tiles only
//           layout  per (query block, key block) BlockState, from block sparsity
//                   and a summary of the mask the host computes: BLOCK_OFF tiles
//                   are skipped, BLOCK_ALL ones need no per-element mask test
//           dropout after the softmax statistics: dropped probabilities are 0,
//                   kept ones are scaled by keep_scale (dropout.cuh)
//           user modifications (cuflash.mods, user_mod.cuh; compiled in by the host's
//                   prelude): mask modifications in the per-element test (their block
//                   states in the layout), score modifications on every visible score
//                   after it (forward: apply_user_score; backward: prob_and_dscore_at)
// One EXTRA bit rather than one per piece keeps the variant count at 2x; the
// plain kernels (EXTRA off) carry none of this code.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "dropout.cuh"
#include "softmax.cuh"
#include "user_mod.cuh"

template <bool BAND_, bool EXTRA_>
struct MaskFlags {
    static constexpr bool BAND = BAND_;
    static constexpr bool EXTRA = EXTRA_;
};

struct TileRange {
    int begin, end;   // tiles [begin, end); empty when begin >= end

    __device__ __forceinline__ bool contains(int t) const { return t >= begin && t < end; }
};

// TILE_BAND: partial only where the band or the sequences' ends cut it; every element inside them is allowed
// (its layout blocks are BLOCK_ALL, or there is no layout): the per-element test is the band's alone.
enum TileKind { TILE_SKIP = 0, TILE_PARTIAL = 1, TILE_FULL = 2, TILE_BAND = 3 };

__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// PER_SEQ (the split-KV forwards, KV_SPLIT, and the packed ones, PACKED): MaskParams::key_lengths, where
// not null, gives each batch entry its own key count (a KV cache's valid keys, at most dims.lk), and the
// band, computed on the host for dims.lk keys aligned to the end, moves with it: every sequence's diagonal
// ends at its own last key. A packed sequence's block brings its own counts (the PackedBlock constructor).
template <typename Flags, typename A, typename T = A, bool PER_SEQ = false>
struct ScoreMod {
    int lq, lk;
    A scale_log2;
    int batch, head;   // whose scores these are (bias, mask, layout and dropout read them)
    const MaskParams& m;
    int shift = 0;     // PER_SEQ: this sequence's key count minus dims.lk (<= 0)

    // scale_log2_: the params' scale_log2 in the accumulator's precision (acc_param).
    __device__ __forceinline__ ScoreMod(const MaskParams& m_, const AttnDims& dims, A scale_log2_, int batch_,
                                        int head_)
        : lq(dims.lq), lk(dims.lk), scale_log2(scale_log2_), batch(batch_), head(head_), m(m_) {
        if constexpr (PER_SEQ) {
            if (m.key_lengths != nullptr) {   // clamped: an unchecked length stays inside the cache
                lk = min(max(m.key_lengths[batch], 0), dims.lk);
                shift = lk - dims.lk;
            }
        }
    }

    // A block of a packed sequence (PackedBlock, scheduler.cuh): the sequence's own query and key counts,
    // the band moved by lk - lq where it is aligned to the sequence's end (MaskParams::band_from_end).
    __device__ __forceinline__ ScoreMod(const MaskParams& m_, const PackedBlock& blk, A scale_log2_, int head_)
        : lq(blk.lq), lk(blk.lk), scale_log2(scale_log2_), batch(0), head(head_), m(m_),
          shift(m_.band_from_end ? blk.lk - blk.lq : 0) {
        static_assert(PER_SEQ && !Flags::EXTRA, "a packed sequence's counts: the kernels without EXTRA (PER_SEQ)");
        static_assert(!USER_SCORE && !USER_MASK, "packed sequences take no user modifications");
    }

    // The band's offsets (MaskParams::band_lo / band_hi, moved with a sequence's own end under PER_SEQ).
    __device__ __forceinline__ int band_lo() const {
        if constexpr (PER_SEQ) return m.band_lo + shift;
        else return m.band_lo;
    }
    __device__ __forceinline__ int band_hi() const {
        if constexpr (PER_SEQ) return m.band_hi + shift;
        else return m.band_hi;
    }

    __device__ __forceinline__ bool has_bias() const { return Flags::EXTRA && m.bias.ptr != nullptr; }

    // The plain tensor-core kernels leave scores as raw dot products and fold the
    // scale into the exponential's FFMA, 2^(s * scale_log2 - ref) (one instruction
    // a score fewer). That needs a positive, normal float scale_log2: it commutes
    // with the row max and keeps a masked -inf at -inf, where zero or a negative
    // scale would not; the host launches the EXTRA variant for any other scale
    // (cuflash/_dispatch/plan.py, scale_folds). The EXTRA kernels form x themselves (a
    // biased score is x already, and at 251-255 registers they spill with both
    // forms compiled in).
    __device__ __forceinline__ static constexpr bool scores_stay_raw() { return !Flags::EXTRA; }
    // The factor the softmax still applies to apply_score_mod's output (x_per_s).
    __device__ __forceinline__ A x_per_score() const { return scores_stay_raw() ? scale_log2 : A(1); }

    __device__ __forceinline__ bool has_dropout() const { return Flags::EXTRA && m.drop_threshold != 0u; }

    __device__ __forceinline__ bool in_band(int row, int col) const {
        return !Flags::BAND || (col >= row + band_lo() && col <= row + band_hi());
    }

    // The per-element test of a partial tile.
    __device__ __forceinline__ bool allowed(int row, int col) const {
        if (col >= lk || !in_band(row, col)) return false;
        if (!Flags::EXTRA) return true;
        if (row >= lq) return false;   // rows past the end: nothing to read there
        if (m.layout.ptr) {
            const int state = *m.layout.at<signed char>(batch, head, fast_div(row, m.block_q_mul, m.block_q_shift),
                                                         fast_div(col, m.block_k_mul, m.block_k_shift));
            if (state == BLOCK_OFF) return false;
            // every source of the layout (block layout, mask, mask modifications) allows the whole block: the
            // element needs none of their per-element tests
            if (state == BLOCK_ALL) return true;
        }
        if (USER_MASK && !user_mask_allows(batch, head, row, col, m.mod_args)) return false;
        return !m.mask.ptr || *m.mask.at<unsigned char>(batch, head, row, col) != 0;
    }

    // The user score modifications of a visible score s as a kernel holds it, x / x_per_s (x in log2 units:
    // x_per_s 1 where the kernel formed x, the scale where its scores stay raw dot products), returned as
    // the modified x (the softmax then takes x_per_s 1: softmax_x_per_s).
    // SELECT_USER: the user modifications are evaluated everywhere (ScoreMod everywhere=True) in the plain
    // kernels (score modifications alone, the fast path): -inf selected after them, or (the forwards'
    // mask_and_modify) the kernel's mask applied after them. The EXTRA kernels' registers hold their
    // per-element tests, and the unconditional chain spilled there: a branch. (Of the backwards, the Hopper
    // dK/dV kernel takes the select too, prob_and_dscore_at FOLDED; the portable ones keep the branch: their
    // unconditional derivative chain spilled 20-120 bytes.)
    static constexpr bool SELECT_USER = USER_SCORE_EVERYWHERE && !Flags::EXTRA;

    // FOLDED: the plain forwards' form (mask_and_modify), whose softmax takes CUF_USER_OUT_SCALE as its x_per_s
    // (softmax_x_per_s): the first modification's input factor joins x_per_s (one multiply an element), the
    // last one's output factor is left to the softmax's exponential.
    template <bool FOLDED = false>
    __device__ __forceinline__ A user_score(A s, int row, int col, A x_per_s) const {
        clamp_for_user<SELECT_USER>(row, col);   // (rel_pos of the clamped indices: they differ where dropped)
        return user_modified_score<SELECT_USER ? USER_SELECT : USER_BRANCH, FOLDED>(
            s * (FOLDED ? x_per_s * A(CUF_USER_IN_SCALE) : x_per_s), batch, head, row, col, A(0), m.mod_args);
    }
    // The folded form of a raw score before the mask (SELECT_USER kernels: mask_and_modify): no test of x.
    // rel: col - row, as mask_and_modify forms it.
    __device__ __forceinline__ A user_score_before_mask(A s, int row, int col, A rel, A x_per_s) const {
        static_assert(SELECT_USER, "before the mask: modifications evaluated everywhere, in the plain kernels");
        clamp_for_user<true>(row, col);
        return user_modified_score<USER_BEFORE_MASK, true, true>(s * (x_per_s * A(CUF_USER_IN_SCALE)), batch, head,
                                                                 row, col, rel, m.mod_args);
    }

    // A tile's rows and keys past the sequences' ends as the last ones, where the user modifications would
    // see them: a plain kernel has no per-element row test and forms the rows past lq (their scores are not
    // -inf), and modifications evaluated everywhere (SELECT) see the keys past lk too. The clamped indices
    // read only where a visible element would. (The EXTRA kernels mask both.)
    template <bool SELECT>
    __device__ __forceinline__ void clamp_for_user(int& row, int& col) const {
        if (!Flags::EXTRA) row = imin(row, lq - 1);
        if (SELECT) col = imin(col, lk - 1);
    }

    // prob_and_dscore (softmax.cuh) of the score x at (row, col). With user score modifications P is
    // that of the modified score and dS that of the raw one (dS of the modified one times their
    // derivative), and with PARAM_GRADS the trainable parameters take their gradients from dS of the
    // modified one: in the one kernel of a backward that forms every dS for dK (not the dQ, dbias or
    // dV-only passes, which form them again). FOLDED: the modifications' folded form (as the forwards'),
    // their input factor joined to x_per_s and their output factor the exponential's (the Hopper dK/dV kernel;
    // the portable dK/dV kernel at head dim 128 spilled 8-28 bytes with it, NVRTC 12.9).
    template <bool PARAM_GRADS, bool FOLDED = false>
    __device__ __forceinline__ void prob_and_dscore_at(A& s_to_p, A& dp_to_ds, A lse_log2, A dsum, A keep, A x_per_s,
                                                       int row, int col) const {
        if constexpr (!USER_SCORE) {
            prob_and_dscore(s_to_p, dp_to_ds, lse_log2, dsum, keep, x_per_s);
        } else {
            const A x = s_to_p * x_per_s;
            A grad;
            if constexpr (FOLDED) {
                const A rel = A(col - row);   // before the clamp (the portable kernels form it behind the branch)
                clamp_for_user<SELECT_USER>(row, col);
                s_to_p = user_modified_score_grad<true, SELECT_USER, true>(s_to_p * (x_per_s * A(CUF_USER_IN_SCALE)),
                                                                           batch, head, row, col, rel, m.mod_args,
                                                                           grad);
                prob_and_dscore(s_to_p, dp_to_ds, lse_log2, dsum, keep, A(CUF_USER_OUT_SCALE));
            } else {
                clamp_for_user<false>(row, col);
                s_to_p = user_modified_score_grad(x, batch, head, row, col, A(0), m.mod_args, grad);
                prob_and_dscore(s_to_p, dp_to_ds, lse_log2, dsum, keep);
            }
            if constexpr (PARAM_GRADS) user_param_grads<A>(x, batch, head, row, col, m.mod_args, dp_to_ds);
            dp_to_ds = dp_to_ds == A(0) ? A(0) : dp_to_ds * grad;   // P = 0 (masked): 0, whatever grad is there
        }
    }

    // Without EXTRA a partial tile's test is the band and the sequence end only:
    // query `row` sees keys col0 + [lo, hi]. The elements of one fragment row share
    // these two numbers, so a kernel compares each element's offset from col0 (a
    // compile-time constant there) with them instead of forming (row, col) and
    // calling allowed().
    __device__ __forceinline__ void visible_keys(int row, int col0, int& lo, int& hi) const {
        static_assert(!Flags::EXTRA, "the EXTRA pieces need the per-element test (allowed)");
        lo = (Flags::BAND ? row + band_lo() : 0) - col0;
        hi = (Flags::BAND ? imin(row + band_hi(), lk - 1) : lk - 1) - col0;
    }

    // The same seen from a key (the dK/dV kernels' S^T, whose rows are keys): key `col`
    // is seen by the queries row0 + [lo, hi] (none past the sequence end).
    __device__ __forceinline__ void visible_queries(int col, int row0, int& lo, int& hi) const {
        static_assert(!Flags::EXTRA, "the EXTRA pieces need the per-element test (allowed)");
        lo = Flags::BAND ? col - band_hi() - row0 : 0;
        hi = col >= lk ? -1 : Flags::BAND ? col - band_lo() - row0 : lq;
    }

    // Key tiles of width block_n that each of the rows [row0, row0 + rows) sees whole,
    // so that no element needs a test. Without EXTRA every other visited tile is
    // TILE_PARTIAL (classify's band and sequence-end tests, solved for the tile index
    // once instead of evaluated per tile).
    __device__ __forceinline__ TileRange full_key_tiles(int row0, int rows, int block_n) const {
        static_assert(!Flags::EXTRA, "a block layout makes tiles partial too (classify)");
        const int key_end = Flags::BAND ? imin(lk, row0 + band_hi() + 1) : lk;   // last key + 1 of row0
        const int key_begin = Flags::BAND ? imax(0, row0 + rows - 1 + band_lo()) : 0;   // first key of the last row
        return {ceil_div(key_begin, block_n), key_end < 0 ? 0 : key_end / block_n};
    }

    // Key tiles of width block_n that any of the query rows [row0, row0 + rows) may see. SPANS: narrowed to a
    // block layout's spans (within_span; a kernel whose registers those loads overflow walks instead).
    template <bool SPANS = true>
    __device__ __forceinline__ TileRange key_tiles(int row0, int rows, int block_n) const {
        int begin = 0, end = ceil_div(lk, block_n);
        if (Flags::BAND) {
            const int last_key = row0 + rows - 1 + band_hi(), first_key = row0 + band_lo();
            end = last_key < 0 ? 0 : imin(end, last_key / block_n + 1);
            begin = imax(0, first_key) / block_n;
        }
        if constexpr (Flags::EXTRA && SPANS) {
            // (not packed GQA rows, band_period > 0: a block's rows are several heads' positions)
            if (m.layout_rows.ptr && m.band_period == 0 && imin(row0 + rows, lq) > row0)
                return within_span(TileRange{begin, end}, m.layout_rows, head, 1, row0 / m.block_q,
                                   (imin(row0 + rows, lq) - 1) / m.block_q, m.block_k, block_n);
        }
        return {begin, end};
    }

    // Query tiles of height block_m in which some row may see one of the keys [col0, col0 + cols), of the
    // query heads head .. head + heads - 1.
    __device__ __forceinline__ TileRange query_tiles(int col0, int cols, int block_m, int heads = 1) const {
        int begin = 0, end = ceil_div(lq, block_m);
        if (Flags::BAND) {
            const int first_row = col0 - band_hi(), last_row = col0 + cols - 1 - band_lo();
            begin = imax(0, first_row) / block_m;
            end = last_row < 0 ? 0 : imin(end, last_row / block_m + 1);
        }
        if constexpr (Flags::EXTRA) {
            if (m.layout_cols.ptr && imin(col0 + cols, lk) > col0)
                return within_span(TileRange{begin, end}, m.layout_cols, head, heads, col0 / m.block_k,
                                   (imin(col0 + cols, lk) - 1) / m.block_k, m.block_q, block_m);
        }
        return {begin, end};
    }

    // EXTRA with a block layout: tiles of `tile` rows (keys, or queries) narrowed to the union of the
    // layout's spans (MaskParams::layout_rows / layout_cols: the first and last block not BLOCK_OFF, in
    // blocks of `block` along the tiles' axis) of blocks first .. last on the other axis, heads head ..
    // head + heads - 1: the tiles before the first visible block and after the last are not walked one
    // classify at a time (a document mask's earlier documents, a window's far keys). A few loads, all at once.
    __device__ __forceinline__ static TileRange span_tiles(TileRange r, int first, int last, int block, int tile) {
        if (last < first) return {r.begin, r.begin};   // nothing visible
        return {imax(r.begin, first * block / tile), imin(r.end, ((last + 1) * block - 1) / tile + 1)};
    }
    __device__ __forceinline__ TileRange within_span(TileRange r, const ScoreTensor& spans, int head0, int heads,
                                                     int first, int last, int block, int tile) const {
        int lo = 0x7fffffff, hi = -1;
#pragma unroll 1
        for (int h = head0; h < head0 + heads; ++h)
#pragma unroll 1
            for (int i = first; i <= last; ++i) {
                const int2 span = *reinterpret_cast<const int2*>(spans.at<int>(batch, h, i, 0));   // 8-byte pairs
                lo = imin(lo, span.x);
                hi = imax(hi, span.y);
            }
        return span_tiles(r, lo, hi, block, tile);
    }

    // allowed() in a TILE_BAND tile: the band and the sequences' ends.
    __device__ __forceinline__ bool allowed_in_band(int row, int col) const {
        return col < lk && in_band(row, col) && (!Flags::EXTRA || row < lq);
    }

    // What the tile (rows [row0, row0 + rows), keys [col0, col0 + cols)) needs.
    __device__ __forceinline__ int classify(int row0, int rows, int col0, int cols) const {
        const int row1 = row0 + rows - 1, col1 = col0 + cols - 1;
        if (Flags::BAND && (col0 > row1 + band_hi() || col1 < row0 + band_lo())) return TILE_SKIP;
        int kind = col1 >= lk || (Flags::BAND && (col1 > row0 + band_hi() || col0 < row1 + band_lo()))
                       ? TILE_PARTIAL : TILE_FULL;
        if (Flags::EXTRA && m.layout.ptr) {
            const int last_row = imin(row1, lq - 1), last_col = imin(col1, lk - 1);
            if (last_row < row0) return TILE_PARTIAL;   // rows past the end only: whatever, they are not written
            bool any = false, all = true;
            // Unsigned division (every index here is >= 0): cheaper, and fewer registers in the
            // Hopper forward's producer threads, which walk the tiles too.
            const unsigned bq = m.block_q, bk = m.block_k;
#pragma unroll 1
            for (int bi = unsigned(row0) / bq; bi <= int(unsigned(last_row) / bq); ++bi)
#pragma unroll 1
                for (int bj = unsigned(col0) / bk; bj <= int(unsigned(last_col) / bk); ++bj) {
                    const int state = *m.layout.at<signed char>(batch, head, bi, bj);
                    any |= state != BLOCK_OFF;
                    all &= state == BLOCK_ALL;
                }
            if (!any) return TILE_SKIP;
            if (!all) return TILE_PARTIAL;
            return kind == TILE_PARTIAL ? TILE_BAND : kind;
        }
        if constexpr (!Flags::EXTRA) return kind;
        // no layout: the band and the ends are the only tests where no mask is (a mask always brings a layout)
        return kind == TILE_PARTIAL && !USER_MASK && !m.mask.ptr ? TILE_BAND : kind;
    }

    __device__ __forceinline__ bool tile_is_partial(int row0, int rows, int col0, int cols) const {
        return classify(row0, rows, col0, cols) != TILE_FULL;
    }

    // The first key tile in [j, end) that the rows [row0, row0 + rows) do not skip (end if none).
    __device__ __forceinline__ int next_key_tile(int j, int end, int row0, int rows, int block_n) const {
        if (Flags::EXTRA && m.layout.ptr)
            while (j < end && classify(row0, rows, j * block_n, block_n) == TILE_SKIP) ++j;
        return j;
    }

    // x = (s * scale + bias) * log2(e), or -inf where masked. `bias` is the
    // element's bias (0 without one), from wherever the kernel staged it.
    __device__ __forceinline__ A score(A dot, A bias, int row, int col, bool partial) const {
        if (partial && !allowed(row, col)) return neg_inf<A>();
        A x = dot * scale_log2;
        if (has_bias()) x += bias * A(LOG2E);
        return x;
    }

    // Dropout's verdict for one element: keep_scale if kept, 0 if dropped. Rows and keys in the call's
    // coordinates; the params' origin (drop_row0, drop_col0: a multiple of 4) moves them into the mask's.
    __device__ __forceinline__ A keep(int row, int col) const {
        const PhiloxWords r = dropout_words(m.seed_lo, m.seed_hi, batch, head, row + m.drop_row0, col + m.drop_col0);
        return r.word(col & 3) >= m.drop_threshold ? A(m.keep_scale) : A(0);
    }

    // The verdicts of two neighbouring keys col, col + 1 (col even): one Philox draw.
    __device__ __forceinline__ void keep2(int row, int col, A& keep0, A& keep1) const {
        const PhiloxWords r = dropout_words(m.seed_lo, m.seed_hi, batch, head, row + m.drop_row0, col + m.drop_col0);
        keep0 = r.word(col & 3) >= m.drop_threshold ? A(m.keep_scale) : A(0);
        keep1 = r.word((col & 3) + 1) >= m.drop_threshold ? A(m.keep_scale) : A(0);
    }

    // The verdicts of the four keys col .. col + 3 (col a multiple of 4) of one row, one
    // Philox draw: bit k set iff key col + k is kept (keep() of each, as bits).
    __device__ __forceinline__ unsigned keep4_bits(int row, int col) const {
        const PhiloxWords r = dropout_words(m.seed_lo, m.seed_hi, batch, head, row + m.drop_row0, col + m.drop_col0);
        const unsigned t = m.drop_threshold;
        return unsigned(r.w0 >= t) | unsigned(r.w1 >= t) << 1 | unsigned(r.w2 >= t) << 2 | unsigned(r.w3 >= t) << 3;
    }
};

// The steps of one key block (dK/dV): (query head of the group, query block of BM) pairs whose
// query block sees some key of the block, in order (query_tiles; or the given range of blocks, the
// portable kernels' ordered dbias turns, which walk every block). The Hopper kernel's producer and
// consumers walk the same list; the portable kernels walk it with a StepCursor.
template <int BM>
struct KeyBlockSteps {
    int first_head, begin, m_blocks, count;

    __device__ __forceinline__ KeyBlockSteps(const TileRange& queries, const KeyBlock& blk)
        : first_head(blk.first_head), begin(queries.begin), m_blocks(imax(0, queries.end - queries.begin)),
          count((blk.end_head - blk.first_head) * m_blocks) {}
    template <typename Mod>
    __device__ __forceinline__ KeyBlockSteps(const Mod& mod, const KeyBlock& blk)
        : KeyBlockSteps(mod.query_tiles(blk.n0, blk.keys, BM, blk.end_head - blk.first_head), blk) {}
    // The step after (head, block): the next query block, or the next head's first one. Counted
    // along rather than divided out of the step index (that cost the d=64 band consumer a spill,
    // and the portable kernels two integer divisions a step).
    __device__ __forceinline__ void advance(int& head, int& block) const {
        if (++block == m_blocks) block = 0, ++head;
    }
    __device__ __forceinline__ int m0(int block) const { return (begin + block) * BM; }
    // EXTRA: whether the step at query block m0 of head mod.head sees none of the block's keys (a block
    // layout's TILE_SKIP). The Hopper kernel's consumers ask (its producer threads, 40 registers, which
    // classify's layout walk overflowed, load every step; the consumers give a hidden step's stage
    // straight back); the portable kernels skip such steps (StepCursor::next_visible).
    template <typename Mod>
    __device__ __forceinline__ bool hidden(const Mod& mod, const KeyBlock& blk, int m0) const {
        return mod.classify(m0, imin(BM, mod.lq - m0), blk.n0, blk.keys) == TILE_SKIP;
    }
};

// A position in a KeyBlockSteps list: step t of `count`, query head `head`, block index `block`.
struct StepCursor {
    int t, head, block;

    template <int BM>
    __device__ __forceinline__ static StepCursor first(const KeyBlockSteps<BM>& steps) {
        return {0, steps.first_head, 0};
    }
    template <int BM>
    __device__ __forceinline__ StepCursor after(const KeyBlockSteps<BM>& steps) const {
        StepCursor c = *this;
        ++c.t;
        steps.advance(c.head, c.block);
        return c;
    }
    // This step or the first later one a block layout does not hide (every step unless `skip`: the
    // ordered dbias turns visit them all). Leaves mod.head at the last head it asked about.
    template <int BM, typename Mod>
    __device__ __forceinline__ StepCursor next_visible(const KeyBlockSteps<BM>& steps, Mod& mod, const KeyBlock& blk,
                                                       bool skip) const {
        StepCursor c = *this;
        for (; skip && c.t < steps.count; c = c.after(steps)) {
            mod.head = c.head;
            if (!steps.hidden(mod, blk, steps.m0(c.block))) break;
        }
        return c;
    }
};

// score() over a register tile s[I][J]; coord(i, j, row, col) names the element's
// absolute query row and key column (each kernel's fragment layout differs), and
// bias(i, j, row, col) its bias when the call has one, from wherever the kernel
// staged it (the FMA kernels: their P tile in shared memory, loaded with the step's
// other tiles). A fully visible tile without a bias only scales.
template <typename Mod, typename A, int I, int J, typename Coord, typename Bias>
__device__ __forceinline__ void apply_score_mod(A (&s)[I][J], const Mod& mod, bool partial, Coord coord, Bias bias) {
    if (!partial && !mod.has_bias()) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int j = 0; j < J; ++j) s[i][j] = mod.score(s[i][j], A(0), 0, 0, false);
        return;
    }
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int j = 0; j < J; ++j) {
            int row, col;
            coord(i, j, row, col);
            const A b = mod.has_bias() ? bias(i, j, row, col) : A(0);
            s[i][j] = mod.score(s[i][j], b, row, col, partial);
        }
}

// The tensor-core kernels' form. The caller has either formed x already (with a
// bias: scale_add_bias_frags in warp_gemm.cuh reads the bias 16 columns at a time
// straight into fragment positions) or keeps raw dot products (scores_stay_raw);
// otherwise the scores are scaled here. A partial tile's masked scores become
// -inf in whichever units the tile holds.
template <typename Mod, typename A, int I, int J, typename Coord>
__device__ __forceinline__ void apply_score_mod(A (&s)[I][J], const Mod& mod, bool partial, Coord coord) {
    const bool scaled = mod.has_bias() || mod.scores_stay_raw();   // nothing to multiply here
    if (!partial) {
        if (!scaled)
#pragma unroll
            for (int i = 0; i < I; ++i)
#pragma unroll
                for (int j = 0; j < J; ++j) s[i][j] = mod.score(s[i][j], A(0), 0, 0, false);
        return;
    }
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int j = 0; j < J; ++j) {
            int row, col;
            coord(i, j, row, col);
            s[i][j] = !mod.allowed(row, col) ? neg_inf<A>() : scaled ? s[i][j] : s[i][j] * mod.scale_log2;
        }
}

// Dropout over a register tile of probabilities: p *= keep(row, col). With
// PAIRS, elements (i, 2t) and (i, 2t + 1) are keys col, col + 1 of one row with
// col even (the mma C fragment), and share one Philox draw.
template <bool PAIRS, typename Mod, typename A, int I, int J, typename Coord>
__device__ __forceinline__ void apply_dropout(A (&p)[I][J], const Mod& mod, Coord coord) {
    if (!mod.has_dropout()) return;
#pragma unroll
    for (int i = 0; i < I; ++i) {
        if (PAIRS) {
#pragma unroll
            for (int j = 0; j < J; j += 2) {
                int row, col;
                coord(i, j, row, col);
                A k0, k1;
                mod.keep2(row, col, k0, k1);
                p[i][j] *= k0;
                p[i][j + 1] *= k1;
            }
        } else {
#pragma unroll
            for (int j = 0; j < J; ++j) {
                int row, col;
                coord(i, j, row, col);
                p[i][j] *= mod.keep(row, col);
            }
        }
    }
}

// The fragment-bit forms of apply_score_mod and apply_dropout, for a warp's m16n8 C
// fragments (the mma.sync and wgmma accumulator layout: lane 4 g + t holds rows g and
// g + 8, keys 8 n + 2 t + {0, 1} of n8 tile n) where the unrolled per-element code does
// not fit (the Hopper forward with EXTRA: its consumer loop grows to ~10000 instructions
// and spills). The per-element verdicts are drawn in a loop that is not unrolled and
// folded into one bit per element, e = 4 n + i (C-fragment element i of tile n, at most
// 64 a thread); only applying the bits is unrolled. Same values as the unrolled forms.
template <int N>
__device__ __forceinline__ bool frag_bit(unsigned long long bits, int n, int i) {
    static_assert(N <= 16, "one bit an element in 64 bits");
    return (bits >> (4 * n + i)) & 1ull;
}

// apply_score_mod's tensor-core form (the caller formed x already where there is a bias):
// a partial tile's test (allowed) as bits, then masked scores -inf, the others scaled
// unless already x.
// `unseen`: the caller knows that no element is allowed (classify said TILE_SKIP for these
// rows, e.g. a layout's off block under a query block that straddles layout rows), which
// spares the per-element test its layout and mask reads. `band`: classify said TILE_BAND, and the
// test is the band's and the ends' alone (allowed_in_band: no layout, mask or mask modification read an
// element; a document mask's diagonal tiles).
template <typename Mod, int N, typename Coord>
__device__ __forceinline__ void apply_score_mod_bits(float (&s)[N][4], const Mod& mod, bool partial, Coord coord,
                                                     bool unseen = false, bool band = false) {
    const bool scaled = mod.has_bias() || mod.scores_stay_raw();
    if (!partial) {
        if (!scaled)
#pragma unroll
            for (int n = 0; n < N; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[n][i] *= mod.scale_log2;
        return;
    }
    unsigned long long allowed = 0;
    if (band) {
#pragma unroll 1
        for (int e = 0; e < 4 * N; ++e) {
            int row, col;
            coord(e / 4, e % 4, row, col);
            allowed |= (unsigned long long)mod.allowed_in_band(row, col) << e;
        }
    } else {
#pragma unroll 1
        for (int e = 0; e < (unseen ? 0 : 4 * N); ++e) {
            int row, col;
            coord(e / 4, e % 4, row, col);
            allowed |= (unsigned long long)mod.allowed(row, col) << e;
        }
    }
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            s[n][i] = !frag_bit<N>(allowed, n, i) ? neg_inf<float>() : scaled ? s[n][i] : s[n][i] * mod.scale_log2;
}

// The user score modifications (user_mod.cuh) over a register tile of scores after the mask, held as x /
// x_per_s, leaving the modified x (ScoreMod::user_score; FOLDED: over CUF_USER_OUT_SCALE): the forward's (the
// backward's prob_and_dscore_at applies them itself). coord as apply_score_mod's; s[I][J] or the C fragments
// s[N][4] with coord(n, i, row, col).
template <bool FOLDED = false, typename Mod, typename A, int I, int J, typename Coord>
__device__ __forceinline__ void apply_user_score(A (&s)[I][J], const Mod& mod, Coord coord, A x_per_s) {
    if constexpr (USER_SCORE) {
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int j = 0; j < J; ++j) {
                int row, col;
                coord(i, j, row, col);
                s[i][j] = mod.template user_score<FOLDED>(s[i][j], row, col, x_per_s);
            }
    }
}

// A forward's mask and user score modifications over a tile of scores (raw, x / x_per_s, in the plain kernels),
// leaving the modified x over CUF_USER_OUT_SCALE (the softmax's x_per_s: softmax_x_per_s), or -inf where
// masked. `mask()`: the kernel's own mask of the tile (which only writes -inf in a plain kernel). With
// modifications evaluated everywhere (ScoreMod::SELECT_USER) they run first, at every element, and the mask
// overwrites what they gave masked elements (no compare and select an element after them; 0 spills in every
// forward variant with softcap, ALiBi or both, NVRTC 12.9 / 13.0 / 13.5). Else the mask first and the
// modifications behind a branch (or a select) an element (apply_user_score). s[I][J] or the C fragments s[N][4]
// with coord(n, i, row, col).
template <typename Mod, typename A, int I, int J, typename Coord, typename Mask>
__device__ __forceinline__ void mask_and_modify(A (&s)[I][J], const Mod& mod, Coord coord, A x_per_s, Mask mask) {
    if constexpr (USER_SCORE && Mod::SELECT_USER) {
        // rel = col - row as A: element (0, 0)'s converted once, the others' a constant apart (the fragment
        // layout's), one add an element and no integer conversion
        int row0, col0;
        coord(0, 0, row0, col0);
        const A rel0 = A(col0 - row0);
#pragma unroll
        for (int i = 0; i < I; ++i)
#pragma unroll
            for (int j = 0; j < J; ++j) {
                int row, col;
                coord(i, j, row, col);
                const A rel = rel0 + A((col - row) - (col0 - row0));
                s[i][j] = mod.user_score_before_mask(s[i][j], row, col, rel, x_per_s);
            }
        mask();
    } else {
        mask();
        apply_user_score<true>(s, mod, coord, x_per_s);
    }
}

// The x_per_s the softmax takes after mask_and_modify: the last score modification's output factor with
// user score modifications (the scores are the modified x over it then, not raw dot products: no multiply
// back to x / x_per_s and out again), else the kernel's own.
template <typename A>
__device__ __forceinline__ A softmax_x_per_s(A x_per_s) {
    return USER_SCORE ? A(CUF_USER_OUT_SCALE) : x_per_s;
}

// apply_dropout<true>'s verdicts on the C fragments, half a Philox draw an element pair
// instead of one: keys 8 n + 4 (t / 2) + {0..3} of a row are one draw (dropout.cuh), of
// which lanes t and t ^ 1 each hold half. Lane t draws that group for row g + 8 (t % 2),
// keeps its own half and passes the other half to its partner (one shuffle), which drew
// the other row. Bit e as frag_bit; the keep-mask is exactly keep2's.
template <int N, typename Mod>
__device__ __forceinline__ unsigned long long dropout_frag_bits(const Mod& mod, int row_g, int col0, int lane) {
    const int t = lane % 4, odd = t % 2;
    unsigned long long bits = 0;
#pragma unroll 1
    for (int n = 0; n < N; ++n) {
        const unsigned drawn = mod.keep4_bits(row_g + 8 * odd, col0 + 8 * n + 4 * (t / 2));
        const unsigned mine = (drawn >> (2 * odd)) & 3u, theirs = (drawn >> (2 - 2 * odd)) & 3u;
        const unsigned other_row = __shfl_xor_sync(0xffffffffu, theirs, 1);   // the partner's draw, my keys
        const unsigned four = odd ? other_row | mine << 2 : mine | other_row << 2;   // rows g, g + 8
        bits |= (unsigned long long)four << (4 * n);
    }
    return bits;
}

// The same verdicts for the dK/dV kernels' transposed tiles (S^T: lane 4 g + t holds keys g, g + 8 and
// queries 8 n + 2 t + {0, 1} of n8 tile n). A Philox draw covers four consecutive keys of one query,
// which here lie in four lanes' rows, so the warp draws each (4-key group, query) of the tile once and
// exchanges bits: for tile n lane (g, t) draws query 8 n + 2 t + g % 2, keys 4 (g / 2) + {0..3} (32
// draws: the tile's 16 keys x 8 queries), and element i (key k = g + 8 (i / 2), query 2 t + i % 2) is
// bit k % 4 of lane 4 (2 (k / 4) + i % 2) + t's draw: four shuffles a tile, every lane in each.
// Bit e = 4 n + i as frag_bit, in 32 bits (N <= 8: one register where the kernel is tightest); the
// keep-mask is exactly keep()'s. key0: a multiple of 4.
template <int N, typename Mod>
__device__ __forceinline__ unsigned dropout_frag_bits_t(const Mod& mod, int query0, int key0, int lane) {
    static_assert(N <= 8, "one bit an element in 32 bits");
    const int g = lane / 4, t = lane % 4;
    unsigned bits = 0;
#pragma unroll 1
    for (int n = 0; n < N; ++n) {
        const unsigned drawn = mod.keep4_bits(query0 + 8 * n + 2 * t + g % 2, key0 + 4 * (g / 2));
        unsigned four = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = g + 8 * (i / 2);
            const unsigned theirs = __shfl_sync(0xffffffffu, drawn, 4 * (2 * (key / 4) + i % 2) + t);
            four |= ((theirs >> (key % 4)) & 1u) << i;
        }
        bits |= four << (4 * n);
    }
    return bits;
}

// Dropout's factor on element i of n8 tile n: keep_scale or 0 from keep bits laid out as
// dropout_frag_bits(_t) lay them out (bit 4 n + i), 1 without dropout (a uniform test: the
// probability loops that use it carry no Philox draw and no branch).
template <typename Mod, typename Bits>
__device__ __forceinline__ float drop_factor(const Mod& mod, Bits kept, int n, int i) {
    if (!mod.has_dropout()) return 1.0f;
    return (kept >> (4 * n + i)) & 1u ? float(mod.m.keep_scale) : 0.0f;
}

// p *= keep on the C fragments of one warp's 16 rows: row_g = its row g (lane / 4),
// col0 the tile's first key.
template <typename Mod, int N>
__device__ __forceinline__ void apply_dropout_frags(float (&p)[N][4], const Mod& mod, int row_g, int col0, int lane) {
    if (!mod.has_dropout()) return;
    const unsigned long long kept = dropout_frag_bits<N>(mod, row_g, col0, lane);
    const float keep_scale = float(mod.m.keep_scale);
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) p[n][i] *= frag_bit<N>(kept, n, i) ? keep_scale : 0.0f;
}

// The forward's mask of one 16-row strip of a partial tile without EXTRA (only the band and
// the sequence end), on its m16n8 C fragments (the 16-bit and the TF32 kernels alike): the
// lane's rows are row0 and row0 + 8, its keys col0 + 8n + e (e = 0, 1), and each row's
// visible keys are one interval (ScoreMod::visible_keys), so every element is two compares
// with a constant rather than a (row, col) pair formed and tested. Masked scores become
// -inf (raw dot products stay raw).
// mask_partial_strip_rows: the same with the lane's two rows' band positions given (packed GQA rows
// under a band, MaskParams::band_period: a row's position is not row0 + 8). mask_strip_rows: any fragment
// layout, `key(n, e)` the lane's key offset from col0 of its element (n, e) (C fragments: 8n + e) and
// `score(r, n, e)` that element of row r (0: row_a, 1: row_b) in the caller's fragments.
template <typename A, int N, typename Mod, typename Key, typename Score>
__device__ __forceinline__ void mask_strip_rows(const Mod& mod, int row_a, int row_b, int col0, Key&& key,
                                                Score&& score) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int lo, hi;
        mod.visible_keys(r == 0 ? row_a : row_b, col0, lo, hi);
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (key(n, e) < lo || key(n, e) > hi) score(r, n, e) = neg_inf<A>();
    }
}

__device__ __forceinline__ int c_frag_key(int n, int e) { return 8 * n + e; }   // a C fragment's key offset

template <int N, typename Mod>
__device__ __forceinline__ void mask_partial_strip_rows(float (&s)[N][4], const Mod& mod, int row_a, int row_b,
                                                        int col0) {
    mask_strip_rows<float, N>(mod, row_a, row_b, col0, c_frag_key,
                              [&](int r, int n, int e) -> float& { return s[n][2 * r + e]; });
}

// The same on fp64 C fragments: a 16-row strip as two 8-row tiles (warp_gemm_f64.cuh), rows row_a and row_b.
template <int N, typename Mod>
__device__ __forceinline__ void mask_partial_strip_rows(double (&s)[2][N][2], const Mod& mod, int row_a, int row_b,
                                                        int col0) {
    mask_strip_rows<double, N>(mod, row_a, row_b, col0, c_frag_key,
                               [&](int r, int n, int e) -> double& { return s[r][n][e]; });
}

template <int N, typename Mod>
__device__ __forceinline__ void mask_partial_strip(float (&s)[N][4], const Mod& mod, int row0, int col0) {
    mask_partial_strip_rows(s, mod, row0, row0 + 8, col0);
}

// The dK/dV kernels' mask of one 16-key strip of a partial S^T tile without EXTRA (the band and
// the sequence end): the lane's keys are key_a and key_a + 8, its queries
// q0 + 8n + e (e = 0, 1), and each key is seen by one interval of queries
// (ScoreMod::visible_queries), so an element is two compares with a constant.
// Masked scores become -inf (raw dot products stay raw).
template <int BM, typename Mod>
__device__ __forceinline__ void mask_partial_strip_t(float (&st)[BM / 8][4], const Mod& mod, int key_a, int q0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int lo, hi;
        mod.visible_queries(key_a + 8 * r, q0, lo, hi);
#pragma unroll
        for (int n = 0; n < BM / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (8 * n + e < lo || 8 * n + e > hi) st[n][2 * r + e] = neg_inf<float>();
    }
}
