"""The portable forward ("cuflash sm80") against FA2 (PyTorch SDPA flash) under a sustained load: a queued loop of
~3 s per contender, twice each, nvidia-smi sampling SM clock, power and temperature every 20 ms; prints ms per call
and the loaded samples' mean clock and power (needs a GPU, PyTorch and nvidia-smi). bf16, B x L = 16384, H x D = 2048.

    PYTHONPATH=. python benchmarks/sustained_clocks.py HEAD_DIM L causal|plain

benchmarks/NOTES.md quotes its output (2026-11-26)."""
import subprocess, sys, time, statistics as st
import cupy as cp
sys.path.insert(0, "benchmarks")
import bench

d, n, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "causal"
b, h = max(1, 16384 // n), 2048 // d
rng = cp.random.default_rng(0)
import ml_dtypes
q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(ml_dtypes.bfloat16) for _ in range(4))
fns = bench.contenders(q, k, v, do, causal, with_bwd=False)
for name in ("cuflash sm80", "torch flash", "cuflash sm80", "torch flash"):
    fn = fns[name]
    for _ in range(20): fn()
    cp.cuda.Device().synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                            "-lms", "20"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(); calls = 0; t0 = time.time()
    while time.time() - t0 < 3.0:
        for _ in range(20): fn()
        calls += 20
        cp.cuda.Device().synchronize()
    e1.record(); e1.synchronize()
    ms = cp.cuda.get_elapsed_time(e0, e1) / calls
    smi.terminate(); out = smi.communicate()[0]
    rows = [list(map(float, l.split(","))) for l in out.strip().splitlines() if l.count(",") == 2]
    rows = rows[len(rows) // 5:]   # the loaded part
    print(f"{name:13s} {ms:.4f} ms/call  SM clock {st.mean(r[0] for r in rows):.0f} MHz (min {min(r[0] for r in rows):.0f})  "
          f"power {st.mean(r[1] for r in rows):.0f} W (max {max(r[1] for r in rows):.0f})  temp {max(r[2] for r in rows):.0f} C  ({len(rows)} samples)", flush=True)
