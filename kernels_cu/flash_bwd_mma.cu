// flash_bwd_mma.cu -- attention backward on tensor cores (float16 / bfloat16, head dim <= 128).
//
// The math is flash_bwd_fma.cu's (see there); here every product runs on mma.sync
// with fp32 accumulation, and P, dS enter the second GEMMs as 16-bit values.
//
// flash_bwd_dkdv_mma: one CTA (4 warps) per (key block of BN = 64, K/V head, batch).
// Warp w owns keys 16w..16w+15, so it computes the *transposed* score tiles
//     S^T = K_j Q_i^T,  dP^T = V_j dO_i^T              (16 keys x BM queries)
// and its rows of P^T and dS^T are exactly the A operands of
//     dV_j += P^T dO_i,  dK_j += dS^T Q_i               (straight from registers).
// dQ_i += dS K_j needs dS with queries as rows, so dS^T goes through shared
// memory once and the four warps split the BM x HEAD product; results are
// added to an fp32 accumulator with atomics (ATOMIC_DQ), two columns per
// vector reduction on sm_90 (atomics.cuh).
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

// dK/dV kernel: BN keys per CTA (16 per warp), BM queries per step, Q/dO tiles
// STAGES deep; dS (queries x keys) in shared memory only when dQ is formed here.
// With EXTRA each Q/dO stage has the step's bias tile ([query][key], pitch BN + 8)
// beside it, loaded with it.
template <typename T, typename Cfg, bool ATOMIC_DQ, bool EXTRA>
struct DkdvMmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int STAGES = Cfg::STAGES, THREADS = 32 * WARPS;
    static constexpr int PITCH = HEAD + 8;         // padded rows: conflict-free ldmatrix
    static constexpr int DS_PITCH = BN + 8;
    static constexpr int DS_ELEMS = ATOMIC_DQ ? BM * DS_PITCH : 0;
    static constexpr int BIAS_PITCH = BN + 8;
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    // dQ = dS K: BM/16 row strips x Q_SPLIT column chunks, one per warp.
    static constexpr int Q_SPLIT = WARPS / (BM / 16);
    static constexpr int DQ_COLS = HEAD / Q_SPLIT;
    static constexpr int SMEM_BYTES = ((2 * BN + 2 * STAGES * BM) * PITCH + DS_ELEMS + STAGES * BIAS_ELEMS)
                                      * int(sizeof(T)) + 2 * BM * int(sizeof(float));
    static_assert(HEAD % 16 == 0 && BM % 16 == 0 && BM <= 16 * WARPS && DQ_COLS % 32 == 0, "tile shape");
    static_assert(BN == 16 * WARPS, "each warp owns 16 keys");
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

