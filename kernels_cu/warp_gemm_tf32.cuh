// warp_gemm_tf32.cuh -- warp-level GEMMs on float32 data with the TF32 tensor cores
// (mma.sync m16n8k8, fp32 accumulate), in one of three arithmetics (SPLIT, compile time;
// the kernels' SPLIT template parameter is one of the TF32_* kinds below):
//   TF32_PLAIN (precision="tf32"): one MMA a product; operands carry 11 significant bits.
//   TF32X3_ROUNDED (precision="highest", "3xTF32"): each operand a = big + small with
//       big = a rounded to 11 significant bits and small = (a - big) rounded likewise, and
//       a b ~ big_a big_b + big_a small_b + small_a big_b; the dropped small_a small_b and
//       the rounding of small are each below 2^-22 |a b|, about float32's own rounding.
//   TF32X3_FAST (3xTF32, a cheaper split; a tuning candidate, benchmarks/tune_f32.py): big
//       rounded by its bits (two integer instructions) and small = a - big (exact) left
//       unrounded: the tensor core truncates it. small has at most 12 significant bits, so
//       the bit dropped leaves at most 2^-23 |a|, the rounded split's worst case too (its one
//       dropped bit is then a tie); CUTLASS's fast-f32 GEMMs also truncate small. 3
//       instructions an element instead of 7: the split of K, V and P per fragment is most
//       of the forward's issue slots (the 3xTF32 kernels are issue-bound, not
//       tensor-bound).
//
// Fresh fragments. The tensor core adds an MMA's products and its C input with truncation,
// not rounding: an accumulator carried through every k-step loses up to an ulp per MMA, in
// one direction (on an H100 a 3xTF32 product accumulated so has an error that grows with the
// head dim; tests/test_fragments_tf32.py). So in SPLIT each k-step's three MMAs go into a zeroed
// fragment (small products first, then big_a big_b), which is then added to the accumulator
// with ordinary round-to-nearest FADDs. Plain TF32 (an error of ~2^-11 an operand) chains.
//
// Where operands are split. Q is split once per CTA in shared memory (split_tile: big in
// place, small beside it), since every warp reads its strips again for every key tile. K, V
// and P are split in registers as their fragments are loaded, each element once per warp that
// reads it: a shared copy would double the bytes each fragment load moves, and shared-memory
// bandwidth, not the split's few FP32 instructions, is the scarcer resource next to the MMAs.
// In plain TF32, Q and P are rounded (once each) and K and V go in as they are: the tensor
// core then truncates them (2^-10 rather than 2^-11 an element), which saves the rounding of
// every fragment in every warp.
//
// Fragment loads (fp32 data; mma.cuh's m16n8k8 layouts; tiles row-major with pitch P floats):
//   A of S = Q K^T: ldmatrix.x4 of four 8 x (4 floats) blocks: 16 bytes a row are 4 floats, and
//       ldmatrix gives lane (g, t) the 32-bit word t of row g: (row g, k t), a0..a3 in order.
//   B of S = Q K^T (K stored [key][d]): the same, b0 / b1 of two n8 tiles a load.
//   A of O += P V: P's C fragments as they are, read in a permuted key order: A's k index t
//       stands for key 2t and t + 4 for key 2t + 1 (a0..a3 = c0, c2, c1, c3), which the B
//       fragment then follows: b0 = V[2t][g], b1 = V[2t + 1][g], two 4-byte loads (a 32-bit
//       transpose has no ldmatrix). A contraction's order of terms is free.
// Banks: ldmatrix rows 16 bytes apart mod 128 (P = 4 mod 32 with P = HEAD + 4) and the V
// loads' words 8t + g and 8t + 4 + g (2t P = 8t mod 32) are conflict-free with one pitch.
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "warp_gemm.cuh"

// a rounded to nearest at 11 significant bits (TF32's precision), in fp32 bits. Veltkamp's
// split, c = a (2^13 + 1), big = c - (c - a): three FP32 instructions, which keep NaN a NaN
// (cvt.rna.tf32.f32 is four, two of them on the slower integer pipe; adding half a TF32 ulp
// to the bits and masking is two, but turns the NaN 0x7fffffff into -0). The .rn forms stop
// ptxas from fusing c - a into an FMA (which would make it exact and the split empty).
// Finite for |a| < 2^114 (c overflows beyond; no attention input of that size has a finite
// score either).
__device__ __forceinline__ float round_tf32(float a) {
    float c, d, big;
    asm("mul.rn.f32 %0, %1, 0f46000400;" : "=f"(c) : "f"(a));   // 8193 = 2^13 + 1 (0x46000400)
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(c), "f"(a));
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(big) : "f"(c), "f"(d));
    return big;
}

