// flash_bwd_aux.cu -- the backward's row-wise kernels, one warp per query row:
//   flash_bwd_dsum        before the main kernels: Dsum = rowsum(dO * O)
//   flash_bwd_convert_dq  after the atomic path: dQ = dQ_acc in the input dtype
// Grid: ceil(Lq / BM) x Hq x B CTAs (BlockInfo) of BM warps.
#include "common.cuh"
#include "params.cuh"

template <typename Cfg>
struct RowwiseTraits {
    static constexpr int ROWS = Cfg::BM;           // one warp per row
    static_assert(Cfg::THREADS == 32 * ROWS, "the variant table's thread count");
    static_assert(Cfg::SMEM_BYTES == 0, "no shared memory");
};

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS)
flash_bwd_dsum(const BwdParams p) {
    typedef typename AccumOf<T>::type A;
    constexpr int ROWS = RowwiseTraits<Cfg>::ROWS;
    const BlockInfo blk = BlockInfo::from_grid<false>(ceil_div(p.dims.lq, ROWS), p.dims.heads_q);
    const int row = blk.tile * ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= p.dims.lq) return;   // the whole warp
    const T* dout = p.dout.at<const T>(blk.batch, blk.head, row);
    const T* out = p.out.at<const T>(blk.batch, blk.head, row);
    A acc = A(0);
    for (int c = lane; c < p.dims.dv; c += 32) acc = fma(to_acc(dout[c]), to_acc(out[c]), acc);
    acc = group_sum<32>(acc);
    if (lane == 0) *p.dsum.at<A>(blk.batch, blk.head, row) = acc;
}

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS)
flash_bwd_convert_dq(const BwdParams p) {
    typedef typename AccumOf<T>::type A;
    constexpr int ROWS = RowwiseTraits<Cfg>::ROWS;
    const BlockInfo blk = BlockInfo::from_grid<false>(ceil_div(p.dims.lq, ROWS), p.dims.heads_q);
    const int row = blk.tile * ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= p.dims.lq) return;
    const A* acc = p.dq_acc.at<const A>(blk.batch, blk.head, row);
    T* dq = p.dq.at<T>(blk.batch, blk.head, row);
    for (int c = lane; c < p.dims.d; c += 32) dq[c] = from_acc<T>(acc[c]);
}
