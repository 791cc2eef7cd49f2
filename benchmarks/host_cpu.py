"""Host time per call without a GPU: cuflash's Python path on fake device memory, the driver's launch
and tensor-map calls replaced by no-ops (CuPy arrays over unowned addresses, never read).

    python benchmarks/host_cpu.py [TREE] [--profile]

TREE: a source tree to import cuflash from (default: this checkout); a tree of the older layout
(cuflash/_launch.py) is patched at its own names, so two trees can be compared on one CPU. Prints
the best of five runs of 3000 repeated calls (fp16, (1, 2, 128, 64), on a fake compute capability 9.0
device): forward, and forward + backward; then one query row of 32 heads over a cache of 8 heads x 4096
keys: the forward, attention_with_kvcache and a paged cache of 16-key pages (``validate=False``: a check
reads the device), with NumPy lengths (and table) checked on the host, and with one new key appended where
the append is one kernel; --profile adds cProfile's cumulative table for cuflash.
On the H200 host the same comparison measured 34.0 -> 38.9 us (forward) where this CPU measured
27.5 -> 31.3 us: the proxy tracks the device host's figures to ~20%.
"""
import cProfile
import pkgutil
import pstats
import sys
import time
from pathlib import Path

import numpy as np

import cupy as cp
from cupy.cuda import driver, memory

ROOT = Path(__file__).resolve().parent.parent


class FakeDevice:
    """Unowned fake addresses, 1 KB aligned, never read."""

    def __init__(self):
        self.next = 0x7F0000000000

    def empty(self, shape, dtype=np.float32, order="C"):
        n = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        mem = memory.UnownedMemory(self.next, n, None, device_id=0)
        self.next += (n + 1023) // 1024 * 1024
        return cp.ndarray(shape, dtype=dtype, memptr=memory.MemoryPointer(mem, 0))

    def alloc(self, nbytes):
        """A memory pointer over ``nbytes`` (cupy.cuda.alloc's place)."""
        return self.empty((max(int(nbytes), 1),), np.uint8).data


class _Kernel:
    class kernel:
        ptr = 1


class _Stream:
    ptr = 0


class _Event:
    def __init__(self, **_):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _patch(cuflash, dev: FakeDevice) -> None:
    cp.empty = cp.zeros = dev.empty
    cp.cuda.alloc = dev.alloc
    cp.cuda.runtime.getDevice = lambda: 0
    cp.cuda.get_current_stream = lambda: _Stream
    driver.launchKernel = lambda *args: None
    # NumPy lengths' uploads (kvcache._uploaded): page-locked buffers as plain ones, copies and events no-ops
    import cupyx
    cupyx.empty_pinned = lambda shape, dtype=np.float32: np.empty(shape, dtype)
    cp.cuda.runtime.memcpyAsync = lambda *args: None
    cp.cuda.Event = _Event
    facts = (90, 232448, "H200 (fake)", 132)
    names = {m.name for m in pkgutil.iter_modules(cuflash.__path__)}
    if "_dispatch" in names:
        from cuflash._runtime import device, launch, tma
        device.device_facts = lambda device_id: facts
        launch.get_kernel = lambda variant: _Kernel
        tma._encode_fn = lambda: (lambda addr, *args: 0)
        tma._replace_fn = lambda: (lambda addr, ptr: 0)
    else:   # the older layout
        from cuflash import _launch, _tma
        _launch._device_facts = lambda device_id: facts
        _launch.get_kernel = lambda variant: _Kernel
        _tma._encode_fn = lambda: (lambda addr, *args: 0)
        _tma._replace_fn = lambda: (lambda addr, ptr: 0)


def kvcache_module(cuflash):
    """cuflash.kvcache, or None in a tree without it."""
    import importlib

    try:
        return importlib.import_module(cuflash.__name__ + ".kvcache")
    except ImportError:
        return None


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tree = Path(args[0]).resolve() if args else ROOT
    sys.path.insert(0, str(tree))
    import cuflash

    dev = FakeDevice()
    _patch(cuflash, dev)
    q, k, v, do = (dev.empty((1, 2, 128, 64), np.float16) for _ in range(4))

    def forward():
        return cuflash.attention_forward(q, k, v)

    def both():
        out, lse = cuflash.attention_forward(q, k, v)
        cuflash.attention_backward(do, q, k, v, out, lse)

    cases = [(forward, "forward"), (both, "forward+backward")]
    if hasattr(cuflash, "attention_with_kvcache"):   # one query row of 32 heads over an (8, 4096) cache
        dq = dev.empty((1, 32, 1, 64), np.float16)
        kc, vc = (dev.empty((1, 8, 4096, 64), np.float16) for _ in range(2))
        kp, vp = (dev.empty((256, 8, 16, 64), np.float16) for _ in range(2))
        lengths, table = dev.empty((1,), np.int32), dev.empty((1, 256), np.int32)
        cases += [(lambda: cuflash.attention_forward(dq, kc, vc), "decoding forward"),
                  (lambda: cuflash.attention_with_kvcache(dq, kc, vc, cache_seqlens=lengths, causal=True,
                                                          validate=False), "kvcache, validate=False"),
                  (lambda: cuflash.attention_with_kvcache(dq, kp, vp, cache_seqlens=lengths, block_table=table,
                                                          causal=True, validate=False), "paged 16, validate=False")]
        if hasattr(kvcache_module(cuflash), "_uploaded"):   # NumPy lengths and tables, checked on the host
            host_lengths, host_table = np.array([4000], np.int32), np.arange(256, dtype=np.int32)[None]
            cases += [(lambda: cuflash.attention_with_kvcache(dq, kc, vc, cache_seqlens=host_lengths, causal=True),
                       "kvcache, NumPy lengths"),
                      (lambda: cuflash.attention_with_kvcache(dq, kp, vp, cache_seqlens=host_lengths,
                                                              block_table=host_table, causal=True),
                       "paged 16, NumPy lengths and table")]
        if hasattr(kvcache_module(cuflash), "_appended"):   # an append the fake device can take (one kernel)
            kn, vn = (dev.empty((1, 8, 1, 64), np.float16) for _ in range(2))
            cases += [(lambda: cuflash.attention_with_kvcache(dq, kc, vc, kn, vn, cache_seqlens=lengths, causal=True,
                                                              validate=False), "kvcache append, validate=False")]
    for fn, label in cases:
        for _ in range(50):
            fn()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(3000):
                fn()
            best = min(best, (time.perf_counter() - t0) / 3000 * 1e6)
        print(f"{tree.name or tree}: {label} {best:.1f} us a call")
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3000):
            both()
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats("cuflash", 30)


if __name__ == "__main__":
    main()
