"""cuflash command line: run a demo, print the installation, build the kernels.

  demo      run attention forward and backward on the GPU (or the NumPy path without one)
  info      versions, device, NVRTC, kernel cache
  compile   build every kernel variant for this GPU, or check builds for --arch without one
  estimate  tiles, score entries and HBM bytes of naive attention vs the tiled kernel
  bench     benchmark against PyTorch SDPA and naive CuPy (GPU, source checkout);
            bench --precision: float32/float64 speed next to each contender's error;
            bench --decode: few query rows over a long KV cache (split-KV);
            bench --varlen: packed sequences of different lengths against padding;
            bench --mods: user score and mask modifications against FlexAttention
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np


def _progress(items, desc: str, total=None):
    """``items`` with a progress bar on stderr (tqdm's, or one line every 10% with the count and an ETA)."""
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False)
    except ImportError:
        return _counted(items, desc, total)


def _counted(items, desc: str, total):
    start, step, shown = time.perf_counter(), max(1, (total or 0) // 10), 0
    for done, item in enumerate(items, 1):
        yield item
        if total and (done - shown >= step or done == total):
            shown = done
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (total - done)
            print(f"{desc}: {done} of {total}, {elapsed:.0f} s, about {eta:.0f} s left", file=sys.stderr,
                  flush=True)


def _check_arches(text: str) -> list:
    """The --arch list, or SystemExit with one line saying what is wrong."""
    from ._dispatch.model import SUPPORTED_ARCHES

    arches = [a.strip() for a in text.split(",") if a.strip()]
    for arch in arches:
        if arch not in SUPPORTED_ARCHES:
            raise SystemExit(f"error: --arch {arch!r}: cuflash builds for {', '.join(SUPPORTED_ARCHES)} "
                             "(A100; RTX 30, A40; RTX 40, L4, L40; H100, H200; RTX 50)")
    if not arches:
        raise SystemExit("error: --arch needs at least one architecture, e.g. --arch sm_80,sm_90")
    return arches


def cmd_compile(args) -> int:
    """Without --arch: build every variant for this machine's GPU into CuPy's kernel
    cache. With --arch: compile every variant for those architectures with NVRTC
    (no GPU needed) and report registers, spills and shared memory."""
    arches = _check_arches(args.arch) if args.arch else None
    try:
        import cupy_backends.cuda.libs.nvrtc  # noqa: F401
    except ImportError:
        from ._runtime.device import INSTALL_HINT

        raise SystemExit(f"error: compiling kernels needs CuPy and NVRTC, which are not installed: {INSTALL_HINT}")
    return _compile_offline(arches) if arches else _compile_for_this_gpu()


def _parallel(fn, items, desc: str):
    """fn over items on a thread pool (NVRTC releases the GIL), in order, with a progress bar."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield from _progress(pool.map(fn, items), desc, total=len(items))


def _compile_for_this_gpu() -> int:
    from ._runtime.build import CompileError, get_kernel
    from ._runtime.device import gpu_available
    from ._dispatch.select import all_variants

    ok, what = gpu_available()
    if not ok:
        print(f"No GPU here ({what}). To check that every kernel builds without one, run\n"
              "    python -m cuflash compile --arch sm_80,sm_90")
        return 2

    def build(var):
        try:
            get_kernel(var)
            return var, None
        except CompileError as exc:
            return var, exc

    from ._runtime.device import compute_capability as _compute_capability

    cc = _compute_capability()   # the Hopper variants only on Hopper
    variants = [var for var in all_variants() if var.compile_target(f"sm_{cc}")]
    start = time.perf_counter()
    failures = [(var, exc) for var, exc in _parallel(build, variants, "compiling") if exc is not None]
    for var, exc in failures:
        print(f"FAILED {var.name}\n{exc.log}")
    print(f"{len(variants) - len(failures)} of {len(variants)} kernel variants built for {what} in "
          f"{time.perf_counter() - start:.0f} s, into CuPy's kernel cache ({_cache_dir()}): "
          "later processes load them without compiling")
    return 1 if failures else 0


def _cache_dir() -> str:
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def _compile_offline(arches) -> int:
    from ._runtime.build import CompileError, compile_offline
    from ._dispatch.model import smem_limit_for_arch
    from ._dispatch.select import all_variants

    # Each architecture builds the variants its GPUs can select (those fitting their shared memory).
    # The Hopper (sm90a) variants build for sm_90a under --arch sm_90, and not elsewhere.
    jobs = [(arch, var) for arch in arches for var in all_variants()
            if var.smem_bytes <= smem_limit_for_arch(arch) and var.compile_target(arch)]

    def build(job):
        arch, var = job
        try:
            return arch, var, compile_offline(var.entry, var.name, var.compile_target(arch)), None
        except CompileError as exc:
            return arch, var, None, exc

    failures = spills = 0
    print(f"{'arch':6} {'regs':>4} {'spill B':>7} {'smem KB':>7}  variant")
    for arch, var, build, exc in _parallel(build, jobs, "compiling"):
        if exc is not None:
            failures += 1
            print(f"{arch:6} FAILED  {var.name}\n{exc.log}")
            continue
        spills += build.spills > 0
        print(f"{arch:6} {build.registers:4d} {build.spills:7d} {var.smem_bytes / 1024:7.1f}  {var.name}"
              + ("   <-- SPILLS" if build.spills else ""))
    print(f"{len(jobs)} variant builds: {failures} failed, {spills} with spills")
    return 1 if failures or spills else 0


def cmd_info(args) -> int:
    from . import __version__
    from ._runtime.build import kernel_dir, source_hash
    from ._runtime.device import gpu_available
    from ._dispatch.select import all_variants

    print(f"cuflash      {__version__}  (kernels {kernel_dir()}, source hash {source_hash()})")
    print(f"python       {platform.python_version()}  numpy {np.__version__}")
    try:
        import ml_dtypes

        print(f"ml_dtypes    {ml_dtypes.__version__}")
    except ImportError:
        print("ml_dtypes    not installed (bfloat16 unavailable)")
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc

        from ._runtime.build import preload_nvrtc_wheel

        preload_nvrtc_wheel()
        print(f"cupy         {cupy.__version__}")
        try:
            print("nvrtc        %d.%d" % nvrtc.getVersion())
        except Exception as exc:
            print(f"nvrtc        not loadable ({exc})")
        print(f"kernel cache {_cache_dir()}")
    except ImportError:
        from ._runtime.device import INSTALL_HINT

        print(f"cupy         not installed: NumPy inputs only (for the GPU: {INSTALL_HINT})")
    ok, what = gpu_available()
    print(f"device       {what if ok else 'none: ' + what}")
    variants = all_variants()
    print(f"variants     {len(variants)} (build all ahead of time: python -m cuflash compile)")
    return 0


def _measure(fn):
    """(median ms, pool growth in MiB) of fn() on the GPU."""
    import cupy
    from cupyx.profiler import benchmark

    pool = cupy.get_default_memory_pool()
    fn()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    fn()
    cupy.cuda.Device().synchronize()
    grown = (pool.total_bytes() - before) / 2**20
    res = benchmark(fn, n_repeat=20, n_warmup=3)
    return float(np.median(res.gpu_times[0]) * 1e3), grown


def _rel(x, ref) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def cmd_demo(args) -> int:
    from . import attention_backward, attention_forward, reference
    from ._runtime.device import gpu_available

    ok, what = gpu_available()
    if not ok:
        print(f"No GPU here: {what}.\nRunning the NumPy reference path on a small problem instead.")
        given = [f"--{name}" for name, default in _DEMO_DEFAULTS.items() if getattr(args, name) != default]
        if given:
            print(f"(note: {', '.join(given)} set the GPU problem; the NumPy path runs a fixed small one)")
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((1, 2, 256, 64)) for _ in range(4))
        t = time.perf_counter()
        out, lse = attention_forward(q, k, v, causal=True)
        grads = attention_backward(dout, q, k, v, out, lse, causal=True)
        ms = (time.perf_counter() - t) * 1e3
        ref = reference.attention_naive(q, k, v, causal=True)[0]
        ref_grads = reference.attention_backward_naive(dout, q, k, v, causal=True)
        err = max([_rel(out, ref)] + [_rel(g, r) for g, r in zip(grads, ref_grads)])
        print(f"numpy  B=1 H=2 L=256 D=64 float64 causal, forward + backward: {ms:.1f} ms, "
              f"max rel. error vs naive {err:.1e}")
        return 0 if err < 1e-10 else 1

    import cupy

    b, h, n, d = args.batch, args.heads, args.seqlen, args.headdim
    dtype = np.float16
    print(f"device {what}; problem B={b} H={h} L={n} D={d} float16 causal")
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(dtype) for _ in range(4))
    out, lse = attention_forward(q, k, v, causal=True)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=True)
    # Check one (batch, head) slice against the float64 NumPy reference.
    sl = (0, h - 1)
    host = [cupy.asnumpy(x[sl]).astype(np.float64) for x in (q, k, v, dout)]
    ref, ref_lse = reference.attention_naive(*host[:3], causal=True)
    ref_grads = reference.attention_backward_naive(host[3], *host[:3], causal=True)
    errs = [_rel(cupy.asnumpy(x[sl]), r) for x, r in zip((out, dq, dk, dv), (ref,) + tuple(ref_grads))]
    lse_err = np.abs(cupy.asnumpy(lse[sl]) - ref_lse).max()
    print(f"check vs float64 reference on head {sl}: rel. error out {errs[0]:.2e}, dq {errs[1]:.2e}, "
          f"dk {errs[2]:.2e}, dv {errs[3]:.2e}; max lse error {lse_err:.2e}")
    flops = 4 * b * h * n * n * d / 2

    def fwd_bwd():
        o, l_ = attention_forward(q, k, v, causal=True)
        return attention_backward(dout, q, k, v, o, l_, causal=True)

    rows = [("cuflash forward", flops, lambda: attention_forward(q, k, v, causal=True)),
            ("naive cupy forward", flops, lambda: reference.attention_materialised(q, k, v, causal=True)),
            ("cuflash fwd + bwd", 3.5 * flops, fwd_bwd)]
    print(f"{'':20} {'ms':>8} {'TFLOP/s':>8} {'extra MiB':>10}")
    for name, work, fn in rows:
        try:
            ms, mib = _measure(fn)
            print(f"{name:20} {ms:8.3f} {work / ms / 1e9:8.1f} {mib:10.1f}")
        except cupy.cuda.memory.OutOfMemoryError:
            print(f"{name:20} out of memory")
    return 0 if max(errs) < 1e-2 else 1


def cmd_bench(args, rest) -> int:
    """Run benchmarks/bench.py (with --precision: benchmarks/bench_precision.py) from the source
    checkout this package comes from."""
    import runpy
    from pathlib import Path

    name = "bench.py"
    if "--precision" in rest:   # float32 / float64 speed next to error: benchmarks/bench_precision.py
        name = "bench_precision.py"
        rest = [a for a in rest if a != "--precision"]
    elif "--decode" in rest:   # few query rows over a long KV cache: benchmarks/bench_decode.py
        name = "bench_decode.py"
        rest = [a for a in rest if a != "--decode"]
    elif "--varlen" in rest:   # packed sequences against padding: benchmarks/bench_varlen.py
        name = "bench_varlen.py"
        rest = [a for a in rest if a != "--varlen"]
    elif "--mods" in rest:   # user modifications against FlexAttention: benchmarks/bench_mods.py
        name = "bench_mods.py"
        rest = [a for a in rest if a != "--mods"]
    script = Path(__file__).resolve().parent.parent / "benchmarks" / name
    if not script.is_file():
        raise SystemExit("error: the benchmark ships with the source repository, not the installed package: "
                         "clone it and run `python -m cuflash bench` (or `python benchmarks/bench.py`) there")
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_estimate(args) -> int:
    from .estimate import estimate

    causal = {"none": False, "top_left": True, "bottom_right": "bottom_right"}[args.causal]
    try:
        est = estimate(lq=args.lq, lk=args.lk if args.lk is not None else args.lq, d=args.d, dv=args.dv,
                       dtype=args.dtype, causal=causal, batch=args.batch, heads_q=args.heads, gpu=args.gpu)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(est.table())
    return 0


_DEMO_DEFAULTS = {"batch": 4, "heads": 16, "seqlen": 4096, "headdim": 64}


def _prog() -> str:
    """How the user called us: the installed ``cuflash`` script or ``python -m cuflash``."""
    return "cuflash" if os.path.basename(sys.argv[0] or "") == "cuflash" else "python -m cuflash"


def main(argv=None) -> int:
    from ._dispatch.model import SUPPORTED_ARCHES

    parser = argparse.ArgumentParser(prog=_prog(), description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", metavar="command")
    p = sub.add_parser("demo", help="run attention forward and backward on a representative problem",
                       description="Run causal float16 attention forward and backward on the GPU, check one head "
                                   "against the float64 reference and time it next to naive CuPy attention. "
                                   "Without a GPU, run the NumPy path on a small fixed problem.")
    p.add_argument("--batch", type=int, default=_DEMO_DEFAULTS["batch"], help="batch size B (default 4)")
    p.add_argument("--heads", type=int, default=_DEMO_DEFAULTS["heads"], help="heads H (default 16)")
    p.add_argument("--seqlen", type=int, default=_DEMO_DEFAULTS["seqlen"], help="sequence length L (default 4096)")
    p.add_argument("--headdim", type=int, default=_DEMO_DEFAULTS["headdim"], help="head dim D, 1..256 (default 64)")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("info", help="versions, device, NVRTC, kernel cache")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("compile", help="build every kernel variant for this GPU (or check --arch builds without one)",
                       description="Without --arch: build every kernel variant for this machine's GPU into "
                                   "CuPy's kernel cache, so later processes start without compiling. With --arch: "
                                   "compile every variant for those architectures with NVRTC (no GPU needed) and "
                                   "report registers, spills and shared memory.")
    p.add_argument("--arch", default=None, help="comma-separated architectures, e.g. sm_80,sm_86,sm_90")
    p.set_defaults(fn=cmd_compile)
    p = sub.add_parser("estimate", help="tiles, score entries and HBM bytes: naive attention vs the tiled kernel",
                       description="Model one forward call: the (query, key) tiles the kernel visits with its "
                                   "real tile sizes, the n x n scores naive attention stores, HBM bytes and "
                                   "arithmetic intensity of both. No GPU needed.")
    p.add_argument("--lq", type=int, required=True, help="query length")
    p.add_argument("--lk", type=int, default=None, help="key length (default: --lq)")
    p.add_argument("--d", type=int, default=64, help="q/k head dim (default 64)")
    p.add_argument("--dv", type=int, default=None, help="v head dim (default: --d)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "float64"])
    p.add_argument("--causal", nargs="?", const="top_left", default="none",
                   choices=["none", "top_left", "bottom_right"], help="causal mask (bare --causal: top-left)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--gpu", default="sm_90", choices=list(SUPPORTED_ARCHES),
                   help="the GPU whose shared memory chooses the tile (default sm_90: H100, H200)")
    p.set_defaults(fn=cmd_estimate)
    p = sub.add_parser("bench", help="benchmark against PyTorch SDPA (GPU, source checkout; --precision: "
                                     "float32 / float64 with errors; --decode: decoding over a KV cache; "
                                     "--varlen: packed sequences; --mods: user modifications)",
                       description="Run benchmarks/bench.py (needs a GPU and a source checkout); every option "
                                   "after `bench` goes to it, e.g. --quick, --out DIR, --replot JSON. With "
                                   "--precision: benchmarks/bench_precision.py instead (float32 and float64, "
                                   "each contender's error next to its speed); with --decode: "
                                   "benchmarks/bench_decode.py (few query rows over a long KV cache); with "
                                   "--varlen: benchmarks/bench_varlen.py (packed sequences against padding); "
                                   "with --mods: benchmarks/bench_mods.py (user modifications against "
                                   "FlexAttention).",
                       add_help=False)
    p.set_defaults(fn=cmd_bench)
    args, rest = parser.parse_known_args(argv)
    if args.cmd is None:
        parser.print_help()
        print(f"\nchoose a command, e.g. {parser.prog} demo")
        return 2
    if args.cmd == "bench":
        return args.fn(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
