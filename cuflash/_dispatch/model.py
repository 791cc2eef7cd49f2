"""The variant model: what a compiled kernel is (:class:`Variant`: a family at a dtype, head-dim
bucket, flags and :class:`Tile`), its shared memory, its C++ name expression and its grid.

The tiles themselves live in :mod:`cuflash._dispatch.tables` (one table per architecture row,
one line of reason per tile), the choice of variants for a call in :mod:`cuflash._dispatch.select`.
A variant's template name expression carries its tile configuration, the thread count, the
shared-memory size the launch will use and its schedule; each kernel ``static_assert``s that they
match its own layout, so the tables and ``kernels_cu/`` cannot drift apart without the CPU compile
check failing.

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
fwd_combine         flash_fwd_combine.cu    split-KV forward: merge the partial results into out and lse
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
compute capability 9.0 (``select.forward_variant``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Dict, Tuple

from ..semantics import acc_itemsize

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
    ``head_split`` (the fp64 dK/dV kernel ``bwd_dkdv_dmma`` only, plain, its HEAD_SPLIT): 2 makes two warps
    share each group of keys, both forming its S^T and dP^T and each accumulating half of dK / dV's columns,
    so that a warp holds the pair of 8-key tiles ``wide_k`` needs at head dim 128 (flash_bwd_dmma.cu).
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
    step's first GEMM instead of before its first barrier, where every warp's address arithmetic delayed the MMAs.
    ``split_only`` (the split table): a split-KV partial kernel's tile only; packed calls, which read the split
    table too, go on to its next tile or to the plain table."""

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
    head_split: int = 1
    resident: int = 1
    park: bool = False
    late_copies: bool = False
    split_only: bool = False


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


SUPPORTED_ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120")
"""The GPU architectures cuflash builds for and checks (compute capability 8.0, 8.6, 8.9, 9.0, 12.0: A100;
RTX 30 / A40; RTX 40 / L4 / L40; H100 / H200; RTX 50), in the one spelling the command line takes."""


def smem_limit_for_arch(arch: str) -> int:
    """Opt-in shared memory per block of an ``sm_XY`` architecture (SMEM_LIMITS' classes;
    unknown newer ones are assumed to have the largest)."""
    cc = int(arch.split("_")[1].rstrip("a"))
    if cc in (80, 87):
        return SMEM_LIMITS["sm_80 (A100)"]
    if cc in (86, 89, 120, 121):
        return SMEM_LIMITS["sm_86, sm_89, sm_120 (RTX 30/40/50, L40)"]
    return SMEM_MAX


TABLES: Dict[str, Dict[Tuple[str, str, str, int], Tuple[Tile, ...]]] = {"plain": {}, "extra": {}, "short": {},
                                                                       "split": {}}
"""The tile tables (filled by :mod:`cuflash._dispatch.tables`), keyed by (arch row, family, dtype, head
bucket), tiles in order of preference; a call takes the first whose shared memory fits the device.
"plain": every variant's; "extra": tiles for the EXTRA variants (bias / mask / block sparsity / dropout
compiled in) where the plain tile would spill with that code on top; "short": the Hopper forward's
short-rows tiles (calls whose query blocks visit few keys, ``select.row_class``); "split": the split-KV
partial kernels' tiles without EXTRA (``Variant.kv_split``: few query rows over many keys)."""


def add(family: str, dtypes, heads, *tiles: Tile, arch: str = "sm80", extra: bool = False,
        short: bool = False, split: bool = False) -> None:
    """Enter ``tiles`` (preferred first) for ``family`` at every dtype and head bucket given."""
    table = TABLES["short" if short else "extra" if extra else "split" if split else "plain"]
    for dtype in dtypes:
        for head in heads:
            table[(arch, family, dtype, head)] = tuple(tiles)


def _pitch_mma(head: int) -> int:
    return head + 8        # 16-byte row padding: conflict-free ldmatrix