// PASS: 0 computes dK and dV together; at head dim 128 their accumulators alone
// fill 128 registers a thread, so the launch splits them: PASS 1 = dV only,
// PASS 2 = dK (and dQ) only, each recomputing S^T (one extra GEMM, no spills).
// Grid: ceil(Lk / BN) x Hk x B CTAs (BlockInfo), key block 0 (the most causal work) first.
template <typename T, typename Cfg, typename Flags, int PASS, bool ATOMIC_DQ, bool VEC>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dkdv_mma(const BwdParams p) {
    typedef DkdvMmaTraits<T, Cfg, ATOMIC_DQ, Flags::EXTRA> Tr;
    constexpr int BN = Tr::BN, BM = Tr::BM, HEAD = Tr::HEAD, P = Tr::PITCH;
    constexpr bool DO_DV = PASS != 2, DO_DK = PASS != 1;
    static_assert(DO_DK || !ATOMIC_DQ, "dQ needs dS, which the dV-only pass does not form");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + BN * P;
    T* q_stages = v_s + BN * P;                               // STAGES x [BM][P]
    T* do_stages = q_stages + Tr::STAGES * BM * P;            // STAGES x [BM][P]
    T* ds_s = do_stages + Tr::STAGES * BM * P;                // dS as [query][key] (ATOMIC_DQ)
    T* bias_stages = ds_s + Tr::DS_ELEMS;                     // STAGES x [BM][BIAS_PITCH] (EXTRA)
    float* lse_s = reinterpret_cast<float*>(bias_stages + Tr::STAGES * Tr::BIAS_ELEMS);
    float* dsum_s = lse_s + BM;

    const AttnDims& dims = p.dims;
    const KeyBlock blk = KeyBlock::from_grid<BN>(dims);
    const int n0 = blk.n0, kv_head = blk.kv_head, batch = blk.batch, keys_valid = blk.keys;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float scale = float(p.scale);
    ScoreMod<Flags, float, T> mod(p.mask, dims, acc_param<float>(p.scale_log2, p.scale_log2_f), batch,
                                  blk.first_head);
    const float x_per_s = mod.x_per_score();

    load_row_tiles<T, BN, HEAD, P, Tr::THREADS, VEC>(k_s, p.k, dims.d, v_s, p.v, dims.dv, batch, kv_head, n0, keys_valid);
    cp_async_commit();

    float acc_dk[HEAD / 8][4], acc_dv[HEAD / 8][4];
    zero_frags(acc_dk);
    zero_frags(acc_dv);
    const int key0 = warp * 16;                                // this warp's keys within the block
    // Steps walk (query head of the group, query block) pairs over the query
    // blocks that can see this key block.
    const TileRange queries = mod.query_tiles(n0, keys_valid, BM);
    const int m_blocks = imax(0, queries.end - queries.begin);
    const int n_steps = (blk.end_head - blk.first_head) * m_blocks;
    auto step_head = [&](int step) { return blk.first_head + step / m_blocks; };
    auto step_m0 = [&](int step) { return (queries.begin + step % m_blocks) * BM; };
    auto next_step = [&](int step) {   // the first step >= step whose tile is visible
        for (; step < n_steps; ++step) {
            mod.head = step_head(step);
            const int m0 = step_m0(step);
            if (mod.classify(m0, imin(BM, dims.lq - m0), n0, keys_valid) != TILE_SKIP) break;
        }
        return step;
    };
    auto issue_query_block = [&](int step, int stage) {
        const int head = step_head(step), m0 = step_m0(step);
        load_row_tiles<T, BM, HEAD, P, Tr::THREADS, VEC>(q_stages + stage * BM * P, p.q, dims.d, do_stages + stage * BM * P,
                                                         p.dout, dims.dv, batch, head, m0, imin(BM, dims.lq - m0));
        if (mod.has_bias())   // (mod.head is the current step's here, not this one's: head is passed on)
            load_score_tile<T, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_stages + stage * Tr::BIAS_ELEMS, p.mask.bias,
                                                                   batch, head, m0, n0, imin(BM, dims.lq - m0),
                                                                   keys_valid);
        cp_async_commit();
    };
    int step = next_step(0);
    if (step < n_steps) issue_query_block(step, 0);
