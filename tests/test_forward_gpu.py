"""Forward kernels on the GPU against the float64 NumPy reference (marker `gpu`)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference

from _errors import exact, magnitude, naive_same_dtype, rel_error, within_budget
from _gpu_checks import DTYPES, check_forward, make_inputs
from _tiers import sampled

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

HEAD_DIMS = [1, 8, 16, 31, 32, 59, 64, 72, 111, 128, 160, 200, 256]
CAUSAL = [False, True, "bottom_right"]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(list(DTYPES)), b=st.integers(1, 2), hk=st.integers(1, 2),
       group=st.sampled_from([1, 1, 2, 3]), lq=st.integers(1, 300), lk=st.integers(1, 300),
       d=st.sampled_from(HEAD_DIMS), dv_same=st.booleans(), dv=st.sampled_from(HEAD_DIMS),
       causal=st.sampled_from(CAUSAL), seed=st.integers(0, 2**31))
def test_forward_matches_reference(dtype, b, hk, group, lq, lk, d, dv_same, dv, causal, seed):
    check_forward(dtype, b, hk * group, hk, lq, lk, d, d if dv_same else dv, causal, seed)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("lq,lk,d", sampled([(97, 1025, 59), (1025, 97, 111), (256, 256, 64), (128, 512, 128),
                                             (200, 130, 256)], [(97, 1025, 59), (1025, 97, 111), (200, 130, 256)],
                                            multi=True))
def test_forward_grid(dtype, causal, lq, lk, d):
    """Every dtype x head bucket x causal mode at odd sizes (the variant matrix)."""
    check_forward(dtype, 1, 2, 1, lq, lk, d, d, causal, seed=lq * lk + d)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_huge_logits_stay_finite(dtype):
    # q ~ 1e4 * N(0, 1), so |s| ~ 1e4: a naive exp would overflow.
    out = check_forward(dtype, 1, 2, 2, 64, 80, 64, 64, True, seed=5, logit_scale=1e4)
    assert np.isfinite(cp.asnumpy(out).astype(np.float64)).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", [64, 59])
def test_every_output_element_written(dtype, d):
    """Fill the pool blocks that out and lse will reuse with 0xFF bytes (NaN in
    every float format), free them, then call: no NaN may survive."""
    shape = (2, 3, 133, d)
    rng = np.random.default_rng(1)
    q, k, v = (cp.asarray(rng.standard_normal(shape).astype(DTYPES[dtype])) for _ in range(3))
    out_bytes = q.nbytes
    lse_bytes = q.nbytes // (q.itemsize * d) * (8 if dtype == "float64" else 4)
    for _ in range(3):
        poison = [cp.full(n, 0xFF, dtype=cp.uint8) for n in (out_bytes, lse_bytes)]
        del poison
        out, lse = cuflash.attention_forward(q, k, v, causal="bottom_right")
        assert not np.isnan(cp.asnumpy(out).astype(np.float64)).any()
        assert not np.isnan(cp.asnumpy(lse)).any()
        del out, lse


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_with_nothing_to_attend(dtype):
    """Bottom-right causal with Lq > Lk: the first Lq - Lk rows see no key."""
    rng = np.random.default_rng(2)
    lq, lk = 150, 40
    _, dev, _ = make_inputs(rng, dtype, 1, 2, 2, lq, lk, 64, 64)
    out, lse = cuflash.attention_forward(*dev, causal="bottom_right")
    out = cp.asnumpy(out).astype(np.float64)
    lse = cp.asnumpy(lse)
    assert (out[:, :, : lq - lk] == 0).all()
    assert np.isneginf(lse[:, :, : lq - lk]).all()
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    assert np.isfinite(lse[:, :, lq - lk:]).all()


@pytest.mark.parametrize("d", sampled([32, 59, 64, 111, 128, 200, 256], [59, 128, 256]))
@pytest.mark.parametrize("causal", [True, "bottom_right"])
def test_float64_tensor_core_forward_masked(d, causal, launches):
    """The fp64 tensor-core forward (fwd_dmma) at every head bucket, through 16-byte loads (even d)
    and element loads (odd d), with a causal mask, a bias (with -inf entries), a boolean mask, and
    rows that see no key: against the long-double reference under the error rule, output exactly 0
    and lse exactly -inf on the empty rows, lse within 1e-12 elsewhere."""
    b, hq, hk, lq, lk = 2, 2, 1, 97, 130
    rng = np.random.default_rng(d)
    ref_in, dev, _ = make_inputs(rng, "float64", b, hq, hk, lq, lk, d, d)
    bias = rng.standard_normal((1, hq, lq, lk))
    bias[:, :, 5, ::3] = -np.inf                                   # a bias that masks too
    mask = rng.random((b, 1, lq, lk)) < 0.7
    mask[:, :, ::11] = False                                       # rows 0, 11, 22, ... see nothing
    out, lse = cuflash.attention_forward(*dev, causal=causal, bias=cp.asarray(bias), mask=cp.asarray(mask))
    assert [v.family for v in launches] == ["fwd_dmma"]
    opts = dict(causal=causal, scale=1 / np.sqrt(d), bias=bias, mask=mask)
    got = cp.asnumpy(out)
    ok, msg = within_budget(got, exact(*ref_in, dtype="float64", **opts),
                            naive_same_dtype(*ref_in, dtype="float64", **opts), magnitude(*ref_in, **opts), "float64")
    assert ok, msg
    ref_lse = reference.attention_naive(*ref_in, **opts)[1]
    got_lse = cp.asnumpy(lse)
    empty = np.isneginf(ref_lse)
    assert empty[:, :, ::11].all() and (np.isneginf(got_lse) == empty).all()
    assert (got[empty] == 0).all() and np.isfinite(got).all()
    np.testing.assert_allclose(got_lse[~empty], ref_lse[~empty], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_strided_blhd_inputs(dtype):
    """(B, L, H, D) data through swapaxes: no copy needed, same answer as contiguous."""
    rng = np.random.default_rng(3)
    b, lq, lk, h, d = 2, 77, 91, 3, 64
    q, k, v = (cp.asarray(rng.standard_normal((b, n, h, d)).astype(DTYPES[dtype])) for n in (lq, lk, lk))
    qs, ks, vs = (x.swapaxes(1, 2) for x in (q, k, v))
    assert not qs.flags.c_contiguous
    before = [x.copy() for x in (q, k, v)]
    out = cuflash.attention(qs, ks, vs, causal=True)
    out_contig = cuflash.attention(*(cp.ascontiguousarray(x) for x in (qs, ks, vs)), causal=True)
    np.testing.assert_array_equal(cp.asnumpy(out).astype(np.float64), cp.asnumpy(out_contig).astype(np.float64))
    for x, c in zip((q, k, v), before):   # inputs untouched
        assert (x == c).all()
    host = [cp.asnumpy(x).astype(np.float64) for x in (qs, ks, vs)]
    opts = dict(causal=True, scale=1 / np.sqrt(d))
    ok, msg = within_budget(cp.asnumpy(out).astype(np.float64), exact(*host, dtype=dtype, **opts),
                            naive_same_dtype(*host, dtype=dtype, **opts), magnitude(*host, **opts), dtype)
    assert ok, msg


def test_2d_and_3d_inputs():
    """(L, D) is one head and (H, L, D) has a head axis: shapes kept, values match the reference."""
    rng = np.random.default_rng(4)
    for shape_q, shape_kv in (((45, 32), (61, 32)), ((3, 45, 32), (3, 61, 32))):
        host = [rng.standard_normal(s) for s in (shape_q, shape_kv, shape_kv)]
        out = cuflash.attention(*(cp.asarray(x.astype(np.float32)) for x in host), causal=True)
        assert out.shape == shape_q
        ref, _ = reference.attention_naive(*(x.astype(np.float32).astype(np.float64) for x in host), causal=True)
        assert rel_error(cp.asnumpy(out), ref) < 1e-5


def test_numpy_and_cupy_agree():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 70, 40)) for _ in range(3))
    out_np = cuflash.attention(q, k, v, causal=True)
    out_cp = cuflash.attention(*(cp.asarray(x) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(cp.asnumpy(out_cp), out_np, rtol=1e-12, atol=1e-13)


def test_over_2_31_elements():
    """64-bit offsets: q and out hold more than 2^31 elements."""
    b, lq, lk, d = 32769, 1024, 64, 64      # b * lq * d = 2^31 + 2^16
    q = cp.random.standard_normal((b, 1, lq, d), dtype=cp.float32).astype(cp.float16)
    k = cp.random.standard_normal((b, 1, lk, d), dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal((b, 1, lk, d), dtype=cp.float32).astype(cp.float16)
    out = cuflash.attention(q, k, v)
    for i in (0, b - 1):
        ref, _ = reference.attention_naive(*(cp.asnumpy(x[i]).astype(np.float64) for x in (q, k, v)))
        assert rel_error(cp.asnumpy(out[i]), ref) < 2e-3
    del q, k, v, out
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", sampled([False, True, "bottom_right"], [False, True]))
@pytest.mark.parametrize("lq,lk", sampled([(300, 2049), (1, 4100), (700, 4097)], [(300, 2049), (700, 4097)], multi=True))
def test_hopper_forward_kernel_choice_by_keys(dtype, d, causal, lq, lk, launches):
    """On compute capability 9.0 the 16-bit forward runs the TMA kernel: at head dim 64 its short-rows tile
    (two CTAs an SM, Variant.short) where a query block visits at most HOPPER_FWD_SHORT_KEYS keys on average
    (half the keys under a causal mask), the table tile past that (at 128 and 256 always); answers within the
    error budget, grouped-query heads, across tile edges. Unsplit: one query row over 4100 keys would otherwise
    take the split-KV forward."""
    from cuflash._dispatch.select import row_class
    from cuflash._runtime import device

    if device.compute_capability() != 90:
        pytest.skip("needs a GPU of compute capability 9.0 (the Hopper path)")
    for keys in (lk, 1024):
        launches.clear()
        check_forward(dtype, 1, 4, 2, lq, keys, d, d, causal, seed=lq + keys + d, num_splits=1)
        assert [x.family for x in launches] == ["fwd_wgmma"], (d, keys)
        assert launches[0].short == (row_class(d, keys, causal is not False) != "long"), (d, keys)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_forward_falls_back_where_tensor_maps_cannot_go(dtype, launches):
    """On compute capability 9.0 the 16-bit forward at head dim 128 runs the TMA kernel; K and V
    broadcast over the batch (stride 0, which a tensor map cannot describe) take the portable
    kernel instead, and both answers are within the error budget of the same reference."""
    from cuflash._runtime import device

    if device.compute_capability() != 90:
        pytest.skip("needs a GPU of compute capability 9.0 (the Hopper path)")
    rng = np.random.default_rng(7)
    b, h, lq, lk, d = 3, 2, 200, 333, 128
    q = cp.asarray(rng.standard_normal((b, h, lq, d)).astype(DTYPES[dtype]))
    k1, v1 = (cp.asarray(rng.standard_normal((1, h, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
    k_bc, v_bc = (cp.broadcast_to(x, (b, h, lk, d)) for x in (k1, v1))
    k_full, v_full = (cp.ascontiguousarray(x) for x in (k_bc, v_bc))
    host = [cp.asnumpy(x).astype(np.float64) for x in (q, k_full, v_full)]
    opts = dict(causal=True, scale=1 / np.sqrt(d))
    for k, v, family in ((k_full, v_full, "fwd_wgmma"), (k_bc, v_bc, "fwd_mma")):
        launches.clear()
        out = cuflash.attention(q, k, v, causal=True)
        assert [x.family for x in launches] == [family]
        ok, msg = within_budget(cp.asnumpy(out).astype(np.float64), exact(*host, dtype=dtype, **opts),
                                naive_same_dtype(*host, dtype=dtype, **opts), magnitude(*host, **opts), dtype)
        assert ok, f"{family}: {msg}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("lq,lk,ctas", sampled([(1000, 4200, 3), (333, 4500, 5), (4500, 4150, 7)], [(333, 4500, 5)], multi=True))
@pytest.mark.parametrize("walk", ["default", "stride"])
def test_hopper_forward_persistent_ctas(dtype, d, causal, lq, lk, ctas, walk, monkeypatch, request):
    """The Hopper forward's walkable variants on a persistent grid with far fewer CTAs than query
    blocks (an SM count of 3-7 given to the planner, and the causal ones forced onto a persistent
    schedule too): each CTA walks many blocks, its stage ring, Q barriers and O store running on from
    one block to the next, across partial blocks, grouped-query heads and bottom-right rows that see no
    key (lq > lk: whole blocks without a visible tile); keys enough for head dim 64's long-rows tile.
    Causal head dim 128 takes its blocks from the host's block queue ("default") or strides
    ("stride"). Answers within the error budget."""
    from cuflash._dispatch import model, select
    from cuflash._runtime import device, launch
    from cuflash._runtime.params import STRUCTS

    if device.compute_capability() != 90:
        pytest.skip("needs a GPU of compute capability 9.0 (the Hopper path)")
    if walk == "stride" and not (causal and d == 128):
        pytest.skip("only causal head dim 128 takes a block queue by default")
    facts = device.device_facts
    monkeypatch.setattr(device, "device_facts", lambda device_id: facts(device_id)[:3] + (ctas,))
    if walk == "stride":
        schedule = lambda v: "stride" if model.walkable(v) else "block"   # noqa: E731
    else:   # select.schedule_for, with the causal variants without the block ring striding too
        schedule = lambda v: ("block" if not model.walkable(v)   # noqa: E731
                              else "queue" if v.band and v.tile.warps == 12 else "stride")
    monkeypatch.setattr(select, "schedule_for", schedule)
    # forward_variant is cached and the plan memo's key does not hold schedule_for: forget both now
    # and again after the test (the finalizer runs before monkeypatch restores schedule_for; either
    # order leaves the caches empty).
    select.clear_selection_caches()
    request.addfinalizer(select.clear_selection_caches)
    launched = []
    real = launch.launch_kernel

    def record(variant, params, grid, extra_args=()):
        launched.append((variant, params, grid))
        real(variant, params, grid, extra_args)

    monkeypatch.setattr(launch, "launch_kernel", record)
    b, hq, hk = 2, 4, 2
    check_forward(dtype, b, hq, hk, lq, lk, d, d, causal, seed=lq + lk + d + ctas)
    ((variant, params, grid),) = launched
    assert variant.family == "fwd_wgmma" and model.walkable(variant) and variant.schedule != "block"
    assert grid == ctas < variant.grid(b, hq, hq // hk, lq, lk)
    queue = int(np.frombuffer(params.data, dtype=STRUCTS["FwdParams"])["block_queue"][0])
    assert (queue != 0) == (variant.schedule == "queue") == (walk == "default" and bool(causal) and d == 128)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d,lq,lk", sampled([(128, 777, 1111), (128, 1111, 777), (128, 1030, 1030), (111, 200, 390),
                                             (64, 1030, 1030)], [(128, 777, 1111), (111, 200, 390)], multi=True))
def test_portable_forward_several_blocks(dtype, causal, d, lq, lk, launches, monkeypatch):
    """The portable 16-bit forward (as any GPU without the Hopper path runs it) over several query
    blocks and key stages, grouped-query heads, ragged last blocks and causal stages that see part of
    a block: at head dim 128 the table's 64-key stages formed 32 keys at a time (FwdMmaTraits::SUB_N),
    whose second half may lie wholly past the last key or the causal edge."""
    from cuflash._runtime import device

    monkeypatch.setattr(device, "compute_capability", lambda: 80)
    check_forward(dtype, 1, 4, 2, lq, lk, d, d, causal, seed=lq + 5 * lk + d)
    assert "fwd_mma" in [v.family for v in launches]
