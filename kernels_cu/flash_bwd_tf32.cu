// flash_bwd_tf32.cu -- attention backward on float32 data with the TF32 tensor cores.
//
// flash_bwd_fma.cu's math (see there), flash_bwd_mma.cu's loop order, and warp_gemm_tf32.cuh's
// arithmetic at one of two precisions (SPLIT, an int kind of warp_gemm_tf32.cuh), as flash_fwd_tf32.cu:
//   SPLIT (precision="highest"): 3xTF32, operands split into big + small, each k-step's
//         three MMAs in a fresh fragment added to the accumulator by FADD: float32 accuracy.
//   plain (precision="tf32"): one MMA a product, ~2^-11 an operand.
//
// flash_bwd_dkdv_tf32: one CTA (WARPS warps) per (key block of BN = 16 WARPS keys, or 8 WARPS with two
// query groups, K/V head, batch). Warp w owns the 16 keys key0 = 16 (w % (BN / 16)).. and, per step
// (query head, query block i; its half of the block's queries with query groups),
//     S^T = K_j Q_i^T,  dP^T = V_j dO_i^T         (warp_gemm_qk_tf32; A: the warp's keys)
//     P^T = 2^(x - lse),  dS^T = P^T (dP^T - Dsum)
//     dV_j += P^T dO_i,  dK_j += dS^T Q_i         (warp_gemm_pv_tf32; A: P^T, dS^T in registers)
// K_j and V_j are the A operands of every step: split once per CTA in shared memory
// (split_tile: big in place, small beside; plain: rounded in place). Q_i and dO_i are B
// operands, double-buffered with cp.async (with the rows' lse and Dsum, so a step's statistics
// arrive with its tiles) and split per fragment as the forward splits K and V.
// With ATOMIC_DQ each warp stores its dS^T fragments ([key][query], fp32) and the warps split
// dQ_i += scale dS K_j by rows and columns (warp_gemm_ds_k_tf32, K's split parts as B), added to
// the fp32 accumulator with vector reductions (atomics.cuh). With EXTRA each Q/dO stage has the
// step's bias tile ([query][key]) beside it, and a bias that wants its gradient gets dS added
// here (bias_grad.cuh's ADD / ATOMIC / ORDERED modes, as the FMA kernel, or bias_grad_t.cuh's
// vector reductions into a key-major accumulator, as the Hopper kernel: no dbias kernel).
//
// flash_bwd_dq_tf32: the deterministic dQ. One CTA per (query block, head, batch); warp w owns
// the 16 query rows 16 (w % (BM / 16)).. (with two key groups, half of each key block) and walks the
// key blocks in order, K/V (and the bias) double-buffered:
//     S = Q_i K_j^T,  dP = dO_i V_j^T             (warp_gemm_qk_tf32; Q, dO split once per CTA)
//     dS = P (dP - Dsum),  dQ_i += dS K_j         (warp_gemm_pv_tf32, as the forward's O += P V)
//
// Every fp32 tile has rows padded by 4 floats (warp_gemm_tf32.cuh: conflict-free ldmatrix of the
// A and B^T operands and 4-byte loads of the [key][column] B operands with one pitch).
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "warp_gemm_tf32.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "bias_grad.cuh"
#include "bias_grad_t.cuh"
#include "atomics.cuh"

