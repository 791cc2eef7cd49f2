"""Input validation (CPU): every bad call raises a clear Python exception."""
import ml_dtypes
import numpy as np
import pytest

import cuflash


def _qkv(shape_q=(2, 4, 16, 8), shape_k=None, shape_v=None, dtype=np.float32):
    rng = np.random.default_rng(0)
    shape_k = shape_k or shape_q
    shape_v = shape_v or shape_k
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_v))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_bad_dtype(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="dtype"):
        cuflash.attention(q.astype(dtype), k, v)


def test_mixed_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        cuflash.attention(q, k.astype(np.float64), v)


def test_not_an_array():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="ndarray"):
        cuflash.attention(q.tolist(), k, v)


@pytest.mark.parametrize("shapes,match", [
    (((2, 4, 16, 8), (2, 4, 16, 9), None), "head dims differ"),
    (((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 15, 8)), "lengths differ"),
    (((2, 4, 16, 8), (3, 4, 16, 8), None), "leading dims"),
    (((2, 4, 16, 8), (2, 3, 16, 8), None), "multiple of key/value heads"),
    (((2, 4, 16, 8), (2, 2, 16, 8), (2, 1, 16, 8)), "head counts differ"),
    (((2, 4, 16, 300), None, None), "head dim must be in"),
    (((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 257)), "v head dim"),
    (((16,), None, None), "at least 2 dims"),
    (((4, 16, 8), (2, 4, 16, 8), None), "same number of dims"),
])
def test_bad_shapes(shapes, match):
    q, k, v = _qkv(*shapes)
    with pytest.raises(ValueError, match=match):
        cuflash.attention(q, k, v)


@pytest.mark.parametrize("causal", ["yes", "bottom-right", 1.5, "BOTTOM_RIGHT"])
def test_bad_causal(causal):
    with pytest.raises(ValueError, match="causal"):
        cuflash.attention(*_qkv(), causal=causal)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.1", True])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="scale"):
        cuflash.attention(*_qkv(), scale=scale)


def test_tf32_precision_is_accepted():
    # NumPy inputs run the float64 reference whatever the precision (it sets a lower bound only).
    q, k, v = _qkv()
    np.testing.assert_array_equal(cuflash.attention(q, k, v, precision="tf32"), cuflash.attention(q, k, v))


def test_bad_precision():
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention(*_qkv(), precision="fast")


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_numpy_path_matches_naive(dtype, causal):
    q, k, v = _qkv((2, 4, 37, 24), (2, 2, 53, 24), (2, 2, 53, 16), dtype=dtype)
    out, lse = cuflash.attention_forward(q, k, v, causal=causal)
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 4, 37, 16)
    assert lse.dtype == (np.float64 if dtype is np.float64 else np.float32) and lse.shape == (2, 4, 37)
    ref, ref_lse = cuflash.reference.attention_naive(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    tol = {np.float64: 1e-12}.get(dtype, float(np.finfo(np.float32).eps) * 8)
    if dtype in (np.float16, ml_dtypes.bfloat16):
        tol = 1e-2
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=tol, rtol=tol)


def test_numpy_2d_and_inputs_untouched():
    q, k, v = _qkv((19, 8), (23, 8), (23, 5))
    copies = [x.copy() for x in (q, k, v)]
    out = cuflash.attention(q, k, v, causal="bottom_right")
    assert out.shape == (19, 5)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)
