"""Where a forward call's host time goes (needs a GPU; PyTorch for the peers).

1. The stages of ``cuflash.attention_forward`` replayed with timestamps as a call without a
   memoised plan runs them (``options.forward_call``, then ``plan.plan_forward`` and
   ``plan.execute_forward`` taken apart), back to back ("hot") and each after a synchronisation
   ("cold", as bench.py times a call alone): checks (``options.forward_call``), alloc (out, lse),
   masking (``masking.kernel_masking``), select (``select.forward_choice``), params
   (``params.fwd_params``), maps (the Hopper kernel's tensor maps), launch
   (``launch.launch_kernel``).
2. The building blocks on their own, hot: the driver's tensor-map encoder (one map, through the
   ctypes call cuflash makes), ``cuTensorMapReplaceAddress`` on an encoded map, ``cupy.empty``,
   a driver launch of an empty kernel, a NumPy scratch buffer, the validation and masking steps.
3. cupyx's ``cpu_times`` of cuflash and the PyTorch backends.

bf16, L = 1024, head dims 64 and 128, B x L = 16384, H x D = 2048. The replay mirrors
cuflash/options.py and cuflash/_dispatch/plan.py: keep it in step when they change.

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
from cuflash import options  # noqa: E402
from cuflash._dispatch import masking as masking_  # noqa: E402
from cuflash._dispatch import plan  # noqa: E402
from cuflash._dispatch.model import head_bucket  # noqa: E402
from cuflash._dispatch.select import forward_choice, row_class  # noqa: E402
from cuflash._runtime import device, launch, params as params_, tma  # noqa: E402
from cuflash.semantics import acc_dtype  # noqa: E402

L = 1024
rng = cp.random.default_rng(0)


def staged(q, k, v):
    t = [time.perf_counter()]
    call = options.forward_call(q, k, v, causal=False, scale=None)
    p, opts = call.problem, call.options
    t.append(time.perf_counter())
    with device.on_device(p.q.data.device_id):
        out = cp.empty((p.batch, p.heads_q, p.lq, p.dv), dtype=p.q.dtype)
        lse = cp.empty((p.batch, p.heads_q, p.lq), dtype=acc_dtype(p.dtype))
        t.append(time.perf_counter())
        masking = masking_.kernel_masking(p, opts)
        t.append(time.perf_counter())
        head = head_bucket(max(p.d, p.dv))
        band = masking.band is not None
        extra = masking.extra or not plan.scale_folds(p.scale)
        variant, _ = forward_choice(p.dtype, head, band, extra, plan.vec_loads_ok(p.d, p.dv, p.q, p.k, p.v),
                                    row_class(head, p.lk, band), device.compute_capability(), device.smem_limit())
        blocks = variant.grid(p.batch, p.heads_q, p.group, p.lq, p.lk)
        grid = blocks if variant.schedule == "block" else min(blocks, device.sm_count())
        t.append(time.perf_counter())
        queue = cp.zeros(1, dtype=cp.int32) if variant.schedule == "queue" else None
        params = params_.fwd_params(p.q, p.k, p.v, out, lse, group=p.group, scale=p.scale, mask=masking.values,
                                    block_queue=0 if queue is None else queue.data.ptr)
        t.append(time.perf_counter())
        extra_args = ()
        if variant.arch == "sm90a":
            store_out = variant.family == "fwd_wgmma" and head >= plan.TMA_STORE_O_HEAD
            extra_args = (tma.fwd_tensor_maps(p.q, p.k, p.v, out, variant.tile.block_m, variant.tile.block_n,
                                              store_out=store_out),)
        t.append(time.perf_counter())
        launch.launch_kernel(variant, params, grid, extra_args)
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
    encode = tma._encode_fn()
    strides = tma._strides_if_ok(q)
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
    p = options.check_qkv(q, q, q)
    opts = options.check_options(p)
    rows["forward_call (a signature seen before)"] = per_call_us(lambda: options.forward_call(q, q, q))
    rows["check_qkv"] = per_call_us(lambda: options.check_qkv(q, q, q))
    rows["check_options"] = per_call_us(lambda: options.check_options(p))
    rows["kernel_masking"] = per_call_us(lambda: masking_.kernel_masking(p, opts))
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
