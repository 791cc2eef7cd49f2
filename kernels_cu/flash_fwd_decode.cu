// flash_fwd_decode.cu -- the split-KV partial forward for decoding (float16 / bfloat16, and float32 on
// 3xTF32): at most 16
// query rows a (batch, head) block -- Lq new rows, times the query heads of a K/V head with packed
// GQA -- over a long key range.
//
// flash_fwd_mma's split twin gives each warp 16 query rows of a 64-row block, so a decoding block
// fills one warp's rows and every warp reads each K/V tile whole from shared memory for padding
// rows. Here the warps share one 16-row Q strip and split each K/V tile's keys instead: warp w
// takes keys [n0 + w * KEYS_W, n0 + (w + 1) * KEYS_W) of tile n0, with its own online softmax
// (softmax.cuh) over its keys. Each K/V element then crosses shared memory once and the padded
// tensor-core work falls by the warp count. At the end the warps' (O, max, sum) merge in shared
// memory, as combine.cuh merges splits, and warp 0 writes the split's partial O and lse (KeySplit,
// scheduler.cuh), which the block's last split (or, without split_counters, the combine kernel) merges.
//   load Q strip (16 rows, zeros past the block's rows)
//   for each key tile j of this split (the next one streams in with cp.async meanwhile):
//       S_w = Q K_j[w]^T, masked where the tile is partial (the band, the sequence's own end)
//       online softmax of S_w; O_w += P_w V_j[w]
//   merge the warps' O_w, max_w, sum_w; warp 0 writes O and lse of the split
//   the block's last split to finish merges the splits into out and lse (combine_in_last_split)
// The K/V copies are flash_fwd_mma's (tile_io.cuh load_kv_tile, a paged cache included) into
// swizzled rows without padding: the K/V stream is the kernel's bound, and copies into rows padded
// by 16 bytes split a warp's 512 bytes over more shared-memory lines (1.5x the L2 sector reads
// under ncu, 83% of HBM against 91% for cuDNN's decode; benchmarks/stream_layout.py). No EXTRA
// option (bias, mask, dropout, block layout): those calls take flash_fwd_mma's split twin.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "warp_gemm_tf32.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "epilogue.cuh"
#include "combine.cuh"

// float32 (F32): 3xTF32 on mma.sync m16n8k8 (warp_gemm_tf32.cuh, flash_fwd_tf32.cu's arithmetic at
// precision="highest"): Q split once into big and small parts, K, V and P split per fragment; every
// tile's rows padded by 4 floats (the TF32 fragment loads' conflict-free pitch) instead of swizzled.
template <typename T, typename Cfg>
struct FwdDecodeTraits {
    static constexpr bool F32 = sizeof(T) == sizeof(float);
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int KEYS_W = BN / WARPS;     // keys of a tile each warp takes
    static constexpr int PITCH = F32 ? HEAD + 4 : HEAD + 8;    // Q's shared row pitch in elements (padding)
    static constexpr int KV_PITCH = F32 ? HEAD + 4 : HEAD;     // 16-bit: swizzled rows, no padding
    static constexpr int S_TILES = KEYS_W / 8;    // n8 tiles of one warp's S
    static constexpr int O_TILES = HEAD / 8;      // n8 tiles of one warp's O
    static constexpr int Q_ELEMS = (F32 ? 2 : 1) * BM * PITCH;   // F32: Q's big part, then its small part
    static constexpr int KV_ELEMS = BN * KV_PITCH;   // one K or V stage
    static constexpr int SMEM_BYTES = (Q_ELEMS + 2 * Cfg::STAGES * KV_ELEMS) * int(sizeof(T));
    // The warps' merge: every warp but 0 leaves its O fragments and row statistics in the K/V stages.
    static constexpr int MERGE_FLOATS = (WARPS - 1) * 32 * (4 * O_TILES + 4);
    static_assert(BM == 16, "one 16-row strip, shared by the warps");
    static_assert(!USER_SCORE && !USER_MASK, "no user modifications in the decoding kernel (the split twin takes them)");
    static_assert(sizeof(T) == 2 || F32, "16-bit or float32");
    static_assert(BN % (16 * WARPS) == 0 && HEAD % (F32 ? 32 : 64) == 0,
                  "whole k16 steps (n8 pairs) of keys a warp; 16-bit rows of 8 chunks");
    static_assert(Cfg::STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
    static_assert(MERGE_FLOATS * int(sizeof(float)) <= 2 * Cfg::STAGES * KV_ELEMS * int(sizeof(T)),
                  "the merge fits in the K/V stages");
};

// The warps' (O, max, sum) of one 16-row strip merged into warp 0's registers, as
// flash_fwd_combine.cu merges splits (in log2 units here): peak = max_w max_w (NaN kept),
// O = sum_w O_w 2^(max_w - peak), sum = sum_w sum_w 2^(max_w - peak). A warp that saw no key has
// max -inf and O = sum = 0: weight 0. Lane l of every warp holds the same rows and columns, so lane
// l of warp 0 merges lane l's values. `stage`: at least MERGE_FLOATS floats of shared memory that the
// key loop's copies and reads have finished with (the barrier here orders them before the writes).
template <typename Tr>
__device__ __forceinline__ void merge_warps(float* stage, int warp, int lane, float (&acc_o)[1][Tr::O_TILES][4],
                                            float (&row_max)[1][2], float (&row_sum)[1][2]) {
    constexpr int PER_WARP = 4 * Tr::O_TILES + 4;   // floats a lane leaves: O, then max and sum of its two rows
    __syncthreads();
    if (warp > 0) {
        float* mine = stage + (warp - 1) * PER_WARP * 32 + lane;   // lane-minor: no bank conflicts
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) mine[(4 * t + i) * 32] = acc_o[0][t][i];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mine[(4 * Tr::O_TILES + r) * 32] = row_max[0][r];
            mine[(4 * Tr::O_TILES + 2 + r) * 32] = row_sum[0][r];
        }
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float peak = row_max[0][r];
        for (int w = 1; w < Tr::WARPS; ++w) {
            const float m = stage[((w - 1) * PER_WARP + 4 * Tr::O_TILES + r) * 32 + lane];
            peak = (m != m || peak != peak) ? m + peak : amax(peak, m);
        }
        const float shift = peak == neg_inf<float>() ? 0.0f : peak;   // every warp empty: weights 0
        const float own = fast_exp2(row_max[0][r] - shift);
        row_sum[0][r] *= own;
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t) {
            acc_o[0][t][2 * r] *= own;
            acc_o[0][t][2 * r + 1] *= own;
        }
        for (int w = 1; w < Tr::WARPS; ++w) {
            const float* theirs = stage + (w - 1) * PER_WARP * 32 + lane;
            const float weight = fast_exp2(theirs[(4 * Tr::O_TILES + r) * 32] - shift);
            row_sum[0][r] += weight * theirs[(4 * Tr::O_TILES + 2 + r) * 32];
#pragma unroll
            for (int t = 0; t < Tr::O_TILES; ++t) {
                acc_o[0][t][2 * r] += weight * theirs[(4 * t + 2 * r) * 32];
                acc_o[0][t][2 * r + 1] += weight * theirs[(4 * t + 2 * r + 1) * 32];
            }
        }
        row_max[0][r] = shift;
    }
}

