"""attention_with_kvcache: ragged cache lengths, the append in place (nothing else in the cache
changes), causal per sequence, windows, GQA, empty sequences, bad input refused before anything is
written; on NumPy arrays, and with marker `gpu` on CuPy arrays of every dtype."""
import ml_dtypes
import numpy as np
import pytest
from _nvrtc import needs_nvrtc
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash

DEVICES = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)]
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def _xp(name):
    if name == "numpy":
        return np
    return pytest.importorskip("cupy")


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _setup(xp, dtype=np.float64, b=3, hq=4, hk=2, lq=2, cap=40, n_new=3, d=8, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(dtype) for s in
              ((b, hq, lq, d), (b, hk, cap, d), (b, hk, cap, d), (b, hk, n_new, d), (b, hk, n_new, d))]
    return [xp.asarray(a) for a in arrays]


def _expected(q, kc, vc, kn, vn, lengths, causal, window=None):
    """Per sequence: its valid cache keys, then the new ones, attended by the NumPy reference."""
    outs = []
    for bi, n in enumerate(lengths):
        k = np.concatenate([kc[bi, :, :n], kn[bi]], axis=1).astype(np.float64)
        v = np.concatenate([vc[bi, :, :n], vn[bi]], axis=1).astype(np.float64)
        if k.shape[1] == 0:
            outs.append(np.zeros(q.shape[1:3] + (v.shape[-1],)))
            continue
        lq, lk = q.shape[2], k.shape[1]
        diagonal = np.arange(lq)[:, None] + lk - lq               # the sequence's own bottom right
        j = np.arange(lk)[None, :]
        allowed = np.ones((lq, lk), dtype=bool)
        if causal:
            allowed &= j <= diagonal
        if window is not None:
            allowed &= (j >= diagonal - window[0]) & (j <= diagonal + window[1])
        outs.append(cuflash.attention(q[bi].astype(np.float64), k, v, mask=allowed))
    return np.stack(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_matches_attention_over_each_sequence(device, causal, window):
    xp = _xp(device)
    q, kc, vc, kn, vn = _setup(xp)
    lengths = np.array([0, 17, 37])
    before_k, before_v = _host(kc).copy(), _host(vc).copy()
    out = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=xp.asarray(lengths), causal=causal,
                                         window=window)
    want = _expected(_host(q), before_k, before_v, _host(kn), _host(vn), lengths, causal, window)
    np.testing.assert_allclose(_host(out), want, rtol=1e-10, atol=1e-12)
    after_k, after_v = _host(kc), _host(vc)
    for bi, n in enumerate(lengths):   # the new keys at n .. n + 2, every other slot as it was
        np.testing.assert_array_equal(after_k[bi, :, n:n + 3], _host(kn)[bi])
        np.testing.assert_array_equal(after_v[bi, :, n:n + 3], _host(vn)[bi])
        keep = np.ones(40, dtype=bool)
        keep[n:n + 3] = False
        np.testing.assert_array_equal(after_k[bi][:, keep], before_k[bi][:, keep])
        np.testing.assert_array_equal(after_v[bi][:, keep], before_v[bi][:, keep])


@pytest.mark.parametrize("device, dtype", [("numpy", "float64")] + [pytest.param("cupy", t, marks=pytest.mark.gpu)
                                                                     for t in DTYPES])
