"""Benchmark cuflash against naive CuPy attention and PyTorch SDPA backends (needs a GPU).

Same input buffers for every contender (PyTorch reads CuPy's arrays through
DLPack), CUDA-event timing after warm-up, median of repeated runs, two ways:
``ms`` times each call alone (events around one call, synchronised after it:
the host's work before the first launch is inside the time, as for a call whose
result is needed at once), ``ms_queued`` the mean call in a run of ``repeat``
calls queued back to back (median of 5 runs: the host's work overlaps the GPU's
wherever it is the shorter, as in a training loop). FLOPs:
4*B*H*Lq*Lk*D forward (halved when causal); forward+backward is 3.5x forward.
Writes JSON, a Markdown table and a PNG plot named by device into a new folder
(./cuflash-bench-<time>/ unless --out says otherwise; --out benchmarks/results
replaces the committed results), and prints the table. Install the extra
``pip install ".[cuda12,bench]"``; PyTorch is optional (its SDPA backends are
the peers when it imports).

    PYTHONPATH=. python benchmarks/bench.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from unittest import mock
from pathlib import Path

import numpy as np

from cuflash._runtime.device import gpu_available

import cuflash
import cuflash.reference
from cuflash._dispatch import select
from cuflash._runtime import device as cf_device

try:
    import cupy as cp
    from cupyx.profiler import benchmark as cupy_benchmark
except ImportError:   # main() says what is missing
    cp = cupy_benchmark = None

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception:  # torch is optional
    torch = None

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def device_name() -> str:
    """The current CUDA device's name (CuPy's properties give bytes or str)."""
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _cp_dtype(name):
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32,
            "float64": np.float64}[name]


def _time(fn, repeat):
    """Median ms of one call timed alone (synchronised after each)."""
    res = cupy_benchmark(fn, n_repeat=repeat, n_warmup=3)
    return float(np.median(res.gpu_times[0]) * 1e3)


def side_args(argv, doc: str, what: str, quick_help: str, repeat: int, skip_example: str, more=None):
    """(arguments, the device's name, the contenders to skip) of a side benchmark (bench_decode.py,
    bench_varlen.py): --quick, --repeat, --skip, --out, and what ``more(parser)`` adds; None, after saying
    why, where there is no GPU."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument("--skip", default="", help=f"contenders to leave out, e.g. {skip_example}")
    parser.add_argument("--out", default=None, help="folder for the JSON and Markdown")
    if more is not None:
        more(parser)
    args = parser.parse_args(argv)
    if getattr(args, "replot", None):   # a side benchmark's --replot: no GPU needed
        return args, None, set()
    ok, why = gpu_available()
    if not ok or cp is None:
        print(f"The {what} benchmark needs a GPU: {why}")
        return None
    return args, device_name(), {s.strip() for s in args.skip.split(",") if s.strip()}


