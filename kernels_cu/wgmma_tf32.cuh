// wgmma_tf32.cuh -- Hopper warpgroup MMA on TF32 operands (sm_90a): the m64nNk8 wrappers and
// warp_gemm_tf32.cuh's 3xTF32 discipline carried over to asynchronous MMAs.
//
// wgmma.mma_async.sync.aligned.m64nNk8.f32.tf32.tf32: one k8 step, D (64 x N, fp32) += A (64 x 8)
// B (8 x N). For .tf32 the PTX ISA allows no transpose immediates: every shared-memory operand is
// K-major (k contiguous). A may come from registers instead: per warp the m16n8k8 TF32 A fragment
// of its 16 rows (CUTLASS ALayout_64x8), g = lane / 4, t = lane % 4:
//     a0 = (row g, k t), a1 = (row g + 8, k t), a2 = (row g, k t + 4), a3 = (row g + 8, k t + 4).
// D is wgmma.cuh's layout: per warp the m16n8 C fragments of mma.cuh, N / 8 of them.
// Shared-memory operands are 128-byte swizzled like the 16-bit ones (wgmma.cuh): a 128-byte row
// segment of an atom holds 32 floats, 4 k8 steps of 32 bytes, so k_major_desc(tile, kk, slab_bytes)
// addresses k8 step kk unchanged (slab kk / 4, byte (kk % 4) * 32; SBO 1024 between 8-row groups).
//
// 3xTF32 (warp_gemm_tf32.cuh): a = big + small for both operands, a b ~ small_a big_b + big_a small_b
// + big_a big_b. Fresh fragments: the tensor core sums with truncation, so a k8 step's three
// products go into a fragment whose first wgmma ignores its old contents (scale-d = 0), and ordinary
// round-to-nearest FADDs add it into the accumulator (the small products first, as there). The FADDs
// need the step's wgmmas complete, so steps are pipelined over two fresh fragments (fresh_steps):
// step s is issued into fresh[s % 2] before the FADDs of step s - 1, and the tensor core works on
// step s while the warps add step s - 1.
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

// D (64 x N) = A B + (accumulate ? D : 0), A and B K-major from shared memory (S = Q K^T).
template <int N>
__device__ __forceinline__ void wgmma_tf32_ss(float (&d)[N / 2], uint64 desc_a, uint64 desc_b, int accumulate);
// D (64 x N) = A B + (accumulate ? D : 0), A from registers (the warp's ALayout_64x8 fragment), B
// K-major from shared memory (O += P V, V stored transposed).
template <int N>
__device__ __forceinline__ void wgmma_tf32_rs(float (&d)[N / 2], const unsigned (&a)[4], uint64 desc_b,
                                              int accumulate);

#define CUF_WGMMA_TF32_SS(N, REGS, ACC, A_OP, B_OP, SCALE_OP)                                                \
    template <>                                                                                              \
    __device__ __forceinline__ void wgmma_tf32_ss<N>(float (&d)[N / 2], uint64 desc_a, uint64 desc_b,        \
                                                     int accumulate) {                                       \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_OP ", 0;\n"                                  \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 " REGS ", " A_OP ", " B_OP     \
                     ", p, 1, 1;\n}\n"                                                                       \
                     : ACC(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                  \
    }
#define CUF_WGMMA_TF32_RS(N, REGS, ACC, A_OPS, B_OP, SCALE_OP)                                               \
    template <>                                                                                              \
    __device__ __forceinline__ void wgmma_tf32_rs<N>(float (&d)[N / 2], const unsigned (&a)[4],              \
                                                     uint64 desc_b, int accumulate) {                        \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_OP ", 0;\n"                                  \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 " REGS ", " A_OPS ", " B_OP    \
                     ", p, 1, 1;\n}\n"                                                                       \
                     : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));   \
    }
