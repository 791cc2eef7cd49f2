"""Masking options on the CPU: their semantics in the references (hypothesis), the NumPy
path of the API, dbias against finite differences, dropout's RNG, and input validation."""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import options, reference
from cuflash._dispatch import masking as _masking
from cuflash.options import check_qkv

RNG = np.random.default_rng(0)


def _score(ptr, batch_stride, head_stride, row_stride, col_stride):
    """A ScoreTensor's values by field name (pointer and strides in elements)."""
    return {"ptr": ptr, "batch_stride": batch_stride, "head_stride": head_stride, "row_stride": row_stride,
            "col_stride": col_stride}


def _qkv(b=2, hq=2, hk=1, lq=21, lk=27, d=8, dv=6, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, hq, lq, d)), rng.standard_normal((b, hk, lk, d)),
            rng.standard_normal((b, hk, lk, dv)), rng.standard_normal((b, hq, lq, dv)))


# --------------------------------------------------------------------------- dropout RNG

def test_philox_known_answers():
    """Random123's published Philox4x32-10 vectors."""
    z = np.zeros(1, dtype=np.uint32)
    assert [int(w[0]) for w in reference.philox4x32_10(z, z, z, z, 0, 0)] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    f = np.full(1, 0xFFFFFFFF, dtype=np.uint32)
    assert [int(w[0]) for w in reference.philox4x32_10(f, f, f, f, 0xFFFFFFFF, 0xFFFFFFFF)] == [
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_one_minus_p_and_is_unbiased(p):
    keep = reference.dropout_keep(1234, p, 0, np.arange(4)[:, None, None], np.arange(256)[:, None],
                                  np.arange(256)[None, :])
    n = keep.size
    kept = float((keep > 0).mean())
    assert abs(kept - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)        # 5 sigma
    assert abs(float(keep.mean()) - 1.0) < 5 * np.sqrt(p / (1 - p) / n)
    assert set(np.unique(keep)) <= {0.0, 1.0 / (1.0 - p)}


def test_dropout_depends_on_every_coordinate_and_the_seed():
    base = reference.dropout_keep(7, 0.5, 0, 0, np.arange(64)[:, None], np.arange(64)[None, :])
    for args in ((8, 0, 0), (7, 1, 0), (7, 0, 1)):
        seed, batch, head = args
        other = reference.dropout_keep(seed, 0.5, batch, head, np.arange(64)[:, None], np.arange(64)[None, :])
        assert (other != base).mean() > 0.3
    again = reference.dropout_keep(7, 0.5, 0, 0, np.arange(64)[:, None], np.arange(64)[None, :])
    np.testing.assert_array_equal(again, base)


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), hq=st.integers(1, 3), lq=st.integers(1, 40),
       lk=st.integers(1, 70), data=st.data(), seed=st.integers(0, 2**63 - 1), p=st.floats(0.01, 0.99))
def test_dropout_tile_draws_each_counter_once_and_matches_dropout_keep(lead, hq, lq, lk, data, seed, p):
    """The references' tiles (reference._dropout_tile) draw one Philox counter per four keys and slice
    the words; element for element they are dropout_keep's, for any tile start (mid-quad too) and any
    origin of the scores in the mask's coordinates (a slice of a larger problem)."""
    r0 = data.draw(st.integers(0, lq)); r1 = data.draw(st.integers(r0, lq))
    c0 = data.draw(st.integers(0, lk)); c1 = data.draw(st.integers(c0, lk))
    origin = data.draw(st.tuples(st.integers(0, 5), st.integers(0, 300), st.integers(0, 300)))
    lead = tuple(lead)
    tile = reference._dropout_tile(reference._dropout_arg(p, seed, origin), lead + (hq, lq, lk), slice(r0, r1),
                                   slice(c0, c1), np)
    nb = int(np.prod(lead)) if lead else 1
    batch = np.arange(nb).reshape(lead + (1, 1, 1)) if lead else np.zeros((1, 1, 1), dtype=np.int64)
    b0, q0, k0 = origin
    each = reference.dropout_keep(seed, p, b0 + batch, np.arange(hq).reshape(hq, 1, 1),
                                  q0 + np.arange(r0, r1)[:, None], k0 + np.arange(c0, c1)[None, :])
    assert tile.shape == each.shape
    np.testing.assert_array_equal(tile, each)


