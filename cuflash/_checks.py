"""Input validation: every bad call ends here with a clear TypeError/ValueError,
before anything reaches a kernel."""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # bfloat16 arrays are ml_dtypes.bfloat16 (NumPy and CuPy alike)
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
    _BF16 = None

SUPPORTED_DTYPES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                    np.dtype(np.float64): "float64"}
if _BF16 is not None:
    SUPPORTED_DTYPES[_BF16] = "bfloat16"

MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def _cupy():
    """The cupy module, or None where CuPy does not import (NumPy-only use)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def array_module(x: Any):
    """numpy or cupy for an array; TypeError for anything else."""
    if isinstance(x, np.ndarray):
        return np
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy
    raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(x).__name__}")


def dtype_name(x: Any, what: str) -> str:
    try:
        return SUPPORTED_DTYPES[np.dtype(x.dtype)]
    except KeyError:
        raise TypeError(f"{what} has dtype {x.dtype}; supported: float16, bfloat16 "
                        "(ml_dtypes.bfloat16), float32, float64") from None


def causal_mode(causal: Any) -> str | None:
    """None (no causal mask), "top_left" or "bottom_right"."""
    if causal is False or causal is None:
        return None
    if causal is True or (isinstance(causal, str) and causal == "top_left"):
        return "top_left"
    if isinstance(causal, str) and causal == "bottom_right":
        return "bottom_right"
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def check_scale(scale: Any, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite real number or None, got {scale!r}")
    return float(scale)


def check_unsupported(*, precision="highest") -> None:
    """Options the API checks before any other: ``precision`` is "highest" or "tf32" (float32
    only; the backward runs float32-accurate FMA kernels for both)."""
    if precision not in ("highest", "tf32"):
        raise ValueError(f"precision must be 'highest' or 'tf32', got {precision!r}")


@dataclass
class Problem:
    """A validated attention call, with the inputs as 4-D (B, H, L, D) arrays."""

    xp: Any
    dtype: str
    lead: tuple          # the leading ("...") dims of the inputs
    q: Any
    k: Any
    v: Any
    causal: str | None   # None, "top_left" or "bottom_right"
    scale: float
    q_shape: tuple       # q's shape as given

    @property
    def causal_offset(self) -> int | None:
        """None without a causal mask; else key j is allowed for query i iff j <= i + offset."""
        if self.causal is None:
            return None
        return 0 if self.causal == "top_left" else self.lk - self.lq

    @property
    def reference_causal(self):
        """The causal argument in reference.py's spelling."""
        return {None: False, "top_left": True, "bottom_right": "bottom_right"}[self.causal]

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads_q(self) -> int:
        return self.q.shape[1]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def lq(self) -> int:
        return self.q.shape[2]

    @property
    def lk(self) -> int:
        return self.k.shape[2]

    @property
    def dv(self) -> int:
        return self.v.shape[3]

    def out_shape(self) -> tuple:
        """out's shape: q's with the last dim replaced by Dv (2-D stays 2-D)."""
        return self.q_shape[:-1] + (self.dv,)

    def lse_shape(self) -> tuple:
        return self.q_shape[:-1]


def _as_4d(x, xp, lead_size: int):
    """(..., H, L, D) -> (B, H, L, D), unit-stride last axis. A view where possible (the array
    itself when it is 4-D already: a reshape costs a microsecond a call)."""
    if x.ndim == 2:
        x = x[None]
    if x.strides[-1] != x.itemsize and x.shape[-1] > 1:
        x = xp.ascontiguousarray(x)
    if x.ndim == 4:
        return x
    return x.reshape((lead_size,) + x.shape[-3:])


def check_qkv(q, k, v, *, causal=False, scale=None) -> Problem:
    """Validate q, k, v and the options shared by every entry point."""
    xp = array_module(q)
    for name, x in (("k", k), ("v", v)):
        if array_module(x) is not xp:
            raise TypeError(f"q is a {xp.__name__} array but {name} is a "
                            f"{array_module(x).__name__} array: pass all inputs from one library")
    dtype = dtype_name(q, "q")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        dtype_name(k, "k"), dtype_name(v, "v")   # an unsupported dtype is the first thing to say
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if xp is not np:
        devices = (q.data.device_id, k.data.device_id, v.data.device_id)
        if devices[0] != devices[1] or devices[0] != devices[2]:
            raise ValueError(f"q, k, v are on different devices {sorted(set(devices))}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (L, D), got shape {x.shape}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v must have the same number of dims, got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.ndim >= 3:
        lead = tuple(q.shape[:-3])
        if k.shape[:-3] != lead or v.shape[:-3] != lead:
            raise ValueError(f"leading dims must be equal: q {q.shape}, k {k.shape}, v {v.shape}")
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    else:
        lead, hq, hk, hv = (), 1, 1, 1
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    lk, lv = k.shape[-2], v.shape[-2]
    if d != dk:
        raise ValueError(f"q and k head dims differ: q {q.shape}, k {k.shape}")
    if lk != lv:
        raise ValueError(f"k and v sequence lengths differ: k {k.shape}, v {v.shape}")
    if hk != hv:
        raise ValueError(f"k and v head counts differ: k {k.shape}, v {v.shape}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    for name, size in (("q/k head dim", d), ("v head dim", dv)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in 1..{MAX_HEAD_DIM}, got {size}")
    mode = causal_mode(causal)
    scale = check_scale(scale, d)
    lead_size = math.prod(lead)
    return Problem(xp, dtype, lead, _as_4d(q, xp, lead_size), _as_4d(k, xp, lead_size),
                   _as_4d(v, xp, lead_size), mode, scale, tuple(q.shape))


def check_backward_inputs(p: Problem, dout, out, lse):
    """Validate dout, out, lse against a checked forward problem.

    Returns (dout, out) as 4-D views and lse as a (B, Hq, Lq) array in the
    accumulator dtype (float32; float64 for float64 inputs), a view where possible.
    """
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if array_module(x) is not p.xp:
            raise TypeError(f"{name} is a {array_module(x).__name__} array but q is a "
                            f"{p.xp.__name__} array")
        if p.xp is not np and x.device.id != p.q.device.id:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {p.q.device.id}")
    for name, x in (("dout", dout), ("out", out)):
        if np.dtype(x.dtype) != np.dtype(p.q.dtype):
            raise TypeError(f"{name} must have q's dtype {p.q.dtype}, got {x.dtype}")
        if tuple(x.shape) != p.out_shape():
            raise ValueError(f"{name} must have shape {p.out_shape()} (q's with the last dim Dv), "
                             f"got {tuple(x.shape)}")
    if tuple(lse.shape) != p.lse_shape():
        raise ValueError(f"lse must have shape {p.lse_shape()}, got {tuple(lse.shape)}")
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"lse must be a float array, got {lse.dtype}")
    acc = np.float64 if p.dtype == "float64" else np.float32
    lse4 = lse.astype(acc, copy=False).reshape(p.batch, p.heads_q, p.lq)
    return _as_4d(dout, p.xp, p.batch), _as_4d(out, p.xp, p.batch), lse4
