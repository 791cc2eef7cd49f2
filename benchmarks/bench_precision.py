"""float32 and float64 attention: speed and error side by side (needs a GPU).

float32: cuflash precision="highest" (3xTF32 forward), precision="tf32", and the internal
FMA forward ("cuflash fma", the baseline the tensor-core kernels replace; no public option
names it, selected by patching ``cuflash._dispatch.plan.forward_choice``)
against SDPA "efficient" and SDPA "math" in float32 with TF32 matmuls off (and on: "torch
math tf32"). float64: cuflash against SDPA "math" and naive CuPy (materialised scores;
forward+backward through ``reference.attention_backward_naive`` on the GPU). Every
contender reads the same buffers (PyTorch through DLPack); the float64 inputs are the
float32 inputs' values, so one exact answer serves both dtypes.

Cases: head dims 64 and 128, L in 1024 / 4096 / 16384 (``--quick``: 4096), B*L = 16384
tokens, H*D = 2048, causal and not, forward and forward+backward. FLOPs 4*B*H*L*L*D
forward, halved when causal, forward+backward 3.5x (as bench.py). Timing as bench.py:
``ms`` is the median of calls timed alone, ``ms_queued`` the mean call of back-to-back
runs; the repeat count shrinks for slow calls (``--budget-ms`` of calls a measurement).
SDPA math and naive CuPy store n x n matrices (2 for a forward, 4 (math) or 6 (naive)
for forward+backward): a contender whose estimate is above ``--max-gb`` is skipped with
the reason recorded.

Error: relative Frobenius norm ||got - exact|| / ||exact|| on the probe slice, batch 0,
head 0: ``out`` over all L query rows; ``dq`` over ``--probe`` query rows and ``dk``,
``dv`` over ``--probe`` key rows (evenly spaced, first and last included). "exact" is
computed on the host from the inputs' values in NumPy long double (x86: 64-bit
significand, 2^-64 = 5e-20 relative; ``--ref float64`` takes float64 instead, which is
exact enough for the float32 contenders only: it is no reference for float64 ones).
The forward pass of the reference (every row's lse and out, needed for dk/dv's
rowsum(dO * O)) costs L*L*D multiply-adds (halved when causal) in long double (NumPy's
loop, ~0.2 G/s a core): it runs in a process pool (``--ref-workers``; the workers only
run NumPy) before the timings.

    PYTHONPATH=. python benchmarks/bench_precision.py [--quick] [--out DIR] [--logit-scale 30]
    python -m cuflash bench --precision [same options]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PEER = {"fp32": "torch efficient", "fp64": "torch math"}
CONTENDERS = {"fp32": ("cuflash fma", "cuflash highest", "cuflash tf32", "torch efficient", "torch math",
                       "torch math tf32"),
              "fp64": ("cuflash", "torch math", "naive cupy")}
NP_DTYPE = {"fp32": np.float32, "fp64": np.float64}
FIELDS = ("out", "dq", "dk", "dv")
# n x n matrices a materialising contender holds at once: (forward, forward+backward).
NXN = {"torch math": (2, 4), "torch math tf32": (2, 4), "naive cupy": (2, 6)}


# ----------------------------------------------------------------------------- cases and arithmetic

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="L = 4096 only")
    parser.add_argument("--lengths", default=None, help="sequence lengths, e.g. 1024,4096 (default 1024,4096,16384)")
    parser.add_argument("--head-dims", default="64,128", help="head dims (default 64,128)")
    parser.add_argument("--dtypes", default="fp32,fp64", help="fp32, fp64 or both (default)")
    parser.add_argument("--no-bwd", action="store_true", help="forward only")
    parser.add_argument("--repeat", type=int, default=20, help="most timed calls a measurement (default 20)")
    parser.add_argument("--budget-ms", type=float, default=200.0,
                        help="fewer timed calls for slow contenders: about this many ms of calls (default 200)")
    parser.add_argument("--skip", default="", help="contenders to leave out, e.g. 'torch math tf32,naive cupy'")
    parser.add_argument("--logit-scale", type=float, default=1.0,
                        help="q and k drawn from N(0, s^2) (s = 30: logits of several hundred; default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", type=int, default=64,
                        help="query rows (dq) and key rows (dk, dv) the gradient errors cover (default 64)")
    parser.add_argument("--ref", choices=("longdouble", "float64"), default="longdouble",
                        help="precision of the exact answer (float64: float32 contenders only)")
    parser.add_argument("--ref-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="processes computing the exact answer (default: cores - 1)")
    parser.add_argument("--max-gb", type=float, default=40.0,
                        help="skip materialising contenders whose n x n matrices exceed this (default 40)")
    parser.add_argument("--tag", default="", help="suffix of the output names, e.g. d64 for a --head-dims 64 run")
    parser.add_argument("--out", default=None,
                        help="output folder (default: a new ./cuflash-precision-<time>/); benchmarks/results "
                             "writes precision-<device>.json/.md there")
    args = parser.parse_args(argv)
    args.lengths = _ints(args.lengths) if args.lengths else ((4096,) if args.quick else (1024, 4096, 16384))
    args.head_dims = _ints(args.head_dims)
    args.dtypes = tuple(t.strip() for t in args.dtypes.split(",") if t.strip())
    bad = [t for t in args.dtypes if t not in NP_DTYPE]
    if bad or not args.dtypes:
        parser.error(f"--dtypes takes fp32 and/or fp64, got {bad or 'nothing'}")
    for n in args.lengths:
        if n < 1 or 16384 % n:
            parser.error(f"--lengths: {n} does not divide the 16384 tokens (B = 16384 / L)")
    for d in args.head_dims:
        if d < 1 or d > 256 or 2048 % d:
            parser.error(f"--head-dims: {d} must divide H*D = 2048 and be at most 256")
    args.skip = frozenset(s.strip() for s in args.skip.split(",") if s.strip())
    return args


def _ints(text):
    return tuple(int(x) for x in text.split(",") if x.strip())


def cases(dtypes, head_dims, lengths, with_bwd=True):
    """(dtype, B, H, L, D, causal, pass) in run order: inputs are grouped by (D, L)."""
    out = []
    for d in head_dims:
        for n in lengths:
            for dtype in dtypes:
                for pass_ in ("fwd", "fwd+bwd") if with_bwd else ("fwd",):
                    for causal in (False, True):
                        out.append((dtype, 16384 // n, 2048 // d, n, d, causal, pass_))
    return out


def flops(b, h, n, d, causal, pass_):
    """4*B*H*L*L*D for the forward, halved when causal; forward+backward is 3.5x the forward."""
    return 4.0 * b * h * n * n * d * (0.5 if causal else 1.0) * (3.5 if pass_ == "fwd+bwd" else 1.0)


def nxn_gb(name, dtype, b, h, n, pass_):
    """Estimated GB of n x n matrices a materialising contender holds (0 for the tiled ones)."""
    count = NXN.get(name, (0, 0))[pass_ == "fwd+bwd"]
    return count * b * h * n * n * np.dtype(NP_DTYPE[dtype]).itemsize / 1e9


def probe_indices(n, count):
    """``count`` evenly spaced indices of range(n), first and last included (all of them if n <= count)."""
    return np.unique(np.linspace(0, n - 1, min(n, max(count, 2))).round().astype(np.int64))


# ----------------------------------------------------------------------------- inputs and the exact answer

def make_inputs(b, h, n, d, seed, logit_scale=1.0):
    """q, k, v, dout as float32 host arrays (B, H, L, D), N(0, 1), q and k times ``logit_scale``."""
    rng = np.random.default_rng([seed, d, n])
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=np.float32) for _ in range(4))
    if logit_scale != 1.0:
        q *= np.float32(logit_scale)
        k *= np.float32(logit_scale)
    return q, k, v, do


def _forward_rows(q_rows, k, v, r0, causal, scale, work):
    """(lse, out) of query rows ``r0:r0 + len(q_rows)`` of one head, in ``work`` precision (row max
    subtracted); with ``causal``, ``k`` and ``v`` need hold only the keys these rows see."""
    r1 = r0 + len(q_rows)
    kend = r1 if causal else len(k)
    qw, kw, vw = (x.astype(work) for x in (q_rows, k[:kend], v[:kend]))
    s = (qw @ kw.T) * work(scale)                                   # S = scale Q K^T
    if causal:
        s[np.arange(kend)[None, :] > np.arange(r0, r1)[:, None]] = -np.inf
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)                                               # P = exp(S - m) / rowsum
    total = e.sum(axis=-1, keepdims=True)
    return (m + np.log(total))[:, 0], (e @ vw) / total              # lse, O = P V


def _forward_task(args):
    return _forward_rows(*args)


def exact_probe(q, k, v, do, causal, rows, keys, work=np.longdouble, pool=None, block=256):
    """The exact answer on one head's probe: q, k, v, do are (L, D) host arrays.

    Returns {"out": (L, Dv) every row, "dq": (len(rows), D), "dk", "dv": (len(keys), D)} in
    ``work`` precision. lse and out of every row come first (FlashAttention's recipe, in
    ``work`` precision): dK and dV of a key need Dsum = rowsum(dO * O) and P of every query.
    """
    n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    jobs = [(q[r0:r0 + block], *((k[:r0 + block], v[:r0 + block]) if causal else (k, v)), r0, causal, scale, work)
            for r0 in range(0, n, block)]
    parts = list(pool.map(_forward_task, jobs) if pool is not None else map(_forward_task, jobs))
    lse = np.concatenate([p[0] for p in parts])
    out = np.concatenate([p[1] for p in parts])
    qw, kw, vw, dow = (x.astype(work) for x in (q, k, v, do))
    dsum = (dow * out).sum(axis=-1)                                 # Dsum = rowsum(dO * O)
    w = work(scale)

    def ds_of(s, p_rows, p_cols, lse_, dsum_, dp):
        if causal:
            s[p_cols[None, :] > p_rows[:, None]] = -np.inf
        p = np.exp(s - lse_[:, None])                               # P = exp(S - lse)
        return p, p * (dp - dsum_[:, None])                         # dS = P (dP - Dsum)

    all_rows = np.arange(n)
    _, ds = ds_of((qw[rows] @ kw.T) * w, rows, all_rows, lse[rows], dsum[rows], dow[rows] @ vw.T)
    dq = (ds @ kw) * w                                              # dQ = scale dS K
    p, ds = ds_of((qw @ kw[keys].T) * w, all_rows, keys, lse, dsum, dow @ vw[keys].T)
    dv = p.T @ dow                                                  # dV = P^T dO
    dk = (ds.T @ qw) * w                                            # dK = scale dS^T Q
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def rel_error(got, exact):
    """||got - exact||_F / ||exact||_F in long double (nan where got has NaN/inf)."""
    got = np.asarray(got, dtype=np.longdouble)
    exact = np.asarray(exact, dtype=np.longdouble)
    denom = np.sqrt(np.sum(exact * exact))
    diff = got - exact
    return float(np.sqrt(np.sum(diff * diff)) / (denom if denom > 0 else 1.0))


def _to_host(x):
    """One head (L, D) of a CuPy array, a torch tensor or a NumPy array, as NumPy."""
    if hasattr(x, "detach"):                         # torch
        return x.detach()[0, 0].cpu().numpy()
    head = x[0, 0]
    return head.get() if hasattr(head, "get") else np.asarray(head)


def errors(results, exact, rows, keys):
    """err_<field> of a contender's (out, dq, dk, dv) tuple (None entries and missing ones skipped)."""
    picks = {"out": slice(None), "dq": rows, "dk": keys, "dv": keys}
    errs = {}
    for name, got in zip(FIELDS, results):
        if got is not None and name in exact:
            errs[f"err_{name}"] = rel_error(_to_host(got)[picks[name]], exact[name])
    return errs


