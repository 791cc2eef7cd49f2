"""Ring attention (context parallelism): one sequence sharded over the ranks of a ring, exact.

Each rank holds a slice of the sequence's queries, keys and values (its *segments*: one contiguous
piece; with ``layout="zigzag"`` two pieces, chunk ``r`` and chunk ``2 n - 1 - r`` of ``2 n``; with
``layout="striped"`` every ``n``-th position from ``r``). Zigzag and striped balance a causal mask's work over
the ``n`` ranks: under striped each step is one causal call of the two slices (the diagonal kept when the keys
come from a rank at or below this one), under zigzag most block pairs are calls without a mask. Keys and
values travel around the ring; at each step a rank attends its queries to the block it holds, in the accumulator precision, and merges the
partial result by its log-sum-exp (:func:`cuflash.merge_attention`'s rule), while the next block is
already in flight. The backward sends the keys and values around again with their dK / dV
accumulators, each rank adding its queries' share, and hands each accumulator back to its owner.
Dropout draws the whole sequence's mask: each block pair is a call at its global (query, key) origin.

The transport is a communicator with ``rank``, ``size``, ``exchange_async(arrays, shapes)`` (send to the
next rank, receive the previous one's, whose shapes are ``shapes``: slices of odd lengths differ by a
position; ``.wait()`` returns what arrived) and ``all_reduce(array, op)``:
:class:`NcclRing` (CuPy's NCCL, one process per GPU, set up from torchrun / mpirun / SLURM
environments) or :class:`ThreadRing` (ranks as threads of one process, for tests and the NumPy path).
"""
from __future__ import annotations

import threading
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import api, reference
from .merge import _to_acc, merge_into
from .options import SUPPORTED_DTYPES, array_module, check_window
from .semantics import acc_dtype

__all__ = ["segments", "shard", "unshard", "ring_attention", "ring_attention_forward", "ring_attention_backward",
           "ring_vjp", "ThreadRing", "NcclRing", "launch"]

LAYOUTS = ("zigzag", "contiguous", "striped")


# ----------------------------------------------------------------------------- layouts

def segments(length: int, size: int, layout: str = "zigzag") -> List[List[range]]:
    """Each rank's positions of a sequence of ``length`` over ``size`` ranks, as ranges in the order its
    local slice holds them. "contiguous": rank r the r-th of ``size`` near-equal pieces; "zigzag": pieces
    r and ``2 size - 1 - r`` of ``2 size``; "striped": ``range(r, length, size)``. Zigzag and striped give
    the ranks equal causal work."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if size < 1 or length < 0:
        raise ValueError(f"need size >= 1 and length >= 0, got {size} and {length}")
    if layout == "striped":
        return [[range(r, length, size)] for r in range(size)]
    pieces = size if layout == "contiguous" else 2 * size
    bounds = [i * length // pieces for i in range(pieces + 1)]
    spans = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    if layout == "contiguous":
        return [[spans[r]] for r in range(size)]
    return [[spans[r], spans[pieces - 1 - r]] for r in range(size)]


def _positions(ranges: Sequence[range]) -> np.ndarray:
    return np.concatenate([np.arange(rg.start, rg.stop, rg.step) for rg in ranges] or [np.zeros(0, int)])


def shard(x, rank: int, size: int, layout: str = "zigzag", axis: int = -2):
    """Rank ``rank``'s slice of ``x`` along ``axis`` (the sequence axis of (..., L, D) arrays)."""
    xp = array_module(x)
    return x.take(xp.asarray(_positions(segments(x.shape[axis], size, layout)[rank])), axis=axis)


def unshard(parts: Sequence[Any], layout: str = "zigzag", axis: int = -2):
    """The whole sequence from every rank's slice (``parts[r]`` from rank r), inverse of :func:`shard`."""
    xp = array_module(parts[0])
    length = sum(p.shape[axis] for p in parts)
    held = np.concatenate([_positions(spans) for spans in segments(length, len(parts), layout)])
    return xp.concatenate(list(parts), axis=axis).take(xp.asarray(np.argsort(held, kind="stable")), axis=axis)


# ----------------------------------------------------------------------------- communicators

class _Arrived:
    def __init__(self, fetch):
        self._fetch = fetch

    def wait(self) -> list:
        return self._fetch()


