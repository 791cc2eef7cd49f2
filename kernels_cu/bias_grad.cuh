// bias_grad.cuh -- dbias: dS summed into the bias's own broadcast shape.
//
// dbias = dS (dL / d(score), natural-log units) summed over every axis the bias
// broadcasts along. The accumulator (DbiasParams::acc, fp32 or fp64) has the
// bias's shape; the kernel addresses it with the element's (batch, head, row,
// col) and stride 0 folds the broadcast axes. The host picks how additions meet:
//   DBIAS_ADD      every accumulator element is only ever touched by one thread
//                  (a full bias, or a broadcast that stays inside one CTA: the
//                  same fragment position is the same thread at every step),
//                  plain read-add-write, deterministic.
//   DBIAS_ATOMIC   CTAs of different (batch, K/V head) share elements: atomics.
//   DBIAS_ORDERED  as ATOMIC but bitwise reproducible (deterministic=True): the
//                  CTAs that share a bias tile take turns in a fixed order, by a
//                  per-tile counter (wait_turn / pass_turn below).
//   DBIAS_KERNEL   (the tensor-core backward) a kernel of its own sums dS in
//                  registers over the broadcast axes, no atomics (flash_bwd_dbias.cu).
//   DBIAS_KEY_MAJOR (the Hopper dK/dV kernel) adds dS^T from its registers into a
//                  key-major accumulator with vector reductions (bias_grad_t.cuh).
// ADD, ATOMIC and ORDERED are the modes of the dK/dV kernels that add dS themselves:
// the FMA kernel (flash_bwd_fma.cu) and the fp64 tensor-core one (flash_bwd_dmma.cu).
// A bias with one query row (key padding biases, (B, 1, 1, Lk)) is first summed
// over the tile's queries in registers, in a fixed order.
#pragma once
#include "common.cuh"
#include "params.cuh"

template <typename A>
__device__ __forceinline__ void dbias_add(const DbiasParams& g, A* at, A value) {
    if (g.mode == DBIAS_ATOMIC) {
        atomicAdd(at, value);
    } else if (g.mode == DBIAS_ORDERED) {
        // volatile: bypass L1, which does not see the other CTAs' writes
        volatile A* v = at;
        *v = *v + value;
    } else {
        *at = *at + value;
    }
}

template <typename A>
__device__ __forceinline__ A* dbias_at(const DbiasParams& g, int batch, int head, int row, int col) {
    return const_cast<A*>(g.acc.at<A>(batch, head, g.rows_broadcast ? 0 : row, col));
}

// DBIAS_ORDERED: the bias tile a (batch, head, query block, key block) step adds
// to, and its rank among all the steps that add to that tile. Ranks follow
// (batch, head, query block) order; a lower rank always belongs to an earlier
// step of the same CTA or to a CTA of lower blockIdx (batch and K/V head vary
// slowest in the grid), which the hardware starts first, so the waits end.
struct DbiasTurn {
    int* counter;
    int rank;

    __device__ __forceinline__ static DbiasTurn of(const DbiasParams& g, const AttnDims& dims, int batch, int head,
                                                   int q_block, int q_blocks, int k_block, int k_blocks) {
        const int b = g.tiles_b == 1 ? 0 : batch, h = g.tiles_h == 1 ? 0 : head, i = g.tiles_i == 1 ? 0 : q_block;
        const int tile = ((b * g.tiles_h + h) * g.tiles_i + i) * k_blocks + k_block;
        const int rb = g.tiles_b == 1 ? batch : 0, rh = g.tiles_h == 1 ? head : 0, ri = g.tiles_i == 1 ? q_block : 0;
        const int nh = g.tiles_h == 1 ? dims.heads_q : 1, ni = g.tiles_i == 1 ? q_blocks : 1;
        return {g.order + tile, (rb * nh + rh) * ni + ri};
    }

    // Every thread of the CTA returns once all lower ranks have added their part.
    __device__ __forceinline__ void wait_turn() const {
        if (threadIdx.x == 0) {
            int seen;
            do {
                asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            } while (seen != rank);
        }
        __syncthreads();
    }

    // After this CTA's additions: let the next rank in.
    __device__ __forceinline__ void pass_turn() const {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(counter), "r"(rank + 1) : "memory");
        }
    }
};
