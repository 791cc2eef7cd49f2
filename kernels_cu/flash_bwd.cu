// flash_bwd.cu -- attention backward with CUDA-core FMA, for every dtype.
//
// Nothing n x n is stored: each tile of P is recomputed from Q, K and the
// saved lse. With s = q.k * scale, lse the natural-log logsumexp of row s:
//   P  = exp(s - lse) = 2^(s*log2e - lse*log2e)
//   Dsum = rowsum(dO * O)                       (bwd_preprocess)
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - Dsum)
//   dK = scale * dS^T Q,  dQ = scale * dS K
// Inputs are read in their storage type and converted to the accumulator
// type A (fp32; fp64 for float64) as they are used.
//
// flash_bwd_dkdv: one CTA per (key block, K/V head, batch). K_j, V_j stay in
// shared memory; the CTA walks every query block of every query head that
// reads this K/V head (grouped-query attention sums there, in a fixed order),
// accumulating dK_j, dV_j in registers. With ATOMIC_DQ it also adds each
// block's dS K_j into an fp32/fp64 dQ accumulator (atomics: fast, order
// varies run to run). flash_bwd_dq computes dQ without atomics (one CTA per
// query block, walking the key blocks in order): the deterministic path.
//
// Threads form a 16 x 16 grid (ty, tx). Score-shaped tiles: thread holds rows
// ty*TM + i and columns tx + 16*j. Output tiles (dK, dV, dQ): rows ty*R + i,
// columns tx + 16*c.
#include "common.cuh"
#include "tile_io.cuh"
#include "mask.cuh"

template <typename T> __device__ __forceinline__ float load_acc(T x, float) { return to_float(x); }
__device__ __forceinline__ double load_acc(double x, double) { return x; }

template <typename T, int HEAD_, int BM_, int BN_>
struct BwdTraits {
    typedef typename AccumOf<T>::type A;
    static constexpr int HEAD = HEAD_, BM = BM_, BN = BN_;
    static constexpr int THREADS = 256;
    static constexpr int TM = BM / 16;        // score rows per thread
    static constexpr int TN = BN / 16;        // score columns per thread
    static constexpr int TD = HEAD / 16;      // output columns per thread
    static constexpr int PITCH = HEAD + 1;    // +1: 16 threads reading 16 rows at one column hit 16 banks
    static constexpr int S_PITCH = BN + 1;
    static constexpr int TILE_BYTES = (2 * BN + 2 * BM) * PITCH * sizeof(T);
    static constexpr int SMEM_BYTES = TILE_BYTES + (2 * BM * S_PITCH + 2 * BM) * sizeof(A);
    static_assert(BM % 16 == 0 && BN % 16 == 0 && HEAD % 16 == 0, "16 x 16 thread grid");
    static_assert(TILE_BYTES % sizeof(A) == 0, "the accumulator tiles start aligned");
};

// Shared memory of both kernels: the four input tiles, then P, dS, lse, Dsum.
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

