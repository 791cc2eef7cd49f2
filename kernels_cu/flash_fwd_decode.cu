// flash_fwd_decode.cu -- the split-KV partial forward for decoding (float16 / bfloat16; float32 on
// 3xTF32; float64 on the fp64 tensor cores): few query rows a (batch, head) block -- Lq new rows, times
// the query heads of a K/V head with packed GQA: one 16-row strip, or 2-4 strips for 16-bit -- over a
// long key range.
//
// flash_fwd_mma's split twin gives each warp 16 query rows of a 64-row block, so a decoding block
// fills one warp's rows and every warp reads each K/V tile whole from shared memory for padding
// rows. Here the warps share the block's Q strips and split each K/V tile's keys instead: warp w
// takes keys [n0 + w * KEYS_W, n0 + (w + 1) * KEYS_W) of tile n0, with its own online softmax
// (softmax.cuh) over its keys. Each K/V element then crosses shared memory once and the padded
// tensor-core work falls by the warp count. At the end the warps' (O, max, sum) merge in shared
// memory, as combine.cuh merges splits, and warp 0 writes the split's partial O and lse (KeySplit,
// scheduler.cuh), which the block's last split (or, without split_counters, the combine kernel) merges.
//   load the Q strips (16 rows each, zeros past the block's rows)
//   for each key tile j of this split (the next one streams in with cp.async meanwhile):
//       S_w = Q K_j[w]^T, masked where the tile is partial (the band, the sequence's own end)
//       online softmax of S_w; O_w += P_w V_j[w]
//   merge the warps' O_w, max_w, sum_w; warp 0 writes O and lse of the split
//   the block's last split to finish merges the splits into out and lse (combine_in_last_split);
//   a call of one split without partial buffers writes out and lse at once
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
#include "warp_gemm_f64.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "epilogue.cuh"
#include "combine.cuh"

// float32 (F32): 3xTF32 on mma.sync m16n8k8 (warp_gemm_tf32.cuh, flash_fwd_tf32.cu's arithmetic at
// precision="highest"): Q split once into big and small parts, K, V and P split per fragment (into
// exact TF32 parts, as the Hopper float32 forward splits); every tile's rows padded by 4 floats (the
// TF32 fragment loads' conflict-free pitch) instead of swizzled.
// float64 (F64): flash_fwd_dmma.cu's arithmetic (warp_gemm_f64.cuh) with fp64 accumulators and softmax,
// the strip as two 8-row tiles; Q and K rows padded to head + 4 doubles, V rows to head + 2 (each
// operand's conflict-free pitch). On sm_90 both GEMMs run on m16n8k8, the full fp64 tensor rate (m8n8k4
// runs at half, benchmarks/dmma_rate.py; m16n8k16 for S spills with the page cursor); before sm_90, on
// m8n8k4.
// 16-bit blocks of 32 or 64 rows (STRIPS = BM / 16; the table has 32 at head dim 128): every warp holds every
// strip's O over its keys, so each K/V element still crosses shared memory once, where the 64-row split twin's
// warps each read the whole tile for their strip; the online softmax's rescale and row statistics then come
// every KEYS_W keys for all the strips (dispatch/tables.py: measured per tile).
// float32 blocks of at most 8 query rows (QUERY_MINOR, BM = 8): S^T = K Q^T and O^T += V^T P^T with the
// keys as the MMA's M side and the queries its n8 side (warp_gemm_tf32.cuh's query-minor GEMMs): 8 padded
// query rows instead of 16, Q^T in registers; the online softmax runs down S^T's columns. K rows head + 4
// floats apart (ldmatrix), V rows head + 8 (the transposed reads).
#if __CUDA_ARCH__ >= 900
constexpr int DECODE_F64_WIDE_K = 8;   // warp_gemm_f64.cuh's WIDE_K: m16n8k8
#else
constexpr int DECODE_F64_WIDE_K = 0;   // m8n8k4
#endif

