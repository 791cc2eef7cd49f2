"""Time forward tile configs of the tensor-core kernels side by side (fills the variant
table's "why" column). B x L = 16384 tokens, H x D = 2048, L = 1024 and 4096.
fp16 and bf16 (fwd_mma, the portable kernel: on a Hopper GPU the script takes the portable path,
as bench.py's "cuflash sm80"): a config with BM > 16 * warps gives each warp BM / (16 * warps)
row strips. float64 (fwd_dmma, --dtype float64): each warp owns BM / (8 * warps) 8-row
tiles; the first row of each head dim is the FMA kernel that fwd_dmma replaced, at its
last table tile (the baseline). A float64 config (BM, BN, warps, K) with K = 4, 8 or 16
runs the GEMMs on mma.m16n8kK over pairs of 8-row tiles (Variant.wide_k; sm_90 only:
skipped elsewhere). float64 rows also give the error against a long-double reference
on the first --check-rows query rows of batch 0, head 0 (relative Frobenius norm); a row
above TOLERANCE_F64 (or with a non-finite output) is marked FAILED, and the script exits
with status 1 after the last row.

    PYTHONPATH=. python benchmarks/tune_fwd.py [--heads 64,128] [--dtype float64] [--lengths 1024,4096]
        [--wide-only] [--peer]
"""
import argparse
import contextlib
from dataclasses import replace

import ml_dtypes
import numpy as np

import cupy as cp
from cupyx.profiler import benchmark

import cuflash
from cuflash import reference
from cuflash._dispatch import plan
from cuflash._dispatch.model import Tile, Variant
from cuflash._dispatch.select import tile_override
from cuflash._runtime import device

# (block_m, block_n, warps[, "park"]); the first is the reference the others are checked against. "park":
# the kernel's PARK (Tile.park: block coordinates and loop bounds in shared memory, flash_fwd_mma.cu).
CANDIDATES = {
    32: [(64, 64, 4), (128, 64, 4), (128, 128, 4), (64, 64, 2)],
    64: [(64, 64, 4), (128, 64, 4), (64, 64, 2), (128, 32, 4), (128, 128, 4)],
    # (128, 64, 4, "park"): FA2's tile, the table's (without PARK it spills 8-56
    # bytes). Measured and not taken: 48-key tiles (0.97-1.06x 128x32, spilling 32-48 bytes in the sm_90
    # 16-byte-load variants) and a third K/V stage with one barrier a tile (0.96-1.01x at 128x32; 0.80-0.93x
    # at 128x64, one CTA an SM).
    128: [(128, 64, 4, "park"), (128, 32, 4), (128, 64, 4), (128, 32, 4, "park")],
}
# float64: "fma" is the FMA baseline; every config compiles with 0 spills (plain kernel).
# (BM, BN, warps, K): the m16n8kK candidates (benchmarks/NOTES.md), plain
# kernel registers on sm_90 from the offline compile: d=64 64x32/4w K=16 176, K=4 152 (m8n8k4
# 168); d=128 64x32/4w K=16 240, K=4 254 (m8n8k4 236); 128x16/8w: two warps a scheduler at d=128.
# NVRTC 12.9, sm_90, plain / band: d=64 128x32/8w K=8 166 / 186, 64x32/4w K=8 166 / 186, 128x64/8w K=8 222 / 228;
# d=128 128x16/8w K=8 232 / 238.
CANDIDATES_F64 = {
    32: ["fma", (128, 32, 4), (64, 32, 4), (64, 64, 4), (128, 16, 4)],
    64: ["fma", (64, 32, 4), (64, 16, 4), (64, 64, 4), (128, 32, 4), (32, 32, 2),
         (64, 32, 4, 16), (64, 32, 4, 4), (128, 32, 8, 16), (128, 32, 8, 8), (64, 32, 4, 8), (128, 64, 8, 8)],
    128: ["fma", (64, 32, 4), (64, 16, 4), (64, 24, 4), (32, 16, 2),
          (64, 32, 4, 16), (64, 32, 4, 4), (128, 16, 8, 16), (128, 16, 8), (128, 16, 8, 8)],
    256: ["fma", (32, 16, 4), (32, 8, 4), (16, 16, 2), (16, 8, 2)],
}
TOLERANCE_F64 = 1e-12   # float64 rows: relative error against long double (fp64 kernels reach ~1e-15)
# The float64 FMA forward's tiles before fwd_dmma (flash_fwd_fma.cu: 256 threads).
FMA_F64 = {32: Tile(64, 64, 8, 1, "baseline"), 64: Tile(64, 64, 8, 1, "baseline"),
           128: Tile(32, 32, 8, 1, "baseline", ctas=2), 256: Tile(32, 32, 8, 1, "baseline")}


