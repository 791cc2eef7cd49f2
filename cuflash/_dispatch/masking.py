"""A call's validated masking options turned into what the kernels read (``MaskParams`` /
``DbiasParams`` in ``kernels_cu/params.cuh``, by field name).

* ``causal`` and ``window`` become one diagonal band ``(lo, hi)`` (semantics.band_limits).
* ``bias`` and ``mask`` become (batch, head, row, col) views with stride 0 along
  their broadcast axes: never expanded in memory.
* A boolean mask is summarised per (query block, key block) as BlockState
  (0: nothing visible, 1: some, 2: all), combined with a block-sparse
  ``block_layout``: the kernels skip state-0 tiles without loading them and test
  the mask per element only in state-1 tiles (key padding costs one tile column).
* ``dropout_p`` and ``seed`` become a Philox threshold and key.
* User modifications (cuflash.mods) become their parameter words; mask modifications also become
  block states, computed on the GPU (kernels_cu/mask_mod_states.cu) and cached.
* The backward's ``dbias``: an accumulator of the bias's own shape, and how the
  kernels add into it (bias_grad.cuh): the tensor-core backward's own dbias kernel
  (flash_bwd_dbias.cu), the FMA dK/dV kernel's adds, atomics or turns, or the Hopper
  dK/dV kernel's vector reductions into a key-major accumulator (bias_grad_t.cuh).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from ..mods import MAX_PARAM_SLOTS, Mods
from ..options import Options, Problem, own_4d
from .._runtime.launch import HelperKernel
from .._runtime.params import DBIAS_OFF, NO_SCORE, PACKERS, block_divisors
from ..semantics import acc_dtype, band_limits, dropout_key, dropout_threshold

MASK_SUMMARY_BLOCK = (64, 64)
"""Block size of a mask's summary when no block layout sets one."""

DBIAS_NONE, DBIAS_ADD, DBIAS_ATOMIC, DBIAS_ORDERED, DBIAS_KERNEL, DBIAS_KEY_MAJOR = 0, 1, 2, 3, 4, 5
MAX_DBIAS_SPLITS = 16
"""At most this many slices of the dbias accumulator (each the bias's own size) when its
tiles alone are too few to fill the GPU (DbiasParams::splits)."""


def _broadcast_view(x4, full: tuple) -> dict:
    """A ``ScoreTensor`` of a 4-D own-shape array seen as ``full``: its address and four strides
    in elements, 0 on broadcast axes."""
    b, h, r, c = (0 if n == 1 and f != 1 else s // x4.itemsize for n, f, s in zip(x4.shape, full, x4.strides))
    return {"ptr": x4.data.ptr, "batch_stride": b, "head_stride": h, "row_stride": r, "col_stride": c}


def score_view(x4, p: Problem) -> dict:
    """A bias, mask or dbias accumulator seen as the (B, Hq, Lq, Lk) scores."""
    return _broadcast_view(x4, (p.batch, p.heads_q, p.lq, p.lk))




_SPANS_KERNEL = HelperKernel("layout_spans.cu", "layout_spans")


MAX_STATES_GRID = 2**30
_MOD_STATES: dict = {}
MAX_MOD_STATES = 64
"""Block states kept (a cache: the same mask modification objects and shape give the same states)."""


def clear_mod_states() -> None:
    """Forget the cached block states of mask modifications (after changing a parameter array in place)."""
    _MOD_STATES.clear()


def mod_states(p: Problem, mods: Mods, block: Tuple[int, int]):
    """The BlockState int8 array (B', H', query blocks, key blocks) of the mask modifications: B' = B
    where a modification reads ``b`` (else 1), H' likewise for ``h``. Cached per (modification objects,
    shape, block): a MaskMod's arrays are its own (it keeps them alive), and one changed in place needs a
    new MaskMod (or :func:`clear_mod_states`)."""
    from .._runtime import device
    from .._runtime.launch import launch_kernel

    cupy = p.xp
    batches = p.batch if any(m.reads_batch for m in mods.mask) else 1
    heads = p.heads_q if any(m.reads_head for m in mods.mask) else 1
    nq, nk = -(-p.lq // block[0]), -(-p.lk // block[1])
    key = (tuple(id(m) for m in mods.mask), batches, heads, p.lq, p.lk, block, p.q.data.device_id)
    cached = _MOD_STATES.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], mods.mask)):
        return cached[1]
    words, _ = mods.words(np.float32, with_grads=False)
    states = cupy.empty((batches, heads, nq, nk), dtype=np.int8)
    kernel = HelperKernel("mask_mod_states.cu", "mask_mod_states", mods.prelude(False))
    total = batches * heads * nq * nk
    with device.on_device(p.q.data.device_id):
        for first in range(0, total, MAX_STATES_GRID):
            params = PACKERS["MaskStatesParams"].pack({
                "states": states.data.ptr, "args": words, "first": first, "heads": heads, "q_blocks": nq,
                "k_blocks": nk, "lq": p.lq, "lk": p.lk, "block_q": block[0], "block_k": block[1]})
            launch_kernel(kernel, params, min(MAX_STATES_GRID, total - first))
    if len(_MOD_STATES) >= MAX_MOD_STATES:
        _MOD_STATES.clear()
    _MOD_STATES[key] = (mods.mask, states)   # the objects too: their ids stay theirs while cached
    return states


