"""Public entry points: attention, attention_forward, attention_backward, vjp."""
from __future__ import annotations

from typing import Any, Literal, Optional, Tuple, Union

import numpy as np

from . import _checks, reference
from ._launch import launch_backward, launch_forward

Causal = Union[bool, Literal["top_left", "bottom_right"]]

__all__ = ["attention", "attention_forward", "attention_backward", "vjp"]


def attention(q, k, v, *, causal: Causal = False, scale: Optional[float] = None, bias: Any = None,
              mask: Any = None, dropout_p: float = 0.0, seed: Optional[int] = None, window: Any = None,
              precision: str = "highest"):
    """Exact softmax attention, ``softmax(scale * q k^T) v``, computed tile by tile.

    Parameters
    ----------
    q : cupy.ndarray or numpy.ndarray, shape (..., Hq, Lq, D) or (Lq, D)
        Queries. float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64.
    k : array, shape (..., Hk, Lk, D) or (Lk, D)
        Keys, same dtype and leading dims as ``q``; ``Hq % Hk == 0`` (grouped-query
        attention: query head h reads key/value head ``h // (Hq // Hk)``).
    v : array, shape (..., Hk, Lk, Dv) or (Lk, Dv)
        Values. ``Dv`` may differ from ``D``; both are at most 256.
    causal : bool or {"top_left", "bottom_right"}
        ``True``/``"top_left"``: query i sees keys ``j <= i`` (like
        ``numpy.tril(ones((Lq, Lk)))``). ``"bottom_right"``: ``j <= i + Lk - Lq``
        (the diagonal ends at the last key, as in KV-cache decoding).
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    bias, mask, dropout_p, seed, window, precision
        Reserved: non-default values raise NotImplementedError until they land.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv), the input dtype.
        A query row that can see no key is 0.

    Notes
    -----
    CuPy inputs run the fused kernels on the current device and stream; the
    n x n score matrix is never stored. NumPy inputs run the NumPy blocked
    reference (float64 arithmetic). Strided inputs (e.g. ``x.swapaxes(-2, -3)``
    of ``(B, L, H, D)`` data) are used without copying when their last axis is
    unit-stride. Inputs are never modified.
    """
    return attention_forward(q, k, v, causal=causal, scale=scale, bias=bias, mask=mask,
                             dropout_p=dropout_p, seed=seed, window=window, precision=precision)[0]


def attention_forward(q, k, v, *, causal: Causal = False, scale: Optional[float] = None,
                      bias: Any = None, mask: Any = None, dropout_p: float = 0.0,
                      seed: Optional[int] = None, window: Any = None,
                      precision: str = "highest") -> Tuple[Any, Any]:
    """Attention output and the row logsumexp saved for the backward pass.

    Parameters are those of :func:`attention`.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv), the input dtype.
    lse : array, shape (..., Hq, Lq), float32 (float64 for float64 inputs).
        Natural-log logsumexp over keys of the scaled (masked) scores; ``-inf``
        for a row that can see no key.
    """
    _checks.check_unsupported(bias=bias, mask=mask, dropout_p=dropout_p, seed=seed, window=window,
                              precision=precision)
    p = _checks.check_qkv(q, k, v, causal=causal, scale=scale)
    if p.xp is np:
        return _forward_numpy(p, q.dtype)
    return _forward_cupy(p, q.dtype)


def _lse_dtype(dtype_name: str):
    return np.float64 if dtype_name == "float64" else np.float32


def _forward_numpy(p: _checks.Problem, dtype) -> Tuple[np.ndarray, np.ndarray]:
    out, lse = reference.attention_blocked(p.q, p.k, p.v, causal=p.reference_causal, scale=p.scale)
    return (out.astype(dtype).reshape(p.out_shape()),
            lse.astype(_lse_dtype(p.dtype)).reshape(p.lse_shape()))


