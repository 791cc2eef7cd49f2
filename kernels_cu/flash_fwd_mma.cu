// flash_fwd_mma.cu -- forward attention on tensor cores (float16 / bfloat16).
//
// FlashAttention-2 loop order. One CTA per (query block, head, batch); each of
// the WARPS warps owns STRIPS x 16 query rows, so a row's softmax never leaves
// its warp, and each K / V fragment a warp loads feeds STRIPS MMAs.
//   load Q tile
//   for each visible K/V tile j (the next one streams in with cp.async meanwhile):
//       S = Q K_j^T                           (mma.sync, fp32 accumulate)
//       x = S * scale * log2(e), masked       (score_mod.cuh; without a bias the
//                                              scale folds into the exp2's FFMA; only
//                                              tiles crossing the band's edges or the
//                                              sequence end are masked)
//       m_new = max(m, rowmax(x)); P = 2^(x - m_new); l = l * 2^(m - m_new) + rowsum(P)
//       O = O * 2^(m - m_new) + P V_j         (P stays in registers, rounded to 16 bits
//                                              as it is formed: the A operand; m moves
//                                              lazily: warp_softmax_tile)
//   O = O / l; lse = (m + log2 l) ln 2
// Shared memory rows are padded by 16 bytes so the 8 row addresses of an
// ldmatrix fall in different banks. With EXTRA, each K/V stage has a bias tile
// (BM x BN, pitch BN + 8) beside it, loaded with it, and read into S's fragment
// layout with ldmatrix (warp_gemm.cuh, scale_add_bias_frags).
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "epilogue.cuh"

