// flash_bwd_mma.cu -- attention backward on tensor cores (float16 / bfloat16, head dim <= 128).
//
// The math is flash_bwd.cu's (see there); here every product runs on mma.sync
// with fp32 accumulation, and P, dS enter the second GEMMs as 16-bit values.
//
// flash_bwd_dkdv_mma: one CTA (4 warps) per (key block of 64, K/V head, batch).
// Warp w owns keys 16w..16w+15, so it computes the *transposed* score tiles
//     S^T = K_j Q_i^T,  dP^T = V_j dO_i^T              (16 keys x BM queries)
// and its rows of P^T and dS^T are exactly the A operands of
//     dV_j += P^T dO_i,  dK_j += dS^T Q_i               (straight from registers).
// dQ_i += dS K_j needs dS with queries as rows, so dS^T goes through shared
// memory once and the four warps split the BM x HEAD product; results are
// added to an fp32 accumulator with atomics (ATOMIC_DQ).
//
// Causal masking is always compiled in, as a runtime offset (key j is seen by
// query i iff j <= i + causal_offset): without a causal mask the launch passes
// causal_offset = lk, which allows every key. (A separate non-causal build spilled
// registers at head dim 64 and 128; this one does not, and only edge tiles test
// elements either way.)
//
// flash_bwd_dq_mma: the deterministic dQ. One CTA per (query block of 64, head,
// batch); warp w owns query rows 16w..16w+15 and walks the key blocks in order:
//     S = Q_i K_j^T, dP = dO_i V_j^T, dS = P (dP - Dsum), dQ_i += dS K_j.
#include "common.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "mask.cuh"

template <int HEAD, int BM, int BN_ = 64>
struct BwdMmaTraits {
    static constexpr int WARPS = 4, THREADS = 128;
    static constexpr int BN = BN_;                 // keys per CTA (dkdv) / per step (dq)
    static constexpr int PITCH = HEAD + 8;         // padded rows: conflict-free ldmatrix
    static constexpr int DS_PITCH = BN + 8;
    static constexpr int DS_ELEMS = BM * DS_PITCH;
    // dQ = dS K in the dkdv kernel: BM/16 row strips x Q_SPLIT column chunks, one per warp.
    static constexpr int Q_SPLIT = WARPS / (BM / 16);
    static constexpr int DQ_COLS = HEAD / Q_SPLIT;
    static_assert(HEAD % 16 == 0 && BM % 16 == 0 && BM <= 64 && DQ_COLS % 32 == 0, "tile shape");
};

// P = 2^(s * scale_log2 - lse_log2) where allowed (0 elsewhere), dS = P (dP - Dsum).
__device__ __forceinline__ void p_and_ds(float& s_to_p, float& dp_to_ds, float lse_log2, float dsum,
                                         bool allowed, float scale_log2) {
    const float p = (allowed && lse_log2 != neg_inf<float>()) ? fast_exp2(s_to_p * scale_log2 - lse_log2) : 0.0f;
    s_to_p = p;
    dp_to_ds = p * (dp_to_ds - dsum);
}

// lse (natural log -> log2 units) and Dsum of BM query rows into shared memory.
template <int BM, int THREADS>
__device__ __forceinline__ void load_row_stats(float* lse_s, float* dsum_s, const float* lse, const float* dsum,
                                               int rows_valid) {
    for (int i = threadIdx.x; i < BM; i += THREADS) {
        lse_s[i] = i < rows_valid ? lse[i] * 1.4426950408889634f : neg_inf<float>();
        dsum_s[i] = i < rows_valid ? dsum[i] : 0.0f;
    }
}

