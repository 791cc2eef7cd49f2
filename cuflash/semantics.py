"""Definitions the launch path and the NumPy reference share, written once.

* the accumulation dtype: float64 inputs accumulate (and keep lse) in float64, every other
  dtype in float32;
* the causal alignment and the diagonal band of a causal mask and a sliding window;
* dropout's threshold and Philox key (``kernels_cu/dropout.cuh`` draws the same words).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

Causal = Union[bool, str, None]

LOG2E = float(np.log2(np.e))
"""log2(e): kernels fold ``scale * log2(e)`` into their exp2."""


def acc_dtype(dtype: Any):
    """The accumulator (and lse) dtype of inputs of ``dtype`` (a dtype or its cuflash name):
    ``numpy.float64`` for float64, else ``numpy.float32``."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return np.float64 if name == "float64" else np.float32


def acc_itemsize(dtype: Any) -> int:
    """Bytes of one accumulator element for inputs of ``dtype``: 8 for float64, else 4."""
    return np.dtype(acc_dtype(dtype)).itemsize


def causal_offset(causal: Causal, lq: int, lk: int) -> Optional[int]:
    """None without a causal mask; else key j is visible to query i iff ``j <= i + offset``
    (0 for ``True`` / "top_left", ``lk - lq`` for "bottom_right")."""
    if causal is None or (isinstance(causal, (bool, np.bool_)) and not causal):
        return None
    if isinstance(causal, (bool, np.bool_)) or (isinstance(causal, str) and causal == "top_left"):
        return 0
    if isinstance(causal, str) and causal == "bottom_right":
        return lk - lq
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def band_limits(causal: Causal, window, lq: int, lk: int) -> Optional[Tuple[int, int]]:
    """The diagonal band of a causal mask and/or a sliding window, or None for neither.

    Key ``j`` is visible to query ``i`` iff ``i + lo <= j <= i + hi``. With the
    alignment offset ``o`` (``Lk - Lq`` for ``causal="bottom_right"``, else 0):
    ``causal`` gives ``hi = o``; ``window=(left, right)`` gives ``lo = o - left``
    and ``hi = o + right`` (``None`` for an unbounded side); with both, ``hi`` is the
    smaller. Unbounded sides are clamped to ``-(lq + 1)`` / ``lk + 1``, which no
    pair reaches.
    """
    offset = causal_offset(causal, lq, lk)
    if offset is None and window is None:
        return None
    align = offset or 0
    lo, hi = -(lq + 1), lk + 1
    if offset is not None:
        hi = offset
    if window is not None:
        left, right = window
        if left is not None:
            lo = align - int(left)
        if right is not None:
            hi = min(hi, align + int(right))
    return max(lo, -(lq + 1)), min(max(hi, -(lq + 1)), lk + 1)


def dropout_threshold(p: float) -> int:
    """An element is dropped iff its 32-bit Philox word is below this: ``round(p * 2**32)``."""
    return min(2**32 - 1, max(1, int(round(float(p) * 2**32))))


def dropout_key(seed: int) -> Tuple[int, int]:
    """The Philox4x32-10 key of a 64-bit dropout seed: (low word, high word)."""
    seed = int(seed)
    return seed & 0xFFFFFFFF, seed >> 32
