"""Smoke test of the float32 Hopper forward on TF32 wgmma (kernels_cu/
flash_fwd_wgmma_tf32.cu, with the EXTRA options: bias, boolean mask, dropout,
block layout): a few small forward calls per precision on an H100 / H200, the kernel families
launched, and out / lse errors against the float64 NumPy reference, next to the portable TF32
kernel's (the same call with the compute capability patched to 8.0). Run it FIRST, under a timeout
(a wrong mbarrier count or parity hangs rather than fails):
    timeout 60 env PYTHONPATH=. python benchmarks/smoke_tf32_wgmma.py [--plain | --extra]
(``--plain``: the cases without masking options only, ``--extra``: those with them only; on a cold
kernel cache each half compiles ~16 variants, so the two halves under separate timeouts of 60 s.)
Each line: precision, the case, the families launched, max |out - ref| / max |ref|, the relative
Frobenius error, max |lse - ref|; "PORTABLE" the same for the mma.sync kernel. Expect "highest"
within ~2x the portable 3xTF32 error (~1e-6 relative) and "tf32" around 1e-3. The script
exits 1 (listing why) when, on compute capability 9.0, a call did not launch the precision's
fwd_wgmma_tf32* family (with masking options its EXTRA variant; a bias whose rows are not 16-byte
chunks: the portable kernel, the launcher's fallback), when out is not finite, lse not finite where
the reference is or not -inf where the reference's row sees no key (NaN fails:
comparisons are written so that NaN never passes), or when the out / lse error exceeds 4x the portable kernel's (floors 2^-24 for
"highest" out, 2^-11 for "tf32" out, 1e-6 for lse). Each call's line "... running" is printed
before it starts, so a timeout names the call that hung.
"""
import sys

import numpy as np
import cupy as cp

import cuflash
from cuflash import reference
from cuflash._runtime import device, launch

launched = []        # the families of the current call's kernels
launched_extra = []  # whether each was an EXTRA variant
_real_launch = launch.launch_kernel


def _record(variant, *args, **kwargs):
    launched.append(variant.family)
    launched_extra.append(variant.extra)
    _real_launch(variant, *args, **kwargs)


launch.launch_kernel = _record
cc = device.compute_capability()
print(f"device compute capability {cc // 10}.{cc % 10}", flush=True)
if cc != 90:
    print("not a Hopper GPU: the wgmma kernel is never chosen here", flush=True)

# (name, B, Hq, Hk, Lq, Lk, D, causal, window[, masking options (OPTIONS)]): the first one tiny (one
# tile, one CTA's worth of rows)
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
    # EXTRA (after the plain cases: a hang here is the EXTRA code's). Keys a multiple of 4 unless said:
    # the bias rows are then 16-byte chunks, which the wgmma kernel needs.
    ("d=64 key padding", 2, 2, 2, 200, 332, 64, False, None, "key padding"),
    ("d=128 key padding c", 2, 2, 1, 257, 300, 128, True, None, "key padding"),
    ("d=64 pair bias", 1, 2, 2, 200, 332, 64, False, None, "pair bias"),
    ("d=128 pair bias c", 1, 2, 2, 257, 512, 128, True, None, "pair bias"),
    ("d=64 head bias br", 2, 2, 1, 100, 400, 64, "bottom_right", None, "head bias"),
    ("d=64 bias 333 keys", 1, 2, 2, 200, 333, 64, False, None, "pair bias"),   # -> portable (not chunks)
    ("d=64 empty rows", 1, 2, 2, 200, 332, 64, False, None, "empty rows"),
    ("d=64 dropout", 1, 2, 2, 200, 332, 64, False, None, "dropout"),
    ("d=128 dropout", 1, 2, 2, 130, 250, 128, False, None, "dropout"),
    ("d=64 block layout", 1, 2, 2, 333, 520, 64, False, None, "block layout"),
    ("d=128 block layout", 1, 2, 2, 333, 520, 128, True, None, "block layout"),
    ("d=64 all", 2, 2, 1, 333, 520, 64, True, (300, 40), "all"),
    ("d=64 all L=2048", 1, 4, 4, 2048, 2048, 64, False, None, "all"),
]


