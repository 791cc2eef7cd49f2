// warp_gemm_f64.cuh -- warp-level GEMMs on the fp64 tensor cores (mma.m8n8k4, fp64 in and out).
//
// A warp's result is M x N C fragments of 8 x 8 (mma.cuh's m8n8k4 layout: lane
// (g, t) = (lane / 4, lane % 4) holds row g, columns 2t and 2t + 1): M row tiles
// of 8 by N column tiles of 8, acc[m][n][0..1].
//   warp_gemm_nt_f64: acc += A B^T   A: 8M x K rows in smem, B: 8N x K rows in smem   (S = Q K^T)
//   warp_gemm_rn_f64: acc += P B     P: 8M x K C fragments in registers,
//                                    B: K x 8N rows in smem                          (O += P V)
// Operands are plain 8-byte shared loads (ldmatrix moves 16-bit data). Each B
// fragment feeds M MMAs and, in the nt form, each A fragment N: a warp-wide
// 8-byte load is 256 bytes, 2 clocks of the SM's 128 bytes a clock, about what
// one m8n8k4 costs the SM on the H100 (~2.3 clocks; benchmarks/dmma_rate.py), so a
// loop with fewer than ~1 MMA per load is bound by shared memory.
//
// Bank conflicts. Shared memory has 32 banks of 4 bytes: 16 "pairs" of 8 bytes.
// A warp's 8-byte load is served as two half-warps (lanes 0-15: g = 0..3;
// 16-31: g = 4..7), each in one pass when its 16 doubles lie in 16 different
// pairs, i.e. their element offsets differ mod 16. With a row pitch P (doubles):
//   nt  lane reads row g, column k0 + t:      offset g P + t           -> P = 4 (mod 8)
//       (g P mod 16 = 0, 4, 8, 12 for g = 0..3, plus t = 0..3: all 16 pairs)
//   rn  lane reads row k0 + 2t + s, column g: offset (2t + s) P + g    -> P = 2 (mod 4)
//       (2t P mod 16 = 0, 4, 8, 12 for t = 0..3, plus g = 0..3)
// Over the whole warp each pair is then hit exactly twice: two passes, the least
// that 256 bytes take. The two conditions exclude each other, so K (nt) and V
// (rn) tiles need different pitches (fwd_dmma: head + 4 and head + 2).
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "swizzle_f64.cuh"

template <int M, int N>
__device__ __forceinline__ void zero_frags(double (&acc)[M][N][2]) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int n = 0; n < N; ++n) acc[m][n][0] = acc[m][n][1] = 0.0;
}

// acc[m][n] += A_m B_n^T over depth K: A_m = rows [8m, 8m + 8) of `a` (pitch PA),
// B_n = rows [8n, 8n + 8) of `b` (pitch PB), both row-major [row][k].
// WIDE_K (sm_90+): 0 issues m8n8k4; 4, 8 or 16 issues m16n8kWIDE_K on each pair of
// 8-row tiles (2m, 2m + 1), WIDE_K / 4 k4 steps at once (mma_16x8_f64): the same
// fragments and loads, half the tensor-core time per flop on the H100.
template <int M, int N, int K, int PA, int PB, int WIDE_K = 0>
__device__ __forceinline__ void warp_gemm_nt_f64(double (&acc)[M][N][2], const double* a, const double* b, int lane) {
    static_assert(K % 4 == 0, "k4 steps");
    static_assert(PA % 8 == 4 && PB % 8 == 4, "conflict-free pitches (see the header)");
    const double* a_lane = a + (lane / 4) * PA + lane % 4;   // A[g][t]
    const double* b_lane = b + (lane / 4) * PB + lane % 4;   // B^T[n = g][k = t]
    if constexpr (WIDE_K == 0) {
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += 4) {
            double af[M], bf[N];
#pragma unroll
            for (int m = 0; m < M; ++m) af[m] = a_lane[8 * m * PA + k0];
#pragma unroll
            for (int n = 0; n < N; ++n) bf[n] = b_lane[8 * n * PB + k0];
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int n = 0; n < N; ++n) mma_884_f64(acc[m][n], af[m], bf[n]);
        }
    } else {
        constexpr int K4 = WIDE_K / 4;   // k4 steps per MMA
        static_assert(M % 2 == 0 && K % WIDE_K == 0, "pairs of 8-row tiles, whole MMA depths");
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += WIDE_K) {
            double af[M][K4], bf[N][K4];
#pragma unroll
            for (int j = 0; j < K4; ++j) {
#pragma unroll
                for (int m = 0; m < M; ++m) af[m][j] = a_lane[8 * m * PA + k0 + 4 * j];
#pragma unroll
                for (int n = 0; n < N; ++n) bf[n][j] = b_lane[8 * n * PB + k0 + 4 * j];
            }
#pragma unroll
            for (int m = 0; m < M; m += 2)
#pragma unroll
                for (int n = 0; n < N; ++n) mma_16x8_f64<K4>(acc[m][n], acc[m + 1][n], af[m], af[m + 1], bf[n]);
        }
    }
}

