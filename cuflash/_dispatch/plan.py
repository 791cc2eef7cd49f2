"""A call's plan: the list of kernels it launches (each with its grid), the buffers it allocates,
its params struct with the array addresses left to fill, and its tensor maps. Forward and backward
alike are lists, chosen once (:mod:`cuflash._dispatch.select`) and replayed by
:mod:`cuflash._runtime.launch`.

Plans are memoised. A call without masking options repeats, in a training or sampling loop, with
the same shapes, strides, dtypes and options: its plan differs from the last one only in the array
addresses (five in a forward, eleven in a backward). :func:`forward` and :func:`backward` keep the
plan under the call's signature (``options.Call.signature``, which holds everything the choice reads)
together with the device hooks that tests and benchmarks replace; a later call with that signature
allocates what the first allocated, writes its addresses into a copy of the params, re-points the
Hopper kernels' tensor maps and launches the same list. A call with a masking option (bias, mask,
window, block layout, dropout, seed) has no signature: its params point at arrays built from the
options, so it is planned afresh. The memo is a cache: a plan is a pure function of its key.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

import numpy as np

from .._runtime import device, tma
from .._runtime.launch import KernelLaunch, run
from .._runtime.params import DBIAS_OFF, MASK_OFF, PACKERS, HostArg, as_float32, bwd_params, fwd_params
from ..semantics import LOG2E, acc_dtype, band_limits
from . import masking as masking_
from .model import MAX_GRID_X, SCORING_FAMILIES, head_bucket, takes_linear_bias
from .packed import Spans, device_table
from .select import (CACHES_OF_CHOICES, TF32_BWD_FAMILIES, backward_variants, ctas_per_sm,
                     DECODE_ROWS, forward_choice, packed_backward_variants, packed_variant, row_class, SPLIT_FILL,
                     SPLIT_MIN_KEYS, query_groups_in_two_passes, split_count, split_variants, takes_plain_mods, vec_chunk,
                     with_mods)

MAX_PLANS = 256
"""Plans kept per direction; a loop over more signatures than this re-plans (no LRU bookkeeping)."""

TMA_STORE_O_HEAD = 128
"""The 16-bit Hopper forward stores O through its tensor map from this head dim on
(``FwdWgmmaTraits::TMA_STORE_O``); below it, and in the float32 one, O is stored element by
element and its map is not encoded."""

_FWD_ARRAYS = ("q", "k", "v", "out", "lse")
_BWD_ARRAYS = ("q", "k", "v", "out", "dout", "lse", "dsum", "dq_acc", "dq", "dk", "dv")
_FWD_ADDRESSES = tuple(PACKERS["FwdParams"].offset(f"{name}.ptr") for name in _FWD_ARRAYS)
_FWD_QUEUE = (PACKERS["FwdParams"].offset("block_queue"),)
_FWD_PARTIALS = tuple(PACKERS["FwdParams"].offset(f"{name}.ptr") for name in ("out_partial", "lse_partial"))
_FWD_KEY_LENGTHS = (PACKERS["FwdParams"].offset("mask.key_lengths"),)
_FWD_SPLIT_COUNTERS = (PACKERS["FwdParams"].offset("split_counters"),)
_FWD_PAGE_TABLE = (PACKERS["FwdParams"].offset("mask.page_table"),)


class PagesNotReadInPlace(ValueError):
    """The kernel a paged-cache call takes cannot read these pages in place (:func:`_reads_pages`): the
    caller gathers them (cuflash.kvcache)."""


PERIODIC_BAND_FAMILIES = ("fwd_mma", "fwd_decode")
"""The split forwards whose band reads a packed GQA row's position as row % Lq (MaskParams::band_period): the
decoding kernel and the 16-bit portable split twin (flash_fwd_mma.cu, PERIODIC)."""
PAGED_FAMILIES = ("fwd_mma", "fwd_decode")
"""The split forwards whose K/V loader reads a paged cache (kernels_cu/tile_io.cuh, load_paged_rows): the 16-bit
split twin and the decoding kernel (every dtype); the float32 split twin's tiles spill 8-160 bytes with the page
lookups and the float64 one has its own loader, so their pages are gathered."""
_BWD_ADDRESSES = tuple(PACKERS["BwdParams"].offset(f"{name}.ptr") for name in _BWD_ARRAYS)


def scale_folds(scale: float) -> bool:
    """Whether the plain kernels can take ``scale``: they fold ``scale * log2(e)`` (as float32)
    into the exponential, which needs it positive and normal (``ScoreMod::scores_stay_raw`` in
    kernels_cu/score_mod.cuh). Any other scale runs on the EXTRA variant, which scales first."""
    return as_float32(scale * LOG2E) >= float(np.finfo(np.float32).tiny)


def vec_loads_ok(d: int, dv: int, *arrays) -> bool:
    """16-byte cp.async loads: rows of whole 16-byte chunks (8 16-bit or 2 fp64 elements, ``vec_chunk``), a
    16-byte aligned base, and batch, head and row strides of whole chunks (every row's start 16-byte aligned:
    heads of (L, H, 68)-element rows sliced to 64 lie 136 bytes apart) where that dimension has more than one
    entry."""
    chunk = vec_chunk(arrays[0].itemsize)
    return (d % chunk == 0 and dv % chunk == 0
            and all(x.data.ptr % 16 == 0 and all((stride // x.itemsize) % chunk == 0
                                                 for stride, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)
                    for x in arrays))


def _without_addresses(params: HostArg, offsets: tuple) -> bytes:
    """A params struct's bytes with the array addresses at ``offsets`` zero: a plan's template."""
    template = bytearray(params.data)
    for offset in offsets:
        template[offset:offset + 8] = bytes(8)
    return bytes(template)


class _Maps:
    """A plan's tensor maps: (array name, box rows) for each map (None: a map the kernel does not
    read), encoded on the first call and re-pointed on later ones where the driver can."""

    __slots__ = ("specs", "encoded")

    def __init__(self, specs: tuple):
        self.specs = specs
        self.encoded: Optional[bytes] = None

    def for_arrays(self, arrays: dict) -> HostArg:
        chosen = [None if name is None else arrays[name] for name, _ in self.specs]
        if self.encoded is not None:
            maps = tma.readdressed(self.encoded, chosen)
            if maps is not None:
                return maps
        maps = tma.maps_of(self.specs, arrays)
        if maps is None:   # the planner checked the layouts; only a driver without an encoder gets here
            raise RuntimeError("the driver has no tensor-map encoder (cuTensorMapEncodeTiled)")
        self.encoded = bytes(maps.data)
        return maps


# ------------------------------------------------------------------ forward

@dataclass
class ForwardPlan:
    """A forward call's kernels (one, or a split-KV forward's partial kernel and combine kernel), its
    outputs' shapes and dtypes, its params with the array addresses (and the block queue's) zero, its
    tensor maps, whether it takes a block queue, the split-KV partial buffers' shapes (None unsplit)
    and the arrays its params point into (masking)."""

    device: int
    kernels: Tuple[KernelLaunch, ...]
    out_shape: Tuple[int, ...]
    lse_shape: Tuple[int, ...]
    out_dtype: object
    lse_dtype: object
    params: bytes
    maps: Optional[_Maps]
    queue: bool
    partial_shapes: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
    keep_alive: tuple = field(default=(), repr=False)
    partial_only: bool = False   # the result is the partial buffers' one split (accumulator precision)
    key_lengths: bool = False    # each batch entry's key count comes with the call (MaskParams::key_lengths)
    paged: bool = False          # K and V are pages, read through the call's page table
    counters: int = 0            # the decoding kernel's combine in its last split: query blocks counted


def plan_forward(p, opts, precision: str, num_splits: Optional[int] = None, accumulator_out: bool = False,
                 key_lengths: bool = False, pages: Optional[Tuple[int, int]] = None,
                 layouts: Optional[dict] = None) -> ForwardPlan:
    """The forward plan of a validated call (``p``: :class:`cuflash.options.Problem` on CuPy with
    keys and outputs, ``opts``: its :class:`cuflash.options.Options`). ``num_splits``: the split-KV
    forward's key splits (None: :func:`select.split_count` decides; 1: unsplit). ``accumulator_out``:
    out in the accumulator type (float32; float64 for float64) for results merged again later
    (cuflash.distributed): float32 and float64 calls plan as usual; 16-bit ones take the Hopper forward's
    ``acc_out`` twin where the call takes that kernel without EXTRA or user modifications, else the
    split-KV partial kernel over one split. ``key_lengths``: each batch entry
    attends its own number of keys (an int32 array the call passes), the band aligned to its own end:
    the split-KV kernels, which read them (ScoreMod's PER_SEQ), with as many splits as chosen (1 included).
    ``pages`` ``(page_size, pages_per_seq, num_pages)``: K and V are a paged cache (their views' batch stride steps
    from page to page) read through a page table the call passes; ValueError where the kernel's loader
    cannot (:data:`PAGED_FAMILIES`, load_paged_rows' layout). ``layouts``: the byte strides of the outputs the
    caller gives :func:`execute_forward`, "out" (4) and "lse" (3), for an unsplit plan (``num_splits=1``; packed
    sequences of equal lengths write their packed outputs so); default contiguous ones it allocates."""
    q, k, v = p.q, p.k, p.v
    if layouts and (num_splits != 1 or accumulator_out or key_lengths):
        raise ValueError("output layouts are for unsplit forwards (num_splits=1) into the call's dtype")
    d, dv = p.d, p.dv
    masking = masking_.kernel_masking(p, opts)
    extra = masking.extra or not scale_folds(p.scale)
    head = head_bucket(max(d, dv))
    band = masking.band is not None and not _band_is_full(masking.band, p.lq, p.lk)
    smem_limit = device.smem_limit()
    variant, portable = forward_choice(p.dtype, head, band, extra, vec_loads_ok(d, dv, q, k, v),
                                       row_class(head, p.lk, band), device.compute_capability(), smem_limit,
                                       precision)
    if opts.mods is not None:
        if not extra:   # score modifications alone: the plain Hopper forward, else the EXTRA portable one
            variant_x, portable = forward_choice(p.dtype, head, band, True, vec_loads_ok(d, dv, q, k, v),
                                                 row_class(head, p.lk, band), device.compute_capability(),
                                                 smem_limit, precision)
            if not takes_plain_mods(variant):
                variant = variant_x
        prelude = _mods_prelude(p, opts)
        variant, portable = _with_linear_bias(variant, _linear_prelude(p, opts, masking, extra), prelude), \
            with_mods(portable, prelude)
    out_shape, lse_shape = (p.batch, p.heads_q, p.lq, dv), (p.batch, p.heads_q, p.lq)
    lse_dtype = acc_dtype(p.dtype)
    accumulator_out = accumulator_out and np.dtype(q.dtype) != np.dtype(lse_dtype)
    masked = extra or opts.mods is not None   # an option that reads a row's head: no packed GQA rows
    pack = _gqa_packing(p, masked, band, q, portable, smem_limit)
    one_split_decodes = not layouts and p.lk >= SPLIT_MIN_KEYS and _one_split_decodes(p, portable, pack, smem_limit)
    if accumulator_out and one_split_decodes:   # the unsplit call's kernel, its result before the rounding
        return _plan_split_forward(p, masking, masked, band, portable, 1, out_shape, lse_shape, lse_dtype,
                                   smem_limit, partial_only=True)
    if accumulator_out and not (variant.family == "fwd_wgmma" and not extra and opts.mods is None
                                and _maps_fit(masking, q, k, v)):
        return _plan_split_forward(p, masking, extra or band or opts.mods is not None, False, portable, 1,
                                   out_shape, lse_shape, lse_dtype, smem_limit, partial_only=True)
    if accumulator_out:   # the Hopper forward's twin that writes O in float32 (no O tensor map), unsplit
        variant, num_splits = replace(variant, acc_out=True), 1
    splits = _auto_splits(p, portable, pack, smem_limit) if num_splits is None else num_splits
    if key_lengths:
        if extra:   # only the split kernels without EXTRA read the lengths (ScoreMod's PER_SEQ)
            raise ValueError("per-sequence key lengths take no masking option and a positive scale")
        values = masking.values if pages is None else dict(masking.values, page_size=pages[0],
                                                                         pages_per_seq=pages[1], num_pages=pages[2])
        plan = _plan_split_forward(p, replace(masking, values=values), extra, band, portable, splits, out_shape,
                                   lse_shape, lse_dtype, smem_limit)
        if pages is not None and not _reads_pages(plan.kernels[0].variant, q.itemsize, p.k, p.v, pages[0]):
            raise PagesNotReadInPlace(f"the {plan.kernels[0].variant.family} split kernel reads no such paged cache")
        return replace(plan, key_lengths=True, paged=pages is not None,
                       params=_without_addresses(HostArg(plan.params), _FWD_KEY_LENGTHS + _FWD_PAGE_TABLE))
    if splits > 1 or one_split_decodes:
        return _plan_split_forward(p, masking, masked, band, portable, splits, out_shape, lse_shape, lse_dtype,
                                   smem_limit)
    maps = None
    if variant.arch == "sm90a":
        # The Hopper kernels load through tensor maps and read a bias by 16-byte chunks of its rows;
        # any other call, EXTRA or not, takes the portable kernel of the same GPU.
        if _maps_fit(masking, q, k, v):
            store_out = variant.family == "fwd_wgmma" and head >= TMA_STORE_O_HEAD and not variant.acc_out
            maps = _Maps(tma.fwd_map_specs(variant.tile.block_m, variant.tile.block_n, store_out))
        else:
            variant = portable
    blocks = variant.grid(p.batch, p.heads_q, p.group, p.lq, p.lk)
    grid = blocks if variant.schedule == "block" else min(blocks, device.sm_count())
    out_dtype = lse_dtype if variant.acc_out else q.dtype
    layouts = layouts or {}
    out_view, lse_view = (_Strided(shape, layouts[name], np.dtype(dtype).itemsize) if name in layouts
                          else _Strided.contiguous(shape, dtype)
                          for name, shape, dtype in (("out", out_shape, out_dtype), ("lse", lse_shape, lse_dtype)))
    params = fwd_params(q, k, v, out_view, lse_view, group=p.group,
                        scale=p.scale, mask=masking.values)
    return ForwardPlan(q.data.device_id, (KernelLaunch(variant, grid, maps is not None),), out_shape, lse_shape,
                       out_dtype, lse_dtype, _without_addresses(params, _FWD_ADDRESSES + _FWD_QUEUE), maps,
                       variant.schedule == "queue", None, masking.keep_alive)


def _maps_fit(masking, q, k, v) -> bool:
    """Whether the Hopper forward can take the call's arrays: tensor maps describe q, k and v and a bias is
    read by 16-byte chunks of its rows."""
    return masking.bias_in_chunks and tma.tma_ok(q, k, v) and tma.can_encode()


def _linear_prelude(p, opts, masking, extra: bool) -> str:
    """The linear bias's prelude (cuflash.mods.Mods.linear_prelude) where a 16-bit call's modifications are one
    such bias (alibi), it has no EXTRA option and its band shows no query a key after it (hi <= 0: causal
    aligned at the start, or at the end with Lq >= Lk, or a window with no keys to the right), so that the bias
    is slope (kv - q) at every visible score; else ""."""
    if (extra or not opts.mods.linear or p.dtype not in ("float16", "bfloat16") or masking.band is None
            or masking.band[1] > 0):
        return ""
    return opts.mods.linear_prelude()


def _with_linear_bias(v, linear: str, prelude: str):
    """``v`` with the linear bias's prelude where it is one of the kernels that add it (model.takes_linear_bias;
    its tile and schedule kept: no per-element code), else with the call's modifications (select.with_mods)."""
    if linear and takes_linear_bias(v):
        return replace(v, prelude=linear)
    return with_mods(v, prelude)


def _mods_prelude(p, opts) -> str:
    """The source of a call's user modifications placed before its kernels' (cuflash.mods); the
    special-function approximations for 16-bit inputs."""
    return opts.mods.prelude(p.dtype in ("float16", "bfloat16"))


def _reads_pages(v, itemsize: int, k, v_pages, page_size: int) -> bool:
    """Whether a split variant's K/V loader reads these pages (tile_io.cuh: PageCursor::FITS, 16-byte
    copies; one address a row for K and V, so equal strides; pages of a power-of-two size, found by a
    shift; a page's stride and every row's offset within a page (row, head, column) in 32 bits)."""
    if v.family not in PAGED_FAMILIES or v.extra or not v.vec or page_size & (page_size - 1):
        return False
    page_stride, head_stride, row_stride, _ = (abs(s) // itemsize for s in k.strides)
    in_page = (k.shape[1] - 1) * head_stride + (page_size - 1) * row_stride + max(k.shape[3], v_pages.shape[3])
    if k.strides != v_pages.strides or max(page_stride, in_page) >= 2 ** 31:
        return False
    per_row = v.head // (16 // itemsize)
    return v.threads % per_row == 0 and v.tile.block_n % (v.threads // per_row) == 0


def _fills_gpu(p, pack: int) -> bool:
    """Whether a split call's decoding blocks (16 packed rows each) fill the GPU before any split
    (:data:`SPLIT_FILL` of its SMs): its decoding kernel then takes a tile of several CTAs an SM
    (select.split_variants)."""
    rows, heads = p.lq * pack, p.heads_q // pack
    return p.batch * heads * -(-rows // DECODE_ROWS) >= SPLIT_FILL * device.sm_count()


def _decodes(p, portable, pack: int, smem_limit: int) -> bool:
    """Whether a call's blocks (``pack`` query heads of Lq rows) take the decoding kernel on the split path."""
    return split_variants(portable, p.dv, smem_limit, p.lq * pack, _fills_gpu(p, pack))[0].family == "fwd_decode"


UNPACKED_ONE_SPLIT_ROWS = 16
"""Query rows up to which a block of one query head (no packed GQA) takes the decoding kernel over one split in
place of the unsplit kernels (H200, bf16, 32 heads, one query row, head dim 128, 8192 keys: B = 4 127 us against
129 for the Hopper forward, B = 16 487 against 511: benchmarks/bench_decode.py --quick's fourth row, with this
set to 0 for the Hopper forward)."""


def _one_split_decodes(p, portable, pack: int, smem_limit: int) -> bool:
    """Whether an unsplit call runs the decoding kernel over one split, which writes out and lse itself: packed
    GQA rows that the decoding kernel takes (each K/V byte read once, where the unsplit kernels read a K/V head
    once a query head; on a full GPU 0.99-1.02x cuDNN where splits measured 0.93-0.98x: H200, bf16, one query
    row of 4 heads, B = 32-132, 4096-16384 keys, benchmarks/split_counts.py --rows 64:4096:64,64:16384:128
    --counts 1,2,3), and blocks of one query head of at most :data:`UNPACKED_ONE_SPLIT_ROWS` rows."""
    return (pack > 1 or p.lq <= UNPACKED_ONE_SPLIT_ROWS) and _decodes(p, portable, pack, smem_limit)


def _auto_splits(p, portable, pack: int, smem_limit: int) -> int:
    """The key splits a call takes unasked: decoding-like calls only, whose (packed) query rows fit one
    block of the portable kernel over at least SPLIT_MIN_KEYS keys, split where their blocks leave the
    GPU idle (select.split_count); other calls keep the unsplit kernels (the Hopper forward where it
    applies). Unpacked blocks (one query head each) that give every SM one already stay unsplit: the
    split's partials and combine then cost more than a second CTA an SM gains (B=4, 32 heads, D=128,
    Lk=8192 on the H200: 127 us unsplit, 142 us in two splits; benchmarks/bench_decode.py --quick)."""
    rows, heads = p.lq * pack, p.heads_q // pack
    if rows > portable.tile.block_m or p.lk < SPLIT_MIN_KEYS:
        return 1
    blocks = portable.grid(p.batch, heads, 1, rows, p.lk)
    if pack == 1 and blocks >= SPLIT_FILL * device.sm_count():
        return 1
    partial = split_variants(portable, p.dv, smem_limit, rows, _fills_gpu(p, pack))[0]   # what a split call runs
    slots = device.sm_count() * ctas_per_sm(partial, smem_limit)
    key_tiles = -(-p.lk // partial.tile.block_n)
    # The 16-bit decoding kernel streams K/V at the HBM rate with one CTA an SM (benchmarks/split_counts.py: the
    # rule's count the fastest of those tried; more blocks than SMs take split_count's wave rule instead);
    # float32 and float64 wait on their instructions' latency and fill every CTA slot evenly (H200, one
    # query row of 4 heads, head dim 64, two CTAs an SM against one: float64 B=8, 32768 keys 87% / 58% of the HBM
    # peak; float32 B=1, 131072 keys, 264 CTAs 70%, 232 58%: benchmarks/bench_decode.py --splits).
    streams = None
    if partial.family == "fwd_decode":
        streams = device.sm_count() if partial.dtype in ("float16", "bfloat16") else slots
    # One split of packed rows is the decoding kernel writing out and lse itself (_one_split_decodes); of
    # packed rows on another partial kernel, the unsplit kernel, which reads each K/V head once a query head.
    return split_count(partial.grid(p.batch, heads, 1, rows, p.lk), key_tiles, slots, sms=streams,
                       min_splits=2 if pack > 1 and partial.family != "fwd_decode" else 1)


def _band_is_full(band: Tuple[int, int], lq: int, lk: int) -> bool:
    """Whether a causal / window band lets every query see every key (e.g. one query aligned to the
    bottom right): then no kernel needs it."""
    lo, hi = band
    return lo <= -(lq - 1) and hi >= lk - 1


def _gqa_packing(p, masked: bool, band: bool, q, portable, smem_limit: int) -> int:
    """How many query heads of a K/V head a split-KV forward packs into one tile's rows (the heads as
    consecutive rows of one (batch, K/V head): each K/V byte read once for all of them): the largest divisor
    of the group whose rows (Lq each) fit one block of the portable kernel (so that the call can still split
    its keys, _auto_splits), where no option depends on a row's head (no bias, mask, block layout, dropout or
    user modification) and q's heads lie row after row in memory (head stride = Lq row strides); with a
    causal band or a window (they read a row's position) only where the partial kernel reads a row's position
    as row % Lq (MaskParams::band_period): the decoding kernel and the 16-bit portable split twin; else 1."""
    if p.group == 1 or masked or q.strides[1] != p.lq * q.strides[2]:
        return 1
    for pack in (n for n in range(p.group, 1, -1) if p.group % n == 0 and p.lq * n <= portable.tile.block_m):
        partial = split_variants(portable, p.dv, smem_limit, p.lq * pack)[0]
        if not band or (not partial.extra and partial.family in PERIODIC_BAND_FAMILIES):
            return pack
    return 1


def _plan_split_forward(p, masking, masked: bool, band: bool, portable, splits: int, out_shape, lse_shape,
                        lse_dtype, smem_limit: int, partial_only: bool = False) -> ForwardPlan:
    """A split-KV forward: the portable kernel's partial twin over ``splits`` ranges of key tiles, then
    the combine kernel (kernels_cu/flash_fwd_combine.cu); the decoding kernel merges a query block's
    splits in its last split's CTA instead (FwdParams::split_counters: one launch, no combine kernel's
    start behind the partials). With packed GQA (:func:`_gqa_packing`) the kernels see (B, Hk, group x Lq)
    query rows; out and lse are laid out alike either way. ``partial_only`` (one split): the partial kernel
    alone, its buffers the result."""
    q, k, v = p.q, p.k, p.v
    pack = _gqa_packing(p, masked, band, q, portable, smem_limit)
    b, heads, rows = p.batch, p.heads_q // pack, p.lq * pack
    values = dict(masking.values, band_period=p.lq) if band and pack > 1 else masking.values
    partial, combine = split_variants(portable, p.dv, smem_limit, rows, _fills_gpu(p, pack))
    qv = _Strided((b, heads, rows, p.d), (q.strides[0], q.strides[1] * pack, q.strides[2], q.strides[3]), q.itemsize)
    out_view = _Strided.contiguous((b, heads, rows, p.dv), q.dtype)
    lse_view = _Strided.contiguous((b, heads, rows), lse_dtype)
    key_tiles = -(-p.lk // partial.tile.block_n)
    split_tiles = -(-key_tiles // splits)
    dv_pad = p.dv + p.dv % 2        # the partial kernels write column pairs
    partial_shapes = ((splits * b, heads, rows, dv_pad), (splits * b, heads, rows))
    params = fwd_params(qv, k, v, out_view, lse_view, group=p.group // pack, scale=p.scale, mask=values,
                        num_splits=splits, split_tiles=split_tiles,
                        out_partial=_Strided.contiguous(partial_shapes[0], lse_dtype),
                        lse_partial=_Strided.contiguous(partial_shapes[1], lse_dtype))
    blocks = partial.grid(b, heads, 1, rows, p.lk)
    kernels = (KernelLaunch(partial, splits * blocks), KernelLaunch(combine, combine.grid(b, heads, 1, rows, p.lk)))
    merged_in_partial = partial.family == "fwd_decode" and not partial_only
    if merged_in_partial and splits == 1:   # no partial buffers: the decoding kernel writes out and lse
        partial_shapes = None
    return ForwardPlan(q.data.device_id, kernels[:1] if partial_only or merged_in_partial else kernels, out_shape,
                       lse_shape, q.dtype, lse_dtype,
                       _without_addresses(params, _FWD_ADDRESSES + _FWD_QUEUE + _FWD_PARTIALS), None, False,
                       partial_shapes, masking.keep_alive, partial_only,
                       counters=blocks if merged_in_partial and splits > 1 else 0)


class _Strided:
    """An array's layout without its memory, as :func:`cuflash._runtime.params.view` reads it (the
    address is written at run time): a view the kernels take of an array (packed GQA's query rows) or
    a buffer not yet allocated."""

    class _Data:
        ptr = 0

    data = _Data()

    def __init__(self, shape: tuple, strides: tuple, itemsize: int):
        self.shape, self.strides, self.itemsize, self.ndim = tuple(shape), tuple(strides), itemsize, len(shape)

    @classmethod
    def contiguous(cls, shape: tuple, dtype) -> "_Strided":
        itemsize = np.dtype(dtype).itemsize
        strides, step = [], itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(shape, tuple(reversed(strides)), itemsize)


_PARTIAL_ALIGN = 256
"""Bytes between the starts of the split forward's partial O and lse in their one allocation."""


def _partial_memory(cupy, shapes, dtype):
    """One pool allocation for the split forward's partial O and lse (``shapes``): (its memory pointer,
    lse's byte offset). Raw memory, no arrays: a decoding call's host time is part of its time."""
    itemsize = np.dtype(dtype).itemsize
    lse_at = -(-math.prod(shapes[0]) * itemsize // _PARTIAL_ALIGN) * _PARTIAL_ALIGN
    return cupy.cuda.alloc(lse_at + math.prod(shapes[1]) * itemsize), lse_at


_COUNTERS: dict = {}
"""(device, stream) -> the decoding kernel's split counters: zeroed once, left zero by every launch (each
query block's last split resets its own), so that one stream's launches, which run in order, share them;
another stream has its own."""


def _split_counters(cupy, device_id: int, count: int):
    """At least ``count`` zeroed int32 counters for the current stream of ``device_id``."""
    key = (device_id, cupy.cuda.get_current_stream().ptr)
    counters = _COUNTERS.get(key)
    if counters is None or counters.size < count:
        counters = _COUNTERS[key] = cupy.zeros(max(count, 4096), dtype=cupy.int32)
    return counters


def execute_forward(plan: ForwardPlan, q, k, v, key_lengths=None, page_table=None, out=None, lse=None):
    """(out, lse) of ``plan`` run on ``q``, ``k``, ``v`` (4-D); with ``plan.partial_only`` out in the
    accumulator type (a view of the partial buffer without its padding column); ``key_lengths`` (int32
    (B,)) and ``page_table`` (int32 (B, pages_per_seq)) for a plan that takes them; ``out`` and ``lse``
    given (the plan's ``layouts``) or new contiguous arrays."""
    cupy, _ = device.cupy_modules()
    with device.on_device(plan.device):
        params = HostArg(plan.params)
        if plan.partial_only:   # out and lse are the partial buffers (their addresses stay 0 in the params)
            out = lse = None
            params.put_addresses(_FWD_ADDRESSES[:3], (q.data.ptr, k.data.ptr, v.data.ptr))
        else:
            if out is None:
                out = cupy.empty(plan.out_shape, dtype=plan.out_dtype)
                lse = cupy.empty(plan.lse_shape, dtype=plan.lse_dtype)
            params.put_addresses(_FWD_ADDRESSES, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr))
        if plan.queue:   # a zeroed counter a launch: CTAs of two launches never share one
            queue = cupy.zeros(1, dtype=cupy.int32)
            params.put_addresses(_FWD_QUEUE, (queue.data.ptr,))
        if plan.partial_shapes is not None:   # split-KV: every split writes its whole slice, no zeroing
            partials, lse_at = _partial_memory(cupy, plan.partial_shapes, plan.lse_dtype)
            params.put_addresses(_FWD_PARTIALS, (partials.ptr, partials.ptr + lse_at))
        if plan.counters:
            params.put_addresses(_FWD_SPLIT_COUNTERS, (_split_counters(cupy, plan.device, plan.counters).data.ptr,))
        if plan.key_lengths:
            params.put_addresses(_FWD_KEY_LENGTHS, (key_lengths.data.ptr,))
        if plan.paged:
            params.put_addresses(_FWD_PAGE_TABLE, (page_table.data.ptr,))
        maps = None if plan.maps is None else plan.maps.for_arrays({"q": q, "k": k, "v": v, "out": out})
        run(plan.kernels, params, maps)
    if plan.partial_only:   # (B, Hk, group x Lq) packed rows are (B, Hq, Lq) rows in memory
        out_partial = cupy.ndarray(plan.partial_shapes[0], plan.lse_dtype, partials)
        lse_partial = cupy.ndarray(plan.partial_shapes[1], plan.lse_dtype, partials + lse_at)
        return out_partial.reshape(plan.out_shape[:3] + (-1,))[..., :plan.out_shape[3]], \
            lse_partial.reshape(plan.lse_shape)
    return out, lse


# ------------------------------------------------------------------ packed sequences

PACKED_MAX_ROWS = 2 ** 30
"""Packed rows a call may have: the band's unbounded sides (+-2**30) stay out of reach of every row and
key after a sequence's shift (kernels_cu/score_mod.cuh, the PackedBlock constructor)."""

_FWD_PACKED_BLOCKS = (PACKERS["FwdParams"].offset("mask.packed_blocks"),)
_BWD_PACKED_BLOCKS = (PACKERS["BwdParams"].offset("mask.packed_blocks"),)
_PACKED_COUNT = {_FWD_PACKED_BLOCKS: PACKERS["FwdParams"].offset("mask.packed_count"),
                 _BWD_PACKED_BLOCKS: PACKERS["BwdParams"].offset("mask.packed_count")}


def _packed_mask(p, opts, *arrays) -> Optional[dict]:
    """MaskParams of a packed call, or None where the packed kernels cannot take it: EXTRA options, a
    scale that does not fold, too many rows, or rows that are not unit-stride (validation's copies of
    such arrays are not what a packed plan would address). The band is the one through (0, 0), moved by
    each sequence's lk - lq where it is aligned to the end (``band_from_end``)."""
    q, k = arrays[0], arrays[1]
    if opts.extra or not scale_folds(p.scale) or max(q.shape[0], k.shape[0]) >= PACKED_MAX_ROWS \
            or not all(x.shape[2] == 1 or x.strides[2] == x.itemsize for x in arrays):
        return None
    unbounded = PACKED_MAX_ROWS - 2   # band_limits clamps the open sides to -(lq + 1) and lk + 1
    band = band_limits("top_left" if p.causal else False, opts.window, unbounded, unbounded)
    lo, hi = band if band is not None else (0, 0)
    return dict(MASK_OFF, band_lo=lo, band_hi=hi, band_from_end=int(p.causal == "bottom_right"),
                band=band is not None)


def _packed_layout(rows: int, heads: int, cols: int, itemsize: int, strides=None) -> "_Strided":
    """A packed (total, H, D) layout (strides in bytes; default contiguous) as the (1, H, total, D) view
    whose batch stride is one row (a block's batch index is its sequence's first row: scheduler.cuh,
    PackedBlock)."""
    s0, s1, s2 = strides if strides is not None else (heads * cols * itemsize, cols * itemsize, itemsize)
    return _Strided((1, heads, rows, cols), (s0, s1, s0, s2), itemsize)


def _packed_rows_vector(heads: int, rows: int, dtype, strides=None) -> "_Strided":
    """An (H, total) vector (lse, dsum; byte ``strides`` of heads and rows, default contiguous) as the
    (1, H, total) view whose batch stride is one row."""
    it = np.dtype(dtype).itemsize
    s_head, s_row = strides if strides is not None else (rows * it, it)
    return _Strided((1, heads, rows), (s_row, s_head, s_row), it)


def _packed_accumulator(heads: int, rows: int, cols: int, dtype, strides=None) -> "_Strided":
    """The (1, H, total, cols) dQ accumulator (byte ``strides`` of heads and rows, default contiguous) as the
    view whose batch stride is one row (the portable dK/dV kernels address a packed block's rows from its
    sequence's first; the convert kernel reads batch 0)."""
    it = np.dtype(dtype).itemsize
    s_head, s_row = strides if strides is not None else (rows * cols * it, cols * it)
    return _Strided((1, heads, rows, cols), (s_row, s_head, s_row, it), it)


def _packed_view(x):
    """A packed (total, H, D) array as the (1, H, total, D) view whose tensor map the Hopper kernels read
    (kernels_cu/scheduler.cuh, TmaRows: rows counted from the packed tensor's first)."""
    return x.transpose(1, 0, 2)[None]


def _launch_packed(kernel, table, heads: int, params: HostArg, offsets: tuple,
                   maps: Optional[HostArg] = None) -> None:
    """Launch a PACKED kernel over a block table on the device (:func:`packed.device_table`; entries x heads
    blocks: a CTA a block, or one an SM walking them, from a zeroed counter under the "queue" schedule), the
    table's address and the block count written into the params first (the driver copies them at the
    launch), with its tensor maps where it reads some."""
    cupy, _ = device.cupy_modules()
    if len(table) == 0:
        return
    blocks = len(table) * heads
    if blocks > MAX_GRID_X:
        raise ValueError(f"{blocks} thread blocks exceed the grid limit {MAX_GRID_X}: fewer packed rows a call")
    params.put_addresses(offsets, (table.data.ptr,))
    params.put_int32((_PACKED_COUNT[offsets],), (blocks,))
    if kernel.schedule == "queue":   # a zeroed counter a launch
        queue = cupy.zeros(1, dtype=cupy.int32)
        params.put_addresses(_FWD_QUEUE, (queue.data.ptr,))
    grid = blocks if kernel.schedule == "block" else min(blocks, device.sm_count())
    run((KernelLaunch(kernel, grid, maps is not None),), params, maps)


@dataclass
class PackedForwardPlan:
    """A forward over packed sequences: the PACKED kernel, whether a sequence's last block comes first
    (causal), its params without addresses, its outputs' shapes and dtypes, and its tensor maps (the
    Hopper kernel's; None for the portable ones)."""

    device: int
    variant: object
    reverse: bool
    params: bytes
    out_shape: Tuple[int, ...]
    lse_shape: Tuple[int, ...]
    out_dtype: object
    lse_dtype: object
    maps: Optional[_Maps] = None


def plan_packed_forward(q, k, v, p, opts, precision: str, longest_keys: Optional[int] = None,
                        layouts: Optional[dict] = None) -> Optional[PackedForwardPlan]:
    """The forward plan of packed sequences (cuflash.varlen): ``q (total_q, Hq, D)``, ``k``, ``v``
    (total_k, Hk, D / Dv) CuPy arrays, ``p`` and ``opts`` their validated problem and options (the
    packed arrays seen as one batch entry). None where no packed kernel takes the call (:func:`_packed_mask`;
    the tensor-core forwards of float16, bfloat16, float64 and float32 (3xTF32) have one,
    :func:`select.packed_variant`):
    its sequences then run one dense launch each. The Hopper kernel reads its arrays through tensor maps
    where they can describe them, else the portable one runs; its tile is the one the dense forward takes for
    ``longest_keys`` keys (the longest sequence's; default the packed total): the short-rows tile where every
    sequence's query blocks visit few keys. ``layouts``: the byte strides of the outputs the caller gives
    :func:`execute_packed_forward`, "out" (rows, heads, columns) and "lse" (heads, rows); default contiguous
    ones it allocates."""
    mask = _packed_mask(p, opts, q, k, v)
    if mask is None:
        return None
    head, band = head_bucket(max(p.d, p.dv)), mask.pop("band")
    smem_limit = device.smem_limit()
    rows = row_class(head, p.lk if longest_keys is None else longest_keys, band)
    choice, portable = forward_choice(p.dtype, head, band, False, vec_loads_ok(p.d, p.dv, p.q, p.k, p.v), rows,
                                      device.compute_capability(), smem_limit, precision)
    variant, maps = packed_variant(choice, portable, smem_limit), None
    if variant is not None and variant.arch == "sm90a":
        if tma.tma_ok(*(_packed_view(x) for x in (q, k, v))) and tma.can_encode():
            store_out = variant.family == "fwd_wgmma" and head >= TMA_STORE_O_HEAD
            maps = _Maps(tma.fwd_map_specs(variant.tile.block_m, variant.tile.block_n, store_out))
        else:
            variant = packed_variant(portable, portable, smem_limit)
    if variant is None:
        return None
    acc, tq, tk, hq, hk, it = acc_dtype(p.dtype), q.shape[0], k.shape[0], p.heads_q, k.shape[1], q.itemsize
    layouts = layouts or {}
    params = fwd_params(_packed_layout(tq, hq, p.d, it, q.strides), _packed_layout(tk, hk, p.d, it, k.strides),
                        _packed_layout(tk, hk, p.dv, it, v.strides), _packed_layout(tq, hq, p.dv, it, layouts.get("out")),
                        _packed_rows_vector(hq, tq, acc, layouts.get("lse")), group=p.group, scale=p.scale, mask=mask)
    return PackedForwardPlan(q.data.device_id, variant, p.causal is not None,
                             _without_addresses(params, _FWD_ADDRESSES + _FWD_PACKED_BLOCKS), (tq, hq, p.dv),
                             (hq, tq), q.dtype, acc, maps)


def execute_packed_forward(plan: PackedForwardPlan, q, k, v, spans: Spans, out=None, lse=None):
    """(out (total_q, Hq, Dv), lse (Hq, total_q)) of ``plan`` on packed ``q``, ``k``, ``v`` with the
    sequences ``spans``; ``out`` and ``lse`` given (the plan's ``layouts``) or new contiguous arrays. Every
    query row of a sequence is written: a sequence without keys gets 0 and -inf from its blocks, whose key
    range is empty."""
    cupy, _ = device.cupy_modules()
    with device.on_device(plan.device):
        table = device_table(spans, plan.variant.tile.block_m, "q", plan.reverse)
        if out is None:
            out = cupy.empty(plan.out_shape, dtype=plan.out_dtype)
            lse = cupy.empty(plan.lse_shape, dtype=plan.lse_dtype)
        params = HostArg(plan.params)
        params.put_addresses(_FWD_ADDRESSES, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr))
        maps = None if plan.maps is None else plan.maps.for_arrays(
            {name: _packed_view(x) for name, x in (("q", q), ("k", k), ("v", v), ("out", out))})
        _launch_packed(plan.variant, table, plan.out_shape[1], params, _FWD_PACKED_BLOCKS, maps)
    return out, lse


@dataclass
class PackedBackwardPlan:
    """A backward over packed sequences: dsum, then the PACKED dK/dV kernel over a key-major block table (or
    its two passes, dV then dK, over one table) and either the PACKED dQ kernel over a query-major one (each
    its own tile), or (the Hopper dK/dV
    kernel, which adds dQ into an fp32 accumulator through its tensor maps) the convert kernel; the params
    without addresses, and the accumulator's shape and the maps where there is one."""

    device: int
    kernels: Tuple[object, ...]   # (dsum, the dK/dV pass(es), dQ or convert) variants
    params: bytes
    acc_dtype: object
    reverse: bool
    dq_acc_shape: Optional[Tuple[int, ...]] = None
    maps: Optional[_Maps] = None


def plan_packed_backward(q, k, v, dout, out, p, opts, precision: str, deterministic: bool = True,
                         layouts: Optional[dict] = None) -> Optional[PackedBackwardPlan]:
    """The backward plan of packed sequences (cuflash.varlen) of CuPy arrays ``q``, ``k``, ``v``, ``dout``
    and ``out`` (packed (total, H, D)); None where no packed kernels take it (:func:`_packed_mask`;
    select.packed_backward_variants: the tensor-core kernels of float16, bfloat16, float64 and float32
    (3xTF32) at head dims up to 128 where they fit the GPU's shared memory; not ``deterministic``, the 16-bit
    Hopper wgmma dK/dV kernel where tensor maps describe the arrays, and float32's and float64's dK/dV kernels,
    each adding dQ into an fp32 / fp64 accumulator with atomics). ``layouts``: the byte strides of the
    buffers the caller gives :func:`execute_packed_backward`, "rows" (lse and dsum: heads, rows), "dq_acc"
    (heads, rows), "dq", "dk", "dv" (rows, heads, columns); default contiguous ones it allocates."""
    mask = _packed_mask(p, opts, q, k, v, dout, out)
    if mask is None:
        return None
    band = mask.pop("band")
    vec = vec_loads_ok(p.d, p.dv, p.q, p.k, p.v) and vec_loads_ok(p.d, p.dv, dout.transpose(1, 0, 2)[None])
    choose = functools.partial(packed_backward_variants, p.dtype, head_bucket(max(p.d, p.dv)), band, vec,
                               device.smem_limit(), deterministic=deterministic, precision=precision)
    kernels, maps = choose(cc=device.compute_capability()), None
    acc, tq, tk, hq, hk, it = acc_dtype(p.dtype), q.shape[0], k.shape[0], p.heads_q, k.shape[1], q.itemsize
    hopper = next((v_ for v_ in kernels or () if v_.family == "bwd_dkdv_wgmma"), None)
    if hopper is not None:
        if tma.tma_ok(*(_packed_view(x) for x in (q, dout, k, v))) and tma.can_encode():
            maps = _Maps(tma.bwd_map_specs(hopper.tile.block_m, hopper.tile.block_n))
        else:
            kernels = choose(cc=device.MIN_COMPUTE_CAPABILITY)
    if kernels is None:
        return None
    layouts = layouts or {}
    rows = _packed_rows_vector(hq, tq, acc, layouts.get("rows"))   # lse and dsum
    dq_acc_shape, dq_acc = None, None
    if kernels[-1].family == "bwd_convert_dq":   # dQ added with atomics: the (1, Hq, total, D) accumulator
        dq_acc_shape = dq_accumulator_shape(kernels, 1, hq, tq, p.d)
        dq_acc = _packed_accumulator(hq, tq, dq_acc_shape[-1], acc, layouts.get("dq_acc"))
    params = bwd_params(_packed_layout(tq, hq, p.d, it, q.strides), _packed_layout(tk, hk, p.d, it, k.strides),
                        _packed_layout(tk, hk, p.dv, it, v.strides), _packed_layout(tq, hq, p.dv, it, out.strides),
                        _packed_layout(tq, hq, p.dv, it, dout.strides), rows, rows, dq_acc,
                        _packed_layout(tq, hq, p.d, it, layouts.get("dq")), _packed_layout(tk, hk, p.d, it, layouts.get("dk")),
                        _packed_layout(tk, hk, p.dv, it, layouts.get("dv")), group=p.group, scale=p.scale, mask=mask)
    return PackedBackwardPlan(q.data.device_id, tuple(kernels), _without_addresses(params, _BWD_ADDRESSES), acc,
                              p.causal is not None, dq_acc_shape, maps)


def execute_packed_backward(plan: PackedBackwardPlan, dout, q, k, v, out, lse, spans: Spans, buffers=None,
                            rows_kernels=None):
    """(dq, dk, dv), packed like q, k, v, of ``plan`` with ``lse (Hq, total_q)`` in the accumulator dtype and
    the sequences ``spans``. Every row of a sequence is written: keys of a sequence without queries, and queries
    of one without keys, get 0 from their blocks, which see nothing (the Hopper plan's dq: its zeroed
    accumulator). ``buffers``: (dsum, dq_acc (zeroed) or None, dq, dk, dv) in the plan's ``layouts``, default new
    contiguous ones. ``rows_kernels(kernel)``: runs the row-wise dsum and convert kernels in place of
    their launch over the packed rows (a document mask's rows are a dense batch's: documents.py)."""
    cupy, _ = device.cupy_modules()
    dsum_kernel, *dkdv_passes, last = plan.kernels
    hq, hk, tq, tk = q.shape[1], k.shape[1], q.shape[0], k.shape[0]
    with device.on_device(plan.device):
        if buffers is None:
            dsum = cupy.empty((hq, tq), dtype=plan.acc_dtype)
            dq_acc = None if plan.dq_acc_shape is None else cupy.zeros(plan.dq_acc_shape, dtype=plan.acc_dtype)
            dq, dk, dv = (cupy.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
        else:
            dsum, dq_acc, dq, dk, dv = buffers
        addresses = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr, dsum.data.ptr,
                     0 if dq_acc is None else dq_acc.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr)
        params = HostArg(plan.params)
        params.put_addresses(_BWD_ADDRESSES, addresses)
        maps = None if plan.maps is None else plan.maps.for_arrays(
            dict({name: _packed_view(x) for name, x in (("q", q), ("dout", dout), ("k", k), ("v", v))},
                 dq_acc=dq_acc[..., :q.shape[2]]))

        def rows_kernel(kernel):
            if rows_kernels is not None:
                rows_kernels(kernel)
            elif tq:
                run((KernelLaunch(kernel, kernel.grid(1, hq, hq // hk, tq, tk)),), params)

        rows_kernel(dsum_kernel)
        for dkdv in dkdv_passes:   # one pass (dK and dV), or dV then dK: one key-major table
            _launch_packed(dkdv, device_table(spans, dkdv.tile.block_n, "k", False), hk, params, _BWD_PACKED_BLOCKS,
                           maps)
        if last.family == "bwd_convert_dq":
            rows_kernel(last)
        else:
            _launch_packed(last, device_table(spans, last.tile.block_m, "q", plan.reverse), hq, params,
                           _BWD_PACKED_BLOCKS)
    return dq, dk, dv


# ------------------------------------------------------------------ backward

@dataclass
class BackwardPlan:
    """A backward call's kernels in launch order, the buffers it allocates (dsum; the dQ
    accumulator, None on the deterministic path; dq, dk, dv), its params with the eleven array
    addresses zero, its tensor maps, and its dbias accumulator (masking calls only)."""

    device: int
    kernels: Tuple[KernelLaunch, ...]
    acc_dtype: object
    dsum_shape: Tuple[int, ...]
    dq_acc_shape: Optional[Tuple[int, ...]]
    grad_dtype: object
    grad_shapes: Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]
    params: bytes
    maps: Optional[_Maps]
    dbias: Optional[masking_.DbiasPlan] = None
    keep_alive: tuple = field(default=(), repr=False)
    param_grads: tuple = ()   # user modifications' trainable parameters: their gradient accumulators


def dq_accumulator_shape(kernels, b: int, hq: int, lq: int, d: int) -> Tuple[int, int, int, int]:
    """The shape of the atomic backward's fp32 dQ accumulator for a list of variants. The 16-bit
    tensor-core dK/dV kernel adds into 16 x 8 fragment tiles (atomics.cuh, dq_tile): rows up to whole
    steps of its tile, columns its head bucket, so that no reduction needs a test; the convert kernel
    reads them as tiles. The other kernels add row-major, rows padded to an even width (two columns at
    a time). Kernels read the accumulator's strides only, so they take the whole array (the Hopper
    kernel's tensor map the view ``[..., :d]``)."""
    tiled = next((v_ for v_ in kernels if v_.family == "bwd_dkdv_mma" and v_.atomic_dq), None)
    if tiled is not None:
        rows = -(-lq // tiled.tile.block_m) * tiled.tile.block_m
        return (b, hq, rows, tiled.head)
    return (b, hq, lq, d + d % 2)


def plan_backward(p, opts, dout, out, lse, deterministic: bool, precision: str, want_dbias: bool,
                  layouts: Optional[dict] = None) -> BackwardPlan:
    """The backward plan of a validated call: ``p`` the problem (4-D q, k, v), ``dout`` and ``out`` 4-D
    views and ``lse`` (B, Hq, Lq) in the accumulator dtype, as the kernels read them (their strides
    are in the params), ``want_dbias`` whether the call has a bias. ``layouts``: the byte strides of the
    gradients the caller gives :func:`execute_backward`, "dq", "dk" and "dv" (4 each); default contiguous
    ones it allocates."""
    q, k, v = p.q, p.k, p.v
    b, hq, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    masking = masking_.kernel_masking(p, opts, param_grads=True)
    acc = acc_dtype(p.dtype)
    extra = masking.extra or not scale_folds(p.scale)
    choose = functools.partial(backward_variants, p.dtype, head_bucket(max(d, dv)), band=masking.band is not None,
                               extra=extra, vec=vec_loads_ok(d, dv, q, k, v, dout), deterministic=deterministic,
                               smem_limit=device.smem_limit(), dbias=want_dbias, precision=precision)
    prelude = _mods_prelude(p, opts) if opts.mods is not None else ""
    linear = _linear_prelude(p, opts, masking, extra) if opts.mods is not None else ""
    variants = _with_mods_list(choose, device.compute_capability(), prelude, linear)
    hopper = next((v_ for v_ in variants if v_.family == "bwd_dkdv_wgmma"), None)
    # (the Hopper kernel at head dim 256 forms dS from a 16-bit P in another warpgroup: no modifications)
    if hopper is not None and not (masking.bias_in_chunks and tma.tma_ok(q, dout, k, v) and tma.can_encode()
                                   and not (prelude and hopper.head == 256)):
        variants, hopper = _with_mods_list(choose, device.MIN_COMPUTE_CAPABILITY, prelude, linear), None
    dq_acc_shape = None if deterministic else dq_accumulator_shape(variants, b, hq, lq, d)
    maps = None
    if hopper is not None:   # atomic dQ: the accumulator is row-major; its map covers [..., :d]
        maps = _Maps(tma.bwd_map_specs(hopper.tile.block_m, hopper.tile.block_n))
    dbias = None
    dbias_kernel = next((v_ for v_ in variants if v_.family == "bwd_dbias_mma"), None)
    if want_dbias:
        if dbias_kernel is not None:
            dbias = masking_.dbias_plan(p, opts, deterministic, sm_count=device.sm_count(),
                                        kernel_tile=(dbias_kernel.tile.block_m, dbias_kernel.tile.block_n))
        elif hopper is not None and hopper.dbias:
            dbias = masking_.dbias_plan(p, opts, deterministic, key_major=True)
        else:
            dk_kernel = [v_ for v_ in variants if v_.family.startswith("bwd_dkdv") and v_.pass_ != 1][0]
            dbias = masking_.dbias_plan(
                p, opts, deterministic, dkdv_tile=(dk_kernel.tile.block_m, dk_kernel.tile.block_n),
                key_major_for_atomics=any(dk_kernel.family == f[0] for f in TF32_BWD_FAMILIES.values()))
    kernels = []
    for variant in variants:
        if variant is dbias_kernel:
            if not dbias.grid:
                continue   # dbias is exactly zero (a bias constant along keys)
            grid = dbias.grid
        else:
            grid = variant.grid(b, hq, p.group, lq, lk)
        kernels.append(KernelLaunch(variant, grid, variant is hopper))
    grad_shapes = ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv))
    dq_acc = None if dq_acc_shape is None else _Strided.contiguous(dq_acc_shape, acc)
    layouts = layouts or {}
    grads = (_Strided(shape, layouts[name], q.itemsize) if name in layouts else _Strided.contiguous(shape, q.dtype)
             for name, shape in zip(("dq", "dk", "dv"), grad_shapes))
    params = bwd_params(q, k, v, out, dout, lse, _Strided.contiguous((b, hq, lq), acc), dq_acc, *grads,
                        group=p.group, scale=p.scale,
                        mask=masking.values, dbias=DBIAS_OFF if dbias is None else dbias.values)
    return BackwardPlan(q.data.device_id, tuple(kernels), acc, (b, hq, lq), dq_acc_shape, q.dtype, grad_shapes,
                        _without_addresses(params, _BWD_ADDRESSES), maps, dbias, masking.keep_alive,
                        masking.param_grads)


def _with_mods_list(choose, cc: int, prelude: str, linear: str = "") -> list:
    """The backward list ``choose(cc=cc)`` with a call's user modifications (``prelude``) compiled into its
    scoring kernels; where a plain one does not take them (select.PLAIN_MODS_FAMILIES), the EXTRA list. ``linear``:
    the linear bias's prelude for the kernels that add it instead (_with_linear_bias)."""
    variants = choose(cc=cc)
    if prelude and not all(v.extra or takes_plain_mods(v) for v in variants if v.family in SCORING_FAMILIES):
        variants = choose(cc=cc, extra=True)
    if prelude:
        variants = query_groups_in_two_passes(variants)
    return [_with_linear_bias(v, linear, prelude) for v in variants]


def execute_backward(plan: BackwardPlan, dout, q, k, v, out, lse, grads=None):
    """(dq, dk, dv) of ``plan`` run on 4-D views of the inputs and ``lse (B, Hq, Lq)`` in the accumulator
    dtype: ``grads`` given (4-D views, the plan's ``layouts``) or new contiguous 4-D arrays. Allocates dsum,
    the dQ accumulator (zeroed), dq, dk, dv in that order."""
    cupy, _ = device.cupy_modules()
    with device.on_device(plan.device):
        dsum = cupy.empty(plan.dsum_shape, dtype=plan.acc_dtype)
        dq_acc = None if plan.dq_acc_shape is None else cupy.zeros(plan.dq_acc_shape, dtype=plan.acc_dtype)
        dq, dk, dv = grads if grads is not None else (cupy.empty(s, dtype=plan.grad_dtype) for s in plan.grad_shapes)
        params = HostArg(plan.params)
        params.put_addresses(_BWD_ADDRESSES, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr,
                                              lse.data.ptr, dsum.data.ptr, 0 if dq_acc is None else dq_acc.data.ptr,
                                              dq.data.ptr, dk.data.ptr, dv.data.ptr))
        maps = None
        if plan.maps is not None:
            # The accumulator's map covers [..., :d], which starts where the buffer does: re-pointing an
            # encoded map needs the address alone (a slice costs microseconds of every call).
            readdress = plan.maps.encoded is not None and tma.can_readdress()
            acc_d = dq_acc if readdress else dq_acc[..., :q.shape[3]]
            maps = plan.maps.for_arrays({"q": q, "dout": dout, "k": k, "v": v, "dq_acc": acc_d})
        run(plan.kernels, params, maps)
    return dq, dk, dv


# ------------------------------------------------------------------ the memo

_FORWARD_PLANS: dict = {}
_BACKWARD_PLANS: dict = {}
_CALL_PLANS: dict = {}
"""A caller's memo of whole validated calls that hold a forward plan (cuflash.kvcache): forgotten with
the plans."""


def _hooks() -> tuple:
    """The functions a plan's choice reads that tests and benchmarks replace: part of every key, so
    that a replaced one is a different key."""
    return (device.compute_capability, device.smem_limit, device.device_facts, device.sm_count, forward_choice,
            backward_variants, split_variants, tma.tma_ok)


def call_plan(key: tuple):
    """What :func:`remember_call` kept under ``key`` with the current :func:`_hooks`, or None."""
    return _CALL_PLANS.get((key, _hooks()))


def remember_call(key: tuple, value) -> None:
    _remember(_CALL_PLANS, (key, _hooks()), value)


def _remember(plans: dict, key: tuple, plan) -> None:
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan


def clear_plans() -> None:
    """Forget every forward and backward plan (a table or a hook they were chosen by changed)."""
    _FORWARD_PLANS.clear()
    _BACKWARD_PLANS.clear()
    _PACKED_PLANS.clear()
    _CALL_PLANS.clear()


CACHES_OF_CHOICES.append(clear_plans)


_PACKED_PLANS: dict = {}


def _packed_key(arrays, p, opts, precision: str, *rest) -> tuple:
    """The memo key of a packed plan: the packed arrays' layouts (shape, strides, dtype, device, 16-byte
    alignment), the validated options the choice reads, and the hooks."""
    layouts = tuple((x.shape, x.strides, x.dtype, x.data.device_id, x.data.ptr & 15) for x in arrays)
    return (layouts, p.causal, p.scale, opts.extra, opts.window, precision, *rest, _hooks())


def known_packed_plan(arrays, p, opts, precision: str, *rest):
    """A plan kept by :func:`keep_packed_plan` for a packed call of these arrays, options and ``rest``, or None."""
    return _PACKED_PLANS.get(_packed_key(arrays, p, opts, precision, *rest))


def keep_packed_plan(plan, arrays, p, opts, precision: str, *rest) -> None:
    """Memoise ``plan`` of a packed call (cuflash.varlen's equal lengths: a dense plan on views of the packed
    arrays, whose strides the key holds) for :func:`known_packed_plan`."""
    _remember(_PACKED_PLANS, _packed_key(arrays, p, opts, precision, *rest), plan)


def packed_forward(q, k, v, p, opts, precision: str, longest_keys: int,
                   layouts: Optional[dict] = None) -> Optional[PackedForwardPlan]:
    """:func:`plan_packed_forward`, memoised: a batch's longest sequence enters the key only through the
    row class it selects the tile by (select.row_class), so batches of other lengths share the plan."""
    mask = _packed_mask(p, opts, q, k, v)
    rows = None if mask is None else row_class(head_bucket(max(p.d, p.dv)), longest_keys, mask["band"])
    key = _packed_key((q, k, v), p, opts, precision, "fwd", rows, _layouts_key(layouts))
    if key not in _PACKED_PLANS:
        _remember(_PACKED_PLANS, key, plan_packed_forward(q, k, v, p, opts, precision, longest_keys, layouts))
    return _PACKED_PLANS[key]


def packed_backward(q, k, v, dout, out, p, opts, precision: str, deterministic: bool,
                    layouts: Optional[dict] = None) -> Optional[PackedBackwardPlan]:
    """:func:`plan_packed_backward`, memoised."""
    key = _packed_key((q, k, v, dout, out), p, opts, precision, "bwd", deterministic, _layouts_key(layouts))
    if key not in _PACKED_PLANS:
        _remember(_PACKED_PLANS, key, plan_packed_backward(q, k, v, dout, out, p, opts, precision, deterministic,
                                                           layouts))
    return _PACKED_PLANS[key]


def _layouts_key(layouts: Optional[dict]) -> tuple:
    return () if not layouts else tuple(sorted(layouts.items()))


def forward(call, precision: str, num_splits: Optional[int] = None, accumulator_out: bool = False,
            key_lengths=None, page_table=None, page_size: int = 0, num_pages: int = 0, out=None, lse=None,
            plans: Optional[list] = None):
    """(out, lse) as 4-D / 3-D arrays of a validated CuPy call (:class:`cuflash.options.Call`) with
    keys and outputs; ``num_splits`` (part of the call's signature), ``accumulator_out``, ``key_lengths``
    (an int32 array (B,) or None) and a paged cache's ``page_table`` (int32 (B, pages_per_seq)) with its
    ``page_size`` and the cache's ``num_pages`` as :func:`plan_forward` takes them; ``out`` (B, Hq, Lq, Dv)
    and ``lse`` (B, Hq, Lq), views of the caller's memory the unsplit forward writes (``num_splits=1``), or
    None. ``plans``: a list the plan run is appended to (a caller that memoises whole calls keeps it)."""
    p = call.problem
    with_lengths = key_lengths is not None
    pages = None if page_table is None else (int(page_size), int(page_table.shape[1]), int(num_pages))
    layouts = None if out is None else {"out": out.strides, "lse": lse.strides}
    key = None if call.signature is None else (call.signature, accumulator_out, with_lengths, pages,
                                               _layouts_key(layouts), _hooks())
    plan = None if key is None else _FORWARD_PLANS.get(key)
    if plan is None:
        plan = plan_forward(p, call.options, precision, num_splits, accumulator_out, with_lengths, pages, layouts)
        if key is not None:
            _remember(_FORWARD_PLANS, key, plan)
    if plans is not None:
        plans.append(plan)
    return execute_forward(plan, p.q, p.k, p.v, key_lengths, page_table, out, lse)


def backward(call, dout, out, lse, precision: str, deterministic: bool, bias_grad: bool = True, grads=None):
    """(dq, dk, dv, dbias plan or None, the trainable parameters' gradient accumulators (a call with user
    modifications: its plan is its own)) of a validated CuPy call with 4-D views ``dout``, ``out`` and
    ``lse (B, Hq, Lq)`` in the accumulator dtype; ``bias_grad`` False leaves a bias's gradient out; ``grads``
    (dq, dk, dv): 4-D views of the caller's memory the kernels write, or None."""
    p = call.problem
    layouts = None if grads is None else dict(zip(("dq", "dk", "dv"), (g.strides for g in grads)))
    key = None if call.signature is None else (call.signature, deterministic, _layouts_key(layouts), _hooks())
    plan = None if key is None else _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = plan_backward(p, call.options, dout, out, lse, deterministic, precision,
                             call.options.bias is not None and bias_grad, layouts)
        if key is not None:
            _remember(_BACKWARD_PLANS, key, plan)
    return (*execute_backward(plan, dout, p.q, p.k, p.v, out, lse, grads), plan.dbias, plan.param_grads)