// Query-block inputs: Q_i, dO_i, and lse_i (in log2 units), Dsum_i; rows past lq get
// lse = -inf, so their P is 0.
template <typename T, typename Tr, int BM>
__device__ __forceinline__ void load_query_block(const BwdSmem<T, Tr>& sm, const T* q, int64 q_sr,
                                                 const T* dout, int64 do_sr, const typename Tr::A* lse,
                                                 const typename Tr::A* dsum, int rows_valid, int d, int dv) {
    typedef typename Tr::A A;
    load_tile<T, BM, Tr::TD * 16, Tr::PITCH, Tr::THREADS, false>(sm.q, q, q_sr, rows_valid, d);
    load_tile<T, BM, Tr::TD * 16, Tr::PITCH, Tr::THREADS, false>(sm.dout, dout, do_sr, rows_valid, dv);
    const A log2e = A(1.4426950408889634074);
    for (int i = threadIdx.x; i < BM; i += Tr::THREADS) {
        sm.lse[i] = i < rows_valid ? lse[i] * log2e : neg_inf<A>();
        sm.dsum[i] = i < rows_valid ? dsum[i] : A(0);
    }
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
        for (int i = 0; i < Tr::TM; ++i) a[i] = load_acc(a_s[(ty * Tr::TM + i) * Tr::PITCH + c], A(0));
#pragma unroll
        for (int j = 0; j < Tr::TN; ++j) b[j] = load_acc(b_s[(tx + 16 * j) * Tr::PITCH + c], A(0));
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
            for (int j = 0; j < Tr::TN; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
}

// P and dS of one (query block, key block) tile, written to shared memory.
template <typename T, typename Tr, bool CAUSAL>
__device__ __forceinline__ void tile_p_ds(const BwdSmem<T, Tr>& sm, const ScoreMask<CAUSAL>& mask,
                                          int m0, int n0, int d, int dv, typename Tr::A scale_log2) {
    typedef typename Tr::A A;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    A s[Tr::TM][Tr::TN], dp[Tr::TM][Tr::TN];
    tile_abt<T, Tr>(s, sm.q, sm.k, d);        // S = Q K^T
    tile_abt<T, Tr>(dp, sm.dout, sm.v, dv);   // dP = dO V^T
    // P = 2^(s log2e scale - lse log2e); dS = P (dP - Dsum)
#pragma unroll
    for (int i = 0; i < Tr::TM; ++i) {
        const int r = ty * Tr::TM + i;
        const A row_lse = sm.lse[r], row_dsum = sm.dsum[r];
#pragma unroll
        for (int j = 0; j < Tr::TN; ++j) {
            const int c = tx + 16 * j;
            const bool ok = row_lse != neg_inf<A>() && mask.allowed(m0 + r, n0 + c);
            const A p = ok ? fast_exp2(s[i][j] * scale_log2 - row_lse) : A(0);
            sm.p[r * Tr::S_PITCH + c] = p;
            sm.ds[r * Tr::S_PITCH + c] = p * (dp[i][j] - row_dsum);
        }
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
            yv[c] = (tx + 16 * c < cols) ? load_acc(y[m * Tr::PITCH + tx + 16 * c], A(0)) : A(0);
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
        for (int c = 0; c < Tr::TD; ++c) kv[c] = load_acc(sm.k[n * Tr::PITCH + tx + 16 * c], A(0));
#pragma unroll
        for (int i = 0; i < Tr::TM; ++i) {
            const A dsv = sm.ds[(row0 + i) * Tr::S_PITCH + n];
#pragma unroll
            for (int c = 0; c < Tr::TD; ++c) acc[i][c] = fma(dsv, kv[c], acc[i][c]);
        }
    }
}

// Dsum[row] = sum_c dO[row][c] * O[row][c]. One warp per row; grid (row blocks of 8, Hq, batch).
template <typename T>
__global__ void __launch_bounds__(256)
bwd_preprocess(const T* __restrict__ dout, const T* __restrict__ out, typename AccumOf<T>::type* __restrict__ dsum,
               int64 do_sb, int64 do_sh, int64 do_sr, int64 o_sb, int64 o_sh, int64 o_sr, int lq, int dv) {
    typedef typename AccumOf<T>::type A;
    const int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= lq) return;
    const int head = blockIdx.y, batch = blockIdx.z;
    dout += batch * do_sb + head * do_sh + row * do_sr;
    out += batch * o_sb + head * o_sh + row * o_sr;
    A acc = A(0);
    for (int c = lane; c < dv; c += 32) acc = fma(load_acc(dout[c], A(0)), load_acc(out[c], A(0)), acc);
    acc = group_sum<32>(acc);
    if (lane == 0) dsum[(int64(batch) * gridDim.y + head) * lq + row] = acc;
}

