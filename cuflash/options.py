"""Validation: every bad call ends here with a clear TypeError / ValueError, before anything
reaches a kernel. A call becomes a :class:`Problem` (q, k, v as 4-D arrays, the causal mode and the
scale) and its :class:`Options` (the masking options)."""
from __future__ import annotations

import functools
import math
import numbers
import secrets
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from .block_sparse import BlockLayout
from .mods import Mods, resolve as resolve_mods
from .semantics import acc_dtype

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


def check_precision(precision) -> None:
    """``precision`` is "highest" or "tf32" (it matters for float32 only)."""
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
    def d(self) -> int:
        return self.q.shape[3]

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


def check_qkv(q, k, v, *, causal=False, scale=None, shapes=None) -> Problem:
    """Validate q, k, v and the options shared by every entry point. ``shapes``: the (q, k, v) shapes the
    messages name, where the caller passed other arrays than these views (cuflash.varlen's packed ones)."""
    xp = array_module(q)
    shown_q, shown_k, shown_v = shapes or (q.shape, k.shape, v.shape)
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
                         f"{shown_q}, {shown_k}, {shown_v}")
    if q.ndim >= 3:
        lead = tuple(q.shape[:-3])
        if k.shape[:-3] != lead or v.shape[:-3] != lead:
            raise ValueError(f"leading dims must be equal: q {shown_q}, k {shown_k}, v {shown_v}")
        hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    else:
        lead, hq, hk, hv = (), 1, 1, 1
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    lk, lv = k.shape[-2], v.shape[-2]
    if d != dk:
        raise ValueError(f"q and k head dims differ: q {shown_q}, k {shown_k}")
    if lk != lv:
        raise ValueError(f"k and v sequence lengths differ: k {shown_k}, v {shown_v}")
    if hk != hv:
        raise ValueError(f"k and v head counts differ: k {shown_k}, v {shown_v}")
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


def own_4d(x, p: Problem):
    """``x`` (broadcastable to the scores) as a 4-D (B', H', Lq', Lk') array of its own sizes:
    B' is 1 when every leading dim broadcasts, else B (then broadcast over the leading dims,
    a copy only if they cannot be merged into one stride)."""
    xp = p.xp
    nd = len(p.lead) + 3
    x = x.reshape((1,) * (nd - x.ndim) + tuple(x.shape))
    own_lead = x.shape[:len(p.lead)]
    if all(n == 1 for n in own_lead):
        return x.reshape((1,) + x.shape[len(p.lead):])
    x = xp.broadcast_to(x, p.lead + x.shape[len(p.lead):])
    return x.reshape((p.batch,) + x.shape[len(p.lead):])


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
    lse4 = lse.astype(acc_dtype(p.dtype), copy=False)
    if lse4.shape != (p.batch, p.heads_q, p.lq):   # (the array itself where it has that shape already)
        lse4 = lse4.reshape(p.batch, p.heads_q, p.lq)
    return _as_4d(dout, p.xp, p.batch), _as_4d(out, p.xp, p.batch), lse4


# --------------------------------------------------------------------------- masking options

@dataclass
class Options:
    """The masking options of one call, validated against its Problem."""

    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    bias: Any = None              # as given (for the NumPy path and dbias's shape)
    mask: Any = None
    dropout_p: float = 0.0
    seed: Optional[int] = None
    block_layout: Optional[BlockLayout] = None
    mods: Optional[Mods] = None   # score and mask modifications (cuflash.mods)
    dropout_origin: Tuple[int, int] = (0, 0)   # the mask's (query, key) of the call's (0, 0)

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def extra(self) -> bool:
        """Whether the kernels need their EXTRA pieces (score_mod.cuh): score modifications alone run on the
        plain kernels (their hooks work on raw scores too), mask modifications need the per-element test."""
        return (self.bias is not None or self.mask is not None or self.block_layout is not None or self.dropout
                or (self.mods is not None and bool(self.mods.mask)))

    def reference_kwargs(self) -> dict:
        return dict(bias=self.bias, mask=self.mask, window=self.window, dropout_p=self.dropout_p, seed=self.seed,
                    dropout_origin=(0,) + self.dropout_origin, block_layout=self.block_layout,
                    score_mod=self.mods.score if self.mods else None,
                    mask_mod=self.mods.mask if self.mods else None)


