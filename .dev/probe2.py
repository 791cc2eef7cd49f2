"""Auto split counts after the one-split rule, against cuDNN and the read ceiling; pack-1 rows on the one-split decoding kernel."""
import sys
from pathlib import Path
import cupy as cp
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench, bench_decode, read_ceiling
import cuflash
from cuflash._dispatch import plan, select

ROWS = [(64, 32, 8, 4096, 64), (64, 32, 8, 4096, 128), (64, 32, 8, 16384, 64), (64, 32, 8, 16384, 128),
        (32, 32, 8, 8192, 128), (16, 32, 8, 16384, 64), (8, 32, 8, 16384, 64), (8, 32, 8, 32768, 128),
        (1, 32, 8, 131072, 128), (132, 32, 8, 4096, 64), (25, 32, 8, 16384, 64), (12, 32, 8, 16384, 128),
        (4, 32, 32, 8192, 128), (16, 32, 32, 8192, 128), (2, 32, 32, 16384, 128), (64, 32, 8, 4096, 64, 4),
        (16, 32, 8, 16384, 128, 4)]
t = lambda fn: min(bench._time_queued(fn, 20, runs=9) * 1000 for _ in range(2))
real = plan._one_split_decodes
out = []
for row in ROWS:
    b, hq, hk, lk, d = row[:5]
    lq = row[5] if len(row) > 5 else 1
    rng = cp.random.RandomState(0)
    dt = bench._cp_dtype("bfloat16")
    q, k, v = (bench_decode._normal(rng, s, dt) for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d)))
    f = lambda: cuflash.attention_forward(q, k, v)
    r = {"auto": t(f), "grid": bench_decode._first_grid(f)}
    r["2sp"] = t(lambda: cuflash.attention_forward(q, k, v, num_splits=2))
    if hk == hq:
        plan._one_split_decodes = lambda p, portable, pack, smem: plan._decodes(p, portable, pack, smem)
        plan.clear_plans()
        g = lambda: cuflash.attention_forward(q, k, v, num_splits=1)
        ref = cuflash.attention_forward(q, k, v, num_splits=2)[0].astype(cp.float32)
        r["1sp-decode"] = t(g)
        r["err"] = float(cp.abs(g()[0].astype(cp.float32) - ref).max())
        r["1sp-grid"] = bench_decode._first_grid(g)
        plan._one_split_decodes = real
        plan.clear_plans()
    tq, tk, tv = (bench_decode.torch.from_dlpack(x) for x in (q, k, v))
    def cudnn():
        with bench_decode.sdpa_kernel(bench_decode.SDPBackend.CUDNN_ATTENTION):
            return bench_decode.F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    try:
        cudnn(); r["cudnn"] = t(cudnn)
    except Exception:
        r["cudnn"] = float("nan")
    def fa2():
        with bench_decode.sdpa_kernel(bench_decode.SDPBackend.FLASH_ATTENTION):
            return bench_decode.F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    try:
        fa2(); r["fa2"] = t(fa2)
    except Exception:
        r["fa2"] = float("nan")
    r["ceil"] = t(read_ceiling.reader(k, v))
    print(row, {kk: (round(vv, 1) if isinstance(vv, float) else vv) for kk, vv in r.items()},
          f"auto/min(peer) {min(r['cudnn'], r['fa2']) / r['auto']:.3f}", flush=True)
    del q, k, v, tq, tk, tv
    cp.get_default_memory_pool().free_all_blocks()
