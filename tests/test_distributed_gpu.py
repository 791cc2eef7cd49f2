"""Ring attention on the GPU (marker `gpu`): over NCCL on two GPUs of one host (skipped with fewer), one
process a GPU started by cuflash.distributed.launch, every case of CASES in one launch; and the same cases
with two ranks as threads of one process on one GPU. The result and the gradients of each within the
dtype's error budget against the exact reference of the whole sequence (_errors.py), as one GPU's are:
every dtype, causal (zigzag, striped and contiguous) and not, sliding windows, GQA, odd lengths, head dims
64 and 128 (the 16-bit Hopper forward's float32-output twin), dropout drawn at global positions (the whole
sequence's mask). A timed NCCL ring's recorded waits."""
import functools

import ml_dtypes
import numpy as np
import pytest

from _errors import exact, lse_bound, magnitude, naive_same_dtype, rel_error, within_budget

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
RANKS = 2

# (dtype, causal, layout, window, length, head dim, dropout_p)
# (float64's reference is long double: shorter)
CASES = [(dtype, causal, layout, None, 515 if dtype == "float64" else 2001, 64, 0.0)
         for dtype in DTYPES for causal, layout in ((True, "zigzag"), (False, "contiguous"))]
CASES += [("bfloat16", True, "zigzag", None, 4099, 128, 0.0), ("float16", False, "contiguous", None, 2048, 128, 0.0),
          ("bfloat16", True, "contiguous", None, 2001, 64, 0.0),
          ("bfloat16", True, "zigzag", (300, None), 2001, 64, 0.0),
          ("float16", False, "contiguous", (200, 150), 2001, 128, 0.0),
          ("float32", True, "zigzag", (500, None), 2001, 64, 0.0),
          ("bfloat16", True, "zigzag", None, 2001, 128, 0.1), ("float32", False, "contiguous", None, 2001, 64, 0.1),
          ("float64", True, "zigzag", (100, None), 515, 64, 0.2),
          ("bfloat16", True, "striped", None, 2001, 128, 0.0), ("float32", True, "striped", (300, None), 2001, 64, 0.0),
          ("float16", False, "striped", None, 2048, 64, 0.0), ("float64", True, "striped", None, 515, 64, 0.0)]


def _ids():
    return [f"{d}-{'causal' if c else 'full'}-{lay}-w{w}-L{n}-d{h}" + (f"-drop{p}" if p else "")
            for d, c, lay, w, n, h, p in CASES]


def _dropout(index):
    """Case ``index``'s dropout options (one seed for every rank and the reference)."""
    p = CASES[index][6]
    return dict(dropout_p=p, seed=1000 + index) if p else {}


def _gpus() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _inputs(index):
    dtype, _, _, _, length, d, _ = CASES[index]
    rng = np.random.default_rng(index)
    shapes = ((1, 8, length, d), (1, 2, length, d), (1, 2, length, d), (1, 8, length, d))   # GQA: 8 / 2 heads
    return [rng.standard_normal(s).astype(DTYPES[dtype]) for s in shapes]


def _ring_rank(comm, cases, inputs, dropouts):
    """One rank's ring forward and backward of every case (its slices of the whole inputs)."""
    from cuflash import distributed as dist

    results = []
    for (dtype, causal, layout, window, _, _, _), arrays, drop in zip(cases, inputs, dropouts):
        q, k, v, dout = (cp.asarray(dist.shard(x, comm.rank, comm.size, layout)) for x in arrays)
        out, vjp_fn = dist.ring_vjp(q, k, v, comm, causal=causal, layout=layout, window=window, **drop)
        results.append([out, *vjp_fn(dout)])
    return results


@pytest.fixture(scope="module")
def ring_results():
    if _gpus() < RANKS:
        pytest.skip(f"needs {RANKS} GPUs, this machine has {_gpus()}")
    from cuflash import distributed as dist

    inputs = [_inputs(i) for i in range(len(CASES))]
    dropouts = [_dropout(i) for i in range(len(CASES))]
    return inputs, dist.launch(_ring_rank, RANKS, args=(CASES, inputs, dropouts), timeout=900)


@pytest.mark.parametrize("index", range(len(CASES)), ids=_ids())
def test_two_ranks_within_the_error_budget(ring_results, index):
    inputs, per_rank = ring_results
    _check_case(index, inputs[index], [per_rank[r][index] for r in range(RANKS)])


