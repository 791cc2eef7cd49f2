// softmax.cuh -- online-softmax state of one query row, in log2 units, and the
// backward's view of it.
//
// Forward invariant after each key tile (x = score_mod's log2-unit score):
//     row_max = max over seen keys of x
//     row_sum = sum over seen keys of 2^(x - row_max)   (this thread's part)
//     acc_o   = sum over seen keys of 2^(x - row_max) * v
// so out = acc_o / row_sum and lse = (row_max + log2(row_sum)) * ln 2 at the end.
// The tensor-core forward relaxes the first line (lazy rescaling): row_max is any
// reference with max x - RESCALE_SLACK <= row_max <= max x, moved only when a
// tile's max exceeds it by more than RESCALE_SLACK; the other two lines and the
// results hold for any such reference, and p = 2^(x - row_max) <= 2^RESCALE_SLACK
// stays far from overflow in fp32, fp16 and bf16.
// The backward recomputes P = 2^(x - lse * log2 e) from the saved lse.
// GROUP consecutive lanes hold pieces of the same row; row_max is kept equal
// across them, row_sum is reduced only once, in the epilogue (epilogue.cuh).
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "user_mod.cuh"

constexpr float RESCALE_SLACK = 8.0f;

// Fold the tile's scores into the row state: s holds x / x_per_s, masked ones
// -inf (x itself with the default x_per_s = 1; raw dot products with x_per_s =
// ScoreMod::x_per_score, which is positive, so it commutes with the max and the
// scale joins the subtraction in one FMA). s is overwritten with
// p = 2^(x - row_max_new). Returns the factor 2^(row_max_old - row_max_new) by
// which the caller rescales the row of acc_o. STRIDE: the row's GROUP lanes lie STRIDE apart (group_max).
template <int GROUP, int STRIDE = 1, int N, typename A>
__device__ __forceinline__ A softmax_update_row(A (&s)[N], A& row_max, A& row_sum, A x_per_s = A(1)) {
    A tile_max = s[0];
#pragma unroll
    for (int j = 1; j < N; ++j) tile_max = amax(tile_max, s[j]);
    tile_max = group_max<GROUP, STRIDE>(tile_max) * x_per_s;
    const A new_max = amax(row_max, tile_max);
    // A row that has allowed nothing yet has max -inf; subtracting 0 instead
    // keeps every p at exactly 0 rather than NaN (-inf - -inf).
    const A ref = new_max == neg_inf<A>() ? A(0) : new_max;
    const A correction = fast_exp2(row_max - ref);
    A tile_sum = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        s[j] = fast_exp2(s[j] * x_per_s - ref);
        tile_sum += s[j];
    }
    row_sum = row_sum * correction + tile_sum;
    row_max = new_max;
    return correction;
}

// The fp64 tensor-core forwards' online-softmax step (flash_fwd_dmma.cu, flash_fwd_decode.cu) for the
// row this lane holds in one row tile (C-fragment row lane / 4, 2 S_TILES of its scores; the row's
// other scores are in the 3 neighbouring lanes). s holds x / x_per_s (ScoreMod::x_per_score: raw dot
// products in the plain kernels).
template <typename Tr>
__device__ __forceinline__ void warp_softmax_update_f64(double (&s)[Tr::S_TILES][2], double (&acc_o)[Tr::O_TILES][2],
                                                        double& row_max, double& row_sum, double x_per_s) {
    double (&x)[2 * Tr::S_TILES] = reinterpret_cast<double (&)[2 * Tr::S_TILES]>(s);
    const double correction = softmax_update_row<4>(x, row_max, row_sum, x_per_s);
    // Once a few tiles are in, row maxima rarely move and the correction is exactly 2^0 = 1:
    // skip the 2 O_TILES fp64 multiplies (fp64 CUDA-core work is the softmax's cost here) when
    // no row of the warp needs them.
    if (__all_sync(0xffffffffu, correction == 1.0)) return;
#pragma unroll
    for (int t = 0; t < Tr::O_TILES; ++t) {
        acc_o[t][0] *= correction;
        acc_o[t][1] *= correction;
    }
}