// dK, dV for one key block (and, with ATOMIC_DQ, dQ contributions). lse and Dsum are
// contiguous (B, Hq, Lq); dq_acc is contiguous (B, Hq, Lq, d); dk, dv are contiguous
// (B, Hk, Lk, d or dv). q, k, v, dout take strides in elements.
template <typename T, int HEAD, int BM, int BN, bool CAUSAL, bool ATOMIC_DQ>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const T* __restrict__ dout, const typename AccumOf<T>::type* __restrict__ lse,
               const typename AccumOf<T>::type* __restrict__ dsum, typename AccumOf<T>::type* __restrict__ dq_acc,
               T* __restrict__ dk, T* __restrict__ dv_out,
               int64 q_sb, int64 q_sh, int64 q_sr, int64 k_sb, int64 k_sh, int64 k_sr,
               int64 v_sb, int64 v_sh, int64 v_sr, int64 do_sb, int64 do_sh, int64 do_sr,
               int group, int lq, int lk, int d, int dv, double scale_in, int causal_offset) {
    typedef BwdTraits<T, HEAD, BM, BN> Tr;
    typedef typename Tr::A A;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const BwdSmem<T, Tr> sm(smem_raw);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int n0 = blockIdx.x * BN, kv_head = blockIdx.y, batch = blockIdx.z;
    const int hq = gridDim.y * group;
    const A scale = A(scale_in), scale_log2 = A(scale_in * 1.4426950408889634074);
    const ScoreMask<CAUSAL> mask{lk, causal_offset};
    const int keys_valid = imin(BN, lk - n0);

    load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, false>(sm.k, k + batch * k_sb + kv_head * k_sh + n0 * k_sr, k_sr, keys_valid, d);
    load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, false>(sm.v, v + batch * v_sb + kv_head * v_sh + n0 * v_sr, v_sr, keys_valid, dv);

    A acc_dk[Tr::TN][Tr::TD], acc_dv[Tr::TN][Tr::TD];
#pragma unroll
    for (int i = 0; i < Tr::TN; ++i)
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) { acc_dk[i][c] = A(0); acc_dv[i][c] = A(0); }

    // Causal: query row m sees key n0 only if n0 <= m + causal_offset.
    const int first_row = CAUSAL ? imax(0, n0 - causal_offset) : 0;
    for (int hh = 0; hh < group; ++hh) {
        const int head = kv_head * group + hh;
        const int64 row_base = (int64(batch) * hq + head) * lq;
        for (int m0 = (first_row / BM) * BM; m0 < lq; m0 += BM) {
            const int rows_valid = imin(BM, lq - m0);
            __syncthreads();   // the previous block's tiles are no longer read
            load_query_block<T, Tr, BM>(sm, q + batch * q_sb + head * q_sh + m0 * q_sr, q_sr,
                                        dout + batch * do_sb + head * do_sh + m0 * do_sr, do_sr,
                                        lse + row_base + m0, dsum + row_base + m0, rows_valid, d, dv);
            __syncthreads();
            tile_p_ds<T, Tr, CAUSAL>(sm, mask, m0, n0, d, dv, scale_log2);
            __syncthreads();
            accumulate_xt_y<T, Tr, Tr::TN>(acc_dv, sm.p, sm.dout, rows_valid, ty * Tr::TN, dv);   // dV += P^T dO
            accumulate_xt_y<T, Tr, Tr::TN>(acc_dk, sm.ds, sm.q, rows_valid, ty * Tr::TN, d);      // dK += dS^T Q
            if (ATOMIC_DQ) {   // dQ_i += scale * dS K_j
                A part[Tr::TM][Tr::TD];
#pragma unroll
                for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
                    for (int c = 0; c < Tr::TD; ++c) part[i][c] = A(0);
                accumulate_ds_k<T, Tr>(part, sm, keys_valid, ty * Tr::TM);
#pragma unroll
                for (int i = 0; i < Tr::TM; ++i) {
                    const int r = ty * Tr::TM + i;
                    if (r >= rows_valid) continue;
#pragma unroll
                    for (int c = 0; c < Tr::TD; ++c)
                        if (tx + 16 * c < d) atomicAdd(dq_acc + (row_base + m0 + r) * d + tx + 16 * c, part[i][c] * scale);
                }
            }
        }
    }

    // dK = scale * sum dS^T Q, dV = sum P^T dO. Key rows past lk are not written.
    const int64 kv_row_base = (int64(batch) * gridDim.y + kv_head) * lk + n0;