@pytest.mark.parametrize("lq", [1, 3, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 7, 64])
def test_a_decoding_loop_over_shuffled_pages(device, dtype, lq, num_splits):
    """Three steps of a decoding loop (each appends lq keys and attends lq queries, causal, GQA 8 / 2 heads)
    into a paged cache of 16-position pages in shuffled order, held as a (num_pages, page_size, Hk, D) store
    seen through swapaxes (no copy); splits forced from 1 to 64: every step within the dtype's error of
    the reference over the keys so far, and the store holds every appended key at its page and slot."""
    xp = _xp(device)
    rng = np.random.default_rng(lq + 10 * (num_splits or 0))
    b, hq, hk, d, page, steps = 3, 8, 2, 16, 16, 3
    lengths = np.array([0, 9, 30])
    per_seq = (int(lengths.max()) + steps * lq + page - 1) // page
    table = rng.permutation(b * per_seq + 4)[:b * per_seq].reshape(b, per_seq)
    store_k = rng.standard_normal((b * per_seq + 4, page, hk, d)).astype(DTYPES[dtype])
    store_v = rng.standard_normal(store_k.shape).astype(DTYPES[dtype])
    def in_order(store, bi):   # sequence bi's positions (Hk, pages x page, D) from its pages
        return store[table[bi]].transpose(2, 0, 1, 3).reshape(hk, -1, d)

    valid_k = [in_order(store_k, bi)[:, :n].copy() for bi, n in enumerate(lengths)]
    valid_v = [in_order(store_v, bi)[:, :n].copy() for bi, n in enumerate(lengths)]
    sk, sv, tab = xp.asarray(store_k), xp.asarray(store_v), xp.asarray(table)
    tol = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    for step in range(steps):
        q = rng.standard_normal((b, hq, lq, d)).astype(DTYPES[dtype])
        kn, vn = (rng.standard_normal((b, hk, lq, d)).astype(DTYPES[dtype]) for _ in range(2))
        out = cuflash.attention_with_kvcache(xp.asarray(q), sk.swapaxes(1, 2), sv.swapaxes(1, 2), xp.asarray(kn),
                                             xp.asarray(vn), cache_seqlens=xp.asarray(lengths), causal=True,
                                             block_table=tab, num_splits=num_splits)
        valid_k = [np.concatenate([valid_k[bi], kn[bi]], axis=1) for bi in range(b)]
        valid_v = [np.concatenate([valid_v[bi], vn[bi]], axis=1) for bi in range(b)]
        lengths = lengths + lq
        for bi in range(b):
            want = cuflash.attention(q[bi].astype(np.float64), valid_k[bi].astype(np.float64),
                                     valid_v[bi].astype(np.float64), causal="bottom_right")
            got = _host(out)[bi].astype(np.float64)
            assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), (step, bi)
    held_k = _host(sk)
    for bi, n in enumerate(lengths):
        np.testing.assert_array_equal(in_order(held_k, bi)[:, :n], valid_k[bi])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_and_a_strided_cache(device, dtype):
    xp = _xp(device)
    q, kc, vc, kn, vn = _setup(xp, DTYPES[dtype], lq=1, n_new=1)
    # the caches as (B, Lcap, Hk, D) memory seen as (B, Hk, Lcap, D)
    kc, vc = (xp.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (kc, vc))
    lengths = np.array([3, 30, 38])
    before_k, before_v = _host(kc).copy(), _host(vc).copy()
    out, lse = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=xp.asarray(lengths), causal=True,
                                              return_lse=True)
    assert out.dtype == np.dtype(DTYPES[dtype]) and lse.shape == (3, 4, 1)
    want = _expected(_host(q), before_k, before_v, _host(kn), _host(vn), lengths, True)
    tol = {"float64": 1e-10, "float32": 1e-5}.get(dtype, 2e-2)
    np.testing.assert_allclose(_host(out).astype(np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_no_new_keys_and_an_int_length(device):
    xp = _xp(device)
    q, kc, vc, _, _ = _setup(xp)
    out = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=25, causal=True)
    want = cuflash.attention(_host(q), _host(kc)[:, :, :25], _host(vc)[:, :, :25], causal="bottom_right")
    np.testing.assert_allclose(_host(out), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(cache_seqlens=np.array([0, 5, 38])), ValueError, "past the cache's 40"),
    (dict(cache_seqlens=np.array([0, -1, 3])), ValueError, ">= 0"),
    (dict(cache_seqlens=np.array([1.0, 2.0, 3.0])), TypeError, "integers"),
    (dict(cache_seqlens=np.array([1, 2])), ValueError, r"shape \(3,\)"),
    (dict(cache_seqlens="3"), TypeError, "int or an integer array"),
    (dict(cache_seqlens=3, window=5), ValueError, "window"),
    (dict(cache_seqlens=3, window=(-3, 0)), ValueError, "window"),
    (dict(cache_seqlens=3, window=(2.5, 0)), ValueError, "window"),
    (dict(cache_seqlens=3, window=("a", 0)), ValueError, "window"),
    (dict(cache_seqlens=3, scale=float("nan")), ValueError, "scale"),
    (dict(cache_seqlens=3, num_splits=0), ValueError, "num_splits"),
    (dict(cache_seqlens=3, num_splits=1.5), TypeError, "num_splits"),
    (dict(cache_seqlens=3, causal="top_left"), TypeError, "causal must be True or False"),
])
def test_bad_input_is_refused_and_the_cache_untouched(kwargs, err, match):
    q, kc, vc, kn, vn = _setup(np)
    before = kc.copy()
    with pytest.raises(err, match=match):
        cuflash.attention_with_kvcache(q, kc, vc, kn, vn, **kwargs)
    np.testing.assert_array_equal(kc, before)


