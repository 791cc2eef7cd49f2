"""The packed calls (cuflash.varlen) against the dense kernel on the same tokens, on one GPU: bench_varlen.py's
cases a (32 x 2048) and b (16 lengths 128..8192), bfloat16, H x D = 2048, 65536 tokens; the dense yardstick on
equal lengths of the mean, once on the packed tokens viewed (B, L, H, D) -> (B, H, L, D) (the packed rows'
stride) and once on a contiguous (B, H, L, D) copy. Case c (one 32768 and 128 x 256) in its parts: each part
packed alone against its dense call, and the whole. Useful TFLOP/s (each sequence's own FLOPs); a time is the
median of 3 runs of 10 queued calls' mean (CUDA events). The forward by default; ``--backward``: forward and
backward. ``--rounds R``: the contenders of a row timed in turn R times and each one's median kept, so that a
clock or thermal drift of the GPU during the run falls on all of them alike. Equal lengths (case a) run the dense
kernels on the packed arrays; the packed kernels the other cases run are timed beside them ("packed kernel").

    PYTHONPATH=. python benchmarks/varlen_vs_dense.py [--dims 128,64] [--cases abc] [--backward] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_varlen as bv  # noqa: E402

cp = bv.cp


def timed(fn) -> float:
    fn()
    cp.cuda.Device().synchronize()
    return bv.bench._time_queued(fn, 10, runs=3)


def interleaved(fns: List[Callable], rounds: int) -> List[float]:
    """Each of ``fns`` timed (:func:`timed`) once a round, in turn, over ``rounds`` rounds: the median of each."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, kept in zip(fns, times):
            kept.append(timed(fn))
    return [float(np.median(t)) for t in times]


def packed_call(q, k, v, cu_q, cu_k, causal, dout=None) -> Callable:
    """The packed forward, or with ``dout`` the forward and its backward."""
    from cuflash import varlen

    def call():
        out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal)
        if dout is not None:
            varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal)
    return call


def packed_kernel_call(call: Callable) -> Callable:
    """``call`` with cuflash.varlen's equal-length path turned off: the packed kernels."""
    def packed():
        with bv.packed_kernel_only():
            call()
    return packed


def dense_call(q, k, v, causal, dout=None) -> Callable:
    """The dense forward of (B, H, L, D) views, or with ``dout`` the forward and its backward."""
    import cuflash

    def call():
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)
        if dout is not None:
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    return call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--cases", default="abc")
    parser.add_argument("--backward", action="store_true", help="time the forward and the backward")
    parser.add_argument("--rounds", type=int, default=1, help="contenders timed in turn this many times (median)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rng = np.random.default_rng(1)
    what = "fwd+bwd" if args.backward else "fwd"
    for d in (int(x) for x in args.dims.split(",")):
        h = 2048 // d
        bf16 = bv.bench._cp_dtype("bfloat16")
        q, k, v, do = (cp.asarray(rng.standard_normal((bv.TOKENS, h, d), dtype=np.float32)).astype(bf16)
                       for _ in range(4))
        dout = do if args.backward else None
        if "c" in args.cases:
            case_c(q, k, v, dout, h, d, args.rounds)
        for case in args.cases.replace("c", ""):
            lengths = bv.lengths_of(case)
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            b, mean = len(lengths), bv.TOKENS // len(lengths)
            token_major = [x.reshape(b, mean, h, d).transpose(0, 2, 1, 3) for x in (q, k, v, do)]
            contiguous = [cp.ascontiguousarray(x) for x in token_major]
            equal = len(set(lengths)) == 1
            for causal in (False, True):
                fns = [packed_call(q, k, v, cu, cu, causal, dout),
                       dense_call(*token_major[:3], causal, token_major[3] if args.backward else None),
                       dense_call(*contiguous[:3], causal, contiguous[3] if args.backward else None)]
                if equal:   # equal lengths run the dense kernels on the packed arrays: the packed ones too
                    fns.append(packed_kernel_call(packed_call(q, k, v, cu, cu, causal, dout)))
                times = interleaved(fns, args.rounds)
                flops = [bv.useful_flops(lengths, h, d, causal, args.backward)]
                flops += 2 * [bv.useful_flops([mean] * b, h, d, causal, args.backward)]
                tf = [f / t / 1e9 for f, t in zip(flops + flops[:1], times)]
                kernel = f" | packed kernel {tf[3]:6.1f}: {tf[3] / tf[1]:.3f} {tf[3] / tf[2]:.3f}" if equal else ""
                print(f"D={d} {case} causal={causal!s:5} {what} TF/s varlen {tf[0]:6.1f} dense (B, L, H, D) "
                      f"{tf[1]:6.1f} dense (B, H, L, D) {tf[2]:6.1f} | varlen / the two: {tf[0] / tf[1]:.3f} "
                      f"{tf[0] / tf[2]:.3f}{kernel}", flush=True)
    return 0


def case_c(q, k, v, dout, h: int, d: int, rounds: int) -> None:
    """Case c's long sequence and its short ones, each packed alone and as a dense call, then the whole case:
    where the packed call's time goes beyond its parts' dense times (``dout``: forward and backward)."""
    lengths = bv.lengths_of("c")
    long_, short = max(lengths), [n for n in lengths if n != max(lengths)]
    parts = {"long": (0, long_, [long_]), "short": (long_, bv.TOKENS, short)}
    for causal in (False, True):
        fns = []
        for a, b, seqs in parts.values():
            cu = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int32)
            rows = [x[a:b] for x in (q, k, v)] + [None if dout is None else dout[a:b]]
            n = seqs[0]
            dense = [None if x is None else cp.ascontiguousarray(x.reshape(len(seqs), n, h, d).transpose(0, 2, 1, 3))
                     for x in rows]
            fns += [packed_call(*rows[:3], cu, cu, causal, rows[3]), dense_call(*dense[:3], causal, dense[3])]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        fns.append(packed_call(q, k, v, cu, cu, causal, dout))
        long_packed, long_dense, short_packed, short_dense, whole = interleaved(fns, rounds)
        print(f"D={d} c causal={causal!s:5} {'fwd+bwd' if dout is not None else 'fwd'} long packed {long_packed:.3f} "
              f"/ dense {long_dense:.3f} ms | short packed {short_packed:.3f} / dense {short_dense:.3f} ms | whole "
              f"packed {whole:.3f} ms = {whole / (long_dense + short_dense):.3f}x the two dense parts", flush=True)


if __name__ == "__main__":
    sys.exit(main())