template <typename T, typename Cfg>
struct FwdDecodeTraits {
    static constexpr bool F32 = sizeof(T) == sizeof(float), F64 = sizeof(T) == sizeof(double);
    typedef typename AccumOf<T>::type A;          // float; double for float64
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr bool QUERY_MINOR = BM == 8;  // S^T and O^T: float32 blocks of at most 8 query rows
    static constexpr int LAYOUT = QUERY_MINOR ? 2 : F64 ? 1 : 0;   // StripRows' fragments
    static constexpr int STRIPS = sizeof(T) == 2 ? BM / 16 : 1;      // 16-row strips of Q every warp holds
    static constexpr int KEYS_W = BN / WARPS;     // keys of a tile each warp takes
    static constexpr int PITCH = F32 || F64 ? HEAD + 4 : HEAD + 8;      // Q's shared row pitch in elements (padding)
    static constexpr int KV_PITCH = F32 || F64 ? HEAD + 4 : HEAD;       // K's; 16-bit: swizzled rows, no padding
    static constexpr int V_PITCH = QUERY_MINOR ? HEAD + 8 : F64 ? HEAD + 2 : KV_PITCH;   // V's
    // S: n8 tiles of one warp's S (QUERY_MINOR: 16-key tiles of S^T); O: n8 tiles of O (16-column tiles of O^T)
    static constexpr int S_TILES = QUERY_MINOR ? KEYS_W / 16 : KEYS_W / 8;
    static constexpr int O_TILES = QUERY_MINOR ? HEAD / 16 : HEAD / 8;
    static constexpr int Q_ELEMS = (F32 ? 2 : 1) * BM * PITCH;   // F32: Q's big part, then its small part
    static constexpr int KV_ELEMS = BN * (V_PITCH > KV_PITCH ? V_PITCH : KV_PITCH);   // one K or V stage
    static constexpr int SMEM_BYTES = (Q_ELEMS + 2 * Cfg::STAGES * KV_ELEMS) * int(sizeof(T));
    // The warps' merge, a strip at a time: every warp but 0 leaves its O fragments and row statistics of the
    // strip in the K/V stages.
    static constexpr int MERGE_ELEMS = (WARPS - 1) * 32 * (4 * O_TILES + 4);
    static_assert(BM == 16 || (QUERY_MINOR && F32) || (sizeof(T) == 2 && (BM == 32 || BM == 64)),
                  "one 16-row strip (float32: or 8 query rows; 16-bit: or 2-4 strips), shared by the warps");
    static_assert(!QUERY_MINOR || KEYS_W % 16 == 0, "whole 16-key tiles of S^T a warp");
    static_assert(!USER_SCORE && !USER_MASK, "no user modifications in the decoding kernel (the split twin takes them)");
    static_assert(sizeof(T) == 2 || F32 || F64, "16-bit, float32 or float64");
    static_assert(KEYS_W % (sizeof(T) == 2 ? 16 : 8) == 0 && HEAD % (F64 ? 16 : F32 ? 32 : 64) == 0,
                  "whole n8 tiles of keys a warp (16-bit: k16 steps of O += P V); whole k steps of the head; "
                  "16-bit rows of 8 chunks");
    static_assert(Cfg::STAGES == 2 || Cfg::STAGES == 3, "K/V tiles in a ring of two or three stages");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
    static_assert(MERGE_ELEMS * int(sizeof(A)) <= 2 * Cfg::STAGES * KV_ELEMS * int(sizeof(T)),
                  "the merge fits in the K/V stages");
};

