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
from typing import Any, Dict, Tuple

import numpy as np

from ..semantics import LOG2E

_VIEW = np.dtype([("ptr", np.uint64), ("batch_stride", np.int64), ("head_stride", np.int64),
                  ("row_stride", np.int64)], align=True)
_DIMS = np.dtype([(name, np.int32) for name in ("batch", "heads_q", "group", "lq", "lk", "d", "dv")], align=True)
_SCORE = np.dtype([("ptr", np.uint64), ("batch_stride", np.int64), ("head_stride", np.int64),
                   ("row_stride", np.int64), ("col_stride", np.int64)], align=True)
_STRIDED4 = np.dtype([("ptr", np.uint64), ("strides", np.int64, (4,))], align=True)
_MASK = np.dtype([("band_lo", np.int32), ("band_hi", np.int32), ("block_q", np.int32), ("block_k", np.int32),
                  ("block_q_mul", np.uint32), ("block_k_mul", np.uint32), ("block_q_shift", np.int32),
                  ("block_k_shift", np.int32),
                  ("bias", _SCORE), ("mask", _SCORE), ("layout", _SCORE), ("layout_rows", _SCORE),
                  ("layout_cols", _SCORE), ("drop_threshold", np.uint32),
                  ("seed_lo", np.uint32), ("seed_hi", np.uint32), ("drop_row0", np.int32), ("drop_col0", np.int32),
                  ("keep_scale", np.float64),
                  ("key_lengths", np.uint64), ("page_table", np.uint64), ("page_size", np.int32),
                  ("pages_per_seq", np.int32), ("num_pages", np.int32), ("packed_blocks", np.uint64),
                  ("band_from_end", np.int32), ("packed_count", np.int32), ("band_period", np.int32),
                  ("mod_args", np.uint64, (16,))],
                 align=True)
_DBIAS = np.dtype([("acc", _SCORE), ("order", np.uint64), ("mode", np.int32), ("rows_broadcast", np.int32),
                   ("tiles_b", np.int32), ("tiles_h", np.int32), ("tiles_i", np.int32), ("splits", np.int32),
                   ("split_stride", np.int64)], align=True)

STRUCTS: Dict[str, np.dtype] = {
    "View": _VIEW,
    "AttnDims": _DIMS,
    "ScoreTensor": _SCORE,
    "MaskParams": _MASK,
    "DbiasParams": _DBIAS,
    "MaskStatesParams": np.dtype([("states", np.uint64), ("args", np.uint64, (16,)), ("first", np.int64)]
                                 + [(n, np.int32) for n in ("heads", "q_blocks", "k_blocks", "lq", "lk", "block_q",
                                                            "block_k")], align=True),
    "LayoutSpansParams": np.dtype([("states", np.uint64), ("rows", np.uint64), ("cols", np.uint64)]
                                  + [(n, np.int32) for n in ("pairs", "q_blocks", "k_blocks", "call_q_blocks",
                                                             "call_k_blocks")], align=True),
    "Strided4": _STRIDED4,
    "KvAppendParams": np.dtype([(n, _STRIDED4) for n in ("k_new", "v_new", "k_cache", "v_cache")]
                               + [(n, np.uint64) for n in ("lengths", "page_table", "total")]
                               + [(n, np.int32) for n in ("length", "batch", "heads", "n_new", "d", "dv", "cap",
                                                          "page_size", "pages_per_seq", "num_pages")], align=True),
    "FwdParams": np.dtype([("q", _VIEW), ("k", _VIEW), ("v", _VIEW), ("out", _VIEW), ("lse", _VIEW),
                           ("dims", _DIMS), ("mask", _MASK), ("scale_log2", np.float64),
                           ("scale_log2_f", np.float32), ("num_splits", np.int32), ("split_tiles", np.int32),
                           ("out_partial", _VIEW), ("lse_partial", _VIEW), ("block_queue", np.uint64),
                           ("split_counters", np.uint64)], align=True),
    "BwdParams": np.dtype([(n, _VIEW) for n in ("q", "k", "v", "out", "dout", "lse", "dsum", "dq_acc",
                                                  "dq", "dk", "dv")]
                          + [("dims", _DIMS), ("mask", _MASK), ("dbias", _DBIAS), ("scale", np.float64),
                             ("scale_log2", np.float64), ("scale_log2_f", np.float32)],
                          align=True),
}


_CODES = {("u", 8): "Q", ("i", 8): "q", ("i", 4): "i", ("u", 4): "I", ("f", 8): "d", ("f", 4): "f"}


def _leaves(dtype: np.dtype, base: int = 0, path: tuple = ()):
    """(path of field names, byte offset, leaf dtype) of every scalar field of ``dtype``, in memory order."""
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]
        if sub.names:
            yield from _leaves(sub, base + offset, path + (name,))
        elif sub.subdtype is not None:   # a fixed-size array: one leaf an element, indexed by position
            item, shape = sub.subdtype
            for i in range(int(np.prod(shape))):
                yield path + (name, i), base + offset + i * item.itemsize, item
        else:
            yield path + (name,), base + offset, sub


