// flash_bwd_wgmma.cu -- attention backward (dK, dV and atomic dQ) on Hopper's warpgroup MMA
// (sm_90a), float16 / bfloat16, head dims 64, 128 and 256.
//
// The math is flash_bwd_mma.cu's (flash_bwd_fma.cu explains it); the machinery is the Hopper
// forward's (flash_fwd_wgmma.cu): a producer warp streams tiles through the bulk tensor copy
// engine (tma.cuh) into 128-byte swizzled shared memory on mbarrier stages, and two consumer
// warpgroups multiply on wgmma (wgmma.cuh) with their accumulators in registers.
//
// One CTA per (key block of BN keys, K/V head, batch); 3 warpgroups. Warpgroup 0: its first
// warp loads K and V once, then for every (query head of the group, query block of BM) step
// that sees the block: Q_i and dO_i by the copy engine, lse_i (in log2 units) and Dsum_i by
// the warp's 32 lanes, into a two-stage ring. The consumers split the work in one of two ways.
//
// Head dims 64 and 128 (consume_key_halves): BN = 128, consumer warpgroup c owns keys
// [64 c, 64 c + 64) of the block and, per step:
//     S^T  = K_c Q_i^T,  dP^T = V_c dO_i^T     wgmma, operands from shared memory (M = 64 keys,
//                                              N = BM queries); the accumulator of a warp is the
//                                              m16n8 C layout, so softmax.cuh's prob_and_dscore and
//                                              score_mod.cuh's strip mask apply unchanged
//     P^T  = 2^(S^T x - lse),  dS^T = P^T (dP^T - Dsum)
//     dV_c += P^T dO_i,  dK_c += dS^T Q_i      wgmma with P^T / dS^T from registers (16-bit A
//                                              fragments packed from the accumulators) and dO / Q
//                                              read transposed (MN-major)
//     dS^T -> shared memory (key-major, swizzled), one named barrier with the other warpgroup
//     dQ_i += scale dS K                       wgmma with both operands MN-major: warpgroup c forms a
//                                              64 x 64 block of the BM x HEAD product (rows 64 c.. at
//                                              BM = 128, columns 64 c.. at BM = 64), stages it in
//                                              shared memory, and one of its threads has the copy
//                                              engine add it to the fp32 accumulator (a bulk tensor
//                                              reduction; forward+backward 1.10-1.18x over vector
//                                              atomics from registers: benchmarks/tune_bwd.py)
// dS^T is double-buffered: the named barrier of step t + 1 is passed only after both warpgroups
// have waited for their step-t dQ products, so buffer t % 2 is free again at step t + 2.
//
// Head dim 256 (SPLIT_HEAD, consume_head_halves): dK and dV of 64 keys over 256 columns are
// 128 + 128 accumulator registers a thread, more than a consumer's 232. So BN = 64 and BM = 64,
// both consumer warpgroups own all 64 keys of the block, and warpgroup c accumulates columns
// [128 c, 128 c + 128) of dK and dV (64 + 64 registers). S^T and dP^T are formed once each and
// exchanged through shared memory (recomputing both in each warpgroup would be 1.4x the
// tensor-core work), per step:
//     warpgroup 0: S^T = K Q_i^T; P^T = 2^(S^T x - lse) -> P^T buffer
//     warpgroup 1: dP^T = V dO_i^T
//     both:        named barrier P_T; dV_c += P^T dO_i[:, c]    (P^T from shared memory, wgmma_ss_bmn)
//     warpgroup 1: dS^T = P^T (dP^T - Dsum) -> dS^T buffer    (P^T read back in 16 bits)
//     both:        named barrier DS_T; dK_c += dS^T Q_i[:, c],  dQ_i[:, c] = dS K[:, c]
//     dQ_i[:, c] (64 x 128 fp32, two 64-column products) is staged in warpgroup c's own 64-column
//     slabs of this step's Q and dO (2c, 2c + 1 of each: after P_T / DS_T only its own dK_c / dV_c
//     read them) and added by the copy engine; the stage goes back to the producer once the engine
//     has read it (the warpgroup's leader arrives on "empty" one step late).
// Both barriers are passed by both warpgroups (a warpgroup's wgmmas read the rows its sibling
// warps stored, so a plain arrive on the writing side would not do). P^T and dS^T are double-
// buffered: each warpgroup has waited for all its step-t products before it reaches the barriers
// of step t + 1, so buffer t % 2 is free again at step t + 2.
//
// dK = scale sum dS^T Q and dV leave from registers at the end. The deterministic dQ takes the
// portable kernels.
//
// EXTRA (bias, mask, dropout, block layout; head dims 64 and 128): the portable kernel's policy
// (flash_bwd_mma.cu) on S^T, whose rows are keys. Producer warps 2-3
// copy each step's [query][key] bias tile into a swizzled stage beside Q / dO (the Hopper forward's
// machinery, arriving on the same full barrier), warp 1 loads the row statistics; the consumers read
// the bias transposed into S^T's fragments (ldmatrix.trans), mask partial strips per element, and draw
// dropout's keep bits from the same Philox stream (dropout_frag_bits_t). Steps a block layout hides
// are given back unformed. Head dim 64 takes 64-query steps there (two bias stages beside 128-query
// steps would not fit), with dQ split by keys.
//
// DBIAS (with EXTRA): the call wants dbias, so each warp adds
// its fp32 dS^T, as formed and before it is packed to 16 bits, into a key-major fp32 accumulator with
// vector reductions (bias_grad_t.cuh); a one-row bias is summed over the queries in registers and added
// once per (CTA, head). The portable dbias kernel, which recomputes S and dP a second time, is not run.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "bias_grad_t.cuh"
#include "linear_bias.cuh"

// The kernel's tensor maps (cuflash/_runtime/tma.py): Q and dO with boxes of BM rows, K and V of BN.
// dq: the fp32 dQ accumulator, boxes of 32 columns (one 128-byte slab) x 64 rows, added into.
struct BwdTensorMaps {
    TensorMap q, dout, k, v, dq;
};

