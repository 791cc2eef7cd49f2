"""Masking options on the GPU (marker `gpu`): bias with dbias, boolean masks, windows,
dropout and block sparsity, every dtype, against the float64 reference under the error
rule; determinism; PyTorch SDPA with the same attn_mask where torch imports."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference
from cuflash._runtime import device

from _gpu_checks import DTYPES, check_forward_tf32, check_masked, device_options, make_grad_inputs, seed_of
from _tiers import sampled

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

B, HQ, HK, LQ, LK = 2, 4, 2, 113, 150


def _options(kind: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pad = np.ones((B, 1, 1, LK), dtype=bool)
    pad[0, ..., 70:] = False
    pad[1, ..., 140:] = False
    return {
        "pair bias (1,1,L,L)": dict(bias=rng.standard_normal((1, 1, LQ, LK))),
        "full bias": dict(bias=rng.standard_normal((B, HQ, LQ, LK))),
        "key bias (B,1,1,L)": dict(bias=rng.standard_normal((B, 1, 1, LK))),
        "head bias (H,L,L)": dict(bias=rng.standard_normal((HQ, LQ, LK))),
        "key padding": dict(mask=pad),
        "query padding": dict(mask=np.arange(LQ)[None, None, :, None] < np.array([50, 113])[:, None, None, None]),
        "random mask": dict(mask=rng.random((B, HQ, LQ, LK)) < 0.3),
        "empty rows": dict(mask=np.where(np.arange(LQ)[:, None] % 7 == 0, False, rng.random((LQ, LK)) < 0.5)),
        "window": dict(window=(17, 5)),
        "window left": dict(window=(40, None)),
        "dropout": dict(dropout_p=0.2, seed=seed),
        "block sparse": dict(block_layout=cuflash.BlockLayout(rng.random((HQ, 8, 10)) < 0.4, 16)),
        "all": dict(bias=rng.standard_normal((1, HQ, LQ, LK)), mask=pad, window=(60, 10), dropout_p=0.1, seed=3,
                    block_layout=cuflash.BlockLayout.from_rule(LQ, LK, 32, local=1, global_blocks=1)),
    }[kind]


KINDS = ["pair bias (1,1,L,L)", "full bias", "key bias (B,1,1,L)", "head bias (H,L,L)", "key padding",
         "query padding", "random mask", "empty rows", "window", "window left", "dropout", "block sparse", "all"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, causal", sampled([(dt, c) for dt in DTYPES for c in (False, "bottom_right")],
                                                  [("float16", False), ("bfloat16", "bottom_right"),
                                                   ("float32", "bottom_right"), ("float64", False)], multi=True))
def test_options_against_reference(dtype, kind, causal):
    for d in (64, 40):
        seed = seed_of(dtype, kind, str(causal), d)
        check_masked(dtype, B, HQ, HK, LQ, LK, d, d, causal, seed, _options(kind, seed))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("kind", ["pair bias (1,1,L,L)", "key bias (B,1,1,L)", "all"])
def test_deterministic_dbias_is_bitwise_stable(dtype, kind):
    """A bias shared across CTAs takes turns in a fixed order: bitwise equal, and correct."""
    opts = _options(kind, 5)
    out, grads = check_masked(dtype, B, HQ, HK, LQ, LK, 64, 64, True, 5, opts, deterministic=True)
    rng = np.random.default_rng(5)
    (_, _, _, _), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, LQ, LK, 64, 64)
    dev = device_options(opts, dtype)
    for _ in range(3):
        o, lse = cuflash.attention_forward(qd, kd, vd, causal=True, **dev)
        again = cuflash.attention_backward(dod, qd, kd, vd, o, lse, causal=True, deterministic=True, **dev)
        for a, b in zip(grads, again):
            assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("kind", ["pair bias (1,1,L,L)", "key bias (B,1,1,L)", "all"])
def test_a_backward_without_the_bias_gradient_gives_the_same_dq_dk_dv(dtype, kind):
    """bias_grad=False: the kernels leave dbias out; dq, dk, dv bitwise those of the call that forms it
    (deterministic, so both sum dQ in one order)."""
    rng = np.random.default_rng(5)
    q = cp.asarray(rng.standard_normal((B, HQ, LQ, 64)).astype(DTYPES[dtype]))
    k, v = (cp.asarray(rng.standard_normal((B, HK, LK, 64)).astype(DTYPES[dtype])) for _ in range(2))
    opts = device_options(_options(kind, 4), dtype)
    out, lse = cuflash.attention_forward(q, k, v, **opts)
    dout = cp.asarray(rng.standard_normal(out.shape).astype(DTYPES[dtype]))
    full = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **opts)
    without = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, bias_grad=False, **opts)
    assert len(full) == 4 and len(without) == 3
    for a, b in zip(without, full[:3]):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("lk", [144, 150])
def test_bias_tile_paths(dtype, lk, monkeypatch):
    """Each way a bias tile reaches shared memory (tile_io.cuh load_score_tile): 16-byte
    chunks (rows aligned: lk = 144), element by element (lk = 150), chunks cut by the
    sequence end (one broadcast row at lk = 150), and a transposed view (key stride
    lq), which must give bitwise what the same bias made contiguous gives. The bitwise
    comparison runs on the portable kernels (compute capability patched to 8.0): on Hopper
    a float32 bias in 16-byte chunks takes the wgmma forward and the transposed view the
    portable one (test_hopper_forward_takes_the_portable_kernel_for_a_bias_not_in_chunks)."""
    lq = 70
    rng = np.random.default_rng(lk)
    bias = rng.standard_normal((1, 1, lq, lk))
    check_masked(dtype, B, HQ, HK, lq, lk, 64, 64, False, 11, dict(bias=bias))
    check_masked(dtype, B, HQ, HK, lq, lk, 64, 64, "bottom_right", 12, dict(bias=rng.standard_normal((B, 1, 1, lk))))
    (_, _, _, _), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, lq, lk, 64, 64)
    dense = device_options(dict(bias=bias), dtype)["bias"]
    view = cp.ascontiguousarray(dense.swapaxes(-1, -2)).swapaxes(-1, -2)
    assert view.strides[-1] != view.itemsize
    monkeypatch.setattr(device, "compute_capability", lambda: 80)
    results = []
    for b in (dense, view):
        out, lse = cuflash.attention_forward(qd, kd, vd, bias=b)
        grads = cuflash.attention_backward(dod, qd, kd, vd, out, lse, bias=b, deterministic=True)
        results.append((out, lse) + tuple(grads))
    for name, a, c in zip(["out", "lse", "dq", "dk", "dv", "dbias"], *results):
        assert a.shape == c.shape and bool((a.view(cp.uint8) == c.view(cp.uint8)).all()), name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1, 0, 0), (B, 1, 1, 0), (1, HQ, 1, 0), (B, HQ, 0, 0), (B, 1, 0, 0)])
def test_dbias_kernel_walks(dtype, shape, monkeypatch):
    """The tensor-core backward's dbias kernel (flash_bwd_dbias.cu): one CTA per accumulator
    tile walks the axes the bias broadcasts along. At L = 720 a (B, 1, L, L) bias has
    2 x 12 x 12 tiles (one split on an H100: 132 SMs), a one-row bias few tiles and a long
    walk (cut into slices the host adds). Against the reference; and dbias is bitwise the
    same on every call, deterministic=True or not (it has no atomics).

    The portable path is selected (as on a GPU without sm_90a): on compute capability 9.0 the
    Hopper dK/dV kernel adds dbias itself with fp32 atomics, so there a broadcast bias's dbias
    is bitwise stable only with deterministic=True (test_deterministic_dbias_is_bitwise_stable)."""
    monkeypatch.setattr(device, "compute_capability", lambda: 80)
    n = 720
    shape = tuple(x or n for x in shape)
    rng = np.random.default_rng(sum(shape))
    opts = dict(bias=rng.standard_normal(shape))
    check_masked(dtype, B, HQ, HK, n, n, 64, 64, True, 21, opts)
    (_, _, _, _), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, n, n, 64, 64)
    dev = device_options(opts, dtype)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=True, **dev)
    first = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=True, **dev)[3]
    assert first.shape == shape
    for _ in range(2):
        again = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=True, **dev)[3]
        assert bool((first.view(cp.uint8) == again.view(cp.uint8)).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(list(DTYPES)), lq=st.integers(1, 200), lk=st.integers(1, 200),
       d=st.sampled_from([8, 16, 32, 64, 80, 128]), causal=st.sampled_from([False, True, "bottom_right"]),
       window=st.one_of(st.none(), st.tuples(st.integers(0, 80), st.integers(0, 80))),
       bias=st.booleans(), density=st.sampled_from([None, 0.0, 0.2, 0.9]), dropout=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_hypothesis_shapes(dtype, lq, lk, d, causal, window, bias, density, dropout, seed):
    rng = np.random.default_rng(seed)
    opts = {"window": window}
    if bias:
        opts["bias"] = rng.standard_normal((1, 2, lq, lk))
    if density is not None:
        opts["mask"] = rng.random((1, 1, lq, lk)) < density
    if dropout:
        opts.update(dropout_p=0.25, seed=seed)
    check_masked(dtype, 1, 2, 1, lq, lk, d, d, causal, seed, opts)


def test_dropout_is_unbiased_in_expectation():
    """The mean over many seeds of dropout attention approaches attention without dropout."""
    rng = np.random.default_rng(0)
    q, k, v = (cp.asarray(rng.standard_normal((1, 1, 64, 32)).astype(np.float32)) for _ in range(3))
    ref = cuflash.attention(q, k, v)
    runs = 400
    mean = sum(cuflash.attention(q, k, v, dropout_p=0.5, seed=s) for s in range(runs)) / runs
    err = float(cp.abs(mean - ref).max())
    spread = float(cp.abs(ref).max())
    assert err < 0.25 * spread, (err, spread)   # ~ 1/sqrt(400) of the per-run spread
    a = cuflash.attention(q, k, v, dropout_p=0.5, seed=9)
    assert bool((a == cuflash.attention(q, k, v, dropout_p=0.5, seed=9)).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_dropout_origin_draws_the_whole_calls_mask(dtype):
    """A call on queries 40.. and keys 8.. with dropout_origin (40, 8) drops what the call over everything
    drops there (against the reference at that origin, and the rows of a query slice against the whole
    call's); a key origin that is not a multiple of 4 is refused before any launch."""
    opts = dict(dropout_p=0.3, seed=11)
    check_masked(dtype, B, HQ, HK, LQ - 40, LK - 8, 64, 64, False, 5, dict(opts, dropout_origin=(40, 8)))
    rng = np.random.default_rng(2)
    q, k, v = (cp.asarray(rng.standard_normal(s).astype(DTYPES[dtype]))
               for s in ((B, HQ, LQ, 64), (B, HK, LK, 64), (B, HK, LK, 64)))
    whole = cuflash.attention(q, k, v, causal=True, **opts).astype(cp.float64)
    rows = cuflash.attention(q[:, :, 40:], k, v, window=(None, 40), dropout_origin=(40, 0),   # j <= 40 + i
                             **opts).astype(cp.float64)
    tol = {"bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    assert float(cp.abs(rows - whole[:, :, 40:]).max()) < tol * (1 + float(cp.abs(whole).max()))
    with pytest.raises(ValueError, match="multiple of 4"):
        cuflash.attention(q, k, v, dropout_origin=(0, 3), **opts)


def test_float64_dbias_finite_differences():
    rng = np.random.default_rng(1)
    q, k, v, do = (cp.asarray(rng.standard_normal(s)) for s in ((2, 2, 33, 16), (2, 1, 41, 16), (2, 1, 41, 16),
                                                                (2, 2, 33, 16)))
    bias = cp.asarray(rng.standard_normal((1, 1, 33, 41)))
    mask = cp.asarray(rng.random((2, 1, 1, 41)) < 0.8)

    def loss(b):
        return float((cuflash.attention(q, k, v, bias=b, mask=mask, causal=True) * do).sum())

    out, lse = cuflash.attention_forward(q, k, v, bias=bias, mask=mask, causal=True)
    dbias = cp.asnumpy(cuflash.attention_backward(do, q, k, v, out, lse, bias=bias, mask=mask, causal=True)[3])
    h = 1e-6
    for idx in [(0, 0, 0, 0), (0, 0, 5, 3), (0, 0, 32, 40), (0, 0, 20, 11), (0, 0, 31, 2)]:
        e = cp.zeros(bias.shape)
        e[idx] = h
        fd = (loss(bias + e) - loss(bias - e)) / (2 * h)
        assert abs(fd - dbias[idx]) <= 1e-6 * (1 + abs(fd)), idx


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_matches_torch_sdpa_attn_mask(dtype, kind):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q = cp.asarray(rng.standard_normal((2, 4, 96, 64)).astype(DTYPES[dtype]))
    k, v = (cp.asarray(rng.standard_normal((2, 2, 128, 64)).astype(DTYPES[dtype])) for _ in range(2))
    if kind == "bool":
        m = cp.asarray(rng.random((2, 1, 1, 128)) < 0.7)
        ours = cuflash.attention(q, k, v, mask=m)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_dlpack(x) for x in (q, k, v)), attn_mask=torch.from_dlpack(m), enable_gqa=True)
    else:
        b = cp.asarray(rng.standard_normal((1, 1, 96, 128)).astype(DTYPES[dtype]))
        ours = cuflash.attention(q, k, v, bias=b)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_dlpack(x) for x in (q, k, v)), attn_mask=torch.from_dlpack(b), enable_gqa=True)
    ours = cp.asnumpy(ours).astype(np.float64)
    theirs = theirs.float().cpu().numpy()
    tol = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5}[dtype]
    assert np.abs(ours - theirs).max() < tol * (1 + np.abs(theirs).max())


