"""cuflash.varlen: packed sequences of different lengths against one dense call over the packed arrays
with a block-diagonal mask (each sequence's queries see its own keys, causal and windows per
sequence; dropout's mask at (packed query row, key of the sequence), written out); pack / unpack; bad
offsets refused. NumPy arrays, and with marker `gpu` CuPy arrays of every dtype."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import reference, varlen
from cuflash.semantics import band_limits

from _errors import rel_error

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
# a GPU output's error against the float64 NumPy path's on the same data (gradients: 4x)
GPU_TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}


def _close_to_numpy(got: dict, want: dict, tol: float) -> None:
    """Every CuPy array of ``got`` (name -> array; tuples of gradients, a dict of parameter gradients) within
    ``tol`` (outputs) or 4 tol (gradients) of ``want``'s NumPy array of that name, shapes equal."""
    for name, w in want.items():
        g = got[name]
        if isinstance(w, dict):
            _close_to_numpy(g, w, 4 * tol)
            continue
        pairs = zip(g, w) if isinstance(w, tuple) else ((g, w),)
        for g_i, w_i in pairs:
            assert g_i.shape == w_i.shape, name
            assert rel_error(g_i.get().astype(np.float64), np.asarray(w_i, np.float64)) < \
                (4 * tol if isinstance(w, tuple) else tol), name


def _packed(rng, lengths_q, lengths_k, hq=4, hk=2, d=8, dv=8, dtype=np.float64):
    qs = [rng.standard_normal((n, hq, d)).astype(dtype) for n in lengths_q]
    ks = [rng.standard_normal((n, hk, d)).astype(dtype) for n in lengths_k]
    vs = [rng.standard_normal((n, hk, dv)).astype(dtype) for n in lengths_k]
    (q, cu_q), (k, cu_k), (v, _) = varlen.pack(qs), varlen.pack(ks), varlen.pack(vs)
    return q, k, v, cu_q, cu_k


def _ragged(rng, dtype: str):
    """Four sequences with an empty and a one-row one (queries 70, 0, 1, 130; keys 90, 5, 1, 130), 4 / 2 heads,
    D = Dv = 64: the GPU tests' packed arrays and offsets."""
    return _packed(rng, [70, 0, 1, 130], [90, 5, 1, 130], hq=4, hk=2, d=64, dv=64, dtype=DTYPES[dtype])


