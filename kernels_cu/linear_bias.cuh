// linear_bias.cuh -- a score bias linear in the key-query distance, added by the tensor cores
// (the Hopper forward and dK/dV kernels, 16-bit).
//
// ALiBi (cuflash.mods.alibi: -slope_h |q - kv| in log2 units) under a band that shows no query a key after
// it (causal aligned so that kv <= q wherever visible) is c_h (kv - q) with c_h the slope in log2 units;
// the plain kernels hold raw dot products and fold scale_log2 into the exponential, so they add
// c (kv - q) with c = c_h / scale_log2 to S. For rows r and columns j of an N-column tile that is a rank-2
// matrix, which one more k16 step of the tile's S = Q K^T adds with no work an element:
//     A (registers, a row):        [a_hi, a_mid, a_lo, c_hi, c_mid, c_lo, t_hi, t_mid | t_lo, 0 ... 0]
//     B (shared memory, column j): [1, 1, 1, u, u, u, 1, 1 | 1, 0 ... 0]     u = j - N / 2
// a row's value a plus c u plus a tile's shift t (the same for every row, zero where unused). a, c and t are
// each the sum of three bfloat16 parts (the fp32 value to ~2^-24), products with 1 and with integers
// |u| <= 128 are exact, and the tensor core sums them into S in fp32. It aligns a step's products to the
// largest before it adds them, so the bias carries an error of about 2^-24 of its largest term where c (kv - q)
// formed in fp32 would carry 2^-24 of its own size: centred columns (u) and rows taken from the warp's first
// keep the terms at c N / 2 on the tiles by the diagonal (2^-17 x slope in natural units at N = 128); farther
// out, a (and t) grow with the distance, as the bias does. The step is bfloat16 for float16 inputs too (an
// accumulator takes products of either type): fp32's range for a, c and t, which float16 parts would
// overflow past 65504.
//   Forward (rows: queries r, columns: keys n0 + j): c (kv - q) = c (n0 + N / 2 - w0) + a + c u with
//     a = -c (r - w0) the warp's (w0 its first row; formed once a block). At head dim 64 the tile's
//     c (n0 + N / 2 - w0), in log2 units, is an offset the online softmax adds to its max and exponent
//     (warp_softmax_step: two adds a row a tile); past 64 it is the shift t (flash_fwd_wgmma.cu, LIN_TILE_A).
//   dK/dV (S^T: rows keys kv, columns queries m0 + j of a step): a = c (kv - m0 - N / 2) and the slope
//     parts those of -c, formed a step (the step's query head's slope).
// The B table depends on neither head nor tile: it is written once a CTA, N rows of 16 columns K-major
// without swizzle (core matrices of 8 rows x 16 bytes: the k halves 128 bytes apart, 8-row groups 256 bytes
// apart).
// The host compiles this in (CUF_LINEAR_BIAS, with cuf_linear_slope from the call's prelude: cuflash/mods.py,
// Mods.linear_prelude) in place of the modification's per-element code, where the band allows it
// (cuflash/_dispatch/plan.py).
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

#ifndef CUF_LINEAR_BIAS
#define CUF_LINEAR_BIAS 0
#endif
constexpr bool LINEAR_BIAS = CUF_LINEAR_BIAS;

// Shared-memory bytes of the B table for N columns (0 when the bias is not compiled in).
template <int N>
struct LinearBiasTable {
    static constexpr int BYTES = LINEAR_BIAS ? N * 32 : 0;
    static_assert(N % 8 == 0 && N <= 256, "8-row core matrices; centred column indices exact in bfloat16");

    // Write the table (generic pointer `table`, 16-byte aligned), THREADS threads from `thread`: one
    // 16-byte chunk (a core-matrix row: 8 columns k of one n) each.
    template <int THREADS>
    __device__ __forceinline__ static void write(unsigned char* table, int thread) {
        for (int chunk = thread; chunk < 2 * N; chunk += THREADS) {
            const int group = chunk / 16, half = (chunk / 8) % 2, n = 8 * group + chunk % 8;
            const float u = float(n - N / 2);
            uint4 v = make_uint4(0, 0, 0, 0);
            if (half == 0) {   // k 0..7: 1, 1, 1, u, u, u, 1, 1
                v.x = pack2<bf16_t>(1.0f, 1.0f);
                v.y = pack2<bf16_t>(1.0f, u);
                v.z = pack2<bf16_t>(u, u);
                v.w = pack2<bf16_t>(1.0f, 1.0f);
            } else {           // k 8..15: 1, 0 ... 0
                v.x = pack2<bf16_t>(1.0f, 0.0f);
            }
            *reinterpret_cast<uint4*>(table + 256 * group + 128 * half + 16 * (n % 8)) = v;
        }
    }

