"""CPU: the references agree with a direct softmax and with each other (hypothesis)."""
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import reference as R

CAUSAL = [False, True, "bottom_right"]


def direct_attention(q, k, v, causal, scale):
    """Row-by-row softmax attention for one head, written out plainly."""
    lq, lk = q.shape[0], k.shape[0]
    out = np.zeros((lq, v.shape[1]))
    lse = np.full(lq, -np.inf)
    for i in range(lq):
        keys = [j for j in range(lk) if causal is False or j <= i + (0 if causal is True else lk - lq)]
        if not keys:
            continue
        s = np.array([scale * q[i] @ k[j] for j in keys])
        w = np.exp(s - s.max())
        out[i] = sum(wj * v[j] for wj, j in zip(w, keys)) / w.sum()
        lse[i] = s.max() + np.log(w.sum())
    return out, lse


@st.composite
def problems(draw, max_len=70, with_bias=True):
    b, hk = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from([1, 2, 3]))
    lq, lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    d, dv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    logit = draw(st.sampled_from([1.0, 1.0, 1e4]))
    q = rng.standard_normal((b, hq, lq, d)) * logit
    k, v = rng.standard_normal((b, hk, lk, d)), rng.standard_normal((b, hk, lk, dv))
    bias = mask = None
    if with_bias and draw(st.booleans()):
        shape = draw(st.sampled_from([(1, 1, lq, lk), (b, 1, 1, lk), (lk,), (hq, lq, 1)]))
        bias = rng.standard_normal(shape)
    if with_bias and draw(st.booleans()):
        mask = rng.random((lq, lk)) < 0.7
    return dict(q=q, k=k, v=v, causal=draw(st.sampled_from(CAUSAL)), bias=bias, mask=mask,
                block_m=draw(st.integers(1, 70)), block_n=draw(st.integers(1, 70)))


@settings(max_examples=60, deadline=None)
@given(problems())
def test_blocked_equals_naive(p):
    opts = dict(causal=p["causal"], bias=p["bias"], mask=p["mask"])
    out, lse = R.attention_naive(p["q"], p["k"], p["v"], **opts)
    bout, blse = R.attention_blocked(p["q"], p["k"], p["v"], block_m=p["block_m"], block_n=p["block_n"], **opts)
    assert np.isfinite(bout).all()
    np.testing.assert_allclose(bout, out, rtol=1e-10, atol=1e-12)
    assert (np.isneginf(blse) == np.isneginf(lse)).all()
    seen = np.isfinite(lse)
    np.testing.assert_allclose(blse[seen], lse[seen], rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(problems(max_len=20, with_bias=False))
def test_naive_equals_direct_softmax(p):
    q, k, v = p["q"][0, 0], p["k"][0, 0], p["v"][0, 0]
    scale = 0.3
    out, lse = R.attention_naive(q, k, v, causal=p["causal"], scale=scale)
    ref, ref_lse = direct_attention(q, k, v, p["causal"], scale)
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))


@pytest.mark.parametrize("fn", [R.attention_naive, R.attention_blocked])
def test_rows_with_nothing_to_attend(fn):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((9, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 5))
    mask = np.ones((9, 3), bool)
    mask[7] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = fn(q, k, v, causal="bottom_right", mask=mask)
    assert (out[:6] == 0).all() and np.isneginf(lse[:6]).all()
    assert (out[7] == 0).all() and np.isneginf(lse[7])
    assert np.isfinite(out).all() and np.isfinite(lse[[6, 8]]).all()


def test_causal_tiles_are_skipped():
    x = np.random.default_rng(1).standard_normal((256, 16))
    _, _, stats = R.attention_blocked(x, x, x, causal=True, block_m=64, block_n=64, return_stats=True)
    assert stats == {"tiles_total": 16, "tiles_computed": 10}


def test_bad_causal():
    x = np.zeros((4, 4))
    with pytest.raises(ValueError, match="causal"):
        R.attention_naive(x, x, x, causal="diagonal")


def _fd_check(p, which, rng, eps=1e-6):
    opts = dict(causal=p["causal"], bias=p["bias"], mask=p["mask"])
    w = rng.standard_normal(R.attention_naive(p["q"], p["k"], p["v"], **opts)[0].shape)
    grads = R.attention_backward_naive(w, p["q"], p["k"], p["v"], **opts)
    names = ["q", "k", "v"] + (["bias"] if p["bias"] is not None else [])
    g = dict(zip(names, grads))[which]
    u = rng.standard_normal(g.shape)

    def f(delta):
        args = dict(p)
        args[which] = args[which] + delta * u
        return float((R.attention_naive(args["q"], args["k"], args["v"], causal=args["causal"],
                                        bias=args["bias"], mask=args["mask"])[0] * w).sum())

    fd = (f(eps) - f(-eps)) / (2 * eps)
    assert abs(fd - float((g * u).sum())) <= 1e-6 * max(1.0, abs(fd)), which


@settings(max_examples=20, deadline=None)
@given(problems(max_len=12))
def test_backward_naive_matches_finite_differences(p):
    if np.abs(p["q"]).max() > 100:   # finite differences need moderate logits
        return
    rng = np.random.default_rng(0)
    for which in ("q", "k", "v") + (("bias",) if p["bias"] is not None else ()):
        _fd_check(p, which, rng)


@settings(max_examples=40, deadline=None)
@given(problems())
def test_blocked_backward_equals_naive(p):
    opts = dict(causal=p["causal"], bias=p["bias"], mask=p["mask"])
    out, lse = R.attention_naive(p["q"], p["k"], p["v"], **opts)
    do = np.random.default_rng(2).standard_normal(out.shape)
    naive = R.attention_backward_naive(do, p["q"], p["k"], p["v"], **opts)
    blocked = R.attention_backward_blocked(do, p["q"], p["k"], p["v"], out, lse, block_m=p["block_m"],
                                           block_n=p["block_n"], **opts)
    assert len(naive) == len(blocked) == (4 if p["bias"] is not None else 3)
    for a, b in zip(blocked, naive):
        assert a.shape == b.shape
        assert np.isfinite(a).all()
        # Relative to the gradient's own scale: with |s| ~ 1e4, recomputing P from lse
        # costs |lse| * eps of relative accuracy.
        tol = 1e-9 * max(1.0, float(np.abs(p["q"]).max()))
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())))


def test_low_precision_emulation_orders_errors():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 128, 64)) for _ in range(3))
    ref, _ = R.attention_naive(q, k, v)
    errs = {}
    for dt in (np.float32, np.float16, "bfloat16"):
        out, _ = R.attention_naive(q, k, v, dtype=dt)
        errs[str(dt)] = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    e32, e16, ebf = errs[str(np.float32)], errs[str(np.float16)], errs["bfloat16"]
    assert 1e-9 < e32 < 1e-5 and 1e-5 < e16 < 3e-3 and 1e-3 < ebf < 3e-2
    assert e32 < e16 < ebf


def test_round_to_bfloat16_matches_ml_dtypes():
    x = np.random.default_rng(4).standard_normal(1000) * 100
    np.testing.assert_array_equal(R.round_to_dtype(x, "bfloat16"),
                                  x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))