def _block_diagonal(cu_q, cu_k, causal, window):
    """(total_q, total_k) bool: query i of sequence b sees key j of sequence b inside its band."""
    allowed = np.zeros((cu_q[-1], cu_k[-1]), dtype=bool)
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        i = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        sees = np.ones((lq, lk), dtype=bool)
        band = band_limits(causal, window, lq, lk)
        if band is not None:
            lo, hi = band
            sees = (j >= i + lo) & (j <= i + hi)
        allowed[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = sees
    return allowed


def _dense(q, k, v, cu_q, cu_k, causal, window, dropout_p=0.0, seed=None, dout=None):
    """The oracle: one (H, total, D) call with the block-diagonal mask; with dropout the same written out
    (:func:`_written_out`)."""
    if dropout_p:
        return _written_out(q, k, v, cu_q, cu_k, causal, window, dropout_p, seed, dout)
    if q.shape[0] == 0 or k.shape[0] == 0:   # nothing attends anything (the naive reference needs keys)
        if dout is None:
            return np.zeros(q.shape[:2] + v.shape[2:]), np.full((q.shape[1], q.shape[0]), -np.inf)
        return tuple(np.zeros(x.shape) for x in (q, k, v))
    qh, kh, vh = (np.asarray(x, dtype=np.float64).transpose(1, 0, 2) for x in (q, k, v))
    mask = _block_diagonal(cu_q, cu_k, causal, window)
    out, lse = reference.attention_naive(qh, kh, vh, mask=mask, dropout_p=dropout_p, seed=seed)
    if dout is None:
        return out.transpose(1, 0, 2), lse
    grads = reference.attention_backward_naive(np.asarray(dout, dtype=np.float64).transpose(1, 0, 2), qh, kh, vh,
                                               mask=mask, dropout_p=dropout_p, seed=seed)
    return tuple(g.transpose(1, 0, 2) for g in grads[:3])


def _written_out(q, k, v, cu_q, cu_k, causal, window, p, seed, dout=None):
    """Attention over the packed arrays with the block-diagonal mask and dropout's mask at (packed query row,
    key counted from its sequence's first), written out in float64: (out, lse), or with ``dout`` the
    gradients (P the softmax, M the keep factors: O = (P * M) V, dS = P * (dO V^T * M - rowsum(dO * O)))."""
    hq, hk = q.shape[1], k.shape[1]
    scale = 1 / np.sqrt(q.shape[2])
    qh = np.asarray(q, np.float64).transpose(1, 0, 2)
    kh, vh = (np.repeat(np.asarray(x, np.float64).transpose(1, 0, 2), hq // hk, axis=0) for x in (k, v))
    allowed = _block_diagonal(cu_q, cu_k, causal, window)
    key_seq = np.searchsorted(cu_k, np.arange(k.shape[0]), side="right") - 1
    keep = reference.dropout_keep(seed, p, 0, np.arange(hq)[:, None, None], np.arange(q.shape[0])[None, :, None],
                                  (np.arange(k.shape[0]) - np.asarray(cu_k)[key_seq])[None, None, :])
    s = np.where(allowed, scale * qh @ kh.transpose(0, 2, 1), -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = e.sum(axis=-1, keepdims=True)
    prob = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    out = (prob * keep) @ vh
    if dout is None:
        with np.errstate(divide="ignore"):
            return out.transpose(1, 0, 2), (m + np.log(total))[..., 0]
    do = np.asarray(dout, np.float64).transpose(1, 0, 2)
    dv = (prob * keep).transpose(0, 2, 1) @ do
    dp = (do @ vh.transpose(0, 2, 1)) * keep
    ds = prob * (dp - (do * out).sum(axis=-1, keepdims=True))
    dq, dk = scale * ds @ kh, scale * ds.transpose(0, 2, 1) @ qh
    grouped = [x.reshape(hk, hq // hk, *x.shape[1:]).sum(axis=1) for x in (dk, dv)]
    return tuple(x.transpose(1, 0, 2) for x in (dq, *grouped))


lengths = st.lists(st.integers(0, 40), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(lq=lengths, data=st.data(), causal=st.sampled_from([False, True, "bottom_right"]),
       window=st.sampled_from([None, (3, 0), (None, 2), (5, 5)]), dropout=st.booleans(), hk=st.sampled_from([1, 2, 4]))
def test_numpy_matches_block_diagonal_dense(lq, data, causal, window, dropout, hk):
    lk = data.draw(st.lists(st.integers(0, 40), min_size=len(lq), max_size=len(lq)))
    rng = np.random.default_rng(len(lq) * 1000 + sum(lq) + 7 * sum(lk))
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hk=hk)
    kw = dict(causal=causal, window=window, dropout_p=0.25 if dropout else 0.0, seed=11 if dropout else None)
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    ref_out, ref_lse = _dense(q, k, v, cu_q, cu_k, causal, window, kw["dropout_p"], kw["seed"])
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-12)
    dout = rng.standard_normal(out.shape)
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
    for g, r in zip(grads, _dense(q, k, v, cu_q, cu_k, causal, window, kw["dropout_p"], kw["seed"], dout=dout)):
        np.testing.assert_allclose(g, r, atol=1e-11)


def test_pack_unpack_round_trip_and_empty_sequences():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((n, 3, 4)) for n in (2, 0, 5, 1)]
    packed, cu = varlen.pack(arrays)
    assert packed.shape == (8, 3, 4) and cu.dtype == np.int32 and cu.tolist() == [0, 2, 2, 7, 8]
    for a, b in zip(varlen.unpack(packed, cu), arrays):
        np.testing.assert_array_equal(a, b)
    q, k, v, cu_q, cu_k = _packed(rng, [0, 3], [4, 0])
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k)
    assert (out == 0).all() and np.isneginf(lse).all()   # sequence 1's queries have no keys
    dq, dk, dv = varlen.attention_varlen_backward(np.ones_like(out), q, k, v, out, lse, cu_q, cu_k)
    assert not dq.any() and not dk.any() and not dv.any()


def test_vjp_varlen_draws_and_keeps_a_seed():
    rng = np.random.default_rng(1)
    q, k, v, cu_q, cu_k = _packed(rng, [6, 9], [6, 9])
    out, fn = varlen.vjp_varlen(q, k, v, cu_q, cu_k, causal=True, dropout_p=0.5)
    assert fn.seed is not None
    kw = dict(causal=True, dropout_p=0.5, seed=fn.seed)
    again, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    np.testing.assert_array_equal(out, again)
    dout = rng.standard_normal(out.shape)
    want = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
    for g, w in zip(fn(dout), want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("cu_q,error,match", [
    (np.array([1, 3, 5], dtype=np.int32), ValueError, "start at 0"),
    (np.array([0, 4, 3, 5], dtype=np.int32), ValueError, "not decrease"),
    (np.array([0, 3, 6], dtype=np.int32), ValueError, "ends at 6"),
    (np.array([0, 3, 5], dtype=np.float64), TypeError, "int32 or int64"),
    (np.array([[0, 3, 5]], dtype=np.int64), ValueError, "1-D"),
    (np.zeros(0, dtype=np.int32), ValueError, "1-D"),
    ([0, 3, 5], TypeError, "NumPy or CuPy"),
    (np.array([0, 5], dtype=np.int32), ValueError, "1 sequences, cu_seqlens_k 2"),
])
def test_bad_offsets_refused(cu_q, error, match):
    rng = np.random.default_rng(2)
    q, k, v, _, cu_k = _packed(rng, [3, 2], [3, 2])
    with pytest.raises(error, match=match):
        varlen.attention_varlen_forward(q, k, v, cu_q, cu_k)


def test_bad_packed_arrays_refused():
    rng = np.random.default_rng(3)
    q, k, v, cu_q, cu_k = _packed(rng, [3, 2], [3, 2])
    with pytest.raises(ValueError, match="packed as"):
        varlen.attention_varlen_forward(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="multiple"):
        varlen.attention_varlen_forward(np.zeros((5, 3, 8)), k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="seed"):
        varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, dropout_p=0.1)
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="lse must have shape"):
        varlen.attention_varlen_backward(out, q, k, v, out, lse.T, cu_q, cu_k)
    with pytest.raises(ValueError, match="pack needs"):
        varlen.pack([])
    with pytest.raises(ValueError, match="every array"):
        varlen.pack([np.zeros((2, 3, 4)), np.zeros((2, 2, 4))])
    with pytest.raises(ValueError, match=r"must be \(L, H, D\)"):
        varlen.pack([np.zeros(3)])
    # messages name the packed shapes the caller passed
    with pytest.raises(ValueError, match=r"sequence lengths differ: k \(5, 2, 8\), v \(6, 2, 8\)"):
        varlen.attention_varlen(q, k, np.zeros((6, 2, 8)), cu_q, cu_k)
    with pytest.raises(ValueError, match=r"head dims differ: q \(5, 4, 8\), k \(5, 2, 4\)"):
        varlen.attention_varlen(q, k[..., :4], v, cu_q, cu_k)
    with pytest.raises(ValueError, match=r"head counts differ: k \(5, 2, 8\), v \(5, 1, 8\)"):
        varlen.attention_varlen(q, k, v[:, :1], cu_q, cu_k)


def _mods_per_sequence():
    """(score_mod, mask_mod) pairs for varlen: ALiBi (positions), softcap, T5's trainable table, a custom mask."""
    import cuflash
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    table = np.random.default_rng(9).standard_normal((32, 4)) * 0.5
    window = cuflash.MaskMod("kv_idx >= q_idx - 5", python=lambda b, h, q, kv: kv >= q - 5, name="last6")
    return {"alibi": dict(score_mod=cuflash.alibi(slopes)),
            "softcap+mask": dict(score_mod=cuflash.softcap(2.0), mask_mod=window),
            "t5": dict(score_mod=cuflash.relative_position_bias(table, max_distance=20))}


@pytest.mark.parametrize("kind", ["alibi", "softcap+mask", "t5"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_modifications_apply_to_each_sequence_as_its_own_call(kind, causal):
    """score_mod / mask_mod: each packed sequence's rows, gradients and (T5) table gradient as the same
    modification over that sequence alone gives them (positions from the sequence's first row); the table's
    gradient summed over the sequences."""
    import cuflash
    rng = np.random.default_rng(8)
    q, k, v, cu_q, cu_k = _packed(rng, [7, 0, 12, 1], [9, 3, 12, 4])
    opts = _mods_per_sequence()[kind]
    out, vjp_fn = varlen.vjp_varlen(q, k, v, cu_q, cu_k, causal=causal, **opts)
    dout = rng.standard_normal(out.shape)
    grads = vjp_fn(dout)
    assert len(grads) == (4 if kind == "t5" else 3)
    table_grad = 0
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        qb, kb, vb, db = (x.transpose(1, 0, 2) for x in (q[rows], k[keys], v[keys], dout[rows]))
        want, want_vjp = cuflash.vjp(qb, kb, vb, causal=causal, **opts)
        np.testing.assert_allclose(out[rows].transpose(1, 0, 2), want, rtol=1e-12, atol=1e-12)
        wg = want_vjp(db)
        for g, w, span in zip(grads[:3], wg[:3], (rows, keys, keys)):
            np.testing.assert_allclose(g[span].transpose(1, 0, 2), w, rtol=1e-10, atol=1e-12)
        if kind == "t5":
            table_grad = table_grad + wg[-1]["table"]
    if kind == "t5":
        np.testing.assert_allclose(grads[-1]["table"], table_grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"slopes has shape \(2,\); this call needs \(4,\)"):
        varlen.attention_varlen(q, k, v, cu_q, cu_k, score_mod=cuflash.alibi(np.ones(2, np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["alibi", "softcap+mask", "t5"])
def test_cupy_modifications_match_numpy(dtype, kind):
    """score_mod / mask_mod on the GPU (the dense kernels once a sequence): forward, backward and the T5 table's
    gradient within the dtype's error budget of the float64 NumPy results."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(10)
    q, k, v, cu_q, cu_k = _ragged(rng, dtype)
    host = _mods_per_sequence()[kind]
    dev = {name: m.on(cp) for name, m in host.items()}
    out, vjp_fn = varlen.vjp_varlen(q, k, v, cu_q, cu_k, causal="bottom_right", **host)
    dout = rng.standard_normal(out.shape).astype(DTYPES[dtype])
    grads = vjp_fn(dout)
    out_d, vjp_d = varlen.vjp_varlen(*(cp.asarray(x) for x in (q, k, v)), cu_q, cu_k, causal="bottom_right", **dev)
    grads_d = vjp_d(cp.asarray(dout))
    _close_to_numpy(dict(out=out_d, grads=grads_d[:3], params=grads_d[3:] and grads_d[3]),
                    dict(out=out, grads=grads[:3], params=grads[3:] and grads[3]), GPU_TOL[dtype])


def test_max_seqlen_bounds_checked():
    """FlashAttention's max_seqlen_q / max_seqlen_k: optional, an int at least the longest sequence."""
    rng = np.random.default_rng(7)
    q, k, v, cu_q, cu_k = _packed(rng, [3, 2], [4, 1])
    want = varlen.attention_varlen(q, k, v, cu_q, cu_k)
    np.testing.assert_array_equal(varlen.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=9), want)
    with pytest.raises(ValueError, match="max_seqlen_q=2 but a sequence has 3 rows"):
        varlen.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=2)
    with pytest.raises(ValueError, match="max_seqlen_k=3 but a sequence has 4 rows"):
        varlen.vjp_varlen(q, k, v, cu_q, cu_k, max_seqlen_k=3)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, max_seqlen_k=4.0)
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        varlen.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@settings(max_examples=6, deadline=None)
@given(lq=st.lists(st.integers(0, 300), min_size=1, max_size=6), data=st.data(), d=st.sampled_from([32, 64, 128]),
       causal=st.sampled_from([False, True, "bottom_right"]), deterministic=st.booleans())
def test_gpu_sequences_match_each_sequence_alone(dtype, lq, data, d, causal, deterministic):
    """Drawn length lists (0 and 1 included, keys as many as queries or not): every packed sequence's rows
    and gradients on the GPU within the dtype's error budget of that sequence's exact attention alone, 0 and
    lse -inf where a row sees no key, 0 for keys no query sees, and bitwise equal gradients run to run
    where deterministic (_gpu_checks.check_packed)."""
    from _gpu_checks import check_packed
    lk = data.draw(st.lists(st.integers(0, 300), min_size=len(lq), max_size=len(lq)))
    check_packed(dtype, 4, 2, (lq, lk), d, causal, seed=sum(lq) + 3 * sum(lk) + d, backward=True,
                 deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_cupy_matches_numpy(dtype, causal):
    """Every dtype on the GPU, with GQA, a window, empty and one-row sequences, CuPy offsets: forward and
    backward within the dtype's error budget of the float64 NumPy results."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(4)
    q, k, v, cu_q, cu_k = _ragged(rng, dtype)
    window = (40, 3)
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, window=window)
    dout = rng.standard_normal(out.shape).astype(DTYPES[dtype])
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, window=window)
    dev = [cp.asarray(x) for x in (q, k, v)]
    dout_d = cp.asarray(dout)
    out_d, lse_d = varlen.attention_varlen_forward(*dev, cp.asarray(cu_q), cp.asarray(cu_k), causal=causal,
                                                   window=window)
    grads_d = varlen.attention_varlen_backward(dout_d, *dev, out_d, lse_d, cu_q, cu_k, causal=causal, window=window)
    _close_to_numpy(dict(out=out_d, grads=grads_d), dict(out=out, grads=grads), GPU_TOL[dtype])
    np.testing.assert_array_equal(np.isneginf(lse_d.get()), np.isneginf(lse))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [("float16", "highest"), ("bfloat16", "highest"), ("float32", "highest"),
                                             ("float32", "tf32"), ("float64", "highest")])
def test_cupy_strided_views_scale_and_value_dim(dtype, precision):
    """Packed q, k, v as strided views (q, k of one (total, 2, H, D) array, rows far apart; v with a value
    head dim of its own), a scale that is not 1 / sqrt(D), float32 at both precisions: forward and backward
    within the dtype's error budget of the float64 NumPy results on the same data."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(6)
    cu = np.array([0, 129, 130, 130, 400], dtype=np.int32)
    qk = rng.standard_normal((400, 2, 4, 64)).astype(DTYPES[dtype])
    v = rng.standard_normal((400, 4, 40)).astype(DTYPES[dtype])
    kw = dict(causal="bottom_right", scale=0.3, precision=precision)
    out, lse = varlen.attention_varlen_forward(qk[:, 0], qk[:, 1], v, cu, cu, **kw)
    dout = rng.standard_normal(out.shape).astype(DTYPES[dtype])
    grads = varlen.attention_varlen_backward(dout, qk[:, 0], qk[:, 1], v, out, lse, cu, cu, **kw)
    qk_d, v_d = cp.asarray(qk), cp.asarray(v)
    out_d, lse_d = varlen.attention_varlen_forward(qk_d[:, 0], qk_d[:, 1], v_d, cu, cu, **kw)
    grads_d = varlen.attention_varlen_backward(cp.asarray(dout), qk_d[:, 0], qk_d[:, 1], v_d, out_d, lse_d, cu, cu,
                                               **kw)
    tol = 3e-3 if precision == "tf32" else GPU_TOL[dtype]
    _close_to_numpy(dict(out=out_d, lse=lse_d, grads=grads_d), dict(out=out, lse=lse, grads=grads), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("lengths", [[129, 1, 0, 270], [100] * 4])
def test_cupy_heads_whose_rows_start_unaligned(dtype, lengths):
    """q, k, v sliced from rows of 68 elements to head dim 64, (total, H, 68)[..., :64]: heads 136 bytes apart, so
    rows of odd heads do not start 16-byte aligned and the kernels load elements; ragged lengths (the packed
    path) and equal ones (the dense kernels): forward and backward within the dtype's error budget of the float64
    NumPy results on the same data."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(8)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    wide = rng.standard_normal((3, int(cu[-1]), 4, 68)).astype(DTYPES[dtype])
    q, k, v = (x[..., :64] for x in wide)
    kw = dict(causal="bottom_right", window=(50, None))
    out, lse = varlen.attention_varlen_forward(q, k, v, cu, cu, **kw)
    dout = rng.standard_normal(out.shape).astype(DTYPES[dtype])
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, **kw)
    q_d, k_d, v_d = (x[..., :64] for x in cp.asarray(wide))
    out_d, lse_d = varlen.attention_varlen_forward(q_d, k_d, v_d, cu, cu, **kw)
    grads_d = varlen.attention_varlen_backward(cp.asarray(dout), q_d, k_d, v_d, out_d, lse_d, cu, cu, **kw)
    _close_to_numpy(dict(out=out_d, grads=grads_d), dict(out=out, grads=grads), GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_cupy_dropout_drops_what_numpy_drops(dtype, causal):
    """Dropout on the GPU (the dense kernels a sequence, each at its sequence's origin): the NumPy path's
    mask, sequences starting at keys of every residue mod 4; forward and backward within the dtype's
    error budget of the float64 NumPy results, and the mask dropped something."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    q, k, v, cu_q, cu_k = _packed(rng, [70, 0, 3, 130, 9], [93, 5, 2, 130, 11], hq=4, hk=2, d=64, dv=64,
                                  dtype=DTYPES[dtype])
    kw = dict(causal=causal, window=(40, None), dropout_p=0.2, seed=123)
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    dout = rng.standard_normal(out.shape).astype(DTYPES[dtype])
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
    dev = [cp.asarray(x) for x in (q, k, v)]
    out_d, lse_d = varlen.attention_varlen_forward(*dev, cu_q, cu_k, **kw)
    grads_d = varlen.attention_varlen_backward(cp.asarray(dout), *dev, out_d, lse_d, cu_q, cu_k, **kw)
    _close_to_numpy(dict(out=out_d, grads=grads_d), dict(out=out, grads=grads), GPU_TOL[dtype])
    plain = varlen.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=(40, None))
    assert rel_error(out.astype(np.float64), plain.astype(np.float64)) > 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [("float16", "highest"), ("bfloat16", "highest"), ("float32", "highest"),
                                             ("float32", "tf32"), ("float64", "highest")])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), ("bottom_right", (50, None)), (False, (30, 7))])
