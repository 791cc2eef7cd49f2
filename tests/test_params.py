"""The host-side params structs (cuflash/_runtime/params.py) against kernels_cu/params.cuh (CPU).

NVRTC compiles a translation unit that static_asserts every size and field offset
as NumPy lays them out; a mismatch fails to compile. No GPU is needed. Packing is
by field name: every leaf written is read back by its name.
"""
import numpy as np
import pytest

from cuflash import CompileError
from cuflash._runtime import params as _params
from cuflash._runtime.build import compile_source_offline, inline_includes

from _nvrtc import needs_nvrtc


def _compile_layout_check():
    compile_source_offline(inline_includes(_params.layout_check_source()), "layout.cu", "layout_check", "sm_80")


@needs_nvrtc
def test_struct_layouts_match_cuda():
    _compile_layout_check()


@needs_nvrtc
def test_layout_check_can_fail():
    """The check is real: shifting one field by 8 bytes is caught."""
    src = _params.layout_check_source()
    offset = _params.STRUCTS["BwdParams"].fields["dims"][1]
    bad = src.replace(f"OFFSET_OF(BwdParams, dims) == {offset}", f"OFFSET_OF(BwdParams, dims) == {offset + 8}")
    assert bad != src
    with pytest.raises(CompileError, match="offset of BwdParams::dims"):
        compile_source_offline(inline_includes(bad), "layout.cu", "layout_check", "sm_80")


def _swapped(dtype: np.dtype, a: str, b: str) -> np.dtype:
    """``dtype`` with fields ``a`` and ``b`` trading places (same types, so the same size)."""
    names = list(dtype.names)
    i, j = names.index(a), names.index(b)
    names[i], names[j] = names[j], names[i]
    return np.dtype([(n, dtype.fields[n][0]) for n in names], align=True)


@needs_nvrtc
@pytest.mark.parametrize("struct,a,b", [("FwdParams", "out", "lse"), ("BwdParams", "dq", "dk"),
                                        ("MaskParams", "band_lo", "band_hi")])
def test_swapping_two_fields_fails_the_layout_check(monkeypatch, struct, a, b):
    """Two fields of one type trading places in the host description keep every size, so nothing but
    their offsets tells them apart: the static_asserts against params.cuh must refuse it."""
    desc = _params.STRUCTS[struct]
    swapped = _swapped(desc, a, b)
    assert swapped.itemsize == desc.itemsize and swapped.fields[a][1] == desc.fields[b][1]
    monkeypatch.setitem(_params.STRUCTS, struct, swapped)
    with pytest.raises(CompileError, match=f"offset of {struct}::({a}|{b})"):
        _compile_layout_check()


def _distinct_values(dtype: np.dtype, counter: list) -> dict:
    """A value for every leaf of ``dtype``, by field name, no two alike (each fits its leaf's type)."""
    values = {}
    for name in dtype.names:
        sub = dtype.fields[name][0]
        if sub.names:
            values[name] = _distinct_values(sub, counter)
        elif sub.subdtype is not None:   # a fixed-size array: a list, one distinct value an element
            item, shape = sub.subdtype
            values[name] = [_distinct_value(item, counter) for _ in range(int(np.prod(shape)))]
        else:
            values[name] = _distinct_value(sub, counter)
    return values


def _distinct_value(sub: np.dtype, counter: list):
    counter[0] += 1
    n = counter[0]
    if sub.kind == "f":
        return n + 0.5                                   # exact in float32 and float64
    if sub.kind == "u" and sub.itemsize == 8:
        return (n << 40) | 0xBEEF                        # beyond 32 bits
    if sub.kind == "i" and sub.itemsize == 8:
        return -((n << 36) + 7)                          # negative, beyond 32 bits
    if sub.kind == "u":
        return 0x80000000 + n                            # the top bit set
    return -n


def _read_back(record, dtype: np.dtype) -> dict:
    """Every leaf of a structured record, by field name, as Python numbers."""
    out = {}
    for name in dtype.names:
        sub = dtype.fields[name][0]
        if sub.names:
            out[name] = _read_back(record[name], sub)
        else:
            out[name] = record[name].tolist() if sub.subdtype is not None else record[name].item()
    return out


@pytest.mark.parametrize("name", ["FwdParams", "BwdParams"])
def test_pack_round_trip_by_field_name(name):
    """Every leaf packed by name is read back by name from the bytes the kernel gets, at the offset
    NumPy's description (which test_struct_layouts_match_cuda checks against params.cuh) gives it."""
    desc = _params.STRUCTS[name]
    values = _distinct_values(desc, [0])
    arg = _params.PACKERS[name].pack(values)
    assert arg.nbytes == desc.itemsize
    record = np.frombuffer(arg.data, desc)[0]
    assert _read_back(record, desc) == values
    packer = _params.PACKERS[name]
    assert len(packer.fields) == len(packer.leaves) == sum(1 for _ in _leaves_of(desc))
    raw = bytes(arg.data)
    for path, offset in packer.fields.items():   # .offset() of each leaf is where its bytes are
        leaf = _leaf_dtype(desc, path)
        want = values
        for part in path.split("."):
            want = want[int(part)] if part.isdigit() else want[part]
        assert np.frombuffer(raw, leaf, count=1, offset=offset)[0].item() == want
        assert packer.offset(path) == offset


