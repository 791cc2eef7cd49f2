"""Where a kernel's warps wait: read an Nsight Compute report and print its stall reasons
and its hottest SASS instructions.

    ncu --set full -k regex:flash_fwd_mma --launch-skip 2 --launch-count 1 -o fwd \\
        python benchmarks/profile_case.py plain
    python benchmarks/ncu_hot.py fwd.ncu-rep [--top 40]

Prints, per profiled kernel: a few throughput figures (tensor pipe, issue slots, shared-memory
bank conflicts, instructions), the warp-stall reasons by PC-sampling share, and the --top SASS
instructions by sampled stalls with their dominant reasons. `ncu` is looked up on PATH and in
/usr/local/cuda*/bin.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import shutil
import subprocess
from collections import defaultdict

FIGURES = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "lts__t_sectors_op_red.sum",
    "lts__t_sectors_op_atom.sum",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sector_hit_rate.pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "launch__registers_per_thread",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)


def ncu_bin() -> str:
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))), None)
    if not found:
        raise SystemExit("ncu not found")
    return found


def ncu_csv(report: str, *page: str) -> list[list[str]]:
    text = subprocess.run([ncu_bin(), "-i", report, "--csv", *page], capture_output=True, text=True, check=True).stdout
    return list(csv.reader(io.StringIO(text)))


def number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def raw_figures(report: str) -> None:
    rows = ncu_csv(report, "--page", "raw")
    if len(rows) < 3:
        print("  (no raw page)")
        return
    head = rows[0]
    for row in rows[2:]:   # rows[1] holds the units
        rec = dict(zip(head, row))
        print(f"== {rec.get('Kernel Name', '?')[:150]}")
        for name in FIGURES:
            if name in rec:
                print(f"  {name:75} {rec[name]}")
        stalls = {k: number(v) for k, v in rec.items()
                  if k.startswith("smsp__pcsamp_warps_issue_stalled_") and not k.endswith("_not_issued")}
        total = sum(stalls.values()) or 1.0
        print("  stall reasons (share of PC samples):")
        for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:12]:
            print(f"    {k.removeprefix('smsp__pcsamp_warps_issue_stalled_'):28} {100 * v / total:5.1f}%")


def hot_sass(report: str, top: int) -> None:
    rows = ncu_csv(report, "--page", "source", "--print-source", "sass")
    header_at = next((i for i, r in enumerate(rows) if any("Source" == c for c in r)), None)
    if header_at is None:
        print("  (no source page)")
        return
    head = rows[header_at]
    samples = next((c for c in head if c.startswith("Warp Stall Sampling (All")), None)
    if samples is None:
        print("  source columns:", head)
        return
    reason_cols = [c for c in head if c.startswith("stall_") or c.endswith("(All Samples)") and c != samples]
    body = [dict(zip(head, r)) for r in rows[header_at + 1:] if len(r) == len(head)]
    total = sum(number(r[samples]) for r in body) or 1.0
    by_op = defaultdict(float)
    for r in body:
        op = r.get("Source", "").split()
        if op:
            name = op[1] if op[0].startswith("@") and len(op) > 1 else op[0]
            by_op[name.split(".")[0]] += number(r[samples])
    print("  samples by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%"
                                            for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:14]))
    print(f"  top {top} SASS lines by sampled stalls:")
    for r in sorted(body, key=lambda r: -number(r[samples]))[:top]:
        reasons = sorted(((c, number(r[c])) for c in reason_cols if number(r[c]) > 0), key=lambda kv: -kv[1])[:3]
        why = " ".join(f"{c.replace('stall_', '')}:{v:.0f}" for c, v in reasons)
        print(f"    {100 * number(r[samples]) / total:5.2f}%  {r.get('# Address', r.get('Address', ''))[:8]:8} "
              f"{r.get('Source', '')[:70]:70} {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    for report in args.reports:
        print(f"#### {report}")
        for step in (raw_figures, lambda r: hot_sass(r, args.top)):
            try:
                step(report)
            except subprocess.CalledProcessError as exc:
                print("  ncu failed:", exc.stderr[-400:])


if __name__ == "__main__":
    main()
