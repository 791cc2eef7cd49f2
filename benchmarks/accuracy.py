"""Accuracy per dtype: cuflash's error against the exact result, next to a naive
same-dtype computation's (the README's accuracy table; needs a GPU).

Relative Frobenius error of out, dq, dk, dv against float64 (long double for
float64 inputs), B = 1, H = 4, L = 1024, D = 64, inputs N(0, 1), causal and not.
"Naive" is reference.attention_naive / attention_backward_naive emulating a
framework that materialises the scores in that dtype.

    PYTHONPATH=. python benchmarks/accuracy.py
"""
import sys

import ml_dtypes
import numpy as np

from cuflash import reference
from cuflash._runtime.device import gpu_available

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def rel(x, ref) -> float:
    x, ref = np.asarray(x, np.longdouble), np.asarray(ref, np.longdouble)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main() -> None:
    ok, why = gpu_available()
    if not ok:
        sys.exit(f"benchmarks/accuracy.py measures the GPU kernels, and there is no usable GPU here: {why}")
    import cupy as cp

    import cuflash

    rng = np.random.default_rng(0)
    shape = (1, 4, 1024, 64)
    print("| dtype | causal | cuflash out / dq / dk / dv | naive same-dtype out / dq / dk / dv |")
    print("|---|---|---|---|")
    for name, dtype in DTYPES.items():
        for causal in (False, True):
            host = [rng.standard_normal(shape).astype(dtype).astype(np.float64) for _ in range(4)]
            dev = [cp.asarray(x.astype(dtype)) for x in host]
            out, lse = cuflash.attention_forward(*dev[:3], causal=causal)
            grads = cuflash.attention_backward(dev[3], *dev[:3], out, lse, causal=causal)
            exact = "longdouble" if name == "float64" else None
            ref_out, _ = reference.attention_naive(*host[:3], causal=causal, dtype=exact)
            ref_grads = reference.attention_backward_naive(host[3], *host[:3], causal=causal, dtype=exact)
            naive_out, _ = reference.attention_naive(*host[:3], causal=causal, dtype=name)
            naive_grads = reference.attention_backward_naive(host[3], *host[:3], causal=causal, dtype=name)
            ours = [rel(cp.asnumpy(g).astype(np.float64), r) for g, r in zip((out,) + grads, (ref_out,) + ref_grads)]
            theirs = [rel(g, r) for g, r in zip((naive_out,) + naive_grads, (ref_out,) + ref_grads)]
            print(f"| {name} | {'yes' if causal else 'no'} | {' / '.join(f'{e:.1e}' for e in ours)} "
                  f"| {' / '.join(f'{e:.1e}' for e in theirs)} |", flush=True)


if __name__ == "__main__":
    main()