// The arithmetic kinds (values of the kernels' int SPLIT; any nonzero kind is a 3xTF32 split).
// TF32X3_PARTS (the Hopper wgmma forward, flash_fwd_wgmma_tf32.cu): big as FAST's, small = a - big
// with its low 13 bits cleared, so that both parts are exact TF32 values (split_tf32 below).
constexpr int TF32_PLAIN = 0, TF32X3_ROUNDED = 1, TF32X3_FAST = 2, TF32X3_PARTS = 3;

// a rounded to nearest (ties away from zero) at 11 significant bits by its bits: half a TF32
// ulp added to the magnitude, the low 13 bits cleared. Two integer instructions. A NaN may
// become -0 or 0 here, but the caller's small = a - big is then NaN, so NaN still reaches the
// products; +-inf gives big = +-inf and small = NaN (inf - inf); finite values within half a
// TF32 ulp of FLT_MAX (|bits| >= 0x7f7ff000) give big = +-inf and small = -+inf: the products'
// sum is NaN either way (tests/test_fragments_tf32.py), as the rounded split's is from 2^114.
__device__ __forceinline__ unsigned round_tf32_bits(float a) {
    return (__float_as_uint(a) + 0x1000u) & 0xffffe000u;
}

// a = big + small: big with 11 significant bits; small with 11 (ROUNDED: rounded, exact as
// a - big before its rounding; PARTS: a - big truncated by its bits) or up to 12 (FAST: a - big
// exactly, which the tensor core truncates to 11).
// PARTS gives the tensor core nothing to round or truncate (both parts have their low 13 bits
// zero), so its result does not depend on which of the two the hardware does; the cost is one
// LOP3 over FAST. Its error bound is FAST's: big is a rounded to 11 bits, so for a in [2^e,
// 2^(e+1)) a - big is a multiple of 2^(e-23) below 2^(e-11) in magnitude: at most 12
// significant bits (13 only when it is the power of two 2^(e-11), which clearing keeps), of
// which the cleared low bit is below 2^(e-23) <= 2^-23 |a|. NaN survives: a NaN's big may
// wrap to +-0, but small = a - big is then a NaN whose cleared form (0x7fffe000 for the
// canonical 0x7fffffff) is still a NaN; +-inf gives big = +-inf and small = NaN, as FAST
// (tests/test_fragments_wgmma_tf32.py).
template <int SPLIT = TF32X3_ROUNDED>
__device__ __forceinline__ void split_tf32(float a, unsigned& big, unsigned& small) {
    if (SPLIT == TF32X3_FAST || SPLIT == TF32X3_PARTS) {
        big = round_tf32_bits(a);
        small = __float_as_uint(a - __uint_as_float(big));
        if (SPLIT == TF32X3_PARTS) small &= 0xffffe000u;
        return;
    }
    const float b = round_tf32(a);
    big = __float_as_uint(b);
    small = __float_as_uint(round_tf32(a - b));
}

// A fragment (4 registers) or B fragment pair, raw fp32 bits -> the operands of one precision:
// SPLIT: big and small; plain: `big` is the raw value itself (the tensor core truncates it).
template <int SPLIT, int R>
__device__ __forceinline__ void split_frag(const unsigned (&raw)[R], unsigned (&big)[R], unsigned (&small)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
        if (SPLIT) split_tf32<SPLIT>(__uint_as_float(raw[i]), big[i], small[i]);
        else big[i] = raw[i];
    }
}

struct alignas(16) Float4 { float v[4]; };   // one 16-byte shared access

// Every element of a ROWS x COLS tile (pitch P floats) in shared memory, by THREADS threads:
// SPLIT: big in place and small into `small` (same layout); plain: rounded in place. The
// caller synchronises before and after.
template <int SPLIT, int ROWS, int COLS, int P, int THREADS>
__device__ __forceinline__ void split_tile(float* tile, float* small) {
    static_assert(COLS % 4 == 0 && P % 4 == 0, "16-byte groups");
#pragma unroll 2
    for (int i = threadIdx.x; i < ROWS * COLS / 4; i += THREADS) {
        const int at = (i / (COLS / 4)) * P + (i % (COLS / 4)) * 4;
        const Float4 a = *reinterpret_cast<const Float4*>(tile + at);
        Float4 big, lo;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (SPLIT == TF32X3_FAST) {
                unsigned b, l;
                split_tf32<TF32X3_FAST>(a.v[e], b, l);
                big.v[e] = __uint_as_float(b);
                lo.v[e] = __uint_as_float(l);
                continue;
            }
            big.v[e] = round_tf32(a.v[e]);
            lo.v[e] = round_tf32(a.v[e] - big.v[e]);
        }
        *reinterpret_cast<Float4*>(tile + at) = big;
        if (SPLIT) *reinterpret_cast<Float4*>(small + at) = lo;
    }
}

