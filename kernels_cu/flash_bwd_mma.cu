// flash_bwd_mma.cu -- attention backward on tensor cores (float16 / bfloat16, head dim <= 128).
//
// The math is flash_bwd_fma.cu's (see there); here every product runs on mma.sync
// with fp32 accumulation, and P, dS enter the second GEMMs as 16-bit values.
//
// flash_bwd_dkdv_mma: one CTA (WARPS warps) per (key block of BN, K/V head, batch).
// Warp w owns KEY_STRIPS strips of 16 keys (WARP_KEYS = 16 KEY_STRIPS keys from
// key0), so it computes the *transposed* score tiles
//     S^T = K_j Q_i^T,  dP^T = V_j dO_i^T              (WARP_KEYS keys x WARP_QUERIES queries)
// whose rows of P^T and dS^T are the A operands of
//     dV_j += P^T dO_i,  dK_j += dS^T Q_i.
// In all four GEMMs an operand fragment loaded from shared memory is the B operand
// of KEY_STRIPS MMAs (warp_gemm_strips): with two strips a warp issues twice the
// MMAs per ldmatrix of the one-strip layout, which is bound by shared-memory loads.
// Two layouts (QSPLIT, the variant table's Tile.query_split):
//   QSPLIT 1: each warp forms S^T for all BM queries of the step and accumulates all
//     HEAD columns of dK / dV for its keys: P^T and dS^T go from registers straight
//     into the dV / dK GEMMs (head dim 128: 16 keys a warp, 128 accumulators a thread).
//   QSPLIT 2: two warps share each key strip (FlashAttention-2's backward layout,
//     transposed): warp (key group g, half h) forms S^T for the step's queries
//     [h BM/2, (h + 1) BM/2) and accumulates dK / dV columns [h HEAD/2, (h + 1) HEAD/2).
//     P^T and dS^T go through shared memory ([key][query]), since each half needs
//     its partner's queries: at head dim 128 a warp then owns 32 keys (two strips)
//     in the same 128 accumulators, and each fragment it loads feeds twice the MMAs.
// dQ_i += dS K_j needs dS with queries as rows: each warp stores its dS^T
// fragments key-major (two queries of one key in one 32-bit store), the dQ GEMM
// reads them back transposed by ldmatrix.trans, and the warps split the BM x HEAD
// product; results are added to an fp32 accumulator with atomics (ATOMIC_DQ). That
// accumulator is laid out in 16 x 8 fragment tiles (atomics.cuh, dq_tile): a lane's four
// values of a C fragment are adjacent, so each fragment is one 16-byte reduction a lane
// and 512 contiguous bytes a warp, with no per-element test (the host pads the tiles to
// whole steps of rows and HEAD columns); flash_bwd_convert_dq reads them back.
// With LATE_COPIES (Tile.late_copies) the next step's Q / dO copies are issued after this
// step's S^T GEMM instead of before its first barrier, off the path into the MMAs.
//
// flash_bwd_dq_mma: the deterministic dQ. One CTA per (query block of 64, head,
// batch); warp w owns query rows 16w..16w+15 and walks the key blocks in order:
//     S = Q_i K_j^T, dP = dO_i V_j^T, dS = P (dP - Dsum), dQ_i += dS K_j.
//
// dbias is not formed here: flash_bwd_dbias.cu has a kernel of its own for it.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "atomics.cuh"

