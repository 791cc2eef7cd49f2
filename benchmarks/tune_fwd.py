"""Time forward tile configs of the tensor-core kernel side by side (fills the variant
table's "why" column). B x L = 16384 tokens, H x D = 2048, fp16 and bf16, L = 1024 and 4096.
A config with BM > 16 * warps gives each warp BM / (16 * warps) row strips.

    PYTHONPATH=. python benchmarks/tune_fwd.py [--heads 64,128]
"""
import argparse

import ml_dtypes
import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash._variants import Tile, tile_override

# (block_m, block_n, warps); the first is the reference the others are checked against.
CANDIDATES = {
    32: [(64, 64, 4), (128, 64, 4), (128, 128, 4), (64, 64, 2)],
    64: [(64, 64, 4), (128, 64, 4), (64, 64, 2), (128, 32, 4)],
    128: [(64, 64, 4), (128, 32, 4), (64, 32, 2)],
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="32,64,128")
    args = parser.parse_args()
    print(f"{'dtype':5} {'D':>4} {'L':>5} {'BMxBN':>8} {'warps':>5} {'causal':>6} {'ms':>8} {'TFLOP/s':>8} {'max|diff|':>9}")
    for d in (int(x) for x in args.heads.split(",")):
        for dtype in (np.float16, ml_dtypes.bfloat16):
            for n in (1024, 4096):
                b, h = 16384 // n, 2048 // d
                rng = cp.random.default_rng(0)
                q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype) for _ in range(3))
                refs = {}
                for bm, bn, warps in CANDIDATES[d]:
                    with tile_override("fwd_mma", d, Tile(bm, bn, warps, 2, "tuning")):
                        for causal in (False, True):
                            out = cuflash.attention(q, k, v, causal=causal).astype(cp.float32)
                            ref = refs.setdefault(causal, out)
                            diff = float(cp.abs(out - ref).max())
                            t = benchmark(lambda: cuflash.attention(q, k, v, causal=causal), n_repeat=30, n_warmup=5)
                            ms = float(np.median(t.gpu_times[0]) * 1e3)
                            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                            print(f"{np.dtype(dtype).name[:5]:5} {d:4d} {n:5d} {bm:>3}x{bn:<4} {warps:5d} {str(causal):>6} "
                                  f"{ms:8.3f} {flops / ms / 1e9:8.1f} {diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