class ThreadRing:
    """A ring of ``size`` ranks as threads of one process (NumPy or CuPy arrays on one device): for
    tests and for running the ring on the CPU. ``ThreadRing.create(size)`` gives one communicator a
    rank; :func:`run` runs a function on every rank in its own thread."""

    def __init__(self, rank: int, size: int, boxes: list, barrier: threading.Barrier, board: list):
        self.rank, self.size = rank, size
        self._boxes, self._barrier, self._board = boxes, barrier, board
        self._sent = 0

    @classmethod
    def create(cls, size: int) -> List["ThreadRing"]:
        boxes = [(threading.Condition(), {}) for _ in range(size)]
        barrier, board = threading.Barrier(size), [None] * size
        return [cls(r, size, boxes, barrier, board) for r in range(size)]

    def exchange_async(self, arrays: Sequence[Any], shapes: Sequence[Tuple[int, ...]]) -> _Arrived:
        """Send copies of ``arrays`` to the next rank; ``.wait()`` gives the previous rank's, which must
        have ``shapes`` (RuntimeError otherwise: NCCL would wait forever on a size that differs). Exchanges
        pair up by their order on each rank (as NCCL's sends and receives do), whatever order they are
        waited for in."""
        number, self._sent = self._sent, self._sent + 1
        shapes = [tuple(s) for s in shapes]
        cond, box = self._boxes[(self.rank + 1) % self.size]
        with cond:
            box[number] = [a.copy() for a in arrays]
            cond.notify_all()
        own_cond, own_box = self._boxes[self.rank]

        def fetch():
            with own_cond:
                own_cond.wait_for(lambda: number in own_box)
                arrived = own_box.pop(number)
            if [tuple(a.shape) for a in arrived] != shapes:
                raise RuntimeError(f"rank {self.rank} expected arrays of shapes {shapes} from the previous rank, "
                                   f"got {[tuple(a.shape) for a in arrived]}")
            return arrived

        return _Arrived(fetch)

    def all_reduce(self, array, op: str = "max"):
        """``array`` reduced elementwise over the ranks (``op`` "max" or "min"); every rank gets it."""
        xp = array_module(array)
        self._board[self.rank] = array
        self._barrier.wait()
        stacked = xp.stack(list(self._board))
        self._barrier.wait()
        return stacked.max(axis=0) if op == "max" else stacked.min(axis=0)

    @staticmethod
    def run(fn, comms: Sequence["ThreadRing"]) -> list:
        """``[fn(comm) for comm in comms]``, each rank in its own thread; the first error re-raised."""
        results, errors = [None] * len(comms), []

        def work(comm):
            try:
                results[comm.rank] = fn(comm)
            except BaseException as exc:   # re-raised in the caller
                errors.append(exc)
                comm._barrier.abort()

        threads = [threading.Thread(target=work, args=(c,)) for c in comms]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class NcclRing:
    """A ring over NCCL (CuPy's ``cupy.cuda.nccl``), one process per GPU: the exchanges run on a
    stream of their own, ordered after the compute stream's work on the arrays they send, and the
    compute stream waits for what arrives only where it reads it.

    ``NcclRing(rank, size, unique_id)``, or :meth:`from_env` under torchrun, mpirun or SLURM. With
    ``timed=True`` the ring records CUDA events around each of the compute stream's waits (``waits``, a list
    of (start, end) events; :meth:`wait_ms`): the time a transfer was not hidden behind the compute."""

    def __init__(self, rank: int, size: int, unique_id, device: Optional[int] = None, timed: bool = False):
        import cupy

        nccl = _nccl()
        self.rank, self.size = rank, size
        self._cupy, self._nccl = cupy, nccl
        if device is not None:
            cupy.cuda.Device(device).use()
        self._comm = nccl.NcclCommunicator(size, unique_id, rank)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self.waits = [] if timed else None

    def wait_ms(self) -> float:
        """Milliseconds the compute stream stood waiting for arriving arrays over the waits recorded so far
        (``waits.clear()`` starts again); waits for them to be measured."""
        if self.waits is None:
            raise RuntimeError("a ring made with timed=True records its waits")
        for _, end in self.waits:
            end.synchronize()
        return float(sum(self._cupy.cuda.get_elapsed_time(start, end) for start, end in self.waits))

    @staticmethod
    def unique_id():
        """A new NCCL unique id (rank 0 makes it; every rank passes it to the constructor)."""
        return _nccl().get_unique_id()

    @classmethod
    def from_env(cls, id_file: Optional[str] = None, timed: bool = False) -> "NcclRing":
        """The ring of a launcher's processes: rank, size and local GPU from torchrun (RANK,
        WORLD_SIZE, LOCAL_RANK), Open MPI (OMPI_COMM_WORLD_*) or SLURM (SLURM_PROCID, SLURM_NTASKS,
        SLURM_LOCALID); rank 0's NCCL id passed through torch.distributed's TCP store (MASTER_ADDR,
        MASTER_PORT) when PyTorch is installed, else mpi4py when installed, else the file ``id_file``
        (or $CUFLASH_NCCL_ID_FILE) on a path every process sees. ``timed``: the constructor's."""
        import os

        env = os.environ
        for rank_key, size_key, local_key in (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                                              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                               "OMPI_COMM_WORLD_LOCAL_RANK"),
                                              ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
            if rank_key in env and size_key in env:
                rank, size, local = int(env[rank_key]), int(env[size_key]), int(env.get(local_key, 0))
                break
        else:
            raise RuntimeError("no launcher environment: run under torchrun, mpirun or srun (RANK / WORLD_SIZE, "
                               "OMPI_COMM_WORLD_RANK / _SIZE or SLURM_PROCID / SLURM_NTASKS)")
        uid = _shared_unique_id(rank, size, id_file or env.get("CUFLASH_NCCL_ID_FILE"))
        return cls(rank, size, uid, device=local, timed=timed)

    def exchange_async(self, arrays: Sequence[Any], shapes: Sequence[Tuple[int, ...]]) -> _Arrived:
        """Send ``arrays`` to the next rank; ``.wait()`` gives the previous rank's (of ``shapes``, each with
        its counterpart's dtype: the byte counts of a send and its receive must match)."""
        cupy, nccl = self._cupy, self._nccl
        sent = [cupy.ascontiguousarray(a) for a in arrays]
        received = [cupy.empty(tuple(shape), dtype=a.dtype) for a, shape in zip(sent, shapes)]
        ready = cupy.cuda.get_current_stream().record()
        self._stream.wait_event(ready)
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        nccl.groupStart()
        for s, r in zip(sent, received):   # as bytes: any dtype, bfloat16 and float64 included
            self._comm.send(s.data.ptr, s.nbytes, nccl.NCCL_UINT8, nxt, self._stream.ptr)
            self._comm.recv(r.data.ptr, r.nbytes, nccl.NCCL_UINT8, prv, self._stream.ptr)
        nccl.groupEnd()
        done = self._stream.record()

        def fetch():
            stream = cupy.cuda.get_current_stream()
            start = stream.record() if self.waits is not None else None
            stream.wait_event(done)
            if start is not None:   # reached when the stream's earlier work ends, passed when the transfer does
                self.waits.append((start, stream.record()))
            del sent[:]   # kept alive until the sends are ordered before the next use of their memory
            return received

        return _Arrived(fetch)

    def all_reduce(self, array, op: str = "max"):
        cupy, nccl = self._cupy, self._nccl
        out = cupy.empty_like(array)
        reduce_op = nccl.NCCL_MAX if op == "max" else nccl.NCCL_MIN
        if np.dtype(array.dtype) != np.int64:
            raise TypeError(f"all_reduce takes int64 arrays (signatures and counts), got {array.dtype}")
        self._comm.allReduce(array.data.ptr, out.data.ptr, array.size, nccl.NCCL_INT64, reduce_op,
                             cupy.cuda.get_current_stream().ptr)
        return out


