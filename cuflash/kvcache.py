"""Attention over a KV cache with per-sequence lengths, appending the new keys and values in place.

The cache holds ``cache_seqlens[b]`` valid keys of sequence b (the rest is free room); the call writes
``k_new`` / ``v_new`` at positions ``cache_seqlens[b] ...`` of each sequence and attends the queries to
the sequence's ``cache_seqlens[b] + Lnew`` keys, causal aligned to each sequence's own end (query i of
Lq sees keys ``j <= cache_seqlens[b] + Lnew - Lq + i``), as FlashAttention's ``flash_attn_with_kvcache``.
On the GPU the split-KV kernels read each sequence's key count and align the causal band to its own
end (no mask; the query heads of a K/V head share one tile); a window without causal, a scale that is
not positive, and the NumPy path take a boolean mask over the cache instead.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import api
from ._dispatch import plan as _plan
from ._runtime import device as _device
from ._runtime import params as _params
from ._runtime import launch as _launch
from ._runtime.launch import HelperKernel
from .options import (MAX_HEAD_DIM, _arrays_signature, array_module, check_num_splits, check_scale, check_window,
                      dtype_name)

Array = Any   # numpy.ndarray or cupy.ndarray

__all__ = ["attention_with_kvcache"]


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


_STREAM_BUFFERS: dict = {}
"""(use, device, stream, thread, batch) -> an int32 buffer (batch,) that every call of that stream and thread
rewrites (an int ``cache_seqlens``'s copy, the append's key counts): written and read in stream order (the
previous call's kernels have read it before the next call writes it; a thread of its own, so that two
threads' calls on one stream never interleave on one buffer)."""


def _stream_buffer(use: str, batch: int, cupy):
    """The int32 CuPy buffer (batch,) of ``use`` for the current device, stream and thread (_STREAM_BUFFERS)."""
    key = (use, cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr, threading.get_ident(), batch)
    buffer = _STREAM_BUFFERS.get(key)
    if buffer is None:
        if len(_STREAM_BUFFERS) >= 64:
            _STREAM_BUFFERS.clear()
        buffer = _STREAM_BUFFERS[key] = cupy.empty((batch,), dtype=np.int32)
    return buffer


def _filled(value: int, batch: int, cupy):
    """An int32 CuPy array (batch,) of ``value`` on the current device: a reused buffer the driver fills,
    where ``cupy.full`` would launch an elementwise kernel (benchmarks/host_decode.py times the int-length
    call)."""
    fill = _device.memset32_fn()
    if fill is None:
        return cupy.full((batch,), value, dtype=np.int32)
    buffer = _stream_buffer("filled", batch, cupy)
    if batch and fill(buffer.data.ptr, value, batch, cupy.cuda.get_current_stream().ptr) != 0:
        return cupy.full((batch,), value, dtype=np.int32)
    return buffer


def _on_host(x) -> bool:
    """An int, None or a NumPy array: values the host reads without a transfer."""
    return x is None or _is_int(x) or isinstance(x, np.ndarray)


def _check_device(name: str, x, mod, xp, device_id: Optional[int]) -> None:
    """ValueError unless a CuPy ``x`` (of module ``mod``) is on q's device ``device_id``: the kernels read it."""
    if mod is xp and xp is not np and x.data.device_id != device_id:
        raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device_id}")


def _check_lengths(cache_seqlens, batch: int, xp, device_id: Optional[int] = None) -> bool:
    """TypeError / ValueError unless cache_seqlens is an int or an integer array (B,) of q's library, or of
    NumPy for CuPy inputs (its values: _check_ranges); whether it is the contiguous int32 array the kernels
    read as it is."""
    if _is_int(cache_seqlens):
        return False
    try:
        mod = array_module(cache_seqlens)
    except TypeError:
        raise TypeError("cache_seqlens must be an int or an integer array of shape (B,)") from None
    if np.dtype(cache_seqlens.dtype).kind not in "iu":
        raise TypeError(f"cache_seqlens must hold integers, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},), got {tuple(cache_seqlens.shape)}")
    if mod is not xp and mod is not np:
        raise TypeError(f"cache_seqlens is a {mod.__name__} array but q is a {xp.__name__} array")
    _check_device("cache_seqlens", cache_seqlens, mod, xp, device_id)
    return mod is xp and np.dtype(cache_seqlens.dtype) == np.int32 and cache_seqlens.flags.c_contiguous