// acc[m][t0], acc[m][t0 + 1] += A_m B_h (h = 0, 1: the two n8 tiles) for one k8 step of M
// strips: in SPLIT from the split operands through fresh fragments (the header), else one
// chained MMA each. The 2M fresh fragments' chains interleave (each MMA of a step waits on
// the previous one of its chain only), so the tensor pipe sees 2M independent MMAs a step.
template <int SPLIT, int M, int NT>
__device__ __forceinline__ void mma_step_tf32(float (&acc)[M][NT][4], int t0, const unsigned (&a_big)[M][4],
                                              const unsigned (&a_small)[M][4], const unsigned (&b_big)[2][2],
                                              const unsigned (&b_small)[2][2]) {
    if (!SPLIT) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) mma_1688_tf32(acc[m][t0 + h], a_big[m], b_big[h][0], b_big[h][1]);
        return;
    }
    float fresh[M][2][4];
#pragma unroll
    for (int m = 0; m < M; ++m) zero_frags(fresh[m]);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma_1688_tf32(fresh[m][h], a_small[m], b_big[h][0], b_big[h][1]);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma_1688_tf32(fresh[m][h], a_big[m], b_small[h][0], b_small[h][1]);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma_1688_tf32(fresh[m][h], a_big[m], b_big[h][0], b_big[h][1]);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][t0 + h][i] += fresh[m][h][i];
}

// The lane's ldmatrix row address for A fragments of 16-row strips (the strip's first row):
// matrix i = lane / 8 is rows 8 (i % 2).., floats 4 (i / 2)..
template <int P>
__device__ __forceinline__ unsigned a_lane_addr_tf32(const float* strip, int lane) {
    return smem_addr(strip + (lane % 16) * P + (lane / 16) * 4);
}
// ... and for B^T stored [n][k] (K): matrix i is keys 8 (i / 2).., floats 4 (i % 2)..
template <int P>
__device__ __forceinline__ unsigned bt_lane_addr_tf32(const float* rows, int lane) {
    return smem_addr(rows + ((lane / 16) * 8 + lane % 8) * P + ((lane / 8) % 2) * 4);
}

// S (M strips of 16 rows x N keys) += Q K^T over depth K:
//   q_big / q_small: the warp's first strip of Q (split_tile's two tiles; q_small unread
//   unless SPLIT), k: rows [key][d] of K. All pitch P.
template <int SPLIT, int M, int N, int K, int P>
__device__ __forceinline__ void warp_gemm_qk_tf32(float (&s)[M][N / 8][4], const float* q_big, const float* q_small,
                                                  const float* k, int lane) {
    static_assert(N % 16 == 0 && K % 8 == 0, "mma tiles: n8 pairs, k8 steps");
    const unsigned big_addr = a_lane_addr_tf32<P>(q_big, lane);
    const unsigned small_addr = a_lane_addr_tf32<P>(q_small, lane);
    const unsigned k_addr = bt_lane_addr_tf32<P>(k, lane);
    // SPLIT keeps the k-steps a loop: unrolled, ptxas hoists later steps' K fragments and their
    // splits and spills 20-324 bytes in every SPLIT variant (offline compile, sm_90). Where a step
    // has only the two fresh-fragment chains of one strip and one n8 pair (N = 16, M = 1: the dK/dV
    // kernel's 16-query steps), two steps unrolled put four in flight: with one, that kernel's warps
    // wait on MMA latency, one step's fresh fragments being the next step's.
    constexpr int UNROLL = !SPLIT ? K / 8 : (M * N == 16 ? 2 : 1);
#pragma unroll UNROLL
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned a_big[M][4], a_small[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            ldmatrix_x4(a_big[m], big_addr + (m * 16 * P + k0) * 4);
            if (SPLIT) ldmatrix_x4(a_small[m], small_addr + (m * 16 * P + k0) * 4);
        }
#pragma unroll
        for (int n0 = 0; n0 < N; n0 += 16) {
            unsigned raw[4], big[4], small[4];
            ldmatrix_x4(raw, k_addr + (n0 * P + k0) * 4);
            split_frag<SPLIT>(raw, big, small);
            mma_step_tf32<SPLIT>(s, n0 / 8, a_big, a_small, reinterpret_cast<const unsigned (&)[2][2]>(big),
                                 reinterpret_cast<const unsigned (&)[2][2]>(small));
        }
    }
}

