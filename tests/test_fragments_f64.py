"""The fp64 tensor-core backward's fragment arithmetic, lane by lane in NumPy (CPU).

kernels_cu/swizzle_f64.cuh and the swizzled GEMMs of warp_gemm_f64.cuh index shared
memory with per-lane formulas that no CPU compile can check. Here the same formulas
(transcribed, names as in the CUDA source) drive an emulated warp: mma.sync m8n8k4
with mma.cuh's fragment layout, shared memory as a flat array. A wrong lane mapping,
a swizzle that is not a permutation, or a bank conflict fails here without a GPU.
The dK/dV step of flash_bwd_dkdv_dmma (S^T, P^T, dS^T, dV, dK, and dQ through the dS
tile) is emulated for a whole CTA and compared with the NumPy gradients.
"""
import re

import numpy as np
import pytest

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


# --------------------------------------------------------------------------- swizzle_f64.cuh

def swz_xor(row):
    r = np.asarray(row) & 7
    return 4 * ((r & 2) | ((r ^ (r >> 2)) & 1))


def swz_offset(cols, row, col):
    return np.asarray(row) * cols + (np.asarray(col) ^ swz_xor(row))


def swz_col(col, x):
    return (np.asarray(col) & ~15) + ((np.asarray(col) & 15) ^ x)


def store_swz(tile):
    rows, cols = tile.shape
    smem = np.full(rows * cols, np.nan)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    smem[swz_offset(cols, r, c)] = tile
    return smem


# --------------------------------------------------------------------------- mma.cuh (m8n8k4, fp64)

def mma_884(c, a, b):
    """c (32, 2) += A B; lane (g, t) gives A[g][t] = a[lane], B[t][g] = b[lane], holds C[g][2t + i]."""
    A = np.zeros((8, 4))
    B = np.zeros((4, 8))
    A[G, T] = a
    B[T, G] = b
    C = A @ B
    c += np.stack([C[G, 2 * T], C[G, 2 * T + 1]], axis=1)


def frags_to_matrix(acc):
    """[M][N] C fragments (each (32, 2)) -> the (8M, 8N) matrix they hold."""
    M, N = len(acc), len(acc[0])
    out = np.zeros((8 * M, 8 * N))
    for m in range(M):
        for n in range(N):
            for i in range(2):
                out[8 * m + G, 8 * n + 2 * T + i] = acc[m][n][:, i]
    return out


def zero_frags(M, N):
    return [[np.zeros((32, 2)) for _ in range(N)] for _ in range(M)]


# --------------------------------------------------------------------------- warp_gemm_f64.cuh (swizzled)

def warp_gemm_nt_swz(acc, M, N, K, CA, CB, smem_a, a0, smem_b, b0):
    x = swz_xor(G)
    a_lane = a0 + G * CA + T
    b_lane = b0 + G * CB + T
    for k0 in range(0, K, 4):
        col = swz_col(k0, x)
        af = [smem_a[a_lane + 8 * m * CA + col] for m in range(M)]
        bf = [smem_b[b_lane + 8 * n * CB + col] for n in range(N)]
        for m in range(M):
            for n in range(N):
                mma_884(acc[m][n], af[m], bf[n])


def warp_gemm_rn_swz(acc, M, N, KT, CB, p, smem_b, b0):
    for s in range(2):
        x = swz_xor(2 * T + s)
        b_lane = b0 + (2 * T + s) * CB
        for kt in range(KT):
            for n in range(N):
                bf = smem_b[b_lane + 8 * kt * CB + swz_col(8 * n + G, x)]
                for m in range(M):
                    mma_884(acc[m][n], p[m][kt][:, s], bf)


def warp_gemm_nn_swz(acc, M, N, K, CA, CB, smem_a, a0, smem_b, b0, n_first):
    xa = swz_xor(G)
    a_lane = a0 + G * CA + T
    b_lane = b0 + T * CB
    for k0 in range(0, K, 4):
        xb = swz_xor(k0 + T)
        af = [smem_a[a_lane + 8 * m * CA + swz_col(k0, xa)] for m in range(M)]
        bf = [smem_b[b_lane + k0 * CB + swz_col(8 * (n_first + n) + G, xb)] for n in range(N)]
        for m in range(M):
            for n in range(N):
                mma_884(acc[m][n], af[m], bf[n])