@pytest.mark.parametrize("strided", [False, True])
def test_equal_lengths_run_the_dense_kernels_in_place(dtype, precision, d, causal, window, strided, launches):
    """Five sequences of 96 queries over 160 keys each (GQA 6 / 2; ``strided``: 80 keys each, q and k strided
    views of one array): one dense forward launch writing the packed out and lse, within the dtype's budget of
    the float64 block-diagonal reference; the dense backward from them (no packed kernel) writing packed
    gradients, within it of the float64 NumPy path's."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(d + 7)
    lq, lk = [96] * 5, [160] * 5
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq=6, hk=2, d=d, dv=d, dtype=DTYPES[dtype])
    dev = [cp.asarray(x) for x in (q, k, v)]
    if strided:   # q (480, 6, d) and k (400, 2, d) views of one array, rows 2 x 6 x d apart: 80 keys a sequence
        both = rng.standard_normal((480, 2, 6, d)).astype(q.dtype)
        q, k, v, cu_k = both[:, 0], both[:400, 1, :2], v[:400], cu_k // 2
        both_d = cp.asarray(both)
        dev = [both_d[:, 0], both_d[:400, 1, :2], dev[2][:400]]
    kw = dict(causal=causal, window=window, precision=precision)
    out_d, lse_d = varlen.attention_varlen_forward(*dev, cu_q, cu_k, **kw)
    assert len(launches) == 1 and not launches[0].packed
    assert out_d.shape == (480, 6, d) and out_d.flags.c_contiguous and lse_d.shape == (6, 480)
    ref_out, ref_lse = _dense(q, k, v, cu_q, cu_k, causal, window)
    tol = 3e-3 if precision == "tf32" else GPU_TOL[dtype]
    assert rel_error(out_d.get().astype(np.float64), ref_out) < tol
    np.testing.assert_array_equal(np.isneginf(lse_d.get()), np.isneginf(ref_lse))
    live = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_d.get()[live], ref_lse[live], atol=2e-3)
    dout = rng.standard_normal(out_d.shape).astype(DTYPES[dtype])
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, **kw)
    grads = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
    launches.clear()
    grads_d = varlen.attention_varlen_backward(cp.asarray(dout), *dev, out_d, lse_d, cu_q, cu_k, **kw)
    assert launches and not any(x.packed for x in launches)
    assert [g.shape for g in grads_d] == [x.shape for x in dev] and all(g.flags.c_contiguous for g in grads_d)
    _close_to_numpy(dict(grads=grads_d), dict(grads=grads), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), ("bottom_right", None), (False, (100, 20)),
                                           ("bottom_right", (64, None))])
def test_packed_kernel_matches_the_reference(dtype, d, causal, window, launches):
    """The forward's one kernel over every sequence (16-bit: PACKED fwd_wgmma on Hopper at head dims 64-256,
    else fwd_mma; float32: PACKED fwd_wgmma_tf32x3 on Hopper at head dims 64 and 128, else fwd_tf32x3, and a
    dense launch a sequence at 256): one long sequence among short ones, empty and one-row sequences,
    sequences with no keys, more keys than queries and fewer, GQA; every row against the float64
    block-diagonal reference."""
    from cuflash._runtime import device
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(d)
    lq = [700, 1, 0, 33, 64, 65, 5, 130]
    lk = [650, 1, 4, 0, 64, 200, 70, 3]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq=6, hk=2, d=d, dv=d, dtype=DTYPES[dtype])
    out, lse = varlen.attention_varlen_forward(*(cp.asarray(x) for x in (q, k, v)), cu_q, cp.asarray(cu_k),
                                               causal=causal, window=window)
    if dtype != "float32":
        assert [x.packed for x in launches] == [True]
    elif d in (64, 128) and device.compute_capability() == 90:
        assert [(x.family, x.packed) for x in launches] == [("fwd_wgmma_tf32x3", True)]
    elif d < 256:
        assert [(x.family, x.packed) for x in launches] == [("fwd_tf32x3", True)]
    else:   # head dim 256: the FMA forward, a dense launch a sequence
        assert launches and not any(x.packed for x in launches)
    ref_out, ref_lse = _dense(q, k, v, cu_q, cu_k, causal, window)
    tol = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5}[dtype]
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_error(got, ref_out) < tol
    np.testing.assert_array_equal(np.isneginf(lse.get()), np.isneginf(ref_lse))
    live = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse.get()[live], ref_lse[live], atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", [64, 128])
def test_a_neighbours_non_finite_rows_stay_out(dtype, d):
    """A tile of a sequence's queries or keys that runs past its end holds the next sequence's rows (the
    Hopper copy engine loads whole tiles of the packed arrays): NaN queries and infinite keys and values
    there leave the sequences around them finite and exact, forward and backward."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(d + 2)
    lq, lk = [100, 50, 77], [130, 40, 90]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq=4, hk=2, d=d, dv=d, dtype=DTYPES[dtype])
    dout = rng.standard_normal(q.shape).astype(DTYPES[dtype])
    want_out, _ = _dense(q, k, v, cu_q, cu_k, False, None)
    want_grads = _dense(q, k, v, cu_q, cu_k, False, None, dout=dout)
    bad_q, bad_k = slice(cu_q[1], cu_q[2]), slice(cu_k[1], cu_k[2])
    q[bad_q], k[bad_k], v[bad_k] = np.nan, np.inf, -np.inf
    dev = [cp.asarray(x) for x in (q, k, v)]
    out, lse = varlen.attention_varlen_forward(*dev, cu_q, cu_k)
    grads = varlen.attention_varlen_backward(cp.asarray(dout), *dev, out, lse, cu_q, cu_k)
    tol = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    for b in (0, 2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        got = out.get()[rows].astype(np.float64)
        assert np.isfinite(got).all(), f"sequence {b}"
        assert rel_error(got, want_out[rows]) < tol, f"sequence {b}"
        for name, g, w, span in zip(("dq", "dk", "dv"), grads, want_grads, (rows, keys, keys)):
            got = g.get()[span].astype(np.float64)
            assert np.isfinite(got).all(), f"sequence {b} {name}"
            assert rel_error(got, w[span]) < 4 * tol, f"sequence {b} {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), ("bottom_right", (64, None))])
@pytest.mark.parametrize("deterministic", [True, False])
def test_packed_backward_matches_the_reference(dtype, d, causal, window, deterministic, launches):
    """The packed backward kernels: dsum, PACKED dK/dV (float32 at head dim 128: its dV and dK passes) and
    PACKED dQ (tensor cores: 16 bits, float32's 3xTF32, float64); not deterministic, float32's and float64's
    PACKED dK/dV adding dQ with atomics and the convert kernel, and on Hopper, 16-bit rows at head dims 64 and
    128, the PACKED wgmma dK/dV kernel and the convert kernel: gradients of every packed row against the
    float64 block-diagonal reference, 0 for keys no query sees, bitwise equal run to run where deterministic."""
    from cuflash._runtime import device
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(d + 1)
    lq = [700, 1, 0, 33, 64, 65, 5, 130]
    lk = [650, 1, 4, 0, 64, 200, 70, 3]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, hq=6, hk=2, d=d, dv=d, dtype=DTYPES[dtype])
    dout = rng.standard_normal((sum(lq), 6, d)).astype(DTYPES[dtype])
    dev = [cp.asarray(x) for x in (q, k, v)]
    out, lse = varlen.attention_varlen_forward(*dev, cu_q, cu_k, causal=causal, window=window)
    launches.clear()
    grads = varlen.attention_varlen_backward(cp.asarray(dout), *dev, out, lse, cu_q, cu_k, causal=causal,
                                             window=window, deterministic=deterministic)
    kind = {"float64": "dmma", "float32": "tf32x3"}.get(dtype, "mma")
    if not deterministic and dtype in ("float16", "bfloat16") and d in (64, 128) and device.compute_capability() == 90:
        assert [x.family for x in launches] == ["bwd_dsum", "bwd_dkdv_wgmma", "bwd_convert_dq"]
        assert launches[1].packed
    else:
        if dtype == "float32" and d == 128 and device.smem_limit() < 102400:   # no 3xTF32 tile fits: dense
            assert not any(x.packed for x in launches)
        else:   # float32 at head dim 128: the dK/dV kernel in one pass or two (dV, then dK), by the GPU's tile
            passes = len(launches) - 2 if dtype == "float32" and d == 128 else 1
            assert passes in (1, 2)
            atomic = not deterministic and dtype in ("float32", "float64")   # dK/dV adds dQ, convert writes it
            last = "bwd_convert_dq" if atomic else f"bwd_dq_{kind}"
            assert [x.family for x in launches] == ["bwd_dsum"] + passes * [f"bwd_dkdv_{kind}"] + [last]
            assert all(x.packed for x in launches[1:1 + passes]) and launches[-1].packed != atomic
            assert launches[passes].atomic_dq == atomic
    if deterministic:
        again = varlen.attention_varlen_backward(cp.asarray(dout), *dev, out, lse, cu_q, cu_k, causal=causal,
                                                 window=window, deterministic=True)
        for a, b in zip(grads, again):
            np.testing.assert_array_equal(a.get().view(np.uint8), b.get().view(np.uint8))
    want = _dense(q, k, v, cu_q, cu_k, causal, window, dout=dout)
    tol = {"float16": 1e-2, "bfloat16": 6e-2, "float32": 1e-4, "float64": 1e-10}[dtype]
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        got = g.get().astype(np.float64)
        assert np.isfinite(got).all(), name
        assert rel_error(got, w) < tol, name
    assert not grads[1].get()[cu_k[2]:cu_k[3]].any()   # sequence 2 has keys and no queries