def _forward_cupy(p: _checks.Problem, dtype):
    import cupy

    with cupy.cuda.Device(p.q.device.id):
        out = cupy.empty((p.batch, p.heads_q, p.lq, p.dv), dtype=dtype)
        lse = cupy.empty((p.batch, p.heads_q, p.lq), dtype=_lse_dtype(p.dtype))
        if p.lk == 0:   # no keys: every row attends to nothing
            out.view(cupy.uint8).fill(0)    # zero bits are 0.0 in every float format
            lse.fill(-np.inf)
        elif out.size > 0:
            launch_forward(p.q, p.k, p.v, out, lse, dtype=p.dtype, causal_offset=p.causal_offset,
                           scale=p.scale, group=p.group)
    return out.reshape(p.out_shape()), lse.reshape(p.lse_shape())


def attention_backward(dout, q, k, v, out, lse, *, causal: Causal = False, scale: Optional[float] = None,
                       bias: Any = None, mask: Any = None, dropout_p: float = 0.0,
                       seed: Optional[int] = None, window: Any = None, precision: str = "highest",
                       deterministic: bool = False) -> Tuple[Any, Any, Any]:
    """Gradients of ``sum(dout * attention(q, k, v))`` with respect to q, k and v.

    The n x n probabilities are recomputed tile by tile from q, k and the saved
    ``lse``; extra memory is O(L * D).

    Parameters
    ----------
    dout : array, shape (..., Hq, Lq, Dv), q's dtype
        Gradient of the loss with respect to ``out``.
    q, k, v : arrays
        The forward inputs (see :func:`attention`).
    out, lse : arrays
        What :func:`attention_forward` returned for these inputs and options.
        ``lse`` may be any float dtype; it is read as float32 (float64 for float64).
    causal, scale, bias, mask, dropout_p, seed, window, precision
        The options the forward pass used (they must match).
    deterministic : bool
        False (default): dQ is summed with fp32/fp64 atomics, fast but the last
        bits may differ run to run. True: dQ is computed by a separate pass with
        a fixed summation order; results are bitwise identical run to run.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtype of q, k, v.
        With grouped-query attention, dk and dv sum over the query heads that
        share a key/value head. Rows that attend to nothing contribute 0.
    """
    _checks.check_unsupported(bias=bias, mask=mask, dropout_p=dropout_p, seed=seed, window=window,
                              precision=precision)
    p = _checks.check_qkv(q, k, v, causal=causal, scale=scale)
    dout4, out4, lse4 = _checks.check_backward_inputs(p, dout, out, lse)
    if p.xp is np:
        grads = reference.attention_backward_blocked(dout4, p.q, p.k, p.v, out4, lse4,
                                                     causal=p.reference_causal, scale=p.scale)
        return tuple(g.astype(x.dtype).reshape(x.shape) for g, x in zip(grads[:3], (q, k, v)))

    import cupy

    shapes = (q.shape, k.shape, v.shape)
    with cupy.cuda.Device(p.q.device.id):
        if p.lq == 0 or p.lk == 0 or p.batch == 0 or p.heads_q == 0:
            grads = tuple(cupy.zeros(x.shape, dtype=x.dtype) for x in (p.q, p.k, p.v))
        else:
            grads = launch_backward(dout4, p.q, p.k, p.v, out4, lse4, dtype=p.dtype,
                                    causal_offset=p.causal_offset, scale=p.scale, group=p.group,
                                    deterministic=bool(deterministic))
    return tuple(g.reshape(s) for g, s in zip(grads, shapes))


def vjp(q, k, v, *, deterministic: bool = False, **options):
    """Forward pass plus a function that maps ``dout`` to ``(dq, dk, dv)``.

    Parameters
    ----------
    q, k, v : arrays, as for :func:`attention`.
    deterministic : bool
        Passed to :func:`attention_backward`.
    **options
        causal, scale, bias, mask, dropout_p, seed, window, precision.

    Returns
    -------
    out : array, shape (..., Hq, Lq, Dv)
    vjp_fn : callable
        ``vjp_fn(dout) -> (dq, dk, dv)``; may be called any number of times.
        It holds references to q, k, v, out and lse (not copies): do not modify
        them in place between the forward and the backward.
    """
    out, lse = attention_forward(q, k, v, **options)

    def vjp_fn(dout):
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)

    return out, vjp_fn
