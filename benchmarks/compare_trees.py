"""Time two cuflash source trees side by side: did a change speed things up or slow them down?

Both trees are imported into one process (as ``cuflash_before`` / ``cuflash_after``)
and timed on the same buffers, interleaved round by round so that clock and
thermal drift hit both alike. Each round takes the median of ``--repeat``
CUDA-event-timed calls after warm-up; the table shows the median over rounds and
the spread (max/min over rounds of the after/before ratio). Outputs are compared
too (max abs difference), so a faster but different kernel is noticed.

    PYTHONPATH=. python benchmarks/compare_trees.py --before /path/to/old/tree [--after .] [--quick | --decode]

Cases: B x L = 16384 tokens, H x D = 2048 (the benchmark's shape), forward and
forward+backward, the dtypes and head dims of benchmarks/bench.py. ``--decode``: decoding
shapes instead (DECODE_ROWS: few query rows over a long cache), each as the forward, as a
KV-cache step that appends Lq keys and values (unvalidated lengths) and as that step over
pages of 16 positions; the time is a queued call's (a loop of calls between two events, the
host's time included, as a decoding loop sees it).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np

import cupy as cp
from cupyx.profiler import benchmark


def load_tree(root: Path, name: str):
    """Import the cuflash package of the source tree ``root`` under the module name ``name``."""
    pkg = root / "cuflash"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def patch_compute_capability(m, value: int) -> None:
    """Make the tree ``m`` (loaded by :func:`load_tree`) report compute capability ``value``: its
    ``_runtime.device.compute_capability`` where the tree has ``_runtime``, else the older layout's
    ``_launch._compute_capability``."""
    if importlib.util.find_spec(f"{m.__name__}._runtime") is not None:
        importlib.import_module(f"{m.__name__}._runtime.device").compute_capability = lambda: value
    else:
        importlib.import_module(f"{m.__name__}._launch")._compute_capability = lambda: value


def cases(quick: bool, lengths=None):
    out = []
    for dtype in ("bfloat16", "float16"):
        for d in (64, 128):
            for n in lengths or ((4096,) if quick else (1024, 4096)):
                for causal in (False, True):
                    out.append(("fwd", dtype, d, n, causal))
            for causal in (False, True):
                out.append(("fwd+bwd", dtype, d, 4096, causal))
    for dtype, d in (("float32", 64), ("float32", 128), ("float64", 64)):
        out += [("fwd", dtype, d, 4096, True), ("fwd+bwd", dtype, d, 4096, True)]
    return out


def masking_cases():
    """The masking benchmark's shapes (bench_masking.py): (label, pass, dtype, B, H, L, D, causal, options-maker)."""
    def bias(b, h, n, dtype):
        return dict(bias=cp.random.default_rng(1).standard_normal((1, 1, n, n), dtype=cp.float32).astype(dtype))

    def padding(b, h, n, dtype):
        pad = cp.ones((b, 1, 1, n), dtype=bool)
        for i in range(b):
            pad[i, ..., n - (i + 1) * n // 8:] = False
        return dict(mask=pad)

    def window(b, h, n, dtype):
        return dict(window=(256, None))

    out = []
    for kind in ("fwd", "fwd+bwd"):
        out += [("bias (1,1,L,L)", kind, "float16", 4, 16, 4096, 64, False, bias),
                ("key padding", kind, "float16", 4, 16, 4096, 64, False, padding),
                ("window (256, 0)", kind, "float16", 1, 16, 16384, 64, True, window),
                ("bias (1,1,L,L)", kind, "float32", 4, 16, 4096, 64, False, bias),
                ("bias (1,1,L,L)", kind, "float32", 1, 16, 8192, 64, False, bias),
                ("bias (1,1,L,L)", kind, "float16", 1, 16, 16384, 64, False, bias)]
    return out


def _dtype(name):
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16}.get(name, np.dtype(name))


