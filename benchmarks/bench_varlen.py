"""Packed sequences of different lengths (cuflash.varlen) against padding, on one GPU.

    PYTHONPATH=. python benchmarks/bench_varlen.py [--quick] [--dtypes bfloat16,float32] [--dims 64,128]
                                                   [--cases abc] [--out DIR] [--repeat 10]
    python -m cuflash bench --varlen [--quick]

Each case packs 65536 tokens: (a) 32 sequences of 2048, (b) lengths drawn uniformly from 128..8192
(seed 0), (c) one sequence of 32768 and 128 of 256; H x D = 2048 (H = 32 at D = 64, 16 at D = 128),
queries, keys and values of one length a sequence. Contenders on the same data (PyTorch reads CuPy's
arrays through DLPack): cuflash varlen (offsets as a NumPy array: no device read; on equal lengths, case a, the
dense kernels on views of the packed arrays, and beside them the packed kernels the other cases run), cuflash dense on the
batch padded to its longest sequence (a (B, 1, 1, L) key mask without causal; causal alone hides the
right padding), PyTorch SDPA on nested jagged tensors (its flash path) and SDPA efficient on the padded
batch (the key mask as a boolean attn_mask); a padded batch of more than 4x the packed tokens (case c:
129 x 32768) is left out. Beside them, the yardsticks: cuflash dense on equal lengths of the mean
(cases a and b: as many sequences of the mean length, its own FLOPs; as (B, H, L, D) arrays and as
(B, L, H, D) ones seen as (B, H, L, D), whose rows lie H x D apart as packed rows do), and (case c) the long sequence
alone plus the short ones alone (two dense calls, their times added). Forward, and forward+backward (the
gradients of every input). Useful TFLOP/s counts each sequence's own FLOPs, 4 L^2 H D (halved when
causal; forward+backward 3.5x the forward), over the time: the median of --repeat queued calls' mean,
5 runs (CUDA events). Every contender reads random normal data (queries, keys, values and the output's
gradient).
Writes JSON and Markdown named by the device into --out (default ./cuflash-varlen-<time>/).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import cuflash  # noqa: E402
from cuflash import varlen  # noqa: E402

cp, torch = bench.cp, bench.torch   # None where CuPy (main() says so) or PyTorch (no peers) is missing

TOKENS = 65536
MAX_PADDING = 4   # padded contenders run where the padded batch has at most this many times the packed tokens


def lengths_of(case: str) -> list:
    """The sequence lengths of case a, b or c (TOKENS tokens)."""
    if case == "a":
        return [2048] * (TOKENS // 2048)
    if case == "c":
        return [32768] + [256] * ((TOKENS - 32768) // 256)
    rng = np.random.default_rng(0)
    out, total = [], 0
    while total < TOKENS:
        n = min(int(rng.integers(128, 8193)), TOKENS - total)
        out.append(n)
        total += n
    return out


def useful_flops(lengths, h: int, d: int, causal: bool, with_bwd: bool) -> float:
    per = sum(4.0 * n * n * h * d for n in lengths) * (0.5 if causal else 1.0)
    return per * (3.5 if with_bwd else 1.0)


@contextlib.contextmanager
def packed_kernel_only():
    """cuflash.varlen without its equal-length path (the dense kernels on views of the packed arrays): its
    packed kernels, timed on equal lengths too."""
    equal = varlen._equal_lengths
    varlen._equal_lengths = lambda call: (0, 0)
    try:
        yield
    finally:
        varlen._equal_lengths = equal


def _padded(x, cu, lmax):
    """(total, H, D) packed -> (B, H, Lmax, D) zero-padded copy."""
    b = len(cu) - 1
    out = cp.zeros((b, lmax) + x.shape[1:], dtype=x.dtype)
    for i in range(b):
        out[i, :cu[i + 1] - cu[i]] = x[cu[i]:cu[i + 1]]
    return out.transpose(0, 2, 1, 3)


def normal(shape, dtype, seed: int):
    """A new CuPy array of standard normal values in ``dtype``. Every contender reads random data: on constant
    data (all ones) the tensor cores switch fewer bits, draw less power and the GPU holds a higher clock."""
    return cp.random.default_rng(seed).standard_normal(shape, dtype=cp.float32).astype(dtype)


def _dense_call(shape, dtype, causal: bool, with_bwd: bool, token_major: bool = False):
    """A cuflash dense call on new random (B, H, L, D) arrays (``token_major``: (B, L, H, D) arrays seen as (B,
    H, L, D), the packed layout's row stride): forward, or forward and backward."""
    b, h, n, d = shape
    if token_major:
        q, k, v, do = (normal((b, n, h, d), dtype, seed).transpose(0, 2, 1, 3) for seed in range(4))
    else:
        q, k, v, do = (normal(shape, dtype, seed) for seed in range(4))

    def call():
        if not with_bwd:
            return cuflash.attention_forward(q, k, v, causal=causal)
        out, fn = cuflash.vjp(q, k, v, causal=causal)
        return fn(do)
    return call


def yardsticks(q, cu, causal: bool, with_bwd: bool, h: int, d: int) -> dict:
    """name -> (callable, note, FLOPs or None: the case's useful FLOPs): cuflash dense on equal lengths of
    the mean (its own FLOPs), as (B, H, L, D) arrays and as (B, L, H, D) ones (the packed rows' stride), or
    where one sequence is at least half the tokens (case c), the long one alone
    plus the others alone (two dense calls of equal lengths each; the case's FLOPs)."""
    lengths = np.diff(cu)
    if lengths.max() * 2 >= lengths.sum():
        long_ = _dense_call((1, h, int(lengths.max()), d), q.dtype, causal, with_bwd)
        rest = lengths[lengths != lengths.max()]
        short = _dense_call((len(rest), h, int(rest.max()), d), q.dtype, causal, with_bwd)
        assert (rest == rest.max()).all(), "the other sequences are of one length"

        def parts():
            long_()
            return short()
        return {"cuflash long + short alone": (parts, f"1 x {lengths.max()}, then {len(rest)} x {rest.max()}", None)}
    mean = int(round(lengths.mean()))
    flops = useful_flops([mean] * len(lengths), h, d, causal, with_bwd)
    shape = (len(lengths), h, mean, d)
    return {"cuflash dense, mean length": (_dense_call(shape, q.dtype, causal, with_bwd),
                                          f"B={len(lengths)}, L={mean}", flops),
            "cuflash dense, mean length, (B, L, H, D)": (_dense_call(shape, q.dtype, causal, with_bwd, True),
                                                         f"B={len(lengths)}, L={mean}", flops)}


def contenders(q, k, v, cu, causal: bool, with_bwd: bool) -> dict:
    """name -> (callable or None, note)."""
    lengths = np.diff(cu)
    lmax = int(lengths.max())
    do = normal(q.shape, q.dtype, 4)

    def cuflash_varlen():
        if not with_bwd:
            return varlen.attention_varlen_forward(q, k, v, cu, cu, causal=causal)
        out, fn = varlen.vjp_varlen(q, k, v, cu, cu, causal=causal)
        return fn(do)

    out = {"cuflash varlen": (cuflash_varlen, "")}
    if (lengths == lengths[0]).all():   # equal lengths run the dense kernels: the packed ones beside them

        def packed_kernel():
            with packed_kernel_only():
                return cuflash_varlen()

        out["cuflash varlen, packed kernels"] = (packed_kernel, "the packed kernels on equal lengths")
    padding = len(lengths) * lmax / lengths.sum()
    if padding > MAX_PADDING:
        left_out = (None, f"left out: padded to {len(lengths)} x {lmax}, {padding:.0f}x the tokens")
        out["cuflash padded"] = left_out
    else:
        pq, pk, pv, pdo = (_padded(x, cu, lmax) for x in (q, k, v, do))
        keys = cp.asarray(np.arange(lmax)[None, :] < lengths[:, None]).reshape(len(lengths), 1, 1, lmax)
        kw = dict(causal=True) if causal else dict(mask=keys)

        def cuflash_padded():
            if not with_bwd:
                return cuflash.attention_forward(pq, pk, pv, **kw)
            out_, fn = cuflash.vjp(pq, pk, pv, **kw)
            return fn(pdo)

        out["cuflash padded"] = (cuflash_padded, f"B={len(lengths)}, L={lmax}")
    if torch is None:
        return out
    F, SDPBackend, sdpa_kernel = bench.F, bench.SDPBackend, bench.sdpa_kernel
    offsets = torch.as_tensor(cu.astype(np.int64), device="cuda")
    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_(with_bwd) for x in (q, k, v))
    tdo = torch.from_dlpack(do)

    grad = []   # the output's gradient: tdo's values in the layout of the output's values (made once)

    def nested():
        nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (tq, tk, tv))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(nq, nk, nv, is_causal=causal)
        if with_bwd:
            values = o.values()
            if not grad:
                grad.append(torch.empty_like(values).copy_(tdo.reshape(values.shape)))
            values.backward(grad[0])
        return o

    try:
        nested()
        out["torch flash nested"] = (nested, "")
    except Exception as exc:
        out["torch flash nested"] = (None, f"n/a ({type(exc).__name__})")
    if padding > MAX_PADDING:
        out["torch efficient padded"] = left_out
        return out
    ptq, ptk, ptv = (torch.from_dlpack(x).detach().requires_grad_(with_bwd) for x in (pq, pk, pv))
    ptdo = torch.from_dlpack(pdo)
    tkeys = torch.from_dlpack(keys)

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o = (F.scaled_dot_product_attention(ptq, ptk, ptv, is_causal=True) if causal
                 else F.scaled_dot_product_attention(ptq, ptk, ptv, attn_mask=tkeys))
        if with_bwd:
            o.backward(ptdo)
        return o

    try:
        efficient()
        out["torch efficient padded"] = (efficient, f"B={len(lengths)}, L={lmax}")
    except Exception as exc:
        out["torch efficient padded"] = (None, f"n/a ({type(exc).__name__})")
    return out


