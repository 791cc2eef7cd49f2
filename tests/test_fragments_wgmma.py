"""The Hopper dK/dV kernel's shared-memory arithmetic, lane by lane in NumPy (CPU).

flash_bwd_dkdv_wgmma (kernels_cu/flash_bwd_wgmma.cu) addresses its operands through wgmma
descriptors (start, LBO, SBO on 128-byte swizzled tiles) and per-lane formulas that no CPU
compile can check: the P^T / dS^T fragment offsets, head dim 256's exchange of P^T and dS^T
between the two consumer warpgroups, its dQ staging in the step's own Q / dO slabs. Here the
same formulas (transcribed, names as in the CUDA source) drive an emulated CTA for one step:
shared memory as a flat array of 16-bit slots, the copy engine's swizzled writes, wgmma reads
that apply the swizzle to the absolute address bits as the hardware does (wgmma.cuh), and the
m16n8 accumulator layout of each warp. Values stay float64 (no 16-bit rounding), so a wrong
offset shows as a wrong gradient (or a NaN: unwritten memory is NaN), not as noise.

The head-dim-128 path, which has passed its GPU tests, runs through the same emulator first:
that checks the emulator's reading of the descriptors, so that the head-dim-256 check means
something before the kernel has run on a GPU. What it cannot see is timing: the steps run one
after another, so a buffer overwritten while an asynchronous wgmma still reads it (a race
racecheck finds on the GPU) passes here.
"""
import itertools

import numpy as np
import pytest

LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


# --------------------------------------------------------------------------- wgmma.cuh