def run_case(mods, kind, dtype, d, n, causal, rounds, repeat, b=None, h=None, opts=None):
    b, h = b or 16384 // n, h or 2048 // d
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(_dtype(dtype)) for _ in range(4))
    opts = opts or {}

    def fn(m):
        if kind == "fwd":
            return lambda: m.attention_forward(q, k, v, causal=causal, **opts)
        def fwd_bwd():
            out, lse = m.attention_forward(q, k, v, causal=causal, **opts)
            return m.attention_backward(do, q, k, v, out, lse, causal=causal, **opts)
        return fwd_bwd

    fns = [fn(m) for m in mods]
    results = [f() for f in fns]                     # compile + warm up
    first = [r[0] for r in results]             # out, or dq
    diff = float(cp.abs(first[0].astype(cp.float64) - first[1].astype(cp.float64)).max())
    times = [[], []]
    for _ in range(rounds):
        for i, f in enumerate(fns):
            t = benchmark(f, n_repeat=repeat, n_warmup=2)
            times[i].append(float(np.median(t.gpu_times[0]) * 1e3))
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0) * (3.5 if kind == "fwd+bwd" else 1.0)
    ratios = [a / b_ for a, b_ in zip(times[1], times[0])]
    ms = [float(np.median(t)) for t in times]
    return {"pass": kind, "dtype": dtype, "D": d, "L": n, "B": b, "H": h, "causal": causal,
            "before_ms": ms[0], "after_ms": ms[1], "before_tflops": flops / ms[0] / 1e9,
            "after_tflops": flops / ms[1] / 1e9, "speedup": ms[0] / ms[1],
            "ratio_spread": [min(ratios), max(ratios)], "max_abs_diff_first_output": diff}


DECODE_ROWS = [("bfloat16", 8, 32, 8, 1, 32768, 128), ("bfloat16", 1, 32, 8, 1, 131072, 128),
               ("bfloat16", 1, 8, 8, 16, 65536, 64), ("bfloat16", 4, 32, 32, 1, 8192, 128),
               ("bfloat16", 1, 32, 8, 1, 65536, 128), ("bfloat16", 8, 32, 8, 1, 131072, 64),
               ("bfloat16", 64, 32, 8, 1, 4096, 128), ("bfloat16", 1, 32, 8, 1, 4096, 64),
               ("bfloat16", 8, 32, 8, 16, 65536, 64), ("float32", 8, 32, 8, 1, 32768, 128),
               ("float64", 8, 32, 8, 1, 32768, 128)]
"""(dtype, B, Hq, Hk, Lq, Lk, D) of --decode: bench_decode.py's four reference rows, then rows where the
one-row decode reads at the peers' rate, a call the host's time bounds, 16 rows, float32 and float64."""
DECODE_KINDS = ("forward", "append", "paged 16 append")


def queued_ms(fn, calls: int) -> float:
    """Milliseconds a call of ``calls`` queued back to back (between two events: host time included;
    bench.py's timing, one run)."""
    from bench import _time_queued

    cp.cuda.get_current_stream().synchronize()   # nothing earlier on the clock
    return _time_queued(fn, calls, runs=1)


