// flash_fwd_tf32.cu -- forward attention on float32 data with the TF32 tensor cores.
//
// flash_fwd_mma.cu's algorithm and layout (FlashAttention-2 loop order; each of the WARPS
// warps owns STRIPS x 16 query rows; K/V double-buffered with cp.async) on mma.sync m16n8k8
// TF32 (sm_80+) at one of two precisions (SPLIT, an int kind of warp_gemm_tf32.cuh):
//   SPLIT (precision="highest"): 3xTF32, operands split into big + small, each k-step's
//         three MMAs in a fresh fragment added to the accumulator by FADD: float32 accuracy.
//   plain (precision="tf32"): one MMA a product, ~2^-11 an operand.
//   load Q tile; split it in place (SPLIT: Q_small beside it; plain: Q rounded)
//   for each visible K/V tile j (the next one streams in with cp.async meanwhile):
//       S = Q K_j^T                           (warp_gemm_qk_tf32; K split per fragment)
//       x = S * scale * log2(e), masked       (score_mod.cuh: as the 16-bit kernel)
//       m_new = max(m, rowmax(x)); P = 2^(x - m_new); l = l * 2^(m - m_new) + rowsum(P)
//       O = O * 2^(m - m_new) + P V_j         (P stays in registers in fp32 and is split,
//                                              or rounded, per k-step: warp_gemm_pv_tf32)
//   O = O / l; lse = (m + log2 l) ln 2
// The data stay float32 from HBM to the MMAs (no conversion pass). Every tile's rows are
// padded by 4 floats (warp_gemm_tf32.cuh: conflict-free ldmatrix of Q and K and 4-byte
// loads of V with one pitch). With EXTRA, each K/V stage has an fp32 bias tile (BM x BN,
// pitch BN + 8) beside it, read two neighbouring scores at a time.
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

template <typename Cfg, bool EXTRA, int SPLIT>
struct FwdTf32Traits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int STRIPS = BM / (16 * WARPS);     // 16-row strips per warp
    static constexpr int WARP_ROWS = 16 * STRIPS;
    static constexpr int PITCH = HEAD + 4;               // = 4 (mod 32) floats: warp_gemm_tf32.cuh
    static constexpr int S_TILES = BN / 8;               // n8 tiles of one strip's S
    static constexpr int O_TILES = HEAD / 8;             // n8 tiles of one strip's O
    static constexpr int Q_ELEMS = BM * PITCH;           // Q (big), and with SPLIT Q_small as much again
    static constexpr int KV_ELEMS = BN * PITCH;          // one K or V stage
    static constexpr int BIAS_PITCH = BN + 8;            // = 8 (mod 16) floats: scale_add_bias_frags_f32
    static constexpr int BIAS_ELEMS = EXTRA ? BM * BIAS_PITCH : 0;   // one bias stage
    static constexpr int SMEM_BYTES =
        ((SPLIT ? 2 : 1) * Q_ELEMS + 2 * Cfg::STAGES * KV_ELEMS + Cfg::STAGES * BIAS_ELEMS) * int(sizeof(float));
    static_assert(HEAD % 32 == 0 && BN % 16 == 0, "tiles: n8 pairs; pitches = 4 (mod 32)");
    static_assert(BM % (16 * WARPS) == 0, "each warp owns whole 16-row strips");
    static_assert(Cfg::STAGES == 2, "K/V tiles are double-buffered");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first;