def sw128_offset(row, col, slab_bytes):
    return (col // 64) * slab_bytes + row * 128 + (((col % 64) // 8) ^ (row % 8)) * 16 + (col % 8) * 2


def k_major_desc(tile, kk, slab_bytes):
    return tile + (kk // 4) * slab_bytes + (kk % 4) * 32, 16, 1024      # (start, LBO, SBO)


def mn_major_desc(tile, kk, rows):
    return tile + kk * 16 * 128, rows * 128, 1024


def physical(addr):
    """The 128-byte swizzle on address bits: 16-byte chunk (bits 4-6) ^ row in the atom (bits 7-9)."""
    return addr ^ (((addr >> 7) & 7) << 4)


class Smem:
    """Shared memory as 16-bit slots (float64 values); an fp32 value takes the slot of its first
    two bytes and leaves inf in the second, so a 16-bit read of it is wrong or not finite."""

    def __init__(self, nbytes):
        self.h = np.full(nbytes // 2, np.nan)

    def tma_load(self, dst, tile, rows):
        """tma_load_tile: a rows x (64 slabs) tile, 128-byte swizzled, slab s at dst + s rows 128."""
        for r in range(tile.shape[0]):
            for c in range(tile.shape[1]):
                self.h[(dst + sw128_offset(r, c, rows * 128)) // 2] = tile[r, c]

    def store_pair(self, at, lo, hi):          # a 32-bit store of two 16-bit values
        self.h[at // 2], self.h[at // 2 + 1] = lo, hi

    def load_pair(self, at):
        return self.h[at // 2], self.h[at // 2 + 1]

    def store_f32(self, at, x):
        self.h[at // 2], self.h[at // 2 + 1] = x, np.inf

    def read_k_major(self, desc, rows):
        """A (rows x 16) or B^T (N x 16) of a K-major operand."""
        start, _, sbo = desc
        r, k = np.arange(rows)[:, None], np.arange(16)[None, :]
        return self.h[physical(start + (r // 8) * sbo + (r % 8) * 128 + 2 * k) // 2]

    def read_mn_major(self, desc, cols):
        """A^T (16 x M) or B (16 x N) of an MN-major operand: k rows of contiguous m / n."""
        start, lbo, sbo = desc
        k, x = np.arange(16)[:, None], np.arange(cols)[None, :]
        return self.h[physical(start + (k // 8) * sbo + (k % 8) * 128 + (x // 64) * lbo + (x % 64) * 2) // 2]

    def box_f32(self, box):
        """The 64 x 32 fp32 box the copy engine's reduction reads (128-byte swizzled)."""
        r, c = np.arange(64)[:, None], np.arange(32)[None, :]
        return self.h[physical(box + r * 128 + 4 * c) // 2]


def wgmma_ss(d, sm, desc_a, desc_b, n, accumulate):           # both K-major
    prod = sm.read_k_major(desc_a, 64) @ sm.read_k_major(desc_b, n).T
    return d + prod if accumulate else prod


def wgmma_ss_mn(d, sm, desc_a, desc_b, n, accumulate):        # both MN-major
    prod = sm.read_mn_major(desc_a, 64).T @ sm.read_mn_major(desc_b, n)
    return d + prod if accumulate else prod


def wgmma_ss_bmn(d, sm, desc_a, desc_b, n, accumulate):       # A K-major, B MN-major
    prod = sm.read_k_major(desc_a, 64) @ sm.read_mn_major(desc_b, n)
    return d + prod if accumulate else prod


def wgmma_rs(d, a_frags, sm, desc_b, n):
    """A from registers: a_frags[w] is warp w's m16n8k16 A fragment (4 (32, 2) arrays)."""
    a = np.zeros((64, 16))
    for w in range(4):
        for e in range(2):
            a[16 * w + G, 2 * T + e] = a_frags[w][0][:, e]
            a[16 * w + G + 8, 2 * T + e] = a_frags[w][1][:, e]
            a[16 * w + G, 2 * T + 8 + e] = a_frags[w][2][:, e]
            a[16 * w + G + 8, 2 * T + 8 + e] = a_frags[w][3][:, e]
    return d + a @ sm.read_mn_major(desc_b, n)


def frags(d, w):
    """Warp w's m16n8 C fragments of a 64 x N accumulator: [lane][n][i]."""
    n8 = np.arange(d.shape[1] // 8)
    return np.stack([d[16 * w + G[:, None] + 8 * (i // 2), 8 * n8[None, :] + 2 * T[:, None] + i % 2]
                     for i in range(4)], axis=2)


def frag_col(n, i=0):
    return n * 8 + 2 * T + i % 2


def pack_a_frag(p, k0):
    """warp_gemm.cuh: the A fragment (k0..k0 + 15) of fp32 C fragments p[lane][n][i], as pairs."""
    t = k0 // 8
    pair = lambda n, i: np.stack([p[:, n, i], p[:, n, i + 1]], axis=1)
    return [pair(t, 0), pair(t, 2), pair(t + 1, 0), pair(t + 1, 2)]


# --------------------------------------------------------------------------- flash_bwd_wgmma.cu

class Layout:
    """DkdvWgmmaTraits and the kernel's carve-up (tiles from a 1024-aligned 0)."""

    def __init__(self, head, bm, bn, stages=2):
        self.HEAD, self.BM, self.BN, self.STAGES = head, bm, bn, stages
        self.SPLIT_HEAD = head == 256
        self.WG_COLS = head // 2 if self.SPLIT_HEAD else head
        self.Q_BYTES, self.KV_BYTES, self.DS_BYTES = bm * head * 2, bn * head * 2, bn * bm * 2
        self.PT_BYTES = self.DS_BYTES if self.SPLIT_HEAD else 0
        self.DQ_BOX_BYTES = 64 * 128
        self.DQ_STAGE_BYTES = 0 if self.SPLIT_HEAD else 2 * 2 * self.DQ_BOX_BYTES
        self.k = 0
        self.v = self.k + self.KV_BYTES
        self.q = self.v + self.KV_BYTES
        self.dout = self.q + stages * self.Q_BYTES
        self.ds = self.dout + stages * self.Q_BYTES
        self.pt = self.ds + 2 * self.DS_BYTES
        self.dq = self.pt + 2 * self.PT_BYTES
        self.end = self.dq + self.DQ_STAGE_BYTES          # the statistics and barriers follow

    def q_tile(self, stage):
        return self.q + stage * self.Q_BYTES

    def do_tile(self, stage):
        return self.dout + stage * self.Q_BYTES

    def ds_tile(self, buffer):
        return self.ds + buffer * self.DS_BYTES

    def pt_tile(self, buffer):
        return self.pt + buffer * self.PT_BYTES

    def dq_stage(self, consumer):
        return self.dq + consumer * 2 * self.DQ_BOX_BYTES


def t_frag_offset(lay, kk, i, key_row):
    row = key_row + G + 8 * (i % 2)
    q = 16 * kk + 8 * (i // 2) + 2 * T
    return sw128_offset(row, q, lay.BN * 128)


def store_frags_t(lay, sm, tile, frags16, key_row):
    for kk in range(lay.BM // 16):
        for i in range(4):
            for lane, at in enumerate(tile + t_frag_offset(lay, kk, i, key_row)):
                sm.store_pair(at, *frags16[kk][i][lane])


def form_ds_t(lay, sm, pt_tile, ds_tile, dpt, dsum, key_row):
    for n in range(lay.BM // 8):
        d0, d1 = dsum[frag_col(n)], dsum[frag_col(n) + 1]
        for r in range(2):
            at = t_frag_offset(lay, n // 2, 2 * (n % 2) + r, key_row)
            for lane in range(32):
                p0, p1 = sm.load_pair(pt_tile + at[lane])
                sm.store_pair(ds_tile + at[lane], p0 * (dpt[lane, n, 2 * r] - d0[lane]),
                              p1 * (dpt[lane, n, 2 * r + 1] - d1[lane]))


def stage_dq_block(sm, stage, dq, warp_row0, scale):
    odd_g = (G & 1).astype(bool)
    for j in range(8):
        for r in range(2):
            n = np.where(odd_g, j ^ 2, j)
            v0 = np.where(odd_g, dq[:, j ^ 2, 2 * r], dq[:, j, 2 * r])
            v1 = np.where(odd_g, dq[:, j ^ 2, 2 * r + 1], dq[:, j, 2 * r + 1])
            row, col = warp_row0 + G + 8 * r, 8 * (n % 4) + 2 * T
            at = stage + (n // 4) * 64 * 128 + row * 128 + ((col // 4) ^ (row % 8)) * 16 + (col % 4) * 4
            for lane in range(32):
                sm.store_f32(at[lane], v0[lane] * scale)
                sm.store_f32(at[lane] + 4, v1[lane] * scale)


def reference(q, k, v, do, lse_log2, dsum, x_per_s, scale):
    pt = 2.0 ** (k @ q.T * x_per_s - lse_log2[None, :])        # P^T (keys x queries)
    dst = pt * (v @ do.T - dsum[None, :])                       # dS^T
    return dict(dv=pt @ do, dk=scale * dst @ q, dq=scale * dst.T @ k)


def _problem(head, bm, bn, seed):
    rng = np.random.default_rng(seed)
    q, do = rng.standard_normal((bm, head)), rng.standard_normal((bm, head))
    k, v = rng.standard_normal((bn, head)), rng.standard_normal((bn, head))
    scale = 1 / np.sqrt(head)
    x_per_s = scale * np.log2(np.e)
    lse_log2 = np.log2(np.exp(q @ k.T * scale).sum(1)) + 0.5        # lse in log2 units, shifted
    return q, k, v, do, lse_log2, rng.standard_normal(bm), x_per_s, scale


def _loaded(lay, q, k, v, do, stage):
    sm = Smem(lay.end)
    sm.tma_load(lay.k, k, lay.BN)
    sm.tma_load(lay.v, v, lay.BN)
    sm.tma_load(lay.q_tile(stage), q, lay.BM)
    sm.tma_load(lay.do_tile(stage), do, lay.BM)
    return sm


def consume_key_halves_step(lay, q, k, v, do, lse_log2, dsum, x_per_s, scale, t=1):
    """One step of consume_key_halves (head dims 64, 128) for both consumer warpgroups."""
    stage, buf = t % lay.STAGES, t & 1
    sm = _loaded(lay, q, k, v, do, stage)
    q_tile, do_tile, ds_tile = lay.q_tile(stage), lay.do_tile(stage), lay.ds_tile(buf)
    BM, BN, HEAD = lay.BM, lay.BN, lay.HEAD
    acc = {}
    pt16, dst16 = {}, {}
    for consumer in range(2):
        k_wg, v_wg = lay.k + consumer * 64 * 128, lay.v + consumer * 64 * 128
        st = dpt = 0
        for kk in range(HEAD // 16):
            st = wgmma_ss(st, sm, k_major_desc(k_wg, kk, BN * 128), k_major_desc(q_tile, kk, BM * 128), BM, kk > 0)
            dpt = wgmma_ss(dpt, sm, k_major_desc(v_wg, kk, BN * 128), k_major_desc(do_tile, kk, BM * 128), BM, kk > 0)
        st = 2.0 ** (st * x_per_s - lse_log2[None, :])                    # prob_and_dscore, whole tile
        dpt = st * (dpt - dsum[None, :])
        dv, dk = np.zeros((64, HEAD)), np.zeros((64, HEAD))
        for cwarp in range(4):
            key_row = 64 * consumer + 16 * cwarp
            pf, df = frags(st, cwarp), frags(dpt, cwarp)
            pt16[consumer, cwarp] = [pack_a_frag(pf, 16 * kk) for kk in range(BM // 16)]
            dst16[consumer, cwarp] = [pack_a_frag(df, 16 * kk) for kk in range(BM // 16)]
            store_frags_t(lay, sm, ds_tile, dst16[consumer, cwarp], key_row)
        for kk in range(BM // 16):
            dv = wgmma_rs(dv, [pt16[consumer, w][kk] for w in range(4)], sm, mn_major_desc(do_tile, kk, BM), HEAD)
            dk = wgmma_rs(dk, [dst16[consumer, w][kk] for w in range(4)], sm, mn_major_desc(q_tile, kk, BM), HEAD)
        acc[consumer] = dv, dk
    # named barrier DS_T; then each warpgroup's dQ block
    dq_acc = np.zeros((BM, HEAD))
    split_rows = BM == 128
    split_keys = HEAD == 64 and BM == 64          # DQ_SPLIT_KEYS (EXTRA at head dim 64)
    for consumer in range(2):
        dq_row0, dq_col0 = (64 * consumer, 0) if split_rows else (0, 0) if split_keys else (0, 64 * consumer)
        k_steps, kk0 = (64 // 16, 4 * consumer) if split_keys else (BN // 16, 0)
        dq = 0
        for kk in range(k_steps):
            dq = wgmma_ss_mn(dq, sm, mn_major_desc(ds_tile + (dq_row0 // 64) * BN * 128, kk0 + kk, BN),
                             mn_major_desc(lay.k + (dq_col0 // 64) * BN * 128, kk0 + kk, BN), 64, kk > 0)
        stage_at = lay.dq_stage(consumer)
        for cwarp in range(4):
            stage_dq_block(sm, stage_at, frags(dq, cwarp), 16 * cwarp, scale)
        for box in range(2):
            dq_acc[dq_row0:dq_row0 + 64, dq_col0 + 32 * box:dq_col0 + 32 * box + 32] += sm.box_f32(
                stage_at + box * lay.DQ_BOX_BYTES)
    dv = np.concatenate([acc[0][0], acc[1][0]])
    dk = np.concatenate([acc[0][1], acc[1][1]]) * scale
    return dict(dv=dv, dk=dk, dq=dq_acc)


def consume_head_halves_step(lay, q, k, v, do, lse_log2, dsum, x_per_s, scale, t=1, order=(0, 1)):
    """One step of consume_head_halves (head dim 256). After the DS_T barrier the two warpgroups run
    unsynchronised: ``order`` is which one completes dK, dQ and its dQ staging first (the other's
    reads must not see the first one's staging)."""
    stage, buf = t % lay.STAGES, t & 1
    sm = _loaded(lay, q, k, v, do, stage)
    q_tile, do_tile = lay.q_tile(stage), lay.do_tile(stage)
    pt_tile, ds_tile = lay.pt_tile(buf), lay.ds_tile(buf)
    BM, BN, HEAD, COLS = lay.BM, lay.BN, lay.HEAD, lay.WG_COLS
    SLAB_BYTES = BM * 128
    xt = {}
    for consumer in range(2):                        # warpgroup 0: S^T; warpgroup 1: dP^T
        forms_p = consumer == 0
        x = 0
        for kk in range(HEAD // 16):
            x = wgmma_ss(x, sm, k_major_desc(lay.k if forms_p else lay.v, kk, BN * 128),
                         k_major_desc(q_tile if forms_p else do_tile, kk, BM * 128), BM, kk > 0)
        xt[consumer] = x
    p_t = 2.0 ** (xt[0] * x_per_s - lse_log2[None, :])  # prob_of_score
    for cwarp in range(4):
        pf = frags(p_t, cwarp)
        store_frags_t(lay, sm, pt_tile, [pack_a_frag(pf, 16 * kk) for kk in range(BM // 16)], 16 * cwarp)
    # named barrier P_T
    acc = {}
    for consumer in range(2):
        slab0 = consumer * COLS // 64
        dv = np.zeros((64, COLS))
        for kk in range(BM // 16):
            dv = wgmma_ss_bmn(dv, sm, k_major_desc(pt_tile, kk, BN * 128),
                              mn_major_desc(do_tile + slab0 * SLAB_BYTES, kk, BM), COLS, True)
        acc[consumer] = [dv]
    for cwarp in range(4):
        form_ds_t(lay, sm, pt_tile, ds_tile, frags(xt[1], cwarp), dsum, 16 * cwarp)
    # named barrier DS_T
    dq_acc = np.zeros((BM, HEAD))
    for consumer in order:
        slab0 = consumer * COLS // 64
        dk = np.zeros((64, COLS))
        for kk in range(BM // 16):
            dk = wgmma_ss_bmn(dk, sm, k_major_desc(ds_tile, kk, BN * 128),
                              mn_major_desc(q_tile + slab0 * SLAB_BYTES, kk, BM), COLS, True)
        dq = [0, 0]
        for j in range(2):
            for kk in range(BN // 16):
                dq[j] = wgmma_ss_mn(dq[j], sm, mn_major_desc(ds_tile, kk, BN),
                                    mn_major_desc(lay.k + (slab0 + j) * BN * 128, kk, BN), 64, kk > 0)
        acc[consumer].append(dk)
        staging = [q_tile + slab0 * SLAB_BYTES, do_tile + slab0 * SLAB_BYTES]
        for j in range(2):
            for cwarp in range(4):
                stage_dq_block(sm, staging[j], frags(dq[j], cwarp), 16 * cwarp, scale)
        for j in range(2):
            for box in range(2):
                col = 64 * (slab0 + j) + 32 * box
                dq_acc[:, col:col + 32] += sm.box_f32(staging[j] + box * lay.DQ_BOX_BYTES)
    dv = np.concatenate([acc[0][0], acc[1][0]], axis=1)
    dk = np.concatenate([acc[0][1], acc[1][1]], axis=1) * scale
    return dict(dv=dv, dk=dk, dq=dq_acc)


def _check(got, want):
    for name in ("dv", "dk", "dq"):
        assert np.isfinite(got[name]).all(), name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("head,bm", [(64, 128), (128, 64), (64, 64)])
def test_key_halves_step_emulated(head, bm):
    """The GPU-tested layouts (head dims 64, 128) through the emulator: checks the emulator. (64, 64):
    the EXTRA tile at head dim 64, dQ split by keys: both
    warpgroups add their part into the one 64 x 64 block."""
    lay = Layout(head, bm, 128)
    prob = _problem(head, bm, 128, seed=head)
    _check(consume_key_halves_step(lay, *prob), reference(*prob))


@pytest.mark.parametrize("t", [0, 1])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_head_halves_step_emulated(t, order):
    """Head dim 256: S^T in warpgroup 0, dP^T in warpgroup 1, P^T / dS^T exchanged, dK / dV / dQ split
    by columns, dQ staged in the step's Q / dO slabs; either warpgroup may stage first."""
    lay = Layout(256, 64, 64)
    prob = _problem(256, 64, 64, seed=7 + t)
    _check(consume_head_halves_step(lay, *prob, t=t, order=order), reference(*prob))


def test_head_halves_layout_fits_and_exchanges_are_conflict_free():
    """226 KB of tiles (+ statistics, barriers, slack: the table's 231464 bytes); each 32-bit P^T / dS^T
    access of a warp (store_frags_t, form_ds_t) hits 32 distinct banks."""
    lay = Layout(256, 64, 64)
    assert lay.end + 1024 + 2 * 2 * 64 * 4 + 8 * 5 == 231464
    for kk in range(lay.BM // 16):
        for i in range(4):
            for key_row in (0, 16, 32, 48):
                banks = (t_frag_offset(lay, kk, i, key_row) // 4) % 32
                assert len(set(banks.tolist())) == 32


# --------------------------------------------------------------------------- EXTRA (branch bwd-extra)

def sw_chunk_offset(row, chunk, cols):
    """tile_io.cuh: 16-bit rows of `cols` elements, 16-byte chunk c of row r at c ^ (r % 8)."""
    return row * cols * 2 + ((chunk ^ (row % 8)) * 16)


@pytest.mark.parametrize("bm,bn", [(64, 128)])
def test_bias_read_transposed_into_st_fragments(bm, bn):
    """scale_add_bias_frags_sw_t (warp_gemm.cuh): the bias tile [query][key] as the loaders write it
    (sw_chunk_offset, rows of BN keys), read by ldmatrix.x4.trans at each lane's address, lands in each
    warp's S^T C fragments (rows: keys key0 + g (+8), columns: queries 8 n + 2 t (+1)) as bias[q, key];
    each 8-lane phase of an x4 reads 8 distinct 16-byte bank groups."""
    rng = np.random.default_rng(1)
    bias = rng.standard_normal((bm, bn))
    smem = np.full(bm * bn, np.nan)
    for qr in range(bm):
        for key in range(bn):
            smem[(sw_chunk_offset(qr, key // 8, bn) + (key % 8) * 2) // 2] = bias[qr, key]
    for key0 in range(0, bn, 16):
        row = 8 * (LANES // 16) + LANES % 8
        chunk = key0 // 8 + (LANES // 8) % 2
        addr = row * bn * 2 + ((chunk ^ (row % 8)) * 16)
        for g in range(bm // 16):
            a = addr + g * 16 * bn * 2
            for phase in range(4):
                groups = (a[8 * phase:8 * phase + 8] % 128) // 16
                assert len(set(groups.tolist())) == 8
            # ldmatrix.trans: matrix j's rows are the addresses of lanes 8 j..8 j + 7; lane l receives, in
            # register j, elements (row 2 (l % 4) + e, column l / 4) of matrix j, e = 0 (low), 1.
            regs = np.zeros((32, 4, 2))
            for j in range(4):
                for l in range(32):
                    for e in range(2):
                        src = a[8 * j + 2 * (l % 4) + e] + 2 * (l // 4)
                        regs[l, j, e] = smem[src // 2]
            # scale_add_bias_group: r[2h + i / 2] holds elements i, i + 1 (i even) of n8 tile 2g + h.
            for l in range(32):
                for h in range(2):
                    for i in range(4):
                        got = regs[l, 2 * h + i // 2, i % 2]
                        key = key0 + l // 4 + 8 * (i // 2)                # frag_row
                        query = 8 * (2 * g + h) + 2 * (l % 4) + i % 2       # frag_col
                        assert got == bias[query, key]


@pytest.mark.parametrize("q0,k0", [(0, 0), (64, 16), (1088, 112)])
def test_dropout_bits_for_transposed_fragments(q0, k0):
    """dropout_frag_bits_t (score_mod.cuh): one Philox draw a lane a tile (query 8 n + 2 t + g % 2, keys
    4 (g / 2)..) and four shuffles give each lane exactly keep() of its S^T elements, bit 4 n + i."""
    from cuflash import reference

    seed, p_drop, batch, head, n_tiles = 987654321, 0.3, 1, 3, 8
    keep = lambda q, k: reference.dropout_keep(seed, p_drop, batch, head, q, k) > 0   # noqa: E731
    g, t = G, T
    bits = np.zeros(32, dtype=np.int64)
    for n in range(n_tiles):
        dq_ = q0 + 8 * n + 2 * t + g % 2
        dk_ = k0 + 4 * (g // 2)
        drawn = sum(keep(dq_, dk_ + b).astype(np.int64) << b for b in range(4))   # keep4_bits
        four = np.zeros(32, dtype=np.int64)
        for i in range(4):
            key = g + 8 * (i // 2)
            theirs = drawn[4 * (2 * (key // 4) + i % 2) + t]                     # __shfl_sync
            four |= ((theirs >> (key % 4)) & 1) << i
        bits |= four << (4 * n)
    for n in range(n_tiles):
        for i in range(4):
            want = keep(q0 + 8 * n + 2 * t + i % 2, k0 + g + 8 * (i // 2))
            np.testing.assert_array_equal((bits >> (4 * n + i)) & 1, want.astype(np.int64))


# --------------------------------------------------------------------------- bias_grad_t.cuh

def query_quad(frag):
    """QueryQuad::of: frag[lane][i] (one n8 tile) -> the four values each lane adds, after the lane
    pair t, t ^ 1 swapped one pair (__shfl_xor_sync(.., 1))."""
    odd = (LANES & 1).astype(bool)
    send0 = np.where(odd, frag[:, 0], frag[:, 2])
    send1 = np.where(odd, frag[:, 1], frag[:, 3])
    got0, got1 = send0[LANES ^ 1], send1[LANES ^ 1]
    return np.stack([np.where(odd, got0, frag[:, 0]), np.where(odd, got1, frag[:, 1]),
                     np.where(odd, frag[:, 2], got0), np.where(odd, frag[:, 3], got1)], axis=1)


QUAD_KEY, QUAD_QUERY = G + 8 * (LANES & 1), 4 * (T // 2)   # QueryQuad::key, QueryQuad::query


@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("m0, n0, lq, lk", [(0, 0, 333, 1096), (320, 1024, 333, 1096), (64, 128, 100, 190)])
def test_dbias_key_major_quads(bm, m0, n0, lq, lk):
    """bias_grad_t.cuh on one step of both consumer warpgroups (8 warps of 16 keys, dS^T of the block's
    BN = 128 keys x BM queries in the m16n8 layout): DbiasKeyMajorStep adds every (key < lk, query < lq)
    element once into a [key][pitch] accumulator, at 16-byte aligned addresses; a warp's instruction
    covers whole 32-byte sectors (two lanes each: rows of a pitch of whole sectors) except at the lq edge;
    dropped quads are exactly those past lq or lk.
    DbiasRowSums (a one-row bias) gives the sums over the step's queries."""
    rng = np.random.default_rng(bm + m0 + lq)
    queries = m0 + np.arange(bm)
    ds_t = rng.standard_normal((128, bm))
    ds_t[:, queries >= lq] = 0.0                      # P = 0 past lq (load_row_stats: lse_log2 = +inf)
    pitch = -(-lq // 8) * 8                            # _masking._key_major_plan
    acc = np.zeros((lk, pitch))
    row_total = np.zeros(lk)
    for warp in range(8):                              # key_row = 64 consumer + 16 cwarp
        key_row = 16 * warp
        tile = np.zeros((64, bm))
        tile[:16] = ds_t[key_row:key_row + 16]
        fr = frags(tile, 0)                            # [lane][n][i]
        key = n0 + key_row + QUAD_KEY                  # DbiasKeyMajorStep::of
        q0 = m0 + QUAD_QUERY
        queries_left = lq - q0
        sums = np.zeros((32, 2))
        for n in range(bm // 8):
            quad = query_quad(fr[:, n])
            keep = (key < lk) & (8 * n < queries_left)
            sectors = {}
            for lane in np.flatnonzero(keep):
                at = key[lane] * pitch + q0[lane] + 8 * n
                assert at % 4 == 0                     # red.global.add.v4.f32: 16-byte aligned
                assert q0[lane] + 8 * n + 3 < pitch    # inside the row (its padding at most)
                acc.flat[at:at + 4] += quad[lane]
                sectors.setdefault(at // 8, []).append(lane)
            whole = m0 + 8 * n + 4 < lq                # both quads of a key's sector start below lq
            assert all(len(lanes) == (2 if whole else 1) for lanes in sectors.values()), (n, sectors)
            sums[:, 0] += fr[:, n, 0] + fr[:, n, 1]    # DbiasRowSums::add
            sums[:, 1] += fr[:, n, 2] + fr[:, n, 3]
        for r in range(2):                             # DbiasRowSums::flush
            sums[:, r] += sums[LANES ^ 1, r]
            sums[:, r] += sums[LANES ^ 2, r]
            rkey = n0 + key_row + G + 8 * r
            for lane in np.flatnonzero((T == 0) & (rkey < lk)):
                row_total[rkey[lane]] += sums[lane, r]
    keys = n0 + np.arange(128)
    want = np.zeros((lk, pitch))
    inside = keys < lk
    cols = queries[queries < pitch]
    want[keys[inside][:, None], cols[None, :]] = ds_t[inside][:, queries < pitch]
    np.testing.assert_allclose(acc, want, rtol=0, atol=1e-12)
    want_rows = np.zeros(lk)
    want_rows[keys[inside]] = ds_t[inside].sum(axis=1)
    np.testing.assert_allclose(row_total, want_rows, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("shape", [(1, 1, 203, 150), (2, 4, 203, 150), (2, 1, 203, 150), (1, 4, 203, 150),
                                   (203, 150), (2, 1, 1, 150), (1, 4, 1, 150), (150,)], ids=str)
def test_dbias_key_major_whole_backward(bm, shape, monkeypatch):
    """(Offline review of hopper-dbias.) The consumers' dbias path of flash_bwd_dkdv_wgmma end to end, lane by
    lane: every CTA (batch, K/V head, key block of 128) walks its query heads (GQA: 2 a K/V head, so the row
    sums change head inside a CTA) and a range of query blocks (as a causal query_tiles range), with steps a
    block layout hides (`continue` before any dbias work); each of the 8 warps forms DbiasKeyMajorStep /
    DbiasRowSums as consume_key_halves does (flush at a formed step of a new head and at the end) and adds
    through the ScoreTensor strides _masking._key_major_plan hands the kernel (pointer 0 = the store's
    start). Lq = 203 (a padded row pitch of 208, a last quad cut at the edge), Lk = 150 (a key block cut at 22
    keys). dS^T past lq is 0 (P = 0 there), past lk garbage (must be dropped). Every v4 address is 16-byte
    aligned and stays inside its key's row; DbiasPlan.result gives dS of the formed steps summed over the
    bias's broadcast axes."""
    from cuflash import options
    from cuflash._dispatch import masking as _masking
    from cuflash.options import check_qkv

    b, hq, hk, lq, lk, bn = 2, 4, 2, 203, 150, 128
    group = hq // hk
    full = (b, hq, lq, lk)
    monkeypatch.setattr(_masking, "score_view", lambda x4, p: dict(zip(
        ("ptr", "batch_stride", "head_stride", "row_stride", "col_stride"),
        (0,) + tuple(0 if n == 1 and f != 1 else s_ // x4.itemsize for n, f, s_ in zip(x4.shape, full, x4.strides)))))
    rng = np.random.default_rng(len(shape) * 7 + bm)
    q, k, v = rng.standard_normal((b, hq, lq, 8)), rng.standard_normal((b, hk, lk, 8)), rng.standard_normal((b, hk, lk, 8))
    p = check_qkv(q, k, v)
    bias = np.ones(shape)
    plan = _masking.dbias_plan(p, options.Options(bias=bias), False, key_major=True)
    acc = plan.values["acc"]
    bs, hs, rs, cs = (acc[n] for n in ("batch_stride", "head_stride", "row_stride", "col_stride"))
    assert plan.values["mode"] == _masking.DBIAS_KEY_MAJOR
    rows_bc = bool(plan.values["rows_broadcast"])
    store = plan.keep_alive[0].reshape(-1)
    ds = rng.standard_normal(full)
    formed_mask = np.zeros(full, dtype=bool)
    q_blocks = -(-lq // bm)

    def flush(sums, batch, head, key0):
        for r in range(2):
            sums[:, r] += sums[LANES ^ 1, r]
            sums[:, r] += sums[LANES ^ 2, r]
            key = key0 + G + 8 * r
            for lane in np.flatnonzero((T == 0) & (key < lk)):
                store[batch * bs + head * hs + key[lane] * cs] += sums[lane, r]
        sums[:] = 0.0

    for batch, kv_head, kblock in itertools.product(range(b), range(hk), range(-(-lk // bn))):
        n0 = bn * kblock
        begin = kblock % q_blocks                       # a causal-like range of query blocks
        m_blocks = q_blocks - begin
        first_head = kv_head * group
        hidden = rng.random((group, m_blocks)) < 0.3
        for consumer, cwarp in itertools.product(range(2), range(4)):
            key_row = 64 * consumer + 16 * cwarp
            sums = np.zeros((32, 2))
            rows_head = first_head
            head, block = first_head, 0
            for _ in range(group * m_blocks):
                m0 = (begin + block) * bm
                if not hidden[head - first_head, block]:
                    if rows_bc and head != rows_head:
                        flush(sums, batch, rows_head, n0 + key_row)
                        rows_head = head
                    keys = n0 + key_row + np.arange(16)
                    queries = m0 + np.arange(bm)
                    tile = np.zeros((64, bm))
                    tile[:16] = rng.standard_normal((16, bm))                        # garbage past lk
                    kin, qin = keys < lk, queries < lq
                    tile[:16][:, ~qin] = 0.0                                         # P = 0 past lq
                    tile[:16][np.ix_(kin, qin)] = ds[batch, head][np.ix_(queries[qin], keys[kin])].T
                    formed_mask[batch, head][np.ix_(queries[qin], keys[kin])] = True
                    fr = frags(tile, 0)
                    key = n0 + key_row + QUAD_KEY
                    q0 = m0 + QUAD_QUERY
                    for n in range(bm // 8):
                        quad = query_quad(fr[:, n])             # all 32 lanes shuffle
                        if rows_bc:
                            sums[:, 0] += fr[:, n, 0] + fr[:, n, 1]
                            sums[:, 1] += fr[:, n, 2] + fr[:, n, 3]
                            continue
                        for lane in np.flatnonzero((key < lk) & (8 * n < lq - q0)):
                            at = batch * bs + head * hs + (q0[lane] + 8 * n) * rs + key[lane] * cs
                            assert at % 4 == 0 and at + 4 <= store.size
                            assert (at + 3) // cs == at // cs            # one key's row (pitch cs)
                            store[at:at + 4] += quad[lane]
                block += 1
                if block == m_blocks:
                    block, head = 0, head + 1
            if rows_bc:
                flush(sums, batch, rows_head, n0 + key_row)
    got = plan.result(p, options.Options(bias=bias))
    own = (1,) * (4 - len(shape)) + shape
    axes = tuple(a for a in range(4) if own[a] == 1 and full[a] != 1)
    want = (ds * formed_mask).sum(axis=axes, keepdims=True).reshape(shape)
    assert got.shape == shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
