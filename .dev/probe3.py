import sys
from pathlib import Path
import cupy as cp
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench, bench_decode, read_ceiling
import cuflash
from cuflash._dispatch import plan

ROWS = [("bfloat16", 64, 8, 8, 16, 8192, 128), ("bfloat16", 64, 8, 8, 16, 8192, 64), ("bfloat16", 32, 16, 16, 4, 8192, 128),
        ("bfloat16", 16, 32, 32, 1, 8192, 128), ("bfloat16", 64, 8, 8, 1, 4096, 64),
        ("float32", 64, 32, 8, 1, 4096, 128), ("float64", 64, 32, 8, 1, 4096, 128), ("float32", 64, 32, 8, 1, 8192, 64),
        ("float64", 64, 32, 8, 1, 4096, 64), ("float32", 16, 32, 32, 1, 8192, 128), ("bfloat16", 25, 32, 8, 1, 16384, 64)]
t = lambda fn: min(bench._time_queued(fn, 20, runs=9) * 1000 for _ in range(2))
for dtype, b, hq, hk, lq, lk, d in ROWS:
    rng = cp.random.RandomState(0)
    dt = bench._cp_dtype(dtype)
    q, k, v = (bench_decode._normal(rng, s, dt) for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d)))
    r = {}
    f = lambda: cuflash.attention_forward(q, k, v)
    ref = cuflash.attention_forward(q, k, v, num_splits=2)[0].astype(cp.float64)
    r["auto"] = t(f); r["grid"] = bench_decode._first_grid(f)
    r["err"] = float(cp.abs(f()[0].astype(cp.float64) - ref).max())
    for n in (2, 3, 4):
        r[f"{n}sp"] = t(lambda n=n: cuflash.attention_forward(q, k, v, num_splits=n))
    if hq == hk:
        plan.UNPACKED_ONE_SPLIT_ROWS = 0; plan.clear_plans()
        r["dense"] = t(f); r["dense grid"] = bench_decode._first_grid(f)
        plan.UNPACKED_ONE_SPLIT_ROWS = 16; plan.clear_plans()
    if dtype in ("bfloat16", "float16"):
        tq, tk, tv = (bench_decode.torch.from_dlpack(x) for x in (q, k, v))
        def cudnn():
            with bench_decode.sdpa_kernel(bench_decode.SDPBackend.CUDNN_ATTENTION):
                return bench_decode.F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        try:
            cudnn(); r["cudnn"] = t(cudnn)
        except Exception:
            r["cudnn"] = float("nan")
    r["ceil"] = t(read_ceiling.reader(k, v))
    print((dtype, b, hq, hk, lq, lk, d), {kk: (round(vv, 1) if isinstance(vv, float) and vv > 1e-3 else vv) for kk, vv in r.items()}, flush=True)
    del q, k, v
    cp.get_default_memory_pool().free_all_blocks()
