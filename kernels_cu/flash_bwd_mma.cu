// flash_bwd_mma.cu -- attention backward on tensor cores (float16 / bfloat16, head dim <= 128).
//
// The math is flash_bwd_fma.cu's (see there); here every product runs on mma.sync
// with fp32 accumulation, and P, dS enter the second GEMMs as 16-bit values.
//
// flash_bwd_dkdv_mma: one CTA (WARPS warps) per (key block of BN, K/V head, batch).
// Warp w owns KEY_STRIPS strips of 16 keys (WARP_KEYS = 16 KEY_STRIPS keys from
// key0 = w WARP_KEYS), so it computes the *transposed* score tiles
//     S^T = K_j Q_i^T,  dP^T = V_j dO_i^T              (WARP_KEYS keys x BM queries)
// and its rows of P^T and dS^T are exactly the A operands of
//     dV_j += P^T dO_i,  dK_j += dS^T Q_i               (straight from registers).
// In all four GEMMs a Q or dO fragment loaded from shared memory is the B operand
// of KEY_STRIPS MMAs (warp_gemm_strips): with two strips a warp issues twice the
// MMAs per ldmatrix of the one-strip layout, which was bound by shared-memory loads.
// dQ_i += dS K_j needs dS with queries as rows: each warp stores its dS^T
// fragments key-major (two queries of one key in one 32-bit store), the dQ GEMM
// reads them back transposed by ldmatrix.trans, and the warps split the BM x HEAD
// product; results are added to an fp32 accumulator with atomics (ATOMIC_DQ), two
// columns per vector reduction on sm_90 (atomics.cuh).
//
// flash_bwd_dq_mma: the deterministic dQ. One CTA per (query block of 64, head,
// batch); warp w owns query rows 16w..16w+15 and walks the key blocks in order:
//     S = Q_i K_j^T, dP = dO_i V_j^T, dS = P (dP - Dsum), dQ_i += dS K_j.
//
// dbias is not formed here: flash_bwd_dbias.cu has a kernel of its own for it.
#include "common.cuh"
#include "params.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "atomics.cuh"

