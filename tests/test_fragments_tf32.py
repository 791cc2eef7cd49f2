"""The float32 tensor-core forward's arithmetic and fragment layouts, lane by lane in NumPy (CPU).

flash_fwd_tf32 (kernels_cu/flash_fwd_tf32.cu over warp_gemm_tf32.cuh) rests on facts that no
CPU compile can check:
  * the split: round_tf32 (Veltkamp's c = a (2^13 + 1), big = c - (c - a), in float32
    round-to-nearest steps) leaves 11 significant bits, and big + small carries a to ~2^-22;
  * why each k-step's three MMAs go into a fresh fragment: an MMA that sums with truncation,
    chained through every k-step, drifts in one direction; the fresh-fragment sum does not;
  * the lane formulas: ldmatrix of fp32 rows (a 16-byte row is 4 floats), the m16n8k8 TF32
    A / B / C layouts, the permuted key order of O += P V (A's k index t is key 2t, t + 4 is
    key 2t + 1; B reads V[2t][g] and V[2t + 1][g]) and the bias reads; their bank patterns.
Here the same formulas (transcribed, names as in the CUDA source) drive an emulated warp.
"""
import re

import numpy as np
import pytest

from cuflash._runtime.build import kernel_dir

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4
f32 = np.float32


# --------------------------------------------------------------------------- the split (round_tf32)

def _veltkamp_constant():
    """The multiplier of round_tf32's mul.rn.f32, read from the CUDA source (a PTX hex float,
    0fXXXXXXXX: its IEEE bits), so that the emulation runs the kernel's constant, not a copy."""
    src = (kernel_dir() / "warp_gemm_tf32.cuh").read_text()   # the installed package's copy in CI
    bits = re.search(r"mul\.rn\.f32 %0, %1, 0f([0-9A-Fa-f]{8});", src).group(1)
    return np.array(int(bits, 16), dtype=np.uint32).view(f32)[()]


VELTKAMP = _veltkamp_constant()


def round_tf32(a):
    """warp_gemm_tf32.cuh round_tf32: three float32 operations, each rounded (mul.rn, sub.rn)."""
    a = np.asarray(a, dtype=f32)
    with np.errstate(over="ignore", invalid="ignore"):
        c = (a * VELTKAMP).astype(f32)
        d = (c - a).astype(f32)
        return (c - d).astype(f32)


def split_tf32(a):
    big = round_tf32(a)
    return big, round_tf32((np.asarray(a, dtype=f32) - big).astype(f32))


def significant_bits_ok(x):
    """True where x (float32) has at most 11 significant bits: the low 13 mantissa bits are zero."""
    return (np.asarray(x, dtype=f32).view(np.uint32) & 0x1FFF) == 0


@pytest.fixture(scope="module")
def values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200000) * np.exp(rng.uniform(-30, 30, 200000))
    return np.concatenate([x, [0.0, -0.0, 1.0, 3.0, 2.0**-126, 1e30, -7.5e33]]).astype(f32)


def test_round_tf32_is_a_nearest_11_bit_rounding(values):
    big = round_tf32(values)
    assert significant_bits_ok(big).all()
    # Nearest: |a - big| <= half an 11-bit ulp of a (2^-11 relative), never more.
    a = values.astype(np.float64)
    err = np.abs(a - big.astype(np.float64))
    assert (err <= np.abs(a) * 2.0**-11 * (1 + 2.0**-20)).all()


def test_veltkamp_constant_is_2_pow_13_plus_1():
    # 0f46002000 (8200 = 2^13 + 2^3, the first version's constant) still leaves 11 significant
    # bits, but rounds 8191 of every 2^23 values a whole TF32 ulp away (review, offline).
    assert VELTKAMP == f32(8193)


def test_round_tf32_is_round_to_nearest_even_on_a_whole_binade():
    """Every float32 of [1, 2) and of -[2^-100, 2^-99) against the bit-exact round-to-nearest-even
    at 10 mantissa bits."""
    for top in (0x3F800000, 0x8D800000):
        a = (np.arange(2**23, dtype=np.uint32) | np.uint32(top)).view(f32)
        bits = a.view(np.uint32).astype(np.int64)
        keep, rest = bits >> 13, bits & 0x1FFF
        up = (rest > 0x1000) | ((rest == 0x1000) & (keep & 1 == 1))
        want = ((keep + up) << 13).astype(np.uint32).view(f32)
        np.testing.assert_array_equal(round_tf32(a), want)


