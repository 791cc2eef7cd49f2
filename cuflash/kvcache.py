"""Attention over a KV cache with per-sequence lengths, appending the new keys and values in place.

The cache holds ``cache_seqlens[b]`` valid keys of sequence b (the rest is free room); the call writes
``k_new`` / ``v_new`` at positions ``cache_seqlens[b] ...`` of each sequence and attends the queries to
the sequence's ``cache_seqlens[b] + Lnew`` keys, causal aligned to each sequence's own end (query i of
Lq sees keys ``j <= cache_seqlens[b] + Lnew - Lq + i``), as FlashAttention's ``flash_attn_with_kvcache``.
The per-sequence lengths reach the kernels as a boolean mask over the cache (the masked kernels skip
whole blocks past a sequence's end without loading them); long caches split their keys (``num_splits``).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import api
from .options import array_module, dtype_name

__all__ = ["attention_with_kvcache"]


def _lengths(cache_seqlens, batch: int, xp):
    """cache_seqlens as an int64 array of shape (batch,) on q's device, or TypeError / ValueError."""
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        return xp.full((batch,), int(cache_seqlens), dtype=np.int64)
    try:
        mod = array_module(cache_seqlens)
    except TypeError:
        raise TypeError("cache_seqlens must be an int or an integer array of shape (B,)") from None
    if np.dtype(cache_seqlens.dtype).kind not in "iu":
        raise TypeError(f"cache_seqlens must hold integers, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},), got {tuple(cache_seqlens.shape)}")
    if mod is not xp:
        raise TypeError(f"cache_seqlens is a {mod.__name__} array but q is a {xp.__name__} array")
    return cache_seqlens.astype(np.int64)


def attention_with_kvcache(q, k_cache, v_cache, k_new=None, v_new=None, *, cache_seqlens,
                           causal: bool = False, window: Any = None, scale: Optional[float] = None,
                           num_splits: Optional[int] = None, return_lse: bool = False) -> Any:
    """Attention of new queries over a KV cache, appending the new keys and values in place.

    Parameters
    ----------
    q : array (B, Hq, Lq, D)
        The new queries (CuPy or NumPy; float16, bfloat16, float32 or float64).
    k_cache, v_cache : arrays (B, Hk, Lcap, D) and (B, Hk, Lcap, Dv)
        The caches, q's dtype and device, any strides (a (B, Lcap, Hk, D) cache passes as
        ``cache.swapaxes(1, 2)``, no copy); ``Hq % Hk == 0``. Written only at the appended slots.
    k_new, v_new : arrays (B, Hk, Lnew, D) and (B, Hk, Lnew, Dv), optional
        Keys and values to append at positions ``cache_seqlens[b] ... cache_seqlens[b] + Lnew - 1``
        of sequence b (both or neither).
    cache_seqlens : int or integer array (B,)
        Valid keys of each sequence before the append; ``cache_seqlens[b] + Lnew <= Lcap``.
    causal : bool
        Query i sees keys ``j <= cache_seqlens[b] + Lnew - Lq + i`` (each sequence's own bottom right).
    window : (left, right), optional
        Sliding window around that diagonal (keys ``i' - left <= j <= i' + right`` with
        ``i' = cache_seqlens[b] + Lnew - Lq + i``; None for an unbounded side).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    num_splits : int, optional
        As :func:`cuflash.attention`'s.
    return_lse : bool
        Also return the natural-log log-sum-exp (B, Hq, Lq).

    Returns
    -------
    out : array (B, Hq, Lq, Dv), q's dtype; ``(out, lse)`` with ``return_lse``. A query that sees no
    key (an empty sequence) gives 0 and lse -inf.
    """
    xp = array_module(q)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if x is None:
            continue
        if array_module(x) is not xp:
            raise TypeError(f"{name} is a {array_module(x).__name__} array but q is a {xp.__name__} array")
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, D), got shape {tuple(x.shape)}")
        if np.dtype(x.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
        if xp is not np and x.device.id != q.device.id:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {q.device.id}")
    dtype_name(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D (B, Hq, Lq, D), got shape {tuple(q.shape)}")
    b, hq, lq, d = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be (B, Hk, Lcap, D) "
                         f"and (B, Hk, Lcap, Dv) for q {tuple(q.shape)}")
    hk, cap = k_cache.shape[1], k_cache.shape[2]
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together")
    n_new = 0
    if k_new is not None:
        n_new = k_new.shape[2]
        if k_new.shape != (b, hk, n_new, d) or v_new.shape != (b, hk, n_new, v_cache.shape[3]):
            raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} must be (B, Hk, Lnew, D) and "
                             f"(B, Hk, Lnew, Dv) of the caches")
    lengths = _lengths(cache_seqlens, b, xp)
    lo, hi = int(lengths.min()) if b else 0, int(lengths.max()) if b else 0
    if lo < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {lo}")
    if hi + n_new > cap:
        raise ValueError(f"cache_seqlens + Lnew reaches {hi + n_new} keys, past the cache's {cap}")
    if window is not None and (not isinstance(window, tuple) or len(window) != 2):
        raise ValueError(f"window must be (left, right), got {window!r}")

    if n_new:   # the append: every new key of sequence b at cache_seqlens[b] + t, one scatter for the batch
        rows = xp.arange(b)[:, None]
        slots = lengths[:, None] + xp.arange(n_new)[None, :]
        k_cache[rows, :, slots] = k_new.transpose(0, 2, 1, 3)
        v_cache[rows, :, slots] = v_new.transpose(0, 2, 1, 3)
    total = lengths + n_new                                     # keys of each sequence after the append
    keys = xp.arange(cap)[None, None, None, :]
    allowed = keys < total[:, None, None, None]                 # (B, 1, 1, Lcap)
    if causal or window is not None:
        diagonal = (total - lq)[:, None, None, None] + xp.arange(lq)[None, None, :, None]   # (B, 1, Lq, 1)
        left, right = window if window is not None else (None, None)
        if causal:
            right = 0 if right is None else min(int(right), 0)
        if right is not None:
            allowed = allowed & (keys <= diagonal + int(right))
        if left is not None:
            allowed = allowed & (keys >= diagonal - int(left))
    out, lse = api.attention_forward(q, k_cache, v_cache, mask=allowed, scale=scale, num_splits=num_splits)
    return (out, lse) if return_lse else out
