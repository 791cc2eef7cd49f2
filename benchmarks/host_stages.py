"""Where a forward call's host time goes (needs a GPU; PyTorch for the peers): the stages of
``cuflash.attention_forward`` on the Hopper path replayed with timestamps, back to back ("hot") and
each after a synchronisation ("cold", as bench.py times a call alone); then cupyx's ``cpu_times`` of
cuflash and the PyTorch backends. bf16, L = 1024, head dim 128, B x L = 16384, H x D = 2048. The replay
mirrors api.py / _launch.py as of the eighth session: keep it in step when they change.

    PYTHONPATH=. python benchmarks/host_stages.py"""
import sys
from pathlib import Path
import time

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import cuflash  # noqa: E402
from cuflash import _checks, _launch, _masking, _params, _tma  # noqa: E402
from cuflash._variants import forward_choice, head_bucket, row_class  # noqa: E402

rng = cp.random.default_rng(0)
L, d = 1024, 128
b, h = 16384 // L, 2048 // d
q, k, v, do = (rng.standard_normal((b, h, L, d), dtype=cp.float32).astype(bench._cp_dtype("bfloat16"))
               for _ in range(4))


def staged():
    t = [time.perf_counter()]
    p = _checks.check_qkv(q, k, v, causal=False, scale=None)
    opts = _masking.check_options(p)
    t.append(time.perf_counter())
    with cp.cuda.Device(p.q.device.id):
        out = cp.empty((p.batch, p.heads_q, p.lq, p.dv), dtype=q.dtype)
        lse = cp.empty((p.batch, p.heads_q, p.lq), dtype=np.float32)
        t.append(time.perf_counter())
        masking = _masking.kernel_masking(p, opts)
        t.append(time.perf_counter())
        dd, dv = q.shape[3], v.shape[3]
        head = head_bucket(max(dd, dv))
        variant, _ = forward_choice("bfloat16", head, False, False, _launch.vec_loads_ok(dd, dv, q, k, v),
                                    row_class(head, k.shape[2], False), _launch._compute_capability(), _launch._smem_limit())
        t.append(time.perf_counter())
        params = _params.fwd_params(q, k, v, out, lse, group=1, scale=p.scale, mask=masking.values)
        t.append(time.perf_counter())
        maps = _tma.fwd_tensor_maps(q, k, v, out, variant.tile.block_m, variant.tile.block_n)
        t.append(time.perf_counter())
        _launch._launch(variant, params, (b, h, 1, L, L), extra_args=(maps,))
        t.append(time.perf_counter())
    return np.diff(t) * 1e6


names = ["checks", "alloc", "masking", "select", "params", "maps", "launch"]
for mode in ("hot", "cold"):
    rows = []
    for i in range(200):
        rows.append(staged())
        if mode == "cold":
            cp.cuda.Device().synchronize()
    med = np.median(np.array(rows[20:]), axis=0)
    print(f"{mode:5s} " + "  ".join(f"{n} {x:5.1f}" for n, x in zip(names, med)) + f"  total {med.sum():.1f} us")

for causal in (False, True):
    cons = bench.contenders(q, k, v, do, causal, False)
    for name in ("cuflash", "torch flash", "torch cudnn"):
        fn = cons[name]
        r = benchmark(fn, n_repeat=50, n_warmup=5)
        print(f"causal={causal!s:5} {name:12s} event-timed gpu {np.median(r.gpu_times[0]) * 1e3:.3f} ms, "
              f"cpu {np.median(r.cpu_times) * 1e6:.1f} us", flush=True)
