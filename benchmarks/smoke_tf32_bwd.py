"""Smoke test of the float32 TF32 backward: one small backward call per precision
(B=1, H=2, L=300, D=64, causal), the kernel families launched and the relative errors of dq, dk, dv
against the float64 reference, next to the FMA backward's. Seconds; safe under `timeout 60`:
    timeout 60 env PYTHONPATH=. python benchmarks/smoke_tf32_bwd.py
"""
import numpy as np
import cupy as cp

import cuflash
from cuflash import reference
from cuflash._dispatch import plan
from cuflash._runtime import launch

launched = []
_real_launch = launch.launch_kernel


def _record(variant, *args, **kwargs):
    launched.append(variant.family + (f"[pass {variant.pass_}]" if variant.pass_ else ""))
    _real_launch(variant, *args, **kwargs)


launch.launch_kernel = _record
rng = np.random.default_rng(0)
b, h, n, d = 1, 2, 300, 64
q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4))
host = [x.astype(np.float64) for x in (q, k, v, do)]
ref = reference.attention_backward_naive(host[3], *host[:3], causal=True)
dev = [cp.asarray(x) for x in (q, k, v, do)]


def rel(x, r):
    return float(np.linalg.norm(cp.asnumpy(x).astype(np.float64) - r) / np.linalg.norm(r))


def run(precision, deterministic, backward_precision=None):
    launched.clear()
    out, lse = cuflash.attention_forward(*dev[:3], causal=True, precision=precision)
    if backward_precision == "fma":   # the FMA backward: the baseline no public option selects
        choose = plan.backward_variants
        plan.backward_variants = lambda *a, **kw: choose(*a, **{**kw, "precision": "fma"})
    try:
        grads = cuflash.attention_backward(dev[3], *dev[:3], out, lse, causal=True, precision=precision,
                                           deterministic=deterministic)
        cp.cuda.Device().synchronize()
    finally:
        if backward_precision == "fma":
            plan.backward_variants = choose
    errs = " ".join(f"{name} {rel(g, r):.2e}" for name, g, r in zip(("dq", "dk", "dv"), grads, ref))
    finite = all(bool(cp.isfinite(g).all()) for g in grads)
    print(f"{precision:7s} det={deterministic!s:5s} bwd={backward_precision or precision:7s} finite={finite} "
          f"{errs}  {launched}", flush=True)


for precision in ("highest", "tf32"):
    for deterministic in (False, True):
        run(precision, deterministic)
        run(precision, deterministic, "fma")
