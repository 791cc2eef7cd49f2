// flash_fwd_wgmma.cu -- forward attention on Hopper's warpgroup MMA (sm_90a), float16 / bfloat16.
//
// The FlashAttention-2 loop of flash_fwd_mma.cu with the two GEMMs on wgmma
// (wgmma.cuh): each warpgroup of 4 warps owns 64 query rows, a warp 16 of them.
//   load Q tile (128-byte swizzled, tile_io_sw128.cuh)
//   for each visible K tile j (K_next and V_j stream in with cp.async meanwhile):
//       S = Q K_j^T          wgmma, both operands from shared memory (HEAD / 16 k-steps)
//       O += P_prev V_prev   wgmma with P from registers (packed from S, no shared
//                            memory) and V read transposed; in flight during:
//       masking, online softmax of S: score_mod.cuh and warp_softmax_step, unchanged --
//                            the wgmma accumulator of a warp is the m16n8 C fragment
//                            layout of mma.sync, so every per-element helper applies;
//                            acc_o's correction waits for the P V product
//   O += P_last V_last; O = O / l; lse = (m + log2 l) ln 2
// All threads load (no producer warps yet) and one barrier a tile publishes the
// copies; ncu (NOTES.md, fifth session) finds the loader's index arithmetic, the
// barrier and the wgmma waits where a warp-specialised kernel would hide them.
// With EXTRA, each K/V stage has an unswizzled bias tile (BM x BN, pitch BN + 8)
// beside it, read into S's fragment layout with ldmatrix as in the mma.sync kernel.
#include "common.cuh"
#include "params.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "tile_io_sw128.cuh"
#include "wgmma.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"

