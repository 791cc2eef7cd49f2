"""The Hopper forward with persistent CTAs: one CTA an SM walking query blocks, or a CTA a block?

With one CTA an SM (the 192 x 128 tile at head dim 64, 128 x 128 at 128), each CTA of a grid of
one CTA a block starts its pipeline bare (Q and the first K/V tiles in flight, nothing to overlap
them) and drains its epilogue alone. FwdWgmmaTraits::PERSISTENT variants can walk several blocks,
the next block's Q and first tiles landing while this one finishes. This script times, on the
same buffers and interleaved round by round,

    per-block    a CTA a query block (every schedule "block", as with select.HOPPER_FWD_PERSISTENT off)
    persistent   the default: one CTA an SM, a stride over the blocks without a causal band; causal
                 head dim 128 takes its blocks from a block queue, causal head
                 dim 64 a CTA a block
    stride       one CTA an SM striding over causal blocks too (their blocks differ in work)
    cudnn        PyTorch SDPA's cuDNN backend (when torch imports)

at B x L = 16384 tokens, H x D = 2048 (bench.py's shape), timed alone (cupyx benchmark: the host's
work before the kernel included) and queued (the mean call of back-to-back calls), and prints each
contender's max |difference| from the per-block output (the same arithmetic a block: 0 expected).

    PYTHONPATH=. python benchmarks/tune_persistent.py [--heads 64,128] [--lengths 1024,2048,4096,16384] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
from dataclasses import replace

from cuflash._dispatch import model, plan

from tune_short import print_header, problems, time_rules


def _rescheduled(rule):
    """``plan.forward_choice`` with the Hopper forward's schedule replaced by ``rule(variant)`` (one
    function a rule, so that the plan memo keeps its plans)."""
    choose = plan.forward_choice

    @functools.lru_cache(maxsize=None)
    def pick(*args):
        variant, portable = choose(*args)
        if variant.family == "fwd_wgmma":
            variant = replace(variant, schedule=rule(variant))
        return variant, portable

    return pick


RULES = {
    "per-block": _rescheduled(lambda v: "block"),
    "persistent": plan.forward_choice,   # the library's own (select.schedule_for)
    "stride": _rescheduled(lambda v: "stride" if model.walkable(v) else "block"),
}


@contextlib.contextmanager
def grid_rule(kind):
    """Forwards launched by one grid rule ("per-block", "persistent" or "stride")."""
    real = plan.forward_choice
    plan.forward_choice = RULES[kind]
    try:
        yield
    finally:
        plan.forward_choice = real


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--lengths", default="1024,2048,4096,16384")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--causal", default="no,yes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    print_header(width=11)
    for dname, d, n, (q, k, v) in problems(args.heads, args.dtypes, args.lengths):
        for causal in (c == "yes" for c in args.causal.split(",")):
            kinds = ["per-block", "persistent"] + (["stride"] if causal else [])
            time_rules(q, k, v, causal, kinds, grid_rule, f"{dname:8} {d:3d} {n:5d} {str(causal):>6}", args.rounds,
                       args.repeat, width=11)

if __name__ == "__main__":
    main()
