// flash_bwd_dbias.cu -- dbias of the tensor-core backward, by a kernel of its own
// (float16 / bfloat16, head dim <= 128).
//
// dbias is dS summed over every axis the bias broadcasts along: batch, heads and,
// for a one-row bias ((B, 1, 1, Lk), key padding), the query rows. Added from the
// dK/dV kernel that sum costs one fp32 atomic per score element, all B x H heads
// of a shared (1, 1, L, L) bias landing on the same addresses (on an
// H100 at B=4, H=16, L=4096, D=64: 15-24 ms of a 31 ms forward+backward). Here
// one CTA owns one BM x BN tile of the accumulator and walks every (batch, head,
// query block) that adds to it, recomputing
//     S = Q_i K_j^T,  P = 2^(S * scale + bias - lse),  dP = dO_i V_j^T,  dS = P (dP - Dsum)
// (two of the backward's five GEMMs) and summing dS in registers, in a fixed
// order; the tile is written once, without atomics, so dbias is deterministic.
// When the accumulator has too few tiles to fill the GPU, the walk is cut into
// DbiasParams::splits parts, each writing its own slice (split_stride apart);
// the host adds the slices, in order.
//
// Warp w owns query rows 16w..16w+15 of the step's block (the dQ kernel's
// layout). The step's tiles (Q, dO, K, V, bias) are double-buffered with cp.async.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "bias_grad.cuh"

template <typename T, typename Cfg>
struct DbiasMmaTraits {
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN, WARPS = Cfg::WARPS;
    static constexpr int STAGES = Cfg::STAGES, THREADS = 32 * WARPS;
    static constexpr int PITCH = HEAD + 8;         // padded rows: conflict-free ldmatrix
    static constexpr int BIAS_PITCH = BN + 8;
    static constexpr int ROWS_ELEMS = (BM + BN) * PITCH;                 // Q or dO (BM rows) + K or V (BN rows)
    static constexpr int STAGE_ELEMS = 2 * ROWS_ELEMS + BM * BIAS_PITCH; // Q, K, dO, V, bias
    static constexpr int SMEM_BYTES = STAGES * STAGE_ELEMS * int(sizeof(T)) + 2 * BM * int(sizeof(float));
    static_assert(HEAD % 16 == 0 && BN % 16 == 0, "tile shape");
    static_assert(BM == 16 * WARPS, "each warp owns 16 query rows");
    static_assert(STAGES == 1 || STAGES == 2, "single or double buffered");
    static_assert(WARPS * BN * int(sizeof(float)) <= STAGES * STAGE_ELEMS * int(sizeof(T)),
                  "the one-row sum reuses the tile buffers");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// The accumulator tile a CTA owns and the steps it walks. Axes the bias
// broadcasts along (its accumulator's stride 0, or one query row) are walked;
// the others are decoded from the grid: key block fastest, then query block,
// head, batch and split. Step t of the walk is (batch, head, query block) with
// the query block fastest.
struct DbiasWork {
    int n0, keys;                          // the key block
    int own_m0, own_head, own_batch;       // the owned query block (0 for a one-row bias), head, batch
    int walk_q, walk_h, walk_b;            // how many query blocks / heads / batches the walk runs over
    int split, first, end;                 // this CTA's part of the walk: steps [first, end)

    template <int BM, int BN>
    __device__ __forceinline__ static DbiasWork from_grid(const DbiasParams& g, const AttnDims& dims) {
        const bool over_b = g.acc.batch_stride == 0, over_h = g.acc.head_stride == 0, over_q = g.rows_broadcast;
        const int q_blocks = ceil_div(dims.lq, BM), k_blocks = ceil_div(dims.lk, BN);
        int idx = blockIdx.x;
        DbiasWork w;
        w.n0 = (idx % k_blocks) * BN;
        w.keys = imin(BN, dims.lk - w.n0);
        idx /= k_blocks;
        w.own_m0 = 0;
        if (!over_q) { w.own_m0 = (idx % q_blocks) * BM; idx /= q_blocks; }
        w.own_head = 0;
        if (!over_h) { w.own_head = idx % dims.heads_q; idx /= dims.heads_q; }
        w.own_batch = 0;
        if (!over_b) { w.own_batch = idx % dims.batch; idx /= dims.batch; }
        w.walk_q = over_q ? q_blocks : 1;
        w.walk_h = over_h ? dims.heads_q : 1;
        w.walk_b = over_b ? dims.batch : 1;
        const long long total = (long long)w.walk_b * w.walk_h * w.walk_q;
        w.split = idx;
        w.first = int(total * w.split / g.splits);
        w.end = int(total * (w.split + 1) / g.splits);
        return w;
    }

