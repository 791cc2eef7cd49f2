"""THE variant table: (arch, kernel family, dtype, head-dim bucket, flags) -> tile configuration.

Everything that names a kernel derives from this module: the launcher
(:mod:`cuflash._launch`) selects variants here, the CPU compile check
(``tests/test_build.py``, ``python -m cuflash compile``) and the GPU test that runs
every shipped variant (``tests/test_variants_gpu.py``) iterate :func:`all_variants`.
A variant's template name expression carries its tile configuration, the thread
count and the shared-memory size the launch will use; each kernel ``static_assert``s
that they match its own layout, so this table and ``kernels_cu/`` cannot drift
apart without the CPU compile check failing.

Kernel families (``kernels_cu/`` entry files):

==================  ======================  ==========================================
family              entry                   what
==================  ======================  ==========================================
fwd_mma             flash_fwd_mma.cu        forward, float16/bfloat16, mma.sync
fwd_dmma            flash_fwd_dmma.cu       forward, float64, mma.sync m8n8k4 (fp64 tensor cores)
fwd_wgmma           flash_fwd_wgmma.cu      forward, float16/bfloat16, Hopper wgmma (arch "sm90a")
fwd_tf32x3          flash_fwd_tf32.cu       forward, float32 precision="highest", split TF32 (3xTF32) mma.sync
fwd_tf32            flash_fwd_tf32.cu       forward, float32 precision="tf32", TF32 mma.sync
fwd_wgmma_tf32x3    flash_fwd_wgmma_tf32.cu forward, float32 precision="highest", 3xTF32 on Hopper wgmma (arch "sm90a")
fwd_wgmma_tf32      flash_fwd_wgmma_tf32.cu plain TF32 on Hopper wgmma: no table rows (slower than fwd_tf32 on the H100)
fwd_fma             flash_fwd_fma.cu        forward, float32 where no TF32 tile fits, CUDA-core FMA
bwd_dsum            flash_bwd_aux.cu        Dsum = rowsum(dO * O)
bwd_dkdv_mma        flash_bwd_mma.cu        dK, dV (+ atomic dQ), 16-bit, head dim <= 128
bwd_dq_mma          flash_bwd_mma.cu        deterministic dQ, 16-bit, head dim <= 128
bwd_dkdv_wgmma      flash_bwd_wgmma.cu      dK, dV, atomic dQ, float16/bfloat16, Hopper wgmma (arch "sm90a")
bwd_dbias_mma       flash_bwd_dbias.cu      dbias (a bias's gradient), 16-bit, head dim <= 128
bwd_dkdv_dmma       flash_bwd_dmma.cu       dK, dV (+ atomic dQ), float64, fp64 tensor cores, head dim <= 128
bwd_dq_dmma         flash_bwd_dmma.cu       deterministic dQ, float64, fp64 tensor cores, head dim <= 128
bwd_dkdv_tf32x3     flash_bwd_tf32.cu       dK, dV (+ atomic dQ), float32 precision="highest", 3xTF32 mma.sync
bwd_dq_tf32x3       flash_bwd_tf32.cu       deterministic dQ, float32 precision="highest", 3xTF32 mma.sync
bwd_dkdv_tf32       flash_bwd_tf32.cu       dK, dV (+ atomic dQ), float32 precision="tf32", TF32 mma.sync
bwd_dq_tf32         flash_bwd_tf32.cu       deterministic dQ, float32 precision="tf32", TF32 mma.sync
bwd_dkdv_fma        flash_bwd_fma.cu        dK, dV (+ atomic dQ), FMA
bwd_dq_fma          flash_bwd_fma.cu        deterministic dQ, FMA
bwd_convert_dq      flash_bwd_aux.cu        dQ accumulator -> input dtype
==================  ======================  ==========================================

``arch`` names the family's instruction set: "sm80" is the portable mma.sync / FMA
path that runs on every GPU of compute capability 8.0 or newer (it is compiled for
sm_80 and sm_90 in the CPU check); "sm90" rows hold tiles of the same portable kernels
that GPUs of compute capability 9.0 or newer take instead of the "sm80" row (tiles tuned on the
H100 that spill on sm_80, or the fp64 MMA shapes that need sm_90: Tile.wide_k), compiled for
sm_90 only; "sm90a" is Hopper's own (wgmma), compiled for sm_90a only and chosen on GPUs of
compute capability 9.0 (:func:`forward_variant`).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, List, Tuple

HEAD_BUCKETS = (32, 64, 128, 256)
"""Head dims are padded up to one of these (the mma k-step is 16, the FMA kernels
split columns over 16 threads)."""

DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_TYPES = ("float16", "bfloat16")
CXX_TYPE = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
MAX_GRID_X = 2**31 - 1
MMA_BWD_MAX_HEAD = 128
"""The portable tensor-core backward covers head dims up to 128; the 16-bit backward at 256 is FMA
there (on Hopper, the wgmma kernel's head-dim-256 variant)."""


def head_bucket(d: int) -> int:
    """The smallest head-dim bucket holding ``d``."""
    for bucket in HEAD_BUCKETS:
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim {d} is larger than the largest supported ({HEAD_BUCKETS[-1]})")


def acc_itemsize(dtype: str) -> int:
    """Bytes of the accumulator type: fp32, or fp64 for float64."""
    return 8 if dtype == "float64" else 4


@dataclass(frozen=True)
class Tile:
    """A tile configuration: ``block_m`` query rows x ``block_n`` keys, ``warps``
    warps per CTA, ``stages`` deep shared-memory pipeline, ``ctas`` CTAs per SM
    that the register budget must allow (``__launch_bounds__``' minimum blocks);
    ``why`` is the measurement or constraint that chose it. ``passes`` (the
    tensor-core dK/dV kernel only): 1 forms dK and dV in one pass, 2 in a dV pass
    and a dK pass where their accumulators and the step's score tiles would not
    fit the registers together (:func:`_dkdv_passes`). ``split`` (the 3xTF32 families
    only, ``*_tf32x3``): how operands are split into big + small, the kernels' SPLIT kind
    (warp_gemm_tf32.cuh): 1 both parts rounded (TF32X3_ROUNDED), 2 big rounded by its bits
    and small left for the tensor core to truncate (TF32X3_FAST, a tuning candidate:
    benchmarks/tune_f32.py). ``wide_k`` (the fp64 tensor-core families of :data:`WIDE_K_FAMILIES`,
    sm_90+ only, so in "sm90" rows): 0 runs their GEMMs on ``mma.m8n8k4``, 4 / 8 / 16 on
    ``mma.m16n8k{4,8,16}`` over pairs of 8-row tiles (warp_gemm_f64.cuh), which run at full fp64
    tensor-core rate on the H100 where m8n8k4 runs at half (benchmarks/dmma_rate.py: 66 against 33
    TFLOP/s). ``query_split`` (the 16-bit dK/dV kernel ``bwd_dkdv_mma`` only, its QSPLIT): 1 gives each
    warp its keys for the whole step and head dim; 2 makes two warps share each key strip, one forming
    S^T for half the step's queries and accumulating half of dK / dV's columns, with P^T and dS^T
    exchanged through shared memory (FlashAttention-2's backward layout, flash_bwd_mma.cu).
    ``split`` 3 (TF32X3_PARTS, the Hopper wgmma forward's ``fwd_wgmma_tf32x3``): big as
    the fast split's, small = a - big with its low 13 bits cleared, so that the tensor core reads both
    exactly whether it rounds or truncates. ``vec_only``: only variants with 16-byte loads (``Variant.vec``) take this tile; the
    element-load ones go on to the next (a tile whose scalar loader's addresses push it past the
    registers). ``resident``: a GPU takes this tile only where that many of its CTAs fit one SM's
    shared memory (:func:`fits_resident`), the next tile otherwise: a 4-warp tile tuned at two CTAs
    an SM on the H100 is not taken where it would run alone (the A100's 164 KB). ``park`` (the 16-bit
    forward ``fwd_mma`` only, its PARK): the block's coordinates and the key loop's bounds wait in
    shared memory (the Q rows' padding) instead of registers, which a tile needs where the loop
    holds every register (flash_fwd_mma.cu). ``late_copies`` (``bwd_dkdv_mma`` with two stages, its LATE_COPIES;
    taken at head dim 128, where one CTA of 8 warps fills an SM): the next step's Q / dO copies are issued after the
    step's first GEMM instead of before its first barrier, where every warp's address arithmetic delayed the MMAs."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    why: str
    ctas: int = 1
    passes: int = 1
    split: int = 1
    wide_k: int = 0
    vec_only: bool = False
    query_split: int = 1
    resident: int = 1
    park: bool = False
    late_copies: bool = False


# --------------------------------------------------------------------------- the table

# Each entry lists tiles in order of preference; a call takes the first whose
# shared memory fits the device's per-block limit (SMEM_LIMITS), so a table entry
# tuned on an H100 (227 KB) keeps a configuration for the A100 (163 KB) and for
# sm_86 / sm_89 / sm_120 GPUs (99 KB).
_TABLE: Dict[Tuple[str, str, str, int], Tuple[Tile, ...]] = {}

SMEM_LIMITS = {"sm_90 (H100, H200)": 232448, "sm_80 (A100)": 166912, "sm_86, sm_89, sm_120 (RTX 30/40/50, L40)": 101376}
"""Opt-in shared memory per block by GPU class, in bytes (the CUDA programming guide's
compute-capability table); what the tests and the README check against. At run time the
device's own attribute decides."""
SMEM_MAX = max(SMEM_LIMITS.values())


CTA_RESERVED_SMEM = 1024
"""Shared memory the hardware reserves per resident CTA (sm_80 and later): an SM holds the per-block
opt-in limit plus one reservation, so ``n`` CTAs of ``b`` bytes fit where n * (b + 1 KB) <= limit + 1 KB."""


def fits_resident(smem_bytes: int, resident: int, smem_limit: int) -> bool:
    """Whether ``resident`` CTAs of ``smem_bytes`` each fit one SM of a GPU whose per-block opt-in limit
    is ``smem_limit`` (the per-SM capacity is that limit plus one CTA reservation on sm_80 and later)."""
    return resident * (smem_bytes + CTA_RESERVED_SMEM) <= smem_limit + CTA_RESERVED_SMEM


def smem_limit_for_arch(arch: str) -> int:
    """Opt-in shared memory per block of an ``sm_XY`` architecture (SMEM_LIMITS' classes;
    unknown newer ones are assumed to have the largest)."""
    cc = int(arch.split("_")[1].rstrip("a"))
    if cc in (80, 87):
        return SMEM_LIMITS["sm_80 (A100)"]
    if cc in (86, 89, 120, 121):
        return SMEM_LIMITS["sm_86, sm_89, sm_120 (RTX 30/40/50, L40)"]
    return SMEM_MAX


_EXTRA_TABLE: Dict[Tuple[str, str, str, int], Tuple[Tile, ...]] = {}
"""Tiles for the EXTRA variants (bias / mask / block sparsity / dropout compiled in) where
the plain variant's tile would spill with that code on top."""

_SHORT_TABLE: Dict[Tuple[str, str, str, int], Tuple[Tile, ...]] = {}
"""Tiles for calls with too few keys for the table's tile to pay (:func:`row_class`; ``Variant.short``):
the Hopper forward's short-rows tiles, plain and band variants only."""


def _add(family: str, dtypes, heads, *tiles: Tile, arch: str = "sm80", extra: bool = False,
         short: bool = False) -> None:
    table = _SHORT_TABLE if short else _EXTRA_TABLE if extra else _TABLE
    for dtype in dtypes:
        for head in heads:
            table[(arch, family, dtype, head)] = tiles


_SMALL_BYTES = "99 KB of shared memory (sm_86 / sm_89 / sm_120)"

# Tensor-core forward: each warp owns block_m / warps query rows, in 16-row strips;
# with two strips a warp reuses every K / V fragment it loads for two MMAs (the
# 16-row loop was bound by shared-memory bandwidth: 36 ldmatrix.x4 per 64 MMAs).
# benchmarks/tune_fwd.py on an H100 (fp16 / bf16 alike, B*L=16384, H*D=2048;
# TFLOP/s at L=4096, non-causal / causal), 2026-11-23:
#   d=32:  64x64/4w 151/140   128x64/4w 181/141   128x128/4w 184/168   64x64/2w 168/134
#   d=64:  64x64/4w 194/172   128x64/4w 223/195   64x64/2w 199/176     128x32/4w 206/160
#   d=128: 64x64/4w 207/187   128x32/4w 230/189   64x32/2w 209/176
#   (2026-11-22, one strip: d=256 64x32/4w 188/145 beat 32x32/2w 129/88; at d=256 two strips spill.)
# 128x64 at d=128 spills (acc_o + S exceed 255 registers). Sixteenth session, tune_fwd.py on the portable
# path of an H100 (fp16 / bf16, L=4096): 128x32/4w 327/325 non-causal, 276/284 causal; 128x64/4w 343/353,
# 289/283 (L=1024: +5-8% both): FA2's tile is faster, but it spills 8-56 bytes (NVRTC 12.9 and 13.0, plain and
# band variants); recomputing the block after the loop (blockIdx read through asm volatile) only moved the
# spills into the loop. Not adopted while a variant spills.
_add("fwd_mma", HALF_TYPES, [32], Tile(128, 128, 4, 2, "two strips per warp: +19% over 64x64/4w (tune_fwd.py)"))
# d=64, 128x128 (2026-11-23, fourth session, fp16 tune_fwd.py): 241 -> 269 TFLOP/s at L=4096 over 128x64,
# 183 -> 203 at L=1024; causal 197 -> 220 while the band variant still spilled 132 bytes. It fits every
# plain and band variant (both load widths) since P is packed to 16 bits as the softmax forms it, the
# partial tiles' mask is two bounds a fragment row, the fully visible tiles are found once per warp
# and the K/V loader walks one pointer down the rows (branch band128): 251-255 registers, 0 spills
# on sm_80 and sm_90 (the band variant spilled 132 bytes, the sm_80 scalar-load one 108).
_add("fwd_mma", HALF_TYPES, [64], Tile(128, 128, 4, 2, "two strips of 128 keys: +11% (causal +12%, spilling) over "
                                                      "128x64 (tune_fwd.py); 251-255 registers, 0 spills"))
# d=128 at FA2's 128x64 (twentieth session). Without PARK it spills 8-56 bytes (the block's coordinates, the K/V
# pointers or the loop bounds, wherever ptxas puts the pressure); with PARK (Tile.park) they wait in the Q rows'
# padding and every plain and band variant fits 255 registers, 0 spills (NVRTC 12.9, sm_80 / sm_90). PARK costs
# 30-60 instructions a step (the parked values come back per thread, not in uniform registers): 2-4% against the
# spilling kernel. tune_fwd.py --peer on the H100 (calls 3 and 4, fp16 / bf16, L=1024-16384), 128x64 PARK against
# 128x32: 1.00-1.10x non-causal, 0.94-1.08x causal (median 1.03); against FA2 0.95-1.12x. 102 KB: two CTAs an SM
# on the H100 only (resident=2); the A100 and the 99 KB GPUs keep 128x32 (68 KB, two CTAs an SM on the A100).
_add("fwd_mma", HALF_TYPES, [128],
     Tile(128, 64, 4, 2, "FA2's tile with PARK: 1.00-1.10x 128x32 non-causal, 0.94-1.08x causal (tune_fwd.py)",
          resident=2, park=True),
     Tile(128, 32, 4, 2, "two strips per warp, 32-key tiles: +11-15% non-causal, +1-3% causal over 64x64 "
                         "(tune_fwd.py)"))
# With EXTRA, 128x64 spills at d=128 with PARK (8-148 bytes) and without (0-144; NVRTC 12.9): 32-key tiles.
_add("fwd_mma", HALF_TYPES, [128], Tile(128, 32, 4, 2, "128x64 spills with the EXTRA code"), extra=True)
_add("fwd_mma", HALF_TYPES, [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles"))
# With EXTRA (bias, mask, block layout, dropout) and the bias staged in shared memory: two strips as in
# the plain kernel; 128x128 spills (d=32: 44-252 bytes, d=64: 68-236). With the band too, the d=64
# kernel spilled at 128x64 (4-8 bytes on sm_90 when chosen, 24-48 on both archs later) and took 128x32
# (plain causal: 160 TFLOP/s against 195 at 128x64, tune_fwd.py); since the K/V loader of branch band128
# it fits 128x64 (240-253 registers, 0 spills on sm_80 / sm_90), as the EXTRA kernel without the band.
_add("fwd_mma", HALF_TYPES, [32, 64], Tile(128, 64, 4, 2, "two strips per warp of 64 keys; 128x128 spills with the "
                                                          "EXTRA code"), extra=True)
_add("fwd_mma", HALF_TYPES, [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles"),
     Tile(64, 16, 4, 2, "16-key tiles: K/V and the bias stages fit " + _SMALL_BYTES), extra=True)

# Hopper forward (flash_fwd_wgmma.cu, arch "sm90a"): a TMA producer warpgroup and two consumer
# warpgroups of 64 query rows; S = Q K^T and O += P V on wgmma (m64nNk16), Q/K/V in 128-byte
# swizzled shared memory on mbarrier stages. Offline compile (NVRTC 12.9, sm_90a): 168 registers
# at launch, consumers up to 232 after setmaxnreg, 0 spills. On the H100 (compare_trees.py, sixth
# session) against the fifth session's cp.async kernel at d=128: 1.07-2.0x (bf16 L=16384 673
# TFLOP/s); against the portable kernel at d=64: 1.20-1.42x at L >= 4096, 0.92-0.98x at L = 1024
# (per-block start-up; the short-rows tile below and persistent CTAs since). Ping-pong of the consumers measured
# 0.90-1.01x and is off (FwdWgmmaTraits::PINGPONG). Head dim 64 takes three consumer warpgroups
# (192 rows; 160 registers each after setmaxnreg, the consumer code up to R156): 1.12-1.25x the
# two-warpgroup kernel non-causal, 1.02-1.06x causal at L 2048-16384 (compare_trees.py, eighth
# session). EXTRA (bias, mask, dropout, block layout; ninth session)
# keeps these tiles: a swizzled bias tile per K/V stage (Hopper d=128 and 256: 225 KB), copied
# by two producer warps; offline 0 spills, consumers up to R157 / R229 of 160 / 232, the producer
# up to R29 of 32 at head dim 64 (24 without EXTRA) and R37 of 40 (benchmarks/NOTES.md).
# Persistent CTAs (seventeenth session; FwdWgmmaTraits::PERSISTENT, persistent_grid): the 192- and 128-row
# tiles without EXTRA walk query blocks, one CTA an SM, where the call has no causal band; at head dim 128 O
# is staged in a tile of its own (193 KB) so that the next block's Q lands during this one's epilogue.
# benchmarks/tune_persistent.py on the H100 (queued, same buffers, bitwise-equal outputs): d=128 L=1024
# 1.15x / 1.13x (bf16 / fp16), L=2048 1.08x / 1.04x, L=4096 1.03x / 1.00x; causal calls forced onto the
# stride 0.94-1.02x (their blocks differ in work), so they keep a CTA a block; d=64's long-rows tile
# (L = 4096 here) 1.00-1.02x.
_add("fwd_wgmma", HALF_TYPES, [64], Tile(192, 128, 16, 2, "a TMA producer and three consumer warpgroups of 64 "
                                                         "rows, 128-key tiles: 89 KB"), arch="sm90a")
_add("fwd_wgmma", HALF_TYPES, [128], Tile(128, 128, 12, 2, "a TMA producer and two consumer warpgroups of 64 rows, "
                                                          "128-key tiles, an O tile: 193 KB"), arch="sm90a")
# Head dim 256: acc_o is 128 registers a consumer thread, so 64-key tiles (S 32, P 16 registers):
# Q 64 KB + two stages of K and V 128 KB = 193 KB.
_add("fwd_wgmma", HALF_TYPES, [256], Tile(128, 64, 12, 2, "a TMA producer and two consumer warpgroups of 64 rows, "
                                                         "64-key tiles (acc_o is 128 registers): 193 KB"),
     arch="sm90a")
# Short rows at head dim 64 (row_class, HOPPER_FWD_SHORT_KEYS): the 192 x 128 tile runs one CTA an SM,
# whose start (Q and the first tiles in flight, nothing to overlap them) and epilogue no other CTA
# hides: ~16 K cycles a block against ~2.5 K a key tile at L = 1024 (ncu, thirteenth session). Two CTAs
# an SM: 384 x 80 registers at launch, the producer keeps 24, the consumers take 104 (FwdWgmmaTraits,
# MIN_CTAS 2), which 64-key tiles fit when each tile's P V is waited for before the next S (OVERLAP_PV
# off; with it 16 bytes spill and ptxas serialises every wgmma). Offline (NVRTC 12.9 and 13.0, sm_90a):
# 0 spills, consumer code up to R98. benchmarks/tune_short.py, H100: L = 1024 1.19-1.21x the 192-row tile
# non-causal, 1.6x causal (queued; benchmarks/NOTES.md, fifteenth session).
_add("fwd_wgmma", HALF_TYPES, [64], Tile(128, 64, 12, 2, "short rows: two consumer warpgroups of 64 rows, 64-key "
                                                        "tiles, two CTAs an SM: 49 KB", ctas=2),
     arch="sm90a", short=True)

# Hopper backward (flash_bwd_wgmma.cu, arch "sm90a"): dK, dV and atomic dQ. A TMA producer warp and
# two consumer warpgroups of 64 keys (a CTA per 128-key block); S^T, dP^T, dV, dK and dQ on wgmma,
# dQ as a 64 x 64 block per warpgroup: d=64 takes 128-query steps (dQ split by rows), d=128 64-query
# steps (split by columns). Non-deterministic calls only (backward_variants); EXTRA at head dims 64 and
# 128 (ninth session): a swizzled bias tile per Q/dO stage, copied by two
# producer warps; at d=64 two 32 KB bias stages beside the 128-query steps' buffers would be 258 KB, so
# EXTRA takes 64-query steps there (dQ split by keys: both warpgroups add into one 64 x 64 block).
# With a bias's gradient wanted the EXTRA variant adds dS^T itself (``dbias``; branch hopper-dbias,
# run on the H100 in the tenth session: bias forward+backward 9.6 -> 7.9 ms): vector reductions into a key-major fp32 accumulator, same tiles and shared memory,
# offline 0 spills, consumer code up to R205 (d=64) / R228 (d=128) of 232; no dbias kernel.
_add("bwd_dkdv_wgmma", HALF_TYPES, [64], Tile(128, 128, 12, 2, "a TMA producer warp, two consumer warpgroups of 64 "
                                                              "keys, 128-query steps: 194 KB"), arch="sm90a")
_add("bwd_dkdv_wgmma", HALF_TYPES, [128], Tile(64, 128, 12, 2, "a TMA producer warp, two consumer warpgroups of 64 "
                                                               "keys, 64-query steps: 193 KB"), arch="sm90a")
_add("bwd_dkdv_wgmma", HALF_TYPES, [64], Tile(64, 128, 12, 2, "EXTRA: 64-query steps, dQ split by keys; two bias "
                                                              "stages: 161 KB (128-query steps: 258 KB)"),
     arch="sm90a", extra=True)
# Head dim 256 (ninth session): dK + dV of 64 keys over all 256 columns
# would be 256 accumulator registers a consumer thread (of 232), so both consumer warpgroups own the
# block's 64 keys and split dK, dV and dQ by columns (128 each: 64 + 64 registers); S^T (warpgroup 0)
# and dP^T (warpgroup 1) are formed once and P^T / dS^T exchanged in shared memory; dQ is staged in
# the step's own Q / dO slabs. K, V 64 KB + two stages of Q, dO 128 KB + P^T, dS^T twice 32 KB = 226 KB.
_add("bwd_dkdv_wgmma", HALF_TYPES, [256], Tile(64, 64, 12, 2, "a TMA producer warp, two consumer warpgroups sharing "
                                                              "64 keys, 128 columns each, 64-query steps: 226 KB"),
     arch="sm90a")

# FMA forward: 16 x 16 threads, block_m / 16 rows per thread; Q, K, V and P
# tiles once each in shared memory.
_add("fwd_fma", ["float32"], [32, 64], Tile(64, 64, 8, 1, "4x4 scores per thread"))
_SMALL = "fits " + _SMALL_BYTES
_add("fwd_fma", ["float32"], [128], Tile(64, 64, 8, 1, "113 KB shared"), Tile(32, 64, 8, 1, _SMALL))
_add("fwd_fma", ["float32"], [256], Tile(64, 32, 8, 1, "137 KB shared; 32-key tiles"), Tile(16, 32, 8, 1, _SMALL))
# float32 on the TF32 tensor cores (flash_fwd_tf32.cu; run on the H100 in the tenth session, 34-42
# TFLOP/s "highest", 125-167 "tf32": the tiles are still chosen by the offline compile alone, NVRTC 12.9, 0 spills on sm_80 and sm_90; benchmarks/NOTES.md has
# the register counts). Two families of one kernel: fwd_tf32x3 is precision="highest" (3xTF32,
# three MMAs a product and the operand splits), fwd_tf32 is precision="tf32" (one MMA).
# 3xTF32 is MMA-bound (each B fragment load feeds 3 MMAs a strip): one 16-row strip a warp
# suffices, and its K loop stays rolled (warp_gemm_tf32.cuh); two strips spilled 20-324 bytes.
# At head dim 256 (acc_o alone 128 registers) 64x16/4w spilled 4-188 bytes: "highest" stays on
# the FMA kernel there, as does any call whose GPU has no tile here (forward_variant).
_add("fwd_tf32x3", ["float32"], [32], Tile(64, 64, 4, 2, "one strip a warp (3xTF32 is MMA-bound), 64-key tiles: "
                                                         "54 KB"))
# Eleventh session (benchmarks/tune_f32.py on the H100, L=4096, TFLOP/s non-causal / causal): the fast
# operand split (Tile.split 2, TF32X3_FAST: 3 instructions an element instead of 7; the kernels were
# instruction-issue bound) with the same errors as the rounded split (4.6-4.7e-7 against float64):
#   d=64:  64x64/4w rounded (the table before) 42.0 / 39.9; fast 64x64/4w 54.1 / 49.7 (254 registers on
#          sm_90, 12 bytes spilled on sm_80: an "sm90" row), 64x32/4w 50.1 / 46.3, 128x64/8w 51.7 / 47.6.
#   d=128: 128x16/8w rounded (the table before) 36.7 / 33.5; fast 128x16/8w 43.5 / 38.7, 128x32/8w 50.5 /
#          46.6 (255 registers with 16-byte loads); rounded 128x32/8w 42.5 / 39.6.
_add("fwd_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "fast split, one strip a warp, 32-key tiles: 1.19x the "
                                                         "rounded 64x64 (tune_f32.py); 68 KB", split=2))
_add("fwd_tf32x3", ["float32"], [64], Tile(64, 64, 4, 2, "fast split, 64-key tiles (12 bytes spilled on sm_80): "
                                                         "1.25-1.29x the rounded 64x64 (tune_f32.py); 102 KB",
                                           split=2), arch="sm90")
# 128x32/8w fast spills 16 bytes on sm_90 in its element-load (vec=False) variants: 16-byte loads only.
_add("fwd_tf32x3", ["float32"], [128], Tile(128, 32, 8, 2, "fast split, 8 warps of one strip, 32-key tiles, 16-byte "
                                                           "loads: 1.38-1.39x the rounded 128x16 (tune_f32.py); "
                                                           "198 KB", split=2, vec_only=True),
     Tile(128, 16, 8, 2, "element loads (32-key tiles spill 16 bytes on sm_90), fast split, 16-key tiles: "
                         "1.16-1.19x the rounded one (tune_f32.py); 165 KB", split=2),
     Tile(64, 16, 4, 2, "4 warps, 16-key tiles: 99 KB, the A100 and " + _SMALL_BYTES, split=2))
_add("fwd_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "the bias stages, 32-key tiles (64 spilled 4 bytes on "
                                                         "sm_80), fast split: 88 KB", split=2), extra=True)
_add("fwd_tf32x3", ["float32"], [128], Tile(64, 16, 4, 2, "the bias stages, fast split: 111 KB", split=2), extra=True)
# Plain TF32: one MMA a product, so two strips a warp as the 16-bit kernel (each K / V fragment
# feeds two MMAs; shared-memory bandwidth bounds the one-strip loop).
_add("fwd_tf32", ["float32"], [32, 64], Tile(128, 64, 4, 2, "two strips a warp, 64-key tiles: d=64 102 KB"),
     Tile(64, 32, 4, 2, "one strip, 32-key tiles: " + _SMALL_BYTES))
_add("fwd_tf32", ["float32"], [128], Tile(128, 32, 4, 2, "two strips a warp, 32-key tiles: 132 KB"),
     Tile(64, 32, 4, 2, "one strip: 99 KB, the A100 and " + _SMALL_BYTES),
     Tile(64, 16, 4, 2, "16-key tiles: with the bias stages 78 KB, " + _SMALL_BYTES))
_add("fwd_tf32", ["float32"], [256], Tile(64, 32, 4, 2, "acc_o alone is 128 registers: one strip, 32-key tiles: "
                                                        "195 KB"),
     Tile(64, 16, 4, 2, "16-key tiles: 130 KB, the A100"))
# float32 on Hopper's warpgroup MMA with TF32 operands (flash_fwd_wgmma_tf32.cu, arch "sm90a"; branch
# tf32-wgmma, written and compiled offline, NOT RUN ON A GPU yet): a TMA producer warpgroup that also
# writes K's parts and V's transposed parts (TF32 wgmma takes K-major shared operands only), consumer
# warpgroups of 64 rows; 3xTF32 in fresh fragments pipelined two deep (wgmma_tf32.cuh). Shared memory
# is the limit (fp32 parts: Q twice, a stage K twice, V once as loaded, V^T twice): head dim 64 takes
# two consumer warpgroups and 64-key tiles (225 KB), head dim 128 one warpgroup and 32-key tiles
# (225 KB). Offline compile (NVRTC 12.9, sm_90a), 0 spills: d=64 168 registers at launch (consumers
# 232, the producer 40 after setmaxnreg), d=128 240. EXTRA (bias, mask, dropout, block layout; branch
# wgmma-tf32-extra, offline only) keeps these tiles and their shared memory (no EXTRA rows: the
# _EXTRA_TABLE is for tiles that differ): no room for bias stages, so the consumers read the bias from
# global memory into S's fragments (bias_frags.cuh); 0 spills, consumer code up to R227 of 232 (d=64
# 3xTF32; R195 without EXTRA), R233 of 240 (d=128 3xTF32; R227), R164 plain TF32 (sm_90a SASS, NVRTC 13).
_add("fwd_wgmma_tf32x3", ["float32"], [64], Tile(128, 64, 12, 2, "a TMA producer (K's parts, V^T's) and two "
                                                                "consumer warpgroups of 64 rows, 64-key tiles: "
                                                                "225 KB; 79 TFLOP/s, 1.45x the portable table "
                                                                "(tune_f32.py, H100)", split=3), arch="sm90a")
_add("fwd_wgmma_tf32x3", ["float32"], [128], Tile(64, 32, 8, 2, "a TMA producer and one consumer warpgroup, "
                                                               "32-key tiles: 225 KB; 54 TFLOP/s, 1.04x the "
                                                               "portable table (H100)", split=3),
     arch="sm90a")
# Plain TF32 (SPLIT 0: one wgmma a k8 step, no small parts; the same tiles at 129 KB) has no rows: on
# the H100 it measured slower than the portable fwd_tf32 (bench_precision.py --quick, thirteenth session:
# 127.9 against 146.2 TFLOP/s at D=64, 76.7 against 138.7 at D=128), the producer's V^T copy being the
# limit without a split to hide it. The family stays defined (fwd_wgmma_tf32); rows here route it.
# (float64 forwards run on the fp64 tensor cores below; fwd_fma compiles for double too, and
# forward_variant falls back to it for any head bucket that has no fwd_dmma entry.)

# fp64 tensor-core forward (mma.sync m8n8k4): each warp owns block_m / warps query rows in 8-row
# tiles (two or more: every K / V fragment a warp loads feeds that many MMAs; an 8-byte load by a
# warp costs about what one m8n8k4 does, warp_gemm_f64.cuh). With 4 warps, registers (140-250:
# ptxas hoists fragment loads as far as the budget allows) allow two CTAs an SM, so a tile of
# <= 113 KB runs 8 warps an SM. Registers of the plain / band kernels from the offline compile
# (sm_80 / sm_90, every flag, 0 spills). Timed on an H100 (benchmarks/tune_fwd.py --dtype float64,
# TFLOP/s non-causal / causal, L=4096): d=64 FMA 11.5 / 10.8, 64x32/4w 18.5 / 17.6, 64x16/4w
# 19.5 / 18.3, 64x64 and 128x32 13.8-13.9; d=128 FMA 9.7 / 9.4, 64x32/4w 16.0 / 15.4, 64x24 15.7 /
# 15.0, 64x16 15.0 / 14.3. (64x16 at d=64 is a candidate still to confirm at L=1024.)
#   d=32:  128x32/4w (four 8-row tiles a warp) 214-230 regs, 71 KB; 128x64 spills 64-550 bytes.
#   d=64:  64x32/4w 174-196 regs, 101 KB; 128x32/4w fits plain (252) but spills with EXTRA or band.
#   d=128: 64x32/4w 238-242 regs, 197 KB (one CTA an SM; so is 64x16: 131 KB).
#   d=256: 32x16/4w (one row tile a warp: acc_o alone is 128 registers) 230-250 regs, 195 KB.
_add("fwd_dmma", ["float64"], [32], Tile(128, 32, 4, 2, "four 8-row tiles a warp (half the shared loads per MMA "
                                                        "of two); 71 KB, two CTAs an SM by registers"))
_add("fwd_dmma", ["float64"], [64], Tile(64, 32, 4, 2, "two 8-row tiles a warp, 101 KB: two CTAs an SM; four tiles "
                                                       "spill with EXTRA or the band"),
     Tile(64, 16, 4, 2, "16-key tiles: 69 KB, " + _SMALL))
_add("fwd_dmma", ["float64"], [128], Tile(64, 32, 4, 2, "two 8-row tiles a warp, 197 KB (one CTA an SM)"),
     Tile(64, 16, 4, 2, "16-key tiles: 131 KB, the A100"), Tile(32, 16, 2, 2, "two warps: 99 KB, " + _SMALL))
# sm_90 runs mma.m16n8k{4,8,16}.f64 at full rate, m8n8k4 at half (benchmarks/dmma_rate.py on the H100: 66
# against 33 TFLOP/s). tune_fwd.py --dtype float64 (eleventh session, H100, L=4096, TFLOP/s non-causal /
# causal): d=64 64x32/4w m8n8k4 (the sm80 row) 18.5 / 18.1, 64x32/4w k16 25.5 / 22.5, k4 25.9 / 24.8,
# 128x32/8w k16 26.8 / 24.9; d=128 64x32/4w 16.0 / 15.5, k16 20.0 / 19.1, k4 23.0 / 21.9, 128x16/8w 21.5 /
# 19.8, 128x16/8w k16 31.5 / 28.5. Errors 2.1-2.2e-15 (non-causal) against long double, as m8n8k4's.
_add("fwd_dmma", ["float64"], [64], Tile(128, 32, 8, 2, "mma.m16n8k16 (full-rate fp64 on sm_90), four 8-row tiles a "
                                                        "warp: 1.38-1.45x m8n8k4's 64x32 (tune_fwd.py); 135 KB",
                                         wide_k=16), arch="sm90")
_add("fwd_dmma", ["float64"], [128], Tile(128, 16, 8, 2, "mma.m16n8k16 (full-rate fp64 on sm_90), 8 warps, 16-key "
                                                         "tiles: 1.84-1.97x m8n8k4's 64x32 (tune_fwd.py); 197 KB",
                                          wide_k=16), arch="sm90")
_add("fwd_dmma", ["float64"], [256], Tile(32, 16, 4, 2, "acc_o alone is 128 registers: one 8-row tile a warp; 195 KB"),
     Tile(32, 8, 4, 2, "8-key tiles: 133 KB, the A100"), Tile(8, 8, 1, 2, "one warp: 83 KB, " + _SMALL))
# With EXTRA each stage also holds a BM x BN fp64 bias tile: smaller tiles keep two CTAs an SM.
_add("fwd_dmma", ["float64"], [32], Tile(64, 32, 4, 2, "the bias stages: 95 KB at 64 rows (two CTAs an SM; 128 rows: "
                                                       "151 KB, one)"), extra=True)
_add("fwd_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "the bias stages: 94 KB with 16-key tiles (two CTAs an SM; "
                                                       "32 keys: 141 KB, one)"), extra=True)
_add("fwd_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "the bias stages: 156 KB with 16-key tiles (32 keys: 237 KB "
                                                        "exceed 227)"),
     Tile(32, 8, 2, 2, "two warps, 8-key tiles: 71 KB, " + _SMALL), extra=True)
_add("fwd_dmma", ["float64"], [256], Tile(32, 16, 4, 2, "the bias stages: 207 KB"),
     Tile(32, 8, 4, 2, "8-key tiles: 137 KB, the A100"), Tile(8, 8, 1, 2, "one warp: 84 KB, " + _SMALL), extra=True)

# Tensor-core backward. dK/dV: warp w owns block_n / warps keys, in 16-key strips
# (flash_bwd_mma.cu, KEY_STRIPS); with two strips each Q / dO fragment it loads
# feeds two MMAs in all four GEMMs, and a key block of 128 halves the dQ atomics
# and the Q / dO tile loads per key. benchmarks/tune_bwd.py, H100, fp16 L=4096
# (backward TFLOP/s, non-causal / causal), one strip, 64x64/4w, 2026-11-22:
#   d=64: 1 stage 107 / 103, 2 stages 109 / 105;  d=128: 1 stage 94 / 88, 2 stages 96 / 91
#   (head dim 128 in two passes: dK + dV accumulators and the 64-query score tiles spill in one).
# Branch bwd2 (offline compile, NVRTC 12.9, 0 spills on sm_80 / sm_90; benchmarks/NOTES.md): d=64 two
# strips a warp, 32-query steps (dK + dV: 128 registers, S^T + dP^T: 64; 254-255 registers, no spill at
# a 240 cap); d=128 one pass with 32-query steps (dK + dV 128, S^T + dP^T 32), 8 warps of 16 keys. The
# EXTRA kernels keep the one-strip 64x64 tiles. tune_bwd.py, H100, fp16 L=4096, attention_backward ms
# (non-causal / causal), sixth session: d=64 64x64/4w 8.27 / 4.78, 32x128/4w 6.38 / 3.87, 32x64/4w
# 8.08 / 5.39, 64x128/8w 7.98 / 4.77; d=128 64x64/4w two passes 9.73 / 5.47, 32x128/8w 7.81 / 4.55,
# 32x64/4w 8.04 / 4.53. dK and dV bitwise equal to the 64x64 layout's.
_add("bwd_dkdv_mma", HALF_TYPES, [32], Tile(64, 64, 4, 2, "2 stages +2-3% over 1 (tune_bwd.py)"))
_add("bwd_dkdv_mma", HALF_TYPES, [64], Tile(32, 128, 4, 2, "two 16-key strips a warp: 1.24-1.29x the 64x64 "
                                                          "layout (tune_bwd.py); 66 KB"))
# The atomic dQ of every bwd_dkdv_mma tile goes into fragment tiles (atomics.cuh, dq_tile; twenty-first session):
# one 16-byte reduction a lane and fragment. tune_bwd.py on the H100 (whole backward, bf16, L=2048-16384), against
# the tiles before it: d=64 1.05-1.18x, d=128 1.03-1.08x (which no longer stages its dQ tile in shared memory:
# 207 -> 173 KB). d=128 late_copies: +1-3% (one CTA of 8 warps an SM; at d=64, two CTAs of 4, it measured 0.97-1.0x).
_add("bwd_dkdv_mma", HALF_TYPES, [128], Tile(64, 128, 8, 2, "two warps a 32-key group, 64-query steps, P^T and dS^T "
                                                           "through shared memory (FlashAttention-2's layout): "
                                                           "173 KB", query_split=2, late_copies=True),
     Tile(64, 128, 8, 1, "the same with one Q/dO stage: 138.5 KB (A100)", query_split=2),
     Tile(32, 64, 4, 2, "one pass, 32-query steps (within 3% of 32x128/8w on the H100): 75 KB, " + _SMALL))
_add("bwd_dkdv_mma", HALF_TYPES, [64], Tile(64, 64, 4, 2, "EXTRA (251-255 registers at one strip): 2 stages +2-3% "
                                                         "over 1 (tune_bwd.py)"), extra=True)
_add("bwd_dkdv_mma", HALF_TYPES, [128], Tile(64, 64, 4, 2, "EXTRA: 2 stages +2-3% over 1 (tune_bwd.py); 112 KB "
                                                          "shared", passes=2),
     Tile(64, 64, 4, 1, "one Q/dO stage: 78 KB, " + _SMALL, passes=2), extra=True)
_add("bwd_dq_mma", HALF_TYPES, [32], Tile(64, 64, 4, 1, "16 rows per warp, 64-key steps; 21 KB shared: three "
                                                       "CTAs an SM at <= 168 registers", ctas=3))
_add("bwd_dq_mma", HALF_TYPES, [64], Tile(64, 64, 4, 1, "16 rows per warp, 64-key steps; a 168-register cap (three "
                                                       "CTAs an SM) spills 16 bytes on sm_90, so two"))
_add("bwd_dq_mma", HALF_TYPES, [128], Tile(64, 32, 4, 1, "32-key steps: 64 spilled registers"))
_add("bwd_dq_mma", HALF_TYPES, [32], Tile(64, 64, 4, 1, "EXTRA spills under the 168-register cap: two CTAs an SM",
                                         ctas=2), extra=True)
# dbias kernel: warps of 16 query rows, the step's Q/dO/K/V/bias double-buffered. Every step loads
# four fresh tiles for two GEMMs, so a larger accumulator tile amortises each load over more MMAs
# (64x64: 32 FLOP per byte loaded; 128x64: 43; benchmarks/tune_dbias.py). 128x128 (64) spilled 52-180
# bytes in every variant but the plain 16-byte-load one.
_add("bwd_dbias_mma", HALF_TYPES, [32], Tile(128, 64, 8, 2, "8 warps of 16 rows, 97 KB: 1.3x the MMAs per byte "
                                                       "loaded of 64x64"))
_add("bwd_dbias_mma", HALF_TYPES, [64], Tile(128, 64, 8, 2, "8 warps of 16 rows, 145 KB: 1.3x the MMAs per byte "
                                                       "loaded of 64x64"),
     Tile(64, 64, 4, 2, "as the dQ kernel's rows; 2 stages: 92 KB, two CTAs an SM, " + _SMALL, ctas=2))
_add("bwd_dbias_mma", HALF_TYPES, [128], Tile(64, 64, 4, 2, "2 stages: 155 KB"),
     Tile(64, 64, 4, 1, "one stage: 78 KB, " + _SMALL))

# FMA backward: 16 x 16 threads; K, V, Q, dO tiles in the input dtype and P, dS
# tiles in the accumulator dtype in shared memory; dK, dV in registers.
for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    _add(_fam, ["float32"], [32, 64], Tile(64, 64, 8, 1, "98 KB shared, 4x4 scores per thread: two CTAs an SM at "
                                                         "<= 128 registers (145 halved occupancy: -25% measured)",
                                           ctas=2))
    _add(_fam, ["float32"], [128], Tile(64, 64, 8, 1, "162 KB shared"), Tile(32, 32, 8, 1, _SMALL))
    _add(_fam, ["float32"], [256], Tile(32, 32, 8, 1, "137 KB shared; dK+dV are 64 registers"),
         Tile(16, 16, 8, 1, _SMALL))
    _add(_fam, HALF_TYPES, [256], Tile(32, 32, 8, 1, "73 KB shared; dK+dV are 64 registers: two CTAs an SM at "
                                                     "<= 128 registers", ctas=2))
    # (float64 at head dims 32-128 runs on the fp64 tensor cores: bwd_dkdv_dmma / bwd_dq_dmma below. The FMA
    # tiles it replaced, for a baseline: 32x32/8w at d=32, 64 (84 KB) and 128 (146 KB).)
    _add(_fam, ["float64"], [256], Tile(16, 32, 8, 1, "fp64: 201 KB shared; dK+dV are 128 registers"),
         Tile(16, 16, 8, 1, "133 KB: the A100; no fp64 head-dim-256 backward fits 99 KB"))

for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    _add(_fam, ["float32"], [32, 64], Tile(64, 64, 8, 1, "EXTRA spills 8-80 bytes under the 128-register cap of "
                                                        "two CTAs an SM: one"), extra=True)
_add("bwd_dkdv_fma", ["float64"], [256], Tile(16, 16, 8, 1, "EXTRA spills 12 bytes with 32-key tiles: 16"), extra=True)
for _fam in ("bwd_dkdv_fma", "bwd_dq_fma"):
    _add(_fam, HALF_TYPES, [256], Tile(32, 32, 8, 1, "EXTRA spills 12-180 bytes under two CTAs' 128 registers: one"),
         extra=True)

# fp64 tensor-core backward (flash_bwd_dmma.cu; mma.sync m8n8k4). dK/dV: 4 warps, each owning
# block_n / 32 8-key tiles (its dK, dV accumulators: head * tiles registers; one pass while that is
# <= 128), block_m query rows a step; all tiles unpadded and swizzled (swizzle_f64.cuh). Registers
# and spills from the offline compile (NVRTC 12.9, sm_80 / sm_90, every flag); NOT yet timed on a
# GPU (benchmarks/tune_bwd.py): the tiles are arithmetic, two CTAs an SM on the H100.
#   d=32:  32x64/4w: two key tiles a warp, 82 KB, 188-238 registers.
#   d=64:  16x64/4w: two key tiles a warp (dK + dV: 128 registers), 104 KB, 220-255.
#   d=128: 16x32/4w one Q/dO stage: one key tile a warp (dK + dV: 128 registers), 100 KB, 224-254.
# With EXTRA (bias stages, per-element dropout draws, dbias) 32-query steps at d=32 and two key tiles
# a warp at d=64 spilled 12-84 bytes on sm_90: 16-query steps at d=32, one key tile a warp at d=64
# (156-195 registers; 8x64, two key tiles a warp with 8-query steps, fit at 255: a lead to time).
_add("bwd_dkdv_dmma", ["float64"], [32], Tile(32, 64, 4, 2, "two 8-key tiles a warp, 32-query steps: 82 KB, two "
                                                            "CTAs an SM (not yet timed)"))
_add("bwd_dkdv_dmma", ["float64"], [64], Tile(16, 64, 4, 2, "two 8-key tiles a warp (dK + dV: 128 registers): "
                                                            "104 KB, two CTAs an SM (not yet timed)"),
     Tile(16, 32, 4, 2, "one 8-key tile a warp: 70 KB, " + _SMALL_BYTES + " (one stage of 16x64 spills)"))
_add("bwd_dkdv_dmma", ["float64"], [128], Tile(16, 32, 4, 1, "one 8-key tile a warp (dK + dV: 128 registers), one "
                                                             "Q/dO stage: 100 KB, two CTAs an SM (not yet timed)"),
     Tile(8, 32, 4, 1, "8-query steps: 84 KB, " + _SMALL_BYTES))
_add("bwd_dkdv_dmma", ["float64"], [32], Tile(16, 64, 4, 2, "16-query steps (32 spill with EXTRA): 73 KB"),
     extra=True)
_add("bwd_dkdv_dmma", ["float64"], [64], Tile(16, 32, 4, 2, "one 8-key tile a warp (two spill with EXTRA): 78 KB"),
     extra=True)
_add("bwd_dkdv_dmma", ["float64"], [128], Tile(16, 32, 4, 1, "the bias stage: 104 KB"),
     Tile(8, 32, 4, 1, "8-query steps: 86 KB, " + _SMALL_BYTES), extra=True)
# Deterministic dQ: query-major as the forward; each warp owns block_m / 32 8-row tiles, K/V double-buffered.
_add("bwd_dq_dmma", ["float64"], [32], Tile(64, 32, 4, 2, "two 8-row tiles a warp: 64 KB (not yet timed)"))
_add("bwd_dq_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "two 8-row tiles a warp, 16-key steps: 96 KB, two CTAs "
                                                          "an SM (not yet timed)"))
_add("bwd_dq_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "two 8-row tiles a warp (dQ: 128 registers): 192 KB "
                                                           "(not yet timed)"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 128 KB, the A100"),
     Tile(16, 16, 2, 2, "two warps: 96 KB, " + _SMALL_BYTES))
# With EXTRA each K/V stage also holds a block_m x block_n fp64 bias tile.
_add("bwd_dq_dmma", ["float64"], [32], Tile(64, 16, 4, 2, "the bias stages: 72 KB with 16-key steps"), extra=True)
_add("bwd_dq_dmma", ["float64"], [64], Tile(64, 16, 4, 2, "the bias stages: 120 KB"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 76 KB, " + _SMALL_BYTES), extra=True)
_add("bwd_dq_dmma", ["float64"], [128], Tile(64, 16, 4, 2, "the bias stages: 216 KB"),
     Tile(32, 16, 4, 2, "one 8-row tile a warp: 140 KB, the A100"),
     Tile(8, 16, 1, 2, "one warp: 83 KB, " + _SMALL_BYTES), extra=True)

# float32 backward on the TF32 tensor cores (flash_bwd_tf32.cu; branch tf32-bwd, run on the H100 in the tenth
# session, benchmarks/NOTES.md: the tiles are still chosen by shared-memory arithmetic and the offline compile alone, NVRTC 12.9, 0 spills on
# sm_80 and sm_90; benchmarks/NOTES.md has the register counts). Two families per kernel, as the
# forward: *_tf32x3 is precision="highest" (3xTF32), *_tf32 is precision="tf32". dK/dV: a warp owns
# 16 keys (block_n = 16 warps); K and V are split once per CTA in shared memory (3xTF32: big and
# small parts, four fp32 tiles of block_n rows), Q / dO / bias per stage, dS^T for the atomic dQ.
# dQ: a warp owns 16 query rows; Q and dO split once (four tiles with 3xTF32), K / V / bias per stage.
# A call whose GPU has no tile here takes the FMA kernel for that part of the plan (_backward_plan).
# 3xTF32 dK/dV (a fresh fragment and the split operands on top of the accumulators) spilled offline
# at 64-query steps at d=32 (20-36 bytes on sm_80), 32-query steps at d=64 (28-68 bytes) and in one
# pass at d=128 (16-64 bytes; 16-query steps, one stage with EXTRA and element loads: 724-796):
# d=32 and 64 take half the query rows a step, d=128 two passes (dV, then dK and dQ: S^T twice).
_add("bwd_dkdv_tf32x3", ["float32"], [32], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps (64 spilled 20-36 "
                                                              "bytes on sm_80): 65 KB (EXTRA 82)"))
# The fast operand split (Tile.split 2; tune_f32.py on the H100, eleventh session, backward TFLOP/s
# non-causal / causal): d=64 33.4 / 30.3 -> 38.8 / 35.3, d=128 19.6 / 18.8 -> 21.9 / 20.8, errors equal.
_add("bwd_dkdv_tf32x3", ["float32"], [64], Tile(16, 64, 4, 2, "16 keys a warp, 16-query steps (32 spilled 28-68 "
                                                              "bytes), fast split: 1.16x rounded; 92 KB (EXTRA 99)",
                                                split=2))
_add("bwd_dkdv_tf32x3", ["float32"], [128], Tile(16, 64, 4, 2, "16 keys a warp, 16-query steps, two passes (one "
                                                               "spilled 16-64 bytes), fast split: 1.11x rounded; "
                                                               "174 KB (EXTRA 183)", passes=2, split=2),
     Tile(16, 64, 4, 1, "one Q/dO stage: 157 KB (EXTRA 162), the A100", passes=2, split=2))
_add("bwd_dkdv_tf32", ["float32"], [32], Tile(64, 64, 4, 2, "16 keys a warp, 64-query steps: 73 KB (EXTRA 108)"),
     Tile(32, 64, 4, 2, "32-query steps: 46 KB (EXTRA 64), " + _SMALL_BYTES))
_add("bwd_dkdv_tf32", ["float32"], [64], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps: 79 KB (EXTRA 97)"))
_add("bwd_dkdv_tf32", ["float32"], [128], Tile(32, 64, 4, 2, "16 keys a warp, 32-query steps: 145 KB (EXTRA 162)"),
     Tile(16, 64, 4, 1, "16-query steps, one Q/dO stage: 90 KB (EXTRA 94), " + _SMALL_BYTES))
_add("bwd_dq_tf32x3", ["float32"], [32], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 74 KB (EXTRA 111)"),
     Tile(64, 32, 4, 2, "32-key steps: EXTRA 76 KB, " + _SMALL_BYTES))
_add("bwd_dq_tf32x3", ["float32"], [64], Tile(64, 32, 4, 2, "16 rows a warp, 32-key steps: 104 KB (EXTRA 125)"),
     Tile(32, 32, 2, 2, "two warps: 70 KB (EXTRA 80), " + _SMALL_BYTES))
_add("bwd_dq_tf32x3", ["float32"], [128], Tile(64, 16, 4, 2, "16 rows a warp, 16-key steps: 169 KB (EXTRA 181)"),
     Tile(32, 16, 2, 2, "two warps: 101 KB (EXTRA 108), the A100"))
_add("bwd_dq_tf32", ["float32"], [32], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 55 KB (EXTRA 92)"))
_add("bwd_dq_tf32", ["float32"], [64], Tile(64, 64, 4, 2, "16 rows a warp, 64-key steps: 104 KB (EXTRA 141)"),
     Tile(64, 32, 4, 2, "32-key steps: 70 KB (EXTRA 90), " + _SMALL_BYTES))
_add("bwd_dq_tf32", ["float32"], [128], Tile(64, 32, 4, 2, "16 rows a warp, 32-key steps: 135 KB (EXTRA 156)"),
     Tile(64, 16, 4, 2, "16-key steps: 101 KB, " + _SMALL_BYTES),
     Tile(32, 16, 2, 2, "two warps: EXTRA 74 KB, " + _SMALL_BYTES))

# Row-wise helpers (flash_bwd_aux.cu): block_m / warps rows a warp, read 16 bytes a lane where rows
# allow; memory-bound, so sized by the bytes in flight (head dim does not matter: key 0). One warp a row,
# 8 rows a CTA, one element a lane reached 1.6 (dsum) and 2.0 (convert) of the H100's ~3.35 TB/s (ncu).
# These tiles: ncu on the H100 (eighteenth session, the same shape) dsum 82 -> 61 us, convert 98 -> 70 us.
_add("bwd_dsum", DTYPES, [0], Tile(16, 0, 8, 1, "2 rows a warp: dO and O of both in flight, 64 bytes a lane; "
                                   "<= 48 registers, 5 CTAs an SM (80 KB in flight); 8 CTAs (<= 32) spill",
                                   ctas=5))
_add("bwd_convert_dq", DTYPES, [0], Tile(16, 0, 8, 1, "2 rows a warp: 32 bytes of dQ_acc a lane in flight; a full "
                                         "SM, 8 CTAs at <= 32 registers (64 KB in flight); 4 rows need 56", ctas=8))


# --------------------------------------------------------------------------- families

def _pitch_mma(head: int) -> int:
    return head + 8        # 16-byte row padding: conflict-free ldmatrix


def _smem_fwd_mma(v: "Variant") -> int:
    t = v.tile
    bias = t.stages * t.block_m * (t.block_n + 8) if v.extra else 0   # EXTRA: a bias tile per K/V stage
    return ((t.block_m + 2 * t.stages * t.block_n) * _pitch_mma(v.head) + bias) * ITEMSIZE[v.dtype]


def _smem_fwd_dmma(v: "Variant") -> int:
    # Pitches in doubles (flash_fwd_dmma.cu, warp_gemm_f64.cuh): Q and K rows head + 4, V rows
    # head + 2, bias rows = 8 (mod 16); Q once, K, V (and with EXTRA the bias) per stage.
    t = v.tile
    bias = t.block_m * (t.block_n // 16 * 16 + 8) if v.extra else 0
    stage = t.block_n * (v.head + 4) + t.block_n * (v.head + 2) + bias
    return (t.block_m * (v.head + 4) + t.stages * stage) * ITEMSIZE[v.dtype]


def _smem_fwd_wgmma(v: "Variant") -> int:
    # Unpadded swizzled Q, K, V tiles (1024 bytes of slack to align them); with EXTRA a swizzled
    # block_m x block_n bias tile per stage; an O tile of Q's size where O is stored through its
    # tensor map (head dim >= 128) by CTAs that walk blocks and it fits in sm_90's 227 KB (else O is
    # staged in Q's tile); then the pipeline's mbarriers: Q full and empty, and full / empty for K
    # and V per stage (with EXTRA for the bias too), and a walking CTA's block-index ring, 8 bytes
    # each (FwdWgmmaTraits, whose SMEM_LIMIT is SMEM_LIMITS' sm_90 entry).
    t = v.tile
    bias = t.stages * t.block_m * t.block_n if v.extra else 0
    barriers = 2 + 4 * t.stages + (2 * t.stages if v.extra else 0)
    if walk_ring(v):
        barriers += 2 + 2 * 2   # BlockWalk's two index slots and their full / empty barriers
    q_bytes = t.block_m * v.head * ITEMSIZE[v.dtype]
    total = 1024 + ((t.block_m + 2 * t.stages * t.block_n) * v.head + bias) * ITEMSIZE[v.dtype] + 8 * barriers
    own_o = v.head >= 128 and wgmma_persistent(v) and total + q_bytes <= SMEM_LIMITS["sm_90 (H100, H200)"]
    return total + (q_bytes if own_o else 0)


HOPPER_FWD_PERSISTENT = True
"""Launch the Hopper forward's PERSISTENT variants one CTA an SM, each walking query blocks in turn
(:func:`persistent_grid`); False: a CTA a block (benchmarks compare the two)."""


def persistent_grid(v: "Variant") -> bool:
    """Whether ``v`` launches one CTA an SM rather than one a query block: a :func:`wgmma_persistent`
    variant. Without a causal band its blocks are of equal work, and a stride over them balances the
    SMs. Causal blocks differ up to Lk / block_n-fold: counting visible key tiles, a stride of 132 (the
    H100's SMs) leaves the busiest SM at 1.21x the mean at L = 2048 with 128-row blocks (1.38x at
    1024, 1.13x at 4096; measured 0.77-0.92x of a CTA a block per call), so a banded grid takes its
    blocks from a queue (:func:`block_queue`), each going to whichever CTA frees first, as the
    hardware's CTA scheduler hands out a grid of one CTA a block: 1.06-1.21x over a CTA a block at
    head dim 128 (benchmarks/results/hopper-block-queue-*.txt). Banded variants without the queue's
    ring (head dim 64's three consumer warpgroups) launch a CTA a block."""
    return HOPPER_FWD_PERSISTENT and wgmma_persistent(v) and (not v.band or block_queue(v))


def walk_ring(v: "Variant") -> bool:
    """Whether a :func:`wgmma_persistent` variant's producer hands its blocks to the consumers through
    a ring (FwdWgmmaTraits::WALK_RING: two consumer warpgroups, head dim 128's tile), so that it can take
    them from a block queue."""
    return wgmma_persistent(v) and v.tile.warps == 12


def block_queue(v: "Variant") -> bool:
    """Whether a persistent launch of ``v`` takes its blocks from a zeroed counter the host passes
    (``FwdParams::block_queue``) rather than striding: a causal band, whose blocks differ in work, on
    a :func:`walk_ring` variant. Causal variants without the ring launch a CTA a block."""
    return walk_ring(v) and v.band


def wgmma_persistent(v: "Variant") -> bool:
    """Whether a Hopper forward variant's CTAs can walk several query blocks (FwdWgmmaTraits::
    PERSISTENT: one CTA an SM, no EXTRA code, head dim <= 128); the others need a CTA a block."""
    return v.family == "fwd_wgmma" and v.tile.ctas == 1 and not v.extra and v.head <= 128


def _smem_fwd_wgmma_tf32(v: "Variant") -> int:
    # FwdWgmmaTf32Traits: fp32 swizzled tiles (1024 bytes of alignment slack): Q (loaded, then big)
    # and with 3xTF32 Q small; per stage K (loaded, then big) [+ K small], V as loaded, V^T big
    # [+ V^T small]; then mbarriers: Q full, and K / V full, ready, empty per stage, 8 bytes each.
    t, parts = v.tile, 2 if v.split else 1
    kv = t.block_n * v.head * 4
    return 1024 + parts * t.block_m * v.head * 4 + t.stages * (2 * parts + 1) * kv + 8 * (1 + 6 * t.stages)


def _smem_dkdv_wgmma(v: "Variant") -> int:
    # Swizzled K, V once; Q, dO and the row statistics (lse, Dsum: fp32) per stage; dS^T twice;
    # the two consumer warpgroups' 64 x 64 fp32 dQ blocks; 1024 bytes of alignment slack;
    # mbarriers: K/V full, and full / empty per stage. Head dim 256 (DkdvWgmmaTraits::SPLIT_HEAD):
    # P^T twice as well, and no dQ blocks (staged in the step's Q and dO tiles). EXTRA: a swizzled
    # block_m x block_n bias tile per stage (covered by the stage's own barriers).
    t = v.tile
    split_head = v.head == 256
    ds = (2 if split_head else 1) * 2 * t.block_n * t.block_m
    bias = t.stages * t.block_m * t.block_n if v.extra else 0
    tiles = (2 * t.block_n * v.head + 2 * t.stages * t.block_m * v.head + ds + bias) * ITEMSIZE[v.dtype]
    dq_stage = 0 if split_head else 2 * 64 * 64 * 4
    return 1024 + tiles + dq_stage + t.stages * 2 * t.block_m * 4 + 8 * (1 + 2 * t.stages)


def _smem_fwd_fma(v: "Variant") -> int:
    t, qk_pitch = v.tile, v.head + 1
    elems = t.block_m * qk_pitch + t.block_n * qk_pitch + t.block_n * v.head + t.block_m * (t.block_n + 1)
    return elems * ITEMSIZE[v.dtype]


def _smem_fwd_tf32(v: "Variant") -> int:
    # fp32 tiles of pitch head + 4 (flash_fwd_tf32.cu): Q once (twice with the 3xTF32 split:
    # big and small parts), K and V per stage, with EXTRA a bias tile of pitch block_n + 8 per stage.
    t = v.tile
    q = (2 if v.split else 1) * t.block_m * (v.head + 4)
    bias = t.stages * t.block_m * (t.block_n + 8) if v.extra else 0
    return (q + 2 * t.stages * t.block_n * (v.head + 4) + bias) * ITEMSIZE[v.dtype]


def _smem_dkdv_mma(v: "Variant") -> int:
    t = v.tile
    shared_pt = t.query_split > 1                                     # P^T and dS^T through shared memory
    ds = t.block_n * (t.block_m + 8) * ((v.atomic_dq or shared_pt) + shared_pt)   # dS^T (and P^T), [key][query]
    bias = t.stages * t.block_m * (t.block_n + 8) if v.extra else 0   # EXTRA: a bias tile per Q/dO stage
    return (((2 * t.block_n + 2 * t.stages * t.block_m) * _pitch_mma(v.head) + ds + bias) * ITEMSIZE[v.dtype]
            + t.stages * 2 * t.block_m * 4)   # the rows' lse and Dsum per stage


def _smem_dq_mma(v: "Variant") -> int:
    t = v.tile
    bias = t.block_m * (t.block_n + 8) if v.extra else 0              # EXTRA: the step's bias tile
    return ((2 * t.block_n + 2 * t.block_m) * _pitch_mma(v.head) + bias) * ITEMSIZE[v.dtype] + 2 * t.block_m * 4


def _smem_dbias_mma(v: "Variant") -> int:
    t = v.tile
    stage = 2 * (t.block_m + t.block_n) * _pitch_mma(v.head) + t.block_m * (t.block_n + 8)   # Q, K, dO, V, bias
    return t.stages * stage * ITEMSIZE[v.dtype] + 2 * t.block_m * 4


def _smem_dkdv_dmma(v: "Variant") -> int:
    # Unpadded swizzled fp64 tiles (flash_bwd_dmma.cu): K, V once; Q, dO (and with EXTRA a
    # [query][key] bias tile of pitch block_n + 2) per stage; dS with atomic dQ; lse and Dsum.
    t = v.tile
    bias = t.block_m * (t.block_n + 2) if v.extra else 0
    ds = t.block_m * t.block_n if v.atomic_dq else 0
    return (2 * t.block_n * v.head + t.stages * (2 * t.block_m * v.head + bias) + ds + 2 * t.block_m) * 8


def _smem_dq_dmma(v: "Variant") -> int:
    # Q, dO once; K, V (and with EXTRA a bias tile of pitch = 8 mod 16) per stage.
    t = v.tile
    bias = t.block_m * (t.block_n // 16 * 16 + 8) if v.extra else 0
    return (2 * t.block_m * v.head + t.stages * (2 * t.block_n * v.head + bias)) * 8


def _smem_dkdv_tf32(v: "Variant") -> int:
    # fp32 tiles of pitch head + 4 (flash_bwd_tf32.cu, DkdvTf32Traits): K and V once (twice each with
    # the 3xTF32 split: big and small parts), Q and dO (and with EXTRA a [query][key] bias tile of
    # pitch block_n + 4) and the rows' lse and Dsum per stage, dS^T (pitch block_m + 4) with atomic dQ.
    t, pitch = v.tile, v.head + 4
    kv = (4 if v.split else 2) * t.block_n * pitch
    bias = t.block_m * (t.block_n + 4) if v.extra else 0
    ds = t.block_n * (t.block_m + 4) if v.atomic_dq else 0
    return (kv + t.stages * (2 * t.block_m * pitch + bias + 2 * t.block_m) + ds) * 4


def _smem_dq_tf32(v: "Variant") -> int:
    # Q and dO once (twice each with the split), K and V (and with EXTRA a bias tile of pitch
    # block_n + 8) per stage (DqTf32Traits).
    t, pitch = v.tile, v.head + 4
    bias = t.block_m * (t.block_n + 8) if v.extra else 0
    return ((4 if v.split else 2) * t.block_m * pitch + t.stages * (2 * t.block_n * pitch + bias)) * 4


def _smem_bwd_fma(v: "Variant") -> int:
    t, pitch = v.tile, v.head + 1
    tiles = (2 * t.block_n + 2 * t.block_m) * pitch * ITEMSIZE[v.dtype]
    return tiles + (2 * t.block_m * (t.block_n + 1) + 2 * t.block_m) * acc_itemsize(v.dtype)


@dataclass(frozen=True)
class Family:
    """A kernel template: its entry file, the flags it takes (in template order),
    the axis its CTAs tile (``"q"``: query blocks of block_m per (query head,
    batch); ``"k"``: key blocks of block_n per (K/V head, batch)) and its
    shared-memory formula (mirrored by the kernel's traits, which static_assert it).
    ``"bias"``: the dbias kernel, whose grid follows the bias's shape (DbiasPlan.grid)."""

    kernel: str
    entry: str
    flags: Tuple[str, ...]
    axis: str
    smem: Callable[["Variant"], int] = field(compare=False)


FAMILY_WHAT = {"fwd_mma": "forward", "fwd_dmma": "forward", "fwd_wgmma": "forward", "fwd_fma": "forward",
               "fwd_tf32x3": "forward", "fwd_tf32": "forward", "fwd_wgmma_tf32x3": "forward",
               "fwd_wgmma_tf32": "forward",
               "bwd_dsum": "backward", "bwd_dkdv_mma": "backward",
               "bwd_dq_mma": "deterministic backward", "bwd_dkdv_fma": "backward",
               "bwd_dq_fma": "deterministic backward", "bwd_dkdv_tf32x3": "backward", "bwd_dkdv_tf32": "backward",
               "bwd_dq_tf32x3": "deterministic backward", "bwd_dq_tf32": "deterministic backward", "bwd_dkdv_dmma": "backward", "bwd_dkdv_wgmma": "backward",
               "bwd_dq_dmma": "deterministic backward", "bwd_convert_dq": "backward", "bwd_dbias_mma": "bias gradient"}

FAMILIES: Dict[str, Family] = {
    "fwd_mma": Family("flash_fwd_mma", "flash_fwd_mma.cu", ("mask", "vec"), "q", _smem_fwd_mma),
    "fwd_dmma": Family("flash_fwd_dmma", "flash_fwd_dmma.cu", ("mask", "vec"), "q", _smem_fwd_dmma),
    "fwd_wgmma": Family("flash_fwd_wgmma", "flash_fwd_wgmma.cu", ("mask",), "q", _smem_fwd_wgmma),
    "fwd_fma": Family("flash_fwd_fma", "flash_fwd_fma.cu", ("mask",), "q", _smem_fwd_fma),
    "fwd_tf32x3": Family("flash_fwd_tf32", "flash_fwd_tf32.cu", ("mask", "vec", "split"), "q", _smem_fwd_tf32),
    "fwd_tf32": Family("flash_fwd_tf32", "flash_fwd_tf32.cu", ("mask", "vec", "split"), "q", _smem_fwd_tf32),
    "fwd_wgmma_tf32x3": Family("flash_fwd_wgmma_tf32", "flash_fwd_wgmma_tf32.cu", ("mask", "split"), "q",
                               _smem_fwd_wgmma_tf32),
    "fwd_wgmma_tf32": Family("flash_fwd_wgmma_tf32", "flash_fwd_wgmma_tf32.cu", ("mask", "split"), "q",
                             _smem_fwd_wgmma_tf32),
    "bwd_dsum": Family("flash_bwd_dsum", "flash_bwd_aux.cu", (), "q", lambda v: 0),
    "bwd_dkdv_mma": Family("flash_bwd_dkdv_mma", "flash_bwd_mma.cu", ("mask", "pass_", "atomic_dq", "vec"), "k",
                           _smem_dkdv_mma),
    "bwd_dq_mma": Family("flash_bwd_dq_mma", "flash_bwd_mma.cu", ("mask", "vec"), "q", _smem_dq_mma),
    "bwd_dbias_mma": Family("flash_bwd_dbias_mma", "flash_bwd_dbias.cu", ("mask", "vec"), "bias", _smem_dbias_mma),
    "bwd_dkdv_dmma": Family("flash_bwd_dkdv_dmma", "flash_bwd_dmma.cu", ("mask", "pass_", "atomic_dq", "vec"), "k",
                            _smem_dkdv_dmma),
    "bwd_dq_dmma": Family("flash_bwd_dq_dmma", "flash_bwd_dmma.cu", ("mask", "vec"), "q", _smem_dq_dmma),
    "bwd_dkdv_wgmma": Family("flash_bwd_dkdv_wgmma", "flash_bwd_wgmma.cu", ("mask", "dbias"), "k",
                             _smem_dkdv_wgmma),
    "bwd_dkdv_tf32x3": Family("flash_bwd_dkdv_tf32", "flash_bwd_tf32.cu", ("mask", "pass_", "atomic_dq", "vec", "split"),
                              "k", _smem_dkdv_tf32),
    "bwd_dkdv_tf32": Family("flash_bwd_dkdv_tf32", "flash_bwd_tf32.cu", ("mask", "pass_", "atomic_dq", "vec", "split"),
                            "k", _smem_dkdv_tf32),
    "bwd_dq_tf32x3": Family("flash_bwd_dq_tf32", "flash_bwd_tf32.cu", ("mask", "vec", "split"), "q", _smem_dq_tf32),
    "bwd_dq_tf32": Family("flash_bwd_dq_tf32", "flash_bwd_tf32.cu", ("mask", "vec", "split"), "q", _smem_dq_tf32),
    "bwd_dkdv_fma": Family("flash_bwd_dkdv_fma", "flash_bwd_fma.cu", ("mask", "atomic_dq"), "k", _smem_bwd_fma),
    "bwd_dq_fma": Family("flash_bwd_dq_fma", "flash_bwd_fma.cu", ("mask",), "q", _smem_bwd_fma),
    "bwd_convert_dq": Family("flash_bwd_convert_dq", "flash_bwd_aux.cu", ("dq_tiled",), "q", lambda v: 0),
}


WIDE_K_FAMILIES = ("fwd_dmma", "bwd_dkdv_dmma", "bwd_dq_dmma")
"""Families whose kernels take ``WIDE_K`` (Variant.wide_k) as their last template parameter."""


def _cxx(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: a family at a dtype and head bucket with its flags.

    ``band`` and ``extra`` are the masking policy's compile-time flags (score_mod.cuh
    ``MaskFlags``): ``band`` for causal masks and sliding windows, ``extra`` for
    bias, boolean mask, block sparsity and dropout (each switched at run time);
    ``vec`` selects 16-byte ``cp.async`` loads; ``pass_`` (dK/dV
    tensor-core kernel) is 0 for dK and dV together, 1 for dV only, 2 for dK
    only; ``atomic_dq`` makes the dK/dV kernel also add dQ with atomics; ``dbias``
    (Hopper dK/dV kernel) makes it also add dS into dbias (DBIAS_KEY_MAJOR).
    ``arch``: the table rows the variant's tile comes from ("sm80", "sm90" or "sm90a"; see the
    module's docstring). ``short``: the tile comes from the short-rows table (calls whose query
    blocks visit few keys, :func:`row_class`).
    """

    family: str
    dtype: str
    head: int
    band: bool = False
    extra: bool = False
    vec: bool = False
    pass_: int = 0
    atomic_dq: bool = False
    dbias: bool = False
    arch: str = "sm80"
    short: bool = False
    dq_tiled: bool = False
    tile: Tile = field(default=None, repr=False)   # default: the table's preferred tile

    def __post_init__(self):
        if self.tile is None:
            object.__setattr__(self, "tile", self.tiles()[0])
        if self.wide_k and (self.family not in WIDE_K_FAMILIES or self.wide_k not in (4, 8, 16)):
            raise ValueError(f"wide_k={self.wide_k}: 4, 8 or 16, and only for {', '.join(WIDE_K_FAMILIES)}")
        if self.tile.query_split != 1 and (self.family != "bwd_dkdv_mma" or self.tile.query_split != 2
                                           or self.extra or self.tile.passes != 1 or self.pass_ != 0):
            raise ValueError(f"query_split={self.tile.query_split}: 2 only for bwd_dkdv_mma in one pass, "
                             "without EXTRA")
        if self.tile.park and self.family != "fwd_mma":
            raise ValueError("park: only for fwd_mma")
        if self.tile.late_copies and self.family != "bwd_dkdv_mma":
            raise ValueError("late_copies: only for bwd_dkdv_mma")
        if self.dq_tiled and self.family != "bwd_convert_dq":
            raise ValueError("dq_tiled: only for bwd_convert_dq (the tiled accumulator of bwd_dkdv_mma)")

    @property
    def wide_k(self) -> int:
        """The fp64 tensor-core kernels' MMA k (Tile.wide_k; 0: m8n8k4), their last template parameter."""
        return self.tile.wide_k

    def tiles(self) -> Tuple[Tile, ...]:
        """The table's tiles for this variant's (arch, family, dtype, head), preferred first."""
        key = (self.arch, self.family, self.dtype, self.head)
        if self.short:
            return _SHORT_TABLE[key]
        if self.extra and key in _EXTRA_TABLE:
            return _EXTRA_TABLE[key]
        return _TABLE[key]

    def fitted(self, smem_limit: int) -> "Variant":
        """This variant with the first tile whose shared memory fits ``smem_limit`` bytes (tiles marked
        ``vec_only`` only for 16-byte loads)."""
        tiles = [t for t in self.tiles() if self.vec or not t.vec_only]
        if not tiles:
            raise ValueError(f"{self.dtype} {FAMILY_WHAT[self.family]} at head dim {self.head}: the table has "
                             f"tiles for 16-byte loads only")
        for tile in tiles:
            v = replace(self, tile=tile)
            if v.smem_bytes <= smem_limit and fits_resident(v.smem_bytes, tile.resident, smem_limit):
                return v
        raise ValueError(
            f"{self.dtype} {FAMILY_WHAT[self.family]} at head dim {self.head} needs "
            f"{min(replace(self, tile=t).smem_bytes for t in tiles) // 1024} KB of shared memory per "
            f"thread block; this GPU allows {smem_limit // 1024} KB. Use a smaller head dim or another dtype.")

    @property
    def split(self) -> int:
        """The float32 tensor-core kernels' SPLIT kind (warp_gemm_tf32.cuh): 0 plain TF32
        (precision="tf32"); for the 3xTF32 families (precision="highest") the tile's kind,
        nonzero."""
        return self.tile.split if self.family.endswith("_tf32x3") else 0

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def nvrtc_arch(self) -> "str | None":
        """The ``-arch`` this variant needs beyond CuPy's default for the device (``sm_90a`` for the
        Hopper path; None: the device's own, which CuPy names)."""
        return "sm_90a" if self.arch == "sm90a" else None

    def compile_target(self, arch: str) -> "str | None":
        """The NVRTC target to check this variant for, for a GPU architecture ``arch`` (``sm_80``,
        ``sm_90``, ...); None where such a GPU never runs it (the Hopper path off Hopper)."""
        if self.arch == "sm90a":
            return "sm_90a" if arch.rstrip("a") == "sm_90" else None
        if (self.wide_k or self.arch == "sm90") and int(arch.split("_")[1].rstrip("a")) < 90:
            return None   # an "sm90" row (mma.m16n8k* with f64 needs sm_90; other tiles spill on sm_80)
        return arch

    @property
    def entry(self) -> str:
        return self.fam.entry

    @property
    def threads(self) -> int:
        return 32 * self.tile.warps

    @property
    def smem_bytes(self) -> int:
        return self.fam.smem(self)

    @property
    def name(self) -> str:
        """The C++ name expression NVRTC instantiates."""
        t = self.tile
        cfg = (f"TileCfg<{self.head}, {t.block_m}, {t.block_n}, {t.warps}, {t.stages}, {t.ctas}, "
               f"{self.threads}, {self.smem_bytes}>")
        args = [CXX_TYPE[self.dtype], cfg]
        for flag in self.fam.flags:
            args.append(f"MaskFlags<{_cxx(self.band)}, {_cxx(self.extra)}>" if flag == "mask"
                        else _cxx(getattr(self, flag)))
        if self.wide_k:   # the kernel's last template parameter, 0 (m8n8k4) by default
            args.append(str(self.wide_k))
        if self.tile.query_split != 1 or self.tile.late_copies:   # bwd_dkdv_mma's QSPLIT (1 by default)
            args.append(str(self.tile.query_split))
        if self.tile.park:   # fwd_mma's last template parameter, PARK (false by default)
            args.append("true")
        if self.tile.late_copies:   # bwd_dkdv_mma's, after QSPLIT: LATE_COPIES (false by default)
            args.append("true")
        return f"{self.fam.kernel}<{', '.join(args)}>"

    def grid(self, batch: int, heads_q: int, group: int, lq: int, lk: int) -> int:
        """Number of CTAs (the grid is one-dimensional; kernels decode it with BlockInfo)."""
        t = self.tile
        if self.fam.axis == "bias":
            raise ValueError("the dbias kernel's grid follows the bias (cuflash._masking.DbiasPlan.grid)")
        if self.fam.axis == "q":
            n = -(-lq // t.block_m) * heads_q * batch
        else:
            n = -(-lk // t.block_n) * (heads_q // group) * batch
        if n > MAX_GRID_X:
            raise ValueError(f"{n} thread blocks exceed the grid limit {MAX_GRID_X}: split the batch")
        return n


# --------------------------------------------------------------------------- selection

def _dkdv_passes(tile: Tile, head: int, atomic_dq: bool, extra: bool = False,
                 vec: bool = True, family: str = "bwd_dkdv_mma") -> List[Tuple[int, bool]]:
    """(pass_, atomic_dq) launches of the tensor-core dK/dV kernel with ``tile``: dK and dV in one
    pass, or in two where the tile says so (``Tile.passes``) and, in the 16-bit kernel, at head dim
    64 with the EXTRA code, element-wise loads and atomic dQ (20-84 spilled bytes in one pass; with
    16-byte loads it fits in 254 registers since dbias has a kernel of its own)."""
    one = tile.passes == 1 and not (family == "bwd_dkdv_mma" and head == 64 and extra and atomic_dq and not vec)
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
0.89-0.93x the portable one, at L = 2048 0.99-1.05x (bench.py sweep, seventh session, H100); at head
dim 128 it is faster from L = 1024 (1.01-1.21x)."""

HOPPER_FWD_SHORT_KEYS = {64: 2048}
"""Head dim -> the most keys a query block visits on average (every key; half of them with a causal
mask or a window) for which a call without EXTRA options takes the Hopper forward's short-rows tile
(``Variant.short``: two CTAs an SM). benchmarks/tune_short.py (fifteenth session, H100, bf16 / fp16,
queued ratio to cuDNN, table tile -> short tile): L = 1024 0.81-0.84 -> 0.98-1.00, causal 0.57 ->
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


def has_short_tile(dtype: str, head: int) -> bool:
    """Whether the Hopper forward has a short-rows tile (``Variant.short``) for ``dtype`` at ``head``."""
    return ("sm90a", "fwd_wgmma", dtype, head) in _SHORT_TABLE



SM90_MIN_CC = 90
"""The compute capability from which a portable family takes its "sm90" row where the table has one."""


def _portable_arch(family: str, dtype: str, head: int, extra: bool, cc: int) -> str:
    """The row ("sm90" or "sm80") a portable variant's tiles come from on a GPU of compute
    capability ``cc``: "sm90" from SM90_MIN_CC where the table that serves the call (the EXTRA
    table with ``extra``, where it has the key) has such a row."""
    if cc < SM90_MIN_CC:
        return "sm80"
    key = ("sm90", family, dtype, head)
    if extra and ("sm80", family, dtype, head) in _EXTRA_TABLE:
        return "sm90" if key in _EXTRA_TABLE else "sm80"
    return "sm90" if key in _TABLE else "sm80"


TF32_FAMILY = {"highest": "fwd_tf32x3", "tf32": "fwd_tf32"}
"""float32 precision -> the tensor-core forward family (flash_fwd_tf32.cu)."""

TF32_WGMMA_FAMILY = {"highest": "fwd_wgmma_tf32x3"}
"""float32 precision -> the Hopper forward family (flash_fwd_wgmma_tf32.cu, arch "sm90a"), chosen on
compute capability 9.0 for calls whose rows are 16-byte loadable, EXTRA options included (a bias
whose rows are not 16-byte chunks falls back to the portable kernel: _launch.launch_forward).
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
    rows are not 16-byte chunks (_launch.launch_forward). float32 runs on the TF32 tensor cores,
    3xTF32 for ``precision`` "highest" and TF32 for "tf32" (:data:`TF32_FAMILY`), where the GPU's
    shared memory fits a tile, else on the FMA kernel (float32-accurate, so either precision); on
    Hopper, calls with 16-byte loadable rows take the wgmma kernel of :data:`TF32_WGMMA_FAMILY`
    where the table has one, EXTRA options included (``rows`` does not apply: its thresholds are
    the 16-bit kernel's measurements). ``wgmma`` False: the portable kernel the GPU would take were
    there no Hopper kernel (the fallback where tensor maps cannot describe a call's arrays)."""
    if dtype == "float32":
        hopper = TF32_WGMMA_FAMILY.get(precision)
        if cc == HOPPER_CC and wgmma and vec and ("sm90a", hopper, dtype, head) in _TABLE:
            with contextlib.suppress(ValueError):   # no Hopper tile fits: the portable kernels below
                return Variant(hopper, dtype, head, band=band, extra=extra, arch="sm90a").fitted(smem_limit)
        family = TF32_FAMILY.get(precision)
        if ("sm80", family, dtype, head) in _TABLE:
            try:
                return Variant(family, dtype, head, band=band, extra=extra, vec=vec,
                               arch=_portable_arch(family, dtype, head, extra, cc)).fitted(smem_limit)
            except ValueError:   # no TF32 tile fits this GPU
                pass
        return Variant("fwd_fma", dtype, head, band=band, extra=extra).fitted(smem_limit)
    if cc == HOPPER_CC and wgmma and vec and ("sm90a", "fwd_wgmma", dtype, head) in _TABLE:
        hopper = Variant("fwd_wgmma", dtype, head, band=band, extra=extra, arch="sm90a")
        if rows != "long" and not extra and has_short_tile(dtype, head):
            return replace(hopper, short=True, tile=None).fitted(smem_limit)
        if rows != "few" or not extra:
            return hopper.fitted(smem_limit)
    if dtype in HALF_TYPES:
        return Variant("fwd_mma", dtype, head, band=band, extra=extra, vec=vec).fitted(smem_limit)
    if ("sm80", "fwd_dmma", dtype, head) in _TABLE:
        return Variant("fwd_dmma", dtype, head, band=band, extra=extra, vec=vec,
                       arch=_portable_arch("fwd_dmma", dtype, head, extra, cc)).fitted(smem_limit)
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
    not 16-byte chunks (_launch.launch_backward)."""
    return tuple(v.fitted(smem_limit)
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
            and ("sm90a", "bwd_dkdv_wgmma", dtype, head) in _TABLE):
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
    elif ("sm80", "bwd_dkdv_dmma", dtype, head) in _TABLE:
        # float64 on the fp64 tensor cores: one pass (every table tile keeps dK + dV within 128 registers).
        plan.append(Variant("bwd_dkdv_dmma", dtype, head, vec=vec, atomic_dq=atomic, **flags))
        if deterministic:
            plan.append(Variant("bwd_dq_dmma", dtype, head, vec=vec, **flags))
    elif dtype == "float32" and ("sm80", TF32_BWD_FAMILIES.get(precision, ("",))[0], dtype, head) in _TABLE:
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
                    seen[forward_variant(dtype, head, band=band, extra=extra, vec=vec, smem_limit=limit,
                                         cc=HOPPER_CC, precision=precision, rows=rows)] = None
            ccs = (80, HOPPER_CC) if limit == SMEM_LIMITS["sm_90 (H100, H200)"] else (80,)
            precisions = FLOAT32_PRECISIONS if dtype == "float32" else ("highest",)
            for det, dbias, cc, precision in itertools.product((False, True), (False, True) if extra else (False,),
                                                               ccs, precisions):
                for v in _backward_plan(dtype, head, band, extra, vec, det, dbias, limit, cc, precision):
                    try:
                        seen[v.fitted(limit)] = None
                    except ValueError:   # documented: no such kernel for this GPU class
                        pass
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
    return ((key, tile) for table in (_TABLE, _EXTRA_TABLE, _SHORT_TABLE)
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
    tables = (_TABLE, _EXTRA_TABLE)   # every table that has the key
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


def clear_selection_caches() -> None:
    """The caches that hold what the tables chose: the selections and the forward and backward
    plans (cuflash._launch), which store chosen variants under a call's signature."""
    from . import _launch   # _launch imports this module

    for cached in (forward_variant, forward_choice, backward_variants):
        cached.cache_clear()
    _launch.clear_plans()