def _lengths(cache_seqlens, batch: int, xp, device_id: Optional[int] = None):
    """cache_seqlens (checked: _check_lengths) as a contiguous int32 array (B,) on q's device ``device_id``
    (itself when it is one)."""
    if _is_int(cache_seqlens):
        value = min(max(int(cache_seqlens), 0), 2 ** 31 - 1)
        if xp is not np and device_id == xp.cuda.runtime.getDevice():
            return _filled(value, batch, xp)
        return xp.full((batch,), value, dtype=np.int32)
    return _as_int32(cache_seqlens, xp, device_id)


def _as_int32(x, xp, device_id: Optional[int]):
    """x (lengths or a table, checked) as a contiguous int32 array on q's device: a NumPy array for CuPy inputs
    by an asynchronous copy (_uploaded)."""
    if xp is not np and isinstance(x, np.ndarray):
        return _uploaded(x, xp, device_id)
    return xp.ascontiguousarray(x.astype(np.int32, copy=False))


@dataclass
class _Staging:
    host: np.ndarray   # int32, in page-locked memory (cupyx.empty_pinned)
    device: Any        # an int32 CuPy array of the same size
    done: Any          # the event recorded after the copy from `host`
    host_ptr: int = 0  # host's address, read once (.ctypes.data is slow on a call's host path)
    views: dict = field(default_factory=dict)   # shape -> device's first elements as that shape, made once
    # (benchmarks/host_cpu.py times the host path)


UPLOAD_SLOTS = 8
"""Staging buffers a (device, stream, thread) cycles through: the host runs up to this many calls with NumPy
lengths or tables ahead of the device before a copy waits for an earlier one's."""

_UPLOADS: dict = {}
"""(device, stream, thread) -> [next slot, UPLOAD_SLOTS _Staging or None]."""


