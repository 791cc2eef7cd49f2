"""A paged KV cache against the same cache contiguous, in one process (needs a GPU).

    PYTHONPATH=. python benchmarks/paged_vs_contiguous.py [--rounds 5] [--calls 20]

Each row (bf16, bench_decode.py's shapes: 16 query rows of 4 heads a K/V head, one query row) runs
``attention_with_kvcache`` (causal, ``validate=False``, every sequence's whole cache) over the contiguous
cache and over the same keys and values as shuffled pages of 16 and of 256 positions
(bench_decode._paged_cache), the three interleaved over --rounds rounds; a round's time is the median of 3
runs of --calls queued calls between two CUDA events. Prints each page size's median time and its ratio to
the contiguous call's, and any difference between their outputs (the same kernel reads both: none).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import bench_decode  # noqa: E402
import cuflash  # noqa: E402

try:
    import cupy as cp
except ImportError:   # main() says what is missing
    cp = None

# (B, Hq, Hk, Lq, Lk, D)
ROWS = [(8, 32, 8, 16, 131072, 128), (1, 32, 8, 16, 131072, 128), (8, 32, 8, 16, 32768, 64),
        (1, 32, 8, 16, 65536, 64), (8, 32, 8, 1, 32768, 128), (1, 32, 8, 1, 131072, 128), (1, 32, 8, 1, 65536, 64),
        (4, 32, 32, 1, 8192, 128)]
PAGES = (16, 256)


def run_row(row, rounds: int, calls: int, rng) -> str:
    b, hq, hk, lq, lk, d = row
    dt = bench._cp_dtype("bfloat16")
    q = bench_decode._normal(rng, (b, hq, lq, d), dt)
    k, v = (bench_decode._normal(rng, (b, hk, lk, d), dt) for _ in range(2))
    lengths = cp.full((b,), lk, dtype=cp.int32)
    fns = {"contiguous": lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True,
                                                                 validate=False)}
    want = fns["contiguous"]().astype(cp.float32)
    notes = []
    for size in PAGES:
        k_pages, v_pages, table = bench_decode._paged_cache(k, v, size)
        fns[size] = lambda k_pages=k_pages, v_pages=v_pages, table=table: cuflash.attention_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, causal=True, validate=False)
        diff = float(cp.abs(fns[size]().astype(cp.float32) - want).max())
        if diff:
            notes.append(f"pages of {size} differ by {diff:.3g}")
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench._time_queued(fn, calls, runs=3) * 1e3)
    med = {name: float(np.median(t)) for name, t in times.items()}
    paged = ", ".join(f"pages of {size} {med[size]:.1f} ({med[size] / med['contiguous']:.3f}x)" for size in PAGES)
    return (f"B={b} {hq}/{hk} Lq={lq} Lk={lk} D={d}: contiguous {med['contiguous']:.1f} us, {paged}"
            + "".join(f"; {n}" for n in notes))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    if cp is None:
        print("paged_vs_contiguous.py needs CuPy and a GPU")
        return 1
    rng = cp.random.RandomState(0)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, bf16, queued us a call")
    for row in ROWS:
        print(run_row(row, args.rounds, args.calls, rng), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
