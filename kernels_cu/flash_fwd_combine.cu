// flash_fwd_combine.cu -- the split-KV forward's last kernel: merge the num_splits partial results
// of each query row into out and lse (combine.cuh). One warp a query row, BM rows a CTA (QueryBlock's
// grid: ceil(Lq / BM) x Hq x B).
#include "common.cuh"
#include "params.cuh"
#include "scheduler.cuh"
#include "tile_io.cuh"
#include "combine.cuh"

template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS)
flash_fwd_combine(const FwdParams p) {
    constexpr int BM = Cfg::BM;
    static_assert(Cfg::THREADS == 32 * BM && Cfg::WARPS == BM, "one warp a row");
    const QueryBlock blk = QueryBlock::from_grid<BM>(p.dims);
    const int lane = threadIdx.x % 32, row = threadIdx.x / 32;
    if (row >= blk.rows) return;
    combine_row<T, Cfg::HEAD>(p, blk.batch, blk.head, blk.m0 + row, lane);
}
