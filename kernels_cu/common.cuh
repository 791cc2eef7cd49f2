// common.cuh -- element types, conversions, exp2 and warp reductions.
//
// The kernels include no CUDA headers: 16-bit types are plain 16-bit storage and
// every conversion is one PTX instruction. NVRTC then needs no include path, so
// the same source compiles on a machine with only the NVRTC wheel.
#pragma once

typedef long long int64;

// Scores are kept in log2 units (x = s * log2 e) so that each exponential is one
// exp2; lse is stored in natural-log units. These are the only two conversion
// constants in the kernels.
constexpr double LOG2E = 1.4426950408889634074;
constexpr double LN2 = 0.6931471805599453094;

// Storage-only 16-bit float types. The tensor cores read them as raw bits.
struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

// Accumulator type: fp32 for 16-bit and fp32 inputs, fp64 for fp64.
template <typename T> struct AccumOf { typedef float type; };
template <> struct AccumOf<double> { typedef double type; };

__device__ __forceinline__ float to_float(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float(((unsigned)x.bits) << 16);
}
__device__ __forceinline__ float to_float(float x) { return x; }

// Storage -> accumulator type: 16-bit and fp32 values to fp32, fp64 stays fp64.
template <typename T> __device__ __forceinline__ typename AccumOf<T>::type to_acc(T x) { return to_float(x); }
template <> __device__ __forceinline__ double to_acc<double>(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(float x);
template <> __device__ __forceinline__ half_t from_acc<half_t>(float x) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(float x) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T zero_value() { T z; z.bits = 0; return z; }
template <> __device__ __forceinline__ float zero_value<float>() { return 0.0f; }
template <> __device__ __forceinline__ double zero_value<double>() { return 0.0; }

// Two fp32 values -> one register of two 16-bit values, `lo` in the low half
// (the order mma.sync expects for consecutive columns).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<half_t>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ unsigned pack2<bf16_t>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Value `hi` (0: the low 16 bits, 1: the high) of a register of two 16-bit values, as fp32.
template <typename T> __device__ __forceinline__ float unpack_half(unsigned r, int hi) {
    T x;
    x.bits = (unsigned short)(hi ? r >> 16 : r & 0xffffu);
    return to_float(x);
}

// 2^x for the softmax: one MUFU.EX2. exp2f adds a compare, two multiplies and a select
// around it (3-4 instructions per score) only to return subnormal results below 2^-126,
// which no probability here can use (a row's sum is >= 1). -inf gives 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ double fast_exp2(double x) { return exp2(x); }

// 2^x on the FMA pipe, for kernels whose special-function unit is their limit (a score modification's
// tanh beside the softmax's exp2: softmax.cuh's FMA_EXP2). t = x + 1.5 * 2^23 + 127 rounds x to j and
// leaves j + 127 in t's low bits, so t's bits shifted into the exponent field are 2^j; 2^(x - j) is the
// degree-4 minimax polynomial on [-1/2, 1/2] (relative error 2.7e-6: a row's lse moves by less than its
// fp32 test bound, 2e-5, where degree 3's 7.5e-5 did not). Results below 2^-126 are 0 (as MUFU.EX2.FTZ's),
// -inf gives 0 (j = -127 makes the scale 0), and max.NaN keeps a NaN.
__device__ __forceinline__ float fma_exp2(float x) {
    float y;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(x), "f"(-127.0f));
    const float rounder = 12583039.0f;
    const float t = y + rounder;
    const float f = y - (t - rounder);
    const float p = fmaf(fmaf(fmaf(fmaf(0.009570068679749966f, f, 0.055917806923389435f), f, 0.240247443318367f), f,
                              0.6931218504905701f), f, 0.9999992847442627f);
    return p * __int_as_float(__float_as_int(t) << 23);
}
__device__ __forceinline__ float log2_of(float x) { return log2f(x); }
__device__ __forceinline__ double log2_of(double x) { return log2(x); }

template <typename A> __device__ __forceinline__ A pos_inf();
template <> __device__ __forceinline__ float pos_inf<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double pos_inf<double>() { return __longlong_as_double(0x7ff0000000000000LL); }
template <typename A> __device__ __forceinline__ A neg_inf() { return -pos_inf<A>(); }

// Reductions over the lanes that share one row. WIDTH lanes with consecutive
// lane ids (WIDTH a power of two) hold pieces of the row.
__device__ __forceinline__ float amax(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double amax(double a, double b) { return fmax(a, b); }

// STRIDE: the pieces lie STRIDE lanes apart instead (lane bits log2(STRIDE).. of the same low bits: the
// decoding kernel's query-minor tile, STRIDE 4, a query's 8 lanes).
template <int WIDTH, int STRIDE = 1, typename A>
__device__ __forceinline__ A group_max(A x) {
#pragma unroll
    for (int offset = WIDTH / 2 * STRIDE; offset >= STRIDE; offset /= 2)
        x = amax(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
template <int WIDTH, int STRIDE = 1, typename A>
__device__ __forceinline__ A group_sum(A x) {
#pragma unroll
    for (int offset = WIDTH / 2 * STRIDE; offset >= STRIDE; offset /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// 32-bit shared-memory address of a generic pointer into shared memory (for PTX operands).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
    return addr;
}

// Four ints parked in 16 bytes of shared memory (16-byte aligned) across a loop that needs
// every register, where ptxas would otherwise hold them (or values it derives from them)
// through the loop or spill them to local memory. Lane 0 of each warp writes its warp's slot
// (the warp's own lanes read it, after __syncwarp); the read is volatile, so the compiler
// neither keeps the values in registers nor forwards the store, and each read costs one
// 16-byte shared load.
// BYTES: an immediate offset from slot_addr (no register holds the sum).
struct Parked4 { int a, b, c, d; };
template <int BYTES = 0>
__device__ __forceinline__ void park4(unsigned slot_addr, Parked4 v) {
    if (threadIdx.x % 32 == 0)
        asm volatile("st.shared.v4.s32 [%0+%1], {%2, %3, %4, %5};"
                     :: "r"(slot_addr), "n"(BYTES), "r"(v.a), "r"(v.b), "r"(v.c), "r"(v.d) : "memory");
    __syncwarp();
}
template <int BYTES = 0>
__device__ __forceinline__ Parked4 unpark4(unsigned slot_addr) {
    Parked4 v;
    asm volatile("ld.volatile.shared.v4.s32 {%0, %1, %2, %3}, [%4+%5];"
                 : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "r"(slot_addr), "n"(BYTES) : "memory");
    return v;
}

// The thread index read again (asm volatile: not the value ptxas already holds), for an
// epilogue's row arithmetic after such a loop: otherwise ptxas keeps what it derived from
// the index before the loop live across it.
__device__ __forceinline__ int thread_index_reread() {
    int tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}

// Two neighbouring floats of shared memory (8-byte aligned) in one 8-byte load.
struct alignas(8) FloatPair {
    float v[2];
    __device__ __forceinline__ float operator[](int i) const { return v[i]; }
};
__device__ __forceinline__ FloatPair load_pair(const float* p) { return *reinterpret_cast<const FloatPair*>(p); }

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
// x / d for 0 <= x < 2^31 and d >= 2, by the host's (mul, shift) of d (cuflash/_runtime/params.py,
// fast_divisor: mul = ceil(2^(31 + l) / d), shift = l - 1, l = ceil(log2 d); Granlund and Montgomery).
__device__ __forceinline__ int fast_div(int x, unsigned mul, int shift) {
    return int(__umulhi(unsigned(x), mul) >> shift);
}
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