# --------------------------------------------------------------------------- band

@pytest.mark.parametrize("lq,lk", [(7, 7), (5, 9), (9, 5)])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("window", [None, (2, 1), (0, 0), (None, 3), (4, None)])
def test_band_matches_the_definition(lq, lk, causal, window):
    band = reference.band_limits(causal, window, lq, lk)
    if band is None:
        assert causal is False and window is None
        return
    lo, hi = band
    offset = {False: 0, True: 0, "bottom_right": lk - lq}[causal]
    for i, j in itertools.product(range(lq), range(lk)):
        want = True
        if causal is not False:
            want &= j <= i + offset
        if window is not None:
            left, right = window
            want &= left is None or j >= i + offset - left
            want &= right is None or j <= i + offset + right
        assert (i + lo <= j <= i + hi) == want, (i, j)


# --------------------------------------------------------------------------- references agree

@st.composite
def masked_problems(draw):
    b, hk = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hk * draw(st.integers(1, 2))
    lq, lk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    causal = draw(st.sampled_from([False, True, "bottom_right"]))
    opts = {}
    if draw(st.booleans()):   # a bias in one of the broadcast patterns users pass
        shape = draw(st.sampled_from([(b, hq, lq, lk), (1, 1, lq, lk), (b, 1, 1, lk), (hq, lq, lk), (lq, lk),
                                      (b, hq, lq, 1), (1, hq, 1, lk)]))
        opts["bias"] = np.random.default_rng(draw(st.integers(0, 99))).standard_normal(shape)
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(b, hq, lq, lk), (b, 1, 1, lk), (1, 1, lq, lk), (b, 1, lq, 1)]))
        density = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
        opts["mask"] = np.random.default_rng(draw(st.integers(0, 99))).random(shape) < density
    if draw(st.booleans()):
        opts["window"] = (draw(st.one_of(st.none(), st.integers(0, 10))), draw(st.one_of(st.none(), st.integers(0, 10))))
    if draw(st.booleans()):
        opts["dropout_p"], opts["seed"] = draw(st.sampled_from([0.1, 0.5])), draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        bs = draw(st.sampled_from([16, 32]))
        nq, nk = -(-lq // bs), -(-lk // bs)
        opts["block_layout"] = cuflash.BlockLayout(np.random.default_rng(draw(st.integers(0, 99))).random((nq, nk)) < 0.6,
                                                   bs)
    return (b, hq, hk, lq, lk), causal, opts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(masked_problems())
def test_api_numpy_path_matches_naive_reference(problem):
    (b, hq, hk, lq, lk), causal, opts = problem
    q, k, v, do = _qkv(b, hq, hk, lq, lk)
    out, lse = cuflash.attention_forward(q, k, v, causal=causal, **opts)
    ref_out, ref_lse = reference.attention_naive(q, k, v, causal=causal, **opts)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-12)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, **opts)
    ref = reference.attention_backward_naive(do, q, k, v, causal=causal, **opts)
    assert len(grads) == len(ref) == (4 if "bias" in opts else 3)
    for g, r in zip(grads, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, atol=1e-11)
    assert all(np.isfinite(g).all() for g in grads)


def test_rows_with_nothing_to_attend_give_zero():
    q, k, v, do = _qkv(lq=20, lk=30)
    mask = np.ones((2, 1, 20, 30), dtype=bool)
    mask[:, :, 3] = False          # one row sees nothing
    mask[:, :, :, :16] = False     # a whole 16-key tile is hidden
    mask[1, :, :, :] = False       # batch 1 sees nothing at all
    bias = RNG.standard_normal((20, 30))
    out, lse = cuflash.attention_forward(q, k, v, mask=mask, bias=bias)
    assert (out[:, :, 3] == 0).all() and np.isneginf(lse[:, :, 3]).all() and (out[1] == 0).all()
    dq, dk, dv, dbias = cuflash.attention_backward(do, q, k, v, out, lse, mask=mask, bias=bias)
    assert (dq[:, :, 3] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dbias[3] == 0).all() and (dbias[:, :16] == 0).all()
    assert all(np.isfinite(g).all() for g in (dq, dk, dv, dbias))