def _nccl():
    """CuPy's NCCL bindings, or RuntimeError saying how to get them."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:   # CuPy itself missing
        raise RuntimeError(f"the NCCL ring needs CuPy with NCCL: {exc}") from exc
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator") \
            or not hasattr(nccl, "get_unique_id"):
        raise RuntimeError("CuPy finds no NCCL library: install it for CuPy's CUDA version (pip install "
                           "nvidia-nccl-cu12 for cupy-cuda12x, nvidia-nccl-cu13 for cupy-cuda13x)")
    return nccl


def _shared_unique_id(rank: int, size: int, id_file: Optional[str]):
    """Rank 0's NCCL unique id (CuPy's ``nccl.get_unique_id()``) on every rank, through an existing
    store: torch.distributed's TCP store, mpi4py, or a file; pickled on the way."""
    import os
    import pickle

    uid = NcclRing.unique_id() if rank == 0 else None
    try:
        import torch.distributed as torch_dist

        store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, rank == 0)
        if rank == 0:
            store.set("cuflash_nccl_id", pickle.dumps(uid))
        return pickle.loads(store.get("cuflash_nccl_id"))
    except (ImportError, KeyError):
        pass
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.bcast(uid, root=0)
    except ImportError:
        pass
    if not id_file:
        raise RuntimeError("no store for the NCCL id: install PyTorch (torchrun's MASTER_ADDR / MASTER_PORT) or "
                           "mpi4py, or set CUFLASH_NCCL_ID_FILE to a path every process sees")
    import time

    if rank == 0:
        with open(id_file + ".tmp", "wb") as f:
            pickle.dump(uid, f)
        os.replace(id_file + ".tmp", id_file)
        return uid
    for _ in range(6000):
        if os.path.exists(id_file):
            with open(id_file, "rb") as f:
                return pickle.load(f)
        time.sleep(0.01)
    raise RuntimeError(f"the NCCL id file {id_file} did not appear within a minute")


