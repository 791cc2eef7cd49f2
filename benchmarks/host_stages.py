"""Where a forward call's host time goes (needs a GPU; PyTorch for the peers).

1. The stages of ``cuflash.attention_forward`` replayed with timestamps, back to back ("hot") and
   each after a synchronisation ("cold", as bench.py times a call alone).
2. The building blocks on their own, hot: the driver's tensor-map encoder (one map, through the
   ctypes call cuflash makes), ``cuTensorMapReplaceAddress`` on an encoded map, ``cupy.empty``,
   a driver launch of an empty kernel, a NumPy scratch buffer.
3. cupyx's ``cpu_times`` of cuflash and the PyTorch backends.

bf16, L = 1024, head dims 64 and 128, B x L = 16384, H x D = 2048. The replay mirrors api.py /
_launch.py: keep it in step when they change.

    PYTHONPATH=. python benchmarks/host_stages.py"""
import ctypes
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from cuflash import _checks, _launch, _masking, _params, _tma  # noqa: E402
from cuflash._variants import forward_choice, head_bucket, row_class  # noqa: E402

L = 1024
rng = cp.random.default_rng(0)


def staged(q, k, v):
    t = [time.perf_counter()]
    p = _checks.check_qkv(q, k, v, causal=False, scale=None)
    opts = _masking.check_options(p)
    t.append(time.perf_counter())
    with cp.cuda.Device(p.q.device.id):
        out = cp.empty((p.batch, p.heads_q, p.lq, p.dv), dtype=q.dtype)
        lse = cp.empty((p.batch, p.heads_q, p.lq), dtype=np.float32)
        t.append(time.perf_counter())
        masking = _masking.kernel_masking(p, opts)
        t.append(time.perf_counter())
        dd, dv = q.shape[3], v.shape[3]
        head = head_bucket(max(dd, dv))
        variant, _ = forward_choice("bfloat16", head, False, False, _launch.vec_loads_ok(dd, dv, q, k, v),
                                    row_class(head, k.shape[2], False), _launch._compute_capability(),
                                    _launch._smem_limit())
        t.append(time.perf_counter())
        params = _params.fwd_params(q, k, v, out, lse, group=1, scale=p.scale, mask=masking.values)
        t.append(time.perf_counter())
        maps = _tma.fwd_tensor_maps(q, k, v, out, variant.tile.block_m, variant.tile.block_n,
                                    store_out=head >= _launch.TMA_STORE_O_HEAD)
        t.append(time.perf_counter())
        b, h = q.shape[:2]
        _launch._launch(variant, params, (b, h, 1, L, L), extra_args=(maps,))
        t.append(time.perf_counter())
    return np.diff(t) * 1e6


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def building_blocks(q):
    """Hot per-call microseconds of the pieces a forward is made of."""
    encode = _tma._encode_fn()
    strides = _tma._strides_if_ok(q)
    bq, hq, lq, dq = q.shape
    words = np.array([dq, lq, hq, bq, *strides, 0, 64 | 128 << 32, 1 | 1 << 32, 1 | 1 << 32, 1 | 1 << 32],
                     dtype=np.uint64)
    a = words.ctypes.data
    buf = np.zeros(192, dtype=np.uint8)
    m = buf.ctypes.data + (-buf.ctypes.data % 64)

    def enc():
        err = encode(m, 1, 4, q.data.ptr, a, a + 32, a + 64, a + 80, 0, 3, 2, 0)
        assert err == 0, err
    enc()
    rows = {"encode one map (ctypes + driver)": per_call_us(enc)}
    lib = ctypes.CDLL("libcuda.so.1")
    try:
        replace = lib.cuTensorMapReplaceAddress
        replace.restype = ctypes.c_int
        replace.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        ptr = q.data.ptr + 1024

        def rep():
            err = replace(m, ptr)
            assert err == 0, err
        rows["cuTensorMapReplaceAddress (ctypes + driver)"] = per_call_us(rep)
    except AttributeError:
        pass
    ctypes_nop = ctypes.CDLL(None).getpid
    rows["ctypes call of getpid (the FFI alone)"] = per_call_us(ctypes_nop)
    rows["cupy.empty x2 (out, lse)"] = per_call_us(
        lambda: (cp.empty(q.shape, q.dtype), cp.empty(q.shape[:3], np.float32)))
    rows["np.zeros(448, uint8)"] = per_call_us(lambda: np.zeros(448, dtype=np.uint8))
    nop = cp.RawKernel('extern "C" __global__ void nop(long long x) {}', "nop")
    nop((1,), (32,), (np.int64(0),))
    arg = np.zeros(1, dtype=np.int64)
    import array
    from cupy.cuda import driver
    ptrs = array.array("Q", [arg.ctypes.data])
    fptr = nop.kernel.ptr

    def drv():
        driver.launchKernel(fptr, 1, 1, 1, 32, 1, 1, 0, cp.cuda.get_current_stream().ptr, ptrs.buffer_info()[0], 0)
    rows["driver.launchKernel, empty kernel"] = per_call_us(drv)
    rows["RawKernel call, empty kernel"] = per_call_us(lambda: nop((1,), (32,), (arg,)))
    cp.cuda.Device().synchronize()
    p = _checks.check_qkv(q, q, q)
    opts = _masking.check_options(p)
    rows["check_qkv"] = per_call_us(lambda: _checks.check_qkv(q, q, q))
    rows["check_options"] = per_call_us(lambda: _masking.check_options(p))
    rows["kernel_masking"] = per_call_us(lambda: _masking.kernel_masking(p, opts))
    for name, us in rows.items():
        print(f"  {name:45s} {us:6.2f} us")


names = ["checks", "alloc", "masking", "select", "params", "maps", "launch"]
for d in (64, 128):
    b, h = 16384 // L, 2048 // d
    q, k, v, do = (rng.standard_normal((b, h, L, d), dtype=cp.float32).astype(bench._cp_dtype("bfloat16"))
                   for _ in range(4))
    print(f"bf16 d={d} L={L}: replayed stages, median us")
    for mode in ("hot", "cold"):
        rows = []
        for i in range(300):
            rows.append(staged(q, k, v))
            if mode == "cold":
                cp.cuda.Device().synchronize()
        med = np.median(np.array(rows[30:]), axis=0)
        print(f"  {mode:5s} " + "  ".join(f"{n} {x:5.1f}" for n, x in zip(names, med)) + f"  total {med.sum():.1f}")
    cp.cuda.Device().synchronize()
    print("building blocks, hot:")
    building_blocks(q)
    for causal in (False, True):
        cons = bench.contenders(q, k, v, do, causal, False)
        for name in ("cuflash", "cuflash sm80", "torch flash", "torch cudnn"):
            fn = cons.get(name)
            if fn is None:
                continue
            r = benchmark(fn, n_repeat=100, n_warmup=10)
            print(f"  causal={causal!s:5} {name:12s} event-timed gpu {np.median(r.gpu_times[0]) * 1e3:.3f} ms, "
                  f"cpu {np.median(r.cpu_times) * 1e6:.1f} us", flush=True)
    del q, k, v, do
    cp.get_default_memory_pool().free_all_blocks()