// The saved natural-log lse in log2 units, as the backward's P = 2^(x - lse_log2)
// needs it. A row that saw no key (lse = -inf) maps to +inf: then P = 2^(x - inf)
// is exactly 0 for every x, -inf included, with no per-element test. Rows past
// the sequence end are given +inf too.
template <typename A>
__device__ __forceinline__ A lse_to_log2(A lse) {
    return lse == neg_inf<A>() ? pos_inf<A>() : lse * A(LOG2E);
}

// The backward's two elementwise steps for one score, x = s * x_per_s (x_per_s =
// ScoreMod::x_per_score: the scale where the scores stayed raw dot products, one FFMA
// with the subtraction; else 1):
//     P = 2^(x - lse_log2)      (prob_of_score)
//     dS = P (dP - Dsum)        (dscore_of_prob)
// The head-dim-256 Hopper backward forms them in different warpgroups (P in one, dS
// from P as the other reads it back in 16 bits); every other kernel in one place
// (prob_and_dscore).
template <typename A>
__device__ __forceinline__ A prob_of_score(A s, A lse_log2, A x_per_s = A(1)) {
    return fast_exp2(s * x_per_s - lse_log2);
}
template <typename A>
__device__ __forceinline__ A dscore_of_prob(A p, A dp, A dsum) {
    return p * (dp - dsum);
}

// P and dS in place. With dropout, keep is the forward's verdict for this element
// (keep_scale or 0): the forward multiplied V by keep * P, so dV takes keep * P and
// dS = P (keep * dP - Dsum). Without, keep = 1 folds away.
template <typename A>
__device__ __forceinline__ void prob_and_dscore(A& s_to_p, A& dp_to_ds, A lse_log2, A dsum, A keep = A(1),
                                                A x_per_s = A(1)) {
    const A p = prob_of_score(s_to_p, lse_log2, x_per_s);
    s_to_p = p * keep;
    dp_to_ds = dscore_of_prob(p, dp_to_ds * keep, dsum);
}

// The backward's row statistics of query rows [m0, m0 + BM) into shared memory:
// lse in log2 units (lse_to_log2) and Dsum = rowsum(dO * O). Rows past the
// sequence end get lse_log2 = +inf (so P = 0) and Dsum = 0. `thread`: this thread's index among the
// THREADS that share the copy.
template <int BM, int THREADS, typename A>
__device__ __forceinline__ void load_row_stats(A* lse_s, A* dsum_s, const View& lse, const View& dsum,
                                               int batch, int head, int m0, int rows_valid,
                                               int thread = threadIdx.x) {
    for (int i = thread; i < BM; i += THREADS) {
        lse_s[i] = i < rows_valid ? lse_to_log2(*lse.at<const A>(batch, head, m0 + i)) : pos_inf<A>();
        dsum_s[i] = i < rows_valid ? *dsum.at<const A>(batch, head, m0 + i) : A(0);
    }
}

// load_row_stats in two halves, the loads (`load`) and the stores (`store`), each thread's BM / THREADS
// rows held in registers in between: a pipeline's producer issues a step's loads before it waits for the
// step's stage to be free, and stores them once it is. (In a producer warp of few registers, the Hopper
// dK/dV kernel's 40, ptxas compiles load_row_stats to convert and store each row as it lands before loading
// the next: one L2 round trip a row, eight a step at BM 128, which the consumers wait for: ncu, NOTES.)
template <int BM, int THREADS, typename A>
struct RowStatsInFlight {
    static_assert(BM % THREADS == 0, "whole rows a thread");
    static constexpr int ROWS = BM / THREADS;
    A lse[ROWS], dsum[ROWS];
    int rows_valid;

