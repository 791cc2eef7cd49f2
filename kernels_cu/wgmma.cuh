// wgmma.cuh -- Hopper warpgroup MMA (sm_90a): shared-memory matrix descriptors,
// the wgmma.mma_async wrappers and their ordering fences.
//
// A warpgroup (4 consecutive warps, the first one's index a multiple of 4) issues
// one wgmma for a 64 x N x 16 product: D (64 x N, fp32, in registers) += A (64 x 16)
// B (16 x N). B always comes from shared memory through a descriptor; A either from
// shared memory (a descriptor) or from registers.
//
// Register layouts (PTX ISA, "wgmma register fragments"), warp w of the warpgroup
// owning rows 16w..16w+15, g = lane / 4, t = lane % 4:
//   D (64 x N, fp32):  d[4n + 0..1] = (row g,     cols 8n + 2t + {0,1})
//                      d[4n + 2..3] = (row g + 8, the same cols)
//     -- per warp, exactly the m16n8 C fragments of mma.cuh, N / 8 of them.
//   A (64 x 16, 16-bit, registers): a[0] = (row g, k 2t..2t+1), a[1] = (row g + 8, same k),
//                      a[2], a[3] = the same rows at k + 8
//     -- the m16n8k16 A fragment, so P = softmax(S) packs from D in registers
//        (pack_a_frag in warp_gemm.cuh) with no shared memory.
//
// Shared-memory tiles are 128-byte swizzled (swizzle mode 1): a tile is stored as
// atoms of 8 rows x 128 bytes (1024 bytes, 1024-byte aligned); in row r of an atom
// the 16-byte chunk c sits at chunk position c ^ (r % 8), so the 8 rows of any
// 16-byte column land in 8 different bank groups (the bulk tensor copy engine writes it:
// CU_TENSOR_MAP_SWIZZLE_128B, cuflash/_runtime/tma.py).
// A row of HEAD 16-bit elements spans HEAD / 64 atoms side by side; the tile keeps
// each 64-column slab contiguous: slab a at a * ROWS * 128 bytes.
//   K-major operand (Q as A, K as B of S = Q K^T; k = head dim, contiguous):
//     SBO = 1024 (8-row groups), LBO unused (a k16 step is 32 bytes, inside one
//     128-byte row); the k16 step kk starts at slab kk / 4, byte (kk % 4) * 32.
//   MN-major operand (V as B of O = P V, read transposed; n = head dim contiguous,
//   k = keys): SBO = 1024 (8-key groups), LBO = ROWS * 128 (the next 64-column
//   slab along n); the k16 step kk starts 16 keys = 2048 bytes further.
// The hardware applies the XOR on address bits, which is why atoms must be
// 1024-byte aligned and why a k step inside an atom is a plain byte offset.
#pragma once
#include "common.cuh"

typedef unsigned long long uint64;

// A 64-bit wgmma shared-memory matrix descriptor: start address >> 4 (bits 0-13),
// leading-dimension byte offset >> 4 (bits 16-29), stride-dimension byte offset
// >> 4 (bits 32-45), base offset 0 (atoms are 1024-byte aligned), swizzle mode
// in bits 62-63 (1: 128-byte swizzle).
__device__ __forceinline__ uint64 sw128_desc(unsigned smem_byte_addr, unsigned lbo_bytes, unsigned sbo_bytes) {
    return (uint64)((smem_byte_addr & 0x3ffffu) >> 4)
           | ((uint64)((lbo_bytes & 0x3ffffu) >> 4) << 16)
           | ((uint64)((sbo_bytes & 0x3ffffu) >> 4) << 32)
           | (1ull << 62);
}

// The first 1024-byte boundary at or after a shared-memory address: where a kernel's swizzled
// tiles start (its dynamic shared memory carries 1024 bytes of slack for this).
__device__ __forceinline__ unsigned align_1024(unsigned smem_byte_addr) {
    return smem_byte_addr + ((1024u - (smem_byte_addr & 1023u)) & 1023u);
}

// The k16 step kk of a K-major swizzled operand whose 64-column slabs are
// slab_bytes apart: slab kk / 4, 32 bytes per step inside it. Q as A and K as B of
// S = Q K^T; K / V as A of the backward's S^T / dP^T; P^T / dS^T (rows: keys, k:
// queries) as A of head dim 256's dV += P^T dO, dK += dS^T Q.
__device__ __forceinline__ uint64 k_major_desc(unsigned tile, int kk, int slab_bytes) {
    return sw128_desc(tile + (kk / 4) * slab_bytes + (kk % 4) * 32, 16, 1024);
}
// The k16 step kk (16 rows along k) of an MN-major swizzled tile of `rows` rows: V as B
// of O = P V (rows: keys, n: head dim), dO / Q as B of dV += P^T dO, dK += dS^T Q (rows:
// queries), dS^T as A and K as B of dQ = dS K (rows: keys; m: queries, n: head dim).
__device__ __forceinline__ uint64 mn_major_desc(unsigned tile, int kk, int rows) {
    return sw128_desc(tile + kk * 16 * 128, rows * 128, 1024);
}