// acc[m][n] += P_m B for every pair of 8-row tiles (m, m + 1) over the K4 permuted k4 steps
// q0.. (step q: key tile q / 2, permuted step q % 2, warp_gemm_rn_f64's order), one
// m16n8k(4 K4) each; bf holds the lane's B fragment of those steps for column tile n.
template <int K4, int M, int N, int KT>
__device__ __forceinline__ void mma_p_pairs_f64(double (&acc)[M][N][2], const double (&p)[M][KT][2], int n, int q0,
                                                const double (&bf)[K4]) {
#pragma unroll
    for (int m = 0; m < M; m += 2) {
        double top[K4], bot[K4];
#pragma unroll
        for (int j = 0; j < K4; ++j) {
            top[j] = p[m][(q0 + j) / 2][(q0 + j) % 2];
            bot[j] = p[m + 1][(q0 + j) / 2][(q0 + j) % 2];
        }
        mma_16x8_f64<K4>(acc[m][n], acc[m + 1][n], top, bot, bf);
    }
}

// acc[m][n] += P_m B_n over the 8 KT keys: P_m the C fragments p[m][0..KT) (row g,
// keys 8kt + 2t, 8kt + 2t + 1), B row-major [key][column] (pitch PB).
// An A fragment needs key t of a k4 step, but a C fragment holds keys 2t and
// 2t + 1. Rather than move P between lanes, each 8-key tile is two k4 steps over
// permuted keys: step s takes a0 = P[g][8kt + 2t + s] and b0 = B[8kt + 2t + s][g].
// A and B agree on the order, and a dot product's terms may come in any order.
// WIDE_K as in warp_gemm_nt_f64: one m16n8kWIDE_K takes WIDE_K / 4 consecutive permuted
// k4 steps (step q = 2 kt + s) of a pair of 8-row tiles.
template <int M, int N, int KT, int PB, int WIDE_K = 0>
__device__ __forceinline__ void warp_gemm_rn_f64(double (&acc)[M][N][2], const double (&p)[M][KT][2], const double* b,
                                                 int lane) {
    static_assert(PB % 4 == 2, "conflict-free pitch (see the header)");
    const double* b_lane = b + 2 * (lane % 4) * PB + lane / 4;   // B[2t][g]
    if constexpr (WIDE_K == 0) {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int n = 0; n < N; ++n) {
                    const double bf = b_lane[(8 * kt + s) * PB + 8 * n];
#pragma unroll
                    for (int m = 0; m < M; ++m) mma_884_f64(acc[m][n], p[m][kt][s], bf);
                }
    } else {
        constexpr int K4 = WIDE_K / 4;
        static_assert(M % 2 == 0 && (2 * KT) % K4 == 0, "pairs of 8-row tiles, whole MMA depths");
#pragma unroll
        for (int q0 = 0; q0 < 2 * KT; q0 += K4)
#pragma unroll
            for (int n = 0; n < N; ++n) {
                double bf[K4];
#pragma unroll
                for (int j = 0; j < K4; ++j) {
                    const int q = q0 + j;   // key tile q / 2, permuted step q % 2
                    bf[j] = b_lane[(8 * (q / 2) + q % 2) * PB + 8 * n];
                }
                mma_p_pairs_f64<K4>(acc, p, n, q0, bf);
            }
    }
}

