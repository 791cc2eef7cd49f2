// layout_spans.cu -- the spans of a block layout (MaskParams::layout_rows, layout_cols): for each query
// block the first and last key block not BLOCK_OFF, and for each key block the first and last query block.
// The kernels narrow a block's tile range to them (ScoreMod::key_tiles, query_tiles) instead of walking the
// hidden tiles before and after one classify at a time.
//
// A thread a line: lines 0 .. q_blocks - 1 of a (batch, head) are its query blocks (a scan along the key
// blocks), the k_blocks after them its key blocks (a scan along the query blocks). An axis the states
// broadcast (one block for all, e.g. a mask without a key axis) spans every block of the call.
#include "common.cuh"
#include "params.cuh"

__global__ void __launch_bounds__(256) layout_spans(const __grid_constant__ LayoutSpansParams p) {
    const long long line = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int lines = p.q_blocks + p.k_blocks;
    if (line >= (long long)p.pairs * lines) return;
    const int pair = int(line / lines), i = int(line % lines);
    const signed char* states = p.states + (long long)pair * p.q_blocks * p.k_blocks;
    const bool along_keys = i < p.q_blocks;   // a query block's span over the key blocks
    const int n = along_keys ? p.k_blocks : p.q_blocks, full = along_keys ? p.call_k_blocks : p.call_q_blocks;
    const long long at = along_keys ? (long long)i * p.k_blocks : i - p.q_blocks, step = along_keys ? 1 : p.k_blocks;
    int first = full, last = -1;
    for (int j = 0; j < n; ++j) {
        if (states[at + j * step] != BLOCK_OFF) {
            first = imin(first, j);
            last = j;
        }
    }
    if (n == 1 && full > 1 && last == 0) last = full - 1;   // one state for every block of the axis
    int* out = along_keys ? p.rows + 2 * ((long long)pair * p.q_blocks + i)
                          : p.cols + 2 * ((long long)pair * p.k_blocks + (i - p.q_blocks));
    out[0] = first;
    out[1] = last;
}
