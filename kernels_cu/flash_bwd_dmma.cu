// flash_bwd_dmma.cu -- attention backward on fp64 tensor cores (float64).
//
// flash_bwd_fma.cu's math (see there) with every product on mma.sync m8n8k4
// (fp64 in, fp64 accumulate), in flash_bwd_mma.cu's loop order:
//
// flash_bwd_dkdv_dmma: one CTA per (key block of BN, K/V head, batch). Warp w owns
// M_TILES 8-key tiles, so it forms the transposed score tiles
//     S^T = K_j Q_i^T,  dP^T = V_j dO_i^T               (warp_gemm_nt_swz)
//     P^T = 2^(x - lse),  dS^T = P^T (dP^T - Dsum)      (a lane: key g, queries 2t, 2t + 1)
// whose C fragments are straight away the A operands of
//     dV_j += P^T dO_i,  dK_j += dS^T Q_i               (warp_gemm_rn_swz)
// K_j, V_j stay in shared memory; Q_i, dO_i (and with EXTRA the bias tile) are
// double-buffered with cp.async. With HEAD_SPLIT = 2 two warps share each group of
// keys: both form the group's S^T and dP^T, and each accumulates half of dK's and
// dV's columns. That doubles the two score GEMMs but halves the accumulators, so a
// warp holds a pair of 8-key tiles at head dim 128, which m16n8k* (full-rate fp64
// on sm_90, where m8n8k4 runs at half) needs. With ATOMIC_DQ, dS goes through
// shared memory and the warps split dQ_i += scale dS K_j by columns (warp_gemm_nn_swz), added
// to the fp64 dQ accumulator with atomics. With EXTRA and a bias that wants its
// gradient, dS is added into dbias here (bias_grad.cuh's ADD / ATOMIC / ORDERED
// modes, as the FMA kernel).
//
// flash_bwd_dq_dmma: the deterministic dQ. One CTA per (query block, head, batch);
// warp w owns M_TILES 8-row query tiles and walks the key tiles in order, K/V
// double-buffered:  S = Q K^T, dP = dO V^T, dS = P (dP - Dsum), dQ += dS K.
//
// Q, dO, K, V and dS tiles use swizzle_f64.cuh's layout: the kernels read them
// both as (row g, column t) and as (row 2t + s, column g) fragments.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm_f64.cuh"
#include "swizzle_f64.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "bias_grad.cuh"

