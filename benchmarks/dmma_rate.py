"""Throughput of the fp64 tensor-core MMA shapes on the current GPU: mma.sync m8n8k4 (sm_80+)
and m16n8k4, m16n8k8, m16n8k16 (sm_90+), each warp issuing CHAINS independent MMAs in a loop
(registers only: no memory traffic), at full occupancy and at one warp per scheduler (the
occupancy of the float64 forward at head dim 128, one 4-warp CTA an SM).

    PYTHONPATH=. python benchmarks/dmma_rate.py [--tf32]

Why: the kernel notes measured m8n8k4 at half of m16n8k16's 66.7 TFLOP/s on an H100;
warp_gemm_f64.cuh's WIDE_K variants issue m16n8kK over pairs of 8-row tiles, and which K
reaches the full rate decides which one the variant table should take. ``--tf32``: mma.sync m16n8k8 on
TF32 operands with float32 accumulators instead (the float32 kernels' MMA; 3xTF32 issues three a product), at
32, 16 and 4 warps an SM: the ceiling of the float32 tensor-core kernels.
"""
import argparse

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


TF32_SOURCE = f"""
extern "C" __global__ void rate(float* out, const float* in, int iters) {{
    unsigned a[4], b[2];
    float c[{CHAINS}][4];
    for (int i = 0; i < 4; ++i) a[i] = __float_as_uint(in[(threadIdx.x + i) % 64]);
    for (int i = 0; i < 2; ++i) b[i] = __float_as_uint(in[(threadIdx.x + 7 * i) % 64]);
    for (int j = 0; j < {CHAINS}; ++j)
        for (int i = 0; i < 4; ++i) c[j][i] = 0.0f;
    for (int it = 0; it < iters; ++it) {{
#pragma unroll
        for (int j = 0; j < {CHAINS}; ++j)
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {{%0, %1, %2, %3}}, "
                         "{{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
                         : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }}
    float s = 0.0f;
    for (int j = 0; j < {CHAINS}; ++j)
        for (int i = 0; i < 4; ++i) s += c[j][i];
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tf32", action="store_true", help="TF32 m16n8k8 with float32 accumulators")
    args = parser.parse_args(argv)
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    sm90 = int(dev.compute_capability) >= 90
    # "warps/SM": resident warps (the occupancy API; registers may keep it under the 32 asked for: the
    # m16n8kK kernels take ~95-160 registers); the best of REPEATS launches (clocks ramping up).
    print(f"{'shape':>9} {'warps/SM':>8} {'regs':>5} {'TFLOP/s':>8}")
    dtype = cp.float32 if args.tf32 else cp.float64
    inp = cp.random.default_rng(0).standard_normal(64).astype(dtype) * 1e-3
    shapes = ("m16n8k8",) if args.tf32 else tuple(SHAPES)
    for shape in shapes:
        if shape != "m8n8k4" and not sm90 and not args.tf32:
            continue
        kernel = cp.RawModule(code=TF32_SOURCE if args.tf32 else source(shape)).get_function("rate")
        # 32 warps an SM (asked); with --tf32 also 16 and 4; 1 warp a scheduler
        for blocks_per_sm, threads in ((8, 128), (4, 128), (1, 128)) if args.tf32 else ((8, 128), (1, 128)):
            grid = sms * blocks_per_sm
            out = cp.empty(grid * threads, dtype=dtype)
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
