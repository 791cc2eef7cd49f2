"""The HBM read ceiling by size: how fast one kernel that does nothing but read N bytes once runs, launch,
ramp-up and tail included. A decoding call reads its K/V cache once; this is the rate no such call can beat
at the same byte count, and the measure its speed is held against where the bytes are few.

    PYTHONPATH=. python benchmarks/read_ceiling.py [--repeat 50]

Each configuration: CTAs of 256 threads, ``ctas`` a streaming multiprocessor (all of them resident: at most 32
registers a thread, __launch_bounds__), every
thread reading 16-byte words grid-stride with ``unroll`` independent loads in flight (``ld.global.nc``, the
words XOR-ed into a value stored only if it matches a constant, so the loads stay). Time: bench.py's queued
timing (the median of 5 runs of ``--repeat`` calls between two CUDA events). Prints TB/s and % of the HBM
peak (benchmarks/bench_decode.py's table) for sizes from 16 MB to 8 GB; ``bench_decode.py`` times
:func:`reader` on each row's K and V as its "HBM read ceiling" contender.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))

SOURCE = r'''
template <int UNROLL>
__device__ __forceinline__ unsigned read_words(const uint4* words, long long count, long long first,
                                               long long stride) {
    unsigned seen = 0;
    long long i = first;
    for (; i + (UNROLL - 1) * stride < count; i += UNROLL * stride) {
        uint4 w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) w[u] = __ldg(words + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) seen ^= w[u].x ^ w[u].y ^ w[u].z ^ w[u].w;
    }
    for (; i < count; i += stride) {
        const uint4 w = __ldg(words + i);
        seen ^= w.x ^ w.y ^ w.z ^ w.w;
    }
    return seen;
}

// Thread t of the grid reads words t, t + stride, ... of a, then of b; nothing is written unless the
// XOR of everything it read is 0x9e3779b9 (the store keeps the loads).
template <int UNROLL>
__device__ void read_once(const uint4* a, long long a_words, const uint4* b, long long b_words, unsigned* sink) {
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const unsigned seen = read_words<UNROLL>(a, a_words, first, stride) ^ read_words<UNROLL>(b, b_words, first, stride);
    if (seen == 0x9e3779b9u) sink[0] = seen;
}

extern "C" __global__ void __launch_bounds__(256, 8) read_once_4(const uint4* a, long long na, const uint4* b,
                                                              long long nb, unsigned* sink) {
    read_once<4>(a, na, b, nb, sink);
}
extern "C" __global__ void __launch_bounds__(256, 8) read_once_8(const uint4* a, long long na, const uint4* b,
                                                              long long nb, unsigned* sink) {
    read_once<8>(a, na, b, nb, sink);
}
'''
THREADS = 256
CONFIGS = ((4, 4), (8, 4), (8, 8), (4, 8))
"""(CTAs an SM, loads in flight a thread) timed by main(); :func:`reader` takes READER_CONFIG."""
READER_CONFIG = (4, 4)
"""The configuration bench_decode.py's ceiling contender runs: main()'s fastest on the H200 (4.02 TB/s at 134 MB,
4.62 from 2 GB)."""

_MODULE = None


def _kernel(unroll: int):
    global _MODULE
    if _MODULE is None:
        _MODULE = cp.RawModule(code=SOURCE)
    return _MODULE.get_function(f"read_once_{unroll}")


def reader(a: cp.ndarray, b: cp.ndarray, config=READER_CONFIG) -> Optional[Callable[[], None]]:
    """A callable that reads every byte of ``a`` and ``b`` once in one launch; None where either is not
    C-contiguous or its size is not a whole number of 16-byte words."""
    if not (a.flags.c_contiguous and b.flags.c_contiguous) or a.nbytes % 16 or b.nbytes % 16:
        return None
    ctas_per_sm, unroll = config
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    fn = _kernel(unroll)
    sink = cp.zeros(1, cp.uint32)
    args = (a, cp.int64(a.nbytes // 16), b, cp.int64(b.nbytes // 16), sink)
    grid = (sms * ctas_per_sm,)
    return lambda: fn(grid, (THREADS,), args)


def main(argv=None) -> int:
    import bench
    from bench_decode import HBM_PEAK

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    peak = next((bw for key, bw in HBM_PEAK.items() if key in name), None)
    print(f"{name}: one kernel reading two buffers once, 256 threads a CTA")
    print(f"{'MB':>7s} " + " ".join(f"{f'{c}x{u} TB/s':>11s}" for c, u in CONFIGS) + "   best % peak")
    for mb in (16, 32, 64, 134, 268, 537, 1074, 2147, 4295, 8590):
        half = mb * 10**6 // 2 // 16 * 16
        a, b = (cp.ones(half // 4, cp.uint32) for _ in range(2))
        rates = []
        for config in CONFIGS:
            fn = reader(a, b, config)
            fn()
            cp.cuda.Device().synchronize()
            rates.append(2 * half / bench._time_queued(fn, args.repeat) / 1e9)
        best = max(rates)
        print(f"{mb:7d} " + " ".join(f"{r:11.2f}" for r in rates)
              + (f"   {100 * best * 1e12 / peak:10.1f}" if peak else ""))
        del a, b
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
