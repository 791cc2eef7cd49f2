"""The variant table (CPU): complete, consistent, and fully covered by the GPU tests."""
import itertools

import numpy as np
from dataclasses import replace

import pytest

from cuflash._dispatch import model as M
from cuflash._dispatch import select as V

from _variant_problems import problem_for


def test_every_variant_has_a_table_entry_and_fits():
    for v in V.all_variants():
        t = v.tile
        assert t in v.tiles(), v.name                 # a table entry, not an ad-hoc tile
        assert v.threads == 32 * t.warps
        assert 0 <= v.smem_bytes <= M.SMEM_MAX, v.name
        assert t.why, v.name


@pytest.mark.parametrize("gpu", list(M.SMEM_LIMITS))
def test_every_call_has_kernels_on_every_gpu_class(gpu):
    """Every (dtype, head bucket, causal, dQ strategy) call selects kernels that fit the
    GPU class's shared memory, except the one documented gap: the float64 backward at
    head dim 256 on 99 KB GPUs (sm_86 / sm_89 / sm_120)."""
    limit = M.SMEM_LIMITS[gpu]
    gaps = []
    for dtype, head, band, extra, det in itertools.product(M.DTYPES, M.HEAD_BUCKETS, (False, True), (False, True),
                                                           (False, True)):
        for vec in V.vec_choices(dtype):
            flags = dict(band=band, extra=extra, vec=vec)
            assert V.forward_variant(dtype, head, smem_limit=limit, **flags).smem_bytes <= limit
            try:
                plan = V.backward_variants(dtype, head, deterministic=det, smem_limit=limit, **flags)
            except ValueError as exc:
                assert "shared memory" in str(exc) and "this GPU allows" in str(exc)
                gaps.append((dtype, head))
                continue
            assert all(v.smem_bytes <= limit for v in plan)
    assert set(gaps) == ({("float64", 256)} if limit < 130 * 1024 else set())


def test_gpus_of_compute_capability_9_and_above_with_99_kb_get_portable_kernels():
    """The "sm90" rows are tuned for the H100 / H200's 227 KB; a newer GPU with 99 KB a block (sm_120) takes the
    "sm80" rows' tiles where an "sm90" row has none that fits, forward and backward, and those are variants the
    tests build (all_variants)."""
    limit, known = M.SMEM_LIMITS["sm_86, sm_89, sm_120 (RTX 30/40/50, L40)"], set(V.all_variants())
    for dtype, head, band, det in itertools.product(M.DTYPES, (64, 128), (False, True), (False, True)):
        for vec in V.vec_choices(dtype):
            fwd = V.forward_variant(dtype, head, band=band, vec=vec, smem_limit=limit, cc=120)
            bwd = V.backward_variants(dtype, head, band=band, vec=vec, deterministic=det, smem_limit=limit, cc=120)
            for v in (fwd,) + bwd:
                assert v.smem_bytes <= limit and v in known, v.name


def test_variants_are_unique_and_named_uniquely():
    variants = V.all_variants()
    assert len({v.name for v in variants}) == len(variants)


def test_every_table_entry_is_used():
    used = {(v.arch, v.family, v.dtype, v.head, v.tile) for v in V.all_variants()}
    unused = [(key, tile) for key, tile in V.table_rows() if key + (tile,) not in used]
    assert not unused, f"table entries no call can reach: {unused}"


def test_gpu_problem_runs_the_variant():
    """test_variants_gpu.py runs problem_for(v) for every v; the launcher's own selection must then
    include v (the GPU test also records the launches). One test over every row of the table."""
    missed = []
    for variant in V.all_variants():
        try:
            if variant not in problem_for(variant).variants():
                missed.append(variant.name)
        except ValueError as exc:
            missed.append(f"{variant.name}: {exc}")
    assert not missed, f"{len(missed)} variants no GPU problem runs: " + "; ".join(missed)