@contextlib.contextmanager
def forced_forward(family, tile, wide_k=0):
    """Every forward through ``family`` at ``tile`` (and ``wide_k``), whatever the table says
    (plan.plan_forward asks forward_choice for its variant and the portable fallback)."""
    real = plan.forward_choice

    def pick(dtype, head, band, extra, vec, rows, cc, smem_limit, precision="highest"):
        v = Variant(family, dtype, head, band=band, extra=extra, vec=vec and family != "fwd_fma",
                    tile=replace(tile, wide_k=wide_k))
        return v, v

    plan.forward_choice = pick
    try:
        yield
    finally:
        plan.forward_choice = real


def fma_forward(d):
    """Forwards of head bucket d through the FMA kernel (the float64 baseline)."""
    return forced_forward("fwd_fma", FMA_F64[d])


def config(d, cand, float64):
    """(label, context manager) of one candidate."""
    if cand == "fma":
        return "FMA", fma_forward(d)
    if float64 and len(cand) == 4:   # float64 on mma.m16n8kK
        bm, bn, warps, wide_k = cand
        return f"{bm}x{bn}/{warps}w/k{wide_k}", forced_forward("fwd_dmma", Tile(bm, bn, warps, 2, "tuning"), wide_k)
    bm, bn, warps = cand[:3]
    park = "park" in cand[3:]
    family = "fwd_dmma" if float64 else "fwd_mma"
    dtypes = ["float64"] if float64 else ["float16", "bfloat16"]
    label = f"{bm}x{bn}/{warps}w" + ("/park" if park else "")
    return label, tile_override(family, d, Tile(bm, bn, warps, 2, "tuning", park=park), dtypes=dtypes)


