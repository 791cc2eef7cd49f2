// flash_bwd_fma.cu -- attention backward with CUDA-core FMA: float32, float64, and
// the 16-bit types at head dim 256.
//
// Nothing n x n is stored: each tile of P is recomputed from Q, K and the
// saved lse. With x = s * scale * log2(e) (score_mod.cuh) and lse the
// natural-log logsumexp of row s:
//   P  = 2^(x - lse * log2 e)                   (softmax.cuh: prob_and_dscore)
//   Dsum = rowsum(dO * O)                       (flash_bwd_aux.cu)
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - Dsum)
//   dK = scale * dS^T Q,  dQ = scale * dS K
// Inputs are read in their storage type and converted to the accumulator
// type A (fp32; fp64 for float64) as they are used.
//
// flash_bwd_dkdv_fma: one CTA per (key block, K/V head, batch). K_j, V_j stay in
// shared memory; the CTA walks every query block of every query head that
// reads this K/V head (grouped-query attention sums there, in a fixed order),
// accumulating dK_j, dV_j in registers. With ATOMIC_DQ it also adds each
// block's dS K_j into an fp32/fp64 dQ accumulator (atomics: fast, order
// varies run to run). flash_bwd_dq_fma computes dQ without atomics (one CTA per
// query block, walking the key blocks in order): the deterministic path.
//
// Threads form a 16 x 16 grid (ty, tx). Score-shaped tiles: thread holds rows
// ty*TM + i and columns tx + 16*j. Output tiles (dK, dV, dQ): rows ty*R + i,
// columns tx + 16*c.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "tile_io.cuh"
#include "softmax.cuh"
#include "score_mod.cuh"
#include "bias_grad.cuh"

template <typename T, typename Cfg>
struct BwdFmaTraits {
    typedef typename AccumOf<T>::type A;
    static constexpr int HEAD = Cfg::HEAD, BM = Cfg::BM, BN = Cfg::BN;
    static constexpr int THREADS = 256;       // the 16 x 16 thread grid
    static constexpr int TM = BM / 16;        // score rows per thread
    static constexpr int TN = BN / 16;        // score columns per thread
    static constexpr int TD = HEAD / 16;      // output columns per thread
    static constexpr int PITCH = HEAD + 1;    // +1: 16 threads reading 16 rows at one column hit 16 banks
    static constexpr int S_PITCH = BN + 1;
    static constexpr int TILE_BYTES = (2 * BN + 2 * BM) * PITCH * int(sizeof(T));
    static constexpr int SMEM_BYTES = TILE_BYTES + (2 * BM * S_PITCH + 2 * BM) * int(sizeof(A));
    static_assert(BM % 16 == 0 && BN % 16 == 0 && HEAD % 16 == 0, "16 x 16 thread grid");
    static_assert(TILE_BYTES % sizeof(A) == 0, "the accumulator tiles start aligned");
    static_assert(Cfg::STAGES == 1, "single-buffered tiles");
    static_assert(Cfg::THREADS == THREADS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == SMEM_BYTES, "the variant table's shared-memory size");
};

// Shared memory of both kernels: the four input tiles, then P, dS, lse (log2), Dsum.
template <typename T, typename Tr>
struct BwdSmem {
    typedef typename Tr::A A;
    T *k, *v, *q, *dout;
    A *p, *ds, *lse, *dsum;
    __device__ __forceinline__ explicit BwdSmem(unsigned char* raw) {
        k = reinterpret_cast<T*>(raw);
        v = k + Tr::BN * Tr::PITCH;
        q = v + Tr::BN * Tr::PITCH;
        dout = q + Tr::BM * Tr::PITCH;
        p = reinterpret_cast<A*>(raw + Tr::TILE_BYTES);
        ds = p + Tr::BM * Tr::S_PITCH;
        lse = ds + Tr::BM * Tr::S_PITCH;
        dsum = lse + Tr::BM;
    }
};