// A warp's rows of the strips: O, and the row maximum and sum of the lane's two rows (g and g + 8) of each.
// at(m, t, r, e): the lane's element e of O's column tile t in its row r of strip m; stat(m, r, 0) /
// stat(m, r, 1): that row's max / sum. LAYOUT 0 (16-bit and float32): m16n8 C fragments; 1 (float64): two 8-row tiles
// (warp_gemm_f64.cuh); 2 (QUERY_MINOR): O^T's C fragments, the lane's rows the queries 2t and 2t + 1,
// its elements of column tile t the columns 16t + g and 16t + g + 8.
// LAYOUT 0 holds Tr::STRIPS strips (m); the other layouts one (m = 0).
template <typename Tr, int LAYOUT = Tr::LAYOUT>
struct StripRows {
    static constexpr int STRIPS = Tr::STRIPS;
    float acc_o[STRIPS][Tr::O_TILES][4];
    float row_max[STRIPS][2], row_sum[STRIPS][2];
    __device__ __forceinline__ void start() { start_rows(acc_o, row_max, row_sum); }
    __device__ __forceinline__ float& at(int m, int t, int r, int e) { return acc_o[m][t][2 * r + e]; }
    __device__ __forceinline__ float& stat(int m, int r, int which) {
        return which == 0 ? row_max[m][r] : row_sum[m][r];
    }
};

template <typename Tr>
struct StripRows<Tr, 2> {
    static constexpr int STRIPS = 1;
    float acc_o[Tr::O_TILES][4];
    float row_max[2], row_sum[2];
    __device__ __forceinline__ void start() {
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[t][i] = 0.0f;
        row_max[0] = row_max[1] = neg_inf<float>();
        row_sum[0] = row_sum[1] = 0.0f;
    }
    __device__ __forceinline__ float& at(int, int t, int r, int e) { return acc_o[t][2 * e + r]; }
    __device__ __forceinline__ float& stat(int, int r, int which) { return which == 0 ? row_max[r] : row_sum[r]; }
};

template <typename Tr>
struct StripRows<Tr, 1> {
    static constexpr int STRIPS = 1;
    double acc_o[2][Tr::O_TILES][2];
    double row_max[2], row_sum[2];
    __device__ __forceinline__ void start() {
        zero_frags(acc_o);
        row_max[0] = row_max[1] = neg_inf<double>();
        row_sum[0] = row_sum[1] = 0.0;
    }
    __device__ __forceinline__ double& at(int, int t, int r, int e) { return acc_o[r][t][e]; }
    __device__ __forceinline__ double& stat(int, int r, int which) { return which == 0 ? row_max[r] : row_sum[r]; }
};

// The warps' (O, max, sum) of each 16-row strip merged into warp 0's registers, as
// flash_fwd_combine.cu merges splits (in log2 units here): peak = max_w max_w (NaN kept),
// O = sum_w O_w 2^(max_w - peak), sum = sum_w sum_w 2^(max_w - peak). A warp that saw no key has
// max -inf and O = sum = 0: weight 0. Lane l of every warp holds the same rows and columns, so lane
// l of warp 0 merges lane l's values. `stage`: at least MERGE_ELEMS accumulators of shared memory that
// the key loop's copies and reads have finished with (the barrier here orders them before the writes);
// the strips pass through it one after the other.
template <typename Tr, typename A>
__device__ __forceinline__ void merge_warps_strip(A* stage, int warp, int lane, StripRows<Tr>& rows, int m) {
    constexpr int PER_WARP = 4 * Tr::O_TILES + 4;   // values a lane leaves: O, then max and sum of its two rows
    constexpr int MAX_AT = 4 * Tr::O_TILES, SUM_AT = 4 * Tr::O_TILES + 2;
    __syncthreads();   // the key loop's (or the previous strip's) reads of the stage are done
    if (warp > 0) {
        A* mine = stage + (warp - 1) * PER_WARP * 32 + lane;   // lane-minor: no bank conflicts
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) mine[(4 * t + i) * 32] = rows.at(m, t, i / 2, i % 2);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mine[(MAX_AT + r) * 32] = rows.stat(m, r, 0);
            mine[(SUM_AT + r) * 32] = rows.stat(m, r, 1);
        }
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        A peak = rows.stat(m, r, 0);
        for (int w = 1; w < Tr::WARPS; ++w) {
            const A x = stage[((w - 1) * PER_WARP + MAX_AT + r) * 32 + lane];
            peak = (x != x || peak != peak) ? x + peak : amax(peak, x);
        }
        const A shift = peak == neg_inf<A>() ? A(0) : peak;   // every warp empty: weights 0
        const A own = fast_exp2(rows.stat(m, r, 0) - shift);
        rows.stat(m, r, 1) *= own;
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t) {
            rows.at(m, t, r, 0) *= own;
            rows.at(m, t, r, 1) *= own;
        }
        for (int w = 1; w < Tr::WARPS; ++w) {
            const A* theirs = stage + (w - 1) * PER_WARP * 32 + lane;
            const A weight = fast_exp2(theirs[(MAX_AT + r) * 32] - shift);
            rows.stat(m, r, 1) += weight * theirs[(SUM_AT + r) * 32];
#pragma unroll
            for (int t = 0; t < Tr::O_TILES; ++t) {
                rows.at(m, t, r, 0) += weight * theirs[(4 * t + 2 * r) * 32];
                rows.at(m, t, r, 1) += weight * theirs[(4 * t + 2 * r + 1) * 32];
            }
        }
        rows.stat(m, r, 0) = shift;
    }
}

