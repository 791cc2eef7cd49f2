// flash_fwd_wgmma.cu -- forward attention on Hopper's warpgroup MMA (sm_90a), float16 / bfloat16.
//
// Warp-specialised: three warpgroups of 4 warps. Warpgroup 0 is the producer: one of its
// threads streams Q once and K, V tile by tile through the bulk tensor copy engine (tma.cuh)
// into a two-stage ring of 128-byte swizzled tiles, and gives most of its registers to the
// others (setmaxnreg). Warpgroups 1.. (two, or three at head dim 64) are the consumers, 64 query
// rows each, a warp 16:
//   wait for Q
//   for each visible K tile j:
//       S = Q K_j^T          wgmma, both operands from shared memory (HEAD / 16 k-steps)
//       O += P_prev V_prev   wgmma with P from registers (packed from S, no shared
//                            memory) and V read transposed; in flight during:
//       masking, online softmax of S: score_mod.cuh and warp_softmax_step, unchanged --
//                            the wgmma accumulator of a warp is the m16n8 C fragment
//                            layout of mma.sync, so every per-element helper applies;
//                            acc_o's correction waits for the P V product
//   O += P_last V_last; O = O / l; lse = (m + log2 l) ln 2
// Every stage has a "full" mbarrier (the copy engine's bytes) and an "empty" one (each
// consumer thread arrives once its wgmmas have read the stage); no CTA-wide barrier after
// the start, so the two consumer warpgroups drift freely against each other. With PINGPONG
// they take turns on the tensor cores through two named barriers (one warpgroup's GEMMs
// issued while the other runs its softmax); on the H100 that runs at 0.90-1.01x of the
// free-running order (benchmarks/tune_fwd.py), so it is off.
// SCHEDULE (scheduler.cuh): a CTA a block, or a persistent grid walking blocks in turn.
// EXTRA (bias, boolean mask, dropout, block layout; score_mod.cuh): the producer and the
// consumers walk the same visible tiles (next_key_tile skips what a layout turns off).
// A bias, whose broadcast axes (stride 0) no tensor map can describe, is copied by two
// more producer warps with cp.async into a bias stage beside each K/V stage (tile_io.cuh's
// swizzled layout) and read by the consumers with ldmatrix straight into S's fragments,
// as the portable kernel does (there 2.2x over element loads, benchmarks/bench_masking.py); its
// stages have full / empty mbarriers of their own. The mask (partial tiles only) and
// dropout (Philox keyed by (seed, batch, head, row, col), so the same keep-mask as the
// portable kernel's) are per-element work in the consumers, as there.
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
#include "epilogue.cuh"
#include "linear_bias.cuh"