// Query-block inputs: Q_i, dO_i and the row statistics of rows [m0, m0 + BM) of one head.
template <typename T, typename Tr>
__device__ __forceinline__ void load_query_block(const BwdSmem<T, Tr>& sm, const BwdParams& p, int batch, int head,
                                                 int m0) {
    const int rows_valid = imin(Tr::BM, p.dims.lq - m0);
    load_row_tiles<T, Tr::BM, Tr::HEAD, Tr::PITCH, Tr::THREADS, false>(sm.q, p.q, p.dims.d, sm.dout, p.dout, p.dims.dv,
                                                                       batch, head, m0, rows_valid);
    load_row_stats<Tr::BM, Tr::THREADS>(sm.lse, sm.dsum, p.lse, p.dsum, batch, head, m0, rows_valid);
}

// acc = A B^T over `depth` columns for this thread's score entries: A rows
// ty*TM + i, B rows tx + 16 j (both tiles row-major with the input pitch).
template <typename T, typename Tr>
__device__ __forceinline__ void tile_abt(typename Tr::A (&acc)[Tr::TM][Tr::TN], const T* a_s, const T* b_s, int depth) {
    typedef typename Tr::A A;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
        for (int j = 0; j < Tr::TN; ++j) acc[i][j] = A(0);
#pragma unroll 2
    for (int c = 0; c < depth; ++c) {
        A a[Tr::TM], b[Tr::TN];
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i) a[i] = to_acc(a_s[(ty * Tr::TM + i) * Tr::PITCH + c]);
#pragma unroll
        for (int j = 0; j < Tr::TN; ++j) b[j] = to_acc(b_s[(tx + 16 * j) * Tr::PITCH + c]);
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
            for (int j = 0; j < Tr::TN; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
}

// The bias tile of (query block m0, key block n0), staged in P's place (tile_p_ds
// reads it there before overwriting it); with the step's other tile loads.
template <typename T, typename Tr, typename Mod>
__device__ __forceinline__ void load_bias_tile(const BwdSmem<T, Tr>& sm, const Mod& mod, const BwdParams& p, int m0,
                                               int n0) {
    if (!mod.has_bias()) return;
    load_score_tile_acc<T, typename Tr::A, Tr::BM, Tr::BN, Tr::S_PITCH, Tr::THREADS>(
        sm.p, p.mask.bias, mod.batch, mod.head, m0, n0, imin(Tr::BM, p.dims.lq - m0), imin(Tr::BN, p.dims.lk - n0));
}

// P and dS of one (query block m0, key block n0) tile, written to shared memory.
// A bias tile, when the call has one, is in sm.p (load_bias_tile). PARAM_GRADS: the dK/dV kernel's
// (ScoreMod::prob_and_dscore_at).
template <typename T, typename Tr, bool PARAM_GRADS, typename Mod>
__device__ __forceinline__ void tile_p_ds(const BwdSmem<T, Tr>& sm, const Mod& mod, int m0, int n0, int d, int dv) {
    typedef typename Tr::A A;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    A s[Tr::TM][Tr::TN], dp[Tr::TM][Tr::TN];
    tile_abt<T, Tr>(s, sm.q, sm.k, d);        // S = Q K^T
    tile_abt<T, Tr>(dp, sm.dout, sm.v, dv);   // dP = dO V^T
    auto coord = [&](int i, int j, int& row, int& col) {
        row = m0 + ty * Tr::TM + i;
        col = n0 + tx + 16 * j;
    };
    // Each thread reads the bias entries it later overwrites with P: no other thread's.
    auto bias = [&](int i, int j, int, int) { return sm.p[(ty * Tr::TM + i) * Tr::S_PITCH + tx + 16 * j]; };
    apply_score_mod(s, mod, mod.tile_is_partial(m0, Tr::BM, n0, Tr::BN), coord, bias);
#pragma unroll
    for (int i = 0; i < Tr::TM; ++i) {
        const int r = ty * Tr::TM + i;
#pragma unroll
        for (int j = 0; j < Tr::TN; ++j) {
            const int c = tx + 16 * j;
            A keep = A(1);
            if (mod.has_dropout()) keep = mod.keep(m0 + r, n0 + c);
            mod.template prob_and_dscore_at<PARAM_GRADS>(s[i][j], dp[i][j], sm.lse[r], sm.dsum[r], keep, A(1), m0 + r,
                                                         n0 + c);
            sm.p[r * Tr::S_PITCH + c] = s[i][j];
            sm.ds[r * Tr::S_PITCH + c] = dp[i][j];
        }
    }
}

// dbias += the dS tile in shared memory (queries x keys), consecutive threads on
// consecutive keys. A one-row bias: one thread per key sums the tile's queries in order.
template <typename T, typename Tr>
__device__ __forceinline__ void add_dbias_tile(const DbiasParams& g, const BwdSmem<T, Tr>& sm, int batch, int head,
                                               int m0, int n0, const AttnDims& dims) {
    typedef typename Tr::A A;
    if (g.rows_broadcast) {
        for (int c = threadIdx.x; c < Tr::BN; c += Tr::THREADS) {
            if (n0 + c >= dims.lk) continue;
            A sum = A(0);
            for (int r = 0; r < imin(Tr::BM, dims.lq - m0); ++r) sum += sm.ds[r * Tr::S_PITCH + c];
            dbias_add(g, dbias_at<A>(g, batch, head, 0, n0 + c), sum);
        }
        return;
    }
    for (int e = threadIdx.x; e < Tr::BM * Tr::BN; e += Tr::THREADS) {
        const int r = e / Tr::BN, c = e % Tr::BN;
        if (m0 + r < dims.lq && n0 + c < dims.lk)
            dbias_add(g, dbias_at<A>(g, batch, head, m0 + r, n0 + c), sm.ds[r * Tr::S_PITCH + c]);
    }
}

// acc[i][c] += sum_m X[m][row0 + i] * Y[m][tx + 16 c]: the transposed product
// (dV += P^T dO, dK += dS^T Q) of a score tile X and an input tile Y.
template <typename T, typename Tr, int R>
__device__ __forceinline__ void accumulate_xt_y(typename Tr::A (&acc)[R][Tr::TD], const typename Tr::A* x,
                                                const T* y, int rows, int row0, int cols) {
    typedef typename Tr::A A;
    const int tx = threadIdx.x % 16;
    for (int m = 0; m < rows; ++m) {
        A yv[Tr::TD];
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c)
            yv[c] = (tx + 16 * c < cols) ? to_acc(y[m * Tr::PITCH + tx + 16 * c]) : A(0);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const A xv = x[m * Tr::S_PITCH + row0 + i];
#pragma unroll
            for (int c = 0; c < Tr::TD; ++c) acc[i][c] = fma(xv, yv[c], acc[i][c]);
        }
    }
}

