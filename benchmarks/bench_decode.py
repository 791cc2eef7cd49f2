"""Decoding over a KV cache: few query rows against a long cache (needs a GPU).

    PYTHONPATH=. python benchmarks/bench_decode.py [--quick] [--splits] [--dtypes D,..] [--lq N,..] [--out DIR]
        [--repeat 50]
    python -m cuflash bench --decode [--quick]

Each row: B sequences, Hq query heads over Hk K/V heads (grouped-query attention), Lq new query rows
against Lk cached keys, head dim D, no mask (one query row: bottom-right causal is no mask; longer
rows get the same no-mask call from every contender). Contenders on the same buffers (PyTorch reads
CuPy's arrays through DLPack): cuflash (the split-KV forward where it decides), cuflash's split forward
on the 64-row split kernel in place of the decoding kernel ("split twin": what the decoding kernel
buys), cuflash with ``num_splits=1`` (one thread block a query block: what the split buys),
cuflash.attention_with_kvcache
(causal: with Lq > 1 the bottom-right band, a few keys fewer) on the same cache contiguous, its lengths
checked (a device read a call), not (``validate=False``) and given as a NumPy array (checked on the host,
copied asynchronously), as a decoding step (the last Lq keys and values appended in the call, unchecked
CuPy lengths and checked NumPy ones), and as shuffled pages of 16 and 256
positions (not checked), and PyTorch SDPA's flash
(FlashAttention-2), cuDNN, efficient and math backends with ``enable_gqa`` (a backend that refuses
GQA gets K/V repeated to Hq heads beforehand, outside the time, and reads Hq / Hk times the bytes;
the row says so). Time: the median of ``--repeat`` queued calls' mean, 5 runs (CUDA events). TB/s
counts the K and V bytes of the cache once (B x Hk x Lk x D x 2 x itemsize) over the time; % peak
against the device's HBM bandwidth where known (H100 SXM 3.35 TB/s, H200 4.8 TB/s).
Writes JSON, Markdown and a PNG (% of the HBM peak against Lk) named by the device into --out (default
./cuflash-decode-<time>/); ``--replot results.json`` redraws the PNG beside a results JSON (no GPU).
``--splits``: the four reference rows through cuflash only, unasked (the note gives the split count
taken, read off the launch) and with ``num_splits`` forced to each of SPLIT_COUNTS.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import read_ceiling  # noqa: E402
import cuflash  # noqa: E402
from cuflash._dispatch import plan, select  # noqa: E402

try:
    import cupy as cp
except ImportError:   # main() says what is missing
    cp = None

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception:  # torch is optional
    torch = None

HBM_PEAK = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12}

# (dtype, B, Hq, Hk, Lq, Lk, D): the four rows first, then the sweep.
QUICK = [("bfloat16", 8, 32, 8, 1, 32768, 128), ("bfloat16", 1, 32, 8, 1, 131072, 128),
         ("bfloat16", 1, 8, 8, 16, 65536, 64), ("bfloat16", 4, 32, 32, 1, 8192, 128)]


def sweep() -> list:
    rows = list(QUICK)
    for d in (64, 128):
        for lq in (1, 4, 16):
            for lk in (4096, 16384, 32768, 65536, 131072, 262144):
                for b in (1, 8, 64):
                    if b * lk <= 2 ** 21:   # caches up to 2M tokens a call
                        rows.append(("bfloat16", b, 32, 8, lq, lk, d))
    for dtype in ("float16", "float32", "float64"):
        rows += [(dtype, 1, 32, 8, 1, 65536, 128), (dtype, 8, 32, 8, 1, 32768, 128)]
    for dtype in ("float32", "float64"):
        rows += [(dtype, 1, 32, 8, 1, 131072, 64), (dtype, 8, 32, 8, 1, 32768, 64)]
    return rows


SPLIT_COUNTS = (1, 2, 4, 5, 6, 7, 8, 12, 16, 24, 33, 42, 49, 50, 64)


def _first_grid(call) -> int:
    """The CTAs of the first kernel ``call`` (one cuflash forward) launches: a split call's partial kernel."""
    from cuflash._runtime import launch
    grids = []
    real = launch.launch_kernel

    def record(variant, params, grid, extra_args=()):
        grids.append(grid)
        real(variant, params, grid, extra_args)
    launch.launch_kernel = record
    try:
        call()
    finally:
        launch.launch_kernel = real
    return grids[0]


