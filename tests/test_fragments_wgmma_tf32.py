"""The float32 Hopper forward's arithmetic and shared-memory formulas, lane by lane in NumPy (CPU).

flash_fwd_wgmma_tf32 (kernels_cu/flash_fwd_wgmma_tf32.cu over wgmma_tf32.cuh and tf32_operands.cuh)
rests on facts no CPU compile can check; here the same formulas (transcribed, names as in the CUDA
source) drive an emulated CTA:
  * TF32X3_PARTS (warp_gemm_tf32.cuh split_tf32): both parts exact TF32 values (low 13 bits zero), so
    the tensor core's treatment of low bits cannot matter; big + small carries a to 2^-23 |a|; NaN and
    inf reach the products;
  * the 128-byte swizzled fp32 tiles the copy engine writes (32-column slabs) read back through
    wgmma.cuh's k_major_desc as the k8 steps of S = Q K^T;
  * V^T: the producer's transposition (transpose_v_tile) into the permuted key order, read by the
    descriptors of O += P V, against P's A fragments taken from its C fragments as c0, c2, c1, c3;
  * the bank patterns of the producer's and the consumers' shared-memory accesses;
  * the shared-memory map of FwdWgmmaTf32Traits / Tf32Smem (disjoint, aligned, = the table's size).
What it cannot see is timing (a stage overwritten while a wgmma still reads it): racecheck and
synccheck on the GPU (benchmarks/NOTES.md, the branch's checklist).
"""
import re

import numpy as np
import pytest

from cuflash._runtime.build import kernel_dir
from cuflash._dispatch import model as M
from cuflash._dispatch import select as V

f32 = np.float32
LANES = np.arange(32)
G, T = LANES // 4, LANES % 4


# --------------------------------------------------------------------------- TF32X3_PARTS

def _parts_source():
    src = (kernel_dir() / "warp_gemm_tf32.cuh").read_text()
    half = int(re.search(r"return \(__float_as_uint\(a\) \+ 0x([0-9a-f]+)u\) & 0x([0-9a-f]+)u;", src).group(1), 16)
    mask = int(re.search(r"if \(SPLIT == TF32X3_PARTS\) small &= 0x([0-9a-f]+)u;", src).group(1), 16)
    return half, mask


HALF_ULP, SMALL_MASK = _parts_source()


def split_parts(a):
    """split_tf32<TF32X3_PARTS>: big = a rounded by its bits, small = (a - big) with the low 13 bits cleared."""
    a = np.asarray(a, dtype=f32)
    big = ((a.view(np.uint32) + np.uint32(HALF_ULP)) & np.uint32(0xFFFFE000)).view(f32)
    with np.errstate(invalid="ignore", over="ignore"):
        small = (a - big).astype(f32)
    return big, (small.view(np.uint32) & np.uint32(SMALL_MASK)).view(f32)


def exact_tf32(x):
    return (np.asarray(x, dtype=f32).view(np.uint32) & 0x1FFF) == 0


def test_parts_constants():
    assert HALF_ULP == 1 << 12 and SMALL_MASK == 0xFFFFE000


@pytest.mark.parametrize("sign,exponent", [(1, -30), (1, 0), (-1, 3), (1, 60), (-1, -100)])
def test_parts_are_exact_tf32_and_carry_a_whole_binade(sign, exponent):
    # every float32 of a binade: both parts exact TF32 values, |a - big - small| <= 2^(e - 23)
    mant = np.arange(1 << 23, dtype=np.uint32)
    a = (((np.uint32(127 + exponent) << 23) | mant).view(f32) * f32(sign)).astype(f32)
    big, small = split_parts(a)
    assert exact_tf32(big).all() and exact_tf32(small).all()
    err = np.abs(a.astype(np.float64) - big.astype(np.float64) - small.astype(np.float64))
    assert (err <= 2.0 ** (exponent - 23)).all() and err.max() == 2.0 ** (exponent - 23)   # one bit of small


def test_parts_products_carry_a_product_to_float32_accuracy():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal(200000).astype(f32), rng.standard_normal(200000).astype(f32)
    (ab, as_), (bb, bs) = split_parts(a), split_parts(b)
    three = as_.astype(np.float64) * bb + ab.astype(np.float64) * bs + ab.astype(np.float64) * bb
    exact = a.astype(np.float64) * b
    assert (np.abs(three - exact) <= 2.0**-21 * np.abs(exact) + 1e-45).all()


