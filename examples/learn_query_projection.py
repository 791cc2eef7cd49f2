"""Learn a query projection by plain gradient descent (no autograd).

The loss is ||attention(x W, k, v) - target||^2 / 2, with target made by a hidden
W_true; the gradient with respect to W is x^T dq, dq from cuflash.vjp. Prints the loss
curve (it falls about 70-fold in 300 steps, never rising). Runs on the
GPU with CuPy arrays, or, where there is no usable GPU, on NumPy arrays (cuflash's
CPU reference path, same code).

    PYTHONPATH=. python examples/learn_query_projection.py
"""
import math

import cuflash
from cuflash._runtime.device import gpu_available

ok, why = gpu_available()
if ok:
    import cupy as xp
else:
    import numpy as xp
    print(f"No GPU here ({why}): running on NumPy arrays instead.")

rng = xp.random.default_rng(0)
n, d = 256, 64
x = rng.standard_normal((n, d), dtype=xp.float32)
k = rng.standard_normal((n, d), dtype=xp.float32)
v = rng.standard_normal((n, d), dtype=xp.float32)
w_true = rng.standard_normal((d, d), dtype=xp.float32)
target = cuflash.attention(x @ w_true, k, v, causal=True)

w = xp.zeros((d, d), dtype=xp.float32)
losses = []
for step in range(301):
    out, vjp_fn = cuflash.vjp(x @ w, k, v, causal=True)
    residual = out - target
    losses.append(0.5 * float((residual ** 2).sum()))
    dq, dk, dv = vjp_fn(residual)          # d loss / d (q, k, v)
    w -= 0.0015 * (x.T @ dq)               # q = x w  =>  d loss / d w = x^T dq

# The loss curve: every 25th step, a bar on a log scale.
top, bottom = max(losses), min(losses)
for step in range(0, len(losses), 25):
    width = 1 + round(50 * (math.log(losses[step]) - math.log(bottom)) / (math.log(top) - math.log(bottom)))
    print(f"step {step:3d}  loss {losses[step]:9.2f}  {'#' * width}")
rises = sum(b > a * 1.01 for a, b in zip(losses, losses[1:]))
assert rises == 0 and losses[-1] < losses[0] / 30, f"not converging: {rises} rises, final {losses[-1]:.1f}"
print(f"loss {losses[0]:.1f} -> {losses[-1]:.1f} in {len(losses) - 1} steps, never rising by more than 1%")
