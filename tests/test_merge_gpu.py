"""merge_attention on CuPy arrays (marker `gpu`): every dtype against the NumPy merge of the same
parts, and against the GPU's one-shot attention."""
import ml_dtypes
import numpy as np
import pytest

import cuflash

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cupy_merge_matches_numpy_and_one_shot(dtype):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 4, 33, 64), (2, 4, 300, 64), (2, 4, 300, 64)))
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    cuts = (0, 64, 250, 300)
    parts = [cuflash.attention_forward(qd, kd[:, :, a:b], vd[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    parts[1][1][0, 0, :5] = -cp.inf                     # rows of one part that saw nothing
    parts[1][0][0, 0, :5] = 0                           # ... and wrote 0
    out, lse = cuflash.merge_attention([o for o, _ in parts], [l_ for _, l_ in parts])
    assert isinstance(out, cp.ndarray) and out.dtype == np.dtype(dtype)
    host = cuflash.merge_attention([cp.asnumpy(o) for o, _ in parts], [cp.asnumpy(l_) for _, l_ in parts])
    tol = 1e-12 if dtype is np.float64 else 1e-6
    np.testing.assert_allclose(cp.asnumpy(lse), host[1], rtol=tol, atol=tol)
    # the device's exp and fused multiply-adds differ from NumPy's by an ulp or so
    np.testing.assert_allclose(cp.asnumpy(out).astype(np.float64), host[0].astype(np.float64), rtol=tol,
                               atol=tol if dtype in (np.float32, np.float64) else 1e-2)
    one_out, one_lse = cuflash.attention_forward(qd, kd, vd)
    ok = np.ones(lse.shape, dtype=bool)
    ok[0, 0, :5] = False
    np.testing.assert_allclose(cp.asnumpy(lse)[ok], cp.asnumpy(one_lse)[ok], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("band", [{}, {"causal": True}, {"window": (70, 30)}], ids=["full", "causal", "window"])
@pytest.mark.parametrize("lq, lk", [(1000, 1100), (37, 1100), (5, 5000)])
def test_a_16_bit_partial_in_float32_is_the_forward_before_its_rounding(dtype, d, band, lq, lk):
    """forward_in_accumulator (the ring's partials): out in float32 from the same kernel arithmetic as
    attention_forward's, which rounds it to 16 bits: equal after that rounding, bit for bit, lse equal."""
    rng = np.random.default_rng(d + lq)
    q = cp.asarray(rng.standard_normal((2, 4, lq, d)).astype(dtype))
    k, v = (cp.asarray(rng.standard_normal((2, 2, lk, d)).astype(dtype)) for _ in range(2))
    out32, lse32 = cuflash.api.forward_in_accumulator(q, k, v, **band)
    out, lse = cuflash.attention_forward(q, k, v, num_splits=1, **band)   # (few rows: unsplit, as the partial)
    assert out32.dtype == np.float32 and out32.shape == out.shape and lse32.dtype == np.float32
    np.testing.assert_array_equal(cp.asnumpy(out32.astype(dtype)).view(np.uint16), cp.asnumpy(out).view(np.uint16))
    np.testing.assert_array_equal(cp.asnumpy(lse32), cp.asnumpy(lse))
    assert float(cp.abs(out32 - out32.astype(dtype).astype(cp.float32)).max()) > 0   # not rounded to 16 bits


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_cupy_merge_equals_one_shot_and_is_associative(dtype):
    """Parts over disjoint keys merged on the GPU: out and lse within the dtype's error of one call over all
    keys; merged all at once, left to right and right to left alike."""
    rng = np.random.default_rng(1)
    q, k, v = (cp.asarray(rng.standard_normal(s).astype(dtype)) for s in ((2, 4, 33, 64), (2, 2, 300, 64),
                                                                         (2, 2, 300, 48)))
    cuts = (0, 7, 190, 300)
    (o1, l1), (o2, l2), (o3, l3) = (cuflash.attention_forward(q, k[:, :, a:b], v[:, :, a:b])
                                    for a, b in zip(cuts, cuts[1:]))
    tol = 1e-12 if dtype is np.float64 else 2e-5
    want_out, want_lse = cuflash.attention_forward(q, k, v)
    at_once = cuflash.merge_attention([o1, o2, o3], [l1, l2, l3])
    o12, l12 = cuflash.merge_attention([o1, o2], [l1, l2])
    o32, l32 = cuflash.merge_attention([o3, o2], [l3, l2])
    for out, lse in (at_once, cuflash.merge_attention([o12, o3], [l12, l3]), cuflash.merge_attention([o32, o1],
                                                                                                       [l32, l1])):
        np.testing.assert_allclose(cp.asnumpy(out), cp.asnumpy(want_out), rtol=tol, atol=tol)
        np.testing.assert_allclose(cp.asnumpy(lse), cp.asnumpy(want_lse), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_cupy_backward_of_a_merged_result_is_exact_per_part(dtype):
    """Each part's GPU backward given the merged out and lse: dk, dv of its keys and dq summed over the parts
    within the dtype's error of the backward of one call over all keys."""
    rng = np.random.default_rng(2)
    q, k, v = (cp.asarray(rng.standard_normal(s).astype(dtype)) for s in ((1, 4, 70, 64), (1, 4, 260, 64),
                                                                         (1, 4, 260, 64)))
    cuts = (0, 100, 130, 260)
    parts = [cuflash.attention_forward(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:])]
    out, lse = cuflash.merge_attention([o for o, _ in parts], [l_ for _, l_ in parts])
    dout = cp.asarray(rng.standard_normal(out.shape).astype(dtype))
    grads = [cuflash.attention_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse) for a, b in zip(cuts, cuts[1:])]
    got = (sum(g[0] for g in grads), cp.concatenate([g[1] for g in grads], axis=2),
           cp.concatenate([g[2] for g in grads], axis=2))
    one_out, one_lse = cuflash.attention_forward(q, k, v)
    want = cuflash.attention_backward(dout, q, k, v, one_out, one_lse)
    tol = 1e-11 if dtype is np.float64 else 1e-4
    for g, w in zip(got, want):
        scale = float(cp.abs(w).max())
        assert float(cp.abs(g - w).max()) <= tol * scale