// dK/dV kernel: BN keys per CTA (KEY_STRIPS strips of 16 per warp, QSPLIT warps per
// strip), BM queries per step, Q/dO tiles STAGES deep; dS^T (keys x queries) in shared
// memory where dQ is formed here or QSPLIT > 1, P^T beside it where QSPLIT > 1. With
// EXTRA each Q/dO stage has the step's bias tile ([query][key], pitch BN + 8) beside
// it, loaded with it.
template <typename T, typename Cfg, bool ATOMIC_DQ, bool EXTRA, int QSPLIT>
struct DkdvMmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int STAGES = Cfg::STAGES, THREADS = 32 * WARPS;
    static constexpr int KEY_GROUPS = WARPS / QSPLIT;            // warps with distinct keys
    static constexpr int KEY_STRIPS = BN / (16 * KEY_GROUPS);   // the variant table's block_n says how many
    static constexpr int WARP_KEYS = 16 * KEY_STRIPS;
    static constexpr int WARP_QUERIES = BM / QSPLIT;            // S^T / dP^T columns a warp forms
    static constexpr int WARP_COLS = HEAD / QSPLIT;             // dK / dV columns a warp accumulates
    static constexpr bool PT_SHARED = QSPLIT > 1;               // P^T, dS^T through shared memory
    static constexpr int PITCH = HEAD + 8;         // padded rows: conflict-free ldmatrix
    // dS^T (and P^T) as [key][query], pitch BM + 8 (16 bytes of padding): the 8 keys of one
    // fragment store and the 8 rows of one ldmatrix (.trans) fall in distinct banks.
    static constexpr int DS_PITCH = BM + 8;
    static constexpr int DS_ELEMS = (ATOMIC_DQ || PT_SHARED) ? BN * DS_PITCH : 0;
    static constexpr int PT_ELEMS = PT_SHARED ? BN * DS_PITCH : 0;
    static constexpr int BIAS_PITCH = BN + 8;
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    // dQ = dS K: row groups of DQ_STRIPS 16-row strips x Q_SPLIT column blocks, one per
    // warp, formed DQ_CHUNK columns at a time (DQ_STRIPS x 16 fp32 registers of partial
    // product at most). Two strips a warp where the step has the rows (QSPLIT 2's 64-query
    // steps): each K fragment then feeds two MMAs.
    static constexpr int DQ_STRIPS = QSPLIT;
    static constexpr int Q_SPLIT = WARPS / (BM / (16 * DQ_STRIPS));
    static constexpr int DQ_COLS = HEAD / Q_SPLIT;
    static constexpr int DQ_CHUNK = DQ_COLS < 32 ? DQ_COLS : 32;
    static constexpr int SMEM_BYTES = ((2 * BN + 2 * STAGES * BM) * PITCH + DS_ELEMS + PT_ELEMS + STAGES * BIAS_ELEMS)
                                      * int(sizeof(T)) + STAGES * 2 * BM * int(sizeof(float));
    static_assert(HEAD % (16 * QSPLIT) == 0 && BM % (16 * QSPLIT) == 0, "tile shape");
    static_assert(WARPS % (BM / (16 * DQ_STRIPS)) == 0, "dQ row groups");
    static_assert(DQ_COLS % DQ_CHUNK == 0 && DQ_CHUNK % 16 == 0, "dQ column blocks of whole 16-column groups");
    static_assert(BN == WARP_KEYS * KEY_GROUPS && (KEY_STRIPS == 1 || KEY_STRIPS == 2), "one or two 16-key strips a warp");
    static_assert(QSPLIT == 1 || QSPLIT == 2, "one or two warps a key strip");
    static_assert(QSPLIT == 1 || !EXTRA, "the EXTRA code keeps the one-warp-a-strip layout");
    static_assert(STAGES == 1 || STAGES == 2, "Q/dO tiles are single or double buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Deterministic dQ kernel: BM query rows per CTA (16 per warp), BN keys per step;
// with EXTRA the step's bias tile ([query][key], pitch BN + 8) beside K/V.
template <typename T, typename Cfg, bool EXTRA>
struct DqMmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int PITCH = HEAD + 8;
    static constexpr int BIAS_PITCH = BN + 8;
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;
    static constexpr int SMEM_BYTES = ((2 * BN + 2 * BM) * PITCH + BIAS_ELEMS) * int(sizeof(T))
                                      + 2 * BM * int(sizeof(float));
    static_assert(HEAD % 16 == 0 && BN % 16 == 0, "tile shape");
    static_assert(BM == 16 * WARPS, "each warp owns 16 query rows");
    static_assert(Cfg::STAGES == 1, "single-buffered K/V");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// PASS: 0 computes dK and dV together; where their accumulators and the score
// tiles do not fit the registers together (head dim 128 with one warp a strip and
// 64-query steps), the launch splits them: PASS 1 = dV only, PASS 2 = dK (and dQ)
// only, each recomputing S^T (one extra GEMM, no spills; cuflash/_dispatch/tables.py,
// _dkdv_passes). QSPLIT: the layout (header comment).
// Grid: ceil(Lk / BN) x Hk x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), key block 0 (the most causal work) first.
// PACKED: the key blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), each with its
// sequence's own query and key counts; without EXTRA or dQ atomics.
template <typename T, typename Cfg, typename Flags, int PASS, bool ATOMIC_DQ, bool VEC, int QSPLIT = 1,
          bool LATE_COPIES = false, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dkdv_mma(const BwdParams p) {
    typedef DkdvMmaTraits<T, Cfg, ATOMIC_DQ, Flags::EXTRA, QSPLIT> Tr;
    constexpr int BN = Tr::BN, BM = Tr::BM, HEAD = Tr::HEAD, P = Tr::PITCH, M = Tr::KEY_STRIPS;
    constexpr int WQ = Tr::WARP_QUERIES, WC = Tr::WARP_COLS;
    constexpr bool DO_DV = PASS != 2, DO_DK = PASS != 1;
    static_assert(DO_DK || !ATOMIC_DQ, "dQ needs dS, which the dV-only pass does not form");
    static_assert(PASS == 0 || !Tr::PT_SHARED, "the shared-strip layout forms dK and dV in one pass");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + BN * P;
    T* q_stages = v_s + BN * P;                               // STAGES x [BM][P]
    T* do_stages = q_stages + Tr::STAGES * BM * P;            // STAGES x [BM][P]
    T* ds_s = do_stages + Tr::STAGES * BM * P;                // dS^T as [key][query] (ATOMIC_DQ or PT_SHARED)
    T* pt_s = ds_s + Tr::DS_ELEMS;                            // P^T as [key][query] (PT_SHARED)
    T* bias_stages = pt_s + Tr::PT_ELEMS;                     // STAGES x [BM][BIAS_PITCH] (EXTRA)
    // STAGES x [lse | Dsum] of BM rows, raw (copy_row_stats_async: with the step's Q / dO)
    float* stat_stages = reinterpret_cast<float*>(bias_stages + Tr::STAGES * Tr::BIAS_ELEMS);

    const AttnDims& dims = p.dims;
    static_assert(!PACKED || !(Flags::EXTRA || ATOMIC_DQ), "packed sequences: the plain kernel, dQ apart");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q / dims.group) : PackedBlock{};
    const KeyBlock blk = PACKED ? seq.key_block(dims, BN)
                                : KeyBlock::from_grid<BN>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int n0 = blk.n0, kv_head = blk.kv_head, batch = blk.batch, keys_valid = blk.keys;
    const int q_batch = PACKED ? seq.q_start : batch;   // the query side's batch index (packed: its first row)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float scale = float(p.scale);
    typedef ScoreMod<Flags, float, T, PACKED> Mod;
    const float scale_log2 = acc_param<float>(p.scale_log2, p.scale_log2_f);
    Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, scale_log2, blk.first_head);
        else return Mod(p.mask, dims, scale_log2, batch, blk.first_head);
    }();
    const float x_per_s = mod.x_per_score();

    load_row_tiles<T, BN, HEAD, P, Tr::THREADS, VEC>(k_s, p.k, dims.d, v_s, p.v, dims.dv, batch, kv_head, n0, keys_valid);
    cp_async_commit();

    float acc_dk[M][WC / 8][4], acc_dv[M][WC / 8][4];   // rows: this warp's keys, strip by strip
