"""Variable-length sequences packed back to back: attention over a batch of sequences of different
lengths, with no padding.

The layout is FlashAttention's "varlen" one. The tokens of B sequences lie one after another:
``q`` is (total_q, Hq, D), ``k`` (total_k, Hk, D), ``v`` (total_k, Hk, Dv). Sequence b holds the rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v.
The offsets ``cu_seqlens`` (B + 1,) start at 0, never decrease and end at the packed length, so a
sequence may be empty. Sequence b's queries attend only its own keys, exactly as
:func:`cuflash.attention` does for ``q_b`` and ``k_b`` alone. :func:`pack` and :func:`unpack` convert
between a list of (L, H, D) arrays and this layout.

Options per sequence: ``causal`` (``"top_left"``: query i sees keys j <= i of its sequence;
``"bottom_right"``: j <= i + Lk_b - Lq_b), ``window`` (relative to each sequence's own diagonal),
``scale``, grouped-query heads and ``precision``. Dropout's mask is a pure function of the positions:
element (query row r, counted in the packed q, key j, counted from its sequence's first) of head h is
kept as :func:`cuflash.reference.dropout_keep` ``(seed, p, 0, h, r, j)`` says, so that every
sequence's keys start a Philox group of four (the kernels draw four keys a word). Score and mask
modifications (cuflash.mods) apply to each sequence as a call of its own (positions counted from its first
row, ``b`` = 0). Bias and boolean masks have no per-sequence form here and are not taken.

The offsets are read on the host: pass them as NumPy arrays (as :func:`pack` returns them) to avoid
a device read; CuPy offsets are copied to the host once a call. On the GPU the float16, bfloat16 and
float64 forward without dropout runs one kernel over every sequence's blocks, longest sequence first
(kernels_cu/scheduler.cuh, PackedBlock: the Hopper kernel on an H100 / H200 where the rows are 16-byte
loads), and so does their backward at head dims up to 128: unless ``deterministic``, a dK/dV kernel
adding dQ into an accumulator with atomics, then the convert kernel (on Hopper the Hopper dK/dV kernel for
16-bit rows at head dims 64 and 128; float64's own), else dK/dV and dQ kernels of their own, deterministic by
construction (the 16-bit portable kernels always). float32 at precision "highest" runs the 3xTF32 kernels'
packed twins: the forward (Hopper's, a CTA a block, or the portable one) and the dK/dV kernel (one pass, or
dV then dK at head dim 128) with dQ by atomics or, ``deterministic``, its dQ kernel; other calls (float32
at other precisions, dropout, score and mask modifications) launch the dense kernels once a sequence, with
dropout at the sequence's origin (``dropout_origin``). A batch whose sequences all have the same lengths
(Lq > 0 queries and Lk > 0 keys each) is a dense batch: without dropout or modifications its forward and backward
run the dense kernels on (B, H, L, D) views of the packed arrays (token-major memory, no copy), writing the packed
out and lse, and dq, dk and dv, in place.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import api, options, reference
from ._dispatch import plan as _plan
from ._dispatch.packed import Spans
from ._runtime.device import on_device
from .semantics import acc_dtype

Array = Any   # numpy.ndarray or cupy.ndarray

__all__ = ["pack", "unpack", "attention_varlen", "attention_varlen_forward", "attention_varlen_backward",
           "vjp_varlen"]


def pack(arrays: Sequence[Any]) -> Tuple[Any, np.ndarray]:
    """Concatenate sequences along their first axis.

    Parameters
    ----------
    arrays : sequence of arrays, each (L_b, H, D)
        NumPy or CuPy arrays (one library, one dtype, equal H and D); L_b may be 0.

    Returns
    -------
    packed : array (sum of L_b, H, D), the arrays' module and dtype (a new array)
    cu_seqlens : numpy.ndarray (B + 1,), int32
        The offsets of the sequences in ``packed``: 0, L_0, L_0 + L_1, ...
    """
    arrays = list(arrays)
    if not arrays:
        raise ValueError("pack needs at least one array")
    xp = options.array_module(arrays[0])
    for i, x in enumerate(arrays):
        if options.array_module(x) is not xp:
            raise TypeError(f"arrays[{i}] is a {options.array_module(x).__name__} array but arrays[0] a "
                            f"{xp.__name__} array")
        if x.ndim != 3 or x.shape[1:] != arrays[0].shape[1:] or x.dtype != arrays[0].dtype:
            want = f"(L, {arrays[0].shape[1]}, {arrays[0].shape[2]})" if arrays[0].ndim == 3 else "(L, H, D)"
            raise ValueError(f"arrays[{i}] has shape {tuple(x.shape)} and dtype {x.dtype}; every array must be "
                             f"{want} of dtype {arrays[0].dtype}")
    lengths = np.array([x.shape[0] for x in arrays], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    if cu[-1] >= 2**31:
        raise ValueError(f"{cu[-1]} packed rows: at most 2**31 - 1")
    return xp.concatenate(arrays, axis=0), cu.astype(np.int32)


def unpack(packed: Any, cu_seqlens: Any) -> List[Any]:
    """The sequences of a packed array, as views: ``packed[cu_seqlens[b]:cu_seqlens[b + 1]]``.

    Parameters
    ----------
    packed : array (total, ...)
    cu_seqlens : int array (B + 1,), NumPy or CuPy (offsets as in :mod:`cuflash.varlen`)
    """
    cu = check_cu_seqlens(cu_seqlens, packed.shape[0], "cu_seqlens")
    return [packed[int(a):int(b)] for a, b in zip(cu[:-1], cu[1:])]


def check_cu_seqlens(cu_seqlens: Any, total: int, name: str) -> np.ndarray:
    """``cu_seqlens`` validated against a packed length ``total``: a 1-D int32 or int64 array (NumPy
    or CuPy) of B + 1 >= 1 offsets that start at 0, never decrease and end at ``total``. Returned on
    the host as int64."""
    try:
        xp = options.array_module(cu_seqlens)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy or CuPy int32 / int64 array, got "
                        f"{type(cu_seqlens).__name__}") from None
    if np.dtype(cu_seqlens.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 1 offsets, got shape {tuple(cu_seqlens.shape)}")
    cu = (cu_seqlens if xp is np else cu_seqlens.get()).astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    steps = np.diff(cu)
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must not decrease: entry {b + 1} ({cu[b + 1]}) < entry {b} ({cu[b]})")
    if cu[-1] != total:
        raise ValueError(f"{name} ends at {cu[-1]} but the packed arrays have {total} rows")
    return cu


class _Packed:
    """A validated varlen call: the packed arrays, their offsets on the host, and the checked options."""

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, dropout_p, seed,
                 precision, max_seqlen_q=None, max_seqlen_k=None, score_mod=None, mask_mod=None):
        for name, x in (("q", q), ("k", k), ("v", v)):
            options.array_module(x)
            if x.ndim != 3:
                raise ValueError(f"{name} must be packed as (total, heads, head dim), got shape {tuple(x.shape)}")
        options.check_precision(precision)
        # The packed arrays seen as one batch entry (1, H, total, D): q, k, v and the options are checked
        # as one dense call's (dtypes, heads, dims, devices, scale, window, dropout), messages naming the
        # packed shapes
        p = options.check_qkv(*(x.transpose(1, 0, 2)[None] for x in (q, k, v)), causal=causal, scale=scale,
                              shapes=tuple(tuple(x.shape) for x in (q, k, v)))
        self.opts = options.check_options(p, window=window, dropout_p=dropout_p, seed=seed)
        # every sequence its own call of batch 1: a modification sees b = 0 and each sequence's own positions
        self.mods = options.check_mods(p, score_mod, mask_mod)
        self.mod_kwargs = {} if self.mods is None else dict(score_mod=score_mod, mask_mod=mask_mod)
        self.cu_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        self.cu_k = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
        if len(self.cu_q) != len(self.cu_k):
            raise ValueError(f"cu_seqlens_q has {len(self.cu_q) - 1} sequences, cu_seqlens_k {len(self.cu_k) - 1}")
        for name, cu, limit in (("max_seqlen_q", self.cu_q, max_seqlen_q), ("max_seqlen_k", self.cu_k, max_seqlen_k)):
            if limit is None:
                continue
            if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(limit).__name__}")
            longest = int(np.diff(cu).max()) if len(cu) > 1 else 0
            if longest > limit:
                raise ValueError(f"{name}={limit} but a sequence has {longest} rows")
        self.q, self.k, self.v, self.p = q, k, v, p
        self.kwargs = dict(causal=causal, scale=p.scale, window=window, precision=precision)

    @property
    def xp(self):
        return self.p.xp

    def spans(self):
        """(b, query rows, key rows) of every sequence, as slices of the packed arrays."""
        for b in range(len(self.cu_q) - 1):
            yield b, slice(int(self.cu_q[b]), int(self.cu_q[b + 1])), slice(int(self.cu_k[b]), int(self.cu_k[b + 1]))

    def dropout_kwargs(self, rows: slice) -> dict:
        """A sequence's dropout options: the mask at its first packed query row and its first key."""
        if not self.opts.dropout:
            return {}
        return dict(dropout_p=self.opts.dropout_p, seed=self.opts.seed, dropout_origin=(rows.start, 0))


