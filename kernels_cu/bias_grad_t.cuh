// bias_grad_t.cuh -- dbias added from dS^T's fragments (rows: keys), the Hopper dK/dV
// kernel's tile (flash_bwd_wgmma.cu), without the dbias kernel's second recomputation of dS.
//
// A warp holds dS^T of 16 keys x BM queries in fp32, the m16n8 accumulator layout: n8 tile n,
// element i is key g + 8 (i / 2), query 8n + 2t + (i % 2) (g = lane / 4, t = lane % 4). The
// accumulator is laid out key-major, [key][query] (DBIAS_KEY_MAJOR, cuflash/_dispatch/masking.py: rows
// of a pitch that is a multiple of 8 floats, whole 32-byte sectors), where a thread's pairs of
// queries are adjacent: lanes t and t ^ 1 swap one pair each, and every lane adds four
// consecutive queries of one key with one vector reduction (red.global.add.v4.f32, 16-byte
// aligned; a warp's instruction covers 16 keys x 8 queries, one whole sector per key). The host
// transposes the sum back into the bias's shape (the copy into the bias dtype it makes anyway).
//
// The same accumulator element is added to by every (batch, head) the bias broadcasts along,
// from different CTAs: reductions at L2, in no fixed order (deterministic=True keeps the
// portable dbias kernel). Each addend is the fp32 dS that dK takes, before its 16-bit packing:
// the portable dbias kernel's addends (prob_and_dscore).
//
// A bias with one query row ((B, 1, 1, Lk) key padding) sums dS over queries: each thread keeps
// the running sums of its two keys over the steps of one (batch, head) in registers, and a quad
// of lanes adds them once per head (DbiasRowSums).
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "atomics.cuh"

// The word a lane sends to its partner t ^ 1 and the four it then adds: an even t keeps key g,
// queries 2t, 2t + 1 and takes 2t + 2, 2t + 3 from its partner; an odd t keeps key g + 8,
// queries 2t, 2t + 1 and takes 2t - 2, 2t - 1. frag: elements 0-3 of one n8 tile.
struct QueryQuad {
    float v[4];

    __device__ __forceinline__ static QueryQuad of(const float (&frag)[4], int lane) {
        const bool odd = lane & 1;
        const float send0 = odd ? frag[0] : frag[2], send1 = odd ? frag[1] : frag[3];
        const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1);
        const float got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
        QueryQuad q;
        q.v[0] = odd ? got0 : frag[0];
        q.v[1] = odd ? got1 : frag[1];
        q.v[2] = odd ? frag[2] : got0;
        q.v[3] = odd ? frag[3] : got1;
        return q;
    }
    // The quad's key within the warp's 16 and its first query within the n8 tile.
    __device__ __forceinline__ static int key(int lane) { return lane / 4 + 8 * (lane & 1); }
    __device__ __forceinline__ static int query(int lane) { return 4 * ((lane % 4) / 2); }
};

// One step of a warp: where its quads go (the row of its key, at the step's first query) and
// how many queries are real. Rows past lk and quads past lq are dropped; queries past lq inside
// a quad carry dS = 0 (P = 0 there: load_row_stats) and land in the row's padding.
struct DbiasKeyMajorStep {
    float* row;        // &acc[batch, head][key][m0 + QueryQuad::query]; null: the key is past lk
    int queries_left;  // lq - m0 - QueryQuad::query: quad n is kept while 8n < queries_left

    __device__ __forceinline__ static DbiasKeyMajorStep of(const DbiasParams& g, int batch, int head, int m0, int lq,
                                                           int key, int lk, int lane) {
        const int q0 = m0 + QueryQuad::query(lane);
        float* at = key < lk ? const_cast<float*>(g.acc.at<float>(batch, head, q0, key)) : nullptr;
        return {at, lq - q0};
    }
    // dS^T's n8 tile n (elements 0-3 of this thread) into the accumulator. All 32 lanes call it.
    __device__ __forceinline__ void add(const float (&frag)[4], int n, int lane) const {
        const QueryQuad q = QueryQuad::of(frag, lane);
        if (row != nullptr && 8 * n < queries_left) red_add4(row + 8 * n, q.v[0], q.v[1], q.v[2], q.v[3]);
    }
};

// A one-row bias: this thread's sums of dS over the queries of the steps formed so far, for its
// keys g (sum[0]) and g + 8 (sum[1]), all of one (batch, head).
struct DbiasRowSums {
    float sum[2];

    __device__ __forceinline__ void zero() { sum[0] = sum[1] = 0.0f; }
    // dS^T's n8 tile n: two queries of each key.
    __device__ __forceinline__ void add(const float (&frag)[4]) {
        sum[0] += frag[0] + frag[1];
        sum[1] += frag[2] + frag[3];
    }
    // The four lanes of a key row sum their parts (all 32 lanes call it); lane t = 0 adds the
    // row's total for keys key0 + g and key0 + g + 8 (those below lk) into dbias[batch, head, key].
    __device__ __forceinline__ void flush(const DbiasParams& g, int batch, int head, int key0, int lk, int lane) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
            const int key = key0 + lane / 4 + 8 * r;
            if (lane % 4 == 0 && key < lk) atomicAdd(const_cast<float*>(g.acc.at<float>(batch, head, 0, key)), sum[r]);
        }
        zero();
    }
};