# --------------------------------------------------------------------------- the Hopper forward (sm_90a)

@pytest.fixture
def launched(launches):
    """The variants launched during the test, in order (conftest's recorder); skips off compute
    capability 9.0."""
    if device.compute_capability() != 90:
        pytest.skip("needs a GPU of compute capability 9.0 (the Hopper path)")
    return launches


# More keys than head dim 64's threshold (HOPPER_FWD_MIN_KEYS), a multiple of 8 (the bias's rows are
# then 16-byte chunks: masking.rows_in_chunks), and tile edges inside the last query and key blocks.
HOPPER_LQ, HOPPER_LK = 333, 1096


def _hopper_options(kind: str, seed: int) -> dict:
    lq, lk = HOPPER_LQ, HOPPER_LK
    rng = np.random.default_rng(seed)
    pad = np.ones((B, 1, 1, lk), dtype=bool)
    pad[0, ..., lk - 300:] = False
    pad[1, ..., lk - 5:] = False
    layout = rng.random((HQ, -(-lq // 64), -(-lk // 64))) < 0.4
    layout[0, :4] = False      # head 0: query rows 0-255 see nothing (whole Hopper query blocks: Q never loaded)
    return {
        "pair bias (1,1,L,L)": dict(bias=rng.standard_normal((1, 1, lq, lk))),
        "key bias (B,1,1,L)": dict(bias=rng.standard_normal((B, 1, 1, lk))),
        "head bias (H,L,L)": dict(bias=rng.standard_normal((HQ, lq, lk))),
        "key padding": dict(mask=pad),
        "random mask": dict(mask=rng.random((B, HQ, lq, lk)) < 0.3),
        "empty rows": dict(mask=np.where(np.arange(lq)[:, None] % 7 == 0, False, rng.random((lq, lk)) < 0.5)),
        "dropout": dict(dropout_p=0.2, seed=seed),
        "block sparse": dict(block_layout=cuflash.BlockLayout(layout, 64)),
        "all": dict(bias=rng.standard_normal((1, HQ, lq, lk)), mask=pad, window=(300, 40), dropout_p=0.1, seed=3,
                    block_layout=cuflash.BlockLayout(layout, 64)),
    }[kind]


HOPPER_KINDS = ["pair bias (1,1,L,L)", "key bias (B,1,1,L)", "head bias (H,L,L)", "key padding", "random mask",
                "empty rows", "dropout", "block sparse", "all"]


@pytest.mark.parametrize("kind", HOPPER_KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, causal", sampled([(64, False), (64, "bottom_right"), (128, True), (128, False),
                                               (256, "bottom_right")], [(64, "bottom_right"), (128, True), (256, "bottom_right")],
                                              multi=True))
def test_hopper_forward_with_masking_options(kind, dtype, d, causal, launched):
    """On compute capability 9.0 the forward with a bias, a boolean mask, dropout or a block layout runs the
    wgmma kernel (EXTRA), at head dims 64 (three consumer warpgroups), 128 and 256, both causal alignments;
    within the error budget of the reference, rows that see nothing give 0 and lse = -inf."""
    seed = seed_of(dtype, kind, str(causal), d)
    check_masked(dtype, B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d, causal, seed, _hopper_options(kind, seed),
                 backward=False)
    assert [(v.family, v.extra) for v in launched] == [("fwd_wgmma", True)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_dropout_drops_what_the_portable_forward_drops(dtype, d, launched, monkeypatch):
    """Dropout on the Hopper forward keeps exactly the elements the portable forward keeps on the same seed
    (and the reference's Philox): the backward, which is portable, regenerates that mask. V is one-hot on a
    window of d keys a head (the other keys masked), so out[b, h, i, c] != 0 exactly where key c0_h + c is
    kept; the windows sit at keys 0 and 776, two places in Philox's key counter."""
    b, hq, hk, lq, lk, p_drop, seed = 2, 2, 1, 300, HOPPER_LK, 0.3, 12345
    c0 = (0, 776)
    rng = np.random.default_rng(d)
    q = rng.standard_normal((b, hq, lq, d)) * 0.3        # flat scores: no probability near underflow
    k = rng.standard_normal((b, hk, lk, d))
    v = np.zeros((b, hk, lk, d))
    mask = np.zeros((1, hq, 1, lk), dtype=bool)
    for h, c in enumerate(c0):
        mask[0, h, 0, c:c + d] = True
        v[:, :, c:c + d, :] = np.eye(d)
    dev = [cp.asarray(x.astype(DTYPES[dtype])) for x in (q, k, v)]
    kept = {}
    for cc in (90, 80):
        monkeypatch.setattr(device, "compute_capability", lambda cc=cc: cc)
        launched.clear()
        out = cp.asnumpy(cuflash.attention(*dev, mask=cp.asarray(mask), dropout_p=p_drop, seed=seed)).astype(np.float32)
        assert [x.family for x in launched] == ["fwd_wgmma" if cc == 90 else "fwd_mma"]
        assert np.isfinite(out).all()
        kept[cc] = out != 0
    np.testing.assert_array_equal(kept[90], kept[80])
    rows, cols = np.arange(lq)[:, None], np.arange(d)[None, :]
    ref = np.stack([np.stack([reference.dropout_keep(seed, p_drop, bb, h, rows, c0[h] + cols) for h in range(hq)])
                    for bb in range(b)]) > 0
    np.testing.assert_array_equal(kept[90], ref)
    assert 0.6 < kept[90].mean() < 0.8


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_forward_takes_the_portable_kernel_for_a_bias_not_in_chunks(dtype, launched):
    """The Hopper forward copies a bias by 16-byte chunks of its rows; a bias whose rows are not (1100 keys
    of 16 bits: 2200-byte rows; a transposed view) runs the portable forward, within the same budget, and
    a transposed view gives bitwise what the same bias made contiguous gives there."""
    lq, d = 200, 128
    for lk, family in ((1096, "fwd_wgmma"), (1100, "fwd_mma")):
        launched.clear()
        check_masked(dtype, B, HQ, HK, lq, lk, d, d, True, lk, dict(bias=np.random.default_rng(lk).standard_normal(
            (1, 1, lq, lk))), backward=False)
        assert [x.family for x in launched] == [family]
    rng = np.random.default_rng(3)
    (_, _, _, _), (qd, kd, vd, _) = make_grad_inputs(rng, dtype, B, HQ, HK, lq, 1096, d, d)
    dense = cp.asarray(rng.standard_normal((1, 1, lq, 1096)).astype(DTYPES[dtype]))
    view = cp.ascontiguousarray(dense.swapaxes(-1, -2)).swapaxes(-1, -2)
    results = []
    for bias in (view, dense):
        launched.clear()
        results.append(cuflash.attention_forward(qd, kd, vd, bias=bias))
    assert [x.family for x in launched] == ["fwd_wgmma"]   # the dense one; the view took the portable kernel
    out_view, out_dense = (cp.asnumpy(o).astype(np.float64) for o, _ in results)
    assert np.abs(out_view - out_dense).max() <= 2e-2 * np.abs(out_dense).max()


def _huge_logits_and_empty_rows(dtype, d, families, out_tol, launched, monkeypatch):
    """Logits in the thousands with a bias, and rows whose every key is masked, on a Hopper GPU's forward
    (``families``: the Hopper family, the portable one): the output is finite, empty rows give 0 and
    lse = -inf, and it agrees with the portable forward (the same call with the capability patched to 8.0)
    within ``out_tol`` of the largest output."""
    rng = np.random.default_rng(d)
    lq, lk = 150, HOPPER_LK
    q = cp.asarray((rng.standard_normal((B, HQ, lq, d)) * 60).astype(dtype))
    k, v = (cp.asarray(rng.standard_normal((B, HK, lk, d)).astype(dtype)) for _ in range(2))
    bias = cp.asarray((rng.standard_normal((1, 1, lq, lk)) * 100).astype(dtype))
    mask = cp.asarray(np.where(np.arange(lq)[:, None] % 5 == 0, False, rng.random((lq, lk)) < 0.7))
    results = {}
    for cc in (90, 80):
        monkeypatch.setattr(device, "compute_capability", lambda cc=cc: cc)
        launched.clear()
        out, lse = cuflash.attention_forward(q, k, v, bias=bias, mask=mask)
        assert [x.family for x in launched] == [families[0 if cc == 90 else 1]]
        results[cc] = cp.asnumpy(out).astype(np.float64), cp.asnumpy(lse)
    (out, lse), (out_p, lse_p) = results[90], results[80]
    empty = np.arange(lq) % 5 == 0
    assert np.isfinite(out).all() and (out[:, :, empty] == 0).all()
    assert np.isneginf(lse[:, :, empty]).all() and np.isfinite(lse[:, :, ~empty]).all()
    np.testing.assert_allclose(lse[:, :, ~empty], lse_p[:, :, ~empty], rtol=1e-5)
    assert np.abs(out - out_p).max() <= out_tol * max(1.0, np.abs(out_p).max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_forward_huge_logits_and_empty_rows(dtype, d, launched, monkeypatch):
    """Logits in the thousands with a bias, and rows whose every key is masked: the Hopper forward's output
    is finite, empty rows give 0 and lse = -inf, and it agrees with the portable forward."""
    _huge_logits_and_empty_rows(DTYPES[dtype], d, ("fwd_wgmma", "fwd_mma"), 2e-2, launched, monkeypatch)


# ------------------------------------------------------------- the float32 Hopper forward (sm_90a, TF32 wgmma)
# flash_fwd_wgmma_tf32.cu with EXTRA (branch wgmma-tf32-extra): head dims 64 and 128, the bias read from
# global memory into S's fragments (bias_frags.cuh), so again only for bias rows of 16-byte chunks.

HOPPER_F32_FWD = {"highest": ("fwd_wgmma_tf32x3", "fwd_tf32x3"), "tf32": ("fwd_tf32", "fwd_tf32")}
"""float32 precision -> (the family a Hopper GPU takes, the portable one): "tf32" keeps the portable kernel
(faster there; select.TF32_WGMMA_FAMILY)."""


@pytest.mark.parametrize("kind", HOPPER_KINDS)
@pytest.mark.parametrize("precision", ["highest", "tf32"])
@pytest.mark.parametrize("d, causal", sampled([(64, False), (64, "bottom_right"), (128, True), (128, False)],
                                              [(64, "bottom_right"), (128, True)], multi=True))
def test_hopper_float32_forward_with_masking_options(kind, precision, d, causal, launched):
    """On compute capability 9.0 the float32 forward with a bias, a boolean mask, dropout or a block layout runs
    the TF32 wgmma kernel (EXTRA) of its precision: "highest" within the error budget of the reference, "tf32"
    within TF32_TOL; rows that see nothing give 0 and lse = -inf."""
    seed = seed_of("float32", kind, str(causal), d, precision)
    opts = _hopper_options(kind, seed)
    if precision == "highest":
        check_masked("float32", B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d, causal, seed, opts, backward=False)
    else:
        check_forward_tf32(B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d, causal, seed, opts)
    assert [(v.family, v.extra) for v in launched] == [(HOPPER_F32_FWD[precision][0], True)]


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_float32_dropout_drops_what_the_portable_forward_drops(d, launched, monkeypatch):
    """As test_hopper_dropout_drops_what_the_portable_forward_drops, for the float32 Hopper forward (3xTF32)."""
    b, hq, hk, lq, lk, p_drop, seed = 2, 2, 1, 300, HOPPER_LK, 0.3, 4321
    c0 = (0, 776)
    rng = np.random.default_rng(d)
    q = rng.standard_normal((b, hq, lq, d)) * 0.3
    k = rng.standard_normal((b, hk, lk, d))
    v = np.zeros((b, hk, lk, d))
    mask = np.zeros((1, hq, 1, lk), dtype=bool)
    for h, c in enumerate(c0):
        mask[0, h, 0, c:c + d] = True
        v[:, :, c:c + d, :] = np.eye(d)
    dev = [cp.asarray(x.astype(np.float32)) for x in (q, k, v)]
    kept = {}
    for cc in (90, 80):
        monkeypatch.setattr(device, "compute_capability", lambda cc=cc: cc)
        launched.clear()
        out = cp.asnumpy(cuflash.attention(*dev, mask=cp.asarray(mask), dropout_p=p_drop, seed=seed))
        assert [x.family for x in launched] == [HOPPER_F32_FWD["highest"][0 if cc == 90 else 1]]
        assert np.isfinite(out).all()
        kept[cc] = out != 0
    np.testing.assert_array_equal(kept[90], kept[80])
    rows, cols = np.arange(lq)[:, None], np.arange(d)[None, :]
    ref = np.stack([np.stack([reference.dropout_keep(seed, p_drop, bb, h, rows, c0[h] + cols) for h in range(hq)])
                    for bb in range(b)]) > 0
    np.testing.assert_array_equal(kept[90], ref)


@pytest.mark.parametrize("precision", ["highest", "tf32"])
def test_hopper_float32_forward_bias_not_in_chunks_takes_the_portable_kernel(precision, launched):
    """The float32 Hopper forward reads a bias by 8-byte pairs of 16-byte chunked rows: 1096 keys (4384-byte
    rows) run it, 1098 (4392 bytes) the portable forward of the same precision, both within their bounds; a
    (1, 1, 1, 1097) bias (every stride 0: chunks whatever the key count, its last pair cut by the sequence
    end) runs it too."""
    lq, d = 200, 64
    for lk, bias_shape, hopper in ((1096, (1, 1, lq, 1096), True), (1098, (1, 1, lq, 1098), False),
                                   (1097, (1, 1, 1, 1097), True)):
        launched.clear()
        opts = dict(bias=np.random.default_rng(lk).standard_normal(bias_shape))
        if precision == "highest":
            check_masked("float32", B, HQ, HK, lq, lk, d, d, True, lk, opts, backward=False)
        else:
            check_forward_tf32(B, HQ, HK, lq, lk, d, d, True, lk, opts)
        assert [x.family for x in launched] == [HOPPER_F32_FWD[precision][0 if hopper else 1]], lk


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_float32_forward_huge_logits_and_empty_rows(d, launched, monkeypatch):
    """As test_hopper_forward_huge_logits_and_empty_rows, for the float32 Hopper forward (3xTF32) against the
    portable 3xTF32 one. Logits in the hundreds: float32's score error (~2^-23 of them) moves probabilities
    by ~1e-4 relative."""
    _huge_logits_and_empty_rows(np.float32, d, HOPPER_F32_FWD["highest"], 2e-3, launched, monkeypatch)


# --------------------------------------------------------------------------- the Hopper backward (sm_90a)
# The wgmma dK/dV kernel with EXTRA options at head dims 64 and 128 adds dbias itself
# (kernels_cu/bias_grad_t.cuh), no dbias kernel; head dim 256 stays portable.

def _hopper_backward_families(dbias: bool):
    return ["bwd_dsum", "bwd_dkdv_wgmma", "bwd_convert_dq"]


@pytest.mark.parametrize("kind", HOPPER_KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, causal", sampled([(64, False), (64, True), (64, "bottom_right"), (128, False), (128, True),
                                               (128, "bottom_right")], [(64, "bottom_right"), (128, True)], multi=True))
def test_hopper_backward_with_masking_options(kind, dtype, d, causal, launched):
    """On compute capability 9.0 the backward with a bias, a boolean mask, dropout or a block layout runs
    the wgmma dK/dV kernel (EXTRA) at head dims 64 and 128, both causal alignments: every gradient within
    the error budget of the float64 reference, finite, rows and keys that see nothing give 0."""
    seed = seed_of(dtype, kind, str(causal), d, "bwd")
    opts = _hopper_options(kind, seed)
    check_masked(dtype, B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d, causal, seed, opts)
    bwd = [(v.family, v.extra) for v in launched if v.family.startswith("bwd_")]
    assert [f for f, _ in bwd] == _hopper_backward_families("bias" in opts)
    assert ("bwd_dkdv_wgmma", True) in bwd


@pytest.mark.parametrize("kind", ["pair bias (1,1,L,L)", "random mask", "block sparse", "all"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, causal", [(64, "bottom_right"), (128, True)])
def test_hopper_backward_agrees_with_the_portable_backward(kind, dtype, d, causal, launched, monkeypatch):
    """The same gradients (within 16-bit rounding of different summation orders) from the Hopper and the
    portable backward on the same forward output, dropout included (same keep-mask)."""
    seed = seed_of(dtype, kind, str(causal), d, "ab")
    rng = np.random.default_rng(seed)
    (_, _, _, _), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d)
    dev = device_options(_hopper_options(kind, seed), dtype)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=causal, **dev)
    grads = {}
    for cc in (90, 80):
        monkeypatch.setattr(device, "compute_capability", lambda cc=cc: cc)
        launched.clear()
        grads[cc] = [cp.asnumpy(g).astype(np.float64)
                     for g in cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal, **dev)]
        assert ("bwd_dkdv_wgmma" in [v.family for v in launched]) == (cc == 90)
    for name, h, p in zip(["dq", "dk", "dv", "dbias"], grads[90], grads[80]):
        assert np.isfinite(h).all(), name
        assert np.abs(h - p).max() <= 2e-2 * max(1.0, np.abs(p).max()), name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_backward_dropout_pattern_is_the_forwards(dtype, d, launched, monkeypatch):
    """The Hopper backward regenerates exactly the forward's keep-mask: with dO = identity over d query rows,
    dV[key, i] = P[i, key] keep(i, key), so dV != 0 exactly where (i, key) is kept; the same pattern as the
    portable backward's and the reference's Philox, at keys on both sides of a 128-key block edge."""
    b, h, lk, p_drop, seed = 2, 1, HOPPER_LK, 0.3, 2024
    rng = np.random.default_rng(d)
    q = rng.standard_normal((b, h, d, d)) * 0.05       # flat scores: P ~ 1 / lk, far from underflow
    k = rng.standard_normal((b, h, lk, d))
    v = rng.standard_normal((b, h, lk, d))
    do = np.broadcast_to(np.eye(d), (b, h, d, d))
    qd, kd, vd, dod = (cp.asarray(np.ascontiguousarray(x).astype(DTYPES[dtype])) for x in (q, k, v, do))
    kept = {}
    for cc in (90, 80):
        monkeypatch.setattr(device, "compute_capability", lambda cc=cc: cc)
        launched.clear()
        out, lse = cuflash.attention_forward(qd, kd, vd, dropout_p=p_drop, seed=seed)
        _, _, dv = cuflash.attention_backward(dod, qd, kd, vd, out, lse, dropout_p=p_drop, seed=seed)
        assert ("bwd_dkdv_wgmma" in [x.family for x in launched]) == (cc == 90)
        dv = cp.asnumpy(dv).astype(np.float32)
        assert np.isfinite(dv).all()
        kept[cc] = dv[:, 0].swapaxes(-1, -2) != 0       # [b, query i, key]
    np.testing.assert_array_equal(kept[90], kept[80])
    rows, cols = np.arange(d)[:, None], np.arange(lk)[None, :]
    ref = np.stack([reference.dropout_keep(seed, p_drop, bb, 0, rows, cols) for bb in range(b)]) > 0
    np.testing.assert_array_equal(kept[90], ref)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_backward_empty_rows_and_key_blocks(dtype, d, launched):
    """Rows that see nothing and a whole 128-key block that nobody sees (a mask, and a block layout that
    hides whole query blocks): gradients exactly 0 there, finite everywhere, with huge biased logits."""
    rng = np.random.default_rng(d + 1)
    lq, lk = 300, HOPPER_LK
    q = cp.asarray((rng.standard_normal((B, HQ, lq, d)) * 30).astype(DTYPES[dtype]))
    k, v = (cp.asarray(rng.standard_normal((B, HK, lk, d)).astype(DTYPES[dtype])) for _ in range(2))
    do = cp.asarray(rng.standard_normal((B, HQ, lq, d)).astype(DTYPES[dtype]))
    bias = cp.asarray((rng.standard_normal((1, 1, lq, lk)) * 100).astype(DTYPES[dtype]))
    mask = rng.random((lq, lk)) < 0.7
    mask[np.arange(lq) % 5 == 0] = False           # empty rows
    mask[:, 128:256] = False                       # key block 1: nobody sees it
    layout = np.ones((HQ, -(-lq // 64), -(-lk // 64)), dtype=bool)
    layout[0, :2] = False                          # head 0: query rows 0-127 hidden (whole Hopper steps)
    opts = dict(bias=bias, mask=cp.asarray(mask), block_layout=cuflash.BlockLayout(layout, 64))
    out, lse = cuflash.attention_forward(q, k, v, **opts)
    launched.clear()
    dq, dk, dv, dbias = (cp.asnumpy(g).astype(np.float64) for g in cuflash.attention_backward(do, q, k, v, out, lse,
                                                                                            **opts))
    assert "bwd_dkdv_wgmma" in [x.family for x in launched]
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        assert np.isfinite(g).all(), name
    assert (dq[:, :, np.arange(lq) % 5 == 0] == 0).all()
    assert (dq[:, 0, :128] == 0).all()
    assert (dk[:, :, 128:256] == 0).all() and (dv[:, :, 128:256] == 0).all()
    assert (dbias[..., 128:256] == 0).all()


HOPPER_DBIAS_SHAPES = [(1, 1, HOPPER_LQ, HOPPER_LK), (B, 1, HOPPER_LQ, HOPPER_LK), (1, HQ, HOPPER_LQ, HOPPER_LK),
                       (B, HQ, HOPPER_LQ, HOPPER_LK), (HOPPER_LQ, HOPPER_LK), (B, 1, 1, HOPPER_LK),
                       (1, HQ, 1, HOPPER_LK), (HOPPER_LK,)]


@pytest.mark.parametrize("shape", HOPPER_DBIAS_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, causal", sampled([(64, True), (64, "bottom_right"), (128, True), (128, "bottom_right"),
                                               (64, False)], [(64, True), (128, "bottom_right")], multi=True))
def test_hopper_dbias_every_broadcast_shape(shape, dtype, d, causal, launched, monkeypatch):
    """dbias from the Hopper dK/dV kernel itself (its dbias variant: dS^T added from registers into a
    key-major fp32 accumulator, bias_grad_t.cuh; no dbias kernel) for every broadcast shape of the bias:
    shared by batch and / or heads (reductions from several CTAs), full, 2-D, one row per batch or head
    or for all (summed over the queries in registers first). Lq = 333 (a row pitch with padding), Lk = 1096
    (a key block cut at 72 keys), two query heads per K/V head (the row sums change head inside a CTA).
    Within the float64 reference's error budget, and close to the portable dbias kernel's result."""
    seed = seed_of(dtype, shape, str(causal), d, "hdb")
    rng = np.random.default_rng(seed)
    opts = dict(bias=rng.standard_normal(shape))
    check_masked(dtype, B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d, causal, seed, opts)
    wgmma = [v for v in launched if v.family == "bwd_dkdv_wgmma"]
    assert [v.family for v in launched if v.family.startswith("bwd_")] == _hopper_backward_families(True)
    assert len(wgmma) == 1 and wgmma[0].dbias and wgmma[0].extra
    (_, _, _, _), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d)
    dev = device_options(opts, dtype)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=causal, **dev)
    dbias = {}
    for cc in (90, 80):
        monkeypatch.setattr(device, "compute_capability", lambda cc=cc: cc)
        launched.clear()
        dbias[cc] = cp.asnumpy(cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal, **dev)[3])
        assert ("bwd_dbias_mma" in [v.family for v in launched]) == (cc == 80)
        assert dbias[cc].shape == shape and np.isfinite(dbias[cc].astype(np.float64)).all()
    h, p = (dbias[cc].astype(np.float64) for cc in (90, 80))
    assert np.abs(h - p).max() <= 2e-2 * max(1.0, np.abs(p).max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_dbias_deterministic_stays_portable(dtype, launched):
    """deterministic=True: no atomics, so the portable backward and its dbias kernel, bitwise stable."""
    rng = np.random.default_rng(5)
    opts = dict(bias=rng.standard_normal((1, 1, HOPPER_LQ, HOPPER_LK)))
    (_, _, _, _), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, B, HQ, HK, HOPPER_LQ, HOPPER_LK, 64, 64)
    dev = device_options(opts, dtype)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=True, **dev)
    launched.clear()
    first = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=True, deterministic=True, **dev)[3]
    families = [v.family for v in launched]
    assert "bwd_dkdv_wgmma" not in families and "bwd_dbias_mma" in families
    again = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=True, deterministic=True, **dev)[3]
    assert bool((first.view(cp.uint8) == again.view(cp.uint8)).all())


