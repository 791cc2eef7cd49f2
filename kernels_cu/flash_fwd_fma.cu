// flash_fwd_fma.cu -- forward attention with CUDA-core FMA (float32 / float64).
//
// Same algorithm as flash_fwd_mma.cu, accumulated in the input precision's
// accumulator type (fp32, or fp64 for float64). 256 threads as a 16 x 16 grid:
// thread (ty, tx) owns query rows ty*TM .. ty*TM+TM-1 and, of each key tile,
// keys tx, tx+16, ...; of the output, columns tx, tx+16, ... The 16 threads of
// a row sit in one half-warp, so row reductions are 4 shuffles.
//   for each visible K/V tile j:
//       S = Q K_j^T (registers) -> x = score_mod(S) -> online softmax -> P to shared
//       O = O * 2^(m - m_new) + P V_j
// Q and K rows are padded by one element so the 16 threads reading 16 different
// K rows at one d hit 16 different banks.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "epilogue.cuh"

template <typename T, typename Cfg>
struct FwdFmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN;
    static constexpr int THREADS = 256;      // the 16 x 16 thread grid
    static constexpr int TM = BM / 16;       // rows per thread
    static constexpr int TN = BN / 16;       // keys per thread per tile
    static constexpr int TD = HEAD / 16;     // output columns per thread
    static constexpr int QK_PITCH = HEAD + 1;
    static constexpr int V_PITCH = HEAD;
    static constexpr int P_PITCH = BN + 1;
    static constexpr int SMEM_BYTES =
        (BM * QK_PITCH + BN * QK_PITCH + BN * V_PITCH + BM * P_PITCH) * int(sizeof(T));
    static_assert(BM % 16 == 0 && BN % 16 == 0 && HEAD % 16 == 0, "16 x 16 thread grid");
    static_assert(Cfg::STAGES == 1, "single-buffered tiles");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first;
// KV_SPLIT: that many times FwdParams::num_splits, each copy over its split's key tiles (KeySplit).
template <typename T, typename Cfg, typename Flags, bool KV_SPLIT = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_fwd_fma(const FwdParams p) {
    typedef FwdFmaTraits<T, Cfg> Tr;
    typedef T A;   // float or double: the accumulator is the input type here
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);
    T* k_s = q_s + BM * Tr::QK_PITCH;
    T* v_s = k_s + BN * Tr::QK_PITCH;
    A* p_s = v_s + BN * Tr::V_PITCH;

    const AttnDims& dims = p.dims;
    typedef KeySplit<BM, KV_SPLIT> Split;
    const QueryBlock blk = Split::query_block(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int m0 = blk.m0;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int row0 = ty * Tr::TM;   // first row of this thread within the tile
    // a KV cache's per-sequence key counts (MaskParams::key_lengths): the split kernels without EXTRA
    constexpr bool PER_SEQ = KV_SPLIT && !Flags::EXTRA;
    const ScoreMod<Flags, A, T, PER_SEQ> mod(p.mask, dims, acc_param<A>(p.scale_log2, p.scale_log2_f), blk.batch,
                                             blk.head);
    const TileRange keys = Split::keys(mod.key_tiles(m0, blk.rows, BN), p);
    // K / V rows from the sequence's key count on are zeros (a KV cache's own count: load_kv_tile, tile_io.cuh)
    const int key_count = PER_SEQ ? mod.lk : dims.lk;

    A acc_o[Tr::TM][Tr::TD];
    A row_max[Tr::TM], row_sum[Tr::TM];
#pragma unroll
    for (int i = 0; i < Tr::TM; ++i) {
        row_max[i] = neg_inf<A>();
        row_sum[i] = A(0);
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) acc_o[i][c] = A(0);
    }

    const int first = mod.next_key_tile(keys.begin, keys.end, m0, blk.rows, BN);
    if (first < keys.end)
        load_tile<T, BM, HEAD, Tr::QK_PITCH, Tr::THREADS, false>(q_s, p.q.at<const T>(blk.batch, blk.head, m0),
                                                                 p.q.row_stride, blk.rows, dims.d);
    for (int j = first; j < keys.end; j = mod.next_key_tile(j + 1, keys.end, m0, blk.rows, BN)) {
        const int n0 = j * BN;
        load_tile<T, BN, HEAD, Tr::QK_PITCH, Tr::THREADS, false>(k_s, p.k.at<const T>(blk.batch, blk.kv_head, n0),
                                                                 p.k.row_stride, key_count - n0, dims.d);
        load_tile<T, BN, HEAD, Tr::V_PITCH, Tr::THREADS, false>(v_s, p.v.at<const T>(blk.batch, blk.kv_head, n0),
                                                                p.v.row_stride, key_count - n0, dims.dv);
        if (mod.has_bias())   // the bias tile waits in P's place until the probabilities overwrite it
            load_score_tile_acc<T, A, BM, BN, Tr::P_PITCH, Tr::THREADS>(p_s, p.mask.bias, blk.batch, blk.head, m0, n0,
                                                                        blk.rows, dims.lk - n0);
        __syncthreads();

        // S = Q K^T over the real head dim only (padding columns are zeros anyway).
        A s[Tr::TM][Tr::TN];
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
            for (int jj = 0; jj < Tr::TN; ++jj) s[i][jj] = A(0);
#pragma unroll 4
        for (int dd = 0; dd < dims.d; ++dd) {
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

        auto coord = [&](int i, int jj, int& row, int& col) {
            row = m0 + row0 + i;
            col = n0 + tx + 16 * jj;
        };
        // Each thread reads the bias entries it later overwrites with P: no other thread's.
        auto bias = [&](int i, int jj, int, int) { return p_s[(row0 + i) * Tr::P_PITCH + tx + 16 * jj]; };
        apply_score_mod(s, mod, mod.tile_is_partial(m0, BM, n0, BN), coord, bias);
        apply_user_score(s, mod, coord, A(1));   // (the FMA kernels form x themselves: ScoreMod::score)
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i) {
            const A correction = softmax_update_row<16>(s[i], row_max[i], row_sum[i]);
#pragma unroll
            for (int c = 0; c < Tr::TD; ++c) acc_o[i][c] *= correction;
        }
        apply_dropout<false>(s, mod, coord);   // after the statistics: row_sum counts every key
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
            for (int jj = 0; jj < Tr::TN; ++jj) p_s[(row0 + i) * Tr::P_PITCH + tx + 16 * jj] = s[i][jj];
        __syncthreads();

        // O += P V
        const int n_valid = imin(BN, key_count - n0);
        for (int kk = 0; kk < n_valid; ++kk) {
            A vv[Tr::TD];
#pragma unroll
            for (int c = 0; c < Tr::TD; ++c) vv[c] = v_s[kk * Tr::V_PITCH + tx + 16 * c];
#pragma unroll
            for (int i = 0; i < Tr::TM; ++i) {
                const A pv = p_s[(row0 + i) * Tr::P_PITCH + kk];
#pragma unroll
                for (int c = 0; c < Tr::TD; ++c) acc_o[i][c] = fma(pv, vv[c], acc_o[i][c]);
            }
        }
        __syncthreads();   // the next tile's loads overwrite K, V and P
    }

    // Epilogue: O = acc_o / l, lse per row (16 threads a row). Rows past lq are not written.
    store_o_lse_thread_rows<16, T, KV_SPLIT>(p, Split::partial_block(blk, dims), row0, tx, acc_o, row_max, row_sum);
}