template <typename T, typename Cfg, bool EXTRA, bool DBIAS = false>
struct DkdvWgmmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS, STAGES = Cfg::STAGES;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int CONSUMER_THREADS = 256;
    // Head dim 256: both consumer warpgroups own the block's keys and split dK / dV by columns
    // (the file's head); otherwise each owns 64 keys and all columns.
    static constexpr bool SPLIT_HEAD = HEAD == 256;
    static_assert(!SPLIT_HEAD || !USER_SCORE, "head dim 256 forms P and dS in different warpgroups, dS from P: no "
                                              "user score modifications (the portable kernels take them)");
    static constexpr int WG_COLS = SPLIT_HEAD ? HEAD / 2 : HEAD;   // dK / dV columns of a consumer warpgroup
    static constexpr bool EXTRA_OPTIONS = EXTRA;
    static constexpr bool ADDS_DBIAS = DBIAS;   // the consumers add dS^T into dbias (bias_grad_t.cuh)
    static constexpr int SLABS = HEAD / 64;               // 64-column swizzle slabs of a Q / dO / K / V row
    static constexpr int Q_BYTES = BM * HEAD * int(sizeof(T));    // one Q or dO stage
    static constexpr int KV_BYTES = BN * HEAD * int(sizeof(T));   // K or V
    static constexpr int DS_BYTES = BN * BM * int(sizeof(T));     // one dS^T buffer: BM / 64 slabs of BN keys
    static constexpr int PT_BYTES = SPLIT_HEAD ? DS_BYTES : 0;    // one P^T buffer (exchanged as dS^T is)
    static constexpr int STATS_BYTES = 2 * BM * int(sizeof(float));   // lse_log2 and Dsum of one stage
    // EXTRA: the step's BM x BN bias tile ([query][key], tile_io.cuh's swizzled layout) in each stage,
    // copied by BIAS_LOADERS producer threads (warps 2 and 3; warp 0 drives the copy engine, warp 1 loads
    // the row statistics) as the
    // Hopper forward does. Head dim 64 then takes 64-query steps: at 128, two 32 KB bias stages
    // would not fit beside its dS^T buffers and dQ staging (258 KB).
    static constexpr int BIAS_BYTES = EXTRA ? BM * BN * int(sizeof(T)) : 0;
    static constexpr int BIAS_LOADERS = 64, FIRST_BIAS_LOADER = 64;
    // dQ staging: each consumer warpgroup's 64 x 64 fp32 block as two swizzled 32-column boxes
    // (SPLIT_HEAD stages in the step's Q and dO tiles instead: no room for 64 KB more).
    static constexpr int DQ_BOX_BYTES = 64 * 128, DQ_STAGE_BYTES = SPLIT_HEAD ? 0 : 2 * 2 * DQ_BOX_BYTES;
    // dQ per consumer warpgroup c (not SPLIT_HEAD): a 64 x 64 block of the BM x HEAD product, rows
    // 64 c.. (BM 128) or columns 64 c.. (HEAD 128).
    // At head dim 64 with 64-query steps (EXTRA) the product is one 64 x 64 block: warpgroup c forms the
    // part over its own 64 keys (dS[:, 64 c..] K[64 c.., :]) and both add theirs into the same block.
    static constexpr bool DQ_SPLIT_ROWS = BM == 128;
    static constexpr bool DQ_SPLIT_KEYS = !SPLIT_HEAD && HEAD == 64 && BM == 64;
    // Barriers after the tiles: K/V full, then full / empty per stage.
    static constexpr int BARRIERS = 1 + 2 * STAGES;
    // LINEAR_BIAS: the B table of the linear bias's k16 step over a step's BM queries (linear_bias.cuh).
    static constexpr int LIN_BYTES = LinearBiasTable<BM>::BYTES;
    static_assert(!LINEAR_BIAS || (!EXTRA && !SPLIT_HEAD), "the linear bias: plain variants at head dims 64, 128");
    static constexpr int TILE_BYTES = 2 * KV_BYTES + 2 * STAGES * Q_BYTES + 2 * DS_BYTES + 2 * PT_BYTES
                                      + DQ_STAGE_BYTES + STAGES * BIAS_BYTES + LIN_BYTES;
    // 1024 bytes of slack: the swizzled tiles start at the first 1024-byte boundary.
    static constexpr int SMEM_BYTES = 1024 + TILE_BYTES + STAGES * STATS_BYTES + 8 * BARRIERS;
    // The producer warpgroup keeps 40 registers a thread, the consumers take 232: the CTA holds
    // 384 x 168 registers from its launch (__launch_bounds__), and setmaxnreg.inc waits until the
    // others have given back what it takes, so more than that deadlocks (24 spill in the producer).
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
    static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 384 * 168, "the launch's register file");
    static_assert(sizeof(T) == 2, "wgmma here takes 16-bit operands");
    static_assert(!DBIAS || EXTRA, "dbias comes with a bias, an EXTRA piece");
    static_assert(!EXTRA || !SPLIT_HEAD, "head dim 256 with EXTRA takes the portable kernels: its 226 KB leave no "
                                         "room for bias stages");
    static_assert(FIRST_BIAS_LOADER >= 64 && FIRST_BIAS_LOADER + BIAS_LOADERS <= 128,
                  "the bias loaders are producer warps other than the copy engine's and the statistics'");
    static_assert(WARPS == 12 && BN == (SPLIT_HEAD ? 64 : 128),
                  "a producer and two consumer warpgroups: of 64 keys each, or (SPLIT_HEAD) both of the block's 64");
    static_assert(SPLIT_HEAD ? BM == 64 : (HEAD == 64 && (BM == 128 || BM == 64)) || (HEAD == 128 && BM == 64),
                  "dQ: a 64 x 64 block per consumer warpgroup, split by rows (BM 128), columns (HEAD 128) or "
                  "keys (HEAD 64, BM 64); SPLIT_HEAD: 64-query steps");
    static_assert(!SPLIT_HEAD || BM * 128 == DQ_BOX_BYTES, "SPLIT_HEAD: a dQ box fills one 64-column slab of Q or dO");
    static_assert(STAGES >= 2 && STAGES <= 4, "Q/dO tiles: a ring of 2-4 stages");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Named barriers (0 is __syncthreads). DS_T: dS^T is in shared memory (both consumer
// warpgroups); DQ_STAGED + c: consumer warpgroup c's dQ staging is complete (its 128 threads);
// P_T: SPLIT_HEAD's P^T is in shared memory (both consumer warpgroups).
// ZEROED (PACKED): the rows past a sequence's end in K, V or a step's Q, dO are zeroed (both).
enum BwdNamedBarrier { BAR_DS_T = 1, BAR_DQ_STAGED = 2, BAR_P_T = 4, BAR_ZEROED = 5 };

// Shared-memory addresses of the pipeline's tiles, row statistics and barriers, and the generic
// pointer of an address (raw is the dynamic shared memory, at shared address base).
template <typename Tr>
struct BwdWgmmaSmem {
    unsigned char* raw;
    unsigned base;
    unsigned k, v, q, dout, ds, pt, dq, bias, lin, stats, bars;
    __device__ __forceinline__ unsigned char* at(unsigned addr) const { return raw + (addr - base); }
    __device__ __forceinline__ unsigned q_tile(int stage) const { return q + stage * Tr::Q_BYTES; }
    __device__ __forceinline__ unsigned do_tile(int stage) const { return dout + stage * Tr::Q_BYTES; }
    __device__ __forceinline__ unsigned ds_tile(int buffer) const { return ds + buffer * Tr::DS_BYTES; }
    __device__ __forceinline__ unsigned pt_tile(int buffer) const { return pt + buffer * Tr::PT_BYTES; }
    __device__ __forceinline__ unsigned dq_stage(int consumer) const { return dq + consumer * 2 * Tr::DQ_BOX_BYTES; }
    __device__ __forceinline__ unsigned bias_tile(int stage) const { return bias + stage * Tr::BIAS_BYTES; }
    __device__ __forceinline__ unsigned kv_full() const { return bars; }
    // Q, dO (copy engine bytes plus the producer warp's 32 stat arrivals) of one stage; with EXTRA and a
    // bias also the bias loaders' arrivals (one each, when its copies have landed).
    __device__ __forceinline__ unsigned full(int stage) const { return bars + 8 * (1 + 2 * stage); }
    __device__ __forceinline__ unsigned empty(int stage) const { return bars + 8 * (2 + 2 * stage); }
};

// The producer warp: K and V once, then each step's Q, dO (lane 0, the copy engine) and row
// statistics (all lanes; with EXTRA the bias loaders' job: STATS false) into stage t % STAGES once
// the consumers have emptied it, the statistics' loads issued before that wait. `at`: the block's
// rows in the maps' coordinates (TmaRows, scheduler.cuh); `lq`: its sequence's query count.
template <typename Tr, bool STATS = true, bool PACKED = false>
__device__ __forceinline__ void produce_steps(const BwdWgmmaSmem<Tr>& sm, float* stats0, const BwdTensorMaps& maps,
                                              const BwdParams& p, const KeyBlock& blk,
                                              const KeyBlockSteps<Tr::BM>& steps, const TmaRows& at, int lq) {
    constexpr int BM = Tr::BM;
    // Not with score modifications at every element: ptxas then spills the head-dim-64 consumers (32 B,
    // NVRTC 12.9 to 13.5) beside a producer that holds a step's statistics.
    constexpr bool IN_FLIGHT = STATS && !USER_SCORE_EVERYWHERE;
    const int lane = threadIdx.x % 32;
    const int q_batch = PACKED ? at.q0 : blk.batch;   // the statistics' batch index (packed: the first row)
    if (lane == 0) {
        mbar_arrive_expect_tx(sm.kv_full(), 2 * Tr::KV_BYTES);
        tma_load_tile<Tr::BN, Tr::SLABS>(sm.k, &maps.k, sm.kv_full(), at.k0 + blk.n0, blk.kv_head, at.batch);
        tma_load_tile<Tr::BN, Tr::SLABS>(sm.v, &maps.v, sm.kv_full(), at.k0 + blk.n0, blk.kv_head, at.batch);
    }
    for (int t = 0, head = steps.first_head, block = 0; t < steps.count; ++t, steps.advance(head, block)) {
        const int stage = t % Tr::STAGES, m0 = steps.m0(block);
        RowStatsInFlight<BM, 32, float> stats;   // loaded while the stage is still in use
        if constexpr (IN_FLIGHT) stats.load(p.lse, p.dsum, q_batch, head, m0, imin(BM, lq - m0), lane);
        mbar_wait(sm.empty(stage), ((t / Tr::STAGES) & 1) ^ 1);   // the round before this one
        if (lane == 0) {
            mbar_arrive_expect_tx(sm.full(stage), 2 * Tr::Q_BYTES);
            tma_load_tile<BM, Tr::SLABS>(sm.q_tile(stage), &maps.q, sm.full(stage), at.q0 + m0, head, at.batch);
            tma_load_tile<BM, Tr::SLABS>(sm.do_tile(stage), &maps.dout, sm.full(stage), at.q0 + m0, head, at.batch);
        }
        if constexpr (STATS) {
            float* lse_s = stats0 + stage * 2 * BM;
            if constexpr (IN_FLIGHT) stats.store(lse_s, lse_s + BM, lane);
            else load_row_stats<BM, 32>(lse_s, lse_s + BM, p.lse, p.dsum, q_batch, head, m0, imin(BM, lq - m0));
            mbar_arrive(sm.full(stage));   // release: this lane's statistics are visible to the waiters
        }
    }
}

// EXTRA: producer warp 1 loads each step's row statistics into stage t % STAGES once the consumers
// have emptied it, and its 32 lanes arrive on the stage's full barrier (a release), as warp 0's do in
// the plain kernel (produce_steps): there, beside the bias loaders' code, warp 0's 40 registers spill.
template <typename Tr>
__device__ __forceinline__ void produce_stats(const BwdWgmmaSmem<Tr>& sm, float* stats0, const BwdParams& p,
                                              const KeyBlock& blk, const KeyBlockSteps<Tr::BM>& steps, int lane) {
    constexpr int BM = Tr::BM;
#pragma unroll 1
    for (int t = 0, head = steps.first_head, block = 0; t < steps.count; ++t, steps.advance(head, block)) {
        const int stage = t % Tr::STAGES, m0 = steps.m0(block);
        mbar_wait(sm.empty(stage), ((t / Tr::STAGES) & 1) ^ 1);   // the round before this one
        float* lse_s = stats0 + stage * 2 * BM;
        load_row_stats<BM, 32>(lse_s, lse_s + BM, p.lse, p.dsum, blk.batch, head, m0, imin(BM, p.dims.lq - m0), lane);
        mbar_arrive(sm.full(stage));
    }
}

// EXTRA with a bias: the bias loaders (`loader` of BIAS_LOADERS, producer warps 2 and 3) copy each
// step's bias tile, queries [m0, m0 + BM) of the step's head x the block's keys, into bias stage
// t % STAGES once the consumers have emptied the stage (the ring of Q and dO: its empty barrier), and
// arrive on the stage's full barrier when their copies have landed (cp.async.mbarrier.arrive.noinc,
// counted among full's arrivals): the consumers' one wait covers Q, dO, the statistics and the bias.
// The host takes this kernel only for a bias whose rows are 16-byte chunks (cuflash/_dispatch/masking.py,
// bias_in_chunks), as for the Hopper forward (flash_fwd_wgmma.cu, produce_bias_tiles).
template <typename T, typename Tr>
__device__ __forceinline__ void produce_bias_steps(const BwdWgmmaSmem<Tr>& sm, const ScoreTensor& bias,
                                                   const KeyBlock& blk, const KeyBlockSteps<Tr::BM>& steps, int lq,
                                                   int lk, int loader) {
    // A chunk column and the rows first_row + k ROW_STEP a loader (ScoreChunkCopy's split), its source
    // walked down the query blocks of a head and set again at the next head: a pointer, a stride and
    // the loop's counters is what lives here (a ScoreChunkCopy built every step took more).
    typedef ScoreChunkCopy<T, Tr::BM, Tr::BN, Tr::BIAS_LOADERS> Split;
    const int chunk = loader % Split::CHUNKS, first_row = loader / Split::CHUNKS;
    const int src_bytes = 2 * imax(0, imin(8, lk - blk.n0 - 8 * chunk));   // 16, a cut chunk's head, or 0
    const T* src = nullptr;
#pragma unroll 1
    for (int t = 0, head = steps.first_head, block = 0; t < steps.count; ++t, steps.advance(head, block)) {
        const int stage = t % Tr::STAGES, m0 = steps.m0(block);
        if (block == 0) src = bias.at<T>(blk.batch, head, m0 + first_row, blk.n0 + 8 * chunk);
        mbar_wait(sm.empty(stage), ((t / Tr::STAGES) & 1) ^ 1);   // the round before this one
        const unsigned tile = sm.bias_tile(stage);
        const T* row_src = src;
#pragma unroll 1
        for (int row = first_row; row < Tr::BM; row += Split::ROW_STEP, row_src += Split::ROW_STEP * bias.row_stride) {
            const int n = m0 + row < lq ? src_bytes : 0;
            cp_async_16_head(tile + sw_chunk_offset<Tr::BN>(row, chunk), n ? row_src : bias.ptr, n);
        }
        mbar_arrive_on_cp_async(sm.full(stage));
        src += Tr::BM * bias.row_stride;   // the next query block of this head
    }
    // No copy left in flight behind an exiting thread (wait_group counts committed groups only).
    cp_async_commit();
    cp_async_wait<0>();
}

// Where word i of this warp's 16-bit A fragment kk of a transposed score tile (P^T or dS^T:
// keys key_row + lane / 4 + 8 (i % 2), queries 16 kk + 8 (i / 2) + 2 (lane % 4) and + 1; a[1],
// a[3] are row g + 8, a[2], a[3] queries + 8) lies in its swizzled key-major buffer
// (sw128_offset: query q of key r at slab q / 64, row r). Each 32-bit access of a warp hits 32
// distinct banks.
template <typename Tr>
__device__ __forceinline__ int t_frag_offset(int kk, int i, int key_row, int lane) {
    const int row = key_row + lane / 4 + 8 * (i % 2);
    const int q = 16 * kk + 8 * (i / 2) + 2 * (lane % 4);
    return sw128_offset(row, q, Tr::BN * 128);
}

// This warp's 16 x BM tile of P^T or dS^T (keys key_row.., the step's queries) as 16-bit pairs
// into its buffer.
template <typename Tr>
__device__ __forceinline__ void store_frags_t(unsigned char* tile, const unsigned (&frags16)[Tr::BM / 16][4],
                                              int key_row, int lane) {
#pragma unroll
    for (int kk = 0; kk < Tr::BM / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            *reinterpret_cast<unsigned*>(tile + t_frag_offset<Tr>(kk, i, key_row, lane)) = frags16[kk][i];
}

// Where a lane's dQ values go in a staging tile (stage_dq_block): the byte offsets of its row g
// (warp_row0 + lane / 4) for fragment j % 4 of a box (fragment j / 4 adds a box, row g + 8 adds 8
// rows), its row and whether it stores the swapped fragment (odd g). The same every step: made once
// before the key block's loop, they leave a step's stores waiting on their values only (made in the
// step, the address arithmetic ran behind the wait for the dQ product).
struct DqStageLanes {
    int offset[4];
    int row;
    bool odd_g;

    __device__ __forceinline__ static DqStageLanes of(int warp_row0, int lane) {
        DqStageLanes s;
        const int g = lane / 4, half = (lane / 2) % 2;
        s.row = warp_row0 + g;
        s.odd_g = g & 1;
#pragma unroll
        for (int m = 0; m < 4; ++m) {   // n % 4 = m, or m ^ 2 for odd g; 16-byte chunk (col / 4) ^ (row % 8)
            const int n = s.odd_g ? m ^ 2 : m;
            s.offset[m] = s.row * 128 + ((2 * n + half) ^ g) * 16 + (lane % 2) * 8;
        }
        return s;
    }
};

// scale * this warp's 16 x 64 block of dQ (the wgmma accumulator: rows g, g + 8 from the lanes'
// warp_row0, columns 8n + 2t, + 1) into its warpgroup's staging tile: two boxes of 32 fp32 columns x 64
// rows, 128-byte swizzled as the copy engine reads them (16-byte chunk c of row r at c ^ (r % 8)).
// An 8-byte store is served a half-warp (rows g = 0-3 or 4-7) at a time; in the accumulator's
// order rows g and g ^ 1 would hit the same two chunks (two wavefronts a half-warp, which ncu
// counts as 34 M conflicts). So lanes of odd g store fragment n ^ 2 while the others store n:
// the half-warp's four rows then cover the row's four chunk pairs (n % 4) ^ 2 (g & 1) ^ (g >> 1)
// once each, one wavefront a half. BOUNDED (packed sequences): rows from `rows` on are then
// overwritten with 0 (the next sequence's rows, which the addition reaches: dS is 0 there, but 0 x an
// infinite K is NaN), by the lanes that stored them, only in a block that has such rows (a sequence's
// last query block): every step's stores stay straight-line code the scheduler can place early.
template <bool BOUNDED = false>
__device__ __forceinline__ void stage_dq_block(unsigned char* stage, const DqStageLanes& lanes, const float (&dq)[8][4],
                                               float scale, int rows = 64) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float v0 = lanes.odd_g ? dq[j ^ 2][2 * r] : dq[j][2 * r];   // (j ^ 2 stays in j's box of four)
            const float v1 = lanes.odd_g ? dq[j ^ 2][2 * r + 1] : dq[j][2 * r + 1];
            unsigned char* at = stage + (j / 4) * 64 * 128 + r * 8 * 128 + lanes.offset[j % 4];
            *reinterpret_cast<float2*>(at) = make_float2(v0 * scale, v1 * scale);
        }
    if (BOUNDED && rows < 64) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                unsigned char* at = stage + (j / 4) * 64 * 128 + r * 8 * 128 + lanes.offset[j % 4];
                if (lanes.row + 8 * r >= rows) *reinterpret_cast<float2*>(at) = make_float2(0.0f, 0.0f);
            }
    }
}

