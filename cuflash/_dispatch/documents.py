"""Document masks on the packed-sequence kernels.

A document mask (cuflash.document_mask) whose documents are runs of positions is block diagonal: a
document's queries see its own keys only, as the sequences of a varlen batch do (cuflash.varlen). Its
calls run the packed kernels, which skip every tile outside a document and test no element.

A dense 4-D array x (B, H, L, C) is read as a packed one: the (rows, H, C) view whose row ``b * R + i``
is ``x[b, :, i]``, where R is the batch stride counted in rows (H x L for memory ordered (B, H, L, C),
L for (B, L, H, C)); ``rows = (B - 1) * R + L``, so the view's last element is x's. A document of batch
entry b starting at position i is the sequence whose first row is ``b * R + i``. The view's other rows
(past an entry's L positions, before the next entry's first) are rows of other heads: no sequence holds
them, the kernels write none, and a tile that runs past a sequence's end reads some of them masked, as
it reads the next sequence's rows in a varlen batch. Every array of the query side (q, out, lse, dout,
dsum, the dQ accumulator, dq) must have q's R, and k, v, dk, dv k's: the outputs are allocated in the
axis order of the input they share rows with, and given inputs with another R are copied into that
order. The row-wise dsum and convert kernels run over the dense arrays (the packed view would give
each row H times).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from .._runtime import device
from .._runtime.launch import KernelLaunch, run
from .._runtime.params import bwd_params
from ..options import Options
from ..semantics import acc_dtype
from . import plan as _plan
from .packed import Spans


def runs_of(p, opts: Options):
    """The (batch row, first position, length) runs of a call whose only masking is a document mask of
    runs (with causal and window) over its Lq == Lk positions, else None."""
    mods = opts.mods
    if mods is None or mods.score or len(mods.mask) != 1 or opts.bias is not None or opts.mask is not None \
            or opts.block_layout is not None or opts.dropout:
        return None
    documents = mods.mask[0].documents
    if documents is None or not p.lq == p.lk == documents.shape[1]:
        return None
    return documents.runs


def batch_rows(x) -> Optional[int]:
    """R of a 4-D array (B, H, L, C) or rows vector (B, H, L): its batch stride in rows, where it is a
    whole number of rows and at least L (any one batch entry: L); else None."""
    b, _, length = x.shape[:3]
    s_batch, s_row = x.strides[0], x.strides[2]
    if b == 1:
        return length
    if s_row <= 0 or s_batch % s_row or s_batch // s_row < length:
        return None
    return s_batch // s_row


def _packed_rows(x, batch_stride_rows: int) -> int:
    """The rows of x's packed view: batch entry B - 1's last position is its last row."""
    return (x.shape[0] - 1) * batch_stride_rows + x.shape[2]


def rows_view(x, batch_stride_rows: int):
    """A 4-D array (B, H, L, C) as the packed (rows, H, C) view (module docstring)."""
    cupy, _ = device.cupy_modules()
    shape = (_packed_rows(x, batch_stride_rows), x.shape[1], x.shape[3])
    return cupy.lib.stride_tricks.as_strided(x, shape, (x.strides[2], x.strides[1], x.strides[3]))


def _accumulator_view(x, batch_stride_rows: int):
    """The dQ accumulator (B, H, L, cols) as the packed (1, H, rows, cols) view whose batch stride is one row
    (plan._packed_accumulator)."""
    cupy, _ = device.cupy_modules()
    shape = (1, x.shape[1], _packed_rows(x, batch_stride_rows), x.shape[3])
    return cupy.lib.stride_tricks.as_strided(x, shape, (x.strides[2], x.strides[1], x.strides[2], x.strides[3]))


def _rows_vector_view(x, batch_stride_rows: int):
    """A rows vector (B, H, L) as the packed (H, rows) view."""
    cupy, _ = device.cupy_modules()
    shape = (x.shape[1], _packed_rows(x, batch_stride_rows))
    return cupy.lib.stride_tricks.as_strided(x, shape, (x.strides[1], x.strides[2]))


def _heads_outer(like) -> bool:
    """Whether ``like``'s heads are further apart in memory than its rows: (B, H, L) order, else (B, L, H)."""
    return like.strides[1] >= like.strides[2]


def _empty(like, cols: Optional[int], dtype, zero: bool = False):
    """A new (B, H, L, cols) array (cols None: a (B, H, L) rows vector) in ``like``'s order of the batch,
    head and row axes (:func:`_heads_outer`)."""
    cupy, _ = device.cupy_modules()
    b, h, length = like.shape[:3]
    tail = () if cols is None else (cols,)
    shape = (b, h, length) if _heads_outer(like) else (b, length, h)
    x = (cupy.zeros if zero else cupy.empty)(shape + tail, dtype=dtype)
    return x if _heads_outer(like) else x.swapaxes(1, 2)


def _empty_strides(like, cols: int, dtype) -> tuple:
    """The (head, row) byte strides :func:`_empty` gives a (B, H, L, cols) array like ``like`` (the dQ
    accumulator's, before the plan says whether there is one)."""
    _, h, length = like.shape[:3]
    row = cols * np.dtype(dtype).itemsize
    return (length * row, row) if _heads_outer(like) else (row, h * row)


def _in_rows(x, like, rows: int):
    """``x`` where its batch stride is ``rows`` rows, else a copy in ``like``'s axis order."""
    if batch_rows(x) == rows:
        return x
    y = _empty(like, None if x.ndim == 3 else x.shape[3], x.dtype)
    bits = np.dtype(f"u{x.itemsize}")   # a copy of the bits: every dtype, bfloat16 included
    y.view(bits)[...] = x.view(bits)
    return y