#pragma unroll
    for (int m = 0; m < M; ++m) {
        zero_frags(acc_dk[m]);
        zero_frags(acc_dv[m]);
    }
    // This warp's keys, its step queries and its dK / dV columns within the block.
    const int half = Tr::PT_SHARED ? warp / Tr::KEY_GROUPS : 0;
    const int key0 = (Tr::PT_SHARED ? warp % Tr::KEY_GROUPS : warp) * Tr::WARP_KEYS;
    const int q0 = half * WQ, c0 = half * WC;
    // dS^T's (and P^T's) 32-bit store of (key row r of the fragment, queries q0 + 2t, q0 + 2t + 1),
    // t = lane % 4, for strip m and n8 query tile n is at ds_lane + (16 m + 8 r) * DS_PITCH + 8 n.
    T* ds_lane = ds_s + (key0 + lane / 4) * Tr::DS_PITCH + q0 + 2 * (lane % 4);
    T* pt_lane = ds_lane + Tr::DS_ELEMS;   // (pt_s's)
    // Steps walk (query head of the group, query block) pairs over the query
    // blocks that can see this key block.
    const KeyBlockSteps<BM> steps(mod, blk);
    constexpr bool LATE = LATE_COPIES && Tr::STAGES == 2;
    auto issue_query_block = [&](const StepCursor& at, int stage) {
        const int head = at.head, m0 = steps.m0(at.block);
        const int rows = imin(BM, (PACKED ? mod.lq : dims.lq) - m0);   // the sequence's own count if packed
        load_tile_fixed_col<T, BM, HEAD, P, Tr::THREADS, VEC>(q_stages + stage * BM * P, p.q.at<const T>(q_batch, head, m0),
                                                              p.q.row_stride, rows, dims.d);
        load_tile_fixed_col<T, BM, HEAD, P, Tr::THREADS, VEC>(do_stages + stage * BM * P,
                                                              p.dout.at<const T>(q_batch, head, m0), p.dout.row_stride,
                                                              rows, dims.dv);
        if (mod.has_bias())   // (mod.head is the current step's here, not this one's: head is passed on)
            load_score_tile<T, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_stages + stage * Tr::BIAS_ELEMS, p.mask.bias,
                                                                   batch, head, m0, n0, imin(BM, dims.lq - m0),
                                                                   keys_valid);
        copy_row_stats_async<BM, Tr::THREADS>(stat_stages + stage * 2 * BM, p.lse, p.dsum, q_batch, head, m0, rows);
        cp_async_commit();
    };
    StepCursor cur = StepCursor::first(steps).next_visible(steps, mod, blk, true);
    if (cur.t < steps.count) issue_query_block(cur, 0);
