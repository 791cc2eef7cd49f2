"""The 16-bit tensor-core dK/dV kernel's fragment arithmetic, lane by lane in NumPy (CPU).

flash_bwd_dkdv_mma (kernels_cu/flash_bwd_mma.cu) indexes shared memory with per-lane
formulas that no CPU compile can check: warp_gemm.cuh's ldmatrix lane addresses, its
key strips (KEY_STRIPS), the key-major dS^T stores and the transposed A operand that
reads them back for dQ. Here the same formulas (transcribed, names as in the CUDA
source) drive an emulated warp: ldmatrix (.trans) and mma.sync m16n8k16 with mma.cuh's
fragment layouts, shared memory as a flat array of elements. Values stay float64 (no
16-bit rounding), so a wrong lane mapping shows as a wrong gradient, not as noise.
"""
import numpy as np
import pytest

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


# --------------------------------------------------------------------------- mma.cuh (m16n8k16)

def ldmatrix_x4(smem, row_addr, trans=False):
    """Four 8 x 8 matrices; lanes 8j..8j+7 give the row addresses (in elements) of matrix j.
    Register j of a lane holds two elements of matrix j: (row g, columns 2t, 2t + 1), or with
    .trans (rows 2t, 2t + 1, column g). Each register is a (32, 2) array (low, high half)."""
    regs = []
    for j in range(4):
        rows = row_addr[8 * j:8 * j + 8]                          # the 8 row addresses of matrix j
        mat = np.stack([smem[r:r + 8] for r in rows])             # mat[row][col]
        if trans:
            regs.append(np.stack([mat[2 * T, G], mat[2 * T + 1, G]], axis=1))
        else:
            regs.append(np.stack([mat[G, 2 * T], mat[G, 2 * T + 1]], axis=1))
    return regs


