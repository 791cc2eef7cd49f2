"""User score and mask modifications on the GPU (marker `gpu`): the library modifications and their
compositions with every masking option, every dtype, forward and backward, on the Hopper and the portable
kernels, against the float64 reference under the error rule; the trainable table's gradient; the block
states the kernels skip by; no rebuild for a new sequence length."""
import numpy as np
import pytest

import cuflash
from cuflash import mods as M, reference
from cuflash._dispatch import masking
from cuflash._dispatch.model import SCORING_FAMILIES
from cuflash._runtime import build, device

from _gpu_checks import DTYPES, as_token_major, check_masked, device_options, host_options, make_grad_inputs, seed_of
from _tiers import sampled

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

B, HQ, HK, LQ, LK = 2, 4, 2, 113, 150


def _options(kind: str, seed: int) -> dict:
    """Host (NumPy) modifications; check_masked moves their parameter arrays to the device."""
    rng = np.random.default_rng(seed)
    doc = np.sort(rng.integers(0, 4, (B, LK)), axis=1).astype(np.int32)
    table = (rng.standard_normal((32, HQ)) * 0.5).astype(np.float32)
    softcap, alibi = cuflash.softcap(30.0), cuflash.alibi(np.geomspace(0.5, 0.02, HQ).astype(np.float32))
    return {
        "softcap": dict(score_mod=softcap),
        "softcap tight": dict(score_mod=cuflash.softcap(0.5)),
        "alibi": dict(score_mod=alibi),
        "relative position": dict(score_mod=cuflash.relative_position_bias(table, max_distance=64)),
        "document": dict(mask_mod=cuflash.document_mask(doc)),
        "prefix lm": dict(mask_mod=cuflash.prefix_lm_mask(np.array([20, 90], np.int32))),
        "custom": dict(score_mod=cuflash.ScoreMod(
            "score * scale_h[h] + acc_t(0.01) * acc_t(kv_idx % 7)", grad="acc_t(scale_h[h])",
            params={"scale_h": np.linspace(0.5, 1.5, HQ).astype(np.float32)},
            python=lambda s, b, h, q, kv, scale_h: s * scale_h[h] + 0.01 * (kv % 7),
            python_grad=lambda s, b, h, q, kv, scale_h: np.broadcast_to(scale_h[h], s.shape))),
        "positions everywhere": dict(score_mod=cuflash.ScoreMod(
            "score + acc_t(row_bias[q_idx]) - acc_t(key_bias[kv_idx])", grad="acc_t(1)", everywhere=True,
            params={"row_bias": rng.standard_normal(LQ).astype(np.float32),
                    "key_bias": rng.standard_normal(LK).astype(np.float32)},
            python=lambda s, b, h, q, kv, row_bias, key_bias: s + row_bias[q] - key_bias[kv],
            python_grad=lambda s, b, h, q, kv, row_bias, key_bias: np.ones_like(s))),
        # scales: folded around the chain (natural units: with the conversions), kept inside it (the first's c)
        "scaled, composed": dict(score_mod=(cuflash.ScoreMod(
            "score + acc_t(0.05) * acc_t(kv_idx % 5)", grad="acc_t(1)", scales=(0.8, 1.25), everywhere=True,
            python=lambda t, b, h, q, kv: t + 0.05 * (kv % 5), python_grad=lambda t, *r: np.ones_like(t)), softcap)),
        "with every option": dict(score_mod=(alibi, softcap), mask_mod=cuflash.document_mask(doc),
                                  bias=rng.standard_normal((1, HQ, LQ, LK)), window=(70, 10), dropout_p=0.1, seed=3,
                                  block_layout=cuflash.BlockLayout.from_rule(LQ, LK, 32, local=2, global_blocks=1)),
    }[kind]


# "positions everywhere": arrays of exactly LQ / LK elements indexed by the position under everywhere=True
# (evaluated at masked elements and at the tiles' rows and keys past the end, indices clamped): the values
# here, and memcheck on sanitize_workload.py --mods, check that it reads nothing past them.
KINDS = ["softcap", "softcap tight", "alibi", "relative position", "document", "prefix lm", "custom",
         "positions everywhere", "scaled, composed", "with every option"]
