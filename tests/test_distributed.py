"""Ring attention on ranks simulated as threads (ThreadRing, NumPy arrays): every layout, causal and
not, sliding windows, GQA, odd lengths, 1 to 4 ranks, forward and backward equal to one-shot attention of the whole
sequence; the shard / unshard helpers; a call that differs across ranks refused on every rank."""
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import distributed as dist


def _full(seed=0, b=2, hq=4, hk=2, length=37, d=8, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in ((b, hq, length, d), (b, hk, length, d), (b, hk, length, d),
                                                           (b, hq, length, d))]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 31])
def test_shard_then_unshard_is_the_identity(layout, size):
    x = np.arange(2 * 3 * 29 * 5).reshape(2, 3, 29, 5)
    parts = [dist.shard(x, r, size, layout) for r in range(size)]
    assert sum(p.shape[2] for p in parts) == 29
    np.testing.assert_array_equal(parts[min(1, size - 1)][0, 0, :, 0] // 5,
                                  [j for rg in dist.segments(29, size, layout)[min(1, size - 1)] for j in rg])
    np.testing.assert_array_equal(dist.unshard(parts, layout), x)


def test_zigzag_balances_causal_work():
    spans = dist.segments(64, 4, "zigzag")
    assert spans[0] == [range(0, 8), range(56, 64)] and spans[3] == [range(24, 32), range(32, 40)]
    work = [sum(j + 1 for rg in s for j in rg) for s in spans]   # keys seen by the rank's queries
    assert max(work) - min(work) <= 64


def test_striped_takes_every_nth_position_and_balances_causal_work():
    spans = dist.segments(64, 4, "striped")
    assert spans[1] == [range(1, 64, 4)]
    work = [sum(j + 1 for rg in s for j in rg) for s in spans]
    assert max(work) - min(work) <= 64


def _visible(length, causal, window):
    """(length, length) bool: query i sees key j of the whole sequence."""
    left, right = window if window is not None else (None, None)
    right = 0 if causal else right
    q_pos, k_pos = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = np.ones((length, length), bool)
    if left is not None:
        visible &= k_pos >= q_pos - left
    if right is not None:
        visible &= k_pos <= q_pos + right
    return visible


def _local_band(rows, cols, band):
    """(rows, cols) bool: what a call's top-left ``band`` (left, right; None: every key) lets it see."""
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    local = np.ones((rows, cols), bool)
    if band is not None:
        local &= (j >= i - (band[0] if band[0] is not None else rows + cols))
        local &= (j <= i + (band[1] if band[1] is not None else rows + cols))
    return local


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("causal, window", [(True, None), (True, (5, None)), (False, (0, 0)), (False, (3, 6)),
                                            (False, None), (True, (0, None))])
def test_striped_steps_are_one_call_that_sees_the_visible_pairs(size, causal, window):
    """Each striped step is at most one call, and the calls over all (query rank, key rank) pairs attend each
    visible (query, key) of the sequence exactly once; under a plain causal mask every step is one call."""
    length = 53
    visible = _visible(length, causal, window)
    seen = np.zeros((length, length), int)
    spans = dist.segments(length, size, "striped")
    for mine in spans:
        for theirs in spans:
            calls = list(dist._step_calls(mine, theirs, causal, window, False))
            assert len(calls) <= 1 and (len(calls) == 1 or window is not None)
            for on_kernels, q_sl, k_sl, band, _, _ in calls:
                assert on_kernels and (band is None or min(b for b in band if b is not None) >= 0)
                local = _local_band(q_sl.stop - q_sl.start, k_sl.stop - k_sl.start, band)
                qg = np.asarray(mine[0])[q_sl][:, None]
                kg = np.asarray(theirs[0])[k_sl][None, :]
                np.add.at(seen, (np.broadcast_to(qg, local.shape)[local], np.broadcast_to(kg, local.shape)[local]), 1)
    np.testing.assert_array_equal(seen, visible.astype(int))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal, layout", [(False, "contiguous"), (True, "zigzag"), (True, "contiguous"),
                                            (False, "zigzag"), (True, "striped"), (False, "striped")])
def test_ring_equals_one_shot_attention(size, causal, layout):
    q, k, v, dout = _full(length=37 if size != 4 else 41)
    want_out, want_lse = cuflash.attention_forward(q, k, v, causal=causal)
    want_grads = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, causal=causal)

    def rank_work(comm):
        mine = [dist.shard(x, comm.rank, comm.size, layout) for x in (q, k, v, dout)]
        out, vjp_fn = dist.ring_vjp(*mine[:3], comm, causal=causal, layout=layout)
        return out, vjp_fn(mine[3])

    results = dist.ThreadRing.run(rank_work, dist.ThreadRing.create(size))
    out = dist.unshard([r[0] for r in results], layout)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    for i, want in enumerate(want_grads):
        got = dist.unshard([r[1][i] for r in results], layout)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("causal, layout, window", [(False, "contiguous", None), (True, "zigzag", None),
                                                    (True, "zigzag", (5, None)), (False, "zigzag", (3, 6))])
