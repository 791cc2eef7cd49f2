"""DESIGN.md's error rule, shared by the GPU tests.

cuflash's error against an exact reference must not exceed twice the error of
the naive (materialised) computation in the same dtype, plus a floor:

    ||got - exact|| <= 2 ||naive - exact|| + eps * ||magnitude||

where eps is the dtype's machine epsilon and ``magnitude`` is the same
quantity computed with absolute values in every product (|P| |V| for out,
scale P (|dP| + |Dsum|) |K| for dQ, ...): one unit in the last place of the
terms being summed. That floor matters only where cancellation makes the true
result tiny (a row of one key has dQ = 0 exactly). The backward adds
eps * max|s| * ||magnitude||: it recomputes P = exp(s - lse) from the saved lse,
whose own rounding is |lse| * eps, so with logits of size |s| every
probability carries that relative error (FlashAttention's design; the naive
computation subtracts the exact row max instead).

The naive same-dtype computation is what a framework does: float32 and float64
run genuinely in that dtype (BLAS matmuls, exp in that precision); float16 and
bfloat16 are emulated by rounding every matmul result and every n x n
intermediate to the dtype (softmax in float32), as framework kernels that
accumulate in fp32 do. The exact reference is float64, or long double when
the dtype under test is float64 itself.
"""
import numpy as np

FLOOR = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def rel_error(x, ref) -> float:
    denom = norm(ref)
    return norm(np.asarray(x, dtype=np.longdouble) - np.asarray(ref, dtype=np.longdouble)) / (denom or 1.0)


def norm(x) -> float:
    x = np.asarray(x, dtype=np.longdouble)
    return float(np.sqrt(np.sum(x * x)))


def within_budget(got, exact_val, naive_val, magnitude, dtype: str, logit_max: float = 0.0):
    """(ok, message) for the error rule above, errors reported relative to ||exact||."""
    err = norm(np.asarray(got, dtype=np.longdouble) - exact_val)
    naive_err = norm(np.asarray(naive_val, dtype=np.longdouble) - exact_val)
    limit = 2.0 * naive_err + FLOOR[dtype] * (1.0 + logit_max) * norm(magnitude)
    scale = norm(exact_val) or 1.0
    msg = (f"rel. error {err / scale:.3e}, naive {naive_err / scale:.3e}, "
           f"limit {limit / scale:.3e} ({dtype})")
    return err <= limit, msg


def round_to(x, dtype: str):
    """Round values to `dtype` and return them as float64."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(x).astype(dtype).astype(np.float64)


def _materialised(q, k, v, do, *, causal, scale, group, work, rnd, absolute=False):
    """out (and dq, dk, dv when do is given) computed in `work` precision, with
    `rnd` applied to every matmul result and n x n intermediate. With
    `absolute`, the magnitudes: every product of the forward's P V and the
    backward's formulas taken over absolute values."""
    from cuflash import reference

    q, k, v = (np.asarray(x, dtype=work) for x in (q, k, v))
    kk, vv = (np.repeat(x, group, axis=1) for x in (k, v))
    s = rnd(np.matmul(q, kk.swapaxes(-1, -2)) * work(scale))
    allowed = reference.causal_mask(q.shape[2], k.shape[2], causal)
    if allowed is not None:
        s = np.where(allowed, s, work(-np.inf))
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, work(0))
    e = np.exp(s - mx)
    den = e.sum(-1, keepdims=True)
    p = rnd(np.divide(e, np.where(den > 0, den, work(1))) * (den > 0))
    a = np.abs if absolute else (lambda x: x)
    o = rnd(np.matmul(p, a(vv)))
    if do is None:
        return o
    do = np.asarray(do, dtype=work)
    dv = rnd(np.matmul(p.swapaxes(-1, -2), a(do)))
    dp = rnd(np.matmul(a(do), a(vv).swapaxes(-1, -2)))
    dsum = (a(do) * o).sum(-1, keepdims=True)
    ds = rnd(p * (dp + dsum) if absolute else p * (dp - dsum))
    dq = rnd(np.matmul(ds, a(kk)) * work(scale))
    dk = rnd(np.matmul(ds.swapaxes(-1, -2), a(q)) * work(scale))
    fold = lambda g: g.reshape(g.shape[0], -1, group, *g.shape[2:]).sum(2)  # noqa: E731
    return o, (dq, fold(dk), fold(dv))


def exact(q, k, v, do=None, *, causal, scale, dtype: str, group: int = 1):
    """The exact reference for inputs of `dtype` (float64 arithmetic; long double for float64)."""
    work = np.longdouble if dtype == "float64" else np.float64
    return _materialised(q, k, v, do, causal=causal, scale=scale, group=group, work=work, rnd=lambda x: x)


def magnitude(q, k, v, do=None, *, causal, scale, group: int = 1):
    """The absolute-value version of out (and of the gradients), in float64."""
    return _materialised(q, k, v, do, causal=causal, scale=scale, group=group, work=np.float64,
                         rnd=lambda x: x, absolute=True)


def naive_same_dtype(q, k, v, do=None, *, causal, scale, dtype: str, group: int = 1):
    """The naive computation in `dtype` (see the module docstring)."""
    if dtype in ("float32", "float64"):
        work = np.dtype(dtype).type
        return _materialised(q, k, v, do, causal=causal, scale=scale, group=group, work=work,
                             rnd=lambda x: x)
    r = lambda x: round_to(x, dtype)  # noqa: E731
    q, k, v = (r(x) for x in (q, k, v))
    return _materialised(q, k, v, do, causal=causal, scale=scale, group=group, work=np.float64, rnd=r)