@pytest.mark.parametrize("shape", HOPPER_DBIAS_SHAPES, ids=str)
@pytest.mark.parametrize("d, causal", sampled([(64, True), (128, "bottom_right"), (64, False)], [(128, "bottom_right")],
                                              multi=True))
def test_float32_dbias_key_major(shape, d, causal, monkeypatch):
    """float32 on the TF32 tensor cores: a bias with query rows that CTAs share (over batch or K/V heads)
    gets dbias from the dK/dV kernel's vector reductions into a key-major accumulator (DBIAS_KEY_MAJOR,
    bias_grad_t.cuh) instead of scalar atomics; a full bias keeps plain adds, a one-row bias its atomics of
    row sums, deterministic=True its turns. Every shape within the float64 reference's budget ("highest"),
    and "tf32"'s dbias close to it. Lq = 333 (a quad of queries crossing Lq), Lk = 1096."""
    from cuflash._dispatch import masking

    plans = []
    real = masking.dbias_plan

    def record(*args, **kwargs):
        plan = real(*args, **kwargs)
        plans.append(plan.values["mode"])
        return plan

    monkeypatch.setattr(masking, "dbias_plan", record)
    seed = seed_of(shape, str(causal), d, "f32km")
    rng = np.random.default_rng(seed)
    opts = dict(bias=rng.standard_normal(shape))
    check_masked("float32", B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d, causal, seed, opts)
    full = (1,) * (4 - len(shape)) + tuple(shape)
    shared = (full[0] == 1 and B > 1) or (full[1] == 1 and HK > 1)
    want = masking.DBIAS_KEY_MAJOR if shared and full[2] > 1 else (
        masking.DBIAS_ATOMIC if shared else masking.DBIAS_ADD)
    assert plans == [want]
    (_, _, _, _), (qd, kd, vd, dod) = make_grad_inputs(rng, "float32", B, HQ, HK, HOPPER_LQ, HOPPER_LK, d, d)
    dev = device_options(opts, "float32")
    got = {}
    for precision in ("highest", "tf32"):
        out, lse = cuflash.attention_forward(qd, kd, vd, causal=causal, precision=precision, **dev)
        got[precision] = cp.asnumpy(cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal,
                                                               precision=precision, **dev)[3]).astype(np.float64)
        assert got[precision].shape == tuple(shape) and np.isfinite(got[precision]).all()
    ref = got["highest"]
    assert np.abs(got["tf32"] - ref).max() <= 2e-2 * max(1.0, np.abs(ref).max())
    plans.clear()
    cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal, deterministic=True, **dev)
    assert plans == [masking.DBIAS_ORDERED if shared else masking.DBIAS_ADD]


