"""One split of the decoding kernel (writing out and lse itself) against the split counts, by tile, on full-GPU rows.
PYTHONPATH=. python .dev/probe_onesplit.py [--rows B:Lk:D,...] [--tiles64 ...] [--tiles128 ...]"""
import argparse, sys
from dataclasses import replace
from pathlib import Path
import numpy as np
import cupy as cp
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench, bench_decode, read_ceiling, tune_decode
import cuflash
from cuflash._dispatch import plan, select
from cuflash._dispatch.model import TABLES

ap = argparse.ArgumentParser()
ap.add_argument("--rows", default="64:4096:64,64:4096:128,64:16384:64,64:16384:128,32:8192:128,16:16384:64,8:16384:64,132:4096:64")
ap.add_argument("--tiles64", default="16x128x4x2@2,16x64x4x2@4,16x64x4x3@3,16x128x4x3@2,16x256x8x2@1")
ap.add_argument("--tiles128", default="16x64x4x2@3,16x128x4x2@1,16x64x4x3@2,16x32x4x2@4")
ap.add_argument("--splits", default="2,3,4")
ap.add_argument("--hq", type=int, default=32)
ap.add_argument("--lq", type=int, default=1)
args = ap.parse_args()
tiles = {64: args.tiles64.split(","), 128: args.tiles128.split(",")}
for d in (64, 128):
    tune_decode.precompile("fwd_decode", "bfloat16", d, [tune_decode.parse_tile(s) for s in tiles[d]])
t = lambda fn: bench._time_queued(fn, 20, runs=9) * 1000
res = []
for spec in args.rows.split(","):
    b, lk, d = (int(x) for x in spec.split(":"))
    rng = cp.random.RandomState(0)
    dt = bench._cp_dtype("bfloat16")
    q, k, v = (bench_decode._normal(rng, s, dt) for s in ((b, args.hq, args.lq, d), (b, 8, lk, d), (b, 8, lk, d)))
    key = ("sm80", "fwd_decode", "bfloat16", d)
    table = TABLES["split"][key]
    row = {}
    ref = cuflash.attention_forward(q, k, v, num_splits=3)[0].astype(cp.float32)
    try:
        for rnd in range(2):
            TABLES["split"][key] = table; select.clear_selection_caches(); plan.clear_plans()
            for n in [None] + [int(x) for x in args.splits.split(",")]:
                f = lambda n=n: cuflash.attention_forward(q, k, v, num_splits=n)
                lab = f"auto[{bench_decode._first_grid(f)}]" if n is None else f"{n}sp"
                row[lab] = min(row.get(lab, 1e9), t(f))
            for spec_t in tiles[d]:
                TABLES["split"][key] = (tune_decode.parse_tile(spec_t),); select.clear_selection_caches(); plan.clear_plans()
                f = lambda: cuflash.attention_forward(q, k, v, num_splits=1)
                if rnd == 0:
                    err = float(cp.abs(f()[0].astype(cp.float32) - ref).max())
                    ran = tune_decode.launched(f)
                    print(f"  B={b} Lk={lk} D={d} one split {spec_t}: ran {ran}, max |diff| vs 3 splits {err:.2e}", flush=True)
                lab = f"1sp {spec_t}"
                row[lab] = min(row.get(lab, 1e9), t(f))
                f3 = lambda: cuflash.attention_forward(q, k, v, num_splits=3)
                lab = f"3sp {spec_t}"
                row[lab] = min(row.get(lab, 1e9), t(f3))
    finally:
        TABLES["split"][key] = table; select.clear_selection_caches(); plan.clear_plans()
    tq, tk, tv = (bench_decode.torch.from_dlpack(x) for x in (q, k, v))
    F, SB = bench_decode.F, bench_decode.SDPBackend
    def cudnn():
        with bench_decode.sdpa_kernel(SB.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    try:
        cudnn(); row["cudnn"] = min(t(cudnn), t(cudnn))
    except Exception as e:
        row["cudnn"] = float("nan")
    r = read_ceiling.reader(k, v)
    row["ceiling"] = t(r)
    best = min(vv for kk, vv in row.items() if kk not in ("cudnn", "ceiling"))
    print(f"B={b} Lk={lk} D={d}: " + ", ".join(f"{kk} {vv:.1f}" for kk, vv in row.items())
          + f" | best cuflash / cudnn {row['cudnn'] / best:.3f}x", flush=True)
    res.append((spec, row))
    del q, k, v; cp.get_default_memory_pool().free_all_blocks()
print("\n== summary (us) ==")
for spec, row in res:
    best = min((vv, kk) for kk, vv in row.items() if kk not in ("cudnn", "ceiling"))
    auto = next(vv for kk, vv in row.items() if kk.startswith("auto"))
    print(f"{spec:14s} auto {auto:7.1f} best {best[0]:7.1f} ({best[1]}) cudnn {row['cudnn']:7.1f} ceil {row['ceiling']:7.1f}"
          f"  auto/cudnn {row['cudnn']/auto:.3f} best/cudnn {row['cudnn']/best[0]:.3f}")