    template <int BM>
    __device__ __forceinline__ int m0(int step) const { return walk_q > 1 ? (step % walk_q) * BM : own_m0; }
    __device__ __forceinline__ int head(int step) const { return walk_h > 1 ? (step / walk_q) % walk_h : own_head; }
    __device__ __forceinline__ int batch(int step) const { return walk_b > 1 ? step / (walk_q * walk_h) : own_batch; }
};

// Grid: ceil(Lk / BN) x (query blocks, heads, batches the bias does not broadcast
// along) x splits CTAs (cuflash/_dispatch/masking.py, DbiasPlan.grid).
template <typename T, typename Cfg, typename Flags, bool VEC>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dbias_mma(const BwdParams p) {
    typedef DbiasMmaTraits<T, Cfg> Tr;
    constexpr int BM = Tr::BM, BN = Tr::BN, HEAD = Tr::HEAD, P = Tr::PITCH;
    static_assert(Flags::EXTRA, "a bias is an EXTRA piece");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* stages = reinterpret_cast<T*>(smem_raw);   // per stage: Q, K (pitch P), dO, V, bias (BIAS_PITCH)
    float* lse_s = reinterpret_cast<float*>(stages + Tr::STAGES * Tr::STAGE_ELEMS);
    float* dsum_s = lse_s + BM;
    auto q_of = [&](int stage) { return stages + stage * Tr::STAGE_ELEMS; };
    auto k_of = [&](int stage) { return q_of(stage) + BM * P; };
    auto do_of = [&](int stage) { return q_of(stage) + Tr::ROWS_ELEMS; };
    auto v_of = [&](int stage) { return do_of(stage) + BM * P; };
    auto bias_of = [&](int stage) { return q_of(stage) + 2 * Tr::ROWS_ELEMS; };

    const AttnDims& dims = p.dims;
    const DbiasParams& g = p.dbias;
    const DbiasWork w = DbiasWork::from_grid<BM, BN>(g, dims);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, row0 = 16 * warp;
    ScoreMod<Flags, float, T> mod(p.mask, dims, acc_param<float>(p.scale_log2, p.scale_log2_f), w.own_batch, w.own_head);

    auto rows_of = [&](int step) { return imin(BM, dims.lq - w.m0<BM>(step)); };
    auto next_step = [&](int step) {   // the first step >= step whose (query block, key block) tile is visible
        for (; step < w.end; ++step) {
            mod.batch = w.batch(step);
            mod.head = w.head(step);
            if (mod.classify(w.m0<BM>(step), rows_of(step), w.n0, w.keys) != TILE_SKIP) break;
        }
        return step;
    };
    auto issue_step = [&](int step, int stage) {
        const int batch = w.batch(step), head = w.head(step), m0 = w.m0<BM>(step), rows = rows_of(step);
        load_row_tiles<T, BM, HEAD, P, Tr::THREADS, VEC>(q_of(stage), p.q, dims.d, do_of(stage), p.dout, dims.dv,
                                                         batch, head, m0, rows);
        load_row_tiles<T, BN, HEAD, P, Tr::THREADS, VEC>(k_of(stage), p.k, dims.d, v_of(stage), p.v, dims.dv,
                                                         batch, head / dims.group, w.n0, w.keys);
        load_score_tile<T, BM, BN, Tr::BIAS_PITCH, Tr::THREADS>(bias_of(stage), p.mask.bias, batch, head, m0, w.n0,
                                                               rows, w.keys);
        cp_async_commit();
    };

    float acc_db[BN / 8][4];   // dS summed over the walk: this warp's 16 rows x BN keys
    zero_frags(acc_db);
    int step = next_step(w.first);
    if (step < w.end) issue_step(step, 0);
#pragma unroll 1
    for (int stage = 0; step < w.end;) {
        const int next = next_step(step + 1);
        const int m0 = w.m0<BM>(step);
        mod.batch = w.batch(step);
        mod.head = w.head(step);
        prefetch_next_step<Tr::STAGES>(next, w.end, stage, issue_step);   // the next step meanwhile
        load_row_stats<BM, Tr::THREADS>(lse_s, dsum_s, p.lse, p.dsum, mod.batch, mod.head, m0, rows_of(step));
        __syncthreads();

        float s[BN / 8][4], dp[BN / 8][4];
        zero_frags(s);
        zero_frags(dp);
        warp_gemm_nt<T, BN, HEAD, P, P>(s, q_of(stage) + row0 * P, k_of(stage), lane);     // S = Q K^T
        warp_gemm_nt<T, BN, HEAD, P, P>(dp, do_of(stage) + row0 * P, v_of(stage), lane);   // dP = dO V^T
        scale_add_bias_frags<T, BN, Tr::BIAS_PITCH, false>(s, bias_of(stage) + row0 * Tr::BIAS_PITCH, lane,
                                                           mod.scale_log2);
        auto coord = [&](int n, int i, int& row, int& col) {
            row = m0 + row0 + frag_row(lane, i);
            col = w.n0 + frag_col(lane, n, i);
        };
        apply_score_mod(s, mod, mod.tile_is_partial(m0 + row0, 16, w.n0, BN), coord);
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; i += 2) {   // elements i, i + 1: one row, keys col and col + 1
                const int row = row0 + frag_row(lane, i);
                float keep0 = 1.0f, keep1 = 1.0f;
                const int col = w.n0 + frag_col(lane, n, i);
                if (mod.has_dropout()) mod.keep2(m0 + row, col, keep0, keep1);
                mod.template prob_and_dscore_at<false>(s[n][i], dp[n][i], lse_s[row], dsum_s[row], keep0, 1.0f, m0 + row,
                                                       col);
                mod.template prob_and_dscore_at<false>(s[n][i + 1], dp[n][i + 1], lse_s[row], dsum_s[row], keep1, 1.0f,
                                                       m0 + row, col + 1);
                acc_db[n][i] += dp[n][i];
                acc_db[n][i + 1] += dp[n][i + 1];
            }
        __syncthreads();   // this stage and the row stats are read; the next step may overwrite them
        step = next;
        if (Tr::STAGES == 2) stage ^= 1;
        else if (step < w.end) issue_step(step, 0);
    }

