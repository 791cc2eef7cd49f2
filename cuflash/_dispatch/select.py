"""Which kernels a call launches: the forward's and the backward's variant lists for the facts of a
call (dtype, head bucket, masking flags, load width, GPU), and every variant the library can launch
(:func:`all_variants`, what ``python -m cuflash compile`` builds and the sweeps test)."""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
from dataclasses import replace
from typing import Dict, Iterator, List, Optional, Tuple

from .model import (DTYPES, HALF_TYPES, HEAD_BUCKETS, KV_SPLIT_FAMILIES, MMA_BWD_MAX_HEAD, PACKED_ATOMIC_DQ_FAMILIES,
                    SCORING_FAMILIES, SMEM_LIMITS, SMEM_MAX, TABLES, Tile, Variant, fits_resident, head_bucket, walkable)


def _on_query_groups(family: str, tile: Tile) -> bool:
    """Whether the float32 dK/dV kernel runs ``tile`` on query groups (two warps a 16-key strip, DkdvTf32Traits):
    255 registers in one pass."""
    return family.startswith("bwd_dkdv_tf32") and tile.warps > tile.block_n // 16


def _dkdv_passes(tile: Tile, head: int, atomic_dq: bool, extra: bool = False,
                 vec: bool = True, family: str = "bwd_dkdv_mma") -> List[Tuple[int, bool]]:
    """(pass_, atomic_dq) launches of the tensor-core dK/dV kernel with ``tile``: dK and dV in one
    pass, or in two where the tile says so (``Tile.passes``); in the 16-bit kernel, at head dim
    64 with the EXTRA code, element-wise loads and atomic dQ (20-84 spilled bytes in one pass; with
    16-byte loads it fits in 254 registers since dbias has a kernel of its own); and in the float32
    kernel on query groups without dQ atomics (4 bytes spilled in one pass with a band, NVRTC 12.9;
    packed calls and user modifications: :func:`query_groups_in_two_passes`)."""
    one = tile.passes == 1 and not (family == "bwd_dkdv_mma" and head == 64 and extra and atomic_dq and not vec)
    if _on_query_groups(family, tile) and not atomic_dq:
        one = False
    return [(0, atomic_dq)] if one else [(1, False), (2, atomic_dq)]


def _dkdv_plan(dtype: str, head: int, vec: bool, atomic_dq: bool, smem_limit: int, **flags) -> List["Variant"]:
    """The dK/dV launches: the passes follow the tile that fits ``smem_limit`` (each pass is then
    fitted on its own; a pass may take another tile than the one-pass variant would, which changes
    its speed, not its results)."""
    whole = Variant("bwd_dkdv_mma", dtype, head, vec=vec, pass_=0, atomic_dq=atomic_dq, **flags)
    try:
        tile = whole.fitted(smem_limit).tile
    except ValueError:   # no tile fits: fitting the plan says so
        return [whole]
    return [replace(whole, pass_=p, atomic_dq=a, tile=None)
            for p, a in _dkdv_passes(tile, head, atomic_dq, flags.get("extra", False), vec)]


HOPPER_CC = 90
"""The compute capability whose GPUs (H100, H200) take the sm90a variants."""


HOPPER_BWD_EXTRA_HEADS = (64, 128)
"""Head dims at which the Hopper dK/dV kernel takes EXTRA options (bias, mask, dropout, block layout).
At 256 its 226 KB of shared memory leave no room for the bias stages (2 x 8 KB): EXTRA calls stay on
the portable kernels there."""


HOPPER_FWD_MIN_KEYS = {64: 1025}
"""Head dim -> the fewest keys for which the Hopper forward's table tile takes an EXTRA call (bias,
mask, dropout, block layout). Each of its blocks starts and drains its pipeline alone (one CTA an
SM), so short rows favour the portable kernel: at head dim 64 and L = 1024 the Hopper forward measured
0.89-0.93x the portable one, at L = 2048 0.99-1.05x (benchmarks/bench.py, H100); at head dim 128 it
is faster from L = 1024 (1.01-1.21x)."""

HOPPER_FWD_SHORT_KEYS = {64: 2048}
"""Head dim -> the most keys a query block visits on average (every key; half of them with a causal
mask or a window) for which a call without EXTRA options takes the Hopper forward's short-rows tile
(``Variant.short``: two CTAs an SM). benchmarks/tune_short.py (H100, bf16 / fp16, queued ratio to
cuDNN, table tile -> short tile): L = 1024 0.81-0.84 -> 0.98-1.00, causal 0.57 ->
0.90-0.91; L = 2048 1.01-1.05 -> 1.03-1.05, causal 0.76-0.78 -> 0.96-1.01; L = 4096 1.07 -> 1.04,
causal 0.89-0.91 -> 1.01."""

ROWS = ("long", "short", "few")
"""How many keys a call's query blocks visit, for the Hopper forward's choice (:func:`row_class`)."""


def row_class(head: int, lk: int, band: bool) -> str:
    """"few": fewer than :data:`HOPPER_FWD_MIN_KEYS` keys (EXTRA calls run the portable forward);
    "short": at most :data:`HOPPER_FWD_SHORT_KEYS` keys visited by a query block on average, ``lk``
    or ``lk / 2`` with a ``band`` (causal mask or window); else "long"."""
    if lk < HOPPER_FWD_MIN_KEYS.get(head, 0):
        return "few"
    return "short" if (lk / 2 if band else lk) <= HOPPER_FWD_SHORT_KEYS.get(head, 0) else "long"


HOPPER_FWD_PERSISTENT = True
"""Let the Hopper forward's walkable variants run a persistent grid (:func:`schedule_for`); False: a
CTA a block everywhere (benchmarks/tune_persistent.py compares the two)."""


