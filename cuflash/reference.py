"""NumPy/CuPy reference attention: naive (materialised) and blocked (online softmax).

Everything here runs on whichever array library the inputs come from (NumPy, or
CuPy when given CuPy arrays) and computes in float64 unless told otherwise.
Conventions are the library's:

* ``q (..., Hq, Lq, D)``, ``k (..., Hk, Lk, D)``, ``v (..., Hk, Lk, Dv)``; 2-D is one
  head; ``Hq % Hk == 0`` (query head h reads K/V head ``h // (Hq // Hk)``).
* scores ``s = scale * q k^T (+ bias)``, ``scale`` defaulting to ``1/sqrt(D)``;
  ``mask`` False means "does not attend"; ``causal`` True/"top_left" allows key j
  for query i iff ``j <= i``, "bottom_right" iff ``j <= i + Lk - Lq``.
* ``lse`` is the natural-log logsumexp of the allowed scores; a row that allows
  nothing has ``out = 0``, ``lse = -inf`` and zero gradients, never NaN.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

__all__ = ["causal_mask", "attention_naive", "attention_blocked", "attention_backward_naive",
           "attention_backward_blocked", "round_to_dtype"]


def _xp(*arrays):
    try:
        import cupy

        for a in arrays:
            if isinstance(a, cupy.ndarray):
                return cupy
    except ImportError:
        pass
    return np


def _causal_offset(causal, lq: int, lk: int) -> Optional[int]:
    if causal is False or causal is None:
        return None
    if causal is True or (isinstance(causal, str) and causal == "top_left"):
        return 0
    if isinstance(causal, str) and causal == "bottom_right":
        return lk - lq
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def causal_mask(lq: int, lk: int, causal, xp=np):
    """Boolean ``(lq, lk)`` matrix of allowed (query, key) pairs, or None without causal."""
    offset = _causal_offset(causal, lq, lk)
    if offset is None:
        return None
    i = xp.arange(lq)[:, None]
    j = xp.arange(lk)[None, :]
    return j <= i + offset


def _prepare(q, k, v, scale, xp, dtype=np.float64):
    """4-D float arrays with K/V heads repeated for grouped-query attention."""
    q, k, v = (xp.asarray(x).astype(dtype) for x in (q, k, v))
    squeeze = q.ndim == 2
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    hq, hk = q.shape[-3], k.shape[-3]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    group = hq // hk
    if group > 1:
        k = xp.repeat(k, group, axis=-3)
        v = xp.repeat(v, group, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return q, k, v, scale, group, squeeze


def _allowed(lq, lk, causal, mask, xp):
    """Broadcastable boolean array of allowed pairs (or None for all allowed)."""
    allowed = causal_mask(lq, lk, causal, xp)
    if mask is not None:
        m = xp.asarray(mask).astype(bool)
        allowed = m if allowed is None else (allowed & m)
    return allowed


def round_to_dtype(x, dtype):
    """Round to ``dtype`` (float16, "bfloat16", float32, float64) and return float64 values."""
    xp = _xp(x)
    name = np.dtype(dtype).name if not (isinstance(dtype, str) and dtype == "bfloat16") else "bfloat16"
    if name == "float64":
        return x.astype(np.float64)
    if name == "bfloat16":
        f = x.astype(np.float32)
        if xp is np:
            import ml_dtypes

            return f.astype(ml_dtypes.bfloat16).astype(np.float64)
        bits = f.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
        finite = xp.isfinite(f)
        return xp.where(finite, rounded.view(np.float32), f).astype(np.float64)
    return x.astype(name).astype(np.float64)


def _softmax_rows(s, xp):
    """(p, lse) of scores with -inf for disallowed entries; empty rows give p = 0, lse = -inf."""
    m = s.max(axis=-1, keepdims=True)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.exp(s - m_safe)
    total = e.sum(axis=-1, keepdims=True)
    safe_total = xp.where(total > 0, total, 1.0)
    p = xp.where(total > 0, e / safe_total, 0.0)
    lse = xp.where(total[..., 0] > 0, m_safe[..., 0] + xp.log(safe_total[..., 0]), -xp.inf)
    return p, lse


def attention_naive(q, k, v, *, causal=False, scale=None, bias=None, mask=None, dtype=None):
    """Materialised attention ``softmax(scale q k^T + bias) v``.

    Parameters
    ----------
    q, k, v : arrays ``(..., Hq, Lq, D)``, ``(..., Hk, Lk, D)``, ``(..., Hk, Lk, Dv)`` or 2-D.
    causal, scale, bias, mask : see the module docstring.
    dtype : None, or float16 / "bfloat16" / float32 / float64
        None computes exactly in float64. Otherwise emulates the naive computation
        in that dtype: inputs, scores, probabilities and the output are rounded to
        it (matmuls accumulate in float64 here, softmax in float32 for 16-bit
        types). Used to measure the error a naive same-dtype computation makes.

    Returns
    -------
    out : float64 array ``(..., Hq, Lq, Dv)``
    lse : float64 array ``(..., Hq, Lq)``
    """
    xp = _xp(q, k, v)
    q, k, v, scale, _, squeeze = _prepare(q, k, v, scale, xp)
    r = (lambda x: x) if dtype is None else (lambda x: round_to_dtype(x, dtype))
    q, k, v = r(q), r(k), r(v)
    s = xp.matmul(q, xp.swapaxes(k, -1, -2)) * scale
    if bias is not None:
        s = s + xp.asarray(bias).astype(np.float64)
    s = r(s)
    allowed = _allowed(q.shape[-2], k.shape[-2], causal, mask, xp)
    if allowed is not None:
        s = xp.where(allowed, s, -xp.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if dtype is not None and np.dtype(np.float32 if dtype == "bfloat16" else dtype).itemsize <= 2:
            p, lse = _softmax_rows(s.astype(np.float32).astype(np.float64), xp)
        else:
            p, lse = _softmax_rows(s, xp)
    out = r(xp.matmul(r(p), v))
    if squeeze:
        out, lse = out[0], lse[0]
    return out, lse


def _tile_bias(bias, shape, rows, cols, xp):
    """The (rows, cols) slice of a bias/mask broadcast to ``shape`` without expanding it."""
    b = xp.asarray(bias)
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    r = rows if b.shape[-2] != 1 else slice(None)
    c = cols if b.shape[-1] != 1 else slice(None)
    return b[..., r, c]


def attention_blocked(q, k, v, *, causal=False, scale=None, bias=None, mask=None, block_m: int = 64,
                      block_n: int = 64, return_stats: bool = False):
    """FlashAttention-2's algorithm in float64: online softmax over key tiles.

    Per query tile: running max ``m`` (-inf), running sum ``l`` (0), running output
    ``o`` (0); per key tile: ``m_new = max(m, rowmax(S))``, ``c = exp(m - m_new)``,
    ``P = exp(S - m_new)``, ``l = l c + rowsum(P)``, ``o = o c + P V``; finally
    ``out = o / l``, ``lse = m + log l``. Key tiles fully masked by ``causal`` are
    skipped. Same parameters and returns as :func:`attention_naive`; with
    ``return_stats`` a third value ``{"tiles_total", "tiles_computed"}``.
    """
    xp = _xp(q, k, v)
    q, k, v, scale, _, squeeze = _prepare(q, k, v, scale, xp)
    lq, lk = q.shape[-2], k.shape[-2]
    offset = _causal_offset(causal, lq, lk)
    out = xp.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = xp.full(q.shape[:-1], -xp.inf)
    full_shape = q.shape[:-1] + (lk,)
    total = computed = 0
    for m0 in range(0, lq, block_m):
        rows = slice(m0, min(m0 + block_m, lq))
        qi = q[..., rows, :]
        m = xp.full(qi.shape[:-1], -xp.inf)
        l_ = xp.zeros(qi.shape[:-1])
        o = xp.zeros(qi.shape[:-1] + (v.shape[-1],))
        for n0 in range(0, lk, block_n):
            total += 1
            cols = slice(n0, min(n0 + block_n, lk))
            if offset is not None and n0 > rows.stop - 1 + offset:
                continue   # every key of this tile is after every query's diagonal
            computed += 1
            s = xp.matmul(qi, xp.swapaxes(k[..., cols, :], -1, -2)) * scale
            if bias is not None:
                s = s + _tile_bias(bias, full_shape, rows, cols, xp).astype(np.float64)
            allowed = None
            if offset is not None:
                allowed = (xp.arange(cols.start, cols.stop)[None, :]
                           <= xp.arange(rows.start, rows.stop)[:, None] + offset)
            if mask is not None:
                mt = _tile_bias(mask, full_shape, rows, cols, xp).astype(bool)
                allowed = mt if allowed is None else allowed & mt
            if allowed is not None:
                s = xp.where(allowed, s, -xp.inf)
            m_new = xp.maximum(m, s.max(axis=-1))
            ref = xp.where(xp.isfinite(m_new), m_new, 0.0)      # no (-inf) - (-inf)
            corr = xp.exp(m - ref)
            p = xp.exp(s - ref[..., None])
            l_ = l_ * corr + p.sum(axis=-1)
            o = o * corr[..., None] + xp.matmul(p, v[..., cols, :])
            m = m_new
        seen = l_ > 0
        safe = xp.where(seen, l_, 1.0)
        out[..., rows, :] = xp.where(seen[..., None], o / safe[..., None], 0.0)
        lse[..., rows] = xp.where(seen, m + xp.log(safe), -xp.inf)
    if squeeze:
        out, lse = out[0], lse[0]
    if return_stats:
        return out, lse, {"tiles_total": total, "tiles_computed": computed}
    return out, lse


def _fold_groups(g, group, squeeze):
    """Sum a K/V gradient over the query heads that share each K/V head."""
    if group > 1:
        g = g.reshape(g.shape[:-3] + (g.shape[-3] // group, group) + g.shape[-2:]).sum(axis=-3)
    return g[0] if squeeze else g


def _reduce_to(g, shape):
    """Sum a (..., Hq, Lq, Lk) gradient down to a broadcast bias shape."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return (g.sum(axis=axes, keepdims=True) if axes else g).reshape(shape)