# ----------------------------------------------------------------------------- tables

def _fmt_err(x):
    if x is None:
        return ""
    if isinstance(x, str) or not math.isfinite(x):
        return str(x)
    return f"{x:.1e}"


def _peer_ms(case):
    peer = next((r for r in case["results"] if r["contender"] == PEER[case["dtype"]] and "ms" in r), None)
    return None if peer is None else peer["ms"]


def markdown(data):
    """The Markdown report of a results dict ({"meta": ..., "cases": [...]})."""
    meta = data["meta"]
    lines = [f"# cuflash float32 / float64: speed and error ({meta['device']})", "",
             f"`{meta.get('command', '')}` (commit {meta.get('commit', '?')}, torch {meta.get('torch')}, "
             f"cupy {meta.get('cupy')}); inputs N(0, 1), q and k times {meta.get('logit_scale', 1.0):g}.", "",
             "\"vs peer\" is the peer's time divided by the contender's (above 1x: faster than the peer; peer = "
             "SDPA efficient for float32, SDPA math for float64). Errors: relative Frobenius norm against the "
             f"exact answer ({meta.get('ref', 'longdouble')}) on batch 0, head 0: out over all query rows, dq over "
             f"{meta.get('probe', '?')} query rows, dk and dv over {meta.get('probe', '?')} key rows. \"ms\" times "
             "each call alone, \"queued\" the mean call of back-to-back calls.", "",
             "| pass | dtype | B | H | L | D | causal | contender | ms | TFLOP/s | queued ms | vs peer "
             "| err out | err dq | err dk | err dv |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in data["cases"]:
        peer = _peer_ms(case)
        for r in case["results"]:
            head = (f"| {case['pass']} | {case['dtype']} | {case['B']} | {case['H']} | {case['L']} | {case['D']} "
                    f"| {'yes' if case['causal'] else 'no'} | {r['contender']} |")
            if "ms" not in r:
                lines.append(head + f" n/a | | | | | | | {r.get('error', '')} |")
                continue
            ratio = f"{peer / r['ms']:.2f}x" if peer else ""
            errs = " | ".join(_fmt_err(r.get(f"err_{f}")) for f in FIELDS)
            lines.append(head + f" {r['ms']:.3f} | {r['tflops']:.1f} | {r.get('ms_queued', float('nan')):.3f} "
                                f"| {ratio} | {errs} |")
    return "\n".join(lines) + "\n"


def short_table(case):
    """The few lines printed after each case."""
    peer = _peer_ms(case)
    title = (f"{case['dtype']} {case['pass']} B={case['B']} H={case['H']} L={case['L']} D={case['D']}"
             f"{' causal' if case['causal'] else ''}")
    lines = [title, f"  {'contender':16} {'ms':>9} {'TFLOP/s':>8} {'vs peer':>8}  err out / dq / dk / dv"]
    for r in case["results"]:
        if "ms" not in r:
            lines.append(f"  {r['contender']:16} {r.get('error', '')}")
            continue
        ratio = f"{peer / r['ms']:.2f}x" if peer else ""
        errs = " / ".join(_fmt_err(r.get(f"err_{f}")) or "-" for f in FIELDS)
        lines.append(f"  {r['contender']:16} {r['ms']:9.3f} {r['tflops']:8.1f} {ratio:>8}  {errs}")
    return "\n".join(lines)


def _json_safe(x):
    """NaN/inf as strings (strict JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def device_slug(device):
    return re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()


# ----------------------------------------------------------------------------- the GPU part

def git_commit():
    """The tree's commit: $CUFLASH_COMMIT where set (a device copy of a working tree may carry another
    checkout's git metadata), else git's HEAD."""
    if os.environ.get("CUFLASH_COMMIT"):
        return os.environ["CUFLASH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


@contextlib.contextmanager
def _torch_tf32(torch, allow):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _fma_forward():
    """The float32 FMA forward for the calls inside: the planner's ``forward_choice`` with the
    precision (its last argument) replaced by "fma"."""
    from unittest import mock

    from cuflash._dispatch import plan

    choose = plan.forward_choice
    return mock.patch.object(plan, "forward_choice", lambda *args: choose(*args[:-1], "fma"))


@contextlib.contextmanager
def _recording():
    """The family of every cuflash kernel launched inside (proof of which forward ran)."""
    from unittest import mock

    from cuflash._runtime import launch

    seen, real = [], launch.launch_kernel

    def record(variant, *args, **kwargs):
        seen.append(variant.family)
        return real(variant, *args, **kwargs)

    with mock.patch.object(launch, "launch_kernel", record):
        yield seen


def contenders(dtype, q, k, v, do, causal, with_bwd, torch=None):
    """name -> (callable returning (out, dq, dk, dv) with None for what it does not compute,
    context manager factory entered around its timing)."""
    import cuflash
    from cuflash import reference

    def cf(precision):
        def run():
            o, lse = cuflash.attention_forward(q, k, v, causal=causal, precision=precision)
            if not with_bwd:
                return (o,)
            return (o,) + tuple(cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, precision=precision))
        return run

    out = {}
    if dtype == "fp32":
        out["cuflash fma"] = (cf("highest"), _fma_forward)
        out["cuflash highest"] = (cf("highest"), contextlib.nullcontext)
        out["cuflash tf32"] = (cf("tf32"), contextlib.nullcontext)
    else:
        out["cuflash"] = (cf("highest"), contextlib.nullcontext)
        if with_bwd:   # the materialised forward and backward, float64 on the GPU
            out["naive cupy"] = (lambda: (None,) + tuple(reference.attention_backward_naive(do, q, k, v,
                                                                                           causal=causal)),
                                 contextlib.nullcontext)
        else:
            out["naive cupy"] = (lambda: (reference.attention_materialised(q, k, v, causal=causal),),
                                 contextlib.nullcontext)
    if torch is None:
        return out
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, do))
    if with_bwd:
        tq, tk, tv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=bool(causal))
                if not with_bwd:
                    return (o,)
                return (o,) + tuple(torch.autograd.grad(o, (tq, tk, tv), tdo))
        return run

    if dtype == "fp32":
        out["torch efficient"] = (sdpa(SDPBackend.EFFICIENT_ATTENTION), contextlib.nullcontext)
        out["torch math"] = (sdpa(SDPBackend.MATH), lambda: _torch_tf32(torch, False))
        out["torch math tf32"] = (sdpa(SDPBackend.MATH), lambda: _torch_tf32(torch, True))
    else:
        out["torch math"] = (sdpa(SDPBackend.MATH), contextlib.nullcontext)
    return out


def _measure(fn, max_repeat, budget_ms):
    """(ms, ms_queued): bench.py's two timings, ``budget_ms`` of calls each (3x for the queued
    runs), at least 3 and at most ``max_repeat`` calls."""
    import cupy as cp
    from bench import _time_queued
    from cupyx.profiler import benchmark

    fn()                                   # first use: builds the kernels
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    fn()
    cp.cuda.Device().synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    repeat = int(max(3, min(max_repeat, budget_ms / max(first_ms, 1e-3))))
    # bench._time's measurement (median of calls timed alone) with one warm-up: two calls ran above
    ms = float(np.median(benchmark(fn, n_repeat=repeat, n_warmup=1).gpu_times[0]) * 1e3)
    return ms, _time_queued(fn, repeat, runs=3)


def run_case(case, inputs, exact, rows, keys, args, torch=None):
    import cupy as cp

    dtype, b, h, n, d, causal, pass_ = case
    with_bwd = pass_ == "fwd+bwd"
    q, k, v, do = (cp.asarray(x.astype(NP_DTYPE[dtype], copy=False)) for x in inputs)
    work = flops(b, h, n, d, causal, pass_)
    rows_out = []
    for name, (fn, ctx) in contenders(dtype, q, k, v, do, causal, with_bwd, torch).items():
        if name in args.skip:
            continue
        gb = nxn_gb(name, dtype, b, h, n, pass_)
        if gb > args.max_gb:
            rows_out.append({"contender": name, "error": f"skipped: ~{gb:.0f} GB of n x n matrices > --max-gb "
                                                         f"{args.max_gb:g}"})
            continue
        try:
            with ctx():
                ms, ms_queued = _measure(fn, args.repeat, args.budget_ms)
                with _recording() as kernels:
                    got = fn()
                cp.cuda.Device().synchronize()
            row = {"contender": name, "ms": ms, "tflops": work / ms / 1e9, "ms_queued": ms_queued,
                   "tflops_queued": work / ms_queued / 1e9}
            if kernels:
                row["kernels"] = sorted(set(kernels))     # which cuflash kernel families ran
            row.update(errors(got, exact, rows, keys))
            if name == "cuflash fma":
                row["note"] = "baseline: the float32 FMA forward (internal, FLOAT32_PRECISIONS)"
            rows_out.append(row)
            del got
        except Exception as exc:   # a backend refusing float32/float64 or this shape, or out of memory
            rows_out.append({"contender": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                             if str(exc) else type(exc).__name__})
        finally:
            cp.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    return {"dtype": dtype, "B": b, "H": h, "L": n, "D": d, "causal": bool(causal), "pass": pass_,
            "flops": work, "results": rows_out}


def _progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        return items


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench.py's timing helpers
    from cuflash._runtime.device import gpu_available

    ok, why = gpu_available()
    if not ok:
        sys.exit(f"benchmarks/bench_precision.py times kernels on an NVIDIA GPU, and there is none usable here: {why}")
    if args.ref == "float64" and "fp64" in args.dtypes:
        print("note: --ref float64 is no reference for the float64 contenders; their errors are left out",
              file=sys.stderr)
    chosen = cases(args.dtypes, args.head_dims, args.lengths, not args.no_bwd)
    groups = sorted({(c[4], c[3]) for c in chosen}, key=lambda g: (args.head_dims.index(g[0]),
                                                                  args.lengths.index(g[1])))
    # Host inputs and the exact answers first: the pool forks before CUDA is initialised.
    started = time.perf_counter()
    inputs, exact = {}, {}
    work = np.longdouble if args.ref == "longdouble" else np.float64
    pool = None
    if args.ref_workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.ref_workers, mp_context=multiprocessing.get_context("fork"))
    try:
        for d, n in _progress(groups, "exact answers"):
            inputs[d, n] = make_inputs(16384 // n, 2048 // d, n, d, args.seed, args.logit_scale)
            rows, keys = probe_indices(n, args.probe), probe_indices(n, args.probe)
            head = [x[0, 0] for x in inputs[d, n]]
            for causal in sorted({c[5] for c in chosen if (c[4], c[3]) == (d, n)}):
                exact[d, n, causal] = exact_probe(*head, causal, rows, keys, work=work, pool=pool)
    finally:
        if pool is not None:
            pool.shutdown()
    ref_s = time.perf_counter() - started

    import cupy as cp

    import cuflash

    try:
        import torch
    except Exception:   # torch is optional: the cuflash rows alone
        torch = None
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    results = []
    for case in _progress(chosen, "cases"):
        dtype, _, _, n, d, causal, _ = case
        ref = exact[d, n, causal]
        if dtype == "fp64" and args.ref == "float64":
            ref = {}
        probe = probe_indices(n, args.probe)
        res = run_case(case, inputs[d, n], ref, probe, probe, args, torch)
        results.append(res)
        print(short_table(res), flush=True)
    meta = {"device": device, "cupy": cp.__version__, "torch": getattr(torch, "__version__", None),
            "cuflash": cuflash.__version__, "commit": git_commit(),
            "command": "python benchmarks/bench_precision.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "time": time.strftime("%Y-%m-%d %H:%M"), "logit_scale": args.logit_scale, "seed": args.seed,
            "ref": args.ref, "probe": args.probe, "ref_seconds": round(ref_s, 1),
            "torch_math_tf32_default": None if torch is None else bool(torch.backends.cuda.matmul.allow_tf32)}
    data = _json_safe({"meta": meta, "cases": results})
    out = Path(args.out or time.strftime("cuflash-precision-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    stem = "precision-" + device_slug(device) + ("" if args.logit_scale == 1.0 else f"-logit{args.logit_scale:g}")
    stem += f"-{args.tag}" if args.tag else ""
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    table = markdown(data)
    (out / f"{stem}.md").write_text(table)
    print(table)
    print(f"results written to {out}/{stem}.json and .md (exact answers took {ref_s:.0f} s)")


if __name__ == "__main__":
    main()
