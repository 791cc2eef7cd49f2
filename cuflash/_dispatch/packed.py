"""The block tables of packed sequences (cuflash.varlen): which sequence and which tile each CTA of a
packed kernel works on.

A packed kernel has ``entries x heads`` blocks (a CTA each, or a persistent grid walking them): a
sequence of ``T`` tiles whose first entry is ``E`` has blocks ``E * heads`` to ``(E + T) * heads - 1``, a
head's ``T`` tiles in a row (so that CTAs running together share one head's K / V in L2). Entries run
longest sequence first, so that one long sequence among many short ones starts at once and the short
ones fill the SMs around it; under a causal mask a sequence's last tiles (the most keys) come first. An
entry is eight int32 (kernels_cu/scheduler.cuh, PackedBlock):

    q_start, k_start   the sequence's first row in the packed q (out, lse) and k (v)
    first              the tile's first query row (query-major kernels) or key (key-major), in the sequence
    lq, lk             the sequence's query and key counts
    seq                the sequence's index
    seq_entry          the sequence's first entry E
    seq_tiles          the sequence's tile count T
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from .._runtime import device

ENTRY_INTS = 8

MAX_TABLES = 64
"""Device tables kept (:func:`device_table`); past this the cache starts over."""

_TABLES: dict = {}

_PER_THREAD_STREAM = 2
"""cudaStreamPerThread's handle (CuPy's ``Stream.ptds``)."""


class Spans(NamedTuple):
    """Where each sequence of a packed call lies, as int64 host arrays (B,): its first row in the rows the
    kernels address of q (out, lse) and of k (v), and its query and key counts. A varlen batch's rows
    follow one another (:meth:`of_offsets`); a document mask's runs lie in the rows of a dense batch seen
    as packed, a batch entry's documents apart from the next's (cuflash/_dispatch/documents.py)."""

    q_start: np.ndarray
    lq: np.ndarray
    k_start: np.ndarray
    lk: np.ndarray

    @classmethod
    def of_offsets(cls, cu_q, cu_k) -> "Spans":
        """The sequences of the offsets ``cu_q``, ``cu_k`` (B + 1,) (checked, as cuflash.varlen takes them)."""
        cu_q, cu_k = np.asarray(cu_q, dtype=np.int64), np.asarray(cu_k, dtype=np.int64)
        return cls(cu_q[:-1], np.diff(cu_q), cu_k[:-1], np.diff(cu_k))

    def key(self) -> bytes:
        return b"".join(np.ascontiguousarray(x, dtype=np.int64).tobytes() for x in self)


def block_table(cu_q: np.ndarray, cu_k: np.ndarray, tile: int, axis: str, reverse: bool) -> np.ndarray:
    """The (blocks, 8) int32 table of a packed kernel whose tiles are ``tile`` query rows (``axis``
    "q") or keys ("k") of a sequence; ``reverse``: a sequence's last tile first. Sequences with no
    query rows (or, key-major, no keys) have no entries. ``cu_q``, ``cu_k``: the checked offsets
    (B + 1,) on the host."""
    return span_table(Spans.of_offsets(cu_q, cu_k), tile, axis, reverse)


def span_table(spans: Spans, tile: int, axis: str, reverse: bool) -> np.ndarray:
    """:func:`block_table` of the sequences ``spans``."""
    q_start, lq, k_start, lk = (np.asarray(x, dtype=np.int64) for x in spans)
    own = lq if axis == "q" else lk
    order = np.argsort(-own, kind="stable")
    order = order[own[order] > 0]
    tiles = -(-own[order] // tile)
    seq = np.repeat(order, tiles)
    # the tile's index inside its sequence: 0, 1, ... (or from the last) for each sequence in turn
    starts = np.repeat(np.cumsum(tiles) - tiles, tiles)
    local = np.arange(int(tiles.sum()), dtype=np.int64) - starts
    if reverse:
        local = np.repeat(tiles, tiles) - 1 - local
    table = np.zeros((len(seq), ENTRY_INTS), dtype=np.int64)
    table[:, 0] = q_start[seq]
    table[:, 1] = k_start[seq]
    table[:, 2] = local * tile
    table[:, 3] = lq[seq]
    table[:, 4] = lk[seq]
    table[:, 5] = seq
    table[:, 6] = starts
    table[:, 7] = np.repeat(tiles, tiles)
    if table.size and table.max() >= 2**31:
        raise ValueError("packed sequences of 2**31 rows or more")
    return table.astype(np.int32)


def device_table(spans: Spans, tile: int, axis: str, reverse: bool):
    """:func:`span_table` as an int32 CuPy array on the current device, kept per (spans, tile, order,
    device, stream): a model's layers repeat one batch's offsets, and a table is only ever read, so the
    later calls launch with no host work or copy for it. The copy that fills a table is ordered on the
    stream of the call that built it, so a table is reused on that stream only: the entry holds the
    stream object (which keeps it alive, so that its handle cannot pass to a new stream), and the
    per-thread default stream, one handle for every host thread, is keyed by thread too."""
    cupy, _ = device.cupy_modules()
    stream = cupy.cuda.get_current_stream()
    thread = threading.get_ident() if stream.ptr == _PER_THREAD_STREAM else None
    key = (spans.key(), tile, axis, reverse, cupy.cuda.runtime.getDevice(), stream.ptr, thread)
    entry = _TABLES.get(key)
    if entry is None or entry[0] is not stream:
        if len(_TABLES) >= MAX_TABLES:
            _TABLES.clear()
        entry = _TABLES[key] = (stream, cupy.asarray(span_table(spans, tile, axis, reverse)))
    return entry[1]