def split_contenders(q, k, v) -> dict:
    """--splits: cuflash unasked and with each count of SPLIT_COUNTS; the note gives the partial kernel's CTAs."""
    out = {}
    for n in (None,) + SPLIT_COUNTS:
        call = (lambda n=n: cuflash.attention_forward(q, k, v, num_splits=n))
        out["cuflash " + ("unasked" if n is None else f"{n} splits")] = (call, f"{_first_grid(call)} CTAs")
    return out


def _paged_cache(k, v, page_size: int):
    """k, v (B, Hk, Lk, D) as shuffled pages (num_pages, Hk, page_size, D) and their block table."""
    b, hk, lk, d = k.shape
    per_seq = -(-lk // page_size)
    order = cp.asarray(np.random.default_rng(1).permutation(b * per_seq).reshape(b, per_seq))
    pages = []
    for c in (k, v):
        padded = cp.zeros((b, hk, per_seq * page_size, d), dtype=c.dtype)
        padded[:, :, :lk] = c
        blocks = padded.reshape(b, hk, per_seq, page_size, d).transpose(0, 2, 1, 3, 4).reshape(-1, hk, page_size, d)
        store = cp.empty_like(blocks)
        store[order.reshape(-1)] = blocks
        pages.append(store)
    return pages[0], pages[1], order.astype(cp.int32)


def _split_twin(portable, dv, smem_limit, rows=None, full=False):
    """select.split_variants for blocks of more rows than the decoding kernel takes: the portable
    forward's split twin (flash_fwd_mma.cu). ``rows`` and ``full`` mirror split_variants' signature."""
    return select.split_variants(portable, dv, smem_limit, select.DECODE_MAX_ROWS + 1)


def _with_split_twin(call):
    """``call()`` with the split forwards on the portable kernel's twin (a plan of its own: plan._hooks)."""
    real = plan.split_variants
    plan.split_variants = _split_twin
    try:
        return call()
    finally:
        plan.split_variants = real


def contenders(q, k, v) -> dict:
    """name -> (callable, note). The KV-cache rows attend every sequence's whole cache (lengths Lk)."""
    lengths = cp.full((q.shape[0],), k.shape[2], dtype=cp.int32)
    host_lengths = np.full((q.shape[0],), k.shape[2], dtype=np.int32)
    out = {"cuflash": (lambda: cuflash.attention_forward(q, k, v), ""),
           "cuflash split twin": (functools.partial(_with_split_twin, lambda: cuflash.attention_forward(q, k, v)),
                                  "64-row split kernel in the decoding kernel's place"),
           "cuflash unsplit": (lambda: cuflash.attention_forward(q, k, v, num_splits=1), ""),
           "cuflash kvcache": (lambda: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True),
                               "lengths checked (a device read a call)"),
           "cuflash kvcache unchecked": (lambda: cuflash.attention_with_kvcache(
               q, k, v, cache_seqlens=lengths, causal=True, validate=False), "validate=False"),
           "cuflash kvcache host lengths": (lambda: cuflash.attention_with_kvcache(
               q, k, v, cache_seqlens=host_lengths, causal=True), "NumPy lengths, checked on the host")}
    # A decoding step: Lq new keys and values appended after Lk - Lq cached ones, then the same Lk keys attended.
    lq = q.shape[2]
    k_new, v_new = (x[:, :, -lq:].copy() for x in (k, v))
    before, host_before = lengths - lq, host_lengths - lq
    out["cuflash kvcache append"] = (lambda: cuflash.attention_with_kvcache(
        q, k, v, k_new, v_new, cache_seqlens=before, causal=True, validate=False), "Lq keys appended, validate=False")
    out["cuflash kvcache append host lengths"] = (lambda: cuflash.attention_with_kvcache(
        q, k, v, k_new, v_new, cache_seqlens=host_before, causal=True), "Lq keys appended, NumPy lengths")
    out["HBM read ceiling"] = (read_ceiling.reader(k, v), "one kernel reading the K/V bytes once "
                               "(benchmarks/read_ceiling.py): no call reading them is faster")
    for page_size in (16, 256):
        k_pages, v_pages, table = _paged_cache(k, v, page_size)
        out[f"cuflash paged {page_size}"] = (
            lambda k_pages=k_pages, v_pages=v_pages, table=table: cuflash.attention_with_kvcache(
                q, k_pages, v_pages, cache_seqlens=lengths, causal=True, block_table=table, validate=False),
            "validate=False")
    if torch is None:
        return out
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    backends = {"torch flash": SDPBackend.FLASH_ATTENTION, "torch cudnn": SDPBackend.CUDNN_ATTENTION,
                "torch efficient": SDPBackend.EFFICIENT_ATTENTION, "torch math": SDPBackend.MATH}
    for name, backend in backends.items():
        def gqa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        try:
            gqa()
            out[name] = (gqa, "")
            continue
        except Exception:   # this backend takes no GQA: K/V repeated to Hq heads (more bytes read)
            pass
        rk, rv = (x.repeat_interleave(group, dim=1) for x in (tk, tv))

        def repeated(backend=backend, rk=rk, rv=rv):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, rk, rv)
        try:
            repeated()
            out[name] = (repeated, f"K/V repeated {group}x")
        except Exception as exc:
            out[name] = (None, f"n/a ({type(exc).__name__})")
    return out


