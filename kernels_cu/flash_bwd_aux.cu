// flash_bwd_aux.cu -- the backward's row-wise kernels:
//   flash_bwd_dsum        before the main kernels: Dsum = rowsum(dO * O)
//   flash_bwd_convert_dq  after the atomic path: dQ = dQ_acc in the input dtype (DQ_TILED: the 16-bit
//                         tensor-core dK/dV kernel's accumulator, in fragment tiles)
// Grid: ceil(Lq / BM) x Hq x B CTAs (QueryBlock) of WARPS warps; each warp owns BM / WARPS rows.
//
// Both only stream memory, so their speed is the bytes each SM keeps in flight. One warp a row,
// one element a lane a step and 8 rows a CTA kept ~4 KB in flight per CTA: ncu on the H100 (B=16,
// H=16, L=1024, D=128, bf16) measured dsum at 82 us (134 MB read: 1.6 TB/s) and convert at 98 us
// (134 MB read, 67 MB written: 2.0 TB/s) against the ~3.35 TB/s peak (cuDNN's convert: 76 us).
// Little's law asks ~3.35 TB/s x ~1 us of latency over 132 SMs, ~25 KB in flight per SM, more
// as the latency grows near the peak. So a lane moves 16 bytes an access, and a warp issues the
// loads of all its rows before it uses any: dsum 2 rows x (dO, O) = 64 bytes in flight a lane,
// 80 KB an SM at its 5 CTAs (<= 48 registers); convert 2 rows of dQ_acc = 32 bytes a lane, 64 KB
// an SM at 8 CTAs (<= 32 registers). 4 rows a warp would cost more occupancy than they add bytes
// (dsum spills even at 64 registers, convert needs 56). Rows whose width or start rules out
// 16-byte accesses (head dims not whole chunks, views of dout / out whose rows start off a 16-byte
// boundary) take the same loop one element a lane.
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "atomics.cuh"

// The query rows this warp owns: ROWS = BM / WARPS of its CTA's block, interleaved (row r is
// m0 + warp + r * WARPS) so that the CTA's warps read neighbouring rows together. Rows at or past
// lq store nothing; whether a row is valid is the same for the whole warp, so shuffles stay legal.
template <typename Cfg>
struct WarpRows {
    static constexpr int ROWS = Cfg::BM / Cfg::WARPS;
    int batch, head, first, lq, lane;

    __device__ __forceinline__ static WarpRows from_grid(const AttnDims& dims) {
        static_assert(Cfg::THREADS == 32 * Cfg::WARPS, "the variant table's thread count: 32 a warp");
        static_assert(Cfg::BM % Cfg::WARPS == 0, "whole rows a warp");
        static_assert(Cfg::SMEM_BYTES == 0, "no shared memory");
        const QueryBlock blk = QueryBlock::from_grid<Cfg::BM, false>(dims);
        return {blk.batch, blk.head, blk.m0 + int(threadIdx.x) / 32, dims.lq, int(threadIdx.x) % 32};
    }

    __device__ __forceinline__ int row(int r) const { return first + r * Cfg::WARPS; }
    __device__ __forceinline__ bool valid(int r) const { return row(r) < lq; }
    // The row that row r reads: one past the end reads the last row again (from cache) and stores
    // nothing, so that the loads need no branches around them.
    __device__ __forceinline__ int read_row(int r) const { return imin(row(r), lq - 1); }
};

// N consecutive elements of T that a lane moves with one access: N = 1, any address; or 16 bytes
// (VEC16), the address 16-byte aligned.
template <typename T> constexpr int VEC16 = 16 / int(sizeof(T));
template <typename T, int N> struct Chunk { T v[N]; };

__device__ __forceinline__ bool aligned(const void* p, int bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1)) == 0;
}

template <int N, typename T>
__device__ __forceinline__ Chunk<T, N> load_chunk(const T* p) {
    Chunk<T, N> x;
    if constexpr (N == 1) {
        x.v[0] = *p;
    } else {
        static_assert(N * sizeof(T) == 16, "one element or 16 bytes");
        const uint4 bits = *reinterpret_cast<const uint4*>(p);   // one 128-bit load
        memcpy(&x, &bits, 16);
    }
    return x;
}