#pragma unroll
    for (int i = 0; i < Tr::TN; ++i) {
        const int n = ty * Tr::TN + i;
        if (n >= keys_valid) continue;
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) {
            const int col = tx + 16 * c;
            if (col < d) dk[(kv_row_base + n) * d + col] = from_acc<T>(acc_dk[i][c] * scale);
            if (col < dv) dv_out[(kv_row_base + n) * dv + col] = from_acc<T>(acc_dv[i][c]);
        }
    }
}

// dQ without atomics: one CTA per (query block, query head, batch) walks the key
// blocks in order, so the sum order is fixed and the result bitwise reproducible.
template <typename T, int HEAD, int BM, int BN, bool CAUSAL>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             const T* __restrict__ dout, const typename AccumOf<T>::type* __restrict__ lse,
             const typename AccumOf<T>::type* __restrict__ dsum, T* __restrict__ dq,
             int64 q_sb, int64 q_sh, int64 q_sr, int64 k_sb, int64 k_sh, int64 k_sr,
             int64 v_sb, int64 v_sh, int64 v_sr, int64 do_sb, int64 do_sh, int64 do_sr,
             int group, int lq, int lk, int d, int dv, double scale_in, int causal_offset) {
    typedef BwdTraits<T, HEAD, BM, BN> Tr;
    typedef typename Tr::A A;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const BwdSmem<T, Tr> sm(smem_raw);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM, head = blockIdx.y, batch = blockIdx.z;
    const int kv_head = head / group;
    const A scale = A(scale_in), scale_log2 = A(scale_in * 1.4426950408889634074);
    const ScoreMask<CAUSAL> mask{lk, causal_offset};
    const int rows_valid = imin(BM, lq - m0);
    const int64 row_base = (int64(batch) * gridDim.y + head) * lq + m0;

    load_query_block<T, Tr, BM>(sm, q + batch * q_sb + head * q_sh + m0 * q_sr, q_sr,
                                dout + batch * do_sb + head * do_sh + m0 * do_sr, do_sr,
                                lse + row_base, dsum + row_base, rows_valid, d, dv);
    A acc_dq[Tr::TM][Tr::TD];
#pragma unroll
    for (int i = 0; i < Tr::TM; ++i)
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c) acc_dq[i][c] = A(0);

    const int n_tiles = mask.key_tile_end(m0, BM, BN);
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BN, keys_valid = imin(BN, lk - n0);
        __syncthreads();
        load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, false>(sm.k, k + batch * k_sb + kv_head * k_sh + n0 * k_sr, k_sr, keys_valid, d);
        load_tile<T, BN, HEAD, Tr::PITCH, Tr::THREADS, false>(sm.v, v + batch * v_sb + kv_head * v_sh + n0 * v_sr, v_sr, keys_valid, dv);
        __syncthreads();
        tile_p_ds<T, Tr, CAUSAL>(sm, mask, m0, n0, d, dv, scale_log2);
        __syncthreads();
        accumulate_ds_k<T, Tr>(acc_dq, sm, keys_valid, ty * Tr::TM);
    }
#pragma unroll
    for (int i = 0; i < Tr::TM; ++i) {
        const int r = ty * Tr::TM + i;
        if (r >= rows_valid) continue;
#pragma unroll
        for (int c = 0; c < Tr::TD; ++c)
            if (tx + 16 * c < d) dq[(row_base + r) * d + tx + 16 * c] = from_acc<T>(acc_dq[i][c] * scale);
    }
}

// dq = dq_acc in the output dtype (after the atomic path).
template <typename T>
__global__ void __launch_bounds__(256)
bwd_convert_dq(const typename AccumOf<T>::type* __restrict__ dq_acc, T* __restrict__ dq, int64 n) {
    for (int64 i = blockIdx.x * int64(blockDim.x) + threadIdx.x; i < n; i += int64(gridDim.x) * blockDim.x)
        dq[i] = from_acc<T>(dq_acc[i]);
}
