"""The GPU checks every GPU test shares: run cuflash on random inputs, compare with the
exact reference under DESIGN.md's error rule (_errors.py)."""
import zlib

import ml_dtypes
import numpy as np

import cuflash
from cuflash import reference

from _errors import exact, lse_bound, magnitude, naive_same_dtype, rel_error, within_budget

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
          "float64": np.float64}


def _cupy():
    import cupy

    return cupy


def make_inputs(rng, dtype, b, hq, hk, lq, lk, d, dv, logit_scale=1.0):
    """Host float64 arrays already rounded to `dtype`, and their device copies."""
    host = []
    for shape in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv)):
        x = rng.standard_normal(shape) * (logit_scale if len(host) == 0 else 1.0)
        host.append(x.astype(DTYPES[dtype]))
    dev = [_cupy().asarray(x) for x in host]
    return [x.astype(np.float64) for x in host], dev, host


def check_forward(dtype, b, hq, hk, lq, lk, d, dv, causal, seed, logit_scale=1.0, num_splits=None):
    rng = np.random.default_rng(seed)
    ref_in, dev, low = make_inputs(rng, dtype, b, hq, hk, lq, lk, d, dv, logit_scale)
    # num_splits passed only when given: a test may have bound it on attention_forward
    out, lse = cuflash.attention_forward(*dev, causal=causal, **({} if num_splits is None else {"num_splits": num_splits}))
    assert out.dtype == np.dtype(DTYPES[dtype]) and out.shape == (b, hq, lq, dv)
    assert lse.shape == (b, hq, lq)
    scale = 1 / np.sqrt(d)
    ref_lse = reference.attention_naive(*ref_in, causal=causal)[1]
    ref = exact(*ref_in, causal=causal, scale=scale, dtype=dtype)
    naive = naive_same_dtype(*ref_in, causal=causal, scale=scale, dtype=dtype)
    got = _cupy().asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all(), "NaN or inf in the output"
    mag = magnitude(*ref_in, causal=causal, scale=scale)
    ok, msg = within_budget(got, ref, naive, mag, dtype)
    assert ok, msg
    assert rel_error(got, ref) < 2e-2, msg   # and absolutely small, whatever the naive computation did
    got_lse = _cupy().asnumpy(lse).astype(np.float64)
    seen = np.isfinite(ref_lse)
    assert (np.isneginf(got_lse) == ~seen).all(), "lse must be -inf exactly for rows that see no key"
    lse_tol = 1e-12 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(got_lse[seen], ref_lse[seen], rtol=lse_tol, atol=lse_tol)
    return out