def test_mismatched_arrays_are_refused():
    q, kc, vc, kn, vn = _setup(np)
    with pytest.raises(ValueError, match="go together"):
        cuflash.attention_with_kvcache(q, kc, vc, kn, None, cache_seqlens=1)
    with pytest.raises(TypeError, match="dtype"):
        cuflash.attention_with_kvcache(q, kc.astype(np.float32), vc, cache_seqlens=1)
    with pytest.raises(ValueError, match="k_new"):
        cuflash.attention_with_kvcache(q, kc, vc, kn[:, :1], vn[:, :1], cache_seqlens=1)
    before = kc.copy()
    with pytest.raises(ValueError, match="not a multiple"):
        cuflash.attention_with_kvcache(q[:, :3], kc, vc, kn, vn, cache_seqlens=1)
    wide = [np.zeros(x.shape[:3] + (300,)) for x in (q, kc, vc, kn, vn)]
    with pytest.raises(ValueError, match="head dims up to 256"):
        cuflash.attention_with_kvcache(*wide, cache_seqlens=1)
    np.testing.assert_array_equal(kc, before)


def _paged(xp, kc, vc, page_size, seed=3):
    """The same caches as shuffled pages (num_pages, Hk, page_size, D) and their block table."""
    b, hk, cap, d = kc.shape
    per_seq = cap // page_size
    order = np.random.default_rng(seed).permutation(b * per_seq + 5)[:b * per_seq]     # 5 spare pages
    table = order.reshape(b, per_seq)
    k_pages = np.zeros((b * per_seq + 5, hk, page_size, d), dtype=kc.dtype)
    v_pages = np.zeros_like(k_pages)
    for bi in range(b):
        for j in range(per_seq):
            k_pages[table[bi, j]] = kc[bi, :, j * page_size:(j + 1) * page_size]
            v_pages[table[bi, j]] = vc[bi, :, j * page_size:(j + 1) * page_size]
    return xp.asarray(k_pages), xp.asarray(v_pages), xp.asarray(table)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [8, 20])
