"""Time tile configs of the tensor-core dK/dV kernel side by side (fills the variant
table's comments) and check each config's gradients against the first one's.
fp16 (or bf16), L = 4096 (or --lengths), B x L = 16384, H x D = 2048, causal and not. On a
Hopper GPU the calls take the portable path (as bench.py's "cuflash sm80"), whose kernels these are.

    PYTHONPATH=. python benchmarks/tune_bwd.py [--heads 64,128] [--lengths 1024,4096] [--dtype bfloat16]

A config (block_m, block_n, warps, passes, stages, query_split) gives each group of query_split
warps block_n / (16 warps / query_split) strips of 16 keys (flash_bwd_mma.cu, KEY_STRIPS) and
steps over block_m queries; passes = 2 forms dV and dK in separate launches; query_split = 2
makes two warps share each key strip (half the step's queries, half the head dim each; P^T and
dS^T through shared memory); "late" issues the next step's copies after the step's first GEMM
(Tile.late_copies). The first config of each head dim is the table's tile, the reference (--only
picks others; the first picked is then the reference): dK and dV of the others must match it to fp32-accumulation tolerance (the same MMAs in the
same order give identical bits; the report says whether they are), and dQ too (its
atomic additions come in any order, so it differs in the last bits). Each config
compiles its variants on first use (a few seconds each); the whole run takes about
a minute on an H100.

--dtype float64 times the fp64 tensor-core backward (bwd_dkdv_dmma, bwd_dq_dmma) instead:
CANDIDATES_F64 name the dK/dV tile (None: the table's), the dQ path (atomic adds in the
dK/dV kernel, or the deterministic dQ kernel) and each kernel's Variant.wide_k (label kA,B:
0 is mma.m8n8k4, 16 mma.m16n8k16 over pairs of 8-row tiles, sm_90 only). The first config is the table's plan;
dK and dV of the others are compared with it, and dQ of the first --check-rows query rows
of batch 0, head 0 with a long-double reference (relative Frobenius norm).

    PYTHONPATH=. python benchmarks/tune_bwd.py --dtype float64 [--heads 64,128]
"""
import argparse
import contextlib
from unittest import mock
from dataclasses import replace

import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash import reference
from cuflash._dispatch import plan
from cuflash._dispatch.model import Tile
from cuflash._dispatch.select import tile_override
from cuflash._runtime import device

CANDIDATES = {   # (block_m, block_n, warps, passes, stages, query_split[, "late"])
    # "late": Tile.late_copies (the next step's Q / dO copies after the step's first GEMM).
    # Measured and not kept (benchmarks/NOTES.md): the dQ tile staged in shared memory (the
    # fragment-tiled accumulator replaced it), late copies at d=64 (0.97-1.0x), 128x128/8w at d=64 (0.86-0.91x).
    64: [(32, 128, 4, 1, 2, 1), (64, 64, 4, 1, 2, 1), (64, 128, 8, 1, 2, 2), (32, 128, 4, 1, 2, 1, "late"),
         (128, 128, 8, 1, 2, 2)],
    128: [(64, 128, 8, 1, 2, 2, "late"), (64, 128, 8, 1, 2, 2), (64, 64, 4, 2, 2, 1), (32, 128, 8, 1, 2, 1),
          (64, 128, 8, 1, 1, 2), (32, 64, 4, 1, 2, 1)],
}
TOLERANCE = 4e-3   # max |new - reference| / max |reference|: a few fp16 ulps of the largest entry
# float64 (benchmarks/NOTES.md): (dK/dV tile or None, deterministic, dK/dV wide_k, dQ kernel wide_k). A tile's
# own wide_k stands where the dK/dV wide_k is None. Offline compile, sm_90, plain kernels (NVRTC 12.9): with atomic
# dQ, d=64 16x64/4w spills 8-168 bytes at every wide_k, 16x128/8w (two 8-key tiles a warp) fits k8 at 255 registers,
# and the head-split tiles (two warps a key group, half of dK / dV's columns each) take 217-244 at d=64 and 255 at
# d=128 16x64/8w k8 (k16 spills 32 bytes, 32-query steps 500-1100).
_TWO_PASS = Tile(16, 64, 4, 1, "tuning", passes=2)
_HS = lambda bm, bn, st, k: Tile(bm, bn, 8, st, "tuning", wide_k=k, head_split=2)
CANDIDATES_F64 = {
    64: [(None, False, 0, 0), (_HS(32, 64, 2, 8), False, None, 0), (_HS(32, 64, 2, 16), False, None, 0),
         (_HS(16, 64, 2, 16), False, None, 0), (Tile(16, 128, 8, 2, "tuning", wide_k=8), False, None, 0),
         (None, True, 16, 16)],
    128: [(None, False, 0, 0), (_HS(16, 64, 2, 8), False, None, 0), (_HS(16, 64, 2, 16), False, None, 0),
          (None, True, 0, 0), (_HS(16, 64, 2, 8), True, None, 0)],
}
TOLERANCE_F64 = 1e-12


