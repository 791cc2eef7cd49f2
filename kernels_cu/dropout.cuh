// dropout.cuh -- the counter-based random numbers behind dropout.
//
// Philox4x32-10 (Salmon et al., SC'11): a keyed bijection of a 128-bit counter,
// so an element's random word is a pure function of (seed, batch, head, row,
// col). The backward regenerates the forward's mask from the seed alone; nothing
// is stored, and any kernel (any tile shape, any thread layout) draws the same
// word for the same element. cuflash/reference.py implements the same function
// in NumPy (and checks it against the published known-answer vector).
//   counter = (col / 4, row, head, batch), key = (seed_lo, seed_hi)
//   element (row, col) uses word col % 4 of the output; it is dropped iff
//   word < drop_threshold = round(p * 2^32).
#pragma once
#include "common.cuh"

struct PhiloxWords {
    unsigned w0, w1, w2, w3;

    // Word i (0..3) without indexing an array, which would put it in local memory.
    __device__ __forceinline__ unsigned word(int i) const {
        return i == 0 ? w0 : i == 1 ? w1 : i == 2 ? w2 : w3;
    }
};

__device__ __forceinline__ PhiloxWords philox4x32_10(unsigned c0, unsigned c1, unsigned c2, unsigned c3,
                                                     unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;   // the Weyl key schedule
        k1 += 0xBB67AE85u;
    }
    return {c0, c1, c2, c3};
}

// The four words of the group of keys [4 * (col / 4), 4 * (col / 4) + 4) of one query row.
__device__ __forceinline__ PhiloxWords dropout_words(unsigned seed_lo, unsigned seed_hi, int batch, int head, int row,
                                                     int col) {
    return philox4x32_10(unsigned(col) >> 2, unsigned(row), unsigned(head), unsigned(batch), seed_lo, seed_hi);
}