template <typename Cfg, int SPLIT, bool ATOMIC_DQ, bool EXTRA>
struct DkdvTf32Traits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int STAGES = Cfg::STAGES, THREADS = 32 * WARPS;
    static constexpr int PITCH = HEAD + 4;               // = 4 (mod 32) floats: warp_gemm_tf32.cuh
    static constexpr int KV_ELEMS = BN * PITCH;          // K or V (and with SPLIT each one's small part)
    static constexpr int QD_ELEMS = BM * PITCH;          // one stage of Q or dO
    static constexpr int DS_PITCH = BM + 4;              // = 4 (mod 16): warp_gemm_ds_k_tf32's loads
    static constexpr int DS_ELEMS = ATOMIC_DQ ? BN * DS_PITCH : 0;   // dS^T, [key][query]
    static constexpr int BIAS_PITCH = BN + 4;            // = 4 (mod 8): scale_add_bias_frags_f32_t
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage, [query][key]
    // dQ = dS K: BM/16 row strips x Q_SPLIT column blocks, one per warp, formed DQ_CHUNK
    // columns at a time (16 fp32 registers of partial product at most; 8 with query groups, whose
    // one pass at head dim 128 holds 255 registers: 32 columns spilled 8 bytes, NVRTC 12.9).
    static constexpr int Q_SPLIT = WARPS / (BM / 16);
    static constexpr int DQ_COLS = HEAD / Q_SPLIT;
    // Query groups: with WARPS = 2 x BN / 16, two warps own each 16-key strip, one the step's first
    // BM / 2 queries and one the rest, each with its own dK / dV accumulators (summed through shared
    // memory at the end): twice the warps an SM of one warp a strip in the same shared memory, whose
    // K and V parts fill it (head dim 128, one 4-warp CTA an SM: a warp a scheduler waiting on its MMAs).
    static constexpr int KEY_WARPS = BN / 16;
    static constexpr int QUERY_GROUPS = WARPS / KEY_WARPS;
    static constexpr int WARP_QUERIES = BM / QUERY_GROUPS;   // a warp's queries of each step
    static constexpr int DQ_CHUNK_MAX = QUERY_GROUPS > 1 ? 16 : 32;   // DQ_CHUNK's bound (above)
    static constexpr int DQ_CHUNK = DQ_COLS < DQ_CHUNK_MAX ? DQ_COLS : DQ_CHUNK_MAX;
    // The end's sum (sum_over_warp_groups): the accumulators of query groups 1.. in K and V's tiles.
    static constexpr int SUM_FLOATS = (QUERY_GROUPS - 1) * KEY_WARPS * 32 * (HEAD / 8) * 4 * 2;
    static constexpr int SMEM_BYTES =
        ((SPLIT ? 4 : 2) * KV_ELEMS + STAGES * (2 * QD_ELEMS + BIAS_ELEMS + 2 * BM) + DS_ELEMS) * int(sizeof(float));
    static_assert(HEAD % 32 == 0 && BM % 16 == 0, "tiles: n8 pairs; pitches = 4 (mod 32)");
    static_assert(BN % 16 == 0 && WARPS % KEY_WARPS == 0, "each warp owns one 16-key strip");
    static_assert(QUERY_GROUPS == 1 || WARP_QUERIES % 16 == 0, "query groups: n8 pairs of queries a warp");
    static_assert(SUM_FLOATS <= (SPLIT ? 4 : 2) * KV_ELEMS, "the end's sum fits K and V's tiles");
    static_assert(WARPS % (BM / 16) == 0, "dQ: whole row strips per warp group");
    static_assert(DQ_COLS % DQ_CHUNK == 0 && DQ_CHUNK % 16 == 0, "dQ column blocks of whole 16-column groups");
    static_assert(STAGES == 1 || STAGES == 2, "Q/dO tiles are single or double buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

template <typename Cfg, int SPLIT, bool EXTRA>
struct DqTf32Traits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int PITCH = HEAD + 4;
    static constexpr int QD_ELEMS = BM * PITCH;          // Q or dO (and with SPLIT each one's small part)
    static constexpr int KV_ELEMS = BN * PITCH;          // one stage of K or V
    static constexpr int BIAS_PITCH = BN + 8;            // = 8 (mod 16): scale_add_bias_frags_f32
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    static constexpr int SMEM_BYTES =
        ((SPLIT ? 4 : 2) * QD_ELEMS + Cfg::STAGES * (2 * KV_ELEMS + BIAS_ELEMS)) * int(sizeof(float));
    // Key groups: with WARPS = 2 x BM / 16, two warps own each 16-row strip, one the first BN / 2 keys of
    // each step and one the rest, each with its own dQ accumulator (summed through shared memory at the
    // end): as the dK/dV kernel's query groups, twice the warps an SM where Q and dO's parts fill it.
    static constexpr int STRIP_WARPS = BM / 16;
    static constexpr int KEY_GROUPS = WARPS / STRIP_WARPS;
    static constexpr int WARP_KEYS = BN / KEY_GROUPS;   // a warp's keys of each step
    static constexpr int SUM_FLOATS = (KEY_GROUPS - 1) * STRIP_WARPS * 32 * (HEAD / 8) * 4;
    static_assert(HEAD % 32 == 0 && BN % 16 == 0, "tiles: n8 pairs; pitches = 4 (mod 32)");
    static_assert(BM % 16 == 0 && WARPS % STRIP_WARPS == 0, "each warp owns one 16-row strip");
    static_assert(KEY_GROUPS == 1 || (!EXTRA && WARP_KEYS % 16 == 0), "key groups: plain variants, n8 pairs of keys");
    static_assert(SUM_FLOATS <= Cfg::STAGES * 2 * KV_ELEMS, "the end's sum fits the K / V stages");
    static_assert(Cfg::STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// dbias += dS on one warp's S^T-shaped fragments (rows: keys key_first + g + 8r, columns:
// queries m0 + 8n + 2t + e; C element i: r = i / 2, e = i % 2). A one-row bias: each key's
// queries are summed first, in a fixed order (this lane's, then the 4 lanes of the key), and
// one lane adds (flash_bwd_dmma.cu's add_dbias_frags_t on the m16n8 layout).
// DBIAS_KEY_MAJOR (a bias with query rows shared by CTAs, deterministic=False; cuflash/_dispatch/masking.py):
// the m16n8 accumulator layout is the Hopper kernel's, so each lane adds four queries of one key
// with one vector reduction into the [key][query] accumulator (bias_grad_t.cuh), a quarter of the
// scalar atomics of DBIAS_ATOMIC, whole sectors. All 32 lanes take this branch together.
template <int N>
__device__ __forceinline__ void add_dbias_frags_t_f32(const DbiasParams& g, const float (&dst)[N][4], int batch,
                                                      int head, int m0, int key_first, const AttnDims& dims,
                                                      int lane) {
    if (g.mode == DBIAS_KEY_MAJOR) {
        const DbiasKeyMajorStep step = DbiasKeyMajorStep::of(g, batch, head, m0, dims.lq,
                                                             key_first + QueryQuad::key(lane), dims.lk, lane);
#pragma unroll
        for (int n = 0; n < N; ++n) step.add(dst[n], n, lane);
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key_first + lane / 4 + 8 * r;
        if (g.rows_broadcast) {
            float sum = 0.0f;   // rows past lq hold dS = 0 (P = 0 there)
#pragma unroll
            for (int n = 0; n < N; ++n) sum += dst[n][2 * r] + dst[n][2 * r + 1];
            sum = group_sum<4>(sum);
            if (lane % 4 == 0 && key < dims.lk) dbias_add(g, dbias_at<float>(g, batch, head, 0, key), sum);
            continue;
        }
        if (key >= dims.lk) continue;
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int q = m0 + frag_col(lane, n, e);
                if (q < dims.lq) dbias_add(g, dbias_at<float>(g, batch, head, q, key), dst[n][2 * r + e]);
            }
    }
}

// Accumulators of warps that own the same rows but different queries (dK/dV: query groups) or keys (dQ: key
// groups) of each step, summed into group 0's: each warp holds A (and, USE_B, B) for row block `member`; groups
// 1.. store theirs in `scratch` (tiles no warp reads any more), lane-major so that a warp's stores and loads
// are whole 128-byte rows. True for the warps of group 0, which hold the sums.
template <int GROUPS, int MEMBERS, bool USE_A, bool USE_B, int NA, int NB>
__device__ __forceinline__ bool sum_over_warp_groups(float* scratch, float (&a)[NA][4], float (&b)[NB][4], int group,
                                                     int member, int lane) {
    constexpr int A_FLOATS = USE_A ? 32 * NA * 4 : 0, WARP_FLOATS = A_FLOATS + (USE_B ? 32 * NB * 4 : 0);
    __syncthreads();   // every warp is past its last read of the tiles `scratch` overlays
    if (group > 0) {
        float* mine = scratch + ((group - 1) * MEMBERS + member) * WARP_FLOATS + lane;
#pragma unroll
        for (int n = 0; n < NA; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (USE_A) mine[(4 * n + i) * 32] = a[n][i];
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (USE_B) mine[A_FLOATS + (4 * n + i) * 32] = b[n][i];
    }
    __syncthreads();
    if (group > 0) return false;
#pragma unroll 1
    for (int g = 1; g < GROUPS; ++g) {
        const float* theirs = scratch + ((g - 1) * MEMBERS + member) * WARP_FLOATS + lane;
#pragma unroll
        for (int n = 0; n < NA; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (USE_A) a[n][i] += theirs[(4 * n + i) * 32];
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (USE_B) b[n][i] += theirs[A_FLOATS + (4 * n + i) * 32];
    }
    return true;
}

// PASS: 0 computes dK and dV together; 1 dV only, 2 dK (and dQ) only, each recomputing S^T
// (the variant table splits the passes where one pass's tile does not fit: cuflash/_dispatch/tables.py).
// Grid: ceil(Lk / BN) x Hk x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), key block 0 (the most causal work) first.
// PACKED: the key blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), each with its
// sequence's own query and key counts; without EXTRA. ATOMIC_DQ adds into the packed rows' accumulator
// (batch index: the sequence's first query row, the accumulator's batch stride one row).
template <typename T, typename Cfg, typename Flags, int PASS, bool ATOMIC_DQ, bool VEC, int SPLIT, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dkdv_tf32(const BwdParams p) {
    static_assert(sizeof(T) == sizeof(float), "TF32 tensor cores: float32 only");
    typedef DkdvTf32Traits<Cfg, SPLIT, ATOMIC_DQ, Flags::EXTRA> Tr;
    constexpr int BN = Tr::BN, BM = Tr::BM, HEAD = Tr::HEAD, P = Tr::PITCH, WQ = Tr::WARP_QUERIES, QT = WQ / 8;
    constexpr bool DO_DV = PASS != 2, DO_DK = PASS != 1;
    static_assert(DO_DK || !ATOMIC_DQ, "dQ needs dS, which the dV-only pass does not form");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* k_s = reinterpret_cast<float*>(smem_raw);             // K, then its big part
    float* v_s = k_s + Tr::KV_ELEMS;                              // V, then its big part
    float* k_small_s = v_s + Tr::KV_ELEMS;                        // SPLIT: the small parts
    float* v_small_s = k_small_s + (SPLIT ? Tr::KV_ELEMS : 0);
    float* q_stages = v_small_s + (SPLIT ? Tr::KV_ELEMS : 0);     // STAGES x [BM][P]
    float* do_stages = q_stages + Tr::STAGES * Tr::QD_ELEMS;      // STAGES x [BM][P]
    float* bias_stages = do_stages + Tr::STAGES * Tr::QD_ELEMS;   // STAGES x [BM][BIAS_PITCH] (EXTRA)
    float* ds_s = bias_stages + Tr::STAGES * Tr::BIAS_ELEMS;      // dS^T, [key][query] (ATOMIC_DQ)
    float* stat_stages = ds_s + Tr::DS_ELEMS;                     // STAGES x [lse | Dsum] of BM rows, raw

    const AttnDims& dims = p.dims;
    static_assert(!PACKED || !Flags::EXTRA, "packed sequences: the plain kernel");
    const bool key_major = Flags::EXTRA && DO_DK && p.dbias.mode == DBIAS_KEY_MAJOR;
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q / dims.group) : PackedBlock{};
    const KeyBlock blk = PACKED ? seq.key_block(dims, BN)
                                : KeyBlock::from_grid<BN>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask, key_major));
    const int n0 = blk.n0, batch = blk.batch, keys_valid = blk.keys;
    const int q_batch = PACKED ? seq.q_start : batch;   // the query side's batch index (packed: its first row)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int key0 = warp % Tr::KEY_WARPS * 16;                   // this warp's first key within the block
    const int query_group = warp / Tr::KEY_WARPS;
    const int q_first = query_group * WQ;                         // this warp's first query of a step
    const float scale = float(p.scale);
    typedef ScoreMod<Flags, float, float, PACKED> Mod;   // PACKED: the sequence's own counts (PER_SEQ)
    Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, p.scale_log2_f, blk.first_head);
        else return Mod(p.mask, dims, p.scale_log2_f, batch, blk.first_head);
    }();
    const int lq = PACKED ? mod.lq : dims.lq;                     // the sequence's own count if packed
    const float x_per_s = mod.x_per_score();
    const bool dbias = Flags::EXTRA && DO_DK && p.dbias.mode != DBIAS_NONE;
    const bool ordered = dbias && p.dbias.mode == DBIAS_ORDERED;

    load_row_tiles<float, BN, HEAD, P, Tr::THREADS, VEC>(k_s, p.k, dims.d, v_s, p.v, dims.dv, batch, blk.kv_head, n0,
                                                         keys_valid);
    cp_async_commit();

    float acc_dk[DO_DK ? HEAD / 8 : 1][4], acc_dv[DO_DV ? HEAD / 8 : 1][4];   // rows: this warp's 16 keys
    zero_frags(acc_dk);
    zero_frags(acc_dv);
    // dS^T's 8-byte store of (key row r of the fragment, queries 2t, 2t + 1), t = lane % 4, for
    // n8 query tile n is at ds_lane + 8 r DS_PITCH + 8 n (up to a 2-way bank conflict, a half-warp's
    // rows g DS_PITCH apart with DS_PITCH = 4 (mod 16); the loads that read them back, once per
    // column block, are conflict-free: tests/test_fragments_tf32.py).
    float* ds_lane = ds_s + (key0 + lane / 4) * Tr::DS_PITCH + q_first + 2 * (lane % 4);
    // Steps walk (query head of the group, query block) pairs over the query blocks that can see
    // this key block; every block when dbias contributions take turns (DBIAS_ORDERED: each step
    // passes its turn; a tile nothing sees adds zeros).
    const int q_blocks = ceil_div(lq, BM);
    const KeyBlockSteps<BM> steps(ordered ? TileRange{0, q_blocks}
                                          : mod.query_tiles(n0, keys_valid, BM, blk.end_head - blk.first_head), blk);
    auto issue_query_block = [&](const StepCursor& at, int stage) {
        const int head = at.head, m0 = steps.m0(at.block);
        const int rows = imin(BM, lq - m0);
        load_tile_fixed_col<float, BM, HEAD, P, Tr::THREADS, VEC>(q_stages + stage * Tr::QD_ELEMS,
                                                                  p.q.at<const float>(q_batch, head, m0),
                                                                  p.q.row_stride, rows, dims.d);
        load_tile_fixed_col<float, BM, HEAD, P, Tr::THREADS, VEC>(do_stages + stage * Tr::QD_ELEMS,
                                                                  p.dout.at<const float>(q_batch, head, m0),
                                                                  p.dout.row_stride, rows, dims.dv);
        if (mod.has_bias())   // (mod.head is the current step's here, not this one's: head is passed on)
            load_score_tile<float, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_stages + stage * Tr::BIAS_ELEMS,
                                                                       p.mask.bias, batch, head, m0, n0, rows,
                                                                       keys_valid);
        copy_row_stats_async<BM, Tr::THREADS>(stat_stages + stage * 2 * BM, p.lse, p.dsum, q_batch, head, m0, rows);
        cp_async_commit();
    };
    StepCursor cur = StepCursor::first(steps).next_visible(steps, mod, blk, !ordered);
    if (cur.t < steps.count) issue_query_block(cur, 0);
    // K and V are split once, before the loop (the first query block arrives meanwhile); the
    // loop's first __syncthreads publishes the split.
    cp_async_wait<0>();
    __syncthreads();
    split_tile<SPLIT, BN, HEAD, P, Tr::THREADS>(k_s, k_small_s);
    split_tile<SPLIT, BN, HEAD, P, Tr::THREADS>(v_s, v_small_s);
