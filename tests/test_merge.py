"""merge_attention: attention over disjoint key sets merged by their log-sum-exp equals attention over
the union, forward and (through the merged out and lse) backward; empty parts, NaN, validation."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference
from cuflash.merge import merge_into

BF16 = np.dtype(ml_dtypes.bfloat16)


def _qkv(rng, b=2, h=3, lq=17, lk=40, d=8, dv=5):
    return (rng.standard_normal((b, h, lq, d)), rng.standard_normal((b, h, lk, d)),
            rng.standard_normal((b, h, lk, dv)))


def _cuts(lk, parts, rng):
    inner = np.sort(rng.choice(np.arange(1, lk), size=parts - 1, replace=False)) if parts > 1 else []
    return [0, *map(int, inner), lk]


@settings(max_examples=40, deadline=None)
@given(parts=st.integers(1, 5), lk=st.integers(5, 60), lq=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_merged_parts_equal_attention_over_all_keys(parts, lk, lq, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, lq=lq, lk=lk)
    cuts = _cuts(lk, min(parts, lk), rng)
    results = [cuflash.attention_forward(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    out, lse = cuflash.merge_attention([o for o, _ in results], [l_ for _, l_ in results])
    want_out, want_lse = cuflash.attention_forward(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
    assert out.dtype == np.float64 and lse.dtype == np.float64


def test_merge_is_associative_and_commutative():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, lk=30)
    parts = [cuflash.attention_forward(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 7), (7, 19), (19, 30))]
    (o1, l1), (o2, l2), (o3, l3) = parts
    all_at_once = cuflash.merge_attention([o1, o2, o3], [l1, l2, l3])
    left = cuflash.merge_attention([*cuflash.merge_attention([o1, o2], [l1, l2])[:1], o3],
                                   [cuflash.merge_attention([o1, o2], [l1, l2])[1], l3])
    o23, l23 = cuflash.merge_attention([o3, o2], [l3, l2])
    right = cuflash.merge_attention([o23, o1], [l23, l1])
    for got in (left, right):
        np.testing.assert_allclose(got[0], all_at_once[0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(got[1], all_at_once[1], rtol=1e-13, atol=1e-14)


def test_a_part_that_saw_no_key_adds_nothing():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng)
    out, lse = cuflash.attention_forward(q, k, v)
    zeros, empty = np.zeros_like(out), np.full_like(lse, -np.inf)   # what the forward writes for it
    got_out, got_lse = cuflash.merge_attention([zeros, out], [empty, lse])
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_lse, lse)
    none_out, none_lse = cuflash.merge_attention([zeros, zeros], [empty, empty])
    assert (none_out == 0).all() and np.isneginf(none_lse).all()
    nan_out, _ = cuflash.merge_attention([np.full_like(out, np.nan), out], [empty, lse])
    assert np.isnan(nan_out).all()                  # NaN propagates, even from a part without keys


def test_rows_masked_in_one_part_and_seen_in_another():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, lq=6, lk=12)
    mask = np.ones((1, 1, 6, 12), dtype=bool)
    mask[..., :3, :6] = False                     # rows 0-2 see no key of the first half
    a = cuflash.attention_forward(q, k[:, :, :6], v[:, :, :6], mask=mask[..., :6])
    b = cuflash.attention_forward(q, k[:, :, 6:], v[:, :, 6:], mask=mask[..., 6:])
    assert np.isneginf(a[1][:, :, :3]).all()
    out, lse = cuflash.merge_attention([a[0], b[0]], [a[1], b[1]])
    want = cuflash.attention_forward(q, k, v, mask=mask)
    np.testing.assert_allclose(out, want[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want[1], rtol=1e-12, atol=1e-13)


def test_nan_in_a_part_with_keys_propagates():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng)
    a = cuflash.attention_forward(q, k[:, :, :20], v[:, :, :20])
    b = cuflash.attention_forward(q, k[:, :, 20:], v[:, :, 20:])
    out_a = a[0].copy()
    out_a[0, 1, 2, 3] = np.nan
    out, lse = cuflash.merge_attention([out_a, b[0]], [a[1], b[1]])
    nan = np.isnan(out)
    assert nan[0, 1, 2, 3] and nan.sum() == 1      # the element it reaches, nothing else
    lse_a = a[1].copy()
    lse_a[1, 0, 5] = np.nan
    out, lse = cuflash.merge_attention([a[0], b[0]], [lse_a, b[1]])
    assert np.isnan(lse[1, 0, 5]) and np.isnan(out[1, 0, 5]).all()


def test_backward_of_a_merged_result_is_exact_per_part():
    """Each part's backward with the merged out and lse: dk, dv exact for its keys, dq summing to the
    exact dq."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, lq=9, lk=33, d=6, dv=4)
    cuts = (0, 10, 25, 33)
    results = [cuflash.attention_forward(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    out, lse = cuflash.merge_attention([o for o, _ in results], [l_ for _, l_ in results])
    dout = rng.standard_normal(out.shape)
    grads = [cuflash.attention_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse)
             for a, b in zip(cuts, cuts[1:])]
    dq = sum(g[0] for g in grads)
    dk = np.concatenate([g[1] for g in grads], axis=2)
    dv = np.concatenate([g[2] for g in grads], axis=2)
    want = reference.attention_backward_naive(dout, q, k, v, causal=False, scale=1 / np.sqrt(6))
    for got, exact in zip((dq, dk, dv), want):
        np.testing.assert_allclose(got, exact, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_low_precision_parts_merge_in_float32(dtype):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, lk=48)
    parts = [cuflash.attention_forward(*(x.astype(dtype) for x in (q, k[:, :, a:b], v[:, :, a:b])))
             for a, b in ((0, 16), (16, 48))]
    out, lse = cuflash.merge_attention([o for o, _ in parts], [l_ for _, l_ in parts])
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    want_out, want_lse = cuflash.attention_forward(*(x.astype(dtype) for x in (q, k, v)))
    tol = {np.dtype(np.float32): 1e-6}.get(np.dtype(dtype), 1e-2)
    np.testing.assert_allclose(out.astype(np.float64), want_out.astype(np.float64), rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    out64, lse64 = cuflash.merge_attention([o for o, _ in parts], [l_ for _, l_ in parts], dtype=np.float64)
    assert out64.dtype == np.float64 and lse64.dtype == np.float64


def test_a_stacked_array_is_taken_as_parts():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng)
    parts = [cuflash.attention_forward(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 13), (13, 40))]
    stacked = cuflash.merge_attention(np.stack([o for o, _ in parts]), np.stack([l_ for _, l_ in parts]))
    listed = cuflash.merge_attention([o for o, _ in parts], [l_ for _, l_ in parts])
    np.testing.assert_array_equal(stacked[0], listed[0])


