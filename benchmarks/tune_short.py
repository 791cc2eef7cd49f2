"""The Hopper forward at short rows: which kernel should a call with few keys take?

At head dim 64 the table's Hopper tile (192 x 128, one CTA an SM) starts and drains each
block's pipeline alone, so below HOPPER_FWD_MIN_KEYS keys the portable kernel used to run
instead. The short-rows table (Variant.short) gives calls whose query blocks visit at most
HOPPER_FWD_SHORT_KEYS keys on average a Hopper tile with two CTAs an SM. This script times, on the same buffers and interleaved round by round, every head dim's

    portable     the portable kernel (forward_variant(..., wgmma=False))
    hopper       the table's Hopper tile
    short        the short-rows tile (Variant.short), where the head dim has one
    cudnn        PyTorch SDPA's cuDNN backend (when torch imports)

at B x L = 16384 tokens, H x D = 2048 (bench.py's shape), timed alone (cupyx benchmark: the
host's work before the kernel included) and queued (the mean call of back-to-back calls),
and prints each contender's max |difference| from the portable kernel's output.

    PYTHONPATH=. python benchmarks/tune_short.py [--heads 64] [--lengths 512,1024,2048,4096] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
from dataclasses import replace

import ml_dtypes
import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash._dispatch import plan
from cuflash._dispatch.model import Variant
from cuflash._dispatch.select import forward_variant, has_short_tile, schedule_for

try:
    import torch
except ImportError:   # pragma: no cover - the device has it
    torch = None


def _choice(kind):
    """A ``plan.forward_choice`` that returns one kernel choice ("portable", "hopper" or "short")
    whatever the rules say (one function a kind, so that the plan memo keeps its plans)."""

    @functools.lru_cache(maxsize=None)
    def pick(dtype, head, band, extra, vec, rows, cc, smem_limit, precision="highest"):
        portable = forward_variant(dtype, head, band=band, extra=extra, vec=vec, smem_limit=smem_limit, cc=cc,
                                   wgmma=False)
        if kind == "portable":
            return portable, portable
        hopper = Variant("fwd_wgmma", dtype, head, band=band, extra=extra, arch="sm90a").fitted(smem_limit)
        if kind == "short":
            hopper = replace(hopper, short=True, tile=None).fitted(smem_limit)
        return replace(hopper, schedule=schedule_for(hopper)), portable   # the schedule the library gives it

    return pick


CHOICES = {kind: _choice(kind) for kind in ("portable", "hopper", "short")}


@contextlib.contextmanager
def forced(kind):
    """Forwards through one kernel choice ("portable", "hopper" or "short") whatever the rules say."""
    real = plan.forward_choice
    plan.forward_choice = CHOICES[kind]
    try:
        yield
    finally:
        plan.forward_choice = real


def time_alone(fn, repeat):
    return float(np.median(benchmark(fn, n_repeat=repeat, n_warmup=3).gpu_times[0]) * 1e3)


def time_queued(fn, repeat):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    fn()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / repeat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    print_header(width=9)
    for dname, d, n, (q, k, v) in problems(args.heads, args.dtypes, args.lengths):
        for causal in (False, True):
            kinds = ["portable", "hopper"] + (["short"] if has_short_tile(dname, d) else [])
            time_rules(q, k, v, causal, kinds, forced, f"{dname:8} {d:3d} {n:5d} {str(causal):>6}", args.rounds,
                       args.repeat, width=9)


def print_header(width: int) -> None:
    print(f"{'dtype':8} {'D':>3} {'L':>5} {'causal':>6} {'contender':>{width}} {'ms':>7} {'TFLOP/s':>7} {'queued':>7} "
          f"{'TFLOP/s':>7} {'vs cudnn':>8} {'q vs cudnn':>10} {'max|diff|':>9}")


def problems(heads: str, dtypes: str, lengths: str):
    """(dtype name, head dim, L, (q, k, v)) for every comma-separated head dim, dtype and length: B x L =
    16384 tokens, H x D = 2048 (bench.py's shape), standard normal values."""
    for d in (int(x) for x in heads.split(",")):
        for dname in dtypes.split(","):
            dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dname]
            for n in (int(x) for x in lengths.split(",")):
                b, h = max(1, 16384 // n), 2048 // d
                rng = cp.random.default_rng(0)
                yield dname, d, n, tuple(rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype)
                                         for _ in range(3))


def flops(q, causal) -> float:
    """Forward FLOPs of self-attention on q's shape (B, H, L, D): 4 B H L^2 D, halved when causal."""
    b, h, n, d = q.shape
    return 4 * b * h * n * n * d * (0.5 if causal else 1.0)


def cudnn_contender(q, k, v, causal) -> dict:
    """{"cudnn": PyTorch SDPA's cuDNN backend on the same buffers}, or {} without torch."""
    if torch is None:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    return {"cudnn": cudnn}


def time_rules(q, k, v, causal, kinds: list, rule, label: str, rounds: int, repeat: int, width: int) -> None:
    """``cuflash.attention`` under each of ``kinds`` (entered as ``with rule(kind)``) beside cuDNN, timed and
    printed by :func:`time_and_print`, differences against the first kind's output."""
    fns = {}
    for kind in kinds:
        def run(kind=kind):
            with rule(kind):
                return cuflash.attention(q, k, v, causal=causal)
        fns[kind] = run
    fns.update(cudnn_contender(q, k, v, causal))
    time_and_print(fns, kinds, kinds[0], flops(q, causal), label, rounds, repeat, width=width)


def time_and_print(fns: dict, kinds: list, ref_kind: str, flops: float, label: str, rounds: int, repeat: int,
                   width: int) -> None:
    """Time every contender of ``fns`` alone and queued, ``rounds`` rounds interleaved, and print a row each:
    ms, TFLOP/s, the ratio to cuDNN (where it ran) and, for ``kinds``, max |difference| from ``ref_kind``."""
    ref = fns[ref_kind]().astype(cp.float32)
    diffs = {kind: float(cp.abs(fns[kind]().astype(cp.float32) - ref).max()) for kind in kinds}
    alone = {kind: [] for kind in fns}
    queued = {kind: [] for kind in fns}
    for _ in range(rounds):
        for kind, fn in fns.items():
            alone[kind].append(time_alone(fn, repeat))
            queued[kind].append(time_queued(fn, repeat))
    ms = {kind: float(np.median(x)) for kind, x in alone.items()}
    qms = {kind: float(np.median(x)) for kind, x in queued.items()}
    for kind in fns:
        vs = f"{ms['cudnn'] / ms[kind]:8.2f}" if "cudnn" in ms else f"{'':8}"
        qvs = f"{qms['cudnn'] / qms[kind]:10.2f}" if "cudnn" in qms else f"{'':10}"
        diff = f"{diffs[kind]:9.2e}" if kind in diffs else ""
        print(f"{label} {kind:>{width}} {ms[kind]:7.3f} {flops / ms[kind] / 1e9:7.1f} {qms[kind]:7.3f} "
              f"{flops / qms[kind] / 1e9:7.1f} {vs} {qvs} {diff}", flush=True)

if __name__ == "__main__":
    main()
