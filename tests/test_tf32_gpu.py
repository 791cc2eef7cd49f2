"""float32 on the TF32 tensor cores (flash_fwd_tf32.cu, flash_bwd_tf32.cu) against the float64 reference
(marker `gpu`).

precision="highest" (3xTF32) must be as accurate as the float32 FMA kernel it replaces, huge logits
included (DESIGN.md's error rule, and no more than twice the FMA kernel's own error on the same
inputs); precision="tf32" within _gpu_checks.TF32_TOL. Every head-dim bucket, both causal
alignments, odd lengths, masking options; the launches are recorded to prove which kernel ran.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash._dispatch import plan as plan_
from cuflash._dispatch.model import head_bucket
from cuflash._dispatch.select import HOPPER_CC
from cuflash._runtime import device

from _errors import FLOOR, magnitude, norm, rel_error
from _gpu_checks import (check_backward, check_backward_tf32, check_forward, check_forward_tf32, check_masked,
                         make_inputs)
from _tiers import sampled

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CAUSAL = [False, True, "bottom_right"]
SHAPES = [(97, 130, 32), (97, 1025, 59), (1025, 97, 64), (256, 256, 111), (128, 512, 128)]
SHAPES_KEPT = [(97, 1025, 59), (128, 512, 128)]   # the gpu tier's; the rest under gpu_sweep (tests/_tiers.py)
SHAPES_SAMPLED = sampled(SHAPES, SHAPES_KEPT, multi=True)


WGMMA_TF32_HEADS = (64, 128)
"""Head-dim buckets of the Hopper float32 forward (fwd_wgmma_tf32x3 / fwd_wgmma_tf32 rows)."""


@pytest.fixture(params=["default", "portable"])
def path(request, monkeypatch):
    """"default": the kernels this GPU takes; "portable": the call as on a GPU without sm_90a
    (compute capability patched to 8.0, as bench.py's "cuflash sm80" contender)."""
    if request.param == "portable":
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    return request.param


def _forward_family(base: str, d: int, bias_lk: int = 0) -> str:
    """The float32 forward family a call of head dim d takes on this GPU (base: "fwd_tf32x3" or
    "fwd_tf32"; "tf32" keeps the portable kernel on Hopper too, select.TF32_WGMMA_FAMILY): for
    "highest" the wgmma one on compute capability 9.0 for head buckets 64 and 128 with 16-byte
    rows (d a multiple of 4), masking options included, unless the call has a (contiguous) bias of
    ``bias_lk`` keys whose rows are not 16-byte chunks (bias_lk not a multiple of 4: the launcher's
    fallback, masking.rows_in_chunks), else base."""
    hopper = (base == "fwd_tf32x3" and device.compute_capability() == HOPPER_CC and d % 4 == 0 and bias_lk % 4 == 0
              and head_bucket(d) in WGMMA_TF32_HEADS)
    return base.replace("fwd_", "fwd_wgmma_") if hopper else base


def _fma_only(monkeypatch):
    """Make the launcher take the float32 FMA forward (the accuracy baseline: FLOAT32_PRECISIONS)."""
    choose = plan_.forward_choice
    monkeypatch.setattr(plan_, "forward_choice", lambda *args: choose(*args[:-1], "fma"))


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("lq,lk,d", SHAPES_SAMPLED)
def test_highest_matches_reference(causal, lq, lk, d, path, launches):
    check_forward("float32", 1, 2, 1, lq, lk, d, d, causal, seed=lq * lk + d)
    assert launches[-1].family == _forward_family("fwd_tf32x3", d), launches[-1].name


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("lq,lk,d", sampled(SHAPES + [(200, 130, 256)], SHAPES_KEPT + [(200, 130, 256)], multi=True))
def test_tf32_matches_reference(causal, lq, lk, d, path, launches):
    check_forward_tf32(1, 2, 1, lq, lk, d, d, causal, seed=lq * lk + d + 1)
    assert launches[-1].family == _forward_family("fwd_tf32", d), launches[-1].name


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [1.0, 30.0])
def test_highest_is_as_accurate_as_fma(d, causal, size, monkeypatch):
    """q and k elements ~ size * N(0, 1) (size 30: logits in the hundreds, where every absolute
    error of a score becomes a relative error of its probability): 3xTF32's error at most twice
    the FMA kernel's on the same inputs, plus float32's floor."""
    rng = np.random.default_rng(int(size) * 1000 + d)
    b, h, lq, lk = 2, 2, 256, 384
    q, k, v = (rng.standard_normal((b, h, n, d)) for n in (lq, lk, lk))
    q, k = q * size, k * size
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    exact64 = [x.astype(np.float64) for x in (q, k, v)]
    ref, _ = reference.attention_naive(*exact64, causal=causal)
    mag = magnitude(*exact64, causal=causal, scale=1 / np.sqrt(d))
    dev = [cp.asarray(x) for x in (q, k, v)]
    got = cp.asnumpy(cuflash.attention(*dev, causal=causal)).astype(np.float64)
    with monkeypatch.context() as m:
        _fma_only(m)
        fma = cp.asnumpy(cuflash.attention(*dev, causal=causal)).astype(np.float64)
    err, fma_err = norm(got - ref), norm(fma - ref)
    assert err <= 2 * fma_err + FLOOR["float32"] * norm(mag), (
        f"3xTF32 rel. error {err / norm(ref):.3e}, FMA {fma_err / norm(ref):.3e}")


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_highest_huge_logits_stay_finite(causal, path, launches):
    out = check_forward("float32", 1, 2, 2, 64, 80, 64, 64, causal, seed=5, logit_scale=1e4)
    assert np.isfinite(cp.asnumpy(out)).all()
    assert launches[-1].family == _forward_family("fwd_tf32x3", 64)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lk", [130, 132])
