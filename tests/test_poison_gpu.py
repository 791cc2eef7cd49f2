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

from _errors import within_budget

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


DTYPES = {"float16": np.float16, "bfloat16": None, "float32": np.float32, "float64": np.float64}


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return DTYPES[name]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d, lq, lk", [(40, 77, 133), (64, 97, 130), (128, 33, 65)])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_results_stay_finite_and_right_on_a_nan_pool(dtype, d, lq, lk, causal, deterministic):
    rng = np.random.default_rng(d + lq)
    host = {name: rng.standard_normal(shape) for name, shape in
            (("q", (1, 2, lq, d)), ("k", (1, 1, lk, d)), ("v", (1, 1, lk, d)), ("do", (1, 2, lq, d)))}
    dt = _dtype(dtype)
    rounded = {name: x.astype(dt).astype(np.float64) for name, x in host.items()}
    with nan_filled_pool():
        q, k, v, do = (cp.asarray(host[n].astype(dt)) for n in ("q", "k", "v", "do"))
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)
        dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        cp.cuda.Device().synchronize()
        got = {name: cp.asnumpy(x).astype(np.float64) for name, x in
               (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
    for name, x in got.items():
        assert np.isfinite(x).all(), f"{name} has non-finite values: a read of unwritten memory"
    want_out, _ = reference.attention_naive(rounded["q"], rounded["k"], rounded["v"], causal=causal)
    want = dict(zip(("dq", "dk", "dv"), reference.attention_backward_naive(
        rounded["do"], rounded["q"], rounded["k"], rounded["v"], causal=causal)[:3]))
    want["out"] = want_out
    for name in got:
        err = np.abs(got[name] - want[name]).max() / max(np.abs(want[name]).max(), 1e-30)
        assert err < {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-3, "float64": 1e-10}[dtype], (name, err)
