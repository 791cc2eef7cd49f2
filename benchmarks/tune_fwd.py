"""Time forward tile configs of the tensor-core kernel side by side (fills the variant
table's "why" column). B x L = 16384 tokens, H x D = 2048, fp16, L = 4096.

    PYTHONPATH=. python benchmarks/tune_fwd.py
"""
import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash._variants import Tile, tile_override

CANDIDATES = {
    32: [(128, 64, 8), (64, 64, 4), (64, 128, 4)],
    64: [(128, 64, 8), (64, 64, 4), (64, 128, 4)],
    128: [(128, 64, 8), (64, 64, 4), (64, 32, 4)],
    256: [(64, 32, 4), (32, 32, 2)],
}


def main():
    print(f"{'D':>4} {'BMxBN':>8} {'warps':>5} {'causal':>6} {'ms':>8} {'TFLOP/s':>8}")
    for d, configs in CANDIDATES.items():
        n, b, h = 4096, 4, 2048 // d
        rng = cp.random.default_rng(0)
        q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(3))
        ref = None
        for bm, bn, warps in configs:
            with tile_override("fwd_mma", d, Tile(bm, bn, warps, 2, "tuning")):
                for causal in (False, True):
                    out = cuflash.attention(q, k, v, causal=causal)
                    if not causal:
                        ref = out if ref is None else ref
                        assert float(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32)).max()) < 1e-2
                    t = benchmark(lambda: cuflash.attention(q, k, v, causal=causal), n_repeat=30, n_warmup=5)
                    ms = float(np.median(t.gpu_times[0]) * 1e3)
                    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                    print(f"{d:4d} {bm:>3}x{bn:<4} {warps:5d} {str(causal):>6} {ms:8.3f} {flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