def attention_backward_naive(dout, q, k, v, *, causal=False, scale=None, bias=None, mask=None):
    """Materialised float64 gradients of ``sum(dout * out)``.

    ``P = softmax(S)``, ``dV = P^T dO``, ``dP = dO V^T``, ``Dsum = rowsum(dO * O)``,
    ``dS = P (dP - Dsum)``, ``dQ = scale dS K``, ``dK = scale dS^T Q``.

    Returns
    -------
    (dq, dk, dv), plus dbias (the bias's shape) when ``bias`` is given; float64.
    """
    xp = _xp(dout, q, k, v)
    hk_shape = (k.shape, v.shape)
    q4, k4, v4, scale, group, squeeze = _prepare(q, k, v, scale, xp)
    do = xp.asarray(dout).astype(np.float64)
    do = do[None] if squeeze else do
    s = xp.matmul(q4, xp.swapaxes(k4, -1, -2)) * scale
    if bias is not None:
        s = s + xp.asarray(bias).astype(np.float64)
    allowed = _allowed(q4.shape[-2], k4.shape[-2], causal, mask, xp)
    if allowed is not None:
        s = xp.where(allowed, s, -xp.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        p, _ = _softmax_rows(s, xp)
    o = xp.matmul(p, v4)
    dv = xp.matmul(xp.swapaxes(p, -1, -2), do)
    dp = xp.matmul(do, xp.swapaxes(v4, -1, -2))
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    dq = xp.matmul(ds, k4) * scale
    dk = xp.matmul(xp.swapaxes(ds, -1, -2), q4) * scale
    grads = ((dq[0] if squeeze else dq), _fold_groups(dk, group, squeeze), _fold_groups(dv, group, squeeze))
    assert grads[1].shape == hk_shape[0] and grads[2].shape == hk_shape[1]
    if bias is not None:
        return grads + (_reduce_to(ds[0] if squeeze else ds, xp.asarray(bias).shape),)
    return grads


def attention_backward_blocked(dout, q, k, v, out, lse, *, causal=False, scale=None, bias=None, mask=None,
                               block_m: int = 64, block_n: int = 64):
    """FlashAttention-2's backward in float64, from the saved ``out`` and ``lse``.

    ``Dsum = rowsum(dO * O)``; for each key tile (outer) and query tile (inner):
    recompute ``P = exp(S - lse)`` (0 where lse is -inf), then ``dV_j += P^T dO_i``,
    ``dP = dO_i V_j^T``, ``dS = P (dP - Dsum_i)``, ``dK_j += scale dS^T Q_i``,
    ``dQ_i += scale dS K_j``. Returns as :func:`attention_backward_naive`.
    """
    xp = _xp(dout, q, k, v)
    q4, k4, v4, scale, group, squeeze = _prepare(q, k, v, scale, xp)
    do, o, lse = (xp.asarray(x).astype(np.float64) for x in (dout, out, lse))
    if squeeze:
        do, o, lse = do[None], o[None], lse[None]
    lq, lk = q4.shape[-2], k4.shape[-2]
    offset = _causal_offset(causal, lq, lk)
    full_shape = q4.shape[:-1] + (lk,)
    dsum = (do * o).sum(axis=-1)
    dq, dk, dv = xp.zeros(q4.shape), xp.zeros(k4.shape), xp.zeros(v4.shape)
    dbias = xp.zeros(full_shape) if bias is not None else None
    lse_safe = xp.where(xp.isfinite(lse), lse, 0.0)
    for n0 in range(0, lk, block_n):
        cols = slice(n0, min(n0 + block_n, lk))
        kj, vj = k4[..., cols, :], v4[..., cols, :]
        for m0 in range(0, lq, block_m):
            rows = slice(m0, min(m0 + block_m, lq))
            if offset is not None and n0 > rows.stop - 1 + offset:
                continue
            s = xp.matmul(q4[..., rows, :], xp.swapaxes(kj, -1, -2)) * scale
            if bias is not None:
                s = s + _tile_bias(bias, full_shape, rows, cols, xp).astype(np.float64)
            ok = xp.isfinite(lse[..., rows])[..., None] & xp.ones(s.shape, bool)
            if offset is not None:
                ok = ok & (xp.arange(cols.start, cols.stop)[None, :]
                           <= xp.arange(rows.start, rows.stop)[:, None] + offset)
            if mask is not None:
                ok = ok & _tile_bias(mask, full_shape, rows, cols, xp).astype(bool)
            with np.errstate(over="ignore", invalid="ignore"):
                p = xp.where(ok, xp.exp(xp.where(ok, s, 0.0) - lse_safe[..., rows, None]), 0.0)
            dv[..., cols, :] += xp.matmul(xp.swapaxes(p, -1, -2), do[..., rows, :])
            dp = xp.matmul(do[..., rows, :], xp.swapaxes(vj, -1, -2))
            ds = p * (dp - dsum[..., rows, None])
            dk[..., cols, :] += xp.matmul(xp.swapaxes(ds, -1, -2), q4[..., rows, :]) * scale
            dq[..., rows, :] += xp.matmul(ds, kj) * scale
            if dbias is not None:
                dbias[..., rows, cols] = ds
    grads = ((dq[0] if squeeze else dq), _fold_groups(dk, group, squeeze), _fold_groups(dv, group, squeeze))
    if bias is not None:
        return grads + (_reduce_to(dbias[0] if squeeze else dbias, xp.asarray(bias).shape),)
    return grads
