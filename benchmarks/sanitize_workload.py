"""A small forward + backward workload of every dtype, for compute-sanitizer.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python benchmarks/sanitize_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/sanitize_workload.py --quick
    compute-sanitizer --tool racecheck python benchmarks/sanitize_workload.py --quick --dims 256 --dtypes float16

Odd lengths at the tile edges (Lq = 97, Lk = 130), grouped-query heads, both dQ
strategies; the full set also covers both causal alignments, unaligned head dims
and the two-pass head-dim-128 backward. Prints one line per call so a sanitizer
report can be placed.
"""
import argparse
import itertools

import ml_dtypes
import numpy as np

import cupy as cp

import cuflash

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="head dims 64, 128 and 256 (the Hopper forward), "
                                                                 "bottom-right causal only")
    parser.add_argument("--dims", default=None, help="only these head dims, e.g. 256 (one kernel under a sanitizer)")
    parser.add_argument("--dtypes", default=None, help="only these dtypes, e.g. float16,bfloat16")
    args = parser.parse_args(argv)
    dims = (64, 128, 256) if args.quick else (64, 111, 128, 256)
    if args.dims:
        dims = tuple(int(d) for d in args.dims.split(","))
    dtypes = args.dtypes.split(",") if args.dtypes else list(DTYPES)
    modes = ("bottom_right",) if args.quick else (False, "bottom_right")
    rng = np.random.default_rng(0)
    mask = np.ones((2, 1, 1, 130), dtype=bool)
    mask[0, ..., 90:] = False
    for dtype, d, causal, det, masked in itertools.product(dtypes, dims, modes, (False, True), (False, True)):
        q, do = (cp.asarray(rng.standard_normal((2, 2, 97, d)).astype(DTYPES[dtype])) for _ in range(2))
        k, v = (cp.asarray(rng.standard_normal((2, 1, 130, d)).astype(DTYPES[dtype])) for _ in range(2))
        opts = {}
        if masked:   # every EXTRA piece at once; the bias is shared by the batch (dbias atomics or turns)
            opts = dict(bias=cp.asarray(rng.standard_normal((1, 2, 97, 130)).astype(DTYPES[dtype])),
                        mask=cp.asarray(mask), window=(60, 20), dropout_p=0.2, seed=11,
                        block_layout=cuflash.BlockLayout.from_rule(97, 130, 32, local=1, global_blocks=1))
        out, lse = cuflash.attention_forward(q, k, v, causal=causal, **opts)
        grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=det, **opts)
        cp.cuda.Device().synchronize()
        finite = all(bool(cp.isfinite(x.astype(cp.float64)).all()) for x in (out,) + grads)
        print(f"{dtype:8} d={d:3} causal={causal!s:12} deterministic={det!s:5} masked={masked!s:5} finite={finite}",
              flush=True)


if __name__ == "__main__":
    main()
