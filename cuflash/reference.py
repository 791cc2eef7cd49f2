"""NumPy/CuPy reference attention: naive (materialised) and blocked (FlashAttention-2).

Everything here runs on whichever array library the inputs come from (NumPy, or
CuPy when given CuPy arrays; CuPy is imported lazily, so this module imports fine
without it or without a GPU) and computes in float64 unless told otherwise.
Complex inputs are rejected. Conventions are the library's:

* ``q (..., Hq, Lq, D)``, ``k (..., Hk, Lk, D)``, ``v (..., Hk, Lk, Dv)``; 2-D
  ``(L, D)`` inputs are one head. Leading dims are equal and ``Hq % Hk == 0``:
  grouped-query attention, query head ``h`` reads K/V head ``h // (Hq // Hk)``.
* scores ``s = scale * q k^T + bias`` with ``scale`` defaulting to ``1/sqrt(D)``;
  ``bias`` (float) and ``mask`` (bool, False = does not attend) broadcast to
  ``(..., Hq, Lq, Lk)``.
* ``causal``: False (or None) for none; True or "top_left" allows key ``j`` for
  query ``i`` iff ``j <= i``; "bottom_right" iff ``j <= i + Lk - Lq``. Anything
  else raises ValueError.
* ``out (..., Hq, Lq, Dv)``; ``lse (..., Hq, Lq)`` is the natural-log logsumexp of
  the allowed scores. A row that allows nothing has ``out = 0``, ``lse = -inf`` and
  zero gradients, never NaN, and no floating-point warnings are raised.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple, Union

import numpy as np

from .semantics import acc_dtype, band_limits, causal_offset, dropout_key, dropout_threshold

__all__ = ["causal_mask", "attention_naive", "attention_materialised", "attention_blocked",
           "attention_backward_naive", "attention_magnitude", "attention_backward_blocked", "round_to_dtype"]

Array = Any                      # numpy.ndarray or cupy.ndarray
Causal = Union[bool, str, None]  # False/None, True/"top_left", "bottom_right"

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


# ----------------------------------------------------------------------------- helpers

@functools.lru_cache(maxsize=1)
def _cupy():
    """The cupy module, or None when it cannot be imported (missing, broken CUDA install)."""
    try:
        import cupy
    except Exception:
        return None
    return cupy


def _array_module(*arrays):
    """cupy when any argument is a CuPy array, else numpy."""
    cp = _cupy()
    if cp is None:
        return np
    return cp.get_array_module(*(a for a in arrays if a is not None))


def causal_mask(lq: int, lk: int, causal: Causal, xp=np) -> Optional[Array]:
    """The allowed (query, key) pairs of a causal mask.

    Parameters
    ----------
    lq, lk : int
        Query and key lengths.
    causal : False, None, True, "top_left" or "bottom_right"
    xp : module, optional
        numpy (default) or cupy: where the result lives.

    Returns
    -------
    bool array ``(lq, lk)``, True where key ``j`` may be attended by query ``i``;
    None when ``causal`` is False/None.
    """
    offset = causal_offset(causal, lq, lk)
    if offset is None:
        return None
    return xp.arange(lk)[None, :] <= xp.arange(lq)[:, None] + offset


def _band_tile(rows: slice, cols: slice, band, xp):
    """The band's allowed-matrix of one (rows, cols) tile."""
    lo, hi = band
    j = xp.arange(cols.start, cols.stop)[None, :]
    i = xp.arange(rows.start, rows.stop)[:, None]
    return (j >= i + lo) & (j <= i + hi)


_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int, xp=np):
    """Philox4x32-10 (Salmon et al., SC'11) of uint32 counter arrays under the key (k0, k1).

    The same function as ``kernels_cu/dropout.cuh``; returns the four uint32 output words.
    """
    mask = np.uint64(0xFFFFFFFF)
    c = [xp.asarray(x).astype(np.uint64) for x in (c0, c1, c2, c3)]
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(10):
        p0 = c[0] * np.uint64(_PHILOX_M[0])
        p1 = c[2] * np.uint64(_PHILOX_M[1])
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
             p0 & mask]
        k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
    return tuple(x.astype(np.uint32) for x in c)


def dropout_keep(seed: int, p: float, batch, head, rows, cols, xp=np):
    """Dropout's verdict per element: ``1 / (1 - p)`` where kept, 0 where dropped.

    ``batch``, ``head``, ``rows``, ``cols`` are integer arrays that broadcast
    together (the element's flattened batch index, query head, query row and
    key). The word is Philox4x32-10 of the counter ``(col // 4, row, head, batch)``
    under the key ``(seed mod 2**32, seed // 2**32)``, word ``col % 4``; exactly
    what the kernels draw, so this regenerates their mask.
    """
    shape = np.broadcast_shapes(*(np.shape(x) for x in (batch, head, rows, cols)))
    b, h, r, c = (xp.broadcast_to(xp.asarray(x, dtype=np.int64), shape) for x in (batch, head, rows, cols))
    words = philox4x32_10(c >> 2, r, h, b, *dropout_key(seed), xp=xp)
    sel = c & 3
    word = xp.where(sel == 0, words[0], xp.where(sel == 1, words[1], xp.where(sel == 2, words[2], words[3])))
    keep = word >= np.uint32(dropout_threshold(p))
    return xp.where(keep, 1.0 / (1.0 - float(p)), 0.0)