def _spans(runs, rows_q: int, rows_k: int) -> Spans:
    row, first, length = runs
    return Spans(row * rows_q + first, length, row * rows_k + first, length)


def _packed_problem(p, q, k, v):
    """The problem of the packed views, seen as one batch entry (1, H, rows, D), with the call's options."""
    views = [x.transpose(1, 0, 2)[None] for x in (q, k, v)]
    return dataclasses.replace(p, lead=(1,), q=views[0], k=views[1], v=views[2], q_shape=tuple(views[0].shape))


def _strides3(x) -> tuple:
    return (x.strides[2], x.strides[1], x.strides[3])


def _documents_and_rows(call):
    """(runs, R of q, R of k and v) of a call with a document mask of runs whose inputs the packed views can
    read (:func:`runs_of`, :func:`batch_rows`), else None."""
    p = call.problem
    runs = runs_of(p, call.options)
    if runs is None:
        return None
    rows_q, rows_k = batch_rows(p.q), batch_rows(p.k)
    if rows_q is None or rows_k is None or batch_rows(p.v) != rows_k:
        return None
    return runs, rows_q, rows_k


def forward(call, precision: str):
    """(out (B, Hq, L, Dv), lse (B, Hq, L)) of a validated CuPy call with a document mask of runs on the
    packed forward, in q's axis order; None where the packed kernels do not take it."""
    p, opts, taken = call.problem, call.options, _documents_and_rows(call)
    if taken is None:
        return None
    runs, rows_q, rows_k = taken
    with device.on_device(p.q.data.device_id):
        out = _empty(p.q, p.dv, p.q.dtype)
        lse = _empty(p.q, None, acc_dtype(p.dtype))   # (the runs cover every position: every row is written)
        if batch_rows(out) != rows_q or batch_rows(lse) != rows_q:
            return None   # q's rows are padded: not the outputs' batch stride
        q, k, v = rows_view(p.q, rows_q), rows_view(p.k, rows_k), rows_view(p.v, rows_k)
        out_rows, lse_rows = rows_view(out, rows_q), _rows_vector_view(lse, rows_q)
        pp, popts = _packed_problem(p, q, k, v), Options(window=opts.window)
        layouts = {"out": _strides3(out), "lse": (lse.strides[1], lse.strides[2])}
        plan = _plan.packed_forward(q, k, v, pp, popts, precision, int(runs[2].max()), layouts)
        if plan is None:
            return None
        _plan.execute_packed_forward(plan, q, k, v, _spans(runs, rows_q, rows_k), out_rows, lse_rows)
    return out, lse


def backward(call, dout, out, lse, precision: str, deterministic: bool):
    """(dq, dk, dv) of a validated CuPy call with a document mask of runs on the packed backward, ``dout``,
    ``out`` and ``lse`` 4-D / 3-D views (lse in the accumulator dtype); dq in q's axis order, dk and dv in
    k's. None where the packed kernels do not take it."""
    p, opts, taken = call.problem, call.options, _documents_and_rows(call)
    if taken is None:
        return None
    runs, rows_q, rows_k = taken
    acc = acc_dtype(p.dtype)
    cols = p.d + p.d % 2   # the row-major dQ accumulator's width (plan.dq_accumulator_shape)
    with device.on_device(p.q.data.device_id):
        dq, dk, dv = _empty(p.q, p.d, p.q.dtype), _empty(p.k, p.d, p.k.dtype), _empty(p.k, p.dv, p.v.dtype)
        dsum = _empty(p.q, None, acc)
        if batch_rows(dq) != rows_q or batch_rows(dsum) != rows_q \
                or batch_rows(dk) != rows_k or batch_rows(dv) != rows_k:
            return None   # padded rows: not the gradients' batch stride
        dout, out, lse = (_in_rows(x, p.q, rows_q) for x in (dout, out, lse))
        q, k, v = rows_view(p.q, rows_q), rows_view(p.k, rows_k), rows_view(p.v, rows_k)
        dout_rows, out_rows = rows_view(dout, rows_q), rows_view(out, rows_q)
        pp, popts = _packed_problem(p, q, k, v), Options(window=opts.window)
        acc_strides = _empty_strides(p.q, cols, acc)   # (as dq's rows: the same order)
        layouts = {"rows": (dsum.strides[1], dsum.strides[2]), "dq_acc": acc_strides,
                   "dq": _strides3(dq), "dk": _strides3(dk), "dv": _strides3(dv)}
        plan = _plan.packed_backward(q, k, v, dout_rows, out_rows, pp, popts, precision, deterministic, layouts)
        if plan is None:
            return None
        if plan.dq_acc_shape is None:
            dq_acc = None
        elif plan.dq_acc_shape[-1] != cols:
            return None   # (not a packed plan's accumulator: select.packed_backward_variants)
        else:
            dq_acc = _empty(p.q, cols, acc, zero=True)
        buffers = (_rows_vector_view(dsum, rows_q), None if dq_acc is None else _accumulator_view(dq_acc, rows_q),
                   rows_view(dq, rows_q), rows_view(dk, rows_k), rows_view(dv, rows_k))
        dense = bwd_params(p.q, p.k, p.v, out, dout, lse, dsum, dq_acc, dq, dk, dv, group=p.group, scale=p.scale)

        def rows_kernels(kernel):   # dsum and convert over the dense arrays
            run((KernelLaunch(kernel, kernel.grid(p.batch, p.heads_q, p.group, p.lq, p.lk)),), dense)

        _plan.execute_packed_backward(plan, dout_rows, q, k, v, out_rows, _rows_vector_view(lse, rows_q),
                                      _spans(runs, rows_q, rows_k), buffers, rows_kernels)
    return dq, dk, dv
