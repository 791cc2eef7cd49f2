"""The split-KV forward on the GPU (marker `gpu`): forced splits from 1 to 64 and the automatic choice,
every dtype, decoding shapes (few query rows, grouped-query heads packed into one tile), causal and
windowed, masking options, empty splits, NaN, and the backward of a split forward's result; each
against the exact reference under DESIGN.md's error rule (_gpu_checks)."""
import functools

import numpy as np
import pytest

import cuflash
from cuflash._dispatch import plan as plan_
from cuflash._dispatch.model import TABLES, Variant
from cuflash._runtime import device

from _gpu_checks import DTYPES, check_backward, check_forward, check_masked, seed_of
from _tiers import sampled

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture
def split_forward(monkeypatch):
    """Make every cuflash forward of the test take ``num_splits`` (a function of the test)."""
    def force(num_splits):
        monkeypatch.setattr(cuflash, "attention_forward",
                            functools.partial(cuflash.attention_forward, num_splits=num_splits))
    return force


def _families(launches):
    return [(v.family, v.kv_split) for v in launches]


def _split_and_merged(families) -> bool:
    """A split forward's launches: its partial kernel, then the combine kernel; or the decoding kernel
    alone, each query block's last split merging them (FwdParams::split_counters)."""
    return families[0][1] and (families[-1] == ("fwd_combine", False) or families == [("fwd_decode", True)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("splits", sampled([1, 2, 3, 7, 64], [1, 3, 64]))
@pytest.mark.parametrize("lq, causal", [(1, "bottom_right"), (3, "bottom_right"), (16, False), (3, True)])
def test_forced_splits_match_the_reference(dtype, splits, lq, causal, split_forward, launches):
    split_forward(splits)
    check_forward(dtype, 2, 8, 2, lq, 1000, 64, 64, causal, seed_of(dtype, splits, lq, str(causal)))
    families = _families(launches)
    if splits > 1:
        assert _split_and_merged(families), families
    else:
        assert all(family != "fwd_combine" for family, _ in families), families


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d, dv", [(128, 128), (59, 40), (256, 256)])
def test_head_dims_and_value_dims(dtype, d, dv, split_forward, launches):
    split_forward(5)
    check_forward(dtype, 1, 4, 4, 2, 777, d, dv, "bottom_right", seed_of(dtype, d, dv))
    assert _split_and_merged(_families(launches)), _families(launches)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("b, hq, hk, lk", [(1, 32, 8, 16384), (8, 32, 8, 4096), (1, 8, 8, 8192)])
def test_decoding_shapes_split_on_their_own(dtype, b, hq, hk, lk, launches):
    """One query row a sequence over a long cache: the query blocks alone would leave the GPU idle, so
    the forward splits the keys unasked (and packs each K/V head's query heads into one tile)."""
    check_forward(dtype, b, hq, hk, 1, lk, 128, 128, "bottom_right", seed_of(dtype, b, hq, lk))
    families = _families(launches)
    assert _split_and_merged(families), families


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_the_decoding_kernels_merge_leaves_its_counters_at_zero(dtype):
    """The decoding kernel's last split of each query block merges the block and resets its counter:
    after calls of several shapes the stream's counters are all zero again, and a call repeated gives
    the same bits (its counters started at zero again)."""
    rng = np.random.default_rng(seed_of(dtype, "counters"))
    dt = DTYPES[dtype]
    for b, hq, hk, lq, lk in ((1, 32, 8, 1, 16384), (3, 8, 2, 3, 5000), (2, 4, 4, 16, 3000)):
        q = cp.asarray(rng.standard_normal((b, hq, lq, 64)).astype(dt))
        k, v = (cp.asarray(rng.standard_normal((b, hk, lk, 64)).astype(dt)) for _ in range(2))
        first = cuflash.attention_forward(q, k, v, causal="bottom_right", num_splits=7)
        again = cuflash.attention_forward(q, k, v, causal="bottom_right", num_splits=7)
        for x, y in zip(first, again):
            assert cp.array_equal(x, y, equal_nan=True)
    cp.cuda.get_current_stream().synchronize()
    counters = [c for (dev, _), c in plan_._COUNTERS.items() if dev == cp.cuda.Device().id]
    assert counters and not any(bool(c.any()) for c in counters)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq, lq, causal, splits", sampled(
    [(8, 1, "bottom_right", None), (8, 2, False, 7), (4, 5, "bottom_right", 3), (2, 16, True, 64),
     (8, 3, "bottom_right", None), (8, 2, True, 5)],
    [(8, 1, "bottom_right", None), (4, 5, "bottom_right", 3), (2, 16, True, 64), (8, 3, "bottom_right", None)],
    multi=True))