// SW_KV: K and V stages in tile_io.cuh's swizzled rows without padding (the split twin: a decoding
// call streams K/V, and copies into padded rows cost 1.5x the L2 sector reads;
// benchmarks/stream_layout.py).
template <typename T, typename Cfg, bool EXTRA, bool SW_KV = false>
struct FwdMmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int STRIPS = BM / (16 * WARPS);     // 16-row strips per warp
    static constexpr int WARP_ROWS = 16 * STRIPS;
    static constexpr int PITCH = HEAD + 8;         // Q's shared row pitch in elements (K / V's without SW_KV)
    static constexpr int KV_PITCH = SW_KV ? HEAD : PITCH;
    static constexpr int S_TILES = BN / 8;         // n8 tiles of one warp's S
    static constexpr int O_TILES = HEAD / 8;       // n8 tiles of one warp's O
    static constexpr int Q_ELEMS = BM * PITCH;
    static constexpr int KV_ELEMS = BN * KV_PITCH; // one K or V stage
    static constexpr int BIAS_PITCH = BN + 8;
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    static constexpr int SMEM_BYTES = (Q_ELEMS + 2 * Cfg::STAGES * KV_ELEMS + Cfg::STAGES * BIAS_ELEMS) * int(sizeof(T));
    static_assert(HEAD % 16 == 0 && BN % 16 == 0, "tiles are multiples of the mma shape");
    static_assert(BM % (16 * WARPS) == 0, "each warp owns whole 16-row strips");
    static_assert(Cfg::STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first;
// KV_SPLIT: that many times FwdParams::num_splits, each copy over its split's key tiles (KeySplit).
// PARK (the variant table's Tile.park): the block's coordinates and the loop bounds wait in
// the row padding of each warp's first two Q rows (the 16 bytes past HEAD, which neither the
// Q copy nor any ldmatrix touches), read back where the K/V copies, the loop test and the
// epilogue need them, instead of sitting in registers through the key loop: 64-key tiles at
// head dim 128 fit 255 registers so. It costs a shared load and the K/V pointers' arithmetic
// a step, so only the tiles that need it take it.
// PACKED: the blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), each with its
// sequence's own query and key counts; the split tiles, without EXTRA or PARK.
template <typename T, typename Cfg, typename Flags, bool VEC, bool PARK = false, bool KV_SPLIT = false,
          bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_fwd_mma(const FwdParams p) {
    // The split twin without EXTRA streams K/V through swizzled rows (16-byte copies, 8-chunk rows, each
    // copying thread's rows a multiple of 8 apart).
    constexpr bool SW_KV = KV_SPLIT && !Flags::EXTRA && VEC && sizeof(T) == 2 && Cfg::HEAD % 64 == 0
                           && (Cfg::THREADS / (Cfg::HEAD / 8)) % 8 == 0;
    typedef FwdMmaTraits<T, Cfg, Flags::EXTRA, SW_KV> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, P = Tr::PITCH, KP = Tr::KV_PITCH;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* k_s = q_s + Tr::Q_ELEMS;                 // stage i at k_s + i * KV_ELEMS
    T* v_s = k_s + 2 * Tr::KV_ELEMS;
    T* bias_s = v_s + 2 * Tr::KV_ELEMS;          // stage i at bias_s + i * BIAS_ELEMS (EXTRA)

    const AttnDims& dims = p.dims;
    typedef KeySplit<BM, KV_SPLIT> Split;
    static_assert(!PACKED || !(KV_SPLIT || PARK || Flags::EXTRA), "packed sequences: the plain split tiles");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q) : PackedBlock{};
    const QueryBlock blk = PACKED ? seq.query_block(dims, BM)
                                  : Split::query_block(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // per-sequence key counts: a KV cache's (MaskParams::key_lengths: the split kernels without EXTRA) or
    // a packed sequence's
    constexpr bool PER_SEQ = (KV_SPLIT || PACKED) && !Flags::EXTRA;
    typedef ScoreMod<Flags, float, T, PER_SEQ> Mod;
    const float scale_log2 = acc_param<float>(p.scale_log2, p.scale_log2_f);
    const Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, scale_log2, blk.head);
        else return Mod(p.mask, dims, scale_log2, blk.batch, blk.head);
    }();
    const float x_per_s = mod.x_per_score();
    // Packed GQA rows under a band (MaskParams::band_period; the split twin without EXTRA, as the decoding
    // kernel, flash_fwd_decode.cu): the block's rows are its K/V head's query heads of `period` positions
    // each, so they see what positions [0, period) see, and a lane's rows sit at positions row % period.
    constexpr bool PERIODIC = KV_SPLIT && !Flags::EXTRA && Flags::BAND && !PACKED;
    const int period = PERIODIC ? p.mask.band_period : 0;
    const TileRange keys = Split::keys(period > 0 ? mod.key_tiles(0, period, BN) : mod.key_tiles(blk.m0, blk.rows, BN),
                                       p);

    auto parking_slot = [&](int in_warp) { return smem_addr(q_s + in_warp * Tr::WARP_ROWS * P + HEAD); };
    if constexpr (PARK) park_query_block(parking_slot(warp), blk);
    PageCursor<T, BN, HEAD, Tr::THREADS, VEC> pages;   // a paged cache's pages, a tile ahead (PER_SEQ, not PACKED)
    auto load_kv = [&](int j, int stage, const QueryBlock& b) {
        QueryBlock kv_block = b;
        if constexpr (PACKED) kv_block.batch = seq.k_start;   // K and V rows from the sequence's first key
        load_kv_tile<T, BM, BN, HEAD, KP, Tr::BIAS_PITCH, Tr::THREADS, VEC, Tr::KV_ELEMS, Tr::BIAS_ELEMS,
                     PER_SEQ && !PACKED, PACKED, SW_KV>(k_s, v_s, bias_s, stage, p, kv_block, mod.has_bias(), j * BN,
                                                        PER_SEQ ? mod.lk : dims.lk, &pages);
        cp_async_commit();
    };
    // The visible key tiles in order (block sparsity and mask summaries skip some) before end.
    auto next_tile = [&](int j, int end, const QueryBlock& b) {
        return mod.next_key_tile(j, end, b.m0, b.rows, BN);
    };

    constexpr int M = Tr::STRIPS;
    float acc_o[M][Tr::O_TILES][4];
    float row_max[M][2], row_sum[M][2];
    start_rows(acc_o, row_max, row_sum);

    int j = next_tile(keys.begin, keys.end, blk);
    if (j < keys.end) {
        load_tile<T, BM, HEAD, P, Tr::THREADS, VEC>(q_s, p.q.at<const T>(blk.batch, blk.head, blk.m0), p.q.row_stride,
                                                    blk.rows, dims.d);
        load_kv(j, 0, blk);
    }
    const int warp_row0 = blk.m0 + warp * Tr::WARP_ROWS;
    // Without EXTRA, the key tiles this warp's rows see whole, found once: inside
    // them the loop carries no mask work and no per-tile classification. With PARK
    // they and the end of the key tiles wait in the next Q row's padding.
    TileRange full{0, 0};
    if constexpr (!Flags::EXTRA)
        full = period > 0 ? mod.full_key_tiles(0, period, BN) : mod.full_key_tiles(warp_row0, Tr::WARP_ROWS, BN);
    constexpr int BOUNDS_AT = P * int(sizeof(T));   // bytes past the block's slot
    if constexpr (PARK) park4<BOUNDS_AT>(parking_slot(warp), {keys.end, full.begin, full.end, 0});
    // What the loop test, the prefetch and the mask read: with PARK, read back for step j + 1
    // during step j's P V product (where acc_o and P hold 64 registers fewer than S does), so
    // that the loads' latency stays off the path from the loop test through the prefetch to
    // the barrier.
    struct LoopState {
        int key_end;
        TileRange whole;
        QueryBlock blk;
    };
    auto loop_state = [&]() -> LoopState {
        if constexpr (PARK) {
            const Parked4 bounds = unpark4<BOUNDS_AT>(parking_slot(warp));
            return {bounds.a, {bounds.b, bounds.c}, unpark_query_block<BM>(parking_slot(warp), dims)};
        }
        return {keys.end, full, blk};
    };
    LoopState st = loop_state();
    for (int stage = 0; j < st.key_end; stage ^= 1) {
        const int next = next_tile(j + 1, st.key_end, st.blk);
        // The next visible tile into the other stage.
        prefetch_next_step<2>(next, st.key_end, stage, [&](int j_next, int s_next) { load_kv(j_next, s_next, st.blk); });
        const bool whole_tile = st.whole.contains(j);
        __syncthreads();

        float s[M][Tr::S_TILES][4];   // S = Q K^T for this warp's rows
#pragma unroll
        for (int m = 0; m < M; ++m) zero_frags(s[m]);
        warp_gemm_strips_smem<T, M, BN, HEAD, P, KP, false, SW_KV>(s, q_s + warp * Tr::WARP_ROWS * P,
                                                                   k_s + stage * Tr::KV_ELEMS, lane);
        const int n0 = j * BN;
        const bool partial = Flags::EXTRA ? mod.tile_is_partial(warp_row0, Tr::WARP_ROWS, n0, BN)
                                          : !whole_tile;
        const T* bias_tile = bias_s + stage * Tr::BIAS_ELEMS + (warp * Tr::WARP_ROWS) * Tr::BIAS_PITCH;
        // The absolute (query, key) of element i of n8 tile n in strip m.
        auto strip_coord = [=](int m) {
            return [=](int n, int i, int& row, int& col) {
                row = warp_row0 + 16 * m + frag_row(lane, i);
                col = n0 + frag_col(lane, n, i);
            };
        };
        // The mask: with EXTRA the bias and score_mod.cuh's per-element test; without,
        // partial tiles only, two bounds a fragment row.
#pragma unroll
        for (int m = 0; m < M; ++m) {
            mask_and_modify(s[m], mod, strip_coord(m), x_per_s, [&] {
                if constexpr (Flags::EXTRA) {
                    if (mod.has_bias())
                        scale_add_bias_frags<T, BN, Tr::BIAS_PITCH, false>(s[m], bias_tile + 16 * m * Tr::BIAS_PITCH,
                                                                           lane, mod.scale_log2);
                    apply_score_mod(s[m], mod, partial, strip_coord(m));
                } else if (partial) {
                    const int row_a = warp_row0 + 16 * m + lane / 4;
                    if (PERIODIC && period > 0)
                        mask_partial_strip_rows(s[m], mod, row_a % period, (row_a + 8) % period, n0 + 2 * (lane % 4));
                    else
                        mask_partial_strip(s[m], mod, row_a, n0 + 2 * (lane % 4));
                }
            });
        }
        unsigned p16[M][Tr::S_TILES][2];   // P in 16 bits (pack_frags' layout), the A operand of O += P V
        if constexpr (Flags::EXTRA) {
            // Dropout scales the fp32 probabilities after the statistics (row_sum counts every key),
            // then P is rounded to 16 bits.
            warp_softmax_tile<Tr>(s, acc_o, row_max, row_sum, softmax_x_per_s(x_per_s), [&](int m, int n, int r, float p0, float p1) {
                s[m][n][2 * r] = p0;
                s[m][n][2 * r + 1] = p1;
            });
#pragma unroll
            for (int m = 0; m < M; ++m) {
                apply_dropout<true>(s[m], mod, strip_coord(m));
                pack_frags<T>(p16[m], s[m]);
            }
        } else {
            warp_softmax_tile<Tr>(s, acc_o, row_max, row_sum, softmax_x_per_s(x_per_s), [&](int m, int n, int r, float p0, float p1) {
                p16[m][n][r] = pack2<T>(p0, p1);
            });
        }
        if constexpr (PARK) st = loop_state();
        warp_gemm_strips_rn16<T, M, HEAD, BN, KP, SW_KV>(acc_o, p16, v_s + stage * Tr::KV_ELEMS, lane);   // O += P V
        __syncthreads();   // the next iteration's prefetch overwrites this stage
        j = next;
    }

    // Epilogue: O = acc_o / l, lse per row. Rows past lq are not written.
    int out_warp = warp, out_lane = lane;
    QueryBlock out_blk = blk;
    if constexpr (PARK) {
        const int tid = thread_index_reread();
        out_warp = tid / 32;
        out_lane = tid % 32;
        out_blk = unpark_query_block<BM>(parking_slot(out_warp), dims);
    }
    if constexpr (KV_SPLIT)
        store_o_lse_c_frags<true, float, true>(p, Split::partial_block(out_blk, dims), out_warp * Tr::WARP_ROWS,
                                               out_lane, acc_o, row_max, row_sum);
    else
        store_o_lse_c_frags<VEC, T>(p, out_blk, out_warp * Tr::WARP_ROWS, out_lane, acc_o, row_max, row_sum);
}
