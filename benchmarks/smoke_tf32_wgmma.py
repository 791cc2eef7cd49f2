"""Smoke test of the float32 Hopper forward on TF32 wgmma (branch tf32-wgmma, kernels_cu/
flash_fwd_wgmma_tf32.cu): a few small forward calls per precision on an H100 / H200, the kernel
families launched, and out / lse errors against the float64 NumPy reference, next to the portable
TF32 kernel's (the same call with the compute capability patched to 8.0). Run it FIRST, under a
timeout (a wrong mbarrier count or parity hangs rather than fails):
    timeout 60 env PYTHONPATH=. python benchmarks/smoke_tf32_wgmma.py
Each line: precision, the case, the families launched, max |out - ref| / max |ref|, the relative
Frobenius error, max |lse - ref|; "PORTABLE" the same for the mma.sync kernel. Expect "highest"
within ~2x the portable 3xTF32 error (~1e-6 relative) and "tf32" around 1e-3. The script
exits 1 (listing why) when, on compute capability 9.0, a call did not launch the precision's
fwd_wgmma_tf32* family, when out is not finite or lse not finite where the reference is (NaN fails:
comparisons are written so that NaN never passes), or when the out / lse error exceeds 4x the portable kernel's (floors 2^-24 for
"highest" out, 2^-11 for "tf32" out, 1e-6 for lse). Each call's line "... running" is printed
before it starts, so a timeout names the call that hung.
"""
import sys

import numpy as np
import cupy as cp

import cuflash
from cuflash import _launch, reference

launched = []
_real_launch = _launch._launch


def _record(variant, *args, **kwargs):
    launched.append(variant.family)
    _real_launch(variant, *args, **kwargs)


_launch._launch = _record
cc = _launch._compute_capability()
print(f"device compute capability {cc // 10}.{cc % 10}", flush=True)
if cc != 90:
    print("not a Hopper GPU: the wgmma kernel is never chosen here", flush=True)

# (name, B, Hq, Hk, Lq, Lk, D, causal, window): the first one tiny (one tile, one CTA's worth of rows)
CASES = [
    ("one tile", 1, 1, 1, 64, 64, 64, False, None),
    ("d=64 two tiles", 1, 2, 2, 128, 128, 64, False, None),
    ("d=64 odd lengths", 2, 2, 2, 200, 333, 64, False, None),
    ("d=64 causal", 1, 2, 2, 300, 300, 64, True, None),
    ("d=64 causal br", 1, 2, 1, 100, 400, 64, "bottom_right", None),   # GQA 2:1 too
    ("d=64 window", 1, 2, 2, 512, 512, 64, False, (100, 0)),
    ("d=48 (bucket 64)", 1, 2, 2, 160, 190, 48, False, None),
    ("d=128", 1, 2, 2, 256, 256, 128, False, None),
    ("d=128 odd causal", 2, 4, 2, 257, 513, 128, True, None),
    ("d=96 (bucket 128)", 1, 2, 2, 130, 250, 96, False, None),
    ("d=64 L=2048", 1, 4, 4, 2048, 2048, 64, False, None),
]


def errors(out, lse, ref_out, ref_lse):
    o = cp.asnumpy(out).astype(np.float64)
    l = cp.asnumpy(lse).astype(np.float64)
    finite = np.isfinite(ref_lse)
    return (np.abs(o - ref_out).max() / max(np.abs(ref_out).max(), 1e-30),
            np.linalg.norm(o - ref_out) / max(np.linalg.norm(ref_out), 1e-30),
            np.abs(l[finite] - ref_lse[finite]).max() if finite.any() else 0.0,
            bool(np.isfinite(o).all()))


def run(case, precision, portable=False):
    name, b, hq, hk, lq, lk, d, causal, window = case
    rng = np.random.default_rng(sum(map(ord, name)))
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    ref_out, ref_lse = reference.attention_naive(*(x.astype(np.float64) for x in (q, k, v)), causal=causal,
                                                 window=window)
    tag = "PORTABLE" if portable else "        "
    print(f"{precision:7s} {tag} {name:18s} running", flush=True)   # a timeout stops after this line
    saved = _launch._compute_capability
    if portable:
        _launch._compute_capability = lambda: 80
    launched.clear()
    try:
        out, lse = cuflash.attention_forward(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal,
                                             window=window, precision=precision)
        cp.cuda.Device().synchronize()
    finally:
        _launch._compute_capability = saved
    mx, fro, lse_err, finite = errors(out, lse, ref_out, ref_lse)
    print(f"{precision:7s} {tag} {name:18s} {str(launched):26s} max {mx:.2e} fro {fro:.2e} lse {lse_err:.2e}"
          f"{'' if finite else '  NOT FINITE'}", flush=True)
    return fro, lse_err, finite, launched[:]


WANT = {"highest": "fwd_wgmma_tf32x3", "tf32": "fwd_wgmma_tf32"}
FLOOR = {"highest": 2.0**-24, "tf32": 2.0**-11}
failures = []
worst = 0.0
for case in CASES:
    for precision in ("highest", "tf32"):
        fro, lse_err, finite, fams = run(case, precision)
        ref_fro, ref_lse_err, _, _ = run(case, precision, portable=True)
        why = []
        if cc == 90 and WANT[precision] not in fams:
            why.append(f"{WANT[precision]} not launched (got {fams}: tensor maps? variant table?)")
        if not finite:
            why.append("out not finite")
        ratio = fro / max(ref_fro, FLOOR[precision])
        if not ratio <= 4:   # NaN fails
            why.append(f"out error {fro:.2e} is {ratio:.2f}x the portable kernel's {ref_fro:.2e}")
        if not lse_err <= 4 * max(ref_lse_err, 1e-6):
            why.append(f"lse error {lse_err:.2e} against the portable kernel's {ref_lse_err:.2e}")
        for w in why:
            print(f"    ^ FAIL: {w}", flush=True)
            failures.append(f"{precision} {case[0]}: {w}")
        if precision == "highest":
            worst = worst if ratio <= worst else ratio
print(f"worst 'highest' relative error / the portable kernel's: {worst:.2f} (expect <= ~2)", flush=True)
if failures:
    print(f"FAILED ({len(failures)}):", *failures, sep="\n  ", flush=True)
sys.exit(1 if failures else 0)