CASES = sampled([(dt, c) for dt in DTYPES for c in (False, "bottom_right")],
                [("float16", False), ("bfloat16", "bottom_right"), ("float32", "bottom_right"), ("float64", False)],
                multi=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, causal", CASES)
def test_modifications_against_reference(dtype, kind, causal):
    for d in (64, 128):
        seed = seed_of(dtype, kind, str(causal), d)
        check_masked(dtype, B, HQ, HK, LQ, LK, d, d, causal, seed, _options(kind, seed))


@pytest.mark.parametrize("kind", ["softcap", "relative position", "with every option"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_modifications_on_the_portable_kernels(monkeypatch, dtype, kind):
    monkeypatch.setattr(device, "compute_capability", lambda: 80)
    seed = seed_of(dtype, kind, "portable")
    check_masked(dtype, B, HQ, HK, LQ, LK, 64, 64, True, seed, _options(kind, seed))


def _same_bits_again(dtype, seed, options, grads, lq, lk):
    """The deterministic backward again on check_masked's inputs (``seed``, causal, head dim 64): bitwise the
    gradients ``grads``."""
    rng = np.random.default_rng(seed)
    _, (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, lq, lk, 64, 64)
    dev = device_options(options, dtype)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=True, **dev)
    again = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=True, deterministic=True, **dev)
    for a, b in zip(grads, again):
        assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all())


@pytest.mark.parametrize("kind", ["softcap", "document"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_deterministic_backward_with_modifications(dtype, kind):
    seed = seed_of(dtype, kind, "deterministic")
    _, grads = check_masked(dtype, B, HQ, HK, LQ, LK, 64, 64, True, seed, _options(kind, seed), deterministic=True)
    _same_bits_again(dtype, seed, _options(kind, seed), grads, LQ, LK)


LINEAR_SHAPES = [(113, 113, True, None, None, (40, 64, 96, 128)), (300, 300, "bottom_right", (64, 0), None, (64, 128)),
                 (150, 113, "bottom_right", None, None, (64, 128)), (1030, 1030, True, None, None, (64, 128)),
                 (700, 700, True, (200, None), 0.002, (64, 128))]
"""(Lq, Lk, causal, window, scale, head dims): no query sees a key after it; head dims that fill part of a tile. Short and long rows (the Hopper forward's
two-CTA tile and its walking grids), a window, Lq > Lk aligned at the end (the band's top edge below the
diagonal), and slopes up to 1 (ALiBi's own are below) under a small scale: slope / scale up to 500 raw-score
units a key, whose terms in the far tiles pass float16's range (the step is bfloat16)."""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("lq, lk, causal, window, scale, dims", LINEAR_SHAPES)
def test_alibi_under_a_causal_band_is_added_by_the_tensor_cores(launches, dtype, lq, lk, causal, window, scale, dims):
    """ALiBi where no query sees a key after it: the Hopper forward and dK/dV kernels add it in one more
    tensor-core step a tile (kernels_cu/linear_bias.cuh, no per-element code), against the reference."""
    for d in dims:
        seed = seed_of(dtype, lq, lk, str(causal), window, scale, d, "linear")
        slopes = np.geomspace(1.0, 0.25, HQ) if scale is not None else np.geomspace(0.5, 0.02, HQ)
        options = dict(score_mod=cuflash.alibi(slopes.astype(np.float32)))
        if window is not None:
            options["window"] = window
        launches.clear()
        check_masked(dtype, B, HQ, HK, lq, lk, d, d, causal, seed, options, scale=scale)
        hopper = [v for v in launches if v.family in ("fwd_wgmma", "bwd_dkdv_wgmma")]
        assert {v.family for v in hopper} == {"fwd_wgmma", "bwd_dkdv_wgmma"}, [v.name for v in launches]
        assert all("CUF_LINEAR_BIAS 1" in v.prelude and "CUF_USER_SCORE 1" not in v.prelude for v in hopper)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_alibi_counted_from_the_bottom_right(launches, dtype, causal):
    """alibi(slopes, offset=Lk - Lq) (FlashAttention's alibi_slopes; a nonzero offset takes the per-element
    form, no tensor-core step) forward and backward against the reference, few queries over many keys and a
    square call (offset 0)."""
    for lq, lk in ((40, 150), (LK, LK)):
        seed = seed_of(dtype, str(causal), lq, lk, "alibi offset")
        options = dict(score_mod=cuflash.alibi(np.geomspace(0.5, 0.02, HQ).astype(np.float32), offset=lk - lq))
        launches.clear()
        check_masked(dtype, B, HQ, HK, lq, lk, 64, 64, causal, seed, options)
        if lk != lq:
            assert not any("CUF_LINEAR_BIAS 1" in v.prelude for v in launches)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_alibi_of_the_tensor_cores_with_a_deterministic_backward(launches, dtype):
    """The tensor-core forward's out and lse taken by the portable deterministic backward (the modification's
    own per-element code): the gradients against the reference, bitwise the same twice."""
    seed = seed_of(dtype, "linear deterministic")
    options = dict(score_mod=cuflash.alibi(np.geomspace(0.5, 0.02, HQ).astype(np.float32)))
    _, grads = check_masked(dtype, B, HQ, HK, LK, LK, 64, 64, True, seed, options, deterministic=True)
    assert any(v.family == "fwd_wgmma" and "CUF_LINEAR_BIAS 1" in v.prelude for v in launches)
    assert not any("CUF_LINEAR_BIAS 1" in v.prelude for v in launches if v.family.startswith("bwd"))
    _same_bits_again(dtype, seed, options, grads, LK, LK)


def _packed_documents(rng, b: int, n: int) -> np.ndarray:
    """Ids (b, n) of documents back to back (each a run), one to six a row, the first row's last of length 1."""
    ids = np.zeros((b, n), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n - 1), size=int(rng.integers(0, 6)), replace=False))
        ids[row] = np.searchsorted(cuts, np.arange(n), side="right") + 3 * row
    ids[0, -1] = ids[0, -2] + 1
    return ids


