// flash_fwd_dmma.cu -- forward attention on fp64 tensor cores (float64).
//
// flash_fwd_mma.cu's algorithm with mma.sync m8n8k4 in fp64 (sm_80+), fp64
// accumulators and an fp64 online softmax. One CTA per (query block, head, batch);
// each of the WARPS warps owns M_TILES x 8 query rows (M_TILES m8 row tiles), so a
// row's softmax never leaves its warp (4 lanes hold a row), and each K / V
// fragment a warp loads feeds M_TILES MMAs.
//   load Q tile
//   for each visible K/V tile j (the next one streams in with cp.async meanwhile):
//       S = Q K_j^T                           (warp_gemm_nt_f64)
//       x = S * scale * log2(e), masked       (score_mod.cuh)
//       m_new = max(m, rowmax(x)); P = 2^(x - m_new); l = l * 2^(m - m_new) + rowsum(P)
//       O = O * 2^(m - m_new) + P V_j         (P stays in registers: warp_gemm_rn_f64)
//   O = O / l; lse = (m + log2 l) ln 2
// Shared-memory pitches (warp_gemm_f64.cuh explains the bank arithmetic): Q and K
// rows head + 4 doubles (their fragments read row g, column t), V rows head + 2
// (read row 2t + s, column g). With EXTRA, each K/V stage has a bias tile (BM x BN,
// pitch = 8 mod 16) beside it, read two neighbouring scores at a time.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm_f64.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "epilogue.cuh"

