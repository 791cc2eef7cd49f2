"""Ring attention's scaling: one sequence on one GPU against the same sequence sharded over N GPUs of
one host (needs N GPUs; one process a GPU, NCCL through CuPy).

    PYTHONPATH=. python benchmarks/bench_ring.py [--gpus 2] [--lengths 131072,262144,524288,1048576] [--dtype bfloat16]
        [--heads 16] [--head-dim 128] [--repeat 3] [--long-from 524288] [--causal-layouts zigzag,striped]
        [--single-from results.json] [--out DIR]

For each length, causal (each of --causal-layouts) and not (contiguous): the median time of the forward and of the
forward+backward on 1 GPU (cuflash.attention_forward / attention_backward) and on N (the ring, every
rank timed with CUDA events, the slowest rank's time), the speed-up and the scaling efficiency
(1-GPU time / (N x N-GPU time)), and each rank's time waiting for transfers a forward+backward (NcclRing's
recorded waits: what the overlap did not hide). Writes JSON and Markdown named by the device. ``--single-from``: the 1-GPU times
of a results JSON of this script (same dtype, heads and head dim, same device) where it has the (length, causal)
row, each row naming the file it took them from (they are the bulk of a run's time at 1M tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _inputs(length, heads, d, dtype, seed=0):
    import cupy as cp
    import ml_dtypes

    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype]
    rng = cp.random.default_rng(seed)
    return [rng.standard_normal((1, heads, length, d), dtype=cp.float32).astype(dt) for _ in range(4)]


def _timed(fn, repeat, warm=True):
    """Median ms of ``repeat`` calls (CUDA events), after one untimed call when ``warm``."""
    import cupy as cp

    if warm:
        fn()
        cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def one_gpu(length, heads, d, dtype, causal, repeat, warm):
    import cuflash

    q, k, v, do = _inputs(length, heads, d, dtype)
    fwd = _timed(lambda: cuflash.attention_forward(q, k, v, causal=causal), repeat, warm)

    def both():
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)
        cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)

    return fwd, _timed(both, repeat, warm)


def _rank(comm, rows, heads, d, dtype):
    """One rank's (forward ms, forward+backward ms, forward+backward's wait ms) of each row (length, causal,
    layout, repeat, warm): the wait, the time a call's compute stream stood waiting for transfers (NcclRing's
    recorded waits, a call's mean)."""
    import cupy as cp

    from cuflash import distributed as dist

    times = []
    for length, causal, layout, repeat, warm in rows:
        q, k, v, do = (cp.ascontiguousarray(dist.shard(x, comm.rank, comm.size, layout))
                       for x in _inputs(length, heads, d, dtype))
        cp.get_default_memory_pool().free_all_blocks()   # the whole sequence's inputs, made to be sharded
        fwd = _timed(lambda: dist.ring_attention_forward(q, k, v, comm, causal=causal, layout=layout), repeat, warm)

        def both():
            out, lse = dist.ring_attention_forward(q, k, v, comm, causal=causal, layout=layout)
            dist.ring_attention_backward(do, q, k, v, out, lse, comm, causal=causal, layout=layout)

        comm.waits.clear()
        both_ms = _timed(both, repeat, warm)
        times.append((fwd, both_ms, comm.wait_ms() / (repeat + int(warm))))
        if comm.rank == 0:
            print(f"rank 0: L={length} causal={causal} {layout} fwd {fwd:.2f} ms fwd+bwd {both_ms:.2f} ms "
                  f"(waiting {times[-1][2]:.2f} ms)", flush=True)
        q = k = v = do = None   # freed before the next length's inputs
        cp.get_default_memory_pool().free_all_blocks()
    return times


def _plan(lengths, repeat, long_from, causal_layouts=("zigzag",)):
    """(length, causal, layout, repeat, warm) rows: each mode warmed up at the first length only (the kernels
    are the same at every length), one timed call from ``long_from`` tokens on."""
    modes = [(True, layout) for layout in causal_layouts] + [(False, "contiguous")]
    return [(n, causal, layout, repeat if n < long_from else 1, i == 0)
            for i, n in enumerate(lengths) for causal, layout in modes]


