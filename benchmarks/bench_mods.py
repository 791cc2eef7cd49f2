"""User score and mask modifications against PyTorch's FlexAttention (needs a GPU).

    PYTHONPATH=. python benchmarks/bench_mods.py [--quick] [--out DIR] [--repeat 20] [--kinds plain,softcap]
    python -m cuflash bench --mods [--quick]

Each row: bf16, B=4, H=16, L queries and keys, head dim D, causal, one modification: none (plain causal),
softcap 30 tanh(s / 30), ALiBi, a document mask (four documents a sequence, with the causal mask) or T5's
relative-position bias (32 buckets, max distance 128; its table's gradient in the backward). Contenders on
the same buffers (PyTorch reads CuPy's arrays through DLPack): cuflash with the modification, and
FlexAttention (``torch.compile(flex_attention)``, the same score modification and a block mask from
``create_block_mask`` of the same mask), forward and forward+backward. "vs plain": the time over
cuflash's plain causal time of the same shape. "first call": the wall time of the first forward (then of
the first backward) of a modification never built before (cuflash: NVRTC and CuPy's cache bypassed by a
new source; FlexAttention: a fresh ``torch.compile``), and again at a new sequence length (L - 1).
Time: the median of ``--repeat`` queued calls' mean, 5 runs (CUDA events). Writes JSON and Markdown named
by the device into --out (default ./cuflash-mods-<time>/).
"""
from __future__ import annotations

import copy
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import cuflash  # noqa: E402
from cuflash import mods as M  # noqa: E402

try:
    import cupy as cp
except ImportError:   # main() says what is missing
    cp = None

try:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except Exception:  # torch (with FlexAttention) is optional
    torch = None

KINDS = ("plain", "softcap", "alibi", "document", "relative position")
QUICK = [(64, 4096), (128, 4096)]
SWEEP = [(d, n) for d in (64, 128) for n in (1024, 4096, 16384)]
B, H = 4, 16


def _fresh(mod):
    """``mod`` with a source never compiled before (a comment of its own): its first call builds."""
    if mod is None:
        return None
    fresh = copy.copy(mod)   # every field (params, consts, units, twins) kept
    fresh.source = f"/* {uuid.uuid4().hex} */ " + mod.source
    return fresh


def cuflash_mods(kind: str, n: int):
    """(score_mod, mask_mod) of a row for cuflash, on the device."""
    if kind == "softcap":
        return cuflash.softcap(30.0), None
    if kind == "alibi":
        return cuflash.alibi(cp.asarray(2.0 ** -np.arange(1, H + 1, dtype=np.float32) / 2)), None
    if kind == "document":
        return None, cuflash.document_mask(cp.asarray(_documents(n)))
    if kind == "relative position":
        table = cp.asarray(np.random.default_rng(0).standard_normal((32, H)).astype(np.float32) * 0.1)
        return cuflash.relative_position_bias(table), None
    return None, None


def _documents(n: int) -> np.ndarray:
    """Four documents a sequence, of uneven lengths (int32 (B, n))."""
    rng = np.random.default_rng(1)
    ids = np.zeros((B, n), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, n), 3, replace=False))
        for c in cuts:
            ids[b, c:] += 1
    return ids


def flex_mods(kind: str, n: int):
    """(score_mod, mask_mod) of a row for FlexAttention (torch functions of the same modifications)."""
    dev = "cuda"
    causal = lambda b, h, q, kv: q >= kv   # noqa: E731
    if kind == "softcap":
        return (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)), causal
    if kind == "alibi":
        slopes = torch.tensor(2.0 ** -np.arange(1, H + 1) / 2, device=dev, dtype=torch.float32)
        return (lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs()), causal
    if kind == "document":
        doc = torch.tensor(_documents(n), device=dev)
        return None, lambda b, h, q, kv: (q >= kv) & (doc[b, q] == doc[b, kv])
    if kind == "relative position":
        table = torch.tensor(np.random.default_rng(0).standard_normal((32, H)).astype(np.float32) * 0.1, device=dev,
                             requires_grad=True)
        lookup = torch.tensor(M.t5_bucket(-np.arange(129), 32, 128, True), device=dev)

        def rel(s, b, h, q, kv):
            r = kv - q
            bucket = torch.where(r > 0, 16, 0) + lookup[r.abs().clamp(max=128)]
            return s + table[bucket, h]
        return rel, causal
    return None, causal


def _timed(fn):
    cp.cuda.Device().synchronize()
    if torch is not None:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    cp.cuda.Device().synchronize()
    if torch is not None:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _inputs(n: int, d: int, seed=0):
    rng = np.random.default_rng(seed)
    dt = bench._cp_dtype("bfloat16")
    return tuple(cp.asarray(rng.standard_normal((B, H, n, d), dtype=np.float32).astype(dt)) for _ in range(4))