def options(kind, b, hq, lq, lk, rng):
    """The masking options of an EXTRA case as NumPy arrays (the reference's; bias float32)."""
    if kind is None:
        return {}
    pad = np.ones((b, 1, 1, lk), dtype=bool)
    pad[0, ..., lk - 37:] = False
    if b > 1:
        pad[1] = False          # batch 1 sees no key: every row of it empty (out 0, lse -inf)
    layout = rng.random((hq, -(-lq // 64), -(-lk // 64))) < 0.5
    layout[0, :2] = False       # head 0: the first 128 query rows see nothing
    bias = {"pair bias": (1, 1, lq, lk), "head bias": (hq, lq, lk), "all": (1, hq, lq, lk)}.get(kind)
    opts = {"key padding": dict(mask=pad),
            "empty rows": dict(mask=np.where(np.arange(lq)[:, None] % 7 == 0, False, rng.random((lq, lk)) < 0.5)),
            "dropout": dict(dropout_p=0.2, seed=1234),
            "block layout": dict(block_layout=cuflash.BlockLayout(layout, 64)),
            "all": dict(mask=pad, dropout_p=0.1, seed=3, block_layout=cuflash.BlockLayout(layout, 64))}.get(kind, {})
    if bias is not None:
        opts["bias"] = (rng.standard_normal(bias) * 2).astype(np.float32)
    return opts


def on_device(opts):
    dev = dict(opts)
    for key in ("bias", "mask"):
        if key in opts:
            dev[key] = cp.asarray(opts[key])
    if "block_layout" in opts:
        dev["block_layout"] = cuflash.BlockLayout(cp.asarray(opts["block_layout"].layout),
                                                  opts["block_layout"].block_size)
    return dev


def errors(out, lse, ref_out, ref_lse):
    o = cp.asnumpy(out).astype(np.float64)
    l = cp.asnumpy(lse).astype(np.float64)
    finite = np.isfinite(ref_lse)
    return (np.abs(o - ref_out).max() / max(np.abs(ref_out).max(), 1e-30),
            np.linalg.norm(o - ref_out) / max(np.linalg.norm(ref_out), 1e-30),
            np.abs(l[finite] - ref_lse[finite]).max() if finite.any() else 0.0,
            bool(np.isfinite(o).all()) and bool((np.isneginf(l) == ~finite).all()))


def run(case, precision, portable=False):
    name, b, hq, hk, lq, lk, d, causal, window = case[:9]
    rng = np.random.default_rng(sum(map(ord, name)))
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    opts = options(case[9] if len(case) > 9 else None, b, hq, lq, lk, rng)
    host = {key: (x.astype(np.float64) if key == "bias" else x) for key, x in opts.items()}
    ref_out, ref_lse = reference.attention_naive(*(x.astype(np.float64) for x in (q, k, v)), causal=causal,
                                                 window=window, **host)
    tag = "PORTABLE" if portable else "        "
    print(f"{precision:7s} {tag} {name:18s} running", flush=True)   # a timeout stops after this line
    saved = device.compute_capability
    if portable:
        device.compute_capability = lambda: 80
    launched.clear()
    launched_extra.clear()
    try:
        out, lse = cuflash.attention_forward(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal,
                                             window=window, precision=precision, **on_device(opts))
        cp.cuda.Device().synchronize()
    finally:
        device.compute_capability = saved
    mx, fro, lse_err, finite = errors(out, lse, ref_out, ref_lse)
    print(f"{precision:7s} {tag} {name:18s} {str(launched):26s} max {mx:.2e} fro {fro:.2e} lse {lse_err:.2e}"
          f"{'' if finite else '  NOT FINITE (or lse not -inf where no key is seen)'}", flush=True)
    return fro, lse_err, finite, launched[:], bool(opts) and all(launched_extra)


if "--plain" in sys.argv[1:]:
    CASES = [c for c in CASES if len(c) == 9]
elif "--extra" in sys.argv[1:]:
    CASES = [c for c in CASES if len(c) > 9]

# "tf32" keeps the portable kernel on Hopper (cuflash._dispatch.select.TF32_WGMMA_FAMILY): its lines check that routing.
WANT = {"highest": "fwd_wgmma_tf32x3", "tf32": "fwd_tf32"}
PORTABLE = {"highest": "fwd_tf32x3", "tf32": "fwd_tf32"}
FLOOR = {"highest": 2.0**-24, "tf32": 2.0**-11}
failures = []
worst = 0.0
for case in CASES:
    for precision in ("highest", "tf32"):
        fro, lse_err, finite, fams, extra_ok = run(case, precision)
        ref_fro, ref_lse_err, _, _, _ = run(case, precision, portable=True)
        why = []
        want = WANT[precision]
        if "333 keys" in case[0]:   # a bias whose rows are not 16-byte chunks: the launcher's fallback
            want = PORTABLE[precision]
        if cc == 90 and want not in fams:
            why.append(f"{want} not launched (got {fams}: tensor maps? variant table?)")
        if cc == 90 and len(case) > 9 and not extra_ok:
            why.append("the EXTRA variant was not launched")
        if not finite:
            why.append("out not finite, or lse not -inf exactly where the reference row sees no key")
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