# --------------------------------------------------------------------------- WIDE_K (sm_90 m16n8kK)

def mma_16x8(c_top, c_bot, a_top, a_bot, b):
    """mma.m16n8kK.f64 from the PTX layout (K = 4 len(b)): a[2j] = A[g][t + 4j], a[2j + 1] =
    A[g + 8][t + 4j], b[j] = B[t + 4j][g]; C[g][2t + i] in c_top, C[g + 8][2t + i] in c_bot."""
    k = 4 * len(b)
    A, B = np.zeros((16, k)), np.zeros((k, 8))
    for j in range(len(b)):
        A[G, T + 4 * j], A[G + 8, T + 4 * j], B[T + 4 * j, G] = a_top[j], a_bot[j], b[j]
    C = A @ B
    c_top += np.stack([C[G, 2 * T], C[G, 2 * T + 1]], axis=1)
    c_bot += np.stack([C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], axis=1)


def warp_gemm_nt_f64_wide(acc, M, N, K, PA, PB, smem_a, smem_b, wide_k):
    k4 = wide_k // 4
    a_lane, b_lane = G * PA + T, G * PB + T
    for k0 in range(0, K, wide_k):
        af = [[smem_a[a_lane + 8 * m * PA + k0 + 4 * j] for j in range(k4)] for m in range(M)]
        bf = [[smem_b[b_lane + 8 * n * PB + k0 + 4 * j] for j in range(k4)] for n in range(N)]
        for m in range(0, M, 2):
            for n in range(N):
                mma_16x8(acc[m][n], acc[m + 1][n], af[m], af[m + 1], bf[n])


