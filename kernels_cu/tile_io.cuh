// tile_io.cuh -- global <-> shared tile copies with predicated edges.
//
// A tile is ROWS x COLS elements of a row-major global matrix (row stride in
// elements, unit column stride) copied into shared memory with row pitch PITCH.
// Elements outside (rows_valid, cols_valid) are written as zeros, so padded
// head-dim columns and rows past the sequence end contribute nothing to the
// dot products.
#pragma once
#include "common.cuh"
#include "params.cuh"

__device__ __forceinline__ void cp_async_16(unsigned smem_dst_addr, const void* gmem_src, bool valid) {
    // src-size 0 makes cp.async fill the 16 bytes with zeros without reading.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_dst_addr), "l"(gmem_src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    cp_async_16(smem_addr(smem_dst), gmem_src, valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// One step of a ring of STAGES (1 or 2) cp.async stages over a sequence of steps (key tiles, or
// query blocks): with two stages and a step `next` before `end`, issue(next, stage ^ 1) starts
// its copies into the other stage (issue commits its group) while this step computes from
// `stage`. Returns once this thread's copies for this step have landed; a CTA barrier must
// follow before any thread reads the stage.
template <int STAGES, typename Issue>
__device__ __forceinline__ void prefetch_next_step(int next, int end, int stage, Issue&& issue) {
    if (STAGES == 2 && next < end) {
        issue(next, stage ^ 1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
}

// The end of one step of a dK/dV kernel's query-block ring (prefetch_next_step): the next step's
// copies may overwrite this step's stage and row stats only once every warp has read them. With
// an atomic dQ (DQ_BARRIER: its step already has a barrier between forming dS^T and the dQ product
// that reads dS^T and K only) that barrier follows every such read, and the next step writes dS^T
// only after its own first barrier, which every warp reaches after this step's dQ: none needed here.
template <bool DQ_BARRIER>
__device__ __forceinline__ void end_of_step_barrier() {
    if (!DQ_BARRIER) __syncthreads();
}

// Output rows: a C fragment's two adjacent columns col, col + 1 (col even) of one row, lo and hi
// from the accumulator. PAIRS (dv known even: the variants whose V rows are 16-byte chunks, VEC and
// the Hopper kernels): one 2-element store, since the outputs are cuflash's own contiguous arrays
// (api.py allocates them) and every row of an even dv starts 2-element aligned (16-bit pairs 4
// bytes, float 8, double 16): half the store instructions of the element-wise epilogue. Otherwise
// element by element (with dv odd the rows alternate in alignment).
template <typename T, typename A>
__device__ __forceinline__ void store_pair(T* dst, A lo, A hi) {
    if constexpr (sizeof(T) == 2) *reinterpret_cast<unsigned*>(dst) = pack2<T>(lo, hi);
    else if constexpr (sizeof(T) == 4) *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
    else *reinterpret_cast<double2*>(dst) = make_double2(lo, hi);
}
template <bool PAIRS, typename T, typename A>
__device__ __forceinline__ void store_out_pair(T* out_row, int col, int dv, A lo, A hi) {
    if (PAIRS) {
        if (col < dv) store_pair(out_row + col, lo, hi);
        return;
    }
    if (col < dv) out_row[col] = from_acc<T>(lo);
    if (col + 1 < dv) out_row[col + 1] = from_acc<T>(hi);
}

// VEC: 16-byte cp.async chunks. The caller guarantees 16-byte aligned rows and,
// unless CUT_CHUNKS, cols_valid a multiple of the chunk (with CUT_CHUNKS a chunk
// the row end cuts is copied element by element). Otherwise element by element.
template <typename T, int ROWS, int COLS, int PITCH, int THREADS, bool VEC, bool CUT_CHUNKS = false>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64 row_stride,
                                          int rows_valid, int cols_valid) {
    if (VEC) {
        constexpr int CHUNK = 16 / sizeof(T);
        constexpr int CHUNKS_PER_ROW = COLS / CHUNK;
        // Unrolled by 2, not 4: four chunks' addresses live at once spills the
        // head-dim-128 two-strip forward on sm_90 (255 registers).
#pragma unroll 2
        for (int i = threadIdx.x; i < ROWS * CHUNKS_PER_ROW; i += THREADS) {
            const int row = i / CHUNKS_PER_ROW;
            const int col = (i % CHUNKS_PER_ROW) * CHUNK;
            if (CUT_CHUNKS && row < rows_valid && col < cols_valid && col + CHUNK > cols_valid) {
#pragma unroll
                for (int e = 0; e < CHUNK; ++e)
                    smem[row * PITCH + col + e] = col + e < cols_valid ? gmem[row * row_stride + col + e] : zero_value<T>();
                continue;
            }
            const bool valid = row < rows_valid && col < cols_valid;
            const T* src = valid ? gmem + row * row_stride + col : gmem;
            cp_async_16(smem + row * PITCH + col, src, valid);
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
            const int row = i / COLS;
            const int col = i % COLS;
            smem[row * PITCH + col] = (row < rows_valid && col < cols_valid)
                                          ? gmem[row * row_stride + col] : zero_value<T>();
        }
    }
}

// The same copy where each thread keeps one column (chunk) in every row it
// copies: with THREADS a multiple of the chunks per row, thread t copies chunk
// t % PER_ROW of rows t / PER_ROW + k * ROW_STEP. The trip count is a compile-time
// constant and one source pointer walks down the rows, so a thread holds a
// pointer, a row count and one shared address rather than an address per chunk:
// with 128 x 128 tiles at head dim 64 the forward's K/V prefetch then leaves the
// softmax's registers alone (load_tile's loop spills it). 16-byte chunks are
// unrolled fully (at most 8 a thread in the forward's tiles). Element copies are
// unrolled by 16, so 16 loads are in flight before their stores (by 4 or 8 the
// d=64 band forward spills 32 bytes on sm_90; fully, 32-iteration loops spill
// 140-316 bytes). Shapes whose rows do not split evenly over the threads (scalar
// copies of 256 columns) take load_tile.
// SWIZZLED: the tile's rows unpadded (PITCH == COLS) with 16-byte chunk c of row r stored at chunk
// c ^ (r % 8) (swizzled_chunk), for ldmatrix without bank conflicts (warp_gemm.cuh's SW_B). A warp's
// copies then fill whole 128-byte lines of shared memory: into rows padded by 16 bytes the same
// copies stream K/V at 88% of the H200's HBM rate, unpadded at 96% (benchmarks/stream_layout.py).
// Each thread's rows are ROW_STEP apart, a multiple of 8, so its chunk's swizzled place is the same
// in every row it copies.
__device__ __forceinline__ int swizzled_chunk(int row, int chunk) { return chunk ^ (row & 7); }

template <typename T, int ROWS, int COLS, int PITCH, int THREADS, bool VEC, bool SWIZZLED = false>
__device__ __forceinline__ void load_tile_fixed_col(T* smem, const T* gmem, int64 row_stride, int rows_valid,
                                                    int cols_valid) {
    constexpr int CHUNK = VEC ? 16 / int(sizeof(T)) : 1;
    constexpr int PER_ROW = COLS / CHUNK;
    constexpr int ROW_STEP = THREADS / PER_ROW;
    constexpr bool FITS = COLS % CHUNK == 0 && THREADS % PER_ROW == 0 && ROWS % ROW_STEP == 0;
    static_assert(!SWIZZLED || (FITS && VEC && PITCH == COLS && PER_ROW % 8 == 0 && ROW_STEP % 8 == 0),
                  "swizzled rows: whole groups of 8 chunks, each thread's rows a multiple of 8 apart");
    if constexpr (!FITS) {
        load_tile<T, ROWS, COLS, PITCH, THREADS, VEC>(smem, gmem, row_stride, rows_valid, cols_valid);
    } else {
        constexpr int UNROLL = VEC ? ROWS / ROW_STEP : 16;
        const int col = (threadIdx.x % PER_ROW) * CHUNK, first_row = threadIdx.x / PER_ROW;
        const bool col_valid = col < cols_valid;
        int rows_left = rows_valid - first_row;   // > 0: this thread's current row is inside
        const T* src = gmem + first_row * row_stride + col;
        T* dst = smem + first_row * PITCH + (SWIZZLED ? swizzled_chunk(first_row, col / CHUNK) * CHUNK : col);
        const unsigned dst_addr = smem_addr(dst);
#pragma unroll UNROLL
        for (int k = 0; k < ROWS / ROW_STEP; ++k) {
            const bool valid = col_valid && rows_left > 0;
            if (VEC) cp_async_16(dst_addr + k * ROW_STEP * PITCH * int(sizeof(T)), valid ? src : gmem, valid);
            else dst[k * ROW_STEP * PITCH] = valid ? *src : zero_value<T>();
            src += ROW_STEP * row_stride;
            rows_left -= ROW_STEP;
        }
    }
}

// The rows one thread copies in a K/V tile of a paged cache (MaskParams::page_table), into
// load_tile_fixed_col's shared layout: thread t copies chunk t % PER_ROW of the COUNT consecutive rows
// from (t / PER_ROW) * COUNT (load_tile_fixed_col's threads copy rows ROW_STEP apart instead). Pages
// and COUNT are powers of two, so where a page holds at least COUNT positions a thread's rows lie in
// one page (`grouped`): one table entry and one wide multiply-add a tile, the rows a stride apart; smaller
// pages take an entry and a multiply-add a row. look_up reads the table entries of a tile and works out
// the element offsets inside their pages (row, head and chunk: arithmetic that waits for no load);
// load_kv_tile calls it for the next tile as it issues this tile's copies, so the table reads' latency
// passes during a step; K and V share each address (the plan reads pages in place only where K and V
// have the same strides). With the lookup in front of each copy, and its address worked out for K and
// again for V, the 16-bit split forward streamed a paged cache at 0.45x the contiguous rate
// (benchmarks/bench_decode.py).
template <typename T, int ROWS, int COLS, int THREADS, bool VEC>
struct PageCursor {
    static constexpr int CHUNK = VEC ? 16 / int(sizeof(T)) : 1;
    static constexpr int PER_ROW = COLS / CHUNK;
    static constexpr int ROW_STEP = THREADS / PER_ROW;
    // 16-byte chunks only: element copies would hold a page a row (64 registers at head dim 64)
    static constexpr bool FITS = VEC && COLS % CHUNK == 0 && THREADS % PER_ROW == 0 && ROWS % ROW_STEP == 0;
    static constexpr int COUNT = FITS ? ROWS / ROW_STEP : 1;   // rows a thread copies a tile
    static_assert((COUNT & (COUNT - 1)) == 0, "a thread's rows: a power of two, whole inside pages of as many");
    int row0 = -1;          // the first key of the tile these entries describe (-1: none)
    int page[COUNT];        // the table entry of row (threadIdx.x / PER_ROW) * COUNT + k (not yet clamped)
    int in_page[COUNT];     // that row's chunk's element offset inside its page (row, head, column)

    // A thread's rows of a tile in one page (page[0] and in_page[0] describe them all).
    static __device__ __forceinline__ bool grouped(const MaskParams& m) { return m.page_size >= COUNT; }

    // Issues the table reads for the K/V head `head`'s tile at key row0_next (keys at or past lk read
    // nothing). `pages` is the K view (the V view has its strides).
    __device__ __forceinline__ void look_up(const MaskParams& m, const View& pages, int batch, int head, int row0_next,
                                            int lk) {
        const int* table = m.page_table + int64(batch) * m.pages_per_seq;
        const int first_key = row0_next + int(threadIdx.x) / PER_ROW * COUNT;
        const int chunk = int(head * pages.head_stride) + int(threadIdx.x % PER_ROW) * CHUNK;
        const int shift = __ffs(m.page_size) - 1;   // page sizes are powers of two (the plan's rule)
        row0 = row0_next;
        if (grouped(m)) {   // (a row past lk lies in its first row's page: that page, or page 0, is read from)
            page[0] = first_key < lk ? table[first_key >> shift] : 0;
            in_page[0] = (first_key & (m.page_size - 1)) * int(pages.row_stride) + chunk;
            return;
        }
#pragma unroll
        for (int k = 0; k < COUNT; ++k) {
            const int key = first_key + k;
            page[k] = key < lk ? table[key >> shift] : 0;
            in_page[k] = (key & (m.page_size - 1)) * int(pages.row_stride) + chunk;
        }
    }
};

// load_tile_fixed_col's 16-byte copy of the K and V rows [cursor.row0, cursor.row0 + ROWS) of one head
// from a paged cache (K and V views of equal strides; the batch stride steps between pages), each row
// in its page: rows past rows_valid and K / V columns past k_cols / v_cols are zeros. Page indices are
// clamped to [0, num_pages): an unchecked table stays inside the cache, and so does every address
// formed (a copy past rows_valid reads nothing, from its page). V_PITCH: V's row pitch where it differs
// from K's (the fp64 decoding tiles: each operand's conflict-free pitch, warp_gemm_f64.cuh).
template <typename T, int ROWS, int COLS, int PITCH, int THREADS, bool VEC, bool SWIZZLED = false, int V_PITCH = PITCH>
__device__ __forceinline__ void load_paged_rows(T* k_smem, T* v_smem, const View& k, const View& v,
                                                const PageCursor<T, ROWS, COLS, THREADS, VEC>& cursor,
                                                const MaskParams& m, int rows_valid, int k_cols, int v_cols) {
    typedef PageCursor<T, ROWS, COLS, THREADS, VEC> Cursor;
    constexpr int COUNT = Cursor::COUNT, CHUNK = Cursor::CHUNK;
    static_assert(Cursor::FITS, "load_tile_fixed_col's layout");
    static_assert(!SWIZZLED || (PITCH == COLS && Cursor::PER_ROW % 8 == 0),
                  "load_tile_fixed_col's swizzled layout");
    const int col = (threadIdx.x % Cursor::PER_ROW) * CHUNK, first_row = threadIdx.x / Cursor::PER_ROW * COUNT;
    const bool k_col_valid = col < k_cols, v_col_valid = col < v_cols;
    // row first_row + r's chunk in shared memory, in bytes from the tile's start (swizzled: chunk ^ (row % 8),
    // r % 8 where COUNT is a multiple of 8)
    auto dst = [&](int r, int pitch) {
        const int row_mod8 = COUNT % 8 == 0 ? r % 8 : (first_row + r) % 8;
        const int c = SWIZZLED ? (col / CHUNK ^ row_mod8) * CHUNK : col;
        return unsigned(((first_row + r) * pitch + c) * int(sizeof(T)));
    };
    const unsigned k_dst = smem_addr(k_smem), v_dst = smem_addr(v_smem);
    const T* k_base = static_cast<const T*>(k.ptr);
    const T* v_base = static_cast<const T*>(v.ptr);
    const int num_pages = m.num_pages;
    if (Cursor::grouped(m)) {
        const int page = min(max(cursor.page[0], 0), num_pages - 1);
        // a page's stride and the in-page offset fit 32 bits (the plan's rule): one wide multiply-add a tile
        const int64 offset = int64(page) * int64(int(k.batch_stride)) + cursor.in_page[0];
        const T* k_src = k_col_valid ? k_base + offset : k_base;   // (a column past the head: the cache's first
        const T* v_src = v_col_valid ? v_base + offset : v_base;   // rows, never read)
#pragma unroll
        for (int r = 0; r < COUNT; ++r) {
            const bool row_valid = first_row + r < rows_valid;
            cp_async_16(k_dst + dst(r, PITCH), k_src, row_valid && k_col_valid);
            cp_async_16(v_dst + dst(r, V_PITCH), v_src, row_valid && v_col_valid);
            k_src += k.row_stride;
            v_src += k.row_stride;
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < COUNT; ++r) {
        const bool row_valid = first_row + r < rows_valid;
        const int page = min(max(cursor.page[r], 0), num_pages - 1);
        const int64 offset = int64(page) * int64(int(k.batch_stride)) + cursor.in_page[r];
        const bool k_valid = row_valid && k_col_valid, v_valid = row_valid && v_col_valid;
        cp_async_16(k_dst + dst(r, PITCH), k_valid ? k_base + offset : k_base, k_valid);   // (no bytes read when not valid)
        cp_async_16(v_dst + dst(r, V_PITCH), v_valid ? v_base + offset : v_base, v_valid);
    }
}

// Two tiles of the same ROWS rows [row0, row0 + ROWS) of one (batch, head) from
// two views: Q and dO, or K and V. Rows past rows_valid and columns past each
// view's own width (a_cols, b_cols) are zeros.
template <typename T, int ROWS, int COLS, int PITCH, int THREADS, bool VEC>
__device__ __forceinline__ void load_row_tiles(T* a_s, const View& a, int a_cols, T* b_s, const View& b, int b_cols,
                                               int batch, int head, int row0, int rows_valid) {
    load_tile<T, ROWS, COLS, PITCH, THREADS, VEC>(a_s, a.at<const T>(batch, head, row0), a.row_stride, rows_valid, a_cols);
    load_tile<T, ROWS, COLS, PITCH, THREADS, VEC>(b_s, b.at<const T>(batch, head, row0), b.row_stride, rows_valid, b_cols);
}

// Score-shaped tiles (a bias): ROWS x COLS elements of a ScoreTensor at
// (batch, head, row0.., col0..), whose strides may be 0 (broadcast) and whose
// columns need not be unit-stride. Elements outside (rows_valid, cols_valid)
// are written as zeros, so a kernel reads any element of the tile without tests.

// Score-tile copies share one strided loop; `convert` maps a stored value to S.
template <int ROWS, int COLS, int PITCH, int THREADS, typename S, typename T, typename Convert>
__device__ __forceinline__ void load_strided_tile(S* smem, const T* base, int64 rs, int64 cs, int rows_valid,
                                                  int cols_valid, S zero, Convert convert) {
#pragma unroll 4
    for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
        const int r = i / COLS, c = i % COLS;
        smem[r * PITCH + c] = r < rows_valid && c < cols_valid ? convert(base[r * rs + c * cs]) : zero;
    }
}

// Into a tile of the storage type T: 16-byte cp.async chunks when the tensor's
// rows are unit-stride and 16-byte aligned (the caller commits and waits for the
// group), element by element otherwise (and for a chunk cut by cols_valid).
template <typename T, int ROWS, int COLS, int PITCH, int THREADS>
__device__ __forceinline__ void load_score_tile(T* smem, const ScoreTensor& t, int batch, int head, int row0, int col0,
                                                int rows_valid, int cols_valid) {
    static_assert((PITCH * sizeof(T)) % 16 == 0, "16-byte aligned tile rows");
    const T* base = t.at<T>(batch, head, row0, col0);
    const bool vec = t.col_stride == 1
                     && ((reinterpret_cast<unsigned long long>(base) | (unsigned long long)(t.row_stride * sizeof(T))) % 16) == 0;
    if (vec)
        load_tile<T, ROWS, COLS, PITCH, THREADS, true, true>(smem, base, t.row_stride, rows_valid, cols_valid);
    else
        load_strided_tile<ROWS, COLS, PITCH, THREADS>(smem, base, t.row_stride, t.col_stride, rows_valid, cols_valid,
                                                      zero_value<T>(), [](T x) { return x; });
}

// One key tile of a query block's pipeline, into stage ``stage`` of the K, V and bias rings (KV_ELEMS
// and BIAS_ELEMS elements a stage): K and V rows n0.. (fixed-column copies, zero past the head dims)
// and, with a bias, the block's BM x BN bias tile. All cp.async where the layout allows; the caller
// commits the group. The forwards (16-bit and TF32) and the TF32 dQ kernel share it.
// key_count: the keys of the block's sequence (dims.lk, or a KV cache sequence's own count). V rows
// from it on are zeros: the cache's free room may hold anything, NaN included, which a zero
// probability would not cancel in P V. K rows there are copied up to dims.lk and their scores masked
// (the count held through K's copy too spilled the float32 split tile 128x32).
// PAGED (the split forwards' PER_SEQ path) with a page table: K and V from a paged cache through
// `pages`, which holds tile n0's pages when the previous call read them ahead (else they are read
// now) and is left reading tile n0 + 1's. V_PITCH: V's row pitch (K's by default). PACKED (a packed
// sequence, PackedBlock): K's rows stop at key_count too (past it lie the next sequence's rows, or the
// array's end).
template <typename T, int BM, int BN, int HEAD, int P, int BIAS_PITCH, int THREADS, bool VEC, int KV_ELEMS,
          int BIAS_ELEMS, bool PAGED = false, bool PACKED = false, bool SWIZZLED = false, int V_PITCH = P,
          typename Params>
__device__ __forceinline__ void load_kv_tile(T* k_s, T* v_s, T* bias_s, int stage, const Params& p,
                                             const QueryBlock& blk, bool with_bias, int n0, int key_count,
                                             PageCursor<T, BN, HEAD, THREADS, VEC>* pages = nullptr) {
    const AttnDims& dims = p.dims;
    if constexpr (PAGED && PageCursor<T, BN, HEAD, THREADS, VEC>::FITS) {
        if (p.mask.page_table != nullptr) {
            if (pages->row0 != n0) pages->look_up(p.mask, p.k, blk.batch, blk.kv_head, n0, key_count);
            load_paged_rows<T, BN, HEAD, P, THREADS, VEC, SWIZZLED, V_PITCH>(
                k_s + stage * KV_ELEMS, v_s + stage * KV_ELEMS, p.k, p.v, *pages, p.mask, key_count - n0, dims.d,
                dims.dv);
            pages->look_up(p.mask, p.k, blk.batch, blk.kv_head, n0 + BN, key_count);
            return;
        }
    }
    load_tile_fixed_col<T, BN, HEAD, P, THREADS, VEC, SWIZZLED>(k_s + stage * KV_ELEMS,
                                                                p.k.template at<const T>(blk.batch, blk.kv_head, n0),
                                                                p.k.row_stride, (PACKED ? key_count : dims.lk) - n0,
                                                                dims.d);
    load_tile_fixed_col<T, BN, HEAD, V_PITCH, THREADS, VEC, SWIZZLED>(
        v_s + stage * KV_ELEMS, p.v.template at<const T>(blk.batch, blk.kv_head, n0), p.v.row_stride, key_count - n0,
        dims.dv);
    if (with_bias)
        load_score_tile<T, BM, BN, BIAS_PITCH, THREADS>(bias_s + stage * BIAS_ELEMS, p.mask.bias, blk.batch, blk.head,
                                                        blk.m0, n0, blk.rows, key_count - n0);
}

// Into a tile of the accumulator type A (the FMA kernels' P tile), converted;
// synchronous (the caller's __syncthreads publishes it).
template <typename T, typename A, int ROWS, int COLS, int PITCH, int THREADS>
__device__ __forceinline__ void load_score_tile_acc(A* smem, const ScoreTensor& t, int batch, int head, int row0,
                                                    int col0, int rows_valid, int cols_valid) {
    load_strided_tile<ROWS, COLS, PITCH, THREADS>(smem, t.at<T>(batch, head, row0, col0), t.row_stride, t.col_stride,
                                                  rows_valid, cols_valid, A(0), [](T x) { return A(to_acc(x)); });
}

// A 16-bit score tile without padding, for ldmatrix: ROWS x COLS elements, row r at
// r * COLS * 2 bytes, its 16-byte chunk c stored at chunk position c ^ (r % 8). The 8
// rows of an 8 x 8 ldmatrix block (8 consecutive rows from a multiple of 8, one
// chunk) then sit in 8 different 4-bank groups, as padding each row by 16 bytes would
// do, at no extra space (the Hopper forward's bias stages fill shared memory to
// within 2 KB of the H100's 227 KB: padding would not fit).
template <int COLS>
__device__ __forceinline__ unsigned sw_chunk_offset(int row, int chunk) {
    static_assert(COLS % 64 == 0, "whole groups of 8 chunks a row");
    return row * COLS * 2 + swizzled_chunk(row, chunk) * 16;
}

// cp.async of one 16-byte chunk that copies its first src_bytes (0-16) and fills the
// rest with zeros: a chunk the sequence end cuts needs no element-by-element path.
__device__ __forceinline__ void cp_async_16_head(unsigned smem_dst_addr, const void* gmem_src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_dst_addr), "l"(gmem_src), "r"(src_bytes));
}