def run_case(dtype, case, d, causal, with_bwd, repeat, skip) -> list:
    lengths = lengths_of(case)
    h = 2048 // d
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rng = np.random.default_rng(1)
    dt = bench._cp_dtype(dtype)
    q, k, v = (cp.asarray(rng.standard_normal((TOKENS, h, d), dtype=np.float32)).astype(dt) for _ in range(3))
    flops = useful_flops(lengths, h, d, causal, with_bwd)
    runs = {name: (fn, note, flops) for name, (fn, note) in contenders(q, k, v, cu, causal, with_bwd).items()}
    runs.update(yardsticks(q, cu, causal, with_bwd, h, d))
    runs = {name: (fn, note, lambda ms, f=own_flops or flops: {"TFLOP/s": f / ms / 1e9})
            for name, (fn, note, own_flops) in runs.items()}
    base = {"dtype": dtype, "case": case, "D": d, "H": h, "causal": causal, "pass": "fwd+bwd" if with_bwd else "fwd",
            "sequences": len(lengths), "ms": None, "TFLOP/s": None}
    results = bench.timed_rows(runs, base, repeat, skip)
    del q, k, v
    cp.get_default_memory_pool().free_all_blocks()
    return results


def markdown(results, device) -> str:
    lines = [f"# Packed sequences on {device} ({TOKENS} tokens a call, H x D = 2048)", "",
             "| dtype | case | D | causal | pass | contender | ms | useful TFLOP/s | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
        tf = "" if r["TFLOP/s"] is None else f"{r['TFLOP/s']:.1f}"
        lines.append(f"| {r['dtype']} | {r['case']} ({r['sequences']}) | {r['D']} | {r['causal']} | {r['pass']} | "
                     f"{r['contender']} | {ms} | {tf} | {r['note']} |")
    return "\n".join(lines) + "\n"


def configurations(quick: bool, dtypes=None, dims=None, cases: str = "abc") -> list:
    """(dtype, case, D, causal, forward+backward) of every row: --quick's, or the given dtypes, head dims and
    cases (default all: bfloat16, float16 and float32 at 64 and 128, cases a, b and c)."""
    dtypes = dtypes or (("bfloat16",) if quick else ("bfloat16", "float16", "float32"))
    heads = dims or ((128,) if quick else (64, 128))
    return [(dtype, case, d, causal, with_bwd) for dtype in dtypes for d in heads for case in cases
            for causal in (False, True) for with_bwd in (False, True)]


def main(argv=None) -> int:
    def more(parser):
        parser.add_argument("--dtypes", default="", help="comma-separated, e.g. bfloat16,float32 (default: all)")
        parser.add_argument("--dims", default="", help="head dims, e.g. 64,128 (default: both)")
        parser.add_argument("--cases", default="abc", help="of the cases a, b and c, e.g. ab (default: all)")

    parsed = bench.side_args(argv, __doc__, "varlen", "bfloat16 at head dim 128 only", 10, "'torch efficient padded'",
                             more=more)
    if parsed is None:
        return 2
    args, device, skip = parsed
    dtypes = tuple(x.strip() for x in args.dtypes.split(",") if x.strip())
    dims = tuple(int(x) for x in args.dims.split(",") if x.strip())
    if not args.cases or set(args.cases) - set("abc"):
        print(f"--cases takes letters of abc, got {args.cases!r}", file=sys.stderr)
        return 2
    rows = (run_case(*config, args.repeat, skip) for config in configurations(args.quick, dtypes, dims, args.cases))
    return bench.side_report(rows, markdown, device, args.out, "varlen")


if __name__ == "__main__":
    sys.exit(main())