def _smem_fwd_mma(v: "Variant") -> int:
    t = v.tile
    bias = t.stages * t.block_m * (t.block_n + 8) if v.extra else 0   # EXTRA: a bias tile per K/V stage
    # the split twin without EXTRA: K / V in swizzled rows of head elements (flash_fwd_mma.cu, SW_KV)
    swizzled = v.kv_split and not v.extra and v.vec and ITEMSIZE[v.dtype] == 2 and v.head % 64 == 0 \
        and (32 * t.warps // (v.head // 8)) % 8 == 0
    kv_pitch = v.head if swizzled else _pitch_mma(v.head)
    return (t.block_m * _pitch_mma(v.head) + 2 * t.stages * t.block_n * kv_pitch + bias) * ITEMSIZE[v.dtype]


def _smem_fwd_decode(v: "Variant") -> int:
    # flash_fwd_decode.cu: 16-bit: the Q strip padded, K and V stages in swizzled rows of head elements;
    # float32: Q's big and small parts and K, V rows padded by 4 floats; float64: Q and the K / V stages in rows
    # of head + 4 doubles (V's rows are head + 2 doubles apart inside a stage of K's size).
    t = v.tile
    if v.dtype == "float32" and t.block_m == 8:   # the query-minor tile: V rows head + 8 floats (stages of V's size)
        return (2 * t.block_m * (v.head + 4) + 2 * t.stages * t.block_n * (v.head + 8)) * 4
    if v.dtype == "float32":
        return (2 * t.block_m + 2 * t.stages * t.block_n) * (v.head + 4) * 4
    if v.dtype == "float64":
        return (t.block_m + 2 * t.stages * t.block_n) * (v.head + 4) * 8
    return (t.block_m * _pitch_mma(v.head) + 2 * t.stages * t.block_n * v.head) * ITEMSIZE[v.dtype]


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
    total = (1024 + ((t.block_m + 2 * t.stages * t.block_n) * v.head + bias) * ITEMSIZE[v.dtype] + 8 * barriers
             + (t.block_n * 32 if linear_bias(v) else 0))   # the linear bias's B table (linear_bias.cuh)
    own_o = v.head >= 128 and v.schedule != "block" and total + q_bytes <= SMEM_LIMITS["sm_90 (H100, H200)"]
    return total + (q_bytes if own_o else 0)


SCHEDULES = {"block": 0, "stride": 1, "queue": 2}
"""Which blocks a CTA works on (kernels_cu/scheduler.cuh ``Schedule``), a template parameter of the
Hopper forward: "block" one CTA a query block; "stride" a persistent grid (one CTA an SM) whose CTAs
stride over the blocks; "queue" a persistent grid whose CTAs take block indices from a zeroed counter
the host passes (``FwdParams::block_queue``). The choice is ``select.schedule_for``."""


LINEAR_BIAS_FAMILIES = ("fwd_wgmma", "bwd_dkdv_wgmma")
"""The kernels that add a linear bias (cuflash.mods.alibi where no key after its query is visible) with one more
tensor-core step a tile (kernels_cu/linear_bias.cuh): 16-bit Hopper, plain variants, head dims up to 128."""
LINEAR_BIAS_SWITCH = "#define CUF_LINEAR_BIAS 1"


def linear_bias(v: "Variant") -> bool:
    """Whether a variant's prelude is a linear bias's (cuflash.mods.Mods.linear_prelude)."""
    return LINEAR_BIAS_SWITCH in v.prelude


def takes_linear_bias(v: "Variant") -> bool:
    """Whether a variant can add a linear bias (kernels_cu/linear_bias.cuh): :data:`LINEAR_BIAS_FAMILIES`,
    plain (no EXTRA, packing or float32 output), head dims up to 128."""
    return v.family in LINEAR_BIAS_FAMILIES and not (v.extra or v.packed or v.acc_out) and v.head <= 128


def walkable(v: "Variant") -> bool:
    """Whether a variant's CTAs can walk several query blocks: the Hopper forward at one CTA an SM,
    without EXTRA code, at head dims up to 128 (the others need a CTA a block)."""
    return v.family == "fwd_wgmma" and v.tile.ctas == 1 and not v.extra and v.head <= 128


def walk_ring(v: "Variant") -> bool:
    """Whether a walking variant's producer hands its blocks to the consumers through a two-slot ring
    (FwdWgmmaTraits::WALK_RING: two consumer warpgroups), which a block queue needs."""
    return v.schedule != "block" and v.tile.warps == 12


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
    table = t.block_m * 32 if linear_bias(v) else 0   # the linear bias's B table over a step's queries
    return 1024 + tiles + dq_stage + table + t.stages * 2 * t.block_m * 4 + 8 * (1 + 2 * t.stages)


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
               "fwd_wgmma_tf32": "forward", "fwd_combine": "split-KV combine", "fwd_decode": "decoding forward",
               "bwd_dsum": "backward", "bwd_dkdv_mma": "backward",
               "bwd_dq_mma": "deterministic backward", "bwd_dkdv_fma": "backward",
               "bwd_dq_fma": "deterministic backward", "bwd_dkdv_tf32x3": "backward", "bwd_dkdv_tf32": "backward",
               "bwd_dq_tf32x3": "deterministic backward", "bwd_dq_tf32": "deterministic backward", "bwd_dkdv_dmma": "backward", "bwd_dkdv_wgmma": "backward",
               "bwd_dq_dmma": "deterministic backward", "bwd_convert_dq": "backward", "bwd_dbias_mma": "bias gradient"}