def rel_diff(a, b):
    work = cp.float64 if a.dtype == cp.float64 else cp.float32
    return float(cp.abs(a.astype(work) - b.astype(work)).max() / cp.abs(b.astype(work)).max())


@contextlib.contextmanager
def wide_backward(dkdv_k, dq_k):
    """The float64 tensor-core backward's dK/dV and dQ kernels with these ``wide_k``."""
    real = plan.backward_variants
    wide = {"bwd_dkdv_dmma": dkdv_k, "bwd_dq_dmma": dq_k}

    def pick(*args, **kwargs):
        kernels = []
        for v in real(*args, **kwargs):
            if v.family in wide:
                v = replace(v, tile=replace(v.tile, wide_k=wide[v.family]))
            if v.family == "bwd_dkdv_dmma" and v.tile.passes == 2:   # the table's plan has one pass only
                kernels += [replace(v, pass_=1, atomic_dq=False), replace(v, pass_=2)]
            else:
                kernels.append(v)
        return tuple(kernels)

    plan.backward_variants = pick
    try:
        yield
    finally:
        plan.backward_variants = real


def main_float64(heads, rows):
    """The fp64 tensor-core backward's candidates (CANDIDATES_F64), L = 4096."""
    sm90 = int(cp.cuda.Device().compute_capability) >= 90
    print(f"{'D':>4} {'config':>22} {'causal':>6} {'ms':>8} {'TFLOP/s':>8} {'dK diff':>8} {'dV diff':>8} "
          f"{'dQ err':>8}")
    failed = []
    for d in heads:
        n, b, h = 4096, 16384 // 4096, 2048 // d
        rng = cp.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float64) for _ in range(4))
        for causal in (False, True):
            out, lse = cuflash.attention_forward(q, k, v, causal=causal)
            ex = reference.attention_backward_naive(*(cp.asnumpy(x[0, 0, :rows]) for x in (do, q)),
                                                    *(cp.asnumpy(x[0, 0]) for x in (k, v)), causal=causal,
                                                    dtype="longdouble")[0]
            first = None
            for tile, det, dkdv_k, dq_k in CANDIDATES_F64[d]:
                if dkdv_k is None:
                    dkdv_k = tile.wide_k
                if (dkdv_k or dq_k) and not sm90:
                    continue
                shape = "table" if tile is None else f"{tile.block_m}x{tile.block_n}/{tile.warps}w/{tile.passes}p"
                if tile is not None and tile.head_split != 1:
                    shape += f"/hs{tile.head_split}"
                label = f"{shape}/{'det' if det else 'atomic'}/k{dkdv_k}" + (f",{dq_k}" if det else "")
                ctx = (tile_override("bwd_dkdv_dmma", d, tile, dtypes=("float64",)) if tile is not None
                       else contextlib.nullcontext())
                with ctx, wide_backward(dkdv_k, dq_k):
                    call = lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=det)
                    dq, dk, dv = call()
                    t = benchmark(call, n_repeat=10, n_warmup=2)
                ms = float(np.median(t.gpu_times[0]) * 1e3)
                flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                first = first or (dk, dv)
                diffs = [rel_diff(x, r) for x, r in zip((dk, dv), first)]
                got = cp.asnumpy(dq[0, 0, :rows]).astype(np.longdouble)
                err = float(np.linalg.norm((got - ex).ravel()) / np.linalg.norm(ex.ravel()))
                print(f"{d:4d} {label:>22} {str(causal):>6} {ms:8.3f} {flops / ms / 1e9:8.1f} "
                      f"{diffs[0]:8.1e} {diffs[1]:8.1e} {err:8.1e}", flush=True)
                if max(diffs + [err]) > TOLERANCE_F64 or not all(bool(cp.isfinite(x).all()) for x in (dq, dk, dv)):
                    failed.append(f"d={d} {label} causal={causal}: {diffs} {err}")
    if failed:
        raise SystemExit("float64 gradients off:\n" + "\n".join(failed))


