"""Time float32 precision="highest" (3xTF32) candidates side by side: tiles and the operand
split (Tile.split: 1 rounded, the table's; 2 TF32X3_FAST, warp_gemm_tf32.cuh), forward
(fwd_tf32x3) and backward (bwd_dkdv_tf32x3), each checked against float64; on a Hopper GPU also the
forward on TF32 wgmma (fwd_wgmma_tf32x3, FWD_WGMMA_CANDIDATES; rows "wgmma ...").
B x L = 16384 tokens, H x D = 2048, non-causal and causal (top-left).

    PYTHONPATH=. python benchmarks/tune_f32.py [--heads 64,128] [--length 4096] [--logit-scale 1]
        [--skip-bwd] [--no-torch]

The first candidate of each head dim is the variant table's tile (the reference the others'
errors are compared with). Errors are relative Frobenius norms against a float64 computation on
the GPU of batch 0, head 0 (out for the forward; dq, dk, dv for the backward, whose forward is
the table's). A candidate whose error exceeds twice the table's (plus 2^-24), or is not finite, is flagged "ERR".
Each candidate's first (error) call records its launches (cuflash._runtime.launch.launch_kernel): the script
stops at once if the candidate's family did not run with the candidate's tile and split (a tile
that does not fit the GPU falls back silently otherwise). `planned()` is the same check offline
(tests/test_tune_f32.py).
Times: CUDA events (cupyx.profiler.benchmark), median of --repeat calls after warm-up; a
candidate's kernels are compiled on its first call, before timing. With torch importable, SDPA
efficient (PyTorch's float32 kernel) is timed on the same buffers.
Expected run time on an H100 with a cold kernel cache: about 2-3 minutes.
"""
import argparse
import contextlib

import numpy as np

from cuflash._dispatch import model, select
from cuflash._dispatch.model import Tile
from cuflash._dispatch.select import tile_override

H100_SMEM = model.SMEM_LIMITS["sm_90 (H100, H200)"]

# Candidates by head dim, the table's first (None). Registers / spills offline (NVRTC 12.9,
# sm_90 / sm_80) and the SASS arithmetic are in git history (benchmarks/NOTES.md summarises them).
# The table takes the fast split (its first: 64x64/4w s2 at d=64 on sm_90, 128x32/8w s2
# at d=128, 16-byte loads only; the backward's 16x64 tiles with s2); the rounded tiles of the table before it are the baselines.
FWD_CANDIDATES = {
    64: [None,
         Tile(64, 64, 4, 2, "rounded", split=1),         # the table before (42.0 / 39.9 TFLOP/s on the H100)
         Tile(64, 32, 4, 2, "fast split", split=2),      # 176 / 198 regs: the sm80 row
         Tile(128, 64, 8, 2, "fast split", split=2)],    # 254 regs sm_90 (sm_80: 12 bytes spilled)
    128: [None,
          Tile(128, 16, 8, 2, "rounded", split=1),       # the table before (36.7 / 33.5)
          Tile(128, 16, 8, 2, "fast split", split=2),    # the element-load tile (210 / 238 regs)
          Tile(128, 32, 8, 2, "rounded", split=1)],      # 252 regs sm_90 (sm_80: 28 bytes spilled)
}
# The Hopper forward on TF32 wgmma (fwd_wgmma_tf32x3, arch "sm90a"): timed
# after the portable candidates, its errors held to the portable table kernel's (the rule below). The portable
# candidates run with the sm90a row hidden (without_hopper_forward), as the launcher would without it.
# Offline (NVRTC 12.9, sm_90a), 0 spills each.
HOPPER_FWD = "fwd_wgmma_tf32x3"
FWD_WGMMA_CANDIDATES = {
    64: [None,                                           # 128x64/12w, TF32X3_PARTS: two consumer warpgroups
         Tile(128, 64, 12, 2, "rounded parts", split=1),  # both parts by Veltkamp (7 FP32 instructions, not 4)
         Tile(64, 64, 8, 2, "one consumer", split=3)],    # 193 KB: the softmax not overlapped by a second warpgroup
    128: [None,                                          # 64x32/8w, one consumer warpgroup (225 KB)
          Tile(64, 32, 8, 2, "rounded parts", split=1)],
}
BWD_CANDIDATES = {
    64: [None,
         Tile(32, 64, 8, 2, "query groups", split=2)],                # two warps a 16-key strip
    128: [None,
          Tile(32, 64, 8, 2, "query groups, two passes", passes=2, split=2),   # element loads, packed, modifications
          Tile(16, 64, 4, 2, "one warp a strip", passes=2, split=2)],          # the table before
}


def label(tile):
    if tile is None:
        return "table"
    passes = f"/{tile.passes}p" if tile.passes != 1 else ""
    return f"{tile.block_m}x{tile.block_n}/{tile.warps}w{passes} s{tile.split}"


