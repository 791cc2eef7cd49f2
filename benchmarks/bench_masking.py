"""Benchmark rows for the masking options (needs a GPU; PyTorch optional).

* bias (1, 1, L, L) and key padding (B, 1, 1, L) at L = 4096 against SDPA "efficient"
  with the same attn_mask (forward, and forward+backward with the bias's gradient);
* a sliding window of 256 against full attention at L = 16384;
* block-sparse layouts of density 10 / 25 / 50 / 100 % at L = 16384;
* small head dims 8 / 16 / 32 against SDPA "efficient".
Same buffers for every contender, CUDA-event timing after warm-up (median).
Writes masking-<device>.json and .md into --out and prints the table.

    PYTHONPATH=. python benchmarks/bench_masking.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import _cp_dtype, _time, torch  # noqa: E402
from bench_precision import git_commit  # noqa: E402

import cupy as cp  # noqa: E402

import cuflash  # noqa: E402

if torch is not None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel


def _inputs(dtype, b, h, n, d, seed=0):
    rng = cp.random.default_rng(seed)
    return [rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(_cp_dtype(dtype)) for _ in range(4)]


def _cuflash(q, k, v, do, bwd, **opts):
    def run():
        out, lse = cuflash.attention_forward(q, k, v, **opts)
        return cuflash.attention_backward(do, q, k, v, out, lse, **opts) if bwd else out
    return run


def _sdpa_efficient(q, k, v, do, bwd, attn_mask=None, mask_grad=False):
    tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, do))
    tm = None if attn_mask is None else torch.from_dlpack(attn_mask)
    wrt = ()
    if bwd:
        tq, tk, tv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))
        wrt = (tq, tk, tv)
        if mask_grad:
            tm = tm.detach().requires_grad_(True)
            wrt += (tm,)

    def run():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)
            return torch.autograd.grad(o, wrt, tdo) if bwd else o
    return run


def _flops(b, h, n, d, bwd, density=1.0):
    f = 4.0 * b * h * n * n * d * density
    return f * 3.5 if bwd else f


def _row(rows, group, case, b, h, n, d, bwd, results, density=1.0):
    row = dict(group=group, case=case, B=b, H=h, L=n, D=d, pass_="fwd+bwd" if bwd else "fwd", results={})
    for name, ms in results.items():
        row["results"][name] = dict(ms=ms, tflops=_flops(b, h, n, d, bwd, density) / (ms * 1e-3) / 1e12)
    if "torch efficient" in results:
        row["ratio_to_efficient"] = results["torch efficient"] / results["cuflash"]
    rows.append(row)
    parts = "  ".join(f"{k} {v:8.3f} ms" for k, v in results.items())
    extra = f"  ratio {row['ratio_to_efficient']:.2f}x" if "ratio_to_efficient" in row else ""
    print(f"{group:12} {case:28} {row['pass_']:8} {parts}{extra}", flush=True)


def bias_and_padding(rows, quick, repeat):
    b, h, n, d = 4, 16, 4096, 64
    for dtype in ("float16", "bfloat16", "float32"):
        q, k, v, do = _inputs(dtype, b, h, n, d)
        bias = cp.random.default_rng(1).standard_normal((1, 1, n, n), dtype=cp.float32).astype(q.dtype)
        pad = cp.ones((b, 1, 1, n), dtype=bool)
        for i in range(b):
            pad[i, ..., n - (i + 1) * n // 8:] = False     # 12.5-50 % padding
        for bwd in (False, True):
            for case, opts, tmask, grad in (("bias (1,1,L,L) " + dtype, dict(bias=bias), bias, True),
                                            ("key padding (B,1,1,L) " + dtype, dict(mask=pad), pad, False)):
                res = {"cuflash": _time(_cuflash(q, k, v, do, bwd, **opts), repeat)}
                if torch is not None:
                    res["torch efficient"] = _time(_sdpa_efficient(q, k, v, do, bwd, tmask, grad and bwd), repeat)
                _row(rows, "bias/mask", case, b, h, n, d, bwd, res)
        if quick:
            break


def window(rows, quick, repeat):
    b, h, n, d = 1, 16, 16384, 64
    q, k, v, do = _inputs("float16", b, h, n, d)
    for bwd in (False, True):
        full = _time(_cuflash(q, k, v, do, bwd, causal=True), repeat)
        win = _time(_cuflash(q, k, v, do, bwd, causal=True, window=(256, None)), repeat)
        _row(rows, "window", "causal, full", b, h, n, d, bwd, {"cuflash": full}, density=0.5)
        _row(rows, "window", "causal, window (256, 0)", b, h, n, d, bwd, {"cuflash": win}, density=257 / n)


def block_sparse(rows, quick, repeat):
    b, h, n, d = 1, 16, 16384, 64
    q, k, v, do = _inputs("float16", b, h, n, d)
    nb = n // 128
    rng = np.random.default_rng(3)
    for density in (0.1, 0.25, 0.5, 1.0):
        layout = cuflash.BlockLayout(cp.asarray(rng.random((h, nb, nb)) < density), 128)
        real = layout.density
        for bwd in (False, True):
            ms = _time(_cuflash(q, k, v, do, bwd, block_layout=layout), repeat)
            _row(rows, "block sparse", f"density {real:.2f}", b, h, n, d, bwd, {"cuflash": ms}, density=real)


def small_heads(rows, quick, repeat):
    b, h, n = 4, 16, 4096
    for dtype in ("float16", "float32"):
        for d in (8, 16, 32):
            q, k, v, do = _inputs(dtype, b, h, n, d)
            for bwd in (False, True):
                res = {"cuflash": _time(_cuflash(q, k, v, do, bwd), repeat)}
                if torch is not None:
                    res["torch efficient"] = _time(_sdpa_efficient(q, k, v, do, bwd), repeat)
                _row(rows, "small head", f"D={d} {dtype}", b, h, n, d, bwd, res)


def markdown(rows, device, meta=None):
    lines = [f"# cuflash masking benchmarks ({device})", ""]
    if meta:
        lines += [f"`{meta['command']}` (commit {meta.get('commit') or '?'}, torch {meta.get('torch')})", ""]
    lines += ["| group | case | pass | cuflash ms | cuflash TFLOP/s* | SDPA efficient ms | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["results"]["cuflash"]
        e = r["results"].get("torch efficient")
        lines.append(f"| {r['group']} | {r['case']} | {r['pass_']} | {c['ms']:.3f} | {c['tflops']:.0f} | "
                     f"{'' if e is None else format(e['ms'], '.3f')} | "
                     f"{'' if e is None else format(r['ratio_to_efficient'], '.2f') + 'x'} |")
    lines += ["", "*TFLOP/s count only the visible score entries (window band, layout density, causal half)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"].decode()
    rows = []
    for section in (bias_and_padding, window, block_sparse, small_heads):
        section(rows, args.quick, args.repeat)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "masking-" + re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    meta = dict(device=device, command="PYTHONPATH=. python benchmarks/bench_masking.py " + " ".join(argv or sys.argv[1:]),
                time=time.strftime("%Y-%m-%d %H:%M"), torch=None if torch is None else torch.__version__,
                commit=git_commit())
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / f"{stem}.md").write_text(markdown(rows, device, meta))
    print(markdown(rows, device, meta))


if __name__ == "__main__":
    main()
