// atomics.cuh -- fp32 additions into a global accumulator that other CTAs share
// (dQ with atomic accumulation in the tensor-core dK/dV kernel; dbias in the Hopper one).
//
// On sm_90 a vector reduction (red.global.add.v2.f32) adds two adjacent entries
// as one L2 operation: the atomic dQ otherwise spends its L2 bandwidth on one
// operation per fp32 entry (fp16/bf16 forward+backward 1.15-1.31x faster with
// it, H100). Older GPUs add entry by entry. The address must be 8-byte aligned (red_add4:
// four entries, 16-byte aligned).
#pragma once
#include "common.cuh"

__device__ __forceinline__ void red_add2(float* at, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(at), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(at, a);
    atomicAdd(at + 1, b);
#endif
}

// No "memory" clobber: no thread of the kernel reads what it adds (dbias), so the compiler may move
// other loads across it (the next fragment's shared-memory statistics).
__device__ __forceinline__ void red_add4(float* at, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(at), "f"(a), "f"(b), "f"(c), "f"(d));
#else
    red_add2(at, a, b);
    red_add2(at + 2, c, d);
#endif
}

// The fragment-tiled dQ accumulator of the 16-bit tensor-core dK/dV kernel (flash_bwd_mma.cu) and
// flash_bwd_convert_dq: one (batch, head)'s rows x COLS fp32 values as 16 x 8 tiles of 128 values,
// tile (r / 16, c / 8) at (r / 16) 16 COLS + (c / 8) 128, each in the order of an mma C fragment:
// lane l's c0, c1 (row l / 4, columns 2 (l % 4) + 0, 1) and c2, c3 (8 rows down) at 4 l .. 4 l + 3.
// So a warp adds a fragment in one 16-byte reduction a lane, 512 contiguous bytes, where the row-major
// layout took 8-byte reductions into 8 rows (FlashAttention-2 keeps its dQ accumulator in fragment
// order too). A row view of the accumulator has row_stride COLS. It holds dS K without the softmax
// scale, which flash_bwd_convert_dq applies. dq_tile(row0, col0): the offset of the
// tile whose first row and column these are (row0 a multiple of 16, col0 of 8) from row 0's tile.
template <int COLS>
__device__ __forceinline__ constexpr int dq_tile(int row0, int col0) {
    static_assert(COLS % 8 == 0, "whole tiles a row");
    return row0 * COLS + col0 * 16;
}
