// flash_fwd_wgmma_tf32.cu -- forward attention on float32 data with Hopper's warpgroup MMA on TF32
// operands (sm_90a), precision "highest" (3xTF32) or "tf32" (plain), with or without the EXTRA options
// (bias, boolean mask, dropout, block layout; score_mod.cuh).
//
// flash_fwd_wgmma.cu's pipeline (a producer warpgroup streaming K/V through the bulk tensor copy
// engine into two stages of 128-byte swizzled tiles with mbarriers; consumer warpgroups of 64 query
// rows; setmaxnreg) with two things the 16-bit kernel does not need:
//   * TF32 wgmma takes shared-memory operands K-major only. Q and K (d contiguous) are K-major as
//     loaded; V (keys x d) is not, so the producer warpgroup, otherwise idle between its copies,
//     writes V^T [d][key] (tf32_operands.cuh) before the consumers' O += P V.
//   * 3xTF32 (SPLIT != 0) wants explicit big and small parts of both operands of each GEMM
//     (TF32X3_PARTS: both exact TF32 values, whatever the tensor core does with low bits): Q's are
//     made once by the consumers (big in place of the loaded tile, small beside it), K's and V^T's
//     by the producer per tile, P's in registers (the A operand of O += P V).
// Per K/V tile t, stage t % 2:
//   producer (128 threads; thread 0 also drives the copy engine one tile ahead):
//       copy V_{t+1} raw, and K_{t+1} once the consumers released tile t-1's K
//       K_t:   big in place, small beside           -> k_ready
//       V_t^T: big, small from the raw V_t          -> v_ready (after the consumers released t-2's)
//   consumer warpgroup (64 rows, a warp 16):
//       S = Q K_t^T       HEAD / 8 fresh-fragment k8 steps of 3 wgmmas (wgmma_tf32.cuh); release K_t
//       mask (score_mod.cuh), online softmax (softmax.cuh) -- the accumulator is mma.sync's C layout
//       P = big + small in registers, in V^T's permuted key order
//       O += P V_t        BN / 8 fresh-fragment steps (per 64-column piece of O); release V_t^T
//   O = O / l; lse = (m + log2 l) ln 2
// Within a consumer the two GEMMs and the softmax run in sequence; with two consumer warpgroups one's
// softmax overlaps the other's GEMMs. The accuracy structure is the portable kernel's
// (warp_gemm_tf32.cuh): each k8 step's three products in a fresh fragment, added with FADD.
// EXTRA, as flash_fwd_wgmma.cu's: the producer and the consumers walk the same visible tiles
// (next_key_tile skips what a layout turns off); each consumer warp classifies its 16 rows, tests a
// partial tile's elements (apply_score_mod_bits) and applies dropout after the softmax statistics
// (apply_dropout_frags), the 16-bit kernel's fragment-bit forms (the C layouts are the same). The
// bias cannot be staged as there: the 3xTF32 tiles take 225 KB of the 227 KB an SM has at both head
// dims (plain TF32's 129 KB would leave room, but one code path serves both precisions).
// The consumers read it from global memory straight into S's fragment positions (bias_frags.cuh:
// one 8-byte load a row and n8 tile), issued before S = Q K_t^T so that the GEMM (HEAD / 8 k8
// steps, three wgmmas each with 3xTF32) hides their latency; a bias that several heads
// or batches share is read by CTAs of 16 heads side by side (shared_scores_head_group), from L2.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "warp_gemm_tf32.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_tf32.cuh"
#include "tf32_operands.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "bias_frags.cuh"
#include "epilogue.cuh"

