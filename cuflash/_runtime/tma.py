"""Tensor maps for Hopper's bulk tensor copy engine (TMA), encoded on the host through the
driver's ``cuTensorMapEncodeTiled`` (ctypes on libcuda; CuPy does not wrap it).

A map describes one (B, H, L, D) array as a 4-D tensor (D, L, H, B), innermost first, with a
box of one 128-byte swizzle slab (64 16-bit or 32 fp32 columns, kernels_cu/wgmma.cuh) by
``box_rows`` rows, 128-byte swizzled in shared memory. Loads (Q, K, V, dO) fill what lies
outside the array (rows past L, columns past D) with zeros; stores (the forward's O) and
reductions (the backward's fp32 dQ accumulator) leave it alone. A kernel takes its maps as one
``__grid_constant__`` parameter (``FwdTensorMaps`` in kernels_cu/tma.cuh, for the 16-bit
flash_fwd_wgmma.cu and the float32 flash_fwd_wgmma_tf32.cu, whose float32 maps have 32-column boxes;
``BwdTensorMaps`` in kernels_cu/flash_bwd_wgmma.cu).
"""
from __future__ import annotations

import array
import ctypes
import functools

from .params import HostArg

MAP_BYTES = 128              # sizeof(CUtensorMap)
_UINT16 = 1                  # CU_TENSOR_MAP_DATA_TYPE_UINT16: the copy engine moves bits
_FLOAT32 = 7                 # CU_TENSOR_MAP_DATA_TYPE_FLOAT32: what a reduction adds (the backward's dQ)
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZEROS = 0          # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
_SLAB_BYTES = 128            # one swizzle slab: 64 16-bit or 32 fp32 columns


_VOID, _INT, _UINT32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32


@functools.lru_cache(maxsize=None)
def _encode_fn():
    """The driver's encoder, or None where libcuda has none (the forward then takes the portable
    kernel). Its array arguments are passed as addresses (into one ``array.array`` a call,
    :func:`tensor_maps`): building ctypes arrays per map cost more than the encoding."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    # map, data type, rank, base, dims, byte strides, box, element strides, interleave, swizzle,
    # L2 promotion, out-of-bounds fill
    fn.argtypes = [_VOID, _INT, _UINT32, _VOID, _VOID, _VOID, _VOID, _VOID, _INT, _INT, _INT, _INT]
    return fn


@functools.lru_cache(maxsize=None)
def _replace_fn():
    """The driver's ``cuTensorMapReplaceAddress``, or None where libcuda has none."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapReplaceAddress
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [_VOID, _VOID]
    return fn


def can_encode() -> bool:
    """Whether the driver can encode tensor maps (:func:`tensor_maps`)."""
    return _encode_fn() is not None


def can_readdress() -> bool:
    """Whether the driver can replace a map's address (:func:`readdressed`)."""
    return _replace_fn() is not None


def readdressed(encoded: bytes, arrays) -> "HostArg | None":
    """Maps encoded before (``encoded``: :func:`tensor_maps`' bytes for arrays of the same layouts,
    boxes and dtypes) pointed at ``arrays`` instead, one per map (None: a map left as it is, e.g. the
    zeros of one the kernel does not read); None where the driver cannot replace an address. The
    driver's replacement costs ~0.4 us a map on an H100 host, its encoding ~1.8 us plus the Python
    that gathers the encoder's arguments (a forward or backward plan's maps, cuflash._dispatch.plan)."""
    replace = _replace_fn()
    if replace is None:
        return None
    maps = HostArg.zeros(len(encoded), 64)
    maps.data[:] = encoded
    at = maps.address
    for x in arrays:
        if x is not None:
            err = replace(at, x.data.ptr)
            if err:
                raise RuntimeError(f"cuTensorMapReplaceAddress failed with CUresult {err} for an array of shape "
                                   f"{x.shape}")
        at += MAP_BYTES
    return maps


def _byte_strides(x) -> tuple:
    """Byte strides of axes L, H, B (innermost first); a length-1 axis, whose stride the copy
    engine never uses, gets the contiguous one so that any view passes the encoder's checks."""
    b, h, length, d = x.shape
    sb, sh, sl = x.strides[:3]
    if length == 1:
        sl = d * x.itemsize
    if h == 1:
        sh = sl * length
    if b == 1:
        sb = sh * h
    return sl, sh, sb


def _strides_if_ok(x):
    """:func:`_byte_strides` of ``x`` where the copy engine can address it (a 16-byte aligned base,
    a unit-stride last axis, other strides positive multiples of 16 bytes below 2**40), else None."""
    if x.strides[3] != x.itemsize or x.data.ptr % 16:
        return None
    strides = _byte_strides(x)
    for s in strides:
        if s <= 0 or s % 16 or s >= 1 << 40:
            return None
    return strides


