"""DESIGN.md's error rule, shared by the GPU tests.

cuflash's error against an exact reference must not exceed twice the error of
the naive (materialised) computation in the same dtype, plus a floor:

    ||got - exact|| <= 2 ||naive - exact|| + eps * ||magnitude||

where eps is the dtype's machine epsilon and ``magnitude`` is the same
quantity computed with absolute values in every product (|P| |V| for out,
scale P (|dP| + |Dsum|) |K| for dQ, ...): one unit in the last place of the
terms being summed. That floor matters only where cancellation makes the true
result tiny (a row of one key has dQ = 0 exactly). The backward adds
eps * max|lse| * ||magnitude||: it recomputes P = exp(s - lse) from the saved lse,
whose own rounding is |lse| * eps, so every probability of a row carries that
relative error, and all of them the same one (FlashAttention's design; the naive
computation subtracts the exact row max instead). ``lse_bound`` bounds |lse| by
max|s| + log(keys): a row of 164 keys and logits below 2.4 has lse up to 7.5.

The naive same-dtype computation is what a framework does
(``reference.attention_naive(..., dtype=)`` and ``attention_backward_naive``):
float32 and float64 run genuinely in that dtype (BLAS matmuls, exp in that
precision); float16 and bfloat16 are emulated by rounding every matmul result
and every n x n intermediate to the dtype (float32 arithmetic), as framework
kernels that accumulate in fp32 do. The exact reference is float64, or long
double when the dtype under test is float64 itself. Grouped-query heads are
read from the shapes.
"""
import numpy as np

from cuflash import reference

FLOOR = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def rel_error(x, ref) -> float:
    denom = norm(ref)
    return norm(np.asarray(x, dtype=np.longdouble) - np.asarray(ref, dtype=np.longdouble)) / (denom or 1.0)


def norm(x) -> float:
    x = np.asarray(x, dtype=np.longdouble)
    return float(np.sqrt(np.sum(x * x)))


def lse_bound(q, k, scale: float) -> float:
    """An upper bound of |lse| over the rows of q (B, Hq, Lq, D) against k (B, Hk, Lk, D): the largest
    |scaled logit| plus log(Lk), for any mask (a masked key only lowers a row's lse)."""
    group = q.shape[1] // k.shape[1]
    logits = np.matmul(q, np.repeat(k, group, axis=1).swapaxes(-1, -2))
    return float(np.abs(logits).max()) * scale + float(np.log(max(k.shape[2], 1)))


def within_budget(got, exact_val, naive_val, magnitude, dtype: str, lse_max: float = 0.0):
    """(ok, message) for the error rule above, errors reported relative to ||exact||; ``lse_max`` bounds
    |lse| for a backward (0 for a forward)."""
    err = norm(np.asarray(got, dtype=np.longdouble) - exact_val)
    naive_err = norm(np.asarray(naive_val, dtype=np.longdouble) - exact_val)
    limit = 2.0 * naive_err + FLOOR[dtype] * (1.0 + lse_max) * norm(magnitude)
    scale = norm(exact_val) or 1.0
    msg = (f"rel. error {err / scale:.3e}, naive {naive_err / scale:.3e}, "
           f"limit {limit / scale:.3e} ({dtype})")
    return err <= limit, msg


def exact(q, k, v, do=None, *, causal, scale, dtype: str, **options):
    """The exact reference for inputs of `dtype`: float64 arithmetic, long double for float64.

    Returns out, or (out, (dq, dk, dv[, dbias])) when ``do`` is given. ``options``:
    bias, mask, window, dropout_p, seed, block_layout (NumPy arrays).
    """
    ref = "longdouble" if dtype == "float64" else None
    return _naive(q, k, v, do, causal=causal, scale=scale, dtype=ref, **options)


def naive_same_dtype(q, k, v, do=None, *, causal, scale, dtype: str, **options):
    """The naive computation in `dtype` (reference.attention_naive's emulation)."""
    return _naive(q, k, v, do, causal=causal, scale=scale, dtype=dtype, **options)


def magnitude(q, k, v, do=None, *, causal, scale, **options):
    """The absolute-value version of out (and of the gradients), in float64."""
    return reference.attention_magnitude(q, k, v, do, causal=causal, scale=scale, **options)


def _naive(q, k, v, do, *, causal, scale, dtype, **options):
    out, _ = reference.attention_naive(q, k, v, causal=causal, scale=scale, dtype=dtype, **options)
    if do is None:
        return out
    return out, reference.attention_backward_naive(do, q, k, v, causal=causal, scale=scale, dtype=dtype, **options)