template <typename Cfg, bool ATOMIC_DQ, bool EXTRA, int HEAD_SPLIT = 1>
struct DkdvDmmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int STAGES = Cfg::STAGES, THREADS = 32 * WARPS;
    static constexpr int KEY_WARPS = WARPS / HEAD_SPLIT;   // warps with distinct keys (HEAD_SPLIT share each group)
    static constexpr int M_TILES = BN / (8 * KEY_WARPS);   // 8-key tiles per warp
    static constexpr int WARP_KEYS = 8 * M_TILES;
    static constexpr int Q_TILES = BM / 8;             // 8-query column tiles of S^T
    static constexpr int D_TILES = HEAD / 8;           // 8-column tiles of dK, dV
    static constexpr int ACC_COLS = HEAD / HEAD_SPLIT;   // dK / dV columns a warp accumulates
    static constexpr int ACC_TILES = ACC_COLS / 8;
    static constexpr int DQ_TILES = D_TILES / WARPS;   // dQ: each warp's column tiles (every query row)
    static constexpr int BIAS_PITCH = BN + 2;          // = 2 (mod 4): read transposed (scale_add_bias_frags_f64_t)
    static constexpr int KV_ELEMS = BN * HEAD;         // K or V
    static constexpr int QD_ELEMS = BM * HEAD;         // one stage of Q or dO
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    static constexpr int DS_ELEMS = ATOMIC_DQ ? BM * BN : 0;
    static constexpr int SMEM_BYTES =
        (2 * KV_ELEMS + STAGES * (2 * QD_ELEMS + BIAS_ELEMS) + DS_ELEMS + 2 * BM) * int(sizeof(double));
    static_assert(HEAD % 16 == 0 && BN % 16 == 0 && BM % 8 == 0, "swizzled tiles: rows of whole 16-column groups");
    static_assert(BN % (8 * KEY_WARPS) == 0, "each warp owns whole 8-key tiles");
    static_assert(HEAD_SPLIT == 1 || (HEAD_SPLIT == 2 && ACC_COLS % 16 == 0 && !EXTRA),
                  "two warps a key group, each on whole 16-column swizzle groups; the plain kernel");
    static_assert(D_TILES % WARPS == 0, "dQ's column tiles split evenly over the warps");
    static_assert(STAGES == 1 || STAGES == 2, "Q/dO tiles are single or double buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

template <typename Cfg, bool EXTRA>
struct DqDmmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int M_TILES = BM / (8 * WARPS);   // 8-row query tiles per warp
    static constexpr int WARP_ROWS = 8 * M_TILES;
    static constexpr int S_TILES = BN / 8;
    static constexpr int D_TILES = HEAD / 8;
    static constexpr int BIAS_PITCH = BN / 16 * 16 + 8;   // = 8 (mod 16): pairs (scale_add_bias_frags_f64)
    static constexpr int QD_ELEMS = BM * HEAD;
    static constexpr int KV_ELEMS = BN * HEAD;            // one stage of K or V
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;
    static constexpr int SMEM_BYTES = (2 * QD_ELEMS + Cfg::STAGES * (2 * KV_ELEMS + BIAS_ELEMS)) * int(sizeof(double));
    static_assert(HEAD % 16 == 0 && BN % 16 == 0, "swizzled tiles: rows of whole 16-column groups");
    static_assert(BM % (8 * WARPS) == 0, "each warp owns whole 8-row tiles");
    static_assert(Cfg::STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// P^T and dS^T in place on one 8-key tile's S^T, dP^T fragments (N query tiles;
// this lane: queries 8n + 2t + i). lse_log2 and dsum are the step's row stats in
// shared memory; keep(n, i) dropout's verdict (1 without); coord(n, i, row, col) the element's query
// and key (user score modifications, ScoreMod::prob_and_dscore_at). DO_DS: without it (the dV-only
// pass) only P^T is formed.
template <bool DO_DS, int N, typename Mod, typename Keep, typename Coord>
__device__ __forceinline__ void prob_and_dscore_t(double (&st)[N][2], double (&dpt)[N][2], const double* lse_log2,
                                                  const double* dsum, int lane, double x_per_s, const Mod& mod,
                                                  Keep keep, Coord coord) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const int q = 8 * n + 2 * (lane % 4);   // the pair's first query: both stats in one 16-byte load
        double lse0, lse1, dsum0 = 0.0, dsum1 = 0.0;
        lds_f64x2(lse0, lse1, smem_addr(lse_log2 + q));
        if (DO_DS) lds_f64x2(dsum0, dsum1, smem_addr(dsum + q));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const double k = keep(n, i);
            int row = 0, col = 0;
            if (USER_SCORE) coord(n, i, row, col);
            if (DO_DS)
                mod.template prob_and_dscore_at<true>(st[n][i], dpt[n][i], i ? lse1 : lse0, i ? dsum1 : dsum0, k, x_per_s,
                                                      row, col);
            else if (USER_SCORE)
                st[n][i] = fast_exp2(mod.user_score(st[n][i], row, col, x_per_s) - (i ? lse1 : lse0)) * k;
            else
                st[n][i] = fast_exp2(st[n][i] * x_per_s - (i ? lse1 : lse0)) * k;
        }
    }
}