#pragma unroll 1
    for (int stage = 0; cur.t < steps.count;) {
        const StepCursor next = cur.after(steps).next_visible(steps, mod, blk, true);
        const int head = cur.head, m0 = steps.m0(cur.block);
        mod.head = head;
        if constexpr (LATE) {
            cp_async_wait<0>();
        } else {
            prefetch_next_step<Tr::STAGES>(next.t, steps.count, stage,   // the next block meanwhile
                                           [&](int, int into) { issue_query_block(next, into); });
        }
        __syncthreads();
        const float* stats = stat_stages + stage * 2 * BM;
        const T* q_s = q_stages + stage * BM * P;
        const T* do_s = do_stages + stage * BM * P;
        float st[M][WQ / 8][4], dpt[M][WQ / 8][4];          // S^T, dP^T: WARP_KEYS keys x WQ queries
#pragma unroll
        for (int m = 0; m < M; ++m) {
            zero_frags(st[m]);
            zero_frags(dpt[m]);
        }
        warp_gemm_strips_smem<T, M, WQ, HEAD, P, P, false>(st, k_s + key0 * P, q_s + q0 * P, lane);    // S^T = K Q^T
        if constexpr (LATE) {   // stage ^ 1 is free: every warp is past the previous step (the barrier above)
            if (next.t < steps.count) issue_query_block(next, stage ^ 1);
        }
        if (DO_DK)
            warp_gemm_strips_smem<T, M, WQ, HEAD, P, P, false>(dpt, v_s + key0 * P, do_s + q0 * P, lane);   // dP^T = V dO^T
        // Rows of these tiles are keys, columns queries; the mask is decided for this warp's keys.
        const bool partial = mod.tile_is_partial(m0 + q0, WQ, n0 + key0, Tr::WARP_KEYS);
        unsigned kept[M];   // EXTRA with dropout: each strip's keep bits (drop_factor)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            kept[m] = 0u;
            if constexpr (Flags::EXTRA) {
                auto coord = [&](int n, int i, int& row, int& col) {
                    row = m0 + frag_col(lane, n, i);
                    col = n0 + key0 + 16 * m + frag_row(lane, i);
                };
                // The bias tile is [query][key]; read transposed, it lands in S^T's fragments.
                if (mod.has_bias())
                    scale_add_bias_frags<T, BM, Tr::BIAS_PITCH, true>(st[m], bias_stages + stage * Tr::BIAS_ELEMS + key0
                                                                      + 16 * m, lane, mod.scale_log2);
                // The per-element tests and the Philox draws in loops, once a step, outside the
                // probability loop below (as flash_bwd_tf32.cu: unrolled there, they cost the
                // float32 kernel instruction-cache misses).
                apply_score_mod_bits(st[m], mod, partial, coord);
                if (mod.has_dropout()) kept[m] = dropout_frag_bits_t<BM / 8>(mod, m0, n0 + key0 + 16 * m, lane);
            } else if (partial) {
                mask_partial_strip_t<WQ>(st[m], mod, n0 + key0 + 16 * m + lane / 4, m0 + q0 + 2 * (lane % 4));
            }
        }
        // P^T and dS^T in 16 bits (pack_frags' layout), the A operands of dV += P^T dO and
        // dK += dS^T Q: rounded once, as formed, at half the registers of fp32.
        unsigned pt16[M][WQ / 8][2], dst16[M][WQ / 8][2];
