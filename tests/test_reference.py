"""CPU tests of cuflash.reference: the blocked algorithms agree with the naive ones, the
naive ones with a plainly written softmax and with finite differences, and the
low-precision emulation has the expected error sizes."""
import importlib.util
import math
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import reference as R

CAUSAL = [False, True, "bottom_right"]


def _offset(causal, lq, lk):
    """Written out independently of the module: None, or the diagonal's offset."""
    return {False: None, True: 0, "top_left": 0, "bottom_right": lk - lq}[causal]


def direct_attention(q, k, v, scale, allowed, bias):
    """One head, row by row: out_i = sum_j softmax_j(s_ij) v_j over the allowed keys.

    q (Lq, D), k (Lk, D), v (Lk, Dv), allowed bool (Lq, Lk), bias (Lq, Lk).
    """
    lq, lk = allowed.shape
    out = np.zeros((lq, v.shape[1]))
    lse = np.full(lq, -np.inf)
    for i in range(lq):
        keys = [j for j in range(lk) if allowed[i, j]]
        if not keys:
            continue
        s = np.array([scale * float(np.dot(q[i], k[j])) + bias[i, j] for j in keys])
        w = np.exp(s - s.max())
        out[i] = sum(wj * v[j] for wj, j in zip(w, keys)) / w.sum()
        lse[i] = s.max() + math.log(w.sum())
    return out, lse


def max_tiles_ok(lq, lk, bm, bn, limit=400):
    return math.ceil(lq / bm) * math.ceil(lk / bn) <= limit


@st.composite
def problems(draw, max_len=130, huge=True, extras=True):
    """Random attention problems: shapes, GQA, causal mode, bias/mask, tile sizes."""
    b, hk = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    hq = hk * group
    lq, lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    d, dv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Huge logits: q scaled so that |s| ~ 1e4.
    logit = draw(st.sampled_from([1.0, 1.0, 1e4])) if huge else 1.0
    q = rng.standard_normal((b, hq, lq, d)) * logit
    k, v = rng.standard_normal((b, hk, lk, d)), rng.standard_normal((b, hk, lk, dv))
    bias = mask = None
    if extras and draw(st.booleans()):
        shape = draw(st.sampled_from([(1, 1, lq, lk), (b, 1, 1, lk), (lk,), (hq, lq, 1), (b, hq, lq, lk)]))
        bias = rng.standard_normal(shape)
    if extras and draw(st.booleans()):
        shape = draw(st.sampled_from([(lq, lk), (b, 1, 1, lk), (1, hq, lq, lk), (lq, 1)]))
        mask = rng.random(shape) < draw(st.sampled_from([0.1, 0.7]))
    # Tile sizes from 1 to 70, but not so small on long sequences that the loops get slow.
    bm, bn = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    while not max_tiles_ok(lq, lk, bm, bn):
        bm, bn = bm + 1, bn + 1
    return dict(q=q, k=k, v=v, causal=draw(st.sampled_from(CAUSAL)), bias=bias, mask=mask,
                block_m=bm, block_n=bn, group=group)


def opts(p):
    return dict(causal=p["causal"], bias=p["bias"], mask=p["mask"])