def test_resident_tiles_need_room_for_their_ctas():
    """A tile with ``resident=2`` is taken only where two of its CTAs fit an SM (the per-block
    limit plus one 1 KB reservation): the head-dim-128 forward's 128x64 tile (102 KB) on the
    H100, its 128x32 tile (68 KB) on the A100 and the 99 KB GPUs."""
    limits = M.SMEM_LIMITS
    h100, a100, small = (limits[k] for k in limits)
    for dtype in ("float16", "bfloat16"):
        for limit, (block_n, park) in [(h100, (64, True)), (a100, (32, False)), (small, (32, False))]:
            v = V.forward_variant(dtype, 128, band=False, vec=True, smem_limit=limit)
            assert (v.tile.block_n, v.tile.park) == (block_n, park), (dtype, limit)
            assert v.smem_bytes <= limit
    # The bound: n * (bytes + 1 KB) <= limit + 1 KB.
    assert M.fits_resident(h100 // 2 - 512, 2, h100) and not M.fits_resident(h100 // 2 - 511, 2, h100)
    assert M.fits_resident(h100, 1, h100)


def test_late_copies_is_a_dkdv_tile_option():
    """LATE_COPIES moves the dK/dV kernel's copies within a step: same shared memory, written after QSPLIT;
    other families refuse it."""
    late = M.Tile(64, 128, 8, 2, "test", query_split=2, late_copies=True)
    plain = M.Tile(64, 128, 8, 2, "test", query_split=2)
    a = M.Variant("bwd_dkdv_mma", "bfloat16", 128, vec=True, atomic_dq=True, tile=late)
    b = M.Variant("bwd_dkdv_mma", "bfloat16", 128, vec=True, atomic_dq=True, tile=plain)
    assert a.smem_bytes == b.smem_bytes
    assert a.name.endswith(", 2, true>") and b.name.endswith(", 2>")   # QSPLIT, then LATE_COPIES
    one_warp = M.Variant("bwd_dkdv_mma", "bfloat16", 64, tile=M.Tile(32, 128, 4, 2, "test", late_copies=True))
    assert one_warp.name.endswith(", 1, true>")   # QSPLIT written out before LATE_COPIES
    with pytest.raises(ValueError, match="late_copies"):
        M.Variant("fwd_mma", "bfloat16", 128, tile=M.Tile(128, 64, 4, 2, "test", late_copies=True))


def _dq_tile_offset(row, col, cols):
    """Where the dK/dV kernel adds dQ_acc[row][col] (flash_bwd_mma.cu with atomics.cuh's dq_tile): lane
    4 (row % 8) + (col % 8) / 2 of tile (row / 16, col / 8) holds c0, c1 (row % 16 < 8) or c2, c3."""
    lane = 4 * (row % 8) + (col % 8) // 2
    slot = 2 * ((row % 16) // 8) + col % 2
    return (row // 16) * 16 * cols + (col // 8) * 16 * 8 + 4 * lane + slot


def test_tiled_dq_accumulator_round_trip():
    """The fragment-tiled dQ accumulator: the kernel's scatter (dq_tile plus a lane's C fragment) and the
    convert kernel's gather (convert_dq_tiles: lane l stores rows l / 4, l / 4 + 8 at columns 2 (l % 4) + 0, 1
    of each tile, from its float4) are inverse; every element has its own slot."""
    rows, cols = 64, 128
    values = np.arange(rows * cols, dtype=np.float64).reshape(rows, cols)
    acc = np.full(rows * cols, np.nan)
    for r in range(rows):
        for c in range(cols):
            acc[_dq_tile_offset(r, c, cols)] = values[r, c]
    assert not np.isnan(acc).any()
    back = np.full((rows, cols), np.nan)
    for r0 in range(0, rows, 16):
        for t in range(cols // 8):
            for lane in range(32):
                v = acc[r0 * cols + 128 * t + 4 * lane:][:4]
                top, col = r0 + lane // 4, 8 * t + 2 * (lane % 4)
                back[top, col:col + 2], back[top + 8, col:col + 2] = v[:2], v[2:]
    np.testing.assert_array_equal(back, values)
    # A warp's reduction of one fragment: lane l's 16 bytes at 4 l, 512 contiguous bytes.
    frag = [_dq_tile_offset(16 + l // 4 + 8 * (i // 2), 8 + 2 * (l % 4) + i % 2, cols) for l in range(32) for i in range(4)]
    assert frag == list(range(frag[0], frag[0] + 128))


def test_tiled_dq_accumulator_plans():
    """The convert kernel reads tiles exactly where the plan's dK/dV kernel is the 16-bit tensor-core one, and
    the launcher pads that accumulator to whole steps of the kernel's rows and its head bucket's columns."""
    from cuflash._dispatch.plan import dq_accumulator_shape
    for dtype, head, cc in [("bfloat16", 64, 80), ("float16", 128, 80), ("bfloat16", 128, 90), ("float32", 64, 80),
                            ("float64", 64, 80)]:
        plan = V.backward_variants(dtype, head, band=False, extra=False, vec=True, deterministic=False, cc=cc)
        mma = [v for v in plan if v.family == "bwd_dkdv_mma" and v.atomic_dq]
        assert plan[-1].family == "bwd_convert_dq" and plan[-1].dq_tiled == bool(mma), (dtype, head, cc)
        shape = dq_accumulator_shape(plan, 2, 3, 97, head - 5)
        if mma:
            bm = mma[0].tile.block_m
            assert shape == (2, 3, -(-97 // bm) * bm, head)
        else:
            assert shape == (2, 3, 97, head - 5 + (head - 5) % 2)
    with pytest.raises(ValueError, match="dq_tiled"):
        M.Variant("bwd_dsum", "bfloat16", 0, dq_tiled=True)


def test_park_is_a_forward_tile_option():
    tile = M.Tile(64, 64, 4, 2, "test", park=True)
    assert M.Variant("fwd_mma", "float16", 64, tile=tile).name.endswith(", true>")
    with pytest.raises(ValueError, match="park"):
        M.Variant("bwd_dkdv_mma", "float16", 64, tile=tile)


def test_selection_rules():
    assert V.forward_variant("float16", 64, band=True, vec=True).family == "fwd_mma"
    for head in M.HEAD_BUCKETS:   # float64 on the fp64 tensor cores, float32 on TF32 tensor cores
        assert V.forward_variant("float64", head, band=True, vec=True) == M.Variant("fwd_dmma", "float64", head,
                                                                                    band=True, vec=True)
        assert V.forward_variant("float32", head, band=True, vec=True, precision="tf32") == M.Variant(
            "fwd_tf32", "float32", head, band=True, vec=True)
    # precision="highest" on 3xTF32 where a tile fits, else on FMA (head dim 256).
    highest = V.forward_variant("float32", 128, band=False, vec=True)
    assert highest == M.Variant("fwd_tf32x3", "float32", 128, vec=True) and highest.split
    assert V.forward_variant("float32", 256, band=False, vec=True) == M.Variant("fwd_fma", "float32", 256)
    small = M.SMEM_LIMITS["sm_86, sm_89, sm_120 (RTX 30/40/50, L40)"]
    assert V.forward_variant("float32", 128, band=False, vec=True, smem_limit=small).family == "fwd_tf32x3"
    assert V.forward_variant("float32", 128, band=False, vec=True, precision="fma").family == "fwd_fma"
    # The float32 backward follows the precision: 3xTF32, TF32, or the FMA kernels ("fma", the baseline);
    # FMA at head dim 256, and kernel by kernel where no tensor-core tile fits the GPU.
    for precision, (dkdv, dq) in [("highest", ("bwd_dkdv_tf32x3", "bwd_dq_tf32x3")),
                                  ("tf32", ("bwd_dkdv_tf32", "bwd_dq_tf32")), ("fma", ("bwd_dkdv_fma", "bwd_dq_fma"))]:
        assert [v.family for v in V.backward_variants("float32", 64, band=False, vec=True, deterministic=False,
                                                      precision=precision)] == ["bwd_dsum", dkdv, "bwd_convert_dq"]
        plan = V.backward_variants("float32", 32, band=True, extra=True, vec=False, deterministic=True, dbias=True,
                                   precision=precision)
        assert [v.family for v in plan] == ["bwd_dsum", dkdv, dq]
        assert plan[1].split == (precision == "highest") and not plan[1].atomic_dq
        assert [v.family for v in V.backward_variants("float32", 256, band=False, vec=True, deterministic=True,
                                                      precision=precision)] == ["bwd_dsum", "bwd_dkdv_fma", "bwd_dq_fma"]
    # 3xTF32 at head dim 128 on query groups: one pass with 16-byte loads and dQ atomics; else dV, then dK,
    # each pass recomputing S^T (Tile.vec_only, Tile.passes, select._dkdv_passes), packed calls too.
    plan = V.backward_variants("float32", 128, band=True, vec=True, deterministic=False)
    assert [(v.family, v.pass_, v.atomic_dq) for v in plan] == [
        ("bwd_dsum", 0, False), ("bwd_dkdv_tf32x3", 0, True), ("bwd_convert_dq", 0, False)]
    assert plan[1].tile.warps == 2 * plan[1].tile.block_n // 16
    two = [("bwd_dkdv_tf32x3", 1, False), ("bwd_dkdv_tf32x3", 2, True)]
    plan = V.backward_variants("float32", 128, band=True, vec=False, deterministic=False)
    assert [(v.family, v.pass_, v.atomic_dq) for v in plan][1:3] == two
    plan = V.backward_variants("float32", 128, band=True, vec=True, deterministic=True)
    assert [(v.family, v.pass_, v.atomic_dq) for v in plan] == [
        ("bwd_dsum", 0, False), *[(f, p, False) for f, p, _ in two], ("bwd_dq_tf32x3", 0, False)]
    plan = V.packed_backward_variants("float32", 128, band=True, vec=True, smem_limit=M.SMEM_MAX, deterministic=False)
    assert [(v.family, v.pass_, v.atomic_dq, v.packed) for v in plan][1:3] == [t + (True,) for t in two]
    # On 99 KB GPUs at head dim 128 no 3xTF32 dK/dV tile fits, but the dQ kernel's does (without EXTRA):
    # the fallback is kernel by kernel.
    plan = V.backward_variants("float32", 128, band=False, vec=True, deterministic=True, smem_limit=small)
    assert [v.family for v in plan] == ["bwd_dsum", "bwd_dkdv_fma", "bwd_dq_tf32x3"]
    plan = V.backward_variants("float32", 128, band=False, extra=True, vec=True, deterministic=True, smem_limit=small)
    assert [v.family for v in plan] == ["bwd_dsum", "bwd_dkdv_fma", "bwd_dq_fma"]
    # The dK/dV passes follow the tile: head dim 128 is one pass at 32-query steps, two with the
    # EXTRA kernels' 64-query steps (Tile.passes).
    plan = V.backward_variants("bfloat16", 128, band=False, vec=True, deterministic=False)
    assert [(v.family, v.pass_, v.atomic_dq) for v in plan] == [
        ("bwd_dsum", 0, False), ("bwd_dkdv_mma", 0, True), ("bwd_convert_dq", 0, False)]
    plan = V.backward_variants("bfloat16", 128, band=False, extra=True, vec=True, deterministic=False)
    assert [(v.family, v.pass_, v.atomic_dq) for v in plan] == [
        ("bwd_dsum", 0, False), ("bwd_dkdv_mma", 1, False), ("bwd_dkdv_mma", 2, True), ("bwd_convert_dq", 0, False)]
    with V.tile_override("bwd_dkdv_mma", 128, M.Tile(64, 64, 4, 2, "two passes", passes=2)):
        plan = V.backward_variants("float16", 128, band=True, vec=True, deterministic=True)
        assert [(v.family, v.pass_, v.atomic_dq) for v in plan] == [
            ("bwd_dsum", 0, False), ("bwd_dkdv_mma", 1, False), ("bwd_dkdv_mma", 2, False), ("bwd_dq_mma", 0, False)]
    plan = V.backward_variants("float16", 256, band=True, vec=True, deterministic=True)
    assert [v.family for v in plan] == ["bwd_dsum", "bwd_dkdv_fma", "bwd_dq_fma"]
    for head in (32, 64, 128):   # float64 gradients on the fp64 tensor cores, one dK/dV pass
        plan = V.backward_variants("float64", head, band=False, vec=True, deterministic=False)
        assert [(v.family, v.pass_, v.atomic_dq) for v in plan] == [
            ("bwd_dsum", 0, False), ("bwd_dkdv_dmma", 0, True), ("bwd_convert_dq", 0, False)]
        plan = V.backward_variants("float64", head, band=True, extra=True, vec=False, deterministic=True)
        assert [v.family for v in plan] == ["bwd_dsum", "bwd_dkdv_dmma", "bwd_dq_dmma"]
    plan = V.backward_variants("float64", 256, band=True, vec=True, deterministic=True)
    assert [v.family for v in plan] == ["bwd_dsum", "bwd_dkdv_fma", "bwd_dq_fma"]
    assert M.head_bucket(1) == 32 and M.head_bucket(33) == 64 and M.head_bucket(256) == 256
    with pytest.raises(ValueError, match="larger than"):
        M.head_bucket(257)


def test_hopper_selection():
    """Compute capability 9.0 takes the wgmma forward for 16-bit calls with 16-byte loadable rows at the
    head dims it has tiles for, with the EXTRA options (bias, mask, dropout, block layout) too; everything
    else, and every other GPU, the portable path."""
    v = V.forward_variant("bfloat16", 128, band=True, vec=True, cc=90)
    assert (v.family, v.arch, v.nvrtc_arch) == ("fwd_wgmma", "sm90a", "sm_90a")
    assert v.compile_target("sm_90") == "sm_90a" and v.compile_target("sm_80") is None
    for head in (64, 128, 256):
        x = V.forward_variant("float16", head, band=True, extra=True, vec=True, cc=90)
        assert (x.family, x.extra, x.band) == ("fwd_wgmma", True, True)
        assert x.tile == V.forward_variant("float16", head, band=True, vec=True, cc=90).tile   # the plain tile
        assert x.smem_bytes <= M.SMEM_LIMITS["sm_90 (H100, H200)"]
        # ... not where the keys are too few (head dim 64: its short-rows tile takes no EXTRA option), nor on
        # another GPU or without 16-byte rows
        assert V.forward_variant("float16", head, band=False, extra=True, vec=True, cc=90,
                                 rows=V.row_class(head, 1024, False)).family == ("fwd_mma" if head == 64 else "fwd_wgmma")
        assert V.forward_variant("float16", head, band=False, extra=True, vec=True, cc=80).family == "fwd_mma"
        assert V.forward_variant("float16", head, band=False, extra=True, vec=False, cc=90).family == "fwd_mma"
    assert V.forward_variant("float16", 64, band=False, vec=True, cc=90).family == "fwd_wgmma"
    # Few keys for the Hopper forward's table tile at head dim 64 (HOPPER_FWD_MIN_KEYS for EXTRA calls, and
    # HOPPER_FWD_SHORT_KEYS visited by a query block on average: half the keys under a band); none at 128.
    assert [V.row_class(64, lk, False) for lk in (1024, 1025, 2048, 2049)] == ["few", "short", "short", "long"]
    assert [V.row_class(64, lk, True) for lk in (1024, 4096, 4098)] == ["few", "short", "long"]
    assert V.row_class(128, 1, False) == V.row_class(128, 1, True) == "long"
    # ... where the short-rows tile takes them: two CTAs an SM (Variant.short)
    for band in (False, True):
        for rows in ("few", "short"):
            short = V.forward_variant("float16", 64, band=band, vec=True, cc=90, rows=rows)
            assert (short.family, short.short, short.tile.ctas) == ("fwd_wgmma", True, 2)
            assert short.smem_bytes <= M.SMEM_LIMITS["sm_90 (H100, H200)"] // 2   # two CTAs an SM
            assert short in V.all_variants()
            # EXTRA calls: the table tile for "short" rows, the portable kernel for "few"
            x = V.forward_variant("float16", 64, band=band, extra=True, vec=True, cc=90, rows=rows)
            assert (x.family, x.short) == (("fwd_wgmma", False) if rows == "short" else ("fwd_mma", False))
        assert not V.forward_variant("float16", 64, band=band, vec=True, cc=90, rows="long").short
    assert V.forward_variant("float16", 64, band=False, vec=False, cc=90, rows="few").family == "fwd_mma"
    assert V.forward_variant("float16", 128, band=False, vec=True, cc=90, rows=V.row_class(128, 64, False)).family == "fwd_wgmma"
    assert V.forward_variant("float16", 32, band=False, vec=True, cc=90).family == "fwd_mma"
    assert V.forward_variant("bfloat16", 128, band=True, vec=True, cc=80).family == "fwd_mma"
    assert V.forward_variant("bfloat16", 128, band=True, vec=True, cc=100).family == "fwd_mma"
    assert V.forward_variant("bfloat16", 128, band=True, vec=False, cc=90).family == "fwd_mma"
    assert V.forward_variant("float16", 256, band=False, vec=True, cc=90).family == "fwd_wgmma"
    assert V.forward_variant("float32", 64, band=False, vec=False, cc=90).family == "fwd_tf32x3"   # portable
    assert M.Variant("fwd_mma", "float16", 64).compile_target("sm_80") == "sm_80"


def test_hopper_float32_selection():
    """Compute capability 9.0 takes the TF32 wgmma forward (flash_fwd_wgmma_tf32.cu) for float32 calls
    with 16-byte loadable rows at head dims 64 and 128, 3xTF32 for "highest" ("tf32" keeps the portable
    fwd_tf32, faster there: TF32_WGMMA_FAMILY),
    causal / windowed (band) and EXTRA options included (its EXTRA variant: the same tile and shared
    memory, the bias read from global memory), short rows too; element loads, head dims 32 and 256 and
    other GPUs keep the portable kernels, which are also each call's fallback (forward_choice's second
    variant: the same GPU's portable row, "sm90" included, EXTRA where the call has it)."""
    for head in (64, 128):
        for band, extra in itertools.product((False, True), (False, True)):
            v, portable = V.forward_choice("float32", head, band, extra, True, True, 90, M.SMEM_MAX, "tf32")
            assert v == portable and v.family == "fwd_tf32" and v.extra == extra
            for precision, family in (("highest", "fwd_wgmma_tf32x3"),):
                v, portable = V.forward_choice("float32", head, band, extra, True, True, 90, M.SMEM_MAX, precision)
                assert (v.family, v.arch, v.band, v.extra, v.nvrtc_arch) == (family, "sm90a", band, extra, "sm_90a")
                assert v.split == (3 if precision == "highest" else 0)
                assert v.compile_target("sm_90") == "sm_90a" and v.compile_target("sm_80") is None
                assert v.tile == M.Variant(family, "float32", head, arch="sm90a").fitted(M.SMEM_MAX).tile
                assert portable == V.forward_variant("float32", head, band=band, extra=extra, vec=True, cc=90,
                                                     precision=precision, wgmma=False)
                assert portable.family == V.TF32_FAMILY[precision] and portable.arch != "sm90a"
                assert portable.extra == extra
                assert V.forward_variant("float32", head, band=band, vec=False, cc=90,
                                         precision=precision).family == V.TF32_FAMILY[precision]
                assert V.forward_variant("float32", head, band=band, vec=True, cc=80,
                                         precision=precision).family == V.TF32_FAMILY[precision]
            assert v.smem_bytes <= M.SMEM_LIMITS["sm_90 (H100, H200)"]
    for head in (32, 256):
        assert V.forward_variant("float32", head, band=False, vec=True, cc=90).arch != "sm90a"
    assert V.forward_variant("float32", 64, band=False, vec=True, cc=90, precision="fma").family == "fwd_fma"
    # name expression: float, the tile, the masking flags, the split kind (TF32X3_PARTS = 3; plain 0)
    hi = V.forward_variant("float32", 64, band=True, vec=True, cc=90)
    assert hi.name.startswith("flash_fwd_wgmma_tf32<float, TileCfg<64, 128, 64, 12, 2, 1, 384, ")
    assert hi.name.endswith(", MaskFlags<true, false>, 3>")
    ex = V.forward_variant("float32", 128, band=False, extra=True, vec=True, cc=90)
    assert ex.name.endswith(", MaskFlags<false, true>, 3>") and ex.smem_bytes == V.forward_variant(
        "float32", 128, band=False, vec=True, cc=90).smem_bytes


def test_hopper_backward_selection():
    """Compute capability 9.0 takes the wgmma dK/dV kernel (with atomic dQ) for 16-bit calls with 16-byte
    loadable rows and the default (atomic) dQ at head dims 64, 128 and 256, EXTRA options at 64 and 128
    (adding a bias's gradient itself: its dbias variant, no dbias kernel); a deterministic call, a masking
    option at 256, another head dim or another GPU keeps the portable kernels (at head dim 256 the FMA ones),
    and a deterministic dbias the portable dbias kernel (no atomics)."""
    for dtype, head, band in [("float16", 64, False), ("bfloat16", 128, True), ("float16", 256, True),
                              ("bfloat16", 256, False)]:
        plan = V.backward_variants(dtype, head, band=band, vec=True, deterministic=False, cc=90)
        assert [(v.family, v.arch) for v in plan] == [("bwd_dsum", "sm80"), ("bwd_dkdv_wgmma", "sm90a"),
                                                      ("bwd_convert_dq", "sm80")]
        assert plan[1].band == band and plan[1].compile_target("sm_90") == "sm_90a"
    for dtype, head, band, dbias in [("float16", 64, False, False), ("bfloat16", 64, True, True),
                                     ("float16", 128, True, False), ("bfloat16", 128, False, True)]:
        plan = V.backward_variants(dtype, head, band=band, extra=True, vec=True, deterministic=False, cc=90,
                                   dbias=dbias)
        assert [v.family for v in plan] == ["bwd_dsum", "bwd_dkdv_wgmma", "bwd_convert_dq"]
        assert plan[1].extra and plan[1].band == band and plan[1].tile.block_m == 64 and plan[1].dbias == dbias
        assert plan[1].name.endswith(f", {str(dbias).lower()}>")
        assert plan[1].smem_bytes <= M.SMEM_LIMITS["sm_90 (H100, H200)"]
    portable = dict(band=False, vec=True, deterministic=False)
    for head in (128, 256):
        for kwargs in (dict(cc=80), dict(cc=100), dict(cc=90, deterministic=True),
                       dict(cc=90, deterministic=True, extra=True), dict(cc=90, vec=False)):
            plan = V.backward_variants("float16", head, **{**portable, **kwargs})
            assert "bwd_dkdv_wgmma" not in [v.family for v in plan], (head, kwargs)
            if head == 256:
                assert "bwd_dkdv_fma" in [v.family for v in plan], kwargs
    plan = V.backward_variants("float16", 64, cc=90, extra=True, dbias=True, vec=True, band=False,
                               deterministic=True)
    assert [v.family for v in plan] == ["bwd_dsum", "bwd_dkdv_mma", "bwd_dq_mma", "bwd_dbias_mma"]
    plan = V.backward_variants("float16", 256, cc=90, extra=True, **portable)   # HOPPER_BWD_EXTRA_HEADS
    assert "bwd_dkdv_wgmma" not in [v.family for v in plan] and "bwd_dkdv_fma" in [v.family for v in plan]
    assert "bwd_dkdv_wgmma" not in [v.family for v in V.backward_variants("float16", 32, cc=90, **portable)]
    assert "bwd_dkdv_wgmma" not in [v.family for v in V.backward_variants("float32", 64, cc=90, **portable)]


def test_hopper_backward_head_256_layout():
    """The head-dim-256 Hopper backward (both consumer warpgroups on one 64-key block, split by columns)
    fits the H100's 227 KB: K, V, two stages of Q and dO, P^T and dS^T twice (dQ is staged in the
    step's Q / dO tiles), and the kernel's boxes are whole tensor-map boxes (64 query rows = one dQ box)."""
    v = V.backward_variants("bfloat16", 256, band=True, vec=True, deterministic=False, cc=90)[1]
    t = v.tile
    assert (t.block_m, t.block_n, t.warps, t.stages) == (64, 64, 12, 2)
    assert v.smem_bytes == 1024 + (2 * 64 * 256 + 2 * 2 * 64 * 256 + 2 * 2 * 64 * 64) * 2 + 2 * 2 * 64 * 4 + 8 * 5
    assert v.smem_bytes <= M.SMEM_LIMITS["sm_90 (H100, H200)"]
    assert v.grid(2, 8, 2, 1000, 1000) == -(-1000 // 64) * 4 * 2


def test_grid_has_no_65535_limit_but_a_2_31_one():
    v = V.forward_variant("float16", 64, band=False, vec=True)
    assert v.grid(batch=70000, heads_q=3, group=1, lq=16, lk=16) == 210000
    batch, heads = 2**20, 2**6
    tiles = 2**31 // (batch * heads) + 1                  # one tile row more than 2^31 - 1 CTAs allow
    with pytest.raises(ValueError, match="grid limit"):
        v.grid(batch=batch, heads_q=heads, group=1, lq=tiles * v.tile.block_m, lk=16)


def _with_wide_k(v, k):
    return replace(v, tile=replace(v.tile, wide_k=k))


def test_wide_k_variants_name_their_mma_shape():
    """Tile.wide_k (branch f64-perf): the kernels' last template parameter, only where it is non-zero (the
    m8n8k4 variants keep their names and code), sm_90 only, and only for the fp64 tensor-core families."""
    plain = M.Variant("fwd_dmma", "float64", 128, vec=True)
    wide = _with_wide_k(plain, 16)
    assert not plain.name.endswith(", 16>") and wide.name == plain.name[:-1] + ", 16>"
    assert wide.compile_target("sm_80") is None and wide.compile_target("sm_90") == "sm_90"
    assert plain.compile_target("sm_80") == "sm_80"
    dkdv = _with_wide_k(M.Variant("bwd_dkdv_dmma", "float64", 64, vec=True), 8)
    assert dkdv.name.endswith(", 0, false, true, 8>")
    for family, wide_k in (("fwd_dmma", 12), ("fwd_fma", 16)):
        with pytest.raises(ValueError, match="wide_k"):
            M.Variant(family, "float64", 64, tile=M.Tile(64, 32, 4, 2, "test", wide_k=wide_k))


def test_sm90_rows_are_chosen_from_compute_capability_9():
    """The "sm90" rows (tiles tuned on the H100 that spill on sm_80, or Tile.wide_k's sm_90-only MMA shapes)
    serve calls on compute capability >= 9.0 only, are compiled for sm_90 only, and EXTRA calls keep the EXTRA
    table's sm80 row where it has one and the sm90 row has no EXTRA twin."""
    sm90 = [v for v in V.all_variants() if v.arch == "sm90"]
    assert sm90 and all(v.compile_target("sm_80") is None and v.compile_target("sm_90") == "sm_90" for v in sm90)
    assert all(v.wide_k == 0 for v in V.all_variants() if v.arch == "sm80")
    for dtype, head, family in (("float64", 128, "fwd_dmma"), ("float32", 64, "fwd_tf32x3")):
        # (float32 with 16-byte rows takes the Hopper wgmma kernel, EXTRA too; its portable fallback is this row)
        new = V.forward_variant(dtype, head, band=False, vec=True, cc=90, wgmma=False)
        old = V.forward_variant(dtype, head, band=False, vec=True, cc=80)
        assert (new.family, new.arch, old.family, old.arch) == (family, "sm90", family, "sm80")
        assert new.tile == M.TABLES["plain"][("sm90", family, dtype, head)][0] != old.tile
        extra = V.forward_variant(dtype, head, band=False, extra=True, vec=True, cc=90, wgmma=False)
        assert extra.arch == "sm80" and extra.tile == M.TABLES["extra"][("sm80", family, dtype, head)][0]
    assert V.forward_variant("float64", 128, band=False, vec=True, cc=90).wide_k == 16


def test_vec_only_tiles_serve_16_byte_loads_only():
    """Tile.vec_only: the float32 3xTF32 forward's 128x32 tile at head dim 128 spills in its element-load
    variants, so those take the next tile; a table of vec_only tiles alone has nothing for element loads."""
    fast = V.forward_variant("float32", 128, band=False, vec=True, cc=90, wgmma=False)
    scalar = V.forward_variant("float32", 128, band=False, vec=False, cc=90)
    assert fast.tile.vec_only and (fast.tile.block_n, scalar.tile.block_n) == (32, 16) and not scalar.tile.vec_only
    assert not any(v.tile.vec_only and not v.vec for v in V.all_variants())
    only = M.Tile(64, 32, 4, 2, "test", vec_only=True)
    with V.tile_override("fwd_tf32x3", 64, only, dtypes=("float32",)):
        assert M.Variant("fwd_tf32x3", "float32", 64, vec=True).fitted(M.SMEM_MAX).tile == only
        with pytest.raises(ValueError, match="16-byte loads only"):
            M.Variant("fwd_tf32x3", "float32", 64, vec=False, tile=only).fitted(M.SMEM_MAX)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decoding_tiles_by_rows_and_shared_memory(dtype):
    """The decoding kernel's tile: float32 blocks of at most 8 rows on the query-minor tile where one fits,
    more rows (and float64) on a 16-row strip, the first of the table's that fits (head dim 128: float64 on six
    warps of 48-key tiles on 227 KB, four warps of 32 on the A100's 163 KB); no strip fits 99 KB."""
    decode = M.Variant("fwd_decode", dtype, 128, vec=True, kv_split=True)
    h200, a100, small = (M.SMEM_LIMITS[k] for k in ("sm_90 (H100, H200)", "sm_80 (A100)",
                                                        "sm_86, sm_89, sm_120 (RTX 30/40/50, L40)"))
    for rows in (1, 8, 9, 16):
        for limit in (h200, a100):
            tile = V._decoding_tile(decode, rows, limit).tile
            assert tile.block_m == (8 if dtype == "float32" and rows <= 8 else 16)
            assert tile.stages == 2
            wide = dtype == "float64" and limit == h200
            assert (tile.block_n, tile.warps) == ((48, 6) if wide else (64, 4) if dtype == "float32" else (32, 4))
        with pytest.raises(ValueError):
            V._decoding_tile(decode, rows, small)
    if dtype == "float32":   # a strip that does not fit is not replaced by the 8-row tile for 9 rows or more
        between = 150_000   # the 8-row tile (147712 bytes) fits, the strip (152064) does not
        assert V._decoding_tile(decode, 8, between).tile.block_m == 8
        with pytest.raises(ValueError):
            V._decoding_tile(decode, 9, between)