template <typename T, typename Cfg, bool EXTRA, int SCHEDULE>
struct FwdWgmmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS, STAGES = Cfg::STAGES;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int CONSUMERS = WARPS / 4 - 1;             // warpgroups 1.. compute, 0 loads
    static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
    static constexpr int S_TILES = BN / 8;          // n8 C fragments of one warp's S
    static constexpr int O_TILES = HEAD / 8;        // n8 C fragments of one warp's O
    static constexpr int SLABS = HEAD / 64;         // 64-column swizzle slabs of a row
    static constexpr int Q_BYTES = BM * HEAD * int(sizeof(T));
    static constexpr int KV_BYTES = BN * HEAD * int(sizeof(T));   // one K or V stage
    // EXTRA: a BM x BN bias tile a stage, swizzled rather than padded (tile_io.cuh,
    // sw_chunk_offset; padded, head dim 128's two stages would exceed 227 KB), copied by
    // BIAS_LOADERS producer threads: warps 1 and 2 (warp 0's first thread drives the copy
    // engine). A tile is 1024-3072 16-byte chunks, 16-48 cp.async a loader: a few hundred
    // instructions against the thousands of cycles the consumers spend on a tile.
    static constexpr int BIAS_BYTES = EXTRA ? BM * BN * int(sizeof(T)) : 0;
    static constexpr int BIAS_LOADERS = 64, FIRST_BIAS_LOADER = 32;
    // Barriers after the tiles: Q full, Q empty, then K full / K empty / V full / V empty per
    // stage, then (EXTRA) bias full / bias empty per stage.
    static constexpr int BARRIERS = 2 + 4 * STAGES + (EXTRA ? 2 * STAGES : 0);
    // LINEAR_BIAS: the B table of the linear bias's k16 step (linear_bias.cuh), after the bias stages.
    static constexpr int LIN_BYTES = LinearBiasTable<BN>::BYTES;
    static_assert(!LINEAR_BIAS || (!EXTRA && HEAD <= 128), "the linear bias: plain variants at head dims 64, 128");
    static constexpr int TILE_BYTES = Q_BYTES + 2 * STAGES * KV_BYTES + STAGES * BIAS_BYTES + LIN_BYTES;
    // O through shared memory and a bulk tensor store (the epilogue): at head dim 128 1.03-1.13x
    // over element-wise stores; at head dim 64 1.03-1.10x at L = 1024 but 0.86-0.93x at L = 4096
    // non-causal, so 64 keeps the element-wise stores (benchmarks/tune_fwd.py). Head dim 256 (twice
    // 128's bytes a row) stores as 128 does.
    // (The host encodes the O tensor map only then: cuflash/_dispatch/plan.py, TMA_STORE_O_HEAD.)
    static constexpr bool TMA_STORE_O = HEAD >= 128;
    // PERSISTENT (SCHEDULE_STRIDE or SCHEDULE_QUEUE): a CTA owns several query blocks in turn, the
    // next block's Q and first K/V tile landing while this one's last P V and epilogue run. The
    // schedule is the variant table's. A walk needs one CTA an SM (the short tile's two CTAs an SM
    // hide each other's starts already), no EXTRA and head dim <= 128: at head dim 256 (acc_o of 128
    // registers) and with the EXTRA code the loop over blocks spills 32-328 bytes (NVRTC 12.9).
    static constexpr bool PERSISTENT = SCHEDULE != SCHEDULE_ONE_A_BLOCK;
    static constexpr bool WALKABLE = Cfg::MIN_CTAS == 1 && !EXTRA && HEAD <= 128;
    static_assert(SCHEDULE == SCHEDULE_ONE_A_BLOCK || SCHEDULE == SCHEDULE_STRIDE || SCHEDULE == SCHEDULE_QUEUE,
                  "a Schedule");
    static_assert(!PERSISTENT || WALKABLE, "a persistent schedule walks with one CTA an SM, no EXTRA, head dim <= 128");
    // SCHEDULE_ONE_A_BLOCK: the block loops end after their first pass, by a break, or where the
    // kernel could walk, by the block-index test, which a grid of one CTA a block fails at once: the
    // loop-free head-dim-64 band kernel spills 8 bytes (NVRTC 12.9), the looped one none.
    static constexpr bool ONE_PASS_BREAK = !PERSISTENT && !WALKABLE;
    // WALK_RING: a walking CTA's producer hands each block index to the consumers through
    // BlockWalk's ring (after the pipeline's barriers), so that the grid can take its blocks from
    // the host's queue. Two consumer warpgroups only: the producer beside three runs on 24-32
    // registers, and the ring spills 48-88 bytes there (NVRTC 12.9); those CTAs stride.
    static constexpr bool WALK_RING = PERSISTENT && CONSUMERS == 2;
    static_assert(SCHEDULE != SCHEDULE_QUEUE || WALK_RING, "SCHEDULE_QUEUE: the consumers learn each block from the ring");
    static constexpr int WALK_WORDS = WALK_RING ? BlockWalk<SCHEDULE>::RING_WORDS : 0;
    static constexpr int BARRIER_BYTES = 8 * (BARRIERS + WALK_WORDS);
    // A walking CTA stages O for its store in a tile of its own (head dim 128: 193 KB), so that the
    // next Q need not wait for the store; one that owns one block stages it in Q's tile.
    // SMEM_LIMIT: sm_90's opt-in shared memory a block (227 KB; cuflash/_dispatch/model.py SMEM_LIMITS).
    static constexpr int SMEM_LIMIT = 232448;
    static constexpr int O_BYTES =
        TMA_STORE_O && PERSISTENT && 1024 + TILE_BYTES + Q_BYTES + BARRIER_BYTES <= SMEM_LIMIT ? Q_BYTES : 0;
    static constexpr bool O_OWN_TILE = O_BYTES > 0;
    // Q is free for the next block once the last S = Q K^T has read it, unless O is staged there.
    // A walking CTA always frees it so; the "staged in Q" arrivals below (after the store's read)
    // come from CTAs that own one block, where no producer waits for them.
    static constexpr bool Q_FREE_AFTER_S = !TMA_STORE_O || O_OWN_TILE;
    static_assert(!PERSISTENT || Q_FREE_AFTER_S,
                  "a CTA that walks blocks frees Q after its last S = Q K^T: O is not staged in Q's tile");
    // 1024 bytes of slack: the swizzled tiles start at the first 1024-byte boundary.
    static constexpr int SMEM_BYTES = 1024 + TILE_BYTES + O_BYTES + BARRIER_BYTES;
    // Registers a thread after the split: two consumer warpgroups 128 x 40 + 256 x 232, three
    // 128 x 24 + 384 x 160; with EXTRA the producer's bias loaders walk the tiles too (classify)
    // and need 32 beside three consumer warpgroups, which fills the register file exactly.
    // setmaxnreg.inc waits for registers the others gave back: more than the launch's share
    // (65536 / THREADS, in steps of 8) deadlocks.
    // Short rows (Cfg::MIN_CTAS 2: two CTAs an SM, two consumer warpgroups, no EXTRA): each CTA
    // holds 384 x 80 registers from its launch; the producer keeps 24 and the consumers take 104
    // (128 x 24 + 256 x 104 <= 384 x 80), which 64-key tiles at head dim 64 fit (S 32, P 16,
    // acc_o 32). The second CTA hides each block's start (Q and the first tiles in flight with
    // nothing to overlap them) and its epilogue, which one CTA an SM leaves bare: ~16 K cycles a
    // block against ~2.5 K a key tile at L = 1024 (benchmarks/tune_short.py).
    static constexpr int LAUNCH_REGS = 65536 / (THREADS * Cfg::MIN_CTAS) / 8 * 8;
    // WALK_RING's producer keeps its ring's round and its blocks' bounds beside the tile loop: with 40
    // registers it spills 84-168 bytes; 56 leaves the consumers 224 (no spill).
    static constexpr int PRODUCER_REGS =
        Cfg::MIN_CTAS > 1 ? 24 : WALK_RING ? 56 : CONSUMERS == 2 ? 40 : EXTRA ? 32 : 24;
    static constexpr int CONSUMER_REGS = Cfg::MIN_CTAS > 1
        ? (THREADS * LAUNCH_REGS - 128 * PRODUCER_REGS) / CONSUMER_THREADS / 8 * 8
        : WALK_RING ? 224 : CONSUMERS == 2 ? 232 : 160;
    static_assert(Cfg::MIN_CTAS == 1 || (Cfg::MIN_CTAS == 2 && CONSUMERS == 2 && !EXTRA),
                  "two CTAs an SM: two consumer warpgroups, no EXTRA (more registers for its bias loaders)");
    static_assert(128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= THREADS * LAUNCH_REGS,
                  "the launch's register file");
    static constexpr bool PINGPONG = false;      // measured slower; see the file's head
    // O += P V of tile j in flight during S = Q K^T of tile j + 1 and its softmax (P of tile j, S of
    // tile j + 1 and acc_o live together: 80 registers of fragments at 64-key tiles, 128 at 128).
    // Two CTAs an SM have too few registers for that (104 a consumer thread: 16 bytes spill, and
    // ptxas then serialises every wgmma), and four consumer warpgroups an SM keep the tensor cores
    // busy without it: each tile's P V is issued after its softmax and waited for before the next S.
    static constexpr bool OVERLAP_PV = Cfg::MIN_CTAS == 1;
    static_assert(sizeof(T) == 2, "wgmma here takes 16-bit operands");
    static_assert(FIRST_BIAS_LOADER >= 32 && FIRST_BIAS_LOADER + BIAS_LOADERS <= 128,
                  "the bias loaders are producer warps other than the copy engine's");
    static_assert((CONSUMERS == 2 || CONSUMERS == 3) && BM == 64 * CONSUMERS,
                  "a producer and two or three consumer warpgroups of 64 rows");
    static_assert(!PINGPONG || (CONSUMERS == 2 && OVERLAP_PV), "the ping-pong turns are between two warpgroups");
    static_assert(HEAD % 64 == 0 && BN % 64 == 0 && BM <= 256 && BN <= 256, "whole swizzle slabs, TMA boxes");
    static_assert(STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Shared-memory addresses of the pipeline's tiles and barriers.
template <typename Tr>
struct WgmmaSmem {
    unsigned q, k, v, bias, o, bars, lin;
    __device__ __forceinline__ unsigned k_tile(int stage) const { return k + stage * Tr::KV_BYTES; }
    __device__ __forceinline__ unsigned v_tile(int stage) const { return v + stage * Tr::KV_BYTES; }
    __device__ __forceinline__ unsigned bias_tile(int stage) const { return bias + stage * Tr::BIAS_BYTES; }
    __device__ __forceinline__ unsigned q_full() const { return bars; }
    __device__ __forceinline__ unsigned q_empty() const { return bars + 8; }
    __device__ __forceinline__ unsigned k_full(int stage) const { return bars + 8 * (2 + 4 * stage); }
    __device__ __forceinline__ unsigned k_empty(int stage) const { return bars + 8 * (3 + 4 * stage); }
    __device__ __forceinline__ unsigned v_full(int stage) const { return bars + 8 * (4 + 4 * stage); }
    __device__ __forceinline__ unsigned v_empty(int stage) const { return bars + 8 * (5 + 4 * stage); }
    __device__ __forceinline__ unsigned bias_full(int stage) const { return bars + 8 * (2 + 4 * Tr::STAGES + 2 * stage); }
    __device__ __forceinline__ unsigned bias_empty(int stage) const { return bars + 8 * (3 + 4 * Tr::STAGES + 2 * stage); }
    // BlockWalk's ring (WALK_RING only).
    __device__ __forceinline__ unsigned walk_ring() const { return bars + 8 * Tr::BARRIERS; }
};

// The producer's one thread, for one query block: K_j and V_j of every visible tile into stage
// t % 2 (t counts the visible tiles of the CTA's blocks so far), each after the consumers have
// emptied that stage, and Q (`q_round`: the CTA's blocks with tiles before this one) after the
// first K tile: a later block's Q waits until the consumers are done with the previous one's
// (q_empty), while that K stage was freed a tile earlier. `first`: the first visible tile (< end;
// a block with none loads nothing, and its consumers wait for nothing). `at`: the block's rows in
// the maps' coordinates (TmaRows, scheduler.cuh).
template <typename Tr, typename Mod>
__device__ __forceinline__ void produce_tiles(const WgmmaSmem<Tr>& sm, const FwdTensorMaps& maps, const Mod& mod,
                                              const QueryBlock& blk, const TmaRows& at, int first, int end, int& t,
                                              int q_round) {
    constexpr int BN = Tr::BN;
    for (int j = first; j < end; j = mod.next_key_tile(j + 1, end, blk.m0, blk.rows, BN), ++t) {
        const int stage = t & 1;
        const unsigned empty_parity = ((t >> 1) & 1) ^ 1;   // the round before this one
        mbar_wait(sm.k_empty(stage), empty_parity);
        mbar_arrive_expect_tx(sm.k_full(stage), Tr::KV_BYTES);
        tma_load_tile<BN, Tr::SLABS>(sm.k_tile(stage), &maps.k, sm.k_full(stage), at.k0 + j * BN, blk.kv_head,
                                     at.batch);
        if (j == first) {
            if (q_round > 0) mbar_wait(sm.q_empty(), (q_round - 1) & 1);
            mbar_arrive_expect_tx(sm.q_full(), Tr::Q_BYTES);
            tma_load_tile<Tr::BM, Tr::SLABS>(sm.q, &maps.q, sm.q_full(), at.q0 + blk.m0, blk.head, at.batch);
        }
        mbar_wait(sm.v_empty(stage), empty_parity);
        mbar_arrive_expect_tx(sm.v_full(stage), Tr::KV_BYTES);
        tma_load_tile<BN, Tr::SLABS>(sm.v_tile(stage), &maps.v, sm.v_full(stage), at.k0 + j * BN, blk.kv_head,
                                     at.batch);
    }
}

// EXTRA with a bias: the bias loaders (`loader` of BIAS_LOADERS) copy the bias tile of the
// same visible tiles, rows [m0, m0 + BM) x keys [j BN, j BN + BN), into bias stage t % 2
// once the consumers have read that stage's previous tile; each loader's arrival on the
// stage's full barrier comes when its copies have landed. The host launches this kernel
// only for a bias whose rows are 16-byte chunks (cuflash/_dispatch/masking.py, bias_in_chunks):
// element-by-element copies by a few producer threads would be latency-bound, tens of
// times slower than the consumers.
template <typename T, typename Tr, typename Mod>
__device__ __forceinline__ void produce_bias_tiles(const WgmmaSmem<Tr>& sm, const ScoreTensor& bias, const Mod& mod,
                                                   const QueryBlock& blk, int first, int end, int lk, int loader,
                                                   int& t) {
    constexpr int BN = Tr::BN;
    const ScoreChunkCopy<T, Tr::BM, BN, Tr::BIAS_LOADERS> copy(bias, blk.batch, blk.head, blk.m0, loader);
#pragma unroll 1
    for (int j = first; j < end; j = mod.next_key_tile(j + 1, end, blk.m0, blk.rows, BN), ++t) {
        const int stage = t & 1;
        mbar_wait(sm.bias_empty(stage), ((t >> 1) & 1) ^ 1);   // the round before this one
        copy.copy(sm.bias_tile(stage), j * BN, blk.rows, lk - j * BN, bias.ptr);
        mbar_arrive_on_cp_async(sm.bias_full(stage));
    }
}

// Grid (SCHEDULE, scheduler.cuh): ceil(Lq / BM) x Hq x B CTAs, longest causal query blocks first
// (SCHEDULE_ONE_A_BLOCK), or one CTA an SM, each walking blocks in turn (BlockWalk). A CTA's producer
// and consumers walk the same blocks and tiles, so the stage ring and its parities simply run on
// across blocks.
// PACKED: the blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), entries x heads of
// them (MaskParams::packed_count), a CTA a block or walked as the dense ones are, without EXTRA: each with
// its sequence's own counts, its maps' rows counted from the packed tensor's first (TmaRows); O goes out by
// the copy engine only where all the block's rows are the sequence's (the maps clip at the packed tensor's
// end only).
// ACC_OUT: O in float32, the accumulator's type, stored element pair by pair (no tensor map): a partial
// result that is merged with others before any rounding to 16 bits (cuflash.distributed's ring steps).
// The host checked what the tensor maps need: 16-byte aligned bases and strides (cuflash/_runtime/tma.py).
template <typename T, typename Cfg, typename Flags, int SCHEDULE, bool PACKED = false, bool ACC_OUT = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_fwd_wgmma(const __grid_constant__ FwdParams p, const __grid_constant__ FwdTensorMaps maps) {
    typedef FwdWgmmaTraits<T, Cfg, Flags::EXTRA, SCHEDULE> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, STAGES = Tr::STAGES;
    // LINEAR_BIAS (linear_bias.cuh): the step's A is the block's, -c (row - w0) for the warp's rows. At head dim
    // 64 each tile's c (n0 + BN / 2 - w0) is the softmax's offset; past 64 (LIN_TILE_A) it rides in A's columns
    // 6-8, since the offset's registers, held through the key loop, spill 16-32 bytes in the band kernel at 128
    // (NVRTC 12.9). (An FFMA an element in place of the step measured within 2% of its time at both head dims,
    // benchmarks/NOTES.md, and spilled at 128 too.)
    constexpr bool LIN_TILE_A = LINEAR_BIAS && HEAD > 64;
    // LIN_FIRST (no OVERLAP_PV): the step is issued before K's tile is waited for (its product reads no tile
    // data) and S = Q K^T accumulates onto it; with OVERLAP_PV after Q K^T, so that the previous tile's P is
    // not waited for longer.
    constexpr bool LIN_FIRST = LINEAR_BIAS && !Tr::OVERLAP_PV;
    static_assert(!PACKED || !Flags::EXTRA, "packed sequences: without EXTRA");
    static_assert(!LINEAR_BIAS || (!PACKED && !ACC_OUT), "the linear bias: dense calls, O in its own type");
    static_assert(!(PACKED && ACC_OUT), "packed sequences store O in their own type");
    // O staged for the copy engine: 16-bit rows only (an ACC_OUT row goes out from the registers).
    constexpr bool STAGE_O = Tr::TMA_STORE_O && !ACC_OUT;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned base = smem_addr(smem_raw);
    const unsigned tiles = align_1024(base);
    const WgmmaSmem<Tr> sm{tiles, tiles + Tr::Q_BYTES, tiles + Tr::Q_BYTES + STAGES * Tr::KV_BYTES,
                           tiles + Tr::Q_BYTES + 2 * STAGES * Tr::KV_BYTES, tiles + Tr::TILE_BYTES,
                           tiles + Tr::TILE_BYTES + Tr::O_BYTES, tiles + Tr::TILE_BYTES - Tr::LIN_BYTES};

    const AttnDims& dims = p.dims;
    const int head_group = shared_scores_head_group<Flags::EXTRA>(p.mask);
    // PACKED: block idx's table entry, read where used (not held through the loops: the producer has 24-56
    // registers)
    auto seq = [&](int idx) { return PACKED ? PackedBlock::at(p.mask, idx, dims.heads_q) : PackedBlock{}; };
    const int blocks = PACKED ? p.mask.packed_count : QueryBlock::count<BM>(dims);
    // SCHEDULE_ONE_A_BLOCK: the loops below end after their first pass (and a grid too small for
    // that is the host's bug, stopped here rather than leaving blocks unwritten).
    if (!Tr::PERSISTENT && int(gridDim.x) < blocks) __trap();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warpgroup = warp / 4;
    // Query block `idx`, its rows in the maps, its score modifier and visible key tiles.
    auto block_at = [&](int idx) {
        return PACKED ? seq(idx).query_block(dims, BM) : QueryBlock::from_index<BM>(dims, idx, head_group);
    };
    auto tma_rows = [&](int idx, const QueryBlock& blk) {
        return PACKED ? TmaRows::packed(seq(idx)) : TmaRows::dense(blk.batch);
    };
    typedef ScoreMod<Flags, float, T, PACKED> Mod;   // PACKED: the sequence's own counts (PER_SEQ)
    auto score_mod = [&](int idx, const QueryBlock& blk) {
        const float scale_log2 = acc_param<float>(p.scale_log2, p.scale_log2_f);
        if constexpr (PACKED) return Mod(p.mask, seq(idx), scale_log2, blk.head);
        else return Mod(p.mask, dims, scale_log2, blk.batch, blk.head);
    };

    if (threadIdx.x == 0) {
        mbar_init(sm.q_full(), 1);
        // Q is given back by every consumer thread after its last S, or by each warpgroup's
        // storing thread once the store has read O out of it.
        mbar_init(sm.q_empty(), Tr::Q_FREE_AFTER_S ? Tr::CONSUMER_THREADS : Tr::CONSUMERS);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(sm.k_full(s), 1);
            mbar_init(sm.v_full(s), 1);
            mbar_init(sm.k_empty(s), Tr::CONSUMER_THREADS);
            mbar_init(sm.v_empty(s), Tr::CONSUMER_THREADS);
            if constexpr (Flags::EXTRA) {
                mbar_init(sm.bias_full(s), Tr::BIAS_LOADERS);
                mbar_init(sm.bias_empty(s), Tr::CONSUMER_THREADS);
            }
        }
        if constexpr (Tr::WALK_RING) {
            const BlockWalk<SCHEDULE> walk{sm.walk_ring()};
            for (int s = 0; s < 2; ++s) {
                mbar_init(walk.full(s), 1);
                mbar_init(walk.empty(s), Tr::CONSUMER_THREADS);
            }
        }
        mbar_init_fence();
    }
    if constexpr (LINEAR_BIAS) {   // the linear bias's table, for every block's wgmmas (async proxy)
        LinearBiasTable<BN>::template write<Tr::THREADS>(smem_raw + (sm.lin - base), threadIdx.x);
        fence_proxy_async_smem();
    }
    __syncthreads();   // the last CTA-wide barrier: from here on, the mbarriers order everything

    if (warpgroup == 0) {
        setmaxnreg_dec<Tr::PRODUCER_REGS>();
        const int loader = int(threadIdx.x) - Tr::FIRST_BIAS_LOADER;
        const bool bias_loader = Flags::EXTRA && loader >= 0 && loader < Tr::BIAS_LOADERS;
        if (threadIdx.x != 0 && !bias_loader) return;
        int t = 0, q_round = 0;
        BlockWalk<SCHEDULE> walk{sm.walk_ring()};
#pragma unroll 1
        for (int idx = blockIdx.x;; idx = walk.next(idx, p.block_queue)) {
            if constexpr (Tr::WALK_RING) walk.give(idx);   // (only thread 0 walks: no bias loaders)
            if (idx >= blocks) break;
            const QueryBlock blk = block_at(idx);
            const auto mod = score_mod(idx, blk);
            const TileRange keys = mod.key_tiles(blk.m0, blk.rows, BN);
            const int first = mod.next_key_tile(keys.begin, keys.end, blk.m0, blk.rows, BN);
            if (first >= keys.end) continue;
            if (threadIdx.x == 0) {
                produce_tiles(sm, maps, mod, blk, tma_rows(idx, blk), first, keys.end, t, q_round++);
            } else if constexpr (Flags::EXTRA) {
                if (!mod.has_bias()) return;
                produce_bias_tiles<T>(sm, p.mask.bias, mod, blk, first, keys.end, dims.lk, loader, t);
            }
            if constexpr (Tr::ONE_PASS_BREAK) break;
        }
        if constexpr (Flags::EXTRA) {
            // No copy left in flight behind an exiting thread. wait_group counts committed groups
            // only, and nothing above commits: without the commit the wait would return at once.
            if (bias_loader) {
                cp_async_commit();
                cp_async_wait<0>();
            }
        }
        return;
    }
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    const int consumer = warpgroup - 1, cwarp = warp - 4;   // consumer warpgroup, warp among the consumers

    float acc_o[1][Tr::O_TILES][4];
    float row_max[1][2], row_sum[1][2];

    const unsigned q_wg = sm.q + consumer * 64 * 128;       // this warpgroup's 64 rows of every Q slab
    // ...and of the tile O is staged in for its bulk store
    const unsigned o_wg = Tr::O_OWN_TILE ? sm.o + consumer * 64 * 128 : q_wg;
    // O += P V of the previous tile, whose V is at V stage `stage` (wgmmas issued, not committed).
    auto issue_pv = [&](int stage, const unsigned (&p_frag)[BN / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_rs<T, HEAD>(flat(acc_o), p_frag[kk], mn_major_desc(sm.v_tile(stage), kk, BN));
    };
    // PINGPONG: warpgroup c issues its GEMMs after the other one has issued its own (named
    // barrier 1 + c, 256 threads: its 128 waiting, the other's 128 arriving).
    auto my_turn = [&]() { if (Tr::PINGPONG) named_bar_sync(1 + consumer, 2 * 128); };
    auto your_turn = [&]() { if (Tr::PINGPONG) named_bar_arrive(2 - consumer, 2 * 128); };
    // O += P V of a tile whose V is at `stage`, finished here: the product every tile gets
    // without OVERLAP_PV, and the last tile's with it. `keys`: the sequence's keys in the tile.
    // PACKED: a sequence's last tile holds the next sequence's rows past its last key (the copy engine
    // fills zeros past the packed tensor only); their P is 0, but 0 x inf is NaN, so V's rows there
    // are zeroed first (named barrier 6: every consumer thread).
    auto pv_now = [&](int stage, unsigned full_parity, const unsigned (&p_frag)[BN / 16][4], int keys) {
        mbar_wait(sm.v_full(stage), full_parity);
        if (PACKED && keys < BN) {
            zero_tile_rows<BN, Tr::SLABS, Tr::CONSUMER_THREADS>(smem_raw + (sm.v_tile(stage) - base), keys,
                                                                int(threadIdx.x) - 128);
            fence_proxy_async_smem();   // the stores, before the wgmmas (async proxy) read V
            named_bar_sync(6, Tr::CONSUMER_THREADS);
        }
        my_turn();
        wgmma_fence();
        issue_pv(stage, p_frag);
        wgmma_commit();
        your_turn();
        wgmma_wait<0>();
        fence_regs(flat(acc_o));
    };

    int t = 0, q_round = 0;   // as the producer's: visible tiles so far, blocks with tiles so far
    BlockWalk<SCHEDULE> walk{sm.walk_ring()};
    if (Tr::PINGPONG && consumer == 1) your_turn();   // warpgroup 1 (consumer 0) goes first
#pragma unroll 1
    for (int idx = blockIdx.x;; idx += gridDim.x) {
        if constexpr (Tr::WALK_RING) idx = walk.take();
        if (idx >= blocks) break;
        const QueryBlock blk = block_at(idx);
        const auto mod = score_mod(idx, blk);
        const TileRange keys = mod.key_tiles(blk.m0, blk.rows, BN);
        auto next_tile = [&](int j) { return mod.next_key_tile(j, keys.end, blk.m0, blk.rows, BN); };
        const float x_per_s = mod.x_per_score();
        const int warp_row0 = blk.m0 + cwarp * 16;
        // LINEAR_BIAS: the slope c in raw-score units and the step's A fragment, the block's: c (shift - row) for
        // this lane's rows from the warp's first, shift 0
        const float lin_c = LINEAR_BIAS ? cuf_linear_slope<float>(blk.head, p.mask.mod_args) / mod.scale_log2 : 0.0f;
        unsigned lin_a[4];
        auto form_lin_a = [&](int shift) {
            const int to_row = shift - lane / 4;
            LinearBiasSlope::of(lin_c).frag(lin_a, lin_c * float(to_row), lin_c * float(to_row - 8), lane);
            fence_regs(lin_a);   // formed before the wgmma fence (else ptxas inserts one before the step: C7519)
        };
        if (LINEAR_BIAS) form_lin_a(0);
        start_rows(acc_o, row_max, row_sum);
        unsigned p_frag[BN / 16][4] = {};   // P of the previous tile: the A operand of its O += P V, 16 keys a step

        int j = next_tile(keys.begin);
        const bool has_tiles = j < keys.end;
        int last_n0 = 0;   // the last tile's first key
        if (has_tiles) mbar_wait(sm.q_full(), q_round & 1);
        const int t0 = t;
        for (; j < keys.end; ++t) {
            const int stage = t & 1;
            const unsigned full_parity = (t >> 1) & 1;
            const int next = next_tile(j + 1);
            // S = Q K^T for this warp's 16 rows and (OVERLAP_PV), in flight meanwhile, O += P V of
            // the previous tile.
            float s[1][Tr::S_TILES][4];
            unsigned lin_tile_a[4];   // LIN_TILE_A: the block's with the tile's shift c (n0 + BN / 2 - w0)
            if constexpr (LIN_TILE_A) {
                LinearBiasSlope::with_shift(lin_tile_a, lin_a, lin_c * float(j * BN + BN / 2 - warp_row0), lane);
                fence_regs(lin_tile_a);
            }
            auto& lin_step_a = LIN_TILE_A ? lin_tile_a : lin_a;
            if constexpr (LIN_FIRST) {
                wgmma_fence();
                LinearBiasTable<BN>::add(flat(s), lin_step_a, sm.lin, false);
            }
            mbar_wait(sm.k_full(stage), full_parity);
            const unsigned k_tile = sm.k_tile(stage);
            my_turn();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HEAD / 16; ++kk)
                wgmma_ss<T, BN>(flat(s), k_major_desc(q_wg, kk, BM * 128), k_major_desc(k_tile, kk, BN * 128),
                                kk > 0 || LIN_FIRST);
            if constexpr (LINEAR_BIAS && !LIN_FIRST) LinearBiasTable<BN>::add(flat(s), lin_step_a, sm.lin);
            wgmma_commit();
            if (Tr::OVERLAP_PV && t > t0) {
                mbar_wait(sm.v_full(stage ^ 1), ((t - 1) >> 1) & 1);
                wgmma_fence();          // a new block for ptxas, which would insert it itself (C7519)
                issue_pv(stage ^ 1, p_frag);
                wgmma_commit();
                your_turn();
                wgmma_wait<1>();        // S only: groups complete in order
            } else {
                your_turn();
                wgmma_wait<0>();
            }
            fence_regs(flat(s));
            mbar_arrive(sm.k_empty(stage));   // this thread's wgmmas are done with K_j
            if (Tr::Q_FREE_AFTER_S && next >= keys.end) mbar_arrive(sm.q_empty());   // ...and with Q

            const int n0 = j * BN;
            // Per warp (its 16 rows): where a block layout's blocks are not multiples of BM, a block's
            // rows straddle layout rows, and a warp may see none of a tile the CTA loads.
            const int kind = mod.classify(warp_row0, 16, n0, BN);
            auto coord = [=](int n, int i, int& row, int& col) {
                row = warp_row0 + frag_row(lane, i);
                col = n0 + frag_col(lane, n, i);
            };
            mask_and_modify(s[0], mod, coord, x_per_s, [&] {
                if constexpr (Flags::EXTRA) {
                    if (mod.has_bias()) {   // x = s * scale + bias * log2(e), the warp's 16 bias rows by ldmatrix
                        mbar_wait(sm.bias_full(stage), full_parity);
                        scale_add_bias_frags_sw<T, BN>(s[0], sm.bias_tile(stage) + cwarp * 16 * BN * int(sizeof(T)),
                                                       lane, mod.scale_log2);
                        mbar_arrive(sm.bias_empty(stage));
                    }
                    // the per-element tests in a loop (registers), none where the warp sees nothing
                    apply_score_mod_bits(s[0], mod, kind != TILE_FULL, coord, kind == TILE_SKIP, kind == TILE_BAND);
                } else {
                    apply_score_mod(s[0], mod, kind != TILE_FULL, coord);
                }
            });
            // acc_o is still being written: its correction waits for the P V product.
            float correction[2];
            auto note_correction = [&](int, int r, float c) { correction[r] = c; };
            auto keep_p = [&](int, int n, int r, float p0, float p1) {
                s[0][n][2 * r] = p0;
                s[0][n][2 * r + 1] = p1;
            };
            // (LINEAR_BIAS with the block's A: the tile's offset c_h (n0 + BN / 2 - w0), c_h = c scale_log2)
            const bool moved = warp_softmax_step<Tr, 1, decltype(note_correction), decltype(keep_p),
                                                 LINEAR_BIAS && !LIN_TILE_A,
                                                 fwd_exp2_on_fma<T, HEAD>()>(
                s, row_max, row_sum, softmax_x_per_s(x_per_s), note_correction, keep_p,
                lin_c * mod.scale_log2 * float(n0 + BN / 2 - warp_row0));
            // Dropout scales the fp32 probabilities after the statistics (row_sum counts every key).
            if constexpr (Flags::EXTRA) apply_dropout_frags(s[0], mod, warp_row0 + lane / 4, n0, lane);
            if constexpr (Tr::OVERLAP_PV) {
                wgmma_wait<0>();
                fence_regs(flat(acc_o));
                fence_regs(p_frag);
                if (t > t0) mbar_arrive(sm.v_empty(stage ^ 1));   // ...and with V of the previous tile
            }
            if (moved) {
                rescale_acc_row(acc_o, 0, 0, correction[0]);
                rescale_acc_row(acc_o, 0, 1, correction[1]);
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) pack_a_frag<T, BN>(p_frag[kk], s[0], 16 * kk);
            if constexpr (!Tr::OVERLAP_PV) {   // this tile's O += P V now, done before the next S
                pv_now(stage, full_parity, p_frag, mod.lk - n0);
                fence_regs(p_frag);
                mbar_arrive(sm.v_empty(stage));
            }
            last_n0 = n0;
            j = next;
        }
        if (Tr::OVERLAP_PV && t > t0) {   // the last tile's O += P V
            pv_now((t - 1) & 1, ((t - 1) >> 1) & 1, p_frag, mod.lk - last_n0);
            fence_regs(p_frag);
            mbar_arrive(sm.v_empty((t - 1) & 1));
        }

        // Epilogue: O = acc_o / l, lse per row; rows past lq and columns past dv are not written.
        // Through shared memory where O's tile is free: its own tile, or Q's once this block's
        // S = Q K^T are done (with no tiles, Q's may be receiving the next block's Q).
        const TmaRows at = tma_rows(idx, blk);
        // PACKED: only where the whole block's rows are the sequence's, a test the same for both warpgroups:
        // one on the warpgroup's own rows (threadIdx, to ptxas not warp-uniform) moved the tile counter t off
        // the uniform datapath, adding ~30 vector instructions a key tile (benchmarks/sass.py).
        if (STAGE_O && (Tr::O_OWN_TILE || has_tiles) && (!PACKED || blk.rows == BM)) {
            // The warpgroup's 64 rows of O go, 16-bit and swizzled, into its 64 rows of the tile, and
            // one thread has the copy engine write them out, SLABS boxes of 64 x 64 (the tensor
            // map's bounds clip rows and columns).
            const bool storer = threadIdx.x % 128 == 0;
            if (Tr::O_OWN_TILE) {   // the previous block's store has read the tile
                if (storer) bulk_wait_read<0>();
                named_bar_sync(3 + consumer, 128);
            }
            unsigned char* o_tile = smem_raw + (o_wg - base);
            // PACKED: the lane and warp read again here, so that ptxas does not hoist the 32 swizzled
            // addresses they give out of the block loop and hold them through the key loop (NVRTC 12.9
            // spilled them at head dim 128).
            const int tid = PACKED ? thread_index_reread() : int(threadIdx.x);
            const int stage_lane = PACKED ? tid % 32 : lane, stage_warp = PACKED ? tid / 32 - 4 : cwarp;
            // the warp's rows within the warpgroup's 64, 128-byte swizzled slabs of BM rows
            stage_o_lse_c_frags<T>(o_tile, [](int row, int col) { return sw128_offset(row, col, BM * 128); }, p.lse,
                                   blk, (stage_warp % 4) * 16, consumer * 64, stage_lane, acc_o, row_max, row_sum);
            fence_proxy_async_smem();
            named_bar_sync(3 + consumer, 128);
            if (storer) {
#pragma unroll
                for (int s = 0; s < Tr::SLABS; ++s)
                    tma_store_4d(&maps.o, o_wg + s * BM * 128, 64 * s, at.q0 + blk.m0 + consumer * 64, blk.head,
                                 at.batch);
                bulk_commit();
                if (!Tr::O_OWN_TILE) {   // Q's tile: the next Q waits until the engine has read O
                    bulk_wait_read<0>();
                    mbar_arrive(sm.q_empty());
                }
            }
        } else {
            if constexpr (ACC_OUT) store_o_lse_c_frags<true, float>(p, blk, cwarp * 16, lane, acc_o, row_max, row_sum);
            else store_o_lse_c_frags<true, T>(p, blk, cwarp * 16, lane, acc_o, row_max, row_sum);
        }
        q_round += has_tiles;
        if constexpr (Tr::ONE_PASS_BREAK) break;
    }
    // PINGPONG: every turn a warpgroup waits for is one the other gave, strictly alternating over all
    // its blocks (both see the same tiles); consumer 1 gave one more at the start, which consumer 0
    // takes here, leaving no arrival pending when the CTA exits.
    if (Tr::PINGPONG && consumer == 0) my_turn();
    // Only until the engine has read the last tile: the CTA may exit with the writes in flight
    // (they land before the grid completes).
    if (STAGE_O && Tr::O_OWN_TILE && threadIdx.x % 128 == 0) bulk_wait_read<0>();
}
