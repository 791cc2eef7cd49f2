// mask_mod_states.cu -- the block states (BlockState, params.cuh) of a call's mask modifications
// (cuflash.mods; compiled with their source before this file's, user_mod.cuh): which (query block, key
// block) pairs the attention kernels skip (OFF: no element allowed), test per element (SOME) or take
// whole (ALL). Computed once per modification, shape and parameters, and cached by the host.
//
// One CTA a (batch, head, query block, key block), its elements evaluated by its threads in turn;
// elements past the sequence ends count as neither (the kernels never read them as visible).
#include "common.cuh"
#include "params.cuh"
#include "user_mod.cuh"

__global__ void __launch_bounds__(256) mask_mod_states(const __grid_constant__ MaskStatesParams p) {
    const long long cta = p.first + blockIdx.x;
    const int kb = int(cta % p.k_blocks), qb = int(cta / p.k_blocks % p.q_blocks);
    const int h = int(cta / p.k_blocks / p.q_blocks % p.heads), b = int(cta / p.k_blocks / p.q_blocks / p.heads);
    const int q0 = qb * p.block_q, k0 = kb * p.block_k;
    const int rows = imin(p.block_q, p.lq - q0), cols = imin(p.block_k, p.lk - k0);
    bool any = false, all = true;
    for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
        const bool allowed = user_mask_allows(b, h, q0 + e / cols, k0 + e % cols, p.args);
        any |= allowed;
        all &= allowed;
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0) p.states[cta] = any ? (all ? BLOCK_ALL : BLOCK_SOME) : BLOCK_OFF;
}