def test_masking_options_both_precisions(causal, d, lk, launches):
    """Bias (shared by the batch), key padding and dropout, with a window on top when causal. On compute
    capability 9.0 132 keys (528-byte bias rows) run the wgmma forward, 130 (520 bytes: not 16-byte
    chunks) the portable one."""
    seed = d + len(str(causal)) + lk
    rng = np.random.default_rng(seed)
    lq = 97
    mask = np.ones((2, 1, 1, lk), dtype=bool)
    mask[0, :, :, lk - 40:] = False
    options = dict(bias=rng.standard_normal((1, 2, lq, lk)), mask=mask, dropout_p=0.125, seed=seed)
    if causal:
        options["window"] = (48, 0)
    check_masked("float32", 2, 2, 1, lq, lk, d, d, causal, seed, options, backward=False)
    assert launches[-1].family == _forward_family("fwd_tf32x3", d, bias_lk=lk) and launches[-1].extra
    check_forward_tf32(2, 2, 1, lq, lk, d, d, causal, seed, options)
    assert launches[-1].family == _forward_family("fwd_tf32", d, bias_lk=lk) and launches[-1].extra


def _fma_backward_only(monkeypatch):
    """Make the launcher take the float32 FMA backward (the backward's accuracy baseline)."""
    plan = plan_.backward_variants
    monkeypatch.setattr(plan_, "backward_variants", lambda *args, **kw: plan(*args, **{**kw, "precision": "fma"}))


def _families(launches):
    return [v.family for v in launches]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("lq,lk,d", SHAPES_SAMPLED)
def test_backward_highest_matches_reference(causal, lq, lk, d, deterministic, launches):
    """3xTF32 backward (flash_bwd_tf32.cu) under DESIGN.md's error rule, every head bucket."""
    check_backward("float32", 1, 2, 1, lq, lk, d, d, causal, seed=lq * lk + d + 2, deterministic=deterministic)
    fams = _families(launches)
    assert "bwd_dkdv_tf32x3" in fams, fams
    assert ("bwd_dq_tf32x3" in fams) == deterministic, fams


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("lq,lk,d", SHAPES_SAMPLED)
def test_backward_tf32_matches_reference(causal, lq, lk, d, deterministic, launches):
    check_backward_tf32(1, 2, 1, lq, lk, d, d, causal, seed=lq * lk + d + 3, deterministic=deterministic)
    fams = _families(launches)
    assert _forward_family("fwd_tf32", d) in fams and "bwd_dkdv_tf32" in fams, fams
    assert ("bwd_dq_tf32" in fams) == deterministic, fams


def test_backward_head_256_stays_fma(launches):
    check_backward("float32", 1, 2, 1, 97, 130, 200, 200, True, seed=4)
    assert "bwd_dkdv_fma" in _families(launches)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [1.0, 30.0])
