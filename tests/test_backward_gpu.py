"""Backward kernels on the GPU (marker `gpu`): reference, finite differences,
determinism, empty rows, huge logits, memory, float64 at L = 65536."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference

from _errors import FLOOR, rel_error
from _gpu_checks import DTYPES, check_backward, check_masked, make_grad_inputs
from _tiers import sampled

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

HEAD_DIMS = [1, 8, 31, 32, 59, 64, 111, 128, 200, 256]
CAUSAL = [False, True, "bottom_right"]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from(list(DTYPES)), b=st.integers(1, 2), hk=st.integers(1, 2),
       group=st.sampled_from([1, 1, 2, 3]), lq=st.integers(1, 200), lk=st.integers(1, 200),
       d=st.sampled_from(HEAD_DIMS), dv_same=st.booleans(), dv=st.sampled_from(HEAD_DIMS),
       causal=st.sampled_from(CAUSAL), deterministic=st.booleans(), seed=st.integers(0, 2**31))
def test_backward_matches_reference(dtype, b, hk, group, lq, lk, d, dv_same, dv, causal, deterministic, seed):
    check_backward(dtype, b, hk * group, hk, lq, lk, d, d if dv_same else dv, causal, seed, deterministic)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("lq,lk,d", sampled([(97, 1025, 59), (1025, 97, 111), (130, 70, 256), (64, 64, 32)],
                                             [(97, 1025, 59), (130, 70, 256)], multi=True))
def test_backward_grid(dtype, causal, deterministic, lq, lk, d):
    """Every dtype x head bucket x causal mode x dQ strategy at odd sizes."""
    check_backward(dtype, 1, 2, 1, lq, lk, d, d, causal, seed=lq + lk * d, deterministic=deterministic)


@pytest.mark.parametrize("causal", CAUSAL)
def test_float64_kernel_matches_finite_differences(causal):
    rng = np.random.default_rng(7)
    b, hq, hk, lq, lk, d, dv = 1, 2, 1, 23, 31, 13, 9
    q, k, v = (cp.asarray(rng.standard_normal(s)) for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv)))
    w = cp.asarray(rng.standard_normal((b, hq, lq, dv)))

    def f(q_, k_, v_):
        return float((cuflash.attention(q_, k_, v_, causal=causal) * w).sum())

    out, lse = cuflash.attention_forward(q, k, v, causal=causal)
    grads = cuflash.attention_backward(w, q, k, v, out, lse, causal=causal)
    eps = 1e-6
    for i, g in enumerate(grads):
        u = cp.asarray(rng.standard_normal(g.shape))
        plus = [q, k, v]
        minus = [q, k, v]
        plus[i] = plus[i] + eps * u
        minus[i] = minus[i] - eps * u
        fd = (f(*plus) - f(*minus)) / (2 * eps)
        an = float((g * u).sum())
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), (i, fd, an)


@pytest.fixture
def launched(launches):
    """The variants launched during the test, in order (conftest's recorder)."""
    return launches


@pytest.mark.parametrize("d", sampled([32, 59, 64, 111, 128], [59, 128]))
@pytest.mark.parametrize("causal", [True, "bottom_right"])
@pytest.mark.parametrize("bias_kind", ["pair", "key"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_float64_tensor_core_backward_masked(d, causal, bias_kind, deterministic, launched):
    """The fp64 tensor-core backward (bwd_dkdv_dmma, and bwd_dq_dmma when deterministic) at head
    buckets 32-128, 16-byte loads (even d) and element loads (odd d), with a causal mask, a bias
    and its gradient (a pair bias shared by the batch: dbias by atomics, or in turns when
    deterministic; a key-padding bias: one row, summed per key), a boolean mask, dropout, and rows
    that see no key: every gradient against the float64 reference under the error rule, and
    exactly 0 on the empty rows."""
    b, hq, hk, lq, lk = 2, 2, 1, 97, 130
    rng = np.random.default_rng(d)
    bias = rng.standard_normal((1, hq, lq, lk) if bias_kind == "pair" else (b, 1, 1, lk))
    mask = rng.random((b, 1, lq, lk)) < 0.7
    mask[:, :, ::11] = False                                       # rows 0, 11, 22, ... see nothing
    options = dict(bias=bias, mask=mask, dropout_p=0.125, seed=d + 1)
    _, grads = check_masked("float64", b, hq, hk, lq, lk, d, d, causal, d, options, deterministic=deterministic)
    families = [v.family for v in launched]
    assert "bwd_dkdv_dmma" in families and "bwd_dkdv_fma" not in families, families
    assert ("bwd_dq_dmma" in families) == deterministic and "bwd_dq_fma" not in families, families
    dq = cp.asnumpy(grads[0])
    assert (dq[:, :, ::11] == 0).all()


@pytest.mark.parametrize("d,family", [(32, "bwd_dkdv_dmma"), (64, "bwd_dkdv_dmma"), (128, "bwd_dkdv_dmma"),
                                      (200, "bwd_dkdv_fma")])
@pytest.mark.parametrize("deterministic", [False, True])
def test_float64_backward_kernel_choice(d, family, deterministic, launched):
    """float64 gradients on the fp64 tensor cores up to head dim 128 (the FMA kernels above), plain
    (no masking options) and causal, against the reference."""
    check_backward("float64", 2, 4, 2, 150, 170, d, d, True, seed=d, deterministic=deterministic)
    families = [v.family for v in launched]
    assert family in families, families
    if deterministic:
        assert family.replace("dkdv", "dq") in families, families


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", sampled([64, 72, 128, 200, 256], [64, 128, 256]))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("b,hq,hk,lq,lk", sampled([(1, 2, 2, 1, 1), (2, 4, 2, 300, 77), (1, 3, 1, 129, 520),
                                                  (1, 2, 1, 640, 640)], [(2, 4, 2, 300, 77), (1, 2, 1, 640, 640)],
                                                 multi=True))