template <typename Tr, typename A>
__device__ __forceinline__ void merge_warps(A* stage, int warp, int lane, StripRows<Tr>& rows) {
#pragma unroll
    for (int m = 0; m < StripRows<Tr>::STRIPS; ++m) merge_warps_strip<Tr>(stage, warp, lane, rows, m);
}

// QUERY_MINOR's online softmax down S^T's columns (softmax_update_row): a query's scores lie in the 8 lanes
// of its t (lane bits 2-4, STRIDE 4) and in their tiles' two halves; st becomes P. The row sums stay each
// lane's part (summed in store_o_lse_query_minor).
template <typename Tr, int M>
__device__ __forceinline__ void softmax_query_minor(float (&st)[M][4], StripRows<Tr>& rows, float x_per_s) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float x[2 * M];   // the lane's scores of query 2t + e
#pragma unroll
        for (int i = 0; i < 2 * M; ++i) x[i] = st[i / 2][2 * (i % 2) + e];
        const float correction = softmax_update_row<8, 4>(x, rows.row_max[e], rows.row_sum[e], x_per_s);
#pragma unroll
        for (int i = 0; i < 2 * M; ++i) st[i / 2][2 * (i % 2) + e] = x[i];
        if (__all_sync(0xffffffffu, correction == 1.0f)) continue;   // the maxima stay put once a few tiles are in
#pragma unroll
        for (int t = 0; t < Tr::O_TILES; ++t) {
            rows.acc_o[t][e] *= correction;
            rows.acc_o[t][2 + e] *= correction;
        }
    }
}

// QUERY_MINOR's epilogue (finish_row over a query's 8 lanes): O^T's columns 16t + g and 16t + g + 8 of the
// lane's queries 2t + e (those below blk.rows) and their lse (lanes g = 0).
template <bool KV_SPLIT, typename Tr>
__device__ __forceinline__ void store_o_lse_query_minor(const FwdParams& p, const QueryBlock& blk, int lane,
                                                        const StripRows<Tr>& rows) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const FinishedRow<float> f = finish_row<8, 4>(rows.row_max[e], rows.row_sum[e]);
        const int row = 2 * t + e;
        if (row >= blk.rows) continue;
        float* out_row = out_view<KV_SPLIT>(p).template at<float>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
        for (int c = 0; c < Tr::O_TILES; ++c)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = 16 * c + g + 8 * h;
                if (col < p.dims.dv) out_row[col] = rows.acc_o[c][2 * h + e] * f.inv_sum;
            }
        if (g == 0) store_lse(lse_view<KV_SPLIT>(p), blk, row, f.lse);
    }
}

