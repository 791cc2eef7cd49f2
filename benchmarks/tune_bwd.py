"""Time tile configs of the tensor-core dK/dV kernel side by side (fills the variant
table's comments) and check each config's gradients against the first one's.
fp16, L = 4096, B x L = 16384, H x D = 2048, causal and not.

    PYTHONPATH=. python benchmarks/tune_bwd.py [--heads 64,128]

A config (block_m, block_n, warps, passes) gives each warp block_n / (16 warps) strips
of 16 keys (flash_bwd_mma.cu, KEY_STRIPS) and steps over block_m queries; passes = 2
forms dV and dK in separate launches. The first config of each head dim is the
one-strip 64 x 64 layout the table shipped before branch bwd2, the reference: dK and
dV of the others must match it to fp32-accumulation tolerance (the same MMAs in the
same order give identical bits; the report says whether they are), and dQ too (its
atomic additions come in any order, so it differs in the last bits). Each config
compiles its variants on first use (a few seconds each); the whole run takes about
a minute on an H100.
"""
import argparse

import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash._variants import Tile, tile_override

CANDIDATES = {
    64: [(64, 64, 4, 1), (32, 128, 4, 1), (32, 64, 4, 1), (64, 128, 8, 1)],
    128: [(64, 64, 4, 2), (32, 128, 8, 1), (32, 64, 4, 1)],
}
TOLERANCE = 4e-3   # max |new - reference| / max |reference|: a few fp16 ulps of the largest entry


def rel_diff(a, b):
    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max() / cp.abs(b.astype(cp.float32)).max())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="64,128")
    args = parser.parse_args()
    print(f"{'D':>4} {'config':>14} {'causal':>6} {'ms':>8} {'TFLOP/s':>8} {'dK diff':>8} {'dV diff':>8} "
          f"{'dQ diff':>8} {'dK,dV bits':>10}")
    failed = []
    for d in (int(x) for x in args.heads.split(",")):
        n, b, h = 4096, 16384 // 4096, 2048 // d
        rng = cp.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
        for causal in (False, True):
            out, lse = cuflash.attention_forward(q, k, v, causal=causal)
            reference = None
            for bm, bn, warps, passes in CANDIDATES[d]:
                label = f"{bm}x{bn}/{warps}w/{passes}p"
                with tile_override("bwd_dkdv_mma", d, Tile(bm, bn, warps, 2, "tuning", passes=passes),
                                   dtypes=("float16",)):
                    dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
                    t = benchmark(lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal),
                                  n_repeat=20, n_warmup=3)
                ms = float(np.median(t.gpu_times[0]) * 1e3)
                flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                if reference is None:
                    reference = (dq, dk, dv)
                diffs = [rel_diff(x, r) for x, r in zip((dk, dv, dq), (reference[1], reference[2], reference[0]))]
                same_bits = bool((dk == reference[1]).all()) and bool((dv == reference[2]).all())
                print(f"{d:4d} {label:>14} {str(causal):>6} {ms:8.3f} {flops / ms / 1e9:8.1f} "
                      f"{diffs[0]:8.1e} {diffs[1]:8.1e} {diffs[2]:8.1e} {str(same_bits):>10}", flush=True)
                if max(diffs) > TOLERANCE or not all(bool(cp.isfinite(x).all()) for x in (dq, dk, dv)):
                    failed.append(f"d={d} {label} causal={causal}: {diffs}")
    if failed:
        raise SystemExit("gradients differ from the reference layout's:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