template <typename T, typename Cfg, bool EXTRA>
struct FwdWgmmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS, STAGES = Cfg::STAGES;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int WARPGROUPS = WARPS / 4;
    static constexpr int S_TILES = BN / 8;          // n8 C fragments of one warp's S
    static constexpr int O_TILES = HEAD / 8;        // n8 C fragments of one warp's O
    static constexpr int Q_BYTES = BM * HEAD * int(sizeof(T));
    static constexpr int KV_BYTES = BN * HEAD * int(sizeof(T));   // one K or V stage
    static constexpr int BIAS_PITCH = BN + 8;
    static constexpr int BIAS_BYTES = EXTRA ? BM * BIAS_PITCH * int(sizeof(T)) : 0;   // one bias stage
    // 1024 bytes of slack: the swizzled tiles start at the first 1024-byte boundary.
    static constexpr int SMEM_BYTES = 1024 + Q_BYTES + 2 * STAGES * KV_BYTES + STAGES * BIAS_BYTES;
    static_assert(sizeof(T) == 2, "wgmma here takes 16-bit operands");
    static_assert(WARPS % 4 == 0 && BM == 16 * WARPS, "warpgroups of 4 warps, 16 query rows a warp");
    static_assert(HEAD % 64 == 0 && BN % 64 == 0, "whole 128-byte swizzle atoms");
    static_assert(STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// The k16 step kk of a K-major swizzled operand whose 64-column slabs are
// slab_bytes apart (wgmma.cuh): slab kk / 4, 32 bytes per step inside it.
__device__ __forceinline__ uint64 k_major_desc(unsigned tile, int kk, int slab_bytes) {
    return sw128_desc(tile + (kk / 4) * slab_bytes + (kk % 4) * 32, 16, 1024);
}
// The k16 step kk (16 keys) of an MN-major swizzled V tile of `rows` keys.
__device__ __forceinline__ uint64 mn_major_desc(unsigned tile, int kk, int rows) {
    return sw128_desc(tile + kk * 16 * 128, rows * 128, 1024);
}

template <int A, int B, int C>
__device__ __forceinline__ float (&flat(float (&x)[A][B][C]))[A * B * C] {
    return reinterpret_cast<float(&)[A * B * C]>(x);
}

// Grid: ceil(Lq / BM) x Hq x B CTAs (BlockInfo), longest causal query blocks first.
// Rows of Q, K, V are 16-byte aligned with whole 16-byte chunks (the host's vec_loads_ok).
template <typename T, typename Cfg, typename Flags>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
flash_fwd_wgmma(const FwdParams p) {
    typedef FwdWgmmaTraits<T, Cfg, Flags::EXTRA> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, STAGES = Tr::STAGES;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    const unsigned q_s = smem_addr(smem);
    const unsigned k_s = q_s + Tr::Q_BYTES;                 // stage i at k_s + i * KV_BYTES
    const unsigned v_s = k_s + STAGES * Tr::KV_BYTES;
    T* bias_s = reinterpret_cast<T*>(smem + Tr::Q_BYTES + 2 * STAGES * Tr::KV_BYTES);   // EXTRA

    const AttnDims& dims = p.dims;
    const QueryBlock blk = QueryBlock::from_grid<BM>(dims);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warpgroup = warp / 4;
    const ScoreMod<Flags, float, T> mod(p.mask, dims, acc_param<float>(p.scale_log2, p.scale_log2_f), blk.batch,
                                        blk.head);
    const float x_per_s = mod.x_per_score();
    const TileRange keys = mod.key_tiles(blk.m0, blk.rows, BN);
    // The K tile (and bias tile) of iteration t sits at stage t % 2; its V tile arrives one
    // iteration later, at stage t % 2 of the V buffers, since P V of a tile runs in the next
    // iteration, overlapped with the next tile's softmax.
    auto load_k = [&](int j, int stage) {
        load_tile_sw128<T, BN, HEAD, Tr::THREADS>(k_s + stage * Tr::KV_BYTES, p.k.at<const T>(blk.batch, blk.kv_head, j * BN),
                                                  p.k.row_stride, dims.lk - j * BN, dims.d);
        if (mod.has_bias())
            load_score_tile<T, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_s + stage * (Tr::BIAS_BYTES / 2), p.mask.bias,
                                                                   blk.batch, blk.head, blk.m0, j * BN, blk.rows,
                                                                   dims.lk - j * BN);
    };
    auto load_v = [&](int j, int stage) {
        load_tile_sw128<T, BN, HEAD, Tr::THREADS>(v_s + stage * Tr::KV_BYTES, p.v.at<const T>(blk.batch, blk.kv_head, j * BN),
                                                  p.v.row_stride, dims.lk - j * BN, dims.dv);
    };
    auto next_tile = [&](int j) { return mod.next_key_tile(j, keys.end, blk.m0, blk.rows, BN); };

    float acc_o[1][Tr::O_TILES][4];
    float row_max[1][2], row_sum[1][2];
    zero_frags(acc_o[0]);
    row_max[0][0] = row_max[0][1] = neg_inf<float>();
    row_sum[0][0] = row_sum[0][1] = 0.0f;
    unsigned p_frag[BN / 16][4] = {};   // P of the previous tile: the A operand of its O += P V, 16 keys a step

    int j = next_tile(keys.begin);
    if (j < keys.end) {
        load_tile_sw128<T, BM, HEAD, Tr::THREADS>(q_s, p.q.at<const T>(blk.batch, blk.head, blk.m0), p.q.row_stride,
                                                  blk.rows, dims.d);
        load_k(j, 0);
        cp_async_commit();
    }
    const unsigned q_wg = q_s + warpgroup * 64 * 128;       // this warpgroup's 64 rows of every Q slab
    const int warp_row0 = blk.m0 + warp * 16;
    // O += P V of the previous tile, whose V is at V stage `stage` (wgmmas issued, not committed).
    auto issue_pv = [&](int stage) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_rs<T, HEAD>(flat(acc_o), p_frag[kk], mn_major_desc(v_s + stage * Tr::KV_BYTES, kk, BN));
    };
    int t = 0;
    for (; j < keys.end; ++t) {
        const int stage = t & 1;
        const int next = next_tile(j + 1);
        cp_async_wait<0>();         // this K tile and the previous V tile, issued an iteration ago
        fence_proxy_async_smem();   // this thread's copies, before the wgmmas read them
        __syncthreads();            // ...and everyone's; every warpgroup is done with the stages reloaded next
        if (next < keys.end) load_k(next, stage ^ 1);
        load_v(j, stage);
        cp_async_commit();

        // S = Q K^T for this warp's 16 rows and, in flight meanwhile, O += P V of the previous tile.
        float s[1][Tr::S_TILES][4];
        const unsigned k_tile = k_s + stage * Tr::KV_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD / 16; ++kk)
            wgmma_ss<T, BN>(flat(s), k_major_desc(q_wg, kk, BM * 128), k_major_desc(k_tile, kk, BN * 128), kk > 0);
        wgmma_commit();
        if (t > 0) {
            wgmma_fence();          // a new block for ptxas, which would insert it itself (C7519)
            issue_pv(stage ^ 1);
            wgmma_commit();
            wgmma_wait<1>();        // S only: groups complete in order
        } else {
            wgmma_wait<0>();
        }
        fence_regs(flat(s));

        const int n0 = j * BN;
        const bool partial = mod.tile_is_partial(warp_row0, 16, n0, BN);
        auto coord = [=](int n, int i, int& row, int& col) {
            row = warp_row0 + frag_row(lane, i);
            col = n0 + frag_col(lane, n, i);
        };
        if (mod.has_bias())
            scale_add_bias_frags<T, BN, Tr::BIAS_PITCH, false>(
                s[0], bias_s + stage * (Tr::BIAS_BYTES / 2) + warp * 16 * Tr::BIAS_PITCH, lane, mod.scale_log2);
        apply_score_mod(s[0], mod, partial, coord);
        // acc_o is still being written: its correction waits for the P V product.
        float correction[2];
        const bool moved = warp_softmax_step<Tr>(s, row_max, row_sum, x_per_s,
                                                 [&](int, int r, float c) { correction[r] = c; });
        wgmma_wait<0>();
        fence_regs(flat(acc_o));
        fence_regs(p_frag);
        if (moved) {
            rescale_acc_row(acc_o, 0, 0, correction[0]);
            rescale_acc_row(acc_o, 0, 1, correction[1]);
        }
        apply_dropout<true>(s[0], mod, coord);   // after the statistics: row_sum counts every key
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) pack_a_frag<T, BN>(p_frag[kk], s[0], 16 * kk);
        j = next;
    }
    if (t > 0) {   // the last tile's O += P V
        cp_async_wait<0>();
        fence_proxy_async_smem();
        __syncthreads();
        wgmma_fence();
        issue_pv((t - 1) & 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(flat(acc_o));
    }

    // Epilogue: O = acc_o / l, lse per row. Rows past lq are not written.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float inv_sum, row_lse;
        softmax_finalize_row<4>(row_max[0][r], row_sum[0][r], inv_sum, row_lse);
        const int row = warp * 16 + lane / 4 + 8 * r;
        if (row >= blk.rows) continue;
        T* out_row = p.out.at<T>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t) {
            const int col = t * 8 + 2 * (lane % 4);
            if (col < dims.dv) out_row[col] = from_acc<T>(acc_o[0][t][2 * r] * inv_sum);
            if (col + 1 < dims.dv) out_row[col + 1] = from_acc<T>(acc_o[0][t][2 * r + 1] * inv_sum);
        }
        if (lane % 4 == 0) *p.lse.at<float>(blk.batch, blk.head, blk.m0 + row) = row_lse;
    }
}