// dK/dV kernel: BN keys per CTA (KEY_STRIPS strips of 16 per warp), BM queries per
// step, Q/dO tiles STAGES deep; dS^T (keys x queries) in shared memory only when dQ
// is formed here. With EXTRA each Q/dO stage has the step's bias tile ([query][key],
// pitch BN + 8) beside it, loaded with it.
template <typename T, typename Cfg, bool ATOMIC_DQ, bool EXTRA>
struct DkdvMmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int STAGES = Cfg::STAGES, THREADS = 32 * WARPS;
    static constexpr int KEY_STRIPS = BN / (16 * WARPS);   // the variant table's block_n says how many
    static constexpr int WARP_KEYS = 16 * KEY_STRIPS;
    static constexpr int PITCH = HEAD + 8;         // padded rows: conflict-free ldmatrix
    // dS^T as [key][query], pitch BM + 8 (16 bytes of padding): the 8 keys of one
    // fragment store and the 8 rows of one ldmatrix.trans fall in distinct banks.
    static constexpr int DS_PITCH = BM + 8;
    static constexpr int DS_ELEMS = ATOMIC_DQ ? BN * DS_PITCH : 0;
    static constexpr int BIAS_PITCH = BN + 8;
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    // dQ = dS K: BM/16 row strips x Q_SPLIT column blocks, one per warp, formed
    // DQ_CHUNK columns at a time (16 fp32 registers of partial product at most).
    static constexpr int Q_SPLIT = WARPS / (BM / 16);
    static constexpr int DQ_COLS = HEAD / Q_SPLIT;
    static constexpr int DQ_CHUNK = DQ_COLS < 32 ? DQ_COLS : 32;
    static constexpr int SMEM_BYTES = ((2 * BN + 2 * STAGES * BM) * PITCH + DS_ELEMS + STAGES * BIAS_ELEMS)
                                      * int(sizeof(T)) + STAGES * 2 * BM * int(sizeof(float));
    static_assert(HEAD % 16 == 0 && BM % 16 == 0 && WARPS % (BM / 16) == 0, "tile shape");
    static_assert(DQ_COLS % DQ_CHUNK == 0 && DQ_CHUNK % 16 == 0, "dQ column blocks of whole 16-column groups");
    static_assert(BN == WARP_KEYS * WARPS && (KEY_STRIPS == 1 || KEY_STRIPS == 2), "one or two 16-key strips a warp");
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
// tiles do not fit the registers together (head dim 128), the launch splits them:
// PASS 1 = dV only, PASS 2 = dK (and dQ) only, each recomputing S^T (one extra
// GEMM, no spills; cuflash/_variants.py, _dkdv_passes).
// Grid: ceil(Lk / BN) x Hk x B CTAs (BlockInfo), key block 0 (the most causal work) first.
template <typename T, typename Cfg, typename Flags, int PASS, bool ATOMIC_DQ, bool VEC>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dkdv_mma(const BwdParams p) {
    typedef DkdvMmaTraits<T, Cfg, ATOMIC_DQ, Flags::EXTRA> Tr;
    constexpr int BN = Tr::BN, BM = Tr::BM, HEAD = Tr::HEAD, P = Tr::PITCH, M = Tr::KEY_STRIPS;
    constexpr bool DO_DV = PASS != 2, DO_DK = PASS != 1;
    static_assert(DO_DK || !ATOMIC_DQ, "dQ needs dS, which the dV-only pass does not form");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + BN * P;
    T* q_stages = v_s + BN * P;                               // STAGES x [BM][P]
    T* do_stages = q_stages + Tr::STAGES * BM * P;            // STAGES x [BM][P]
    T* ds_s = do_stages + Tr::STAGES * BM * P;                // dS^T as [key][query] (ATOMIC_DQ)
    T* bias_stages = ds_s + Tr::DS_ELEMS;                     // STAGES x [BM][BIAS_PITCH] (EXTRA)
    // STAGES x [lse | Dsum] of BM rows, raw (copy_row_stats_async: with the step's Q / dO)
    float* stat_stages = reinterpret_cast<float*>(bias_stages + Tr::STAGES * Tr::BIAS_ELEMS);

    const AttnDims& dims = p.dims;
    const KeyBlock blk = KeyBlock::from_grid<BN>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int n0 = blk.n0, kv_head = blk.kv_head, batch = blk.batch, keys_valid = blk.keys;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float scale = float(p.scale);
    ScoreMod<Flags, float, T> mod(p.mask, dims, acc_param<float>(p.scale_log2, p.scale_log2_f), batch,
                                  blk.first_head);
    const float x_per_s = mod.x_per_score();

    load_row_tiles<T, BN, HEAD, P, Tr::THREADS, VEC>(k_s, p.k, dims.d, v_s, p.v, dims.dv, batch, kv_head, n0, keys_valid);
    cp_async_commit();

    float acc_dk[M][HEAD / 8][4], acc_dv[M][HEAD / 8][4];   // rows: this warp's keys, strip by strip
#pragma unroll
    for (int m = 0; m < M; ++m) {
        zero_frags(acc_dk[m]);
        zero_frags(acc_dv[m]);
    }
    const int key0 = warp * Tr::WARP_KEYS;                   // this warp's first key within the block
    // dS^T's 32-bit store of (key row r of the fragment, queries 2t, 2t + 1), t = lane % 4,
    // for strip m and n8 query tile n is at ds_lane + (16 m + 8 r) * DS_PITCH + 8 n.
    T* ds_lane = ds_s + (key0 + lane / 4) * Tr::DS_PITCH + 2 * (lane % 4);
    // Steps walk (query head of the group, query block) pairs over the query
    // blocks that can see this key block.
    const KeyBlockSteps<BM> steps(mod, blk);
    auto issue_query_block = [&](const StepCursor& at, int stage) {
        const int head = at.head, m0 = steps.m0(at.block);
        const int rows = imin(BM, dims.lq - m0);
        load_tile_fixed_col<T, BM, HEAD, P, Tr::THREADS, VEC>(q_stages + stage * BM * P, p.q.at<const T>(batch, head, m0),
                                                              p.q.row_stride, rows, dims.d);
        load_tile_fixed_col<T, BM, HEAD, P, Tr::THREADS, VEC>(do_stages + stage * BM * P,
                                                              p.dout.at<const T>(batch, head, m0), p.dout.row_stride,
                                                              rows, dims.dv);
        if (mod.has_bias())   // (mod.head is the current step's here, not this one's: head is passed on)
            load_score_tile<T, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_stages + stage * Tr::BIAS_ELEMS, p.mask.bias,
                                                                   batch, head, m0, n0, imin(BM, dims.lq - m0),
                                                                   keys_valid);
        copy_row_stats_async<BM, Tr::THREADS>(stat_stages + stage * 2 * BM, p.lse, p.dsum, batch, head, m0, rows);
        cp_async_commit();
    };
    StepCursor cur = StepCursor::first(steps).next_visible(steps, mod, blk, true);
    if (cur.t < steps.count) issue_query_block(cur, 0);
