"""A paged KV cache read in sequence order against shuffled, and the contiguous cache (needs a GPU).

    PYTHONPATH=. python benchmarks/paged_order.py
    PYTHONPATH=. python benchmarks/paged_order.py --one DTYPE D B LK PAGE ORDER    # one case, three calls (ncu)

One query row of 32 heads over 8 K/V heads (``attention_with_kvcache``, ``validate=False``), pages of 16 and
256 positions in (num_pages, Hk, page_size, D) pools, their order the sequence's (page i of sequence b at
b * pages + i) or shuffled; PAGE 0 is the contiguous cache. Time: the median of 7 runs' mean of 20 queued
calls (CUDA events). What it separates: the page table's cost (pages in order against contiguous) from the
scattered pages' memory traffic (shuffled against in order)."""
import sys
from pathlib import Path

import numpy as np
import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import bench_decode  # noqa: E402
import cuflash  # noqa: E402

CASES = (("bfloat16", 128, 8, 131072), ("bfloat16", 128, 8, 32768), ("float32", 128, 8, 32768),
         ("float64", 128, 8, 32768), ("float32", 128, 1, 65536))


def _pages(k, v, page: int, in_order: bool):
    b, hk, lk, d = k.shape
    per = lk // page
    order = np.arange(b * per) if in_order else np.random.default_rng(1).permutation(b * per)
    order = order.reshape(b, per)
    pools = []
    for c in (k, v):
        blocks = c.reshape(b, hk, per, page, d).transpose(0, 2, 1, 3, 4).reshape(-1, hk, page, d)
        pool = cp.empty_like(blocks)
        pool[cp.asarray(order.reshape(-1))] = blocks
        pools.append(pool)
    return pools[0], pools[1], cp.asarray(order.astype(np.int32))


def call(dtype: str, d: int, b: int, lk: int, page: int, order: str):
    rng = cp.random.RandomState(0)
    dt = bench._cp_dtype(dtype)
    q, k, v = (bench_decode._normal(rng, shape, dt) for shape in ((b, 32, 1, d), (b, 8, lk, d), (b, 8, lk, d)))
    lengths = cp.full((b,), lk, dtype=cp.int32)
    if page == 0:
        return lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, validate=False)
    kp, vp, table = _pages(k, v, page, order == "in-order")   # k, v are freed on return
    return lambda: cuflash.attention_with_kvcache(q, kp, vp, cache_seqlens=lengths, block_table=table, causal=True,
                                                  validate=False)


def timed_us(fn) -> float:
    """The median of 7 runs' mean of 20 queued calls, in us (bench.py's timing), after a first call."""
    fn()
    cp.cuda.Device().synchronize()
    return bench._time_queued(fn, 20, runs=7) * 1000


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        dtype, d, b, lk, page, order = sys.argv[2:8]
        fn = call(dtype, int(d), int(b), int(lk), int(page), order)
        for _ in range(3):
            fn()
        cp.cuda.Device().synchronize()
        return
    for dtype, d, b, lk in CASES:
        base = None
        for page, order in ((0, "contiguous"), (16, "in-order"), (16, "shuffled"), (256, "in-order"),
                            (256, "shuffled")):
            us = timed_us(call(dtype, d, b, lk, page, order))
            base = base or us
            print(f"{dtype:8s} D={d} B={b} Lk={lk:6d} page={page:3d} {order:10s} {us:8.1f} us  x{us / base:.3f}",
                  flush=True)
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