FAMILIES: Dict[str, Family] = {
    "fwd_mma": Family("flash_fwd_mma", "flash_fwd_mma.cu", ("mask", "vec"), "q", _smem_fwd_mma),
    "fwd_decode": Family("flash_fwd_decode", "flash_fwd_decode.cu", ("mask", "vec"), "q", _smem_fwd_decode),
    "fwd_dmma": Family("flash_fwd_dmma", "flash_fwd_dmma.cu", ("mask", "vec"), "q", _smem_fwd_dmma),
    "fwd_wgmma": Family("flash_fwd_wgmma", "flash_fwd_wgmma.cu", ("mask",), "q", _smem_fwd_wgmma),
    "fwd_fma": Family("flash_fwd_fma", "flash_fwd_fma.cu", ("mask",), "q", _smem_fwd_fma),
    "fwd_tf32x3": Family("flash_fwd_tf32", "flash_fwd_tf32.cu", ("mask", "vec", "split"), "q", _smem_fwd_tf32),
    "fwd_tf32": Family("flash_fwd_tf32", "flash_fwd_tf32.cu", ("mask", "vec", "split"), "q", _smem_fwd_tf32),
    "fwd_wgmma_tf32x3": Family("flash_fwd_wgmma_tf32", "flash_fwd_wgmma_tf32.cu", ("mask", "split"), "q",
                               _smem_fwd_wgmma_tf32),
    "fwd_wgmma_tf32": Family("flash_fwd_wgmma_tf32", "flash_fwd_wgmma_tf32.cu", ("mask", "split"), "q",
                             _smem_fwd_wgmma_tf32),
    "fwd_combine": Family("flash_fwd_combine", "flash_fwd_combine.cu", (), "q", lambda v: 0),
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


KV_SPLIT_FAMILIES = ("fwd_mma", "fwd_tf32x3", "fwd_tf32", "fwd_dmma", "fwd_fma", "fwd_decode")
"""The forwards that take KV_SPLIT (their last template parameter): the split-KV forward's partial
kernels (kernels_cu/scheduler.cuh, KeySplit), merged by ``fwd_combine``."""

PACKED_FAMILIES = ("fwd_wgmma", "fwd_wgmma_tf32x3", "fwd_mma", "fwd_tf32x3", "fwd_dmma", "bwd_dkdv_wgmma", "bwd_dkdv_mma",
                   "bwd_dq_mma", "bwd_dkdv_dmma", "bwd_dq_dmma", "bwd_dkdv_tf32x3", "bwd_dq_tf32x3")
"""The kernels that take PACKED (their last template parameter): packed sequences (cuflash.varlen), each
block with its sequence's own counts from the host's block table (kernels_cu/scheduler.cuh, PackedBlock)."""

PACKED_ATOMIC_DQ_FAMILIES = ("bwd_dkdv_tf32x3", "bwd_dkdv_dmma")
"""The packed dK/dV kernels that also add dQ with atomics (``atomic_dq``): into a row-major accumulator, whose
rows a packed block addresses from its sequence's first row. bwd_dkdv_mma adds into fragment tiles of whole
query blocks, which the blocks of neighbouring packed sequences would share: it leaves dQ to its dQ kernel."""

WIDE_K_FAMILIES = ("fwd_dmma", "bwd_dkdv_dmma", "bwd_dq_dmma")
"""Families whose kernels take ``WIDE_K`` (Variant.wide_k) as their last template parameter."""


SCORING_FAMILIES = ("fwd_mma", "fwd_tf32", "fwd_tf32x3", "fwd_dmma", "fwd_fma", "fwd_wgmma", "fwd_wgmma_tf32x3",
                    "bwd_dkdv_mma", "bwd_dkdv_tf32", "bwd_dkdv_tf32x3", "bwd_dkdv_dmma", "bwd_dkdv_fma",
                    "bwd_dkdv_wgmma", "bwd_dq_mma", "bwd_dq_tf32", "bwd_dq_tf32x3", "bwd_dq_dmma", "bwd_dq_fma",
                    "bwd_dbias_mma")
"""The families whose kernels score (query, key) pairs and so take a call's user modifications
(Variant.prelude, kernels_cu/user_mod.cuh); the decoding kernel scores too but takes none (its split twin
does)."""


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
    blocks visit few keys, ``select.row_class``). ``dq_tiled`` (the convert kernel): its dQ
    accumulator is in the fragment tiles of ``bwd_dkdv_mma``. ``schedule``: which blocks a CTA works
    on (:data:`SCHEDULES`). ``kv_split``: a split-KV forward's partial kernel (a forward of
    :data:`KV_SPLIT_FAMILIES`), its grid ``FwdParams::num_splits`` copies of the plain one, each over
    one range of key tiles, writing partial O and lse in the accumulator type. ``packed``: the forward
    over packed sequences of different lengths (cuflash.varlen), its grid the host's block table times
    the query heads (K/V heads: dK/dV) (scheduler.cuh, PackedBlock), a CTA a block, or (the Hopper forward)
    a persistent grid walking the table; :data:`PACKED_FAMILIES` without EXTRA (the forward on the split
    tiles). ``acc_out``: the 16-bit Hopper forward writing O in float32 (a
    partial result merged again later, cuflash.distributed), its last template parameter. ``prelude``: source placed before the kernel's, a call's user
    modifications (cuflash.mods, kernels_cu/user_mod.cuh) for an EXTRA variant; the name expression is
    the same, the build another.
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
    schedule: str = "block"
    kv_split: bool = False
    packed: bool = False
    acc_out: bool = False
    tile: Tile = field(default=None, repr=False)   # default: the table's preferred tile
    prelude: str = field(default="", repr=False)

    def __post_init__(self):
        if self.tile is None:
            object.__setattr__(self, "tile", self.tiles()[0])
        if self.wide_k and (self.family not in WIDE_K_FAMILIES or self.wide_k not in (4, 8, 16)):
            raise ValueError(f"wide_k={self.wide_k}: 4, 8 or 16, and only for {', '.join(WIDE_K_FAMILIES)}")
        if self.tile.query_split != 1 and (self.family != "bwd_dkdv_mma" or self.tile.query_split != 2
                                           or self.extra or self.tile.passes != 1 or self.pass_ != 0):
            raise ValueError(f"query_split={self.tile.query_split}: 2 only for bwd_dkdv_mma in one pass, "
                             "without EXTRA")
        if self.tile.head_split != 1 and (self.family != "bwd_dkdv_dmma" or self.tile.head_split != 2 or self.extra
                                          or self.tile.warps % 2):
            raise ValueError(f"head_split={self.tile.head_split}: 2 only for bwd_dkdv_dmma without EXTRA, an even "
                             "number of warps")
        if self.family.startswith("bwd_dkdv_tf32") and self.tile.warps not in (self.tile.block_n // 16,
                                                                              2 * (self.tile.block_n // 16)):
            raise ValueError("bwd_dkdv_tf32: a warp a 16-key strip, or two (query groups)")
        if self.family.startswith("bwd_dq_tf32") and self.tile.warps != self.tile.block_m // 16 \
                and (self.extra or self.tile.warps != 2 * (self.tile.block_m // 16)):
            raise ValueError("bwd_dq_tf32: a warp a 16-row strip, or two (key groups) without EXTRA")
        if self.tile.park and self.family != "fwd_mma":
            raise ValueError("park: only for fwd_mma")
        if self.tile.late_copies and self.family != "bwd_dkdv_mma":
            raise ValueError("late_copies: only for bwd_dkdv_mma")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: one of {', '.join(SCHEDULES)}")
        if self.schedule != "block" and not walkable(self):
            raise ValueError(f"schedule={self.schedule!r}: only the Hopper forward at one CTA an SM, without "
                             "EXTRA, at head dims up to 128 walks blocks")
        if self.schedule == "queue" and not walk_ring(self):
            raise ValueError("schedule='queue': only with two consumer warpgroups (the block ring)")
        if self.prelude and (self.family not in SCORING_FAMILIES or self.packed or self.family == "fwd_decode"):
            raise ValueError(f"prelude: user modifications run on the scoring kernels ({', '.join(SCORING_FAMILIES)}), "
                             "not on packed ones")
        if self.kv_split and self.family not in KV_SPLIT_FAMILIES:
            raise ValueError(f"kv_split: only for {', '.join(KV_SPLIT_FAMILIES)}")
        if self.packed and (self.family not in PACKED_FAMILIES or self.extra or self.kv_split
                            or (self.atomic_dq and self.family not in PACKED_ATOMIC_DQ_FAMILIES)):
            raise ValueError(f"packed: only for {', '.join(PACKED_FAMILIES)} without EXTRA, unsplit, and with "
                             f"atomic_dq only for {', '.join(PACKED_ATOMIC_DQ_FAMILIES)}")
        if linear_bias(self) and not takes_linear_bias(self):
            raise ValueError(f"a linear bias's prelude: only for {', '.join(LINEAR_BIAS_FAMILIES)} without EXTRA, "
                             "packing or float32 output, at head dims up to 128")
        if self.acc_out and (self.family != "fwd_wgmma" or self.packed or self.extra or self.prelude):
            raise ValueError("acc_out: only for fwd_wgmma without EXTRA, packing or user modifications")
        if self.dq_tiled and self.family != "bwd_convert_dq":
            raise ValueError("dq_tiled: only for bwd_convert_dq (the tiled accumulator of bwd_dkdv_mma)")
        # Hashed once: every launch looks its compiled kernel up by variant (launch._launch_config).
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash

    @property
    def wide_k(self) -> int:
        """The fp64 tensor-core kernels' MMA k (Tile.wide_k; 0: m8n8k4), their last template parameter."""
        return self.tile.wide_k

    def tiles(self) -> Tuple[Tile, ...]:
        """The table's tiles for this variant's (arch, family, dtype, head), preferred first."""
        key = (self.arch, self.family, self.dtype, self.head)
        if self.short:
            return TABLES["short"][key]
        if (self.kv_split or self.packed) and not self.extra and key in TABLES["split"]:
            tiles = tuple(t for t in TABLES["split"][key] if self.kv_split or not t.split_only)
            if tiles:
                return tiles
        if self.extra and key in TABLES["extra"]:
            return TABLES["extra"][key]
        return TABLES["plain"][key]

    def fitted(self, smem_limit: int, where=None) -> "Variant":
        """This variant with the first tile whose shared memory fits ``smem_limit`` bytes (tiles marked
        ``vec_only`` only for 16-byte loads) among those ``where(tile)`` is true of (None: all)."""
        tiles = [t for t in self.tiles() if (self.vec or not t.vec_only) and (where is None or where(t))]
        if not tiles:
            raise ValueError(f"{self.dtype} {FAMILY_WHAT[self.family]} at head dim {self.head}: the table has "
                             + ("tiles for 16-byte loads only" if where is None else "no such tile"))
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
        if (self.wide_k or self.tile.head_split != 1
                or ((self.kv_split or self.packed) and self.family in WIDE_K_FAMILIES)):   # 0 (m8n8k4) by default
            args.append(str(self.wide_k))
        packed_dkdv = self.packed and self.family == "bwd_dkdv_mma"
        if self.tile.query_split != 1 or self.tile.late_copies or packed_dkdv:   # bwd_dkdv_mma's QSPLIT (1 by default)
            args.append(str(self.tile.query_split))
        if self.tile.park or ((self.kv_split or self.packed) and self.family == "fwd_mma"):   # fwd_mma's PARK
            args.append(_cxx(self.tile.park))                                                  # (false by default)
        if self.tile.late_copies or packed_dkdv:   # bwd_dkdv_mma's, after QSPLIT: LATE_COPIES (false by default)
            args.append(_cxx(self.tile.late_copies))
        if self.family == "fwd_wgmma":   # its last template parameter: SCHEDULE
            args.append(str(SCHEDULES[self.schedule]))
        if self.kv_split:   # the split-KV forwards' last template parameter, KV_SPLIT (false by default)
            args.append("true")
        if self.packed:     # the last template parameter, PACKED (after KV_SPLIT where the family has it)
            args += ["false", "true"] if self.family in KV_SPLIT_FAMILIES else ["true"]
        if self.acc_out:    # fwd_wgmma's, after PACKED (false)
            args += ["false", "true"]
        if self.tile.head_split != 1:   # bwd_dkdv_dmma's, after PACKED: HEAD_SPLIT (1 by default)
            args += ([] if self.packed else ["false"]) + [str(self.tile.head_split)]
        return f"{self.fam.kernel}<{', '.join(args)}>"

    def grid(self, batch: int, heads_q: int, group: int, lq: int, lk: int) -> int:
        """Number of CTAs (the grid is one-dimensional; kernels decode it with BlockInfo)."""
        t = self.tile
        if self.fam.axis == "bias":
            raise ValueError("the dbias kernel's grid follows the bias (cuflash._dispatch.masking.DbiasPlan.grid)")
        if self.fam.axis == "q":
            n = -(-lq // t.block_m) * heads_q * batch
        else:
            n = -(-lk // t.block_n) * (heads_q // group) * batch
        if n > MAX_GRID_X:
            raise ValueError(f"{n} thread blocks exceed the grid limit {MAX_GRID_X}: split the batch")
        return n