// Warp 0's merged rows written as O and lse: into out and lse (OutT the call's dtype), or with KV_SPLIT into
// the split's slice of the partial buffers (OutT the accumulator type).
template <typename OutT, bool KV_SPLIT, typename Tr>
__device__ __forceinline__ void store_o_lse(const FwdParams& p, const QueryBlock& blk, int lane, const StripRows<Tr>& rows) {
    if constexpr (Tr::QUERY_MINOR)
        store_o_lse_query_minor<KV_SPLIT>(p, blk, lane, rows);
    else if constexpr (Tr::F64)
        store_o_lse_f64_frags<true, OutT, KV_SPLIT>(p, blk, 0, lane, rows.acc_o, rows.row_max, rows.row_sum);
    else
        store_o_lse_c_frags<true, OutT, KV_SPLIT>(p, blk, 0, lane, rows.acc_o, rows.row_max, rows.row_sum);
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

// Grid: num_splits x ceil(rows / BM) x heads x batch CTAs (KeySplit), each over its split's key tiles.
// KV_SPLIT is the split forwards' last template parameter (the variant table names every split kernel
// so); this kernel has no unsplit form.
template <typename T, typename Cfg, typename Flags, bool VEC, bool KV_SPLIT>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_fwd_decode(const FwdParams p) {
    typedef FwdDecodeTraits<T, Cfg> Tr;
    typedef typename Tr::A A;
    static_assert(KV_SPLIT, "a split-KV partial kernel only: the combine kernel finishes its results");
    static_assert(!Flags::EXTRA, "no EXTRA option: flash_fwd_mma's split twin takes those calls");
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, P = Tr::PITCH, KP = Tr::KV_PITCH, VP = Tr::V_PITCH;
    // F32, precision="highest": K, V and P split into parts the tensor core reads exactly (TF32X3_PARTS, four
    // instructions an element against the rounded split's seven; those splits are most of the float32
    // kernel's instructions: ncu, 121 warp instructions a key); Q is split once, rounded (split_tile).
    constexpr int SPLIT = TF32X3_PARTS;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_s = reinterpret_cast<T*>(smem_raw);    // F32: Q's big part, its small part at q_s + BM * P
    T* k_s = q_s + Tr::Q_ELEMS;                 // stage i at k_s + i * KV_ELEMS
    T* v_s = k_s + Cfg::STAGES * Tr::KV_ELEMS;

    const AttnDims& dims = p.dims;
    typedef KeySplit<BM, true> Split;
    const QueryBlock blk = Split::query_block(dims, shared_scores_head_group<false>(p.mask));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const ScoreMod<Flags, A, T, true> mod(p.mask, dims, acc_param<A>(p.scale_log2, p.scale_log2_f), blk.batch,
                                          blk.head);
    const A x_per_s = mod.x_per_score();
    // Packed GQA rows under a band (MaskParams::band_period): the block holds its K/V head's query heads of
    // `period` positions each, so its rows see what positions [0, period) see, and a lane's two rows sit
    // at positions row % period.
    const int period = Flags::BAND ? p.mask.band_period : 0;
    const int band_row0 = period > 0 ? 0 : blk.m0;
    const TileRange keys = Split::keys(mod.key_tiles(band_row0, period > 0 ? period : blk.rows, BN), p);
    // The tiles every row of the block sees whole (the band's inside, short of the sequence's end).
    const TileRange full = mod.full_key_tiles(band_row0, period > 0 ? period : BM, BN);
    // the lane's two rows: g and g + 8 of the (first) strip; QUERY_MINOR: the queries 2t and 2t + 1
    const int lane_row = blk.m0 + (Tr::QUERY_MINOR ? 2 * (lane % 4) : lane / 4);
    const int other_row = lane_row + (Tr::QUERY_MINOR ? 1 : 8);
    const int row_a = period > 0 ? lane_row % period : lane_row, row_b = period > 0 ? other_row % period : other_row;

    PageCursor<T, BN, HEAD, Tr::THREADS, VEC> pages;   // a paged cache's pages, a tile ahead
    auto load_kv = [&](int j, int stage) {
        load_kv_tile<T, BM, BN, HEAD, KP, BN + 8, Tr::THREADS, VEC, Tr::KV_ELEMS, 0, true, false, sizeof(T) == 2, VP>(
            k_s, v_s, nullptr, stage, p, blk, false, j * BN, mod.lk, &pages);
        cp_async_commit();
    };

    StripRows<Tr> rows;
    rows.start();

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
    // Three stages (a tuning candidate, tune_decode.py --stages; the table's tiles have two): two tiles ahead,
    // so that a CTA alone on its SM keeps two tiles of copies in flight while it computes on a third; every
    // step commits one group (empty past the split's end), so that waiting for all but the two latest leaves
    // this step's tile landed.
    if constexpr (Cfg::STAGES == 3) {
        if (j + 1 < keys.end) load_kv(j + 1, 1);
        else cp_async_commit();
    }
    // QUERY_MINOR: Q^T's B fragments, big and small, in registers for the whole key loop
    unsigned qt_big[Tr::QUERY_MINOR ? HEAD / 8 : 1][2], qt_small[Tr::QUERY_MINOR ? HEAD / 8 : 1][2];
    if constexpr (Tr::QUERY_MINOR) {
        if (j < keys.end) {
            __syncthreads();   // the split
            load_qt_frags_tf32<HEAD, P>(qt_big, qt_small, reinterpret_cast<const float*>(q_s),
                                        reinterpret_cast<const float*>(q_s) + BM * P, lane);
        }
    }
    const int key_w = warp * Tr::KEYS_W;   // this warp's keys within a tile
    for (int stage = 0; j < keys.end; stage = stage + 1 == Cfg::STAGES ? 0 : stage + 1) {
        if constexpr (Cfg::STAGES == 3) {
            if (j + 2 < keys.end) load_kv(j + 2, stage == 0 ? 2 : stage - 1);   // the stage of tile j - 1
            else cp_async_commit();
            cp_async_wait<2>();
        } else {
            prefetch_next_step<2>(j + 1, keys.end, stage, [&](int j_next, int s_next) { load_kv(j_next, s_next); });
        }
        __syncthreads();

        const T* k_w = k_s + stage * Tr::KV_ELEMS + key_w * KP;   // this warp's keys of K and V
        const T* v_w = v_s + stage * Tr::KV_ELEMS + key_w * VP;
        const int col0 = j * BN + key_w + 2 * (lane % 4);         // the lane's first key
        if constexpr (Tr::QUERY_MINOR) {
            float st[Tr::S_TILES][4];   // S^T = K Q^T: this warp's keys x the block's queries
            warp_gemm_kq_tf32<SPLIT, Tr::S_TILES, HEAD, KP>(st, reinterpret_cast<const float*>(k_w), qt_big, qt_small,
                                                            lane);
            if (!full.contains(j))   // rows: the lane's queries; keys 16 m + g + 8 r of the warp's, elements 2 r + e
                mask_strip_rows<float, Tr::S_TILES>(mod, row_a, row_b, j * BN + key_w,
                                                    [&](int m, int r) { return 16 * m + lane / 4 + 8 * r; },
                                                    [&](int e, int m, int r) -> float& { return st[m][2 * r + e]; });
            softmax_query_minor(st, rows, x_per_s);
            warp_gemm_vtp_tf32<SPLIT, Tr::S_TILES, HEAD, VP>(rows.acc_o, st, reinterpret_cast<const float*>(v_w), lane);
        } else if constexpr (Tr::F64) {
            double s[2][Tr::S_TILES][2];   // S = Q K^T over this warp's keys, two 8-row tiles
            zero_frags(s);
            warp_gemm_nt_f64<2, Tr::S_TILES, HEAD, P, KP, DECODE_F64_WIDE_K>(s, q_s, k_w, lane);
            if (!full.contains(j)) mask_partial_strip_rows(s, mod, row_a, row_b, col0);
#pragma unroll
            for (int m = 0; m < 2; ++m)
                warp_softmax_update_f64<Tr>(s[m], rows.acc_o[m], rows.row_max[m], rows.row_sum[m], x_per_s);
            warp_gemm_rn_f64<2, Tr::O_TILES, Tr::S_TILES, VP, DECODE_F64_WIDE_K>(rows.acc_o, s, v_w, lane);
        } else {
            float s[Tr::STRIPS][Tr::S_TILES][4];   // S = Q K^T over this warp's keys, every strip
#pragma unroll
            for (int m = 0; m < Tr::STRIPS; ++m) zero_frags(s[m]);
            if constexpr (Tr::F32) {
                const float* q_big = reinterpret_cast<const float*>(q_s);
                warp_gemm_qk_tf32<SPLIT, 1, Tr::KEYS_W, HEAD, P>(s, q_big, q_big + BM * P,
                                                                 reinterpret_cast<const float*>(k_w), lane);
            } else {
                warp_gemm_strips_smem<T, Tr::STRIPS, Tr::KEYS_W, HEAD, P, KP, false, true>(s, q_s, k_w, lane);
            }
            if (!full.contains(j)) {
#pragma unroll
                for (int m = 0; m < Tr::STRIPS; ++m) {   // strip m's rows: the lane's two, 16 m further on
                    const int a = lane_row + 16 * m, b = other_row + 16 * m;
                    mask_partial_strip_rows(s[m], mod, m == 0 ? row_a : period > 0 ? a % period : a,
                                            m == 0 ? row_b : period > 0 ? b % period : b, col0);
                }
            }
            if constexpr (Tr::F32) {   // P in float32, split per fragment in O += P V
                warp_softmax_tile<Tr>(s, rows.acc_o, rows.row_max, rows.row_sum, x_per_s,
                                      [&](int m, int n, int r, float p0, float p1) {
                                          s[m][n][2 * r] = p0;
                                          s[m][n][2 * r + 1] = p1;
                                      });
                warp_gemm_pv_tf32<SPLIT, 1, HEAD, Tr::KEYS_W, P>(rows.acc_o, s, reinterpret_cast<const float*>(v_w),
                                                                 lane);
            } else {
                unsigned p16[Tr::STRIPS][Tr::S_TILES][2];   // P in 16 bits, the A operand of O += P V
                warp_softmax_tile<Tr>(s, rows.acc_o, rows.row_max, rows.row_sum, x_per_s,
                                      [&](int m, int n, int r, float p0, float p1) {
                                          p16[m][n][r] = pack2<T>(p0, p1);
                                      });
                warp_gemm_strips_rn16<T, Tr::STRIPS, HEAD, Tr::KEYS_W, KP, true>(rows.acc_o, p16, v_w, lane);
            }
        }
        __syncthreads();   // the next iteration's prefetch overwrites this stage
        j = j + 1;
    }

    merge_warps<Tr>(reinterpret_cast<A*>(k_s), warp, lane, rows);
    const bool one_split = p.out_partial.ptr == nullptr;   // no partial buffers: the block's result
    if (warp == 0) {
        if (one_split) store_o_lse<T, false>(p, blk, lane, rows);
        else store_o_lse<A, true>(p, Split::partial_block(blk, dims), lane, rows);
    }
    if (p.split_counters != nullptr && !one_split)
        combine_in_last_split<T, Tr>(p, blk, reinterpret_cast<int*>(q_s), warp, lane);
}
