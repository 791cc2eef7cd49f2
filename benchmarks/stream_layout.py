"""How fast 384 CTAs stream a decoding call's K and V through shared memory, by the layout of the
rows they copy into: what a split-KV decoding kernel's copies can reach on the current GPU.

    PYTHONPATH=. python benchmarks/stream_layout.py

Each CTA (128 threads) streams its slice of K and of V (B=8 x Hk=8 heads x 32768 keys x 256-byte rows,
bf16 at head dim 128: 1.07 GB a call) in 64-row tiles with 16-byte cp.async copies, two or three
stages, and reads a word of each tile once it lands; no arithmetic. Thread t copies chunk t % 16 of
rows t / 16 + 8 k (load_tile_fixed_col's layout). The rows land in shared memory unpadded (256
bytes, as tile_io.cuh's swizzled rows) or padded by 16 bytes (272, the portable kernels' pitch for
conflict-free ldmatrix). Time: the best of 5 runs of 20 queued calls (CUDA events); % of the HBM
peak (H200 4.8 TB/s, H100 SXM 3.35 TB/s). The L2 side under ncu:

    ncu --metrics lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,\
        dram__throughput.avg.pct_of_peak_sustained_elapsed -k regex:padded python benchmarks/stream_layout.py
"""
import cupy as cp
import numpy as np

SOURCE = r'''
__device__ __forceinline__ void cp16(char* dst, const char* src) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(addr), "l"(src));
}
// CTA c streams rows [c * rows, (c + 1) * rows) of k and v, 64 rows a tile, STAGES tiles in flight.
template <int PITCH, int STAGES>
__device__ void stream(const char* k, const char* v, int rows, unsigned* sink) {
    constexpr int BN = 64, TILE = BN * 256, STAGE = BN * PITCH;
    extern __shared__ __align__(16) char smem[];
    const char* k_rows = k + (long long)blockIdx.x * rows * 256;
    const char* v_rows = v + (long long)blockIdx.x * rows * 256;
    const int tiles = rows / BN;
    auto issue = [&](int t) {
        if (t < tiles) {
            char* stage = smem + (t % STAGES) * 2 * STAGE;
            for (int c = threadIdx.x; c < TILE / 16; c += 128) {
                const int at = (c / 16) * PITCH + (c % 16) * 16;
                cp16(stage + at, k_rows + (long long)t * TILE + c * 16);
                cp16(stage + STAGE + at, v_rows + (long long)t * TILE + c * 16);
            }
        }
        asm volatile("cp.async.commit_group;");
    };
    for (int t = 0; t < STAGES - 1; ++t) issue(t);
    unsigned seen = 0;
    for (int t = 0; t < tiles; ++t) {
        issue(t + STAGES - 1);
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
        __syncthreads();
        const char* stage = smem + (t % STAGES) * 2 * STAGE;
        seen ^= *(const unsigned*)(stage + threadIdx.x * 16) ^ *(const unsigned*)(stage + STAGE + threadIdx.x * 64);
        __syncthreads();
    }
    if (seen == 0x12345678u) sink[0] = seen;   // keeps the reads
}
extern "C" __global__ void __launch_bounds__(128) unpadded_2(const char* k, const char* v, int r, unsigned* s) { stream<256, 2>(k, v, r, s); }
extern "C" __global__ void __launch_bounds__(128) padded_2(const char* k, const char* v, int r, unsigned* s) { stream<272, 2>(k, v, r, s); }
extern "C" __global__ void __launch_bounds__(128) unpadded_3(const char* k, const char* v, int r, unsigned* s) { stream<256, 3>(k, v, r, s); }
extern "C" __global__ void __launch_bounds__(128) padded_3(const char* k, const char* v, int r, unsigned* s) { stream<272, 3>(k, v, r, s); }
'''
KERNELS = {"unpadded_2": (256, 2), "padded_2": (272, 2), "unpadded_3": (256, 3), "padded_3": (272, 3)}
HBM_PEAK = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12}
ROWS, CTAS = 8 * 8 * 32768, 384


def main() -> None:
    module = cp.RawModule(code=SOURCE)
    k, v = (cp.ones(ROWS * 128, cp.float16) for _ in range(2))
    sink = cp.zeros(1, cp.uint32)
    rows = ROWS // CTAS // 64 * 64
    nbytes = 2 * CTAS * rows * 256
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    peak = next((bw for key, bw in HBM_PEAK.items() if key in name), None)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    print(f"{name}: {CTAS} CTAs x 128 threads, {nbytes / 1e9:.2f} GB of K and V a call")
    print(f"{'rows':10s} {'stages':>6s} {'us':>8s} {'TB/s':>6s} {'% peak':>7s}")
    for kernel, (pitch, stages) in KERNELS.items():
        fn = module.get_function(kernel)
        smem = stages * 2 * 64 * pitch
        fn.max_dynamic_shared_size_bytes = smem
        call = lambda: fn((CTAS,), (128,), (k, v, np.int32(rows), sink), shared_mem=smem)
        call()
        best = float("inf")
        for _ in range(5):
            start.record()
            for _ in range(20):
                call()
            stop.record()
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) / 20 * 1e-3)
        rate = nbytes / best
        share = f"{100 * rate / peak:6.1f}%" if peak else "     -"
        print(f"{'unpadded' if pitch == 256 else 'padded 16':10s} {stages:6d} {best * 1e6:8.1f} {rate / 1e12:6.2f} {share}")


if __name__ == "__main__":
    main()