@contextlib.contextmanager
def without_hopper_forward(d):
    """The variant table without its float32 Hopper forward row at head dim ``d``: an H100 then runs the
    portable fwd_tf32x3 (its "sm90" row included), as it would with no such row."""
    key = ("sm90a", HOPPER_FWD, "float32", d)
    saved = model.TABLES["plain"].pop(key, None)
    select.clear_selection_caches()
    try:
        yield
    finally:
        if saved is not None:
            model.TABLES["plain"][key] = saved
        select.clear_selection_caches()


def override(family, d, tile):
    stack = contextlib.ExitStack()
    if family == "fwd_tf32x3":
        stack.enter_context(without_hopper_forward(d))
    if tile is not None:
        arch = "sm90a" if family == HOPPER_FWD else None
        stack.enter_context(tile_override(family, d, tile, dtypes=("float32",), arch=arch))
    return stack


def expected(family, d, tile):
    """The tile a candidate must run with: its own, or the table's first (None) for an H100 (its "sm90"
    row where there is one)."""
    if tile is not None:
        return tile
    if family == HOPPER_FWD:
        return model.Variant(family, "float32", d, arch="sm90a").tiles()[0]
    arch = select._portable_arch(family, "float32", d, False, 90)
    return model.Variant(family, "float32", d, arch=arch).tiles()[0]


def planned(d, causal, family, tile, smem_limit=H100_SMEM):
    """The variants of ``family`` that the selection picks for this script's calls with ``tile`` in
    place of the table's (offline: no GPU needed)."""
    with override(family, d, tile):
        if family.startswith("fwd"):
            vs = [select.forward_variant("float32", d, band=bool(causal), vec=True, cc=90, smem_limit=smem_limit)]
        else:
            vs = select.backward_variants("float32", d, band=bool(causal), vec=True, deterministic=False, cc=90,
                                          smem_limit=smem_limit)
    return [v for v in vs if v.family == family]


@contextlib.contextmanager
def launches():
    """The variants launched inside, in order (proof that a candidate ran)."""
    from unittest import mock

    from cuflash._runtime import launch

    seen, real = [], launch.launch_kernel

    def record(variant, *args, **kwargs):
        seen.append(variant)
        return real(variant, *args, **kwargs)

    with mock.patch.object(launch, "launch_kernel", record):
        yield seen


def check_ran(variants, family, d, tile, what):
    """Stop unless ``family`` ran, every time with the candidate's tile (and so its split)."""
    want = expected(family, d, tile)
    ran = [v for v in variants if v.family == family]
    if not ran or any(v.tile != want for v in ran):
        got = [(v.family, label(v.tile), v.split) for v in variants]
        raise SystemExit(f"{what}: {family} with {label(want)} did not run; launched {got}")


def reference_f64(q, k, v, do, causal):
    """out, dq, dk, dv of batch 0, head 0 in float64 (materialised, on the GPU)."""
    import cupy as cp

    q, k, v, do = (x[0, 0].astype(cp.float64) for x in (q, k, v, do))
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = q @ k.T * scale
    if causal:
        s = cp.where(cp.tri(s.shape[0], s.shape[1], dtype=bool), s, -cp.inf)
    p = cp.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = p @ v
    dp = do @ v.T
    ds = p * (dp - (do * out).sum(axis=1, keepdims=True))
    return out, ds @ k * scale, ds.T @ q * scale, p.T @ do


def rel_err(x, ref):
    import cupy as cp

    x = x[0, 0].astype(cp.float64)
    return float(cp.linalg.norm(x - ref) / cp.linalg.norm(ref))


def median_ms(fn, repeat):
    import cupy as cp
    from cupyx.profiler import benchmark

    fn()
    cp.cuda.Device().synchronize()
    return float(np.median(benchmark(fn, n_repeat=repeat, n_warmup=2).gpu_times[0]) * 1e3)


