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
