// flash_bwd_aux.cu -- the backward's row-wise kernels, one warp per query row:
//   flash_bwd_dsum        before the main kernels: Dsum = rowsum(dO * O)
//   flash_bwd_convert_dq  after the atomic path: dQ = dQ_acc in the input dtype
// Grid: ceil(Lq / BM) x Hq x B CTAs (BlockInfo) of BM warps.
#include "common.cuh"
#include "params.cuh"

// The query row this warp owns (row >= lq: past the sequence end, nothing to do).
struct WarpRow {
    int batch, head, row, lane;

    template <typename Cfg>
    __device__ __forceinline__ static WarpRow from_grid(const AttnDims& dims) {
        static_assert(Cfg::THREADS == 32 * Cfg::BM, "the variant table's thread count: one warp per row");
        static_assert(Cfg::SMEM_BYTES == 0, "no shared memory");
        const QueryBlock blk = QueryBlock::from_grid<Cfg::BM, false>(dims);
        return {blk.batch, blk.head, blk.m0 + int(threadIdx.x) / 32, int(threadIdx.x) % 32};
    }
};

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_dsum(const BwdParams p) {
    typedef typename AccumOf<T>::type A;
    const WarpRow w = WarpRow::from_grid<Cfg>(p.dims);
    if (w.row >= p.dims.lq) return;   // the whole warp
    const T* dout = p.dout.at<const T>(w.batch, w.head, w.row);
    const T* out = p.out.at<const T>(w.batch, w.head, w.row);
    A acc = A(0);
    // Two loads in flight per lane at <= 32 registers: a full SM of warps hides the memory latency.
#pragma unroll 2
    for (int c = w.lane; c < p.dims.dv; c += 32) acc = fma(to_acc(dout[c]), to_acc(out[c]), acc);
    acc = group_sum<32>(acc);
    if (w.lane == 0) *p.dsum.at<A>(w.batch, w.head, w.row) = acc;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_CTAS)
flash_bwd_convert_dq(const BwdParams p) {
    typedef typename AccumOf<T>::type A;
    const WarpRow w = WarpRow::from_grid<Cfg>(p.dims);
    if (w.row >= p.dims.lq) return;   // the whole warp
    const A* acc = p.dq_acc.at<const A>(w.batch, w.head, w.row);
    T* dq = p.dq.at<T>(w.batch, w.head, w.row);
    for (int c = w.lane; c < p.dims.d; c += 32) dq[c] = from_acc<T>(acc[c]);
}
