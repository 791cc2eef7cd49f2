"""One small problem per shipped kernel variant: the call that makes the launcher run it.

Shared by the GPU test that runs every variant (test_variants_gpu.py) and the CPU
test that checks, through the same selection functions the launcher uses, that
these problems cover the whole variant table (test_variants.py).
"""
import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np

from cuflash._dispatch.model import ITEMSIZE, SMEM_LIMITS, SMEM_MAX, Variant, head_bucket
from cuflash._dispatch.plan import PERIODIC_BAND_FAMILIES
from cuflash._dispatch.select import (HOPPER_FWD_MIN_KEYS, HOPPER_FWD_SHORT_KEYS, backward_variants, forward_variant,
                                      packed_backward_variants, packed_variant, row_class, split_variants,
                                      vec_chunk)

# Odd lengths at every tile edge: 97 = 64 + 33 query rows, 130 = 2 * 64 + 2 keys
# (and 3 * 32 + 34 for the 32-wide tiles); two query heads share one K/V head.
BATCH, HEADS_Q, HEADS_K, LQ, LK = 2, 2, 1, 97, 130
SPLITS = 3   # a split-KV variant's problem: three key ranges, the last one shorter
FULL_SMS = 1   # the SMs of a GPU that a problem's BATCH x HEADS_K blocks fill (Problem.full)
DECODE_LQ = 5   # the decoding partial kernel's problem: 5 query rows (10 with the two query heads packed)
DECODE_LQ_MINOR = 3   # ... on its query-minor tile (float32, at most 8 rows): 6 packed rows
DECODE_LQ_BAND = 9    # ... on its 16-row strip where a band leaves the query heads unpacked (9 rows)
DECODE_LQ_STRIPS = 12   # ... on its tiles of 2-4 strips (16-bit): 24 packed rows
# A packed variant's problem: query and key counts of its sequences (one past a 64-row tile, an empty one, one
# without keys, more keys than queries and fewer); the long form for the Hopper forward's long-rows tile, whose
# longest sequence goes past the short-rows threshold (twice it under a band)
PACKED_LENGTHS = ((LQ, 0, 1, 3, 70), (LK, 4, 0, 1, 33))
PACKED_LENGTHS_LONG = ((LQ, 0, 1, 3, 70), (2 * HOPPER_FWD_SHORT_KEYS[64] + 18, 4, 0, 1, 33))