def check_packed(dtype, hq, hk, lengths, d, causal, seed, backward=False, deterministic=True):
    """cuflash.varlen's forward over packed sequences (``lengths``: (query counts, key counts)) against each
    sequence's exact attention, within the error budget; 0 and lse -inf for rows that see no key. With
    ``backward``, the gradients too (0 for keys no query sees), bitwise equal when run again if
    ``deterministic``."""
    from cuflash import varlen

    cp = _cupy()
    rng = np.random.default_rng(seed)
    lq, lk = lengths
    q = rng.standard_normal((sum(lq), hq, d)).astype(DTYPES[dtype])
    k, v = (rng.standard_normal((sum(lk), hk, d)).astype(DTYPES[dtype]) for _ in range(2))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    dev = [cp.asarray(x) for x in (q, k, v)]
    out_d, lse_d = varlen.attention_varlen_forward(*dev, cu_q, cu_k, causal=causal)
    out, lse = cp.asnumpy(out_d).astype(np.float64), cp.asnumpy(lse_d).astype(np.float64)
    grads = None
    if backward:
        do = rng.standard_normal(out.shape).astype(DTYPES[dtype])
        grads_d = varlen.attention_varlen_backward(cp.asarray(do), *dev, out_d, lse_d, cu_q, cu_k, causal=causal,
                                                   deterministic=deterministic)
        if deterministic:
            again = varlen.attention_varlen_backward(cp.asarray(do), *dev, out_d, lse_d, cu_q, cu_k, causal=causal,
                                                     deterministic=True)
            for a, b in zip(grads_d, again):
                assert (cp.asnumpy(a).view(np.uint8) == cp.asnumpy(b).view(np.uint8)).all(), \
                    "packed gradients not bitwise equal"
        grads = [cp.asnumpy(g).astype(np.float64) for g in grads_d]
        seen_keys = np.zeros(sum(lk), dtype=bool)
    assert np.isfinite(out).all(), "NaN or inf in the output"
    scale = 1 / np.sqrt(d)
    for b in range(len(lq)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq[b] == 0:
            continue
        if lk[b] == 0:
            assert not out[rows].any() and np.isneginf(lse[:, rows]).all(), f"sequence {b}: no keys, 0 and -inf"
            continue
        qb, kb, vb = (x[span].transpose(1, 0, 2)[None].astype(np.float64) for x, span in ((q, rows), (k, keys), (v, keys)))
        ref = exact(qb, kb, vb, causal=causal, scale=scale, dtype=dtype)
        naive = naive_same_dtype(qb, kb, vb, causal=causal, scale=scale, dtype=dtype)
        got = out[rows].transpose(1, 0, 2)[None]
        ok, msg = within_budget(got, ref, naive, magnitude(qb, kb, vb, causal=causal, scale=scale), dtype)
        assert ok, f"sequence {b}: {msg}"
        ref_lse = reference.attention_naive(qb, kb, vb, causal=causal)[1][0]
        seen = np.isfinite(ref_lse)
        got_lse = lse[:, rows]
        assert (np.isneginf(got_lse) == ~seen).all(), f"sequence {b}: lse -inf exactly where a row sees no key"
        np.testing.assert_allclose(got_lse[seen], ref_lse[seen], rtol=2e-5, atol=2e-5)
        if grads is None:
            continue
        seen_keys[keys] = True
        dob = do[rows].transpose(1, 0, 2)[None].astype(np.float64)
        ref_out, ref_grads = exact(qb, kb, vb, dob, causal=causal, scale=scale, dtype=dtype)
        naive_grads = naive_same_dtype(qb, kb, vb, dob, causal=causal, scale=scale, dtype=dtype)[1]
        mag = magnitude(qb, kb, vb, dob, causal=causal, scale=scale)[1]
        lse_max = lse_bound(qb, kb, scale)
        for name, g, span, r, n, m in zip(("dq", "dk", "dv"), grads, (rows, keys, keys), ref_grads, naive_grads, mag):
            ok, msg = within_budget(g[span].transpose(1, 0, 2)[None], r, n, m, dtype, lse_max)
            assert ok, f"sequence {b} {name}: {msg}"
    if grads is not None:   # keys of sequences without queries: no gradient
        assert not grads[1][~seen_keys].any() and not grads[2][~seen_keys].any()


def seed_of(*parts) -> int:
    """A seed from a test's parameters, the same in every process (``hash`` of a str is salted per
    process, so a failure would not reproduce)."""
    return zlib.crc32(repr(parts).encode())


def make_grad_inputs(rng, dtype, b, hq, hk, lq, lk, d, dv, logit_scale=1.0):
    shapes = ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv), (b, hq, lq, dv))
    host = [(rng.standard_normal(s) * (logit_scale if i == 0 else 1.0)).astype(DTYPES[dtype])
            for i, s in enumerate(shapes)]
    return [x.astype(np.float64) for x in host], [_cupy().asarray(x) for x in host]


def check_backward(dtype, b, hq, hk, lq, lk, d, dv, causal, seed, deterministic=False, logit_scale=1.0):
    rng = np.random.default_rng(seed)
    (q, k, v, do), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, b, hq, hk, lq, lk, d, dv, logit_scale)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=causal)
    grads = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal, deterministic=deterministic)
    opts = dict(causal=causal, scale=1 / np.sqrt(d))
    _, ref = exact(q, k, v, do, dtype=dtype, **opts)
    _, naive = naive_same_dtype(q, k, v, do, dtype=dtype, **opts)
    _, mag = magnitude(q, k, v, do, **opts)
    lse_max = lse_bound(q, k, 1 / np.sqrt(d))
    for name, g, x, r, n, m in zip("qkv", grads, (qd, kd, vd), ref, naive, mag):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        got = _cupy().asnumpy(g).astype(np.float64)
        assert np.isfinite(got).all(), f"d{name} has NaN/inf"
        ok, msg = within_budget(got, r, n, m, dtype, lse_max)
        assert ok, f"d{name}: {msg}"
        if logit_scale == 1.0 and np.linalg.norm(r) > 0.1 * np.linalg.norm(m):
            assert rel_error(got, r) < 5e-2, f"d{name}: {msg}"   # absolutely small too
    return grads