def test_parts_keep_nan_and_inf_out_of_finite_results():
    bad = np.array([0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0x7F800001, 0xFF800FFF, 0x7F7FFFFF],
                   dtype=np.uint32).view(f32)
    big, small = split_parts(bad)
    with np.errstate(invalid="ignore", over="ignore"):
        prods = small * f32(1) + big * f32(1e-30) + big * f32(1)
        prods2 = big * split_parts(f32(3.0))[1] + small * split_parts(f32(3.0))[0] + big * split_parts(f32(3.0))[0]
    assert not np.isfinite(prods[:-1]).any()    # NaN and inf inputs: never a finite sum
    assert not np.isfinite(prods2[:-1]).any()
    assert np.isnan(small[:-1]).all()
    # FLT_MAX rounds up to big = inf, small = -inf: not finite either (as the fast split, tests/test_fragments_tf32.py)
    assert not np.isfinite(prods[-1])


# --------------------------------------------------------------------------- shared memory

def physical(addr):
    """The 128-byte swizzle on address bits: 16-byte chunk (bits 4-6) ^ row in the atom (bits 7-9)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def k_major_desc(tile, kk, slab_bytes):
    return tile + (kk // 4) * slab_bytes + (kk % 4) * 32, 1024      # (start, SBO)


class Smem:
    """Shared memory as 4-byte slots (float64 values, NaN where never written)."""

    def __init__(self, nbytes):
        self.w = np.full(nbytes // 4, np.nan)

    def tma_load_f32(self, dst, tile):
        """tma_load_tile<ROWS, SLABS, 32>: slab s (32 columns) at dst + s ROWS 128, 128-byte swizzled."""
        rows, cols = tile.shape
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        self.w[physical(dst + (c // 32) * rows * 128 + r * 128 + (c % 32) * 4) // 4] = tile

    def read_k_major(self, desc, rows):
        """A (rows x 8) or B^T (N x 8) of one k8 step of a K-major TF32 operand."""
        start, sbo = desc
        r, k = np.arange(rows)[:, None], np.arange(8)[None, :]
        return self.w[physical(start + (r // 8) * sbo + (r % 8) * 128 + 4 * k) // 4]


def split_rows_in_place(sm, tile, small_tile, rows, slabs, slab_bytes, threads, split):
    """tf32_operands.cuh split_rows_in_place, every thread's every 16-byte chunk."""
    chunks = rows * 128 // 16
    touched = []
    for thread in range(threads):
        for i in range(chunks * slabs // threads):
            c = thread + i * threads
            at = (c // chunks) * slab_bytes + (c % chunks) * 16
            a = sm.w[(tile + at) // 4:(tile + at) // 4 + 4].astype(f32)
            big, small = split_parts(a) if split else (a, None)
            sm.w[(tile + at) // 4:(tile + at) // 4 + 4] = big
            if split:
                sm.w[(small_tile + at) // 4:(small_tile + at) // 4 + 4] = small
            touched.append(at)
    assert sorted(touched) == sorted({s * slab_bytes + 16 * c for s in range(slabs) for c in range(chunks)})


def vt_offset(head, n, pos):
    return (pos // 32) * head * 128 + n * 128 + ((((pos % 32) // 4) ^ (n % 8)) * 16) + (pos % 4) * 4


def transpose_v_items(bn, head, warps=4):
    """transpose_v_tile's (warp, lane) -> (read addresses relative to the raw tile, write offset) per round."""
    groups, items = bn // 8, (head // 32) * (bn // 8) * 2
    rounds = []
    for r in range(items // warps):
        per_warp = []
        for warp in range(warps):
            item = warp + r * warps
            par, g8, sl = item % 2, (item // 2) % groups, item // (2 * groups)
            n = 32 * sl + LANES
            k = (8 * g8 + par + 2 * np.arange(4))[:, None] + 0 * LANES   # (4, 32): key i of each lane
            reads = sl * bn * 128 + k * 128 + (((LANES // 4) ^ (k % 8)) * 16) + (LANES % 4) * 4
            per_warp.append((reads, vt_offset(head, n, 8 * g8 + 4 * par), n, k))
        rounds.append(per_warp)
    return rounds


def transpose_v_tile(sm, raw, vt_big, vt_small, bn, head, split):
    for per_warp in transpose_v_items(bn, head):
        for reads, write, n, k in per_warp:
            a = sm.w[(raw + reads) // 4].astype(f32)                 # (4, 32)
            big, small = split_parts(a) if split else (a, None)
            for i in range(4):
                sm.w[(vt_big + write) // 4 + i] = big[i]
                if split:
                    sm.w[(vt_small + write) // 4 + i] = small[i]


PERM = np.array([0, 2, 4, 6, 1, 3, 5, 7])   # V^T position j of an 8-key group holds key PERM[j]


def a_frags_from_c(p_tile):
    """P's A fragment of one k8 step from its C fragment (n8 tile) as the kernel packs it: a0..a3 =
    c0, c2, c1, c3; returned as the 16 x 8 A matrix (row, k) of one warp."""
    c = np.zeros((32, 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] = [p_tile[g, 2 * t], p_tile[g, 2 * t + 1], p_tile[g + 8, 2 * t], p_tile[g + 8, 2 * t + 1]]
    a = c[:, [0, 2, 1, 3]]
    A = np.full((16, 8), np.nan)
    for lane in range(32):   # ALayout_64x8: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
        g, t = lane // 4, lane % 4
        A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = a[lane]
    return A


class Layout:
    """Tf32Smem's addresses (relative to the aligned base) for a variant's tile."""

    def __init__(self, v):
        t, self.head = v.tile, v.head
        self.bm, self.bn, self.split = t.block_m, t.block_n, v.split
        self.parts = 2 if self.split else 1
        self.q_bytes, self.kv = t.block_m * v.head * 4, t.block_n * v.head * 4
        self.stage_bytes = (2 * self.parts + 1) * self.kv
        self.q, self.q_small = 0, self.q_bytes
        self.stages = self.parts * self.q_bytes
        self.tile_bytes = self.stages + t.stages * self.stage_bytes
        self.smem = 1024 + self.tile_bytes + 8 * (1 + 6 * t.stages)

    def k_big(self, s): return self.stages + s * self.stage_bytes
    def k_small(self, s): return self.k_big(s) + self.kv
    def v_raw(self, s): return self.k_big(s) + self.parts * self.kv
    def vt_big(self, s): return self.v_raw(s) + self.kv
    def vt_small(self, s): return self.vt_big(s) + self.kv


HOPPER_F32 = [v for v in V.all_variants() if v.family in ("fwd_wgmma_tf32x3", "fwd_wgmma_tf32")]


def test_variants_exist():
    """3xTF32 at head dims 64 and 128; plain TF32 (fwd_wgmma_tf32) has no rows: the portable fwd_tf32 is
    faster on the H100 (cuflash/_dispatch/tables.py)."""
    assert {(v.family, v.head) for v in HOPPER_F32} == {("fwd_wgmma_tf32x3", h) for h in (64, 128)}


@pytest.mark.parametrize("v", HOPPER_F32, ids=lambda v: v.name)
def test_shared_memory_map(v):
    lay = Layout(v)
    assert lay.smem == v.smem_bytes <= M.SMEM_LIMITS["sm_90 (H100, H200)"]
    spans = [(lay.q, lay.q_bytes)] + ([(lay.q_small, lay.q_bytes)] if lay.split else [])
    for s in range(v.tile.stages):
        spans += [(lay.k_big(s), lay.kv), (lay.v_raw(s), lay.kv), (lay.vt_big(s), lay.kv)]
        if lay.split:
            spans += [(lay.k_small(s), lay.kv), (lay.vt_small(s), lay.kv)]
    spans.sort()
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))        # disjoint
    assert spans[-1][0] + spans[-1][1] <= lay.tile_bytes
    assert all(a % 1024 == 0 for a, _ in spans)                                # swizzle atoms aligned


def _problem(v, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((v.tile.block_m, v.head)).astype(f32)
    k = rng.standard_normal((v.tile.block_n, v.head)).astype(f32)
    val = rng.standard_normal((v.tile.block_n, v.head)).astype(f32)
    return q, k, val


def _parts64(x, split):
    big, small = split_parts(x) if split else (x, np.zeros_like(x))
    return big.astype(np.float64), small.astype(np.float64)


@pytest.mark.parametrize("v", HOPPER_F32, ids=lambda v: v.name)
def test_s_from_descriptors_is_q_kt(v):
    """S = Q K^T of each consumer warpgroup through the k8-step descriptors, 3xTF32 (or plain), from the
    tiles the copy engine wrote and the parts the consumers (Q) and the producer (K) made in place."""
    lay = Layout(v)
    q, k, _ = _problem(v, 1)
    sm = Smem(lay.tile_bytes)
    sm.tma_load_f32(lay.q, q)
    sm.tma_load_f32(lay.k_big(1), k)
    slabs = v.head // 32
    for c in range(v.tile.block_m // 64):   # each consumer splits its own 64 rows of every slab
        split_rows_in_place(sm, lay.q + c * 64 * 128, lay.q_small + c * 64 * 128, 64, slabs, lay.bm * 128, 128,
                            lay.split)
    split_rows_in_place(sm, lay.k_big(1), lay.k_small(1), lay.bn, slabs, lay.bn * 128, 128, lay.split)
    (qb, qs), (kb, ks) = _parts64(q, lay.split), _parts64(k, lay.split)
    for c in range(v.tile.block_m // 64):
        s = np.zeros((64, lay.bn))
        rows = slice(64 * c, 64 * c + 64)
        for kk in range(v.head // 8):
            a_big = sm.read_k_major(k_major_desc(lay.q + c * 64 * 128, kk, lay.bm * 128), 64)
            b_big = sm.read_k_major(k_major_desc(lay.k_big(1), kk, lay.bn * 128), lay.bn)
            np.testing.assert_array_equal(a_big, qb[rows, 8 * kk:8 * kk + 8])
            np.testing.assert_array_equal(b_big, kb[:, 8 * kk:8 * kk + 8])
            s += a_big @ b_big.T
            if lay.split:
                a_small = sm.read_k_major(k_major_desc(lay.q_small + c * 64 * 128, kk, lay.bm * 128), 64)
                b_small = sm.read_k_major(k_major_desc(lay.k_small(1), kk, lay.bn * 128), lay.bn)
                s += a_small @ b_big.T + a_big @ b_small.T
        exact = q[rows].astype(np.float64) @ k.T.astype(np.float64)
        tol = 2.0**-20 if lay.split else 2.0**-9
        assert np.abs(s - exact).max() <= tol * np.abs(q[rows]).max() * np.abs(k).max() * v.head


@pytest.mark.parametrize("v", HOPPER_F32, ids=lambda v: v.name)
def test_pv_from_transposed_v_and_permuted_fragments_is_p_v(v):
    """O += P V of one warp: P's A fragments (c0, c2, c1, c3 of its C fragments) against V^T as the
    producer transposed it, read by the k8-step descriptors of each 64-column piece."""
    lay = Layout(v)
    _, _, val = _problem(v, 2)
    sm = Smem(lay.tile_bytes)
    sm.tma_load_f32(lay.v_raw(0), val)
    transpose_v_tile(sm, lay.v_raw(0), lay.vt_big(0), lay.vt_small(0), lay.bn, v.head, lay.split)
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 1, (16, lay.bn)).astype(f32)     # one warp's 16 rows of P
    pb, ps = _parts64(p, lay.split)
    vb, vs = _parts64(val, lay.split)
    pv_n = min(v.head, 64)
    o = np.zeros((16, v.head))
    for kk in range(lay.bn // 8):
        a_big = a_frags_from_c(pb[:, 8 * kk:8 * kk + 8])
        a_small = a_frags_from_c(ps[:, 8 * kk:8 * kk + 8])
        np.testing.assert_array_equal(a_big, pb[:, 8 * kk + PERM])       # A's k index j is key PERM[j]
        for h in range(v.head // pv_n):
            cols = slice(h * pv_n, h * pv_n + pv_n)
            b_big = sm.read_k_major(k_major_desc(lay.vt_big(0) + h * pv_n * 128, kk, v.head * 128), pv_n).T
            np.testing.assert_array_equal(b_big, vb[8 * kk + PERM, cols])   # B's k index j is key PERM[j] too
            o[:, cols] += a_big @ b_big
            if lay.split:
                b_small = sm.read_k_major(k_major_desc(lay.vt_small(0) + h * pv_n * 128, kk, v.head * 128),
                                          pv_n).T
                o[:, cols] += a_small @ b_big + a_big @ b_small
    exact = p.astype(np.float64) @ val.astype(np.float64)
    tol = 2.0**-20 if lay.split else 2.0**-9
    assert np.abs(o - exact).max() <= tol * np.abs(val).max() * lay.bn


def _conflict_free(addresses, width):
    """A warp's shared accesses of `width` bytes: conflict-free when each phase's distinct words (4-byte:
    all 32 lanes; 16-byte: 8 lanes a phase) fall in distinct banks (16-byte: distinct 16-byte bank groups)."""
    addresses = np.asarray(addresses)
    if width == 4:
        return len(set((addresses // 4) % 32)) == 32
    for phase in range(4):
        a = addresses[8 * phase:8 * phase + 8]
        if len(set((a // 16) % 8)) != 8:
            return False
    return True


@pytest.mark.parametrize("v", HOPPER_F32, ids=lambda v: v.name)
def test_producer_and_split_accesses_are_conflict_free(v):
    lay = Layout(v)
    for per_warp in transpose_v_items(lay.bn, v.head):
        for reads, write, n, k in per_warp:
            for i in range(4):
                assert _conflict_free(reads[i], 4)
            assert _conflict_free(write, 16)
    # split_rows_in_place: thread c of a round takes chunk c (consecutive 16-byte chunks)
    assert _conflict_free(16 * LANES, 16)


def test_transposition_covers_v_once():
    """Every (key, column) of V is read once and every V^T position written once, in the permuted order."""
    for bn, head in ((64, 64), (32, 128), (128, 64)):
        seen, written = [], []
        for per_warp in transpose_v_items(bn, head):
            for reads, write, n, k in per_warp:
                seen += list(zip(k.ravel(), np.broadcast_to(n, k.shape).ravel()))
                written += [int(w) // 16 for w in write]
        assert sorted(seen) == sorted((kk, nn) for kk in range(bn) for nn in range(head))
        assert len(set(written)) == len(written) == bn * head // 4


# --------------------------------------------------------------------------- the bias read (bias_frags.cuh)

def _load_bias_frags(n_tiles, strides, row_g, col0, lq, lk):
    """load_bias_frags (transcribed) for every lane: per lane and element (n, i) the element offset read
    (strides: batch, head, row in elements at batch = head = 0), None where it reads nothing (0), and
    the pair loads as (offset, floats)."""
    reads = np.full((32, n_tiles, 4), -1, dtype=np.int64)
    loads = []
    for lane in range(32):
        col = col0 + 2 * (lane % 4)
        for r in range(2):
            row = row_g[lane] + 8 * r
            keys_left = lk - col if row < lq else 0
            at = (row if row < lq else 0) * strides[2] + col
            for n in range(n_tiles):
                if 8 * n + 1 < keys_left:
                    reads[lane, n, 2 * r:2 * r + 2] = (at + 8 * n, at + 8 * n + 1)
                    loads.append((at + 8 * n, 2))
                elif 8 * n < keys_left:
                    reads[lane, n, 2 * r] = at + 8 * n
                    loads.append((at + 8 * n, 1))
    return reads, loads


def test_bias_frags_source_is_the_transcription():
    src = (kernel_dir() / "bias_frags.cuh").read_text()
    for line in ("const int col = col0 + 2 * (lane % 4);",
                 "const int keys_left = row < lq ? lk - col : 0;",
                 "bias.at<float>(batch, head, row < lq ? row : 0, col);",
                 "if (8 * n + 1 < keys_left) pair = __ldg(reinterpret_cast<const float2*>(at + 8 * n));",
                 "else if (8 * n < keys_left) pair.x = __ldg(at + 8 * n);",
                 "b[n][2 * r] = pair.x;", "b[n][2 * r + 1] = pair.y;"):
        assert line in src, line
    kernel = (kernel_dir() / "flash_fwd_wgmma_tf32.cu").read_text()
    assert "load_bias_frags(bias_frag, p.mask.bias, blk.batch, blk.head, warp_row0 + lane / 4, n0, dims.lq," in kernel


@pytest.mark.parametrize("n_tiles", [4, 8])
@pytest.mark.parametrize("lq,lk,row_stride", [(97, 132, 132), (97, 130, 132), (333, 1031, 0), (64, 64, 64)])
def test_bias_frags_read_each_visible_element_into_its_fragment(n_tiles, lq, lk, row_stride):
    """Every element (row < lq, col < lk) of a warp's 16 x 8 N tile is read once, into the C-fragment position
    the kernel's coord names (row g + 8 (i / 2), key 8 n + 2 t + i % 2); nothing past the sequence ends; pairs
    8-byte aligned when the rows are 16-byte chunks (row stride a multiple of 4, or 0); one warp instruction
    (fixed n, r) reads 32 contiguous bytes a row."""
    for warp_row0 in range(0, lq + 16, 16):
        for col0 in range(0, lk, 8 * n_tiles):
            row_g = warp_row0 + G
            reads, loads = _load_bias_frags(n_tiles, (0, 0, row_stride), row_g, col0, lq, lk)
            for n in range(n_tiles):
                for i in range(4):
                    row, col = row_g + 8 * (i // 2), col0 + 8 * n + 2 * T + i % 2
                    seen = (row < lq) & (col < lk)
                    want = np.where(seen, row * row_stride + col, -1)
                    np.testing.assert_array_equal(reads[:, n, i], want)
            assert all(off % 2 == 0 for off, floats in loads if floats == 2)
    # one instruction's pairs: the 4 lanes of a row read keys 8 n + 0..7, 32 contiguous bytes
    offs = (2 * T).reshape(8, 4)
    assert (offs[:, 0] == 0).all() and (np.diff(offs, axis=1) == 2).all()