// dst[0, N) = x in T, in one store: N * sizeof(T) bytes, dst aligned to that (16-bit T from 4
// floats: 8 bytes, two pack2, one cvt a pair; fp32 and fp64 are copied, 16 bytes).
template <typename T, int N, typename A>
__device__ __forceinline__ void store_chunk(T* dst, const Chunk<A, N>& x) {
    if constexpr (N == 1) {
        *dst = from_acc<T>(x.v[0]);
    } else if constexpr (sizeof(T) == 2) {
        static_assert(N == 4, "16 bytes of fp32");
        uint2 pairs;
        pairs.x = pack2<T>(x.v[0], x.v[1]);
        pairs.y = pack2<T>(x.v[2], x.v[3]);
        *reinterpret_cast<uint2*>(dst) = pairs;
    } else {
        static_assert(sizeof(T) == sizeof(A) && N * sizeof(A) == 16, "16 bytes of the input dtype itself");
        uint4 bits;
        memcpy(&bits, &x, 16);
        *reinterpret_cast<uint4*>(dst) = bits;
    }
}

// acc[r] += sum_c dO[r][c] O[r][c] over the lane's columns, chunks of N: lane l takes columns
// [N l, N l + N), then 32 N further on. Each step issues every row's loads before its first FMA.
template <int N, typename T, typename A, int ROWS>
__device__ __forceinline__ void rows_dot(const T* const (&dout)[ROWS], const T* const (&out)[ROWS], int dv,
                                         int lane, A (&acc)[ROWS]) {
#pragma unroll 1   // the rows give the loads in flight; unrolled columns would only cost address registers
    for (int c = N * lane; c < dv; c += 32 * N) {
        Chunk<T, N> x[ROWS], y[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) x[r] = load_chunk<N>(dout[r] + c), y[r] = load_chunk<N>(out[r] + c);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int i = 0; i < N; ++i) acc[r] = fma(to_acc(x[r].v[i]), to_acc(y[r].v[i]), acc[r]);
    }
}

// dq[r][c] = dq_acc[r][c] in T over the lane's columns (as rows_dot), for the warp's valid rows;
// each step issues every row's load before its first store.
template <int N, typename T, typename A, typename Cfg>
__device__ __forceinline__ void rows_convert(const A* const (&acc)[WarpRows<Cfg>::ROWS],
                                             T* const (&dq)[WarpRows<Cfg>::ROWS], int d, const WarpRows<Cfg>& w) {
    constexpr int ROWS = WarpRows<Cfg>::ROWS;
#pragma unroll 1
    for (int c = N * w.lane; c < d; c += 32 * N) {
        Chunk<A, N> x[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) x[r] = load_chunk<N>(acc[r] + c);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (w.valid(r)) store_chunk<T>(dq[r] + c, x[r]);
    }
}