def test_split_carries_a_to_float32_accuracy(values):
    big, small = split_tf32(values)
    assert significant_bits_ok(small).all()
    a = values.astype(np.float64)
    rest = a - big.astype(np.float64) - small.astype(np.float64)
    # small is a - big rounded at 11 bits: what is left is below 2^-22 |a| (float32's unit
    # roundoff is 2^-24).
    assert (np.abs(rest) <= np.abs(a) * 2.0**-22).all()


def test_three_products_carry_a_product_to_float32_accuracy(values):
    rng = np.random.default_rng(1)
    a, b = values[:100000], rng.permutation(values[:100000])
    a, b = a[np.abs(a) < 1e15], b[:np.count_nonzero(np.abs(a) < 1e15)]
    a, b = a[np.abs(b) < 1e15], b[np.abs(b) < 1e15]
    (ab, as_), (bb, bs) = split_tf32(a), split_tf32(b)
    d = lambda x: x.astype(np.float64)   # products of 11-bit values are exact in float64 (and in fp32)
    approx = d(ab) * d(bb) + d(ab) * d(bs) + d(as_) * d(bb)
    exact = d(a) * d(b)
    assert (np.abs(approx - exact) <= np.abs(exact) * 2.0**-20.5).all()


def test_split_keeps_nan():
    # CUDA's canonical NaN: adding half an ulp to its bits and masking would make it -0.
    nan = np.array([0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF], dtype=np.uint32).view(f32)
    assert np.isnan(round_tf32(nan)).all()


def _fast_split_source():
    """round_tf32_bits' two constants (and a check of split_tf32's FAST branch), read from the CUDA
    source, so that the emulation runs the kernel's constants and operations, not a copy (review,
    offline: a transcription once hid a wrong Veltkamp constant)."""
    src = (kernel_dir() / "warp_gemm_tf32.cuh").read_text()
    m = re.search(r"return \(__float_as_uint\(a\) \+ (0x[0-9A-Fa-f]+)u\) & (0x[0-9A-Fa-f]+)u;", src)
    # (TF32X3_PARTS, the Hopper kernel's, shares the branch and only clears small's low bits on top:
    # tests/test_fragments_wgmma_tf32.py)
    fast = re.search(r"if \(SPLIT == TF32X3_FAST \|\| SPLIT == TF32X3_PARTS\) \{\s*big = round_tf32_bits\(a\);\s*"
                     r"small = __float_as_uint\(a - __uint_as_float\(big\)\);\s*"
                     r"if \(SPLIT == TF32X3_PARTS\) small &= 0x[0-9a-f]+u;\s*return;", src)
    assert m and fast, "warp_gemm_tf32.cuh's fast split changed: update the emulation"
    return np.uint32(int(m.group(1), 16)), np.uint32(int(m.group(2), 16))


FAST_HALF_ULP, FAST_MASK = _fast_split_source()


def test_fast_split_constants():
    assert FAST_HALF_ULP == 1 << 12 and FAST_MASK == 0xFFFFFFFF ^ 0x1FFF   # half a TF32 ulp; 13 low bits


def round_tf32_bits(a):
    """warp_gemm_tf32.cuh round_tf32_bits (TF32X3_FAST's big): half a TF32 ulp added to the bits,
    the low 13 bits cleared (uint32 arithmetic wraps as the GPU's does)."""
    bits = np.asarray(a, dtype=f32).view(np.uint32)
    return ((bits + FAST_HALF_ULP) & FAST_MASK).view(f32)


def truncate_tf32(a):
    """What the tensor core reads of a float32 operand: the top 19 bits (mma.cuh)."""
    return (np.asarray(a, dtype=f32).view(np.uint32) & np.uint32(0xFFFFE000)).view(f32)


def split_tf32_fast(a):
    """TF32X3_FAST as the tensor core sees it: big rounded by its bits, small = a - big in float32
    (exact), then truncated to 11 bits by the MMA."""
    big = round_tf32_bits(a)
    with np.errstate(invalid="ignore"):
        small = (np.asarray(a, dtype=f32) - big).astype(f32)
    return big, truncate_tf32(small)