def test_a_paged_cache_equals_the_contiguous_one(device, page_size):
    xp = _xp(device)
    q, kc, vc, kn, vn = _setup(xp)
    lengths = np.array([5, 17, 33])
    k_pages, v_pages, table = _paged(xp, _host(kc), _host(vc), page_size)
    spare_before = _host(k_pages)[np.setdiff1d(np.arange(k_pages.shape[0]), _host(table))].copy()
    out = cuflash.attention_with_kvcache(q, k_pages, v_pages, kn, vn, cache_seqlens=xp.asarray(lengths), causal=True,
                                         block_table=table)
    want = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=xp.asarray(lengths), causal=True)
    np.testing.assert_allclose(_host(out), _host(want), rtol=1e-12, atol=1e-13)
    pages, tab = _host(k_pages), _host(table)
    for bi, n in enumerate(lengths):   # the new keys landed in the sequence's own pages
        for t in range(3):
            p = n + t
            np.testing.assert_array_equal(pages[tab[bi, p // page_size], :, p % page_size], _host(kn)[bi, :, t])
    spare_after = pages[np.setdiff1d(np.arange(pages.shape[0]), tab)]
    np.testing.assert_array_equal(spare_after, spare_before)   # pages no sequence owns: untouched


def test_bad_page_tables_are_refused():
    q, kc, vc, kn, vn = _setup(np)
    k_pages, v_pages, table = _paged(np, kc, vc, 8)
    bad = table.copy()
    bad[1, 0] = k_pages.shape[0]
    wrapped = table.astype(np.int64)
    wrapped[1, 0] += 2 ** 32                      # an int32 copy would wrap it back into range
    for kwargs, err, match in ((dict(block_table=bad), ValueError, "outside"),
                               (dict(block_table=wrapped), ValueError, "outside"),
                               (dict(block_table=table[:2]), ValueError, "shape"),
                               (dict(block_table=table.astype(np.float32)), ValueError, "integer"),
                               (dict(block_table=table, cache_seqlens=np.array([0, 0, 39])), ValueError, "past")):
        before = k_pages.copy()
        with pytest.raises(err, match=match):
            cuflash.attention_with_kvcache(q, k_pages, v_pages, kn, vn, **{"cache_seqlens": 1, **kwargs})
        np.testing.assert_array_equal(k_pages, before)
    for fill in (-1, 99, -100):                # entries past every sequence's last position: never read
        padded = table.copy()
        padded[:, 1:] = fill
        k2, v2 = k_pages.copy(), v_pages.copy()
        out = cuflash.attention_with_kvcache(q, k2, v2, kn, vn, cache_seqlens=1, block_table=padded)
        want = cuflash.attention_with_kvcache(q, k_pages.copy(), v_pages.copy(), kn, vn, cache_seqlens=1,
                                             block_table=table)
        np.testing.assert_array_equal(out, want)


def test_an_append_into_a_shared_page_is_refused():
    """Sequences may share pages they only read (a common prefix); a page the append writes into, named by
    another used entry (another sequence's, or the same sequence's twice), is refused with the caches
    untouched; a read-only v_cache is refused before k_cache is written."""
    q, kc, vc, kn, vn = _setup(np, b=2)
    k_pages, v_pages, table = _paged(np, kc, vc, 8)      # (2, 5) entries, 15 pages
    shared_prefix = table.copy()
    shared_prefix[1, 0] = table[0, 0]                    # both read page table[0, 0]; appends land in entry 2
    lengths = np.array([20, 20])
    out = cuflash.attention_with_kvcache(q, k_pages.copy(), v_pages.copy(), kn, vn, cache_seqlens=lengths,
                                         block_table=shared_prefix)
    assert np.isfinite(out).all()
    for bad in (np.array([[1, 2, 3, 0, 0], [4, 5, 3, 0, 0]]),    # page 3 takes both sequences' appends
                np.array([[1, 2, 3, 0, 0], [4, 3, 6, 0, 0]]),    # page 3: one's append, the other's keys
                np.array([[1, 3, 3, 0, 0], [4, 5, 6, 0, 0]])):   # page 3 twice in one sequence
        before = k_pages.copy(), v_pages.copy()
        with pytest.raises(ValueError, match="more than once"):
            cuflash.attention_with_kvcache(q, k_pages, v_pages, kn, vn, cache_seqlens=lengths, block_table=bad)
        np.testing.assert_array_equal(k_pages, before[0])
        np.testing.assert_array_equal(v_pages, before[1])
    frozen = vc.copy()
    frozen.flags.writeable = False
    before = kc.copy()
    with pytest.raises(ValueError, match="writeable"):
        cuflash.attention_with_kvcache(q, kc, frozen, kn, vn, cache_seqlens=3)
    np.testing.assert_array_equal(kc, before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("page_size, d", [(16, 64), (64, 128), (256, 128), (8, 40), (24, 64), (16, 128), (4, 64),
                                          (8, 128), (2, 128)])
@pytest.mark.parametrize("lq", [1, 6, 16])
def test_pages_read_in_place_equal_the_contiguous_cache(dtype, page_size, d, lq):
    """The 16-bit split kernels and every dtype's decoding kernel read the pages through the table (no
    gather; the float32 and float64 split twins gather them): the same output as the contiguous cache, for
    ragged lengths and an append; 6 new rows of 4 query heads a K/V head (24 packed rows: the 16-bit decoding
    kernel's two strips at head dim 128, the split twin at 64), 16 (64 rows: the split twin). Pages of at least
    a thread's rows of a tile (8 or 16; float64 at head dim 128: 16 rows of its 48-key tile) take one table
    entry a thread and tile, smaller ones (2, 4, 8 at head dim 128) an entry a row (tile_io.cuh, PageCursor)."""
    cp = pytest.importorskip("cupy")
    cap = 3 * 1024   # whole pages of every size below
    q, kc, vc, kn, vn = _setup(cp, DTYPES[dtype], b=3, hq=8, hk=2, lq=lq, cap=cap, n_new=lq, d=d)
    lengths = cp.asarray([0, 300, cap - lq])
    k_pages, v_pages, table = _paged(cp, _host(kc), _host(vc), page_size)
    out = cuflash.attention_with_kvcache(q, k_pages, v_pages, kn, vn, cache_seqlens=lengths, causal=True,
                                         block_table=table)
    want = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lengths, causal=True)
    np.testing.assert_allclose(_host(out).astype(np.float64), _host(want).astype(np.float64), rtol=1e-6, atol=1e-6)


class _Fetchable(np.ndarray):
    def get(self):
        return np.asarray(self)


class _NumpyAsCupy:
    """The CuPy functions kvcache._check_ranges_on_device calls, on NumPy arrays."""
    arange, maximum, minimum, where, zeros, add = np.arange, np.maximum, np.minimum, np.where, np.zeros, np.add

    @staticmethod
    def concatenate(parts):
        return np.concatenate(parts).view(_Fetchable)


def _refusal(lengths, table, page_size, n_new, num_pages):
    """The rule for lengths and a table, sequence by sequence: the error a call must raise (its message's
    words), or None."""
    cap = table.shape[1] * page_size
    if min(lengths) < 0:
        return ">= 0"
    if max(lengths) + n_new > cap:
        return "past the cache's"
    used = [[int(p) for p in row[:-(-(n + n_new) // page_size)]] for row, n in zip(table, lengths)]
    if any(not 0 <= p < num_pages for row in used for p in row):
        return "outside"
    counts = {}
    for p in (p for row in used for p in row):
        counts[p] = counts.get(p, 0) + 1
    written = [p for row, n in zip(used, lengths) for p in row[n // page_size:]] if n_new else []
    return "more than once" if any(counts[p] > 1 for p in written) else None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_host_checks_follow_the_rule_sequence_by_sequence(data):
    """The host's checks of lengths and a table (an int or NumPy lengths, NumPy tables of any integer dtype and
    byte order, padding past a sequence's pages, pages shared between sequences), and the device's reductions
    for a large table (run on NumPy), refuse exactly what the rule refuses."""
    from cuflash import kvcache

    b = data.draw(st.integers(1, 4))
    page_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    max_pages, num_pages = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 12))
    n_new = data.draw(st.integers(0, 5))
    cap = max_pages * page_size
    dtype = data.draw(st.sampled_from([np.int8, np.int32, np.int64, np.uint16, ">i4", ">i8", ">u2"]))
    low = 0 if np.dtype(dtype).kind == "u" else -2   # (big-endian tables too: NumPy arrays of any byte order)
    table = np.array(data.draw(st.lists(st.lists(st.integers(low, num_pages + 1), min_size=max_pages,
                                                 max_size=max_pages), min_size=b, max_size=b)), dtype=dtype)
    if data.draw(st.booleans()):
        cache_seqlens = data.draw(st.integers(-1, cap + 1))
        lengths = [cache_seqlens] * b
    else:
        lengths = data.draw(st.lists(st.integers(-1, cap + 1), min_size=b, max_size=b))
        cache_seqlens = np.array(lengths, dtype=data.draw(st.sampled_from([np.int32, np.int64])))
    want = _refusal(lengths, table, page_size, n_new, num_pages)
    checks = [lambda: kvcache._check_ranges(cache_seqlens, table, page_size, n_new, cap, num_pages, b, np)]
    if not isinstance(cache_seqlens, int):   # the reductions a large CuPy table takes, here on NumPy arrays
        checks.append(lambda: kvcache._check_ranges_on_device(cache_seqlens, table, page_size, n_new, cap, num_pages,
                                                              _NumpyAsCupy))
    for check in checks:
        if want is None:
            check()
        else:
            with pytest.raises(ValueError, match=want):
                check()


def test_numpy_inputs_are_checked_even_unvalidated():
    q, kc, vc, kn, vn = _setup(np)
    with pytest.raises(ValueError, match="past"):
        cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=np.array([0, 1, 38]), validate=False)
    with pytest.raises(ValueError, match=">= 0"):
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=-1, validate=False)


@pytest.mark.gpu
def test_unvalidated_calls_equal_validated_ones_and_stay_inside_the_cache():
    """validate=False reads nothing back: in-range input gives the validated result bit for bit; lengths
    past the cache or negative are clamped to it, page indices outside the pages to them (no fault)."""
    cp = pytest.importorskip("cupy")
    cap = 512
    q, kc, vc, kn, vn = _setup(cp, np.float16, b=3, hq=8, hk=2, lq=1, cap=cap, n_new=1, d=64)
    lengths = cp.asarray([0, 300, cap - 2])
    kc2, vc2 = kc.copy(), vc.copy()
    want = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lengths, causal=True)
    got = cuflash.attention_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=lengths, causal=True, validate=False)
    np.testing.assert_array_equal(_host(got), _host(want))
    np.testing.assert_array_equal(_host(kc2), _host(kc))
    out = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=cp.asarray([cap + 88, -5, cap]), causal=True,
                                         validate=False)
    clamped = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=cp.asarray([cap, 0, cap]), causal=True)
    np.testing.assert_array_equal(_host(out), _host(clamped))
    k_pages, v_pages, table = _paged(cp, _host(kc), _host(vc), 16)
    bad = table.copy()
    bad[1, 3], bad[2, 0] = 10 ** 6, -7
    out = cuflash.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, causal=True, block_table=bad,
                                         validate=False)
    assert bool(cp.isfinite(out.astype(cp.float32)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [False, True])
def test_cache_rows_past_each_length_are_never_used(dtype, paged):
    """The free room past each sequence (here NaN) never reaches the result, not even as 0 x NaN in P V:
    the kernels copy zeros from each sequence's own key count on."""
    cp = pytest.importorskip("cupy")
    cap, lengths = 1024, [0, 300, 1000]
    q, kc, vc, kn, vn = _setup(cp, DTYPES[dtype], b=3, hq=8, hk=2, lq=1, cap=cap, n_new=1, d=64)
    dirty_k, dirty_v = kc.copy(), vc.copy()
    for bi, n in enumerate(lengths):
        dirty_k[bi, :, n:] = cp.nan
        dirty_v[bi, :, n:] = cp.nan
    results = []
    for k_cache, v_cache in ((kc, vc), (dirty_k, dirty_v)):
        table = None
        if paged:
            k_cache, v_cache, table = _paged(cp, _host(k_cache), _host(v_cache), 16)
        results.append(cuflash.attention_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=cp.asarray(lengths),
                                                       causal=True, block_table=table))
    clean, dirty = (_host(r).astype(np.float64) for r in results)
    assert np.isfinite(dirty).all()
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal, window", [(True, None), (False, (5, 2))])
def test_free_room_never_reaches_the_result(device, causal, window):
    """NaN in the room past each sequence: the result equals a clean cache's (the masked paths take V
    with zeros there; the split kernels copy zeros from each sequence's key count on)."""
    xp = _xp(device)
    q, kc, vc, kn, vn = _setup(xp)
    lengths = [5, 17, 33]
    dirty_k, dirty_v = kc.copy(), vc.copy()
    for bi, n in enumerate(lengths):
        dirty_k[bi, :, n:] = np.nan
        dirty_v[bi, :, n:] = np.nan
    clean = cuflash.attention_with_kvcache(q, kc.copy(), vc.copy(), kn, vn, cache_seqlens=xp.asarray(lengths),
                                           causal=causal, window=window)
    dirty = cuflash.attention_with_kvcache(q, dirty_k, dirty_v, kn, vn, cache_seqlens=xp.asarray(lengths),
                                           causal=causal, window=window)
    assert np.isfinite(_host(dirty)).all()
    np.testing.assert_allclose(_host(dirty), _host(clean), rtol=1e-12, atol=1e-14)