def _sm80() -> int:
    """The compute capability the portable path's calls report on a Hopper GPU (one function: the call
    plans are keyed by it)."""
    return 80


def _fa2_backward_ms(q, k, v, do, causal, repeat=20):
    """Median ms of PyTorch SDPA's flash backward (FlashAttention-2's kernels) on the same buffers, the forward
    done once outside the timing."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_(True) for x in (q, k, v))
    tdo = torch.from_dlpack(do)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=bool(causal))
    call = lambda: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True)
    t = benchmark(call, n_repeat=repeat, n_warmup=3)
    return float(np.median(t.gpu_times[0]) * 1e3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="64,128")
    parser.add_argument("--lengths", default="4096", help="16-bit: sequence lengths (B x L = 16384)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float64"), default="float16")
    parser.add_argument("--check-rows", type=int, default=64, help="float64: query rows of dQ checked in long double")
    parser.add_argument("--first", type=int, default=None, help="16-bit: only the first FIRST candidates of each head dim")
    parser.add_argument("--only", default=None, help="16-bit: comma-separated candidate indices of each head dim")
    parser.add_argument("--peer", action="store_true", help="16-bit: also time PyTorch SDPA's flash backward "
                        "(FlashAttention-2) on the same buffers")
    args = parser.parse_args()
    if args.dtype == "float64":
        return main_float64([int(x) for x in args.heads.split(",")], args.check_rows)
    print(f"{'D':>4} {'L':>6} {'config':>18} {'causal':>6} {'ms':>8} {'TFLOP/s':>8} {'dK diff':>8} {'dV diff':>8} "
          f"{'dQ diff':>8} {'dK,dV bits':>10}")
    failed = []
    if args.dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    else:
        dtype = cp.float16
    for d in (int(x) for x in args.heads.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            b, h = max(1, 16384 // n), 2048 // d
            rng = cp.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype) for _ in range(4))
            for causal in (False, True):
                with mock.patch.object(device, "compute_capability", _sm80):
                    out, lse = cuflash.attention_forward(q, k, v, causal=causal)
                reference = None
                if args.peer:
                    print(f"{d:4d} {n:6d} {'FA2 (SDPA flash)':>18} {str(causal):>6} {_fa2_backward_ms(q, k, v, do, causal):8.3f}",
                          flush=True)
                chosen = CANDIDATES[d][:args.first]
                if args.only:
                    chosen = [CANDIDATES[d][int(i)] for i in args.only.split(",")]
                for bm, bn, warps, passes, stages, qsplit, *flags in chosen:
                    label = (f"{bm}x{bn}/{warps}w/{passes}p/{stages}s" + (f"/q{qsplit}" if qsplit > 1 else "")
                             + ("/late" if "late" in flags else ""))
                    tile = Tile(bm, bn, warps, stages, "tuning", passes=passes, query_split=qsplit,
                                late_copies="late" in flags)
                    with tile_override("bwd_dkdv_mma", d, tile, dtypes=(args.dtype,)), \
                            mock.patch.object(device, "compute_capability", _sm80):
                        call = lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
                        dq, dk, dv = call()
                        t = benchmark(call, n_repeat=20, n_warmup=3)
                    ms = float(np.median(t.gpu_times[0]) * 1e3)
                    flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                    if reference is None:
                        reference = (dq, dk, dv)
                    diffs = [rel_diff(x, r) for x, r in zip((dk, dv, dq), (reference[1], reference[2], reference[0]))]
                    same_bits = bool((dk == reference[1]).all()) and bool((dv == reference[2]).all())
                    print(f"{d:4d} {n:6d} {label:>18} {str(causal):>6} {ms:8.3f} {flops / ms / 1e9:8.1f} "
                          f"{diffs[0]:8.1e} {diffs[1]:8.1e} {diffs[2]:8.1e} {str(same_bits):>10}", flush=True)
                    if max(diffs) > TOLERANCE or not all(bool(cp.isfinite(x).all()) for x in (dq, dk, dv)):
                        failed.append(f"d={d} L={n} {label} causal={causal}: {diffs}")
    if failed:
        raise SystemExit("gradients differ from the reference layout's:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