def schedule_for(v: Variant) -> str:
    """The schedule of a fitted forward variant (model.SCHEDULES). Without a causal band the query
    blocks are of equal work, and a persistent grid striding over them balances the SMs ("stride":
    1.03-1.15x a CTA a block at head dim 128, L 1024-4096, benchmarks/tune_persistent.py). Causal
    blocks differ up to Lk / block_n-fold, so a banded grid takes its blocks from a queue ("queue",
    each block to whichever CTA frees first: 1.06-1.21x a CTA a block at head dim 128,
    benchmarks/tune_persistent.py), which needs the two-consumer ring; banded variants without it
    (head dim 64) and every other variant run a CTA a block."""
    if not HOPPER_FWD_PERSISTENT or not walkable(v):
        return "block"
    if not v.band:
        return "stride"
    return "queue" if v.tile.warps == 12 else "block"


def _scheduled(v: Variant) -> Variant:
    return replace(v, schedule=schedule_for(v)) if v.family == "fwd_wgmma" else v


def has_short_tile(dtype: str, head: int) -> bool:
    """Whether the Hopper forward has a short-rows tile (``Variant.short``) for ``dtype`` at ``head``."""
    return ("sm90a", "fwd_wgmma", dtype, head) in TABLES["short"]



SM90_MIN_CC = 90
"""The compute capability from which a portable family takes its "sm90" row where the table has one."""


def _portable_arch(family: str, dtype: str, head: int, extra: bool, cc: int) -> str:
    """The row ("sm90" or "sm80") a portable variant's tiles come from on a GPU of compute
    capability ``cc``: "sm90" from SM90_MIN_CC where the table that serves the call (the EXTRA
    table with ``extra``, where it has the key) has such a row."""
    if cc < SM90_MIN_CC:
        return "sm80"
    key = ("sm90", family, dtype, head)
    if extra and ("sm80", family, dtype, head) in TABLES["extra"]:
        return "sm90" if key in TABLES["extra"] else "sm80"
    return "sm90" if key in TABLES["plain"] else "sm80"


def _fit_portable(v: Variant, smem_limit: int) -> Variant:
    """``v`` fitted to ``smem_limit`` (Variant.fitted); an "sm90" row's variant none of whose tiles fits falls back
    to the "sm80" row: the "sm90" rows are tuned for the H100 / H200's 227 KB, and GPUs of compute capability 9 and
    above with 99 KB (sm_120) take them too."""
    try:
        return v.fitted(smem_limit)
    except ValueError:
        if v.arch != "sm90":
            raise
        return replace(v, arch="sm80", tile=None).fitted(smem_limit)


def _dkdv_dmma_arch(head: int, extra: bool, atomic: bool, cc: int) -> str:
    """The fp64 dK/dV kernel's row (:func:`_portable_arch`); "sm80" where the "sm90" tile is a head split
    (Tile.head_split) and the call has no atomic dQ: the deterministic kernel spills on it (tables.py)."""
    arch = _portable_arch("bwd_dkdv_dmma", "float64", head, extra, cc)
    if arch == "sm90" and not atomic and TABLES["plain"][(arch, "bwd_dkdv_dmma", "float64", head)][0].head_split > 1:
        return "sm80"
    return arch


TF32_FAMILY = {"highest": "fwd_tf32x3", "tf32": "fwd_tf32"}
"""float32 precision -> the tensor-core forward family (flash_fwd_tf32.cu)."""

TF32_WGMMA_FAMILY = {"highest": "fwd_wgmma_tf32x3"}
"""float32 precision -> the Hopper forward family (flash_fwd_wgmma_tf32.cu, arch "sm90a"), chosen on
compute capability 9.0 for calls whose rows are 16-byte loadable, EXTRA options included (a bias
whose rows are not 16-byte chunks falls back to the portable kernel: plan.plan_forward).
"tf32" keeps the portable fwd_tf32, faster on the H100 (the fwd_wgmma_tf32 rows above)."""

FLOAT32_PRECISIONS = ("highest", "tf32", "fma")
"""What :func:`forward_variant` takes for float32: the public precisions, and "fma", the FMA forward
(the float32 fallback, kept selectable as the accuracy and speed baseline of the tensor-core kernels
for the benchmarks and the GPU tests; no public option names it)."""


@functools.lru_cache(maxsize=None)
def forward_variant(dtype: str, head: int, *, band: bool, extra: bool = False, vec: bool,
                    smem_limit: int = SMEM_MAX, cc: int = 80, rows: str = "long",
                    precision: str = "highest", wgmma: bool = True) -> Variant:
    """The forward kernel for one call on a GPU of compute capability ``cc`` (10 * major + minor)
    allowing ``smem_limit`` bytes of shared memory per block. On Hopper (``cc`` 90) 16-bit calls
    with 16-byte loadable rows take the wgmma kernel where the table has one, EXTRA options
    included; where ``rows`` (:func:`row_class`) says the query blocks visit few keys, calls without
    EXTRA options take its short-rows tile (``Variant.short``) where the table has one, and EXTRA
    calls with "few" keys the portable kernel. The launcher
    still takes the portable kernel where tensor maps cannot describe the arrays or a bias's
    rows are not 16-byte chunks (plan.plan_forward). float32 runs on the TF32 tensor cores,
    3xTF32 for ``precision`` "highest" and TF32 for "tf32" (:data:`TF32_FAMILY`), where the GPU's
    shared memory fits a tile, else on the FMA kernel (float32-accurate, so either precision); on
    Hopper, calls with 16-byte loadable rows take the wgmma kernel of :data:`TF32_WGMMA_FAMILY`
    where the table has one, EXTRA options included (``rows`` does not apply: its thresholds are
    the 16-bit kernel's measurements). ``wgmma`` False: the portable kernel the GPU would take were
    there no Hopper kernel (the fallback where tensor maps cannot describe a call's arrays)."""
    if dtype == "float32":
        hopper = TF32_WGMMA_FAMILY.get(precision)
        if cc == HOPPER_CC and wgmma and vec and ("sm90a", hopper, dtype, head) in TABLES["plain"]:
            with contextlib.suppress(ValueError):   # no Hopper tile fits: the portable kernels below
                return Variant(hopper, dtype, head, band=band, extra=extra, arch="sm90a").fitted(smem_limit)
        family = TF32_FAMILY.get(precision)
        if ("sm80", family, dtype, head) in TABLES["plain"]:
            try:
                return _fit_portable(Variant(family, dtype, head, band=band, extra=extra, vec=vec,
                                             arch=_portable_arch(family, dtype, head, extra, cc)), smem_limit)
            except ValueError:   # no TF32 tile fits this GPU
                pass
        return Variant("fwd_fma", dtype, head, band=band, extra=extra).fitted(smem_limit)
    if cc == HOPPER_CC and wgmma and vec and ("sm90a", "fwd_wgmma", dtype, head) in TABLES["plain"]:
        hopper = Variant("fwd_wgmma", dtype, head, band=band, extra=extra, arch="sm90a")
        if rows != "long" and not extra and has_short_tile(dtype, head):
            return _scheduled(replace(hopper, short=True, tile=None).fitted(smem_limit))
        if rows != "few" or not extra:
            return _scheduled(hopper.fitted(smem_limit))
    if dtype in HALF_TYPES:
        return Variant("fwd_mma", dtype, head, band=band, extra=extra, vec=vec).fitted(smem_limit)
    if ("sm80", "fwd_dmma", dtype, head) in TABLES["plain"]:
        return _fit_portable(Variant("fwd_dmma", dtype, head, band=band, extra=extra, vec=vec,
                                     arch=_portable_arch("fwd_dmma", dtype, head, extra, cc)), smem_limit)
    return Variant("fwd_fma", dtype, head, band=band, extra=extra).fitted(smem_limit)