@pytest.mark.gpu
@pytest.mark.parametrize("host_check", [True, False])
def test_a_repeated_call_still_checks_its_values(monkeypatch, host_check):
    """A call of a signature seen before skips the shape checks, never the values': lengths and page
    indices out of range, and an append into a shared page, are refused with the caches untouched, both
    where the table is checked on the host and by reductions on the device (a table over
    kvcache.HOST_CHECK_BYTES)."""
    cp = pytest.importorskip("cupy")
    from cuflash import kvcache
    from cuflash._dispatch import plan
    if not host_check:
        monkeypatch.setattr(kvcache, "HOST_CHECK_BYTES", 0)
    q, kc, vc, kn, vn = _setup(cp, np.float16, b=2, hq=4, hk=2, lq=1, cap=64, n_new=1, d=64)
    k_pages, v_pages, table = _paged(cp, _host(kc), _host(vc), 16)          # (2, 4) entries, 8 pages
    good = cp.asarray([3, 20], dtype=cp.int32)
    for _ in range(2):
        cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=good, causal=True)
        cuflash.attention_with_kvcache(q, k_pages, v_pages, kn, vn, cache_seqlens=good, causal=True,
                                       block_table=table)
    assert len(plan._CALL_PLANS) >= 2
    shared = table.copy()
    shared[1, 1] = table[0, 0]            # sequence 1 appends at position 20: into the page sequence 0 reads
    cases = [(dict(cache_seqlens=cp.asarray([3, 64], dtype=cp.int32)), "past the cache's 64"),
             (dict(cache_seqlens=cp.asarray([-1, 3], dtype=cp.int32)), ">= 0"),
             (dict(cache_seqlens=good, block_table=table + 8), "outside"),
             (dict(cache_seqlens=good, block_table=shared), "more than once")]
    for kwargs, match in cases:
        paged = "block_table" in kwargs
        caches = (k_pages, v_pages) if paged else (kc, vc)
        before = [_host(c) for c in caches]
        with pytest.raises(ValueError, match=match):
            cuflash.attention_with_kvcache(q, *caches, kn, vn, causal=True, **kwargs)
        for c, b in zip(caches, before):
            np.testing.assert_array_equal(_host(c), b)
        if not paged:   # the same lengths against the paged cache
            with pytest.raises(ValueError, match=match):
                cuflash.attention_with_kvcache(q, k_pages, v_pages, kn, vn, causal=True, block_table=table, **kwargs)