def _score_shape(p: Problem) -> tuple:
    return p.lead + (p.heads_q, p.lq, p.lk)


def _broadcastable(x, shape: tuple, name: str) -> None:
    try:
        ok = np.broadcast_shapes(tuple(x.shape), shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to {shape} "
                         "(..., Hq, Lq, Lk) or, for a block layout, (..., Hq, query blocks, key blocks)")


def _same_place(x, p: Problem, name: str):
    if array_module(x) is not p.xp:
        raise TypeError(f"{name} is a {array_module(x).__name__} array but q is a {p.xp.__name__} array")
    if p.xp is not np and x.device.id != p.q.device.id:
        raise ValueError(f"{name} is on device {x.device.id}, q on device {p.q.device.id}")


def check_window(window) -> Optional[Tuple[Optional[int], Optional[int]]]:
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be (left, right) with ints >= 0 or None, got {window!r}") from None
    for side in (left, right):
        if side is not None and (isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < 0):
            raise ValueError(f"window must be (left, right) with ints >= 0 or None, got {window!r}")
    return (None if left is None else int(left), None if right is None else int(right))


def check_mods(p: Problem, score_mod=None, mask_mod=None) -> Optional[Mods]:
    """The call's modifications (cuflash.mods), checked against its inputs: CuPy inputs take parameter
    arrays on their device; NumPy inputs need every modification's NumPy twin."""
    mods = resolve_mods(score_mod, mask_mod)
    if mods is None:
        return None
    for m in mods.score + mods.mask:
        if p.xp is np and m.python is None:
            raise ValueError(f"{m.name}: NumPy inputs run the modification's NumPy twin; give python=...")
        for name, value in m.params.items():
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                if p.xp is not np and array_module(value) is not p.xp:
                    raise TypeError(f"{m.name}: parameter {name!r} is a {array_module(value).__name__} array "
                                    f"but q is a {p.xp.__name__} array")
                if p.xp is not np and value.device.id != p.q.device.id:
                    raise ValueError(f"{m.name}: parameter {name!r} is on device {value.device.id}, "
                                     f"q on device {p.q.device.id}")
        for name, dims in m.param_shapes.items():
            want = tuple({"B": p.batch, "Hq": p.heads_q}.get(d, d) for d in dims)
            if tuple(m.params[name].shape) != want:
                raise ValueError(f"{m.name}: {name} has shape {tuple(m.params[name].shape)}; this call needs {want} "
                                 f"({', '.join(str(d) for d in dims)})")
    for m in mods.mask:
        if m.documents is not None and (m.documents.shape[0] != p.batch or m.documents.shape[1] < max(p.lq, p.lk)):
            raise ValueError(f"{m.name}: document ids of shape {m.documents.shape} need B = {p.batch} rows of at "
                             f"least max(Lq, Lk) = {max(p.lq, p.lk)} positions")
    return mods


NO_ORIGIN = (0, 0)
"""The default ``dropout_origin``: a call draws the dropout mask from its own (0, 0)."""


def check_dropout_origin(origin, p: Problem) -> Tuple[int, int]:
    """``dropout_origin``: two ints >= 0 (query, key) with the call's extent still inside the kernels' 32-bit
    coordinates; on the GPU the key a multiple of 4 (a Philox draw covers four keys from one)."""
    try:
        parts = tuple(origin)
    except TypeError:
        parts = ()
    if len(parts) != 2 or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in parts):
        raise TypeError(f"dropout_origin must be a (query, key) pair of ints, got {origin!r}")
    parts = tuple(int(x) for x in parts)
    if min(parts) < 0:
        raise ValueError(f"dropout_origin must be non-negative, got {parts}")
    for x, extent, name in zip(parts, (p.lq, p.lk), ("query", "key")):
        if x + extent > 2**31 - 1:
            raise ValueError(f"dropout_origin's {name} {x} plus the call's {extent} passes 2**31 - 1")
    if p.xp is not np and parts[1] % 4:
        raise ValueError(f"on the GPU dropout_origin's key is a multiple of 4 (a Philox draw covers keys 4c..4c+3), "
                         f"got {parts[1]}")
    return parts