// dK = scale * acc_dk and dV = acc_dv of this warp's 16 keys (key_row.. within the block) and
// the warpgroup's columns col0..; keys past lk, columns past d / dv are not written.
template <typename T, int COLS>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, const KeyBlock& blk, const float (&acc_dk)[COLS / 8][4],
                                            const float (&acc_dv)[COLS / 8][4], int key_row, int col0, float scale,
                                            int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key_row + lane / 4 + 8 * r;
        if (key >= blk.keys) continue;
        T* dk_row = p.dk.at<T>(blk.batch, blk.kv_head, blk.n0 + key);
        T* dv_row = p.dv.at<T>(blk.batch, blk.kv_head, blk.n0 + key);
#pragma unroll
        for (int n = 0; n < COLS / 8; ++n) {
            const int col = col0 + frag_col(lane, n, 0);
            if (col < p.dims.d)
                *reinterpret_cast<unsigned*>(dk_row + col) = pack2<T>(acc_dk[n][2 * r] * scale,
                                                                      acc_dk[n][2 * r + 1] * scale);
            if (col < p.dims.dv)
                *reinterpret_cast<unsigned*>(dv_row + col) = pack2<T>(acc_dv[n][2 * r], acc_dv[n][2 * r + 1]);
        }
    }
}

// EXTRA: the score policy on this warp's S^T (keys n0 + key_row.., queries m0..; rows are keys, so
// the coordinates are transposed against the forward's): x = s scale + bias log2 e with the bias read
// transposed from the stage's [query][key] tile, masked -inf where allowed() says no in a partial
// tile (the portable kernel's tests, flash_bwd_mma.cu), and dropout's keep bits, returned.
template <typename T, typename Tr, typename Mod>
__device__ __forceinline__ unsigned score_mod_t(float (&st)[Tr::BM / 8][4], const Mod& mod, unsigned bias_tile,
                                                          int m0, int n0, int key_row, int lane) {
    constexpr int BM = Tr::BM;
    const int kind = mod.classify(m0, BM, n0 + key_row, 16);
    if (mod.has_bias()) scale_add_bias_frags_sw_t<T, BM, Tr::BN>(st, bias_tile, key_row, lane, mod.scale_log2);
    auto coord = [=](int n, int i, int& row, int& col) {
        row = m0 + frag_col(lane, n, i);
        col = n0 + key_row + frag_row(lane, i);
    };
    // the per-element tests in a loop (registers); the band's alone in a TILE_BAND tile
    apply_score_mod_bits(st, mod, kind != TILE_FULL, coord, false, kind == TILE_BAND);
    return mod.has_dropout() ? dropout_frag_bits_t<BM / 8>(mod, m0, n0 + key_row, lane) : 0u;
}