def test_fast_split_carries_a_to_float32_accuracy(values):
    finite = values[np.abs(values) < 1e37]
    big, small = split_tf32_fast(finite)
    assert significant_bits_ok(big).all() and significant_bits_ok(small).all()
    # big is within half a TF32 ulp of a (a nearest rounding, ties away from zero)...
    a = finite.astype(np.float64)
    assert (np.abs(a - big.astype(np.float64)) <= np.abs(a) * 2.0**-11).all()
    # ... and the truncated small leaves at most 2^-23 |a| (one float32 ulp of a: small has at most
    # 12 significant bits, the tensor core drops the last; the rounded split's worst case is the same).
    rest = a - big.astype(np.float64) - small.astype(np.float64)
    assert (np.abs(rest) <= np.abs(a) * 2.0**-23).all()


def test_fast_split_three_products_carry_a_product_to_float32_accuracy(values):
    rng = np.random.default_rng(1)
    a = values[np.abs(values) < 1e15][:100000]
    b = rng.permutation(a)
    (ab, as_), (bb, bs) = split_tf32_fast(a), split_tf32_fast(b)
    d = lambda x: x.astype(np.float64)
    approx = d(ab) * d(bb) + d(ab) * d(bs) + d(as_) * d(bb)
    exact = d(a) * d(b)
    # small_a small_b dropped (<= 2^-22 |ab|) + two truncations (<= 2^-23 |a| |b| (1 + 2^-11) each)
    assert (np.abs(approx - exact) <= np.abs(exact) * 2.0**-21 * (1 + 2.0**-10)).all()


@pytest.mark.parametrize("sign,exponent", [(0, 127), (1, 127), (1, 100), (0, 150), (0, 254), (1, 254)])
def test_fast_split_on_a_whole_binade(sign, exponent):
    """Every float32 of one binade (all 2^23 mantissas) through the fast split, against a float64
    round-to-nearest-ties-away at 11 significant bits: big exact, a - big exact in float32 (no
    rounding), what the tensor core reads of small within 2^-23 |a|. Top binade: big overflows to
    inf only within half a TF32 ulp of FLT_MAX (0x7f7ff000 on)."""
    bits = (np.uint32(sign) << np.uint32(31)) | (np.uint32(exponent) << np.uint32(23)) | np.arange(1 << 23, dtype=np.uint32)
    a = bits.view(f32)
    big = round_tf32_bits(a)
    with np.errstate(invalid="ignore", over="ignore"):
        small = (a - big).astype(f32)
    finite = np.isfinite(big)
    top = (bits & np.uint32(0x7FFFFFFF)) >= 0x7F7FF000
    assert (finite == ~top).all()
    assert np.isinf(small[top]).all() and (np.sign(small[top]) == -np.sign(a[top])).all()
    A, B = a[finite].astype(np.float64), big[finite].astype(np.float64)
    ulp = 2.0 ** (exponent - 127 - 10)
    assert (B == np.sign(A) * np.floor(np.abs(A) / ulp + 0.5) * ulp).all()
    assert significant_bits_ok(big).all()
    assert (small[finite].astype(np.float64) == A - B).all()
    rest = A - B - truncate_tf32(small[finite]).astype(np.float64)
    assert (np.abs(rest) <= np.abs(A) * 2.0**-23).all()
    assert np.abs(rest).max() == ulp * 2.0**-13   # the bound is attained: one float32 ulp of a


def test_fast_split_near_float_max_gives_nan_not_a_finite_wrong_value():
    # Within half a TF32 ulp of FLT_MAX big rounds to inf and small = a - inf = -inf: the three
    # products then sum to NaN (inf - inf, or inf * 0), never to a finite wrong value. (The rounded
    # split's Veltkamp c = a (2^13 + 1) overflows from 2^114 on: NaN too.)
    a = np.array([np.finfo(f32).max, -np.finfo(f32).max], dtype=f32)
    big, small = split_tf32_fast(a)
    assert np.isinf(big).all() and np.isinf(small).all() and (np.sign(big) == -np.sign(small)).all()
    with np.errstate(invalid="ignore", over="ignore"):
        for b in (f32(1.0), f32(0.0), f32(3 * 2.0**-20)):
            bb, bs = split_tf32_fast(np.array([b]))
            prods = big * bb + big * bs + small * bb
            assert np.isnan(prods).all()


def test_fast_split_keeps_nan_and_inf_out_of_finite_results():
    # A NaN's big may come out as -0 or 0 (0x7fffffff + 0x1000 wraps the sign), but small = a - big
    # is NaN, so a product with it is NaN; inf gives big = inf and small = inf - inf = NaN.
    # 0x7f800001 (a NaN with only low bits set): big = inf, small = NaN - inf = NaN.
    bad = np.array([0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x7F800001, 0xFF800FFF],
                   dtype=np.uint32).view(f32)
    big, small = split_tf32_fast(bad)
    assert np.isnan(small).all()