def _heads_major(x):
    """(L, H, D) -> (H, L, D) view."""
    return x.transpose(1, 0, 2)


def attention_varlen_forward(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, *,
                             causal: api.Causal = False, scale: Optional[float] = None, window: Any = None,
                             dropout_p: float = 0.0, seed: Optional[int] = None, precision: str = "highest",
                             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                             score_mod: Any = None, mask_mod: Any = None) -> Tuple[Array, Array]:
    """Attention of packed sequences, and the row logsumexp the backward needs.

    Parameters
    ----------
    q : array (total_q, Hq, D)
        The sequences' queries back to back (NumPy or CuPy; float16, bfloat16, float32, float64), any
        strides.
    k : array (total_k, Hk, D); v : array (total_k, Hk, Dv)
        Keys and values, same dtype; ``Hq % Hk == 0``.
    cu_seqlens_q, cu_seqlens_k : int32 / int64 arrays (B + 1,)
        The sequences' offsets in q and in k / v (see :mod:`cuflash.varlen`).
    causal, scale, window, precision
        As :func:`cuflash.attention`, applied to each sequence on its own.
    dropout_p, seed
        Dropout; its mask follows the packed positions (see :mod:`cuflash.varlen`). A seed is needed
        here (:func:`attention_varlen` and :func:`vjp_varlen` draw one).
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's bounds on the longest sequence, not needed here (the offsets are read on the
        host): when given, a sequence longer than the bound is a ValueError.
    score_mod, mask_mod : optional
        User modifications (:mod:`cuflash.mods`), as :func:`cuflash.attention`'s, applied to each sequence as
        a call of its own: ``q_idx`` and ``kv_idx`` count from the sequence's first row, ``b`` is 0 (arrays
        indexed by ``b`` have one entry). On the GPU they run the dense kernels once a sequence.

    Returns
    -------
    out : array (total_q, Hq, Dv), q's dtype
        A query of a sequence with no keys gets 0.
    lse : array (Hq, total_q), float32 (float64 for float64)
        Each query row's natural-log logsumexp over its sequence's keys; -inf where it sees none.
    """
    call = _Packed(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, dropout_p, seed, precision,
                   max_seqlen_q, max_seqlen_k, score_mod, mask_mod)
    xp, p = call.xp, call.p
    acc = acc_dtype(p.dtype)
    if xp is not np and p.lk > 0 and call.mods is None:
        with _device_of(q):
            uniform = _uniform_forward(call, precision)
            if uniform is not None:
                return uniform
            plan = _plan.packed_forward(q, k, v, p, call.opts, precision, int(np.diff(call.cu_k).max()))
            if plan is not None:
                return _plan.execute_packed_forward(plan, q, k, v, Spans.of_offsets(call.cu_q, call.cu_k))
    with _device_of(q):
        out = xp.zeros((q.shape[0], p.heads_q, p.dv), dtype=q.dtype)
        lse = xp.full((p.heads_q, q.shape[0]), -np.inf, dtype=acc)
        for b, rows, keys in call.spans():
            if rows.stop == rows.start or keys.stop == keys.start:
                continue   # no queries, or none of them sees a key: 0 and -inf
            qb, kb, vb = (_heads_major(x) for x in (q[rows], k[keys], v[keys]))
            if xp is np:
                o, l = reference.attention_blocked(qb, kb, vb, causal=p.reference_causal, scale=p.scale,
                                                   window=call.opts.window, **call.dropout_kwargs(rows),
                                                   **call.mod_kwargs)
            else:
                o, l = api.attention_forward(qb[None], kb[None], vb[None], **call.kwargs, **call.dropout_kwargs(rows),
                                             **call.mod_kwargs)
                o, l = o[0], l[0]
            out[rows] = o.transpose(1, 0, 2).astype(q.dtype)
            lse[:, rows] = l.astype(acc)
    return out, lse