// Head dims 64 and 128: consumer warpgroup c owns keys [64 c, 64 c + 64) of the block and all
// head-dim columns (the file's head). `at`: the block's rows in the maps (TmaRows, scheduler.cuh).
// PACKED: the tiles the copy engine loaded past the sequence's end hold the next sequence's rows (it
// fills zeros past the packed tensor only): K and V's rows past the block's keys, and a step's Q and dO
// rows past the sequence's queries, are zeroed before any product reads them. Such rows then give
// scores 0, P = 0 (their lse is +inf: load_row_stats) and dS = 0, as the zero-filled rows of a dense
// call do; the sequence's own values, finite or not, never meet the neighbour's.
template <typename T, typename Tr, bool PACKED, typename Mod>
__device__ __forceinline__ void consume_key_halves(const BwdParams& p, const BwdTensorMaps& maps,
                                                   const BwdWgmmaSmem<Tr>& sm, const float* stats0, const KeyBlock& blk,
                                                   Mod& mod, const KeyBlockSteps<Tr::BM>& steps, const TmaRows& at,
                                                   int lane, int consumer, int cwarp) {
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, STAGES = Tr::STAGES;
    const bool wg_leader = threadIdx.x % 128 == 0;            // issues the warpgroup's dQ additions
    const int key_row = 64 * consumer + 16 * cwarp;           // this warp's first key within the block
    const float x_per_s = mod.x_per_score(), scale = float(p.scale);
    const unsigned k_wg = sm.k + consumer * 64 * 128;         // this warpgroup's 64 keys of every K slab
    const unsigned v_wg = sm.v + consumer * 64 * 128;
    // dQ: this warpgroup's 64 x 64 block of dS (BM x BN) K (BN x HEAD), as slab offsets; DQ_SPLIT_KEYS:
    // the product over its own keys only (16-key steps kk0..).
    const int dq_row0 = Tr::DQ_SPLIT_ROWS ? 64 * consumer : 0;
    const int dq_col0 = Tr::DQ_SPLIT_ROWS || Tr::DQ_SPLIT_KEYS ? 0 : 64 * consumer;
    constexpr int DQ_K_STEPS = Tr::DQ_SPLIT_KEYS ? 64 / 16 : BN / 16;
    const int kk0 = Tr::DQ_SPLIT_KEYS ? 4 * consumer : 0;
    const DqStageLanes dq_lanes = DqStageLanes::of(16 * cwarp, lane);

    float acc_dk[HEAD / 8][4], acc_dv[HEAD / 8][4];   // rows: this warp's 16 keys
    zero_frags(acc_dk);
    zero_frags(acc_dv);
    // ADDS_DBIAS: dS^T into the key-major accumulator per step (dbias_tiles), or for a one-row bias summed
    // over the queries of one head's steps first (dbias_rows, of head rows_head).
    const bool dbias_on = Tr::ADDS_DBIAS && p.dbias.mode == DBIAS_KEY_MAJOR;
    const bool dbias_rows = dbias_on && p.dbias.rows_broadcast, dbias_tiles = dbias_on && !dbias_rows;
    DbiasRowSums row_sums;
    row_sums.zero();
    int rows_head = steps.first_head;
    const int ctid = int(threadIdx.x) - 128;   // this thread among the consumers
    if (steps.count > 0) mbar_wait(sm.kv_full(), 0);
    if (PACKED && steps.count > 0 && blk.keys < BN) {
        zero_tile_rows<BN, Tr::SLABS, Tr::CONSUMER_THREADS>(sm.at(sm.k), blk.keys, ctid);
        zero_tile_rows<BN, Tr::SLABS, Tr::CONSUMER_THREADS>(sm.at(sm.v), blk.keys, ctid);
        fence_proxy_async_smem();   // the stores, before the wgmmas (async proxy) read them
        named_bar_sync(BAR_ZEROED, Tr::CONSUMER_THREADS);
    }
    int formed = 0;   // EXTRA: steps not hidden so far (both warpgroups agree: a CTA-wide classify)
    for (int t = 0, head = steps.first_head, block = 0; t < steps.count; ++t, steps.advance(head, block)) {
        const int stage = t % STAGES, m0 = steps.m0(block);
        const unsigned q_tile = sm.q_tile(stage), do_tile = sm.do_tile(stage);
        mod.head = head;
        mbar_wait(sm.full(stage), (t / STAGES) & 1);
        if (PACKED && m0 + BM > mod.lq) {
            zero_tile_rows<BM, Tr::SLABS, Tr::CONSUMER_THREADS>(sm.at(q_tile), mod.lq - m0, ctid);
            zero_tile_rows<BM, Tr::SLABS, Tr::CONSUMER_THREADS>(sm.at(do_tile), mod.lq - m0, ctid);
            fence_proxy_async_smem();
            named_bar_sync(BAR_ZEROED, Tr::CONSUMER_THREADS);
        }
        if constexpr (Tr::EXTRA_OPTIONS) {
            if (steps.hidden(mod, blk, m0)) {   // nothing to form: the stage goes straight back
                mbar_arrive(sm.empty(stage));
                continue;
            }
        }
        // The dS^T buffer and the dQ staging alternate over the steps formed: between two uses of a
        // buffer both warpgroups pass the next formed step's DS_T barrier (a hidden step has none).
        const int u = Tr::EXTRA_OPTIONS ? formed++ : t;
        DbiasKeyMajorStep dbias_step = {nullptr, 0};
        if constexpr (Tr::ADDS_DBIAS) {
            if (dbias_rows && head != rows_head) {   // the sums so far belong to the previous head's row
                row_sums.flush(p.dbias, blk.batch, rows_head, blk.n0 + key_row, p.dims.lk, lane);
                rows_head = head;
            }
            if (dbias_tiles)
                dbias_step = DbiasKeyMajorStep::of(p.dbias, blk.batch, head, m0, p.dims.lq,
                                                   blk.n0 + key_row + QueryQuad::key(lane), p.dims.lk, lane);
        }

        // S^T = K_c Q^T and dP^T = V_c dO^T: this warp's 16 keys x BM queries each.
        float st[BM / 8][4], dpt[BM / 8][4];
        unsigned lin_a[4];   // LINEAR_BIAS: this lane's keys of the extra step, c (key - m0 - BM / 2), slope -c
        if constexpr (LINEAR_BIAS) {
            const float c = cuf_linear_slope<float>(head, mod.m.mod_args) / mod.scale_log2;
            const int from_m0 = blk.n0 + key_row + lane / 4 - m0 - BM / 2;
            LinearBiasSlope::of(-c).frag(lin_a, c * float(from_m0), c * float(from_m0 + 8), lane);
            fence_regs(lin_a);   // formed before the wgmma fence (else ptxas inserts one before the step: C7519)
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD / 16; ++kk)
            wgmma_ss<T, BM>(flat(st), k_major_desc(k_wg, kk, BN * 128), k_major_desc(q_tile, kk, BM * 128), kk > 0);
        if constexpr (LINEAR_BIAS) LinearBiasTable<BM>::add(flat(st), lin_a, sm.lin);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HEAD / 16; ++kk)
            wgmma_ss<T, BM>(flat(dpt), k_major_desc(v_wg, kk, BN * 128), k_major_desc(do_tile, kk, BM * 128), kk > 0);
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs(flat(st));
        unsigned kept = 0;   // EXTRA with dropout: this thread's keep bits (drop_factor)
        if constexpr (Tr::EXTRA_OPTIONS) {
            kept = score_mod_t<T, Tr>(st, mod, sm.bias_tile(stage), m0, blk.n0, key_row, lane);
        } else if (mod.tile_is_partial(m0, BM, blk.n0 + key_row, 16)) {
            mask_partial_strip_t<BM>(st, mod, blk.n0 + key_row + lane / 4, m0 + 2 * (lane % 4));
        }
        wgmma_wait<0>();
        fence_regs(flat(dpt));

        // P^T and dS^T, packed to 16 bits as the A fragments of the next products (16 queries a k-step).
        const float* lse_s = stats0 + stage * 2 * BM;
        const float* dsum_s = lse_s + BM;
        unsigned pt16[BM / 16][4], dst16[BM / 16][4];
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {   // packed as formed: the fp32 tiles die 16 queries at a time
#pragma unroll
            for (int n = 2 * kk; n < 2 * kk + 2; ++n) {
                const FloatPair lse_log2 = load_pair(lse_s + frag_col(lane, n, 0));   // queries 2t, 2t + 1
                const FloatPair dsum = load_pair(dsum_s + frag_col(lane, n, 0));
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    mod.template prob_and_dscore_at<true, true>(st[n][i], dpt[n][i], lse_log2[i % 2], dsum[i % 2],
                                                                drop_factor(mod, kept, n, i), x_per_s,
                                                                m0 + frag_col(lane, n, i),
                                                                blk.n0 + key_row + frag_row(lane, i));
                if constexpr (Tr::ADDS_DBIAS) {   // dbias += dS, fp32, before dS^T is packed to 16 bits
                    if (dbias_tiles) dbias_step.add(dpt[n], n, lane);
                    else if (dbias_rows) row_sums.add(dpt[n]);
                }
            }
            pack_a_frag<T, BM>(pt16[kk], st, 16 * kk);
            pack_a_frag<T, BM>(dst16[kk], dpt, 16 * kk);
        }
        // dV_c += P^T dO, dK_c += dS^T Q (in flight while dS^T goes to shared memory).
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<T, HEAD>(flat(acc_dv), pt16[kk], mn_major_desc(do_tile, kk, BM));
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<T, HEAD>(flat(acc_dk), dst16[kk], mn_major_desc(q_tile, kk, BM));
        wgmma_commit();

        const unsigned ds_tile = sm.ds_tile(u & 1);
        store_frags_t<Tr>(sm.at(ds_tile), dst16, key_row, lane);
        fence_proxy_async_smem();          // the stores, before the wgmmas (async proxy) read them
        // The previous step's dQ addition has read the staging tile (the barrier tells the warpgroup).
        if (wg_leader && u > 0) bulk_wait_read<0>();
        named_bar_sync(BAR_DS_T, Tr::CONSUMER_THREADS);   // both halves of dS^T are in place

        // dQ block = dS K: A = dS^T read transposed (rows: queries dq_row0.., k: the block's keys),
        // B = K read transposed (k: keys, n: head-dim columns dq_col0..).
        float dq[64 / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DQ_K_STEPS; ++kk)
            wgmma_ss_mn<T, 64>(flat(dq), mn_major_desc(ds_tile + (dq_row0 / 64) * BN * 128, kk0 + kk, BN),
                               mn_major_desc(sm.k + (dq_col0 / 64) * BN * 128, kk0 + kk, BN), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(flat(acc_dv));
        fence_regs(flat(acc_dk));
        fence_regs(flat(dq));
        fence_regs(pt16);
        fence_regs(dst16);
        mbar_arrive(sm.empty(stage));      // Q, dO and the statistics of this stage are read

        // dQ += scale dS K: the block goes through shared memory, and one thread of the warpgroup has
        // the copy engine add it to the accumulator (rows past lq, columns past d are dropped there).
        const unsigned dq_stage = sm.dq_stage(consumer);
        stage_dq_block<PACKED>(sm.at(dq_stage), dq_lanes, dq, scale, mod.lq - m0 - dq_row0);
        fence_proxy_async_smem();
        named_bar_sync(BAR_DQ_STAGED + consumer, 128);
        if (wg_leader) {
#pragma unroll
            for (int box = 0; box < 2; ++box)
                tma_reduce_add_4d(&maps.dq, dq_stage + box * Tr::DQ_BOX_BYTES, dq_col0 + 32 * box, at.q0 + m0 + dq_row0,
                                  head, at.batch);
            bulk_commit();
        }
    }
    if (wg_leader) bulk_wait<0>();   // the last additions have landed (and read the staging tile)
    if constexpr (Tr::ADDS_DBIAS) {
        if (dbias_rows) row_sums.flush(p.dbias, blk.batch, rows_head, blk.n0 + key_row, p.dims.lk, lane);
    }

    // dK = scale * sum dS^T Q, dV = sum P^T dO; rows are keys.
    store_dk_dv<T, HEAD>(p, blk, acc_dk, acc_dv, key_row, 0, scale, lane);
}