def flash_peer(q, k, v, causal):
    """A callable running PyTorch SDPA's flash backend (FA2) on the same buffers, or None without torch."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    return run


def long_double_exact(q, k, v, causal, rows):
    """out[0, 0, :rows] by attention_naive in long double (top-left causal: the first rows see the same keys
    as in the whole problem)."""
    qs, ks, vs = (cp.asnumpy(x[0, 0]) for x in (q[:, :, :rows], k, v))
    return reference.attention_naive(qs, ks, vs, causal=causal, dtype="longdouble")[0]


def long_double_error(exact, out, rows):
    """Relative Frobenius error of out[0, 0, :rows] against ``exact``."""
    got = cp.asnumpy(out[0, 0, :rows]).astype(np.longdouble)
    return float(np.linalg.norm((got - exact).ravel()) / np.linalg.norm(exact.ravel()))


def f64_failure(err: float, finite: bool) -> str:
    """Why a float64 row fails its long-double check ("" if it passes; NaN fails)."""
    if not finite:
        return "non-finite output"
    return "" if err <= TOLERANCE_F64 else f"rel err {err:.1e} > {TOLERANCE_F64:.0e}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default=None, help="head dims (default 32,64,128; 32,64,128,256 for float64)")
    parser.add_argument("--dtype", choices=("half", "float64"), default="half",
                        help="half: float16 and bfloat16 (fwd_mma); float64: fwd_dmma against the FMA baseline")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--peer", action="store_true",
                        help="half: also time PyTorch SDPA's flash backend (FA2) on the same buffers")
    parser.add_argument("--check-rows", type=int, default=128, help="float64: query rows checked in long double")
    parser.add_argument("--wide-only", action="store_true",
                        help="float64: only the table's tile and the m16n8kK candidates (with the m8n8k4 tiles they "
                             "are compared with)")
    args = parser.parse_args()
    float64 = args.dtype == "float64"
    sm90 = int(cp.cuda.Device().compute_capability) >= 90
    if sm90 and not float64:
        # The candidates are tiles of the portable fwd_mma kernel: without this a Hopper GPU would run
        # its wgmma forward for every row (bench.py's "cuflash sm80" contender does the same).
        device.compute_capability = lambda: 80
    heads = args.heads or ("32,64,128,256" if float64 else "32,64,128")
    dtypes = (np.float64,) if float64 else (np.float16, ml_dtypes.bfloat16)
    print(f"{'dtype':5} {'D':>4} {'L':>5} {'config':>14} {'causal':>6} {'ms':>8} {'TFLOP/s':>8} {'max|diff|':>9}"
          + (f" {'rel err':>8}" if float64 else ""))
    failed = []
    for d in (int(x) for x in heads.split(",")):
        for dtype in dtypes:
            for n in (int(x) for x in args.lengths.split(",")):
                b, h = 16384 // n, 2048 // d
                rng = cp.random.default_rng(0)
                q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(dtype) for _ in range(3))
                refs, exacts = {}, {}
                for causal in ((False, True) if args.peer and not float64 else ()):
                    run = flash_peer(q, k, v, causal)
                    if run is None:
                        break
                    t = benchmark(run, n_repeat=30, n_warmup=5)
                    ms = float(np.median(t.gpu_times[0]) * 1e3)
                    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                    print(f"{np.dtype(dtype).name[:5]:5} {d:4d} {n:5d} {'FA2 (SDPA)':>14} {str(causal):>6} "
                          f"{ms:8.3f} {flops / ms / 1e9:8.1f}", flush=True)
                for cand in (CANDIDATES_F64 if float64 else CANDIDATES)[d]:
                    if float64 and cand != "fma" and len(cand) == 4 and not sm90:
                        continue
                    if float64 and args.wide_only and (cand == "fma" or (len(cand) == 3 and cand[:2] not in
                                                                         ((64, 32), (128, 16)))):
                        continue
                    label, ctx = config(d, cand, float64)
                    with ctx:
                        for causal in (False, True):
                            out = cuflash.attention(q, k, v, causal=causal).astype(cp.float64)
                            ref = refs.setdefault(causal, out)
                            diff = float(cp.abs(out - ref).max())
                            t = benchmark(lambda: cuflash.attention(q, k, v, causal=causal), n_repeat=30, n_warmup=5)
                            ms = float(np.median(t.gpu_times[0]) * 1e3)
                            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                            err, why = "", ""
                            if float64:
                                if causal not in exacts:
                                    exacts[causal] = long_double_exact(q, k, v, causal, args.check_rows)
                                rel = long_double_error(exacts[causal], out, args.check_rows)
                                why = f64_failure(rel, bool(cp.isfinite(out).all()))
                                err = f" {rel:8.1e}" + (" FAILED" if why else "")
                                if why:
                                    failed.append(f"D={d} L={n} {label} causal={causal}: {why}")
                            print(f"{np.dtype(dtype).name[:5]:5} {d:4d} {n:5d} {label:>14} {str(causal):>6} "
                                  f"{ms:8.3f} {flops / ms / 1e9:8.1f} {diff:9.2e}{err}", flush=True)
    if failed:
        raise SystemExit("float64 outputs off (timings of these rows mean nothing):\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
