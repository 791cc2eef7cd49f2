// flash_fwd_simt.cu -- forward attention with CUDA-core FMA (float32 / float64).
//
// Same algorithm as flash_fwd.cu, accumulated in the input precision's
// accumulator type (fp32, or fp64 for float64). 256 threads as a 16 x 16 grid:
// thread (ty, tx) owns query rows ty*TM .. ty*TM+TM-1 and, of each key tile,
// keys tx, tx+16, ...; of the output, columns tx, tx+16, ... The 16 threads of
// a row sit in one half-warp, so row reductions are 4 shuffles.
//   for each K/V tile j:
//       S = Q K_j^T (registers) -> scale, mask -> online softmax -> P to shared
//       O = O * 2^(m - m_new) + P V_j
// Q and K rows are padded by one element so the 16 threads reading 16 different
// K rows at one d hit 16 different banks.
#include "common.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "mask.cuh"

template <typename T, int HEAD, int BM, int BN>
struct FwdSimtTraits {
    static constexpr int THREADS = 256;
    static constexpr int TM = BM / 16;       // rows per thread
    static constexpr int TN = BN / 16;       // keys per thread per tile
    static constexpr int TD = HEAD / 16;     // output columns per thread
    static constexpr int QK_PITCH = HEAD + 1;
    static constexpr int V_PITCH = HEAD;
    static constexpr int P_PITCH = BN + 1;
    static constexpr int SMEM_ELEMS = BM * QK_PITCH + BN * QK_PITCH + BN * V_PITCH + BM * P_PITCH;
    static_assert(BM % 16 == 0 && BN % 16 == 0 && HEAD % 16 == 0, "16 x 16 thread grid");
};

template <typename T, int HEAD, int BM, int BN, bool CAUSAL>
__global__ void __launch_bounds__(256, 1)
flash_fwd_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               T* __restrict__ out, T* __restrict__ lse,
               int64 q_sb, int64 q_sh, int64 q_sr, int64 k_sb, int64 k_sh, int64 k_sr,
               int64 v_sb, int64 v_sh, int64 v_sr, int64 o_sb, int64 o_sh, int64 o_sr,
               int64 lse_sb, int64 lse_sh,
               int group, int lq, int lk, int d, int dv, double scale_log2_in, int causal_offset) {
    typedef FwdSimtTraits<T, HEAD, BM, BN> Tr;
    typedef T A;   // float or double: the accumulator is the input type here
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* k_s = q_s + BM * Tr::QK_PITCH;
    T* v_s = k_s + BN * Tr::QK_PITCH;
    A* p_s = v_s + BN * Tr::V_PITCH;

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int head = blockIdx.y, batch = blockIdx.z, kv_head = head / group;
    q += batch * q_sb + head * q_sh + m0 * q_sr;
    k += batch * k_sb + kv_head * k_sh;
    v += batch * v_sb + kv_head * v_sh;
    out += batch * o_sb + head * o_sh + m0 * o_sr;
    lse += batch * lse_sb + head * lse_sh + m0;

    const A scale_log2 = A(scale_log2_in);
    const ScoreMask<CAUSAL> mask{lk, causal_offset};
    const int n_tiles = mask.key_tile_end(m0, BM, BN);
    const int rows_valid = imin(BM, lq - m0);
    const int row0 = ty * Tr::TM;   // first row of this thread within the tile

    A acc_o[Tr::TM][Tr::TD];
    A row_max[Tr::TM], row_sum[Tr::TM];
#pragma unroll
    for (int i = 0; i < Tr::TM; ++i) {
        row_max[i] = neg_inf<A>();
        row_sum[i] = A(0);
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) acc_o[i][c] = A(0);
    }

    if (n_tiles > 0) load_tile<T, BM, HEAD, Tr::QK_PITCH, Tr::THREADS, false>(q_s, q, q_sr, rows_valid, d);
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BN;
        load_tile<T, BN, HEAD, Tr::QK_PITCH, Tr::THREADS, false>(k_s, k + n0 * k_sr, k_sr, lk - n0, d);
        load_tile<T, BN, HEAD, Tr::V_PITCH, Tr::THREADS, false>(v_s, v + n0 * v_sr, v_sr, lk - n0, dv);
        __syncthreads();

        // S = Q K^T over the real head dim only (padding columns are zeros anyway).
        A s[Tr::TM][Tr::TN];
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
            for (int jj = 0; jj < Tr::TN; ++jj) s[i][jj] = A(0);
#pragma unroll 4
        for (int dd = 0; dd < d; ++dd) {
            A qv[Tr::TM], kv[Tr::TN];
#pragma unroll
            for (int i = 0; i < Tr::TM; ++i) qv[i] = q_s[(row0 + i) * Tr::QK_PITCH + dd];
#pragma unroll
            for (int jj = 0; jj < Tr::TN; ++jj) kv[jj] = k_s[(tx + 16 * jj) * Tr::QK_PITCH + dd];
#pragma unroll
            for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
                for (int jj = 0; jj < Tr::TN; ++jj) s[i][jj] = fma(qv[i], kv[jj], s[i][jj]);
        }

        const bool needs_mask = mask.tile_needs_mask(m0, n0, BN);
        scale_mask_simt_tile<Tr::TM, Tr::TN, CAUSAL>(s, scale_log2, mask, needs_mask, m0 + row0, n0 + tx, 16);
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i) {
            const A correction = softmax_update_row<16>(s[i], row_max[i], row_sum[i]);
#pragma unroll
            for (int c = 0; c < Tr::TD; ++c) acc_o[i][c] *= correction;
#pragma unroll
            for (int jj = 0; jj < Tr::TN; ++jj) p_s[(row0 + i) * Tr::P_PITCH + tx + 16 * jj] = s[i][jj];
        }
        __syncthreads();

        // O += P V
        const int n_valid = imin(BN, lk - n0);
        for (int kk = 0; kk < n_valid; ++kk) {
            A vv[Tr::TD];
#pragma unroll
            for (int c = 0; c < Tr::TD; ++c) vv[c] = v_s[kk * Tr::V_PITCH + tx + 16 * c];
#pragma unroll
            for (int i = 0; i < Tr::TM; ++i) {
                const A p = p_s[(row0 + i) * Tr::P_PITCH + kk];
#pragma unroll
                for (int c = 0; c < Tr::TD; ++c) acc_o[i][c] = fma(p, vv[c], acc_o[i][c]);
            }
        }
        __syncthreads();   // the next tile's loads overwrite K, V and P
    }

#pragma unroll
    for (int i = 0; i < Tr::TM; ++i) {
        A inv_sum, row_lse;
        softmax_finalize_row<16>(row_max[i], row_sum[i], inv_sum, row_lse);
        const int row = row0 + i;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) {
            const int col = tx + 16 * c;
            if (col < dv) out[row * o_sr + col] = acc_o[i][c] * inv_sum;
        }
        if (tx == 0) lse[row] = row_lse;
    }
}
