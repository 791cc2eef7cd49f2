"""Merging attention results computed over disjoint sets of keys.

Attention over keys K = K_1 u K_2 u ... is a weighted mean of the attention over each part: with
``lse_s`` the log-sum-exp of part s's scores and ``out_s`` its output,

    lse = log(sum_s exp(lse_s)),        out = sum_s exp(lse_s - lse) * out_s.

This is exact (no approximation beyond rounding), associative and commutative. A part that saw no
key (``lse_s = -inf``, ``out_s = 0`` as the forward writes it) has weight 0; if no part saw a key,
the row is 0 with ``lse = -inf``, as a fully masked row of :func:`cuflash.attention_forward`. A NaN
in any part's out or lse propagates to the merged row, as NaN inputs do in PyTorch.

The split-KV forward merges its partial results the same way on the GPU (kernels_cu/flash_fwd_combine.cu).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .options import SUPPORTED_DTYPES, _BF16, array_module, dtype_name
from .semantics import acc_dtype

__all__ = ["merge_attention"]


def _to_acc(xp, x, acc):
    """``x`` in the accumulator dtype ``acc``; a CuPy bfloat16 array widened by its bits (CuPy 13, which
    the cuda12 extra allows, has no bfloat16 arithmetic)."""
    if xp is not np and x.dtype == _BF16:
        x = (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(acc, copy=False)


def _from_acc(xp, x, dtype):
    """``x`` (float32 / float64) as ``dtype``; to a CuPy bfloat16 array by round-to-nearest-even on its
    bits (NaN stays NaN)."""
    if xp is not np and dtype == _BF16:
        bits = x.astype(xp.float32, copy=False).view(xp.uint32)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = xp.where(xp.isnan(x), xp.uint32(0x7FC0), rounded)
        return rounded.astype(xp.uint16).view(_BF16)
    return x.astype(dtype, copy=False)


def merge_attention(outs: Sequence[Any], lses: Sequence[Any], *,
                    dtype: Optional[Any] = None) -> Tuple[Any, Any]:
    """Combine attention results over disjoint key sets into the result over their union, exactly.

    Parameters
    ----------
    outs : sequence of S >= 1 arrays, each of shape (..., H, Lq, Dv)
        Each part's attention output (what :func:`cuflash.attention_forward` returned for the same
        queries against one part of the keys), all of one shape; any float dtype. A stacked array of
        shape (S, ..., H, Lq, Dv) is taken as S parts.
    lses : sequence of S arrays, each of shape (..., H, Lq)
        Each part's natural-log log-sum-exp (``-inf`` for a row that saw no key of that part); any
        float dtype.
    dtype : dtype, optional
        The merged output's dtype; default the first part's.

    Returns
    -------
    out : array, shape (..., H, Lq, Dv), ``dtype``
    lse : array, shape (..., H, Lq), float32 (float64 when ``dtype`` is float64)

    Notes
    -----
    The weights and the sum are formed in float32 (float64 for float64). For the gradient of a
    merged result, call :func:`cuflash.attention_backward` once per part with that part's keys and
    values and the *merged* ``out`` and ``lse``: each call's dk, dv are exact for its keys and the
    parts' dq sum to the exact dq (the backward recomputes the probabilities from the lse it is
    given, and its row term rowsum(dout * out) needs the merged out).
    """
    outs, lses = list(outs), list(lses)
    if not outs:
        raise ValueError("merge_attention needs at least one part")
    if len(outs) != len(lses):
        raise ValueError(f"{len(outs)} outputs but {len(lses)} lse arrays")
    first = outs[0]
    xp = array_module(first)
    for name, parts in (("outs", outs), ("lses", lses)):
        for i, x in enumerate(parts):
            if array_module(x) is not xp:
                raise TypeError(f"{name}[{i}] is a {array_module(x).__name__} array but outs[0] is a "
                                f"{xp.__name__} array")
            if xp is not np and x.device.id != first.device.id:
                raise ValueError(f"{name}[{i}] is on device {x.device.id}, outs[0] on device {first.device.id}")
            dtype_name(x, f"{name}[{i}]")
    if first.ndim < 3:
        raise ValueError(f"outputs must have shape (..., H, Lq, Dv), got {tuple(first.shape)}")
    for i, (o, l_) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != tuple(first.shape):
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)}, outs[0] {tuple(first.shape)}")
        if tuple(l_.shape) != tuple(first.shape[:-1]):
            raise ValueError(f"lses[{i}] must have shape {tuple(first.shape[:-1])} (its output's without the "
                             f"last dim), got {tuple(l_.shape)}")
    out_dtype = np.dtype(first.dtype) if dtype is None else np.dtype(dtype)
    if out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {out_dtype}")
    acc = np.dtype(acc_dtype(SUPPORTED_DTYPES[out_dtype]))

    weights, lse = _weights([_to_acc(xp, l_, acc) for l_ in lses], acc, xp)
    out = xp.zeros(first.shape, dtype=acc)
    with np.errstate(invalid="ignore", over="ignore"):
        for w, o in zip(weights, outs):
            out += w[..., None] * _to_acc(xp, o, acc)
    return _from_acc(xp, out, out_dtype), lse


def _weights(lse_parts, acc, xp):
    """(each part's weight exp(lse_s - lse), lse) for lse_parts in the accumulator dtype ``acc``: 0 for a
    part that saw no key, every weight 0 and lse -inf where no part did, NaN where a part is NaN."""
    peak = lse_parts[0]
    for l_ in lse_parts[1:]:
        peak = xp.maximum(peak, l_)          # NaN propagates
    finite_peak = xp.where(peak == -np.inf, acc.type(0), peak)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        weights = [xp.exp(l_ - finite_peak) for l_ in lse_parts]
        total = weights[0]
        for w in weights[1:]:
            total = total + w
        lse = finite_peak + xp.log(total)    # -inf where no part saw a key, NaN where a part is NaN
        inv_total = xp.where(total == 0, acc.type(0), 1 / total)   # 0 where no part saw a key
        return [w * inv_total for w in weights], lse


def merge_into(out, lse, part_out, part_lse) -> None:
    """Merge one more part into an accumulated result in place: ``out`` (..., H, Lq, Dv) and ``lse``
    (..., H, Lq), float32 or float64 (the accumulator dtype), become the merge of themselves and
    (``part_out``, ``part_lse``) of the same shapes (float, cast into the accumulators' dtype), as
    :func:`merge_attention` would return them, without a merged copy (the ring forward accumulates its
    steps so). The part must not share memory with the accumulators."""
    xp = array_module(out)
    acc = np.dtype(out.dtype)
    (w_acc, w_part), merged_lse = _weights([lse, part_lse], acc, xp)
    with np.errstate(invalid="ignore", over="ignore"):
        out *= w_acc[..., None]
        out += w_part[..., None] * part_out
    lse[...] = merged_lse
