"""Variant table, tile configs and kernel launches.

One table maps (dtype, head-dim bucket) to a tile config; the kernel name
expression, shared-memory size and grid all derive from it.  Every entry says
why it was chosen.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Iterator

import numpy as np

# Head dims are padded up to one of these buckets (the mma k-step is 16, and
# the SIMT kernels split columns over 16 threads).
HEAD_BUCKETS = (32, 64, 128, 256)

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
_CXX_TYPE = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class FwdConfig:
    """Tile config of one forward variant.

    block_m query rows x block_n keys per tile; ``warps`` warps per CTA.
    """

    block_m: int
    block_n: int
    warps: int
    why: str


# Tensor-core forward (float16, bfloat16): each warp owns 16 query rows, so
# block_m = 16 * warps. Chosen with benchmarks/tune_fwd.py on an H100 (fp16,
# L=4096, B*L=16384, H*D=2048; TFLOP/s non-causal / causal), 2026-11-22:
#   d=32:  128x64/8w 148/93   64x64/4w 143/95   64x128/4w 153/88
#   d=64:  128x64/8w 164/97   64x64/4w 177/123  64x128/4w 183/110
#   d=128: 128x64/8w 198/130  64x64/4w 191/139  64x32/4w 179/140
#   d=256: 64x32/4w 188/145   32x32/2w 129/88
# 4-warp CTAs at ~150-190 registers let 2-3 CTAs share an SM, which helps most
# when causal blocks finish at different times. Zero spills on sm_80 and sm_90.
_MMA_FWD = {
    32: FwdConfig(64, 64, 4, "64x64/4w: best causal, within 4% of the best non-causal"),
    64: FwdConfig(64, 64, 4, "64x64/4w: best causal (+26% over 128x64/8w), 3% under 64x128 non-causal"),
    128: FwdConfig(64, 64, 4, "64x64/4w: best causal at 4% under 128x64/8w non-causal; 104 KB -> 87 KB shared"),
    256: FwdConfig(64, 32, 4, "acc_o alone is 128 registers at d=256: 4 warps, 32-key tiles avoid spills"),
}

# CUDA-core forward (float32, float64): 16 x 16 threads, block_m / 16 rows per
# thread. Shared memory holds Q, K, V and P tiles once (no double buffering).
_SIMT_FWD = {
    ("float32", 32): FwdConfig(64, 64, 8, "4x4 scores per thread"),
    ("float32", 64): FwdConfig(64, 64, 8, "4x4 scores per thread"),
    ("float32", 128): FwdConfig(64, 64, 8, "115 KB shared"),
    ("float32", 256): FwdConfig(64, 32, 8, "140 KB shared; 32-key tiles"),
    ("float64", 32): FwdConfig(64, 64, 8, "66 KB shared"),
    ("float64", 64): FwdConfig(64, 64, 8, "131 KB shared"),
    ("float64", 128): FwdConfig(32, 32, 8, "107 KB shared; 64-row tiles would not fit"),
    ("float64", 256): FwdConfig(32, 32, 8, "205 KB shared, under the 227 KB limit"),
}


def head_bucket(d: int) -> int:
    for bucket in HEAD_BUCKETS:
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim {d} is larger than the largest supported ({HEAD_BUCKETS[-1]})")


@dataclass(frozen=True)
class FwdVariant:
    """One compiled forward kernel: its source entry, name expression and shared memory."""

    dtype: str
    head: int
    causal: bool
    vec: bool          # 16-byte cp.async loads (tensor-core kernels only)

    @property
    def uses_mma(self) -> bool:
        return self.dtype in ("float16", "bfloat16")

    @property
    def config(self) -> FwdConfig:
        return _MMA_FWD[self.head] if self.uses_mma else _SIMT_FWD[(self.dtype, self.head)]

    @property
    def entry(self) -> str:
        return "flash_fwd.cu" if self.uses_mma else "flash_fwd_simt.cu"

    @property
    def name(self) -> str:
        c, t, flag = self.config, _CXX_TYPE[self.dtype], str(self.causal).lower()
        if self.uses_mma:
            return f"flash_fwd_mma<{t}, {self.head}, {c.block_n}, {c.warps}, {flag}, {str(self.vec).lower()}>"
        return f"flash_fwd_simt<{t}, {self.head}, {c.block_m}, {c.block_n}, {flag}>"

    @property
    def threads(self) -> int:
        return 32 * self.config.warps

    @property
    def smem_bytes(self) -> int:
        c, size = self.config, _ITEMSIZE[self.dtype]
        if self.uses_mma:
            pitch = self.head + 8
            return (c.block_m + 4 * c.block_n) * pitch * size
        qk_pitch = self.head + 1
        return (c.block_m * qk_pitch + c.block_n * qk_pitch + c.block_n * self.head
                + c.block_m * (c.block_n + 1)) * size


def all_fwd_variants() -> Iterator[FwdVariant]:
    """Every forward variant the library can launch (what `compile` builds)."""
    for dtype, head, causal in product(DTYPE_NAMES, HEAD_BUCKETS, (False, True)):
        for vec in ((False, True) if dtype in ("float16", "bfloat16") else (False,)):
            yield FwdVariant(dtype, head, causal, vec)


# Backward on CUDA cores (float32, float64, and 16-bit types at head dim 256):
# 16 x 16 threads. Shared memory holds K, V, Q, dO tiles (input dtype) and P, dS
# tiles (accumulator dtype); registers hold dK, dV.
_BWD = {
    (2, 32): (64, 64, "~100 KB shared at fp32 tiles; 4x4 scores per thread"),
    (2, 64): (64, 64, "as 32"),
    (2, 128): (64, 64, "166 KB shared with fp32 inputs"),
    (2, 256): (32, 32, "140 KB shared; dK+dV are 64 registers"),
    (8, 32): (32, 32, "fp64 P/dS tiles: 32x32 keeps shared memory near 84 KB"),
    (8, 64): (32, 32, "fp64: 84 KB shared"),
    (8, 128): (32, 32, "fp64: 149 KB shared"),
    (8, 256): (16, 32, "fp64: 206 KB shared; dK+dV are 128 registers"),
}

# Tensor-core backward (float16, bfloat16, head dim <= 128): 4 warps, 64 keys per
# dK/dV CTA, 64 query rows per step. At head dim 128 dK and dV are computed in two
# passes (their fp32 accumulators alone are 128 registers a thread), and the
# deterministic dQ kernel steps over 32 keys (64 spilled). Zero spills, sm_80/sm_90.
MMA_BWD_MAX_HEAD = 128
# Q/dO buffers of the dK/dV kernel: 2 prefetches the next query block during the
# current one's math (needs (2*64 + 4*64) * (d+8) * 2 bytes of shared memory).
# benchmarks/tune_bwd.py, H100, fp16 L=4096 (backward TFLOP/s, non-causal / causal):
#   d=64: 1 stage 107 / 103, 2 stages 109 / 105;  d=128: 1 stage 94 / 88, 2 stages 96 / 91.
_MMA_BWD_STAGES = {32: 2, 64: 2, 128: 2}


def _bwd_uses_mma(dtype: str, head: int) -> bool:
    return dtype in ("float16", "bfloat16") and head <= MMA_BWD_MAX_HEAD


@dataclass(frozen=True)
class BwdVariant:
    """One CUDA-core backward kernel: ``kind`` is "dkdv" (optionally with atomic dQ) or "dq"."""

    dtype: str
    head: int
    causal: bool
    kind: str
    atomic_dq: bool = False

    entry = "flash_bwd.cu"
    threads = 256

    @property
    def tiles(self) -> tuple:
        block_m, block_n, _ = _BWD[(8 if self.dtype == "float64" else 2, self.head)]
        return block_m, block_n

    @property
    def name(self) -> str:
        (bm, bn), t, flag = self.tiles, _CXX_TYPE[self.dtype], str(self.causal).lower()
        if self.kind == "dkdv":
            return f"flash_bwd_dkdv<{t}, {self.head}, {bm}, {bn}, {flag}, {str(self.atomic_dq).lower()}>"
        return f"flash_bwd_dq<{t}, {self.head}, {bm}, {bn}, {flag}>"

    @property
    def smem_bytes(self) -> int:
        bm, bn = self.tiles
        acc = 8 if self.dtype == "float64" else 4
        return (2 * bn + 2 * bm) * (self.head + 1) * _ITEMSIZE[self.dtype] + (2 * bm * (bn + 1) + 2 * bm) * acc


@dataclass(frozen=True)
class BwdMmaVariant:
    """One tensor-core backward kernel.

    ``kind`` "dkdv": ``pass_`` 0 = dK and dV, 1 = dV only, 2 = dK only (with
    ``atomic_dq``, also dQ). ``kind`` "dq": the deterministic dQ pass.
    Causal masking is a runtime offset in these kernels (no causal flag).
    """

    dtype: str
    head: int
    kind: str
    vec: bool
    pass_: int = 0
    atomic_dq: bool = False

    entry = "flash_bwd_mma.cu"
    threads = 128
    block_m = 64

    @property
    def stages(self) -> int:
        return _MMA_BWD_STAGES[self.head] if self.kind == "dkdv" else 1

    @property
    def block_n(self) -> int:
        return 32 if (self.kind == "dq" and self.head > 64) else 64

    @property
    def name(self) -> str:
        t, vec = _CXX_TYPE[self.dtype], str(self.vec).lower()
        if self.kind == "dkdv":
            return (f"flash_bwd_dkdv_mma<{t}, {self.head}, {self.block_m}, {self.pass_}, {self.stages}, "
                    f"{str(self.atomic_dq).lower()}, {vec}>")
        return f"flash_bwd_dq_mma<{t}, {self.head}, {self.block_n}, {vec}>"

    @property
    def smem_bytes(self) -> int:
        bm, bn, pitch = self.block_m, self.block_n, self.head + 8
        return (2 * bn + 2 * self.stages * bm) * pitch * 2 + bm * (bn + 8) * 2 + 2 * bm * 4


def _mma_passes(head: int, atomic_dq: bool) -> list:
    """(pass, atomic_dq) launches of the dK/dV kernel for one head bucket."""
    return [(0, atomic_dq)] if head <= 64 else [(1, False), (2, atomic_dq)]


@dataclass(frozen=True)
class HelperKernel:
    """A small elementwise kernel of flash_bwd.cu (preprocess, dQ conversion)."""

    dtype: str
    kernel: str
    entry = "flash_bwd.cu"
    smem_bytes = 0
    threads = 256

    @property
    def name(self) -> str:
        return f"{self.kernel}<{_CXX_TYPE[self.dtype]}>"


def all_bwd_variants() -> Iterator:
    for dtype, head in product(DTYPE_NAMES, HEAD_BUCKETS):
        if _bwd_uses_mma(dtype, head):
            for vec in (False, True):
                for atomic in (True, False):
                    for pass_, atomic_dq in _mma_passes(head, atomic):
                        if not (pass_ == 1 and not atomic):   # pass 1 is the same either way
                            yield BwdMmaVariant(dtype, head, "dkdv", vec, pass_, atomic_dq)
                yield BwdMmaVariant(dtype, head, "dq", vec)
            continue
        for causal in (False, True):
            yield BwdVariant(dtype, head, causal, "dkdv", atomic_dq=True)
            yield BwdVariant(dtype, head, causal, "dkdv", atomic_dq=False)
            yield BwdVariant(dtype, head, causal, "dq")
    for dtype in DTYPE_NAMES:
        yield HelperKernel(dtype, "bwd_preprocess")
        yield HelperKernel(dtype, "bwd_convert_dq")


def all_variants() -> list:
    """Every kernel variant of every direction (each has .entry, .name, .smem_bytes)."""
    return list(all_fwd_variants()) + list(all_bwd_variants())


def _elem_strides(x) -> list:
    """Batch, head and row strides of a 4-D array, in elements."""
    return [np.int64(s // x.itemsize) for s in x.strides[:3]]


_MAX_GRID_YZ = 65535


def launch_forward(q, k, v, out, lse, *, dtype: str, causal_offset: int | None,
                   scale: float, group: int) -> None:
    """Launch the forward kernel on 4-D views ``(B, H, L, D)`` (last axis unit-stride).

    ``causal_offset`` is None for no causal mask, else key j is allowed for
    query i iff ``j <= i + causal_offset``.
    """
    from ._build import get_kernel

    b, hq, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[3]
    vec = dtype in ("float16", "bfloat16") and _vec_ok(d, dv, q, k, v)
    variant = FwdVariant(dtype, head_bucket(max(d, dv)), causal_offset is not None, vec)
    kernel = get_kernel(variant.entry, variant.name, variant.smem_bytes)
    cfg = variant.config

    scale_log2 = scale * np.log2(np.e)
    scale_arg = np.float64(scale_log2) if not variant.uses_mma else np.float32(scale_log2)
    m_blocks = -(-lq // cfg.block_m)
    if hq > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} query heads are supported, got {hq}")
    # The grid's z extent is limited: launch the batch in chunks.
    for b0 in range(0, b, _MAX_GRID_YZ):
        nb = min(_MAX_GRID_YZ, b - b0)
        args = [q[b0:], k[b0:], v[b0:], out[b0:], lse[b0:],
                *_elem_strides(q), *_elem_strides(k), *_elem_strides(v), *_elem_strides(out),
                np.int64(lse.strides[0] // lse.itemsize), np.int64(lse.strides[1] // lse.itemsize),
                np.int32(group), np.int32(lq), np.int32(lk), np.int32(d), np.int32(dv),
                scale_arg, np.int32(causal_offset or 0)]
        kernel((m_blocks, hq, nb), (variant.threads,), tuple(args), shared_mem=variant.smem_bytes)


def _vec_ok(d: int, dv: int, *arrays) -> bool:
    """16-byte cp.async loads: 8-element rows, 16-byte aligned base and row stride."""
    return (d % 8 == 0 and dv % 8 == 0
            and all(x.data.ptr % 16 == 0 and (x.strides[2] // x.itemsize) % 8 == 0 for x in arrays))


def launch_backward(dout, q, k, v, out, lse, *, dtype: str, causal_offset: int | None, scale: float,
                    group: int, deterministic: bool):
    """Gradients (dq, dk, dv) as new contiguous 4-D arrays, from 4-D views of the inputs.

    ``lse`` must be contiguous (B, Hq, Lq) in the accumulator dtype.
    """
    import cupy

    from ._build import get_kernel

    b, hq, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    acc_dtype = np.float64 if dtype == "float64" else np.float32
    head = head_bucket(max(d, dv))
    if hq > _MAX_GRID_YZ or b > _MAX_GRID_YZ:
        raise ValueError(f"the backward supports at most {_MAX_GRID_YZ} heads and batch entries")

    def launch(variant, grid, args):
        get_kernel(variant.entry, variant.name, variant.smem_bytes)(
            grid, (variant.threads,), args, shared_mem=variant.smem_bytes)

    # Dsum = rowsum(dO * O)
    dsum = cupy.empty((b, hq, lq), dtype=acc_dtype)
    launch(HelperKernel(dtype, "bwd_preprocess"), (-(-lq // 8), hq, b),
           (dout, out, dsum, *_elem_strides(dout), *_elem_strides(out), np.int32(lq), np.int32(dv)))

    dq = cupy.empty((b, hq, lq, d), dtype=q.dtype)
    dk = cupy.empty((b, hk, lk, d), dtype=q.dtype)
    dv_ = cupy.empty((b, hk, lk, dv), dtype=q.dtype)
    dq_acc = None if deterministic else cupy.zeros((b, hq, lq, d), dtype=acc_dtype)
    mma = _bwd_uses_mma(dtype, head)
    # The tensor-core kernels take "no causal mask" as offset lk (every key allowed).
    offset = causal_offset if (causal_offset is not None or not mma) else lk

    def common():
        return (*_elem_strides(q), *_elem_strides(k), *_elem_strides(v), *_elem_strides(dout),
                np.int32(group), np.int32(lq), np.int32(lk), np.int32(d), np.int32(dv),
                np.float64(scale), np.int32(offset or 0))

    grads_in = (q, k, v, dout, lse, dsum)
    if mma:
        vec = _vec_ok(d, dv, q, k, v, dout)
        for pass_, atomic in _mma_passes(head, not deterministic):
            var = BwdMmaVariant(dtype, head, "dkdv", vec, pass_, atomic)
            launch(var, (-(-lk // 64), hk, b), (*grads_in, dq_acc if atomic else dsum, dk, dv_, *common()))
        if deterministic:
            var = BwdMmaVariant(dtype, head, "dq", vec)
            launch(var, (-(-lq // var.block_m), hq, b), (*grads_in, dq, *common()))
    else:
        causal = causal_offset is not None
        var = BwdVariant(dtype, head, causal, "dkdv", atomic_dq=not deterministic)
        bm, bn = var.tiles
        launch(var, (-(-lk // bn), hk, b),
               (*grads_in, dq_acc if dq_acc is not None else dsum, dk, dv_, *common()))
        if deterministic:
            var = BwdVariant(dtype, head, causal, "dq")
            launch(var, (-(-lq // bm), hq, b), (*grads_in, dq, *common()))
    if not deterministic:
        n = dq.size
        launch(HelperKernel(dtype, "bwd_convert_dq"), (min(-(-n // 256), 65535 * 4),),
               (dq_acc, dq, np.int64(n)))
    return dq, dk, dv_