DOCUMENT_CASES = sampled([(dt, c, w, tm) for dt in DTYPES for c, w in ((True, None), (False, None), (False, (40, 7)),
                                                                       ("bottom_right", (60, None)))
                          for tm in (False, True)],
                         [("float16", True, None, True), ("bfloat16", False, (40, 7), False),
                          ("float32", True, None, False), ("float64", "bottom_right", (60, None), True)], multi=True)


@pytest.mark.parametrize("dtype, causal, window, token_major", DOCUMENT_CASES)
def test_a_document_mask_of_runs_on_the_packed_kernels(launches, dtype, causal, window, token_major):
    """Documents back to back (Lq == Lk) with causal or a window: the packed kernels, no per-element test,
    against the reference, grouped-query heads, (B, H, L, D) and (B, L, H, D) memory."""
    for d in (64, 128):
        seed = seed_of(dtype, str(causal), window, token_major, d, "documents")
        options = dict(mask_mod=cuflash.document_mask(_packed_documents(np.random.default_rng(seed), B, LK)))
        if window is not None:
            options["window"] = window
        launches.clear()
        check_masked(dtype, B, HQ, HK, LK, LK, d, d, causal, seed, options, token_major=token_major)
        scoring = [v for v in launches if v.family in SCORING_FAMILIES]
        assert scoring and all(v.packed and not v.extra for v in scoring), [v.name for v in scoring]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_a_document_mask_of_runs_deterministic_backward(launches, dtype):
    seed = seed_of(dtype, "documents deterministic")
    options = dict(mask_mod=cuflash.document_mask(_packed_documents(np.random.default_rng(seed), B, LK)))
    _, grads = check_masked(dtype, B, HQ, HK, LK, LK, 64, 64, True, seed, options, deterministic=True)
    assert all(v.packed for v in launches if v.family in SCORING_FAMILIES)
    _same_bits_again(dtype, seed, options, grads, LK, LK)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_document_mask_of_runs_takes_outputs_and_gradients_of_any_layout(launches, dtype):
    """Token-major q, k, v with dout, out and lse given in other layouts (copied into q's rows): the
    gradients equal those of matching layouts bit for bit (the deterministic backward), and the forward's
    out equals the (B, H, L, D) call's."""
    seed = seed_of(dtype, "documents layouts")
    dev = device_options(dict(mask_mod=cuflash.document_mask(_packed_documents(np.random.default_rng(seed), B, LK))),
                         dtype)
    _, (qd, kd, vd, dod) = make_grad_inputs(np.random.default_rng(seed), dtype, B, HQ, HK, LK, LK, 64, 64)
    tq, tk, tv, tdo = (as_token_major(x) for x in (qd, kd, vd, dod))
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=True, **dev)
    t_out, t_lse = cuflash.attention_forward(tq, tk, tv, causal=True, **dev)
    assert t_out.strides != out.strides and bool((cp.ascontiguousarray(t_out).view(cp.uint8) == out.view(cp.uint8)).all())
    want = cuflash.attention_backward(tdo, tq, tk, tv, t_out, t_lse, causal=True, deterministic=True, **dev)
    launches.clear()
    got = cuflash.attention_backward(dod, tq, tk, tv, out, cp.ascontiguousarray(t_lse), causal=True,
                                     deterministic=True, **dev)
    assert all(v.packed for v in launches if v.family in SCORING_FAMILIES)
    for a, b in zip(want, got):
        assert a.strides == b.strides and bool((a.view(cp.uint8) == b.view(cp.uint8)).all())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_relative_position_table_gradient(dtype):
    """The trainable table's gradient (atomics from every dS) against the float64 blocked reference's."""
    seed = seed_of(dtype, "table")
    rng = np.random.default_rng(seed)
    (q, k, v, do), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, LQ, LK, 64, 64)
    table = (rng.standard_normal((32, HQ)) * 0.5).astype(np.float64 if dtype == "float64" else np.float32)
    host = cuflash.relative_position_bias(table, max_distance=64)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal="bottom_right", score_mod=host.on(cp))
    *_, grads = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal="bottom_right", score_mod=host.on(cp))
    ref_out, ref_lse = reference.attention_blocked(q, k, v, causal="bottom_right", score_mod=host)
    *_, ref = reference.attention_backward_blocked(do, q, k, v, ref_out, ref_lse, causal="bottom_right",
                                                   score_mod=host)
    assert grads["table"].dtype == table.dtype and grads["table"].shape == table.shape
    got = cp.asnumpy(grads["table"]).astype(np.float64)
    tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-4, "float64": 1e-10}[dtype]
    err = np.linalg.norm(got - ref["table"]) / np.linalg.norm(ref["table"])
    assert err < tol, (dtype, err)


