"""The host-side params structs (cuflash/_params.py) against kernels_cu/params.cuh (CPU).

NVRTC compiles a translation unit that static_asserts every size and field offset
as NumPy lays them out; a mismatch fails to compile. No GPU is needed.
"""
import numpy as np
import pytest

from cuflash import CompileError, _params
from cuflash._build import compile_source_offline, inline_includes

from _nvrtc import needs_nvrtc


@needs_nvrtc
def test_struct_layouts_match_cuda():
    compile_source_offline(inline_includes(_params.layout_check_source()), "layout.cu", "layout_check", "sm_80")


@needs_nvrtc
def test_layout_check_can_fail():
    """The check is real: shifting one field by 8 bytes is caught."""
    src = _params.layout_check_source()
    offset = _params.STRUCTS["BwdParams"].fields["dims"][1]
    bad = src.replace(f"OFFSET_OF(BwdParams, dims) == {offset}", f"OFFSET_OF(BwdParams, dims) == {offset + 8}")
    assert bad != src
    with pytest.raises(CompileError, match="offset of BwdParams::dims"):
        compile_source_offline(inline_includes(bad), "layout.cu", "layout_check", "sm_80")


class _FakeArray:
    """What view() reads from a CuPy array: shape, strides, itemsize, data.ptr."""

    def __init__(self, shape, strides, itemsize=2, ptr=4096):
        self.shape, self.strides, self.itemsize, self.ndim = shape, strides, itemsize, len(shape)
        self.data = type("Mem", (), {"ptr": ptr})()


def test_view_strides_in_elements_and_broadcast():
    x = _FakeArray((2, 3, 5, 8), (240, 0, 16, 2), itemsize=2, ptr=1 << 40)
    assert _params.view(x) == (1 << 40, 120, 0, 8)
    lse = _FakeArray((2, 3, 5), (60, 20, 4), itemsize=4)
    assert _params.view(lse)[1:] == (15, 5, 1)
    with pytest.raises(ValueError, match="unit-stride"):
        _params.view(_FakeArray((2, 3, 5, 8), (480, 160, 32, 4)))


def test_fwd_params_fields():
    q = _FakeArray((2, 4, 10, 64), (5120, 1280, 128, 2))
    k = _FakeArray((2, 2, 12, 64), (3072, 1536, 128, 2))
    v = _FakeArray((2, 2, 12, 32), (1536, 768, 64, 2))
    out = _FakeArray((2, 4, 10, 32), (2560, 640, 64, 2))
    lse = _FakeArray((2, 4, 10), (160, 40, 4), itemsize=4)
    mask = list(_params.MASK_OFF)
    mask[0:2] = [-11, 2]                      # band_lo, band_hi
    mask[19:22] = [123, 0xDEADBEEF, 7]        # drop_threshold, seed_lo, seed_hi
    packed = _params.fwd_params(q, k, v, out, lse, group=2, scale=0.125, mask=tuple(mask))
    assert packed.nbytes == _params.STRUCTS["FwdParams"].itemsize
    p = np.frombuffer(packed.data, dtype=_params.STRUCTS["FwdParams"])
    assert packed.address == np.frombuffer(packed.data, dtype=np.uint8).ctypes.data   # what the launch passes
    dims = p["dims"][0]
    assert tuple(int(dims[n]) for n in ("batch", "heads_q", "group", "lq", "lk", "d", "dv")) == (2, 4, 2, 10, 12, 64, 32)
    assert int(p["mask"]["band_lo"][0]) == -11 and int(p["mask"]["band_hi"][0]) == 2
    assert int(p["mask"]["drop_threshold"][0]) == 123 and int(p["mask"]["seed_lo"][0]) == 0xDEADBEEF
    assert int(p["mask"]["seed_hi"][0]) == 7 and float(p["mask"]["keep_scale"][0]) == 1.0
    assert float(p["scale_log2"][0]) == pytest.approx(0.125 * np.log2(np.e), rel=1e-15)
    assert p["scale_log2_f"][0] == np.float32(0.125 * np.log2(np.e))
    assert int(p["k"]["head_stride"][0]) == 768


@pytest.mark.parametrize("scale,folds", [(0.125, True), (3e-38, True), (1e-38, True), (5e-39, False), (0.0, False),
                                         (-0.3, False), (1e300, True)])
def test_scale_folds(scale, folds):
    """The plain kernels fold scale * log2(e) as float32 into the exponential: positive and
    normal only; any other scale is sent to the EXTRA variants (_launch.scale_folds)."""
    from cuflash._launch import scale_folds

    assert scale_folds(scale) == folds
    assert _params.as_float32(1e300) == np.inf   # out of float32's range: inf, as the kernel's own conversion gave
