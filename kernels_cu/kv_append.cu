// kv_append.cu -- the KV-cache call's append in one launch: row t of k_new / v_new (batch entry b, K/V
// head h) written at position lengths[b] + t of sequence b (the contiguous cache's row, or slot
// position % page_size of page page_table[b][position / page_size]), and each sequence's key count
// after the append, lengths[b] + n_new, for the attention kernels. One launch, where CuPy's integer
// indexing takes one for each index array and a scatter for each cache (each a launch's host time, at
// every step of a decoding loop).
//
// Positions, table entries and page indices out of range (lengths or a table not validated) wrap, as
// CuPy's integer indexing does: the append stays inside the cache. Elements move as bits.
#include "common.cuh"
#include "params.cuh"

constexpr int KV_APPEND_THREADS = 128;

// x mod n in [0, n) for any x (n > 0): Python's %, CuPy's wrap of an index.
__device__ __forceinline__ int64 wrapped(int64 x, int64 n) {
    const int64 r = x % n;
    return r < 0 ? r + n : r;
}

// The element offset of position `position` of sequence b, head h in a cache (its batch stride steps
// from page to page in a paged one).
__device__ __forceinline__ int64 cache_row(const KvAppendParams& p, const Strided4& cache, int b, int h,
                                           int64 position) {
    if (p.page_table == nullptr)
        return b * cache.strides[0] + h * cache.strides[1] + wrapped(position, p.cap) * cache.strides[2];
    const int64 slot = wrapped(position, p.page_size);
    const int64 entry = wrapped((position - slot) / p.page_size, p.pages_per_seq);   // (floor division)
    const int64 page = wrapped(p.page_table[b * int64(p.pages_per_seq) + entry], p.num_pages);
    return page * cache.strides[0] + h * cache.strides[1] + slot * cache.strides[2];
}

// Elements [0, count) of the row at element offset from_row of `from` into the row at to_row of `to`.
template <typename E>
__device__ __forceinline__ void copy_row(const Strided4& to, int64 to_row, const Strided4& from, int64 from_row,
                                         int count) {
    E* dst = static_cast<E*>(to.ptr) + to_row;
    const E* src = static_cast<const E*>(from.ptr) + from_row;
    for (int e = threadIdx.x; e < count; e += KV_APPEND_THREADS)
        dst[e * to.strides[3]] = src[e * from.strides[3]];
}

// One CTA a row (b, h, t) of k_new and v_new, rows a grid apart. E: an unsigned integer of the element's size.
template <typename E>
__global__ void __launch_bounds__(KV_APPEND_THREADS) kv_append(const __grid_constant__ KvAppendParams p) {
    const unsigned rows = unsigned(p.batch * p.heads * p.n_new);   // under 2^31 (the caller's rule)
    for (unsigned next = blockIdx.x; next < rows; next += gridDim.x) {   // (unsigned: no overflow past 2^31)
        const int row = int(next);
        const int t = row % p.n_new, h = row / p.n_new % p.heads, b = row / p.n_new / p.heads;
        const int length = p.lengths != nullptr ? p.lengths[b] : p.length;
        if (h == 0 && t == 0 && threadIdx.x == 0)
            p.total[b] = int(unsigned(length) + unsigned(p.n_new));   // int32 arithmetic, as lengths + n_new
        const int64 position = int64(length) + t;
        const int64 k_src = b * p.k_new.strides[0] + h * p.k_new.strides[1] + t * p.k_new.strides[2];
        const int64 v_src = b * p.v_new.strides[0] + h * p.v_new.strides[1] + t * p.v_new.strides[2];
        copy_row<E>(p.k_cache, cache_row(p, p.k_cache, b, h, position), p.k_new, k_src, p.d);
        copy_row<E>(p.v_cache, cache_row(p, p.v_cache, b, h, position), p.v_new, v_src, p.dv);
    }
}