// SPLIT_HEAD's warpgroup 1: dS^T = P^T (dP^T - Dsum) for this warp's 16 keys x BM queries, with
// P^T as warpgroup 0 stored it (16-bit pairs, store_frags_t) and dP^T in registers; dS^T goes
// into its buffer as 16-bit pairs at the same offsets. dS takes P rounded to 16 bits (as a
// framework's naive backward does, which rounds every n x n intermediate).
template <typename T, typename Tr>
__device__ __forceinline__ void form_ds_t(const unsigned char* pt_tile, unsigned char* ds_tile,
                                          const float (&dpt)[Tr::BM / 8][4], const float* dsum_s, int key_row,
                                          int lane) {
#pragma unroll
    for (int n = 0; n < Tr::BM / 8; ++n) {
        const FloatPair dsum = load_pair(dsum_s + frag_col(lane, n, 0));   // queries 2t, 2t + 1
#pragma unroll
        for (int r = 0; r < 2; ++r) {   // rows g, g + 8: word 2 (n % 2) + r of A fragment n / 2 (pack_a_frag)
            const int at = t_frag_offset<Tr>(n / 2, 2 * (n % 2) + r, key_row, lane);
            const unsigned pt = *reinterpret_cast<const unsigned*>(pt_tile + at);
            *reinterpret_cast<unsigned*>(ds_tile + at) =
                pack2<T>(dscore_of_prob(unpack_half<T>(pt, 0), dpt[n][2 * r], dsum[0]),
                         dscore_of_prob(unpack_half<T>(pt, 1), dpt[n][2 * r + 1], dsum[1]));
        }
    }
}