def _equal_lengths(call: "_Packed") -> Tuple[int, int]:
    """(Lq, Lk) where every sequence of ``call`` has Lq > 0 queries and Lk > 0 keys and the call has no dropout
    (its mask follows the packed rows here, the batch entry's in a dense call) and no modifications: a dense
    batch; else (0, 0)."""
    lengths_q, lengths_k = np.diff(call.cu_q), np.diff(call.cu_k)
    if call.opts.dropout or call.mods is not None or not len(lengths_q) or lengths_q[0] == 0 or lengths_k[0] == 0 \
            or (lengths_q != lengths_q[0]).any() or (lengths_k != lengths_k[0]).any():
        return 0, 0
    return int(lengths_q[0]), int(lengths_k[0])


def _batched(x, n: int):
    """A packed (total, H, D) array as the (total / n, H, n, D) view of its sequences of n rows each; an (H,
    total) row vector (lse) as the (total / n, H, n) one. No copy: token-major memory."""
    xp = options.array_module(x)
    if x.ndim == 3:
        return xp.lib.stride_tricks.as_strided(x, (x.shape[0] // n, x.shape[1], n, x.shape[2]),
                                               (n * x.strides[0], x.strides[1], x.strides[0], x.strides[2]))
    return xp.lib.stride_tricks.as_strided(x, (x.shape[1] // n, x.shape[0], n), (n * x.strides[1], x.strides[0],
                                                                                  x.strides[1]))


def _read_as_given(problem_arrays, views) -> bool:
    """Whether validation kept ``views`` as they are (no copy): a plan made for them holds their strides."""
    return all(a.data.ptr == b.data.ptr and a.strides == b.strides for a, b in zip(problem_arrays, views))


def _uniform_forward(call: _Packed, precision: str) -> Optional[Tuple[Array, Array]]:
    """The forward of a CuPy call of equal lengths (:func:`_equal_lengths`) as the dense batch it is: the dense
    forward on (B, H, L, D) views of the packed arrays, writing the packed out and lse in place; None for
    other calls. Its plan is memoised with the packed calls' (windows included)."""
    lq, lk = _equal_lengths(call)
    if not lq:
        return None
    xp, p = call.xp, call.p
    arrays = (_batched(call.q, lq), _batched(call.k, lk), _batched(call.v, lk))
    out = xp.empty((call.q.shape[0], p.heads_q, p.dv), dtype=call.q.dtype)
    lse = xp.empty((p.heads_q, call.q.shape[0]), dtype=acc_dtype(p.dtype))
    out_b, lse_b = _batched(out, lq), _batched(lse, lq)
    memo = ((call.q, call.k, call.v), p, call.opts, precision, "equal lengths", lq, lk)
    plan = _plan.known_packed_plan(*memo)
    if plan is None:
        dense = options.forward_call(*arrays, **call.kwargs, num_splits=1)
        given, arrays = arrays, (dense.problem.q, dense.problem.k, dense.problem.v)
        plan = _plan.plan_forward(dense.problem, dense.options, precision, 1,
                                  layouts={"out": out_b.strides, "lse": lse_b.strides})
        if _read_as_given(arrays, given):
            _plan.keep_packed_plan(plan, *memo)
    _plan.execute_forward(plan, *arrays, out=out_b, lse=lse_b)
    return out, lse


def _uniform_backward(call: _Packed, dout, out, lse, precision: str, deterministic: bool) -> Optional[tuple]:
    """The backward of a CuPy call of equal lengths as the dense batch it is: the dense backward on (B, H, L, D)
    views of the packed arrays, writing the packed dq, dk and dv; None for other calls. Its plan is memoised
    with the packed calls'."""
    lq, lk = _equal_lengths(call)
    if not lq:
        return None
    xp, p = call.xp, call.p
    lse = lse.astype(acc_dtype(p.dtype), copy=False)
    arrays = (_batched(dout, lq), _batched(call.q, lq), _batched(call.k, lk), _batched(call.v, lk),
              _batched(out, lq), _batched(lse, lq))
    grads = tuple(xp.empty(x.shape, dtype=x.dtype) for x in (call.q, call.k, call.v))
    grads_b = tuple(_batched(g, n) for g, n in zip(grads, (lq, lk, lk)))
    memo = ((call.q, call.k, call.v, dout, out), p, call.opts, precision, "equal lengths", deterministic, lq, lk,
            lse.strides)
    plan = _plan.known_packed_plan(*memo)
    if plan is None:
        dense = options.backward_call(*arrays, **call.kwargs)
        given, arrays = arrays, (*dense.backward_inputs[:1], dense.problem.q, dense.problem.k, dense.problem.v,
                                 *dense.backward_inputs[1:])
        plan = _plan.plan_backward(dense.problem, dense.options, *dense.backward_inputs, deterministic, precision,
                                   False, dict(zip(("dq", "dk", "dv"), (g.strides for g in grads_b))))
        if _read_as_given(arrays, given):
            _plan.keep_packed_plan(plan, *memo)
    dout_b, q_b, k_b, v_b, out_b, lse_b = arrays
    _plan.execute_backward(plan, dout_b, q_b, k_b, v_b, out_b, lse_b, grads_b)
    return grads


def attention_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, *,
                     causal: api.Causal = False, scale: Optional[float] = None, window: Any = None,
                     dropout_p: float = 0.0, seed: Optional[int] = None, precision: str = "highest",
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     score_mod: Any = None, mask_mod: Any = None) -> Array:
    """Exact softmax attention of sequences packed back to back, each sequence's queries over its own keys.

    Parameters
    ----------
    q : array (total_q, Hq, D)
        The sequences' queries back to back (NumPy or CuPy; float16, bfloat16, float32, float64), any
        strides; sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``.
    k : array (total_k, Hk, D); v : array (total_k, Hk, Dv)
        Keys and values, same dtype; ``Hq % Hk == 0`` (grouped-query heads as :func:`cuflash.attention`).
    cu_seqlens_q, cu_seqlens_k : int32 / int64 arrays (B + 1,)
        Offsets that start at 0, never decrease and end at the packed lengths; a sequence may be empty.
        NumPy offsets (as :func:`pack` returns them) save a device read a call.
    causal : bool or {"top_left", "bottom_right"}
        Per sequence: ``"top_left"`` (``True``) query i sees keys ``j <= i``; ``"bottom_right"`` keys
        ``j <= i + Lk_b - Lq_b``.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    window : (left, right), optional
        As :func:`cuflash.attention`, relative to each sequence's own diagonal.
    dropout_p : float
        Dropout probability on the attention weights; the mask is a function of the packed query row and
        the key's index in its sequence (see :mod:`cuflash.varlen`).
    seed : int, optional
        Dropout's seed; one is drawn when ``dropout_p > 0`` and none is given.
    precision : {"highest", "tf32"}
        float32's matrix products, as :func:`cuflash.attention`.
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's bounds on the longest sequence, not needed here: when given, a sequence longer
        than the bound is a ValueError.
    score_mod, mask_mod : optional
        User modifications (:mod:`cuflash.mods`) applied to each sequence as a call of its own (positions
        from the sequence's first row, ``b`` = 0); on the GPU the dense kernels once a sequence.

    Returns
    -------
    out : array (total_q, Hq, Dv), q's dtype
        A query of a sequence with no keys gets 0.

    Bias, boolean masks, ``block_layout``, ``num_splits`` and ``dropout_origin`` are not taken (no
    per-sequence form).
    """
    if dropout_p and seed is None:
        seed = options.draw_seed()
    return attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, window=window,
                                    dropout_p=dropout_p, seed=seed, precision=precision,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, score_mod=score_mod,
                                    mask_mod=mask_mod)[0]