def run_meta() -> dict:
    """What a results file records of its run: the date, the command, the source tree (git HEAD and whether
    it had changes, where the tree is a git checkout) and the versions of CuPy, PyTorch and cuflash."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    head = git("rev-parse", "--short", "HEAD")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
            "tree": head and head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else ""),
            "cupy": getattr(cp, "__version__", None), "torch": getattr(torch, "__version__", None),
            "cuflash": cuflash.__version__}


def side_report(row_lists, markdown, device: str, out, prefix: str, plot=None, **extra) -> int:
    """Print each list of rows of ``row_lists`` as it comes (``markdown(rows, device)``'s table lines) and
    write the rows so far as ``<prefix>-<device>.json`` (the run's :func:`run_meta` and ``extra`` beside the
    rows) and ``.md`` into ``out`` (default ./cuflash-<prefix>-<time>/): a run stopped part way keeps what it
    measured. At the end, with ``plot(rows, path, device)``, the ``.png``, and the whole table printed."""
    folder = Path(out or f"cuflash-{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{prefix}-" + device.replace(" ", "_")
    meta = run_meta()
    results = []
    for rows in row_lists:
        results += rows
        print("\n".join(markdown(rows, device).splitlines()[4:]), flush=True)
        (folder / f"{stem}.json").write_text(json.dumps({"device": device, "meta": meta, **extra, "rows": results},
                                                        indent=1))
        (folder / f"{stem}.md").write_text(markdown(results, device))
    if plot is not None:
        plot(results, folder / f"{stem}.png", device)
    print(markdown(results, device))
    return 0


def markdown_table(title: str, columns, results) -> str:
    """A Markdown table under ``title``: ``columns`` of (header, key, format), a cell being the result row's
    value at ``key`` (or ``key(row)`` where it is a function) formatted by ``format`` ("" where None)."""
    def cell(row, key, fmt):
        value = key(row) if callable(key) else row[key]
        return "" if value is None else format(value, fmt)
    lines = [title, "", "| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, key, fmt) for _, key, fmt in columns) + " |" for r in results]
    return "\n".join(lines) + "\n"


def timed_rows(runs: dict, base: dict, repeat: int, skip) -> list:
    """One result row a contender of ``runs`` (name -> (callable or None, note, fields(ms) -> dict)) not in
    ``skip``: ``base`` with its name and note, timed by :func:`timed_row`."""
    return [timed_row({"contender": name, **base, "note": note}, fn, repeat, fields)
            for name, (fn, note, fields) in runs.items() if name not in skip]


def timed_row(entry: dict, fn, repeat: int, fields) -> dict:
    """``entry`` (a result row) with the time of ``fn``: one warm-up call, then :func:`_time_queued`'s ms and
    ``fields(ms)`` merged in. Where ``fn`` is None the row stays as it is; a call that fails (out of memory,
    a backend that refuses the shape or dtype) leaves its exception's type in the row's note."""
    if fn is not None:
        try:
            fn()
            cp.cuda.Device().synchronize()
            ms = _time_queued(fn, repeat)
            entry.update({"ms": ms, **fields(ms)})
        except Exception as exc:
            entry["note"] = f"n/a ({type(exc).__name__})"
    return entry


def _time_queued(fn, repeat, runs=5):
    """Median over ``runs`` of the mean ms per call of ``repeat`` calls queued without a
    synchronisation between them (the host runs ahead of the GPU where it can)."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    per_call = []
    for _ in range(runs):
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        per_call.append(cp.cuda.get_elapsed_time(start, end) / repeat)
    return float(np.median(per_call))


def _extra_mib(fn):
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    t_before = torch.cuda.memory_allocated() if torch is not None else 0
    if torch is not None:
        torch.cuda.reset_peak_memory_stats()
    fn()
    cp.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    if torch is not None:
        grown += max(0, torch.cuda.max_memory_allocated() - t_before)
    return grown / 2**20


def _sm80() -> int:
    """The compute capability the "cuflash sm80" contender reports: one function for every call, since
    cuflash's call plans are keyed by this hook (a new lambda a call would miss them every time)."""
    return 80


def contenders(q, k, v, do, causal, with_bwd):
    """name -> callable running the forward (and backward when with_bwd)."""
    out = {}

    def cf():
        if with_bwd:
            o, lse = cuflash.attention_forward(q, k, v, causal=causal)
            return cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
        return cuflash.attention_forward(q, k, v, causal=causal)

    out["cuflash"] = cf
    if cf_device.compute_capability() == select.HOPPER_CC and q.dtype.itemsize == 2:
        def portable():   # the same call on the portable mma.sync path, as on a GPU without sm_90a
            with mock.patch.object(cf_device, "compute_capability", _sm80):
                return cf()
        out["cuflash sm80"] = portable
    if not with_bwd and q.dtype != np.dtype(_cp_dtype("bfloat16")):
        out["naive cupy"] = lambda: cuflash.reference.attention_materialised(q, k, v, causal=causal)
    if torch is not None:
        tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, do))
        if with_bwd:
            tq, tk, tv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))
        backends = {"torch flash": SDPBackend.FLASH_ATTENTION, "torch efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "torch cudnn": SDPBackend.CUDNN_ATTENTION, "torch math": SDPBackend.MATH}
        for name, backend in backends.items():
            def run(backend=backend):
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=bool(causal))
                    if with_bwd:
                        return torch.autograd.grad(o, (tq, tk, tv), tdo)
                    return o
            out[name] = run
    return out


