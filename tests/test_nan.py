"""NaN and inf inputs on the NumPy path, with PyTorch SDPA's semantics: a NaN a row reads makes that
row's output and lse NaN and the gradients that depend on it NaN; keys whose scores a row does not
read (masked, outside its causal band) leave its output alone; rows with nothing to attend stay 0 / -inf; no NumPy warning
escapes."""
import warnings

import numpy as np
import pytest

import cuflash


def _qkv(seed=0, lq=6, lk=9, d=4):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, 2, lq, d)), rng.standard_normal((1, 2, lk, d)), rng.standard_normal((1, 2, lk, d))


@pytest.fixture(autouse=True)
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_nan_in_a_query_row_reaches_that_row_only():
    q, k, v = _qkv()
    q[0, 1, 2, 0] = np.nan
    out, lse = cuflash.attention_forward(q, k, v)
    assert np.isnan(out[0, 1, 2]).all() and np.isnan(lse[0, 1, 2])
    rest = np.ones(lse.shape, dtype=bool)
    rest[0, 1, 2] = False
    assert np.isfinite(out[rest]).all() and np.isfinite(lse[rest]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_a_key_reaches_the_rows_that_read_it(causal):
    q, k, v = _qkv()
    k[0, 0, 4, 1] = np.nan
    out, lse = cuflash.attention_forward(q, k, v, causal=causal)
    reads = np.arange(6) >= 4 if causal else np.ones(6, dtype=bool)     # top-left causal: rows 4, 5 read key 4
    assert np.isnan(lse[0, 0, reads]).all() and np.isnan(out[0, 0, reads]).all()
    assert np.isfinite(lse[0, 0, ~reads]).all() and np.isfinite(out[0, 0, ~reads]).all()
    assert np.isfinite(out[0, 1]).all() and np.isfinite(lse[0, 1]).all()


def test_nan_in_a_value_column_leaves_lse_finite():
    q, k, v = _qkv()
    v[0, 1, 3, 2] = np.nan
    out, lse = cuflash.attention_forward(q, k, v)
    assert np.isfinite(lse).all()
    assert np.isnan(out[0, 1, :, 2]).all() and np.isfinite(np.delete(out[0, 1], 2, axis=-1)).all()


def test_a_masked_nan_key_is_not_read():
    """(A NaN *value* of a masked key may still reach a row, through a zero weight times NaN, as in
    PyTorch: its math backend multiplies every weight, its fused ones skip whole blocks.)"""
    q, k, v = _qkv()
    k[0, :, 7] = np.nan
    mask = np.ones((1, 1, 1, 9), dtype=bool)
    mask[..., 7] = False
    out, lse = cuflash.attention_forward(q, k, v, mask=mask)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_gradients_that_depend_on_a_nan_are_nan():
    q, k, v = _qkv()
    k[0, 0, 4, 1] = np.nan
    out, lse = cuflash.attention_forward(q, k, v, causal=True)
    dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    assert np.isnan(dq[0, 0, 4:]).all()        # (rows 0-3 may meet it as 0 x NaN in dS K, as in PyTorch)
    assert np.isfinite(dq[0, 1]).all() and np.isfinite(dk[0, 1]).all() and np.isfinite(dv[0, 1]).all()
    assert np.isnan(dk[0, 0]).any()


def test_fully_masked_rows_stay_zero_and_minus_inf():
    q, k, v = _qkv()
    mask = np.ones((1, 1, 6, 9), dtype=bool)
    mask[..., 3, :] = False
    k[0, 0, 0, 0] = np.nan
    mask[..., :, 0] = False                 # the NaN key is masked for every row
    out, lse = cuflash.attention_forward(q, k, v, mask=mask)
    assert (out[:, :, 3] == 0).all() and np.isneginf(lse[:, :, 3]).all()
    assert np.isfinite(np.delete(lse, 3, axis=-1)).all()


@pytest.mark.parametrize("where", ["q", "k"])
def test_inf_inputs_give_nan_rows_without_warnings(where):
    q, k, v = _qkv()
    (q if where == "q" else k)[0, 0, 2, 0] = np.inf
    out, lse = cuflash.attention_forward(q, k, v)      # the fixture turns any warning into an error
    row = out[0, 0, 2] if where == "q" else out[0, 0]
    assert not np.isfinite(row).all()
