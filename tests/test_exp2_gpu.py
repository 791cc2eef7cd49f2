"""fma_exp2 (kernels_cu/common.cuh) on the GPU (marker `gpu`): 2^x on the FMA pipe, which the 16-bit Hopper
forward uses for part of its probabilities beside a score modification's tanh (softmax.cuh): relative error
under 3e-6 for results from 2^-125 to 2^8, 0 below 2^-126 (as MUFU.EX2.FTZ) and at -inf, NaN kept."""
import numpy as np
import pytest

from cuflash._runtime.build import inline_includes

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

_SOURCE = inline_includes('#include "common.cuh"\n' + r'''
extern "C" __global__ void fma_exp2_probe(const float* x, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fma_exp2(x[i]);
}
''')


def _run(x: np.ndarray):
    kernel = cp.RawModule(code=_SOURCE, options=("-std=c++17",)).get_function("fma_exp2_probe")
    xd = cp.asarray(x, dtype=cp.float32)
    y = cp.empty_like(xd)
    kernel(((x.size + 255) // 256,), (256,), (xd, y, np.int32(x.size)))
    return cp.asnumpy(y).astype(np.float64)


def test_relative_error_over_the_probabilities_range():
    x = np.concatenate([np.linspace(-125.0, 8.0, 1 << 20), np.arange(-125, 9, dtype=np.float64) + 0.5,
                        np.arange(-125, 9, dtype=np.float64)]).astype(np.float32)
    rel = np.abs(_run(x) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= 3e-6, (rel.max(), x[rel.argmax()])


def test_masked_and_underflowing_scores_give_zero_and_nan_stays():
    got = _run(np.array([-np.inf, -1e30, -200.0, -127.6, -127.0, -126.6, np.nan, -np.nan], np.float32))
    assert (got[:6] == 0).all(), got
    assert np.isnan(got[6:]).all(), got