@pytest.mark.gpu
def test_int_lengths_queued_call_after_call_are_each_calls_own():
    """An int cache_seqlens is written into a buffer of the stream's, reused call after call in stream order:
    calls queued without a wait, each of another length, give each length's result (against an int32 array
    of it), on the default stream and on another one, with an append too."""
    cp = pytest.importorskip("cupy")
    q, kc, vc, kn, vn = _setup(cp, np.float16, b=2, hq=4, hk=2, lq=1, cap=96, n_new=1, d=64)
    lengths = list(range(0, 90, 7))
    for stream in (cp.cuda.Stream.null, cp.cuda.Stream(non_blocking=True)):
        with stream:
            outs = [cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=n, causal=True) for n in lengths]
            wants = [cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=cp.full((2,), n, dtype=cp.int32),
                                                    causal=True) for n in lengths]
            k_int, v_int, k_arr, v_arr = kc.copy(), vc.copy(), kc.copy(), vc.copy()
            appended = [cuflash.attention_with_kvcache(q, k_int, v_int, kn, vn, cache_seqlens=n, causal=True)
                        for n in lengths]
            appended_want = [cuflash.attention_with_kvcache(q, k_arr, v_arr, kn, vn, causal=True,
                                                            cache_seqlens=cp.full((2,), n, dtype=cp.int32))
                             for n in lengths]
        stream.synchronize()
        for got, want in zip(outs + appended, wants + appended_want):
            np.testing.assert_array_equal(_host(got), _host(want))
        np.testing.assert_array_equal(_host(k_int), _host(k_arr))
        assert len({float(_host(o).astype(np.float64).sum()) for o in outs}) == len(lengths)   # not all one length


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_host_lengths_queued_call_after_call_equal_device_ones(paged):
    """NumPy lengths and tables with CuPy caches go up through a ring of page-locked buffers: more calls than
    the ring has buffers, queued without a wait, each with other lengths and an append, on the default stream
    and another one, give what the same lengths as CuPy arrays give; the caches end equal."""
    cp = pytest.importorskip("cupy")
    from cuflash import kvcache

    q, kc, vc, kn, vn = _setup(cp, np.float16, b=2, hq=4, hk=2, lq=1, cap=128, n_new=1, d=64)
    steps = [np.array([n, 120 - n]) for n in range(0, 2 * kvcache.UPLOAD_SLOTS + 3)]
    for stream in (cp.cuda.Stream.null, cp.cuda.Stream(non_blocking=True)):
        with stream:
            if paged:
                k_host, v_host, table = _paged(cp, _host(kc), _host(vc), 16)
                k_dev, v_dev = k_host.copy(), v_host.copy()
                table_host, table_dev = _host(table), table
            else:
                k_host, v_host, k_dev, v_dev = kc.copy(), vc.copy(), kc.copy(), vc.copy()
                table_host = table_dev = None
            got = [cuflash.attention_with_kvcache(q, k_host, v_host, kn, vn, cache_seqlens=n, block_table=table_host,
                                                  causal=True) for n in steps]
            want = [cuflash.attention_with_kvcache(q, k_dev, v_dev, kn, vn, cache_seqlens=cp.asarray(n),
                                                   block_table=table_dev, causal=True) for n in steps]
        stream.synchronize()
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_host(a), _host(b))
        np.testing.assert_array_equal(_host(k_host), _host(k_dev))
        np.testing.assert_array_equal(_host(v_host), _host(v_dev))