// dbias += dS on one warp's S^T-shaped fragments (rows: keys key0 + 8m + g, columns:
// queries m0 + 8n + 2t + i). A one-row bias: each key's queries are summed first,
// in a fixed order (this lane's, then the 4 lanes of the key), and one lane adds.
template <int M, int N>
__device__ __forceinline__ void add_dbias_frags_t(const DbiasParams& g, const double (&dst)[M][N][2], int batch,
                                                  int head, int m0, int key_first, const AttnDims& dims, int lane) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int key = key_first + 8 * m + lane / 4;
        if (g.rows_broadcast) {
            double sum = 0.0;   // rows past lq hold dS = 0 (P = 0 there)
#pragma unroll
            for (int n = 0; n < N; ++n) sum += dst[m][n][0] + dst[m][n][1];
            sum = group_sum<4>(sum);
            if (lane % 4 == 0 && key < dims.lk) dbias_add(g, dbias_at<double>(g, batch, head, 0, key), sum);
            continue;
        }
        if (key >= dims.lk) continue;
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int q = m0 + 8 * n + 2 * (lane % 4) + i;
                if (q < dims.lq) dbias_add(g, dbias_at<double>(g, batch, head, q, key), dst[m][n][i]);
            }
    }
}

// PASS: 0 computes dK and dV together; 1 dV only, 2 dK (and dQ) only, each
// recomputing S^T, where both accumulators would not fit the registers.
// HEAD_SPLIT: 1, or 2 (two warps a key group, half the columns each; see the header).
// Grid: ceil(Lk / BN) x Hk x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), key block 0 (the most causal work) first.
// WIDE_K (sm_90+): 0 runs every GEMM on m8n8k4, 4 / 8 / 16 on m16n8kWIDE_K over pairs of
// 8-row tiles (warp_gemm_f64.cuh): this warp's key tiles, and with ATOMIC_DQ the query tiles.
// PACKED: the key blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), each with its
// sequence's own counts; without EXTRA. ATOMIC_DQ adds into the packed rows' accumulator (batch index:
// the sequence's first query row, the accumulator's batch stride one row).
template <typename T, typename Cfg, typename Flags, int PASS, bool ATOMIC_DQ, bool VEC, int WIDE_K = 0,
          bool PACKED = false, int HEAD_SPLIT = 1>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dkdv_dmma(const BwdParams p) {
    static_assert(sizeof(T) == sizeof(double), "fp64 tensor cores: float64 only");
    typedef DkdvDmmaTraits<Cfg, ATOMIC_DQ, Flags::EXTRA, HEAD_SPLIT> Tr;
    constexpr int BN = Tr::BN, BM = Tr::BM, HEAD = Tr::HEAD, M = Tr::M_TILES, QT = Tr::Q_TILES;
    constexpr bool DO_DV = PASS != 2, DO_DK = PASS != 1;
    static_assert(DO_DK || !ATOMIC_DQ, "dQ needs dS, which the dV-only pass does not form");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    double* k_s = reinterpret_cast<double*>(smem_raw);
    double* v_s = k_s + Tr::KV_ELEMS;
    double* q_stages = v_s + Tr::KV_ELEMS;                      // STAGES x [BM][HEAD]
    double* do_stages = q_stages + Tr::STAGES * Tr::QD_ELEMS;   // STAGES x [BM][HEAD]
    double* bias_stages = do_stages + Tr::STAGES * Tr::QD_ELEMS;   // STAGES x [BM][BIAS_PITCH] (EXTRA)
    double* ds_s = bias_stages + Tr::STAGES * Tr::BIAS_ELEMS;   // dS as [query][key] (ATOMIC_DQ)
    double* lse_s = ds_s + Tr::DS_ELEMS;                        // the step's lse in log2 units
    double* dsum_s = lse_s + BM;

    const AttnDims& dims = p.dims;
    static_assert(!PACKED || !Flags::EXTRA, "packed sequences: the plain kernel");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q / dims.group) : PackedBlock{};
    const KeyBlock blk = PACKED ? seq.key_block(dims, BN)
                                : KeyBlock::from_grid<BN>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int n0 = blk.n0, batch = blk.batch, keys_valid = blk.keys;
    const int q_batch = PACKED ? seq.q_start : batch;   // the query side's batch index (packed: its first row)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // This warp's keys within the block and its first dK / dV column (constants without a head split).
    const int key0 = (HEAD_SPLIT == 1 ? warp : warp % Tr::KEY_WARPS) * Tr::WARP_KEYS;
    const int col0 = HEAD_SPLIT == 1 ? 0 : warp / Tr::KEY_WARPS * Tr::ACC_COLS;
    const bool forms_ds = col0 == 0;   // the warps of a key group hold the same dS^T: the first one stores it
    typedef ScoreMod<Flags, double, double, PACKED> Mod;
    Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, p.scale_log2, blk.first_head);
        else return Mod(p.mask, dims, p.scale_log2, batch, blk.first_head);
    }();
    const double x_per_s = mod.x_per_score();
    const bool dbias = Flags::EXTRA && DO_DK && p.dbias.mode != DBIAS_NONE;
    const bool ordered = dbias && p.dbias.mode == DBIAS_ORDERED;

    load_row_tiles_swz<BN, HEAD, Tr::THREADS, VEC>(k_s, p.k, dims.d, v_s, p.v, dims.dv, batch, blk.kv_head, n0,
                                                   keys_valid);
    cp_async_commit();

    double acc_dk[DO_DK ? M : 1][Tr::ACC_TILES][2], acc_dv[DO_DV ? M : 1][Tr::ACC_TILES][2];
    zero_frags(acc_dk);
    zero_frags(acc_dv);
    // Steps walk (query head of the group, query block) pairs over the query blocks
    // that can see this key block; every block when dbias contributions take turns
    // (DBIAS_ORDERED: each step passes its turn; a tile nothing sees adds zeros).
    const int q_blocks = ceil_div(dims.lq, BM);
    const KeyBlockSteps<BM> steps(ordered ? TileRange{0, q_blocks}
                                          : mod.query_tiles(n0, keys_valid, BM, blk.end_head - blk.first_head), blk);
    auto issue_query_block = [&](const StepCursor& at, int stage) {
        const int head = at.head, m0 = steps.m0(at.block), rows = imin(BM, (PACKED ? mod.lq : dims.lq) - m0);
        load_row_tiles_swz<BM, HEAD, Tr::THREADS, VEC>(q_stages + stage * Tr::QD_ELEMS, p.q, dims.d,
                                                       do_stages + stage * Tr::QD_ELEMS, p.dout, dims.dv, q_batch, head,
                                                       m0, rows);
        if (mod.has_bias())
            load_score_tile<double, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_stages + stage * Tr::BIAS_ELEMS,
                                                                        p.mask.bias, batch, head, m0, n0, rows,
                                                                        keys_valid);
        cp_async_commit();
    };
    StepCursor cur = StepCursor::first(steps).next_visible(steps, mod, blk, !ordered);
    if (cur.t < steps.count) issue_query_block(cur, 0);