def check_options(p: Problem, *, bias=None, mask=None, window=None, dropout_p=0.0, seed=None,
                  block_layout=None, need_seed: bool = True, score_mod=None, mask_mod=None,
                  dropout_origin=NO_ORIGIN) -> Options:
    """Validate the masking options of a call (clear TypeError / ValueError, nothing launched)."""
    shape = _score_shape(p)
    if bias is not None:
        _same_place(bias, p, "bias")
        if np.dtype(bias.dtype) == np.bool_:
            raise TypeError("bias must be a float array, got bool (a bool array is a `mask`)")
        if np.dtype(bias.dtype).kind != "f" and np.dtype(bias.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"bias must be a float array, got {bias.dtype}")
        _broadcastable(bias, shape, "bias")
    if mask is not None:
        _same_place(mask, p, "mask")
        if np.dtype(mask.dtype) != np.bool_:
            raise TypeError(f"mask must be a bool array (True = attend), got {mask.dtype}; "
                            "a float array is a `bias`")
        _broadcastable(mask, shape, "mask")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be an int in [0, 2**64) or None, got {seed!r}")
    if dropout_p > 0 and seed is None and need_seed:
        raise ValueError("dropout_p > 0 needs a seed here so that attention_backward can regenerate the mask; "
                         "attention() and vjp() draw one for you")
    if block_layout is not None:
        if not isinstance(block_layout, BlockLayout):
            raise TypeError(f"block_layout must be a cuflash.BlockLayout, got {type(block_layout).__name__}")
        bq, bk = block_layout.block_size
        _broadcastable(block_layout.layout, p.lead + (p.heads_q, *block_layout.blocks(p.lq, p.lk)),
                       f"block_layout (blocks of {bq} x {bk})")
    origin = NO_ORIGIN if dropout_origin is NO_ORIGIN else check_dropout_origin(dropout_origin, p)
    return Options(check_window(window), bias, mask, dropout_p, None if seed is None else int(seed), block_layout,
                   check_mods(p, score_mod, mask_mod), origin)


def draw_seed() -> int:
    """A fresh 64-bit dropout seed."""
    return secrets.randbits(64)


# --------------------------------------------------------------------------- a whole call

NO_OPTIONS = Options()


@dataclass
class Call:
    """A validated call: its :class:`Problem`, its :class:`Options`, and its signature (None where the
    call has masking options or its 4-D views are not the arrays given): the key of the plan memo
    (cuflash._dispatch.plan), holding everything validation and the kernel choice read."""

    problem: Problem
    options: Options
    signature: Optional[tuple] = None
    backward_inputs: Optional[tuple] = None   # (dout, out, lse) as the kernels read them


_PROBLEMS: dict = {}
"""Signature -> the Problem validation made of it, without its arrays: validation is a pure function
of the signature, so a call seen before is not validated again."""
MAX_SIGNATURES = 512


def _plain(causal, scale, bias, mask, window, dropout_p, seed, block_layout, dropout_origin=NO_ORIGIN) -> bool:
    """Whether a call's options can be part of a signature: no masking option, and causal / scale of
    types a key may hold as they are (True == 1 and 1.0 == 1 as dict keys)."""
    return (bias is None and mask is None and window is None and block_layout is None and seed is None
            and type(dropout_p) is float and dropout_p == 0.0 and dropout_origin is NO_ORIGIN
            and (type(causal) is bool or type(causal) is str) and (scale is None or type(scale) is float))


def _arrays_signature(arrays) -> Optional[tuple]:
    """Type, shape, strides, dtype, device and 16-byte alignment of 4-D CuPy arrays with a unit-stride
    last axis (their own 4-D views), or None for anything else."""
    cupy = _cupy()
    if cupy is None:
        return None
    nd = cupy.ndarray
    out = []
    for x in arrays:
        if type(x) is not nd:
            return None
        shape, strides = x.shape, x.strides   # (CuPy builds these tuples anew at each access)
        if len(shape) != 4 or (strides[3] != x.itemsize and shape[3] > 1):
            return None
        data = x.data
        out.append((shape, strides, x.dtype, data.device_id, data.ptr & 15))
    return tuple(out)


def _template(p: Problem) -> Problem:
    return Problem(p.xp, p.dtype, p.lead, None, None, None, p.causal, p.scale, p.q_shape)