// The byte offset of 16-bit element (row, col) of a 128-byte swizzled tile whose 64-column
// slabs are slab_bytes apart (the layout above, which the copy engine reads and writes).
// A warp storing 32-bit pairs of the m16n8 C layout (rows g, columns 2t of one n8 tile) hits
// 8 chunks x 4 lanes: 32 distinct banks.
__device__ __forceinline__ int sw128_offset(int row, int col, int slab_bytes) {
    return (col / 64) * slab_bytes + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
}

// Zero rows [from, ROWS) of every 64-column slab of a ROWS-row swizzled tile (`tile`: its generic
// pointer), THREADS threads from `thread`: a slab's row is one 128-byte line whatever the swizzle.
// (Packed sequences: rows of a tile the copy engine loaded past a sequence's end hold the next
// sequence's, which no product may read: 0 x inf is NaN.) The writer fences and syncs before a wgmma reads.
template <int ROWS, int SLABS, int THREADS>
__device__ __forceinline__ void zero_tile_rows(unsigned char* tile, int from, int thread) {
    constexpr int CHUNKS = 128 / 16;   // 16-byte chunks a line
#pragma unroll 1
    for (int i = thread; i < SLABS * ROWS * CHUNKS; i += THREADS)
        if ((i / CHUNKS) % ROWS >= from) *reinterpret_cast<int4*>(tile + 16 * i) = make_int4(0, 0, 0, 0);
}

// A fragment array seen as the flat accumulator list a wgmma wrapper takes.
template <int A, int B, int C>
__device__ __forceinline__ float (&flat(float (&x)[A][B][C]))[A * B * C] {
    return reinterpret_cast<float(&)[A * B * C]>(x);
}
template <int B, int C>
__device__ __forceinline__ float (&flat(float (&x)[B][C]))[B * C] {
    return reinterpret_cast<float(&)[B * C]>(x);
}

// Order this thread's ordinary (and cp.async, once waited for) shared-memory
// writes before later reads by the async proxy (wgmma operands); a barrier
// after it then publishes them to the other threads' wgmmas.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Before the first wgmma of a batch: orders the warpgroup's earlier register
// writes (accumulators rescaled by ordinary instructions, A fragments) before
// the asynchronous reads.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

// The compiler does not know that a wgmma in flight writes its accumulators; this
// empty asm pins each register's value at the point of the call, so no ordinary
// instruction on them is moved across a commit / wait.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

__device__ __forceinline__ void fence_regs(unsigned (&a)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(a[k]) :: "memory");
}

template <int R>
__device__ __forceinline__ void fence_regs(unsigned (&a)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(a[i][k]) :: "memory");
}

// Operand lists: the accumulators as "+f" constraints, 8 at a time.
#define CUF_ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                       "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define CUF_ACC32(d) CUF_ACC8(d, 0), CUF_ACC8(d, 8), CUF_ACC8(d, 16), CUF_ACC8(d, 24)
#define CUF_ACC64(d) CUF_ACC32(d), CUF_ACC8(d, 32), CUF_ACC8(d, 40), CUF_ACC8(d, 48), CUF_ACC8(d, 56)
#define CUF_ACC128_HI(d) CUF_ACC8(d, 64), CUF_ACC8(d, 72), CUF_ACC8(d, 80), CUF_ACC8(d, 88), CUF_ACC8(d, 96),   \
                         CUF_ACC8(d, 104), CUF_ACC8(d, 112), CUF_ACC8(d, 120)
#define CUF_ACC128(d) CUF_ACC64(d), CUF_ACC128_HI(d)
#define CUF_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
                   "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUF_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
                   "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
                   "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
                   "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define CUF_REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "   \
                    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "   \
                    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "   \
                    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "   \
                    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "   \
                    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "   \
                    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "   \
                    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"   \
                    "}"

// D (64 x N) = A B + (accumulate ? D : 0), both operands from shared memory, both
// K-major (no transpose): S = Q K^T.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64 desc_a, uint64 desc_b, int accumulate);
// D (64 x N) = A B + (accumulate ? D : 0), both operands from shared memory, both
// MN-major (read transposed): the backward's dQ = dS K, with dS^T stored key-major.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[N / 2], uint64 desc_a, uint64 desc_b, int accumulate);
// D (64 x N) = A B + (accumulate ? D : 0), A K-major and B MN-major from shared memory:
// head dim 256's dV += P^T dO and dK += dS^T Q, with P^T / dS^T stored key-major by another
// warpgroup (flash_bwd_wgmma.cu, SPLIT_HEAD).
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_bmn(float (&d)[N / 2], uint64 desc_a, uint64 desc_b, int accumulate);
// D (64 x N) += A B with A from registers (the m16n8k16 A fragment of this warp's
// 16 rows) and B MN-major from shared memory (read transposed): O += P V.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], uint64 desc_b);
// D (64 x N) = A B + (accumulate ? D : 0) with A from registers and B K-major (not transposed): the linear
// bias's table (linear_bias.cuh).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_k(float (&d)[N / 2], const unsigned (&a)[4], uint64 desc_b, int accumulate);