def assert_lse_equal(got, ref, rtol, atol=1e-12):
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    seen = np.isfinite(ref)
    assert np.isfinite(got[seen]).all()
    np.testing.assert_allclose(got[seen], ref[seen], rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- forward

@settings(max_examples=50, deadline=None)
@given(problems())
def test_blocked_equals_naive(p):
    out, lse = R.attention_naive(p["q"], p["k"], p["v"], **opts(p))
    bout, blse = R.attention_blocked(p["q"], p["k"], p["v"], block_m=p["block_m"], block_n=p["block_n"], **opts(p))
    assert bout.shape == out.shape == p["q"].shape[:-1] + (p["v"].shape[-1],)
    assert blse.shape == lse.shape == p["q"].shape[:-1]
    assert bout.dtype == out.dtype == np.float64
    assert np.isfinite(out).all() and np.isfinite(bout).all()
    np.testing.assert_allclose(bout, out, rtol=1e-10, atol=_out_atol(lse, p["v"]))
    assert_lse_equal(blse, lse, rtol=1e-12, atol=_lse_atol(lse))


def _lse_atol(lse):
    """Absolute tolerance between two float64 computations of lse: 1e-12, plus a few float64 ulps of the
    largest |s| ~ |lse|, which the tiles' and the whole matrix's products round differently. A row whose
    lse cancels to ~0.13 among logits ~1e4 differed by 1.4e-12 (a CI run's hypothesis case)."""
    seen = np.isfinite(lse)
    return 1e-12 + 16 * np.finfo(np.float64).eps * (float(np.abs(lse[seen]).max()) if seen.any() else 0.0)


def _out_atol(lse, v):
    """Absolute tolerance between two float64 computations of out: 1e-12, plus what a score's own
    rounding (a few float64 ulps of |s| ~ |lse|) does to the weights of values |v|. With huge logits
    (|s| ~ 1e5) the tiles' and the whole matrix's products round s differently by ~1e-11, and an
    output that cancels (0.015 from values ~1) then differs by ~3e-12 (a CI run's hypothesis case)."""
    seen = np.isfinite(lse)
    s_max = float(np.abs(lse[seen]).max()) if seen.any() else 0.0
    v_max = float(np.abs(v).max()) if v.size else 0.0
    return 1e-12 + 16 * np.finfo(np.float64).eps * s_max * v_max


@settings(max_examples=30, deadline=None)
@given(problems(max_len=12))
def test_naive_equals_direct_softmax(p):
    q, k, v, group = p["q"], p["k"], p["v"], p["group"]
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    scale = 0.37
    out, lse = R.attention_naive(q, k, v, scale=scale, **opts(p))
    full = (b, hq, lq, lk)
    allowed = np.ones(full, bool)
    off = _offset(p["causal"], lq, lk)
    if off is not None:
        allowed &= np.array([[j <= i + off for j in range(lk)] for i in range(lq)]).reshape(1, 1, lq, lk)
    if p["mask"] is not None:
        allowed &= np.broadcast_to(p["mask"], full)
    bias = np.zeros(full) if p["bias"] is None else np.broadcast_to(p["bias"], full)
    for bi in range(b):
        for h in range(hq):
            kv = h // group          # grouped-query attention: query head h reads K/V head h // group
            ref, ref_lse = direct_attention(q[bi, h], k[bi, kv], v[bi, kv], scale, allowed[bi, h], bias[bi, h])
            np.testing.assert_allclose(out[bi, h], ref, rtol=1e-10, atol=1e-12)
            assert_lse_equal(lse[bi, h], ref_lse, rtol=1e-10)


def test_huge_logits_stay_finite():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 100, 16)) * 1e4
    k, v = rng.standard_normal((2, 100, 16)), rng.standard_normal((2, 100, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = R.attention_naive(q, k, v, causal=True)
        bout, blse = R.attention_blocked(q, k, v, causal=True, block_m=16, block_n=24)
    s = np.abs(np.einsum("hid,hjd->hij", q, k) / 4.0)
    assert s.max() > 1e4
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(bout, out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(blse, lse, rtol=1e-13)


def _empty_row_problem():
    """Lq > Lk with bottom_right leaves rows 0..5 with no key; mask empties row 7 too."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 9, 4)), rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 3, 5))
    mask = np.ones((9, 3), bool)
    mask[7] = False
    return q, k, v, mask


@pytest.mark.parametrize("blocked,dtype", [(True, None), (False, None), (False, np.float32), (False, np.float16),
                                            (False, "bfloat16")])
def test_rows_with_nothing_to_attend(blocked, dtype):
    q, k, v, mask = _empty_row_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if blocked:
            out, lse = R.attention_blocked(q, k, v, causal="bottom_right", mask=mask, block_m=2, block_n=2)
        else:
            out, lse = R.attention_naive(q, k, v, causal="bottom_right", mask=mask, dtype=dtype)
    empty = [0, 1, 2, 3, 4, 5, 7]
    assert (out[:, empty] == 0).all() and np.isneginf(lse[:, empty]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[:, [6, 8]]).all()


def test_all_masked_rows_have_zero_gradients_and_no_warnings():
    q, k, v, mask = _empty_row_problem()
    bias = np.random.default_rng(1).standard_normal((9, 3))
    do = np.ones((2, 9, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = R.attention_naive(q, k, v, causal="bottom_right", mask=mask, bias=bias)
        naive = R.attention_backward_naive(do, q, k, v, causal="bottom_right", mask=mask, bias=bias)
        blocked = R.attention_backward_blocked(do, q, k, v, out, lse, causal="bottom_right", mask=mask, bias=bias,
                                               block_m=4, block_n=2)
    for dq, dk, dv, dbias in (naive, blocked):
        for g in (dq, dk, dv, dbias):
            assert np.isfinite(g).all()
        assert (dq[:, [0, 1, 2, 3, 4, 5, 7]] == 0).all() and (dbias[[0, 1, 2, 3, 4, 5, 7]] == 0).all()
        assert np.abs(dq[:, 8]).max() > 0 and np.abs(dv).max() > 0
    for a, b in zip(naive, blocked):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_fully_masked_everything():
    x = np.random.default_rng(2).standard_normal((3, 4, 6))
    mask = np.zeros((4, 4), bool)
    out, lse = R.attention_blocked(x, x, x, mask=mask)
    assert (out == 0).all() and np.isneginf(lse).all()
    grads = R.attention_backward_blocked(np.ones_like(x), x, x, x, out, lse, mask=mask)
    assert all((g == 0).all() for g in grads)


# ----------------------------------------------------------------------------- tiles

def test_causal_tiles_are_skipped():
    x = np.random.default_rng(1).standard_normal((256, 16))
    _, _, stats = R.attention_blocked(x, x, x, causal=True, block_m=64, block_n=64, return_stats=True)
    assert stats == {"tiles_total": 16, "tiles_computed": 10}


@pytest.mark.parametrize("causal,lq,lk,bm,bn", [
    (False, 100, 70, 32, 16), (True, 100, 70, 32, 16), ("bottom_right", 100, 70, 32, 16),
    ("bottom_right", 64, 256, 64, 64), ("top_left", 256, 64, 16, 48), (True, 7, 130, 3, 5),
])
def test_tiles_computed_are_those_with_an_allowed_pair(causal, lq, lk, bm, bn):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((lq, 8)), rng.standard_normal((lk, 8))
    _, _, stats = R.attention_blocked(q, k, k, causal=causal, block_m=bm, block_n=bn, return_stats=True)
    off = _offset(causal, lq, lk)
    tiles = [(i, j) for i in range(0, lq, bm) for j in range(0, lk, bn)]
    needed = [t for t in tiles if off is None or t[1] <= min(t[0] + bm, lq) - 1 + off]
    assert stats == {"tiles_total": len(tiles), "tiles_computed": len(needed)}


# ----------------------------------------------------------------------------- backward

def _fd_check(p, which, rng, eps=1e-6):
    """Directional derivative of sum(out * W) along a random direction, vs the naive backward."""
    w = rng.standard_normal(p["q"].shape[:-1] + (p["v"].shape[-1],))
    grads = R.attention_backward_naive(w, p["q"], p["k"], p["v"], **opts(p))
    names = ["q", "k", "v"] + (["bias"] if p["bias"] is not None else [])
    assert len(grads) == len(names)
    g = dict(zip(names, grads))[which]
    assert g.shape == p[which].shape
    u = rng.standard_normal(g.shape)

    def f(delta):
        args = dict(p)
        args[which] = p[which] + delta * u
        out, _ = R.attention_naive(args["q"], args["k"], args["v"], **opts(args))
        return float((out * w).sum())

    fd = (f(eps) - f(-eps)) / (2 * eps)
    an = float((g * u).sum())
    assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (which, fd, an)


@settings(max_examples=40, deadline=None)
@given(problems(max_len=12, huge=False))
def test_backward_naive_matches_finite_differences(p):
    rng = np.random.default_rng(0)
    for which in ("q", "k", "v") + (("bias",) if p["bias"] is not None else ()):
        _fd_check(p, which, rng)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("lq,lk", [(5, 9), (9, 5)])
def test_backward_finite_differences_gqa_causal_bias(causal, lq, lk):
    rng = np.random.default_rng(lq * 10 + lk)
    p = dict(q=rng.standard_normal((2, 6, lq, 7)), k=rng.standard_normal((2, 2, lk, 7)),
             v=rng.standard_normal((2, 2, lk, 3)), causal=causal, bias=rng.standard_normal((6, 1, lk)), mask=None)
    for which in ("q", "k", "v", "bias"):
        _fd_check(p, which, rng)


@settings(max_examples=40, deadline=None)
@given(problems(max_len=100))
def test_blocked_backward_equals_naive(p):
    out, lse = R.attention_naive(p["q"], p["k"], p["v"], **opts(p))
    do = np.random.default_rng(2).standard_normal(out.shape)
    naive = R.attention_backward_naive(do, p["q"], p["k"], p["v"], **opts(p))
    blocked = R.attention_backward_blocked(do, p["q"], p["k"], p["v"], out, lse, block_m=p["block_m"],
                                           block_n=p["block_n"], **opts(p))
    assert len(naive) == len(blocked) == (4 if p["bias"] is not None else 3)
    shapes = [p["q"].shape, p["k"].shape, p["v"].shape] + ([p["bias"].shape] if p["bias"] is not None else [])
    # Recomputing P = exp(s - lse) from the saved lse costs |s| * eps of relative accuracy in P.
    smax = float(np.abs(p["q"]).max() * np.abs(p["k"]).max() * np.sqrt(p["q"].shape[-1]))
    tol = 1e-12 * max(1.0, smax)
    for a, b, shape in zip(blocked, naive, shapes):
        assert a.shape == b.shape == shape
        assert np.isfinite(a).all() and np.isfinite(b).all()
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())))


# ----------------------------------------------------------------------------- 2-D inputs

def test_two_dimensional_inputs_are_one_head():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((11, 5)), rng.standard_normal((13, 5)), rng.standard_normal((13, 4))
    bias, mask = rng.standard_normal((11, 13)), rng.random((1, 13)) < 0.8
    kw = dict(causal="bottom_right", bias=bias, mask=mask)
    kw4 = dict(causal="bottom_right", bias=bias[None, None], mask=mask[None, None])
    q4, k4, v4 = q[None, None], k[None, None], v[None, None]
    for fn in (R.attention_naive, R.attention_blocked):
        out, lse = fn(q, k, v, **kw)
        out4, lse4 = fn(q4, k4, v4, **kw4)
        assert out.shape == (11, 4) and lse.shape == (11,)
        np.testing.assert_allclose(out, out4[0, 0], rtol=1e-14)
    do = rng.standard_normal((11, 4))
    grads = R.attention_backward_naive(do, q, k, v, **kw)
    grads4 = R.attention_backward_naive(do[None, None], q4, k4, v4, **kw4)
    bgrads = R.attention_backward_blocked(do, q, k, v, out, lse, block_m=3, block_n=4, **kw)
    for g, g4, bg, x in zip(grads, grads4, bgrads, (q, k, v, bias)):
        assert g.shape == bg.shape == x.shape
        np.testing.assert_allclose(g, g4.reshape(x.shape), rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(bg, g, rtol=1e-11, atol=1e-13)


# ----------------------------------------------------------------------------- low precision

def _rel(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("case", ["plain", "gqa_causal_bias"])
def test_low_precision_emulation_orders_errors(case):
    rng = np.random.default_rng(3)
    if case == "plain":
        q, k, v = (rng.standard_normal((2, 128, 64)) for _ in range(3))
        kw = {}
    else:
        q = rng.standard_normal((1, 4, 80, 32))
        k, v = rng.standard_normal((1, 2, 96, 32)), rng.standard_normal((1, 2, 96, 48))
        kw = dict(causal="bottom_right", bias=rng.standard_normal((96,)))
    ref, ref_lse = R.attention_naive(q, k, v, **kw)
    errs = {}
    for name, dt in (("fp32", np.float32), ("fp16", np.float16), ("bf16", "bfloat16")):
        out, lse = R.attention_naive(q, k, v, dtype=dt, **kw)
        assert out.dtype == lse.dtype == np.float64 and out.shape == ref.shape
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        errs[name] = _rel(out, ref)
        assert 0 < np.abs(lse - ref_lse).max() < 50 * errs[name]
    assert 1e-8 < errs["fp32"] < 1e-5, errs
    assert 1e-4 < errs["fp16"] < 5e-3, errs
    assert 1e-3 < errs["bf16"] < 3e-2, errs
    assert errs["bf16"] > errs["fp16"] > errs["fp32"], errs


def test_emulation_dtype_spellings():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 20, 8)) for _ in range(3))
    ref = R.attention_naive(q, k, v, causal=True)
    for a, b in zip(ref, R.attention_naive(q, k, v, causal=True, dtype=np.float64)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(R.attention_naive(q, k, v, dtype="bfloat16"), R.attention_naive(q, k, v, dtype=ml_dtypes.bfloat16)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(R.attention_naive(q, k, v, dtype="float16"), R.attention_naive(q, k, v, dtype=np.float16)):
        np.testing.assert_array_equal(a, b)
    for bad in (np.int32, "float8", np.complex64):
        with pytest.raises(ValueError, match="dtype"):
            R.attention_naive(q, k, v, dtype=bad)


def _plain_emulation(q, k, v, scale, bias, to16):
    """One head in a 16-bit dtype, op by op as a framework does it (float32 math, 16-bit results)."""
    f32 = np.float32
    q, k, v, bias = (to16(x.astype(f32)).astype(f32) for x in (q, k, v, bias))
    s = to16((q @ k.T) * f32(scale)).astype(f32)      # one GEMM, alpha = scale
    s = to16(s + bias).astype(f32)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    p = to16(e / e.sum(axis=1, keepdims=True)).astype(f32)
    return to16(p @ v).astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_emulation_rounds_where_a_framework_does(dtype):
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((24, 16)), rng.standard_normal((40, 16)), rng.standard_normal((40, 8))
    bias = rng.standard_normal((24, 40))
    to16 = (lambda x: x.astype(np.float16)) if dtype is np.float16 else (lambda x: x.astype(ml_dtypes.bfloat16))
    want = _plain_emulation(q, k, v, 0.3, bias, to16)
    got, _ = R.attention_naive(q, k, v, scale=0.3, bias=bias, dtype=dtype)
    # Same roundings; only float32 summation order (BLAS) may differ by a 16-bit ulp here and there.
    ulp = 2.0**-10 if dtype is np.float16 else 2.0**-7
    assert np.abs(got - want).max() <= ulp * np.abs(want).max()
    assert np.mean(got == want) > 0.95


def test_emulated_output_is_representable_in_the_dtype():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((16, 8)) for _ in range(3))
    out16, _ = R.attention_naive(q, k, v, dtype=np.float16)
    np.testing.assert_array_equal(out16, out16.astype(np.float16).astype(np.float64))
    outbf, _ = R.attention_naive(q, k, v, dtype="bfloat16")
    np.testing.assert_array_equal(outbf, outbf.astype(ml_dtypes.bfloat16).astype(np.float64))


def _bf16_cases():
    rng = np.random.default_rng(8)
    wide = (rng.standard_normal(2000) * 10.0 ** rng.uniform(-40, 38, 2000)).astype(np.float32)
    # Exact ties (low 16 bits 0x8000) with even and odd bit 16, near-ties, subnormals, the top of the range.
    bits = rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)
    ties = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    near = np.concatenate([ties - np.uint32(1), ties + np.uint32(1)])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                        np.finfo(np.float32).smallest_subnormal, 1.0, -1.5, 3.0e38], np.float32)
    rand = np.concatenate([ties, near, bits]).view(np.float32)
    x = np.concatenate([wide, rand, special])
    return x[~np.isnan(x)]


def test_bf16_bit_rounding_matches_ml_dtypes():
    x = _bf16_cases()
    got = R._bf16_round_bits(x, np)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    nan = R._bf16_round_bits(np.array([np.nan, -np.nan], np.float32), np)
    assert np.isnan(nan).all()


def test_round_to_dtype():
    x = np.random.default_rng(4).standard_normal(1000) * 100
    np.testing.assert_array_equal(R.round_to_dtype(x, "bfloat16"),
                                  x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))
    np.testing.assert_array_equal(R.round_to_dtype(x, np.float16), x.astype(np.float16).astype(np.float64))
    np.testing.assert_array_equal(R.round_to_dtype(x, np.float64), x)
    assert R.round_to_dtype(x, np.float32).dtype == np.float64


# ----------------------------------------------------------------------------- arguments

def test_causal_mask():
    assert R.causal_mask(3, 4, False) is None
    np.testing.assert_array_equal(R.causal_mask(3, 4, True), np.tril(np.ones((3, 4), bool)))
    np.testing.assert_array_equal(R.causal_mask(3, 4, "top_left"), np.tril(np.ones((3, 4), bool)))
    np.testing.assert_array_equal(R.causal_mask(3, 4, "bottom_right"), np.tril(np.ones((3, 4), bool), k=1))
    np.testing.assert_array_equal(R.causal_mask(4, 2, "bottom_right"), np.tril(np.ones((4, 2), bool), k=-2))
    assert R.causal_mask(3, 4, True).dtype == bool


@pytest.mark.parametrize("bad", ["diagonal", "TOP_LEFT", "bottom-right", 1, 0, "", 2.0])
def test_bad_causal_raises(bad):
    x = np.zeros((4, 4))
    lse = np.zeros(4)
    calls = [lambda: R.causal_mask(4, 4, bad),
             lambda: R.attention_naive(x, x, x, causal=bad),
             lambda: R.attention_blocked(x, x, x, causal=bad),
             lambda: R.attention_backward_naive(x, x, x, x, causal=bad),
             lambda: R.attention_backward_blocked(x, x, x, x, x, lse, causal=bad)]
    for call in calls:
        with pytest.raises(ValueError, match="causal"):
            call()


def test_bad_arguments():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 4, 5, 8)), rng.standard_normal((1, 3, 6, 8)), rng.standard_normal((1, 3, 6, 2))
    with pytest.raises(ValueError, match="multiple"):
        R.attention_naive(q, k, v)
    with pytest.raises(ValueError, match="shapes"):
        R.attention_naive(q, k[..., :7], v[:, :2, :, :])
    k, v = k[:, :2], v[:, :2]
    with pytest.raises(ValueError, match="bias"):
        R.attention_naive(q, k, v, bias=np.zeros((5, 5)))
    with pytest.raises(ValueError, match="mask"):
        R.attention_blocked(q, k, v, mask=np.ones((2, 4, 5, 6), bool))
    with pytest.raises(ValueError, match="block_m"):
        R.attention_blocked(q, k, v, block_m=0)
    with pytest.raises(ValueError, match="dout"):
        R.attention_backward_naive(np.zeros((1, 4, 5, 3)), q, k, v)
    with pytest.raises(TypeError, match="complex"):
        R.attention_naive(q.astype(complex), k, v)


def test_imports_and_runs_without_cupy(monkeypatch):
    """Load reference.py on its own with `import cupy` failing: NumPy inputs still work."""
    monkeypatch.setitem(sys.modules, "cupy", None)      # makes `import cupy` raise ImportError
    spec = importlib.util.spec_from_file_location("cuflash._reference_no_cupy", R.__file__)   # in the package: its relative imports
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._cupy() is None and mod._array_module(np.zeros(2)) is np
    x = np.random.default_rng(0).standard_normal((5, 3))
    np.testing.assert_array_equal(mod.attention_naive(x, x, x)[0], R.attention_naive(x, x, x)[0])


# ----------------------------------------------------------------------------- CuPy (marker `gpu`)

@pytest.mark.gpu
def test_cupy_inputs_give_cupy_results_equal_to_numpy():
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 4, 70, 12))
    k, v = rng.standard_normal((2, 2, 90, 12)), rng.standard_normal((2, 2, 90, 6))
    kw = dict(causal="bottom_right", bias=rng.standard_normal((2, 1, 1, 90)), mask=rng.random((70, 90)) < 0.8)
    dev = [cp.asarray(x) for x in (q, k, v)]
    kw_dev = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    out, lse = R.attention_naive(q, k, v, **kw)
    do = rng.standard_normal(out.shape)
    grads = R.attention_backward_naive(do, q, k, v, **kw)
    checks = [(R.attention_naive(*dev, **kw_dev), (out, lse)),
              (R.attention_blocked(*dev, block_m=16, block_n=32, **kw_dev), (out, lse)),
              (R.attention_backward_naive(cp.asarray(do), *dev, **kw_dev), grads),
              (R.attention_backward_blocked(cp.asarray(do), *dev, cp.asarray(out), cp.asarray(lse), block_m=16,
                                            block_n=32, **kw_dev), grads)]
    for got, want in checks:
        for g, w in zip(got, want):
            assert isinstance(g, cp.ndarray) and g.dtype == np.float64
            np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-10, atol=1e-12)
    for dt, ulp in ((np.float32, 2.0**-23), (np.float16, 2.0**-10), ("bfloat16", 2.0**-7)):
        got, _ = R.attention_naive(*dev, dtype=dt, **kw_dev)
        want, _ = R.attention_naive(q, k, v, dtype=dt, **kw)
        assert isinstance(got, cp.ndarray)
        assert np.abs(cp.asnumpy(got) - want).max() <= 2 * ulp * np.abs(want).max()
    x = _bf16_cases()
    np.testing.assert_array_equal(cp.asnumpy(R._bf16_round_bits(cp.asarray(x), cp)).view(np.uint32),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32))
    # CuPy's float32 -> float64 cast flushes float32 subnormals to zero: compare normal numbers.
    x = x[np.abs(x) >= np.finfo(np.float32).tiny]
    np.testing.assert_array_equal(cp.asnumpy(R.round_to_dtype(cp.asarray(x), "bfloat16")),
                                  R.round_to_dtype(x, "bfloat16"))