def _layout_dense(block_layout, rows: slice, cols: slice, ndim: int, xp):
    """A BlockLayout's allowed-matrix over (rows, cols), broadcastable to ``ndim``-D scores."""
    lay = xp.asarray(block_layout.layout)
    bq, bk = block_layout.block_size
    r = xp.arange(rows.start, rows.stop) // bq
    c = xp.arange(cols.start, cols.stop) // bk
    dense = lay[..., r[:, None], c[None, :]]
    return dense.reshape((1,) * (ndim - dense.ndim) + dense.shape)


def _dropout_tile(dropout, shape: tuple, rows: slice, cols: slice, xp):
    """The dropout keep factors of one (rows, cols) tile of scores of ``shape`` (..., Hq, rows, cols).

    :func:`dropout_keep` for the tile, with each Philox counter drawn once: the four keys 4c..4c+3
    share the counter (c, row, head, batch) and take its four words in order, so the words of the
    quads the tile touches, laid side by side, are the keys' words (a quarter of the work)."""
    p, seed, (batch0, row0, col0) = dropout
    lead = shape[:-3]
    nb = int(np.prod(lead, dtype=np.int64)) if lead else 1
    batch = batch0 + (np.arange(nb).reshape(lead + (1, 1, 1)) if lead else np.zeros((1, 1, 1), dtype=np.int64))
    head = np.arange(shape[-3]).reshape(shape[-3], 1, 1)
    r = np.arange(row0 + rows.start, row0 + rows.stop).reshape(-1, 1)
    cols = slice(col0 + cols.start, col0 + cols.stop)
    if cols.stop <= cols.start:
        return dropout_keep(seed, p, batch, head, r, np.arange(cols.start, cols.stop).reshape(1, -1), xp=xp)
    quads = np.arange(cols.start >> 2, ((cols.stop - 1) >> 2) + 1).reshape(1, -1)
    qshape = np.broadcast_shapes(batch.shape, head.shape, r.shape, quads.shape)
    b_, h_, r_, c_ = (xp.broadcast_to(xp.asarray(x, dtype=np.int64), qshape) for x in (batch, head, r, quads))
    words = philox4x32_10(c_, r_, h_, b_, *dropout_key(seed), xp=xp)
    word = xp.stack(words, axis=-1).reshape(qshape[:-1] + (4 * qshape[-1],))   # key 4c + i: word i of quad c
    first = cols.start - 4 * (cols.start >> 2)
    word = word[..., first:first + (cols.stop - cols.start)]
    keep = word >= np.uint32(dropout_threshold(p))
    return xp.where(keep, 1.0 / (1.0 - float(p)), 0.0)


def _check_real(x, name: str) -> None:
    if np.dtype(x.dtype).kind == "c":
        raise TypeError(f"{name} is complex ({x.dtype}); complex inputs are not supported")


def _prepare(q, k, v, scale, bias, mask, xp, work=np.float64):
    """Validate and convert to ``work`` (float64) with an explicit head axis; K/V heads repeated for GQA.

    Returns ``q (..., Hq, Lq, D)``, ``k (..., Hq, Lk, D)``, ``v (..., Hq, Lk, Dv)`` (``work``),
    ``scale``, ``group = Hq // Hk``, ``squeeze`` (inputs were 2-D), and ``bias``/``mask``
    as arrays (unchanged shape) or None.
    """
    q, k, v = (xp.asarray(x) for x in (q, k, v))
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_real(x, name)
    if not (q.ndim == k.ndim == v.ndim) or q.ndim < 2:
        raise ValueError(f"q, k, v must all be 2-D or all have a head axis; got {q.shape}, {k.shape}, {v.shape}")
    full = q.shape[:-1] + (k.shape[-2],)            # the score shape as the caller sees it
    squeeze = q.ndim == 2
    if squeeze:
        q, k, v = q[None], k[None], v[None]
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    hq, hk = q.shape[-3], k.shape[-3]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    group = hq // hk
    q, k, v = (x.astype(work) for x in (q, k, v))
    if group > 1:
        k = xp.repeat(k, group, axis=-3)
        v = xp.repeat(v, group, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    extra = []
    for x, name in ((bias, "bias"), (mask, "mask")):
        if x is not None:
            x = xp.asarray(x)
            _check_real(x, name)
            try:
                ok = np.broadcast_shapes(x.shape, full) == full
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{name} of shape {x.shape} does not broadcast to the scores' {full}")
            x = x.astype(bool) if name == "mask" else x.astype(work)
        extra.append(x)
    return q, k, v, scale, group, squeeze, extra[0], extra[1]


def _allowed_tile(band, mask, block_layout, rows: slice, cols: slice, ndim: int, xp):
    """Boolean array broadcastable to an ``ndim``-D score tile (rows, cols): the pairs
    the band (causal / window), the mask and the block layout all allow (None when all are)."""
    allowed = None
    parts = []
    if band is not None:
        parts.append(_band_tile(rows, cols, band, xp))
    if mask is not None:
        parts.append(_tile(mask, ndim, rows, cols))
    if block_layout is not None:
        parts.append(_layout_dense(block_layout, rows, cols, ndim, xp))
    for part in parts:
        allowed = part if allowed is None else (allowed & part)
    return allowed


def _mods(score_mod, mask_mod):
    """The modifications (cuflash.mods.Mods) of a reference call, or None."""
    if score_mod is None and mask_mod is None:
        return None
    from .mods import resolve
    return resolve(score_mod, mask_mod)


def _mod_grids(shape: tuple, rows: slice, cols: slice, xp):
    """The (b, h, q_idx, kv_idx) index arrays of a score tile of ``shape`` (..., H, rows, cols), broadcastable
    to it: b the flat index over the leading dims (0 without any), h the query head."""
    lead, heads = shape[:-3], shape[-3]
    b = xp.arange(math.prod(lead)).reshape(lead + (1, 1, 1)) if lead else xp.zeros((1, 1, 1), dtype=np.int64)
    h = xp.arange(heads).reshape(heads, 1, 1)
    return b, h, xp.arange(rows.start, rows.stop).reshape(-1, 1), xp.arange(cols.start, cols.stop).reshape(1, -1)


def _modified(s, mods, grids, xp):
    """Scores after the score modifications; where a score is -inf (masked) it stays so."""
    return s if mods is None else mods.scores(s, *grids, xp)


def _mod_allowed(allowed, mods, grids, xp):
    """``allowed`` and the mask modifications' verdict."""
    if mods is None or not mods.mask:
        return allowed
    verdict = mods.allowed(*grids, xp)
    return verdict if allowed is None else (allowed & verdict)


def _tile(x, ndim: int, rows: slice, cols: slice):
    """The (rows, cols) tile of a bias/mask broadcastable to an ``ndim``-D score array, unexpanded."""
    x = x.reshape((1,) * (ndim - x.ndim) + x.shape)
    return x[..., rows if x.shape[-2] != 1 else slice(None), cols if x.shape[-1] != 1 else slice(None)]


def _check_blocks(block_m: int, block_n: int) -> Tuple[int, int]:
    for b, name in ((block_m, "block_m"), (block_n, "block_n")):
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"{name} must be a positive integer, got {b!r}")
    return int(block_m), int(block_n)