template <typename Cfg, int SPLIT>
struct FwdWgmmaTf32Traits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS, STAGES = Cfg::STAGES;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int CONSUMERS = WARPS / 4 - 1;             // warpgroups 1.. compute, 0 produces
    static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
    static constexpr int S_TILES = BN / 8;                      // n8 C fragments of one warp's S
    static constexpr int O_TILES = HEAD / 8;                    // n8 C fragments of one warp's O
    static constexpr int SLABS = HEAD / 32;                     // 32-column (128-byte) slabs of a Q/K/V row
    static constexpr int PARTS = SPLIT ? 2 : 1;                 // big (+ small) copies of an operand
    static constexpr int Q_BYTES = BM * HEAD * 4;               // the loaded Q, then its big part
    static constexpr int KV_BYTES = BN * HEAD * 4;              // one K, V or V^T part of a stage
    // A stage: K (loaded, then big) [+ K small], V as loaded, V^T big [+ V^T small].
    static constexpr int STAGE_BYTES = (2 * PARTS + 1) * KV_BYTES;
    // Barriers after the tiles: Q full, then per stage K full / ready / empty, V full / ready / empty.
    static constexpr int BARRIERS = 1 + 6 * STAGES;
    static constexpr int TILE_BYTES = PARTS * Q_BYTES + STAGES * STAGE_BYTES;
    // 1024 bytes of slack: the swizzled tiles start at the first 1024-byte boundary.
    static constexpr int SMEM_BYTES = 1024 + TILE_BYTES + 8 * BARRIERS;
    // O += P V in pieces of at most 64 columns: head dim 128's two-deep fresh fragments then take
    // 2 x 32 registers, not 2 x 64.
    static constexpr int PV_N = HEAD < 64 ? HEAD : 64, PV_PIECES = HEAD / PV_N;
    // Registers a thread after the split (setmaxnreg): two consumer warpgroups 256 x 232 + 128 x 40
    // (the launch's 168 a thread exactly), one 128 x 240 + 128 x 56. The producer's transposition
    // holds 12 values and a few addresses. setmaxnreg.inc waits for registers the others gave back:
    // more than the launch's share deadlocks.
    static constexpr int PRODUCER_REGS = CONSUMERS == 2 ? 40 : 56;
    static constexpr int CONSUMER_REGS = CONSUMERS == 2 ? 232 : 240;
    static constexpr int LAUNCH_REGS = (65536 / THREADS > 255 ? 255 : 65536 / THREADS) / 8 * 8;
    static_assert(128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= THREADS * LAUNCH_REGS,
                  "the launch's register file");
    static_assert((CONSUMERS == 1 || CONSUMERS == 2) && BM == 64 * CONSUMERS,
                  "a producer and one or two consumer warpgroups of 64 rows");
    static_assert(HEAD % 64 == 0 && BN % 32 == 0 && BN <= 128, "whole swizzle slabs of Q, K, V and V^T");
    static_assert(STAGES == 2, "K/V tiles are double-buffered");
    static_assert(SPLIT == TF32_PLAIN || SPLIT == TF32X3_PARTS || SPLIT == TF32X3_ROUNDED,
                  "parts the tensor core reads exactly (TF32X3_FAST leaves it to truncate small)");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Shared-memory addresses of the tiles and barriers (every tile 1024-byte aligned: its size is a
// multiple of 1024). Plain TF32 has no small parts: k_small / vt_small are never touched.
template <typename Tr>
struct Tf32Smem {
    unsigned q, q_small, stages, bars;
    __device__ __forceinline__ explicit Tf32Smem(unsigned tiles)
        : q(tiles), q_small(tiles + Tr::Q_BYTES), stages(tiles + Tr::PARTS * Tr::Q_BYTES),
          bars(tiles + Tr::TILE_BYTES) {}
    __device__ __forceinline__ unsigned k_big(int s) const { return stages + s * Tr::STAGE_BYTES; }
    __device__ __forceinline__ unsigned k_small(int s) const { return k_big(s) + Tr::KV_BYTES; }
    __device__ __forceinline__ unsigned v_raw(int s) const { return k_big(s) + Tr::PARTS * Tr::KV_BYTES; }
    __device__ __forceinline__ unsigned vt_big(int s) const { return v_raw(s) + Tr::KV_BYTES; }
    __device__ __forceinline__ unsigned vt_small(int s) const { return vt_big(s) + Tr::KV_BYTES; }
    __device__ __forceinline__ unsigned q_full() const { return bars; }
    // Per stage: full (the copy engine's bytes; 1 arrival), ready (the producer's 128 threads have
    // written the parts), empty (every consumer thread's wgmmas are done with them).
    __device__ __forceinline__ unsigned k_full(int s) const { return bars + 8 * (1 + 6 * s); }
    __device__ __forceinline__ unsigned k_ready(int s) const { return bars + 8 * (2 + 6 * s); }
    __device__ __forceinline__ unsigned k_empty(int s) const { return bars + 8 * (3 + 6 * s); }
    __device__ __forceinline__ unsigned v_full(int s) const { return bars + 8 * (4 + 6 * s); }
    __device__ __forceinline__ unsigned v_ready(int s) const { return bars + 8 * (5 + 6 * s); }
    __device__ __forceinline__ unsigned v_empty(int s) const { return bars + 8 * (6 + 6 * s); }
};

// Phases. A barrier of stage s completes one phase per tile t with t % 2 == s, tile t's being phase
// t / 2: waiting for tile t's is parity (t / 2) % 2. A producer about to fill stage s for tile t
// waits for tile t - 2's release: parity (t / 2) % 2 ^ 1, which a fresh barrier (phase 0 pending)
// passes at once for t = 0, 1.
__device__ __forceinline__ unsigned tile_parity(int t) { return (t >> 1) & 1; }
__device__ __forceinline__ unsigned release_parity(int t) { return tile_parity(t) ^ 1; }

constexpr int TF32_PRODUCER_BAR = 1;   // named barrier of the producer warpgroup; 2 + c: consumer c's

// The producer warpgroup (`thread` 0..127): Q once, then every visible tile's K and V, as the
// file's head says. `first`: the first visible tile (< end); `at`: the block's rows in the maps
// (TmaRows, scheduler.cuh). PACKED: a sequence's last tile holds the next sequence's rows past its
// last key (the copy engine fills zeros past the packed tensor only); their P is 0, but 0 x inf is
// NaN, so V's raw rows there are zeroed before V^T is formed (`smem`: the generic pointer of shared
// address `base`).
template <typename Tr, int SPLIT, bool PACKED, typename Mod>
__device__ __forceinline__ void produce_tf32(const Tf32Smem<Tr>& sm, const FwdTensorMaps& maps, const Mod& mod,
                                             const QueryBlock& blk, const TmaRows& at, int first, int end,
                                             int thread, unsigned char* smem, unsigned base) {
    constexpr int BN = Tr::BN, SLABS = Tr::SLABS;
    auto copy_k = [&](int stage, int j) {
        mbar_arrive_expect_tx(sm.k_full(stage), Tr::KV_BYTES);
        tma_load_tile<BN, SLABS, 32>(sm.k_big(stage), &maps.k, sm.k_full(stage), at.k0 + j * BN, blk.kv_head,
                                     at.batch);
    };
    auto copy_v = [&](int stage, int j) {
        mbar_arrive_expect_tx(sm.v_full(stage), Tr::KV_BYTES);
        tma_load_tile<BN, SLABS, 32>(sm.v_raw(stage), &maps.v, sm.v_full(stage), at.k0 + j * BN, blk.kv_head,
                                     at.batch);
    };
    if (thread == 0) {
        mbar_arrive_expect_tx(sm.q_full(), Tr::Q_BYTES);
        tma_load_tile<Tr::BM, SLABS, 32>(sm.q, &maps.q, sm.q_full(), at.q0 + blk.m0, blk.head, at.batch);
        copy_k(0, first);
        copy_v(0, first);
    }
    int t = 0;
#pragma unroll 1
    for (int j = first; j < end; ++t) {
        const int stage = t & 1;
        const int next = mod.next_key_tile(j + 1, end, blk.m0, blk.rows, BN);
        if (thread == 0 && next < end) {   // tile t + 1 into the other stage
            // Its raw V: every producer thread finished reading it (tile t - 1) before the barrier
            // that closed the last iteration.
            copy_v(stage ^ 1, next);
            mbar_wait(sm.k_empty(stage ^ 1), release_parity(t + 1));   // the consumers' S of tile t - 1
            copy_k(stage ^ 1, next);
        }
        // K_t: big in place of the loaded tile, small beside it. The consumers released tile t - 2's
        // parts before its K was copied (thread 0 waited for that), which k_full orders before this.
        mbar_wait(sm.k_full(stage), tile_parity(t));
        split_rows_in_place<SPLIT, BN, SLABS, BN * 128, 128>(sm.k_big(stage), sm.k_small(stage), thread);
        fence_proxy_async_smem();   // these writes before the consumers' wgmmas read them
        mbar_arrive(sm.k_ready(stage));
        // V_t^T, once the consumers' O += P V of tile t - 2 no longer reads the stage's V^T.
        mbar_wait(sm.v_full(stage), tile_parity(t));
        mbar_wait(sm.v_empty(stage), release_parity(t));
        if (PACKED && mod.lk - j * BN < BN) {   // every producer thread's zeros before any reads them
            zero_tile_rows<BN, SLABS, 128>(smem + (sm.v_raw(stage) - base), mod.lk - j * BN, thread);
            named_bar_sync(TF32_PRODUCER_BAR, 128);
        }
        transpose_v_tile<SPLIT, BN, Tr::HEAD, 4>(sm.v_raw(stage), sm.vt_big(stage), sm.vt_small(stage), thread / 32,
                                                 thread % 32);
        fence_proxy_async_smem();
        mbar_arrive(sm.v_ready(stage));
        // Every producer thread is done with this stage's raw V and with K's in-place writes before
        // thread 0 copies tile t + 2 over them (next iteration); the fences above also order those
        // generic-proxy accesses before the copy engine's writes.
        named_bar_sync(TF32_PRODUCER_BAR, 128);
        j = next;
    }
}

// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first.
// The host checked what the tensor maps need: 16-byte aligned bases and strides (cuflash/_runtime/tma.py).
// PACKED: a CTA for each block of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), without
// EXTRA: each with its sequence's own counts, its maps' rows counted from the packed tensor's first (TmaRows).
template <typename T, typename Cfg, typename Flags, int SPLIT, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
flash_fwd_wgmma_tf32(const __grid_constant__ FwdParams p, const __grid_constant__ FwdTensorMaps maps) {
    static_assert(sizeof(T) == sizeof(float), "float32 data on TF32 tensor cores");
    typedef FwdWgmmaTf32Traits<Cfg, SPLIT> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, STAGES = Tr::STAGES;
    constexpr int PV_N = Tr::PV_N, PIECES = Tr::PV_PIECES;
    static_assert(!PACKED || !Flags::EXTRA, "packed sequences: without EXTRA");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned base = smem_addr(smem_raw);
    const Tf32Smem<Tr> sm(align_1024(base));

    const AttnDims& dims = p.dims;
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q) : PackedBlock{};
    const QueryBlock blk = PACKED ? seq.query_block(dims, BM)
                                  : QueryBlock::from_grid<BM>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warpgroup = warp / 4;
    typedef ScoreMod<Flags, float, float, PACKED> Mod;   // PACKED: the sequence's own counts (PER_SEQ)
    const Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, p.scale_log2_f, blk.head);
        else return Mod(p.mask, dims, p.scale_log2_f, blk.batch, blk.head);
    }();
    // no layout spans: with every library modification the EXTRA band variant at head dim 128 spilled 208
    // bytes with their loads (NVRTC 12.9); it walks the layout tile by tile
    const TileRange keys = mod.template key_tiles<false>(blk.m0, blk.rows, BN);
    auto next_tile = [&](int j) { return mod.next_key_tile(j, keys.end, blk.m0, blk.rows, BN); };

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full(), 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.k_full(s), 1);
            mbar_init(sm.v_full(s), 1);
            mbar_init(sm.k_ready(s), 128);
            mbar_init(sm.v_ready(s), 128);
            mbar_init(sm.k_empty(s), Tr::CONSUMER_THREADS);
            mbar_init(sm.v_empty(s), Tr::CONSUMER_THREADS);
        }
        mbar_init_fence();
    }
    __syncthreads();   // the last CTA-wide barrier: from here on, the mbarriers order everything

    if (warpgroup == 0) {
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        const int first = next_tile(keys.begin);
        const TmaRows at = PACKED ? TmaRows::packed(seq) : TmaRows::dense(blk.batch);
        if (first < keys.end)
            produce_tf32<Tr, SPLIT, PACKED>(sm, maps, mod, blk, at, first, keys.end, threadIdx.x, smem_raw, base);
        return;
    }
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const int consumer = warpgroup - 1, cwarp = warp - 4;   // consumer warpgroup, warp among the consumers
    const float x_per_s = mod.x_per_score();

    float acc_o[1][Tr::O_TILES][4];
    float row_max[1][2], row_sum[1][2];
    start_rows(acc_o, row_max, row_sum);

    // This warpgroup's 64 rows of every Q slab (big, and small with SPLIT).
    const unsigned q_rows = consumer * 64 * 128;
    const unsigned q_big = sm.q + q_rows, q_small = sm.q_small + q_rows;
    const int warp_row0 = blk.m0 + cwarp * 16;

    int j = next_tile(keys.begin);
    if (j < keys.end) {   // Q's parts, once: this warpgroup's rows only
        mbar_wait(sm.q_full(), 0);
        split_rows_in_place<SPLIT, 64, Tr::SLABS, BM * 128, 128>(q_big, q_small, threadIdx.x % 128);
        fence_proxy_async_smem();
        named_bar_sync(2 + consumer, 128);
    }