def test_hopper_backward(dtype, d, causal, b, hq, hk, lq, lk, launched):
    """On compute capability 9.0 the default 16-bit backward at head dims 64, 128 and 256 (72, 200:
    the 128 / 256 kernel with zero-filled columns) runs the wgmma dK/dV kernel: lengths of one row,
    across tile edges (77, 129, 300 against 64- and 128-row steps and 64- and 128-key blocks) and
    several blocks, key blocks that see no query (causal, lq < lk), grouped-query heads; every
    gradient against the float64 reference under the error rule."""
    from cuflash._runtime import device

    if device.compute_capability() != 90:
        pytest.skip("needs a GPU of compute capability 9.0 (the Hopper path)")
    check_backward(dtype, b, hq, hk, lq, lk, d, d, causal, seed=lq * d + lk)
    assert "bwd_dkdv_wgmma" in [v.family for v in launched]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d,lq,lk", sampled([(128, 777, 1111), (128, 1111, 777), (64, 1030, 1030), (111, 200, 390)],
                                             [(128, 777, 1111), (111, 200, 390)], multi=True))
def test_portable_backward_several_blocks(dtype, causal, deterministic, d, lq, lk, launched, monkeypatch):
    """The portable 16-bit dK/dV kernel (as any GPU without the Hopper path runs it) over several key
    blocks and query steps, grouped-query heads, ragged last blocks and causal blocks that see part of
    a step or none of it: at head dim 128 the table's layout where two warps share each key strip and
    exchange P^T and dS^T through shared memory; every gradient against the float64 reference."""
    from cuflash._runtime import device

    monkeypatch.setattr(device, "compute_capability", lambda: 80)
    check_backward(dtype, 1, 4, 2, lq, lk, d, d, causal, seed=lq + 7 * lk + d, deterministic=deterministic)
    assert "bwd_dkdv_mma" in [v.family for v in launched]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_falls_back_where_tensor_maps_cannot_go(dtype, launched):
    """K and V broadcast over the batch (stride 0, which a tensor map cannot describe) take the portable
    dK/dV kernel; the contiguous copies take the wgmma one; both gradients agree within the fp32
    accumulators' rounding (the atomic dQ sums in another order)."""
    from cuflash._runtime import device

    if device.compute_capability() != 90:
        pytest.skip("needs a GPU of compute capability 9.0 (the Hopper path)")
    rng = np.random.default_rng(11)
    b, h, lq, lk, d = 2, 2, 200, 333, 128
    q, do = (cp.asarray(rng.standard_normal((b, h, lq, d)).astype(DTYPES[dtype])) for _ in range(2))
    k1, v1 = (cp.asarray(rng.standard_normal((1, h, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
    k_bc, v_bc = (cp.broadcast_to(x, (b, h, lk, d)) for x in (k1, v1))
    k_full, v_full = (cp.ascontiguousarray(x) for x in (k_bc, v_bc))
    out, lse = cuflash.attention_forward(q, k_full, v_full, causal=True)
    grads = {}
    for k, v, family in ((k_full, v_full, "bwd_dkdv_wgmma"), (k_bc, v_bc, "bwd_dkdv_mma")):
        launched.clear()
        grads[family] = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
        assert family in [x.family for x in launched]
    for name, a, c in zip("qkv", grads["bwd_dkdv_wgmma"], grads["bwd_dkdv_mma"]):
        a, c = (cp.asnumpy(x).astype(np.float64) for x in (a, c))
        assert rel_error(a, c) < (2e-3 if dtype == "float16" else 1.6e-2), name


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_deterministic_is_bitwise_reproducible(dtype):
    rng = np.random.default_rng(8)
    _, (q, k, v, do) = make_grad_inputs(rng, dtype, 2, 4, 2, 700, 900, 64, 64)
    out, lse = cuflash.attention_forward(q, k, v, causal=True)
    first = cuflash.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = cuflash.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True)
        for a, b_ in zip(first, again):
            assert cp.asnumpy(a).tobytes() == cp.asnumpy(b_).tobytes()
    fast = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    for a, b_ in zip(first, fast):
        assert rel_error(cp.asnumpy(b_).astype(np.float64), cp.asnumpy(a).astype(np.float64)) <= 4 * FLOOR[dtype] + 1e-12


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("deterministic", [False, True])
def test_rows_with_nothing_to_attend_have_zero_gradients(dtype, deterministic):
    rng = np.random.default_rng(9)
    lq, lk = 150, 40
    (q, k, v, do), dev = make_grad_inputs(rng, dtype, 1, 2, 2, lq, lk, 64, 64)
    out, lse = cuflash.attention_forward(*dev[:3], causal="bottom_right")
    dq, dk, dv = cuflash.attention_backward(dev[3], *dev[:3], out, lse, causal="bottom_right",
                                            deterministic=deterministic)
    dq = cp.asnumpy(dq).astype(np.float64)
    assert (dq[:, :, : lq - lk] == 0).all()
    for g in (dq, cp.asnumpy(dk).astype(np.float64), cp.asnumpy(dv).astype(np.float64)):
        assert np.isfinite(g).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_huge_logits_gradients_finite(dtype):
    check_backward(dtype, 1, 2, 2, 64, 80, 64, 64, True, seed=10, logit_scale=1e4)   # |s| ~ 1e4


def test_vjp_can_be_called_twice_and_matches():
    rng = np.random.default_rng(11)
    _, (q, k, v, do) = make_grad_inputs(rng, "float32", 2, 4, 1, 70, 90, 48, 40)
    out, vjp_fn = cuflash.vjp(q, k, v, causal="bottom_right", deterministic=True)
    g1 = vjp_fn(do)
    g2 = vjp_fn(do)
    g3 = vjp_fn(2 * do)
    for a, b_, c in zip(g1, g2, g3):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b_))
        np.testing.assert_allclose(cp.asnumpy(c), 2 * cp.asnumpy(a), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(cuflash.attention(q, k, v, causal="bottom_right")))


def test_strided_backward_matches_contiguous():
    rng = np.random.default_rng(12)
    b, lq, lk, h, d = 2, 77, 91, 3, 64
    q, k, v, do = (cp.asarray(rng.standard_normal((b, n, h, d)).astype(np.float16)) for n in (lq, lk, lk, lq))
    views = [x.swapaxes(1, 2) for x in (q, k, v, do)]
    contig = [cp.ascontiguousarray(x) for x in views]
    res = []
    for qq, kk, vv, dd in (views, contig):
        out, lse = cuflash.attention_forward(qq, kk, vv, causal=True)
        res.append(cuflash.attention_backward(dd, qq, kk, vv, out, lse, causal=True, deterministic=True))
    for a, b_ in zip(*res):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b_))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_with_dout_and_out_rows_only_2_byte_aligned(dtype):
    """dout and out as views whose rows start one element (2 bytes) past a 16-byte boundary, at d = 64
    (rows of whole 16-byte chunks): the row-wise Dsum kernel checks each row's address and takes its
    element loads (16-byte loads there would fault or read shifted columns), the main kernels their
    element-load variants. The gradients match the aligned call's to rounding (the paths sum Dsum in
    different orders)."""
    rng = np.random.default_rng(17)
    b, hq, hk, lq, lk, d = 2, 2, 1, 77, 91, 64     # lq = 77: the last row block is cut short
    _, (q, k, v, do) = make_grad_inputs(rng, dtype, b, hq, hk, lq, lk, d, d)
    out, lse = cuflash.attention_forward(q, k, v, causal=True)

    def shifted(x):   # x's values, each row one element past the aligned start of a (d + 8)-wide row
        view = cp.zeros(x.shape[:-1] + (d + 8,), dtype=x.dtype)[..., 1:d + 1]
        view[...] = x
        assert view.data.ptr % 16 == 2 and view.strides[2] % 16 == 0
        return view

    aligned = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    unaligned = cuflash.attention_backward(shifted(do), q, k, v, shifted(out), lse, causal=True)
    for name, a, u in zip("qkv", aligned, unaligned):
        a, u = cp.asnumpy(a).astype(np.float64), cp.asnumpy(u).astype(np.float64)
        assert np.isfinite(u).all(), f"d{name} has NaN/inf"
        assert rel_error(u, a) < 2 * FLOOR[dtype], (name, rel_error(u, a))