def _as_shape(x, shape: tuple, squeeze: bool, name: str, xp, work=np.float64):
    """``x`` as a ``work`` array of the internal ``shape``; the caller's is ``shape[1:]`` if ``squeeze``."""
    x = xp.asarray(x)
    _check_real(x, name)
    expected = shape[1:] if squeeze else shape
    if x.shape != expected:
        raise ValueError(f"{name} has shape {x.shape}, expected {expected}")
    return x.astype(work).reshape(shape)


def _squeeze(squeeze: bool, *arrays):
    return tuple(a[0] if squeeze else a for a in arrays)


# ----------------------------------------------------------------------------- rounding

def _dtype_name(dtype) -> str:
    """'float16', 'bfloat16', 'float32', 'float64' or 'longdouble' for the accepted spellings."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return "bfloat16"
    if isinstance(dtype, str) and dtype == "longdouble" or dtype is np.longdouble:
        return "longdouble"
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _FLOAT_NAMES:
        raise ValueError(f"dtype must be float16, 'bfloat16', float32 or float64, got {dtype!r}")
    return name


def _bf16_round_bits(x, xp):
    """Round float32 values to bfloat16 (nearest, ties to even) with integer arithmetic.

    The bits are viewed as uint32; adding ``0x7FFF + lsb`` (lsb = bit 16) and clearing
    the low 16 bits rounds to nearest-even, carrying into the exponent (and to inf at
    the top of the range) exactly as a correctly rounded conversion does. inf and NaN
    are left alone. Returns float32. Used for CuPy arrays (no bfloat16 dtype there).
    """
    f = xp.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return xp.where(xp.isfinite(f), rounded.view(np.float32), f)


def _round(x, name: str, xp):
    """Values of ``x`` rounded to ``name``, held in float32 for 16-bit types (else in ``name``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "float64":
            return x.astype(np.float64)
        if name == "float32":
            return x.astype(np.float32)
        if name == "float16":
            return x.astype(np.float16).astype(np.float32)
        if xp is np:
            import ml_dtypes

            return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        return _bf16_round_bits(x, xp)


def round_to_dtype(x: Array, dtype) -> Array:
    """Round ``x`` to ``dtype`` and return the rounded values as float64.

    Parameters
    ----------
    x : float array (NumPy or CuPy), any shape
    dtype : float16, float32, float64, "bfloat16" or ``ml_dtypes.bfloat16``

    Returns
    -------
    float64 array, same shape. bfloat16 rounds to nearest even (ml_dtypes on
    NumPy, an equivalent bit manipulation on CuPy). On CuPy, float32 subnormals
    (below 1.2e-38) may be flushed to zero by the device's float32 casts.
    """
    xp = _array_module(x)
    return _round(xp.asarray(x), _dtype_name(dtype), xp).astype(np.float64)


# ----------------------------------------------------------------------------- forward

def _softmax_rows(s, xp):
    """``(p, lse)`` of scores holding -inf where disallowed; rows with nothing give 0 and -inf.

    Computed in ``s``'s dtype, the row max subtracted before ``exp``.
    """
    m = s.max(axis=-1, keepdims=True)                       # NaN where a score is NaN
    m = xp.where(xp.isfinite(m), m, s.dtype.type(0))        # no (-inf) - (-inf)
    e = xp.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    empty = total == 0                                      # nothing allowed; a NaN row stays NaN
    safe = xp.where(empty, s.dtype.type(1), total)
    p = xp.where(empty, s.dtype.type(0), e / safe)
    lse = xp.where(empty[..., 0], s.dtype.type(-np.inf), m[..., 0] + xp.log(safe[..., 0]))
    return p, lse


def _precision(dtype, xp):
    """``(work, rnd)`` for a naive computation at ``dtype``: the working float type and
    the rounding applied to every result (see :func:`attention_naive`)."""
    name = "float64" if dtype is None else _dtype_name(dtype)
    if name == "longdouble":
        if xp is not np:
            raise TypeError("dtype='longdouble' needs NumPy inputs")
        return np.longdouble, lambda x: x
    if name == "float64":
        return np.float64, lambda x: x
    return np.float32, functools.partial(_round, name=name, xp=xp)   # float32 arrays holding `name` values


def _materialise(q, k, v, do, *, scale: float, bias, allowed, xp, work, rnd, absolute: bool = False, keep=None,
                 mods=None):
    """THE naive attention: the n x n scores materialised, each result passed through ``rnd``.

    ``q (..., Hq, Lq, D)``, ``k (..., Hq, Lk, D)``, ``v (..., Hq, Lk, Dv)`` (K/V heads
    already repeated) and ``do`` (or None) in ``work`` precision. Returns ``out``,
    ``lse`` and, when ``do`` is given, ``(dq, dk, dv, ds)`` per query head. ``keep``
    (dropout: ``1/(1-p)`` or 0 per element, or None) multiplies P after the softmax:
    ``O = (keep P) V``, ``dV = (keep P)^T dO``, ``dS = P (keep dP - Dsum)``. With
    ``absolute``, every product is taken over absolute values (``|P| |V|``,
    ``P (|dP| + |Dsum|)``, ...): the magnitudes that bound rounding errors. ``mods``
    (cuflash.mods.Mods): the score modifications applied to S (each result rounded), dS times their
    derivative; the mask modifications are in ``allowed`` already.
    """
    a = xp.abs if absolute else (lambda x: x)
    scale = work(abs(scale) if absolute else scale)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = rnd(xp.matmul(q, xp.swapaxes(k, -1, -2)) * scale)     # S = scale Q K^T (GEMM with alpha = scale)
        if bias is not None:
            s = rnd(s + rnd(bias).astype(work))
        grad = None
        if mods is not None and mods.score:
            grids = _mod_grids(s.shape, slice(0, s.shape[-2]), slice(0, s.shape[-1]), xp)
            if do is not None:
                s_mod, grad, _ = mods.scores_and_grad(s, *grids, xp)
                grad = a(grad)
            else:
                s_mod = mods.scores(s, *grids, xp)
            s = rnd(xp.where(xp.isneginf(s), work(-np.inf), s_mod).astype(work))
        if allowed is not None:
            s = xp.where(allowed, s, work(-np.inf))
        p, lse = _softmax_rows(s, xp)                              # P = softmax(S)
        p = rnd(p)
        pk = p if keep is None else rnd(p * keep)                  # dropout after the softmax
        out = rnd(xp.matmul(pk, a(v)))                             # O = P V
        if do is None:
            return out, lse, None
        dv = rnd(xp.matmul(xp.swapaxes(pk, -1, -2), a(do)))        # dV = P^T dO
        dp = rnd(xp.matmul(a(do), xp.swapaxes(a(v), -1, -2)))     # dP = dO V^T
        if keep is not None:
            dp = dp * keep
        dsum = (a(do) * out).sum(axis=-1, keepdims=True)           # Dsum = rowsum(dO * O)
        ds = rnd(p * (dp + dsum) if absolute else p * (dp - dsum))  # dS = P (dP - Dsum)
        if grad is not None:                                       # dS of the raw scores
            ds = rnd(xp.where(p != 0, ds * grad, 0.0))
        dq = rnd(xp.matmul(ds, a(k)) * scale)                      # dQ = scale dS K
        dk = rnd(xp.matmul(xp.swapaxes(ds, -1, -2), a(q)) * scale)  # dK = scale dS^T Q
    return out, lse, (dq, dk, dv, ds)


def _naive(q, k, v, dout, causal, scale, bias, mask, dtype, absolute=False, window=None, dropout=None,
           block_layout=None, mods=None):
    """Validate, convert to the working precision, run :func:`_materialise`."""
    xp = _array_module(dout, q, k, v)
    work, rnd = (np.float64, lambda x: x) if absolute else _precision(dtype, xp)
    exact = np.longdouble if work is np.longdouble else np.float64    # inputs converted exactly first
    q, k, v, scale, group, squeeze, bias, mask = _prepare(q, k, v, scale, bias, mask, xp, work=exact)
    do = None if dout is None else _as_shape(dout, q.shape[:-1] + (v.shape[-1],), squeeze, "dout", xp, work=exact)
    if work is not np.longdouble:
        q, k, v = (rnd(x).astype(work) for x in (q, k, v))
        do = None if do is None else rnd(do).astype(work)
    lq, lk = q.shape[-2], k.shape[-2]
    rows, cols = slice(0, lq), slice(0, lk)
    band = band_limits(causal, window, lq, lk)
    allowed = _allowed_tile(band, mask, block_layout, rows, cols, q.ndim, xp)
    allowed = _mod_allowed(allowed, mods, _mod_grids(q.shape[:-1] + (lk,), rows, cols, xp), xp)
    keep = None
    if dropout is not None:
        keep = _dropout_tile(dropout, q.shape[:-2] + (lq, lk), rows, cols, xp).astype(work)
    out, lse, grads = _materialise(q, k, v, do, scale=scale, bias=bias, allowed=allowed, xp=xp, work=work, rnd=rnd,
                                   absolute=absolute, keep=keep, mods=mods)
    return out, lse, grads, group, squeeze, bias


def _dropout_arg(dropout_p, seed, origin=(0, 0, 0)):
    """(p, seed, origin) when dropout is on, else None. ``origin``: the (batch, query row, key) that
    the first element of the scores has in the mask's coordinates; a (query row, key) pair is batch 0's
    (cuflash.attention's ``dropout_origin``)."""
    if not dropout_p:
        return None
    if seed is None:
        raise ValueError("dropout_p > 0 needs the seed that drew the mask")
    origin = tuple(origin)
    b0, r0, c0 = (int(x) for x in ((0,) + origin if len(origin) == 2 else origin))
    if min(b0, r0, c0) < 0:
        raise ValueError(f"dropout_origin must be non-negative, got {origin}")
    return float(dropout_p), int(seed), (b0, r0, c0)


def _result_dtype(dtype):
    return np.longdouble if dtype is not None and _dtype_name(dtype) == "longdouble" else np.float64


def attention_naive(q: Array, k: Array, v: Array, *, causal: Causal = False, scale: Optional[float] = None,
                    bias: Optional[Array] = None, mask: Optional[Array] = None,
                    dtype: Any = None, window=None, dropout_p: float = 0.0, seed: Optional[int] = None,
                    block_layout=None, score_mod=None, mask_mod=None,
                    dropout_origin: Tuple[int, int, int] = (0, 0, 0)) -> Tuple[Array, Array]:
    """Attention with the full score matrix materialised: ``softmax(scale q k^T + bias) v``.

    Parameters
    ----------
    q : array ``(..., Hq, Lq, D)`` or ``(Lq, D)``
    k : array ``(..., Hk, Lk, D)`` or ``(Lk, D)``
    v : array ``(..., Hk, Lk, Dv)`` or ``(Lk, Dv)``
        Real floating (or integer) NumPy or CuPy arrays; ``Hq % Hk == 0``.
    causal : False, True, "top_left" or "bottom_right"
    scale : float, optional
        Default ``1 / sqrt(D)``.
    bias : float array broadcastable to ``(..., Hq, Lq, Lk)``, optional
        Added to the scaled scores.
    mask : bool array broadcastable to ``(..., Hq, Lq, Lk)``, optional
        False where a query does not attend a key.
    window : (left, right), optional
        Sliding window: query i attends keys ``i - left <= j <= i + right``
        (shifted by the causal alignment; see :func:`band_limits`).
    dropout_p, seed : float, int
        Dropout after the softmax with the kernels' Philox mask (:func:`dropout_keep`).
    dropout_origin : (batch, row, key) or (row, key)
        The mask's coordinates of the scores' first element (:func:`attention_blocked`).
    block_layout : cuflash.BlockLayout, optional
        Blocks that are off attend nothing.
    score_mod, mask_mod : cuflash.ScoreMod / cuflash.MaskMod or sequences of them, optional
        User modifications, evaluated by their NumPy twins (cuflash.mods) with ``b`` the flat index
        over the leading dims.
    dtype : None, float16, "bfloat16" / ``ml_dtypes.bfloat16``, float32, float64 or "longdouble"
        None (or float64): exact float64 computation; "longdouble": exact in NumPy's
        long double (the reference for float64 results). Otherwise emulate a naive
        framework computing in that dtype, to measure the error that computation
        makes: q, k, v and bias are rounded to ``dtype``; every operation computes
        in float32 for 16-bit types (in ``dtype`` itself for float32) and its result
        is rounded to ``dtype``: ``scale q k^T`` (one GEMM with float32 accumulation
        and ``alpha = scale``, as cuBLAS does), the bias addition, the softmax
        probabilities (softmax in float32) and the output ``P V``. ``lse`` is the softmax's, in float32. Scores that overflow the
        dtype propagate inf/NaN as such a framework would (no warnings are raised).

    Returns
    -------
    out : float64 array ``(..., Hq, Lq, Dv)`` (long double for "longdouble")
    lse : float64 array ``(..., Hq, Lq)``
        Natural-log logsumexp of the allowed scores (-inf for rows with nothing).
    """
    out, lse, _, _, squeeze, _ = _naive(q, k, v, None, causal, scale, bias, mask, dtype, window=window,
                                        dropout=_dropout_arg(dropout_p, seed, dropout_origin),
                                        block_layout=block_layout, mods=_mods(score_mod, mask_mod))
    res = _result_dtype(dtype)
    return _squeeze(squeeze, out.astype(res), lse.astype(res))


def attention_materialised(q: Array, k: Array, v: Array, *, causal: Causal = False,
                           scale: Optional[float] = None) -> Array:
    """Naive attention as a framework runs it, in the inputs' own dtype and on their device.

    ``S = q k^T`` in the input dtype (cuBLAS / BLAS), scaled, masked and
    softmaxed in float32 (float64 for float64 inputs), ``P`` cast back to the
    input dtype, ``out = P v``. The n x n scores are materialised (in place where
    possible). This is the "naive" contender of the benchmark and the demo; for
    accuracy references use :func:`attention_naive`.

    Parameters
    ----------
    q, k, v : arrays ``(..., H, Lq, D)``, ``(..., H, Lk, D)``, ``(..., H, Lk, Dv)``, one dtype
    causal, scale : as :func:`attention_naive`

    Returns
    -------
    out : array ``(..., H, Lq, Dv)``, the inputs' dtype
    """
    xp = _array_module(q, k, v)
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = xp.matmul(q, xp.swapaxes(k, -1, -2)).astype(acc)
    s *= acc(scale)
    allowed = causal_mask(q.shape[-2], k.shape[-2], causal, xp)
    if allowed is not None:
        s = xp.where(allowed, s, acc(-np.inf))
    row_max = s.max(axis=-1, keepdims=True)
    row_max[~xp.isfinite(row_max)] = 0                # rows with nothing to attend: no (-inf) - (-inf)
    s -= row_max
    xp.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    total[total == 0] = 1
    s /= total
    return xp.matmul(s.astype(q.dtype), v)


def _quiet(fn):
    """NumPy's floating-point warnings off inside ``fn``: an inf or NaN input gives inf / NaN results
    (as in PyTorch), not warnings."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(*args, **kwargs)
    return run


@_quiet
def attention_blocked(q: Array, k: Array, v: Array, *, causal: Causal = False, scale: Optional[float] = None,
                      bias: Optional[Array] = None, mask: Optional[Array] = None, block_m: int = 64,
                      block_n: int = 64, return_stats: bool = False, window=None, dropout_p: float = 0.0,
                      seed: Optional[int] = None, block_layout=None, dropout_origin: Tuple[int, int, int] = (0, 0, 0),
                      score_mod=None, mask_mod=None):
    """FlashAttention-2's forward algorithm in float64: online softmax over key tiles.

    For each tile of ``block_m`` query rows: running max ``m = -inf``, running sum
    ``l = 0`` and running output ``o = 0``; for each tile of ``block_n`` keys, with
    ``S`` the tile's scaled, biased, masked scores: ``m_new = max(m, rowmax(S))``,
    ``c = exp(m - m_new)``, ``P = exp(S - m_new)``, ``l = l c + rowsum(P)``,
    ``o = o c + P V``, ``m = m_new``. Finally ``out = o / l`` and
    ``lse = m + log(l)`` (0 and -inf where ``l == 0``). While ``m_new`` is -inf
    (nothing allowed yet) it is replaced by 0 in the subtractions, so ``c = 0``
    and ``P = 0`` without NaN. Key tiles lying entirely outside the causal /
    window band are skipped. With dropout, ``o`` accumulates ``keep P V`` while
    ``l`` sums the undropped ``P``. Leading and head dims are vectorised; only
    tiles are looped.

    Parameters
    ----------
    q, k, v, causal, scale, bias, mask, window, dropout_p, seed, block_layout, score_mod, mask_mod
        As :func:`attention_naive`.
    block_m, block_n : int
        Query and key tile sizes (>= 1).
    dropout_origin : (batch, row, key)
        Where q's first batch entry, first query row and k's first key sit in the coordinates of the
        dropout mask (:func:`dropout_keep`): a slice of a larger problem draws that problem's mask
        (a packed sequence: :mod:`cuflash.varlen`). Default (0, 0, 0).
    return_stats : bool
        Also return ``{"tiles_total": int, "tiles_computed": int}``: the number of
        (query tile, key tile) pairs, and of those not skipped by ``causal``.

    Returns
    -------
    out : float64 array ``(..., Hq, Lq, Dv)``
    lse : float64 array ``(..., Hq, Lq)``
    stats : dict, only with ``return_stats``
    """
    block_m, block_n = _check_blocks(block_m, block_n)
    xp = _array_module(q, k, v)
    q, k, v, scale, _, squeeze, bias, mask = _prepare(q, k, v, scale, bias, mask, xp)
    mods = _mods(score_mod, mask_mod)
    lq, lk = q.shape[-2], k.shape[-2]
    band = band_limits(causal, window, lq, lk)
    dropout = _dropout_arg(dropout_p, seed, dropout_origin)
    out = xp.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = xp.full(q.shape[:-1], -np.inf)
    total = computed = 0
    for m0 in range(0, lq, block_m):
        rows = slice(m0, min(m0 + block_m, lq))
        qi = q[..., rows, :]
        m = xp.full(qi.shape[:-1], -np.inf)
        l_ = xp.zeros(qi.shape[:-1])
        o = xp.zeros(qi.shape[:-1] + (v.shape[-1],))
        for n0 in range(0, lk, block_n):
            total += 1
            cols = slice(n0, min(n0 + block_n, lk))
            if band is not None and (n0 > rows.stop - 1 + band[1] or cols.stop - 1 < m0 + band[0]):
                continue            # the tile lies entirely outside the band
            computed += 1
            s = xp.matmul(qi, xp.swapaxes(k[..., cols, :], -1, -2)) * scale
            if bias is not None:
                s = s + _tile(bias, s.ndim, rows, cols)
            grids = _mod_grids(s.shape, rows, cols, xp) if mods is not None else None
            s = _modified(s, mods, grids, xp)
            allowed = _mod_allowed(_allowed_tile(band, mask, block_layout, rows, cols, s.ndim, xp), mods, grids, xp)
            if allowed is not None:
                s = xp.where(allowed, s, -np.inf)
            m_new = xp.maximum(m, s.max(axis=-1))
            ref = xp.where(xp.isfinite(m_new), m_new, 0.0)
            corr = xp.exp(m - ref)
            p = xp.exp(s - ref[..., None])
            l_ = l_ * corr + p.sum(axis=-1)
            if dropout is not None:
                p = p * _dropout_tile(dropout, s.shape, rows, cols, xp)
            o = o * corr[..., None] + xp.matmul(p, v[..., cols, :])
            m = m_new
        empty = l_ == 0                 # no key allowed: 0 and -inf; a row that read a NaN stays NaN
        safe = xp.where(empty, 1.0, l_)
        out[..., rows, :] = xp.where(empty[..., None], 0.0, o / safe[..., None])
        lse[..., rows] = xp.where(empty, -np.inf, m + xp.log(safe))
    out, lse = _squeeze(squeeze, out, lse)
    if return_stats:
        return out, lse, {"tiles_total": total, "tiles_computed": computed}
    return out, lse


# ----------------------------------------------------------------------------- backward

def _fold_groups(g, group: int):
    """Sum a repeated-heads K/V gradient over the query heads sharing each K/V head."""
    if group > 1:
        g = g.reshape(g.shape[:-3] + (g.shape[-3] // group, group) + g.shape[-2:]).sum(axis=-3)
    return g


def _reduce_to(g, shape: tuple):
    """Sum a gradient of the broadcast scores down to a bias's ``shape`` (same ndim or fewer)."""
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _grads(dq, dk, dv, dbias, group: int, squeeze: bool):
    grads = _squeeze(squeeze, dq, _fold_groups(dk, group), _fold_groups(dv, group))
    return grads if dbias is None else grads + (dbias,)


def attention_backward_naive(dout: Array, q: Array, k: Array, v: Array, *, causal: Causal = False,
                             scale: Optional[float] = None, bias: Optional[Array] = None,
                             mask: Optional[Array] = None, dtype: Any = None, window=None, dropout_p: float = 0.0,
                             seed: Optional[int] = None, block_layout=None, score_mod=None,
                             mask_mod=None, dropout_origin: Tuple[int, int, int] = (0, 0, 0)) -> Tuple[Array, ...]:
    """Gradients of ``sum(dout * out)`` with the score matrix materialised.

    ``P = softmax(S)``, ``O = P V``, ``dV = P^T dO``, ``dP = dO V^T``,
    ``Dsum = rowsum(dO * O)``, ``dS = P (dP - Dsum)``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``, ``dbias = dS`` summed over the axes ``bias`` broadcasts
    along. Rows with nothing to attend have ``P = 0`` and so contribute nothing.

    Parameters
    ----------
    dout : array ``(..., Hq, Lq, Dv)``
        Gradient with respect to ``out``.
    q, k, v, causal, scale, bias, mask, dtype, window, dropout_p, seed, block_layout, score_mod, mask_mod,
    dropout_origin
        As :func:`attention_naive` (``dtype`` emulates the same naive framework:
        every matmul result and n x n intermediate rounded to ``dtype``).

    Returns
    -------
    dq : ``q.shape``; dk : ``k.shape``; dv : ``v.shape``
        (dk, dv summed over the query heads of each grouped-query group), and
    dbias : ``bias.shape``, only when ``bias`` is given. float64 (long double for "longdouble").
    """
    _, _, (dq, dk, dv, ds), group, squeeze, bias = _naive(q, k, v, dout, causal, scale, bias, mask, dtype,
                                                          window=window,
                                                          dropout=_dropout_arg(dropout_p, seed, dropout_origin),
                                                          block_layout=block_layout, mods=_mods(score_mod, mask_mod))
    dbias = None if bias is None else _reduce_to(_squeeze(squeeze, ds)[0], bias.shape)
    res = _result_dtype(dtype)
    return tuple(g.astype(res) for g in _grads(dq, dk, dv, dbias, group, squeeze))


def attention_magnitude(q: Array, k: Array, v: Array, dout: Optional[Array] = None, *, causal: Causal = False,
                        scale: Optional[float] = None, bias: Optional[Array] = None,
                        mask: Optional[Array] = None, window=None, dropout_p: float = 0.0,
                        seed: Optional[int] = None, block_layout=None, score_mod=None, mask_mod=None,
                        dropout_origin: Tuple[int, int, int] = (0, 0, 0)):
    """The naive computation with every product over absolute values, in float64.

    ``|P| |V|`` for the output; ``|P|^T |dO|``, ``P (|dP| + |Dsum|)``, ``|dS| |K|``, ...
    for the gradients: the size of the terms each result sums, which bounds the
    rounding error any method makes (the tests' error floor).

    Returns
    -------
    out magnitude, or ``(out, (dq, dk, dv[, dbias]))`` magnitudes when ``dout`` is given.
    """
    out, _, grads, group, squeeze, _ = _naive(q, k, v, dout, causal, scale, bias, mask, None, absolute=True,
                                              window=window, dropout=_dropout_arg(dropout_p, seed, dropout_origin),
                                              block_layout=block_layout, mods=_mods(score_mod, mask_mod))
    (out,) = _squeeze(squeeze, out)
    if grads is None:
        return out
    dbias = None if bias is None else _reduce_to(_squeeze(squeeze, grads[3])[0], bias.shape)
    return out, _grads(*grads[:3], dbias, group, squeeze)


@_quiet
def attention_backward_blocked(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *,
                               causal: Causal = False, scale: Optional[float] = None,
                               bias: Optional[Array] = None, mask: Optional[Array] = None,
                               block_m: int = 64, block_n: int = 64, window=None, dropout_p: float = 0.0,
                               seed: Optional[int] = None, block_layout=None,
                               dropout_origin: Tuple[int, int, int] = (0, 0, 0), score_mod=None,
                               mask_mod=None) -> Tuple[Array, ...]:
    """FlashAttention-2's backward algorithm in float64, from the forward's ``out`` and ``lse``.

    ``Dsum = rowsum(dO * O)``. For each key tile (outer loop) and each query tile
    (inner loop), skipping tiles entirely above the causal diagonal: recompute
    ``P = exp(S - lse)`` (0 where disallowed or where ``lse`` is -inf), then
    ``dV_j += P^T dO_i``, ``dP = dO_i V_j^T``, ``dS = P (dP - Dsum_i)``,
    ``dK_j += scale dS^T Q_i``, ``dQ_i += scale dS K_j`` (dQ accumulating across key
    tiles) and, with a bias, ``dS`` reduced to the bias's broadcast shape is added
    to its tile of ``dbias``.

    Parameters
    ----------
    dout : array ``(..., Hq, Lq, Dv)``
    q, k, v, causal, scale, bias, mask, window, dropout_p, seed, block_layout, score_mod, mask_mod
        As :func:`attention_naive`.
    out : array ``(..., Hq, Lq, Dv)``; lse : array ``(..., Hq, Lq)``
        The forward's results.
    block_m, block_n : int
        Query and key tile sizes (>= 1).
    dropout_origin : (batch, row, key)
        As :func:`attention_blocked`.

    Returns
    -------
    As :func:`attention_backward_naive`; with trainable parameters of score modifications, also a dict of
    their gradients (float64, the parameters' shapes) last. A score modification's ``dS`` is
    ``P (dP - Dsum)`` times its derivative at the raw score.
    """
    block_m, block_n = _check_blocks(block_m, block_n)
    xp = _array_module(dout, q, k, v, out, lse)
    q, k, v, scale, group, squeeze, bias, mask = _prepare(q, k, v, scale, bias, mask, xp)
    mods = _mods(score_mod, mask_mod)
    param_grads: dict = {}
    do = _as_shape(dout, q.shape[:-1] + (v.shape[-1],), squeeze, "dout", xp)
    o = _as_shape(out, do.shape, squeeze, "out", xp)
    lse = _as_shape(lse, q.shape[:-1], squeeze, "lse", xp)
    lq, lk = q.shape[-2], k.shape[-2]
    band = band_limits(causal, window, lq, lk)
    dropout = _dropout_arg(dropout_p, seed, dropout_origin)
    dsum = (do * o).sum(axis=-1)
    live = lse != -np.inf             # rows that saw a key (a NaN lse too: its gradients are NaN)
    lse_safe = xp.where(live, lse, 0.0)
    dq, dk, dv = xp.zeros(q.shape), xp.zeros(k.shape), xp.zeros(v.shape)
    if bias is not None:
        bias_nd = bias.reshape((1,) * (q.ndim - bias.ndim) + bias.shape)
        dbias = xp.zeros(bias_nd.shape)
        sum_axes = tuple(i for i, n in enumerate(bias_nd.shape[:-2]) if n == 1 and q.shape[i] != 1)
    for n0 in range(0, lk, block_n):
        cols = slice(n0, min(n0 + block_n, lk))
        kj, vj = k[..., cols, :], v[..., cols, :]
        for m0 in range(0, lq, block_m):
            rows = slice(m0, min(m0 + block_m, lq))
            if band is not None and (n0 > rows.stop - 1 + band[1] or cols.stop - 1 < m0 + band[0]):
                continue
            qi, doi = q[..., rows, :], do[..., rows, :]
            s = xp.matmul(qi, xp.swapaxes(kj, -1, -2)) * scale
            if bias is not None:
                s = s + _tile(bias_nd, s.ndim, rows, cols)
            ok = live[..., rows, None]
            grad = inputs = grids = None
            if mods is not None:
                grids = _mod_grids(s.shape, rows, cols, xp)
                if mods.score:
                    raw = s
                    s, grad, inputs = mods.scores_and_grad(s, *grids, xp)
                    s = xp.where(xp.isneginf(raw), -np.inf, s)
            allowed = _mod_allowed(_allowed_tile(band, mask, block_layout, rows, cols, s.ndim, xp), mods, grids, xp)
            if allowed is not None:
                ok = ok & allowed
            ok = ok & xp.ones(s.shape, dtype=bool)
            # Disallowed entries are zeroed before exp, so nothing overflows or warns.
            p = xp.where(ok, xp.exp(xp.where(ok, s - lse_safe[..., rows, None], 0.0)), 0.0)
            dp = xp.matmul(doi, xp.swapaxes(vj, -1, -2))
            if dropout is not None:
                keep = _dropout_tile(dropout, s.shape, rows, cols, xp)
                dv[..., cols, :] += xp.matmul(xp.swapaxes(p * keep, -1, -2), doi)
                dp = dp * keep
            else:
                dv[..., cols, :] += xp.matmul(xp.swapaxes(p, -1, -2), doi)
            ds = p * (dp - dsum[..., rows, None])
            if grad is not None:   # dS of the modified scores -> of the raw ones, and the parameters' gradients
                ds = xp.where(p != 0, ds, 0.0)
                if mods.trainable:
                    for name, g in mods.param_grads_numpy(inputs, ds, *grids, xp).items():
                        param_grads[name] = param_grads.get(name, 0) + g
                ds = xp.where(p != 0, ds * grad, 0.0)
            dk[..., cols, :] += xp.matmul(xp.swapaxes(ds, -1, -2), qi) * scale
            dq[..., rows, :] += xp.matmul(ds, kj) * scale
            if bias is not None:
                g = ds.sum(axis=sum_axes, keepdims=True) if sum_axes else ds
                if bias_nd.shape[-2] == 1:
                    g = g.sum(axis=-2, keepdims=True)
                if bias_nd.shape[-1] == 1:
                    g = g.sum(axis=-1, keepdims=True)
                dbias[..., rows if bias_nd.shape[-2] != 1 else slice(None),
                      cols if bias_nd.shape[-1] != 1 else slice(None)] += g
    grads = _grads(dq, dk, dv, None if bias is None else dbias.reshape(bias.shape), group, squeeze)
    if mods is not None and mods.trainable:
        grads = grads + ({name: param_grads.get(name, xp.zeros(m.params[name].shape))
                          for m, name in mods.trainable},)
    return grads
