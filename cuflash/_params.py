"""Host-side mirror of ``kernels_cu/params.cuh``: FwdParams / BwdParams laid out as NumPy
structured dtypes, packed into host bytes (:class:`HostArg`) the kernels receive by value.

The layouts below are written once, as NumPy dtypes with C alignment; ``tests/test_params.py``
compiles :func:`layout_check_source` with NVRTC, which ``static_assert``s every field offset
and every struct size against the CUDA definitions.
"""
from __future__ import annotations

import array
import math
import struct
from typing import Any, Dict, Optional

import numpy as np

_VIEW = np.dtype([("ptr", np.uint64), ("batch_stride", np.int64), ("head_stride", np.int64),
                  ("row_stride", np.int64)], align=True)
_DIMS = np.dtype([(name, np.int32) for name in ("batch", "heads_q", "group", "lq", "lk", "d", "dv")], align=True)
_SCORE = np.dtype([("ptr", np.uint64), ("batch_stride", np.int64), ("head_stride", np.int64),
                   ("row_stride", np.int64), ("col_stride", np.int64)], align=True)
_MASK = np.dtype([("band_lo", np.int32), ("band_hi", np.int32), ("block_q", np.int32), ("block_k", np.int32),
                  ("bias", _SCORE), ("mask", _SCORE), ("layout", _SCORE), ("drop_threshold", np.uint32),
                  ("seed_lo", np.uint32), ("seed_hi", np.uint32), ("keep_scale", np.float64)], align=True)
_DBIAS = np.dtype([("acc", _SCORE), ("order", np.uint64), ("mode", np.int32), ("rows_broadcast", np.int32),
                   ("tiles_b", np.int32), ("tiles_h", np.int32), ("tiles_i", np.int32), ("splits", np.int32),
                   ("split_stride", np.int64)], align=True)

STRUCTS: Dict[str, np.dtype] = {
    "View": _VIEW,
    "AttnDims": _DIMS,
    "ScoreTensor": _SCORE,
    "MaskParams": _MASK,
    "DbiasParams": _DBIAS,
    "FwdParams": np.dtype([("q", _VIEW), ("k", _VIEW), ("v", _VIEW), ("out", _VIEW), ("lse", _VIEW),
                           ("dims", _DIMS), ("mask", _MASK), ("scale_log2", np.float64),
                           ("scale_log2_f", np.float32), ("block_queue", np.uint64)], align=True),
    "BwdParams": np.dtype([(n, _VIEW) for n in ("q", "k", "v", "out", "dout", "lse", "dsum", "dq_acc",
                                                  "dq", "dk", "dv")]
                          + [("dims", _DIMS), ("mask", _MASK), ("dbias", _DBIAS), ("scale", np.float64),
                             ("scale_log2", np.float64), ("scale_log2_f", np.float32)],
                          align=True),
}

LOG2E = float(np.log2(np.e))

_CODES = {("u", 8): "Q", ("i", 8): "q", ("i", 4): "i", ("u", 4): "I", ("f", 8): "d", ("f", 4): "f"}


def _packer(dtype: np.dtype) -> struct.Struct:
    """A struct.Struct writing ``dtype``'s leaf fields in order, with its padding.

    Packing a flat tuple this way costs ~1 us; assigning NumPy structured fields
    one by one cost ~20 us a launch, which CUDA-event timings of short calls see.
    """
    fmt, pos = "=", 0

    def walk(dt: np.dtype, base: int) -> None:
        nonlocal fmt, pos
        for name in dt.names:
            sub, offset = dt.fields[name][:2]
            if sub.names:
                walk(sub, base + offset)
                continue
            if base + offset > pos:
                fmt += f"{base + offset - pos}x"
            fmt += _CODES[(sub.kind, sub.itemsize)]
            pos = base + offset + sub.itemsize

    walk(dtype, 0)
    fmt += f"{dtype.itemsize - pos}x" if dtype.itemsize > pos else ""
    packer = struct.Struct(fmt)
    assert packer.size == dtype.itemsize, (fmt, dtype)
    return packer


_PACK = {name: _packer(STRUCTS[name]) for name in ("FwdParams", "BwdParams")}
_NO_VIEW = (0, 0, 0, 0)
_ADDRESS = struct.Struct("=Q")