@dataclass(frozen=True)
class Problem:
    dtype: str
    d: int
    dv: int
    causal: object        # False, True or "bottom_right"
    extra: bool           # masking options that need the EXTRA kernels (variant_options())
    backward: bool
    deterministic: bool
    smem_limit: int = SMEM_MAX    # the GPU class (shared memory per block) the launcher selects for
    cc: int = 80                  # the compute capability it selects for (90: the Hopper variants)
    lk: int = LK                  # keys (longer for the Hopper forward's table tile: row_class)
    bias: bool = True             # with extra: variant_options() has a bias (the backward forms dbias); False:
                                  # mask and dropout only (the Hopper dK/dV kernel's variant without dbias)
    precision: str = "highest"    # float32: "tf32" the plain TF32 kernels, "fma" the FMA ones (FLOAT32_PRECISIONS)
    num_splits: int = 1           # > 1: the split-KV forward (the portable kernel's partial twin, then the combine)
    lq: int = LQ                  # query rows (DECODE_LQ: the decoding partial kernel's few rows)
    packed: bool = False          # packed sequences (cuflash.varlen) of these query and key counts:
    packed_lengths: tuple = PACKED_LENGTHS
    accumulator: bool = False     # the forward in float32 (api.forward_in_accumulator: the Hopper forward's acc_out twin)
    full: bool = False            # the split blocks fill the GPU (plan._fills_gpu): the decoding kernel's tile of
                                  # several CTAs an SM; run as on a GPU of FULL_SMS SMs

    @property
    def vec(self) -> bool:
        """What the launcher decides for contiguous inputs of these head dims (plan.vec_loads_ok)."""
        chunk = vec_chunk(ITEMSIZE[self.dtype])
        return self.d % chunk == 0 and self.dv % chunk == 0

    def variants(self) -> list:
        """The variants a call with this problem launches (the launcher's own selection)."""
        head = head_bucket(max(self.d, self.dv))
        band = self.causal is not False
        fwd = forward_variant(self.dtype, head, band=band, extra=self.extra, vec=self.vec, smem_limit=self.smem_limit,
                              cc=self.cc, rows=row_class(head, self.lk, band), precision=self.precision,
                              wgmma=self.num_splits == 1)
        if self.packed:   # plan.plan_packed_forward's choice: the Hopper or the portable forward's PACKED twin
            rows = row_class(head, max(self.packed_lengths[1]), band)   # the longest sequence's (plan_packed_forward)
            choose = functools.partial(forward_variant, self.dtype, head, band=band, extra=False, vec=self.vec,
                                       smem_limit=self.smem_limit, cc=self.cc, rows=rows, precision=self.precision)
            fwd = [packed_variant(choose(), choose(wgmma=False), self.smem_limit)]
            if not self.backward:
                return fwd
            return fwd + (packed_backward_variants(self.dtype, head, band, self.vec, self.smem_limit, self.cc,
                                                   self.deterministic, self.precision) or [])
        if self.accumulator and fwd.family == "fwd_wgmma" and not self.extra:   # plan_forward's accumulator_out
            fwd = replace(fwd, acc_out=True)
        if self.num_splits > 1:   # rows a block holds: the query heads of a K/V head packed where nothing masks
            # (plan._gqa_packing), under a band where the partial kernel reads a packed row's position
            packed = split_variants(fwd, self.dv, self.smem_limit, self.lq * (HEADS_Q // HEADS_K), self.full)
            packs = not self.extra and (self.causal is False or packed[0].family in PERIODIC_BAND_FAMILIES)
            return list(packed if packs else split_variants(fwd, self.dv, self.smem_limit, self.lq, self.full))
        if not self.backward:
            return [fwd]
        return [fwd, *backward_variants(self.dtype, head, band=band, extra=self.extra, vec=self.vec,
                                        deterministic=self.deterministic, smem_limit=self.smem_limit,
                                        dbias=self.extra and self.bias, cc=self.cc, precision=self.precision)]


def variant_options(seed: int, lk: int = LK, bias: bool = True) -> dict:
    """The EXTRA problems' options for ``lk`` keys: a bias shared by the batch (its gradient
    crosses CTAs: atomics, or turns when deterministic; left out where ``bias`` is False),
    key padding, and dropout drawn at a mask origin (query, key) that varies with the seed."""
    rng = np.random.default_rng(seed)
    mask = np.ones((BATCH, 1, 1, lk), dtype=bool)
    mask[0, :, :, lk - 40:] = False          # batch 0: the last 40 keys are padding (a whole 32-key tile too)
    options = dict(bias=rng.standard_normal((1, HEADS_Q, LQ, lk)), mask=mask, dropout_p=0.125, seed=seed,
                   dropout_origin=(7 * (seed % 5), 4 * (seed % 7)))
    if not bias:
        del options["bias"]
    return options


def problem_for(v: Variant) -> Problem:
    """A problem whose call runs ``v``: head dims inside v's bucket (a multiple of 8
    for 16-byte loads, odd otherwise), causal alignment alternating by bucket, and
    the largest GPU class of SMEM_LIMITS under which the launcher picks v's tile. A split-KV
    variant: its unsplit twin's problem with three splits; the combine kernel: a plain forward's; the Hopper
    forward's float32-output twin: its 16-bit twin's problem, in the accumulator type."""
    if v.acc_out:
        return replace(problem_for(replace(v, acc_out=False)), accumulator=True)
    if v.kv_split:   # the call whose portable forward's split twin is v, on the GPU class that takes v's tile
        d = v.head if v.vec else v.head - 5
        causal = False if not v.band else ("bottom_right" if v.head in (64, 256) else True)
        precision = {"fwd_tf32": "tf32", "fwd_fma": "fma"}.get(v.family, "highest")
        lqs = (DECODE_LQ, DECODE_LQ_MINOR, DECODE_LQ_BAND, DECODE_LQ_STRIPS) if v.family == "fwd_decode" else (LQ,)
        for full, lq, limit, cc in itertools.product((False, True), lqs, sorted(SMEM_LIMITS.values(), reverse=True),
                                                     (80, 90)):
            p = Problem(v.dtype, d, d, causal, v.extra, False, False, limit, cc, precision=precision, num_splits=SPLITS,
                        lq=lq, full=full)
            try:
                if v in p.variants():
                    return p
            except ValueError:
                continue
        return Problem(v.dtype, d, d, causal, v.extra, False, False, precision=precision, num_splits=SPLITS,
                       lq=lqs[0])
    if v.packed:   # a varlen call on the GPU class that takes v's tile (the Hopper kernel: 16-byte rows)
        d = v.head if v.vec or v.arch == "sm90a" else v.head - 5
        causal = False if not v.band else ("bottom_right" if v.head in (64, 256) else True)
        backward = not v.family.startswith("fwd")
        for lengths, limit, cc, det in itertools.product((PACKED_LENGTHS, PACKED_LENGTHS_LONG),
                                                         sorted(SMEM_LIMITS.values(), reverse=True), (80, 90),
                                                         (backward, False)):
            p = Problem(v.dtype, d, d, causal, False, backward, det, limit, cc, packed=True, packed_lengths=lengths)
            try:
                if v in p.variants():
                    return p
            except ValueError:   # no such kernel for this GPU class
                continue
        return Problem(v.dtype, d, d, causal, False, backward, backward, packed=True)
    if v.family == "fwd_combine":
        d = v.head - 5
        return Problem(v.dtype, d, d, False, False, False, False, num_splits=SPLITS)
    head = v.head or 64
    hopper = v.arch == "sm90a"    # selected on compute capability 9.0, 16-byte loads only
    cc = 90 if v.arch in ("sm90a", "sm90") else 80   # "sm90": the portable kernels' sm_90 rows
    d = head if v.vec or hopper else head - 5
    causal = False if not v.band else ("bottom_right" if head in (64, 256) else True)
    backward = not v.family.startswith("fwd")
    deterministic = v.family.startswith("bwd_dq") or (v.family.startswith("bwd_dkdv") and not v.atomic_dq)
    if v.family == "bwd_convert_dq":
        deterministic = False
        if not v.dq_tiled and v.dtype in ("float16", "bfloat16"):   # the row-major accumulator: the Hopper kernel's
            cc, d = 90, head
    # A dV-only pass (pass_ 1) never adds dQ itself, but runs in atomic-dQ plans too.
    # A Hopper forward with a key threshold gets just past it (an odd tile edge too; its short-rows
    # tile, Variant.short, stays below it); a Hopper
    # variant with EXTRA gets keys a multiple of 8, so that the bias's rows are 16-byte chunks (the
    # Hopper kernels copy no other bias: masking.rows_in_chunks) and still end inside a tile.
    lk = LK
    if v.family == "fwd_wgmma" and head in HOPPER_FWD_MIN_KEYS and not v.short:
        # past the short-rows threshold (EXTRA calls: past the minimum), twice it under a band
        lk = (HOPPER_FWD_MIN_KEYS[head] if v.extra else HOPPER_FWD_SHORT_KEYS[head] * (2 if v.band else 1)) + 2
    if hopper and v.extra:   # the Hopper backward copies a bias by 16-byte chunks too
        lk = -(-lk // 8) * 8
    precision = "highest"
    if v.dtype == "float32":   # the family's precision: the plain TF32 kernels, or the FMA ones (the baseline)
        precision = {"fwd_tf32": "tf32", "fwd_wgmma_tf32": "tf32", "bwd_dkdv_tf32": "tf32", "bwd_dq_tf32": "tf32", "fwd_fma": "fma",
                     "bwd_dkdv_fma": "fma", "bwd_dq_fma": "fma"}.get(v.family, "highest")
    for bias, det, limit in itertools.product((True, False), (deterministic, not deterministic),
                                              sorted(SMEM_LIMITS.values(), reverse=True)):
        p = Problem(v.dtype, d, d, causal, v.extra, backward, det, limit, cc, lk, bias, precision)
        try:
            if v in p.variants():
                return p
        except ValueError:     # this GPU class has no kernel for the problem
            continue
    return Problem(v.dtype, d, d, causal, v.extra, backward, deterministic, cc=cc, lk=lk, precision=precision)