@pytest.mark.parametrize("shape", [(2, 2, 9, 11), (1, 1, 9, 11), (2, 1, 1, 11), (9, 11)])
def test_dbias_matches_finite_differences(shape):
    q, k, v, do = _qkv(lq=9, lk=11, seed=3)
    bias = np.random.default_rng(4).standard_normal(shape)
    mask = np.random.default_rng(5).random((2, 1, 9, 11)) < 0.8

    def loss(bias_):
        return float((cuflash.attention(q, k, v, bias=bias_, mask=mask, causal="bottom_right") * do).sum())

    out, lse = cuflash.attention_forward(q, k, v, bias=bias, mask=mask, causal="bottom_right")
    dbias = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias, mask=mask, causal="bottom_right")[3]
    assert dbias.shape == bias.shape
    h = 1e-6
    for idx in list(np.ndindex(shape))[:: max(1, bias.size // 25)]:
        e = np.zeros(shape)
        e[idx] = h
        fd = (loss(bias + e) - loss(bias - e)) / (2 * h)
        assert abs(fd - dbias[idx]) <= 1e-6 * (1 + abs(fd)), idx


def test_bias_grad_false_returns_dq_dk_dv_only():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 9, 8)) for _ in range(3))
    bias = rng.standard_normal((1, 3, 9, 9))
    out, lse = cuflash.attention_forward(q, k, v, bias=bias)
    dout = rng.standard_normal(out.shape)
    full = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias)
    without = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, bias_grad=False)
    assert len(full) == 4 and len(without) == 3
    for a, b in zip(without, full[:3]):
        np.testing.assert_array_equal(a, b)


def test_key_constant_bias_has_zero_gradient_and_shifts_lse():
    q, k, v, do = _qkv()
    bias = RNG.standard_normal((2, 2, 21, 1))
    out, lse = cuflash.attention_forward(q, k, v, bias=bias)
    out0, lse0 = cuflash.attention_forward(q, k, v)
    np.testing.assert_allclose(out, out0, atol=1e-12)
    np.testing.assert_allclose(lse, lse0 + bias[..., 0], atol=1e-12)
    dbias = cuflash.attention_backward(do, q, k, v, out, lse, bias=bias)[3]
    np.testing.assert_allclose(dbias, 0, atol=1e-12)


def test_dropout_same_seed_same_result_and_vjp_keeps_it():
    q, k, v, do = _qkv()
    a = cuflash.attention(q, k, v, dropout_p=0.3, seed=5)
    np.testing.assert_array_equal(a, cuflash.attention(q, k, v, dropout_p=0.3, seed=5))
    assert not np.array_equal(a, cuflash.attention(q, k, v, dropout_p=0.3, seed=6))
    out, vjp_fn = cuflash.vjp(q, k, v, dropout_p=0.3)
    assert isinstance(vjp_fn.seed, int)
    ref = reference.attention_naive(q, k, v, dropout_p=0.3, seed=vjp_fn.seed)[0]
    np.testing.assert_allclose(out, ref, atol=1e-12)
    grads = vjp_fn(do)
    ref_grads = reference.attention_backward_naive(do, q, k, v, dropout_p=0.3, seed=vjp_fn.seed)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-11)