// PASS: 0 computes dK and dV together; at head dim 128 their accumulators alone
// fill 128 registers a thread, so the launch splits them: PASS 1 = dV only,
// PASS 2 = dK (and dQ) only, each recomputing S^T (one extra GEMM, no spills).
template <typename T, int HEAD, int BM, int PASS, int STAGES, bool ATOMIC_DQ, bool VEC>
__global__ void __launch_bounds__(128, 1)
flash_bwd_dkdv_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                   float* __restrict__ dq_acc, T* __restrict__ dk, T* __restrict__ dv_out,
                   int64 q_sb, int64 q_sh, int64 q_sr, int64 k_sb, int64 k_sh, int64 k_sr,
                   int64 v_sb, int64 v_sh, int64 v_sr, int64 do_sb, int64 do_sh, int64 do_sr,
                   int group, int lq, int lk, int d, int dv, double scale_in, int causal_offset) {
    typedef BwdMmaTraits<HEAD, BM> Tr;
    constexpr int BN = Tr::BN, P = Tr::PITCH;
    constexpr bool DO_DV = PASS != 2, DO_DK = PASS != 1;
    static_assert(DO_DK || !ATOMIC_DQ, "dQ needs dS, which the dV-only pass does not form");
    static_assert(STAGES == 1 || STAGES == 2, "Q/dO tiles are single or double buffered");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + BN * P;
    T* q_stages = v_s + BN * P;                               // STAGES x [BM][P]
    T* do_stages = q_stages + STAGES * BM * P;                // STAGES x [BM][P]
    T* ds_s = do_stages + STAGES * BM * P;                    // dS as [query][key]
    float* lse_s = reinterpret_cast<float*>(ds_s + Tr::DS_ELEMS);
    float* dsum_s = lse_s + BM;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * BN, kv_head = blockIdx.y, batch = blockIdx.z;
    const int hq = gridDim.y * group;
    const float scale = float(scale_in), scale_log2 = float(scale_in * 1.4426950408889634);
    const ScoreMask<true> mask{lk, causal_offset};
    const int keys_valid = imin(BN, lk - n0);

    load_tile<T, BN, HEAD, P, Tr::THREADS, VEC>(k_s, k + batch * k_sb + kv_head * k_sh + n0 * k_sr, k_sr, keys_valid, d);
    load_tile<T, BN, HEAD, P, Tr::THREADS, VEC>(v_s, v + batch * v_sb + kv_head * v_sh + n0 * v_sr, v_sr, keys_valid, dv);
    cp_async_commit();

    float acc_dk[HEAD / 8][4], acc_dv[HEAD / 8][4];
    zero_frags(acc_dk);
    zero_frags(acc_dv);
    const int key0 = warp * 16;                                // this warp's keys within the block
    // Steps walk (query head of the group, query block) pairs; causal skips the
    // query blocks that end before this key block's first key is visible.
    const int m_first = (imax(0, n0 - causal_offset) / BM) * BM;
    const int m_blocks = m_first < lq ? ceil_div(lq - m_first, BM) : 0;
    const int n_steps = group * m_blocks;
    auto issue_query_block = [&](int step, int stage) {
        const int head = kv_head * group + step / m_blocks, m0 = m_first + (step % m_blocks) * BM;
        const int rows_valid = imin(BM, lq - m0);
        load_tile<T, BM, HEAD, P, Tr::THREADS, VEC>(q_stages + stage * BM * P, q + batch * q_sb + head * q_sh + m0 * q_sr,
                                                    q_sr, rows_valid, d);
        load_tile<T, BM, HEAD, P, Tr::THREADS, VEC>(do_stages + stage * BM * P,
                                                    dout + batch * do_sb + head * do_sh + m0 * do_sr, do_sr, rows_valid, dv);
        cp_async_commit();
    };
    if (n_steps > 0) issue_query_block(0, 0);
#pragma unroll 1
    for (int step = 0; step < n_steps; ++step) {
        const int stage = STAGES == 2 ? (step & 1) : 0;
        const int head = kv_head * group + step / m_blocks, m0 = m_first + (step % m_blocks) * BM;
        const int rows_valid = imin(BM, lq - m0);
        const int64 row_base = (int64(batch) * hq + head) * lq;
        if (step > 0 && STAGES == 1) issue_query_block(step, 0);
        if (STAGES == 2 && step + 1 < n_steps) {   // prefetch the next block while this one computes
            issue_query_block(step + 1, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        load_row_stats<BM, Tr::THREADS>(lse_s, dsum_s, lse + row_base + m0, dsum + row_base + m0, rows_valid);
        __syncthreads();
        const T* q_s = q_stages + stage * BM * P;
        const T* do_s = do_stages + stage * BM * P;
        float st[BM / 8][4], dpt[BM / 8][4];               // S^T, dP^T: 16 keys x BM queries
        zero_frags(st);
        zero_frags(dpt);
        warp_gemm_nt<T, BM, HEAD, P, P>(st, k_s + key0 * P, q_s, lane);
        if (DO_DK) warp_gemm_nt<T, BM, HEAD, P, P>(dpt, v_s + key0 * P, do_s, lane);
        const bool needs_mask = mask.tile_needs_mask(m0, n0, BN) || n0 + BN > lk;
#pragma unroll
        for (int n = 0; n < BM / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = key0 + frag_row(lane, i), row = frag_col(lane, n, i);
                const bool ok = !needs_mask || mask.allowed(m0 + row, n0 + key);
                p_and_ds(st[n][i], dpt[n][i], lse_s[row], dsum_s[row], ok, scale_log2);
                if (ATOMIC_DQ) ds_s[row * Tr::DS_PITCH + key] = from_acc<T>(dpt[n][i]);
            }
        if (DO_DV) warp_gemm_rn<T, HEAD, BM, P>(acc_dv, st, do_s, lane);    // dV += P^T dO
        if (DO_DK) warp_gemm_rn<T, HEAD, BM, P>(acc_dk, dpt, q_s, lane);    // dK += dS^T Q
        if (ATOMIC_DQ) {                                         // dQ += scale * dS K
            __syncthreads();
            const int strip = warp / Tr::Q_SPLIT;
            const int row_a = strip * 16 + lane / 4, row_b = row_a + 8;   // this lane's C-fragment rows
            float* dq_a = dq_acc + (row_base + m0 + row_a) * d;
            float* dq_b = dq_a + 8 * d;
            // 32 columns at a time keeps the partial product at 16 registers.
#pragma unroll
            for (int col0 = (warp % Tr::Q_SPLIT) * Tr::DQ_COLS; col0 < (warp % Tr::Q_SPLIT + 1) * Tr::DQ_COLS; col0 += 32) {
                float part[4][4];
                zero_frags(part);
                warp_gemm_nn<T, 32, BN, Tr::DS_PITCH, P>(part, ds_s + strip * 16 * Tr::DS_PITCH, k_s + col0, lane);
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int col = col0 + frag_col(lane, n, i);
                        if (col >= d) continue;
                        if (i < 2 && row_a < rows_valid) atomicAdd(dq_a + col, part[n][i] * scale);
                        if (i >= 2 && row_b < rows_valid) atomicAdd(dq_b + col, part[n][i] * scale);
                    }
            }
        }
        __syncthreads();   // this stage, the row stats and dS are read; the next step may overwrite them
    }

    // dK = scale * sum dS^T Q, dV = sum P^T dO; rows are keys. Keys past lk are not written.
    const int64 kv_row_base = (int64(batch) * gridDim.y + kv_head) * lk + n0;
#pragma unroll
    for (int n = 0; n < HEAD / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = key0 + frag_row(lane, i), col = frag_col(lane, n, i);
            if (key >= keys_valid) continue;
            if (DO_DK && col < d) dk[(kv_row_base + key) * d + col] = from_acc<T>(acc_dk[n][i] * scale);
            if (DO_DV && col < dv) dv_out[(kv_row_base + key) * dv + col] = from_acc<T>(acc_dv[n][i]);
        }
}

template <typename T, int HEAD, int BN_DQ, bool VEC>
__global__ void __launch_bounds__(128, 1)
flash_bwd_dq_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                 T* __restrict__ dq,
                 int64 q_sb, int64 q_sh, int64 q_sr, int64 k_sb, int64 k_sh, int64 k_sr,
                 int64 v_sb, int64 v_sh, int64 v_sr, int64 do_sb, int64 do_sh, int64 do_sr,
                 int group, int lq, int lk, int d, int dv, double scale_in, int causal_offset) {
    typedef BwdMmaTraits<HEAD, 64, BN_DQ> Tr;
    constexpr int BM = 64, BN = Tr::BN, P = Tr::PITCH;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + BN * P;
    T* q_s = v_s + BN * P;
    T* do_s = q_s + BM * P;
    float* lse_s = reinterpret_cast<float*>(do_s + BM * P + Tr::DS_ELEMS);   // the dkdv layout, one stage
    float* dsum_s = lse_s + BM;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM, head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / group;
    const float scale = float(scale_in), scale_log2 = float(scale_in * 1.4426950408889634);
    const ScoreMask<true> mask{lk, causal_offset};
    const int rows_valid = imin(BM, lq - m0);
    const int64 row_base = (int64(batch) * gridDim.y + head) * lq + m0;
    const int row0 = warp * 16;

    load_tile<T, BM, HEAD, P, Tr::THREADS, VEC>(q_s, q + batch * q_sb + head * q_sh + m0 * q_sr, q_sr, rows_valid, d);
    load_tile<T, BM, HEAD, P, Tr::THREADS, VEC>(do_s, dout + batch * do_sb + head * do_sh + m0 * do_sr, do_sr, rows_valid, dv);
    cp_async_commit();
    load_row_stats<BM, Tr::THREADS>(lse_s, dsum_s, lse + row_base, dsum + row_base, rows_valid);

    float acc_dq[HEAD / 8][4];
    zero_frags(acc_dq);
    const int n_tiles = mask.key_tile_end(m0, BM, BN);
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BN, keys_valid = imin(BN, lk - n0);
        __syncthreads();
        load_tile<T, BN, HEAD, P, Tr::THREADS, VEC>(k_s, k + batch * k_sb + kv_head * k_sh + n0 * k_sr, k_sr, keys_valid, d);
        load_tile<T, BN, HEAD, P, Tr::THREADS, VEC>(v_s, v + batch * v_sb + kv_head * v_sh + n0 * v_sr, v_sr, keys_valid, dv);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[BN / 8][4], dp[BN / 8][4];
        zero_frags(s);
        zero_frags(dp);
        warp_gemm_nt<T, BN, HEAD, P, P>(s, q_s + row0 * P, k_s, lane);     // S = Q K^T
        warp_gemm_nt<T, BN, HEAD, P, P>(dp, do_s + row0 * P, v_s, lane);   // dP = dO V^T
        const bool needs_mask = mask.tile_needs_mask(m0 + row0, n0, BN);
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = row0 + frag_row(lane, i), key = frag_col(lane, n, i);
                const bool ok = !needs_mask || mask.allowed(m0 + row, n0 + key);
                p_and_ds(s[n][i], dp[n][i], lse_s[row], dsum_s[row], ok, scale_log2);
            }
        warp_gemm_rn<T, HEAD, BN, P>(acc_dq, dp, k_s, lane);              // dQ += dS K
    }
#pragma unroll
    for (int n = 0; n < HEAD / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + frag_row(lane, i), col = frag_col(lane, n, i);
            if (row < rows_valid && col < d) dq[(row_base + row) * d + col] = from_acc<T>(acc_dq[n][i] * scale);
        }
}