# --------------------------------------------------------------------------- why fresh fragments

def mma_truncating(c, a, b):
    """One emulated MMA k8 step: the products (exact) and C summed, the sum truncated toward zero to
    float32 (the behaviour the lost tf32 branch measured on an H100; the 3xTF32 design assumes no
    more than this)."""
    s = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    r = s.astype(f32)   # round to nearest, then step toward zero where that rounded up in magnitude
    up = np.abs(r.astype(np.float64)) > np.abs(s)
    r[up] = np.nextafter(r[up], f32(0))
    return r


def gemm_3xtf32(a, b, fresh, split=None):
    """a (m x K) @ b (K x n) in k8 steps of three truncating MMAs: into the accumulator (chained)
    or into a zeroed fragment added with a round-to-nearest FADD (fresh, warp_gemm_tf32.cuh);
    ``split``: split_tf32 (TF32X3_ROUNDED, the default) or split_tf32_fast (TF32X3_FAST)."""
    split = split or split_tf32
    (ab, as_), (bb, bs) = split(a), split(b)
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=f32)
    for k0 in range(0, a.shape[1], 8):
        k = slice(k0, k0 + 8)
        f = np.zeros_like(acc) if fresh else acc
        f = mma_truncating(f, as_[:, k], bb[k])
        f = mma_truncating(f, ab[:, k], bs[k])
        f = mma_truncating(f, ab[:, k], bb[k])
        acc = (acc + f).astype(f32) if fresh else f
    return acc