// acc[i][c] += sum_n dS[row0 + i][n] K[n][tx + 16 c]: dQ's share of one key tile.
template <typename T, typename Tr>
__device__ __forceinline__ void accumulate_ds_k(typename Tr::A (&acc)[Tr::TM][Tr::TD], const BwdSmem<T, Tr>& sm,
                                                int keys, int row0) {
    typedef typename Tr::A A;
    const int tx = threadIdx.x % 16;
    for (int n = 0; n < keys; ++n) {
        A kv[Tr::TD];
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) kv[c] = to_acc(sm.k[n * Tr::PITCH + tx + 16 * c]);
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i) {
            const A dsv = sm.ds[(row0 + i) * Tr::S_PITCH + n];
#pragma unroll
            for (int c = 0; c < Tr::TD; ++c) acc[i][c] = fma(dsv, kv[c], acc[i][c]);
        }
    }
}

template <typename A, int R, int C>
__device__ __forceinline__ void zero_tile(A (&x)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int c = 0; c < C; ++c) x[i][c] = A(0);
}

// dK, dV for one key block (and, with ATOMIC_DQ, dQ contributions).
// Grid: ceil(Lk / BN) x Hk x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), key block 0 (the most causal work) first.
template <typename T, typename Cfg, typename Flags, bool ATOMIC_DQ>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dkdv_fma(const BwdParams p) {
    typedef BwdFmaTraits<T, Cfg> Tr;
    typedef typename Tr::A A;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const BwdSmem<T, Tr> sm(smem_raw);
    const AttnDims& dims = p.dims;
    const KeyBlock blk = KeyBlock::from_grid<Tr::BN>(dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int n0 = blk.n0, batch = blk.batch;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const A scale = A(p.scale);
    ScoreMod<Flags, A, T> mod(p.mask, dims, acc_param<A>(p.scale_log2, p.scale_log2_f), batch, blk.first_head);
    const bool dbias = Flags::EXTRA && p.dbias.mode != DBIAS_NONE;
    const bool ordered = dbias && p.dbias.mode == DBIAS_ORDERED;
    // Every query block when dbias contributions take turns: each step passes its turn, visible or not.
    const int q_blocks = ceil_div(dims.lq, Tr::BM);
    const TileRange queries = ordered ? TileRange{0, q_blocks}
                                      : mod.query_tiles(n0, blk.keys, Tr::BM, blk.end_head - blk.first_head);

    load_row_tiles<T, Tr::BN, Tr::HEAD, Tr::PITCH, Tr::THREADS, false>(sm.k, p.k, dims.d, sm.v, p.v, dims.dv, batch,
                                                                       blk.kv_head, n0, blk.keys);
    A acc_dk[Tr::TN][Tr::TD], acc_dv[Tr::TN][Tr::TD];
    zero_tile(acc_dk);
    zero_tile(acc_dv);
    for (int head = blk.first_head; head < blk.end_head; ++head) {
        mod.head = head;
        for (int i = queries.begin; i < queries.end; ++i) {
            const int m0 = i * Tr::BM, rows_valid = imin(Tr::BM, dims.lq - m0);
            const DbiasTurn turn = ordered ? DbiasTurn::of(p.dbias, dims, batch, head, i, q_blocks, blk.n0 / Tr::BN,
                                                           ceil_div(dims.lk, Tr::BN))
                                           : DbiasTurn{nullptr, 0};
            if (mod.classify(m0, rows_valid, n0, blk.keys) == TILE_SKIP) {
                if (ordered) {   // nothing to add, but the turn passes through this step
                    turn.wait_turn();
                    turn.pass_turn();
                }
                continue;
            }
            __syncthreads();   // the previous block's tiles are no longer read
            load_query_block<T, Tr>(sm, p, batch, head, m0);
            load_bias_tile<T, Tr>(sm, mod, p, m0, n0);
            __syncthreads();
            tile_p_ds<T, Tr, true>(sm, mod, m0, n0, dims.d, dims.dv);
            __syncthreads();
            if (dbias) {
                if (ordered) turn.wait_turn();
                add_dbias_tile<T, Tr>(p.dbias, sm, batch, head, m0, n0, dims);
                if (ordered) turn.pass_turn();
            }
            accumulate_xt_y<T, Tr, Tr::TN>(acc_dv, sm.p, sm.dout, rows_valid, ty * Tr::TN, dims.dv);   // dV += P^T dO
            accumulate_xt_y<T, Tr, Tr::TN>(acc_dk, sm.ds, sm.q, rows_valid, ty * Tr::TN, dims.d);      // dK += dS^T Q
            if (ATOMIC_DQ) {   // dQ_i += scale * dS K_j
                A part[Tr::TM][Tr::TD];
                zero_tile(part);
                accumulate_ds_k<T, Tr>(part, sm, blk.keys, ty * Tr::TM);
#pragma unroll
                for (int r = 0; r < Tr::TM; ++r) {
                    const int row = ty * Tr::TM + r;
                    if (row >= rows_valid) continue;
                    A* dq_row = p.dq_acc.at<A>(batch, head, m0 + row);
#pragma unroll
                    for (int c = 0; c < Tr::TD; ++c)
                        if (tx + 16 * c < dims.d) atomicAdd(dq_row + tx + 16 * c, part[r][c] * scale);
                }
            }
        }
    }

    // dK = scale * sum dS^T Q, dV = sum P^T dO. Key rows past lk are not written.
#pragma unroll
    for (int i = 0; i < Tr::TN; ++i) {
        const int n = ty * Tr::TN + i;
        if (n >= blk.keys) continue;
        T* dk_row = p.dk.at<T>(batch, blk.kv_head, n0 + n);
        T* dv_row = p.dv.at<T>(batch, blk.kv_head, n0 + n);
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) {
            const int col = tx + 16 * c;
            if (col < dims.d) dk_row[col] = from_acc<T>(acc_dk[i][c] * scale);
            if (col < dims.dv) dv_row[col] = from_acc<T>(acc_dv[i][c]);
        }
    }
}