@pytest.mark.parametrize("kind", ["document", "prefix lm"])
def test_block_states_of_a_mask_modification_are_those_of_its_boolean_mask(kind):
    """The GPU's block states of a mask modification equal the host's summary of the same mask as a
    boolean array (which the kernels have skipped by since the start)."""
    opts = host_options(_options(kind, 1), "float16")
    q = cp.zeros((B, HQ, LQ, 64), cp.float16)
    k = cp.zeros((B, HK, LK, 64), cp.float16)
    call = cuflash.options.forward_call(q, k, k, **device_options(_options(kind, 1), "float16"))
    states, block = masking.block_states(call.problem, call.options)
    grids = reference._mod_grids((B, HQ, LQ, LK), slice(0, LQ), slice(0, LK), np)
    mods = M.resolve(opts.get("score_mod"), opts.get("mask_mod"))
    boolean = np.broadcast_to(mods.allowed(*grids, np), (B, HQ, LQ, LK))
    call_b = cuflash.options.forward_call(q, k, k, mask=cp.asarray(boolean))
    want, block_b = masking.block_states(call_b.problem, call_b.options)
    assert block == block_b
    got = cp.broadcast_to(states, want.shape)
    assert bool((got == want).all())


def test_a_new_sequence_length_builds_nothing():
    dev = device_options(_options("softcap", 2), "bfloat16")
    rng = np.random.default_rng(2)
    for lq in (300, 301, 1000):
        _, (qd, kd, vd, dod) = make_grad_inputs(rng, "bfloat16", 1, HQ, HK, lq, lq, 64, 64)
        out, lse = cuflash.attention_forward(qd, kd, vd, causal=True, **dev)
        cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=True, **dev)
        if lq == 300:
            builds = build._module.cache_info().misses
    assert build._module.cache_info().misses == builds


def test_a_mask_that_hides_everything_gives_zero_and_minus_inf():
    dev = dict(mask_mod=cuflash.MaskMod("kv_idx < 0", python=lambda b, h, q, kv: kv < 0))
    q = cp.asarray(np.random.default_rng(0).standard_normal((1, 2, 70, 64)).astype(np.float16))
    out, lse = cuflash.attention_forward(q, q, q, **dev)
    assert bool((out == 0).all()) and bool(cp.isneginf(lse).all())
    dq, dk, dv = cuflash.attention_backward(cp.ones_like(q), q, q, q, out, lse, **dev)
    assert all(bool((g == 0).all()) for g in (dq, dk, dv))


