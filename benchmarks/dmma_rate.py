"""Throughput of the fp64 tensor-core MMA shapes on the current GPU: mma.sync m8n8k4 (sm_80+)
and m16n8k4, m16n8k8, m16n8k16 (sm_90+), each warp issuing CHAINS independent MMAs in a loop
(registers only: no memory traffic), at full occupancy and at one warp per scheduler (the
occupancy of the float64 forward at head dim 128, one 4-warp CTA an SM).

    PYTHONPATH=. python benchmarks/dmma_rate.py

Why: the kernel notes measured m8n8k4 at half of m16n8k16's 66.7 TFLOP/s on an H100;
warp_gemm_f64.cuh's WIDE_K variants issue m16n8kK over pairs of 8-row tiles, and which K
reaches the full rate decides which one the variant table should take.
"""
import cupy as cp

CHAINS = 8       # independent accumulators a warp (hides the MMA latency)
ITERS = 4096
REPEATS = 5     # timed launches a row (the best counts)

# K: (PTX shape, A registers, B registers): A and B fragments as mma.cuh documents them.
SHAPES = {"m8n8k4": (1, 1), "m16n8k4": (2, 1), "m16n8k8": (4, 2), "m16n8k16": (8, 4)}


def source(shape: str) -> str:
    """One kernel: CHAINS accumulators (2 or 4 doubles each) updated ITERS times by `shape`."""
    na, nb = SHAPES[shape]
    nc = 2 if shape == "m8n8k4" else 4
    c_ops = ", ".join(f"%{i}" for i in range(nc))
    a_ops = ", ".join(f"%{nc + i}" for i in range(na))
    b_ops = ", ".join(f"%{nc + na + i}" for i in range(nb))
    asm = (f'"mma.sync.aligned.{shape}.row.col.f64.f64.f64.f64 {{{c_ops}}}, {{{a_ops}}}, {{{b_ops}}}, {{{c_ops}}};"'
           f' : {", ".join(f"{chr(34)}+d{chr(34)}(c[j][{i}])" for i in range(nc))}'
           f' : {", ".join(f"{chr(34)}d{chr(34)}(a[{i}])" for i in range(na))},'
           f' {", ".join(f"{chr(34)}d{chr(34)}(b[{i}])" for i in range(nb))}')
    return f"""
extern "C" __global__ void rate(double* out, const double* in, int iters) {{
    double a[{na}], b[{nb}], c[{CHAINS}][{nc}];
    for (int i = 0; i < {na}; ++i) a[i] = in[(threadIdx.x + i) % 64];
    for (int i = 0; i < {nb}; ++i) b[i] = in[(threadIdx.x + 7 * i) % 64];
    for (int j = 0; j < {CHAINS}; ++j)
        for (int i = 0; i < {nc}; ++i) c[j][i] = 0.0;
    for (int it = 0; it < iters; ++it) {{
#pragma unroll
        for (int j = 0; j < {CHAINS}; ++j) asm volatile({asm});
    }}
    double s = 0.0;
    for (int j = 0; j < {CHAINS}; ++j)
        for (int i = 0; i < {nc}; ++i) s += c[j][i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}
"""


def flops_per_mma(shape: str) -> int:
    m, n, k = (int(x) for x in shape[1:].replace("n", " ").replace("k", " ").split())
    return 2 * m * n * k


def resident_warps(kernel, threads: int, blocks_wanted: int):
    """Warps of this kernel resident on one SM when each SM gets ``blocks_wanted`` blocks (None where the
    occupancy query fails: the label is a diagnostic, not worth losing the run for)."""
    try:
        from cupy_backends.cuda.api import driver
        fits = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, threads, 0)
    except Exception:   # noqa: BLE001
        return None
    return min(fits, blocks_wanted) * threads // 32


def main():
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    sm90 = int(dev.compute_capability) >= 90
    # "warps/SM": resident warps (the occupancy API; registers may keep it under the 32 asked for: the
    # m16n8kK kernels take ~95-160 registers); the best of REPEATS launches (clocks ramping up).
    print(f"{'shape':>9} {'warps/SM':>8} {'regs':>5} {'TFLOP/s':>8}")
    inp = cp.random.default_rng(0).standard_normal(64) * 1e-3
    for shape in SHAPES:
        if shape != "m8n8k4" and not sm90:
            continue
        kernel = cp.RawModule(code=source(shape)).get_function("rate")
        for blocks_per_sm, threads in ((8, 128), (1, 128)):   # 32 warps an SM (asked); 1 warp a scheduler
            grid = sms * blocks_per_sm
            out = cp.empty(grid * threads)
            kernel((grid,), (threads,), (out, inp, cp.int32(16)))   # warm-up and compile
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            seconds = float("inf")
            for _ in range(REPEATS):
                start.record()
                kernel((grid,), (threads,), (out, inp, cp.int32(ITERS)))
                stop.record()
                stop.synchronize()
                seconds = min(seconds, cp.cuda.get_elapsed_time(start, stop) / 1e3)
            total = grid * threads // 32 * ITERS * CHAINS * flops_per_mma(shape)
            warps = resident_warps(kernel, threads, blocks_per_sm)
            print(f"{shape:>9} {'?' if warps is None else warps:>8} {kernel.num_regs:5d} "
                  f"{total / seconds / 1e12:8.1f}", flush=True)


if __name__ == "__main__":
    main()