template <typename Cfg, bool EXTRA>
struct FwdDmmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int M_TILES = BM / (8 * WARPS);   // 8-row tiles per warp
    static constexpr int WARP_ROWS = 8 * M_TILES;
    static constexpr int S_TILES = BN / 8;             // 8-key tiles of one row tile's S
    static constexpr int O_TILES = HEAD / 8;           // 8-column tiles of one row tile's O
    static constexpr int QK_PITCH = HEAD + 4;          // = 4 (mod 8): S = Q K^T reads
    static constexpr int V_PITCH = HEAD + 2;           // = 2 (mod 4): O += P V reads
    static constexpr int BIAS_PITCH = BN / 16 * 16 + 8;   // = 8 (mod 16), >= BN
    static constexpr int Q_ELEMS = BM * QK_PITCH;
    static constexpr int K_ELEMS = BN * QK_PITCH;      // one K stage
    static constexpr int V_ELEMS = BN * V_PITCH;       // one V stage
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    static constexpr int SMEM_BYTES =
        (Q_ELEMS + Cfg::STAGES * (K_ELEMS + V_ELEMS + BIAS_ELEMS)) * int(sizeof(double));
    static_assert(HEAD % 8 == 0 && BN % 8 == 0, "tiles are multiples of the mma shape");
    static_assert(BM % (8 * WARPS) == 0, "each warp owns whole 8-row tiles");
    static_assert(Cfg::STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first;
// KV_SPLIT: that many times FwdParams::num_splits, each copy over its split's key tiles (KeySplit).
// WIDE_K (sm_90+; warp_gemm_f64.cuh): 0 runs both GEMMs on m8n8k4, 4 / 8 / 16 on
// m16n8kWIDE_K over pairs of a warp's 8-row tiles (the H100's full fp64 tensor rate).
// PACKED: the blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), without EXTRA.
template <typename T, typename Cfg, typename Flags, bool VEC, int WIDE_K = 0, bool KV_SPLIT = false,
          bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_fwd_dmma(const FwdParams p) {
    static_assert(sizeof(T) == sizeof(double), "fp64 tensor cores: float64 only");
    typedef FwdDmmaTraits<Cfg, Flags::EXTRA> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, M = Tr::M_TILES;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    double* q_s = reinterpret_cast<double*>(smem_raw);
    double* k_s = q_s + Tr::Q_ELEMS;                       // stage i at k_s + i * K_ELEMS
    double* v_s = k_s + Cfg::STAGES * Tr::K_ELEMS;         // stage i at v_s + i * V_ELEMS
    double* bias_s = v_s + Cfg::STAGES * Tr::V_ELEMS;      // stage i at bias_s + i * BIAS_ELEMS (EXTRA)

    const AttnDims& dims = p.dims;
    typedef KeySplit<BM, KV_SPLIT> Split;
    static_assert(!PACKED || !(KV_SPLIT || Flags::EXTRA), "packed sequences: the plain kernel, unsplit");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q) : PackedBlock{};
    const QueryBlock blk = PACKED ? seq.query_block(dims, BM)
                                  : Split::query_block(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int kv_batch = PACKED ? seq.k_start : blk.batch;   // K and V's batch index (packed: the first key)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // per-sequence key counts: a KV cache's (MaskParams::key_lengths: the split kernels without EXTRA) or
    // a packed sequence's
    constexpr bool PER_SEQ = (KV_SPLIT || PACKED) && !Flags::EXTRA;
    typedef ScoreMod<Flags, double, double, PER_SEQ> Mod;
    const Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, p.scale_log2, blk.head);
        else return Mod(p.mask, dims, p.scale_log2, blk.batch, blk.head);
    }();
    const TileRange keys = Split::keys(mod.key_tiles(blk.m0, blk.rows, BN), p);

    // K / V rows from the sequence's key count on are zeros (a KV cache's own count: load_kv_tile, tile_io.cuh)
    const int key_count = PER_SEQ ? mod.lk : dims.lk;
    auto load_kv = [&](int j, int stage) {
        const int n0 = j * BN;
        load_tile<double, BN, HEAD, Tr::QK_PITCH, Tr::THREADS, VEC>(
            k_s + stage * Tr::K_ELEMS, p.k.at<const double>(kv_batch, blk.kv_head, n0), p.k.row_stride,
            key_count - n0, dims.d);
        load_tile<double, BN, HEAD, Tr::V_PITCH, Tr::THREADS, VEC>(
            v_s + stage * Tr::V_ELEMS, p.v.at<const double>(kv_batch, blk.kv_head, n0), p.v.row_stride,
            key_count - n0, dims.dv);
        if (mod.has_bias())
            load_score_tile<double, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_s + stage * Tr::BIAS_ELEMS,
                                                                        p.mask.bias, blk.batch, blk.head, blk.m0,
                                                                        n0, blk.rows, dims.lk - n0);
        cp_async_commit();
    };
    // The visible key tiles in order (block sparsity and mask summaries skip some).
    auto next_tile = [&](int j) { return mod.next_key_tile(j, keys.end, blk.m0, blk.rows, BN); };

    double acc_o[M][Tr::O_TILES][2];
    double row_max[M], row_sum[M];
    zero_frags(acc_o);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        row_max[m] = neg_inf<double>();
        row_sum[m] = 0.0;
    }

    int j = next_tile(keys.begin);
    if (j < keys.end) {
        load_tile<double, BM, HEAD, Tr::QK_PITCH, Tr::THREADS, VEC>(
            q_s, p.q.at<const double>(blk.batch, blk.head, blk.m0), p.q.row_stride, blk.rows, dims.d);
        load_kv(j, 0);
    }
    const int warp_row0 = blk.m0 + warp * Tr::WARP_ROWS;
    for (int stage = 0; j < keys.end; stage ^= 1) {
        const int next = next_tile(j + 1);
        prefetch_next_step<2>(next, keys.end, stage, load_kv);   // the next visible tile into the other stage
        __syncthreads();

        double s[M][Tr::S_TILES][2];   // S = Q K^T for this warp's rows
        zero_frags(s);
        warp_gemm_nt_f64<M, Tr::S_TILES, HEAD, Tr::QK_PITCH, Tr::QK_PITCH, WIDE_K>(
            s, q_s + warp * Tr::WARP_ROWS * Tr::QK_PITCH, k_s + stage * Tr::K_ELEMS, lane);
        const int n0 = j * BN;
        const bool partial = mod.tile_is_partial(warp_row0, Tr::WARP_ROWS, n0, BN);
        const double* bias_tile = bias_s + stage * Tr::BIAS_ELEMS + warp * Tr::WARP_ROWS * Tr::BIAS_PITCH;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            auto coord = [&](int n, int i, int& row, int& col) {
                row = warp_row0 + 8 * m + frag_row_f64(lane);
                col = n0 + frag_col_f64(lane, n, i);
            };
            mask_and_modify(s[m], mod, coord, mod.x_per_score(), [&] {
                if (mod.has_bias())
                    scale_add_bias_frags_f64<Tr::S_TILES, Tr::BIAS_PITCH>(s[m], bias_tile + 8 * m * Tr::BIAS_PITCH,
                                                                          lane, mod.scale_log2);
                apply_score_mod(s[m], mod, partial, coord);
            });
            warp_softmax_update_f64<Tr>(s[m], acc_o[m], row_max[m], row_sum[m], softmax_x_per_s(mod.x_per_score()));
            apply_dropout<true>(s[m], mod, coord);   // after the statistics: row_sum counts every key
        }
        warp_gemm_rn_f64<M, Tr::O_TILES, Tr::S_TILES, Tr::V_PITCH, WIDE_K>(acc_o, s, v_s + stage * Tr::V_ELEMS, lane);   // O += P V
        __syncthreads();   // the next iteration's prefetch overwrites this stage
        j = next;
    }

    // Epilogue: O = acc_o / l, lse per row. Rows past lq are not written.
    store_o_lse_f64_frags<VEC || KV_SPLIT, double, KV_SPLIT>(p, Split::partial_block(blk, dims), warp * Tr::WARP_ROWS,
                                                            lane, acc_o, row_max, row_sum);
}