def test_dropout_origin_places_a_slice_in_the_whole_calls_mask():
    """Rows are independent: a call on queries r0.. with dropout_origin (r0, 0) gives the whole call's rows
    there (to rounding: BLAS may block fewer rows differently), gradients too; a key origin moves the mask
    along the keys."""
    q, k, v, do = _qkv(b=2, lq=21, lk=27)
    opts = dict(dropout_p=0.4, seed=77)
    whole = cuflash.attention(q, k, v, **opts)
    np.testing.assert_allclose(cuflash.attention(q[:, :, 5:], k, v, dropout_origin=(5, 0), **opts),
                               whole[:, :, 5:], rtol=1e-13, atol=1e-14)
    assert not np.allclose(cuflash.attention(q[:, :, 5:], k, v, **opts), whole[:, :, 5:])
    out, lse = cuflash.attention_forward(q, k, v, **opts)
    dq = cuflash.attention_backward(do, q, k, v, out, lse, **opts)[0]
    out_p, lse_p = cuflash.attention_forward(q[:, :, 5:], k, v, dropout_origin=(5, 0), **opts)
    dq_p = cuflash.attention_backward(do[:, :, 5:], q[:, :, 5:], k, v, out_p, lse_p, dropout_origin=(5, 0),
                                      **opts)[0]
    np.testing.assert_allclose(dq_p, dq[:, :, 5:], rtol=1e-12, atol=1e-13)
    shifted = cuflash.attention(q, k[..., 3:, :], v[..., 3:, :], dropout_origin=(0, 3), **opts)
    ref = reference.attention_naive(q, k[..., 3:, :], v[..., 3:, :], dropout_origin=(0, 0, 3), **opts)[0]
    np.testing.assert_allclose(shifted, ref, atol=1e-12)
    assert not np.allclose(shifted, cuflash.attention(q, k[..., 3:, :], v[..., 3:, :], **opts))


def test_window_equals_the_banded_mask():
    q, k, v, _ = _qkv(lq=30, lk=30)
    i, j = np.arange(30)[:, None], np.arange(30)[None, :]
    got = cuflash.attention(q, k, v, window=(4, 2))
    want = cuflash.attention(q, k, v, mask=(j >= i - 4) & (j <= i + 2))
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_block_layout_helpers():
    lay = cuflash.BlockLayout.from_rule(256, 256, 64, local=0, global_blocks=1)
    assert lay.layout.shape == (4, 4)
    np.testing.assert_array_equal(lay.layout, np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], bool))
    strided = cuflash.BlockLayout.from_rule(256, 256, 64, stride=2, causal=True)
    np.testing.assert_array_equal(strided.layout, np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0],
                                                            [0, 1, 0, 1]], bool))
    mask = np.zeros((100, 70), dtype=bool)
    mask[70, 40] = True
    from_mask = cuflash.BlockLayout.from_mask(mask, (64, 32))
    assert from_mask.layout.shape == (2, 3) and from_mask.layout.sum() == 1 and from_mask.layout[1, 1]
    assert cuflash.BlockLayout(np.ones((2, 2), bool), 64).density == 1.0


def test_mask_summary_states():
    """0: nothing visible in the block, 1: some, 2: all (what lets the kernels skip work)."""
    q, k, v, _ = _qkv(b=2, hq=1, hk=1, lq=100, lk=130)
    p = check_qkv(q, k, v)
    mask = np.ones((2, 1, 1, 130), dtype=bool)
    mask[0, ..., 100:] = False           # key padding from 100 on
    states, block = _masking.block_states(p, options.Options(mask=mask))
    assert block == _masking.MASK_SUMMARY_BLOCK and states.shape == (2, 1, 1, 3)
    np.testing.assert_array_equal(states[:, 0, 0], [[2, 1, 0], [2, 2, 2]])


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs,error,match", [
    ({"window": 4}, ValueError, "window"), ({"window": (-1, 2)}, ValueError, "window"),
    ({"window": (1.5, 2)}, ValueError, "window"),
    ({"bias": np.zeros((3, 21, 27))}, ValueError, "broadcast"), ({"bias": np.zeros((21, 27), int)}, TypeError, "float"),
    ({"bias": np.zeros((21, 27), bool)}, TypeError, "mask"),
    ({"mask": np.zeros((21, 27))}, TypeError, "bool"), ({"mask": np.ones((21, 5), bool)}, ValueError, "broadcast"),
    ({"dropout_p": 1.0, "seed": 1}, ValueError, "dropout_p"), ({"dropout_p": -0.1, "seed": 1}, ValueError, "dropout_p"),
    ({"dropout_p": 0.1, "seed": -1}, ValueError, "seed"), ({"dropout_p": 0.1, "seed": 2**64}, ValueError, "seed"),
    ({"dropout_p": 0.1, "seed": 1, "dropout_origin": (0, 1, 2)}, TypeError, "dropout_origin"),
    ({"dropout_p": 0.1, "seed": 1, "dropout_origin": (1.0, 2)}, TypeError, "dropout_origin"),
    ({"dropout_p": 0.1, "seed": 1, "dropout_origin": 3}, TypeError, "dropout_origin"),
    ({"dropout_p": 0.1, "seed": 1, "dropout_origin": (-1, 2)}, ValueError, "dropout_origin"),
    ({"dropout_p": 0.1, "seed": 1, "dropout_origin": (0, 2**31 - 10)}, ValueError, "2\\*\\*31"),
    ({"block_layout": np.ones((2, 2), bool)}, TypeError, "BlockLayout"),
    ({"block_layout": cuflash.BlockLayout(np.ones((3, 3), bool), 16)}, ValueError, "block_layout"),
])
def test_bad_options(kwargs, error, match):
    q, k, v, _ = _qkv()
    with pytest.raises(error, match=match):
        cuflash.attention_forward(q, k, v, **kwargs)


