"""The decoding kernel (fwd_decode) on candidate tiles, one process, the split table's row swapped between runs
(needs a GPU).

    PYTHONPATH=. python benchmarks/tune_decode.py [--dtypes float32,float64] [--head 128] [--stages 2,3]

For each dtype, the table's tiles for one query row of 32 heads over 8 K/V heads at head dim --head, with the
K/V ring's stages set to each of --stages (a tile that does not fit the GPU's shared memory is left out by the
selection, as for any call): attention_forward and attention_with_kvcache over pages of 16, B = 1 at 65536 and
131072 keys and B = 8 at 32768; the median of 9 runs' mean of 20 queued calls (CUDA events), two rounds of the
candidates in turn, the better round kept."""
import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import bench_decode  # noqa: E402
import cuflash  # noqa: E402
from cuflash._dispatch import plan, select  # noqa: E402
from cuflash._dispatch.model import TABLES  # noqa: E402

ROWS = ((1, 65536), (8, 32768), (1, 131072))


def timed_us(fn) -> float:
    """The median of 9 runs' mean of 20 queued calls, in us (bench.py's timing), after a first call."""
    fn()
    cp.cuda.Device().synchronize()
    return bench._time_queued(fn, 20, runs=9) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--stages", default="2,3")
    args = ap.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    for dtype in args.dtypes.split(","):
        key = ("sm80", "fwd_decode", dtype, args.head)
        candidates = {n: tuple(dict.fromkeys(replace(t, stages=n) for t in TABLES["split"][key])) for n in stages}
        for b, lk in ROWS:
            for n, (dense, paged) in _row(dtype, b, lk, args.head, key, candidates).items():
                kv_bytes = 2 * b * 8 * lk * args.head * np.dtype(bench._cp_dtype(dtype)).itemsize
                print(f"{dtype:8s} D={args.head} B={b} Lk={lk:6d} stages={n}: {dense:7.1f} us "
                      f"({kv_bytes / (dense * 1e-6) / 4.8e12 * 100:5.1f}% of 4.8 TB/s), paged 16 {paged:7.1f} us",
                      flush=True)
            cp.get_default_memory_pool().free_all_blocks()


def _row(dtype: str, b: int, lk: int, head: int, key, candidates: dict) -> dict:
    """stages -> (attention_forward us, paged 16 us), the better of two rounds."""
    rng = cp.random.RandomState(0)
    dt = bench._cp_dtype(dtype)
    q, k, v = (bench_decode._normal(rng, s, dt) for s in ((b, 32, 1, head), (b, 8, lk, head), (b, 8, lk, head)))
    kp, vp, pages = bench_decode._paged_cache(k, v, 16)
    lengths = cp.full((b,), lk, dtype=cp.int32)
    table = TABLES["split"][key]
    best = {}
    try:
        for _ in range(2):
            for n, tiles in candidates.items():
                TABLES["split"][key] = tiles
                select.clear_selection_caches()
                dense = timed_us(lambda: cuflash.attention_forward(q, k, v))
                paged = timed_us(lambda: cuflash.attention_with_kvcache(
                    q, kp, vp, cache_seqlens=lengths, block_table=pages, causal=True, validate=False))
                old = best.get(n, (float("inf"), float("inf")))
                best[n] = (min(old[0], dense), min(old[1], paged))
    finally:
        TABLES["split"][key] = table
        select.clear_selection_caches()
        plan.clear_plans()
    return best


if __name__ == "__main__":
    main()