def _with_arrays(t: Problem, q, k, v) -> Problem:
    return Problem(t.xp, t.dtype, t.lead, q, k, v, t.causal, t.scale, t.q_shape)


def _memo(key: tuple, p: Problem) -> None:
    if len(_PROBLEMS) >= MAX_SIGNATURES:
        _PROBLEMS.clear()
    _PROBLEMS[key] = _template(p)


MAX_SPLITS = 256
"""The most key splits a forward takes (``num_splits``)."""


def check_num_splits(num_splits) -> None:
    """``num_splits``: None (chosen per call) or an int in [1, MAX_SPLITS]."""
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be None or an int, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")


def forward_call(q, k, v, *, causal=False, scale=None, bias=None, mask=None, window=None, dropout_p=0.0,
                 seed=None, block_layout=None, precision="highest", num_splits=None, score_mod=None,
                 mask_mod=None, dropout_origin=NO_ORIGIN) -> Call:
    """Validate a forward call (TypeError / ValueError before anything is launched)."""
    signature = None
    if score_mod is None and mask_mod is None and _plain(causal, scale, bias, mask, window, dropout_p, seed,
                                                         block_layout, dropout_origin) and (
            num_splits is None or type(num_splits) is int):
        arrays = _arrays_signature((q, k, v))
        if arrays is not None:
            signature = ("fwd", arrays, type(causal), causal, type(scale), scale, precision, num_splits)
            known = _PROBLEMS.get(signature)
            if known is not None:
                return Call(_with_arrays(known, q, k, v), NO_OPTIONS, signature)
    check_precision(precision)
    check_num_splits(num_splits)
    p = check_qkv(q, k, v, causal=causal, scale=scale)
    opts = check_options(p, bias=bias, mask=mask, window=window, dropout_p=dropout_p, seed=seed,
                         block_layout=block_layout, score_mod=score_mod, mask_mod=mask_mod,
                         dropout_origin=dropout_origin)
    if signature is not None:
        _memo(signature, p)
    return Call(p, opts, signature)


def backward_call(dout, q, k, v, out, lse, *, causal=False, scale=None, bias=None, mask=None, window=None,
                  dropout_p=0.0, seed=None, block_layout=None, precision="highest", score_mod=None,
                  mask_mod=None, dropout_origin=NO_ORIGIN) -> Call:
    """Validate a backward call; ``Call.backward_inputs`` holds dout and out as 4-D views and lse as
    (B, Hq, Lq) in the accumulator dtype. A scale of zero takes no signature (0.0 == -0.0 as dict
    keys, but the gradients, multiplied by it, carry its sign)."""
    signature = None
    if score_mod is None and mask_mod is None and _plain(causal, scale, bias, mask, window, dropout_p, seed,
                                                         block_layout, dropout_origin) and scale != 0.0:
        arrays = _arrays_signature((q, k, v, dout, out))
        cupy = _cupy()
        if arrays is not None and type(lse) is cupy.ndarray and lse.ndim == 3:
            ld = lse.data
            signature = ("bwd", arrays, lse.shape, lse.strides, lse.dtype, ld.device_id, ld.ptr & 15,
                         type(causal), causal, type(scale), scale, precision)
            known = _PROBLEMS.get(signature)
            if known is not None:
                return Call(_with_arrays(known, q, k, v), NO_OPTIONS, signature, (dout, out, lse))
    check_precision(precision)
    p = check_qkv(q, k, v, causal=causal, scale=scale)
    opts = check_options(p, bias=bias, mask=mask, window=window, dropout_p=dropout_p, seed=seed,
                         block_layout=block_layout, score_mod=score_mod, mask_mod=mask_mod,
                         dropout_origin=dropout_origin)
    if opts.mods is not None and not opts.mods.has_grad:
        missing = ", ".join(m.name for m in opts.mods.score if m.grad is None)
        raise ValueError(f"the backward needs each score modification's derivative: give grad=... to {missing}")
    inputs = check_backward_inputs(p, dout, out, lse)
    if signature is not None and all(a is b for a, b in zip(inputs, (dout, out, lse))):
        _memo(signature, p)
    else:
        signature = None
    return Call(p, opts, signature, inputs)