// One thread's part of copying ROWS x COLS score tiles at rows [row0, row0 + ROWS) of one
// (batch, head) of `t` (16-bit) into the swizzled layout above, with cp.async (the caller
// tracks their completion), by THREADS threads of which this is `thread` (a part of a
// CTA: the Hopper forward's producer warps). Each thread keeps one chunk column and the
// rows first_row + k ROW_STEP, and walks one pointer down them (as load_tile_fixed_col),
// in a loop not unrolled: what it holds across tiles is a pointer, a stride and two
// indices (a producer thread has 24-56 registers). The caller guarantees rows of 16-byte
// chunks: unit key stride, a 16-byte aligned start and batch, head and row strides (0
// included) (cuflash/_dispatch/masking.py, bias_in_chunks).
template <typename T, int ROWS, int COLS, int THREADS>
struct ScoreChunkCopy {
    static constexpr int CHUNKS = COLS / 8, ROW_STEP = THREADS / CHUNKS;
    static_assert(sizeof(T) == 2, "16-bit tiles");
    static_assert(THREADS % CHUNKS == 0 && ROWS % ROW_STEP == 0, "every thread keeps one chunk column");
    const T* src;   // the thread's chunk of its first row at key 0
    int64 step;     // ROW_STEP rows of the tensor, in elements
    int chunk, first_row;

    __device__ __forceinline__ ScoreChunkCopy(const ScoreTensor& t, int batch, int head, int row0, int thread)
        : chunk(thread % CHUNKS), first_row(thread / CHUNKS) {
        src = t.at<T>(batch, head, row0 + first_row, 8 * chunk);
        step = ROW_STEP * t.row_stride;
    }

    // Keys [col0, col0 + COLS) (col0 a multiple of 8) into the tile at `smem`; rows past
    // rows_valid and keys past cols_valid are zeros (a chunk the sequence end cuts is
    // copied in part: cp.async's source size). `valid` is any readable address (given
    // as the source of chunks that read nothing).
    __device__ __forceinline__ void copy(unsigned smem, int col0, int rows_valid, int cols_valid,
                                         const void* valid) const {
        const int src_bytes = 2 * imax(0, imin(8, cols_valid - 8 * chunk));   // 16, a cut chunk's head, or 0
        const T* p = src + col0;
#pragma unroll 1
        for (int row = first_row; row < ROWS; row += ROW_STEP, p += step) {
            const int n = row < rows_valid ? src_bytes : 0;
            cp_async_16_head(smem + sw_chunk_offset<COLS>(row, chunk), n ? p : valid, n);
        }
    }
};