def run_decode_case(mods, row, kind, rounds, calls):
    """One decoding row and kind (DECODE_KINDS) timed on both trees, interleaved round by round."""
    from bench_decode import _paged_cache

    dtype, b, hq, hk, lq, lk, d = row
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((b, hq, lq, d), dtype=cp.float32).astype(_dtype(dtype))
    k, v = (rng.standard_normal((b, hk, lk, d), dtype=cp.float32).astype(_dtype(dtype)) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, hk, lq, d), dtype=cp.float32).astype(_dtype(dtype)) for _ in range(2))
    before = cp.full((b,), lk - lq, dtype=cp.int32)   # each step writes the last lq positions
    held = []                                          # per tree: a function giving its cache's last lq rows

    def fn(m):
        if kind == "forward":
            return lambda: m.attention_forward(q, k, v)
        if kind == "append":   # a cache of the tree's own: an append that writes nothing shows in both checks
            k_own, v_own = k.copy(), v.copy()
            held.append(lambda: (k_own[:, :, -lq:], v_own[:, :, -lq:]))
            return lambda: m.attention_with_kvcache(q, k_own, v_own, k_new, v_new, cache_seqlens=before,
                                                    causal=True, validate=False)
        k_pages, v_pages, table = _paged_cache(k, v, 16)

        def last_rows():
            rows = cp.arange(lk - lq, lk)
            pages = table[:, rows // 16]                              # (B, lq)
            at = (pages, slice(None), rows % 16)
            return k_pages[at].transpose(0, 2, 1, 3), v_pages[at].transpose(0, 2, 1, 3)
        held.append(last_rows)
        return lambda: m.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new, cache_seqlens=before,
                                                block_table=table, causal=True, validate=False)

    fns = [fn(m) for m in mods]
    outs = [f() for f in fns]                           # compile + warm up
    first = [o[0] if isinstance(o, tuple) else o for o in outs]
    diff = float(cp.abs(first[0].astype(cp.float64) - first[1].astype(cp.float64)).max())
    for last in held:   # each tree's append wrote the new keys and values
        for got, want in zip(last(), (k_new, v_new)):
            if not bool((cp.ascontiguousarray(got).view(cp.uint8) == want.view(cp.uint8)).all()):
                raise AssertionError(f"{kind} {row}: a tree's cache does not hold the appended keys and values")
    times = [[], []]
    for _ in range(rounds):
        for i, f in enumerate(fns):
            for _ in range(3):
                f()
            times[i].append(queued_ms(f, calls))
    ratios = [a / b_ for a, b_ in zip(times[1], times[0])]
    ms = [float(np.median(t)) for t in times]
    kv_bytes = 2 * b * hk * lk * d * np.dtype(_dtype(dtype)).itemsize
    return {"pass": kind, "dtype": dtype, "B": b, "Hq": hq, "Hk": hk, "Lq": lq, "Lk": lk, "D": d,
            "before_ms": ms[0], "after_ms": ms[1], "before_tbps": kv_bytes / ms[0] / 1e9,
            "after_tbps": kv_bytes / ms[1] / 1e9, "speedup": ms[0] / ms[1], "ratio_spread": [min(ratios), max(ratios)],
            "max_abs_diff_first_output": diff}