def test_the_upload_ring_waits_for_a_buffers_copy_before_writing_it(monkeypatch):
    """kvcache._uploaded's ring, with CuPy's driver calls recorded: a page-locked buffer is written only after
    the event of its previous copy has been waited for (its reuse UPLOAD_SLOTS uploads later, its growth, and
    the forgetting of every ring past 64 streams and threads); each copy is followed by its event's record."""
    import sys
    import types

    from cuflash import kvcache

    log = []

    class Event:
        def __init__(self, **_):
            self.id = len(log)

        def record(self, stream):
            log.append(("record", self.id))

        def synchronize(self):
            log.append(("wait", self.id))

    class Device:
        def __init__(self, n):
            self.data = types.SimpleNamespace(ptr=0)
            self.size = n
            self.buf = np.zeros(n, np.int32)

        def __getitem__(self, key):
            return self.buf[key]

    streams = iter(range(1, 10 ** 6))
    current = {"stream": types.SimpleNamespace(ptr=0)}
    runtime = types.SimpleNamespace(getDevice=lambda: 0, memcpyHostToDevice=1,
                                    memcpyAsync=lambda dst, src, n, kind, stream: log.append(("copy", n)))
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Event=Event,
                                                            get_current_stream=lambda: current["stream"]),
                                 empty=lambda shape, dtype: Device(shape[0]))
    pinned = types.SimpleNamespace(empty_pinned=lambda shape, dtype: np.zeros(shape, dtype))
    monkeypatch.setitem(sys.modules, "cupyx", pinned)
    monkeypatch.setattr(kvcache, "_UPLOADS", {})
    for i in range(kvcache.UPLOAD_SLOTS + 1):
        kvcache._uploaded(np.array([i, i + 1]), fake, 0)
    # the first UPLOAD_SLOTS uploads take fresh buffers; the next reuses the first after waiting for its event
    assert [e for e in log if e[0] == "wait"] == [("wait", 0)]
    assert log[-3:] == [("wait", 0), ("copy", 8), ("record", 0)]
    log.clear()
    kvcache._uploaded(np.arange(100), fake, 0)    # slot 1 grows: its old copy first
    assert log[0][0] == "wait" and log[-2:] == [("copy", 400), log[-1]] and log[-1][0] == "record"
    for _ in range(64):                          # 64 more streams: every ring's buffers waited for, then forgotten
        current["stream"] = types.SimpleNamespace(ptr=next(streams))
        log.clear()
        kvcache._uploaded(np.array([1]), fake, 0)
    assert len(kvcache._UPLOADS) == 1
    # the first ring's slots, one a ring of the others
    assert sum(1 for e in log if e[0] == "wait") == kvcache.UPLOAD_SLOTS + 63


