"""Tensor maps for Hopper's bulk tensor copy engine (TMA), encoded on the host through the
driver's ``cuTensorMapEncodeTiled`` (ctypes on libcuda; CuPy does not wrap it).

A map describes one (B, H, L, D) array as a 4-D tensor (D, L, H, B), innermost first, with a
box of one 128-byte swizzle slab (64 16-bit or 32 fp32 columns, kernels_cu/wgmma.cuh) by
``box_rows`` rows, 128-byte swizzled in shared memory. Loads (Q, K, V, dO) fill what lies
outside the array (rows past L, columns past D) with zeros; stores (the forward's O) and
reductions (the backward's fp32 dQ accumulator) leave it alone. A kernel takes its maps as one
``__grid_constant__`` parameter (``FwdTensorMaps`` in kernels_cu/flash_fwd_wgmma.cu,
``BwdTensorMaps`` in kernels_cu/flash_bwd_wgmma.cu).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

MAP_BYTES = 128              # sizeof(CUtensorMap)
_UINT16 = 1                  # CU_TENSOR_MAP_DATA_TYPE_UINT16: the copy engine moves bits
_FLOAT32 = 7                 # CU_TENSOR_MAP_DATA_TYPE_FLOAT32: what a reduction adds (the backward's dQ)
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZEROS = 0          # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
_SLAB_BYTES = 128            # one swizzle slab: 64 16-bit or 32 fp32 columns


@functools.lru_cache(maxsize=None)
def _encode_fn():
    """The driver's encoder, or None where libcuda has none (the forward then takes the portable
    kernel)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def _byte_strides(x) -> list:
    """Byte strides of axes L, H, B (innermost first); a length-1 axis, whose stride the copy
    engine never uses, gets the contiguous one so that any view passes the encoder's checks."""
    natural = x.shape[3] * x.itemsize
    out = []
    for axis in (2, 1, 0):
        out.append(x.strides[axis] if x.shape[axis] > 1 else natural)
        natural = out[-1] * x.shape[axis]
    return out


def encoder_available() -> bool:
    """Whether this process can encode tensor maps (a CUDA 12+ driver's libcuda)."""
    return _encode_fn() is not None


def usable(*arrays) -> bool:
    """Whether a Hopper kernel can run on these arrays here: the driver has the encoder and the
    copy engine can read them (:func:`tma_ok`)."""
    return encoder_available() and tma_ok(*arrays)


def tma_ok(*arrays) -> bool:
    """Whether the copy engine can read these 4-D 16-bit arrays: 16-byte aligned bases, a
    unit-stride last axis and other strides positive multiples of 16 bytes below 2**40."""
    for x in arrays:
        if x.itemsize != 2 or x.strides[3] != 2 or x.data.ptr % 16:
            return False
        if any(s <= 0 or s % 16 or s >= 2 ** 40 for s in _byte_strides(x)):
            return False
    return True


_DIMS = ctypes.c_uint64 * 4
_STRIDES = ctypes.c_uint64 * 3
_BOX = ctypes.c_uint32 * 4


def _encode(addr: int, x, box_rows: int) -> None:
    """Encode the CUtensorMap of the 4-D array ``x`` (B, H, L, D) of 16-bit elements (copied as
    bits) or float32 (added into by a reduction), box one 128-byte slab (64 or 32 columns) x
    ``box_rows``, into the 128 bytes at ``addr`` (64-byte aligned)."""
    b, h, length, d = x.shape
    dtype = _UINT16 if x.itemsize == 2 else _FLOAT32
    err = _encode_fn()(addr, dtype, 4, ctypes.c_void_p(x.data.ptr), _DIMS(d, length, h, b), _STRIDES(*_byte_strides(x)),
                       _BOX(_SLAB_BYTES // x.itemsize, box_rows, 1, 1), _BOX(1, 1, 1, 1),
                       _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZEROS)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} for an array of shape {x.shape}, "
                           f"strides {x.strides}")


@functools.lru_cache(maxsize=None)
def _opaque(nbytes: int) -> np.dtype:
    return np.dtype((np.void, nbytes))


def tensor_maps(*specs) -> np.ndarray:
    """The maps of ``(array, box_rows)`` pairs back to back (a kernel's ``...TensorMaps`` struct), as
    one opaque kernel argument: encoded straight into one 64-byte aligned buffer (this is on every
    call's path: about 12 us of Python a map)."""
    nbytes = len(specs) * MAP_BYTES
    buf = np.empty(nbytes + 64, dtype=np.uint8)
    base = buf.ctypes.data
    skip = -base % 64                                   # CUtensorMap is 64-byte aligned
    for i, (x, box_rows) in enumerate(specs):
        _encode(base + skip + i * MAP_BYTES, x, box_rows)
    return buf[skip:skip + nbytes].view(_opaque(nbytes))


def tensor_map(x, box_rows: int) -> bytes:
    """The 128-byte CUtensorMap of one array (see :func:`_encode`)."""
    return tensor_maps((x, box_rows)).tobytes()


def fwd_tensor_maps(q, k, v, out, block_m: int, block_n: int) -> np.ndarray:
    """The forward's ``FwdTensorMaps`` (Q with ``block_m``-row boxes, K and V with ``block_n``, the
    output with 64-row boxes, which the kernel writes) as one opaque kernel argument."""
    return tensor_maps((q, block_m), (k, block_n), (v, block_n), (out, 64))


def bwd_tensor_maps(q, dout, k, v, dq_acc, block_m: int, block_n: int) -> np.ndarray:
    """The Hopper backward's ``BwdTensorMaps`` (Q and dO with ``block_m``-row boxes, K and V with
    ``block_n``, the float32 dQ accumulator with 64-row boxes of 32 columns, which the kernel adds
    into) as one opaque kernel argument."""
    return tensor_maps((q, block_m), (dout, block_m), (k, block_n), (v, block_n), (dq_acc, 64))