#pragma unroll 1
    for (int stage = 0; cur.t < steps.count;) {
        const StepCursor next = cur.after(steps).next_visible(steps, mod, blk, !ordered);
        const int head = cur.head, q_block = steps.begin + cur.block, m0 = q_block * BM;
        const int rows_valid = imin(BM, (PACKED ? mod.lq : dims.lq) - m0);
        mod.head = head;
        prefetch_next_step<Tr::STAGES>(next.t, steps.count, stage,   // the next block meanwhile
                                       [&](int, int into) { issue_query_block(next, into); });
        load_row_stats<BM, Tr::THREADS>(lse_s, dsum_s, p.lse, p.dsum, q_batch, head, m0, rows_valid);
        __syncthreads();
        const double* q_s = q_stages + stage * Tr::QD_ELEMS;
        const double* do_s = do_stages + stage * Tr::QD_ELEMS;
        double st[M][QT][2], dpt[M][QT][2];   // S^T, dP^T: this warp's keys x BM queries
        zero_frags(st);
        zero_frags(dpt);
        if constexpr (DO_DK && WIDE_K != 0)   // S^T = K Q^T and dP^T = V dO^T in one k loop
            warp_gemm_nt_swz_x2<M, QT, HEAD, HEAD, HEAD, WIDE_K>(st, k_s + key0 * HEAD, q_s, dpt, v_s + key0 * HEAD,
                                                               do_s, lane);
        else {
            warp_gemm_nt_swz<M, QT, HEAD, HEAD, HEAD, WIDE_K>(st, k_s + key0 * HEAD, q_s, lane);   // S^T = K Q^T
            if (DO_DK) warp_gemm_nt_swz<M, QT, HEAD, HEAD, HEAD, WIDE_K>(dpt, v_s + key0 * HEAD, do_s, lane);   // dP^T
        }
        const bool partial = mod.tile_is_partial(m0, BM, n0 + key0, Tr::WARP_KEYS);
        const double* bias_tile = bias_stages + stage * Tr::BIAS_ELEMS + key0;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            // Rows of S^T are keys, columns queries.
            auto coord = [&](int n, int i, int& row, int& col) {
                row = m0 + frag_col_f64(lane, n, i);
                col = n0 + key0 + 8 * m + frag_row_f64(lane);
            };
            if (mod.has_bias())
                scale_add_bias_frags_f64_t<QT, Tr::BIAS_PITCH>(st[m], bias_tile + 8 * m, lane, mod.scale_log2);
            apply_score_mod(st[m], mod, partial, coord);
            // Dropout: a lane's two elements are two queries of one key, not the
            // neighbouring keys one Philox draw serves: a draw per element.
            auto keep = [&](int n, int i) {
                if (!mod.has_dropout()) return 1.0;
                int row, col;
                coord(n, i, row, col);
                return mod.keep(row, col);
            };
            prob_and_dscore_t<DO_DK>(st[m], dpt[m], lse_s, dsum_s, lane, x_per_s, mod, keep, coord);   // st: P^T, dpt: dS^T
            if (ATOMIC_DQ && forms_ds)
#pragma unroll
                for (int n = 0; n < QT; ++n)
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        ds_s[swz_offset<BN>(frag_col_f64(lane, n, i), key0 + 8 * m + frag_row_f64(lane))] = dpt[m][n][i];
        }
        if (dbias) {
            const DbiasTurn turn = ordered ? DbiasTurn::of(p.dbias, dims, batch, head, q_block, q_blocks, n0 / BN,
                                                           ceil_div(dims.lk, BN))
                                           : DbiasTurn{nullptr, 0};
            if (ordered) turn.wait_turn();
            add_dbias_frags_t(p.dbias, dpt, batch, head, m0, n0 + key0, dims, lane);
            if (ordered) turn.pass_turn();
        }
        // dV += P^T dO, dK += dS^T Q on this warp's columns (col0: whole swizzle groups, so the tiles' own layout)
        if constexpr (DO_DV) warp_gemm_rn_swz<M, Tr::ACC_TILES, QT, HEAD, WIDE_K>(acc_dv, st, do_s + col0, lane);
        if constexpr (DO_DK) warp_gemm_rn_swz<M, Tr::ACC_TILES, QT, HEAD, WIDE_K>(acc_dk, dpt, q_s + col0, lane);
        if constexpr (ATOMIC_DQ) {                                         // dQ += scale dS K: this warp's columns
            __syncthreads();
            double part[QT][Tr::DQ_TILES][2];
            zero_frags(part);
            const int tile0 = warp * Tr::DQ_TILES;
            warp_gemm_nn_swz<QT, Tr::DQ_TILES, BN, BN, HEAD, WIDE_K>(part, ds_s, k_s, tile0, lane);
#pragma unroll
            for (int r = 0; r < QT; ++r) {
                const int row = 8 * r + frag_row_f64(lane);
                if (row >= rows_valid) continue;
                double* dq_row = p.dq_acc.at<double>(q_batch, head, m0 + row);
#pragma unroll
                for (int n = 0; n < Tr::DQ_TILES; ++n)
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const int col = frag_col_f64(lane, tile0 + n, i);
                        if (col < dims.d) atomicAdd(dq_row + col, part[r][n][i] * p.scale);
                    }
            }
        }
        end_of_step_barrier<ATOMIC_DQ>();   // this stage and the row stats are read
        cur = next;
        if (Tr::STAGES == 2) stage ^= 1;
        else if (cur.t < steps.count) issue_query_block(cur, 0);
    }

    // dK = scale sum dS^T Q, dV = sum P^T dO; rows are keys. Keys past lk are not written.
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int key = key0 + 8 * m + frag_row_f64(lane);
        if (key >= keys_valid) continue;
        double* dk_row = p.dk.at<double>(batch, blk.kv_head, n0 + key);
        double* dv_row = p.dv.at<double>(batch, blk.kv_head, n0 + key);