// Head dim 256 (SPLIT_HEAD): both consumer warpgroups own the block's 64 keys; warpgroup c forms
// columns [128 c, 128 c + 128) of dK, dV and dQ, warpgroup 0 P^T and warpgroup 1 dS^T (the file's
// head).
template <typename T, typename Tr, typename Mod>
__device__ __forceinline__ void consume_head_halves(const BwdParams& p, const BwdTensorMaps& maps,
                                                    const BwdWgmmaSmem<Tr>& sm, const float* stats0, const KeyBlock& blk,
                                                    Mod& mod, const KeyBlockSteps<Tr::BM>& steps, int lane, int consumer,
                                                    int cwarp) {
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, STAGES = Tr::STAGES, COLS = Tr::WG_COLS;
    constexpr int SLAB_BYTES = BM * 128;                      // one 64-column slab of a Q or dO stage
    const bool forms_p = consumer == 0;                       // else it forms dS^T
    const bool wg_leader = threadIdx.x % 128 == 0;            // issues the warpgroup's dQ additions
    const int key_row = 16 * cwarp;                           // this warp's first key within the block
    const int slab0 = consumer * COLS / 64;                   // the warpgroup's first 64-column slab (of 4)
    const float x_per_s = mod.x_per_score(), scale = float(p.scale);
    const DqStageLanes dq_lanes = DqStageLanes::of(16 * cwarp, lane);

    float acc_dk[COLS / 8][4], acc_dv[COLS / 8][4];   // rows: this warp's 16 keys; columns 64 slab0..
    zero_frags(acc_dk);
    zero_frags(acc_dv);
    if (steps.count > 0) mbar_wait(sm.kv_full(), 0);
    for (int t = 0, head = steps.first_head, block = 0; t < steps.count; ++t, steps.advance(head, block)) {
        const int stage = t % STAGES, m0 = steps.m0(block);
        const unsigned q_tile = sm.q_tile(stage), do_tile = sm.do_tile(stage);
        const unsigned pt_tile = sm.pt_tile(t & 1), ds_tile = sm.ds_tile(t & 1);
        const float* lse_s = stats0 + stage * 2 * BM;
        const float* dsum_s = lse_s + BM;
        mod.head = head;
        mbar_wait(sm.full(stage), (t / STAGES) & 1);

        // Warpgroup 0: S^T = K Q^T; warpgroup 1: dP^T = V dO^T (this warp's 16 keys x BM queries).
        float xt[BM / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD / 16; ++kk)
            wgmma_ss<T, BM>(flat(xt), k_major_desc(forms_p ? sm.k : sm.v, kk, BN * 128),
                            k_major_desc(forms_p ? q_tile : do_tile, kk, BM * 128), kk > 0);
        wgmma_commit();
        // The previous step's dQ additions have read their staging (this warpgroup's slabs of that
        // step's Q and dO): with the leader's arrival, the last of the 256, the stage may be refilled.
        if (wg_leader && t > 0) {
            bulk_wait_read<0>();
            mbar_arrive(sm.empty((t - 1) % STAGES));
        }
        wgmma_wait<0>();
        fence_regs(flat(xt));

        if (forms_p) {
            // P^T = 2^(S^T x - lse), packed to 16 bits 16 queries at a time, into the P^T buffer.
            if (mod.tile_is_partial(m0, BM, blk.n0 + key_row, 16))
                mask_partial_strip_t<BM>(xt, mod, blk.n0 + key_row + lane / 4, m0 + 2 * (lane % 4));
            unsigned pt16[BM / 16][4];
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
                for (int n = 2 * kk; n < 2 * kk + 2; ++n) {
                    const FloatPair lse_log2 = load_pair(lse_s + frag_col(lane, n, 0));   // queries 2t, 2t + 1
#pragma unroll
                    for (int i = 0; i < 4; ++i) xt[n][i] = prob_of_score(xt[n][i], lse_log2[i % 2], x_per_s);
                }
                pack_a_frag<T, BM>(pt16[kk], xt, 16 * kk);
            }
            store_frags_t<Tr>(sm.at(pt_tile), pt16, key_row, lane);
            fence_proxy_async_smem();      // the stores, before the wgmmas (async proxy) read them
        }
        named_bar_sync(BAR_P_T, Tr::CONSUMER_THREADS);   // P^T is in place

        // dV_c += P^T dO_c: A = P^T (keys x queries, K-major), B = dO's columns 64 slab0.. read transposed.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            wgmma_ss_bmn<T, COLS>(flat(acc_dv), k_major_desc(pt_tile, kk, BN * 128),
                                  mn_major_desc(do_tile + slab0 * SLAB_BYTES, kk, BM), 1);
        wgmma_commit();

        if (!forms_p) {
            form_ds_t<T, Tr>(sm.at(pt_tile), sm.at(ds_tile), xt, dsum_s, key_row, lane);
            fence_proxy_async_smem();
        }
        named_bar_sync(BAR_DS_T, Tr::CONSUMER_THREADS);   // dS^T is in place

        // dK_c += dS^T Q_c as dV_c above; dQ_c = dS K_c in two 64-column products: A = dS^T read
        // transposed (rows: queries, k: keys), B = K read transposed (k: keys, n: columns).
        float dq[2][64 / 8][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            wgmma_ss_bmn<T, COLS>(flat(acc_dk), k_major_desc(ds_tile, kk, BN * 128),
                                  mn_major_desc(q_tile + slab0 * SLAB_BYTES, kk, BM), 1);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_ss_mn<T, 64>(flat(dq[j]), mn_major_desc(ds_tile, kk, BN),
                                   mn_major_desc(sm.k + (slab0 + j) * BN * 128, kk, BN), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(flat(acc_dv));
        fence_regs(flat(acc_dk));
        fence_regs(flat(dq));

        // dQ += scale dS K: product j goes, as two 32-column boxes, into this warpgroup's slabs
        // slab0, slab0 + 1 of Q (j = 0) or dO (j = 1), which nothing reads any more this step.
        const unsigned staging[2] = {q_tile + slab0 * SLAB_BYTES, do_tile + slab0 * SLAB_BYTES};
#pragma unroll
        for (int j = 0; j < 2; ++j) stage_dq_block(sm.at(staging[j]), dq_lanes, dq[j], scale);
        fence_proxy_async_smem();
        named_bar_sync(BAR_DQ_STAGED + consumer, 128);
        if (wg_leader) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int box = 0; box < 2; ++box)
                    tma_reduce_add_4d(&maps.dq, staging[j] + box * Tr::DQ_BOX_BYTES, 64 * (slab0 + j) + 32 * box, m0,
                                      head, blk.batch);
            bulk_commit();
        } else {
            mbar_arrive(sm.empty(stage));  // this thread is done with the stage (the leader, next step)
        }
    }
    if (wg_leader) bulk_wait<0>();   // the last additions have landed (and read the staging)

    // dK = scale * sum dS^T Q, dV = sum P^T dO; rows are keys, columns the warpgroup's.
    store_dk_dv<T, COLS>(p, blk, acc_dk, acc_dv, key_row, 64 * slab0, scale, lane);
}