def _normal(rng, shape, dt):
    """Standard normal values of dtype ``dt`` made on the GPU (bfloat16 by truncating float32's bits:
    CuPy converts to no bfloat16)."""
    x = rng.standard_normal(shape, dtype=cp.float32)
    if np.dtype(dt) == np.dtype(bench._cp_dtype("bfloat16")):
        return (x.view(cp.uint32) >> 16).astype(cp.uint16).view(dt)
    return x.astype(dt)


def run_row(row, repeat, peak, skip, splits=False) -> list:
    dtype, b, hq, hk, lq, lk, d = row
    rng = cp.random.RandomState(0)   # on the GPU: the sweep's caches reach 2M tokens a call
    dt = bench._cp_dtype(dtype)
    q, k, v = (_normal(rng, shape, dt) for shape in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d)))
    kv_bytes = 2 * b * hk * lk * d * np.dtype(dt).itemsize
    def fields(ms):
        return {"TB/s": kv_bytes / ms / 1e9, "peak %": None if peak is None else 100 * kv_bytes / ms / 1e-3 / peak}
    too_big = b * hq * lq * lk > 2 ** 31   # torch math's score matrix would not fit
    runs = {name: (None if name == "torch math" and too_big else fn, note, fields)
            for name, (fn, note) in (split_contenders if splits else contenders)(q, k, v).items()}
    base = {"dtype": dtype, "B": b, "Hq": hq, "Hk": hk, "Lq": lq, "Lk": lk, "D": d, "ms": None, "TB/s": None,
            "peak %": None}
    results = bench.timed_rows(runs, base, repeat, skip)
    del q, k, v
    cp.get_default_memory_pool().free_all_blocks()
    return results


def markdown(results, device) -> str:
    return bench.markdown_table(
        f"# Decoding over a KV cache on {device}",
        [("dtype", "dtype", ""), ("B", "B", ""), ("Hq/Hk", lambda r: f"{r['Hq']}/{r['Hk']}", ""), ("Lq", "Lq", ""),
         ("Lk", "Lk", ""), ("D", "D", ""), ("contender", "contender", ""), ("ms", "ms", ".4f"),
         ("TB/s", _tbps, ".2f"), ("% peak", "peak %", ".1f"), ("note", "note", "")], results)