class Packer:
    """Writes one struct of :data:`STRUCTS` from its values given by field name.

    ``pack(values)`` takes a dict with one entry per field; a field that is a struct takes a dict
    of its own fields (``{"q": {"ptr": ..., "batch_stride": ...}, ...}``). A missing or unknown name
    raises KeyError: nothing is placed by position, so two fields of one type cannot trade places.
    The leaf order and padding come from the NumPy description, which ``layout_check_source``
    checks against the CUDA header.
    """

    def __init__(self, name: str):
        self.name = name
        dtype = STRUCTS[name]
        self.leaves = tuple(_leaves(dtype))
        fmt, pos = "=", 0
        for _, offset, leaf in self.leaves:
            if offset > pos:
                fmt += f"{offset - pos}x"
            fmt += _CODES[(leaf.kind, leaf.itemsize)]
            pos = offset + leaf.itemsize
        fmt += f"{dtype.itemsize - pos}x" if dtype.itemsize > pos else ""
        self.struct = struct.Struct(fmt)
        assert self.struct.size == dtype.itemsize, (fmt, dtype)
        self.fields = {".".join(str(part) for part in path): offset for path, offset, _ in self.leaves}
        # One generated function reads every leaf by its path: ~3 us a struct, where walking the
        # description per call cost ten times that on every launch's host path.
        reads = ", ".join("v" + "".join(f"[{name!r}]" for name in path) for path, _, _ in self.leaves)
        self._getter = eval(f"lambda v: ({reads},)")   # noqa: S307 (field names of STRUCTS only)

    def flatten(self, values: dict) -> tuple:
        """The leaf values of ``values`` in memory order (KeyError naming a missing field)."""
        try:
            return self._getter(values)
        except KeyError as exc:
            raise KeyError(f"{self.name}: field {exc.args[0]!r} not given") from None

    def pack(self, values: dict) -> "HostArg":
        return HostArg(self.struct.pack(*self.flatten(values)))

    def offset(self, path: str) -> int:
        """Byte offset of the leaf ``path`` ("q.ptr", "mask.bias.ptr", "block_queue")."""
        return self.fields[path]


PACKERS = {name: Packer(name) for name in ("FwdParams", "BwdParams", "MaskStatesParams", "LayoutSpansParams",
                                           "KvAppendParams")}
_ADDRESS = struct.Struct("=Q")
_INT32 = struct.Struct("=i")


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

    def put_int32(self, offsets: tuple, values: tuple) -> None:
        """Write 32-bit ``values`` at byte ``offsets`` (counts known at the launch: a packed grid's blocks)."""
        for offset, value in zip(offsets, values):
            _INT32.pack_into(self._buffer, self._skip + offset, value)

    @property
    def data(self) -> memoryview:
        return memoryview(self._buffer)[self._skip:self._skip + self.nbytes]


VIEW_FIELDS = ("ptr", "batch_stride", "head_stride", "row_stride")
SCORE_FIELDS = ("ptr", "batch_stride", "head_stride", "row_stride", "col_stride")
NO_VIEW = dict.fromkeys(VIEW_FIELDS, 0)
NO_SCORE = dict.fromkeys(SCORE_FIELDS, 0)


