"""The packed forward (cuflash.varlen) against the dense kernel on the same tokens, on one GPU: bench_varlen.py's
cases a (32 x 2048) and b (16 lengths 128..8192), bfloat16, H x D = 2048, 65536 tokens; the dense yardstick on
equal lengths of the mean, once on the packed tokens viewed (B, L, H, D) -> (B, H, L, D) (the packed rows'
stride) and once on a contiguous (B, H, L, D) copy. Case c (one 32768 and 128 x 256) in its parts: each part
packed alone against its dense call, and the whole. Useful TFLOP/s (each sequence's own FLOPs); a time is the
median of 3 runs of 10 queued calls' mean (CUDA events).

    PYTHONPATH=. python benchmarks/varlen_vs_dense.py [--dims 128,64] [--cases abc]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_varlen as bv  # noqa: E402

cp = bv.cp


def timed(fn) -> float:
    fn()
    cp.cuda.Device().synchronize()
    return bv.bench._time_queued(fn, 10, runs=3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--cases", default="abc")
    args = parser.parse_args(argv)
    import cuflash
    from cuflash import varlen

    rng = np.random.default_rng(1)
    for d in (int(x) for x in args.dims.split(",")):
        h = 2048 // d
        bf16 = bv.bench._cp_dtype("bfloat16")
        q, k, v = (cp.asarray(rng.standard_normal((bv.TOKENS, h, d), dtype=np.float32)).astype(bf16) for _ in range(3))
        if "c" in args.cases:
            case_c(q, k, v, h, d)
        for case in args.cases.replace("c", ""):
            lengths = bv.lengths_of(case)
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            b, mean = len(lengths), bv.TOKENS // len(lengths)
            token_major = [x.reshape(b, mean, h, d).transpose(0, 2, 1, 3) for x in (q, k, v)]
            contiguous = [cp.ascontiguousarray(x) for x in token_major]
            for causal in (False, True):
                times = [timed(lambda: varlen.attention_varlen_forward(q, k, v, cu, cu, causal=causal)),
                         timed(lambda: cuflash.attention_forward(*token_major, causal=causal)),
                         timed(lambda: cuflash.attention_forward(*contiguous, causal=causal))]
                flops = [bv.useful_flops(lengths, h, d, causal, False)]
                flops += 2 * [bv.useful_flops([mean] * b, h, d, causal, False)]
                tf = [f / t / 1e9 for f, t in zip(flops, times)]
                print(f"D={d} {case} causal={causal!s:5} fwd TF/s varlen {tf[0]:6.1f} dense (B, L, H, D) {tf[1]:6.1f} "
                      f"dense (B, H, L, D) {tf[2]:6.1f} | varlen / the two: {tf[0] / tf[1]:.3f} {tf[0] / tf[2]:.3f}",
                      flush=True)
    return 0


def case_c(q, k, v, h: int, d: int) -> None:
    """Case c's long sequence and its short ones, each packed alone and as a dense call, then the whole case:
    where the packed call's time goes beyond its parts' dense times."""
    import cuflash
    from cuflash import varlen

    lengths = bv.lengths_of("c")
    long_, short = max(lengths), [n for n in lengths if n != max(lengths)]
    parts = {"long": (0, long_, [long_]), "short": (long_, bv.TOKENS, short), "whole": (0, bv.TOKENS, lengths)}
    for causal in (False, True):
        line = []
        for name, (a, b, seqs) in parts.items():
            cu = np.concatenate([[0], np.cumsum(seqs)]).astype(np.int32)
            pq, pk, pv = (x[a:b] for x in (q, k, v))
            packed = timed(lambda: varlen.attention_varlen_forward(pq, pk, pv, cu, cu, causal=causal))
            if name == "whole":
                line.append(f"whole packed {packed:.3f} ms")
                continue
            n = seqs[0]
            dense_args = [cp.ascontiguousarray(x.reshape(len(seqs), n, h, d).transpose(0, 2, 1, 3))
                          for x in (pq, pk, pv)]
            dense = timed(lambda: cuflash.attention_forward(*dense_args, causal=causal))
            line.append(f"{name} packed {packed:.3f} / dense {dense:.3f} ms")
        print(f"D={d} c causal={causal!s:5} " + " | ".join(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