#pragma unroll
        for (int n = 0; n < WQ / 8; ++n) {
            // This lane's columns of tile n are queries 2t, 2t + 1: each stat pair in one
            // 8-byte load, for all strips. The EXTRA kernels (251-255 registers) load each
            // stat where it is used: the pairs' longer live ranges spill there.
            float lse_log2[2], dsum[2];
            if constexpr (!Flags::EXTRA) stat_pair_of<BM>(stats, q0 + frag_col(lane, n, 0), lse_log2, dsum);
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = frag_col(lane, n, i);
                    const float keep = drop_factor(mod, kept[m], n, i);
                    if constexpr (Flags::EXTRA) {   // (x_per_s is 1 there: ScoreMod::scores_stay_raw)
                        float lse_row, dsum_row;
                        stat_of<BM>(stats, row, lse_row, dsum_row);
                        mod.template prob_and_dscore_at<DO_DK>(st[m][n][i], dpt[m][n][i], lse_row, dsum_row, keep,
                                                               1.0f, m0 + row, n0 + key0 + 16 * m + frag_row(lane, i));
                    } else {
                        mod.template prob_and_dscore_at<DO_DK>(st[m][n][i], dpt[m][n][i], lse_log2[i % 2], dsum[i % 2],
                                                               keep, x_per_s, m0 + row,
                                                               n0 + key0 + 16 * m + frag_row(lane, i));
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {   // fragment row r: key 16 m + lane / 4 + 8 r
                    pt16[m][n][r] = pack2<T>(st[m][n][2 * r], st[m][n][2 * r + 1]);
                    dst16[m][n][r] = pack2<T>(dpt[m][n][2 * r], dpt[m][n][2 * r + 1]);
                    const int at = (16 * m + 8 * r) * Tr::DS_PITCH + 8 * n;
                    if (ATOMIC_DQ || Tr::PT_SHARED) *reinterpret_cast<unsigned*>(ds_lane + at) = dst16[m][n][r];
                    if (Tr::PT_SHARED) *reinterpret_cast<unsigned*>(pt_lane + at) = pt16[m][n][r];
                }
            }
        }
        if constexpr (Tr::PT_SHARED) {
            // Both halves' P^T and dS^T rows are in shared memory: A operands of BM queries. (A warp's
            // own half from its registers saves a sixth of its ldmatrix but spills 12-24 bytes.)
            __syncthreads();
            warp_gemm_strips_smem<T, M, WC, BM, Tr::DS_PITCH, P, true>(acc_dv, pt_s + key0 * Tr::DS_PITCH,
                                                                       do_s + c0, lane);   // dV += P^T dO
            warp_gemm_strips_smem<T, M, WC, BM, Tr::DS_PITCH, P, true>(acc_dk, ds_s + key0 * Tr::DS_PITCH,
                                                                       q_s + c0, lane);    // dK += dS^T Q
        } else {
            if (DO_DV) warp_gemm_strips_rn16<T, M, HEAD, BM, P>(acc_dv, pt16, do_s, lane);    // dV += P^T dO
            if (DO_DK) warp_gemm_strips_rn16<T, M, HEAD, BM, P>(acc_dk, dst16, q_s, lane);    // dK += dS^T Q
        }
        if (ATOMIC_DQ) {                                         // dQ += dS K (scaled as it is converted)
            if (!Tr::PT_SHARED) __syncthreads();                 // (PT_SHARED: dS^T is complete above)
            constexpr int S = Tr::DQ_STRIPS;
            const int group = warp / Tr::Q_SPLIT;                // rows [16 S group, 16 S (group + 1))
            // This lane's slot in the fragment tile of the group's first rows, column 0 (atomics.cuh).
            float* tiles = p.dq_acc.at<float>(batch, head, m0) + dq_tile<HEAD>(16 * S * group, 0) + 4 * lane;
            if (16 * S * group < dims.lq - m0)                   // (a ragged step's padding rows add nothing)
#pragma unroll
                for (int c = 0; c < Tr::DQ_COLS / Tr::DQ_CHUNK; ++c) {
                    const int col0 = (warp % Tr::Q_SPLIT) * Tr::DQ_COLS + c * Tr::DQ_CHUNK;
                    float part[S][Tr::DQ_CHUNK / 8][4];
#pragma unroll
                    for (int m = 0; m < S; ++m) zero_frags(part[m]);
                    // A = dS, this group's queries: columns [16 S group, 16 S (group + 1)) of dS^T.
                    warp_gemm_strips_smem_t<T, S, Tr::DQ_CHUNK, BN, Tr::DS_PITCH, P, true>(part, ds_s + group * 16 * S,
                                                                                          k_s + col0, lane);
#pragma unroll
                    for (int m = 0; m < S; ++m)
#pragma unroll
                        for (int n = 0; n < Tr::DQ_CHUNK / 8; ++n)   // one fragment, one 16-byte reduction a lane
                            red_add4(tiles + dq_tile<HEAD>(16 * m, col0 + 8 * n), part[m][n][0], part[m][n][1],
                                     part[m][n][2], part[m][n][3]);
                }
        }
        // This stage and the row stats are read (and with PT_SHARED, P^T and dS^T).
        end_of_step_barrier<ATOMIC_DQ && !Tr::PT_SHARED>();
        cur = next;
        if (Tr::STAGES == 2) stage ^= 1;
        else if (cur.t < steps.count) issue_query_block(cur, 0);
    }

    // dK = scale * sum dS^T Q, dV = sum P^T dO; rows are keys. Keys past lk are not written.
    // One row pointer per fragment row (key lane / 4 + 8 r of strip m), not per element:
    // at head dim 128 the per-element address arithmetic spills on sm_80. The block is formed
    // again here: the d=64 kernels spill its K/V head and keys, held across the loop for this.
    const KeyBlock out = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q / dims.group).key_block(dims, BN)
                                : KeyBlock::from_index<BN>(dims, block_index_reread(),
                                                           shared_scores_head_group<Flags::EXTRA>(p.mask));
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 16 * m + lane / 4 + 8 * r;
            if (key >= out.keys) continue;
            T* dk_row = p.dk.at<T>(out.batch, out.kv_head, out.n0 + key);
            T* dv_row = p.dv.at<T>(out.batch, out.kv_head, out.n0 + key);
