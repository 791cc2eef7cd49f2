"""Host-side mirror of ``kernels_cu/params.cuh``: FwdParams / BwdParams as NumPy structured
scalars, passed to the kernels by value.

The layouts below are written once, as NumPy dtypes with C alignment; ``tests/test_params.py``
compiles :func:`layout_check_source` with NVRTC, which ``static_assert``s every field offset
and every struct size against the CUDA definitions.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

_VIEW = np.dtype([("ptr", np.uint64), ("batch_stride", np.int64), ("head_stride", np.int64),
                  ("row_stride", np.int64)], align=True)
_DIMS = np.dtype([(name, np.int32) for name in ("batch", "heads_q", "group", "lq", "lk", "d", "dv")], align=True)
_MASK = np.dtype([("causal_offset", np.int32)], align=True)

STRUCTS: Dict[str, np.dtype] = {
    "View": _VIEW,
    "AttnDims": _DIMS,
    "MaskParams": _MASK,
    "FwdParams": np.dtype([("q", _VIEW), ("k", _VIEW), ("v", _VIEW), ("out", _VIEW), ("lse", _VIEW),
                           ("dims", _DIMS), ("mask", _MASK), ("scale_log2", np.float64)], align=True),
    "BwdParams": np.dtype([(n, _VIEW) for n in ("q", "k", "v", "out", "dout", "lse", "dsum", "dq_acc",
                                                  "dq", "dk", "dv")]
                          + [("dims", _DIMS), ("mask", _MASK), ("scale", np.float64), ("scale_log2", np.float64)],
                          align=True),
}

LOG2E = float(np.log2(np.e))


def view(x: Any) -> tuple:
    """``(ptr, batch_stride, head_stride, row_stride)`` of a CuPy array seen as (batch, head, row[, col]).

    ``x`` is 4-D ``(B, H, L, D)`` with a unit-stride last axis, or 3-D ``(B, H, L)``
    (a per-row vector such as lse). Strides are in elements; a broadcast axis has stride 0.
    """
    if x.ndim not in (3, 4):
        raise ValueError(f"a kernel view needs a 3-D or 4-D array, got shape {x.shape}")
    if x.ndim == 4 and x.shape[3] > 1 and x.strides[3] != x.itemsize:
        raise ValueError("a kernel view needs a unit-stride last axis")
    return (x.data.ptr,) + tuple(s // x.itemsize for s in x.strides[:3])


def _dims(batch: int, heads_q: int, group: int, lq: int, lk: int, d: int, dv: int) -> tuple:
    return (batch, heads_q, group, lq, lk, d, dv)


def fwd_params(q, k, v, out, lse, *, group: int, scale: float, causal_offset: Optional[int]) -> np.ndarray:
    """FwdParams for 4-D views ``q (B, Hq, Lq, D)``, ``k``, ``v``, ``out`` and ``lse (B, Hq, Lq)``."""
    p = np.zeros(1, dtype=STRUCTS["FwdParams"])
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        p[name] = view(x)
    b, hq, lq, d = q.shape
    p["dims"] = _dims(b, hq, group, lq, k.shape[2], d, v.shape[3])
    p["mask"] = (causal_offset or 0,)
    p["scale_log2"] = scale * LOG2E
    return p


def bwd_params(q, k, v, out, dout, lse, dsum, dq_acc, dq, dk, dv, *, group: int, scale: float,
               causal_offset: Optional[int]) -> np.ndarray:
    """BwdParams for 4-D views (vectors lse, dsum 3-D). ``dq_acc`` may be None (deterministic path)."""
    p = np.zeros(1, dtype=STRUCTS["BwdParams"])
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse), ("dsum", dsum),
                    ("dq_acc", dq_acc), ("dq", dq), ("dk", dk), ("dv", dv)):
        if x is not None:
            p[name] = view(x)
    b, hq, lq, d = q.shape
    p["dims"] = _dims(b, hq, group, lq, k.shape[2], d, v.shape[3])
    p["mask"] = (causal_offset or 0,)
    p["scale"] = scale
    p["scale_log2"] = scale * LOG2E
    return p


def layout_check_source() -> str:
    """CUDA source that static_asserts every struct's size and field offsets as
    NumPy lays them out here. Compiles (NVRTC, no GPU needed) iff the two agree."""
    # NVRTC has no offsetof (no <cstddef>, no __builtin_offsetof); its EDG front end's
    # __INTADDR__ turns the classic null-pointer member address into a constant expression.
    lines = ['#include "params.cuh"', "#define OFFSET_OF(S, m) __INTADDR__(&((S*)0)->m)"]
    for struct, dtype in STRUCTS.items():
        lines.append(f'static_assert(sizeof({struct}) == {dtype.itemsize}, "sizeof({struct})");')
        for name in dtype.names:
            offset = dtype.fields[name][1]
            lines.append(f'static_assert(OFFSET_OF({struct}, {name}) == {offset}, "offset of {struct}::{name}");')
    lines.append("__global__ void layout_check() {}")
    return "\n".join(lines) + "\n"