def _leaves_of(dtype, path=()):
    for name in dtype.names:
        sub = dtype.fields[name][0]
        if sub.names:
            yield from _leaves_of(sub, path + (name,))
        elif sub.subdtype is not None:
            yield from (path + (name, i) for i in range(int(np.prod(sub.subdtype[1]))))
        else:
            yield path + (name,)


def _leaf_dtype(dtype, path: str):
    for part in path.split("."):
        dtype = dtype.subdtype[0] if part.isdigit() else dtype.fields[part][0]
    return dtype


@pytest.mark.parametrize("name", ["FwdParams", "BwdParams"])
def test_missing_or_unknown_fields(name):
    """A missing field raises KeyError naming it. Nothing is placed by position: a dict with an extra
    name packs exactly what the named fields say (the extra is never read), and a misspelt name leaves
    its field missing, which raises."""
    packer = _params.PACKERS[name]
    values = _distinct_values(_params.STRUCTS[name], [0])
    for field in ("dims", "scale_log2_f"):
        partial = {k: v for k, v in values.items() if k != field}
        with pytest.raises(KeyError, match=f"{name}: field '{field}' not given"):
            packer.pack(partial)
    nested = dict(values, mask={k: v for k, v in values["mask"].items() if k != "band_hi"})
    with pytest.raises(KeyError, match="field 'band_hi' not given"):
        packer.pack(nested)
    misspelt = {("lse_" if k == "lse" else k): v for k, v in values.items()}
    with pytest.raises(KeyError, match="field 'lse' not given"):
        packer.pack(misspelt)
    assert bytes(packer.pack(dict(values, unknown=123)).data) == bytes(packer.pack(values).data)
    with pytest.raises(KeyError):
        packer.offset("no_such_field.ptr")


class _FakeArray:
    """What view() reads from a CuPy array: shape, strides, itemsize, data.ptr."""

    def __init__(self, shape, strides, itemsize=2, ptr=4096):
        self.shape, self.strides, self.itemsize, self.ndim = shape, strides, itemsize, len(shape)
        self.data = type("Mem", (), {"ptr": ptr})()


def test_view_strides_in_elements_and_broadcast():
    x = _FakeArray((2, 3, 5, 8), (240, 0, 16, 2), itemsize=2, ptr=1 << 40)
    assert _params.view(x) == {"ptr": 1 << 40, "batch_stride": 120, "head_stride": 0, "row_stride": 8}
    lse = _FakeArray((2, 3, 5), (60, 20, 4), itemsize=4)
    v = _params.view(lse)
    assert (v["batch_stride"], v["head_stride"], v["row_stride"]) == (15, 5, 1)
    with pytest.raises(ValueError, match="unit-stride"):
        _params.view(_FakeArray((2, 3, 5, 8), (480, 160, 32, 4)))


def test_fwd_params_fields():
    q = _FakeArray((2, 4, 10, 64), (5120, 1280, 128, 2))
    k = _FakeArray((2, 2, 12, 64), (3072, 1536, 128, 2))
    v = _FakeArray((2, 2, 12, 32), (1536, 768, 64, 2))
    out = _FakeArray((2, 4, 10, 32), (2560, 640, 64, 2))
    lse = _FakeArray((2, 4, 10), (160, 40, 4), itemsize=4)
    mask = dict(_params.MASK_OFF, band_lo=-11, band_hi=2, drop_threshold=123, seed_lo=0xDEADBEEF, seed_hi=7)
    packed = _params.fwd_params(q, k, v, out, lse, group=2, scale=0.125, mask=mask)
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
    normal only; any other scale is sent to the EXTRA variants (plan.scale_folds)."""
    from cuflash._dispatch.plan import scale_folds

    assert scale_folds(scale) == folds
    assert _params.as_float32(1e300) == np.inf   # out of float32's range: inf, as the kernel's own conversion gave


@pytest.mark.parametrize("d", [2, 3, 7, 16, 48, 64, 80, 128, 192, 1008, 4096, 65520, 2**20 + 16, 2**30 + 1, 2**31 - 1])
def test_fast_divisor_divides_every_31_bit_numerator(d):
    """fast_div's multiply and shift equal integer division: at every multiple of d and its neighbours near 0,
    near 2**31 and at random numerators."""
    mul, shift = _params.fast_divisor(d)
    assert 0 < mul < 2**32 and shift >= 0
    top = (2**31 - 1) // d
    ks = np.unique(np.concatenate([np.arange(0, 2000), np.arange(max(top - 2000, 0), top + 1)])).astype(np.uint64)
    rng = np.random.default_rng(d)
    x = np.concatenate([ks * d, ks * d + d - 1, (ks * d - 1)[ks > 0], rng.integers(0, 2**31, 20000, dtype=np.uint64),
                        np.array([2**31 - 1], np.uint64)])
    x = x[x < 2**31]
    assert (((x * np.uint64(mul)) >> np.uint64(32)) >> np.uint64(shift) == x // np.uint64(d)).all()


def test_fast_divisor_of_one_and_bad_divisors():
    assert _params.fast_divisor(1) == (0, 0)
    for bad in (0, -16, 2**31, 1.5):
        with pytest.raises(ValueError):
            _params.fast_divisor(bad)
