"""The Hopper forward with persistent CTAs: one CTA an SM walking query blocks, or a CTA a block? (issue 9)

With one CTA an SM (the 192 x 128 tile at head dim 64, 128 x 128 at 128), each CTA of a grid of
one CTA a block starts its pipeline bare (Q and the first K/V tiles in flight, nothing to overlap
them) and drains its epilogue alone. FwdWgmmaTraits::PERSISTENT variants can walk several blocks,
the next block's Q and first tiles landing while this one finishes. This script times, on the
same buffers and interleaved round by round,

    per-block    a CTA a query block (HOPPER_FWD_PERSISTENT off)
    persistent   one CTA an SM, a stride over the blocks (the default for calls without a causal band)
    persist-all  the same stride forced onto causal calls too (their blocks differ in work)
    cudnn        PyTorch SDPA's cuDNN backend (when torch imports)

at B x L = 16384 tokens, H x D = 2048 (bench.py's shape), timed alone (cupyx benchmark: the host's
work before the kernel included) and queued (the mean call of back-to-back calls), and prints each
contender's max |difference| from the per-block output (the same arithmetic a block: 0 expected).

    PYTHONPATH=. python benchmarks/tune_persistent.py [--heads 64,128] [--lengths 1024,2048,4096,16384] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib

import ml_dtypes
import numpy as np

import cupy as cp

import cuflash
from cuflash import _launch, _variants

from tune_short import cudnn_contender, time_and_print

@contextlib.contextmanager
def grid_rule(kind):
    """Forwards launched by one grid rule ("per-block", "persistent" or "persist-all")."""
    saved = _variants.HOPPER_FWD_PERSISTENT, _launch.persistent_grid
    _variants.HOPPER_FWD_PERSISTENT = kind != "per-block"
    if kind == "persist-all":
        _launch.persistent_grid = _variants.wgmma_persistent
    try:
        yield
    finally:
        _variants.HOPPER_FWD_PERSISTENT, _launch.persistent_grid = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--lengths", default="1024,2048,4096,16384")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--causal", default="no,yes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    print(f"{'dtype':8} {'D':>3} {'L':>5} {'causal':>6} {'contender':>11} {'ms':>7} {'TFLOP/s':>7} {'queued':>7} "
          f"{'TFLOP/s':>7} {'vs cudnn':>8} {'q vs cudnn':>10} {'max|diff|':>9}")
    for d in (int(x) for x in args.heads.split(",")):
        for dname in args.dtypes.split(","):
            dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dname]
            for n in (int(x) for x in args.lengths.split(",")):
                b, h = max(1, 16384 // n), 2048 // d
                rng = cp.random.default_rng(0)
                q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype) for _ in range(3))
                for causal in (c == "yes" for c in args.causal.split(",")):
                    kinds = ["per-block", "persistent"] + (["persist-all"] if causal else [])
                    fns = {}
                    for kind in kinds:
                        def run(kind=kind):
                            with grid_rule(kind):
                                return cuflash.attention(q, k, v, causal=causal)
                        fns[kind] = run
                    fns.update(cudnn_contender(q, k, v, causal))
                    time_and_print(fns, kinds, "per-block", 4 * b * h * n * n * d * (0.5 if causal else 1.0),
                                   f"{dname:8} {d:3d} {n:5d} {str(causal):>6}", args.rounds, args.repeat, width=11)

if __name__ == "__main__":
    main()
