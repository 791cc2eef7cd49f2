// tma.cuh -- Hopper's (sm_90a) asynchronous pipeline pieces: the bulk tensor copy
// engine (TMA), the shared-memory barriers (mbarrier) that its copies complete on,
// register reallocation between warpgroups (setmaxnreg) and named barriers.
//
// A tensor map (CUtensorMap, 128 bytes) describes a global tensor to the copy
// engine; the host encodes it (cuflash/_runtime/tma.py) and passes it as a __grid_constant__
// kernel parameter, whose address the copy instruction takes. One thread issues a
// whole tile; the engine writes it to shared memory in the 128-byte swizzled layout
// wgmma reads (wgmma.cuh), fills what lies outside the tensor with zeros, and counts
// the bytes it wrote against the transaction count of an mbarrier.
//
// An mbarrier completes a phase when its expected arrivals have arrived and its
// transaction count is back to zero; a waiter names the phase by its parity. A
// fresh barrier is in phase 0, so waiting for parity 1 returns at once: a producer
// waits on "empty" barriers with the parity of the round before, and the first
// round passes.
#pragma once
#include "common.cuh"

// The host's CUtensorMap: opaque, 64-byte aligned.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// The Hopper forwards' tensor maps (cuflash/_runtime/tma.py, fwd_map_specs): Q, K, V as 4-D (D, L, H, B)
// tensors, a box of one 128-byte swizzle slab (64 16-bit or 32 fp32 columns) by BM (Q) or BN (K, V)
// rows. O: the output, boxes of one slab x 64 rows (one consumer warpgroup's rows), written by the
// 16-bit kernel at head dim >= 128 (flash_fwd_wgmma.cu); the float32 kernel stores O itself.
struct FwdTensorMaps {
    TensorMap q, k, v, o;
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrivals) : "memory");
}

// Make the initialised barriers visible to the copy engine (the async proxy) before
// the barrier that publishes them to the other threads.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces `bytes` of copies still to land in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;"
                 :: "r"(bar), "r"(bytes) : "memory");
}

// A 32-bit word at a shared-memory address (a value handed between threads under an mbarrier's
// release / acquire; "memory": the compiler keeps it on its side of the barrier's asm).
__device__ __forceinline__ void st_shared_s32(unsigned addr, int value) {
    asm volatile("st.shared.s32 [%0], %1;" :: "r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ int ld_shared_s32(unsigned addr) {
    int value;
    asm volatile("ld.shared.s32 %0, [%1];" : "=r"(value) : "r"(addr) : "memory");
    return value;
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// One arrival, made by the hardware once every cp.async (non-bulk) this thread issued
// before it has landed; counted against the barrier's expected arrivals (.noinc). The
// waiters then see those copies.
__device__ __forceinline__ void mbar_arrive_on_cp_async(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}

// Spin until the phase of parity `parity` has completed (acquire: the copies and the
// writes released by its arrivals are visible afterwards).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// Copy the box at (c0, c1, c2, c3) (innermost first, in elements) of the tensor that
// `map` describes into shared memory at `dst`; completes on `bar`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TensorMap* map, unsigned bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Add the box at (c0, c1, c2, c3) of shared memory at `src` into the tensor `map` describes
// (fp32 add, done by the copy engine next to L2; elements outside the tensor are dropped). It
// reads `src` asynchronously: bulk_commit() closes a group of the issuing thread's bulk
// operations, bulk_wait_read<N>() waits until at most N of its groups still read their sources.
__device__ __forceinline__ void tma_reduce_add_4d(const TensorMap* map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
        :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
        : "memory");
}
// Copy shared memory at `src` into the box at (c0, c1, c2, c3) of the tensor `map` describes
// (elements outside the tensor are not written); a bulk group as the reductions above.
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, unsigned src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
                 :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
// ...and until at most N groups are still in flight at all (their writes done).
template <int N>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}

// One ROWS x (SLAB_COLS SLABS) tile of a (D, L, H, B) tensor, rows [row, row + ROWS) of (head,
// batch), as SLABS boxes of one 128-byte slab each (SLAB_COLS = 64 16-bit or 32 fp32 columns):
// slab s at dst + s * ROWS * 128 bytes (the 128-byte swizzled layout of wgmma.cuh).
template <int ROWS, int SLABS, int SLAB_COLS = 64>
__device__ __forceinline__ void tma_load_tile(unsigned dst, const TensorMap* map, unsigned bar, int row, int head,
                                              int batch) {
#pragma unroll
    for (int s = 0; s < SLABS; ++s) tma_load_4d(dst + s * ROWS * 128, map, bar, SLAB_COLS * s, row, head, batch);
}

// Bring the tensor map's 128 bytes into the constant cache ahead of the first copy.
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Registers per thread of the executing warpgroup (all its warps execute it): the
// producer gives registers back, the consumers take them.
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS)); }

// Named barrier `id` (1-15; 0 is __syncthreads) among `threads` threads: sync waits for
// all of them, arrive counts this thread and goes on.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