# ----------------------------------------------------------------------------- local launcher

def launch(fn, nprocs: Optional[int] = None, args: Sequence[Any] = (), timeout: Optional[float] = None,
           timed: bool = False) -> list:
    """``[fn(comm, *args) on rank r for r in range(nprocs)]``: one process a GPU of this host (multiprocessing's
    spawn), rank r on GPU r with ``comm`` its :class:`NcclRing`; the NCCL id travels with the arguments.

    Parameters
    ----------
    fn : callable
        ``fn(comm, *args)``, a module-level function of an importable module (the processes are spawned:
        they import it by name; not a lambda, nor a function defined at the Python prompt).
    nprocs : int, optional
        Ranks (default: every GPU of the host).
    args : sequence
        Picklable arguments passed to every rank (NumPy arrays, numbers, strings).
    timeout : float, optional
        Seconds to wait for all ranks (default: no limit).
    timed : bool
        The rings record their waits (:class:`NcclRing`).

    Returns
    -------
    list
        Each rank's return value, rank order; CuPy arrays in it (also inside lists, tuples and dicts) come back
        as NumPy arrays.

    Raises
    ------
    RuntimeError
        A rank raised (its traceback quoted) or ended without a result (a crash); the other ranks are stopped.
    TimeoutError
        ``timeout`` passed first; every rank is stopped.
    """
    import multiprocessing
    import time
    from multiprocessing.connection import wait

    if nprocs is None:
        import cupy

        nprocs = cupy.cuda.runtime.getDeviceCount()
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = multiprocessing.get_context("spawn")
    uid = NcclRing.unique_id()
    pipes = [ctx.Pipe(duplex=False) for _ in range(nprocs)]
    procs = [ctx.Process(target=_launched, args=(r, nprocs, uid, fn, tuple(args), pipes[r][1], timed),
                         daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    for _, sender in pipes:
        sender.close()   # only the child holds its end: a child that dies closes the pipe
    results, pending = [None] * nprocs, {pipes[r][0]: r for r in range(nprocs)}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending), timeout=left)
            if not ready:
                raise TimeoutError(f"ranks {sorted(pending.values())} gave no result within {timeout} s")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    procs[rank].join(5)
                    raise RuntimeError(f"rank {rank} ended without a result (exit code {procs[rank].exitcode}; "
                                       "is fn a module-level function of an importable module?)") from None
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
    finally:
        for p in procs:
            if pending:
                p.terminate()
            p.join()
    return results


def _launched(rank: int, size: int, uid, fn, args: tuple, conn, timed: bool = False) -> None:
    """A spawned rank of :func:`launch`: its ring, ``fn``'s result (or the traceback) sent back."""
    try:
        import cupy

        comm = NcclRing(rank, size, uid, device=rank, timed=timed)
        result = fn(comm, *args)
        cupy.cuda.get_current_stream().synchronize()
        conn.send(("ok", _on_host(result)))
    except BaseException:   # reported to the parent, which raises it
        import traceback

        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _on_host(value):
    """``value`` with CuPy arrays (also inside lists, tuples and dicts) as NumPy arrays."""
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(x) for x in value)
    if isinstance(value, dict):
        return {key: _on_host(x) for key, x in value.items()}
    if type(value).__module__.startswith("cupy") and hasattr(value, "get"):
        return value.get()
    return value