def test_forward_with_dropout_needs_a_seed():
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="seed"):
        cuflash.attention_forward(q, k, v, dropout_p=0.1)
    cuflash.attention(q, k, v, dropout_p=0.1)     # attention() draws one


@pytest.mark.parametrize("block_size", [8, 0, (64, 24), "a"])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block"):
        cuflash.BlockLayout(np.ones((2, 2), bool), block_size)


def test_dbias_modes():
    """Which dbias accumulation a bias gets: plain adds when one CTA owns each element,
    atomics (or turns, when deterministic) when CTAs of several batches / K/V heads share it."""
    q, k, v, _ = _qkv(b=2, hq=4, hk=2, lq=100, lk=130)
    p = check_qkv(q, k, v)

    def mode(shape, det=False):
        return _masking.dbias_mode(p, options.own_4d(np.zeros(shape), p).shape, det)

    assert mode((2, 4, 100, 130)) == _masking.DBIAS_ADD
    assert mode((2, 4, 1, 130)) == _masking.DBIAS_ADD
    assert mode((1, 4, 100, 130)) == _masking.DBIAS_ATOMIC
    assert mode((2, 1, 100, 130)) == _masking.DBIAS_ATOMIC
    assert mode((1, 1, 100, 130), det=True) == _masking.DBIAS_ORDERED
    assert mode((2, 4, 100, 1)) == _masking.DBIAS_NONE     # constant along keys: exactly zero