def test_fresh_fragments_are_float32_accurate_and_chaining_is_not():
    rng = np.random.default_rng(2)
    # Positive operands (a row of probabilities times V; or Q K^T with correlated rows): every
    # truncation then loses in the same direction.
    a = rng.uniform(0, 1, (16, 256)).astype(f32)
    b = rng.uniform(0, 1, (256, 8)).astype(f32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    naive = (a @ b).astype(np.float64)   # float32 BLAS
    err = lambda x: np.linalg.norm(x.astype(np.float64) - exact) / np.linalg.norm(exact)
    fresh, chained = err(gemm_3xtf32(a, b, True)), err(gemm_3xtf32(a, b, False))
    assert fresh <= 2 * max(err(naive), 2.0**-24)
    assert chained > 2 * fresh   # the drift the fresh fragments remove


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_fast_split_gemm_stays_within_twice_float32(kind):
    # TF32X3_FAST (a tuning candidate): small truncated instead of rounded. Its GEMM error must stay
    # within the rule the GPU tests apply (twice the naive float32 computation's), on positive
    # operands (every truncation one way) and signed ones.
    rng = np.random.default_rng(3)
    draw = (lambda *s: rng.uniform(0, 1, s)) if kind == "uniform" else (lambda *s: rng.standard_normal(s))
    a, b = draw(64, 128).astype(f32), draw(128, 64).astype(f32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err = lambda x: np.linalg.norm(x.astype(np.float64) - exact) / np.linalg.norm(exact)
    naive = err((a @ b).astype(f32))
    fast, rounded = err(gemm_3xtf32(a, b, True, split_tf32_fast)), err(gemm_3xtf32(a, b, True))
    assert fast <= 2 * max(naive, 2.0**-24)
    assert fast <= 2 * rounded + 2.0**-24


# --------------------------------------------------------------------------- fragment layouts

HEAD, BN = 64, 32
P = HEAD + 4                  # FwdTf32Traits::PITCH
BIAS_P = BN + 8               # FwdTf32Traits::BIAS_PITCH


def ldmatrix_x4_b32(smem, row_addr):
    """ldmatrix.x4 of 32-bit data: 4 matrices of 8 rows x 16 bytes (4 floats); lanes 8j..8j+7
    give the row addresses (floats) of matrix j; lane (g, t) receives word t of row g."""
    regs = []
    for j in range(4):
        rows = row_addr[8 * j:8 * j + 8]
        mat = np.stack([smem[r:r + 4] for r in rows])   # mat[row][word]
        regs.append(mat[G, T])
    return regs


def mma_1688(c, a, b0, b1):
    """c (32, 4) += A B, mma.m16n8k8 .tf32 layouts (mma.cuh): a0 (row g, k t), a1 (row g + 8,
    k t), a2 (row g, k t + 4), a3 (row g + 8, k t + 4); b0 (k t, n g), b1 (k t + 4, n g)."""
    A = np.zeros((16, 8))
    B = np.zeros((8, 8))
    A[G, T], A[G + 8, T], A[G, T + 4], A[G + 8, T + 4] = a
    B[T, G], B[T + 4, G] = b0, b1
    C = A @ B
    c += np.stack([C[G, 2 * T], C[G, 2 * T + 1], C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], axis=1)


def a_lane_addr_tf32(strip, pitch=P):
    return strip + (LANES % 16) * pitch + (LANES // 16) * 4


def bt_lane_addr_tf32(rows, pitch=P):
    return rows + ((LANES // 16) * 8 + LANES % 8) * pitch + ((LANES // 8) % 2) * 4


def to_smem(x, pitch):
    smem = np.full(x.shape[0] * pitch, np.nan)
    for r in range(x.shape[0]):
        smem[r * pitch:r * pitch + x.shape[1]] = x[r]
    return smem


def from_frags(frags):
    """(16 x 8N) matrix from N C fragments."""
    out = np.zeros((16, 8 * len(frags)))
    for n, c in enumerate(frags):
        out[G, 8 * n + 2 * T], out[G, 8 * n + 2 * T + 1] = c[:, 0], c[:, 1]
        out[G + 8, 8 * n + 2 * T], out[G + 8, 8 * n + 2 * T + 1] = c[:, 2], c[:, 3]
    return out


def test_qk_fragments_give_q_kt():
    """warp_gemm_qk_tf32: A by ldmatrix from the strip, B pairs by ldmatrix from K rows."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((16, HEAD)), rng.standard_normal((BN, HEAD))
    q_s, k_s = to_smem(q, P), to_smem(k, P)
    s = [np.zeros((32, 4)) for _ in range(BN // 8)]
    big_addr, k_addr = a_lane_addr_tf32(0), bt_lane_addr_tf32(0)
    for k0 in range(0, HEAD, 8):
        a = ldmatrix_x4_b32(q_s, big_addr + k0)
        for n0 in range(0, BN, 16):
            raw = ldmatrix_x4_b32(k_s, k_addr + n0 * P + k0)
            for h in range(2):
                mma_1688(s[n0 // 8 + h], a, raw[2 * h], raw[2 * h + 1])
    np.testing.assert_allclose(from_frags(s), q @ k.T, rtol=1e-12, atol=1e-12)


def test_pv_fragments_in_permuted_key_order_give_p_v():
    """warp_gemm_pv_tf32: A = P's C fragment (c0, c2, c1, c3), B = V[2t][g], V[2t + 1][g]."""
    rng = np.random.default_rng(4)
    p, v = rng.uniform(0, 1, (16, BN)), rng.standard_normal((BN, HEAD))
    p_frags = [np.stack([p[G, 8 * n + 2 * T], p[G, 8 * n + 2 * T + 1], p[G + 8, 8 * n + 2 * T],
                         p[G + 8, 8 * n + 2 * T + 1]], axis=1) for n in range(BN // 8)]
    v_s = to_smem(v, P)
    v_lane = 2 * T * P + G
    o = [np.zeros((32, 4)) for _ in range(HEAD // 8)]
    for kt in range(BN // 8):
        c = p_frags[kt]
        a = [c[:, 0], c[:, 2], c[:, 1], c[:, 3]]
        for n0 in range(0, HEAD, 16):
            for h in range(2):
                b0 = v_s[v_lane + 8 * kt * P + n0 + 8 * h]
                b1 = v_s[v_lane + (8 * kt + 1) * P + n0 + 8 * h]
                mma_1688(o[n0 // 8 + h], a, b0, b1)
    np.testing.assert_allclose(from_frags(o), p @ v, rtol=1e-12, atol=1e-12)


def test_bias_reads_land_on_their_scores():
    """scale_add_bias_frags_f32: lane reads (row g + 8r, keys 8n + 2t, + 1) as one pair."""
    rng = np.random.default_rng(5)
    bias = rng.standard_normal((16, BN))
    tile = to_smem(bias, BIAS_P)
    at = G * BIAS_P + 2 * T
    got = [np.stack([tile[at + 8 * n], tile[at + 8 * n + 1], tile[at + 8 * BIAS_P + 8 * n],
                     tile[at + 8 * BIAS_P + 8 * n + 1]], axis=1) for n in range(BN // 8)]
    np.testing.assert_array_equal(from_frags(got), bias)


@pytest.mark.parametrize("head", [32, 64, 128, 256])
def test_shared_loads_are_conflict_free(head):
    pitch = head + 4
    # ldmatrix: each matrix's 8 rows of 16 bytes in 8 different 16-byte bank groups (mod 128 bytes).
    for addr in (a_lane_addr_tf32(0, pitch), bt_lane_addr_tf32(0, pitch)):
        for j in range(4):
            groups = (addr[8 * j:8 * j + 8] * 4 // 16) % 8
            assert len(set(groups)) == 8
    # V's 4-byte loads b0 and b1: 32 words in 32 different banks.
    for s in range(2):
        assert len(set(((2 * T + s) * pitch + G) % 32)) == 32
    # The bias's 8-byte loads: each half-warp's 16 pairs in 16 different bank pairs.
    for bn in (16, 32, 64):
        pitch_b = bn + 8
        words = G * pitch_b + 2 * T
        for half in (slice(0, 16), slice(16, 32)):
            assert len(set((words[half] % 32) // 2)) == 16


# --------------------------------------------------------------------------- the backward (flash_bwd_tf32.cu)
#
# The dK/dV kernel reuses the forward's two GEMMs with other roles: S^T = K Q^T and dP^T = V dO^T
# are warp_gemm_qk_tf32 with A = the warp's 16 keys of K / V and B = Q / dO rows; dV += P^T dO
# and dK += dS^T Q are warp_gemm_pv_tf32 with A = P^T's / dS^T's C fragments (rows keys, columns
# queries, in the permuted order: A's k index t is query 2t, t + 4 is 2t + 1) and B = dO / Q rows.
# New: the transposed bias read, dS^T's store, dQ += dS K from it (warp_gemm_ds_k_tf32), dbias.

def warp_qk(a_s, a_row0, b_s, n, k, pitch):
    """warp_gemm_qk_tf32 (one strip): C fragments of A[a_row0 : a_row0 + 16] B^T, B rows [n][k]."""
    out = [np.zeros((32, 4)) for _ in range(n // 8)]
    a_addr, b_addr = a_lane_addr_tf32(a_row0 * pitch, pitch), bt_lane_addr_tf32(0, pitch)
    for k0 in range(0, k, 8):
        a = ldmatrix_x4_b32(a_s, a_addr + k0)
        for n0 in range(0, n, 16):
            raw = ldmatrix_x4_b32(b_s, b_addr + n0 * pitch + k0)
            for h in range(2):
                mma_1688(out[n0 // 8 + h], a, raw[2 * h], raw[2 * h + 1])
    return out


def warp_pv(c_frags, b_s, n, pitch):
    """warp_gemm_pv_tf32 (one strip): C fragments of (the 16 x 8KT matrix of c_frags) B, B rows [k][n]."""
    out = [np.zeros((32, 4)) for _ in range(n // 8)]
    b_lane = 2 * T * pitch + G
    for kt, c in enumerate(c_frags):
        a = [c[:, 0], c[:, 2], c[:, 1], c[:, 3]]
        for n0 in range(0, n, 16):
            for h in range(2):
                mma_1688(out[n0 // 8 + h], a, b_s[b_lane + 8 * kt * pitch + n0 + 8 * h],
                         b_s[b_lane + (8 * kt + 1) * pitch + n0 + 8 * h])
    return out


def warp_ds_k(ds_s, strip_col, k_s, col0, n, keys, pa, pb):
    """warp_gemm_ds_k_tf32: dQ fragments (16 queries x n columns from col0) of dS K, dS^T stored
    [key][query] (pitch pa, the strip's first query column strip_col), K rows [key][column] (pitch pb)."""
    out = [np.zeros((32, 4)) for _ in range(n // 8)]
    a_lane = strip_col + 2 * T * pa + G
    b_lane = 2 * T * pb + G
    for kt in range(keys // 8):
        a_at = a_lane + 8 * kt * pa
        a = [ds_s[a_at], ds_s[a_at + 8], ds_s[a_at + pa], ds_s[a_at + pa + 8]]
        for n0 in range(0, n, 16):
            for h in range(2):
                at = b_lane + 8 * kt * pb + col0 + n0 + 8 * h
                mma_1688(out[n0 // 8 + h], a, k_s[at], k_s[at + pb])
    return out


def bias_frags_t(tile, key0, n, pitch):
    """scale_add_bias_frags_f32_t's reads (scale 1, without the log2(e)): S^T-shaped fragments."""
    at = key0 + 2 * T * pitch + G
    return [np.stack([tile[at + (8 * j + i % 2) * pitch + 8 * (i // 2)] for i in range(4)], axis=1)
            for j in range(n // 8)]


@pytest.mark.parametrize("head,bm,warps", [(32, 64, 4), (32, 32, 4), (64, 16, 4), (64, 32, 4), (128, 16, 4)])
def test_dkdv_step_fragments_give_the_gradients(head, bm, warps):
    """One step of flash_bwd_dkdv_tf32, every warp of the CTA, from shared memory to dK, dV and the
    dQ block: S^T, dP^T by the forward's qk GEMM with K / V as A, P^T and dS^T used as A of the pv
    GEMM in their C-fragment order, dS^T stored key-major (the kernel's ds_lane) and read back
    by warp_gemm_ds_k_tf32 with the warps splitting dQ by rows and columns (DkdvTf32Traits)."""
    rng = np.random.default_rng(head + bm)
    bn, pitch, ds_pitch = 16 * warps, head + 4, bm + 4
    k, v = rng.standard_normal((bn, head)), rng.standard_normal((bn, head))
    q, do = rng.standard_normal((bm, head)), rng.standard_normal((bm, head))
    lse, dsum = rng.uniform(2, 3, bm), rng.standard_normal(bm)
    k_s, v_s, q_s, do_s = (to_smem(x, pitch) for x in (k, v, q, do))
    ds_s = np.full(bn * ds_pitch, np.nan)
    dk, dv = np.zeros((bn, head)), np.zeros((bn, head))
    for warp in range(warps):
        key0 = 16 * warp
        st = from_frags(warp_qk(k_s, key0, q_s, bm, head, pitch))     # S^T: 16 keys x bm queries
        dpt = from_frags(warp_qk(v_s, key0, do_s, bm, head, pitch))   # dP^T
        pt = np.exp(st - lse[None, :])                                # (the kernel's exp2 of x: same map)
        dst = pt * (dpt - dsum[None, :])
        frags = lambda x: [np.stack([x[G, 8 * n + 2 * T], x[G, 8 * n + 2 * T + 1], x[G + 8, 8 * n + 2 * T],
                                     x[G + 8, 8 * n + 2 * T + 1]], axis=1) for n in range(bm // 8)]
        dv[key0:key0 + 16] = from_frags(warp_pv(frags(pt), do_s, head, pitch))
        dk[key0:key0 + 16] = from_frags(warp_pv(frags(dst), q_s, head, pitch))
        # ds_lane + 8 r DS_PITCH + 8 n: (key key0 + g + 8r, queries 8n + 2t, + 1), one 8-byte store.
        for n, c in enumerate(frags(dst)):
            for r in range(2):
                at = (key0 + G + 8 * r) * ds_pitch + 8 * n + 2 * T
                ds_s[at], ds_s[at + 1] = c[:, 2 * r], c[:, 2 * r + 1]
    p_full = np.exp(k @ q.T - lse[None, :])
    ds_full = p_full * (v @ do.T - dsum[None, :])                    # dS^T, keys x queries
    np.testing.assert_allclose(dv, p_full @ do, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dk, ds_full @ q, rtol=1e-10, atol=1e-10)
    # dQ: BM / 16 row strips x Q_SPLIT column blocks, one per warp, DQ_CHUNK columns at a time.
    q_split = warps // (bm // 16)
    dq_cols = head // q_split
    chunk = min(dq_cols, 32)
    dq = np.full((bm, head), np.nan)
    for warp in range(warps):
        strip = warp // q_split
        for c in range(dq_cols // chunk):
            col0 = (warp % q_split) * dq_cols + c * chunk
            part = from_frags(warp_ds_k(ds_s, strip * 16, k_s, col0, chunk, bn, ds_pitch, pitch))
            dq[16 * strip:16 * strip + 16, col0:col0 + chunk] = part
    np.testing.assert_allclose(dq, ds_full.T @ k, rtol=1e-10, atol=1e-10)


def test_dq_kernel_fragments_give_ds_k():
    """flash_bwd_dq_tf32: S = Q K^T and dP = dO V^T by the qk GEMM (Q, dO as A), dQ += dS K by the
    pv GEMM with K as its [key][column] B operand (the forward's O += P V with V := K)."""
    rng = np.random.default_rng(11)
    head, bn, pitch = 64, 32, 68
    q, do = rng.standard_normal((16, head)), rng.standard_normal((16, head))
    k, v = rng.standard_normal((bn, head)), rng.standard_normal((bn, head))
    lse, dsum = rng.uniform(2, 3, 16), rng.standard_normal(16)
    q_s, do_s, k_s, v_s = (to_smem(x, pitch) for x in (q, do, k, v))
    s = from_frags(warp_qk(q_s, 0, k_s, bn, head, pitch))
    dp = from_frags(warp_qk(do_s, 0, v_s, bn, head, pitch))
    ds = np.exp(s - lse[:, None]) * (dp - dsum[:, None])
    ds_frags = [np.stack([ds[G, 8 * n + 2 * T], ds[G, 8 * n + 2 * T + 1], ds[G + 8, 8 * n + 2 * T],
                          ds[G + 8, 8 * n + 2 * T + 1]], axis=1) for n in range(bn // 8)]
    dq = from_frags(warp_pv(ds_frags, k_s, head, pitch))
    want = (np.exp(q @ k.T - lse[:, None]) * (do @ v.T - dsum[:, None])) @ k
    np.testing.assert_allclose(dq, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bn", [32, 64])
def test_transposed_bias_reads_land_on_s_t(bn):
    """scale_add_bias_frags_f32_t: a [query][key] tile (pitch block_n + 4) read into the S^T
    fragments of each warp's 16 keys."""
    rng = np.random.default_rng(bn)
    bm, pitch = 32, bn + 4
    bias = rng.standard_normal((bm, bn))
    tile = to_smem(bias, pitch)
    for key0 in range(0, bn, 16):
        np.testing.assert_array_equal(from_frags(bias_frags_t(tile, key0, bm, pitch)), bias[:, key0:key0 + 16].T)


def test_dbias_fragment_map_and_one_row_sums():
    """add_dbias_frags_t_f32: element i of n8 tile n is (key key_first + g + 8 (i / 2), query
    m0 + 8n + 2t + i % 2); a one-row bias sums a key's queries over the lane, then its 4 lanes."""
    rng = np.random.default_rng(12)
    bm, m0, key_first = 32, 64, 16
    dst = rng.standard_normal((16, bm))   # one warp's dS^T: 16 keys x bm queries
    frags = [np.stack([dst[G, 8 * n + 2 * T], dst[G, 8 * n + 2 * T + 1], dst[G + 8, 8 * n + 2 * T],
                       dst[G + 8, 8 * n + 2 * T + 1]], axis=1) for n in range(bm // 8)]
    acc = np.zeros((m0 + bm, key_first + 16))
    for n, c in enumerate(frags):
        for i in range(4):
            acc[m0 + 8 * n + 2 * T + i % 2, key_first + G + 8 * (i // 2)] += c[:, i]
    np.testing.assert_array_equal(acc[m0:, key_first:], dst.T)
    for r in range(2):
        lane_sums = sum(c[:, 2 * r] + c[:, 2 * r + 1] for c in frags)
        key_sums = lane_sums.reshape(8, 4).sum(axis=1)   # group_sum<4>: the 4 lanes of key g (+ 8r)
        np.testing.assert_allclose(key_sums, dst[8 * r:8 * r + 8].sum(axis=1), rtol=1e-12)


@pytest.mark.parametrize("bm,bn", [(16, 64), (32, 64), (64, 64), (32, 32)])
def test_backward_shared_loads_are_conflict_free(bm, bn):
    """Transposed bias reads (pitch block_n + 4) and dQ's dS^T loads (pitch block_m + 4): each
    warp-wide 4-byte load on 32 different banks. dS^T's 8-byte stores from the fragments are a
    2-way conflict (documented in flash_bwd_tf32.cu; one store per element, read back per column block)."""
    for pitch in (bn + 4,):
        for i in range(4):   # scale_add_bias_frags_f32_t: word (8n + i % 2) P + 8 (i / 2) + 2t P + g
            words = (i % 2) * pitch + 8 * (i // 2) + 2 * T * pitch + G
            assert len(set(words % 32)) == 32
    pa = bm + 4
    for off in (0, 8, pa, pa + 8):   # warp_gemm_ds_k_tf32's a_at[0], [8], [PA], [PA + 8]
        assert len(set((2 * T * pa + G + off) % 32)) == 32
    words = G * pa + 2 * T   # the 8-byte stores, by half-warps: bank pair (word / 2) mod 16 per lane
    for half in (slice(0, 16), slice(16, 32)):
        assert np.bincount((words[half] // 2) % 16).max() == 2   # at most 2-way