def tma_ok(*arrays) -> bool:
    """Whether the copy engine can read these 4-D 16-bit or float32 arrays: the rule :func:`tensor_maps`
    applies (:func:`_strides_if_ok`), for the tests."""
    return all(x.itemsize in (2, 4) and _strides_if_ok(x) is not None for x in arrays)


_WORDS = 12   # 64-bit words of one map's encoder arguments: dims 4, strides 3 + 1, box 2, element strides 2
_NO_WORDS = (0,) * _WORDS
_ONES = 1 | 1 << 32   # two uint32 ones: the box's H and B extents, and every element stride


def tensor_maps(*specs) -> "HostArg | None":
    """The maps of ``(array, box_rows)`` pairs back to back (a kernel's ``...TensorMaps`` struct), as
    one kernel argument (:class:`cuflash._runtime.params.HostArg`), encoded straight into its 64-byte
    aligned bytes; None where the driver has no encoder or an array's layout is one the copy
    engine cannot address (:func:`_strides_if_ok`: the caller then takes the portable kernels); a
    ``None`` array leaves its map as zeros (one the kernel does not read). Each map describes its
    4-D array (B, H, L, D) of 16-bit elements (copied as bits) or float32 (added into by a
    reduction) as (D, L, H, B), with a box of one 128-byte slab (64 or 32 columns) x ``box_rows``.
    This is on every call's path: the encoder's arguments for all maps go into one ``array.array``
    (about 3 us a map on an H100 host, against 7 us with ctypes arrays)."""
    encode = _encode_fn()
    if encode is None:
        return None
    words = []
    for x, box_rows in specs:
        if x is None:   # a map the kernel does not read: left as zeros
            words += _NO_WORDS
            continue
        strides = _strides_if_ok(x)
        if strides is None:
            return None
        b, h, length, d = x.shape
        # box (columns, rows, 1, 1) and element strides (1, 1, 1, 1) as uint32 pairs, little-endian
        words += (d, length, h, b, *strides, 0, _SLAB_BYTES // x.itemsize | box_rows << 32, _ONES, _ONES, _ONES)
    args = array.array("Q", words)
    a = args.buffer_info()[0]
    maps = HostArg.zeros(len(specs) * MAP_BYTES, 64)   # CUtensorMap is 64-byte aligned
    at = maps.address
    for x, _ in specs:
        if x is not None:
            err = encode(at, _UINT16 if x.itemsize == 2 else _FLOAT32, 4, x.data.ptr, a, a + 32, a + 64, a + 80,
                         _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZEROS)
            if err:
                raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} for an array of shape "
                                   f"{x.shape}, strides {x.strides}")
        a += 8 * _WORDS
        at += MAP_BYTES
    return maps


def fwd_map_specs(block_m: int, block_n: int, store_out: bool = True) -> tuple:
    """The forward's ``FwdTensorMaps`` in order, as (array name, box rows): Q with ``block_m``-row boxes,
    K and V with ``block_n``, the output with 64-row boxes, which the kernel writes (name None where
    ``store_out`` is False: its map left as zeros, for a kernel that stores O element by element)."""
    return ("q", block_m), ("k", block_n), ("v", block_n), ("out" if store_out else None, 64)


def bwd_map_specs(block_m: int, block_n: int) -> tuple:
    """The Hopper backward's ``BwdTensorMaps`` in order, as (array name, box rows): Q and dO with
    ``block_m``-row boxes, K and V with ``block_n``, the float32 dQ accumulator (its ``[..., :d]`` view)
    with 64-row boxes of 32 columns, which the kernel adds into."""
    return ("q", block_m), ("dout", block_m), ("k", block_n), ("v", block_n), ("dq_acc", 64)


def maps_of(specs: tuple, arrays: dict) -> "HostArg | None":
    """:func:`tensor_maps` of ``specs`` (:func:`fwd_map_specs`, :func:`bwd_map_specs`) for the named arrays."""
    return tensor_maps(*((None if name is None else arrays[name], rows) for name, rows in specs))


def fwd_tensor_maps(q, k, v, out, block_m: int, block_n: int, store_out: bool = True) -> "HostArg | None":
    """The forward's ``FwdTensorMaps`` (:func:`fwd_map_specs`) as one kernel argument, or None
    (:func:`tensor_maps`)."""
    return maps_of(fwd_map_specs(block_m, block_n, store_out), {"q": q, "k": k, "v": v, "out": out})


def bwd_tensor_maps(q, dout, k, v, dq_acc, block_m: int, block_n: int) -> "HostArg | None":
    """The Hopper backward's ``BwdTensorMaps`` (:func:`bwd_map_specs`) as one kernel argument, or None
    (:func:`tensor_maps`)."""
    return maps_of(bwd_map_specs(block_m, block_n), {"q": q, "dout": dout, "k": k, "v": v, "dq_acc": dq_acc})