#pragma unroll 1
    for (int stage = 0; cur.t < steps.count;) {
        const StepCursor next = cur.after(steps).next_visible(steps, mod, blk, !ordered);
        const int head = cur.head, q_block = steps.begin + cur.block, m0 = q_block * BM;
        const int rows_valid = imin(BM, lq - m0);
        mod.head = head;
        prefetch_next_step<Tr::STAGES>(next.t, steps.count, stage,   // the next block meanwhile
                                       [&](int, int into) { issue_query_block(next, into); });
        __syncthreads();
        const float* stats = stat_stages + stage * 2 * BM;
        const float* q_s = q_stages + stage * Tr::QD_ELEMS;
        const float* do_s = do_stages + stage * Tr::QD_ELEMS;
        float st[QT][4], dpt[QT][4];   // S^T, dP^T: this warp's 16 keys x WQ queries
        zero_frags(st);
        zero_frags(dpt);
        warp_gemm_qk_tf32<SPLIT, 1, WQ, HEAD, P>(one_strip(st), k_s + key0 * P, k_small_s + key0 * P,
                                                 q_s + q_first * P, lane);                    // S^T = K Q^T
        if (DO_DK)
            warp_gemm_qk_tf32<SPLIT, 1, WQ, HEAD, P>(one_strip(dpt), v_s + key0 * P, v_small_s + key0 * P,
                                                     do_s + q_first * P, lane);               // dP^T = V dO^T
        // Rows of these tiles are keys, columns queries; the mask is decided for this warp's keys.
        const bool partial = mod.tile_is_partial(m0 + q_first, WQ, n0 + key0, 16);
        unsigned kept = 0;   // EXTRA with dropout: the step's keep bits (drop_factor)
        if constexpr (Flags::EXTRA) {
            auto coord = [&](int n, int i, int& row, int& col) {
                row = m0 + q_first + frag_col(lane, n, i);
                col = n0 + key0 + frag_row(lane, i);
            };
            // The bias tile is [query][key]; read transposed, it lands in S^T's fragments.
            if (mod.has_bias())
                scale_add_bias_frags_f32_t<WQ, Tr::BIAS_PITCH>(
                    st, bias_stages + stage * Tr::BIAS_ELEMS + q_first * Tr::BIAS_PITCH + key0, lane, mod.scale_log2);
            // The per-element tests and the Philox draws in loops, once a step, outside the
            // probability loop below: unrolled there per element, they make the EXTRA kernel's
            // loop ~25% more instructions than the plain one's.
            apply_score_mod_bits(st, mod, partial, coord);
            if (mod.has_dropout()) kept = dropout_frag_bits_t<QT>(mod, m0 + q_first, n0 + key0, lane);
        } else if (partial) {
            mask_partial_strip_t<WQ>(st, mod, n0 + key0 + lane / 4, m0 + q_first + 2 * (lane % 4));
        }
        // P^T and dS^T in place, in fp32 (st: P^T, dpt: dS^T).
#pragma unroll
        for (int n = 0; n < QT; ++n) {
            // This lane's columns of tile n are queries 2t, 2t + 1: each stat pair in one 8-byte load.
            float lse_log2[2], dsum[2];
            stat_pair_of<BM>(stats, q_first + frag_col(lane, n, 0), lse_log2, dsum);
#pragma unroll
            for (int i = 0; i < 4; ++i)   // (x_per_s is 1 with EXTRA: ScoreMod::scores_stay_raw)
                mod.template prob_and_dscore_at<DO_DK>(st[n][i], dpt[n][i], lse_log2[i % 2], dsum[i % 2],
                                                       drop_factor(mod, kept, n, i), x_per_s,
                                                       m0 + q_first + frag_col(lane, n, i),
                                                       n0 + key0 + frag_row(lane, i));
            if (ATOMIC_DQ)
#pragma unroll
                for (int r = 0; r < 2; ++r)
                    *reinterpret_cast<FloatPair*>(ds_lane + 8 * r * Tr::DS_PITCH + 8 * n) =
                        FloatPair{{dpt[n][2 * r], dpt[n][2 * r + 1]}};
        }
        if (dbias) {
            const DbiasTurn turn = ordered ? DbiasTurn::of(p.dbias, dims, batch, head, q_block, q_blocks, n0 / BN,
                                                           ceil_div(dims.lk, BN))
                                           : DbiasTurn{nullptr, 0};
            if (ordered) turn.wait_turn();
            if (Tr::QUERY_GROUPS > 1 && p.dbias.rows_broadcast) {
                // a one-row bias: each key's element takes every query group's sum, one group after another
#pragma unroll 1
                for (int g = 0; g < Tr::QUERY_GROUPS; ++g) {
                    if (g == query_group)
                        add_dbias_frags_t_f32(p.dbias, dpt, batch, head, m0 + q_first, n0 + key0, dims, lane);
                    __syncthreads();
                }
            } else {
                add_dbias_frags_t_f32(p.dbias, dpt, batch, head, m0 + q_first, n0 + key0, dims, lane);
            }
            if (ordered) turn.pass_turn();
        }
        if constexpr (DO_DV)                                                       // dV += P^T dO
            warp_gemm_pv_tf32<SPLIT, 1, HEAD, WQ, P>(one_strip(acc_dv), one_strip(st), do_s + q_first * P, lane);
        if constexpr (DO_DK)                                                       // dK += dS^T Q
            warp_gemm_pv_tf32<SPLIT, 1, HEAD, WQ, P>(one_strip(acc_dk), one_strip(dpt), q_s + q_first * P, lane);
        if constexpr (ATOMIC_DQ) {                                                 // dQ += scale dS K
            __syncthreads();
            const int strip = warp / Tr::Q_SPLIT;
            const int row_a = strip * 16 + lane / 4, row_b = row_a + 8;   // this lane's C-fragment rows
            float* dq_a = p.dq_acc.at<float>(q_batch, head, m0 + row_a);
            float* dq_b = p.dq_acc.at<float>(q_batch, head, m0 + row_b);
#pragma unroll
            for (int c = 0; c < Tr::DQ_COLS / Tr::DQ_CHUNK; ++c) {
                const int col0 = (warp % Tr::Q_SPLIT) * Tr::DQ_COLS + c * Tr::DQ_CHUNK;
                float part[1][Tr::DQ_CHUNK / 8][4];
                zero_frags(part[0]);
                // A = dS, this strip's queries: columns [16 strip, 16 strip + 16) of dS^T.
                warp_gemm_ds_k_tf32<SPLIT, Tr::DQ_CHUNK, BN, Tr::DS_PITCH, P>(part, ds_s + strip * 16, k_s + col0,
                                                                             k_small_s + col0, lane);
                // Columns col, col + 1 (col even) as one vector reduction: the host pads the
                // accumulator's rows to an even width, so col < d leaves col + 1 in the row.
#pragma unroll
                for (int n = 0; n < Tr::DQ_CHUNK / 8; ++n) {
                    const int col = col0 + frag_col(lane, n, 0);
                    if (col >= dims.d) continue;
                    if (row_a < rows_valid) red_add2(dq_a + col, part[0][n][0] * scale, part[0][n][1] * scale);
                    if (row_b < rows_valid) red_add2(dq_b + col, part[0][n][2] * scale, part[0][n][3] * scale);
                }
            }
        }
        end_of_step_barrier<ATOMIC_DQ>();   // this stage and the row stats are read
        cur = next;
        if (Tr::STAGES == 2) stage ^= 1;
        else if (cur.t < steps.count) issue_query_block(cur, 0);
    }

    if constexpr (Tr::QUERY_GROUPS > 1)   // K and V's tiles are free after the last step
        if (!sum_over_warp_groups<Tr::QUERY_GROUPS, Tr::KEY_WARPS, DO_DK, DO_DV>(k_s, acc_dk, acc_dv, query_group,
                                                                                warp % Tr::KEY_WARPS, lane))
            return;
    // dK = scale * sum dS^T Q, dV = sum P^T dO; rows are keys (lane / 4 + 8 r of the warp's strip).
    // Keys past lk are not written.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + lane / 4 + 8 * r;
        if (key >= keys_valid) continue;
        float* dk_row = p.dk.at<float>(batch, blk.kv_head, n0 + key);
        float* dv_row = p.dv.at<float>(batch, blk.kv_head, n0 + key);