def test_backward_memory_is_linear():
    """L=16384, D=64, one head: extra pool memory stays O(L*D), far below an L x L matrix."""
    n, d = 16384, 64
    rng = cp.random.default_rng(13)
    q, k, v, do = (rng.standard_normal((1, 1, n, d), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    out, lse = cuflash.attention_forward(q, k, v, causal=True)
    cuflash.attention_backward(do, q, k, v, out, lse, causal=True)   # compile outside the measurement
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    cp.cuda.Device().synchronize()
    extra = pool.total_bytes() - before
    lxl = n * n * 4
    print(f"backward extra memory at L={n}, D={d}: {extra / 2**20:.1f} MiB (one L x L fp32 matrix: {lxl / 2**20:.0f} MiB)")
    assert extra <= 16 * n * d * 4, extra          # a small multiple of one L x D fp32 array
    assert extra < lxl / 50
    assert all(bool(cp.isfinite(g.astype(cp.float32)).all()) for g in grads)


def _check_causal_rows(q, k, v, do, out, lse, grads, head=32, tail=128, tol=1e-12):
    """One head's (L, D) host arrays, causal: out, lse, dq of the first ``head`` and the last ``tail``
    query rows, and dk, dv of the last ``tail`` keys, against the float64 reference computed for those
    query rows only (the keys each sees under a mask). The last ``tail`` keys are seen only by the last
    ``tail`` queries, so their dK and dV from those rows are complete."""
    n = q.shape[0]
    rows = np.r_[0:head, n - tail:n]
    mask = np.arange(n)[None, :] <= rows[:, None]          # top-left causal, for these rows
    ref_out, ref_lse = reference.attention_naive(q[rows], k, v, mask=mask)
    ref_dq, ref_dk, ref_dv = reference.attention_backward_naive(do[rows], q[rows], k, v, mask=mask)
    dq, dk, dv = grads
    for name, got, ref in (("out", out[rows], ref_out), ("dq", dq[rows], ref_dq),
                           ("dk", dk[-tail:], ref_dk[-tail:]), ("dv", dv[-tail:], ref_dv[-tail:])):
        assert rel_error(got, ref) < tol, (name, rel_error(got, ref))
    np.testing.assert_allclose(lse[rows], ref_lse, rtol=tol, atol=tol)


def test_float64_causal_at_65536_on_one_head():
    """L = 65536, D = 64, one head, float64, causal: forward and backward finite, and rows of
    out / lse / dq and keys of dk / dv against the float64 reference computed for those rows only."""
    n, d = 65536, 64
    rng = np.random.default_rng(15)
    host = [rng.standard_normal((1, 1, n, d)) for _ in range(4)]
    q, k, v, do = (cp.asarray(x) for x in host)
    out, lse = cuflash.attention_forward(q, k, v, causal=True)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=True)
    got = [cp.asnumpy(x)[0, 0] for x in (out, lse) + tuple(grads)]
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert np.isfinite(x).all(), name
    _check_causal_rows(*(x[0, 0] for x in host), got[0], got[1], got[2:])


def test_backward_validation():
    rng = np.random.default_rng(14)
    _, (q, k, v, do) = make_grad_inputs(rng, "float32", 1, 2, 2, 10, 12, 8, 8)
    out, lse = cuflash.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="dout must have shape"):
        cuflash.attention_backward(do[..., :5, :], q, k, v, out, lse)
    with pytest.raises(TypeError, match="dout must have q's dtype"):
        cuflash.attention_backward(do.astype(cp.float64), q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        cuflash.attention_backward(do, q, k, v, out, lse[..., :3])
    with pytest.raises(TypeError, match="numpy"):
        cuflash.attention_backward(cp.asnumpy(do), q, k, v, out, lse)