#pragma unroll 1
    for (int stage = 0; cur.t < steps.count;) {
        const StepCursor next = cur.after(steps).next_visible(steps, mod, blk, true);
        const int head = cur.head, m0 = steps.m0(cur.block), rows_valid = imin(BM, dims.lq - m0);
        mod.head = head;
        prefetch_next_step<Tr::STAGES>(next.t, steps.count, stage,   // the next block meanwhile
                                       [&](int, int into) { issue_query_block(next, into); });
        __syncthreads();
        const float* stats = stat_stages + stage * 2 * BM;
        const T* q_s = q_stages + stage * BM * P;
        const T* do_s = do_stages + stage * BM * P;
        float st[M][BM / 8][4], dpt[M][BM / 8][4];          // S^T, dP^T: WARP_KEYS keys x BM queries
#pragma unroll
        for (int m = 0; m < M; ++m) {
            zero_frags(st[m]);
            zero_frags(dpt[m]);
        }
        warp_gemm_strips_smem<T, M, BM, HEAD, P, P, false>(st, k_s + key0 * P, q_s, lane);              // S^T = K Q^T
        if (DO_DK) warp_gemm_strips_smem<T, M, BM, HEAD, P, P, false>(dpt, v_s + key0 * P, do_s, lane);  // dP^T = V dO^T
        // Rows of these tiles are keys, columns queries; the mask is decided for this warp's keys.
        const bool partial = mod.tile_is_partial(m0, BM, n0 + key0, Tr::WARP_KEYS);
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
                mask_partial_strip_t<BM>(st[m], mod, n0 + key0 + 16 * m + lane / 4, m0 + 2 * (lane % 4));
            }
        }
        // P^T and dS^T in 16 bits (pack_frags' layout), the A operands of dV += P^T dO and
        // dK += dS^T Q: rounded once, as formed, at half the registers of fp32.
        unsigned pt16[M][BM / 8][2], dst16[M][BM / 8][2];