// dQ without atomics: one CTA per (query block, query head, batch) walks the key
// blocks in order, so the sum order is fixed and the result bitwise reproducible.
// Grid: ceil(Lq / BM) x Hq x B CTAs (SCHEDULE_ONE_A_BLOCK, scheduler.cuh), longest causal query blocks first.
template <typename T, typename Cfg, typename Flags>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dq_fma(const BwdParams p) {
    typedef BwdFmaTraits<T, Cfg> Tr;
    typedef typename Tr::A A;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const BwdSmem<T, Tr> sm(smem_raw);
    const QueryBlock blk = QueryBlock::from_grid<Tr::BM>(p.dims, shared_scores_head_group<Flags::EXTRA>(p.mask));
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const ScoreMod<Flags, A, T> mod(p.mask, p.dims, acc_param<A>(p.scale_log2, p.scale_log2_f), blk.batch, blk.head);
    const TileRange keys = mod.key_tiles(blk.m0, blk.rows, Tr::BN);

    load_query_block<T, Tr>(sm, p, blk.batch, blk.head, blk.m0);
    A acc_dq[Tr::TM][Tr::TD];
    zero_tile(acc_dq);
    for (int j = mod.next_key_tile(keys.begin, keys.end, blk.m0, blk.rows, Tr::BN); j < keys.end;
         j = mod.next_key_tile(j + 1, keys.end, blk.m0, blk.rows, Tr::BN)) {
        const int n0 = j * Tr::BN;
        __syncthreads();
        load_row_tiles<T, Tr::BN, Tr::HEAD, Tr::PITCH, Tr::THREADS, false>(sm.k, p.k, p.dims.d, sm.v, p.v, p.dims.dv,
                                                                           blk.batch, blk.kv_head, n0,
                                                                           imin(Tr::BN, p.dims.lk - n0));
        load_bias_tile<T, Tr>(sm, mod, p, blk.m0, n0);
        __syncthreads();
        tile_p_ds<T, Tr, false>(sm, mod, blk.m0, n0, p.dims.d, p.dims.dv);
        __syncthreads();
        accumulate_ds_k<T, Tr>(acc_dq, sm, imin(Tr::BN, p.dims.lk - n0), ty * Tr::TM);
    }
    const A scale = A(p.scale);
#pragma unroll
    for (int r = 0; r < Tr::TM; ++r) {
        const int row = ty * Tr::TM + r;
        if (row >= blk.rows) continue;
        T* dq_row = p.dq.at<T>(blk.batch, blk.head, blk.m0 + row);
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c)
            if (tx + 16 * c < p.dims.d) dq_row[tx + 16 * c] = from_acc<T>(acc_dq[r][c] * scale);
    }
}