#pragma unroll 1
    for (int t = 0; j < keys.end; ++t) {
        const int stage = t & 1;
        const int next = next_tile(j + 1);

        const int n0 = j * BN;
        // EXTRA with a bias: this warp's 16 x BN bias, in flight during S = Q K^T.
        float bias_frag[Flags::EXTRA ? Tr::S_TILES : 1][4];
        if constexpr (Flags::EXTRA) {
            if (mod.has_bias())
                load_bias_frags(bias_frag, p.mask.bias, blk.batch, blk.head, warp_row0 + lane / 4, n0, dims.lq,
                                dims.lk, lane);
        }

        // S = Q K^T for this warpgroup's 64 rows (a warp's 16 in its C fragments).
        float s[1][Tr::S_TILES][4];
        mbar_wait(sm.k_ready(stage), tile_parity(t));
        const unsigned k_big = sm.k_big(stage), k_small = sm.k_small(stage);
        if constexpr (SPLIT != TF32_PLAIN) {
            float fresh[2][BN / 2];
            fresh_steps<HEAD / 8>(
                fresh,
                [&](int kk, float (&f)[BN / 2]) {
                    wgmma_tf32x3_ss<BN>(f, k_major_desc(q_big, kk, BM * 128), k_major_desc(q_small, kk, BM * 128),
                                        k_major_desc(k_big, kk, BN * 128), k_major_desc(k_small, kk, BN * 128));
                },
                [&](int kk, const float (&f)[BN / 2]) {
                    float (&acc)[BN / 2] = flat(s);
#pragma unroll
                    for (int i = 0; i < BN / 2; ++i) acc[i] = kk == 0 ? f[i] : acc[i] + f[i];
                });
        } else {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HEAD / 8; ++kk)
                wgmma_tf32_ss<BN>(flat(s), k_major_desc(q_big, kk, BM * 128), k_major_desc(k_big, kk, BN * 128),
                                  kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(flat(s));
        }
        mbar_arrive(sm.k_empty(stage));   // this thread's wgmmas are done with K_t

        // Per warp (its 16 rows): a block layout's blocks may straddle them (flash_fwd_wgmma.cu).
        const int kind = mod.classify(warp_row0, 16, n0, BN);
        auto coord = [=](int n, int i, int& row, int& col) {
            row = warp_row0 + frag_row(lane, i);
            col = n0 + frag_col(lane, n, i);
        };
        mask_and_modify(s[0], mod, coord, x_per_s, [&] {
            if constexpr (Flags::EXTRA) {
                // x = s scale + bias log2(e)
                if (mod.has_bias()) scale_add_bias_regs(s[0], bias_frag, mod.scale_log2);
                // the per-element tests in a loop (registers), none where the warp sees nothing (not the band's
                // alone in a TILE_BAND tile: that second loop spilled 32 bytes at head dim 32 with the library
                // modifications)
                apply_score_mod_bits(s[0], mod, kind != TILE_FULL, coord, kind == TILE_SKIP);
            } else {
                apply_score_mod(s[0], mod, kind != TILE_FULL, coord);
            }
        });
        // P = 2^(x - m_new) in s; acc_o is not in flight, so a moved reference rescales it at once.
        warp_softmax_step<Tr>(s, row_max, row_sum, softmax_x_per_s(x_per_s),
                              [&](int, int r, float c) { rescale_acc_row(acc_o, 0, r, c); });
        // Dropout scales the fp32 probabilities after the statistics (row_sum counts every key).
        if constexpr (Flags::EXTRA) apply_dropout_frags(s[0], mod, warp_row0 + lane / 4, n0, lane);

        // P's A fragments: k8 step kk is keys 8kk..8kk+7 (S's n8 tile kk) in V^T's permuted order,
        // A's k index t being key 2t and t + 4 key 2t + 1: a0..a3 = c0, c2, c1, c3, no shuffle.
        unsigned p_big[BN / 8][4], p_small[BN / 8][4];
#pragma unroll
        for (int kk = 0; kk < BN / 8; ++kk) {
            const float c[4] = {s[0][kk][0], s[0][kk][2], s[0][kk][1], s[0][kk][3]};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (SPLIT != TF32_PLAIN) split_tf32<SPLIT>(c[i], p_big[kk][i], p_small[kk][i]);
                else p_big[kk][i] = __float_as_uint(round_tf32(c[i]));
            }
        }

        // O += P V_t, in PIECES column pieces of PV_N (V^T rows h PV_N..).
        mbar_wait(sm.v_ready(stage), tile_parity(t));
        const unsigned vt_big = sm.vt_big(stage), vt_small = sm.vt_small(stage);
        auto vt_desc = [&](unsigned part, int kk, int h) {
            return k_major_desc(part + h * PV_N * 128, kk, HEAD * 128);
        };
        if constexpr (SPLIT != TF32_PLAIN) {
            float fresh[2][PV_N / 2];
            fresh_steps<(BN / 8) * PIECES>(
                fresh,
                [&](int st, float (&f)[PV_N / 2]) {
                    const int kk = st / PIECES, h = st % PIECES;
                    wgmma_tf32x3_rs<PV_N>(f, p_big[kk], p_small[kk], vt_desc(vt_big, kk, h), vt_desc(vt_small, kk, h));
                },
                [&](int st, const float (&f)[PV_N / 2]) {
                    add_frags(acc_piece<PV_N / 2>(flat(acc_o), st % PIECES), f);
                });
            // P's registers stay untouched until the last wgmma reading them is done (fresh_steps
            // waited for it): the compiler does not know the reads are asynchronous.
            fence_regs(p_big);
            fence_regs(p_small);
        } else {
            wgmma_fence();   // acc_o rescaled, P written by ordinary instructions
#pragma unroll
            for (int kk = 0; kk < BN / 8; ++kk)
#pragma unroll
                for (int h = 0; h < PIECES; ++h)
                    wgmma_tf32_rs<PV_N>(acc_piece<PV_N / 2>(flat(acc_o), h), p_big[kk], vt_desc(vt_big, kk, h), 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(flat(acc_o));
            fence_regs(p_big);
        }
        mbar_arrive(sm.v_empty(stage));   // ...and with V_t^T
        j = next;
    }

    // Epilogue: O = acc_o / l, lse per row; rows past lq and columns past dv are not written.
    store_o_lse_c_frags<true, float>(p, blk, cwarp * 16, lane, acc_o, row_max, row_sum);
}
