"""DESIGN.md's error rule, shared by the GPU tests.

cuflash's error against the float64 reference must not exceed twice the error
of the naive computation in the same dtype, plus a small floor.
"""
import numpy as np

# Floors: a quarter of each dtype's machine epsilon (relative Frobenius error).
FLOOR = {"float16": 2.5e-4, "bfloat16": 2e-3, "float32": 3e-8, "float64": 6e-17}


def rel_error(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0))


def budget(naive_err: float, dtype: str) -> float:
    return 2.0 * naive_err + FLOOR[dtype]


def round_to(x, dtype: str):
    """Round float64 values to `dtype` and return them as float64."""
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(x).astype(dtype).astype(np.float64)


def naive_backward_same_dtype(dout, q, k, v, *, causal, scale, dtype: str, group: int = 1):
    """The materialised backward as a framework computes it in `dtype`: every
    matmul's result and every n x n intermediate rounded to `dtype` (softmax in
    float32 for 16-bit types). Inputs are float64 arrays (B, H, L, D)."""
    from cuflash import reference

    r = lambda x: round_to(x, dtype)  # noqa: E731
    kk, vv = (np.repeat(x, group, axis=1) for x in (k, v))
    s = r(np.einsum("bhqd,bhkd->bhqk", q, kk) * scale)
    allowed = reference.causal_mask(q.shape[2], k.shape[2], causal)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(s - mx)
    den = e.sum(-1, keepdims=True)
    p = r(np.divide(e, den, out=np.zeros_like(e), where=den > 0))
    o = r(np.einsum("bhqk,bhkd->bhqd", p, vv))
    dv = r(np.einsum("bhqk,bhqd->bhkd", p, dout))
    dp = r(np.einsum("bhqd,bhkd->bhqk", dout, vv))
    ds = r(p * (dp - (dout * o).sum(-1, keepdims=True)))
    dq = r(np.einsum("bhqk,bhkd->bhqd", ds, kk) * scale)
    dk = r(np.einsum("bhqk,bhqd->bhkd", ds, q) * scale)
    fold = lambda g: g.reshape(g.shape[0], -1, group, *g.shape[2:]).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)