    // The descriptor of the table as a K-major B operand: no swizzle, LBO 128 (k halves), SBO 256 (8-row
    // groups).
    __device__ __forceinline__ static uint64 desc(unsigned table_addr) {
        return (uint64)((table_addr & 0x3ffffu) >> 4) | ((uint64)(128 >> 4) << 16) | ((uint64)(256 >> 4) << 32);
    }

    // D (64 x N) = A B + (accumulate ? D : 0): the step, bfloat16 whatever the inputs' type.
    __device__ __forceinline__ static void add(float (&d)[N / 2], const unsigned (&a)[4], unsigned table_addr,
                                               bool accumulate = true) {
        wgmma_rs_k<bf16_t, N>(d, a, desc(table_addr), accumulate);
    }
};

// x rounded to bfloat16, as fp32 (the rounding cvt and a shift back).
__device__ __forceinline__ float round_to_bf16(float x) { return to_float(from_acc<bf16_t>(x)); }

// x as the sum of three bfloat16 values, largest first (x to ~2^-24 of itself).
struct Bf16Parts {
    float hi, mid, lo;
    __device__ __forceinline__ static Bf16Parts of(float x) {
        const float hi = round_to_bf16(x), rest = x - hi, mid = round_to_bf16(rest);
        return {hi, mid, rest - mid};
    }
};

// The A fragment of the extra k16 step. Lane t = lane % 4 holds k columns 2t, 2t + 1 of rows g and g + 8
// (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]): frag gives t = 0 a row's (a_hi, a_mid), t = 1 (a_lo, c_hi),
// t = 2 (c_mid, c_lo), and zeros elsewhere, which with_shift fills with a tile's shift.
struct LinearBiasSlope {
    float c_hi;         // the slope's first part, t = 1's high half
    unsigned c_rest;    // (c_mid, c_lo) packed: t = 2's word

    // c: the slope in A (raw-score units a column).
    __device__ __forceinline__ static LinearBiasSlope of(float c) {
        const Bf16Parts parts = Bf16Parts::of(c);
        return {parts.hi, pack2<bf16_t>(parts.mid, parts.lo)};
    }

    // The word of lane t for a row whose value is a (raw-score units).
    __device__ __forceinline__ unsigned word(float a, int t) const {
        const Bf16Parts parts = Bf16Parts::of(a);
        const unsigned first = pack2<bf16_t>(t == 0 ? parts.hi : parts.lo, t == 0 ? parts.mid : c_hi);
        return t < 2 ? first : t == 2 ? c_rest : 0u;
    }

    // The fragment `block` (frag's) with the tile's shift t (raw-score units; the same for every row) in k columns
    // 6, 7 and 8 (the table's third 1, 1, 1): t's parts (t_hi, t_mid) in a[0], a[1] of the lanes with t = 3 and
    // (t_lo, 0) in a[2], a[3] of those with t = 0, where frag leaves zeros.
    __device__ __forceinline__ static void with_shift(unsigned (&a)[4], const unsigned (&block)[4], float shift,
                                                      int lane) {
        const int t = lane % 4;
        const Bf16Parts parts = Bf16Parts::of(shift);
        const unsigned high = pack2<bf16_t>(parts.hi, parts.mid), low = pack2<bf16_t>(parts.lo, 0.0f);
        a[0] = t == 3 ? high : block[0];
        a[1] = t == 3 ? high : block[1];
        a[2] = t == 0 ? low : 0u;
        a[3] = a[2];
    }

    // This lane's A fragment for rows whose values are a0 (row g) and a1 (row g + 8).
    __device__ __forceinline__ void frag(unsigned (&a)[4], float a0, float a1, int lane) const {
        const int t = lane % 4;
        a[0] = word(a0, t);
        a[1] = word(a1, t);
        a[2] = 0u;
        a[3] = 0u;
    }
};

#if !CUF_LINEAR_BIAS
// Without the call's prelude: never called (every use is behind LINEAR_BIAS).
template <typename A>
__device__ __forceinline__ A cuf_linear_slope(int, const unsigned long long*) { return A(0); }
#endif