// O (M strips of 16 rows x N columns) += P V over K keys: p holds P's C fragments (fp32, the
// softmax's output), v rows [key][column] (pitch P). Plain TF32 rounds P as it reads it.
template <int SPLIT, int M, int N, int K, int P>
__device__ __forceinline__ void warp_gemm_pv_tf32(float (&o)[M][N / 8][4], const float (&p)[M][K / 8][4],
                                                  const float* v, int lane) {
    static_assert(N % 16 == 0 && K % 8 == 0, "mma tiles: n8 pairs, k8 steps");
    const float* v_lane = v + 2 * (lane % 4) * P + lane / 4;   // V[2t][g]
#pragma unroll
    for (int kt = 0; kt < K / 8; ++kt) {
        unsigned a_big[M][4], a_small[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float c[4] = {p[m][kt][0], p[m][kt][2], p[m][kt][1], p[m][kt][3]};   // keys 2t, 2t + 1
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (SPLIT) split_tf32<SPLIT>(c[i], a_big[m][i], a_small[m][i]);
                else a_big[m][i] = __float_as_uint(round_tf32(c[i]));
            }
        }
#pragma unroll
        for (int n0 = 0; n0 < N; n0 += 16) {
            unsigned raw[2][2], big[2][2], small[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                raw[h][0] = __float_as_uint(v_lane[8 * kt * P + n0 + 8 * h]);
                raw[h][1] = __float_as_uint(v_lane[(8 * kt + 1) * P + n0 + 8 * h]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) split_frag<SPLIT>(raw[h], big[h], small[h]);
            mma_step_tf32<SPLIT>(o, n0 / 8, a_big, a_small, big, small);
        }
    }
}

// s = s * scale + bias * log2(e) on one strip's 16 x N C fragments, the bias a 16 x N fp32
// tile in shared memory (pitch P = 8 mod 16 floats: each half-warp's 8-byte loads, rows g,
// columns 8n + 2t, fall in 16 different bank pairs).
template <int N, int P>
__device__ __forceinline__ void scale_add_bias_frags_f32(float (&s)[N / 8][4], const float* tile, int lane,
                                                         float scale) {
    static_assert(P % 16 == 8, "16-byte aligned, conflict-free bias rows");
    const float* at = tile + (lane / 4) * P + 2 * (lane % 4);
    const float log2e = float(LOG2E);
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const FloatPair b = load_pair(at + 8 * r * P + 8 * n);
            s[n][2 * r] = s[n][2 * r] * scale + b[0] * log2e;
            s[n][2 * r + 1] = s[n][2 * r + 1] * scale + b[1] * log2e;
        }
}

// ---------------------------------------------------------------------------
// The backward's further forms (flash_bwd_tf32.cu). Its dK/dV kernel forms S^T = K Q^T and
// dP^T = V dO^T with warp_gemm_qk_tf32 (A: the warp's 16 keys of K or V, split once per CTA;
// B: Q or dO rows, split per fragment) and dV += P^T dO, dK += dS^T Q with warp_gemm_pv_tf32
// (A: P^T's and dS^T's C fragments in the permuted key order, here queries; B: dO or Q rows).
// Two reads are new: the bias seen transposed (S^T's rows are keys) and dQ += dS K with dS
// stored transposed and K already split.

// s = s * scale + bias * log2(e) on one 16-key strip of S^T (16 keys x N queries) from a
// [query][key] fp32 bias tile of pitch P (`tile`: the strip's first key). Element (key g + 8r,
// query 8n + 2t + e) reads tile[(8n + 2t + e) P + g + 8r]: for one (n, r, e) the warp's 32
// 4-byte loads hit banks 2t P + g (mod 32) = 8t + g or 24t + g for P = 4 (mod 8): all 32.
template <int N, int P>
__device__ __forceinline__ void scale_add_bias_frags_f32_t(float (&s)[N / 8][4], const float* tile, int lane,
                                                           float scale) {
    static_assert(P % 8 == 4, "conflict-free transposed reads; 16-byte aligned rows");
    const float* at = tile + 2 * (lane % 4) * P + lane / 4;
    const float log2e = float(LOG2E);
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i)   // C element i: key + 8 (i / 2), query + i % 2
            s[n][i] = s[n][i] * scale + at[(8 * n + i % 2) * P + 8 * (i / 2)] * log2e;
}