@pytest.mark.parametrize("outs, lses, err, match", [
    ([], [], ValueError, "at least one part"),
    ([np.zeros((2, 3, 4))], [], ValueError, "1 outputs but 0 lse"),
    ([np.zeros((2, 3, 4)), np.zeros((2, 3, 5))], [np.zeros((2, 3))] * 2, ValueError, "outs\\[1\\] has shape"),
    ([np.zeros((2, 3, 4))], [np.zeros((2, 4))], ValueError, "lses\\[0\\] must have shape \\(2, 3\\)"),
    ([np.zeros((3, 4))], [np.zeros(3)], ValueError, "\\(..., H, Lq, Dv\\)"),
    ([np.zeros((2, 3, 4), dtype=np.int32)], [np.zeros((2, 3))], TypeError, "outs\\[0\\] has dtype int32"),
    ([np.zeros((2, 3, 4))], [[[0.0] * 3] * 2], TypeError, "numpy.ndarray or cupy.ndarray"),
])
def test_bad_input_is_refused(outs, lses, err, match):
    with pytest.raises(err, match=match):
        cuflash.merge_attention(outs, lses)


def test_bad_dtype_is_refused():
    with pytest.raises(TypeError, match="dtype must be"):
        cuflash.merge_attention([np.zeros((2, 3, 4))], [np.zeros((2, 3))], dtype=np.int8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_into_equals_merge_attention(dtype):
    """The in-place two-part merge (the ring forward's) gives merge_attention's result: rows one part
    saw nothing of, rows neither did, a NaN row."""
    rng = np.random.default_rng(11)
    outs = [rng.standard_normal((2, 3, 7, 5)).astype(dtype) for _ in range(2)]
    lses = [rng.standard_normal((2, 3, 7)).astype(dtype) for _ in range(2)]
    lses[0][0, 0, :2], outs[0][0, 0, :2] = -np.inf, 0       # the accumulated part saw nothing yet
    lses[1][0, 1, 3], outs[1][0, 1, 3] = -np.inf, 0         # the new part saw nothing
    lses[0][1, 2, 4] = lses[1][1, 2, 4] = -np.inf           # neither did
    outs[0][1, 2, 4] = outs[1][1, 2, 4] = 0
    outs[1][1, 0, 6, 2] = np.nan
    want_out, want_lse = cuflash.merge_attention(outs, lses)
    out, lse = outs[0].copy(), lses[0].copy()
    merge_into(out[..., 1:, :], lse[..., 1:], outs[1][..., 1:, :], lses[1][..., 1:])   # on views, in place
    merge_into(out[..., :1, :], lse[..., :1], outs[1][..., :1, :], lses[1][..., :1])
    np.testing.assert_allclose(out, want_out, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=0)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=0)
    assert np.isnan(out[1, 0, 6, 2]) and out[1, 2, 4].tolist() == [0] * 5 and lse[1, 2, 4] == -np.inf