def mma_16816(c, a, b0, b1):
    """c (32, 4) += A B. A: a0 (row g, k 2t..), a1 (row g + 8), a2 (k + 8), a3 (both);
    B: b0 (k 2t.., column g), b1 (k + 8); C: c0, c1 (row g, columns 2t..), c2, c3 (row g + 8)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for e in range(2):
        A[G, 2 * T + e] = a[0][:, e]
        A[G + 8, 2 * T + e] = a[1][:, e]
        A[G, 2 * T + 8 + e] = a[2][:, e]
        A[G + 8, 2 * T + 8 + e] = a[3][:, e]
        B[2 * T + e, G] = b0[:, e]
        B[2 * T + 8 + e, G] = b1[:, e]
    C = A @ B
    c += np.stack([C[G, 2 * T], C[G, 2 * T + 1], C[G + 8, 2 * T], C[G + 8, 2 * T + 1]], axis=1)


def zero_frags(M, N):
    return [[np.zeros((32, 4)) for _ in range(N)] for _ in range(M)]


def frag_row(i):
    return G + 8 * (i // 2)


def frag_col(n, i):
    return 8 * n + 2 * T + i % 2


# --------------------------------------------------------------------------- warp_gemm.cuh

def a_lane_addr(strip, pa):
    return strip + (LANES % 16) * pa + (LANES // 16) * 8


def bt_lane_addr(rows, pb):
    return rows + ((LANES // 16) * 8 + LANES % 8) * pb + ((LANES // 8) % 2) * 8


def b_lane_addr(rows, pb):
    return rows + (((LANES // 8) % 2) * 8 + LANES % 8) * pb + (LANES // 16) * 8


def at_lane_addr(strip, pa):
    return strip + ((LANES // 16) * 8 + LANES % 8) * pa + ((LANES // 8) % 2) * 8


def warp_gemm_strips(acc, M, N, K, PB, B_KN, load_a, smem, b):
    """acc[m] (16 x N) += A_m (16 x K) B; B in smem as rows [k][n] (B_KN) or [n][k]."""
    b_addr = b_lane_addr(b, PB) if B_KN else bt_lane_addr(b, PB)
    for k0 in range(0, K, 16):
        af = [load_a(m, k0) for m in range(M)]
        for n0 in range(0, N, 16):
            bf = ldmatrix_x4(smem, b_addr + (k0 * PB + n0 if B_KN else n0 * PB + k0), trans=B_KN)
            for m in range(M):
                mma_16816(acc[m][n0 // 8], af[m], bf[0], bf[1])
                mma_16816(acc[m][n0 // 8 + 1], af[m], bf[2], bf[3])


def warp_gemm_strips_smem(acc, M, N, K, PA, PB, B_KN, smem, a, b):
    a_addr = a_lane_addr(a, PA)
    warp_gemm_strips(acc, M, N, K, PB, B_KN, lambda m, k0: ldmatrix_x4(smem, a_addr + m * 16 * PA + k0), smem, b)


def warp_gemm_strips_smem_t(acc, M, N, K, PA, PB, B_KN, smem, at, b):
    a_addr = at_lane_addr(at, PA)
    warp_gemm_strips(acc, M, N, K, PB, B_KN,
                     lambda m, k0: ldmatrix_x4(smem, a_addr + m * 16 + k0 * PA, trans=True), smem, b)


def warp_gemm_strips_rn16(acc, M, N, K, PB, p16, smem, b):
    def load_a(m, k0):
        t = k0 // 8
        return [p16[m][t][0], p16[m][t][1], p16[m][t + 1][0], p16[m][t + 1][1]]
    warp_gemm_strips(acc, M, N, K, PB, True, load_a, smem, b)


# --------------------------------------------------------------------------- the CTA's shared memory

class Smem:
    """flash_bwd_dkdv_mma's carve-up (one Q/dO stage): K, V, Q, dO rows of pitch HEAD + 8,
    then dS^T as [key][query] with pitch BM + 8, then (QSPLIT 2) P^T in the same layout.
    Offsets in elements."""

    def __init__(self, head, bm, bn, qsplit=1):
        self.P, self.DS_PITCH = head + 8, bm + 8
        self.k_s = 0
        self.v_s = self.k_s + bn * self.P
        self.q_s = self.v_s + bn * self.P
        self.do_s = self.q_s + bm * self.P
        self.ds_s = self.do_s + bm * self.P
        self.pt_s = self.ds_s + bn * self.DS_PITCH
        self.mem = np.full(self.pt_s + (bn * self.DS_PITCH if qsplit > 1 else 0), np.nan)

    def put(self, at, tile, pitch):
        for r, row in enumerate(tile):
            self.mem[at + r * pitch:at + r * pitch + len(row)] = row


def _problem(head, bm, bn, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(s) for s in ((bm, head), (bn, head), (bn, head), (bm, head)))
    scale = 1 / np.sqrt(head)
    s = q @ k.T * scale
    lse = np.log(np.exp(s).sum(1)) + 0.25
    dsum = rng.standard_normal(bm)
    return q, k, v, do, scale, lse, dsum


# (head, BM, BN, WARPS, QSPLIT): the table's tiles (two 16-key strips a warp at d=64; at d=128
# two warps a 32-key group sharing P^T / dS^T through shared memory), the one-pass 8-warp d=128
# tile before it, the one-strip layout before that, and the 99 KB alternative at d=128.
TILES = [(64, 32, 128, 4, 1), (128, 64, 128, 8, 2), (128, 32, 128, 8, 1), (128, 32, 64, 4, 1), (64, 64, 64, 4, 1),
         (32, 64, 64, 4, 1), (64, 16, 128, 4, 1), (64, 64, 128, 8, 2), (128, 32, 64, 4, 2)]


@pytest.mark.parametrize("head,bm,bn,warps,qsplit", TILES)
def test_dkdv_step_emulated(head, bm, bn, warps, qsplit):
    """One unmasked step of flash_bwd_dkdv_mma for every warp of a CTA (the kernel's
    formulas: KEY_STRIPS key strips a warp, QSPLIT warps a strip, P^T / dS^T packed in
    pack_frags' layout, dS^T (and with QSPLIT 2, P^T) stored key-major, the dV / dK A operands
    read back from there, dQ's A operand read back transposed) against NumPy's gradients."""
    q, k, v, do, scale, lse, dsum = _problem(head, bm, bn, head + bm + bn)
    p = np.exp(q @ k.T * scale - lse[:, None])
    ds = p * (do @ v.T - dsum[:, None])

    QS = qsplit                                                   # DkdvMmaTraits
    KEY_GROUPS = warps // QS
    M = bn // (16 * KEY_GROUPS)                                   # KEY_STRIPS
    WARP_KEYS = 16 * M
    WQ, WC = bm // QS, head // QS                                 # WARP_QUERIES, WARP_COLS
    DQ_STRIPS = QS
    Q_SPLIT = warps // (bm // (16 * DQ_STRIPS))
    DQ_COLS = head // Q_SPLIT
    DQ_CHUNK = min(DQ_COLS, 32)
    sm = Smem(head, bm, bn, QS)
    P, DS_PITCH = sm.P, sm.DS_PITCH
    for at, tile in ((sm.k_s, k), (sm.v_s, v), (sm.q_s, q), (sm.do_s, do)):
        sm.put(at, tile, P)
    lse_log2 = lse * np.log2(np.e)                                # load_row_stats
    x_per_s = scale * np.log2(np.e)                               # ScoreMod::x_per_score (plain kernel)

    def place(warp):                                              # half, key0, q0, c0
        half = warp // KEY_GROUPS if QS > 1 else 0
        return half, (warp % KEY_GROUPS if QS > 1 else warp) * WARP_KEYS, half * WQ, half * WC

    dk, dv = np.full((bn, head), np.nan), np.full((bn, head), np.nan)
    packed = {}
    for warp in range(warps):                                     # up to the barrier (QSPLIT 2)
        half, key0, q0, c0 = place(warp)
        st, dpt = zero_frags(M, WQ // 8), zero_frags(M, WQ // 8)
        warp_gemm_strips_smem(st, M, WQ, head, P, P, False, sm.mem, sm.k_s + key0 * P, sm.q_s + q0 * P)   # S^T
        warp_gemm_strips_smem(dpt, M, WQ, head, P, P, False, sm.mem, sm.v_s + key0 * P, sm.do_s + q0 * P)  # dP^T
        pt16 = [[[None, None] for _ in range(WQ // 8)] for _ in range(M)]
        dst16 = [[[None, None] for _ in range(WQ // 8)] for _ in range(M)]
        frag_at = (key0 + G) * DS_PITCH + q0 + 2 * T
        for n in range(WQ // 8):
            for m in range(M):
                for i in range(4):
                    row = q0 + frag_col(n, i)                     # the lane's query
                    pr = np.exp2(st[m][n][:, i] * x_per_s - lse_log2[row])
                    dpt[m][n][:, i] = pr * (dpt[m][n][:, i] - dsum[row])
                    st[m][n][:, i] = pr
                for r in range(2):
                    pt16[m][n][r] = st[m][n][:, 2 * r:2 * r + 2].copy()
                    dst16[m][n][r] = dpt[m][n][:, 2 * r:2 * r + 2].copy()
                    word = frag_at + (16 * m + 8 * r) * DS_PITCH + 8 * n   # one 32-bit store: two queries
                    for base, frag in ((sm.ds_s, dst16), (sm.pt_s, pt16))[:1 + (QS > 1)]:
                        sm.mem[base + word] = frag[m][n][r][:, 0]
                        sm.mem[base + word + 1] = frag[m][n][r][:, 1]
        packed[warp] = (pt16, dst16)
    acc = {}
    for warp in range(warps):                                     # after it
        half, key0, q0, c0 = place(warp)
        acc_dv, acc_dk = zero_frags(M, WC // 8), zero_frags(M, WC // 8)
        if QS > 1:
            warp_gemm_strips_smem(acc_dv, M, WC, bm, DS_PITCH, P, True, sm.mem, sm.pt_s + key0 * DS_PITCH,
                                  sm.do_s + c0)                   # dV += P^T dO
            warp_gemm_strips_smem(acc_dk, M, WC, bm, DS_PITCH, P, True, sm.mem, sm.ds_s + key0 * DS_PITCH,
                                  sm.q_s + c0)                    # dK += dS^T Q
        else:
            pt16, dst16 = packed[warp]
            warp_gemm_strips_rn16(acc_dv, M, head, bm, P, pt16, sm.mem, sm.do_s)    # dV += P^T dO
            warp_gemm_strips_rn16(acc_dk, M, head, bm, P, dst16, sm.mem, sm.q_s)    # dK += dS^T Q
        acc[warp] = (acc_dk, acc_dv)
    for warp, (acc_dk, acc_dv) in acc.items():                   # the epilogue's (key, column)
        half, key0, q0, c0 = place(warp)
        for m in range(M):
            for r in range(2):
                key = key0 + 16 * m + G + 8 * r
                for n in range(WC // 8):
                    for e in range(2):
                        dk[key, c0 + frag_col(n, e)] = acc_dk[m][n][:, 2 * r + e] * scale
                        dv[key, c0 + frag_col(n, e)] = acc_dv[m][n][:, 2 * r + e]
    np.testing.assert_allclose(dv, p.T @ do, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dk, scale * ds.T @ q, rtol=1e-10, atol=1e-12)
    ds_t = sm.mem[sm.ds_s:sm.pt_s].reshape(bn, DS_PITCH)[:, :bm]
    np.testing.assert_allclose(ds_t, ds.T, rtol=1e-12, atol=1e-14)   # every dS^T entry, in place
    if QS > 1:
        pt_t = sm.mem[sm.pt_s:].reshape(bn, DS_PITCH)[:, :bm]
        np.testing.assert_allclose(pt_t, p.T, rtol=1e-12, atol=1e-14)

    dq = np.zeros((bm, head))
    S = DQ_STRIPS
    for warp in range(warps):                                     # dQ += scale * dS K
        group = warp // Q_SPLIT
        for c in range(DQ_COLS // DQ_CHUNK):
            col0 = (warp % Q_SPLIT) * DQ_COLS + c * DQ_CHUNK
            part = zero_frags(S, DQ_CHUNK // 8)
            warp_gemm_strips_smem_t(part, S, DQ_CHUNK, bn, DS_PITCH, P, True, sm.mem, sm.ds_s + group * 16 * S,
                                    sm.k_s + col0)
            for m in range(S):
                row_a = (group * S + m) * 16 + G
                for n in range(DQ_CHUNK // 8):
                    col = col0 + frag_col(n, 0)
                    for e in range(2):
                        dq[row_a, col + e] += part[m][n][:, e] * scale
                        dq[row_a + 8, col + e] += part[m][n][:, 2 + e] * scale
    np.testing.assert_allclose(dq, scale * ds @ k, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- bank conflicts

def _store_wavefronts(word_addrs):
    """Shared-memory wavefronts of one warp-wide 32-bit store: the most distinct words one bank gets."""
    banks = {}
    for w in set(int(a) for a in word_addrs):
        banks.setdefault(w % 32, set()).add(w)
    return max(len(v) for v in banks.values())


def _ldmatrix_conflict_free(row_addr_elems):
    """Each 8 x 8 matrix of an ldmatrix is one phase: its 8 rows of 16 bytes must cover 8
    distinct 4-bank groups (the rows are 16-byte aligned)."""
    for j in range(4):
        rows = row_addr_elems[8 * j:8 * j + 8] * 2                 # bytes
        assert (rows % 16 == 0).all()
        if len({int(r) // 16 % 8 for r in rows}) != 8:
            return False
    return True


@pytest.mark.parametrize("bm", [16, 32, 64])
def test_ds_stores_and_dq_reads_are_conflict_free(bm):
    """dS^T's 32-bit stores (ds_lane + (16 m + 8 r) DS_PITCH + 8 n) and dQ's transposed A
    reads (at_lane_addr) hit every bank once: the two-byte dS stores of the one-strip kernel
    were 1.5 M bank conflicts on the H100 (ncu, d=64)."""
    DS_PITCH = bm + 8
    for key0 in (0, 16, 32, 48):
        for q0 in {0, bm // 2}:                                 # QSPLIT 2: each half's queries
            for n in range(bm // 8 if q0 == 0 else bm // 16):
                for r in range(2):
                    elems = (key0 + G + 8 * r) * DS_PITCH + q0 + 2 * T + 8 * n
                    assert (elems % 2 == 0).all()
                    assert _store_wavefronts(elems // 2) == 1
        for k0 in range(0, bm, 16):                               # QSPLIT 2: dV / dK's A from P^T / dS^T
            assert _ldmatrix_conflict_free(a_lane_addr(key0 * DS_PITCH, DS_PITCH) + k0)
    for strip in range(bm // 16):
        for k0 in range(0, 128, 16):
            assert _ldmatrix_conflict_free(at_lane_addr(strip * 16, DS_PITCH) + k0 * DS_PITCH)


# --------------------------------------------------------------------------- the band mask of S^T

def _visible_queries(col, row0, lq, lk, band):
    """score_mod.cuh ScoreMod::visible_queries (transcribed)."""
    lo = col - band[1] - row0 if band else 0
    hi = -1 if col >= lk else (col - band[0] - row0 if band else lq)
    return lo, hi


@pytest.mark.parametrize("band", [None, (-1000, 0), (-7, 3), (5, 40), (-40, -5)])
def test_partial_strip_mask_matches_allowed(band):
    """mask_partial_strip_t's two bounds per key against the per-element rule (ScoreMod::allowed
    without EXTRA: key < lk and, with a band, row + lo <= key <= row + hi) on every element of
    every lane of a strip, over tile positions that cross the band's edges and the sequence end."""
    lq, lk, bm = 100, 90, 32
    for m0 in range(0, lq, bm):
        for key_base in range(0, lk + 16, 16):
            for r in range(2):
                key = key_base + G + 8 * r
                q0 = m0 + 2 * T
                for lane in range(32):
                    lo, hi = _visible_queries(int(key[lane]), int(q0[lane]), lq, lk, band)
                    for n in range(bm // 8):
                        for e in range(2):
                            off = 8 * n + e
                            row, col = int(q0[lane]) + off, int(key[lane])
                            allowed = col < lk and (band is None or band[0] <= col - row <= band[1])
                            assert (lo <= off <= hi) == allowed