#pragma unroll
        for (int n = 0; n < HEAD / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = frag_col(lane, n, e);
                if (DO_DK && col < dims.d) dk_row[col] = acc_dk[DO_DK ? n : 0][2 * r + e] * scale;
                if (DO_DV && col < dims.dv) dv_row[col] = acc_dv[DO_DV ? n : 0][2 * r + e];
            }
    }
}

// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first.
// PACKED: the query blocks of packed sequences (PackedBlock), without EXTRA.
template <typename T, typename Cfg, typename Flags, bool VEC, int SPLIT, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dq_tf32(const BwdParams p) {
    static_assert(sizeof(T) == sizeof(float), "TF32 tensor cores: float32 only");
    typedef DqTf32Traits<Cfg, SPLIT, Flags::EXTRA> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, P = Tr::PITCH, WK = Tr::WARP_KEYS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw);              // Q, then its big part
    float* do_s = q_s + Tr::QD_ELEMS;                             // dO, then its big part
    float* q_small_s = do_s + Tr::QD_ELEMS;                       // SPLIT: the small parts
    float* do_small_s = q_small_s + (SPLIT ? Tr::QD_ELEMS : 0);
    float* k_s = do_small_s + (SPLIT ? Tr::QD_ELEMS : 0);         // stage i at k_s + i * KV_ELEMS
    float* v_s = k_s + 2 * Tr::KV_ELEMS;
    float* bias_s = v_s + 2 * Tr::KV_ELEMS;                       // stage i at bias_s + i * BIAS_ELEMS (EXTRA)

    const AttnDims& dims = p.dims;
    static_assert(!PACKED || !Flags::EXTRA, "packed sequences: the plain kernel");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q) : PackedBlock{};
    const QueryBlock blk = PACKED ? seq.query_block(dims, BM)
                                  : QueryBlock::from_grid<BM>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row0 = warp % Tr::STRIP_WARPS * 16;                 // this warp's first row within the block
    const int key_group = warp / Tr::STRIP_WARPS;
    const int k_first = key_group * WK;                           // this warp's first key of a step
    typedef ScoreMod<Flags, float, float, PACKED> Mod;   // PACKED: the sequence's own counts (PER_SEQ)
    const Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, p.scale_log2_f, blk.head);
        else return Mod(p.mask, dims, p.scale_log2_f, blk.batch, blk.head);
    }();
    const float x_per_s = mod.x_per_score();
    const TileRange keys = mod.key_tiles(blk.m0, blk.rows, BN);

    auto load_kv = [&](int j, int stage) {
        QueryBlock kv_block = blk;
        if constexpr (PACKED) kv_block.batch = seq.k_start;   // K and V rows from the sequence's first key
        load_kv_tile<float, BM, BN, HEAD, P, Tr::BIAS_PITCH, Tr::THREADS, VEC, Tr::KV_ELEMS, Tr::BIAS_ELEMS, false,
                     PACKED>(k_s, v_s, bias_s, stage, p, kv_block, mod.has_bias(), j * BN, PACKED ? mod.lk : dims.lk);
        cp_async_commit();
    };
    auto next_tile = [&](int j) { return mod.next_key_tile(j, keys.end, blk.m0, blk.rows, BN); };

    // This lane's rows' statistics, rows row0 + lane / 4 + 8 r (rows past lq: lse_log2 = +inf, so P = 0).
    float lse_log2[2], dsum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + lane / 4 + 8 * r;
        const bool valid = row < blk.rows;
        lse_log2[r] = valid ? lse_to_log2(*p.lse.at<const float>(blk.batch, blk.head, blk.m0 + row)) : pos_inf<float>();
        dsum[r] = valid ? *p.dsum.at<const float>(blk.batch, blk.head, blk.m0 + row) : 0.0f;
    }
    float acc_dq[HEAD / 8][4];
    zero_frags(acc_dq);

    int j = next_tile(keys.begin);
    if (j < keys.end) {
        load_row_tiles<float, BM, HEAD, P, Tr::THREADS, VEC>(q_s, p.q, dims.d, do_s, p.dout, dims.dv, blk.batch,
                                                             blk.head, blk.m0, blk.rows);
        load_kv(j, 0);
        // Q and dO are split once, before the loop (the first K/V tile arrives meanwhile);
        // the loop's first __syncthreads publishes the split.
        cp_async_wait<0>();
        __syncthreads();
        split_tile<SPLIT, BM, HEAD, P, Tr::THREADS>(q_s, q_small_s);
        split_tile<SPLIT, BM, HEAD, P, Tr::THREADS>(do_s, do_small_s);
    }
    for (int stage = 0; j < keys.end; stage ^= 1) {
        const int next = next_tile(j + 1);
        prefetch_next_step<2>(next, keys.end, stage, load_kv);   // the next visible tile into the other stage
        __syncthreads();
        const float* k_tile = k_s + stage * Tr::KV_ELEMS;
        float s[WK / 8][4], dp[WK / 8][4];   // this warp's 16 rows x WK keys
        zero_frags(s);
        zero_frags(dp);
        warp_gemm_qk_tf32<SPLIT, 1, WK, HEAD, P>(one_strip(s), q_s + row0 * P, q_small_s + row0 * P,
                                                 k_tile + k_first * P, lane);                // S = Q K^T
        warp_gemm_qk_tf32<SPLIT, 1, WK, HEAD, P>(one_strip(dp), do_s + row0 * P, do_small_s + row0 * P,
                                                 v_s + stage * Tr::KV_ELEMS + k_first * P, lane);   // dP = dO V^T
        const int n0 = j * BN + k_first;     // this warp's first key
        const bool partial = mod.tile_is_partial(blk.m0 + row0, 16, n0, WK);
        auto coord = [&](int n, int i, int& row, int& col) {
            row = blk.m0 + row0 + frag_row(lane, i);
            col = n0 + frag_col(lane, n, i);
        };
        if constexpr (Flags::EXTRA) {
            if (mod.has_bias())   // this warp's rows of the bias tile
                scale_add_bias_frags_f32<WK, Tr::BIAS_PITCH>(s, bias_s + stage * Tr::BIAS_ELEMS + row0 * Tr::BIAS_PITCH
                                                                    + k_first, lane, mod.scale_log2);
            apply_score_mod(s, mod, partial, coord);
        } else if (partial) {
            mask_partial_strip(s, mod, blk.m0 + row0 + lane / 4, n0 + 2 * (lane % 4));
        }
#pragma unroll
        for (int n = 0; n < WK / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; i += 2) {   // elements i, i + 1: one row, keys col and col + 1 (one Philox draw)
                float keep0 = 1.0f, keep1 = 1.0f;
                int row = 0, col = 0;
                if (mod.has_dropout() || USER_SCORE) coord(n, i, row, col);
                if (mod.has_dropout()) mod.keep2(row, col, keep0, keep1);
                mod.template prob_and_dscore_at<false>(s[n][i], dp[n][i], lse_log2[i / 2], dsum[i / 2], keep0,
                                                       x_per_s, row, col);   // dp: dS
                mod.template prob_and_dscore_at<false>(s[n][i + 1], dp[n][i + 1], lse_log2[i / 2], dsum[i / 2], keep1,
                                                       x_per_s, row, col + 1);
            }
        warp_gemm_pv_tf32<SPLIT, 1, HEAD, WK, P>(one_strip(acc_dq), one_strip(dp), k_tile + k_first * P,
                                                 lane);                                      // dQ += dS K
        __syncthreads();   // the next iteration's prefetch overwrites this stage
        j = next;
    }
    if constexpr (Tr::KEY_GROUPS > 1)   // the K / V stages are free after the last step
        if (!sum_over_warp_groups<Tr::KEY_GROUPS, Tr::STRIP_WARPS, true, false>(k_s, acc_dq, acc_dq, key_group,
                                                                               warp % Tr::STRIP_WARPS, lane))
            return;

    // dQ = scale sum dS K. Rows past lq are not written.
    const float scale = float(p.scale);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + lane / 4 + 8 * r;
        if (row >= blk.rows) continue;
        float* dq_row = p.dq.at<float>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
        for (int n = 0; n < HEAD / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = frag_col(lane, n, e);
                if (col < dims.d) dq_row[col] = acc_dq[n][2 * r + e] * scale;
            }
    }
}