@pytest.mark.parametrize("dtype, d", [("float16", 64), ("bfloat16", 128)])   # at 128 part of P is fma_exp2's
def test_nan_scores_propagate_through_a_modification(dtype, d):
    q = np.random.default_rng(0).standard_normal((1, 1, 40, d)).astype(DTYPES[dtype])
    q[0, 0, 5, 3] = np.nan
    out = cuflash.attention(cp.asarray(q), cp.asarray(q), cp.asarray(q), score_mod=cuflash.softcap(30.0).on(cp))
    got = cp.asnumpy(out)
    assert np.isnan(got[0, 0, 5]).all()
    assert np.isnan(got).any(axis=-1).sum() == 40   # key 5 is NaN for every row (NaN score, as SDPA)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_modifications_in_the_split_forward(dtype):
    """Few query rows over many keys: the split-KV forward's partial kernels with the modifications compiled
    in (not the decoding kernel, and no query heads packed into one tile's rows), then the backward."""
    seed = seed_of(dtype, "split")
    table = (np.random.default_rng(seed).standard_normal((32, 8)) * 0.5).astype(np.float32)
    options = dict(score_mod=(cuflash.softcap(5.0), cuflash.relative_position_bias(table, max_distance=500)))
    check_masked(dtype, 2, 8, 2, 3, 4000, 64, 64, "bottom_right", seed, options)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_modifications_at_head_dim_256(dtype):
    """Head dim 256: the Hopper forward with the modification, the portable backward (the Hopper one forms
    dS from a 16-bit P in another warpgroup)."""
    seed = seed_of(dtype, "256")
    check_masked(dtype, B, HQ, HK, LQ, LK, 256, 256, True, seed, _options("softcap", seed))


def _fd_check_gpu(f, x, grad, points=6, eps=1e-6, seed=0):
    """Central differences of the scalar f at a few entries of the CuPy float64 array x, against grad."""
    rng = np.random.default_rng(seed)
    grad = cp.asnumpy(grad)
    for idx in zip(*(rng.integers(0, n, points) for n in x.shape)):
        e = cp.zeros_like(x)
        e[idx] = eps
        fd = (float(f(x + e)) - float(f(x - e))) / (2 * eps)
        assert abs(fd - grad[idx]) <= 1e-6 * (1 + abs(fd)), (idx, fd, grad[idx])


@pytest.mark.parametrize("kind", ["softcap", "alibi", "relative position"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_float64_gradients_on_the_gpu_match_finite_differences(kind, causal):
    """float64 on the GPU (the fp64 tensor-core kernels with the modification compiled in): dq, dk, dv and
    the T5 table's gradient against central differences of the GPU forward."""
    rng = np.random.default_rng(seed_of("fd", kind, str(causal)))
    q, k, v, do = (cp.asarray(rng.standard_normal(s)) for s in ((B, HQ, 37, 32), (B, HK, 45, 32), (B, HK, 45, 32),
                                                               (B, HQ, 37, 32)))
    table = cp.asarray(rng.standard_normal((32, HQ)) * 0.5)

    def mod(t=table):
        return {"softcap": cuflash.softcap(2.0), "relative position": cuflash.relative_position_bias(t, max_distance=20),
                "alibi": cuflash.alibi(cp.asarray(np.geomspace(0.5, 0.05, HQ).astype(np.float32)))}[kind]

    out, vjp_fn = cuflash.vjp(q, k, v, causal=causal, score_mod=mod())
    dq, dk, dv, *rest = vjp_fn(do)
    loss = lambda **x: (cuflash.attention(x.get("q", q), x.get("k", k), x.get("v", v), causal=causal,  # noqa: E731
                                          score_mod=mod(x.get("t", table))) * do).sum()
    _fd_check_gpu(lambda x: loss(q=x), q, dq)
    _fd_check_gpu(lambda x: loss(k=x), k, dk)
    _fd_check_gpu(lambda x: loss(v=x), v, dv)
    if kind == "relative position":
        _fd_check_gpu(lambda t: loss(t=t), table, rest[0]["table"], points=10)
