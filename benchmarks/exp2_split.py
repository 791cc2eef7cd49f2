"""How many of the softcap forward's probabilities to form on the FMA pipe (needs a GPU).

    PYTHONPATH=. python benchmarks/exp2_split.py [--values 0,1,2,4] [--dims 64,128] [--dtype bfloat16]

The 16-bit Hopper forward with a score modification on the special-function unit (softcap's tanh) forms
FMA_EXP2 of every 8 probabilities with fma_exp2 (kernels_cu/common.cuh) instead of MUFU.EX2; the kernels'
rule (fwd_exp2_on_fma, kernels_cu/softmax.cuh) picks the count by head dim. This script builds the forward
with each count (the CUF_EXP2_ON_FMA override in the modification's source: one build a value) and times
bench_mods' causal row (B=4, H=16, L=4096, softcap 30) beside plain causal attention in one process, the
values interleaved over --rounds rounds (each the median of 5 runs of 20 queued calls, CUDA events), and
prints each count's median time, its ratio to plain, and the error of head (0, 0)'s output against float64.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import bench_decode  # noqa: E402
import cuflash  # noqa: E402
from cuflash import mods as M  # noqa: E402

try:
    import cupy as cp
except ImportError:   # main() says what is missing
    cp = None

B, H, L, CAP = 4, 16, 4096, 30.0


_COUNTS: dict = {}   # id of a softcap object -> its count


def _generate_with_counts(real):
    def generate(self, fast):
        text = real(self, fast)
        counts = [_COUNTS[id(m)] for m in self.score if id(m) in _COUNTS]
        if counts:
            text = text.replace("#define CUF_USER_SPECIAL", f"#define CUF_EXP2_ON_FMA {counts[0]}\n"
                                "#define CUF_USER_SPECIAL")
        return text
    return generate


def softcap_with(count: int):
    """softcap(CAP) whose source overrides the kernels' count with ``count`` (a build of its own)."""
    mod = cuflash.softcap(CAP)
    _COUNTS[id(mod)] = count
    return mod


def as_f64(x, dtype: str):
    if dtype == "bfloat16":
        return (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    return x.astype(cp.float64)


def reference_head(q, k, v, dtype: str):
    """Causal softcapped attention of head (0, 0) in float64."""
    q, k, v = (as_f64(x[0, 0], dtype) for x in (q, k, v))
    s = CAP * cp.tanh(q @ k.T / np.sqrt(q.shape[-1]) / CAP)
    s = cp.where(cp.tril(cp.ones(s.shape, bool)), s, -cp.inf)
    p = cp.exp(s - s.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", default="0,1,2,4")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    if cp is None:
        print("exp2_split.py needs CuPy and a GPU")
        return 1
    values = [int(x) for x in args.values.split(",")]
    M.Mods._generate = _generate_with_counts(M.Mods._generate)
    rng = cp.random.RandomState(0)
    dt = bench._cp_dtype(args.dtype)
    for d in (int(x) for x in args.dims.split(",")):
        q, k, v = (bench_decode._normal(rng, (B, H, L, d), dt) for _ in range(3))
        ref = reference_head(q, k, v, args.dtype)
        calls, errors = {"plain": lambda: cuflash.attention(q, k, v, causal=True)}, {}
        for n in values:
            mod = softcap_with(n)
            calls[n] = lambda mod=mod: cuflash.attention(q, k, v, causal=True, score_mod=mod)
            out = calls[n]()
            errors[n] = float(cp.linalg.norm(as_f64(out[0, 0], args.dtype) - ref) / cp.linalg.norm(ref))
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(bench._time_queued(fn, 20))
        plain = float(np.median(times["plain"]))
        print(f"{args.dtype} D={d}: plain causal {plain:.4f} ms")
        for n in values:
            t = float(np.median(times[n]))
            rounds = ", ".join(f"{x:.4f}" for x in times[n])
            print(f"  softcap, {n}/8 on the FMA pipe: {t:.4f} ms, x plain {t / plain:.3f} (rounds {rounds}), "
                  f"error {errors[n]:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