// Two neighbouring doubles of shared memory in one 16-byte load (addr 16-byte aligned).
__device__ __forceinline__ void lds_f64x2(double& lo, double& hi, unsigned addr) {
    asm volatile("ld.shared.v2.f64 {%0, %1}, [%2];" : "=d"(lo), "=d"(hi) : "r"(addr));
}

// s = s * scale + bias * log2(e) on one row tile's N C fragments; the bias is an
// 8 x 8N tile of doubles, row-major in shared memory with pitch P. A lane's two
// elements of a fragment are neighbours (row g, columns 2t, 2t + 1): one 16-byte
// load. 16-byte loads are served by quarter-warps (g = 2q, 2q + 1; t = 0..3), in one
// pass when the 8 chunks (g P / 2 + t) differ mod 8: P = 8 (mod 16).
template <int N, int P>
__device__ __forceinline__ void scale_add_bias_frags_f64(double (&s)[N][2], const double* tile, int lane,
                                                         double scale) {
    static_assert(P % 16 == 8, "16-byte aligned, conflict-free bias rows");
    const unsigned addr = smem_addr(tile + (lane / 4) * P + 2 * (lane % 4));
#pragma unroll
    for (int n = 0; n < N; ++n) {
        double b0, b1;
        lds_f64x2(b0, b1, addr + 8 * n * int(sizeof(double)));
        s[n][0] = s[n][0] * scale + b0 * LOG2E;
        s[n][1] = s[n][1] * scale + b1 * LOG2E;
    }
}

// Row and column (within the 8 x 8N tile) of element i of C fragment n.
__device__ __forceinline__ int frag_row_f64(int lane) { return lane / 4; }
__device__ __forceinline__ int frag_col_f64(int lane, int n, int i) { return 8 * n + 2 * (lane % 4) + i; }

// ---------------------------------------------------------------------------
// The same GEMMs on swizzled tiles (swizzle_f64.cuh: unpadded rows of C doubles,
// element (r, c) at r C + (c ^ swz_xor(r))), which the fp64 backward reads both
// ways. Every tile pointer passed here is row 0 of an 8-row group of its tile
// (so a fragment row 8m + g has swz_xor(g)). A column c = 16 a + b (b < 16)
// maps to 16 a + (b ^ x): the b ^ x part takes few values per lane, and the
// compiler keeps them (the loops are unrolled, their 16 a part is a constant).
__device__ __forceinline__ int swz_col(int col, int x) { return (col & ~15) + ((col & 15) ^ x); }

// acc[m][n] += A_m B_n^T over depth K, A_m = rows [8m, 8m + 8) of `a` (CA columns),
// B_n = rows [8n, 8n + 8) of `b` (CB columns): lanes read (row g, column k0 + t).
// WIDE_K in these three as in warp_gemm_nt_f64 (pairs of 8-row tiles on m16n8kWIDE_K).
template <int M, int N, int K, int CA, int CB, int WIDE_K = 0>
__device__ __forceinline__ void warp_gemm_nt_swz(double (&acc)[M][N][2], const double* a, const double* b, int lane) {
    static_assert(K % 4 == 0, "k4 steps");
    const int g = lane / 4, t = lane % 4, x = swz_xor(g);
    const double* a_lane = a + g * CA + t;
    const double* b_lane = b + g * CB + t;
    if constexpr (WIDE_K == 0) {
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += 4) {
            const int col = swz_col(k0, x);   // (k0 + t) ^ x = (k0 ^ x) + t: x is a multiple of 4
            double af[M], bf[N];
#pragma unroll
            for (int m = 0; m < M; ++m) af[m] = a_lane[8 * m * CA + col];
#pragma unroll
            for (int n = 0; n < N; ++n) bf[n] = b_lane[8 * n * CB + col];
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int n = 0; n < N; ++n) mma_884_f64(acc[m][n], af[m], bf[n]);
        }
    } else {
        constexpr int K4 = WIDE_K / 4;
        static_assert(M % 2 == 0 && K % WIDE_K == 0, "pairs of 8-row tiles, whole MMA depths");
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += WIDE_K) {
            double af[M][K4], bf[N][K4];
#pragma unroll
            for (int j = 0; j < K4; ++j) {
                const int col = swz_col(k0 + 4 * j, x);
#pragma unroll
                for (int m = 0; m < M; ++m) af[m][j] = a_lane[8 * m * CA + col];
#pragma unroll
                for (int n = 0; n < N; ++n) bf[n][j] = b_lane[8 * n * CB + col];
            }
#pragma unroll
            for (int m = 0; m < M; m += 2)
#pragma unroll
                for (int n = 0; n < N; ++n) mma_16x8_f64<K4>(acc[m][n], acc[m + 1][n], af[m], af[m + 1], bf[n]);
        }
    }
}