// Grid: ceil(Lk / BN) x Hk x B CTAs (KeyBlock), key block 0 (the most causal work) first.
// The host checked what the tensor maps need: 16-byte aligned bases and strides (cuflash/_runtime/tma.py).
// DBIAS: the consumers add dS into dbias (the file's head).
// PACKED: the key blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), a key-major
// table's entries x Hk CTAs, head dims 64 and 128 without EXTRA: each with its sequence's own counts, its
// maps' rows counted from the packed tensors' first (TmaRows), the rows past the sequence zeroed
// (consume_key_halves).
template <typename T, typename Cfg, typename Flags, bool DBIAS, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
flash_bwd_dkdv_wgmma(const __grid_constant__ BwdParams p, const __grid_constant__ BwdTensorMaps maps) {
    typedef DkdvWgmmaTraits<T, Cfg, Flags::EXTRA, DBIAS> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, STAGES = Tr::STAGES;
    static_assert(!PACKED || (!Flags::EXTRA && !Tr::SPLIT_HEAD), "packed sequences: head dims 64 and 128, no EXTRA");
    static_assert(!LINEAR_BIAS || !PACKED, "the linear bias: dense calls");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned base = smem_addr(smem_raw);
    const unsigned tiles = align_1024(base);
    BwdWgmmaSmem<Tr> sm;
    sm.raw = smem_raw;
    sm.base = base;
    sm.k = tiles;
    sm.v = sm.k + Tr::KV_BYTES;
    sm.q = sm.v + Tr::KV_BYTES;
    sm.dout = sm.q + STAGES * Tr::Q_BYTES;
    sm.ds = sm.dout + STAGES * Tr::Q_BYTES;
    sm.pt = sm.ds + 2 * Tr::DS_BYTES;
    sm.dq = sm.pt + 2 * Tr::PT_BYTES;
    sm.bias = sm.dq + Tr::DQ_STAGE_BYTES;
    sm.lin = sm.bias + STAGES * Tr::BIAS_BYTES;
    sm.stats = sm.lin + Tr::LIN_BYTES;
    sm.bars = sm.stats + STAGES * Tr::STATS_BYTES;
    float* stats0 = reinterpret_cast<float*>(sm.at(sm.stats));

    const AttnDims& dims = p.dims;
    // PACKED: the CTA's table entry and K/V head
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q / dims.group) : PackedBlock{};
    const KeyBlock blk = PACKED ? seq.key_block(dims, BN)
                                : KeyBlock::from_grid<BN>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask, DBIAS));
    const TmaRows at = PACKED ? TmaRows::packed(seq) : TmaRows::dense(blk.batch);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warpgroup = warp / 4;
    typedef ScoreMod<Flags, float, T, PACKED> Mod;   // PACKED: the sequence's own counts (PER_SEQ)
    Mod mod = [&]() {
        const float scale_log2 = acc_param<float>(p.scale_log2, p.scale_log2_f);
        if constexpr (PACKED) return Mod(p.mask, seq, scale_log2, blk.first_head);
        else return Mod(p.mask, dims, scale_log2, blk.batch, blk.first_head);
    }();
    const KeyBlockSteps<BM> steps(mod, blk);

    if (threadIdx.x == 0) {
        mbar_init(sm.kv_full(), 1);
        for (int s = 0; s < STAGES; ++s) {
            // lane 0's expect_tx and the 32 lanes' statistics (with EXTRA warp 1's), and with a bias the
            // loaders' copies
            mbar_init(sm.full(s), 1 + 32 + (Flags::EXTRA && mod.has_bias() ? Tr::BIAS_LOADERS : 0));
            mbar_init(sm.empty(s), Tr::CONSUMER_THREADS);
        }
        mbar_init_fence();
    }
    if constexpr (LINEAR_BIAS) {   // the linear bias's table, for every step's wgmmas (async proxy)
        LinearBiasTable<BM>::template write<Tr::THREADS>(sm.at(sm.lin), threadIdx.x);
        fence_proxy_async_smem();
    }
    __syncthreads();   // the last CTA-wide barrier: from here on, the mbarriers order everything

    if (warpgroup == 0) {
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        if constexpr (Flags::EXTRA) {   // warp 0 the copy engine, warp 1 the statistics, warps 2 and 3 the bias
            const int loader = int(threadIdx.x) - Tr::FIRST_BIAS_LOADER;
            if (warp == 0 && steps.count > 0) produce_steps<Tr, false>(sm, stats0, maps, p, blk, steps, at, dims.lq);
            else if (warp == 1) produce_stats(sm, stats0, p, blk, steps, lane);
            else if (loader >= 0 && loader < Tr::BIAS_LOADERS && mod.has_bias())
                produce_bias_steps<T>(sm, p.mask.bias, blk, steps, dims.lq, dims.lk, loader);
        } else if (warp == 0 && steps.count > 0) {
            produce_steps<Tr, true, PACKED>(sm, stats0, maps, p, blk, steps, at, mod.lq);
        }
        return;
    }
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const int consumer = warpgroup - 1, cwarp = warp % 4;   // consumer warpgroup, warp within it
    if constexpr (Tr::SPLIT_HEAD) consume_head_halves<T>(p, maps, sm, stats0, blk, mod, steps, lane, consumer, cwarp);
    else consume_key_halves<T, Tr, PACKED>(p, maps, sm, stats0, blk, mod, steps, at, lane, consumer, cwarp);
}