    __device__ __forceinline__ void load(const View& lse_view, const View& dsum_view, int batch, int head, int m0,
                                         int valid, int thread = threadIdx.x) {
        const A* lse_rows = lse_view.at<const A>(batch, head, m0);
        const A* dsum_rows = dsum_view.at<const A>(batch, head, m0);
        rows_valid = valid;
#pragma unroll
        for (int k = 0; k < ROWS; ++k) {
            const int i = thread + k * THREADS;
            lse[k] = i < valid ? lse_rows[i * lse_view.row_stride] : A(0);
            dsum[k] = i < valid ? dsum_rows[i * dsum_view.row_stride] : A(0);
        }
    }
    // Into shared memory as load_row_stats leaves them: lse in log2 units (+inf past the sequence end).
    __device__ __forceinline__ void store(A* lse_s, A* dsum_s, int thread = threadIdx.x) const {
#pragma unroll
        for (int k = 0; k < ROWS; ++k) {
            const int i = thread + k * THREADS;
            lse_s[i] = i < rows_valid ? lse_to_log2(lse[k]) : pos_inf<A>();
            dsum_s[i] = dsum[k];
        }
    }
};

// The same statistics copied raw by cp.async into a stage (lse at stats[0, BM), Dsum at
// stats[BM, 2 BM)), so that a pipelined kernel fetches a step's statistics with its Q / dO tiles
// (the caller commits the group), one step ahead, instead of a warp's loads in front of the
// step's first barrier. Rows past the sequence end are not read: cp.async fills them with zeros,
// lse = 0 and Dsum = 0. Their Q and dO rows are zero too (the tile copies' fill), so such a row
// has scores 0 (or -inf where a partial tile's test hides it), P = 2^0 = 1 at most, dP = 0 and
// dS = P (dP - Dsum) = 0: it adds nothing to dV, dK, dQ or dbias, as P = 0 (load_row_stats'
// lse_log2 = +inf) would not either, and the per-element test that would give it is saved.
template <int BM, int THREADS, typename A>
__device__ __forceinline__ void copy_row_stats_async(A* stats, const View& lse, const View& dsum, int batch, int head,
                                                     int m0, int rows_valid, int thread = threadIdx.x) {
    static_assert(sizeof(A) == 4 || sizeof(A) == 8, "cp.async of 4 or 8 bytes");
    // Both rows' starts first (the views' uniform arithmetic), then a pointer select per entry: selecting
    // the View by entry indexed the kernel's parameters per thread (LDC with a register offset).
    const A* lse_rows = lse.at<const A>(batch, head, m0);
    const A* dsum_rows = dsum.at<const A>(batch, head, m0);
    auto copy = [&](int i) {
        const int row = i % BM;
        const bool valid = row < rows_valid;
        const A* src = i < BM ? lse_rows + (valid ? row : 0) * lse.row_stride : dsum_rows + (valid ? row : 0) * dsum.row_stride;
        const unsigned bytes = valid ? unsigned(sizeof(A)) : 0u;
        if constexpr (sizeof(A) == 4)
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(smem_addr(stats + i)), "l"(src), "r"(bytes));
        else
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(smem_addr(stats + i)), "l"(src), "r"(bytes));
    };
    if constexpr (2 * BM <= THREADS) {   // one entry a thread at most: no loop (its trip-count arithmetic held
        if (thread < 2 * BM) copy(thread);   // registers across the dK/dV kernels' steps)
    } else {
        for (int i = thread; i < 2 * BM; i += THREADS) copy(i);
    }
}

// Row `row` of a copy_row_stats_async stage: lse in log2 units (lse_to_log2: a row with nothing to
// attend keeps P = 0) and Dsum. stat_pair_of: a lane's two consecutive rows row, row + 1 (row
// even) of a float stage, in two 8-byte loads.
template <int BM, typename A>
__device__ __forceinline__ void stat_of(const A* stats, int row, A& lse_log2, A& dsum) {
    lse_log2 = lse_to_log2(stats[row]);
    dsum = stats[BM + row];
}
template <int BM>
__device__ __forceinline__ void stat_pair_of(const float* stats, int row, float (&lse_log2)[2], float (&dsum)[2]) {
    const FloatPair lse = load_pair(stats + row), sum = load_pair(stats + BM + row);   // 8-byte aligned: row even
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        lse_log2[e] = lse_to_log2(lse[e]);
        dsum[e] = sum[e];
    }
}