    float* out = const_cast<float*>(g.acc.at<float>(w.own_batch, w.own_head, 0, w.n0))
                 + w.split * g.split_stride;
    if (!g.rows_broadcast) {   // one owner per element: plain stores
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = w.own_m0 + row0 + frag_row(lane, i), col = frag_col(lane, n, i);
                if (row < dims.lq && col < w.keys) out[row * g.acc.row_stride + col] = acc_db[n][i];
            }
        return;
    }
    // A one-row bias: the sum over the 16 rows of each warp (the two rows of a lane,
    // then the 8 lanes of a column), then over the warps in order, in shared memory.
    float* col_s = reinterpret_cast<float*>(smem_raw);   // [WARPS][BN]; the tile buffers are free now
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            float x = acc_db[n][c] + acc_db[n][c + 2];
            x += __shfl_xor_sync(0xffffffffu, x, 4);
            x += __shfl_xor_sync(0xffffffffu, x, 8);
            x += __shfl_xor_sync(0xffffffffu, x, 16);
            if (lane < 4) col_s[warp * BN + frag_col(lane, n, c)] = x;
        }
    __syncthreads();
    for (int col = threadIdx.x; col < w.keys; col += Tr::THREADS) {
        float sum = 0.0f;
        for (int k = 0; k < Tr::WARPS; ++k) sum += col_s[k * BN + col];
        out[col] = sum;
    }
}