@functools.lru_cache(maxsize=None)
def forward_choice(dtype: str, head: int, band: bool, extra: bool, vec: bool, rows: str, cc: int,
                   smem_limit: int, precision: str = "highest") -> Tuple[Variant, Variant]:
    """(:func:`forward_variant` for these facts, the portable variant a call falls back to where the
    Hopper kernel cannot take its arrays: the same GPU's, "sm90" rows included), with positional
    arguments: one cache lookup a call."""
    choose = functools.partial(forward_variant, dtype, head, band=band, extra=extra, vec=vec, smem_limit=smem_limit,
                               rows=rows, precision=precision, cc=cc)
    return choose(), choose(wgmma=False)


TF32_BWD_FAMILIES = {"highest": ("bwd_dkdv_tf32x3", "bwd_dq_tf32x3"), "tf32": ("bwd_dkdv_tf32", "bwd_dq_tf32")}
"""float32 precision -> the tensor-core backward's (dK/dV, deterministic dQ) families (flash_bwd_tf32.cu);
"fma" (FLOAT32_PRECISIONS) keeps the FMA backward."""


@functools.lru_cache(maxsize=None)
def backward_variants(dtype: str, head: int, *, band: bool, extra: bool = False, vec: bool, deterministic: bool,
                      smem_limit: int = SMEM_MAX, dbias: bool = False, cc: int = 80,
                      precision: str = "highest") -> Tuple[Variant, ...]:
    """The backward kernels for one call, in launch order (see :func:`forward_variant`);
    ``dbias``: the call wants a bias's gradient (``extra`` then holds). float32 runs on the TF32
    tensor cores at ``precision`` (:data:`TF32_BWD_FAMILIES`) where the GPU's shared memory fits a
    tile, kernel by kernel, else on the FMA kernels; they add dbias in the dK/dV kernel. On Hopper (``cc`` 90)
    16-bit calls with 16-byte loadable rows and atomic dQ take the wgmma dK/dV kernel where the
    table has one, EXTRA options included at the head dims of :data:`HOPPER_BWD_EXTRA_HEADS`;
    that kernel then adds dbias itself (``dbias=True`` variant, no dbias kernel). The launcher still
    takes the portable plan where tensor maps cannot describe the arrays or a bias's rows are
    not 16-byte chunks (plan.plan_backward)."""
    return tuple(_fit_portable(v, smem_limit)
                 for v in _backward_plan(dtype, head, band, extra, vec, deterministic, dbias, smem_limit, cc,
                                         precision))


def _fits(v: Variant, smem_limit: int) -> bool:
    try:
        v.fitted(smem_limit)
    except ValueError:
        return False
    return True


def _backward_plan(dtype: str, head: int, band: bool, extra: bool, vec: bool, deterministic: bool,
                   dbias: bool = False, smem_limit: int = SMEM_MAX, cc: int = 80,
                   precision: str = "highest") -> List[Variant]:
    """The backward's kernels in launch order, not yet fitted to ``smem_limit`` (which only
    decides the dK/dV passes and the float32 tensor-core kernels' fallback here)."""
    atomic = not deterministic
    flags = dict(band=band, extra=extra)
    plan = [Variant("bwd_dsum", dtype, 0)]
    if (cc == HOPPER_CC and vec and atomic and (not extra or head in HOPPER_BWD_EXTRA_HEADS)
            and ("sm90a", "bwd_dkdv_wgmma", dtype, head) in TABLES["plain"]):
        # dbias: dS^T from the kernel's registers into a key-major accumulator (vector reductions at L2;
        # kernels_cu/bias_grad_t.cuh) instead of the dbias kernel's second recomputation of S and dP.
        plan.append(Variant("bwd_dkdv_wgmma", dtype, head, band=band, extra=extra, dbias=dbias, arch="sm90a"))
        return plan + [Variant("bwd_convert_dq", dtype, 0)]
    if dtype in HALF_TYPES and head <= MMA_BWD_MAX_HEAD:
        plan += _dkdv_plan(dtype, head, vec, atomic, smem_limit, **flags)
        if deterministic:
            plan.append(Variant("bwd_dq_mma", dtype, head, vec=vec, **flags))
        if dbias:
            plan.append(Variant("bwd_dbias_mma", dtype, head, vec=vec, **flags))
    elif ("sm80", "bwd_dkdv_dmma", dtype, head) in TABLES["plain"]:
        # float64 on the fp64 tensor cores: one pass (every table tile keeps dK + dV within 128 registers);
        # "sm90" rows (full-rate mma.m16n8k*) from SM90_MIN_CC.
        plan.append(Variant("bwd_dkdv_dmma", dtype, head, vec=vec, atomic_dq=atomic,
                            arch=_dkdv_dmma_arch(head, extra, atomic, cc), **flags))
        if deterministic:
            plan.append(Variant("bwd_dq_dmma", dtype, head, vec=vec,
                                arch=_portable_arch("bwd_dq_dmma", dtype, head, extra, cc), **flags))
    elif dtype == "float32" and ("sm80", TF32_BWD_FAMILIES.get(precision, ("",))[0], dtype, head) in TABLES["plain"]:
        # float32 on the TF32 tensor cores, each kernel falling back to its FMA twin where no tile fits
        # (both add into the same fp32 dQ accumulator, and dbias in the dK/dV kernel).
        dkdv_family, dq_family = TF32_BWD_FAMILIES[precision]
        dkdv = Variant(dkdv_family, dtype, head, vec=vec, atomic_dq=atomic, **flags)
        if _fits(dkdv, smem_limit):   # one pass or two, as the fitted tile says (Tile.passes)
            plan += [replace(dkdv, pass_=p, atomic_dq=a)
                     for p, a in _dkdv_passes(dkdv.fitted(smem_limit).tile, head, atomic, extra, vec, family=dkdv_family)]
        else:
            plan.append(Variant("bwd_dkdv_fma", dtype, head, atomic_dq=atomic, **flags))
        if deterministic:
            dq = Variant(dq_family, dtype, head, vec=vec, **flags)
            plan.append(dq if _fits(dq, smem_limit) else Variant("bwd_dq_fma", dtype, head, **flags))
    else:
        plan.append(Variant("bwd_dkdv_fma", dtype, head, atomic_dq=atomic, **flags))
        if deterministic:
            plan.append(Variant("bwd_dq_fma", dtype, head, **flags))
    if atomic:   # the 16-bit tensor-core dK/dV kernel's accumulator is in fragment tiles (atomics.cuh)
        plan.append(Variant("bwd_convert_dq", dtype, 0, dq_tiled=any(v.family == "bwd_dkdv_mma" for v in plan)))
    return plan