// dQ (one 16-query strip x N columns) += dS K over K keys, with
//   dS stored transposed, [key][query] (pitch PA; `ds_t`: the strip's first query column), read
//       in warp_gemm_pv_tf32's permuted key order: A's k index t is key 2t, t + 4 is key 2t + 1,
//       so a0..a3 = dS^T[2t][g], dS^T[2t][g + 8], dS^T[2t + 1][g], dS^T[2t + 1][g + 8]: 4-byte
//       loads on banks 2t PA + g = 8t + g (mod 32) for PA = 4 (mod 16), conflict-free;
//   K already split in shared memory (rows [key][column], pitch PB, `k_big` / `k_small`: the
//       first column of the block; k_small unread unless SPLIT): b0 = K[2t][g], b1 = K[2t + 1][g].
// dS is split (SPLIT) or rounded (plain) as it is read.
template <int SPLIT, int N, int K, int PA, int PB>
__device__ __forceinline__ void warp_gemm_ds_k_tf32(float (&acc)[1][N / 8][4], const float* ds_t, const float* k_big,
                                                    const float* k_small, int lane) {
    static_assert(N % 16 == 0 && K % 8 == 0, "mma tiles: n8 pairs, k8 steps");
    static_assert(PA % 16 == 4, "conflict-free transposed dS loads");
    const int g = lane / 4, t = lane % 4;
    const float* a_lane = ds_t + 2 * t * PA + g;
    // Lane pointers, so that every load below is one base and an immediate offset (indices into
    // k_big / k_small made ptxas form each of a step's eight addresses with two instructions).
    const float* kb_lane = k_big + 2 * t * PB + g;
    const float* ks_lane = k_small + 2 * t * PB + g;
    // SPLIT keeps the key steps a loop, as warp_gemm_qk_tf32 (hoisted loads would outlive the step),
    // two steps at a time where a step has only two MMA chains (N = 16), as there.
    constexpr int UNROLL = !SPLIT ? K / 8 : (N == 16 ? 2 : 1);
#pragma unroll UNROLL
    for (int kt = 0; kt < K / 8; ++kt) {
        const float* a_at = a_lane + 8 * kt * PA;
        const float raw[4] = {a_at[0], a_at[8], a_at[PA], a_at[PA + 8]};
        unsigned a_big[1][4], a_small[1][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (SPLIT) split_tf32<SPLIT>(raw[i], a_big[0][i], a_small[0][i]);
            else a_big[0][i] = __float_as_uint(round_tf32(raw[i]));
        }
#pragma unroll
        for (int n0 = 0; n0 < N; n0 += 16) {
            unsigned big[2][2], small[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const int at = (8 * kt + s) * PB + n0 + 8 * h;
                    big[h][s] = __float_as_uint(kb_lane[at]);
                    small[h][s] = SPLIT ? __float_as_uint(ks_lane[at]) : 0u;
                }
            mma_step_tf32<SPLIT>(acc, n0 / 8, a_big, a_small, big, small);
        }
    }
}

// ---------------------------------------------------------------------------
// Query-minor GEMMs (the float32 decoding kernel's 8-query tile, flash_fwd_decode.cu): the keys are the
// MMA's M side and the block's 8 query rows its N side (n8), so the tensor-core work is padded to 8
// query rows instead of 16, and Q^T stays in registers for the whole key loop.
//   warp_gemm_kq_tf32:  S^T (M tiles of 16 keys x 8 queries) = K Q^T: A = K rows [key][d] (ldmatrix,
//                       pitch P), B = Q^T from registers (b0 = Q[g][k0 + t], b1 = Q[g][k0 + t + 4]).
//   warp_gemm_vtp_tf32: O^T (HEAD / 16 tiles of 16 columns x 8 queries) += V^T P^T: A = V^T read from V's
//                       rows [key][d] (a0 = V[k0 + t][d0 + g], a1 = V[k0 + t][d0 + g + 8], a2 / a3 the same
//                       at key k0 + t + 4; conflict-free with P = 8 mod 32), B = P^T from S^T's C fragments
//                       by shuffles (pt_frag_tf32).
// Both keep the fresh-fragment accumulation of the 3xTF32 products (the header).