def device_options(options: dict, dtype: str) -> dict:
    """The masking options as cuflash takes them for CuPy inputs (bias in `dtype`, mask as bool)."""
    cp = _cupy()
    dev = dict(options)
    if options.get("bias") is not None:
        dev["bias"] = cp.asarray(options["bias"].astype(DTYPES[dtype]))
    if options.get("mask") is not None:
        dev["mask"] = cp.asarray(options["mask"])
    if options.get("block_layout") is not None:
        lay = options["block_layout"]
        dev["block_layout"] = cuflash.BlockLayout(cp.asarray(lay.layout), lay.block_size)
    for name in ("score_mod", "mask_mod"):   # user modifications: their parameter arrays on the device
        if options.get(name) is not None:
            dev[name] = _mods_on(options[name], cp)
    return dev


def _mods_on(mods, xp):
    return tuple(m.on(xp) for m in mods) if isinstance(mods, (tuple, list)) else mods.on(xp)


def host_options(options: dict, dtype: str) -> dict:
    """The same options for the float64 references (bias rounded to `dtype` first)."""
    host = dict(options)
    if options.get("bias") is not None:
        host["bias"] = options["bias"].astype(DTYPES[dtype]).astype(np.float64)
    for name in ("score_mod", "mask_mod"):
        if options.get(name) is not None:
            host[name] = _mods_on(options[name], np)
    return host


def check_masked(dtype, b, hq, hk, lq, lk, d, dv, causal, seed, options, deterministic=False, scale=None,
                 backward=True, token_major=False):
    """Forward and backward with masking options (bias, mask, window, dropout_p/seed,
    block_layout) against the exact reference under the error rule; dbias too.
    ``scale`` None: the default 1 / sqrt(d). ``backward`` False: the forward only. ``token_major``: the
    device arrays are (B, H, L, D) views of (B, L, H, D) memory."""
    cp = _cupy()
    rng = np.random.default_rng(seed)
    (q, k, v, do), (qd, kd, vd, dod) = make_grad_inputs(rng, dtype, b, hq, hk, lq, lk, d, dv)
    if token_major:
        qd, kd, vd, dod = (as_token_major(x) for x in (qd, kd, vd, dod))
    dev, host = device_options(options, dtype), host_options(options, dtype)
    scale = 1 / np.sqrt(d) if scale is None else scale
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=causal, scale=scale, **dev)
    grads = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal, scale=scale,
                                       deterministic=deterministic, **dev) if backward else None
    opts = dict(causal=causal, scale=scale, **host)
    ref_out, ref = exact(q, k, v, do, dtype=dtype, **opts)
    naive_out, naive = naive_same_dtype(q, k, v, do, dtype=dtype, **opts)
    mag_out, mag = magnitude(q, k, v, do, **opts)
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all(), "NaN or inf in the output"
    ok, msg = within_budget(got, ref_out, naive_out, mag_out, dtype)
    assert ok, f"out: {msg}"
    ref_lse = reference.attention_naive(q, k, v, **opts)[1]
    got_lse = cp.asnumpy(lse).astype(np.float64)
    seen = np.isfinite(ref_lse)
    assert (np.isneginf(got_lse) == ~seen).all(), "lse must be -inf exactly for rows that see no key"
    lse_tol = 1e-12 if dtype == "float64" else 2e-5
    lse_err = np.abs(got_lse[seen] - ref_lse[seen]) / (1 + np.abs(ref_lse[seen]))
    assert lse_err.size == 0 or lse_err.max() <= lse_tol, f"lse error {lse_err.max():.3e}"
    if not backward:
        return out, None
    names = ["dq", "dk", "dv"] + (["dbias"] if options.get("bias") is not None else [])
    if isinstance(grads[-1], dict):   # trainable parameters of user modifications: test_mods_gpu.py checks them
        grads = grads[:-1]
    assert len(grads) == len(names)
    lse_max = float(np.abs(ref_lse[seen]).max()) if seen.any() else 0.0
    for name, g, r, n, m in zip(names, grads, ref, naive, mag):
        got = cp.asnumpy(g).astype(np.float64)
        assert got.shape == r.shape, (name, got.shape, r.shape)
        assert np.isfinite(got).all(), f"{name} has NaN/inf"
        ok, msg = within_budget(got, r, n, m, dtype, lse_max)
        assert ok, f"{name}: {msg}"
    return out, grads