def _single_times(path, device: str, dtype: str, heads: int, head_dim: int) -> dict:
    """(length, causal) -> (forward ms, forward+backward ms) on one GPU from a results JSON of this script."""
    if not path:
        return {}
    data = json.loads(Path(path).read_text())
    if data.get("device") != device:
        raise SystemExit(f"{path} was measured on {data.get('device')}, this is {device}")
    return {(r["L"], r["causal"]): (r["fwd_1gpu_ms"], r["fwdbwd_1gpu_ms"]) for r in data["rows"]
            if (r["dtype"], r["H"], r["D"]) == (dtype, heads, head_dim)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--lengths", default="131072,262144,524288,1048576")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--long-from", type=int, default=524288,
                        help="lengths from here on are timed once (seconds a call)")
    parser.add_argument("--causal-layouts", default="zigzag",
                        help="the ring's layouts for the causal rows, comma-separated (zigzag, striped, contiguous)")
    parser.add_argument("--single-from", default=None,
                        help="a results JSON whose 1-GPU times to reuse (same dtype, heads, head dim and device)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < args.gpus:
        print(f"needs {args.gpus} GPUs, this machine has {cp.cuda.runtime.getDeviceCount()}")
        return 2
    props = cp.cuda.runtime.getDeviceProperties(0)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    from cuflash import distributed as dist

    plan = _plan([int(x) for x in args.lengths.split(",")], args.repeat, args.long_from,
                 args.causal_layouts.split(","))
    single = {}   # one GPU's times a (length, causal), shared by the layouts
    reused = _single_times(args.single_from, device, args.dtype, args.heads, args.head_dim)
    measured = set()   # modes (causal or not) timed on one GPU so far: the first call of each warms up
    for n, causal, _, repeat, warm in plan:
        if (n, causal) in reused and (n, causal) not in single:
            single[n, causal] = reused[n, causal]
            print(f"1 GPU: L={n} causal={causal} from {args.single_from}", flush=True)
        if (n, causal) not in single:
            single[n, causal] = one_gpu(n, args.heads, args.head_dim, args.dtype, causal, repeat,
                                        warm or causal not in measured)
            measured.add(causal)
            print(f"1 GPU: L={n} causal={causal} fwd {single[n, causal][0]:.2f} ms "
                  f"fwd+bwd {single[n, causal][1]:.2f} ms", flush=True)
    ones = [single[n, causal] for n, causal, *_ in plan]
    cp.get_default_memory_pool().free_all_blocks()   # GPU 0 is rank 0's too
    per_rank = dist.launch(_rank, args.gpus, args=(plan, args.heads, args.head_dim, args.dtype), timed=True)
    rows = []
    for (length, causal, layout, repeat, _), (f1, b1), *ranks in zip(plan, ones, *per_rank):
        fn, bn = max(t[0] for t in ranks), max(t[1] for t in ranks)   # the slowest rank's
        row = {"L": length, "causal": causal, "layout": layout, "gpus": args.gpus,
               "single_from": args.single_from if (length, causal) in reused else None,
               "dtype": args.dtype, "H": args.heads, "D": args.head_dim, "repeat": repeat, "fwd_1gpu_ms": f1,
               "fwd_ngpu_ms": fn, "fwdbwd_1gpu_ms": b1, "fwdbwd_ngpu_ms": bn,
               "fwdbwd_wait_ms": [t[2] for t in ranks], "fwd_efficiency": f1 / (args.gpus * fn),
               "fwdbwd_efficiency": b1 / (args.gpus * bn)}
        rows.append(row)
        waits = "/".join(f"{w:.1f}" for w in row["fwdbwd_wait_ms"])
        print(f"L={length:8d} causal={causal!s:5} {layout:10} fwd {f1:9.2f} -> {fn:9.2f} ms "
              f"({row['fwd_efficiency']:.0%}) fwd+bwd {b1:9.2f} -> {bn:9.2f} ms ({row['fwdbwd_efficiency']:.0%}), "
              f"waiting {waits} ms a rank", flush=True)
    out = Path(args.out or f"cuflash-ring-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ring-{args.gpus}x-" + device.replace(" ", "_")
    (out / f"{stem}.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    lines = [f"# Ring attention on {args.gpus} x {device}", "",
             "| L | causal | layout | fwd 1 GPU ms | fwd N GPUs ms | efficiency | fwd+bwd 1 GPU ms | fwd+bwd N GPUs ms "
             "| efficiency | fwd+bwd waiting ms (a rank each) |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['L']} | {r['causal']} | {r['layout']} | {r['fwd_1gpu_ms']:.2f} | {r['fwd_ngpu_ms']:.2f} | "
              f"{r['fwd_efficiency']:.0%} | {r['fwdbwd_1gpu_ms']:.2f} | {r['fwdbwd_ngpu_ms']:.2f} | "
              f"{r['fwdbwd_efficiency']:.0%} | {' / '.join(f'{w:.1f}' for w in r['fwdbwd_wait_ms'])} |" for r in rows]
    taken = sorted({r["L"] for r in rows if r["single_from"]})
    if taken:
        lines += ["", f"1-GPU times at L = {', '.join(map(str, taken))} from {args.single_from}."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
