// tf32_operands.cuh -- the TF32 operands of the Hopper float32 forward (flash_fwd_wgmma_tf32.cu) in
// shared memory: a tile's big and small parts, and V's transposed copy.
//
// Tiles are fp32 in the 128-byte swizzled layout of wgmma.cuh, as the copy engine writes them:
// 32-column slabs, row r of a slab at r * 128 bytes, its 16-byte chunk c (columns 4c..4c+3) at
// chunk position c ^ (r % 8).
//   Parts (split_rows_in_place): elementwise, so any order of 16-byte chunks will do; big
//       overwrites the tile, small goes to the same offset of a second tile. Plain TF32 (SPLIT 0)
//       rounds in place (round_tf32: NaN stays NaN) and writes no small part.
//   V^T (transpose_v_tile): wgmma takes TF32 operands K-major only, and O += P V contracts over
//       keys, so B = V must be stored [column][key]. Its key order is permuted within each group of
//       8 keys, position j holding key pi(j): pi(j) = 2j for j < 4, 2(j - 4) + 1 for j >= 4 (keys
//       0 2 4 6 1 3 5 7), the order in which P's C fragments are already A fragments in registers
//       (flash_fwd_wgmma_tf32.cu, p_parts); a contraction's order of terms is free. Row n of V^T
//       (V's column n) is HEAD rows x BN positions: slabs of 32 positions, slab a at
//       a * HEAD * 128, position p of row n in chunk p / 4 at chunk position (p / 4) ^ (n % 8).
// Banks: transpose_v_tile's lane is the column n = 32 sl + lane: its 4-byte reads of one raw row k
// are chunk (lane / 4) ^ (k % 8), word lane % 4: 32 distinct banks; its 16-byte writes of rows
// n (8 consecutive lanes a phase: 8 distinct n % 8) hit 8 distinct chunk positions. The linear
// 16-byte accesses of split_rows_in_place are conflict-free (tests/test_fragments_wgmma_tf32.py).
#pragma once
#include "common.cuh"
#include "warp_gemm_tf32.cuh"

__device__ __forceinline__ float lds_f32(unsigned addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
    return x;
}
__device__ __forceinline__ void lds_f32x4(unsigned addr, float (&x)[4]) {
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void sts_f32x4(unsigned addr, const float (&x)[4]) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3]) : "memory");
}

// The operand parts of four values: SPLIT: big and small (split_tf32, warp_gemm_tf32.cuh); plain:
// big = a rounded to TF32 (small unset).
template <int SPLIT>
__device__ __forceinline__ void tf32_parts4(const float (&a)[4], float (&big)[4], float (&small)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (SPLIT) {
            unsigned b, s;
            split_tf32<SPLIT>(a[e], b, s);
            big[e] = __uint_as_float(b);
            small[e] = __uint_as_float(s);
        } else {
            big[e] = round_tf32(a[e]);
        }
    }
}

// ROWS rows of every one of SLABS slabs (slab s at tile + s * SLAB_BYTES) split in place: big over
// the tile, small at the same offsets from `small_tile` (SPLIT), by THREADS threads (`thread` this
// one's index among them). The caller fences (fence_proxy_async_smem) and publishes.
template <int SPLIT, int ROWS, int SLABS, int SLAB_BYTES, int THREADS>
__device__ __forceinline__ void split_rows_in_place(unsigned tile, unsigned small_tile, int thread) {
    constexpr int CHUNKS = ROWS * 128 / 16;   // 16-byte chunks of one slab's rows
    static_assert(CHUNKS * SLABS % THREADS == 0, "whole rounds of 16-byte chunks");
    // Two rounds at a time: fully unrolled, ptxas hoists every round's loads and spills 4 bytes of
    // the producer's 40 registers (plain TF32 with the band, offline).
#pragma unroll 2
    for (int i = 0; i < CHUNKS * SLABS / THREADS; ++i) {
        const int c = thread + i * THREADS;
        const unsigned at = (c / CHUNKS) * SLAB_BYTES + (c % CHUNKS) * 16;
        float a[4], big[4], small[4];
        lds_f32x4(tile + at, a);
        tf32_parts4<SPLIT>(a, big, small);
        sts_f32x4(tile + at, big);
        if (SPLIT) sts_f32x4(small_tile + at, small);
    }
}

// The byte offset of position `pos` (0..BN-1, in the permuted key order) of V^T row n.
template <int HEAD>
__device__ __forceinline__ int vt_offset(int n, int pos) {
    return (pos / 32) * HEAD * 128 + n * 128 + ((((pos % 32) / 4) ^ (n % 8)) * 16) + (pos % 4) * 4;
}

// V^T's parts (the header) from the raw V tile (BN keys x HEAD columns, as the copy engine wrote
// it) by WARPS warps. Work item (slab sl, key group g8, parity par): lane = column n - 32 sl reads
// keys 8 g8 + par + 2i (i = 0..3) of its column and writes them as positions 8 g8 + 4 par + i of
// row n: one 16-byte store a part.
template <int SPLIT, int BN, int HEAD, int WARPS>
__device__ __forceinline__ void transpose_v_tile(unsigned raw, unsigned vt_big, unsigned vt_small, int warp,
                                                 int lane) {
    constexpr int GROUPS = BN / 8, ITEMS = (HEAD / 32) * GROUPS * 2;
    static_assert(BN % 32 == 0 && HEAD % 32 == 0 && ITEMS % WARPS == 0, "whole slabs, whole rounds of items");
    // Rolled: unrolled, ptxas hoists every item's loads and spills the producer's 40 registers.
#pragma unroll 1
    for (int r = 0; r < ITEMS / WARPS; ++r) {
        const int item = warp + r * WARPS;
        const int par = item % 2, g8 = (item / 2) % GROUPS, sl = item / (2 * GROUPS);
        const int n = 32 * sl + lane;
        float a[4], big[4], small[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int k = 8 * g8 + par + 2 * i;
            a[i] = lds_f32(raw + sl * BN * 128 + k * 128 + (((lane / 4) ^ (k % 8)) * 16) + (lane % 4) * 4);
        }
        tf32_parts4<SPLIT>(a, big, small);
        const int at = vt_offset<HEAD>(n, 8 * g8 + 4 * par);
        sts_f32x4(vt_big + at, big);
        if (SPLIT) sts_f32x4(vt_small + at, small);
    }
}