# ----------------------------------------------------------------------------- the ring

def _block_pairs(q_spans, k_spans, causal: bool, window) -> Iterator[Tuple[slice, slice, Any, int, int]]:
    """(query slice, key slice, local window, first query, first key) for each pair of this rank's query
    pieces and a key block's pieces that see each other: the slices (of the local arrays) cut to the
    queries that see some key of the piece and the keys some of them see, the band of global positions
    ``q - left <= k <= q + right`` (right 0 with ``causal``; a side may be negative if their sum is not)
    moved to those slices' own (0, 0): a top-left window with both sides >= 0, or None where every query
    sees every key of the slice; and
    the global positions of the slices' first query and key (dropout's origin)."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        return   # an empty band (striped slices: the diagonal of other ranks' keys)
    for (qs, qe), q_sl in zip(_bounds(q_spans), _slices(q_spans)):
        for (ks, ke), k_sl in zip(_bounds(k_spans), _slices(k_spans)):
            qa = qs if right is None else max(qs, ks - right)    # the queries that see a key of [ks, ke)
            qb = qe if left is None else min(qe, ke + left)
            if qa >= qb:
                continue
            ka = ks if left is None else max(ks, qa - left)      # the keys those queries see
            kb = ke if right is None else min(ke, qb + right)
            if ka >= kb:
                continue
            left_ = None if left is None else ka - qa + left     # the band in the slices' own positions
            right_ = None if right is None else qa - ka + right
            full = (left_ is None or left_ >= qb - qa - 1) and (right_ is None or right_ >= kb - ka - 1)
            yield (slice(q_sl.start + qa - qs, q_sl.start + qb - qs), slice(k_sl.start + ka - ks, k_sl.start + kb - ks),
                   None if full else (left_, right_), qa, ka)


def _arriving_shapes(arrays, spans, source: int) -> List[Tuple[int, ...]]:
    """The shapes of ``arrays`` (blocks of rank ``source``'s positions) as the previous rank sends them: of
    rank ``source - 1``'s positions (slices of odd lengths differ by one)."""
    rows = sum(len(rg) for rg in spans[(source - 1) % len(spans)])
    return [tuple(a.shape[:-2]) + (rows, a.shape[-1]) for a in arrays]


def _slices(spans) -> List[slice]:
    """The local slice of each piece (a range of step 1 or a (start, stop) pair) of a rank's positions."""
    out, offset = [], 0
    for start, stop in _bounds(spans):
        out.append(slice(offset, offset + stop - start))
        offset += stop - start
    return out


def _bounds(spans) -> List[Tuple[int, int]]:
    """(start, stop) of each piece: ranges of step 1 or (start, stop) pairs."""
    return [(rg.start, rg.stop) if isinstance(rg, range) else tuple(rg) for rg in spans]


SIGNATURE_WORDS = 32


def _agree(comm, q, k, v, causal, layout, length: Optional[int], window=None, scale: Optional[float] = None,
           dropout_p: float = 0.0, seed: Optional[int] = None) -> int:
    """The whole sequence's length, once every rank is found to make the same call (shapes but the
    sequence axis, dtype, options, dropout's p and seed, ``length`` where given), else ValueError on every
    rank: one max and one min all-reduce of the call's signature and a one-hot of this rank's slice length."""
    xp = array_module(q)
    name = SUPPORTED_DTYPES.get(np.dtype(q.dtype))
    if name is None:
        raise TypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32, float64")
    for name_, x in (("k", k), ("v", v)):
        if np.dtype(x.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{name_} must have q's dtype {q.dtype}, got {x.dtype}")
    words = [q.ndim, *q.shape[:-2], q.shape[-1], *k.shape[:-2], k.shape[-1], *v.shape[:-2], v.shape[-1],
             list(SUPPORTED_DTYPES.values()).index(name), int(bool(causal)), LAYOUTS.index(layout),
             -1 if length is None else int(length), int(window is None),
             *(-1 if w is None else int(w) for w in (window or (None, None))), int(scale is None),
             int(np.float64(0.0 if scale is None else scale).view(np.int64)),
             int(np.float64(dropout_p).view(np.int64)), int(np.uint64(seed or 0).view(np.int64))]
    words = (words + [0] * SIGNATURE_WORDS)[:SIGNATURE_WORDS]
    slices = [0] * comm.size
    slices[comm.rank] = q.shape[-2]
    both = xp.asarray(np.asarray(words + slices, dtype=np.int64))
    high, low = comm.all_reduce(both, "max"), comm.all_reduce(both, "min")
    if not bool((high[:SIGNATURE_WORDS] == low[:SIGNATURE_WORDS]).all()):
        raise ValueError("the ranks' calls differ (shapes, dtype, causal, window, scale, dropout, layout or sequence "
                         "length): every rank must pass its slice of the same sequence with the same options")
    return int(high[SIGNATURE_WORDS:].sum()) if length is None else int(length)


def _layout_of(causal, layout, dropout_p: float = 0.0):
    layout = layout or ("zigzag" if causal else "contiguous")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "striped" and dropout_p:
        raise ValueError("dropout needs layout 'zigzag' or 'contiguous': the kernels draw the mask over positions "
                         "of stride 1 from an origin, a striped slice's are n apart")
    return layout


def ring_attention_forward(q, k, v, comm, *, causal: bool = False, scale: Optional[float] = None, window: Any = None,
                           layout: Optional[str] = None, length: Optional[int] = None, dropout_p: float = 0.0,
                           seed: Optional[int] = None) -> Tuple[Any, Any]:
    """(out, lse) of attention over the whole sequence, for this rank's slice of it.

    Parameters
    ----------
    q, k, v : arrays (B, Hq, L_local, D), (B, Hk, L_local, D), (B, Hk, L_local, Dv)
        This rank's slice of the sequence (:func:`shard`), CuPy (one GPU a rank) or NumPy.
    comm : communicator
        :class:`NcclRing` or :class:`ThreadRing`.
    causal : bool
        Causal over the whole sequence (query i sees keys j <= i, global positions).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    window : (left, right), optional
        Sliding window over global positions: query i sees keys ``i - left <= j <= i + right`` (None for
        an unbounded side; with ``causal`` the right side is 0). Each step attends only the slices of
        queries and keys that the band joins, so the work shrinks with the window.
    layout : {"zigzag", "contiguous", "striped"}, optional
        How the sequence is sharded (:func:`segments`; default "zigzag" when causal, else "contiguous").
        "striped" (every n-th position a rank) makes each causal step one causal call; no dropout.
    length : int, optional
        The whole sequence's length (default: the sum of the slices; needed only to check it).
    dropout_p, seed : float, int
        Dropout on the attention weights, the mask drawn at global positions: the ranks together drop
        exactly what one call over the whole sequence with this seed drops (cuflash.attention's
        ``dropout_origin``). Every rank passes the same seed; None draws one the ranks agree on (the
        backward then needs it: :func:`ring_vjp` keeps it).

    Returns
    -------
    out : array (B, Hq, L_local, Dv) in q's dtype; lse : (B, Hq, L_local) in the accumulator dtype.
    Partial results are merged in float32 (float64 for float64), rounded to q's dtype once.
    """
    layout = _layout_of(causal, layout, dropout_p)
    window = check_window(window)
    xp = array_module(q)
    local = q.shape[-2]
    if dropout_p and seed is None:
        seed = _agreed_seed(comm, xp)
    total = _agree(comm, q, k, v, causal, layout, length, window, scale, dropout_p, seed)
    spans = segments(total, comm.size, layout)
    mine = spans[comm.rank]
    if sum(len(rg) for rg in mine) != local:
        raise ValueError(f"rank {comm.rank} holds {local} positions, but its {layout} share of {total} is "
                         f"{sum(len(rg) for rg in mine)}: shard the sequence with cuflash.distributed.shard")
    acc = acc_dtype(SUPPORTED_DTYPES[np.dtype(q.dtype)])
    out = xp.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc)
    lse = xp.full(q.shape[:-1], -np.inf, dtype=acc)
    kv = [k, v]
    for step in range(comm.size):
        source = (comm.rank - step) % comm.size
        arriving = comm.exchange_async(kv, _arriving_shapes(kv, spans, source)) if step < comm.size - 1 else None
        for on_kernels, q_sl, k_sl, band, q0, k0 in _step_calls(mine, spans[source], causal, window, bool(dropout_p)):
            args = (q[..., q_sl, :], kv[0][..., k_sl, :], kv[1][..., k_sl, :])
            if on_kernels:
                o, l_ = api.forward_in_accumulator(*args, window=band, scale=scale,
                                                   **_dropout(dropout_p, seed, q0, k0))
            else:   # at most 3 keys before an aligned one
                o, l_ = reference.attention_blocked(*_reference_args(args, acc), window=band, scale=scale,
                                                    dropout_p=dropout_p, seed=seed, dropout_origin=(0, q0, k0))
                o, l_ = o.astype(acc), l_.astype(acc)
            merge_into(out[..., q_sl, :], lse[..., q_sl], o, l_)   # views of the accumulators: in place
        if arriving is not None:
            kv = arriving.wait()
    return out.astype(q.dtype), lse


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal: bool = False, scale: Optional[float] = None,
                            window: Any = None, layout: Optional[str] = None, dropout_p: float = 0.0,
                            seed: Optional[int] = None, deterministic: bool = False) -> Tuple[Any, Any, Any]:
    """(dq, dk, dv) of this rank's slice, from the ring forward's ``out`` and ``lse`` (same options).

    The keys and values go around the ring again with float32 (float64) dK / dV accumulators; each
    rank forms its queries' share (cuflash.attention_backward with the merged out and lse, exact per
    key block) while the block's accumulators travel from the previous rank, adds them, and sends
    them on; after the last step they reach their owner.
    """
    layout = _layout_of(causal, layout, dropout_p)
    window = check_window(window)
    xp = array_module(q)
    if dropout_p and seed is None:
        raise ValueError("dropout_p > 0 needs the forward's seed (ring_vjp keeps it)")
    total = _agree(comm, q, k, v, causal, layout, None, window, scale, dropout_p, seed)
    spans = segments(total, comm.size, layout)
    mine = spans[comm.rank]
    acc = acc_dtype(SUPPORTED_DTYPES[np.dtype(q.dtype)])
    dq = xp.zeros(q.shape, dtype=acc)
    kv = [k, v]
    travelling = None   # the accumulators of the block this rank holds, on their way from the previous rank
    for step in range(comm.size):
        source = (comm.rank - step) % comm.size
        arriving = comm.exchange_async(kv, _arriving_shapes(kv, spans, source)) if step < comm.size - 1 else None
        share = [xp.zeros(kv[0].shape, dtype=acc), xp.zeros(kv[1].shape, dtype=acc)]   # this rank's dK, dV part
        for on_kernels, q_sl, k_sl, band, q0, k0 in _step_calls(mine, spans[source], causal, window, bool(dropout_p)):
            args = (dout[..., q_sl, :], q[..., q_sl, :], kv[0][..., k_sl, :], kv[1][..., k_sl, :],
                    out[..., q_sl, :], lse[..., q_sl])
            if on_kernels:
                g = api.attention_backward(*args, window=band, scale=scale, deterministic=deterministic,
                                           **_dropout(dropout_p, seed, q0, k0))
            else:   # at most 3 keys before an aligned one
                g = reference.attention_backward_blocked(*_reference_args(args, acc), window=band, scale=scale,
                                                         dropout_p=dropout_p, seed=seed, dropout_origin=(0, q0, k0))
                g = [x.astype(acc) for x in g[:3]]
            dq[..., q_sl, :] += g[0]
            share[0][..., k_sl, :] += g[1]
            share[1][..., k_sl, :] += g[2]
        if travelling is not None:   # added only now: their transfer ran during this step's work
            share = [a_ + b_ for a_, b_ in zip(travelling.wait(), share)]
        # on to the next rank (after the last step: the owner); the previous rank's share is of the block it
        # holds now, the one this rank holds next
        travelling = comm.exchange_async(share, _arriving_shapes(share, spans, source))
        if arriving is not None:
            kv = arriving.wait()
    grads = travelling.wait()
    return dq.astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype)