#pragma unroll
            for (int n = 0; n < WC / 8; ++n) {
                const int col = c0 + frag_col(lane, n, 0);
                if (DO_DK)
                    store_out_pair<VEC>(dk_row, col, dims.d, acc_dk[m][n][2 * r] * scale,
                                        acc_dk[m][n][2 * r + 1] * scale);
                if (DO_DV) store_out_pair<VEC>(dv_row, col, dims.dv, acc_dv[m][n][2 * r], acc_dv[m][n][2 * r + 1]);
            }
        }
}

// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first.
// PACKED: the query blocks of packed sequences (PackedBlock), without EXTRA.
template <typename T, typename Cfg, typename Flags, bool VEC, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dq_mma(const BwdParams p) {
    typedef DqMmaTraits<T, Cfg, Flags::EXTRA> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, P = Tr::PITCH;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + BN * P;
    T* q_s = v_s + BN * P;
    T* do_s = q_s + BM * P;
    T* bias_s = do_s + BM * P;                   // [BM][BIAS_PITCH] (EXTRA)
    float* lse_s = reinterpret_cast<float*>(bias_s + Tr::BIAS_ELEMS);
    float* dsum_s = lse_s + BM;

    const AttnDims& dims = p.dims;
    static_assert(!PACKED || !Flags::EXTRA, "packed sequences: the plain kernel");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q) : PackedBlock{};
    const QueryBlock blk = PACKED ? seq.query_block(dims, BM)
                                  : QueryBlock::from_grid<BM>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int m0 = blk.m0, head = blk.head, batch = blk.batch, kv_head = blk.kv_head, rows_valid = blk.rows;
    const int kv_batch = PACKED ? seq.k_start : batch;   // K and V's batch index (packed: the first key)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row0 = warp * 16;
    typedef ScoreMod<Flags, float, T, PACKED> Mod;
    const float scale_log2 = acc_param<float>(p.scale_log2, p.scale_log2_f);
    const Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, scale_log2, head);
        else return Mod(p.mask, dims, scale_log2, batch, head);
    }();
    const float x_per_s = mod.x_per_score();

    load_row_tiles<T, BM, HEAD, P, Tr::THREADS, VEC>(q_s, p.q, dims.d, do_s, p.dout, dims.dv, batch, head, m0, rows_valid);
    cp_async_commit();
    load_row_stats<BM, Tr::THREADS>(lse_s, dsum_s, p.lse, p.dsum, batch, head, m0, rows_valid);

    float acc_dq[HEAD / 8][4];
    zero_frags(acc_dq);
    const TileRange keys = mod.key_tiles(m0, rows_valid, BN);
    for (int j = mod.next_key_tile(keys.begin, keys.end, m0, rows_valid, BN); j < keys.end;
         j = mod.next_key_tile(j + 1, keys.end, m0, rows_valid, BN)) {
        const int n0 = j * BN;
        __syncthreads();
        load_row_tiles<T, BN, HEAD, P, Tr::THREADS, VEC>(k_s, p.k, dims.d, v_s, p.v, dims.dv, kv_batch, kv_head, n0,
                                                         imin(BN, (PACKED ? mod.lk : dims.lk) - n0));
        if (mod.has_bias())
            load_score_tile<T, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_s, p.mask.bias, batch, head, m0, n0, rows_valid,
                                                                   dims.lk - n0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[BN / 8][4], dp[BN / 8][4];
        zero_frags(s);
        zero_frags(dp);
        warp_gemm_nt<T, BN, HEAD, P, P>(s, q_s + row0 * P, k_s, lane);     // S = Q K^T
        warp_gemm_nt<T, BN, HEAD, P, P>(dp, do_s + row0 * P, v_s, lane);   // dP = dO V^T
        auto coord = [&](int n, int i, int& row, int& col) {
            row = m0 + row0 + frag_row(lane, i);
            col = n0 + frag_col(lane, n, i);
        };
        if (mod.has_bias())   // this warp's rows of the bias tile
            scale_add_bias_frags<T, BN, Tr::BIAS_PITCH, false>(s, bias_s + row0 * Tr::BIAS_PITCH, lane, mod.scale_log2);
        apply_score_mod(s, mod, mod.tile_is_partial(m0 + row0, 16, n0, BN), coord);
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; i += 2) {   // elements i, i + 1: one row, keys col and col + 1
                const int row = row0 + frag_row(lane, i);
                float keep0 = 1.0f, keep1 = 1.0f;
                const int col = n0 + frag_col(lane, n, i);
                if (mod.has_dropout()) mod.keep2(m0 + row, col, keep0, keep1);
                mod.template prob_and_dscore_at<false>(s[n][i], dp[n][i], lse_s[row], dsum_s[row], keep0, x_per_s,
                                                       m0 + row, col);
                mod.template prob_and_dscore_at<false>(s[n][i + 1], dp[n][i + 1], lse_s[row], dsum_s[row], keep1,
                                                       x_per_s, m0 + row, col + 1);
            }
        warp_gemm_rn<T, HEAD, BN, P>(acc_dq, dp, k_s, lane);              // dQ += dS K
    }
#pragma unroll
    for (int n = 0; n < HEAD / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + frag_row(lane, i), col = frag_col(lane, n, i);
            if (row < rows_valid && col < dims.d)
                p.dq.at<T>(batch, head, m0 + row)[col] = from_acc<T>(acc_dq[n][i] * float(p.scale));
        }
}