// Each of the warp's rows' pointers into two (batch, head, row) views, x and y (the rows read_row
// names), and whether every one is aligned to its view's width in bytes (the 16-byte paths' test).
template <typename X, typename Y, typename Cfg>
__device__ __forceinline__ bool warp_row_pointers(const View& vx, const View& vy, const WarpRows<Cfg>& w,
                                                  X* (&x)[WarpRows<Cfg>::ROWS], Y* (&y)[WarpRows<Cfg>::ROWS],
                                                  int x_align, int y_align) {
    bool all_aligned = true;
#pragma unroll
    for (int r = 0; r < WarpRows<Cfg>::ROWS; ++r) {
        x[r] = vx.at<X>(w.batch, w.head, w.read_row(r));
        y[r] = vy.at<Y>(w.batch, w.head, w.read_row(r));
        all_aligned = all_aligned && aligned(x[r], x_align) && aligned(y[r], y_align);
    }
    return all_aligned;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dsum(const BwdParams p) {
    typedef typename AccumOf<T>::type A;
    typedef WarpRows<Cfg> Rows;
    constexpr int VEC = VEC16<T>;
    const Rows w = Rows::from_grid(p.dims);
    if (!w.valid(0)) return;   // the whole warp: all its rows are past the end
    const int dv = p.dims.dv;
    const T* dout[Rows::ROWS];
    const T* out[Rows::ROWS];
    // 16-byte loads: rows of whole chunks, each row's start 16-byte aligned.
    const bool vec = warp_row_pointers(p.dout, p.out, w, dout, out, 16, 16) && dv % VEC == 0;
    A acc[Rows::ROWS] = {};
    if (vec) rows_dot<VEC>(dout, out, dv, w.lane, acc);
    else rows_dot<1>(dout, out, dv, w.lane, acc);   // any width, any alignment
#pragma unroll
    for (int r = 0; r < Rows::ROWS; ++r) {
        if (!w.valid(r)) break;   // rows grow with r
        const A dsum = group_sum<32>(acc[r]);
        if (w.lane == 0) *p.dsum.at<A>(w.batch, w.head, w.row(r)) = dsum;
    }
}

// dQ from a fragment-tiled accumulator (atomics.cuh, dq_tile; DQ_TILED): the CTA's 16 rows are one row
// of tiles, whose columns (dQ_acc's row_stride, the dK/dV kernel's head bucket) the warps take in turn.
// Lane l of a tile holds rows l / 4 and l / 4 + 8, columns 2 (l % 4) and + 1: two pairs it stores. The tiles
// hold dS K unscaled (the dK/dV kernel saves the multiplication a value): the scale is applied here.
template <typename T, typename Cfg>
__device__ __forceinline__ void convert_dq_tiles(const BwdParams& p) {
    static_assert(Cfg::BM == 16 && Cfg::SMEM_BYTES == 0, "one row of 16 x 8 tiles a CTA, no shared memory");
    constexpr int TILES_IN_FLIGHT = 2;   // a lane's 16-byte loads issued before their stores
    const QueryBlock blk = QueryBlock::from_grid<Cfg::BM, false>(p.dims);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, d = p.dims.d;
    const float scale = float(p.scale);
    const int tiles = int(p.dq_acc.row_stride) / 8;
    const float* src = p.dq_acc.at<const float>(blk.batch, blk.head, blk.m0) + 4 * lane;
    const int top = blk.m0 + lane / 4;   // this lane's rows: top and top + 8
    T* rows[2] = {top < p.dims.lq ? p.dq.at<T>(blk.batch, blk.head, top) : nullptr,
                  top + 8 < p.dims.lq ? p.dq.at<T>(blk.batch, blk.head, top + 8) : nullptr};
    auto store = [&](T* row, int col, float a, float b) {
        if (row == nullptr || col >= d) return;
        if constexpr (sizeof(T) == 2) {
            if (col + 1 < d && d % 2 == 0) {   // a pair in one 32-bit store: with d even every row starts even
                *reinterpret_cast<unsigned*>(row + col) = pack2<T>(a, b);
                return;
            }
        }
        row[col] = from_acc<T>(a);
        if (col + 1 < d) row[col + 1] = from_acc<T>(b);
    };
#pragma unroll 1
    for (int t0 = warp; t0 < tiles; t0 += TILES_IN_FLIGHT * Cfg::WARPS) {
        float4 v[TILES_IN_FLIGHT];
#pragma unroll
        for (int i = 0; i < TILES_IN_FLIGHT; ++i) {
            const int t = t0 + i * Cfg::WARPS;
            if (t < tiles) v[i] = *reinterpret_cast<const float4*>(src + 128 * t);
        }
#pragma unroll
        for (int i = 0; i < TILES_IN_FLIGHT; ++i) {
            const int t = t0 + i * Cfg::WARPS, col = 8 * t + 2 * (lane % 4);
            if (t >= tiles) break;
            store(rows[0], col, v[i].x * scale, v[i].y * scale);
            store(rows[1], col, v[i].z * scale, v[i].w * scale);
        }
    }
}

template <typename T, typename Cfg, bool DQ_TILED>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_convert_dq(const BwdParams p) {
    if constexpr (DQ_TILED) {
        convert_dq_tiles<T, Cfg>(p);
        return;
    }
    typedef typename AccumOf<T>::type A;
    typedef WarpRows<Cfg> Rows;
    constexpr int VEC = VEC16<A>;
    const Rows w = Rows::from_grid(p.dims);
    if (!w.valid(0)) return;   // the whole warp: all its rows are past the end
    const int d = p.dims.d;
    const A* acc[Rows::ROWS];
    T* dq[Rows::ROWS];
    // 16-byte loads of dQ_acc, VEC-element stores of dQ: rows of whole chunks, each row's start
    // aligned for both (dQ_acc's rows are padded to an even width: fp32 rows of d a multiple of 4
    // start 16-byte aligned).
    const bool vec = warp_row_pointers(p.dq_acc, p.dq, w, acc, dq, 16, VEC * int(sizeof(T))) && d % VEC == 0;
    if (vec) rows_convert<VEC>(acc, dq, d, w);
    else rows_convert<1>(acc, dq, d, w);   // any width, any alignment
}