// 2^x for a lane's probability e of a tile (e = 4 n + 2 r + column, a constant once unrolled): the first
// FMA_EXP2 of every 8 on the FMA pipe, the others one FFMA + MUFU.EX2 (with the subtraction before).
template <int FMA_EXP2>
__device__ __forceinline__ float softmax_exp2(float x, int e) {
    if (FMA_EXP2 > 0 && e % 8 < FMA_EXP2) return fma_exp2(x);
    return fast_exp2(x);
}

// FMA_EXP2 of the 16-bit Hopper forward at head dim HEAD: with a score modification on the special-function
// unit (CUF_USER_SPECIAL, user_mod.cuh: softcap's tanh), 1 of 8 probabilities on the FMA pipe at head dims
// from 128, where that unit bounds each tile's softmax; at 64 the instructions it adds cost more than they
// save (benchmarks/exp2_split.py measures both). None without such a modification. CUF_EXP2_ON_FMA, defined
// before the source, overrides the count (the benchmark's knob).
template <typename T, int HEAD>
__host__ __device__ constexpr int fwd_exp2_on_fma() {
#ifdef CUF_EXP2_ON_FMA
    return sizeof(T) == 2 && CUF_USER_SPECIAL > 0 ? CUF_EXP2_ON_FMA : 0;
#else
    return sizeof(T) == 2 && CUF_USER_SPECIAL > 0 && HEAD >= 128 ? 1 : 0;
#endif
}

// One key tile's online-softmax step for all of this warp's rows: M strips, and
// in each the two C-fragment rows lane/4 and lane/4 + 8 (held by 4 lanes each).
// s holds scores with x = s * x_per_s > 0 (raw dot products with the scale
// folded in here, or x itself with x_per_s = 1). Each probability pair of one
// row, keys 8n + 2 (lane % 4) + {0, 1}, goes to emit_p(m, n, r, p0, p1) in fp32 as
// soon as it is formed (row_sum takes the fp32 values; emit_p may overwrite the
// two scores it came from): a caller that packs P to 16 bits there holds 2
// registers per 4 scores from here through O += P V, not 4. Without emit_p, s
// leaves holding P.
// Lazy rescaling (softmax.cuh): the reference row_max moves only when some row of
// the warp would see p > 2^RESCALE_SLACK; otherwise acc_o and row_sum are left as
// they are, which on long rows skips the rescale on most tiles. The vote keeps
// the branch uniform across the warp.
// Tr names S_TILES and O_TILES, the n8 C fragments of one strip's S and O.
// rescale_o(m, r, correction) applies a moved reference to row r of strip m of the
// output accumulator: at once (warp_softmax_tile), or later, when the accumulator
// is still being written by an asynchronous MMA (the wgmma kernel). Returns
// whether any row of the warp moved (warp-uniform).
// OFFSET: every score of the tile is x + offset (log2 units; the linear bias's per-tile part,
// linear_bias.cuh): added to the tile's max and taken off each row's exponent reference, two adds a row.
// FMA_EXP2: of every 8 probabilities a lane forms (two n8 fragments), that many are fma_exp2's
// (common.cuh) instead of a MUFU.EX2: it moves work off the special-function unit where a score
// modification's tanh shares it (fwd_exp2_on_fma).
template <typename Tr, int M, typename RescaleO, typename EmitP, bool OFFSET = false, int FMA_EXP2 = 0>
__device__ __forceinline__ bool warp_softmax_step(float (&s)[M][Tr::S_TILES][4], float (&row_max)[M][2],
                                                  float (&row_sum)[M][2], float x_per_s, RescaleO rescale_o,
                                                  EmitP emit_p, float offset = 0.0f) {
    float tile_max[M][2];
    bool grow = false;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = s[m][0][2 * r];
#pragma unroll
            for (int n = 0; n < Tr::S_TILES; ++n) mx = amax(mx, amax(s[m][n][2 * r], s[m][n][2 * r + 1]));
            tile_max[m][r] = group_max<4>(mx) * x_per_s;   // x_per_s > 0 commutes with max; -inf stays -inf
            if constexpr (OFFSET) tile_max[m][r] += offset;
            grow |= tile_max[m][r] > row_max[m][r] + RESCALE_SLACK;
        }
    grow = __any_sync(0xffffffffu, grow);
    if (grow) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float new_max = amax(row_max[m][r], tile_max[m][r]);
                // A row that has allowed nothing yet has max -inf; subtracting 0 instead
                // keeps every factor at exactly 0 rather than NaN (-inf - -inf).
                const float correction = fast_exp2(row_max[m][r] - (new_max == neg_inf<float>() ? 0.0f : new_max));
                row_max[m][r] = new_max;
                row_sum[m][r] *= correction;
                rescale_o(m, r, correction);
            }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // row_max = -inf here means the tile has nothing visible in this row either.
            const float ref = (row_max[m][r] == neg_inf<float>() ? 0.0f : row_max[m][r]) - (OFFSET ? offset : 0.0f);
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < Tr::S_TILES; ++n) {
                const float p0 = softmax_exp2<FMA_EXP2>(s[m][n][2 * r] * x_per_s - ref, 4 * n + 2 * r);
                tile_sum += p0;
                const float p1 = softmax_exp2<FMA_EXP2>(s[m][n][2 * r + 1] * x_per_s - ref, 4 * n + 2 * r + 1);
                tile_sum += p1;
                emit_p(m, n, r, p0, p1);
            }
            row_sum[m][r] += tile_sum;
        }
    return grow;
}