def _tbps(row):
    """TB/s of a row (results written before the column was TB/s have GB/s)."""
    if row.get("TB/s") is not None:
        return row["TB/s"]
    return None if row.get("GB/s") is None else row["GB/s"] / 1e3


PLOTTED = {"HBM read ceiling": "tab:gray", "cuflash": "tab:red", "cuflash kvcache unchecked": "tab:purple",
           "cuflash paged 16": "tab:orange", "torch flash": "tab:blue", "torch cudnn": "tab:green"}


def plot(results, path, device) -> None:
    """% of the HBM peak against Lk for the bfloat16 sweep rows: a panel a (D, Lq), a colour a contender
    (PLOTTED), a marker a batch size. Nothing without matplotlib or a known peak."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return
    rows = [r for r in results if r["dtype"] == "bfloat16" and r["Hq"] == 32 and r["Hk"] == 8
            and r.get("peak %") is not None and r["contender"] in PLOTTED]
    panels = sorted({(r["D"], r["Lq"]) for r in rows})
    if not panels:
        return
    markers = {1: "o", 8: "s", 64: "^"}
    cols = min(3, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(5.2 * cols, 3.6 * -(-len(panels) // cols)),
                             squeeze=False)
    for ax, (d, lq) in zip(axes.flat, panels):
        for name, color in PLOTTED.items():
            for b, marker in markers.items():
                pts = sorted((r["Lk"], r["peak %"]) for r in rows
                             if (r["D"], r["Lq"], r["B"], r["contender"]) == (d, lq, b, name))
                if pts:
                    ax.plot(*zip(*pts), color=color, marker=marker, markersize=4, linewidth=1.2)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 100)
        ax.set_title(f"D {d}, {lq} query row{'s' if lq > 1 else ''}, 32 / 8 heads", fontsize=10)
        ax.set_xlabel("cached keys Lk")
        ax.set_ylabel("% of HBM peak")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [Line2D([], [], color=c, linewidth=2, label=n) for n, c in PLOTTED.items()]
    handles += [Line2D([], [], color="k", marker=m, linestyle="", label=f"B = {b}") for b, m in markers.items()]
    bench.save_figure(fig, path, f"Decoding over a KV cache (bfloat16), {device}", handles, columns=8, top=0.88)


def main(argv=None) -> int:
    def more(parser):
        parser.add_argument("--splits", action="store_true", help="the reference rows by split count")
        parser.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside a results JSON (no GPU)")
        parser.add_argument("--dtypes", help="only the rows of these dtypes, e.g. float32,float64")
        parser.add_argument("--lq", help="only the rows of these query counts, e.g. 1 (the reference rows stay)")
    parsed = bench.side_args(argv, __doc__, "decode", "the four reference rows only", 50, "'torch math'", more=more)
    if parsed is None:
        return 2
    args, device, skip = parsed
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        plot(data["rows"], Path(args.replot).with_suffix(".png"), data["device"])
        return 0
    peak = next((bw for key, bw in HBM_PEAK.items() if key in device), None)
    wanted = args.dtypes.split(",") if args.dtypes else None
    counts = {int(x) for x in args.lq.split(",")} if args.lq else None
    rows = (run_row(row, args.repeat, peak, skip, args.splits)
            for row in (QUICK if args.quick or args.splits else sweep()) if (wanted is None or row[0] in wanted)
            and (counts is None or row[4] in counts or row in QUICK))
    return bench.side_report(rows, markdown, device, args.out, "decode-splits" if args.splits else "decode",
                             plot=None if args.splits else plot, peak_bytes_per_s=peak)


if __name__ == "__main__":
    sys.exit(main())