def warp_gemm_rn_f64_wide(acc, M, N, KT, PB, p, smem_b, wide_k):
    k4 = wide_k // 4
    b_lane = 2 * T * PB + G
    for q0 in range(0, 2 * KT, k4):
        for n in range(N):
            bf = [smem_b[b_lane + (8 * ((q0 + j) // 2) + (q0 + j) % 2) * PB + 8 * n] for j in range(k4)]
            for m in range(0, M, 2):
                top = [p[m][(q0 + j) // 2][:, (q0 + j) % 2] for j in range(k4)]
                bot = [p[m + 1][(q0 + j) // 2][:, (q0 + j) % 2] for j in range(k4)]
                mma_16x8(acc[m][n], acc[m + 1][n], top, bot, bf)


def warp_gemm_nt_swz_wide(acc, M, N, K, CA, CB, smem_a, a0, smem_b, b0, wide_k):
    k4, x = wide_k // 4, swz_xor(G)
    a_lane, b_lane = a0 + G * CA + T, b0 + G * CB + T
    for k0 in range(0, K, wide_k):
        cols = [swz_col(k0 + 4 * j, x) for j in range(k4)]
        af = [[smem_a[a_lane + 8 * m * CA + cols[j]] for j in range(k4)] for m in range(M)]
        bf = [[smem_b[b_lane + 8 * n * CB + cols[j]] for j in range(k4)] for n in range(N)]
        for m in range(0, M, 2):
            for n in range(N):
                mma_16x8(acc[m][n], acc[m + 1][n], af[m], af[m + 1], bf[n])


def warp_gemm_rn_swz_wide(acc, M, N, KT, CB, p, smem_b, b0, wide_k):
    k4 = wide_k // 4
    x = [swz_xor(2 * T), swz_xor(2 * T + 1)]
    b_lane = [b0 + 2 * T * CB, b0 + (2 * T + 1) * CB]
    for q0 in range(0, 2 * KT, k4):
        for n in range(N):
            bf = []
            for j in range(k4):
                kt, s_ = (q0 + j) // 2, (q0 + j) % 2
                bf.append(smem_b[b_lane[s_] + 8 * kt * CB + swz_col(8 * n + G, x[s_])])
            for m in range(0, M, 2):
                top = [p[m][(q0 + j) // 2][:, (q0 + j) % 2] for j in range(k4)]
                bot = [p[m + 1][(q0 + j) // 2][:, (q0 + j) % 2] for j in range(k4)]
                mma_16x8(acc[m][n], acc[m + 1][n], top, bot, bf)


def warp_gemm_nn_swz_wide(acc, M, N, K, CA, CB, smem_a, a0, smem_b, b0, n_first, wide_k):
    k4, xa = wide_k // 4, swz_xor(G)
    a_lane, b_lane = a0 + G * CA + T, b0 + T * CB
    for k0 in range(0, K, wide_k):
        af = [[None] * k4 for _ in range(M)]
        bf = [[None] * k4 for _ in range(N)]
        for j in range(k4):
            k = k0 + 4 * j
            xb = swz_xor(k + T)
            for m in range(M):
                af[m][j] = smem_a[a_lane + 8 * m * CA + swz_col(k, xa)]
            for n in range(N):
                bf[n][j] = smem_b[b_lane + k * CB + swz_col(8 * (n_first + n) + G, xb)]
        for m in range(0, M, 2):
            for n in range(N):
                mma_16x8(acc[m][n], acc[m + 1][n], af[m], af[m + 1], bf[n])


def c_frags(p, M, KT):
    """The (8M, 8KT) matrix p as [M][KT] C fragments."""
    return [[np.stack([p[8 * m + G, 8 * kt + 2 * T], p[8 * m + G, 8 * kt + 2 * T + 1]], axis=1) for kt in range(KT)]
            for m in range(M)]


# --------------------------------------------------------------------------- tests

def test_m16n8k4_is_two_stacked_m8n8k4():
    """mma_16x8's layout (PTX ISA) against mma.cuh's m8n8k4: the identity WIDE_K rests on."""
    rng = np.random.default_rng(5)
    a_top, a_bot, b = (rng.standard_normal(32) for _ in range(3))
    wide_top, wide_bot, top, bot = (np.zeros((32, 2)) for _ in range(4))
    mma_16x8(wide_top, wide_bot, [a_top], [a_bot], [b])
    mma_884(top, a_top, b)
    mma_884(bot, a_bot, b)
    np.testing.assert_allclose(wide_top, top, rtol=1e-15)
    np.testing.assert_allclose(wide_bot, bot, rtol=1e-15)


def _mma_16x8_asm(k4):
    """mma.cuh's mma_16x8_f64<k4>: (PTX shape, the asm's register groups as lists of operand numbers, and
    the C++ expression bound to each operand number), read from the source the kernels build."""
    from cuflash._runtime.build import kernel_dir

    src = (kernel_dir() / "mma.cuh").read_text()
    body = re.search(r"void mma_16x8_f64<%d>\(.*?\n}" % k4, src, re.S).group(0)
    asm = re.search(r'asm volatile\((.*?);"\s*:', body, re.S).group(1)
    shape = re.search(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)\.row\.col\.f64\.f64\.f64\.f64", asm).group(1)
    groups = [[int(x) for x in re.findall(r"%(\d+)", g)] for g in re.findall(r"\{([^}]*)\}", asm)]
    exprs = re.findall(r'"\+?d"\(([^)]*)\)', body)
    return shape, groups, exprs


@pytest.mark.parametrize("k4", [1, 2, 4])
def test_mma_16x8_asm_operands_follow_the_ptx_register_order(k4):
    """The asm's operand order against the PTX ISA's per-register formulas for .f64 m16n8kK (as CUTLASS's
    SM90_16x8xK_F64 traits give them), not against the stacked reading mma.cuh documents: A register i
    holds (row g + 8 (i % 2), k t + 4 (i // 2)), B register i (k t + 4 i, n g), C/D register i
    (row g + 8 (i // 2), n 2t + i % 2). Then one MMA built from those formulas and the operands' values
    equals two m8n8k4 per k4 step: a swapped operand in mma.cuh fails here, where the emulated
    GEMMs (which take mma_16x8's argument lists as given) cannot see it."""
    shape, groups, exprs = _mma_16x8_asm(k4)
    assert shape == f"m16n8k{4 * k4}"
    d, a, b, c = groups
    assert d == c == [0, 1, 2, 3], "D and C: the four accumulators, in place"
    assert a == list(range(4, 4 + 2 * k4)) and b == list(range(4 + 2 * k4, 4 + 3 * k4))
    # The expected expression of each register from the ISA's row/column of that register.
    for i in range(4):
        assert exprs[d[i]] == f"c_{'top' if i // 2 == 0 else 'bot'}[{i % 2}]", (i, exprs)
    for i in range(2 * k4):
        assert exprs[a[i]] == f"a_{'top' if i % 2 == 0 else 'bot'}[{i // 2}]", (i, exprs)
    for i in range(k4):
        assert exprs[b[i]] == f"b[{i}]", (i, exprs)
    # Numerically: lane values per C++ name, placed by the ISA formulas, against m8n8k4 per k4 step.
    rng = np.random.default_rng(9)
    vals = {f"{x}[{j}]": rng.standard_normal(32) for x in ("a_top", "a_bot", "b") for j in range(k4)}
    vals.update({f"c_{x}[{i}]": rng.standard_normal(32) for x in ("top", "bot") for i in range(2)})
    A, B, C = np.zeros((16, 4 * k4)), np.zeros((4 * k4, 8)), np.zeros((16, 8))
    for i in range(2 * k4):
        A[G + 8 * (i % 2), T + 4 * (i // 2)] = vals[exprs[a[i]]]
    for i in range(k4):
        B[T + 4 * i, G] = vals[exprs[b[i]]]
    for i in range(4):
        C[G + 8 * (i // 2), 2 * T + i % 2] = vals[exprs[c[i]]]
    D = A @ B + C
    top = np.stack([vals["c_top[0]"], vals["c_top[1]"]], axis=1)
    bot = np.stack([vals["c_bot[0]"], vals["c_bot[1]"]], axis=1)
    for j in range(k4):
        mma_884(top, vals[f"a_top[{j}]"], vals[f"b[{j}]"])
        mma_884(bot, vals[f"a_bot[{j}]"], vals[f"b[{j}]"])
    np.testing.assert_allclose(np.stack([D[G, 2 * T], D[G, 2 * T + 1]], axis=1), top, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(np.stack([D[G + 8, 2 * T], D[G + 8, 2 * T + 1]], axis=1), bot, rtol=1e-13,
                               atol=1e-13)


@pytest.mark.parametrize("wide_k", [4, 8, 16])
@pytest.mark.parametrize("M,N,head", [(2, 4, 64), (2, 4, 128), (4, 2, 32)])
def test_wide_padded_gemms(wide_k, M, N, head):
    """fwd_dmma's S = Q K^T (pitch head + 4) and O += P V (pitch head + 2) with WIDE_K."""
    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((8 * M, head)), rng.standard_normal((8 * N, head))
    pq, pk = np.zeros((8 * M, head + 4)), np.zeros((8 * N, head + 4))
    pq[:, :head], pk[:, :head] = q, k
    acc = zero_frags(M, N)
    warp_gemm_nt_f64_wide(acc, M, N, head, head + 4, head + 4, pq.ravel(), pk.ravel(), wide_k)
    np.testing.assert_allclose(frags_to_matrix(acc), q @ k.T, rtol=1e-12, atol=1e-12)
    p, v = rng.standard_normal((8 * M, 8 * N)), rng.standard_normal((8 * N, head))
    pv = np.zeros((8 * N, head + 2))
    pv[:, :head] = v
    acc = zero_frags(M, head // 8)
    warp_gemm_rn_f64_wide(acc, M, head // 8, N, head + 2, c_frags(p, M, N), pv.ravel(), wide_k)
    np.testing.assert_allclose(frags_to_matrix(acc), p @ v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wide_k", [4, 8, 16])
def test_wide_swizzled_gemms(wide_k):
    """The backward's three swizzled GEMMs with WIDE_K, tiles starting past row 0 as the kernels' do."""
    rng = np.random.default_rng(7)
    M, N, K = 2, 2, 64
    a, b = rng.standard_normal((8 * M + 8, K)), rng.standard_normal((8 * N + 16, K))
    acc = zero_frags(M, N)
    warp_gemm_nt_swz_wide(acc, M, N, K, K, K, store_swz(a), 8 * K, store_swz(b), 16 * K, wide_k)
    np.testing.assert_allclose(frags_to_matrix(acc), a[8:8 + 8 * M] @ b[16:16 + 8 * N].T, rtol=1e-12, atol=1e-12)
    KT, NO = 2, 8
    p, v = rng.standard_normal((8 * M, 8 * KT)), rng.standard_normal((8 * KT, 8 * NO))
    acc = zero_frags(M, NO)
    warp_gemm_rn_swz_wide(acc, M, NO, KT, 8 * NO, c_frags(p, M, KT), store_swz(v), 0, wide_k)
    np.testing.assert_allclose(frags_to_matrix(acc), p @ v, rtol=1e-12, atol=1e-12)
    a, b = rng.standard_normal((8 * M, K)), rng.standard_normal((K, 64))
    acc = zero_frags(M, 2)
    warp_gemm_nn_swz_wide(acc, M, 2, K, K, 64, store_swz(a), 0, store_swz(b), 0, 3, wide_k)
    np.testing.assert_allclose(frags_to_matrix(acc), a @ b[:, 24:40], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("wide_k", [4, 8, 16])
def test_head_split_column_halves(wide_k):
    """flash_bwd_dkdv_dmma's HEAD_SPLIT: a warp's dV += P^T dO over half of dO's 128 columns reads the swizzled tile
    from its base plus col0 (a multiple of 16, so inside the tile's own layout), and the two halves make P^T dO."""
    rng = np.random.default_rng(11)
    M, KT, head = 2, 2, 128
    p, do = rng.standard_normal((8 * M, 8 * KT)), rng.standard_normal((8 * KT, head))
    smem = store_swz(do)
    halves = []
    for col0 in (0, head // 2):
        acc = zero_frags(M, head // 16)
        warp_gemm_rn_swz_wide(acc, M, head // 16, KT, head, c_frags(p, M, KT), smem, col0, wide_k)
        halves.append(frags_to_matrix(acc))
    np.testing.assert_allclose(np.concatenate(halves, axis=1), p @ do, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cols", [16, 32, 64, 128])
def test_swizzle_is_a_permutation_that_keeps_chunks_whole(cols):
    rows = 24
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = swz_offset(cols, r, c)
    assert sorted(off.ravel()) == list(range(rows * cols))
    assert (off // cols == r).all()                        # stays in its row
    assert (off[:, 1::2] == off[:, ::2] + 1).all()         # chunk (c even, c + 1) stays whole
    assert (off[:, ::2] % 2 == 0).all()                    # and 16-byte aligned


def _passes(offsets):
    """Shared-memory passes of one warp-wide 8-byte load: each half-warp needs as many passes
    as the most lanes that hit one 8-byte bank pair (offset mod 16) with different addresses."""
    worst = 0
    for half in (offsets[:16], offsets[16:]):
        pairs = {}
        for o in set(int(v) for v in half):
            pairs[o % 16] = pairs.get(o % 16, 0) + 1
        worst += max(pairs.values())
    return worst


@pytest.mark.parametrize("cols", [16, 32, 64, 128])
def test_swizzled_fragment_reads_are_conflict_free(cols):
    for r0 in range(0, 32, 8):                             # tiles start at 8-row groups
        for k0 in range(0, cols, 4):                       # (row g, column k0 + t): nt / nn A operands
            assert _passes(swz_offset(cols, r0 + G, k0 + T)) == 2
            assert _passes(swz_offset(cols, r0 + k0 % 8 + T, (k0 // 8 % (cols // 8)) * 8 + G)) == 2   # nn B
        for n in range(cols // 8):                         # (row 2t + s, column 8n + g): rn B, dS stores
            for s in range(2):
                assert _passes(swz_offset(cols, r0 + 2 * T + s, 8 * n + G)) == 2


def test_transposed_bias_pitch_is_conflict_free():
    for bn in (16, 32, 64):
        pitch = bn + 2                                     # DkdvDmmaTraits::BIAS_PITCH
        for n in range(2):
            for i in range(2):
                assert _passes((8 * n + 2 * T + i) * pitch + G) == 2


@pytest.mark.parametrize("M,N,K,CA", [(2, 2, 64, 64), (1, 4, 32, 32), (2, 1, 128, 128)])
def test_swizzled_nt_gemm(M, N, K, CA):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8 * M + 8, K)), rng.standard_normal((8 * N + 16, K))
    acc = zero_frags(M, N)
    warp_gemm_nt_swz(acc, M, N, K, K, K, store_swz(a), 8 * K, store_swz(b), 16 * K)   # from row 8 / row 16
    np.testing.assert_allclose(frags_to_matrix(acc), a[8:8 + 8 * M] @ b[16:16 + 8 * N].T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("M,N,KT", [(2, 8, 2), (1, 16, 4), (2, 4, 1)])
def test_swizzled_rn_gemm_with_permuted_keys(M, N, KT):
    rng = np.random.default_rng(1)
    p = rng.standard_normal((8 * M, 8 * KT))
    b = rng.standard_normal((8 * KT, 8 * N))
    pf = [[np.stack([p[8 * m + G, 8 * kt + 2 * T], p[8 * m + G, 8 * kt + 2 * T + 1]], axis=1) for kt in range(KT)]
          for m in range(M)]
    acc = zero_frags(M, N)
    warp_gemm_rn_swz(acc, M, N, KT, 8 * N, pf, store_swz(b), 0)
    np.testing.assert_allclose(frags_to_matrix(acc), p @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("M,N,K,n_first,cols", [(2, 2, 64, 2, 64), (4, 1, 64, 3, 32), (1, 4, 32, 4, 128)])
def test_swizzled_nn_gemm(M, N, K, n_first, cols):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((8 * M, K)), rng.standard_normal((K, cols))
    acc = zero_frags(M, N)
    warp_gemm_nn_swz(acc, M, N, K, K, cols, store_swz(a), 0, store_swz(b), 0, n_first)
    want = a @ b[:, 8 * n_first:8 * (n_first + N)]
    np.testing.assert_allclose(frags_to_matrix(acc), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("head,bm,bn,warps", [(32, 32, 64, 4), (64, 16, 64, 4), (64, 16, 32, 4), (128, 16, 32, 4)])
def test_dkdv_step_emulated(head, bm, bn, warps):
    """One step of flash_bwd_dkdv_dmma (a plain tile, no masking) for every warp of a CTA:
    dV, dK and the CTA's dQ contribution against NumPy's backward of the same tile."""
    rng = np.random.default_rng(head + bm)
    M, QT, D_TILES = bn // (8 * warps), bm // 8, head // 8
    DQ_TILES = D_TILES // warps
    q, k, v, do = (rng.standard_normal(s) for s in ((bm, head), (bn, head), (bn, head), (bm, head)))
    scale = 1 / np.sqrt(head)
    s = q @ k.T * scale
    lse = np.log(np.exp(s).sum(1))
    p = np.exp(s - lse[:, None])
    dsum = rng.standard_normal(bm)
    dp = do @ v.T
    ds = p * (dp - dsum[:, None])

    q_s, do_s, k_s, v_s = (store_swz(x) for x in (q, do, k, v))
    lse_s = lse * np.log2(np.e)                            # load_row_stats: lse in log2 units
    scale_log2 = scale * np.log2(np.e)                     # x_per_s of the plain kernel
    ds_s = np.full(bm * bn, np.nan)
    dk = np.zeros((bn, head))
    dv = np.zeros((bn, head))
    for warp in range(warps):
        key0 = warp * 8 * M
        st, dpt = zero_frags(M, QT), zero_frags(M, QT)
        warp_gemm_nt_swz(st, M, QT, head, head, head, k_s, key0 * head, q_s, 0)
        warp_gemm_nt_swz(dpt, M, QT, head, head, head, v_s, key0 * head, do_s, 0)
        for m in range(M):
            for n in range(QT):
                qq = 8 * n + 2 * T                         # prob_and_dscore_t: the lane's query pair
                for i in range(2):
                    pt = np.exp2(st[m][n][:, i] * scale_log2 - lse_s[qq + i])
                    dpt[m][n][:, i] = pt * (dpt[m][n][:, i] - dsum[qq + i])
                    st[m][n][:, i] = pt
                    ds_s[swz_offset(bn, 8 * n + 2 * T + i, key0 + 8 * m + G)] = dpt[m][n][:, i]
        acc_dv, acc_dk = zero_frags(M, D_TILES), zero_frags(M, D_TILES)
        warp_gemm_rn_swz(acc_dv, M, D_TILES, QT, head, st, do_s, 0)
        warp_gemm_rn_swz(acc_dk, M, D_TILES, QT, head, dpt, q_s, 0)
        for m in range(M):                                 # the epilogue's (key, column) of each element
            for n in range(D_TILES):
                for i in range(2):
                    key, col = key0 + 8 * m + G, 8 * n + 2 * T + i
                    dv[key, col] = acc_dv[m][n][:, i]
                    dk[key, col] = acc_dk[m][n][:, i] * scale
    np.testing.assert_allclose(dv, p.T @ do, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dk, scale * ds.T @ q, rtol=1e-10, atol=1e-12)
    assert not np.isnan(ds_s).any()                        # every dS entry written once
    dq = np.zeros((bm, head))
    for warp in range(warps):
        tile0 = warp * DQ_TILES
        part = zero_frags(QT, DQ_TILES)
        warp_gemm_nn_swz(part, QT, DQ_TILES, bn, bn, head, ds_s, 0, k_s, 0, tile0)
        for r in range(QT):
            for n in range(DQ_TILES):
                for i in range(2):
                    dq[8 * r + G, 8 * (tile0 + n) + 2 * T + i] += part[r][n][:, i] * scale
    np.testing.assert_allclose(dq, scale * ds @ k, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("head,bm,bn,warps", [(64, 64, 16, 4), (128, 16, 16, 2), (32, 64, 32, 4)])
def test_dq_step_emulated(head, bm, bn, warps):
    """One key tile of flash_bwd_dq_dmma for every warp: dQ += dS K against NumPy."""
    rng = np.random.default_rng(head + bn)
    M, S_TILES, D_TILES = bm // (8 * warps), bn // 8, head // 8
    q, k, v, do = (rng.standard_normal(s) for s in ((bm, head), (bn, head), (bn, head), (bm, head)))
    scale = 1 / np.sqrt(head)
    s = q @ k.T * scale
    lse = np.log(np.exp(s).sum(1)) + 0.5
    p = np.exp(s - lse[:, None])
    dsum = rng.standard_normal(bm)
    ds = p * (do @ v.T - dsum[:, None])
    q_s, do_s, k_s, v_s = (store_swz(x) for x in (q, do, k, v))
    scale_log2 = scale * np.log2(np.e)
    dq = np.zeros((bm, head))
    for warp in range(warps):
        row0 = warp * 8 * M
        sf, dpf = zero_frags(M, S_TILES), zero_frags(M, S_TILES)
        warp_gemm_nt_swz(sf, M, S_TILES, head, head, head, q_s, row0 * head, k_s, 0)
        warp_gemm_nt_swz(dpf, M, S_TILES, head, head, head, do_s, row0 * head, v_s, 0)
        for m in range(M):
            row = row0 + 8 * m + G
            for n in range(S_TILES):
                for i in range(2):
                    pp = np.exp2(sf[m][n][:, i] * scale_log2 - lse[row] * np.log2(np.e))
                    dpf[m][n][:, i] = pp * (dpf[m][n][:, i] - dsum[row])
        acc = zero_frags(M, D_TILES)
        warp_gemm_rn_swz(acc, M, D_TILES, S_TILES, head, dpf, k_s, 0)
        dq[row0:row0 + 8 * M] = frags_to_matrix(acc) * scale
    np.testing.assert_allclose(dq, scale * ds @ k, rtol=1e-10, atol=1e-12)
