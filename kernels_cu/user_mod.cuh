// user_mod.cuh -- user score and mask modifications (cuflash.mods), as the kernels see them.
//
// The host compiles a call's modifications by placing their generated source before a kernel's
// (cuflash/mods.py, Mods.prelude). That source defines the switches below and the functions they
// guard, each over one element (a score in log2 units as the kernels hold it, x = s log2 e; b, h, q_idx,
// kv_idx; rel = kv_idx - q_idx as A; the parameter words; the generated chain converts to each
// modification's own units):
//     cuf_user_score(s, ...)              the score modifications in order
//     cuf_user_score_grad(s, ..., g)      the same, and g = d modified / d s (chain rule)
//     cuf_user_param_grads(s, ..., ds')   the trainable parameters' gradients from ds' = dL / d modified
//     cuf_user_mask(...)                  every mask modification's verdict
// Without that source every switch is 0 and the hooks (ScoreMod, score_mod.cuh) compile to nothing:
// the library's own kernels are unchanged.
#pragma once
#include "common.cuh"

#ifndef CUF_USER_SCORE
#define CUF_USER_SCORE 0
#endif
#ifndef CUF_USER_MASK
#define CUF_USER_MASK 0
#endif
#ifndef CUF_USER_SCORE_EVERYWHERE
#define CUF_USER_SCORE_EVERYWHERE 0
#endif
#ifndef CUF_USER_PARAM_GRADS
#define CUF_USER_PARAM_GRADS 0
#endif
// The factors the plain forwards fold around the score modifications (cuflash/mods.py, Mods._generate): the
// first one's input factor (and unit conversion), into the scale a score is multiplied by, and the last one's
// output factor (and conversion back), into the softmax's exponential (its x_per_s); cuf_user_score_folded is
// the chain without them.
#ifndef CUF_USER_IN_SCALE
#define CUF_USER_IN_SCALE 1
#endif
#ifndef CUF_USER_OUT_SCALE
#define CUF_USER_OUT_SCALE 1
#endif

// The score modifications' special-function-unit instructions an element (cuf_tanh under CUF_FAST_SPECIAL),
// which share that unit with the softmax's exp2 (the forwards' FMA_EXP2: fwd_exp2_on_fma, softmax.cuh).
#ifndef CUF_USER_SPECIAL
#define CUF_USER_SPECIAL 0
#endif

constexpr bool USER_SCORE = CUF_USER_SCORE;
constexpr bool USER_MASK = CUF_USER_MASK;
// Every score modification may run at masked positions (ScoreMod everywhere=True): the kernels evaluate
// them without a branch an element and select -inf after (or run them before the mask: mask_and_modify). A
// value of (b, h) alone is then one load a tile: the compiler merges the elements' loads of one address, which
// a branch an element keeps apart.
constexpr bool USER_SCORE_EVERYWHERE = CUF_USER_SCORE_EVERYWHERE;

// How a kernel evaluates the score modifications of a score x: behind a branch on x being masked (-inf,
// which stays masked); at every element with -inf selected after (USER_SELECT); or at every element of raw
// scores before the kernel's mask, which then overwrites masked elements with -inf (USER_BEFORE_MASK;
// mask_and_modify, score_mod.cuh).
enum UserScoreForm { USER_BRANCH, USER_SELECT, USER_BEFORE_MASK };

// The score modifications of x, a score in log2 units as the kernels hold it (x = s log2 e), in log2 units.
// FOLDED: x is CUF_USER_IN_SCALE times that, and the result is the modified score over CUF_USER_OUT_SCALE.
// REL: rel (kv_idx - q_idx as A) is the caller's (mask_and_modify's, formed once a tile), else formed here.
template <UserScoreForm FORM, bool FOLDED = false, bool REL = false, typename A>
__device__ __forceinline__ A user_modified_score(A x, int b, int h, int row, int col, A rel_given,
                                                const unsigned long long* args) {
#if CUF_USER_SCORE
    auto chain = [&]() {
        const A rel = REL ? rel_given : A(col - row);
        if constexpr (FOLDED) return cuf_user_score_folded<A>(x, b, h, row, col, rel, args);
        else return cuf_user_score<A>(x, b, h, row, col, rel, args);
    };
    if constexpr (FORM == USER_BEFORE_MASK) {
        return chain();
    } else if constexpr (FORM == USER_SELECT) {
        const A y = chain();
        return x == neg_inf<A>() ? x : y;
    } else {
        if (x == neg_inf<A>()) return x;
        return chain();
    }
#else
    (void)b, (void)h, (void)row, (void)col, (void)rel_given, (void)args;
    return x;
#endif
}

// The modified score of x (log2 units) and its derivative with respect to the raw score; the
// trainable parameters' gradients come from ds_mod, dL / d modified score (natural units). FOLDED: x is
// CUF_USER_IN_SCALE times that, and the value the modified score over CUF_USER_OUT_SCALE (the derivative the
// same). SELECT: evaluated at every element, masked ones (-inf) selected after (USER_SELECT's form), else
// behind a branch.
// REL: rel (kv_idx - q_idx as A) is the caller's, else formed here (behind the branch: formed before it, the
// portable dK/dV kernel at head dim 64 spilled 4-16 bytes, NVRTC 12.9; the Hopper one forms it before its
// clamp, and spilled 8 bytes at head dim 64 with it formed here).
template <bool FOLDED = false, bool SELECT = false, bool REL = false, typename A>
__device__ __forceinline__ A user_modified_score_grad(A x, int b, int h, int row, int col, A rel_given,
                                                      const unsigned long long* args, A& grad) {
#if CUF_USER_SCORE
    auto chain = [&](A& g) {
        const A rel = REL ? rel_given : A(col - row);
        if constexpr (FOLDED) return cuf_user_score_grad_folded<A>(x, b, h, row, col, rel, args, g);
        else return cuf_user_score_grad<A>(x, b, h, row, col, rel, args, g);
    };
    if constexpr (SELECT) {
        A g;
        const A y = chain(g);
        const bool masked = x == neg_inf<A>();
        grad = masked ? A(0) : g;
        return masked ? x : y;
    } else {
        if (x == neg_inf<A>()) {
            grad = A(0);
            return x;
        }
        return chain(grad);
    }
#else
    (void)b, (void)h, (void)row, (void)col, (void)rel_given, (void)args;
    grad = A(1);
    return x;
#endif
}

template <typename A>
__device__ __forceinline__ void user_param_grads(A x, int b, int h, int row, int col, const unsigned long long* args,
                                                 A ds_mod) {
#if CUF_USER_PARAM_GRADS
    if (ds_mod != A(0)) cuf_user_param_grads<A>(x, b, h, row, col, A(col - row), args, ds_mod);
#else
    (void)x, (void)b, (void)h, (void)row, (void)col, (void)args, (void)ds_mod;
#endif
}

__device__ __forceinline__ bool user_mask_allows(int b, int h, int row, int col, const unsigned long long* args) {
#if CUF_USER_MASK
    return cuf_user_mask(b, h, row, col, args);
#else
    (void)b, (void)h, (void)row, (void)col, (void)args;
    return true;
#endif
}