def test_backward_highest_is_as_accurate_as_fma(d, causal, size, deterministic, monkeypatch):
    """Every gradient of the 3xTF32 backward within twice the FMA backward's error on the same inputs
    (the same forward's out and lse), plus float32's floor; q, k ~ size * N(0, 1)."""
    rng = np.random.default_rng(int(size) * 100 + d + causal)
    b, h, lq, lk = 2, 2, 256, 384
    q, k, v = (rng.standard_normal((b, h, n, d)) for n in (lq, lk, lk))
    do = rng.standard_normal((b, h, lq, d))
    q, k, v, do = (x.astype(np.float32) for x in (q * size, k * size, v, do))
    host = [x.astype(np.float64) for x in (q, k, v, do)]
    opts = dict(causal=causal, scale=1 / np.sqrt(d))
    ref = reference.attention_backward_naive(host[3], *host[:3], **opts)
    mag = magnitude(*host[:3], host[3], **opts)[1]
    dev = [cp.asarray(x) for x in (q, k, v, do)]
    out, lse = cuflash.attention_forward(*dev[:3], causal=causal)
    got = cuflash.attention_backward(dev[3], *dev[:3], out, lse, causal=causal, deterministic=deterministic)
    with monkeypatch.context() as m:
        _fma_backward_only(m)
        fma = cuflash.attention_backward(dev[3], *dev[:3], out, lse, causal=causal, deterministic=deterministic)
    for name, g, f, r, mg in zip(("dq", "dk", "dv"), got, fma, ref, mag):
        err, fma_err = (norm(cp.asnumpy(x).astype(np.float64) - r) for x in (g, f))
        assert err <= 2 * fma_err + FLOOR["float32"] * norm(mg), (
            f"{name}: 3xTF32 rel. error {err / norm(r):.3e}, FMA {fma_err / norm(r):.3e}")


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_masking_options_both_precisions(causal, d, deterministic, launches):
    """Bias shared by the batch (dbias crosses CTAs: atomics, or turns when deterministic), key
    padding and dropout, with a window on top when causal; GQA (two query heads a K/V head)."""
    seed = d + len(str(causal)) + 7 * deterministic
    rng = np.random.default_rng(seed)
    lq, lk = 97, 130
    mask = np.ones((2, 1, 1, lk), dtype=bool)
    mask[0, :, :, lk - 40:] = False
    options = dict(bias=rng.standard_normal((1, 2, lq, lk)), mask=mask, dropout_p=0.125, seed=seed)
    if causal:
        options["window"] = (48, 0)
    check_masked("float32", 2, 2, 1, lq, lk, d, d, causal, seed, options, deterministic=deterministic)
    assert "bwd_dkdv_tf32x3" in _families(launches)
    launches.clear()
    check_backward_tf32(2, 2, 1, lq, lk, d, d, causal, seed, options, deterministic=deterministic)
    assert "bwd_dkdv_tf32" in _families(launches)


@pytest.mark.parametrize("precision", ["highest", "tf32"])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_backward_is_bitwise_stable(precision, d, launches):
    """deterministic=True: dQ by flash_bwd_dq_tf32 (no atomics) and dbias in turns: bitwise equal run to run."""
    rng = np.random.default_rng(d)
    b, h, lq, lk = 2, 4, 300, 257
    q, k, v, do = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(np.float32)) for n in (lq, lk, lk, lq))
    bias = cp.asarray(rng.standard_normal((1, 1, lq, lk)).astype(np.float32))
    kw = dict(causal=True, bias=bias, precision=precision)
    out, lse = cuflash.attention_forward(q, k, v, **kw)
    first = [cp.asnumpy(g) for g in cuflash.attention_backward(do, q, k, v, out, lse, deterministic=True, **kw)]
    for _ in range(3):
        again = [cp.asnumpy(g) for g in cuflash.attention_backward(do, q, k, v, out, lse, deterministic=True, **kw)]
        for a, g in zip(first, again):
            np.testing.assert_array_equal(a, g)
    fams = _families(launches)
    suffix = "tf32x3" if precision == "highest" else "tf32"
    assert f"bwd_dq_{suffix}" in fams and f"bwd_dkdv_{suffix}" in fams, fams


def test_vjp_passes_the_precision(launches):
    """vjp's backward takes the forward's precision: "tf32" runs the TF32 backward."""
    rng = np.random.default_rng(7)
    ref_in, dev, _ = make_inputs(rng, "float32", 1, 2, 1, 97, 130, 64, 64)
    do = rng.standard_normal((1, 2, 97, 64)).astype(np.float32)
    out, vjp_fn = cuflash.vjp(*dev, causal=True, precision="tf32")
    grads = vjp_fn(cp.asarray(do))
    assert {_forward_family("fwd_tf32", 64), "bwd_dkdv_tf32"} <= set(_families(launches))
    ref = reference.attention_backward_naive(do.astype(np.float64), *ref_in, causal=True)
    for g, r in zip(grads, ref):
        assert rel_error(cp.asnumpy(g).astype(np.float64), r) < 1e-2


def test_highest_propagates_nan(path, launches):
    """A NaN in q poisons its row only (round_tf32 keeps NaN a NaN)."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 1, 64, 64)).astype(np.float32) for _ in range(3))
    q[0, 0, 3, 5] = np.nan
    out = cp.asnumpy(cuflash.attention(*(cp.asarray(x) for x in (q, k, v))))
    assert np.isnan(out[0, 0, 3]).all()
    assert np.isfinite(np.delete(out[0, 0], 3, axis=0)).all()
    assert launches[-1].family == _forward_family("fwd_tf32x3", 64)


@pytest.mark.parametrize("precision", ["highest", "tf32"])
def test_unaligned_rows_take_the_element_loads(precision, launches):
    """Head dim 61 (rows not 16-byte chunks): the vec=False variant."""
    if precision == "tf32":
        check_forward_tf32(1, 2, 1, 97, 130, 61, 61, True, seed=9)
    else:
        check_forward("float32", 1, 2, 1, 97, 130, 61, 61, True, seed=9)
    assert not launches[-1].vec and launches[-1].family in ("fwd_tf32", "fwd_tf32x3")