class HostArg:
    """One kernel argument's bytes in host memory: the driver's launch copies them from ``address``
    (``kernelParams``). ``HostArg(raw)`` holds the bytes ``raw``; ``HostArg.zeros(nbytes, align)``
    zero bytes at an ``align``-byte aligned address (a CUtensorMap's 64: the driver's encoder
    writes it in place). ``data`` views exactly the argument's bytes
    (``np.frombuffer(arg.data, STRUCTS["FwdParams"])`` reads the fields).

    An ``array.array`` holds them because its address costs ~0.1 us to read, against ~1 us for
    a NumPy array's ``.ctypes.data``: on every launch's host path, which a short call's
    CUDA-event timing sees."""

    __slots__ = ("_buffer", "_skip", "address", "nbytes")

    def __init__(self, raw: bytes):
        self._buffer = array.array("B", raw)
        self._skip, self.nbytes = 0, len(raw)
        self.address = self._buffer.buffer_info()[0]

    @classmethod
    def zeros(cls, nbytes: int, align: int) -> "HostArg":
        arg = cls(bytes(nbytes + align))
        arg._skip, arg.nbytes = -arg.address % align, nbytes
        arg.address += arg._skip
        return arg

    def put_addresses(self, offsets: tuple, addresses: tuple) -> None:
        """Write 64-bit ``addresses`` at byte ``offsets`` of the argument (a plan's array pointers)."""
        for offset, address in zip(offsets, addresses):
            _ADDRESS.pack_into(self._buffer, self._skip + offset, address)

    @property
    def data(self) -> memoryview:
        return memoryview(self._buffer)[self._skip:self._skip + self.nbytes]


def view(x: Any) -> tuple:
    """``(ptr, batch_stride, head_stride, row_stride)`` of a CuPy array seen as (batch, head, row[, col]).

    ``x`` is 4-D ``(B, H, L, D)`` with a unit-stride last axis, or 3-D ``(B, H, L)``
    (a per-row vector such as lse). Strides are in elements; a broadcast axis has stride 0.
    """
    ndim, strides, size = x.ndim, x.strides, x.itemsize
    if ndim not in (3, 4):
        raise ValueError(f"a kernel view needs a 3-D or 4-D array, got shape {x.shape}")
    if ndim == 4 and strides[3] != size and x.shape[3] > 1:
        raise ValueError("a kernel view needs a unit-stride last axis")
    return x.data.ptr, strides[0] // size, strides[1] // size, strides[2] // size


MASK_OFF = (0, 0, 1, 1) + (0,) * 15 + (0, 0, 0, 1.0)
"""MaskParams' values with every piece off (kernels compiled without BAND / EXTRA ignore them)."""
DBIAS_OFF = (0,) * 5 + (0, 0, 0, 1, 1, 1, 1, 0)


_FLOAT32 = struct.Struct("f")


def as_float32(x: float) -> float:
    """``x`` rounded to float32, the kernels' float copy of a scale (beyond float32's
    range: +-inf, what converting in the kernel gave)."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(x))[0]
    except OverflowError:   # struct refuses what rounds past float32's largest finite value
        return math.copysign(math.inf, x)


def fwd_params(q, k, v, out, lse, *, group: int, scale: float, mask: tuple = MASK_OFF,
               block_queue: int = 0) -> HostArg:
    """FwdParams for 4-D views ``q (B, Hq, Lq, D)``, ``k``, ``v``, ``out`` and ``lse (B, Hq, Lq)``
    and MaskParams' values ``mask`` (cuflash._masking), as ``sizeof(FwdParams)`` bytes.
    ``block_queue``: the address of a zeroed int32 a persistent Hopper grid takes its blocks from
    (0: none)."""
    b, hq, lq, d = q.shape
    values = (*view(q), *view(k), *view(v), *view(out), *view(lse),
              b, hq, group, lq, k.shape[2], d, v.shape[3], *mask, scale * LOG2E, as_float32(scale * LOG2E),
              block_queue)
    return HostArg(_PACK["FwdParams"].pack(*values))


def bwd_params(q, k, v, out, dout, lse, dsum, dq_acc, dq, dk, dv, *, group: int, scale: float,
               mask: tuple = MASK_OFF, dbias: tuple = DBIAS_OFF) -> HostArg:
    """BwdParams for 4-D views (vectors lse, dsum 3-D). ``dq_acc`` may be None (deterministic path)."""
    b, hq, lq, d = q.shape
    values = []
    for x in (q, k, v, out, dout, lse, dsum, dq_acc, dq, dk, dv):
        values += view(x) if x is not None else _NO_VIEW
    values += (b, hq, group, lq, k.shape[2], d, v.shape[3], *mask, *dbias, scale, scale * LOG2E,
               as_float32(scale * LOG2E))
    return HostArg(_PACK["BwdParams"].pack(*values))


def layout_check_source() -> str:
    """CUDA source that static_asserts every struct's size and field offsets as
    NumPy lays them out here. Compiles (NVRTC, no GPU needed) iff the two agree."""
    # NVRTC has no offsetof (no <cstddef>, no __builtin_offsetof); its EDG front end's
    # __INTADDR__ turns the classic null-pointer member address into a constant expression.
    lines = ['#include "params.cuh"', "#define OFFSET_OF(S, m) __INTADDR__(&((S*)0)->m)"]
    for cname, dtype in STRUCTS.items():
        lines.append(f'static_assert(sizeof({cname}) == {dtype.itemsize}, "sizeof({cname})");')
        for name in dtype.names:
            offset = dtype.fields[name][1]
            lines.append(f'static_assert(OFFSET_OF({cname}, {name}) == {offset}, "offset of {cname}::{name}");')
    lines.append("__global__ void layout_check() {}")
    return "\n".join(lines) + "\n"