MAX_SPLITS = 256
"""The most key splits a split-KV forward takes (``num_splits``)."""

SPLIT_FILL = 0.8
"""A forward whose query blocks fill this fraction of the GPU's CTA slots runs unsplit (FlashAttention's
rule); below it the keys are split."""

SPLIT_MIN_KEYS = 2048
"""Calls split unasked only from this many keys: below it a split saves little and the Hopper kernel,
which split calls give up, is the faster one. Not yet measured (benchmarks/bench_decode.py sweeps it)."""

SPLIT_EFFICIENCY = 0.85
"""The split count taken: the smallest whose last wave is at least this fraction as full as the best
count's (FlashAttention's 85%-of-best-wave rule)."""


def ctas_per_sm(v: Variant, smem_limit: int, max_threads: int = 2048) -> int:
    """CTAs of ``v`` one SM holds by shared memory and threads (a tile's ``ctas`` bounds its registers
    for that many; where the shared memory holds fewer, as on GPUs of less of it, fewer run)."""
    by_smem = max_threads // v.threads
    while by_smem > 1 and not fits_resident(v.smem_bytes, by_smem, smem_limit):
        by_smem -= 1
    return by_smem


SPLIT_BALANCE = 0.95
"""For a partial kernel bound by its K/V stream: the split count taken is the smallest in one wave whose
CTAs spread over the SMs at least this fraction as evenly as the best count's."""


SPLIT_MAX_WAVES = 4
"""For a partial kernel bound by its K/V stream with more blocks than streams: the split counts considered are those
of at most this many waves of its CTA slots (H200, bf16, one query row of 4 heads, 16384 keys, D = 64, two-CTA
tile, 264 slots; us, one split / the rule's count / cuDNN: 136 blocks 142 / 139 (5) / 154, 200 205 / 201 (5) / 194,
320 343 / 309 (3) / 305, 384 379 / 362 (2) / 355, 512 at 4096 keys 125 / 125 (1) / 125; D = 128: 320 692 / 603 /
672; benchmarks/split_counts.py --rows 17:16384:64,25:16384:64,40:16384:64,48:16384:64 --counts 1,2,3,5)."""


