"""Ring attention over NCCL on two or more GPUs of one host (marker `gpu`; skipped with fewer than
two): one process a GPU, started with multiprocessing's spawn, the NCCL id through a pipe; every
dtype, causal (zigzag) and not (contiguous), GQA, odd lengths; forward and backward equal to one
GPU's within the dtype's error budget (_errors.py)."""
import multiprocessing

import ml_dtypes
import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def _gpus() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _rank(rank, size, uid, arrays, causal, layout, pipe):
    import cupy

    from cuflash import distributed as dist

    cupy.cuda.Device(rank).use()
    comm = dist.NcclRing(rank, size, uid, device=rank)
    q, k, v, dout = (cupy.asarray(dist.shard(x, rank, size, layout)) for x in arrays)
    out, vjp_fn = dist.ring_vjp(q, k, v, comm, causal=causal, layout=layout)
    grads = vjp_fn(dout)
    cupy.cuda.Device().synchronize()
    pipe.send([cupy.asnumpy(x) for x in (out, *grads)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal, layout", [(True, "zigzag"), (False, "contiguous")])
def test_two_ranks_equal_one_gpu(dtype, causal, layout):
    size = 2
    if _gpus() < size:
        pytest.skip(f"needs {size} GPUs, this machine has {_gpus()}")
    import cuflash
    from cuflash import distributed as dist

    rng = np.random.default_rng(0)
    length = 3001
    arrays = [rng.standard_normal(s).astype(DTYPES[dtype]) for s in
              ((1, 8, length, 64), (1, 2, length, 64), (1, 2, length, 64), (1, 8, length, 64))]
    ctx = multiprocessing.get_context("spawn")
    uid = dist.NcclRing.unique_id()
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [ctx.Process(target=_rank, args=(r, size, uid, arrays, causal, layout, pipes[r][1])) for r in range(size)]
    for p in procs:
        p.start()
    results = [pipes[r][0].recv() for r in range(size)]
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    q, k, v, dout = (cp.asarray(x) for x in arrays)
    out, lse = cuflash.attention_forward(q, k, v, causal=causal)
    want = [out, *cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)]
    tol = {"float64": 1e-10, "float32": 1e-4}.get(dtype, 3e-2)
    for i, w in enumerate(want):
        got = dist.unshard([r[i] for r in results], layout).astype(np.float64)
        np.testing.assert_allclose(got, cp.asnumpy(w).astype(np.float64), rtol=tol, atol=tol)