// KV_SPLIT: that many times FwdParams::num_splits, each copy over its split's key tiles (KeySplit).
// PACKED: the blocks of packed sequences (cuflash.varlen; PackedBlock, scheduler.cuh), each with its
// sequence's own query and key counts; without EXTRA or KV_SPLIT.
template <typename T, typename Cfg, typename Flags, bool VEC, int SPLIT, bool KV_SPLIT = false, bool PACKED = false>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_fwd_tf32(const FwdParams p) {
    static_assert(sizeof(T) == sizeof(float), "TF32 tensor cores: float32 only");
    typedef FwdTf32Traits<Cfg, Flags::EXTRA, SPLIT> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, P = Tr::PITCH, M = Tr::STRIPS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* q_s = reinterpret_cast<float*>(smem_raw);     // Q, then its big part
    float* q_small_s = q_s + Tr::Q_ELEMS;                 // SPLIT: Q's small part
    float* k_s = q_small_s + (SPLIT ? Tr::Q_ELEMS : 0);   // stage i at k_s + i * KV_ELEMS
    float* v_s = k_s + 2 * Tr::KV_ELEMS;
    float* bias_s = v_s + 2 * Tr::KV_ELEMS;               // stage i at bias_s + i * BIAS_ELEMS (EXTRA)

    const AttnDims& dims = p.dims;
    typedef KeySplit<BM, KV_SPLIT> Split;
    static_assert(!PACKED || !(KV_SPLIT || Flags::EXTRA), "packed sequences: the plain kernel, unsplit");
    const PackedBlock seq = PACKED ? PackedBlock::of_cta(p.mask, dims.heads_q) : PackedBlock{};
    const QueryBlock blk = PACKED ? seq.query_block(dims, BM)
                                  : Split::query_block(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // per-sequence key counts: a KV cache's (MaskParams::key_lengths: the split kernels without EXTRA) or
    // a packed sequence's
    constexpr bool PER_SEQ = (KV_SPLIT || PACKED) && !Flags::EXTRA;
    typedef ScoreMod<Flags, float, float, PER_SEQ> Mod;
    const Mod mod = [&]() {
        if constexpr (PACKED) return Mod(p.mask, seq, p.scale_log2_f, blk.head);
        else return Mod(p.mask, dims, p.scale_log2_f, blk.batch, blk.head);
    }();
    const float x_per_s = mod.x_per_score();
    const TileRange keys = Split::keys(mod.key_tiles(blk.m0, blk.rows, BN), p);
    // PER_SEQ: the sequence's key count, where V's copies stop (load_kv_tile), parked in the padding of
    // Q's first row (columns HEAD.., which no copy, split or fragment load touches) and read back a tile:
    // held in a register through the loop it spilled the 128x32 tile (24 bytes). Not a static __shared__
    // variable: it would add to the dynamic size, which fills the 99 KB GPUs' limit at head dim 128.
    // PACKED: the sequence's first key row beside it (held through the loop it spilled the same tile).
    int* parked_keys = reinterpret_cast<int*>(q_s + HEAD);
    if constexpr (PER_SEQ) {
        if (threadIdx.x == 0) {
            parked_keys[0] = mod.lk;
            if (PACKED) parked_keys[1] = seq.k_start;
        }
        __syncthreads();
    }

    auto load_kv = [&](int j, int stage) {
        QueryBlock kv_block = blk;
        if constexpr (PACKED) kv_block.batch = parked_keys[1];   // K and V rows from the sequence's first key
        load_kv_tile<float, BM, BN, HEAD, P, Tr::BIAS_PITCH, Tr::THREADS, VEC, Tr::KV_ELEMS, Tr::BIAS_ELEMS, false,
                     PACKED>(k_s, v_s, bias_s, stage, p, kv_block, mod.has_bias(), j * BN,
                             PER_SEQ ? *parked_keys : dims.lk);
        cp_async_commit();
    };
    // The visible key tiles in order (block sparsity and mask summaries skip some).
    auto next_tile = [&](int j) { return mod.next_key_tile(j, keys.end, blk.m0, blk.rows, BN); };

    float acc_o[M][Tr::O_TILES][4];
    float row_max[M][2], row_sum[M][2];
    start_rows(acc_o, row_max, row_sum);

    int j = next_tile(keys.begin);
    if (j < keys.end) {
        load_tile<float, BM, HEAD, P, Tr::THREADS, VEC>(q_s, p.q.at<const float>(blk.batch, blk.head, blk.m0),
                                                        p.q.row_stride, blk.rows, dims.d);
        load_kv(j, 0);
        // Q is split once, before the loop: the first tile's K/V arrive meanwhile. The loop's
        // first __syncthreads publishes the split.
        cp_async_wait<0>();
        __syncthreads();
        split_tile<SPLIT, BM, HEAD, P, Tr::THREADS>(q_s, q_small_s);
    }
    const int warp_row0 = blk.m0 + warp * Tr::WARP_ROWS;
    // Without EXTRA, the key tiles this warp's rows see whole, found once: inside
    // them the loop carries no mask work and no per-tile classification.
    TileRange full{0, 0};
    if constexpr (!Flags::EXTRA) full = mod.full_key_tiles(warp_row0, Tr::WARP_ROWS, BN);
    for (int stage = 0; j < keys.end; stage ^= 1) {
        const int next = next_tile(j + 1);
        prefetch_next_step<2>(next, keys.end, stage, load_kv);   // the next visible tile into the other stage
        __syncthreads();

        float s[M][Tr::S_TILES][4];   // S = Q K^T for this warp's rows
#pragma unroll
        for (int m = 0; m < M; ++m) zero_frags(s[m]);
        warp_gemm_qk_tf32<SPLIT, M, BN, HEAD, P>(s, q_s + warp * Tr::WARP_ROWS * P,
                                                 q_small_s + warp * Tr::WARP_ROWS * P, k_s + stage * Tr::KV_ELEMS,
                                                 lane);
        const int n0 = j * BN;
        const bool partial = Flags::EXTRA ? mod.tile_is_partial(warp_row0, Tr::WARP_ROWS, n0, BN) : !full.contains(j);
        const float* bias_tile = bias_s + stage * Tr::BIAS_ELEMS + (warp * Tr::WARP_ROWS) * Tr::BIAS_PITCH;
        // The absolute (query, key) of element i of n8 tile n in strip m.
        auto strip_coord = [=](int m) {
            return [=](int n, int i, int& row, int& col) {
                row = warp_row0 + 16 * m + frag_row(lane, i);
                col = n0 + frag_col(lane, n, i);
            };
        };
        // The mask: with EXTRA the bias and score_mod.cuh's per-element test; without,
        // partial tiles only, two bounds a fragment row.
#pragma unroll
        for (int m = 0; m < M; ++m) {
            mask_and_modify(s[m], mod, strip_coord(m), x_per_s, [&] {
                if constexpr (Flags::EXTRA) {
                    if (mod.has_bias())
                        scale_add_bias_frags_f32<BN, Tr::BIAS_PITCH>(s[m], bias_tile + 16 * m * Tr::BIAS_PITCH, lane,
                                                                     mod.scale_log2);
                    apply_score_mod(s[m], mod, partial, strip_coord(m));
                } else if (partial) {
                    mask_partial_strip(s[m], mod, warp_row0 + 16 * m + lane / 4, n0 + 2 * (lane % 4));
                }
            });
        }
        // P = 2^(x - m_new) in place, in fp32 (row_sum takes the same values).
        warp_softmax_tile<Tr>(s, acc_o, row_max, row_sum, softmax_x_per_s(x_per_s), [&](int m, int n, int r, float p0, float p1) {
            s[m][n][2 * r] = p0;
            s[m][n][2 * r + 1] = p1;
        });
        if constexpr (Flags::EXTRA) {
            // Dropout scales the probabilities after the statistics (row_sum counts every key).
#pragma unroll
            for (int m = 0; m < M; ++m) apply_dropout<true>(s[m], mod, strip_coord(m));
        }
        warp_gemm_pv_tf32<SPLIT, M, HEAD, BN, P>(acc_o, s, v_s + stage * Tr::KV_ELEMS, lane);   // O += P V
        __syncthreads();   // the next iteration's prefetch overwrites this stage
        j = next;
    }

    // Epilogue: O = acc_o / l, lse per row. Rows past lq are not written.
    store_o_lse_c_frags<VEC || KV_SPLIT, float, KV_SPLIT>(p, Split::partial_block(blk, dims), warp * Tr::WARP_ROWS,
                                                         lane, acc_o, row_max, row_sum);
}