// One specialisation per (type, N); the operand numbers follow the accumulators
// (N / 2 of them): A_OPS / B_OP / SCALE_OP name them. TNSP: the transpose bits of A
// and B ("0, 0": both K-major; "1, 1": both MN-major; "0, 1": B MN-major).
#define CUF_WGMMA_SS_(NAME, TNSP, TYPE, PTX_TYPE, N, REGS, ACC, A_OP, B_OP, SCALE_OP)                        \
    template <>                                                                                              \
    __device__ __forceinline__ void NAME<TYPE, N>(float (&d)[N / 2], uint64 desc_a, uint64 desc_b,           \
                                                  int accumulate) {                                          \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_OP ", 0;\n"                                  \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " " REGS ", "   \
                     A_OP ", " B_OP ", p, 1, 1, " TNSP ";\n}\n"                                              \
                     : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                  \
    }
#define CUF_WGMMA_SS(...) CUF_WGMMA_SS_(wgmma_ss, "0, 0", __VA_ARGS__)
#define CUF_WGMMA_SS_MN(...) CUF_WGMMA_SS_(wgmma_ss_mn, "1, 1", __VA_ARGS__)
#define CUF_WGMMA_SS_BMN(...) CUF_WGMMA_SS_(wgmma_ss_bmn, "0, 1", __VA_ARGS__)
#define CUF_WGMMA_RS(TYPE, PTX_TYPE, N, REGS, ACC, A_OPS, B_OP, SCALE_OP)                                    \
    template <>                                                                                              \
    __device__ __forceinline__ void wgmma_rs<TYPE, N>(float (&d)[N / 2], const unsigned (&a)[4],           \
                                                      uint64 desc_b) {                                       \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_OP ", 0;\n"                                  \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " " REGS ", "   \
                     A_OPS ", " B_OP ", p, 1, 1, 1;\n}\n"                                                    \
                     : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));          \
    }
#define CUF_WGMMA_RS_K(TYPE, PTX_TYPE, N, REGS, ACC, A_OPS, B_OP, SCALE_OP)                                  \
    template <>                                                                                              \
    __device__ __forceinline__ void wgmma_rs_k<TYPE, N>(float (&d)[N / 2], const unsigned (&a)[4],         \
                                                        uint64 desc_b, int accumulate) {                     \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_OP ", 0;\n"                                  \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " " REGS ", "   \
                     A_OPS ", " B_OP ", p, 1, 1, 0;\n}\n"                                                    \
                     : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)); \
    }
CUF_WGMMA_SS(half_t, "f16", 64, CUF_REGS32, CUF_ACC32, "%32", "%33", "%34")
CUF_WGMMA_SS(bf16_t, "bf16", 64, CUF_REGS32, CUF_ACC32, "%32", "%33", "%34")
CUF_WGMMA_SS(half_t, "f16", 128, CUF_REGS64, CUF_ACC64, "%64", "%65", "%66")
CUF_WGMMA_SS(bf16_t, "bf16", 128, CUF_REGS64, CUF_ACC64, "%64", "%65", "%66")
CUF_WGMMA_SS_MN(half_t, "f16", 64, CUF_REGS32, CUF_ACC32, "%32", "%33", "%34")
CUF_WGMMA_SS_MN(bf16_t, "bf16", 64, CUF_REGS32, CUF_ACC32, "%32", "%33", "%34")
// Head dim 256's dV and dK: 128 of the 256 columns a consumer warpgroup.
CUF_WGMMA_SS_BMN(half_t, "f16", 128, CUF_REGS64, CUF_ACC64, "%64", "%65", "%66")
CUF_WGMMA_SS_BMN(bf16_t, "bf16", 128, CUF_REGS64, CUF_ACC64, "%64", "%65", "%66")
CUF_WGMMA_RS(half_t, "f16", 64, CUF_REGS32, CUF_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
CUF_WGMMA_RS(bf16_t, "bf16", 64, CUF_REGS32, CUF_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
CUF_WGMMA_RS(half_t, "f16", 128, CUF_REGS64, CUF_ACC64, "{%64, %65, %66, %67}", "%68", "%69")
CUF_WGMMA_RS(bf16_t, "bf16", 128, CUF_REGS64, CUF_ACC64, "{%64, %65, %66, %67}", "%68", "%69")
// Head dim 256's O += P V: 128 accumulators a thread.
CUF_WGMMA_RS(half_t, "f16", 256, CUF_REGS128, CUF_ACC128, "{%128, %129, %130, %131}", "%132", "%133")
CUF_WGMMA_RS(bf16_t, "bf16", 256, CUF_REGS128, CUF_ACC128, "{%128, %129, %130, %131}", "%132", "%133")
CUF_WGMMA_RS_K(bf16_t, "bf16", 64, CUF_REGS32, CUF_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
CUF_WGMMA_RS_K(bf16_t, "bf16", 128, CUF_REGS64, CUF_ACC64, "{%64, %65, %66, %67}", "%68", "%69")