def cuflash_runs(kind: str, n: int, d: int) -> dict:
    """name -> (fwd callable, fwd+bwd callable, first-call seconds (fwd, bwd), at a new length (fwd, bwd))."""
    q, k, v, do = _inputs(n, d)
    score, mask = cuflash_mods(kind, n)
    kw = dict(causal=True, score_mod=score, mask_mod=mask)
    fresh = dict(causal=True, score_mod=_fresh(score), mask_mod=_fresh(mask))
    box = {}
    first_fwd = _timed(lambda: box.update(r=cuflash.vjp(q, k, v, **fresh)))
    first_bwd = _timed(lambda: box["r"][1](do))
    q2, k2, v2, do2 = _inputs(n - 1, d, 1)
    if kind == "document":   # the mask's ids are per length, its source (the fresh one's) is not
        again = copy.copy(cuflash.document_mask(cp.asarray(_documents(n - 1))))
        again.source = fresh["mask_mod"].source
        fresh = dict(fresh, mask_mod=again)
    again_fwd = _timed(lambda: box.update(r=cuflash.vjp(q2, k2, v2, **fresh)))
    again_bwd = _timed(lambda: box["r"][1](do2))

    def fwd_bwd():
        cuflash.vjp(q, k, v, **kw)[1](do)
    return {"cuflash": (lambda: cuflash.attention(q, k, v, **kw), fwd_bwd, (first_fwd, first_bwd),
                        (again_fwd, again_bwd))}


def flex_runs(kind: str, n: int, d: int) -> dict:
    if torch is None:
        return {}
    q, k, v, do = (torch.from_dlpack(x) for x in _inputs(n, d))
    score, mask = flex_mods(kind, n)
    # a fresh compile a row: otherwise the rows' closures (a document's ids a length) pile up recompiles of
    # one function until dynamo's limit sends flex_attention to its unfused path
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention)
    block_mask = create_block_mask(mask, B if kind == "document" else None, None, n, n, device="cuda")
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    box = {}
    first_fwd = _timed(lambda: box.update(o=compiled(qg, kg, vg, score_mod=score, block_mask=block_mask)))
    first_bwd = _timed(lambda: box["o"].backward(do))
    q2, k2, v2, do2 = (torch.from_dlpack(x) for x in _inputs(n - 1, d, 1))
    score2, mask2 = flex_mods(kind, n - 1)
    mask_2 = create_block_mask(mask2, B if kind == "document" else None, None, n - 1, n - 1, device="cuda")
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q2, k2, v2))
    again_fwd = _timed(lambda: box.update(o=compiled(q2, k2, v2, score_mod=score2, block_mask=mask_2)))
    again_bwd = _timed(lambda: box["o"].backward(do2))

    def fwd():
        with torch.no_grad():
            return compiled(q, k, v, score_mod=score, block_mask=block_mask)

    def fwd_bwd():
        compiled(qg, kg, vg, score_mod=score, block_mask=block_mask).backward(do)
    return {"flex": (fwd, fwd_bwd, (first_fwd, first_bwd), (again_fwd, again_bwd))}


def run_row(kind: str, d: int, n: int, repeat: int, plain_ms: dict, skip) -> list:
    runs = {}
    for maker in (cuflash_runs, flex_runs):
        try:
            runs.update(maker(kind, n, d))
        except Exception as exc:   # a contender that cannot run this row says why in its row
            name = "cuflash" if maker is cuflash_runs else "flex"
            runs[name] = (None, None, (None, None), (None, None), f"n/a ({type(exc).__name__}: {exc})"[:120])
    rows = []
    for name, spec in runs.items():
        if name in skip:
            continue
        fwd, fwd_bwd, first, again = spec[:4]
        note = spec[4] if len(spec) > 4 else ""
        for pass_, fn, i in (("fwd", fwd, 0), ("fwd+bwd", fwd_bwd, 1)):
            base = {"mod": kind, "D": d, "L": n, "pass": pass_, "contender": name, "ms": None, "vs plain": None,
                    "first call s": first[i], "new length s": again[i], "note": note}
            key = (d, n, pass_)

            def fields(ms, key=key):
                return {"vs plain": ms / plain_ms[key] if key in plain_ms else None}
            row = bench.timed_row(base, fn, repeat, fields)
            if kind == "plain" and name == "cuflash" and row["ms"] is not None:
                plain_ms[key] = row["ms"]
                row["vs plain"] = 1.0
            rows.append(row)
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def markdown(results, device) -> str:
    return bench.markdown_table(
        f"# User modifications against FlexAttention on {device} (bf16, B={B}, H={H}, causal)",
        [("mod", "mod", ""), ("D", "D", ""), ("L", "L", ""), ("pass", "pass", ""), ("contender", "contender", ""),
         ("ms", "ms", ".3f"), ("vs cuflash plain", "vs plain", ".2f"), ("first call s", "first call s", ".2f"),
         ("new length s", "new length s", ".3f"), ("note", "note", "")], results)


def main(argv=None) -> int:
    def kinds_option(parser):
        parser.add_argument("--kinds", default=",".join(KINDS),
                            help=f"the modifications to time, of {', '.join(KINDS)} (plain first: the ratios' base)")

    parsed = bench.side_args(argv, __doc__, "modifications", "head dims 64 and 128 at L=4096 only", 20, "flex",
                             kinds_option)
    if parsed is None:
        return 2
    args, device, skip = parsed
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"--kinds: unknown {', '.join(unknown)} (of {', '.join(KINDS)})")
        return 2
    plain: dict = {}
    rows = (run_row(kind, d, n, args.repeat, plain, skip) for d, n in (QUICK if args.quick else SWEEP)
            for kind in kinds)
    return bench.side_report(rows, markdown, device, args.out, "mods")


if __name__ == "__main__":
    sys.exit(main())
