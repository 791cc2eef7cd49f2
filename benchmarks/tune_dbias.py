"""Time tile configs of the dbias kernel (flash_bwd_dbias.cu) side by side, for the variant
table's "why" column: the backward of B=4, H=16, D=64 attention with a pair bias (1, 1, L, L)
and a key bias (B, 1, 1, L), fp16 and bf16. Each config's dbias is compared with the first
config's (a different tile sums in a different order: agreement to fp32 rounding, not bits).

    PYTHONPATH=. python benchmarks/tune_dbias.py [--seqlens 1024,4096] [--head 64]
"""
import argparse

import ml_dtypes
import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash._dispatch.model import Tile
from cuflash._dispatch.select import tile_override

# (block_m, block_n, warps): warps own 16 query rows each, so block_m = 16 * warps.
CANDIDATES = [(64, 64, 4), (128, 64, 8), (64, 128, 4)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--head", type=int, default=64)
    args = parser.parse_args()
    b, h, d = 4, 16, args.head
    print(f"{'dtype':5} {'bias':>12} {'L':>5} {'BMxBN':>8} {'warps':>5} {'bwd ms':>8} {'max|ddb|':>9}")
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for n in (int(x) for x in args.seqlens.split(",")):
            rng = cp.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype) for _ in range(4))
            for name, shape in (("(1,1,L,L)", (1, 1, n, n)), ("(B,1,1,L)", (b, 1, 1, n))):
                bias = rng.standard_normal(shape, dtype=cp.float32).astype(dtype)
                out, lse = cuflash.attention_forward(q, k, v, bias=bias)
                ref = None
                for bm, bn, warps in CANDIDATES:
                    with tile_override("bwd_dbias_mma", d, Tile(bm, bn, warps, 2, "tuning")):
                        def run():
                            return cuflash.attention_backward(do, q, k, v, out, lse, bias=bias)
                        dbias = run()[3].astype(cp.float32)
                        ref = dbias if ref is None else ref
                        diff = float(cp.abs(dbias - ref).max() / max(float(cp.abs(ref).max()), 1e-30))
                        t = benchmark(run, n_repeat=10, n_warmup=3)
                        ms = float(np.median(t.gpu_times[0]) * 1e3)
                        print(f"{np.dtype(dtype).name[:5]:5} {name:>12} {n:5d} {bm:>3}x{bn:<4} {warps:5d} {ms:8.3f} "
                              f"{diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