// The combine in a query block's last split (FwdParams::split_counters), in place of the combine
// kernel's launch: every CTA's partial rows are stored before it counts (a fence a thread, then one
// atomic), and the CTA that counts last merges the block's rows (combine.cuh, a warp a row, reading the
// partials at the L2) and leaves the counter at zero for the next launch. `flag`: an int of shared
// memory the kernel is done with.
template <typename T, typename Tr>
__device__ __forceinline__ void combine_in_last_split(const FwdParams& p, const QueryBlock& blk, int* flag, int warp,
                                                      int lane) {
    const AttnDims& dims = p.dims;
    const int block = (blk.batch * dims.heads_q + blk.head) * ceil_div(dims.lq, Tr::BM) + blk.m0 / Tr::BM;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicAdd(p.split_counters + block, 1) == p.num_splits - 1;
    __syncthreads();
    if (!*flag) return;
    __threadfence();
    for (int row = warp; row < blk.rows; row += Tr::WARPS)
        combine_row<T, Tr::HEAD, true>(p, blk.batch, blk.head, blk.m0 + row, lane);
    if (threadIdx.x == 0) p.split_counters[block] = 0;
}

// Grid: num_splits x ceil(rows / 16) x heads x batch CTAs (KeySplit), each over its split's key tiles.
// KV_SPLIT is the split forwards' last template parameter (the variant table names every split kernel
// so); this kernel has no unsplit form.
template <typename T, typename Cfg, typename Flags, bool VEC, bool KV_SPLIT>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_fwd_decode(const FwdParams p) {
    typedef FwdDecodeTraits<T, Cfg> Tr;
    static_assert(KV_SPLIT, "a split-KV partial kernel only: the combine kernel finishes its results");
    static_assert(!Flags::EXTRA, "no EXTRA option: flash_fwd_mma's split twin takes those calls");
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, P = Tr::PITCH, KP = Tr::KV_PITCH;
    constexpr int SPLIT = TF32X3_ROUNDED;        // F32: precision="highest"
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);    // F32: Q's big part, its small part at q_s + BM * P
    T* k_s = q_s + Tr::Q_ELEMS;                 // stage i at k_s + i * KV_ELEMS
    T* v_s = k_s + 2 * Tr::KV_ELEMS;

    const AttnDims& dims = p.dims;
    typedef KeySplit<BM, true> Split;
    const QueryBlock blk = Split::query_block(dims, shared_scores_head_group<false>(p.mask));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const ScoreMod<Flags, float, T, true> mod(p.mask, dims, acc_param<float>(p.scale_log2, p.scale_log2_f), blk.batch,
                                              blk.head);
    const float x_per_s = mod.x_per_score();
    // Packed GQA rows under a band (MaskParams::band_period): the block holds its K/V head's query heads of
    // `period` positions each, so its rows see what positions [0, period) see, and a lane's two rows sit
    // at positions row % period.
    const int period = Flags::BAND ? p.mask.band_period : 0;
    const int band_row0 = period > 0 ? 0 : blk.m0;
    const TileRange keys = Split::keys(mod.key_tiles(band_row0, period > 0 ? period : blk.rows, BN), p);
    // The tiles every row of the strip sees whole (the band's inside, short of the sequence's end).
    const TileRange full = mod.full_key_tiles(band_row0, period > 0 ? period : BM, BN);
    const int lane_row = blk.m0 + lane / 4;
    const int row_a = period > 0 ? lane_row % period : lane_row, row_b = period > 0 ? (lane_row + 8) % period
                                                                                     : lane_row + 8;

    PageCursor<T, BN, HEAD, Tr::THREADS, VEC> pages;   // a paged cache's pages, a tile ahead
    auto load_kv = [&](int j, int stage) {
        load_kv_tile<T, BM, BN, HEAD, KP, BN + 8, Tr::THREADS, VEC, Tr::KV_ELEMS, 0, true, false, !Tr::F32>(
            k_s, v_s, nullptr, stage, p, blk, false, j * BN, mod.lk, &pages);
        cp_async_commit();
    };

    float acc_o[1][Tr::O_TILES][4];
    float row_max[1][2], row_sum[1][2];
    start_rows(acc_o, row_max, row_sum);

    int j = keys.begin;
    if (j < keys.end) {
        load_tile<T, BM, HEAD, P, Tr::THREADS, VEC>(q_s, p.q.at<const T>(blk.batch, blk.head, blk.m0), p.q.row_stride,
                                                    blk.rows, dims.d);
        load_kv(j, 0);
        if constexpr (Tr::F32) {   // Q split once (the first K/V tile arrives meanwhile); the loop's barrier
            cp_async_wait<0>();    // publishes the split
            __syncthreads();
            split_tile<SPLIT, BM, HEAD, P, Tr::THREADS>(reinterpret_cast<float*>(q_s),
                                                        reinterpret_cast<float*>(q_s) + BM * P);
        }
    }
    const int key_w = warp * Tr::KEYS_W;   // this warp's keys within a tile
    for (int stage = 0; j < keys.end; stage ^= 1) {
        prefetch_next_step<2>(j + 1, keys.end, stage, [&](int j_next, int s_next) { load_kv(j_next, s_next); });
        __syncthreads();

        const T* k_w = k_s + stage * Tr::KV_ELEMS + key_w * KP;   // this warp's keys of K and V
        const T* v_w = v_s + stage * Tr::KV_ELEMS + key_w * KP;
        float s[1][Tr::S_TILES][4];   // S = Q K^T over this warp's keys
        zero_frags(s[0]);
        if constexpr (Tr::F32) {
            const float* q_big = reinterpret_cast<const float*>(q_s);
            warp_gemm_qk_tf32<SPLIT, 1, Tr::KEYS_W, HEAD, P>(s, q_big, q_big + BM * P,
                                                             reinterpret_cast<const float*>(k_w), lane);
        } else {
            warp_gemm_strips_smem<T, 1, Tr::KEYS_W, HEAD, P, KP, false, true>(s, q_s, k_w, lane);
        }
        if (!full.contains(j)) mask_partial_strip_rows(s[0], mod, row_a, row_b, j * BN + key_w + 2 * (lane % 4));
        if constexpr (Tr::F32) {   // P in float32, split per fragment in O += P V
            warp_softmax_tile<Tr>(s, acc_o, row_max, row_sum, x_per_s, [&](int m, int n, int r, float p0, float p1) {
                s[m][n][2 * r] = p0;
                s[m][n][2 * r + 1] = p1;
            });
            warp_gemm_pv_tf32<SPLIT, 1, HEAD, Tr::KEYS_W, P>(acc_o, s, reinterpret_cast<const float*>(v_w), lane);
        } else {
            unsigned p16[1][Tr::S_TILES][2];   // P in 16 bits, the A operand of O += P V
            warp_softmax_tile<Tr>(s, acc_o, row_max, row_sum, x_per_s, [&](int m, int n, int r, float p0, float p1) {
                p16[m][n][r] = pack2<T>(p0, p1);
            });
            warp_gemm_strips_rn16<T, 1, HEAD, Tr::KEYS_W, KP, true>(acc_o, p16, v_w, lane);
        }
        __syncthreads();   // the next iteration's prefetch overwrites this stage
        j = j + 1;
    }

    merge_warps<Tr>(reinterpret_cast<float*>(k_s), warp, lane, acc_o, row_max, row_sum);
    if (warp == 0)
        store_o_lse_c_frags<true, float, true>(p, Split::partial_block(blk, dims), 0, lane, acc_o, row_max, row_sum);
    if (p.split_counters != nullptr) combine_in_last_split<T, Tr>(p, blk, reinterpret_cast<int*>(q_s), warp, lane);
}
