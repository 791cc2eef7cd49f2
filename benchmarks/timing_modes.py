"""Three timings of the same call, to tell host time from GPU time (needs a GPU; PyTorch for the peers):
each call alone (events around one call, synchronised after it: bench.py's ``ms``), calls queued back to
back (bench.py's ``ms_queued``), and each call queued behind a ~1 ms GPU spin kernel (the host's work
before the first launch hidden while the GPU is busy, so the time is the GPU's alone).

    PYTHONPATH=. python benchmarks/timing_modes.py HEAD_DIMS LENGTHS [CONTENDERS]
    PYTHONPATH=. python benchmarks/timing_modes.py 128,256 1024,2048 "cuflash,torch cudnn"

bf16, B x L = 16384 tokens, H x D = 2048; forward and forward+backward (forward only at head dim 256).
benchmarks/NOTES.md quotes its output (2026-11-25)."""
import sys
from pathlib import Path

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long n) {
    long long t = clock64(); while (clock64() - t < n) {} }''', "spin")


def behind_spin(fn, n=20):
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    res = []
    for _ in range(n):
        spin((1,), (1,), (np.int64(2_000_000),))   # ~1 ms at 1.98 GHz
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        res.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(res))


rng = cp.random.default_rng(0)
cases = [(d, L, causal, bwd) for d in [int(x) for x in sys.argv[1].split(",")]
         for L in [int(x) for x in sys.argv[2].split(",")] for causal in (False, True) for bwd in (False, True)]
names = sys.argv[3].split(",") if len(sys.argv) > 3 else ["cuflash", "torch flash", "torch cudnn"]
print("ms: event-timed / back to back / behind a spin")
for d, L, causal, with_bwd in cases:
    if d == 256 and with_bwd:
        continue
    b, h = 16384 // L, 2048 // d
    qq, kk, vv, dd = (rng.standard_normal((b, h, L, d), dtype=cp.float32).astype(bench._cp_dtype("bfloat16"))
                      for _ in range(4))
    cons = bench.contenders(qq, kk, vv, dd, causal, with_bwd)
    flops = 4 * b * h * L * L * d * (0.5 if causal else 1.0) * (3.5 if with_bwd else 1.0)
    line = f"bf16 d={d} L={L} causal={causal!s:5} {'fwd+bwd' if with_bwd else 'fwd':7}"
    for name in names:
        fn = cons.get(name)
        if fn is None:
            continue
        try:
            fn()
            cp.cuda.Device().synchronize()
        except Exception as exc:  # a peer without this case
            line += f" | {name} n/a ({type(exc).__name__})"
            continue
        ev = float(np.median(benchmark(fn, n_repeat=30, n_warmup=3).gpu_times[0]) * 1e3)
        tp = bench._time_queued(fn, 30)
        sp = behind_spin(fn)
        line += f" | {name} {ev:.3f}/{tp:.3f}/{sp:.3f} ({flops / ev / 1e9:.0f} TF)"
    print(line, flush=True)
    del qq, kk, vv, dd, cons
    cp.get_default_memory_pool().free_all_blocks()
