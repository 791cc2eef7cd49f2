"""Build kernel variants into CuPy's kernel cache in parallel processes, before a GPU test run.

    PYTHONPATH=. python benchmarks/precompile.py [--jobs 16] [--family REGEX] [--tile 128x48x4x3 --heads 128]

The GPU tests compile each variant on first use, one at a time; on a fresh device that is most of a
call's time. This builds every variant this GPU takes (``cuflash._dispatch.select.all_variants``, filtered by
``compile_target``; with --family only the families whose name matches) in ``--jobs`` processes, each
loading its share through ``cuflash._runtime.build.get_kernel``, so that the tests (and pytest-xdist workers)
load them from the cache (CUPY_CACHE_DIR) without compiling. ``--tile BMxBNxWARPSxSTAGES[xpark]`` (repeatable) builds
the picked variants of head dims ``--heads`` at those tiles instead (a tuning script's candidates). Processes, not threads: a build holds the
interpreter for its Python part, and 16 threads measured no faster than a few.
"""
import argparse
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _build(chunk):
    from cuflash._runtime.build import CompileError, get_kernel

    failed = []
    for v in chunk:
        try:
            get_kernel(v)
        except CompileError as exc:
            failed.append(f"{v.name}\n{exc.log}")
    return failed


def _tile(text):
    from cuflash._dispatch.model import Tile

    parts = text.split("x")
    bm, bn, warps, stages = (int(x) for x in parts[:4])
    return Tile(bm, bn, warps, stages, "tuning", park="park" in parts[4:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--family", default="", help="regex on the family name (default: every family)")
    parser.add_argument("--tile", action="append", default=[], help="BMxBNxWARPSxSTAGES[xpark]: build at these tiles")
    parser.add_argument("--heads", default="", help="with --tile: the head dims (comma-separated)")
    args = parser.parse_args()
    from dataclasses import replace

    from cuflash._dispatch.select import all_variants
    from cuflash._runtime.device import compute_capability

    cc = compute_capability()
    picked = [v for v in all_variants() if v.compile_target(f"sm_{cc}") and re.search(args.family, v.family)]
    if args.tile:
        heads = {int(h) for h in args.heads.split(",") if h}
        picked = list(dict.fromkeys(replace(v, tile=_tile(t)) for t in args.tile for v in picked
                                    if (not heads or v.head in heads) and not v.extra))
    chunks = [picked[j::args.jobs] for j in range(args.jobs)]
    start = time.perf_counter()
    # spawn: this process has initialised CUDA (the compute capability), which a forked child cannot use
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [f for part in pool.map(_build, chunks) for f in part]
    for f in failed:
        print("FAILED", f)
    print(f"{len(picked) - len(failed)} of {len(picked)} variants built for sm_{cc} in "
          f"{time.perf_counter() - start:.0f} s with {args.jobs} processes")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
