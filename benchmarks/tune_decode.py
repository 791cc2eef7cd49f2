"""The split-KV partial kernels on candidate tiles, one process, the split table's row swapped between runs
(needs a GPU).

    PYTHONPATH=. python benchmarks/tune_decode.py [--dtypes float32,float64] [--head 128] [--stages 2,3]
    PYTHONPATH=. python benchmarks/tune_decode.py --family fwd_mma --dtypes bfloat16 --head 64 --lq 16 \\
        --tiles 64x128x4x2@2,64x128x4x2@3

For each dtype, 32 query heads over 8 K/V heads at head dim --head, --lq query rows (packed GQA: 4 x Lq rows a
block), attention_forward and attention_with_kvcache over pages of 16, B = 1 at 65536 and 131072 keys and B = 8
at 32768 (--rows to choose); the median of 9 runs' mean of 20 queued calls (CUDA events), two rounds of the
candidates in turn, the better round kept. The candidates: --family's table tiles (fwd_decode: the decoding
kernel; fwd_mma: the 64-row split twin, which takes blocks of more than 16 rows) with the K/V ring's stages set
to each of --stages, or the tiles of --tiles (BMxBNxWARPSxSTAGES@CTAS, each alone in the row). A tile that does
not fit the GPU's shared memory or hold the block's rows is left out by the selection, as for any call: each line
names the partial kernel and tile the call ran."""
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
from cuflash._dispatch.model import TABLES, Tile  # noqa: E402

ROWS = ((1, 65536), (8, 32768), (1, 131072))


def timed_us(fn) -> float:
    """The median of 9 runs' mean of 20 queued calls, in us (bench.py's timing), after a first call."""
    fn()
    cp.cuda.Device().synchronize()
    return bench._time_queued(fn, 20, runs=9) * 1000


def parse_tile(spec: str) -> Tile:
    """``BMxBNxWARPSxSTAGES`` or ``...@CTAS`` as a Tile."""
    dims, _, ctas = spec.partition("@")
    bm, bn, warps, stages = (int(x) for x in dims.split("x"))
    return Tile(bm, bn, warps, stages, f"tune_decode.py candidate {spec}", ctas=int(ctas or 1))


def precompile(family: str, dtype: str, head: int, tiles) -> None:
    """Build the candidates' kernels (no mask and the causal band) on a thread pool before any timing."""
    from concurrent.futures import ThreadPoolExecutor

    from cuflash._dispatch.model import Variant
    from cuflash._runtime.build import get_kernel

    variants = [Variant(family, dtype, head, band=band, vec=True, kv_split=True, tile=t)
                for t in dict.fromkeys(tiles) for band in (False, True)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(get_kernel, variants))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="fwd_decode", choices=("fwd_decode", "fwd_mma"))
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--tiles", help="candidate tiles BMxBNxWARPSxSTAGES[@CTAS], comma-separated (not --stages)")
    ap.add_argument("--lq", type=int, default=1)
    ap.add_argument("--rows", help="B:Lk pairs, comma-separated (default 1:65536,8:32768,1:131072)")
    args = ap.parse_args()
    rows = tuple(tuple(int(x) for x in r.split(":")) for r in args.rows.split(",")) if args.rows else ROWS
    for dtype in args.dtypes.split(","):
        key = ("sm80", args.family, dtype, args.head)
        if args.tiles:
            candidates = {spec: (parse_tile(spec),) for spec in args.tiles.split(",")}
        else:
            candidates = {f"stages={n}": tuple(dict.fromkeys(replace(t, stages=n) for t in TABLES["split"][key]))
                          for n in (int(s) for s in args.stages.split(","))}
        precompile(args.family, dtype, args.head, [t for tiles in candidates.values() for t in tiles])
        for b, lk in rows:
            for label, (dense, paged, ran) in _row(dtype, b, lk, args.head, args.lq, key, candidates).items():
                kv_bytes = 2 * b * 8 * lk * args.head * np.dtype(bench._cp_dtype(dtype)).itemsize
                print(f"{dtype:8s} D={args.head} B={b} Lq={args.lq} Lk={lk:6d} {label}: {dense:7.1f} us "
                      f"({kv_bytes / (dense * 1e-6) / 4.8e12 * 100:5.1f}% of 4.8 TB/s), paged 16 {paged:7.1f} us "
                      f"[ran {ran}]",
                      flush=True)
            cp.get_default_memory_pool().free_all_blocks()


def launched(fn) -> str:
    """The partial kernel (family and tile) that one call of ``fn`` launches first."""
    from cuflash._runtime import launch

    seen = []
    real = launch.launch_kernel

    def record(variant, *args, **kwargs):
        if hasattr(variant, "family") and not seen:
            seen.append(variant)
        return real(variant, *args, **kwargs)
    launch.launch_kernel = record
    try:
        fn()
    finally:
        launch.launch_kernel = real
    t = seen[0].tile
    return f"{seen[0].family} {t.block_m}x{t.block_n}x{t.warps}x{t.stages}@{t.ctas}"


def _row(dtype: str, b: int, lk: int, head: int, lq: int, key, candidates: dict) -> dict:
    """candidate -> (attention_forward us, paged 16 us, the kernel the forward ran), the better of two rounds."""
    rng = cp.random.RandomState(0)
    dt = bench._cp_dtype(dtype)
    q, k, v = (bench_decode._normal(rng, s, dt) for s in ((b, 32, lq, head), (b, 8, lk, head), (b, 8, lk, head)))
    kp, vp, pages = bench_decode._paged_cache(k, v, 16)
    lengths = cp.full((b,), lk, dtype=cp.int32)
    table = TABLES["split"][key]
    best = {}
    try:
        for _ in range(2):
            for label, tiles in candidates.items():
                TABLES["split"][key] = tiles
                select.clear_selection_caches()
                ran = launched(lambda: cuflash.attention_forward(q, k, v))
                dense = timed_us(lambda: cuflash.attention_forward(q, k, v))
                paged = timed_us(lambda: cuflash.attention_with_kvcache(
                    q, kp, vp, cache_seqlens=lengths, block_table=pages, causal=True, validate=False))
                old = best.get(label, (float("inf"), float("inf")))
                best[label] = (min(old[0], dense), min(old[1], paged), ran)
    finally:
        TABLES["split"][key] = table
        select.clear_selection_caches()
        plan.clear_plans()
    return best


if __name__ == "__main__":
    main()