def run_case(dtype, b, h, n, d, causal, with_bwd, repeat, skip=frozenset()):
    rng = cp.random.default_rng(0)
    shape = (b, h, n, d)
    q, k, v, do = (rng.standard_normal(shape, dtype=cp.float32).astype(_cp_dtype(DTYPES[dtype]))
                   for _ in range(4))
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0) * (3.5 if with_bwd else 1.0)
    model = None if with_bwd else model_bytes(dtype, b, h, n, d, causal)
    rows = []
    for name, fn in contenders(q, k, v, do, causal, with_bwd).items():
        if name in skip:
            continue
        try:
            fn()
            cp.cuda.Device().synchronize()
            ms = _time(fn, repeat)
            ms_queued = _time_queued(fn, repeat)
            mib = _extra_mib(fn)
            row = {"contender": name, "ms": ms, "tflops": flops / ms / 1e9, "ms_queued": ms_queued,
                   "tflops_queued": flops / ms_queued / 1e9, "extra_mib": mib}
            if model is not None and name in MODEL_OF:
                row["model_gbps"] = model[MODEL_OF[name]] / ms / 1e6
            rows.append(row)
        except Exception as exc:   # backend not available for this dtype/shape, or out of memory
            rows.append({"contender": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"})
        finally:
            cp.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    case = {"dtype": dtype, "B": b, "H": h, "L": n, "D": d, "causal": bool(causal),
            "pass": "fwd+bwd" if with_bwd else "fwd", "results": rows}
    if model is not None:
        case["model"] = model
    return case


# Contenders whose HBM traffic the estimator models: the tiled kernel, and the naive
# computations that store the n x n scores.
MODEL_OF = {"cuflash": "flash_hbm_bytes", "naive cupy": "naive_hbm_bytes", "torch math": "naive_hbm_bytes"}


def model_bytes(dtype, b, h, n, d, causal) -> dict:
    """The forward's modelled HBM bytes and FLOPs (cuflash.estimate, the H100's tiles)."""
    est = cuflash.estimate(lq=n, lk=n, d=d, dtype=DTYPES[dtype], causal=causal, batch=b, heads_q=h)
    return {"flash_hbm_bytes": est.flash_hbm_bytes, "naive_hbm_bytes": est.naive_hbm_bytes, "flops": est.flops,
            "tiles_processed": est.tiles_processed, "tiles_total": est.tiles_total}


def cases(quick, lengths=None, bwd_lengths=None, heads=(64, 128)):
    # B*L = 16384 tokens, H*D = 2048, as in KERNEL_NOTES' peer measurements. The 16-bit
    # forward+backward runs causal at L=4096, or at bwd_lengths both causal and not.
    out = []
    lengths = lengths or ((1024, 4096) if quick else (1024, 2048, 4096, 8192))
    for dtype in ("bf16", "fp16"):
        for d in heads:
            for n in lengths:
                for causal in (False, True):
                    out.append((dtype, 16384 // n, 2048 // d, n, d, causal, False))
            if bwd_lengths is None:
                out.append((dtype, 4, 2048 // d, 4096, d, True, True))
            else:
                out += [(dtype, 16384 // n, 2048 // d, n, d, causal, True) for n in bwd_lengths for causal in (False, True)]
    for dtype, d in (("fp32", 64), ("fp32", 128), ("fp64", 64)):
        for causal in (False, True):
            out.append((dtype, 4, 2048 // d, 4096, d, causal, False))
        out.append((dtype, 4, 2048 // d, 4096, d, True, True))
    return out


def markdown(results, device):
    lines = [f"# cuflash benchmark on {device}", "",
             "\"cuflash speed-up\" is the contender's time divided by cuflash's on the same case: above 1x, "
             "cuflash is faster. \"model GB/s\" is the HBM traffic `cuflash.estimate` models for the forward "
             "(the tiled kernel's upper bound for cuflash; the stored n x n scores for naive CuPy and torch math) "
             "divided by the measured time: compare it and TFLOP/s with the GPU's ceilings (H100: ~3 TB/s, "
             "~780 TFLOP/s dense bf16) to see how far a case is from its roofline. \"ms\" times each call alone "
             "(the host's work before its first kernel included); \"queued\" is the mean call of a run queued "
             "back to back (the host overlapped with the GPU where it is faster).", "",
             "| pass | dtype | B | H | L | D | causal | contender | ms | TFLOP/s | model GB/s | cuflash speed-up "
             "| queued ms | queued speed-up | extra MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        ours = next((r for r in case["results"] if r["contender"] == "cuflash" and "ms" in r), None)
        for r in case["results"]:
            head = (f"| {case['pass']} | {case['dtype']} | {case['B']} | {case['H']} | {case['L']} | {case['D']} "
                    f"| {'yes' if case['causal'] else 'no'} | {r['contender']} |")
            if "ms" not in r:
                lines.append(head + f" n/a | | | | | | {r['error']} |")
                continue
            ratio = f"{r['ms'] / ours['ms']:.2f}x" if ours else ""
            queued = f"{r['ms_queued']:.3f}" if "ms_queued" in r else ""
            ratio_q = (f"{r['ms_queued'] / ours['ms_queued']:.2f}x"
                       if ours and "ms_queued" in r and "ms_queued" in ours else "")
            gbps = f"{r['model_gbps']:.0f}" if "model_gbps" in r else ""
            lines.append(head + f" {r['ms']:.3f} | {r['tflops']:.1f} | {gbps} | {ratio} | {queued} | {ratio_q} "
                                f"| {r['extra_mib']:.0f} |")
    return "\n".join(lines) + "\n"


# One colour per contender in every panel and every run.
COLORS = {"cuflash": "#d62728", "cuflash sm80": "#ff9896", "torch flash": "#1f77b4", "torch cudnn": "#2ca02c",
          "torch efficient": "#ff7f0e", "torch math": "#7f7f7f", "naive cupy": "#9467bd"}
MARKERS = {"bf16": "o", "fp16": "s", "fp32": "^", "fp64": "D"}


def plot(results, path, device):
    """TFLOP/s against L: a grid of panels by head dim (rows) x pass (columns) for the
    16-bit cases; colour = contender, line style = causal (dashed) or not, marker = dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return
    cases = [c for c in results if c["dtype"] in ("bf16", "fp16")]
    if not cases:
        return
    heads = sorted({c["D"] for c in cases})
    passes = [p for p in ("fwd", "fwd+bwd") if any(c["pass"] == p for c in cases)]
    fig, axes = plt.subplots(len(heads), len(passes), figsize=(6 * len(passes), 3.6 * len(heads)), squeeze=False)
    seen = set()
    for (row, d), (col, pass_) in itertools.product(enumerate(heads), enumerate(passes)):
        ax = axes[row][col]
        sel = [c for c in cases if c["D"] == d and c["pass"] == pass_]
        for dtype, causal in sorted({(c["dtype"], c["causal"]) for c in sel}):
            group = sorted((c for c in sel if (c["dtype"], c["causal"]) == (dtype, causal)), key=lambda c: c["L"])
            for name in COLORS:
                pts = [(c["L"], r["tflops"]) for c in group for r in c["results"]
                       if r["contender"] == name and "tflops" in r]
                if not pts:
                    continue
                seen.add(name)
                ax.plot(*zip(*pts), color=COLORS[name], marker=MARKERS[dtype], linestyle="--" if causal else "-",
                        markersize=5, linewidth=1.4)
        ax.set_xscale("log", base=2)
        ax.set_title(f"head dim {d}, {'forward' if pass_ == 'fwd' else 'forward + backward'}", fontsize=10)
        ax.set_xlabel("sequence length L (B x L = 16384 tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=COLORS[n], linewidth=2, label=n) for n in COLORS if n in seen]
    handles += [Line2D([], [], color="k", linestyle="-", label="full"),
                Line2D([], [], color="k", linestyle="--", label="causal")]
    handles += [Line2D([], [], color="k", marker=MARKERS[t], linestyle="", label=t)
                for t in ("bf16", "fp16") if any(c["dtype"] == t for c in cases)]
    save_figure(fig, path, f"cuflash vs PyTorch SDPA backends, {device}", handles, columns=6, top=0.86)


def save_figure(fig, path, title: str, handles, columns: int, top: float) -> None:
    """A benchmark figure's title and legend above its panels (those below ``top`` of its height), written to
    ``path`` and closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, y=0.99, fontsize=11)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.95), ncol=min(len(handles), columns),
               fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer lengths")
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="only redraw the PNG beside a results JSON (no GPU needed)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--dtypes", default=None, help="only these dtypes, e.g. bf16,fp16")
    parser.add_argument("--head-dims", default=None, help="only these head dims, e.g. 128 (16-bit rows: any of "
                                                          "them, e.g. 256; default 64,128)")
    parser.add_argument("--lengths", default=None, help="forward sequence lengths, e.g. 16384 (default 1024-8192; "
                                                        "1024,4096 with --quick)")
    parser.add_argument("--bwd-lengths", default=None,
                        help="16-bit forward+backward lengths, causal and not, e.g. 1024,4096,16384 (default: "
                             "L=4096 causal only); an empty string leaves the forward+backward out")
    parser.add_argument("--skip", default="", help="contenders to leave out, e.g. 'torch math,naive cupy'")
    parser.add_argument("--out", default=None,
                        help="output folder (default: a new ./cuflash-bench-<time>/; "
                             "benchmarks/results replaces the committed results)")
    args = parser.parse_args(argv)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        plot(data["cases"], Path(args.replot).with_suffix(".png"), data["meta"]["device"])
        return
    ok, why = gpu_available()
    if not ok:
        sys.exit(f"benchmarks/bench.py times kernels on an NVIDIA GPU, and there is none usable here: {why}")
    device = device_name()
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda x, **k: x  # noqa: E731
    lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None
    bwd_lengths = None if args.bwd_lengths is None else tuple(int(n) for n in args.bwd_lengths.split(",") if n)
    heads = tuple(int(d) for d in args.head_dims.split(",")) if args.head_dims else (64, 128)
    chosen = [c for c in cases(args.quick, lengths, bwd_lengths, heads)
              if (args.dtypes is None or c[0] in args.dtypes.split(","))
              and (args.head_dims is None or str(c[4]) in args.head_dims.split(","))]
    skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    out = Path(args.out or time.strftime("cuflash-bench-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": device, **run_meta()}
    results = []
    for c in tqdm(chosen, file=sys.stderr):
        results.append(run_case(*c, repeat=args.repeat, skip=skip))
        # Written after every case, so a run stopped part way keeps what it measured.
        (out / f"{slug}.json").write_text(json.dumps({"meta": meta, "cases": results}, indent=1))
    table = markdown(results, device)
    (out / f"{slug}.md").write_text(table)
    plot(results, out / f"{slug}.png", device)
    print(table)
    print(f"results written to {out}/")


if __name__ == "__main__":
    main()
