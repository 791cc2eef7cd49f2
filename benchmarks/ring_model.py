"""When does a ring step's transfer hide behind its compute? A paper model for cuflash.distributed.

    python benchmarks/ring_model.py [--results benchmarks/results/NVIDIA_H200_compare_quick.json]

A ring step moves one key/value block (B x Hk x L_local x D, both K and V) to the next rank while the
rank attends its L_local queries to the block it holds; the backward moves the block again with its
float32 dK / dV accumulators. Per step, with attention throughput T (FLOP/s, the measured bf16 rows of
the results file: 4 B H Lq Lk D forward FLOPs, 3.5x that forward+backward, halved causal) and link
bandwidth W (bytes/s one way) plus a per-step latency t0:

    compute = c B H L_local^2 D / T            c = 4 forward, 10 backward (14 = 3.5 x 4 both)
    transfer = t0 + B Hk L_local D (2 s + g) / W    s = 2 bytes (bf16), g = 0 forward, 2 x 4 backward

so the transfer hides once L_local >= (Hk (2 s + g) T) / (c H W) (latency aside). A causal zigzag step
averages half a block of visible scores: c halves, the threshold doubles. The ring's per-step balance
does not depend on N; N sets the whole length L = N L_local at the threshold. Links assumed (vendor
figures, not measured here): NVLink 4 on the H200, 450 GB/s a direction; InfiniBand NDR, 50 GB/s a GPU;
t0 10 us (NVLink) / 20 us (InfiniBand).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

LINKS = {"NVLink (H200, 450 GB/s)": (450e9, 10e-6), "InfiniBand NDR (50 GB/s)": (50e9, 20e-6)}


def threshold(tflops: float, heads: int, kv_heads: int, head_dim: int, link: tuple, backward: bool,
              causal: bool, batch: int = 1) -> int:
    """The smallest L_local whose step compute covers its transfer (latency included)."""
    bandwidth, latency = link
    flops_per_pair = (10 if backward else 4) * batch * heads * head_dim * (0.5 if causal else 1.0)
    bytes_per_token = batch * kv_heads * head_dim * (2 * 2 + (8 if backward else 0))
    length = 1
    while length < 2**26:
        compute = flops_per_pair * length * length / (tflops * 1e12)
        transfer = latency + bytes_per_token * length / bandwidth
        if compute >= transfer:
            return length
        length = math.ceil(length * 1.05)
    return length


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(Path(__file__).resolve().parent / "results" /
                                                 "NVIDIA_H200_compare_quick.json"))
    args = parser.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    measured = {(r["pass"], r["D"], r["causal"]): r["after_tflops"] for r in data["rows"] if r["dtype"] == "bfloat16"}
    print("L_local (tokens a GPU) from which a step's transfer hides; H = Hk = 16, bf16; whole length at N GPUs")
    print("| link | D | pass | causal | TFLOP/s | L_local | L at N=8 | N=64 | N=512 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, link in LINKS.items():
        for d in (64, 128):
            for kind in ("fwd", "fwd+bwd"):
                for causal in (False, True):
                    t = measured[(kind, d, causal)]
                    backward = kind == "fwd+bwd"
                    lo = threshold(t, 16, 16, d, link, backward, causal)
                    print(f"| {name} | {d} | {kind} | {causal} | {t:.0f} | {lo} | {8 * lo} | {64 * lo} | {512 * lo} |")


if __name__ == "__main__":
    main()