def _uploaded(values: np.ndarray, cupy, device_id: Optional[int]):
    """values (NumPy, checked) as a contiguous int32 CuPy array on device ``device_id``, copied asynchronously
    on the current stream from a page-locked staging buffer: no wait for the work already queued (a copy from
    pageable memory would wait for it). A buffer is written again UPLOAD_SLOTS uploads later, once its event
    says its copy is done; the device side is rewritten in stream order after the kernels that read it."""
    values = np.ascontiguousarray(values, dtype=np.int32)
    if device_id != cupy.cuda.runtime.getDevice():
        with cupy.cuda.Device(device_id):
            return cupy.asarray(values)
    stream = cupy.cuda.get_current_stream()
    key = (device_id, stream.ptr, threading.get_ident())
    ring = _UPLOADS.get(key)
    if ring is None:
        if len(_UPLOADS) >= 64:   # forget every ring, once their copies have left the page-locked buffers
            for _, slots in _UPLOADS.values():
                for slot in slots:
                    if slot is not None:
                        slot.done.synchronize()
            _UPLOADS.clear()
        ring = _UPLOADS[key] = [0, [None] * UPLOAD_SLOTS]
    index = ring[0]
    ring[0] = (index + 1) % UPLOAD_SLOTS
    slot = ring[1][index]
    if slot is not None:
        slot.done.synchronize()   # its last copy has left the page-locked buffer
    if slot is None or slot.device.size < values.size:
        import cupyx

        n = max(values.size, 64)
        host = cupyx.empty_pinned((n,), dtype=np.int32)
        slot = ring[1][index] = _Staging(host, cupy.empty((n,), dtype=np.int32),
                                         cupy.cuda.Event(block=False, disable_timing=True), host.ctypes.data)
    slot.host[:values.size] = values.ravel()
    cupy.cuda.runtime.memcpyAsync(slot.device.data.ptr, slot.host_ptr, values.nbytes,
                                  cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
    slot.done.record(stream)
    view = slot.views.get(values.shape)
    if view is None:
        if len(slot.views) >= 8:
            slot.views.clear()
        view = slot.views[values.shape] = slot.device[:values.size].reshape(values.shape)
    return view


HOST_CHECK_BYTES = 1 << 18
"""A block table up to this size is checked on the host (a copy of it and of the lengths, two transfers,
no reductions launched); a larger one by reductions on the device, read back in one transfer."""


def _check_ranges(cache_seqlens, pages, page_size: int, n_new: int, cap: int, num_pages: int, batch: int,
                  xp) -> None:
    """The lengths (as given) and the page indices a sequence uses in range, and no page that an append
    writes named by another used table entry, or ValueError. Table entries past a sequence's last
    position are not read (e.g. -1 padding). On the device: the arrays copied to the host, or (a large
    table) the lengths, the used indices' extremes and the written pages' largest use count read back
    in one transfer; an int length without pages reads nothing."""
    if xp is not np and (_on_host(pages) or _on_host(cache_seqlens) or pages.nbytes <= HOST_CHECK_BYTES):
        cache_seqlens = cache_seqlens if _on_host(cache_seqlens) else cache_seqlens.get()
        pages = pages if _on_host(pages) else pages.get()
        xp = np
    if xp is np:
        _check_ranges_here(cache_seqlens, pages, page_size, n_new, cap, num_pages, batch)
    else:   # CuPy lengths and a large CuPy table
        _check_ranges_on_device(cache_seqlens, pages, page_size, n_new, cap, num_pages, xp)


def _check_length_extremes(lo: int, hi: int, n_new: int, cap: int) -> None:
    if lo < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {lo}")
    if hi + n_new > cap:
        raise ValueError(f"cache_seqlens + Lnew reaches {hi + n_new} keys, past the cache's {cap}")


_SHARED_PAGE = ("block_table names a page that the append writes into more than once among the sequences' used "
                "entries: the append would overwrite keys another entry reads (pages shared between sequences "
                "must not take new keys)")


def _check_ranges_on_device(lengths, pages, page_size: int, n_new: int, cap: int, num_pages: int, cupy) -> None:
    """_check_ranges of CuPy lengths (B,) and a CuPy table (B, max_pages): the lengths, the used page indices'
    extremes and the largest use count of a page the append writes, reduced on the device and read back in
    one transfer."""
    lengths = lengths.astype(np.int64, copy=False)
    parts = [lengths]
    if pages.size:
        entry = cupy.arange(pages.shape[1])[None, :]
        start = cupy.maximum(lengths, 0)
        used = entry * page_size < cupy.minimum(start + n_new, cap)[:, None]         # (B, max_pages)
        used_pages = cupy.where(used, pages.astype(np.int64, copy=False), 0)
        parts += [used_pages.min().reshape(1), used_pages.max().reshape(1)]
        if n_new:   # the entries an append writes into: [lengths, lengths + n_new) meets their positions
            written = used & ((entry + 1) * page_size > start[:, None])
            in_range = used & (used_pages >= 0) & (used_pages < num_pages)
            slot = cupy.where(in_range, used_pages, num_pages)                      # num_pages: not counted
            uses = cupy.zeros(num_pages + 1, dtype=np.int32)   # counted by a scatter-add: no wait for the device
            cupy.add.at(uses, slot.ravel(), 1)                    # (CuPy's bincount reads its input's extremes back)
            uses[num_pages] = 0
            parts.append(uses[cupy.where(written & in_range, slot, num_pages)].max().reshape(1).astype(np.int64))
    values = cupy.concatenate(parts).get()
    n_lengths = lengths.size
    if n_lengths:
        _check_length_extremes(int(values[:n_lengths].min()), int(values[:n_lengths].max()), n_new, cap)
    page_values = values[n_lengths:]
    if page_values.size:
        if page_values[0] < 0 or page_values[1] >= num_pages:
            raise ValueError(f"block_table holds page indices outside [0, {num_pages})")
        if page_values.size == 3 and page_values[2] > 1:
            raise ValueError(_SHARED_PAGE)


def _check_ranges_here(cache_seqlens, pages, page_size: int, n_new: int, cap: int, num_pages: int,
                       batch: int) -> None:
    """_check_ranges on the host (an int or NumPy lengths, a NumPy table or None), one check after another
    and with few NumPy calls (a decoding loop checks its lengths and table at every step)."""
    if _is_int(cache_seqlens):
        lengths = None
        lo = hi = int(cache_seqlens)
    else:
        lengths = cache_seqlens.astype(np.int64, copy=False)
        # a few values: Python's min and max over a list are quicker than NumPy's reductions
        values = lengths.tolist() if lengths.size <= 64 else (lengths.min(), lengths.max())
        lo, hi = (int(min(values)), int(max(values))) if len(values) else (0, 0)
    _check_length_extremes(lo, hi, n_new, cap)
    if pages is None or not pages.size:
        return
    if lengths is None:
        lengths = np.full(batch, lo, dtype=np.int64)
    entry = np.arange(pages.shape[1])
    used = entry < ((lengths + (n_new + page_size - 1)) // page_size)[:, None]    # (B, max_pages): entries read
    named = pages[used]
    if named.itemsize < 4 or not named.dtype.isnative:   # (a big-endian table seen unsigned would be scrambled)
        named = named.astype(np.int32 if named.itemsize < 4 else named.dtype.newbyteorder("="))
    # one reduction: seen unsigned, a negative index is past every page count (< 2**31)
    if named.size and int(named.view(f"u{named.itemsize}").max()) >= num_pages:
        raise ValueError(f"block_table holds page indices outside [0, {num_pages})")
    if n_new:   # the pages the append writes into: entries from lengths // page_size to the last used one
        written = used & (entry >= (lengths // page_size)[:, None])
        if int(np.bincount(named.astype(np.int64, copy=False))[pages[written]].max()) > 1:   # (written: among named)
            raise ValueError(_SHARED_PAGE)


def _check_pages(block_table, batch: int, k_cache, v_cache, d: int, xp, device_id: Optional[int] = None) -> bool:
    """TypeError / ValueError unless block_table is an integer array (B, max_pages) of q's library (or of NumPy
    for CuPy inputs) over pages of 1-256 positions (its values: _check_ranges); whether it is the contiguous
    int32 array the kernels read as it is."""
    try:
        mod = array_module(block_table)
    except TypeError:
        raise TypeError("block_table must be an integer array of shape (B, max_pages)") from None
    if mod is not xp and mod is not np:
        raise TypeError(f"block_table is a {mod.__name__} array but q is a {xp.__name__} array")
    _check_device("block_table", block_table, mod, xp, device_id)
    if np.dtype(block_table.dtype).kind not in "iu" or block_table.ndim != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be an integer array of shape ({batch}, max_pages), got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d:
        raise ValueError(f"paged caches must be (num_pages, Hk, page_size, D) and (num_pages, Hk, page_size, Dv), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    page_size = k_cache.shape[2]
    if not 1 <= page_size <= 256:
        raise ValueError(f"pages hold 1 to 256 positions, got {page_size}")
    return mod is xp and np.dtype(block_table.dtype) == np.int32 and block_table.flags.c_contiguous


def _gathered(cache, pages):
    """(B, Hk, max_pages * page_size, D): each sequence's pages in their order (a copy). Entries past a
    sequence's end may hold anything (padding): clipped into range, their keys are never attended."""
    xp = array_module(cache)
    blocks = cache[xp.clip(pages, 0, cache.shape[0] - 1)]  # (B, max_pages, Hk, page_size, D)
    b, n, h, size, d = blocks.shape
    return blocks.transpose(0, 2, 1, 3, 4).reshape(b, h, n * size, d)


def attention_with_kvcache(q: Array, k_cache: Array, v_cache: Array, k_new: Optional[Array] = None,
                           v_new: Optional[Array] = None, *, cache_seqlens: Union[int, Array],
                           causal: bool = False, window: Any = None, scale: Optional[float] = None,
                           num_splits: Optional[int] = None, return_lse: bool = False,
                           block_table: Optional[Array] = None,
                           validate: bool = True) -> Union[Array, Tuple[Array, Array]]:
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
        Valid keys of each sequence before the append; ``cache_seqlens[b] + Lnew <= Lcap``. With CuPy
        inputs a CuPy array on q's device, or a NumPy array: checked on the host at no cost and copied
        to the device asynchronously (through page-locked buffers; no wait for queued work).
    causal : bool
        Query i sees keys ``j <= cache_seqlens[b] + Lnew - Lq + i`` (each sequence's own bottom right;
        no other alignment here).
    window : (left, right), optional
        Sliding window around that diagonal (keys ``i' - left <= j <= i' + right`` with
        ``i' = cache_seqlens[b] + Lnew - Lq + i``; None for an unbounded side).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    num_splits : int, optional
        As :func:`cuflash.attention`'s.
    return_lse : bool
        Also return the natural-log log-sum-exp (B, Hq, Lq).
    block_table : integer array (B, max_pages), optional
        A paged cache: ``k_cache`` / ``v_cache`` are pages (num_pages, Hk, page_size, D / Dv) (a
        (num_pages, page_size, Hk, D) store passes as ``.swapaxes(1, 2)``), and position p of
        sequence b lives in page ``block_table[b, p // page_size]``, slot ``p % page_size``; pages in
        any order, 1 to 256 positions; entries past a sequence's last position are not read (e.g. -1).
        With CuPy inputs a CuPy or a NumPy array, as ``cache_seqlens``.
        Sequences may share pages they only read (a common prefix); a page that the append writes into must be
        named once among the used entries. The append writes into those slots; on the GPU the float16 and
        bfloat16 kernels, and the decoding kernel of every dtype (at most 16 query rows a K/V head, head dims
        64 and 128), read pages of a power-of-two size in place (K and V pages of the same strides); other
        calls (other float32 and float64 calls, other page sizes, the NumPy path, a window without causal)
        read them gathered into one buffer first (a copy a call).
    validate : bool
        Check ``cache_seqlens`` and ``block_table`` against the cache before anything is written or
        launched (ValueError). For CuPy arrays that reads them back from the device (a copy of each, or
        for a table over 256 KB a few reductions read back at once), which waits for the work already
        queued. ``False`` skips it for CuPy arrays, for a decoding loop
        that keeps them in range itself (the call then never waits for the device): out-of-range
        values are then not reported, but stay inside the cache (the kernels clamp lengths to
        ``[0, Lcap]`` and page indices to the pages given, the append's indices wrap), so they give a
        meaningless result rather than a fault. Values on the host (an int ``cache_seqlens``, NumPy
        arrays) are always checked: that reads nothing from the device.

    Returns
    -------
    out : array (B, Hq, Lq, Dv), q's dtype
        A query that sees no key (an empty sequence) gives 0.
    lse : array (B, Hq, Lq), float32 (float64 for float64); with ``return_lse`` only
        Natural-log log-sum-exp of each query's scores; -inf where it sees no key.

    Raises
    ------
    TypeError
        Arrays of another library or dtype than q, non-integer lengths, table or ``num_splits``, a ``causal``
        that is not a bool.
    ValueError
        Shapes that do not fit, arrays on another device, options out of range (window, scale,
        ``num_splits``), lengths past the cache or negative, page indices outside the pages given, a page
        written by the append that another used entry names, a read-only cache. Raised before anything
        is written or launched.
    """
    key = _signature(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, causal, window, scale,
                     num_splits)
    known = None if key is None else _plan.call_plan(key)
    if known is None:
        return _full_call(q, k_cache, v_cache, k_new, v_new, cache_seqlens, causal, window, scale, num_splits,
                          return_lse, block_table, validate, key)
    total, pages = _check_and_append(known, cache_seqlens, block_table, k_cache, v_cache, k_new, v_new, validate,
                                     array_module(q), q.data.device_id)
    out, lse = _plan.execute_forward(known.plan, q, k_cache, v_cache, total, pages)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class _Checked:
    """What a call's checks establish from its arrays' types, shapes, strides, dtypes and devices and its
    options alone (not from any value): kept per signature on CuPy inputs (with the split-KV forward's
    plan), so that a repeated call checks only the lengths' and the table's values."""
    batch: int
    n_new: int
    cap: int                # key positions a sequence has room for
    page_size: int          # 0: a contiguous cache
    num_pages: int
    lengths_ready: bool     # cache_seqlens is itself the contiguous int32 array the kernels read
    table_ready: bool       # block_table likewise
    plan: Any = None        # the split-KV forward's plan (_dispatch.plan.ForwardPlan)
    append_params: Optional[bytes] = None   # the append's params but for addresses and an int length


def _signature(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, causal, window, scale,
               num_splits) -> Optional[tuple]:
    """Everything the checks of a CuPy call read but values, with option types kept apart (True == 1 as
    dict keys), or None for a call that is not memoised (NumPy inputs, a last axis that is not unit-stride,
    one of k_new / v_new)."""
    if type(causal) is not bool or not (scale is None or type(scale) is float) \
            or not (num_splits is None or type(num_splits) is int) or (k_new is None) != (v_new is None):
        return None
    if window is not None and not (type(window) is tuple and len(window) == 2
                                   and all(w is None or type(w) is int for w in window)):
        return None
    arrays = _arrays_signature((q, k_cache, v_cache) if k_new is None else (q, k_cache, v_cache, k_new, v_new))
    if arrays is None:
        return None
    parts = []
    for x in (cache_seqlens, block_table):
        if x is None or (x is cache_seqlens and _is_int(x)):
            parts.append(type(x))
        elif type(x) is type(q):
            parts.append((x.dtype, x.shape, x.strides, x.data.device_id))
        elif type(x) is np.ndarray:   # uploaded a call (_uploaded): its layout does not matter
            parts.append((np.ndarray, x.dtype, x.shape))
        else:
            return None
    return ("kvcache", arrays, *parts, causal, window, scale, num_splits)


def _check_and_append(checked: _Checked, cache_seqlens, block_table, k_cache, v_cache, k_new, v_new,
                      validate: bool, xp, device_id: Optional[int]):
    """The lengths' and the table's values checked (ValueError; ``validate``, NumPy inputs and an int
    length), then the lengths and the table as the kernels read them (int32, contiguous, on q's device
    ``device_id``) and the new keys and values written into the cache: (each sequence's key count after
    the append (int32 (B,)), the table or None)."""
    # values on the host (an int, NumPy arrays) are checked always: no transfer
    if validate or xp is np or _on_host(cache_seqlens):
        # block_table as given: its int32 copy would have wrapped entries past 2**31 into range
        _check_ranges(cache_seqlens, block_table if validate or xp is np or _on_host(block_table) else None,
                      checked.page_size, checked.n_new, checked.cap, checked.num_pages, checked.batch, xp)
    n_new = checked.n_new
    kernel_append = n_new and xp is not np   # one kernel writes the new rows and the key counts (_appended;
    # an int length reaches it as a value)
    lengths = cache_seqlens if checked.lengths_ready or (kernel_append and _is_int(cache_seqlens)) \
        else _lengths(cache_seqlens, checked.batch, xp, device_id)
    pages = None
    if checked.page_size:
        pages = block_table if checked.table_ready else _as_int32(block_table, xp, device_id)
    if kernel_append:
        return _appended(checked, lengths, pages, k_cache, v_cache, k_new, v_new, xp, device_id), pages
    if n_new:   # NumPy: every new key of sequence b at cache_seqlens[b] + t, one scatter for the batch
        positions = lengths[:, None] + xp.arange(n_new)[None, :]                 # (B, Lnew)
        if pages is None:
            where = (xp.arange(checked.batch)[:, None], slice(None), positions)
        else:
            owner = xp.take_along_axis(pages, positions // checked.page_size, axis=1)   # (B, Lnew) page indices
            where = (owner, slice(None), positions % checked.page_size)
        k_cache[where] = k_new.transpose(0, 2, 1, 3)
        v_cache[where] = v_new.transpose(0, 2, 1, 3)
    return (lengths + np.int32(n_new) if n_new else lengths), pages


_APPEND_KERNELS = {size: HelperKernel("kv_append.cu", f"kv_append<{name}>", threads=128)
                   for size, name in ((2, "unsigned short"), (4, "unsigned int"), (8, "unsigned long long"))}
"""Element size -> the append kernel that moves elements of that size as bits."""
MAX_APPEND_GRID = 1 << 20
"""CTAs of one append launch at most: each walks the rows (b, h, t) a grid apart past it."""
_APPEND_PACKER = _params.PACKERS["KvAppendParams"]
_APPEND_ADDRESSES = tuple(_APPEND_PACKER.offset(path) for path in ("k_new.ptr", "v_new.ptr", "k_cache.ptr",
                                                                   "v_cache.ptr", "lengths", "page_table", "total"))
_APPEND_LENGTH = (_APPEND_PACKER.offset("length"),)


def _append_params(checked: _Checked, k_cache, v_cache, k_new, v_new, table_entries: int) -> bytes:
    """The append's KvAppendParams (kernels_cu/kv_append.cu) for these arrays' shapes and strides, the addresses
    and the int length left 0 (each call writes its own into a copy: _appended); kept with a remembered call's
    checks."""
    def strided(x):
        return {"ptr": 0, "strides": [s // x.itemsize for s in x.strides]}

    return _APPEND_PACKER.pack({
        "k_new": strided(k_new), "v_new": strided(v_new), "k_cache": strided(k_cache), "v_cache": strided(v_cache),
        "lengths": 0, "page_table": 0, "total": 0, "length": 0, "batch": k_new.shape[0], "heads": k_new.shape[1],
        "n_new": checked.n_new, "d": k_new.shape[3], "dv": v_new.shape[3], "cap": checked.cap,
        "page_size": max(checked.page_size, 1), "pages_per_seq": table_entries,
        "num_pages": checked.num_pages}).data.tobytes()


def _appended(checked: _Checked, start, pages, k_cache, v_cache, k_new, v_new, cupy, device_id: int):
    """k_new / v_new written into the CuPy caches at each sequence's positions ``start[b] + t`` (``start`` an
    int, or the int32 device array (B,)) by one launch of kernels_cu/kv_append.cu, which also writes the key
    counts after the append: returns them (int32 (B,), a buffer of the stream's, _stream_buffer). Positions and
    page indices out of range wrap, as CuPy's integer indexing does (unvalidated lengths stay in the cache)."""
    batch, n_new = checked.batch, checked.n_new
    from_int = _is_int(start)
    with _device.on_device(device_id):
        if not batch * k_new.shape[1] * n_new:   # no heads or no sequences: nothing to write
            return cupy.full((batch,), int(start) + n_new, dtype=np.int32) if from_int else start + np.int32(n_new)
        total = _stream_buffer("total", batch, cupy)
        template = checked.append_params
        if template is None:
            template = _append_params(checked, k_cache, v_cache, k_new, v_new, 0 if pages is None else pages.shape[1])
        params = _params.HostArg(template)   # a copy a call: threads may share a remembered call's template
        params.put_addresses(_APPEND_ADDRESSES, (
            k_new.data.ptr, v_new.data.ptr, k_cache.data.ptr, v_cache.data.ptr, 0 if from_int else start.data.ptr,
            0 if pages is None else pages.data.ptr, total.data.ptr))
        params.put_int32(_APPEND_LENGTH, (int(start) if from_int else 0,))
        _launch.launch_kernel(_APPEND_KERNELS[k_cache.itemsize], params,
                              min(batch * k_new.shape[1] * n_new, MAX_APPEND_GRID))
    return total


def _full_call(q, k_cache, v_cache, k_new, v_new, cache_seqlens, causal, window, scale, num_splits, return_lse,
               block_table, validate, key):
    """attention_with_kvcache with every check; a CuPy call that runs the split-KV forward in place is
    remembered under ``key`` (not None)."""
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
    paged = block_table is not None
    table_ready = False
    if paged:
        table_ready = _check_pages(block_table, b, k_cache, v_cache, d, xp, None if xp is np else q.data.device_id)
        hk, cap = k_cache.shape[1], block_table.shape[1] * k_cache.shape[2]
    else:
        if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[0] != b or k_cache.shape[3] != d:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be (B, Hk, Lcap, "
                             f"D) and (B, Hk, Lcap, Dv) for q {tuple(q.shape)}")
        hk, cap = k_cache.shape[1], k_cache.shape[2]
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together")
    n_new = 0
    if k_new is not None:
        n_new = k_new.shape[2]
        if k_new.shape != (b, hk, n_new, d) or v_new.shape != (b, hk, n_new, v_cache.shape[3]):
            raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} must be (B, Hk, Lnew, D) and "
                             f"(B, Hk, Lnew, Dv) of the caches")
    if n_new and (cap == 0 or (paged and k_cache.shape[0] == 0)):
        raise ValueError(f"k_new holds {n_new} new keys a sequence but the cache has no room for any")
    if xp is not np and b * hk * n_new >= 2 ** 31:
        raise ValueError(f"k_new holds {b * hk * n_new} rows (B x Hk x Lnew); the append takes fewer than 2**31")
    if hq % hk:
        raise ValueError(f"q has {hq} heads, not a multiple of the caches' {hk}")
    if max(d, v_cache.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM}, got {d} and {v_cache.shape[3]}")
    check_scale(scale, d)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False (each sequence's bottom right), got {causal!r}")
    window = check_window(window)
    check_num_splits(num_splits)
    if n_new and xp is np and not (k_cache.flags.writeable and v_cache.flags.writeable):
        raise ValueError("the append writes into k_cache and v_cache: both must be writeable")
    checked = _Checked(b, n_new, cap, k_cache.shape[2] if paged else 0, k_cache.shape[0] if paged else 0,
                       _check_lengths(cache_seqlens, b, xp, None if xp is np else q.data.device_id), table_ready)
    if n_new and xp is not np:
        checked = replace(checked, append_params=_append_params(checked, k_cache, v_cache, k_new, v_new,
                                                                block_table.shape[1] if paged else 0))
    # keys of each sequence after the append (int32), the table as the kernels read it
    total, pages = _check_and_append(checked, cache_seqlens, block_table, k_cache, v_cache, k_new, v_new, validate,
                                     xp, None if xp is np else q.data.device_id)
    if xp is not np and (causal or window is None) and (scale is None or _plan.scale_folds(scale)):
        # The split-KV kernels read each sequence's key count and align the causal band (and a window
        # under it) to its own end: no mask, and the query heads of a K/V head share one tile. The
        # 16-bit ones and the decoding kernel read a paged cache in place; the others take it gathered.
        kwargs = dict(causal="bottom_right" if causal else False, window=window, scale=scale, num_splits=num_splits)
        plans = []
        try:
            out, lse = api.forward_with_key_lengths(q, k_cache, v_cache, total, page_table=pages, plans=plans,
                                                    **kwargs)
        except _plan.PagesNotReadInPlace:
            out, lse = api.forward_with_key_lengths(q, _gathered(k_cache, pages), _gathered(v_cache, pages),
                                                    total, **kwargs)
        else:
            # The plan runs on these arrays' addresses alone (no tensor maps): a repeated call runs it on its
            # own (the pages in place, not the 4-D view of them the checks took).
            if key is not None and plans and plans[0].maps is None \
                    and out.shape == (b, hq, lq, v_cache.shape[3]) and lse.shape == (b, hq, lq):
                _plan.remember_call(key, replace(checked, plan=plans[0]))
        return (out, lse) if return_lse else out
    if pages is not None:   # each sequence's pages in order, as one (B, Hk, Lcap, D) buffer
        k_cache, v_cache = (_gathered(c, pages) for c in (k_cache, v_cache))
    keys = xp.arange(cap)[None, None, None, :]
    allowed = keys < total[:, None, None, None]                 # (B, 1, 1, Lcap)
    # The free room past each sequence may hold anything (NaN included), which a zero probability would
    # not cancel in P V: a copy of V with zeros there (by its bits: CuPy has no bfloat16 arithmetic).
    bits = np.dtype(f"u{v_cache.dtype.itemsize}")
    v_cache = xp.where(allowed[:, :, 0, :, None], v_cache.view(bits), bits.type(0)).view(v_cache.dtype)
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