#pragma unroll
        for (int n = 0; n < BM / 8; ++n) {
            // This lane's columns of tile n are queries 2t, 2t + 1: each stat pair in one
            // 8-byte load, for all strips. The EXTRA kernels (251-255 registers) load each
            // stat where it is used: the pairs' longer live ranges spilled there.
            float lse_log2[2], dsum[2];
            if constexpr (!Flags::EXTRA) stat_pair_of<BM>(stats, frag_col(lane, n, 0), lse_log2, dsum);
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = frag_col(lane, n, i);
                    const float keep = drop_factor(mod, kept[m], n, i);
                    if constexpr (Flags::EXTRA) {   // (x_per_s is 1 there: ScoreMod::scores_stay_raw)
                        float lse_row, dsum_row;
                        stat_of<BM>(stats, row, lse_row, dsum_row);
                        prob_and_dscore(st[m][n][i], dpt[m][n][i], lse_row, dsum_row, keep);   // st: P^T, dpt: dS^T
                    } else
                        prob_and_dscore(st[m][n][i], dpt[m][n][i], lse_log2[i % 2], dsum[i % 2], keep, x_per_s);
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {   // fragment row r: key 16 m + lane / 4 + 8 r
                    pt16[m][n][r] = pack2<T>(st[m][n][2 * r], st[m][n][2 * r + 1]);
                    dst16[m][n][r] = pack2<T>(dpt[m][n][2 * r], dpt[m][n][2 * r + 1]);
                    if (ATOMIC_DQ)
                        *reinterpret_cast<unsigned*>(ds_lane + (16 * m + 8 * r) * Tr::DS_PITCH + 8 * n) = dst16[m][n][r];
                }
            }
        }
        if (DO_DV) warp_gemm_strips_rn16<T, M, HEAD, BM, P>(acc_dv, pt16, do_s, lane);    // dV += P^T dO
        if (DO_DK) warp_gemm_strips_rn16<T, M, HEAD, BM, P>(acc_dk, dst16, q_s, lane);    // dK += dS^T Q
        if (ATOMIC_DQ) {                                         // dQ += scale * dS K
            __syncthreads();
            const int strip = warp / Tr::Q_SPLIT;
            const int row_a = strip * 16 + lane / 4, row_b = row_a + 8;   // this lane's C-fragment rows
            float* dq_a = p.dq_acc.at<float>(batch, head, m0 + row_a);
            float* dq_b = p.dq_acc.at<float>(batch, head, m0 + row_b);
#pragma unroll
            for (int c = 0; c < Tr::DQ_COLS / Tr::DQ_CHUNK; ++c) {
                const int col0 = (warp % Tr::Q_SPLIT) * Tr::DQ_COLS + c * Tr::DQ_CHUNK;
                float part[1][Tr::DQ_CHUNK / 8][4];
                zero_frags(part[0]);
                // A = dS, this strip's queries: columns [16 strip, 16 strip + 16) of dS^T.
                warp_gemm_strips_smem_t<T, 1, Tr::DQ_CHUNK, BN, Tr::DS_PITCH, P, true>(part, ds_s + strip * 16,
                                                                                      k_s + col0, lane);
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

    // dK = scale * sum dS^T Q, dV = sum P^T dO; rows are keys. Keys past lk are not written.
    // One row pointer per fragment row (key lane / 4 + 8 r of strip m), not per element:
    // at head dim 128 the per-element address arithmetic spilled on sm_80.
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 16 * m + lane / 4 + 8 * r;
            if (key >= keys_valid) continue;
            T* dk_row = p.dk.at<T>(batch, kv_head, n0 + key);
            T* dv_row = p.dv.at<T>(batch, kv_head, n0 + key);
#pragma unroll
            for (int n = 0; n < HEAD / 8; ++n) {
                const int col = frag_col(lane, n, 0);
                if (DO_DK)
                    store_out_pair<VEC>(dk_row, col, dims.d, acc_dk[m][n][2 * r] * scale,
                                        acc_dk[m][n][2 * r + 1] * scale);
                if (DO_DV) store_out_pair<VEC>(dv_row, col, dims.dv, acc_dv[m][n][2 * r], acc_dv[m][n][2 * r + 1]);
            }
        }
}

// Grid: ceil(Lq / BM) x Hq x B CTAs (BlockInfo), longest causal query blocks first.
template <typename T, typename Cfg, typename Flags, bool VEC>
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
    const QueryBlock blk = QueryBlock::from_grid<BM>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int m0 = blk.m0, head = blk.head, batch = blk.batch, kv_head = blk.kv_head, rows_valid = blk.rows;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row0 = warp * 16;
    const ScoreMod<Flags, float, T> mod(p.mask, dims, acc_param<float>(p.scale_log2, p.scale_log2_f), batch, head);
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
        load_row_tiles<T, BN, HEAD, P, Tr::THREADS, VEC>(k_s, p.k, dims.d, v_s, p.v, dims.dv, batch, kv_head, n0,
                                                         imin(BN, dims.lk - n0));
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
                if (mod.has_dropout()) mod.keep2(m0 + row, n0 + frag_col(lane, n, i), keep0, keep1);
                prob_and_dscore(s[n][i], dp[n][i], lse_s[row], dsum_s[row], keep0, x_per_s);
                prob_and_dscore(s[n][i + 1], dp[n][i + 1], lse_s[row], dsum_s[row], keep1, x_per_s);
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