#pragma unroll
        for (int n = 0; n < Tr::ACC_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int col = col0 + frag_col_f64(lane, n, i);
                if (DO_DK && col < dims.d) dk_row[col] = acc_dk[DO_DK ? m : 0][n][i] * p.scale;
                if (DO_DV && col < dims.dv) dv_row[col] = acc_dv[DO_DV ? m : 0][n][i];
            }
    }
}

// dQ without atomics: the CTA walks its key tiles in order, so the sum order is
// fixed and the result bitwise reproducible.
// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first.
// WIDE_K as in flash_bwd_dkdv_dmma (pairs of this warp's 8-row query tiles).
// PACKED: the query blocks of packed sequences (PackedBlock), without EXTRA.
template <typename T, typename Cfg, typename Flags, bool VEC, int WIDE_K = 0, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dq_dmma(const BwdParams p) {
    static_assert(sizeof(T) == sizeof(double), "fp64 tensor cores: float64 only");
    typedef DqDmmaTraits<Cfg, Flags::EXTRA> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, M = Tr::M_TILES;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    double* q_s = reinterpret_cast<double*>(smem_raw);
    double* do_s = q_s + Tr::QD_ELEMS;
    double* k_s = do_s + Tr::QD_ELEMS;                         // stage i at k_s + i * KV_ELEMS
    double* v_s = k_s + Cfg::STAGES * Tr::KV_ELEMS;            // stage i at v_s + i * KV_ELEMS
    double* bias_s = v_s + Cfg::STAGES * Tr::KV_ELEMS;         // stage i at bias_s + i * BIAS_ELEMS (EXTRA)

    const AttnDims& dims = p.dims;
    static_assert(!PACKED || !Flags::EXTRA, "packed sequences: the plain kernel");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q) : PackedBlock{};
    const QueryBlock blk = PACKED ? seq.query_block(dims, BM)
                                  : QueryBlock::from_grid<BM>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int kv_batch = PACKED ? seq.k_start : blk.batch;   // K and V's batch index (packed: the first key)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    typedef ScoreMod<Flags, double, double, PACKED> Mod;
    const Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, p.scale_log2, blk.head);
        else return Mod(p.mask, dims, p.scale_log2, blk.batch, blk.head);
    }();
    const double x_per_s = mod.x_per_score();
    const TileRange keys = mod.key_tiles(blk.m0, blk.rows, BN);
    const int warp_row0 = warp * Tr::WARP_ROWS;

    auto load_kv = [&](int j, int stage) {
        const int n0 = j * BN;
        load_row_tiles_swz<BN, HEAD, Tr::THREADS, VEC>(k_s + stage * Tr::KV_ELEMS, p.k, dims.d,
                                                       v_s + stage * Tr::KV_ELEMS, p.v, dims.dv, kv_batch,
                                                       blk.kv_head, n0, imin(BN, (PACKED ? mod.lk : dims.lk) - n0));
        if (mod.has_bias())
            load_score_tile<double, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_s + stage * Tr::BIAS_ELEMS,
                                                                        p.mask.bias, blk.batch, blk.head, blk.m0,
                                                                        n0, blk.rows, dims.lk - n0);
        cp_async_commit();
    };
    auto next_tile = [&](int j) { return mod.next_key_tile(j, keys.end, blk.m0, blk.rows, BN); };

    // This lane's rows' statistics (rows past lq: lse_log2 = +inf, so P = 0).
    double lse_log2[M], dsum[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int row = warp_row0 + 8 * m + frag_row_f64(lane);
        const bool valid = row < blk.rows;
        lse_log2[m] = valid ? lse_to_log2(*p.lse.at<const double>(blk.batch, blk.head, blk.m0 + row)) : pos_inf<double>();
        dsum[m] = valid ? *p.dsum.at<const double>(blk.batch, blk.head, blk.m0 + row) : 0.0;
    }
    double acc_dq[M][Tr::D_TILES][2];
    zero_frags(acc_dq);

    int j = next_tile(keys.begin);
    if (j < keys.end) {
        load_row_tiles_swz<BM, HEAD, Tr::THREADS, VEC>(q_s, p.q, dims.d, do_s, p.dout, dims.dv, blk.batch, blk.head,
                                                       blk.m0, blk.rows);
        load_kv(j, 0);
    }
    for (int stage = 0; j < keys.end; stage ^= 1) {
        const int next = next_tile(j + 1);
        prefetch_next_step<2>(next, keys.end, stage, load_kv);   // the next visible tile into the other stage
        __syncthreads();
        const double* k_tile = k_s + stage * Tr::KV_ELEMS;
        double s[M][Tr::S_TILES][2], dp[M][Tr::S_TILES][2];
        zero_frags(s);
        zero_frags(dp);
        warp_gemm_nt_swz<M, Tr::S_TILES, HEAD, HEAD, HEAD, WIDE_K>(s, q_s + warp_row0 * HEAD, k_tile, lane);   // S = Q K^T
        warp_gemm_nt_swz<M, Tr::S_TILES, HEAD, HEAD, HEAD, WIDE_K>(dp, do_s + warp_row0 * HEAD, v_s + stage * Tr::KV_ELEMS,
                                                           lane);                                      // dP = dO V^T
        const int n0 = j * BN;
        const bool partial = mod.tile_is_partial(blk.m0 + warp_row0, Tr::WARP_ROWS, n0, BN);
        const double* bias_tile = bias_s + stage * Tr::BIAS_ELEMS + warp_row0 * Tr::BIAS_PITCH;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            auto coord = [&](int n, int i, int& row, int& col) {
                row = blk.m0 + warp_row0 + 8 * m + frag_row_f64(lane);
                col = n0 + frag_col_f64(lane, n, i);
            };
            if (mod.has_bias())
                scale_add_bias_frags_f64<Tr::S_TILES, Tr::BIAS_PITCH>(s[m], bias_tile + 8 * m * Tr::BIAS_PITCH, lane,
                                                                      mod.scale_log2);
            apply_score_mod(s[m], mod, partial, coord);
#pragma unroll
            for (int n = 0; n < Tr::S_TILES; ++n) {   // a lane's pair: keys col, col + 1 of one row, one Philox draw
                double keep0 = 1.0, keep1 = 1.0;
                int row = 0, col = 0;
                if (mod.has_dropout() || USER_SCORE) coord(n, 0, row, col);
                if (mod.has_dropout()) mod.keep2(row, col, keep0, keep1);
                mod.template prob_and_dscore_at<false>(s[m][n][0], dp[m][n][0], lse_log2[m], dsum[m], keep0, x_per_s,
                                                       row, col);   // dp: dS
                mod.template prob_and_dscore_at<false>(s[m][n][1], dp[m][n][1], lse_log2[m], dsum[m], keep1, x_per_s,
                                                       row, col + 1);
            }
        }
        warp_gemm_rn_swz<M, Tr::D_TILES, Tr::S_TILES, HEAD, WIDE_K>(acc_dq, dp, k_tile, lane);   // dQ += dS K
        __syncthreads();   // the next iteration's prefetch overwrites this stage
        j = next;
    }

    // dQ = scale sum dS K. Rows past lq are not written.
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int row = warp_row0 + 8 * m + frag_row_f64(lane);
        if (row >= blk.rows) continue;
        double* dq_row = p.dq.at<double>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
        for (int n = 0; n < Tr::D_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int col = frag_col_f64(lane, n, i);
                if (col < dims.d) dq_row[col] = acc_dq[m][n][i] * p.scale;
            }
    }
}
