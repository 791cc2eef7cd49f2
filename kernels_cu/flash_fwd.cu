// flash_fwd.cu -- forward attention on tensor cores (float16 / bfloat16).
//
// FlashAttention-2 loop order. One CTA per (query block, head, batch); each of
// the WARPS warps owns 16 query rows, so a row's softmax never leaves its warp.
//   load Q tile
//   for each K/V tile j (the next one streams in with cp.async meanwhile):
//       S = Q K_j^T                         (mma.sync, fp32 accumulate)
//       S = S * scale * log2(e), masked     (mask.cuh)
//       m_new = max(m, rowmax(S)); P = 2^(S - m_new); l = l * 2^(m - m_new) + rowsum(P)
//       O = O * 2^(m - m_new) + P V_j       (P stays in registers as the A operand)
//   O = O / l; lse = (m + log2 l) ln 2
// Shared memory rows are padded by 16 bytes so the 8 row addresses of an
// ldmatrix fall in different banks.
#include "common.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "mask.cuh"

template <int HEAD, int BN, int WARPS>
struct FwdMmaTraits {
    static constexpr int BM = 16 * WARPS;          // query rows per CTA
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int PITCH = HEAD + 8;         // shared row pitch in elements
    static constexpr int S_TILES = BN / 8;         // n8 tiles of one warp's S
    static constexpr int O_TILES = HEAD / 8;       // n8 tiles of one warp's O
    static constexpr int Q_ELEMS = BM * PITCH;
    static constexpr int KV_ELEMS = BN * PITCH;
    static constexpr int SMEM_ELEMS = Q_ELEMS + 4 * KV_ELEMS;   // Q, 2 stages of K and V
    static_assert(HEAD % 16 == 0 && BN % 16 == 0, "tiles are multiples of the mma shape");
};

// Online-softmax step for the two rows this lane holds (C-fragment rows lane/4 and lane/4 + 8).
template <typename Tr>
__device__ __forceinline__ void warp_softmax_update(float (&s)[Tr::S_TILES][4], float (&acc_o)[Tr::O_TILES][4],
                                                    float (&row_max)[2], float (&row_sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float x[2 * Tr::S_TILES];
#pragma unroll
        for (int n = 0; n < Tr::S_TILES; ++n) { x[2 * n] = s[n][2 * r]; x[2 * n + 1] = s[n][2 * r + 1]; }
        const float correction = softmax_update_row<4>(x, row_max[r], row_sum[r]);
#pragma unroll
        for (int n = 0; n < Tr::S_TILES; ++n) { s[n][2 * r] = x[2 * n]; s[n][2 * r + 1] = x[2 * n + 1]; }
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t) { acc_o[t][2 * r] *= correction; acc_o[t][2 * r + 1] *= correction; }
    }
}

// Strides are in elements. Grid: (query blocks, Hq, batch); the query block
// order is reversed so the longest causal blocks start first.
template <typename T, int HEAD, int BN, int WARPS, bool CAUSAL, bool VEC>
__global__ void __launch_bounds__(32 * WARPS, 1)
flash_fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              T* __restrict__ out, float* __restrict__ lse,
              int64 q_sb, int64 q_sh, int64 q_sr, int64 k_sb, int64 k_sh, int64 k_sr,
              int64 v_sb, int64 v_sh, int64 v_sr, int64 o_sb, int64 o_sh, int64 o_sr,
              int64 lse_sb, int64 lse_sh,
              int group, int lq, int lk, int d, int dv, float scale_log2, int causal_offset) {
    typedef FwdMmaTraits<HEAD, BN, WARPS> Tr;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* k_s = q_s + Tr::Q_ELEMS;                 // stage i at k_s + i * KV_ELEMS
    T* v_s = k_s + 2 * Tr::KV_ELEMS;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * Tr::BM;
    const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / group;
    q += batch * q_sb + head * q_sh + m0 * q_sr;
    k += batch * k_sb + kv_head * k_sh;
    v += batch * v_sb + kv_head * v_sh;
    out += batch * o_sb + head * o_sh + m0 * o_sr;
    lse += batch * lse_sb + head * lse_sh + m0;

    const ScoreMask<CAUSAL> mask{lk, causal_offset};
    const int n_tiles = mask.key_tile_end(m0, Tr::BM, BN);
    const int rows_valid = imin(Tr::BM, lq - m0);

    float acc_o[Tr::O_TILES][4];
    zero_frags(acc_o);
    float row_max[2] = {neg_inf<float>(), neg_inf<float>()};
    float row_sum[2] = {0.0f, 0.0f};

    if (n_tiles > 0) {
        load_tile<T, Tr::BM, HEAD, Tr::PITCH, Tr::THREADS, VEC>(q_s, q, q_sr, rows_valid, d);
        load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, VEC>(k_s, k, k_sr, lk, d);
        load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, VEC>(v_s, v, v_sr, lk, dv);
        cp_async_commit();
    }
    const int warp_row0 = m0 + warp * 16;
    for (int j = 0; j < n_tiles; ++j) {
        const int stage = j & 1;
        if (j + 1 < n_tiles) {   // prefetch tile j+1 into the other stage
            const int n1 = (j + 1) * BN;
            load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, VEC>(k_s + (stage ^ 1) * Tr::KV_ELEMS, k + n1 * k_sr, k_sr, lk - n1, d);
            load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, VEC>(v_s + (stage ^ 1) * Tr::KV_ELEMS, v + n1 * v_sr, v_sr, lk - n1, dv);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        float s[Tr::S_TILES][4];   // S = Q K^T for this warp's 16 rows
        zero_frags(s);
        warp_gemm_nt<T, BN, HEAD, Tr::PITCH, Tr::PITCH>(s, q_s + warp * 16 * Tr::PITCH, k_s + stage * Tr::KV_ELEMS, lane);
        const bool needs_mask = mask.tile_needs_mask(warp_row0, j * BN, BN);
        scale_mask_mma_tile<Tr::S_TILES, CAUSAL>(s, scale_log2, mask, needs_mask, warp_row0, j * BN, lane);
        warp_softmax_update<Tr>(s, acc_o, row_max, row_sum);
        warp_gemm_rn<T, HEAD, BN, Tr::PITCH>(acc_o, s, v_s + stage * Tr::KV_ELEMS, lane);   // O += P V
        __syncthreads();   // the next iteration's prefetch overwrites this stage
    }

    // Epilogue: O = acc_o / l, lse per row. Rows past lq are not written.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float inv_sum, row_lse;
        softmax_finalize_row<4>(row_max[r], row_sum[r], inv_sum, row_lse);
        const int row = warp * 16 + lane / 4 + 8 * r;
        if (row >= rows_valid) continue;
        T* out_row = out + row * o_sr;
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t) {
            const int col = t * 8 + 2 * (lane % 4);
            if (col < dv) out_row[col] = from_acc<T>(acc_o[t][2 * r] * inv_sum);
            if (col + 1 < dv) out_row[col + 1] = from_acc<T>(acc_o[t][2 * r + 1] * inv_sum);
        }
        if (lane % 4 == 0) lse[row] = row_lse;
    }
}