// acc += A B for one m16n8k8 step: in SPLIT the three products into a fresh fragment, then added.
template <int SPLIT>
__device__ __forceinline__ void mma3_tf32(float (&acc)[4], const unsigned (&a_big)[4], const unsigned (&a_small)[4],
                                          const unsigned (&b_big)[2], const unsigned (&b_small)[2]) {
    if (!SPLIT) {
        mma_1688_tf32(acc, a_big, b_big[0], b_big[1]);
        return;
    }
    float fresh[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_1688_tf32(fresh, a_small, b_big[0], b_big[1]);
    mma_1688_tf32(fresh, a_big, b_small[0], b_small[1]);
    mma_1688_tf32(fresh, a_big, b_big[0], b_big[1]);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += fresh[i];
}

// Q^T's B fragments of every k8 step of the head from Q's rows (pitch P; split_tile's big and small
// tiles): b0 = Q[g][k0 + t], b1 = Q[g][k0 + t + 4]. Read once, before the key loop.
template <int HEAD, int P>
__device__ __forceinline__ void load_qt_frags_tf32(unsigned (&q_big)[HEAD / 8][2], unsigned (&q_small)[HEAD / 8][2],
                                                   const float* big, const float* small, int lane) {
    const int at = (lane / 4) * P + lane % 4;
#pragma unroll
    for (int ks = 0; ks < HEAD / 8; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            q_big[ks][h] = __float_as_uint(big[at + 8 * ks + 4 * h]);
            q_small[ks][h] = __float_as_uint(small[at + 8 * ks + 4 * h]);
        }
}

template <int SPLIT, int M, int HEAD, int P>
__device__ __forceinline__ void warp_gemm_kq_tf32(float (&st)[M][4], const float* k, const unsigned (&q_big)[HEAD / 8][2],
                                                  const unsigned (&q_small)[HEAD / 8][2], int lane) {
    static_assert(HEAD % 8 == 0, "k8 steps");
    const unsigned k_addr = a_lane_addr_tf32<P>(k, lane);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) st[m][i] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HEAD / 8; ++ks)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            unsigned raw[4], big[4], small[4];
            ldmatrix_x4(raw, k_addr + (m * 16 * P + 8 * ks) * 4);
            split_frag<SPLIT>(raw, big, small);
            mma3_tf32<SPLIT>(st[m], big, small, q_big[ks], q_small[ks]);
        }
}

// P^T's B fragment for keys [8 half, 8 half + 8) of a 16-key tile, from its C fragment p (key g, queries
// 2t and 2t + 1; key g + 8 in p[2], p[3]): lane (g, t) takes P(key 8 half + t + 4h, query g), which lane
// 4 (t + 4h) + g / 2 holds as element g % 2 of its half `half`.
__device__ __forceinline__ void pt_frag_tf32(const float (&p)[4], int half, int lane, float (&b)[2]) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int src = 4 * (t + 4 * h) + g / 2;
        const float even = __shfl_sync(0xffffffffu, p[2 * half], src);
        const float odd = __shfl_sync(0xffffffffu, p[2 * half + 1], src);
        b[h] = (g & 1) ? odd : even;
    }
}

template <int SPLIT, int M, int HEAD, int P>
__device__ __forceinline__ void warp_gemm_vtp_tf32(float (&ot)[HEAD / 16][4], const float (&pt)[M][4], const float* v,
                                                   int lane) {
    static_assert(HEAD % 16 == 0 && P % 32 == 8, "16-column tiles; conflict-free transposed reads");
    const float* v_lane = v + (lane % 4) * P + lane / 4;   // V[t][g]
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float b[2];
            pt_frag_tf32(pt[m], half, lane, b);
            unsigned b_big[2], b_small[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (SPLIT) split_tf32<SPLIT>(b[h], b_big[h], b_small[h]);
                else b_big[h] = __float_as_uint(round_tf32(b[h]));
            }
            const float* rows = v_lane + (16 * m + 8 * half) * P;
#pragma unroll
            for (int md = 0; md < HEAD / 16; ++md) {
                const unsigned raw[4] = {__float_as_uint(rows[16 * md]), __float_as_uint(rows[16 * md + 8]),
                                         __float_as_uint(rows[4 * P + 16 * md]),
                                         __float_as_uint(rows[4 * P + 16 * md + 8])};
                unsigned big[4], small[4];
                split_frag<SPLIT>(raw, big, small);
                mma3_tf32<SPLIT>(ot[md], big, small, b_big, b_small);
            }
        }
}