def test_ring_with_dropout_drops_what_one_call_over_the_sequence_drops(size, causal, layout, window):
    """Each block pair draws the whole sequence's mask at its global (query, key) origin: odd lengths put
    key origins at every residue mod 4 (a Philox draw covers four keys)."""
    q, k, v, dout = _full(length=37 if size != 4 else 43)
    opts = dict(causal=causal, window=window, dropout_p=0.3, seed=2024)
    want_out, want_lse = cuflash.attention_forward(q, k, v, **opts)
    want_grads = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, **opts)

    def rank_work(comm):
        mine = [dist.shard(x, comm.rank, comm.size, layout) for x in (q, k, v, dout)]
        out, vjp_fn = dist.ring_vjp(*mine[:3], comm, layout=layout, **opts)
        return out, vjp_fn(mine[3])

    results = dist.ThreadRing.run(rank_work, dist.ThreadRing.create(size))
    np.testing.assert_allclose(dist.unshard([r[0] for r in results], layout), want_out, rtol=1e-12, atol=1e-13)
    for i, want in enumerate(want_grads):
        got = dist.unshard([r[1][i] for r in results], layout)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    plain = cuflash.attention(q, k, v, causal=causal, window=window)
    assert np.abs(want_out - plain).max() > 0.1   # the mask dropped something


def test_ring_vjp_agrees_on_a_drawn_seed_and_keeps_it():
    q, k, v, dout = _full(length=37)

    def rank_work(comm):
        mine = [dist.shard(x, comm.rank, comm.size, "zigzag") for x in (q, k, v, dout)]
        out, vjp_fn = dist.ring_vjp(*mine[:3], comm, causal=True, dropout_p=0.2)
        return vjp_fn.seed, out, vjp_fn(mine[3])

    results = dist.ThreadRing.run(rank_work, dist.ThreadRing.create(3))
    seed = results[0][0]
    assert isinstance(seed, int) and all(r[0] == seed for r in results)
    want = cuflash.attention(q, k, v, causal=True, dropout_p=0.2, seed=seed)
    np.testing.assert_allclose(dist.unshard([r[1] for r in results], "zigzag"), want, rtol=1e-12, atol=1e-13)


def test_ranks_with_different_dropout_seeds_are_refused():
    q, k, v, _ = _full(length=32)

    def rank_work(comm):
        mine = [dist.shard(x, comm.rank, comm.size, "zigzag") for x in (q, k, v)]
        with pytest.raises(ValueError, match="differ"):
            dist.ring_attention(*mine, comm, causal=True, dropout_p=0.1, seed=comm.rank)
        return True

    assert all(dist.ThreadRing.run(rank_work, dist.ThreadRing.create(2)))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("causal, layout", [(False, "contiguous"), (True, "zigzag"), (False, "zigzag"),
                                            (True, "striped"), (False, "striped")])
@pytest.mark.parametrize("window", [(3, 5), (0, 0), (None, 4), (6, None), (0, None), (40, 40)])
def test_ring_with_a_window_equals_one_shot_attention(size, causal, layout, window):
    q, k, v, dout = _full(length=37)

    def rank_work(comm):
        mine = [dist.shard(x, comm.rank, comm.size, layout) for x in (q, k, v, dout)]
        out, vjp_fn = dist.ring_vjp(*mine[:3], comm, causal=causal, layout=layout, window=window, scale=0.3)
        return out, vjp_fn(mine[3])

    want_out, want_lse = cuflash.attention_forward(q, k, v, causal=causal, window=window, scale=0.3)
    want_grads = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, causal=causal, window=window,
                                            scale=0.3)
    results = dist.ThreadRing.run(rank_work, dist.ThreadRing.create(size))
    np.testing.assert_allclose(dist.unshard([r[0] for r in results], layout), want_out, rtol=1e-12, atol=1e-13)
    for i, want in enumerate(want_grads):
        got = dist.unshard([r[1][i] for r in results], layout)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_block_pairs_cut_to_the_band():
    # window (2, 3): queries 0..9 reach keys up to 12, none of 20..29
    assert list(dist._block_pairs([(0, 10)], [(20, 30)], False, (2, 3))) == []
    # keys 10..19: only queries 7..9 see any (keys 10..12); the slices' own band gives the same mask
    (q_sl, k_sl, band, q0, k0), = dist._block_pairs([(0, 10)], [(10, 20)], False, (2, 3))
    assert (q_sl, k_sl, q0, k0) == (slice(7, 10), slice(0, 3), 7, 10)   # q0, k0: global positions
    i, j = np.arange(7, 10)[:, None], np.arange(10, 13)[None, :]
    want = (j >= i - 2) & (j <= i + 3)
    li, lj = np.arange(3)[:, None], np.arange(3)[None, :]
    got = (lj >= li - band[0]) & (lj <= li + band[1])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_slices_merge_in_float32(dtype):
    q, k, v, _ = _full(length=64, dtype=dtype)
    want = cuflash.attention(q, k, v, causal=True).astype(np.float64)

    def rank_work(comm):
        return dist.ring_attention(*(dist.shard(x, comm.rank, comm.size) for x in (q, k, v)), comm, causal=True)

    out = dist.unshard(dist.ThreadRing.run(rank_work, dist.ThreadRing.create(2)))
    assert out.dtype == np.dtype(dtype)
    tol = 1e-6 if dtype is np.float32 else 1e-2
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol)


