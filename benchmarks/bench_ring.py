"""Ring attention's scaling: one sequence on one GPU against the same sequence sharded over N GPUs of
one host (needs N GPUs; one process a GPU, NCCL through CuPy).

    PYTHONPATH=. python benchmarks/bench_ring.py [--gpus 2] [--lengths 131072,262144] [--dtype bfloat16]
        [--heads 16] [--head-dim 128] [--repeat 3] [--out DIR]

For each length, causal (zigzag) and not (contiguous): the median time of the forward and of the
forward+backward on 1 GPU (cuflash.attention_forward / attention_backward) and on N (the ring, every
rank timed with CUDA events, the slowest rank's time), the speed-up and the scaling efficiency
(1-GPU time / (N x N-GPU time)). Writes JSON and Markdown named by the device.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
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


def _timed(fn, repeat):
    import cupy as cp

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


def one_gpu(length, heads, d, dtype, causal, repeat):
    import cuflash

    q, k, v, do = _inputs(length, heads, d, dtype)
    fwd = _timed(lambda: cuflash.attention_forward(q, k, v, causal=causal), repeat)

    def both():
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)
        cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)

    return fwd, _timed(both, repeat)


def _rank(rank, size, uid, args, pipe):
    import cupy as cp

    from cuflash import distributed as dist

    cp.cuda.Device(rank).use()
    comm = dist.NcclRing(rank, size, uid, device=rank)
    length, heads, d, dtype, causal, repeat = args
    layout = "zigzag" if causal else "contiguous"
    q, k, v, do = (cp.ascontiguousarray(dist.shard(x, rank, size, layout)) for x in _inputs(length, heads, d, dtype))
    fwd = _timed(lambda: dist.ring_attention_forward(q, k, v, comm, causal=causal, layout=layout), repeat)

    def both():
        out, lse = dist.ring_attention_forward(q, k, v, comm, causal=causal, layout=layout)
        dist.ring_attention_backward(do, q, k, v, out, lse, comm, causal=causal, layout=layout)

    pipe.send((fwd, _timed(both, repeat)))


def n_gpus(size, length, heads, d, dtype, causal, repeat):
    from cuflash import distributed as dist

    ctx = multiprocessing.get_context("spawn")
    uid = dist.NcclRing.unique_id()
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [ctx.Process(target=_rank, args=(r, size, uid, (length, heads, d, dtype, causal, repeat), pipes[r][1]))
             for r in range(size)]
    for p in procs:
        p.start()
    times = [pipes[r][0].recv() for r in range(size)]
    for p in procs:
        p.join()
    return max(t[0] for t in times), max(t[1] for t in times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--lengths", default="131072,262144")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < args.gpus:
        print(f"needs {args.gpus} GPUs, this machine has {cp.cuda.runtime.getDeviceCount()}")
        return 2
    props = cp.cuda.runtime.getDeviceProperties(0)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for causal in (True, False):
            f1, b1 = one_gpu(length, args.heads, args.head_dim, args.dtype, causal, args.repeat)
            fn, bn = n_gpus(args.gpus, length, args.heads, args.head_dim, args.dtype, causal, args.repeat)
            row = {"L": length, "causal": causal, "layout": "zigzag" if causal else "contiguous", "gpus": args.gpus,
                   "dtype": args.dtype, "H": args.heads, "D": args.head_dim, "fwd_1gpu_ms": f1, "fwd_ngpu_ms": fn,
                   "fwdbwd_1gpu_ms": b1, "fwdbwd_ngpu_ms": bn, "fwd_efficiency": f1 / (args.gpus * fn),
                   "fwdbwd_efficiency": b1 / (args.gpus * bn)}
            rows.append(row)
            print(f"L={length:8d} causal={causal!s:5} fwd {f1:9.2f} -> {fn:9.2f} ms ({row['fwd_efficiency']:.0%}) "
                  f"fwd+bwd {b1:9.2f} -> {bn:9.2f} ms ({row['fwdbwd_efficiency']:.0%})", flush=True)
    out = Path(args.out or f"cuflash-ring-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ring-{args.gpus}x-" + device.replace(" ", "_")
    (out / f"{stem}.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    lines = [f"# Ring attention on {args.gpus} x {device}", "",
             "| L | causal | fwd 1 GPU ms | fwd N GPUs ms | efficiency | fwd+bwd 1 GPU ms | fwd+bwd N GPUs ms | efficiency |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['L']} | {r['causal']} | {r['fwd_1gpu_ms']:.2f} | {r['fwd_ngpu_ms']:.2f} | {r['fwd_efficiency']:.0%} | "
              f"{r['fwdbwd_1gpu_ms']:.2f} | {r['fwdbwd_ngpu_ms']:.2f} | {r['fwdbwd_efficiency']:.0%} |" for r in rows]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
