"""NaN on the GPU (marker `gpu`): the NaN pattern of out and lse equals the NumPy path's (which follows
PyTorch SDPA: tests/test_nan.py) for every dtype, on the Hopper and the portable kernels and the
split-KV forward; the gradients of the rows that read a NaN are NaN, the other heads' finite."""
import ml_dtypes
import numpy as np
import pytest

import cuflash

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def _inputs(dtype, where, lq=70, lk=150, d=64):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, n, d)).astype(DTYPES[dtype]) for n in (lq, lk, lk))
    {"q": q, "k": k, "v": v}[where][0, 0, 40, 3] = np.nan
    return q, k, v


@pytest.mark.parametrize("dtype", list(DTYPES))
# (A NaN value under a causal mask reaches the masked rows of its tile as 0 x NaN, tile by tile: no
# pattern to compare.)
@pytest.mark.parametrize("where, causal", [("q", False), ("q", True), ("k", False), ("k", True), ("v", False)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_pattern_matches_the_numpy_path(dtype, where, causal, num_splits):
    q, k, v = _inputs(dtype, where)
    want_out, want_lse = cuflash.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    out, lse = cuflash.attention_forward(*(cp.asarray(x) for x in (q, k, v)), causal=causal, num_splits=num_splits)
    got_out, got_lse = cp.asnumpy(out).astype(np.float64), cp.asnumpy(lse)
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(want_lse))
    np.testing.assert_array_equal(np.isnan(got_out), np.isnan(want_out))
    assert np.isnan(got_out).any()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gradients_of_rows_that_read_a_nan(dtype):
    q, k, v = (cp.asarray(x) for x in _inputs(dtype, "k"))
    out, lse = cuflash.attention_forward(q, k, v, causal=True)
    dq, dk, dv = (cp.asnumpy(g).astype(np.float64) for g in
                  cuflash.attention_backward(cp.ones_like(out), q, k, v, out, lse, causal=True))
    assert np.isnan(dq[0, 0, 40:]).all()          # rows 40 on read key 40
    assert np.isfinite(dq[0, 1]).all() and np.isfinite(dk[0, 1]).all() and np.isfinite(dv[0, 1]).all()
