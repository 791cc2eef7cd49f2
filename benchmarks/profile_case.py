"""One masking case, forward and backward, for a profiler (ncu / nsys) to look at.

    PYTHONPATH=. python benchmarks/profile_case.py bias      # (1, 1, L, L) bias with dbias
    PYTHONPATH=. python benchmarks/profile_case.py padding   # (B, 1, 1, L) key-padding mask
    PYTHONPATH=. python benchmarks/profile_case.py plain     # no option, the same shapes

B=4 (--batch), H=16 (--heads), L=4096 (--seqlen), D=64 (--head-dim), float16 (--dtype), not causal (--causal): the
bench_masking.py shape. Each case runs --calls forward+backward calls (--forward-only: forwards;
the first compiles); profile the last ones, e.g.

    ncu -k regex:flash_ --launch-skip 8 --launch-count 4 --section SpeedOfLight \\
        --section WarpStateStats python benchmarks/profile_case.py bias
"""
from __future__ import annotations

import argparse

import cupy as cp

import cuflash


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=("bias", "padding", "plain"))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true", help="causal (top-left), for the causal kernels' profile")
    ap.add_argument("--forward-only", action="store_true", help="forward calls only")
    ap.add_argument("--no-short-rule", action="store_true",
                    help="Hopper: the wgmma forward's table tile also for few keys (HOPPER_FWD_MIN_KEYS and "
                         "HOPPER_FWD_SHORT_KEYS emptied)")
    ap.add_argument("--portable", action="store_true",
                    help="the portable mma.sync path on a Hopper GPU (bench.py's \"cuflash sm80\")")
    args = ap.parse_args()
    b, h, n, d = args.batch, args.heads, args.seqlen, args.head_dim
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(args.dtype) for _ in range(4))
    opts = {"causal": True} if args.causal else {}
    if args.case == "bias":
        opts["bias"] = rng.standard_normal((1, 1, n, n), dtype=cp.float32).astype(args.dtype)
    elif args.case == "padding":
        opts["mask"] = cp.ones((b, 1, 1, n), dtype=bool)
    if args.no_short_rule:
        from cuflash._dispatch import select
        select.HOPPER_FWD_MIN_KEYS.clear()
        select.HOPPER_FWD_SHORT_KEYS.clear()
    if args.portable:   # as bench.py's "cuflash sm80" contender: the kernels a GPU without sm_90a runs
        from cuflash._runtime import device
        device.compute_capability = lambda: 80
    for _ in range(args.calls):
        out, lse = cuflash.attention_forward(q, k, v, **opts)
        if not args.forward_only:
            cuflash.attention_backward(do, q, k, v, out, lse, **opts)
    cp.cuda.Device().synchronize()
    what = "forward" if args.forward_only else "forward+backward"
    print(f"{args.case}: {args.calls} {what} calls, B={b} H={h} L={n} D={d} {args.dtype} causal={args.causal}"
          + (" (portable path)" if args.portable else ""))


if __name__ == "__main__":
    main()