// The step with P left in s, in fp32.
template <typename Tr, int M, typename RescaleO>
__device__ __forceinline__ bool warp_softmax_step(float (&s)[M][Tr::S_TILES][4], float (&row_max)[M][2],
                                                  float (&row_sum)[M][2], float x_per_s, RescaleO rescale_o) {
    return warp_softmax_step<Tr>(s, row_max, row_sum, x_per_s, rescale_o, [&](int m, int n, int r, float p0, float p1) {
        s[m][n][2 * r] = p0;
        s[m][n][2 * r + 1] = p1;
    });
}

// A warp's rows before their first key tile (the state warp_softmax_step carries): O = 0, running
// max -inf (so the first tile's correction is exp2(-inf) = 0), running sum 0.
template <int M, int O_TILES>
__device__ __forceinline__ void start_rows(float (&acc_o)[M][O_TILES][4], float (&row_max)[M][2],
                                           float (&row_sum)[M][2]) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int t = 0; t < O_TILES; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[m][t][i] = 0.0f;
        row_max[m][0] = row_max[m][1] = neg_inf<float>();
        row_sum[m][0] = row_sum[m][1] = 0.0f;
    }
}

// Row r of strip m of acc_o times `correction`.
template <int M, int O_TILES>
__device__ __forceinline__ void rescale_acc_row(float (&acc_o)[M][O_TILES][4], int m, int r, float correction) {
#pragma unroll
    for (int t = 0; t < O_TILES; ++t) {
        acc_o[m][t][2 * r] *= correction;
        acc_o[m][t][2 * r + 1] *= correction;
    }
}

// The step with acc_o rescaled in place.
template <typename Tr, int M, typename EmitP>
__device__ __forceinline__ void warp_softmax_tile(float (&s)[M][Tr::S_TILES][4], float (&acc_o)[M][Tr::O_TILES][4],
                                                  float (&row_max)[M][2], float (&row_sum)[M][2], float x_per_s,
                                                  EmitP emit_p) {
    warp_softmax_step<Tr>(s, row_max, row_sum, x_per_s,
                          [&](int m, int r, float correction) { rescale_acc_row(acc_o, m, r, correction); }, emit_p);
}