TF32_TOL = 5e-3
"""precision="tf32" (operands with 11 significant bits, 2^-11 ~ 5e-4 each): the bound on the forward's
relative error against the float64 reference on unit-normal inputs, and on lse's error relative to
1 + |lse|."""


def as_token_major(x):
    """A copy of the 4-D array ``x`` (B, H, L, D) in (B, L, H, D) memory, seen as (B, H, L, D)."""
    cp = _cupy()
    y = cp.empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), dtype=x.dtype).transpose(0, 2, 1, 3)
    bits = np.dtype(f"u{x.itemsize}")
    y.view(bits)[...] = x.view(bits)
    return y


def check_forward_tf32(b, hq, hk, lq, lk, d, dv, causal, seed, options=None):
    """The float32 forward with precision="tf32" against the float64 reference (any masking
    ``options``): relative error below TF32_TOL; lse likewise, -inf exactly where a row sees no key."""
    cp = _cupy()
    rng = np.random.default_rng(seed)
    ref_in, dev, _ = make_inputs(rng, "float32", b, hq, hk, lq, lk, d, dv)
    options = options or {}
    scale = 1 / np.sqrt(d)
    out, lse = cuflash.attention_forward(*dev, causal=causal, scale=scale, precision="tf32",
                                         **device_options(options, "float32"))
    opts = dict(causal=causal, scale=scale, **host_options(options, "float32"))
    ref_out, ref_lse = reference.attention_naive(*ref_in, **opts)
    got = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(got).all(), "NaN or inf in the output"
    err = rel_error(got, ref_out)
    assert err < TF32_TOL, f"tf32 rel. error {err:.3e}"
    got_lse = cp.asnumpy(lse).astype(np.float64)
    seen = np.isfinite(ref_lse)
    assert (np.isneginf(got_lse) == ~seen).all(), "lse must be -inf exactly for rows that see no key"
    lse_err = np.abs(got_lse[seen] - ref_lse[seen]) / (1 + np.abs(ref_lse[seen]))
    assert lse_err.size == 0 or lse_err.max() < TF32_TOL, f"lse error {lse_err.max():.3e}"
    return out, err


TF32_BWD_TOL = 1e-2
"""precision="tf32" backward: the bound on each gradient's relative error (norm) against the float64
reference on unit-normal inputs. dS = P (dP - Dsum) subtracts two TF32-accurate numbers of similar
size, so the gradients carry a few times the forward's ~1e-3 (an offline estimate: check on the GPU)."""


def check_backward_tf32(b, hq, hk, lq, lk, d, dv, causal, seed, options=None, deterministic=False):
    """Forward and backward with precision="tf32" (any masking ``options``, dbias too) against the
    float64 reference: every gradient's relative error below TF32_BWD_TOL. Returns the errors."""
    cp = _cupy()
    rng = np.random.default_rng(seed)
    (q, k, v, do), (qd, kd, vd, dod) = make_grad_inputs(rng, "float32", b, hq, hk, lq, lk, d, dv)
    options = options or {}
    dev, host = device_options(options, "float32"), host_options(options, "float32")
    scale = 1 / np.sqrt(d)
    out, lse = cuflash.attention_forward(qd, kd, vd, causal=causal, scale=scale, precision="tf32", **dev)
    grads = cuflash.attention_backward(dod, qd, kd, vd, out, lse, causal=causal, scale=scale, precision="tf32",
                                       deterministic=deterministic, **dev)
    _, ref = exact(q, k, v, do, causal=causal, scale=scale, dtype="float32", **host)
    names = ["dq", "dk", "dv"] + (["dbias"] if options.get("bias") is not None else [])
    if isinstance(grads[-1], dict):   # trainable parameters of user modifications: test_mods_gpu.py checks them
        grads = grads[:-1]
    assert len(grads) == len(names)
    errors = {}
    for name, g, r in zip(names, grads, ref):
        got = cp.asnumpy(g).astype(np.float64)
        assert got.shape == r.shape, (name, got.shape, r.shape)
        assert np.isfinite(got).all(), f"{name} has NaN/inf"
        errors[name] = rel_error(got, r)
        assert errors[name] < TF32_BWD_TOL, f"tf32 {name} rel. error {errors[name]:.3e}"
    return errors
