"""Time forward tile configs of the tensor-core kernels side by side (fills the variant
table's "why" column). B x L = 16384 tokens, H x D = 2048, L = 1024 and 4096.
fp16 and bf16 (fwd_mma): a config with BM > 16 * warps gives each warp BM / (16 * warps)
row strips. float64 (fwd_dmma, --dtype float64): each warp owns BM / (8 * warps) 8-row
tiles; the first row of each head dim is the FMA kernel that fwd_dmma replaced, at its
last table tile (the baseline).

    PYTHONPATH=. python benchmarks/tune_fwd.py [--heads 64,128] [--dtype float64]
"""
import argparse
import contextlib

import ml_dtypes
import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash import _launch
from cuflash._variants import Tile, Variant, tile_override

# (block_m, block_n, warps); the first is the reference the others are checked against.
CANDIDATES = {
    32: [(64, 64, 4), (128, 64, 4), (128, 128, 4), (64, 64, 2)],
    64: [(64, 64, 4), (128, 64, 4), (64, 64, 2), (128, 32, 4), (128, 128, 4)],
    128: [(64, 64, 4), (128, 32, 4), (64, 32, 2)],
}
# float64: "fma" is the FMA baseline; every config compiles with 0 spills (plain kernel).
CANDIDATES_F64 = {
    32: ["fma", (128, 32, 4), (64, 32, 4), (64, 64, 4), (128, 16, 4)],
    64: ["fma", (64, 32, 4), (64, 16, 4), (64, 64, 4), (128, 32, 4), (32, 32, 2)],
    128: ["fma", (64, 32, 4), (64, 16, 4), (64, 24, 4), (32, 16, 2)],
    256: ["fma", (32, 16, 4), (32, 8, 4), (16, 16, 2), (16, 8, 2)],
}
# The float64 FMA forward's tiles before fwd_dmma (flash_fwd_fma.cu: 256 threads).
FMA_F64 = {32: Tile(64, 64, 8, 1, "baseline"), 64: Tile(64, 64, 8, 1, "baseline"),
           128: Tile(32, 32, 8, 1, "baseline", ctas=2), 256: Tile(32, 32, 8, 1, "baseline")}


@contextlib.contextmanager
def fma_forward(d):
    """Forwards of head bucket d through the FMA kernel (the float64 baseline)."""
    real = _launch.forward_variant

    def pick(dtype, head, *, band, extra=False, vec, smem_limit):
        return Variant("fwd_fma", dtype, head, band=band, extra=extra, tile=FMA_F64[head])

    _launch.forward_variant = pick
    try:
        yield
    finally:
        _launch.forward_variant = real


def config(d, cand, float64):
    """(label, context manager) of one candidate."""
    if cand == "fma":
        return "FMA", fma_forward(d)
    bm, bn, warps = cand
    family = "fwd_dmma" if float64 else "fwd_mma"
    dtypes = ["float64"] if float64 else ["float16", "bfloat16"]
    return f"{bm}x{bn}/{warps}w", tile_override(family, d, Tile(bm, bn, warps, 2, "tuning"), dtypes=dtypes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default=None, help="head dims (default 32,64,128; 32,64,128,256 for float64)")
    parser.add_argument("--dtype", choices=("half", "float64"), default="half",
                        help="half: float16 and bfloat16 (fwd_mma); float64: fwd_dmma against the FMA baseline")
    args = parser.parse_args()
    float64 = args.dtype == "float64"
    heads = args.heads or ("32,64,128,256" if float64 else "32,64,128")
    dtypes = (np.float64,) if float64 else (np.float16, ml_dtypes.bfloat16)
    print(f"{'dtype':5} {'D':>4} {'L':>5} {'config':>12} {'causal':>6} {'ms':>8} {'TFLOP/s':>8} {'max|diff|':>9}")
    for d in (int(x) for x in heads.split(",")):
        for dtype in dtypes:
            for n in (1024, 4096):
                b, h = 16384 // n, 2048 // d
                rng = cp.random.default_rng(0)
                q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype) for _ in range(3))
                refs = {}
                for cand in (CANDIDATES_F64 if float64 else CANDIDATES)[d]:
                    label, ctx = config(d, cand, float64)
                    with ctx:
                        for causal in (False, True):
                            out = cuflash.attention(q, k, v, causal=causal).astype(cp.float64)
                            ref = refs.setdefault(causal, out)
                            diff = float(cp.abs(out - ref).max())
                            t = benchmark(lambda: cuflash.attention(q, k, v, causal=causal), n_repeat=30, n_warmup=5)
                            ms = float(np.median(t.gpu_times[0]) * 1e3)
                            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                            print(f"{np.dtype(dtype).name[:5]:5} {d:4d} {n:5d} {label:>12} {str(causal):>6} "
                                  f"{ms:8.3f} {flops / ms / 1e9:8.1f} {diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
