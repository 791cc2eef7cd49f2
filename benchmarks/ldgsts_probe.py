"""Does a padded shared-memory pitch change the L2 requests of 16-byte cp.async copies of contiguous rows? 64 rows x
256 bytes a CTA (head dim 128, 16-bit), 128 threads, 16 threads a row as tile_io.cuh's load_tile_fixed_col; pitch
256 (unpadded) or 272 (HEAD + 8 elements, cuflash's), with and without the src-size operand. Run under ncu:

    ncu --metrics lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,\
        smsp__inst_executed_op_ldgsts.sum -k regex:pitch python benchmarks/ldgsts_probe.py

It tests why the portable forward's copies make 2.6x FA2's L2 read requests (benchmarks/NOTES.md, open
leads); not yet run on a GPU."""
import cupy as cp
src = r'''
template <int PITCH, bool SRC_SIZE>
__device__ void copy_rows(const char* src, int iters) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int t = threadIdx.x, chunk = t % 16, row0 = t / 16;
    const char* base = src + (size_t)blockIdx.x * 64 * 256;
    for (int it = 0; it < iters; ++it) {
        for (int k = 0; k < 8; ++k) {
            const int row = row0 + 8 * k;
            unsigned dst = (unsigned)__cvta_generic_to_shared(smem + row * PITCH + chunk * 16);
            const char* s = base + row * 256 + chunk * 16;
            if (SRC_SIZE) asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(s), "r"(16));
            else asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(s));
        }
        asm volatile("cp.async.commit_group;\n cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
    }
}
extern "C" __global__ void pitch256(const char* s, int n) { copy_rows<256, true>(s, n); }
extern "C" __global__ void pitch272(const char* s, int n) { copy_rows<272, true>(s, n); }
extern "C" __global__ void pitch272_nosize(const char* s, int n) { copy_rows<272, false>(s, n); }
extern "C" __global__ void pitch256_nosize(const char* s, int n) { copy_rows<256, false>(s, n); }
'''
mod = cp.RawModule(code=src, options=("-std=c++17",))
buf = cp.zeros(1024 * 64 * 256, dtype=cp.uint8)
for name in ("pitch256", "pitch272", "pitch272_nosize", "pitch256_nosize"):
    k = mod.get_function(name)
    k((1024,), (128,), (buf, cp.int32(8)), shared_mem=64 * 272)
cp.cuda.Device().synchronize()
print("done")