def _dropout(dropout_p: float, seed: Optional[int], q0: int, k0: int) -> dict:
    """A block pair's dropout options: the mask of the whole sequence at the pair's first query and key."""
    return dict(dropout_p=dropout_p, seed=seed, dropout_origin=(q0, k0)) if dropout_p else {}


def _step_calls(q_spans, k_spans, causal: bool, window, dropout: bool):
    """(on_kernels, query slice, key slice, local window, first query, first key) for each call of a ring
    step: :func:`_block_pairs`; under dropout a pair whose first key is not a multiple of 4 (the kernels
    draw a Philox word group of four keys from an aligned origin) has its keys up to the next multiple of 4
    (at most 3) attended by :mod:`cuflash.reference` on the arrays' device (``on_kernels`` False), the
    rest, from an aligned key, by the kernels. Striped slices (no dropout) go to :func:`_striped_calls`."""
    if any(rg.step != 1 for rg in q_spans + k_spans if isinstance(rg, range)):
        yield from _striped_calls(q_spans[0], k_spans[0], causal, window)
        return
    for q_sl, k_sl, band, q0, k0 in _block_pairs(q_spans, k_spans, causal, window):
        if not dropout or k0 % 4 == 0:
            yield True, q_sl, k_sl, band, q0, k0
            continue
        q_end, k_end = q0 + q_sl.stop - q_sl.start, k0 + k_sl.stop - k_sl.start
        aligned = min(k_end, k0 + (-k0) % 4)
        for ka, kb in ((k0, aligned), (aligned, k_end)):
            for qs, ks, band_, qg, kg in _block_pairs([(q0, q_end)], [(ka, kb)], causal, window):
                # the queries that see some key of [ka, kb) start no later than those of the pair: a cut
                # of the keys of [aligned, k_end) leaves them at `aligned`
                assert ka == k0 or kg == aligned
                yield (ka != k0, slice(q_sl.start + qs.start, q_sl.start + qs.stop),
                       slice(k_sl.start + ka - k0 + ks.start, k_sl.start + ka - k0 + ks.stop), band_, qg, kg)