def attention_varlen_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array,
                              cu_seqlens_q: Array, cu_seqlens_k: Array, *, causal: api.Causal = False,
                              scale: Optional[float] = None, window: Any = None, dropout_p: float = 0.0,
                              seed: Optional[int] = None, precision: str = "highest",
                              deterministic: bool = False, max_seqlen_q: Optional[int] = None,
                              max_seqlen_k: Optional[int] = None, score_mod: Any = None,
                              mask_mod: Any = None) -> Tuple[Any, ...]:
    """Gradients of ``sum(dout * out)`` with respect to the packed q, k, v.

    Parameters
    ----------
    dout : array (total_q, Hq, Dv), q's dtype
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, dropout_p, seed, precision, max_seqlen_q, max_seqlen_k,
    score_mod, mask_mod
        The forward's inputs and options (the same seed with dropout).
    out, lse : arrays
        What :func:`attention_varlen_forward` returned.
    deterministic : bool
        As :func:`cuflash.attention_backward`.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtype of q, k, v
        dk and dv sum over the query heads that share a key/value head; keys of a sequence with no
        queries get 0.
    param_grads : dict, only when a score modification has trainable parameters
        Parameter name -> its gradient summed over the sequences, the parameter's shape and dtype.
    """
    call = _Packed(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window, dropout_p, seed, precision,
                   max_seqlen_q, max_seqlen_k, score_mod, mask_mod)
    xp, p = call.xp, call.p
    for name, x, shape in (("dout", dout, (q.shape[0], p.heads_q, p.dv)), ("out", out, (q.shape[0], p.heads_q, p.dv)),
                           ("lse", lse, (p.heads_q, q.shape[0]))):
        if options.array_module(x) is not xp:
            raise TypeError(f"{name} is a {options.array_module(x).__name__} array but q is a {xp.__name__} array")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        if xp is not np and x.device.id != q.device.id:
            raise ValueError(f"{name} is on device {x.device.id}, q on device {q.device.id}")
    for name, x in (("dout", dout), ("out", out)):
        if np.dtype(x.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"lse must be a float array, got {lse.dtype}")
    if xp is not np and p.lk > 0 and call.mods is None:
        with _device_of(q):
            uniform = _uniform_backward(call, dout, out, lse, precision, deterministic)
            if uniform is not None:
                return uniform
            plan = _plan.packed_backward(q, k, v, dout, out, p, call.opts, precision, deterministic)
            if plan is not None:
                lse_acc = xp.ascontiguousarray(lse.astype(acc_dtype(p.dtype), copy=False))
                return _plan.execute_packed_backward(plan, dout, q, k, v, out, lse_acc,
                                                     Spans.of_offsets(call.cu_q, call.cu_k))
    trained = {} if call.mods is None else {name: m.params[name] for m in call.mods.score for name in m.param_grads}
    with _device_of(q):
        grads = [xp.zeros(x.shape, dtype=x.dtype) for x in (q, k, v)]
        param_grads = {name: xp.zeros(value.shape, dtype=acc_dtype(value.dtype)) for name, value in trained.items()}
        for b, rows, keys in call.spans():
            if rows.stop == rows.start or keys.stop == keys.start:
                continue   # nothing attended: zero gradients
            qb, kb, vb, dob, ob = (_heads_major(x) for x in (q[rows], k[keys], v[keys], dout[rows], out[rows]))
            lb = lse[:, rows]
            if xp is np:
                g = reference.attention_backward_blocked(dob, qb, kb, vb, ob, lb, causal=p.reference_causal,
                                                         scale=p.scale, window=call.opts.window,
                                                         **call.dropout_kwargs(rows), **call.mod_kwargs)
            else:
                g = api.attention_backward(dob[None], qb[None], kb[None], vb[None], ob[None], lb[None],
                                           deterministic=deterministic, **call.kwargs, **call.dropout_kwargs(rows),
                                           **call.mod_kwargs)
            for whole, part, span in zip(grads, g[:3], (rows, keys, keys)):
                whole[span] = (part if xp is np else part[0]).transpose(1, 0, 2).astype(whole.dtype)
            for name in trained:
                param_grads[name] += g[-1][name]
    if trained:
        return tuple(grads) + ({name: g_.astype(trained[name].dtype) for name, g_ in param_grads.items()},)
    return tuple(grads)