@pytest.mark.parametrize("shape, tiles, walk", [
    ((1, 1, 100, 130), 3 * 2, 2 * 4),       # shared by batch and heads: 3 key x 2 query blocks, walk B x Hq
    ((2, 4, 100, 130), 3 * 2 * 4 * 2, 1),   # a full bias: one step a tile
    ((2, 1, 1, 130), 3 * 2, 4 * 2),         # one row per batch: walk heads x query blocks
    ((1, 4, 100, 130), 3 * 2 * 4, 2),
])
@pytest.mark.parametrize("sm_count", [1, 132])
def test_dbias_kernel_plan(shape, tiles, walk, sm_count, monkeypatch):
    """The tensor-core dbias kernel's plan (flash_bwd_dbias.cu, DbiasWork): one CTA per
    accumulator tile and split; splits fill twice the SMs, at most the walk's length and
    MAX_DBIAS_SPLITS; the slices are summed back into exactly the bias's shape. (NumPy
    arrays stand in for CuPy's: the device pointer is not needed here.)"""
    monkeypatch.setattr(_masking, "score_view", lambda x4, p: _score(0, *(s // x4.itemsize for s in x4.strides)))
    q, k, v, _ = _qkv(b=2, hq=4, hk=2, lq=100, lk=130)
    p = check_qkv(q, k, v)
    bias = np.ones(shape)
    plan = _masking.dbias_plan(p, options.Options(bias=bias), False, kernel_tile=(64, 64), sm_count=sm_count)
    splits = max(1, min(walk, _masking.MAX_DBIAS_SPLITS, -(-2 * sm_count // tiles)))
    assert plan.splits == splits and plan.grid == tiles * splits
    assert plan.values["mode"] == _masking.DBIAS_KERNEL and plan.values["splits"] == splits
    assert plan.acc.shape[0] == splits and plan.acc.shape[-1] == 130
    assert plan.values["split_stride"] == int(np.prod(plan.acc.shape[1:-1])) * 132   # slice stride: rows padded to 4
    plan.acc[...] = 1.0
    got = plan.result(p, options.Options(bias=bias))
    assert got.shape == bias.shape and (got == splits).all()


@pytest.mark.parametrize("shape", [(1, 1, 100, 130), (2, 4, 100, 130), (2, 1, 100, 130), (1, 4, 100, 130),
                                   (100, 130), (2, 1, 1, 130), (1, 4, 1, 130), (130,)])
def test_dbias_key_major_plan(shape, monkeypatch):
    """The Hopper dK/dV kernel's dbias accumulator (DBIAS_KEY_MAJOR, kernels_cu/bias_grad_t.cuh): stored
    [key][query] with rows of whole 32-byte sectors, seen through the (batch, head, row, col) strides the
    kernel addresses (0 along broadcast axes; a one-row bias by its key stride alone). Every score's dS
    added where the kernel adds it sums back into exactly the bias's shape: dS summed over its broadcast
    axes. (NumPy arrays stand in for CuPy's, with the device pointer 0.)"""
    full = lambda p: (p.batch, p.heads_q, p.lq, p.lk)   # noqa: E731
    monkeypatch.setattr(_masking, "score_view", lambda x4, p: _score(0, *(
        0 if n == 1 and f != 1 else s_ // x4.itemsize for n, f, s_ in zip(x4.shape, full(p), x4.strides))))
    q, k, v, _ = _qkv(b=2, hq=4, hk=2, lq=100, lk=130)
    p = check_qkv(q, k, v)
    bias = np.ones(shape)
    plan = _masking.dbias_plan(p, options.Options(bias=bias), False, key_major=True)
    acc = plan.values["acc"]
    bs, hs, rs, cs = (acc[n] for n in ("batch_stride", "head_stride", "row_stride", "col_stride"))
    assert plan.values["mode"] == _masking.DBIAS_KEY_MAJOR and plan.values["rows_broadcast"] == int(len(shape) > 1 and shape[-2] == 1
                                                                                 or len(shape) == 1)
    store = plan.keep_alive[0]
    assert store.flags.c_contiguous and store.dtype == (np.float64 if p.dtype == "float64" else np.float32)
    if plan.values["rows_broadcast"]:   # one row: unit key stride (scalar adds), no row stride
        assert (rs, cs) == (0, 1)
    else:                # [key][query]: 16-byte quads of queries, rows of whole 32-byte sectors
        assert rs == 1 and cs % 8 == 0 and cs >= 100 and bs % 8 == 0 and hs % 8 == 0
    ds = np.random.default_rng(3).standard_normal(full(p))
    b, h, i, j = np.indices(full(p))
    at = b * bs + h * hs + (0 if plan.values["rows_broadcast"] else i) * rs + j * cs
    np.add.at(store.reshape(-1), at.reshape(-1), ds.reshape(-1))
    got = plan.result(p, options.Options(bias=bias))
    axes = tuple(a for a in range(4) if (1,) * (4 - len(shape)) + shape != full(p) and
                 ((1,) * (4 - len(shape)) + shape)[a] == 1)
    want = ds.sum(axis=axes, keepdims=True).reshape(shape)
    assert got.shape == shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_bias_rows_in_chunks(monkeypatch):
    """Which biases the Hopper forward copies, by 16-byte chunks of their rows (_masking.rows_in_chunks:
    unit key stride, 16-byte aligned start, batch, head and row strides); for any other the launcher
    takes the portable forward. Views are (ptr, batch, head, row, col strides) in elements, 16-bit."""
    ok = _masking.rows_in_chunks
    assert ok(_score(0, 0, 0, 4096, 1), 2)                  # (1, 1, L, L), L a multiple of 8
    assert ok(_score(32, 4096, 0, 0, 1), 2)                 # (B, 1, 1, L): one row a batch, broadcast over rows
    assert ok(_score(0, 16 * 100 * 136, 100 * 136, 136, 1), 2)
    assert not ok(_score(0, 0, 0, 130, 1), 2)               # rows 260 bytes apart
    assert not ok(_score(8, 0, 0, 4096, 1), 2)              # a start 8 bytes off
    assert not ok(_score(0, 0, 100 * 130 + 4, 136, 1), 2)   # a head stride off
    assert not ok(_score(0, 0, 0, 1, 4096), 2)              # a transposed view
    assert not ok(_score(0, 0, 0, 8, 0), 2)                 # constant along keys (stride 0)
    # Through kernel_masking, as the launcher sees it (NumPy arrays stand in for CuPy's: pointer 0).
    monkeypatch.setattr(_masking, "_broadcast_view", lambda x4, full: _score(0, *(
        0 if n == 1 and f != 1 else s // x4.itemsize for n, f, s in zip(x4.shape, full, x4.strides))))
    for lk, chunks in ((136, True), (130, False)):
        q, k, v, _ = (x.astype(np.float16) for x in _qkv(b=2, hq=4, hk=2, lq=100, lk=lk))
        p = check_qkv(q, k, v)
        for shape in ((1, 1, 100, lk), (2, 1, 1, lk), (4, 100, lk)):
            opts = options.check_options(p, bias=np.ones(shape, dtype=np.float32))   # cast to q's dtype first
            assert _masking.kernel_masking(p, opts).bias_in_chunks == chunks, (lk, shape)
        opts = options.check_options(p, bias=np.ones((1, 1, lk, 100), dtype=np.float16).swapaxes(-1, -2))
        assert not _masking.kernel_masking(p, opts).bias_in_chunks
        assert _masking.kernel_masking(p, options.check_options(p, mask=np.ones((1, 1, 1, lk), bool))).bias_in_chunks


@pytest.mark.parametrize("shape, deterministic, want", [
    ((1, 1, 100, 130), False, "KEY_MAJOR"),   # shared by batch and K/V heads, with query rows
    ((2, 1, 100, 130), False, "KEY_MAJOR"),
    ((2, 4, 100, 130), False, "ADD"),         # one CTA per element: plain adds
    ((1, 1, 1, 130), False, "ATOMIC"),        # one row: row sums with atomics, as before
])
def test_dbias_key_major_for_atomics(shape, deterministic, want, monkeypatch):
    """The float32 tensor-core dK/dV kernels (key_major_for_atomics): DBIAS_KEY_MAJOR where CTAs would
    otherwise meet with scalar atomics on a bias with query rows, every other mode unchanged (deterministic
    turns: test_masking_gpu.py's test_float32_dbias_key_major; their counters need a device array)."""
    monkeypatch.setattr(_masking, "score_view", lambda x4, p: _score(0, *(s // x4.itemsize for s in x4.strides)))
    q, k, v, _ = _qkv(b=2, hq=4, hk=2, lq=100, lk=130)
    p = check_qkv(q, k, v)
    plan = _masking.dbias_plan(p, options.Options(bias=np.ones(shape)), deterministic, dkdv_tile=(16, 64),
                               key_major_for_atomics=True)
    assert plan.values["mode"] == getattr(_masking, f"DBIAS_{want}")
    plain = _masking.dbias_plan(p, options.Options(bias=np.ones(shape)), deterministic, dkdv_tile=(16, 64))
    assert plain.values["mode"] == getattr(_masking, f"DBIAS_{'ATOMIC' if want == 'KEY_MAJOR' else want}")