def host_overhead(mods, calls: int = 2000):
    """Host microseconds per call (tiny problem, calls queued without synchronizing, so
    the host is the bottleneck): forward and forward+backward, per tree."""
    import time

    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 128, 64), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    rows = []
    for kind in ("fwd", "fwd+bwd"):
        per_call = []
        for m in mods:
            def call(m=m):
                out, lse = m.attention_forward(q, k, v)
                if kind == "fwd+bwd":
                    m.attention_backward(do, q, k, v, out, lse)
            for _ in range(20):
                call()
            cp.cuda.Device().synchronize()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                t1 = time.perf_counter()
                cp.cuda.Device().synchronize()
                best = min(best, (t1 - t0) / calls * 1e6)
            per_call.append(best)
        rows.append((kind, *per_call))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path)
    parser.add_argument("--after", default=Path("."), type=Path)
    parser.add_argument("--quick", action="store_true", help="L = 4096 only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--host", action="store_true", help="only the host overhead per call")
    parser.add_argument("--only", default=None, help="only the cases whose label (e.g. 'fwd bfloat16 128 4096 "
                                                     "True'; masking cases: 'bias (1,1,L,L) fwd float32 8192') "
                                                     "matches this regular expression")
    parser.add_argument("--lengths", default=None, help="comma-separated forward lengths (default 1024,4096; "
                                                        "4096 with --quick)")
    parser.add_argument("--masking", action="store_true", help="also the masking benchmark's bias, key padding "
                                                               "and window cases")
    parser.add_argument("--portable", action="store_true", help="both trees on the portable mma.sync path (the "
                                                                "compute capability patched to 8.0 on a Hopper GPU)")
    parser.add_argument("--no-host", action="store_true", help="skip the host-time lines")
    parser.add_argument("--decode", action="store_true", help="decoding shapes instead (DECODE_ROWS x DECODE_KINDS; "
                                                              "--only matches e.g. '^append bfloat16 1 32 8 1 131072')")
    parser.add_argument("--calls", type=int, default=50, help="--decode: queued calls a timing")
    args = parser.parse_args(argv)
    mods = [load_tree(args.before.resolve(), "cuflash_before"), load_tree(args.after.resolve(), "cuflash_after")]
    if args.portable:   # as bench.py's "cuflash sm80" contender
        for m in mods:
            patch_compute_capability(m, 80)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rows = []
    print(f"device {device}; before {args.before}, after {args.after}" + (" (portable path)" if args.portable else ""),
          flush=True)
    for kind, before_us, after_us in ([] if args.no_host and not args.host else host_overhead(mods)):
        print(f"host time per call, {kind:7}: before {before_us:6.1f} us, after {after_us:6.1f} us", flush=True)
    if args.host:
        return
    if args.decode:
        print(f"{'pass':16} {'dtype':9} {'B':>3} {'Hq/Hk':>6} {'Lq':>3} {'Lk':>7} {'D':>4} {'before us':>10} "
              f"{'after us':>9} {'TB/s b/a':>11} {'speed-up':>8} {'spread':>12} {'max|diff|':>9}", flush=True)
        for row in DECODE_ROWS:
            for kind in DECODE_KINDS:
                if args.only and not re.search(args.only, " ".join(str(c) for c in (kind,) + row)):
                    continue
                r = run_decode_case(mods, row, kind, args.rounds, args.calls)
                rows.append(r)
                print(f"{kind:16} {r['dtype']:9} {r['B']:3d} {r['Hq']:>3}/{r['Hk']:<2} {r['Lq']:3d} {r['Lk']:7d} "
                      f"{r['D']:4d} {r['before_ms'] * 1e3:10.1f} {r['after_ms'] * 1e3:9.1f} "
                      f"{r['before_tbps']:5.2f}/{r['after_tbps']:5.2f} {r['speedup']:7.3f}x "
                      f"{1 / r['ratio_spread'][1]:5.3f}-{1 / r['ratio_spread'][0]:5.3f} "
                      f"{r['max_abs_diff_first_output']:9.2e}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
        return
    print(f"{'pass':8} {'dtype':9} {'D':>4} {'L':>5} {'causal':>6} {'before ms':>10} {'after ms':>9} "
          f"{'TFLOP/s b/a':>14} {'speed-up':>8} {'spread':>12} {'max|diff|':>9}", flush=True)
    lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None
    for case in cases(args.quick, lengths):
        if args.only and not re.search(args.only, " ".join(str(c) for c in case)):
            continue
        r = run_case(mods, *case, rounds=args.rounds, repeat=args.repeat)
        rows.append(r)
        print(f"{r['pass']:8} {r['dtype']:9} {r['D']:4d} {r['L']:5d} {str(r['causal']):>6} {r['before_ms']:10.3f} "
              f"{r['after_ms']:9.3f} {r['before_tflops']:6.1f}/{r['after_tflops']:6.1f} {r['speedup']:7.3f}x "
              f"{1 / r['ratio_spread'][1]:5.3f}-{1 / r['ratio_spread'][0]:5.3f} {r['max_abs_diff_first_output']:9.2e}",
              flush=True)
    if args.masking:
        print(f"{'masking case':16} {'pass':8} {'dtype':8} {'L':>5} {'before ms':>10} {'after ms':>9} {'speed-up':>8} {'spread':>12} "
              f"{'max|diff|':>9}", flush=True)
        for label, kind, dtype, b, h, n, d, causal, make in masking_cases():
            if args.only and not re.search(args.only, f"{label} {kind} {dtype} {n}"):
                continue
            r = run_case(mods, kind, dtype, d, n, causal, args.rounds, args.repeat, b=b, h=h,
                         opts=make(b, h, n, dtype))
            r["case"] = label
            rows.append(r)
            print(f"{label:16} {kind:8} {dtype:8} {n:5d} {r['before_ms']:10.3f} {r['after_ms']:9.3f} {r['speedup']:7.3f}x "
                  f"{1 / r['ratio_spread'][1]:5.3f}-{1 / r['ratio_spread'][0]:5.3f} "
                  f"{r['max_abs_diff_first_output']:9.2e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