def vjp_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, *,
               deterministic: bool = False, **kwargs) -> Tuple[Array, Callable[[Array], Tuple[Array, Array, Array]]]:
    """:func:`attention_varlen` and a function mapping ``dout`` to ``(dq, dk, dv)``.

    Parameters
    ----------
    q, k, v, cu_seqlens_q, cu_seqlens_k
        As :func:`attention_varlen`.
    deterministic : bool
        As :func:`cuflash.attention_backward`: bitwise reproducible gradients.
    **kwargs
        causal, scale, window, dropout_p, seed, precision, max_seqlen_q, max_seqlen_k, score_mod, mask_mod
        (as :func:`attention_varlen`). With ``dropout_p > 0`` and no seed, one is drawn and kept
        (``vjp_fn.seed``).

    Returns
    -------
    out : array (total_q, Hq, Dv), q's dtype
    vjp_fn : callable
        ``vjp_fn(dout)`` with dout (total_q, Hq, Dv) in q's dtype returns ``(dq, dk, dv)`` with the shapes
        and dtype of q, k, v (and the trainable parameters' gradients, as :func:`attention_varlen_backward`).
        It holds references to the inputs, out and lse: do not modify them in place before calling it.
    """
    if kwargs.get("dropout_p") and kwargs.get("seed") is None:
        kwargs = dict(kwargs, seed=options.draw_seed())
    out, lse = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)

    def vjp_fn(dout):
        return attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         deterministic=deterministic, **kwargs)

    vjp_fn.seed = kwargs.get("seed")
    return out, vjp_fn


def _device_of(q):
    """The current-device context of a CuPy array's device (nothing for NumPy)."""
    return contextlib.nullcontext() if isinstance(q, np.ndarray) else on_device(q.data.device_id)
