"""One query row over a long cache with the split count forced, beside cuDNN in one process (needs a GPU and
PyTorch): does the split rule (select.split_count) take the fastest count?

    PYTHONPATH=. python benchmarks/split_counts.py [--rows B:Lk:D,...] [--counts 1,2,3,...]

bf16, 32 query heads over 8 K/V heads, one query row; rows (B, Lk, D) below (or --rows). Each: cuflash with the rule's count
("auto"), PyTorch SDPA's cuDNN backend on the same buffers, then cuflash with ``num_splits`` forced to each count
of COUNTS (or --counts) whose grid (B x 8 x n CTAs) stays within 32 CTAs an SM. Time: the better of two medians of 9 runs of 20
queued calls (bench.py's timing), in us.
"""
import argparse
import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import bench_decode  # noqa: E402
import cuflash  # noqa: E402

ROWS = ((1, 131072, 128), (1, 262144, 64), (1, 131072, 64), (1, 65536, 128), (8, 32768, 128), (8, 32768, 64))
COUNTS = (8, 12, 16, 24, 32, 33, 48, 49, 64, 66, 99, 132)


def us(fn) -> float:
    fn()
    cp.cuda.Device().synchronize()
    return min(bench._time_queued(fn, 20, runs=9) for _ in range(2)) * 1000


def main() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help="B:Lk:D triples, comma-separated")
    ap.add_argument("--counts", help="split counts, comma-separated")
    args = ap.parse_args()
    rows = [tuple(int(x) for x in r.split(":")) for r in args.rows.split(",")] if args.rows else ROWS
    counts = [int(x) for x in args.counts.split(",")] if args.counts else COUNTS
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for b, lk, d in rows:
        rng = cp.random.RandomState(0)
        dt = bench._cp_dtype("bfloat16")
        q = bench_decode._normal(rng, (b, 32, 1, d), dt)
        k, v = (bench_decode._normal(rng, (b, 8, lk, d), dt) for _ in range(2))
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        res = {"auto": us(lambda: cuflash.attention_forward(q, k, v)), "cudnn": us(cudnn)}
        for n in counts:
            if b * n <= 4 * sms:
                res[n] = us(lambda: cuflash.attention_forward(q, k, v, num_splits=n))
        print(f"B={b} Lk={lk} D={d}: " + "  ".join(f"{key}:{val:.1f}" for key, val in res.items()), flush=True)
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