def _striped_calls(mine: range, theirs: range, causal: bool, window):
    """The one call of a striped step: local query i is global ``r + i n``, local key j is ``s + j n``
    (``n`` ranks, queries of rank r, keys of rank s), so the global band ``q - left <= k <= q + right``
    is the local band ``i - (left + s - r) // n <= j <= i + (r + right - s) // n``: a causal mask keeps
    the diagonal for keys of ranks s <= r and drops it (one query and one key fewer) for s > r."""
    n, r, s = mine.step, mine.start, theirs.start
    left, right = window if window is not None else (None, None)
    right = 0 if causal else right
    band = (None if left is None else (left + s - r) // n, None if right is None else (r + right - s) // n)
    for q_sl, k_sl, local, _, _ in _block_pairs([(0, len(mine))], [(0, len(theirs))], False, band):
        yield True, q_sl, k_sl, local, None, None


def _reference_args(arrays, acc):
    """Arrays for cuflash.reference on their own device, widened to ``acc`` (a CuPy bfloat16 by its bits)."""
    return [_to_acc(array_module(x), x, acc) for x in arrays]


def _agreed_seed(comm, xp) -> int:
    """A dropout seed drawn on every rank, the largest one taken by all (one all-reduce)."""
    import secrets

    drawn = xp.asarray(np.asarray([secrets.randbits(63)], dtype=np.int64))
    return int(comm.all_reduce(drawn, "max")[0])


def ring_attention(q, k, v, comm, **kwargs):
    """The ring forward's output alone (:func:`ring_attention_forward`)."""
    return ring_attention_forward(q, k, v, comm, **kwargs)[0]


def ring_vjp(q, k, v, comm, *, deterministic: bool = False, **kwargs):
    """(out, vjp_fn) on this rank's slice: ``vjp_fn(dout) -> (dq, dk, dv)`` runs the ring backward
    (every rank must call it, as the forward). With ``dropout_p > 0`` and no ``seed``, the ranks agree on
    a drawn one, kept for the backward and readable as ``vjp_fn.seed``."""
    if kwargs.get("dropout_p") and kwargs.get("seed") is None:
        kwargs = dict(kwargs, seed=_agreed_seed(comm, array_module(q)))
    out, lse = ring_attention_forward(q, k, v, comm, **kwargs)
    kwargs.pop("length", None)

    def vjp_fn(dout):
        return ring_attention_backward(dout, q, k, v, out, lse, comm, deterministic=deterministic, **kwargs)

    vjp_fn.seed = kwargs.get("seed")
    return out, vjp_fn