// Two GEMMs of warp_gemm_nt_swz's shape in one k loop: acc1 += A1 B1^T and acc2 += A2 B2^T, so that a warp
// has twice the independent MMA chains in flight (the fp64 dK/dV kernel's S^T = K Q^T and dP^T = V dO^T, each
// of only 2 chains a warp at 16 keys x 16 queries). Each product sums in warp_gemm_nt_swz's order.
template <int M, int N, int K, int CA, int CB, int WIDE_K>
__device__ __forceinline__ void warp_gemm_nt_swz_x2(double (&acc1)[M][N][2], const double* a1, const double* b1,
                                                    double (&acc2)[M][N][2], const double* a2, const double* b2,
                                                    int lane) {
    if constexpr (WIDE_K == 0) {
        warp_gemm_nt_swz<M, N, K, CA, CB>(acc1, a1, b1, lane);
        warp_gemm_nt_swz<M, N, K, CA, CB>(acc2, a2, b2, lane);
    } else {
        constexpr int K4 = WIDE_K / 4;
        static_assert(M % 2 == 0 && K % WIDE_K == 0, "pairs of 8-row tiles, whole MMA depths");
        const int g = lane / 4, t = lane % 4, x = swz_xor(g);
        const int a_at = g * CA + t, b_at = g * CB + t;
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += WIDE_K) {
            double af1[M][K4], bf1[N][K4], af2[M][K4], bf2[N][K4];
#pragma unroll
            for (int j = 0; j < K4; ++j) {
                const int col = swz_col(k0 + 4 * j, x);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    af1[m][j] = a1[a_at + 8 * m * CA + col];
                    af2[m][j] = a2[a_at + 8 * m * CA + col];
                }
#pragma unroll
                for (int n = 0; n < N; ++n) {
                    bf1[n][j] = b1[b_at + 8 * n * CB + col];
                    bf2[n][j] = b2[b_at + 8 * n * CB + col];
                }
            }
#pragma unroll
            for (int m = 0; m < M; m += 2)
#pragma unroll
                for (int n = 0; n < N; ++n) {
                    mma_16x8_f64<K4>(acc1[m][n], acc1[m + 1][n], af1[m], af1[m + 1], bf1[n]);
                    mma_16x8_f64<K4>(acc2[m][n], acc2[m + 1][n], af2[m], af2[m + 1], bf2[n]);
                }
        }
    }
}

// acc[m][n] += P_m B_n with P in C fragments (warp_gemm_rn_f64's permuted keys:
// step s of key tile kt takes key 8kt + 2t + s) and B a swizzled [key][column]
// tile of CB columns: lanes read (row 8kt + 2t + s, column 8n + g).
template <int M, int N, int KT, int CB, int WIDE_K = 0>
__device__ __forceinline__ void warp_gemm_rn_swz(double (&acc)[M][N][2], const double (&p)[M][KT][2], const double* b,
                                                 int lane) {
    const int g = lane / 4, t = lane % 4;
    if constexpr (WIDE_K == 0) {
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const int x = swz_xor(2 * t + s);
            const double* b_lane = b + (2 * t + s) * CB;
#pragma unroll
            for (int kt = 0; kt < KT; ++kt)
#pragma unroll
                for (int n = 0; n < N; ++n) {
                    const double bf = b_lane[8 * kt * CB + swz_col(8 * n + g, x)];
#pragma unroll
                    for (int m = 0; m < M; ++m) mma_884_f64(acc[m][n], p[m][kt][s], bf);
                }
        }
    } else {
        constexpr int K4 = WIDE_K / 4;
        static_assert(M % 2 == 0 && (2 * KT) % K4 == 0, "pairs of 8-row tiles, whole MMA depths");
        const int x[2] = {swz_xor(2 * t), swz_xor(2 * t + 1)};
        const double* b_lane[2] = {b + 2 * t * CB, b + (2 * t + 1) * CB};
#pragma unroll
        for (int q0 = 0; q0 < 2 * KT; q0 += K4)   // permuted k4 step q = 2 kt + s
#pragma unroll
            for (int n = 0; n < N; ++n) {
                double bf[K4];
#pragma unroll
                for (int j = 0; j < K4; ++j) {
                    const int kt = (q0 + j) / 2, s = (q0 + j) % 2;
                    bf[j] = b_lane[s][8 * kt * CB + swz_col(8 * n + g, x[s])];
                }
                mma_p_pairs_f64<K4>(acc, p, n, q0, bf);
            }
    }
}