def split_count(blocks: int, key_tiles: int, slots: int, max_splits: int = MAX_SPLITS,
                sms: Optional[int] = None, min_splits: int = 1) -> int:
    """The number of key splits for a forward of ``blocks`` CTAs over ``key_tiles`` key tiles on a GPU
    of ``slots`` CTA slots (SMs x CTAs an SM): 1 where the blocks fill most slots, else the smallest
    count whose waves are nearly as full as the best count's. Counts that leave some split's tile
    count unchanged from the count before are skipped (no less work a split). At least ``min_splits``
    (packed GQA rows on the split twin need the split path), where there are two key tiles to split.

    ``sms`` (the decoding kernel: the SMs where it streams K/V at the HBM rate with one CTA an SM, its
    16-bit variants; else its CTA slots): instead, with at most as many blocks as streams, the smallest count
    within one wave whose CTAs spread evenly over the ``sms`` streams (:data:`SPLIT_BALANCE`): fewer, longer
    splits, and no SM with a CTA more than the rest; with more blocks, the smallest count within
    :data:`SPLIT_MAX_WAVES` waves whose last wave is nearly as full as the best count's. The H200,
    bf16, D=128, one query row of 4 heads a K/V head: B=1, 8 K/V heads, 131072 keys: 16 splits (128
    CTAs) 131 us, 33 (264) 131, 42 (336, the wave rule's count) 137, 50 (400, past the 396 slots) 143;
    B=8: 2 splits (128 CTAs) 249 us, 4 245, 6 246, 5 (320) 258, 7 (448) 273 (benchmarks/bench_decode.py
    --splits)."""
    def fill(n: int) -> float:
        waves = blocks * n / slots
        return waves / math.ceil(waves)

    if key_tiles < 2:
        return 1
    limit = max(1, min(max_splits, key_tiles, slots))
    counts = [n for n in range(1, limit + 1) if n == 1 or -(-key_tiles // n) != -(-key_tiles // (n - 1))]
    counts = [n for n in counts if n >= min_splits] or [min(min_splits, limit)]
    if sms is not None and blocks > sms:
        # more blocks than streams: the fewest splits within SPLIT_MAX_WAVES waves of the slots whose last wave
        # is nearly as full as the best count's (a wave's tail, not an SM's share, is what idles the GPU)
        within = [n for n in counts if blocks * n <= SPLIT_MAX_WAVES * slots] or counts[:1]
        best = max(fill(n) for n in within)
        return next(n for n in within if fill(n) >= SPLIT_BALANCE * best)
    if blocks >= SPLIT_FILL * slots:
        if min_splits == 1:
            return 1
        # the GPU is full already and one split is the unpacked kernel (packed rows on the split twin, where
        # unpacked each K/V head is read once a query head): of min_splits .. min_splits + 2, the count whose
        # last wave is fullest
        within = range(min_splits, min(min_splits + 2, key_tiles) + 1)
        best = max(fill(n) for n in within)
        return next(n for n in within if fill(n) >= 0.98 * best)
    if sms is not None:
        one_wave = [n for n in counts if blocks * n <= slots] or counts[:1]

        def balance(n: int) -> float:
            per_sm = blocks * n / sms
            return per_sm / math.ceil(per_sm)

        best = max(balance(n) for n in one_wave)
        return next(n for n in one_wave if balance(n) >= SPLIT_BALANCE * best)
    best = max(fill(n) for n in counts)
    return next(n for n in counts if fill(n) >= SPLIT_EFFICIENCY * best)


DECODE_ROWS = 16
"""Query rows a block of the decoding partial kernel holds on its 16-row strip (flash_fwd_decode.cu)."""

DECODE_MAX_ROWS = 64
"""Query rows a block of the decoding kernel holds at most: 16-bit tiles of 2-4 strips, where the split table
has them (select._decoding_tile); past it, the portable kernel's split twin."""


QUERY_MINOR_ROWS = 8
"""Query rows a block of the decoding kernel's query-minor tile holds (float32; flash_fwd_decode.cu QUERY_MINOR)."""


def _query_minor(tile: Tile) -> bool:
    return tile.block_m == QUERY_MINOR_ROWS


def _decoding_tile(decode: Variant, rows: int, smem_limit: int, full: bool = False) -> Variant:
    """``decode`` fitted to ``smem_limit``: on its query-minor tile (block_m QUERY_MINOR_ROWS) where the blocks'
    ``rows`` fit one and the table has one that fits, else on a 16-row strip where they fit one, else on the
    first tile of more strips that holds them (ValueError where none fits).
    ``full`` (the call's blocks fill the GPU, one split each: plan._auto_splits): the first 16-row tile of several
    CTAs an SM where the table has one (a CTA's start and end then overlap another CTA's copies: the H200, bf16,
    B = 64, one query row of 4 heads a K/V head, 4096 keys at head dim 64, 127 us against 130 on the one-CTA tile;
    dispatch/tables.py)."""
    if rows <= QUERY_MINOR_ROWS:
        with contextlib.suppress(ValueError):
            return decode.fitted(smem_limit, where=_query_minor)
    if rows <= DECODE_ROWS:
        if full:
            with contextlib.suppress(ValueError):
                return decode.fitted(smem_limit, where=lambda tile: tile.block_m == DECODE_ROWS and tile.ctas > 1)
        return decode.fitted(smem_limit, where=lambda tile: tile.block_m == DECODE_ROWS)
    return decode.fitted(smem_limit, where=lambda tile: DECODE_ROWS < tile.block_m and rows <= tile.block_m)


def split_variants(portable: Variant, dv: int, smem_limit: int, rows: int = DECODE_MAX_ROWS + 1,
                   full: bool = False) -> Tuple[Variant, Variant]:
    """The split-KV forward's kernels for a call whose portable forward is ``portable`` (fitted) and
    whose blocks hold ``rows`` query rows (packed GQA: Lq x the heads packed): the partial kernel and
    the combine kernel at the bucket of ``dv``. The partial kernel: for calls of at most DECODE_ROWS rows (16-bit
    ones of at most DECODE_MAX_ROWS where the table has a tile of that many) without an EXTRA option, with
    16-byte loads, at a head bucket the split table has, the decoding kernel
    (``fwd_decode``: the warps split each key tile; not with user modifications; float32 at precision
    "highest", its 3xTF32, on the query-minor tile of 8 rows where they fit it; float64 on the fp64 tensor
    cores; ``full``, blocks that fill the GPU, on a tile of several CTAs an SM: :func:`_decoding_tile`); else
    the portable kernel's twin (``kv_split``)."""
    decode_key = ("sm80", "fwd_decode", portable.dtype, portable.head)
    if rows <= DECODE_MAX_ROWS and not portable.extra and not portable.prelude and portable.vec \
            and decode_key in TABLES["split"] and portable.family in ("fwd_mma", "fwd_tf32x3", "fwd_dmma"):
        with contextlib.suppress(ValueError):   # no decoding tile fits: the portable kernel's twin
            decode = Variant("fwd_decode", portable.dtype, portable.head, band=portable.band, vec=True,
                             kv_split=True)
            decode = _decoding_tile(decode, rows, smem_limit, full)
            return decode, Variant("fwd_combine", portable.dtype, head_bucket(dv)).fitted(smem_limit)
    partial = replace(portable, kv_split=True)
    if not portable.extra and (portable.arch, portable.family, portable.dtype, portable.head) in TABLES["split"]:
        with contextlib.suppress(ValueError):   # no split tile fits: the portable variant's own
            partial = replace(portable, kv_split=True, tile=None).fitted(smem_limit)
    return partial, Variant("fwd_combine", portable.dtype, head_bucket(dv)).fitted(smem_limit)


MODS_FWD_WGMMA_TILE = Tile(128, 128, 12, 2, "user modifications at head dim 64: two consumer warpgroups of 232 "
                           "registers a thread; the 192-row tile's three of 160 spill 528 bytes with softcap "
                           "and 8 with a mask modification (NVRTC 13, benchmarks/sass.py)")
"""The 16-bit Hopper forward's tile where a call's user modifications are compiled in and the table's has
three consumer warpgroups."""
MODS_FWD_WGMMA_TILE_128 = Tile(128, 64, 12, 2, "user modifications at head dim 128 on a walking CTA, or behind a "
                               "branch an element with a band: 64-key tiles; the 128-key tile spills 120 bytes (walking) "
                               "and 100 (a CTA a block, a band) with every library score modification at once "
                               "(NVRTC 12.9)")
"""The 16-bit Hopper forward's tile at head dim 128 where a call's user modifications are compiled in and its CTAs
walk the blocks (no band), or where they have a band and are not evaluated everywhere (ScoreMod everywhere)."""
MODS_FWD_TF32_TILE = Tile(128, 32, 4, 2, "user modifications with masks in the TF32 forward at head dim 64: 32-key "
                          "tiles; the table's 64-key tile spills 16-40 bytes with every library modification "
                          "(NVRTC 12.9)")
"""The TF32 forward's tile (EXTRA, head dim 64) where a call's user modifications are compiled in."""


PLAIN_MODS_FAMILIES = ("fwd_wgmma", "fwd_wgmma_tf32x3", "bwd_dkdv_wgmma", "bwd_dkdv_mma", "bwd_dq_mma", "bwd_dkdv_tf32",
                       "bwd_dq_tf32", "bwd_dkdv_tf32x3", "bwd_dq_tf32x3", "bwd_dkdv_dmma", "bwd_dq_dmma")
"""The families whose plain variants take score modifications (a call with no option that needs EXTRA):
the Hopper forwards and the tensor-core backwards. The portable forwards and the FMA backwards take them
on their EXTRA variants: their plain ones, tuned to the register limit, spill 32-268 bytes with them
(NVRTC 12.9; test_mods.py's sweep)."""


def takes_plain_mods(v: Variant) -> bool:
    return v.family in PLAIN_MODS_FAMILIES


def with_mods(v: Variant, prelude: str) -> Variant:
    """``v`` with a call's user modifications (cuflash.mods: their generated ``prelude``) compiled in: the
    variants that score (:data:`SCORING_FAMILIES`; plain ones only of :data:`PLAIN_MODS_FAMILIES`), on
    :data:`MODS_FWD_WGMMA_TILE` where the Hopper forward's tile has three consumer warpgroups or two CTAs an
    SM (walking where the modifications all run everywhere, ``ScoreMod(everywhere=True)``), except a plain
    variant with one light score modification (``ScoreMod.light``: softcap, ALiBi), which keeps its tile and
    schedule; where they do not run everywhere,
    a CTA a block for its band and :data:`MODS_FWD_WGMMA_TILE_128` at head dim 128 where its CTAs walk or
    have a band; on :data:`MODS_FWD_TF32_TILE` where the TF32 forward's would spill; the others (dsum,
    convert, combine) as they are."""
    if not prelude or v.family not in SCORING_FAMILIES or v.packed or v.acc_out:
        return v
    if not v.extra and not takes_plain_mods(v):
        raise ValueError(f"{v.family}: user modifications run on its EXTRA variants (PLAIN_MODS_FAMILIES)")
    # Score modifications evaluated everywhere (ScoreMod everywhere: softcap, ALiBi) are light: the walking
    # Hopper forwards keep their schedule and tile with them (0 spills, every such library modification at
    # once, NVRTC 12.9); the others run behind a branch an element and take the fallbacks below.
    everywhere = "#define CUF_USER_SCORE_EVERYWHERE 1" in prelude
    # One light modification fits the three-consumer and two-CTA tiles of the plain variants: 0 spills for
    # softcap, ALiBi (NVRTC 12.9 and 13.5); the two at once spilled 20 bytes, and EXTRA variants 68-84.
    light = "#define CUF_USER_SCORE_LIGHT 1" in prelude and not v.extra
    if v.family == "fwd_wgmma" and (v.tile.warps == 16 or v.tile.ctas > 1) and not light:
        v = replace(v, tile=MODS_FWD_WGMMA_TILE, short=False)
        if everywhere:
            v = replace(v, schedule=schedule_for(v))   # one CTA an SM: it can walk
    if v.family == "fwd_wgmma" and not everywhere:
        if v.band and v.schedule != "block":
            # a walking CTA's band forward holds 224-232 registers a consumer thread: 228 bytes spill with
            # modifications (NVRTC 12.9); a CTA a block keeps 232 and spills none
            v = replace(v, schedule="block")
        if v.head == 128 and (v.band or v.schedule != "block"):
            v = replace(v, tile=MODS_FWD_WGMMA_TILE_128, short=False)
    elif v.family == "fwd_tf32" and v.extra and (v.tile.block_m, v.tile.block_n) == (128, 64):
        v = replace(v, tile=MODS_FWD_TF32_TILE)
    return replace(v, prelude=prelude)


def query_groups_in_two_passes(variants: List[Variant]) -> List[Variant]:
    """A backward list with the float32 dK/dV kernel on query groups in two passes where the list has it in
    one: as a call with user modifications or packed sequences runs it (255 registers in one pass: 16 bytes
    spilled packed and with every library modification, NVRTC 12.9; tests/test_mods.py's sweep)."""
    out = []
    for v in variants:
        if _on_query_groups(v.family, v.tile) and v.pass_ == 0:
            out += [replace(v, pass_=1, atomic_dq=False), replace(v, pass_=2)]
        else:
            out.append(v)
    return out


def packed_schedule(v: Variant) -> str:
    """The schedule of the Hopper forward's PACKED twin: its blocks differ in work (each sequence its own key
    count; a causal band), so a grid of one CTA an SM takes them from a queue, longest first as the table
    lists them (each block to whichever CTA frees first), where the tile has the two-consumer ring; where it
    has three consumers (head dim 64) strides over the table without a band and runs a CTA a block with one
    (a stride over causal blocks of unequal work ran at 0.6x the block grid's TFLOP/s); a CTA a block where
    the tile cannot walk (head dim 256). A walk starts each block's Q and first K/V tiles during the
    previous block's last tile and epilogue, which a CTA a block leaves bare (benchmarks/bench_varlen.py)."""
    if not HOPPER_FWD_PERSISTENT or not walkable(v):
        return "block"
    if v.tile.warps == 12:
        return "queue"
    return "block" if v.band else "stride"


def packed_variant(variant: Variant, portable: Variant, smem_limit: int) -> Optional[Variant]:
    """The forward over packed sequences (cuflash.varlen) for a call whose forward is ``variant`` and portable
    forward ``portable`` (:func:`forward_choice`): the Hopper forward's PACKED twin on ``variant``'s tile (the
    short-rows tile where the longest sequence's rows are short: plan.plan_packed_forward), where ``variant``
    is that kernel without EXTRA: one CTA an SM walking the table where the tile can walk
    (:func:`packed_schedule`), else a CTA a block; the float32 Hopper forward's (3xTF32) PACKED twin, a CTA
    a block; else the portable forward's PACKED twin on the split tile, for the 16-bit, float32 (3xTF32) and
    float64 tensor-core forwards without EXTRA; None for the others (their sequences run one dense launch
    each).
    The plan takes ``packed_variant(portable, portable, ...)`` where tensor maps cannot describe the arrays."""
    try:
        if variant.family == "fwd_wgmma" and not variant.extra:
            packed = replace(variant, packed=True, schedule="block", tile=None).fitted(smem_limit)
            return replace(packed, schedule=packed_schedule(packed))
        if variant.family == "fwd_wgmma_tf32x3" and not variant.extra:
            return replace(variant, packed=True, tile=None).fitted(smem_limit)
        if portable.family not in ("fwd_mma", "fwd_tf32x3", "fwd_dmma") or portable.extra:
            return None
        return replace(portable, packed=True, tile=None).fitted(smem_limit)
    except ValueError:
        return None


def packed_backward_variants(dtype: str, head: int, band: bool, vec: bool, smem_limit: int, cc: int = 80,
                             deterministic: bool = True, precision: str = "highest") -> Optional[list]:
    """The backward over packed sequences (cuflash.varlen). On Hopper (``cc`` 90), not ``deterministic``,
    16-bit rows of 16-byte loads at head dims 64 and 128: the Hopper list (dsum, the wgmma dK/dV kernel's
    PACKED twin adding dQ into its fp32 accumulator, the convert kernel). Else, not ``deterministic``, where
    the portable dK/dV kernel adds dQ into a row-major accumulator (:data:`PACKED_ATOMIC_DQ_FAMILIES`:
    float32's 3xTF32 kernel, float64's): the portable atomic list (dsum, the dK/dV pass or passes, the last
    adding dQ, the convert kernel), as a dense call runs it. Otherwise the deterministic portable list (dsum,
    dK/dV without dQ atomics, dQ) with its dK/dV and dQ kernels' PACKED twins (dsum and the convert kernel read
    rows alike, packed or not), for the 16-bit, float64 and float32 (3xTF32, precision "highest") tensor-core
    kernels; None where that list has other kernels (the FMA ones at head dim 256, float32's plain TF32 and
    FMA ones). The plan takes the portable lists where tensor maps cannot describe the arrays (``cc`` 80)."""
    if cc == HOPPER_CC and not deterministic and head in (64, 128):
        with contextlib.suppress(ValueError):
            hopper = backward_variants(dtype, head, band=band, extra=False, vec=vec, deterministic=False,
                                       smem_limit=smem_limit, cc=cc)
            if [v.family for v in hopper] == ["bwd_dsum", "bwd_dkdv_wgmma", "bwd_convert_dq"]:
                return [v if v.family != "bwd_dkdv_wgmma" else replace(v, packed=True) for v in hopper]
    if not deterministic:
        with contextlib.suppress(ValueError):
            atomic = backward_variants(dtype, head, band=band, extra=False, vec=vec, deterministic=False,
                                       smem_limit=smem_limit, cc=cc, precision=precision)
            if any(v.tile.head_split > 1 for v in atomic):   # the fp64 head-split tile spills packed: the sm80 row
                atomic = backward_variants(dtype, head, band=band, extra=False, vec=vec, deterministic=False,
                                           smem_limit=smem_limit, cc=80, precision=precision)
            dsum, *dkdv, last = query_groups_in_two_passes(atomic)
            passes = [(v.pass_, v.atomic_dq) for v in dkdv]
            if (dsum.family == "bwd_dsum" and last.family == "bwd_convert_dq" and not last.dq_tiled
                    and passes in ([(0, True)], [(1, False), (2, True)])
                    and all(v.family in PACKED_ATOMIC_DQ_FAMILIES for v in dkdv)):
                return [dsum] + [replace(v, packed=True) for v in dkdv] + [last]
    try:
        variants = backward_variants(dtype, head, band=band, extra=False, vec=vec, deterministic=True,
                                     smem_limit=smem_limit, cc=80, precision=precision)
    except ValueError:
        return None
    families = [v.family for v in variants]
    one_pass = (["bwd_dsum", "bwd_dkdv_mma", "bwd_dq_mma"], ["bwd_dsum", "bwd_dkdv_dmma", "bwd_dq_dmma"],
                ["bwd_dsum", "bwd_dkdv_tf32x3", "bwd_dq_tf32x3"])
    two_passes = (["bwd_dsum", "bwd_dkdv_tf32x3", "bwd_dkdv_tf32x3", "bwd_dq_tf32x3"],)   # dV, then dK
    if not ((families in one_pass and variants[1].pass_ == 0) or families in two_passes):
        return None   # (execute_packed_backward launches dsum, the dK/dV passes over one table, dQ)
    return [v if v.family == "bwd_dsum" else replace(v, packed=True) for v in variants]


def vec_chunk(itemsize: int) -> int:
    """Elements in one 16-byte ``cp.async`` chunk (tile_io.cuh): rows of 16-byte loads hold a multiple of this."""
    return 16 // itemsize


def vec_choices(dtype: str) -> Tuple[bool, ...]:
    """Both load widths for every dtype: the tensor-core kernels have a 16-byte ``cp.async`` path
    (``vec``); the FMA kernels, which float32 keeps for the backward, have no such flag."""
    return (False, True)


def all_variants() -> List[Variant]:
    """Every variant the library can launch: the union of every call's plan on every
    GPU class of SMEM_LIMITS (what ``python -m cuflash compile`` builds and the tests
    run), no duplicates."""
    seen: Dict[Variant, None] = {}
    for dtype, head, band, extra in itertools.product(DTYPES, HEAD_BUCKETS, (False, True), (False, True)):
        for vec, limit in itertools.product(vec_choices(dtype), SMEM_LIMITS.values()):
            for precision in (FLOAT32_PRECISIONS if dtype == "float32" else ("highest",)):
                seen[forward_variant(dtype, head, band=band, extra=extra, vec=vec, smem_limit=limit,
                                     precision=precision)] = None
            if limit == SMEM_LIMITS["sm_90 (H100, H200)"]:
                for precision, rows in itertools.product(
                        FLOAT32_PRECISIONS if dtype == "float32" else ("highest",), ROWS):
                    hopper = forward_variant(dtype, head, band=band, extra=extra, vec=vec, smem_limit=limit,
                                             cc=HOPPER_CC, precision=precision, rows=rows)
                    seen[hopper] = None
                    if hopper.family == "fwd_wgmma" and not extra:   # its float32-output twin (forward_in_accumulator)
                        seen[replace(hopper, acc_out=True)] = None
            ccs = (80, HOPPER_CC) if limit == SMEM_LIMITS["sm_90 (H100, H200)"] else (80,)
            precisions = FLOAT32_PRECISIONS if dtype == "float32" else ("highest",)
            for det, dbias, cc, precision in itertools.product((False, True), (False, True) if extra else (False,),
                                                               ccs, precisions):
                for v in _backward_plan(dtype, head, band, extra, vec, det, dbias, limit, cc, precision):
                    try:
                        seen[v.fitted(limit)] = None
                    except ValueError:   # documented: no such kernel for this GPU class
                        pass
    # The split-KV forward: the partial twin of each portable forward a GPU class falls back to, and the combines.
    for dtype, head, band, extra, limit in itertools.product(DTYPES, HEAD_BUCKETS, (False, True), (False, True),
                                                             SMEM_LIMITS.values()):
        ccs = (80, HOPPER_CC) if limit == SMEM_LIMITS["sm_90 (H100, H200)"] else (80,)
        for vec, cc, precision in itertools.product(vec_choices(dtype), ccs,
                                                     FLOAT32_PRECISIONS if dtype == "float32" else ("highest",)):
            try:
                portable = forward_variant(dtype, head, band=band, extra=extra, vec=vec, smem_limit=limit, cc=cc,
                                           precision=precision, wgmma=False)
            except ValueError:
                continue
            if portable.family in KV_SPLIT_FAMILIES:
                for rows, full in itertools.product((QUERY_MINOR_ROWS, DECODE_ROWS, 2 * DECODE_ROWS, DECODE_MAX_ROWS,
                                                     DECODE_MAX_ROWS + 1), (False, True)):
                    seen[split_variants(portable, head, limit, rows, full)[0]] = None   # decoding tiles, the twin
            if not extra:   # the packed forward a call takes (the Hopper one where it has one, by row class)
                for rows in ROWS:
                    choice = portable if cc != HOPPER_CC else forward_variant(
                        dtype, head, band=band, vec=vec, smem_limit=limit, cc=cc, precision=precision, rows=rows)
                    packed = packed_variant(choice, portable, limit)
                    if packed is not None:
                        seen[packed] = None
            if not extra and precision == "highest":   # the packed backward, atomic dQ and deterministic
                for det in (False, True):
                    for v in packed_backward_variants(dtype, head, band, vec, limit, cc, deterministic=det,
                                                      precision=precision) or ():
                        seen[v] = None
    for dtype, head in itertools.product(DTYPES, HEAD_BUCKETS):
        seen[Variant("fwd_combine", dtype, head)] = None
    return list(seen)


def unsupported(smem_limit: int) -> List[Variant]:
    """The (default-tile) variants that no tile lets run under ``smem_limit``."""
    out = []
    for v in {replace(v, tile=None) for v in all_variants()}:
        try:
            v.fitted(smem_limit)
        except ValueError:
            out.append(v)
    return out


def table_rows() -> Iterator[Tuple[Tuple[str, str, str, int], Tile]]:
    """The raw table: ((arch, family, dtype, head), Tile) pairs, every alternative."""
    return ((key, tile) for table in (TABLES["plain"], TABLES["extra"], TABLES["short"], TABLES["split"])
            for key, tiles in table.items()
            for tile in tiles)


@contextlib.contextmanager
def tile_override(family: str, head: int, tile: Tile, dtypes=DTYPES, arch: "str | None" = None):
    """Temporarily replace table entries; for the tuning scripts in benchmarks/ only. ``arch`` None:
    the portable rows, "sm80" and "sm90" where the table has one (so that a GPU of either class runs ``tile``).

    A variant carries the tile it was built with (and its name expression says
    so), so kernels compiled for one configuration are never served for another;
    the selection caches are cleared on entry and exit so that calls pick up the
    table as it is.
    """
    tables = (TABLES["plain"], TABLES["extra"])   # every table that has the key
    keys = [(a, family, dtype, head) for dtype in dtypes for a in ((arch,) if arch else ("sm80", "sm90"))]
    saved = [{key: table[key] for key in keys if key in table} for table in tables]
    try:
        for table, entries in zip(tables, saved):
            table.update({key: (tile,) for key in entries})
        clear_selection_caches()
        yield
    finally:
        for table, entries in zip(tables, saved):
            table.update(entries)
        clear_selection_caches()


CACHES_OF_CHOICES: List = []
"""Functions that forget what was chosen from the tables (the plan memo registers its own)."""


def clear_selection_caches() -> None:
    """Forget what the tables chose: the selections, and every cache registered in
    :data:`CACHES_OF_CHOICES` (the forward and backward plans, which hold chosen variants)."""
    for cached in (forward_variant, forward_choice, backward_variants):
        cached.cache_clear()
    for clear in CACHES_OF_CHOICES:
        clear()