def test_few_query_rows_take_the_decoding_kernel(dtype, d, hq, lq, causal, splits, split_forward, launches):
    """At most 16 query rows a block (packed GQA: Lq x the query heads of a K/V head): the decoding
    partial kernel (float32 on 3xTF32, float64 on the fp64 tensor cores), whose warps split each key tile,
    then its merge; odd key counts, empty splits (64 splits of 2500 keys), a band cutting tiles, packed
    query heads under a band (4 heads of 3 or 2 positions: the band reads row % Lq)."""
    split_forward(splits)
    check_forward(dtype, 2, hq, 2, lq, 2500, d, d, causal, seed_of(dtype, d, hq, lq, str(causal), splits))
    assert ("fwd_decode", True) in _families(launches), _families(launches)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq, lq, causal, splits", [(8, 5, "bottom_right", 3), (8, 8, True, None),
                                                    (8, 16, False, 7), (8, 11, "bottom_right", 64),
                                                    (2, 24, "bottom_right", 3), (2, 20, True, None)])
def test_blocks_of_several_strips_take_the_decoding_kernel(dtype, d, hq, lq, causal, splits, split_forward, launches):
    """16-bit blocks of 17-64 rows (4 query heads of 5, 8, 16 or 11 positions packed over each of 2 K/V heads; one
    head of 24 or 20 positions unpacked) on the decoding kernel's tile of two strips at head dim 128 (every warp
    holding every strip over its keys) up to 32 rows where the GPU's shared memory holds it, the split twin past
    it and at head dim 64; bands read a packed row's position as row % Lq, an unpacked row's as its own."""
    split_forward(splits)
    check_forward(dtype, 2, hq, 2, lq, 2500, d, d, causal, seed_of(dtype, d, hq, lq, str(causal), splits, "strips"))
    rows = lq * hq // 2
    strips = [t for t in TABLES["split"].get(("sm80", "fwd_decode", dtype, d), ()) if t.block_m >= rows > 16]
    fits = any(Variant("fwd_decode", dtype, d, vec=True, kv_split=True, tile=t).smem_bytes <= device.smem_limit()
               for t in strips)
    partial = launches[0]
    assert (partial.family, partial.kv_split) == (("fwd_decode" if fits else "fwd_mma"), True), _families(launches)
    assert partial.tile.block_m >= rows


def test_prefill_shapes_stay_unsplit(launches):
    check_forward("bfloat16", 2, 16, 16, 1024, 1024, 64, 64, True, 1)
    assert all(v.family != "fwd_combine" for v in launches)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["bias", "mask", "dropout", "window", "block sparse"])
def test_masking_options_with_splits(dtype, kind, split_forward, launches):
    b, hq, hk, lq, lk = 2, 4, 2, 5, 700
    rng = np.random.default_rng(seed_of(dtype, kind))
    pad = np.ones((b, 1, 1, lk), dtype=bool)
    pad[0, ..., 300:] = False                    # some splits of batch 0 see nothing
    options = {"bias": dict(bias=rng.standard_normal((1, hq, lq, lk))),
               "mask": dict(mask=pad),
               "dropout": dict(dropout_p=0.25, seed=11),
               "window": dict(window=(200, 0)),
               "block sparse": dict(block_layout=cuflash.BlockLayout(rng.random((hq, 1, 11)) < 0.5, 64))}[kind]
    split_forward(6)
    check_masked(dtype, b, hq, hk, lq, lk, 64, 64, "bottom_right", seed_of(dtype, kind, 2), options)
    forward = [family for family in _families(launches) if not family[0].startswith("bwd")]
    assert _split_and_merged(forward), forward


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_more_splits_than_key_tiles(dtype, split_forward, launches):
    """Splits past the last key tile see nothing (lse -inf, O 0) and weigh nothing in the merge."""
    split_forward(64)
    check_forward(dtype, 1, 2, 1, 4, 70, 32, 32, False, 5)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_backward_of_a_split_forward(dtype, split_forward):
    split_forward(4)
    check_backward(dtype, 2, 4, 2, 7, 600, 64, 64, "bottom_right", seed_of(dtype, "bwd"))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_nan_in_one_split_reaches_the_row(dtype):
    rng = np.random.default_rng(3)
    q, k, v = (cp.asarray(rng.standard_normal((1, 2, 1, 64)).astype(dtype)),
               cp.asarray(rng.standard_normal((1, 2, 900, 64)).astype(dtype)),
               cp.asarray(rng.standard_normal((1, 2, 900, 64)).astype(dtype)))
    v[0, 1, 700, 5] = cp.nan
    want = cp.asnumpy(cuflash.attention(q, k, v, num_splits=1))
    got = cp.asnumpy(cuflash.attention(q, k, v, num_splits=8))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 1, 0, 5]) and not np.isnan(got[0, 0]).any()


def test_splits_and_plans_replay(launches):
    """A repeated split call replays its plan: the same two kernels, fresh partial buffers."""
    rng = np.random.default_rng(4)
    q, k, v = (cp.asarray(rng.standard_normal(s).astype(np.float16)) for s in ((2, 8, 1, 64), (2, 2, 5000, 64),
                                                                                (2, 2, 5000, 64)))
    first = cp.asnumpy(cuflash.attention(q, k, v, causal="bottom_right", num_splits=9))
    n = len(launches)
    again = cp.asnumpy(cuflash.attention(q, k, v, causal="bottom_right", num_splits=9))
    np.testing.assert_array_equal(first, again)
    assert [x.name for x in launches[n:]] == [x.name for x in launches[:n]]
    assert any(plan.partial_shapes is not None for plan in plan_._FORWARD_PLANS.values())