def sdpa_efficient(q, k, v, do, causal, repeat):
    """(forward ms, backward ms) of PyTorch's float32 SDPA efficient kernel, or None without torch
    (or where it fails: the comparison is not worth the device call)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    try:
        tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_(True) for x in (q, k, v))
        tdo = torch.from_dlpack(do)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            fwd = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            both = lambda: torch.autograd.grad(fwd(), (tq, tk, tv), tdo)
            f_ms, b_ms = median_ms(fwd, repeat), median_ms(both, repeat)
    except Exception as exc:   # noqa: BLE001 -- a CPU-only torch, no efficient kernel, ...
        print(f"SDPA efficient skipped: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None
    return f_ms, b_ms - f_ms


def _hopper():
    """Whether the current GPU takes the sm90a kernels (compute capability 9.0)."""
    from cuflash._runtime import device

    return device.compute_capability() == select.HOPPER_CC


def flagged_errors(errs, table_errs):
    """Whether a candidate's errors fail the rule: not finite, or above twice the table's + 2^-24
    (the table's own row: not finite)."""
    if not all(np.isfinite(e) for e in errs):
        return True
    return any(e > 2 * t + 2.0**-24 for e, t in zip(errs, table_errs or errs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="64,128")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--logit-scale", type=float, default=1.0, help="q and k scaled by its square root")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--skip-bwd", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    import cupy as cp

    import cuflash

    n = args.length
    print(f"{'pass':4} {'D':>4} {'causal':>6} {'config':>18} {'ms':>8} {'TFLOP/s':>8} {'vs SDPA':>7} "
          f"{'err out/dq':>10} {'err dk':>8} {'err dv':>8} {'vs table':>8}", flush=True)
    flagged = []
    for d in (int(x) for x in args.heads.split(",")):
        b, h = 16384 // n, 2048 // d
        rng = cp.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
        q *= np.float32(np.sqrt(args.logit_scale))
        k *= np.float32(np.sqrt(args.logit_scale))
        for causal in (False, True):
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            ref = reference_f64(q, k, v, do, causal)
            peer = None if args.no_torch else sdpa_efficient(q, k, v, do, causal, args.repeat)

            def row(kind, name, ms, errs, table_errs, peer_ms):
                work = flops * (2.5 if kind == "bwd" else 1.0)
                ratio = f"{peer_ms / ms:6.2f}x" if peer_ms else f"{'-':>7}"
                worst = max(e / t for e, t in zip(errs, table_errs)) if table_errs else 1.0
                bad = flagged_errors(errs, table_errs)
                cells = " ".join(f"{e:8.1e}" for e in errs) + " " * 9 * (3 - len(errs))
                print(f"{kind:4} {d:4d} {str(causal):>6} {name:>18} {ms:8.3f} {work / ms / 1e9:8.1f} {ratio} "
                      f"  {cells} {worst:7.2f}x{' ERR' if bad else ''}", flush=True)
                if bad:
                    flagged.append(f"{kind} d={d} causal={causal} {name}: {errs} vs table {table_errs}")

            if peer:
                print(f"{'fwd':4} {d:4d} {str(causal):>6} {'SDPA efficient':>18} {peer[0]:8.3f} "
                      f"{flops / peer[0] / 1e9:8.1f}", flush=True)
                print(f"{'bwd':4} {d:4d} {str(causal):>6} {'SDPA efficient':>18} {peer[1]:8.3f} "
                      f"{2.5 * flops / peer[1] / 1e9:8.1f}", flush=True)
            table_errs = None
            for tile in FWD_CANDIDATES[d]:
                with override("fwd_tf32x3", d, tile):
                    run = lambda: cuflash.attention_forward(q, k, v, causal=causal, precision="highest")
                    with launches() as seen:
                        out, _ = run()
                    check_ran(seen, "fwd_tf32x3", d, tile, f"fwd d={d} causal={causal} {label(tile)}")
                    errs = [rel_err(out, ref[0])]
                    ms = median_ms(run, args.repeat)
                row("fwd", label(tile), ms, errs, table_errs, peer and peer[0])
                table_errs = table_errs or errs
            for tile in FWD_WGMMA_CANDIDATES.get(d, []) if _hopper() else []:
                with override(HOPPER_FWD, d, tile):
                    run = lambda: cuflash.attention_forward(q, k, v, causal=causal, precision="highest")
                    with launches() as seen:
                        out, _ = run()
                    check_ran(seen, HOPPER_FWD, d, tile, f"fwd d={d} causal={causal} wgmma {label(tile)}")
                    errs = [rel_err(out, ref[0])]
                    ms = median_ms(run, args.repeat)
                row("fwd", "wgmma " + label(tile), ms, errs, table_errs, peer and peer[0])
            if args.skip_bwd:
                continue
            out, lse = cuflash.attention_forward(q, k, v, causal=causal, precision="highest")
            table_errs = None
            for tile in BWD_CANDIDATES[d]:
                with override("bwd_dkdv_tf32x3", d, tile):
                    run = lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                             precision="highest")
                    with launches() as seen:
                        grads = run()
                    check_ran(seen, "bwd_dkdv_tf32x3", d, tile, f"bwd d={d} causal={causal} {label(tile)}")
                    errs = [rel_err(g, r) for g, r in zip(grads, ref[1:])]
                    ms = median_ms(run, args.repeat)
                row("bwd", label(tile), ms, errs, table_errs, peer and peer[1])
                table_errs = table_errs or errs
    if flagged:
        raise SystemExit("errors not finite or above twice the table kernel's:\n" + "\n".join(flagged))


if __name__ == "__main__":
    main()