def _scattered(cp, cache, new, lengths, table, page_size):
    """CuPy's integer indexing of the append (indices out of range wrap): the kernel's reference."""
    n_new = new.shape[2]
    positions = cp.asarray(lengths, dtype=cp.int64)[:, None] + cp.arange(n_new)[None, :]
    if table is None:
        where = (cp.arange(new.shape[0])[:, None], slice(None), positions)
    else:
        owner = cp.take_along_axis(cp.asarray(table), positions // page_size, axis=1)
        where = (owner, slice(None), positions % page_size)
    cache[where] = new.transpose(0, 2, 1, 3)
    return cache


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_append_kernel_compiles_without_spills(arch):
    from cuflash._runtime.build import compile_offline

    for element in ("unsigned short", "unsigned int", "unsigned long long"):
        build = compile_offline("kv_append.cu", f"kv_append<{element}>", arch)
        assert build.spills == 0 and build.stack_frame == 0, build.log


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("lengths_kind", ["cupy", "numpy", "int"])
def test_the_append_kernel_writes_what_integer_indexing_writes(dtype, paged, lengths_kind):
    """The append kernel (kernels_cu/kv_append.cu) against CuPy's integer indexing, bit for bit over the whole
    store: (B, L, H, D) stores seen through swapaxes, new rows cut from wider ones and with a last-axis step of
    2, a head dim of V other than K's, shuffled pages; then, unvalidated, lengths and table entries out of
    range, which both wrap (nothing outside the store is written)."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(7)
    b, hq, hk, n_new, d, dv, page, cap = 3, 4, 2, 3, 64, 40, 16, 64

    def arr(shape):
        return cp.asarray(rng.standard_normal(shape).astype(DTYPES[dtype]))

    q = arr((b, hq, 1, d))
    k_new = arr((b, hk, n_new, d + 16))[..., 16:]
    v_new = arr((b, hk, n_new, 2 * dv))[..., ::2]
    pages = b * cap // page + 3
    table = rng.permutation(pages)[:b * cap // page].reshape(b, cap // page).astype(np.int32) if paged else None
    stores = (arr((pages, page, hk, d)), arr((pages, page, hk, dv))) if paged else \
        (arr((b, cap, hk, d)), arr((b, cap, hk, dv)))
    cases = [(np.array([0, 17, cap - n_new]), table, True)]
    if lengths_kind == "int":
        cases = [(np.full(b, 17), table, True)]
    if lengths_kind == "cupy":   # unvalidated values out of range: the append wraps, as integer indexing does
        cases.append((np.array([cap + 5, -7, 2 ** 31 - 2]), table, False))
        if paged:
            bad = table.copy()
            bad[0, 0], bad[1, 1] = 10 ** 6, -9
            cases.append((np.array([0, 17, 40]), bad, False))
    for lengths, pages_of, validate in cases:
        got = [x.copy() for x in stores]
        want = [_scattered(cp, x.copy().swapaxes(1, 2), new, lengths, pages_of, page).swapaxes(1, 2)
                for x, new in zip(stores, (k_new, v_new))]
        given = {"cupy": cp.asarray(lengths, dtype=cp.int32), "numpy": lengths, "int": int(lengths[0])}[lengths_kind]
        cuflash.attention_with_kvcache(q, got[0].swapaxes(1, 2), got[1].swapaxes(1, 2), k_new, v_new,
                                       cache_seqlens=given, causal=True, validate=validate,
                                       block_table=None if pages_of is None else cp.asarray(pages_of))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(_host(g).view(np.uint8), _host(cp.ascontiguousarray(w)).view(np.uint8))
