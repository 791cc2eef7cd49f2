"""Time backward configs of the tensor-core kernels side by side (fills the
variant table's comments). fp16, L = 4096, B x L = 16384, H x D = 2048.

    PYTHONPATH=. python benchmarks/tune_bwd.py
"""
import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash._variants import Tile, tile_override


def main():
    print(f"{'D':>4} {'stages':>6} {'causal':>6} {'ms':>8} {'TFLOP/s':>8}")
    for d in (64, 128):
        n, b, h = 4096, 4, 2048 // d
        rng = cp.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
        for causal in (False, True):
            out, lse = cuflash.attention_forward(q, k, v, causal=causal)
            first = None
            for stages in (1, 2):
                with tile_override("bwd_dkdv_mma", d, Tile(64, 64, 4, stages, "tuning")):
                    grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=True)
                    if first is None:
                        first = grads
                    else:   # same summation order: bitwise equal
                        assert all(bool((a == b_).all()) for a, b_ in zip(first, grads)), "stages disagree"
                    t = benchmark(lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal),
                                  n_repeat=20, n_warmup=3)
                ms = float(np.median(t.gpu_times[0]) * 1e3)
                flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                print(f"{d:4d} {stages:6d} {str(causal):>6} {ms:8.3f} {flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