def view(x: Any) -> dict:
    """A ``View`` of a CuPy array seen as (batch, head, row[, col]): its address and strides.

    ``x`` is 4-D ``(B, H, L, D)`` with a unit-stride last axis, or 3-D ``(B, H, L)``
    (a per-row vector such as lse); None gives the null view. Strides are in elements;
    a broadcast axis has stride 0.
    """
    if x is None:
        return NO_VIEW
    ndim, strides, size = x.ndim, x.strides, x.itemsize
    if ndim not in (3, 4):
        raise ValueError(f"a kernel view needs a 3-D or 4-D array, got shape {x.shape}")
    if ndim == 4 and strides[3] != size and x.shape[3] > 1:
        raise ValueError("a kernel view needs a unit-stride last axis")
    return {"ptr": x.data.ptr, "batch_stride": strides[0] // size, "head_stride": strides[1] // size,
            "row_stride": strides[2] // size}


def fast_divisor(d: int) -> Tuple[int, int]:
    """(mul, shift) with ``x // d == (x * mul >> 32) >> shift`` for every 0 <= x < 2**31 (the kernels'
    ``fast_div``): mul = ceil(2**(31 + l) / d) < 2**32 and shift = l - 1 for l = ceil(log2 d) (Granlund and
    Montgomery's round-up multiplier for 31-bit numerators). d >= 2; (0, 0) for d = 1, which no layout has."""
    if not isinstance(d, (int, np.integer)) or d < 1 or d >= 2**31:
        raise ValueError(f"fast_divisor: a divisor in [1, 2**31), got {d!r}")
    if d == 1:
        return 0, 0
    l = (int(d) - 1).bit_length()
    return -(-(1 << (31 + l)) // int(d)), l - 1


def block_divisors(block: Tuple[int, int]) -> dict:
    """MaskParams' fast_div fields of a layout's block size (block_q, block_k)."""
    (qm, qs), (km, ks) = fast_divisor(block[0]), fast_divisor(block[1])
    return {"block_q_mul": qm, "block_q_shift": qs, "block_k_mul": km, "block_k_shift": ks}


MASK_OFF = {"band_lo": 0, "band_hi": 0, "block_q": 1, "block_k": 1, **block_divisors((1, 1)), "bias": NO_SCORE,
            "mask": NO_SCORE,
            "layout": NO_SCORE, "layout_rows": NO_SCORE, "layout_cols": NO_SCORE, "drop_threshold": 0, "seed_lo": 0,
            "seed_hi": 0, "drop_row0": 0, "drop_col0": 0,
            "keep_scale": 1.0, "key_lengths": 0,
            "page_table": 0, "page_size": 1, "pages_per_seq": 0, "num_pages": 0, "packed_blocks": 0,
            "band_from_end": 0, "packed_count": 0, "band_period": 0, "mod_args": [0] * 16}
"""MaskParams with every piece off (kernels compiled without BAND / EXTRA ignore it)."""
DBIAS_OFF = {"acc": NO_SCORE, "order": 0, "mode": 0, "rows_broadcast": 0, "tiles_b": 1, "tiles_h": 1,
             "tiles_i": 1, "splits": 1, "split_stride": 0}
"""DbiasParams with no bias gradient."""


_FLOAT32 = struct.Struct("f")


def as_float32(x: float) -> float:
    """``x`` rounded to float32, the kernels' float copy of a scale (beyond float32's
    range: +-inf, what converting in the kernel gave)."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(x))[0]
    except OverflowError:   # struct refuses what rounds past float32's largest finite value
        return math.copysign(math.inf, x)


def _dims(q, k, v, group: int) -> dict:
    b, hq, lq, d = q.shape
    return {"batch": b, "heads_q": hq, "group": group, "lq": lq, "lk": k.shape[2], "d": d, "dv": v.shape[3]}


def fwd_params(q, k, v, out, lse, *, group: int, scale: float, mask: dict = MASK_OFF,
               block_queue: int = 0, num_splits: int = 1, split_tiles: int = 0, out_partial=None,
               lse_partial=None) -> HostArg:
    """FwdParams for 4-D views ``q (B, Hq, Lq, D)``, ``k``, ``v``, ``out`` and ``lse (B, Hq, Lq)``
    and MaskParams ``mask`` (cuflash._dispatch.masking), as ``sizeof(FwdParams)`` bytes.
    ``block_queue``: the address of a zeroed int32 a persistent Hopper grid takes its blocks from
    (0: none). Split-KV: ``num_splits`` partial results of ``split_tiles`` key tiles each, into
    ``out_partial (S * B, Hq, Lq, Dv')`` and ``lse_partial (S * B, Hq, Lq)``; the decoding kernel's
    ``split_counters`` are written at run time (cuflash._dispatch.plan)."""
    return PACKERS["FwdParams"].pack({
        "q": view(q), "k": view(k), "v": view(v), "out": view(out), "lse": view(lse),
        "dims": _dims(q, k, v, group), "mask": mask, "scale_log2": scale * LOG2E,
        "scale_log2_f": as_float32(scale * LOG2E), "num_splits": num_splits, "split_tiles": split_tiles,
        "out_partial": view(out_partial), "lse_partial": view(lse_partial), "block_queue": block_queue,
        "split_counters": 0})


def bwd_params(q, k, v, out, dout, lse, dsum, dq_acc, dq, dk, dv, *, group: int, scale: float,
               mask: dict = MASK_OFF, dbias: dict = DBIAS_OFF) -> HostArg:
    """BwdParams for 4-D views (vectors lse, dsum 3-D). ``dq_acc`` may be None (deterministic path)."""
    return PACKERS["BwdParams"].pack({
        "q": view(q), "k": view(k), "v": view(v), "out": view(out), "dout": view(dout), "lse": view(lse),
        "dsum": view(dsum), "dq_acc": view(dq_acc), "dq": view(dq), "dk": view(dk), "dv": view(dv),
        "dims": _dims(q, k, v, group), "mask": mask, "dbias": dbias, "scale": scale,
        "scale_log2": scale * LOG2E, "scale_log2_f": as_float32(scale * LOG2E)})


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
