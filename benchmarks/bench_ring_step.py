"""One ring step's cost on one GPU: the forward of a block of L/2 queries and keys in 16 bits and in float32
(api.forward_in_accumulator, the ring's partial results), and the backward of the block (bf16, H=16, D=128).

    PYTHONPATH=. python benchmarks/bench_ring_step.py
"""
import sys
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash  # noqa: E402
from cuflash import api  # noqa: E402

def timed(fn, rep=3):
    fn(); cp.cuda.Device().synchronize(); ts = []
    for _ in range(rep):
        s, e = cp.cuda.Event(), cp.cuda.Event(); s.record(); fn(); e.record(); e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    return float(np.median(ts))

for L in (131072, 262144):
    h = L // 2
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 16, h, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(4))
    for causal in (False, "top_left"):
        f16 = timed(lambda: cuflash.attention_forward(q, k, v, causal=causal))
        f32 = timed(lambda: api.forward_in_accumulator(q, k, v, causal=causal))
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)
        b = timed(lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal))
        print(f"block {h} causal={causal}: fwd {f16:.1f} ms, fwd fp32-out {f32:.1f} ms ({f32/f16:.2f}x), bwd {b:.1f} ms", flush=True)