def block_states(p: Problem, opts: Options):
    """The int8 BlockState layout (own 4-D shape) and its block size, or (None, None)."""
    xp = p.xp
    mask_mods = opts.mods is not None and bool(opts.mods.mask)
    if opts.mask is None and opts.block_layout is None and not mask_mods:
        return None, None
    bq, bk = opts.block_layout.block_size if opts.block_layout is not None else MASK_SUMMARY_BLOCK
    nq, nk = -(-p.lq // bq), -(-p.lk // bk)
    states = None
    if opts.mask is not None:
        m = own_4d(opts.mask, p)
        b_, h_, lq_, lk_ = m.shape
        rq, rk = (nq, bq) if lq_ > 1 else (1, 1)
        ck, ckk = (nk, bk) if lk_ > 1 else (1, 1)
        anyp = xp.zeros((b_, h_, rq * rk, ck * ckk), dtype=bool)
        allp = xp.ones((b_, h_, rq * rk, ck * ckk), dtype=bool)
        anyp[:, :, :lq_, :lk_] = m
        allp[:, :, :lq_, :lk_] = m
        anyb = anyp.reshape(b_, h_, rq, rk, ck, ckk).any(axis=(3, 5))
        allb = allp.reshape(b_, h_, rq, rk, ck, ckk).all(axis=(3, 5))
        states = xp.where(anyb, xp.where(allb, 2, 1), 0).astype(np.int8)
    if opts.block_layout is not None:
        lay = own_4d(xp.asarray(opts.block_layout.layout), p)
        user = xp.where(lay, 2, 0).astype(np.int8)
        states = user if states is None else xp.minimum(states, user)
    if mask_mods:
        mine = mod_states(p, opts.mods, (bq, bk))
        states = mine if states is None else xp.minimum(states, mine)
    return xp.ascontiguousarray(states), (bq, bk)


def layout_view(states, p: Problem, block: Tuple[int, int]) -> dict:
    """The block states seen as (B, Hq, query blocks, key blocks)."""
    return _broadcast_view(states, (p.batch, p.heads_q, -(-p.lq // block[0]), -(-p.lk // block[1])))


_SPANS: dict = {}
"""Spans of block states (:func:`layout_spans`), per states array: a mask modification's cached states
(the backward's, a model's layers) take no second launch."""


def layout_spans(states, xp, q_blocks: int, k_blocks: int):
    """(rows, cols) of block states (own shape (b, h, nq, nk), int8, of a call with ``q_blocks`` x ``k_blocks``
    blocks; an axis of one block may be broadcast): int32 (b, h, nq, 2) and (b, h, nk, 2), the first and last
    block not BLOCK_OFF along the key blocks of each query block and along the query blocks of each key block
    (first n and last -1 where there is none; a broadcast axis spans all its blocks), by one small kernel
    (kernels_cu/layout_spans.cu). The kernels start and end a block's walk over the layout there
    (MaskParams::layout_rows, layout_cols)."""
    from .._runtime import device
    from .._runtime.launch import launch_kernel

    key = (id(states), states.data.ptr, states.shape, q_blocks, k_blocks)
    known = _SPANS.get(key)
    if known is not None and known[0] is states:
        return known[1], known[2]
    b, h, nq, nk = states.shape
    rows = xp.empty((b, h, nq, 2), dtype=np.int32)
    cols = xp.empty((b, h, nk, 2), dtype=np.int32)
    params = PACKERS["LayoutSpansParams"].pack({
        "states": states.data.ptr, "rows": rows.data.ptr, "cols": cols.data.ptr, "pairs": b * h, "q_blocks": nq,
        "k_blocks": nk, "call_q_blocks": q_blocks, "call_k_blocks": k_blocks})
    with device.on_device(states.data.device_id):
        launch_kernel(_SPANS_KERNEL, params, -(-(b * h * (nq + nk)) // _SPANS_KERNEL.threads))
    if len(_SPANS) >= MAX_MOD_STATES:
        _SPANS.clear()
    _SPANS[key] = (states, rows, cols)   # the states too: their id stays theirs while cached
    return rows, cols


def span_view(spans, p: Problem, blocks: int) -> dict:
    """Spans (:func:`layout_spans`, own shape (b, h, n, 2)) seen as (B, Hq, n, 2)."""
    return _broadcast_view(spans, (p.batch, p.heads_q, blocks, 2))


def rows_in_chunks(view: dict, itemsize: int) -> bool:
    """Whether a score view (:func:`score_view`, strides in elements) is rows of whole
    16-byte chunks at every (batch, head, row): unit key stride, a 16-byte aligned start and
    batch, head and row strides (0 included). The Hopper forward copies its bias tiles by such
    chunks only (kernels_cu/tile_io.cuh, ScoreChunkCopy)."""
    chunk = 16 // itemsize
    return (view["col_stride"] == 1 and view["ptr"] % 16 == 0
            and all(view[axis] % chunk == 0 for axis in ("batch_stride", "head_stride", "row_stride")))


@dataclass
class KernelMasking:
    """MaskParams' values for one call, and the arrays they point into (kept alive).
    ``bias_in_chunks``: no bias, or one whose rows are 16-byte chunks (:func:`rows_in_chunks`);
    the Hopper forward takes no other."""

    band: Optional[Tuple[int, int]]
    extra: bool
    values: dict       # MaskParams by field name
    keep_alive: tuple
    bias_in_chunks: bool = True
    param_grads: tuple = ()   # the trainable parameters' gradient accumulators (the backward's), in slot order


def kernel_masking(p: Problem, opts: Options, param_grads: bool = False) -> KernelMasking:
    """MaskParams' values of a call; ``param_grads``: allocate (zeroed) the accumulators the backward adds
    the trainable parameters' gradients into."""
    band = band_limits(p.reference_causal, opts.window, p.lq, p.lk)
    keep = []
    bias_view = mask_view = lay_view = rows_view = cols_view = NO_SCORE
    block = (1, 1)
    chunks = True
    if opts.bias is not None:
        b4 = own_4d(opts.bias.astype(p.q.dtype, copy=False), p)
        keep.append(b4)
        bias_view = score_view(b4, p)
        chunks = rows_in_chunks(bias_view, b4.itemsize)
    if opts.mask is not None:
        m4 = own_4d(opts.mask, p)
        keep.append(m4)
        mask_view = score_view(m4, p)
    states, blk = block_states(p, opts)
    if states is not None:
        keep.append(states)
        block = blk
        lay_view = layout_view(states, p, blk)
        if p.xp is not np:   # (the kernels' spans; NumPy arrays stand in for device ones in some tests)
            nq, nk = -(-p.lq // blk[0]), -(-p.lk // blk[1])
            rows, cols = layout_spans(states, p.xp, nq, nk)
            keep += [rows, cols]
            rows_view, cols_view = span_view(rows, p, nq), span_view(cols, p, nk)   # broadcast as the states
    words, grads = [0] * MAX_PARAM_SLOTS, ()
    if opts.mods is not None:
        words, grads = opts.mods.words(acc_dtype(p.dtype), with_grads=param_grads)
        keep += list(grads)
    seed_lo, seed_hi = dropout_key(opts.seed or 0)
    lo, hi = band if band is not None else (0, 0)
    values = {"band_lo": lo, "band_hi": hi, "block_q": block[0], "block_k": block[1], **block_divisors(block),
              "bias": bias_view, "mask": mask_view, "layout": lay_view, "layout_rows": rows_view,
              "layout_cols": cols_view,
              "drop_threshold": dropout_threshold(opts.dropout_p) if opts.dropout else 0,
              "seed_lo": seed_lo, "seed_hi": seed_hi, "drop_row0": opts.dropout_origin[0],
              "drop_col0": opts.dropout_origin[1],
              "keep_scale": 1.0 / (1.0 - opts.dropout_p), "key_lengths": 0,
              "page_table": 0, "page_size": 1, "pages_per_seq": 0, "num_pages": 0, "packed_blocks": 0,
              "band_from_end": 0, "packed_count": 0, "band_period": 0, "mod_args": words}
    return KernelMasking(band, opts.extra, values, tuple(keep), chunks, tuple(grads))


@dataclass
class DbiasPlan:
    """How the backward forms dbias: the accumulator and DbiasParams' values."""

    acc: Any                  # (B', H', Lq', Lk) accumulator (DBIAS_KEY_MAJOR: a transposed view of a
                              # (B', H', Lk, pitch) array), (splits, B', H', Lq', Lk) with splits, or None
    values: dict              # DbiasParams by field name
    keep_alive: tuple
    splits: int = 0           # DBIAS_KERNEL: slices of acc along a leading axis, summed here in order
    grid: int = 0             # DBIAS_KERNEL: CTAs of the dbias kernel

    def result(self, p: Problem, opts: Options):
        """dbias with exactly the bias's shape and dtype."""
        xp = p.xp
        bias = opts.bias
        if self.acc is None:
            return xp.zeros(bias.shape, dtype=bias.dtype)
        g = self.acc
        if self.splits:
            g = g[0] if self.splits == 1 else g.sum(axis=0)
        nd = len(p.lead) + 3
        bias_nd = (1,) * (nd - bias.ndim) + tuple(bias.shape)
        if g.shape[0] != 1 or p.lead:   # back to the leading dims, then summed where the bias broadcasts
            g = g.reshape((p.lead if g.shape[0] != 1 else (1,) * len(p.lead)) + g.shape[1:])
            axes = tuple(i for i in range(len(p.lead)) if bias_nd[i] == 1 and g.shape[i] != 1)
            if axes:
                g = g.sum(axis=axes, keepdims=True)
        # order="C": a key-major accumulator's transposed view would otherwise hand back its layout
        return g.reshape(bias.shape).astype(bias.dtype, order="C")


def dbias_mode(p: Problem, own_shape: tuple, deterministic: bool) -> int:
    """How dS meets in the accumulator of a bias of own 4-D shape (B', H', Lq', Lk'):
    plain adds when one CTA owns each element (the dK/dV CTA of one (batch, K/V
    head) walks its query heads and query blocks in order), else atomics, or
    turns taken in a fixed order when deterministic (bias_grad.cuh)."""
    b_, h_, lq_, lk_ = own_shape
    if lk_ == 1 and p.lk > 1:
        return DBIAS_NONE
    cross_cta = (b_ == 1 and p.batch > 1) or (h_ == 1 and p.heads_q > 1 and p.heads_q // p.group > 1)
    return DBIAS_ADD if not cross_cta else (DBIAS_ORDERED if deterministic else DBIAS_ATOMIC)


def dbias_plan(p: Problem, opts: Options, deterministic: bool, dkdv_tile=None, kernel_tile=None,
               sm_count: Optional[int] = None, key_major: bool = False,
               key_major_for_atomics: bool = False) -> DbiasPlan:
    """Where dS is summed for dbias. ``kernel_tile``: the (block_m, block_n) of the
    tensor-core backward's dbias kernel (DBIAS_KERNEL; ``sm_count`` sizes its splits);
    ``key_major``: the Hopper dK/dV kernel adds dS^T itself (DBIAS_KEY_MAJOR, never
    deterministic); otherwise ``dkdv_tile``, the dK/dV kernel's that adds dS itself (FMA,
    or the float64 / float32 tensor-core kernels). ``key_major_for_atomics`` (the float32
    tensor-core dK/dV kernels, whose fragments are the Hopper kernel's m16n8 layout): where
    CTAs would meet with atomics (DBIAS_ATOMIC) on a bias with query rows, DBIAS_KEY_MAJOR's
    vector reductions instead (a quarter of the L2 operations, whole sectors)."""
    off = DBIAS_OFF
    if opts.bias is None:
        return DbiasPlan(None, off, ())
    xp = p.xp
    own = own_4d(opts.bias, p).shape
    b_, h_, lq_, lk_ = own
    if lk_ == 1 and p.lk > 1:
        # A bias constant along keys shifts every score of a row equally: softmax and
        # the output ignore it, and its gradient sum_j dS_ij = 0 exactly.
        return DbiasPlan(None, off, ())
    acc = acc_dtype(p.dtype)
    if key_major:
        return _key_major_plan(p, own, acc)
    if kernel_tile is not None:
        if sm_count is None:
            raise ValueError("the dbias kernel's plan needs the GPU's SM count (it sizes the splits)")
        block_m, block_n = kernel_tile
        q_blocks, k_blocks = -(-p.lq // block_m), -(-p.lk // block_n)
        # The kernel's grid: one CTA per accumulator tile (key block x the axes the bias does not
        # broadcast along) and split; each walks the broadcast axes (flash_bwd_dbias.cu, DbiasWork).
        tiles = k_blocks * (q_blocks if lq_ > 1 else 1) * h_ * b_
        walk = (p.batch // b_) * (p.heads_q // h_) * (q_blocks if lq_ == 1 else 1)
        splits = max(1, min(walk, MAX_DBIAS_SPLITS, -(-2 * sm_count // tiles)))
        pitch = -(-p.lk // 4) * 4
        slices = xp.zeros((splits, b_, h_, lq_, pitch), dtype=acc)[..., :p.lk]
        # tiles_b/h/i (DBIAS_ORDERED's turn grid) are unused here: the off values.
        values = dict(DBIAS_OFF, acc=score_view(slices[0], p), mode=DBIAS_KERNEL, rows_broadcast=int(lq_ == 1),
                      splits=splits, split_stride=b_ * h_ * lq_ * pitch)
        return DbiasPlan(slices, values, (slices,), splits=splits, grid=tiles * splits)
    mode = dbias_mode(p, own, deterministic)
    if key_major_for_atomics and mode == DBIAS_ATOMIC and lq_ > 1:
        return _key_major_plan(p, own, acc)
    sums = xp.zeros(own, dtype=acc)
    block_m, block_n = dkdv_tile
    tiles_i = 1 if lq_ == 1 else -(-p.lq // block_m)
    order = xp.zeros(b_ * h_ * tiles_i * -(-p.lk // block_n), dtype=np.int32) if mode == DBIAS_ORDERED else None
    values = dict(DBIAS_OFF, acc=score_view(sums, p), order=0 if order is None else order.data.ptr, mode=mode,
                  rows_broadcast=int(lq_ == 1), tiles_b=b_, tiles_h=h_, tiles_i=tiles_i)
    return DbiasPlan(sums, values, (sums,) if order is None else (sums, order))


def _key_major_plan(p: Problem, own: tuple, acc) -> DbiasPlan:
    """DBIAS_KEY_MAJOR (kernels_cu/bias_grad_t.cuh): the accumulator is stored [key][query], rows of
    a pitch of whole 32-byte sectors (each lane adds four queries of one key with one 16-byte vector
    reduction, two lanes fill a sector; queries past Lq inside a group add zeros into the padding),
    and seen by the kernel and by :meth:`DbiasPlan.result` as the bias's own (B', H', Lq', Lk) through
    a transposed view. A one-row bias (Lq' = 1) is one row of keys, with unit key stride."""
    b_, h_, lq_, lk_ = own
    pitch = 1 if lq_ == 1 else -(-lq_ // 8) * 8
    store = p.xp.zeros((b_, h_, lk_, pitch), dtype=acc)
    sums = store[..., :lq_].swapaxes(-1, -2)
    values = dict(DBIAS_OFF, acc=score_view(sums, p), mode=DBIAS_KEY_MAJOR, rows_broadcast=int(lq_ == 1))
    return DbiasPlan(sums, values, (store,))