#define CUF_ACC16(d) CUF_ACC8(d, 0), CUF_ACC8(d, 8)
#define CUF_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
// S tiles of 32 and 64 keys, O pieces of 64 columns (and 128 for a one-piece head dim 128).
CUF_WGMMA_TF32_SS(32, CUF_REGS16, CUF_ACC16, "%16", "%17", "%18")
CUF_WGMMA_TF32_SS(64, CUF_REGS32, CUF_ACC32, "%32", "%33", "%34")
CUF_WGMMA_TF32_SS(128, CUF_REGS64, CUF_ACC64, "%64", "%65", "%66")
CUF_WGMMA_TF32_RS(32, CUF_REGS16, CUF_ACC16, "{%16, %17, %18, %19}", "%20", "%21")
CUF_WGMMA_TF32_RS(64, CUF_REGS32, CUF_ACC32, "{%32, %33, %34, %35}", "%36", "%37")
CUF_WGMMA_TF32_RS(128, CUF_REGS64, CUF_ACC64, "{%64, %65, %66, %67}", "%68", "%69")

// One k8 step of 3xTF32 into a fresh fragment f (its old contents ignored): f = small_a big_b +
// big_a small_b + big_a big_b. The three wgmmas chain on f in issue order (same shape: no fence
// between them).
template <int N>
__device__ __forceinline__ void wgmma_tf32x3_ss(float (&f)[N / 2], uint64 a_big, uint64 a_small, uint64 b_big,
                                                uint64 b_small) {
    wgmma_tf32_ss<N>(f, a_small, b_big, 0);
    wgmma_tf32_ss<N>(f, a_big, b_small, 1);
    wgmma_tf32_ss<N>(f, a_big, b_big, 1);
}
template <int N>
__device__ __forceinline__ void wgmma_tf32x3_rs(float (&f)[N / 2], const unsigned (&a_big)[4],
                                                const unsigned (&a_small)[4], uint64 b_big, uint64 b_small) {
    wgmma_tf32_rs<N>(f, a_small, b_big, 0);
    wgmma_tf32_rs<N>(f, a_big, b_small, 1);
    wgmma_tf32_rs<N>(f, a_big, b_big, 1);
}

// STEPS fresh-fragment steps, pipelined two deep: issue(s, fresh) issues step s's wgmmas into
// `fresh` (its old contents ignored), add(s, fresh) adds the finished step s into the accumulator
// with ordinary instructions. On return every step has been added and no wgmma of this warpgroup
// is in flight. Invariant at the top of iteration s: steps < s - 1 added, step s - 1 in flight in
// fresh[(s - 1) % 2]; fresh[s % 2] free (its FADDs, of step s - 2, came before the fence).
template <int STEPS, int R, typename Issue, typename Add>
__device__ __forceinline__ void fresh_steps(float (&fresh)[2][R], Issue issue, Add add) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
        wgmma_fence();   // the FADDs' reads of fresh[s % 2] (step s - 2) before the wgmmas overwrite it
        issue(s, fresh[s % 2]);
        wgmma_commit();
        if (s > 0) {
            wgmma_wait<1>();   // step s - 1 done (groups complete in order)
            fence_regs(fresh[(s - 1) % 2]);
            add(s - 1, fresh[(s - 1) % 2]);
        }
    }
    wgmma_wait<0>();
    fence_regs(fresh[(STEPS - 1) % 2]);
    add(STEPS - 1, fresh[(STEPS - 1) % 2]);
}

// acc[i] += f[i], round to nearest.
template <int R>
__device__ __forceinline__ void add_frags(float (&acc)[R], const float (&f)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] += f[i];
}

// Piece `piece` (R accumulators) of a flat accumulator list: the wgmma D operand of one N = 2 R
// column block of a wider result (O's 64-column pieces at head dim 128).
template <int R, int TOTAL>
__device__ __forceinline__ float (&acc_piece(float (&d)[TOTAL], int piece))[R] {
    return *reinterpret_cast<float(*)[R]>(&d[piece * R]);
}