@pytest.mark.parametrize("shape, call_blocks", [((2, 3, 7, 9), (7, 9)), ((1, 1, 1, 9), (7, 9)),
                                                ((1, 2, 7, 1), (7, 9)), ((1, 1, 5, 5), (5, 5))])
def test_layout_spans_are_the_first_and_last_visible_blocks(shape, call_blocks):
    """The spans kernel (kernels_cu/layout_spans.cu) against NumPy: per query block the first and last key block
    not BLOCK_OFF and per key block the first and last query block (none: n and -1), an axis the states broadcast
    spanning the call's blocks; states with empty rows and columns, and all-hidden ones."""
    from cuflash._dispatch import masking

    rng = np.random.default_rng(sum(shape))
    states = rng.choice(np.array([0, 0, 1, 2], np.int8), size=shape)
    states[..., 0, :] = 0   # an empty row and column where there is more than one
    states[..., :, -1] = 0 if shape[3] > 1 else states[..., :, -1]
    nq, nk = call_blocks
    rows, cols = masking.layout_spans(cp.asarray(states), cp, nq, nk)

    def want(visible, blocks):   # spans along the last axis of visible (..., n), n 1 = broadcast over blocks
        n = visible.shape[-1]
        out = np.empty(visible.shape[:-1] + (2,), np.int32)
        for idx in np.ndindex(visible.shape[:-1]):
            where = np.flatnonzero(visible[idx])
            if len(where) == 0:
                out[idx] = (blocks, -1)
            else:
                out[idx] = (0, blocks - 1) if n == 1 and blocks > 1 else (where[0], where[-1])
        return out

    visible = states != 0
    np.testing.assert_array_equal(cp.asnumpy(rows), want(visible, nk))
    np.testing.assert_array_equal(cp.asnumpy(cols), want(np.swapaxes(visible, 2, 3), nq))