def test_a_call_that_differs_across_ranks_is_refused_everywhere():
    q, k, v, _ = _full(length=32)

    def rank_work(comm):
        causal = comm.rank == 0            # rank 0 asks for causal, rank 1 not
        mine = [dist.shard(x, comm.rank, comm.size, "contiguous") for x in (q, k, v)]
        with pytest.raises(ValueError, match="differ"):
            dist.ring_attention(*mine, comm, causal=causal, layout="contiguous")
        return True

    assert all(dist.ThreadRing.run(rank_work, dist.ThreadRing.create(2)))


def test_a_slice_of_the_wrong_length_is_refused():
    q, k, v, _ = _full(length=32)

    def rank_work(comm):
        with pytest.raises(ValueError, match="shard the sequence"):
            dist.ring_attention(q[:, :, :16], k[:, :, :16], v[:, :, :16], comm, causal=True, length=40)
        return True

    assert all(dist.ThreadRing.run(rank_work, dist.ThreadRing.create(2)))


def test_bad_layout():
    with pytest.raises(ValueError, match="layout"):
        dist.segments(10, 2, "rows")


def test_striped_refuses_dropout():
    q, k, v, _ = _full(length=32)

    def rank_work(comm):
        mine = [dist.shard(x, comm.rank, comm.size, "striped") for x in (q, k, v)]
        with pytest.raises(ValueError, match="dropout needs layout"):
            dist.ring_attention(*mine, comm, causal=True, layout="striped", dropout_p=0.1, seed=1)
        return True

    assert all(dist.ThreadRing.run(rank_work, dist.ThreadRing.create(2)))


def test_a_missing_nccl_is_a_clear_error():
    try:
        dist._nccl()
    except RuntimeError as exc:
        assert "NCCL" in str(exc)
        with pytest.raises(RuntimeError, match="NCCL"):
            dist.NcclRing.unique_id()
    else:
        pytest.skip("this machine's CuPy has NCCL")


def test_the_thread_ring_checks_what_arrives_against_the_expected_shapes():
    """Slices of an odd length differ by a position, and NCCL's receive must be the sender's size: the ring
    names the previous rank's shapes, and the thread ring refuses arrays of other shapes (an NCCL ring would
    wait forever)."""
    def rank_work(comm):
        mine = np.zeros((1, 2, 5 + comm.rank, 4))
        got = comm.exchange_async([mine], [(1, 2, 5 + (comm.rank - 1) % comm.size, 4)]).wait()
        assert got[0].shape[-2] == 5 + (comm.rank - 1) % comm.size
        with pytest.raises(RuntimeError, match="expected arrays of shapes"):
            comm.exchange_async([mine], [mine.shape]).wait()
        return True

    assert all(dist.ThreadRing.run(rank_work, dist.ThreadRing.create(2)))


@pytest.mark.parametrize("size, layout", [(2, "zigzag"), (3, "zigzag"), (4, "contiguous"), (3, "contiguous")])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (5, None)), (False, (3, 6)),
                                            (False, (0, 9)), (True, (13, None))])
def test_dropout_step_calls_cover_each_visible_pair_once_from_aligned_keys(size, layout, causal, window):
    """Under dropout the kernels take each pair's keys from a multiple of 4 and cuflash.reference at most 3
    keys before it; together the calls attend each visible (query, key) of the sequence exactly once."""
    length = 53
    visible = _visible(length, causal, window)
    seen = np.zeros((length, length), int)
    spans = dist.segments(length, size, layout)
    for mine in spans:
        for theirs in spans:
            for on_kernels, q_sl, k_sl, band, q0, k0 in dist._step_calls(mine, theirs, causal, window, True):
                assert k0 % 4 == 0 if on_kernels else k_sl.stop - k_sl.start <= 3
                local = _local_band(q_sl.stop - q_sl.start, k_sl.stop - k_sl.start, band)
                seen[q0:q0 + local.shape[0], k0:k0 + local.shape[1]] += local
    np.testing.assert_array_equal(seen, visible.astype(int))