// acc[m][n] += A_m B over depth K, both swizzled: A_m = rows [8m, 8m + 8) of `a`
// (CA columns), B = rows [0, K) of `b` (CB columns), columns 8 (n_first + n) + ..
// (n_first: the caller's first column tile). Lanes read A at (row g, column k0 + t)
// and B at (row k0 + t, column 8 (n_first + n) + g).
template <int M, int N, int K, int CA, int CB, int WIDE_K = 0>
__device__ __forceinline__ void warp_gemm_nn_swz(double (&acc)[M][N][2], const double* a, const double* b, int n_first,
                                                 int lane) {
    static_assert(K % 4 == 0, "k4 steps");
    const int g = lane / 4, t = lane % 4, xa = swz_xor(g);
    const double* a_lane = a + g * CA + t;
    const double* b_lane = b + t * CB;
    if constexpr (WIDE_K == 0) {
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += 4) {
            const int xb = swz_xor(k0 + t);   // two values: k0 = 0 or 4 (mod 8)
            double af[M], bf[N];
#pragma unroll
            for (int m = 0; m < M; ++m) af[m] = a_lane[8 * m * CA + swz_col(k0, xa)];
#pragma unroll
            for (int n = 0; n < N; ++n) bf[n] = b_lane[k0 * CB + swz_col(8 * (n_first + n) + g, xb)];
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int n = 0; n < N; ++n) mma_884_f64(acc[m][n], af[m], bf[n]);
        }
    } else {
        constexpr int K4 = WIDE_K / 4;
        static_assert(M % 2 == 0 && K % WIDE_K == 0, "pairs of 8-row tiles, whole MMA depths");
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += WIDE_K) {
            double af[M][K4], bf[N][K4];
#pragma unroll
            for (int j = 0; j < K4; ++j) {
                const int k = k0 + 4 * j, xb = swz_xor(k + t);
#pragma unroll
                for (int m = 0; m < M; ++m) af[m][j] = a_lane[8 * m * CA + swz_col(k, xa)];
#pragma unroll
                for (int n = 0; n < N; ++n) bf[n][j] = b_lane[k * CB + swz_col(8 * (n_first + n) + g, xb)];
            }
#pragma unroll
            for (int m = 0; m < M; m += 2)
#pragma unroll
                for (int n = 0; n < N; ++n) mma_16x8_f64<K4>(acc[m][n], acc[m + 1][n], af[m], af[m + 1], bf[n]);
        }
    }
}

// s = s * scale + bias * log2(e) on S^T fragments (rows: 8 keys, columns: 8N
// queries) from a [query][key] bias tile of pitch P: element (key g, query
// 8n + 2t + i) reads tile[(8n + 2t + i) P + g], which a half-warp takes in one
// pass when 2P = 4 (mod 8), i.e. P = 2 (mod 4) (warp_gemm_f64.cuh's rn pattern).
template <int N, int P>
__device__ __forceinline__ void scale_add_bias_frags_f64_t(double (&s)[N][2], const double* tile, int lane,
                                                           double scale) {
    static_assert(P % 4 == 2, "conflict-free transposed reads");
    const double* at = tile + 2 * (lane % 4) * P + lane / 4;
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i) s[n][i] = s[n][i] * scale + at[(8 * n + i) * P] * LOG2E;
}