#pragma unroll 1
    for (int stage = 0; step < n_steps;) {
        const int next = next_step(step + 1);
        const int head = step_head(step), m0 = step_m0(step), rows_valid = imin(BM, dims.lq - m0);
        mod.head = head;
        if (Tr::STAGES == 2 && next < n_steps) {   // prefetch the next block while this one computes
            issue_query_block(next, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        load_row_stats<BM, Tr::THREADS>(lse_s, dsum_s, p.lse, p.dsum, batch, head, m0, rows_valid);
        __syncthreads();
        const T* q_s = q_stages + stage * BM * P;
        const T* do_s = do_stages + stage * BM * P;
        float st[BM / 8][4], dpt[BM / 8][4];               // S^T, dP^T: 16 keys x BM queries
        zero_frags(st);
        zero_frags(dpt);
        warp_gemm_nt<T, BM, HEAD, P, P>(st, k_s + key0 * P, q_s, lane);
        if (DO_DK) warp_gemm_nt<T, BM, HEAD, P, P>(dpt, v_s + key0 * P, do_s, lane);
        // Rows of these tiles are keys, columns queries.
        auto coord = [&](int n, int i, int& row, int& col) {
            row = m0 + frag_col(lane, n, i);
            col = n0 + key0 + frag_row(lane, i);
        };
        // The bias tile is [query][key]; read transposed, it lands in S^T's fragments.
        if (mod.has_bias())
            scale_add_bias_frags<T, BM, Tr::BIAS_PITCH, true>(st, bias_stages + stage * Tr::BIAS_ELEMS + key0, lane,
                                                              mod.scale_log2);
        apply_score_mod(st, mod, mod.tile_is_partial(m0, BM, n0, BN), coord);
#pragma unroll
        for (int n = 0; n < BM / 8; ++n) {
            // This lane's columns of tile n are queries 2t, 2t + 1: each stat pair in one
            // 8-byte load. The EXTRA kernels (251-255 registers) load each stat where it is
            // used: the pairs' longer live ranges spilled there.
            FloatPair lse_log2, dsum;
            if constexpr (!Flags::EXTRA) {
                lse_log2 = load_pair(lse_s + frag_col(lane, n, 0));
                dsum = load_pair(dsum_s + frag_col(lane, n, 0));
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = frag_col(lane, n, i);
                float keep = 1.0f;
                if (mod.has_dropout()) {
                    int q_row, k_col;
                    coord(n, i, q_row, k_col);
                    keep = mod.keep(q_row, k_col);
                }
                if constexpr (Flags::EXTRA)   // (x_per_s is 1 there: ScoreMod::scores_stay_raw)
                    prob_and_dscore(st[n][i], dpt[n][i], lse_s[row], dsum_s[row], keep);   // st: P^T, dpt: dS^T
                else
                    prob_and_dscore(st[n][i], dpt[n][i], lse_log2[i % 2], dsum[i % 2], keep, x_per_s);
                if (ATOMIC_DQ) ds_s[row * Tr::DS_PITCH + key0 + frag_row(lane, i)] = from_acc<T>(dpt[n][i]);
            }
        }
        if (DO_DV) warp_gemm_rn<T, HEAD, BM, P>(acc_dv, st, do_s, lane);    // dV += P^T dO
        if (DO_DK) warp_gemm_rn<T, HEAD, BM, P>(acc_dk, dpt, q_s, lane);    // dK += dS^T Q
        if (ATOMIC_DQ) {                                         // dQ += scale * dS K
            __syncthreads();
            const int strip = warp / Tr::Q_SPLIT;
            const int row_a = strip * 16 + lane / 4, row_b = row_a + 8;   // this lane's C-fragment rows
            float* dq_a = p.dq_acc.at<float>(batch, head, m0 + row_a);
            float* dq_b = p.dq_acc.at<float>(batch, head, m0 + row_b);
            // 32 columns at a time keeps the partial product at 16 registers.
#pragma unroll
            for (int col0 = (warp % Tr::Q_SPLIT) * Tr::DQ_COLS; col0 < (warp % Tr::Q_SPLIT + 1) * Tr::DQ_COLS; col0 += 32) {
                float part[4][4];
                zero_frags(part);
                warp_gemm_nn<T, 32, BN, Tr::DS_PITCH, P>(part, ds_s + strip * 16 * Tr::DS_PITCH, k_s + col0, lane);
                // Columns col, col + 1 (col even) as one vector reduction: the host pads the
                // accumulator's rows to an even width, so col < d leaves col + 1 in the row.
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const int col = col0 + frag_col(lane, n, 0);
                    if (col >= dims.d) continue;
                    if (row_a < rows_valid) red_add2(dq_a + col, part[n][0] * scale, part[n][1] * scale);
                    if (row_b < rows_valid) red_add2(dq_b + col, part[n][2] * scale, part[n][3] * scale);
                }
            }
        }
        __syncthreads();   // this stage, the row stats and dS are read; the next step may overwrite them
        step = next;
        if (Tr::STAGES == 2) stage ^= 1;
        else if (step < n_steps) issue_query_block(step, 0);
    }

    // dK = scale * sum dS^T Q, dV = sum P^T dO; rows are keys. Keys past lk are not written.
#pragma unroll
    for (int n = 0; n < HEAD / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = key0 + frag_row(lane, i), col = frag_col(lane, n, i);
            if (key >= keys_valid) continue;
            if (DO_DK && col < dims.d) p.dk.at<T>(batch, kv_head, n0 + key)[col] = from_acc<T>(acc_dk[n][i] * scale);
            if (DO_DV && col < dims.dv) p.dv.at<T>(batch, kv_head, n0 + key)[col] = from_acc<T>(acc_dv[n][i]);
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
    const QueryBlock blk = QueryBlock::from_grid<BM>(dims);
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
