"""Every shipped kernel variant, run once on the GPU against the float64 reference (marker `gpu_sweep`:
run it in parts, ``python -m pytest -m gpu_sweep -n auto --sweep-part 1/4`` and so on; tests/conftest.py).

For each variant of the table, problem_for() gives a small call (odd lengths at
every tile edge, grouped-query heads, head dims inside the variant's bucket) that
the launcher answers with that variant; the launches are recorded to prove it ran.
Also (marker `gpu`): batch x heads beyond the old 65535 grid limit, forward and backward.
"""
import functools

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash._dispatch import plan as plan_
from cuflash._dispatch.select import all_variants
from cuflash._runtime import device

from _errors import rel_error
from _gpu_checks import (DTYPES, check_backward, check_backward_tf32, check_forward, check_forward_tf32,
                         check_masked, check_packed, seed_of)
from _variant_problems import BATCH, FULL_SMS, HEADS_K, HEADS_Q, problem_for, variant_options

cp = pytest.importorskip("cupy")


@pytest.mark.gpu_sweep
@pytest.mark.parametrize("variant", all_variants(), ids=lambda v: v.name + (" packed" if v.packed else "") + (" f32-out" if v.acc_out else ""))
def test_every_variant_against_reference(variant, launches, monkeypatch):
    p = problem_for(variant)
    if p.cc == 90 and device.compute_capability() != 90:
        pytest.skip("a Hopper (sm_90a) variant: this GPU is not compute capability 9.0")
    # Select as a GPU with p.smem_limit bytes of shared memory per block would (this one has at least as much),
    # and of compute capability p.cc (the portable variants run on a Hopper GPU too).
    assert device.smem_limit() >= p.smem_limit
    monkeypatch.setattr(device, "smem_limit", lambda: p.smem_limit)
    monkeypatch.setattr(device, "compute_capability", lambda: p.cc)
    if p.full:   # the split blocks fill a GPU of FULL_SMS SMs: the decoding kernel's tile for a full GPU
        monkeypatch.setattr(device, "sm_count", lambda: FULL_SMS)
    if p.precision == "fma":   # the float32 FMA kernels, which no public option selects (FLOAT32_PRECISIONS)
        choose, plan = plan_.forward_choice, plan_.backward_variants
        monkeypatch.setattr(plan_, "forward_choice", lambda *args: choose(*args[:-1], "fma"))
        monkeypatch.setattr(plan_, "backward_variants", lambda *args, **kw: plan(*args, **{**kw, "precision": "fma"}))
    # The split-KV forward forced where the variant is a split one, kept out otherwise (a few query rows over
    # many keys would take it by itself, and the variant under test would not run)
    monkeypatch.setattr(cuflash, "attention_forward",
                        functools.partial(cuflash.attention_forward, num_splits=p.num_splits))
    if p.accumulator:   # the forward in float32 (the ring's partials), rounded to be checked as any forward's
        def in_accumulator(q, k, v, causal=False, num_splits=None):
            out, lse = cuflash.api.forward_in_accumulator(q, k, v, causal=causal)
            assert out.dtype == np.float32
            return out.astype(q.dtype), lse

        monkeypatch.setattr(cuflash, "attention_forward", in_accumulator)
    seed = seed_of(variant.name)
    if p.packed:
        check_packed(p.dtype, HEADS_Q, HEADS_K, p.packed_lengths, p.d, p.causal, seed, backward=p.backward,
                     deterministic=p.deterministic)
    elif p.precision == "tf32" and p.backward:   # the plain TF32 kernels: their own error bound (TF32_BWD_TOL)
        check_backward_tf32(BATCH, HEADS_Q, HEADS_K, p.lq, p.lk, p.d, p.dv, p.causal, seed,
                            variant_options(seed, p.lk, p.bias) if p.extra else None, deterministic=p.deterministic)
    elif p.precision == "tf32":   # the plain TF32 forward: its own error bound (_gpu_checks.TF32_TOL)
        check_forward_tf32(BATCH, HEADS_Q, HEADS_K, p.lq, p.lk, p.d, p.dv, p.causal, seed,
                           variant_options(seed, p.lk) if p.extra else None)
    elif p.extra:   # with bias, key padding and dropout; a forward variant's problem runs the forward only
        # (a small-shared-memory forward may have no backward at that limit: float64 at head dim 256)
        check_masked(p.dtype, BATCH, HEADS_Q, HEADS_K, p.lq, p.lk, p.d, p.dv, p.causal, seed, variant_options(seed, p.lk, p.bias),
                     deterministic=p.deterministic, backward=p.backward)
    elif p.backward:
        check_backward(p.dtype, BATCH, HEADS_Q, HEADS_K, p.lq, p.lk, p.d, p.dv, p.causal, seed,
                       deterministic=p.deterministic)
    else:
        check_forward(p.dtype, BATCH, HEADS_Q, HEADS_K, p.lq, p.lk, p.d, p.dv, p.causal, seed)
    assert variant in launches, f"{variant.name} was not launched; got {[v.name for v in launches]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_times_heads_over_65535(dtype, deterministic):
    """B * H = 70000 query heads (the old grid's y/z limit was 65535), L = 16, D = 32."""
    b, h, n, d = 35000, 2, 16, 32
    rng = cp.random.default_rng(15)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(DTYPES[dtype]) for _ in range(4))
    out, lse = cuflash.attention_forward(q, k, v, causal=True)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=deterministic)
    tol = 2e-3 if dtype == "float16" else 1e-5
    for i in (0, b // 2, b - 1):   # first, middle and last batch entries, both heads
        host = [cp.asnumpy(x[i]).astype(np.float64) for x in (q, k, v, do)]
        ref_out, _ = reference.attention_naive(*host[:3], causal=True)
        ref_grads = reference.attention_backward_naive(host[3], *host[:3], causal=True)
        for got, ref in zip((out, dq, dk, dv), (ref_out,) + tuple(ref_grads)):
            assert rel_error(cp.asnumpy(got[i]).astype(np.float64), ref) < tol
    for g in (out, dq, dk, dv):
        assert bool(cp.isfinite(g.astype(cp.float32)).all())