@pytest.mark.parametrize("index", range(len(CASES)), ids=_ids())
def test_two_thread_ranks_on_one_gpu_within_the_error_budget(index):
    """The same cases with the ranks as threads on one GPU (ThreadRing): the ring's steps, windows and merges
    on the GPU kernels, without NCCL."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    from cuflash import distributed as dist

    arrays = _inputs(index)
    results = dist.ThreadRing.run(lambda comm: _ring_rank(comm, [CASES[index]], [arrays], [_dropout(index)])[0],
                                  dist.ThreadRing.create(RANKS))
    _check_case(index, arrays, [dist._on_host(r) for r in results])


def _check_case(index, arrays, rank_results):
    """Case ``index``'s ring result (``rank_results[r]``: rank r's out, dq, dk, dv) within the error budget."""
    from cuflash import distributed as dist

    dtype, causal, layout, window, _, d, _ = CASES[index]
    got = [dist.unshard([rank_results[r][i] for r in range(RANKS)], layout) for i in range(4)]
    for g, x in zip(got, (arrays[0], arrays[0], arrays[1], arrays[2])):
        assert g.dtype == np.dtype(DTYPES[dtype]) and g.shape == x.shape
    (ref_out, ref), (naive_out, naive), (mag_out, mag), lse_max = _references(index)
    for name, g, r, n, m, lm in (("out", got[0], ref_out, naive_out, mag_out, 0.0),
                                 *((f"d{x}", got[1 + i], ref[i], naive[i], mag[i], lse_max)
                                   for i, x in enumerate("qkv"))):
        g = g.astype(np.float64)
        assert np.isfinite(g).all(), f"{name} has NaN/inf"
        ok, msg = within_budget(g, r, n, m, dtype, lm)
        assert ok, f"{name}: {msg}"
        assert rel_error(g, r) < 5e-2, f"{name}: {msg}"


@functools.lru_cache(maxsize=None)
def _references(index):
    """Case ``index``'s exact result and gradients (long double for float64: the file's bulk of time), the naive
    same-dtype ones, their magnitudes and the largest logit, computed once for both of its tests."""
    dtype, causal, _, window, _, d, _ = CASES[index]
    q, k, v, do = (x.astype(np.float64) for x in _inputs(index))
    opts = dict(causal=causal, scale=1 / np.sqrt(d), window=window, **_dropout(index))
    return (exact(q, k, v, do, dtype=dtype, **opts), naive_same_dtype(q, k, v, do, dtype=dtype, **opts),
            magnitude(q, k, v, do, **opts), lse_bound(q, k, 1 / np.sqrt(d)))


def _one_rank_ring(comm, q):
    from cuflash import distributed as dist

    out = dist.ring_attention(cp.asarray(q), cp.asarray(q), cp.asarray(q), comm, causal=True)
    return {"rank": comm.rank, "size": comm.size, "out": [out]}


def _failing_rank(comm):
    raise ValueError(f"rank {comm.rank} refuses")


def test_launch_returns_each_ranks_result_and_raises_its_error():
    """One rank is enough for the launcher (any GPU machine): results back on the host, an error raised here."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    import cuflash
    from cuflash import distributed as dist

    q = np.random.default_rng(0).standard_normal((1, 2, 100, 64)).astype(np.float16)
    (result,) = dist.launch(_one_rank_ring, 1, args=(q,), timeout=300)
    assert result["rank"] == 0 and result["size"] == 1 and isinstance(result["out"][0], np.ndarray)
    want = cp.asnumpy(cuflash.attention(cp.asarray(q), cp.asarray(q), cp.asarray(q), causal=True))
    np.testing.assert_allclose(result["out"][0].astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)
    with pytest.raises(RuntimeError, match="rank 0 failed:(.|\n)*ValueError: rank 0 refuses"):
        dist.launch(_failing_rank, 1, timeout=300)


def _timed_ring_waits(comm, q):
    from cuflash import distributed as dist

    mine = [cp.asarray(dist.shard(x, comm.rank, comm.size, "zigzag")) for x in (q, q, q)]
    out, vjp_fn = dist.ring_vjp(*mine, comm, causal=True)
    vjp_fn(cp.ones_like(out))
    return len(comm.waits), comm.wait_ms()


def test_nccl_rings_record_their_waits():
    """A timed ring records a wait for each arrival the compute stream waits for: n - 1 in the forward, n - 1
    key / value blocks and n accumulator arrivals in the backward, 3 (n - 1) + 1 a vjp; their time is >= 0."""
    if _gpus() < RANKS:
        pytest.skip(f"needs {RANKS} GPUs, this machine has {_gpus()}")
    from cuflash import distributed as dist

    q = np.random.default_rng(0).standard_normal((1, 2, 1000, 64)).astype(np.float16)
    for count, ms in dist.launch(_timed_ring_waits, RANKS, args=(q,), timeout=300, timed=True):
        assert count == 3 * (RANKS - 1) + 1 and ms >= 0
