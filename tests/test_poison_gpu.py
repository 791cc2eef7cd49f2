"""Reads of memory nobody wrote: every allocation is filled with NaN bits before the library gets it.

A kernel that reads padding, a row past the end of an array, or a buffer it forgot to initialise
turns the result NaN (all-ones bits are NaN in every float format), where a pool that hands back
zeros or old results would hide it. Odd head dims (40: rows of 80 bytes, not whole 128-byte
lines) and odd lengths put every edge of every tile in play.
"""
import contextlib

import numpy as np
import pytest

import cuflash
from cuflash import reference

from _errors import exact, lse_bound, magnitude, naive_same_dtype, within_budget
from _tiers import sampled
from _gpu_checks import DTYPES

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")


@contextlib.contextmanager
def nan_filled_pool():
    """CuPy's allocations come from a fresh pool whose memory is set to 0xFF bytes (NaN) on every hand-out."""
    pool = cp.cuda.MemoryPool()

    def malloc(size: int):
        mem = pool.malloc(size)
        cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, mem.mem.size - (mem.ptr - mem.mem.ptr),
                                    cp.cuda.get_current_stream().ptr)
        return mem

    previous = cp.cuda.get_allocator()
    cp.cuda.set_allocator(malloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(previous)
        pool.free_all_blocks()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d, lq, lk", [(40, 77, 133), (64, 97, 130), (128, 33, 65)])
@pytest.mark.parametrize("causal, deterministic", sampled([(False, False), (False, True), ("bottom_right", False),
                                                          ("bottom_right", True)],
                                                         [(False, True), ("bottom_right", False)], multi=True))
def test_results_stay_finite_and_right_on_a_nan_pool(dtype, d, lq, lk, causal, deterministic):
    """Forward and backward on a NaN-filled pool (two query heads sharing one K/V head): out, lse and
    every gradient finite (lq <= lk: every row sees a key), and within DESIGN.md's error rule
    (_errors.py) of the exact reference, as the other GPU tests."""
    rng = np.random.default_rng(d + lq)
    dt = DTYPES[dtype]
    host = {name: rng.standard_normal(shape).astype(dt) for name, shape in
            (("q", (1, 2, lq, d)), ("k", (1, 1, lk, d)), ("v", (1, 1, lk, d)), ("do", (1, 2, lq, d)))}
    with nan_filled_pool():
        q, k, v, do = (cp.asarray(host[n]) for n in ("q", "k", "v", "do"))
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)
        dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        cp.cuda.Device().synchronize()
        got = {name: cp.asnumpy(x).astype(np.float64) for name, x in
               (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}
        del q, k, v, do, out, lse, dq, dk, dv   # before the pool that holds them goes
    for name, x in got.items():
        assert np.isfinite(x).all(), f"{name} has non-finite values: a read of unwritten memory"
    rounded = {name: x.astype(np.float64) for name, x in host.items()}
    q, k, v, do = (rounded[n] for n in ("q", "k", "v", "do"))
    opts = dict(causal=causal, scale=1 / np.sqrt(d))
    ref_out, ref = exact(q, k, v, do, dtype=dtype, **opts)
    naive_out, naive = naive_same_dtype(q, k, v, do, dtype=dtype, **opts)
    mag_out, mag = magnitude(q, k, v, do, **opts)
    ok, msg = within_budget(got["out"], ref_out, naive_out, mag_out, dtype)
    assert ok, f"out: {msg}"
    ref_lse = reference.attention_naive(q, k, v, **opts)[1]
    lse_tol = 1e-12 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(got["lse"], ref_lse, rtol=lse_tol, atol=lse_tol)
    lse_max = lse_bound(q, k, 1 / np.sqrt(d))
    for name, r, n, m in zip(("dq", "dk", "dv"), ref, naive, mag):
        assert got[name].shape == r.shape, name
        ok, msg = within_budget(got[name], r, n, m, dtype, lse_max)
        assert ok, f"{name}: {msg}"
