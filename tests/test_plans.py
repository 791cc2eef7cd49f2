"""Forward plans (cuflash/_launch.py) on the CPU: CuPy arrays on fake device memory, the driver's
launch, allocation and tensor-map functions replaced by recorders. A repeated call takes its plan
and launches exactly what the full path launched for it (the same variant, the same params and
maps but for the array addresses); a call whose signature differs in anything the checks or the
kernel choice read does not."""
import ctypes
import struct

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from cupy.cuda import memory  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _launch, _params, _tma, _variants  # noqa: E402


class FakeDevice:
    """Fake memory, 1 KB aligned, never read."""

    def __init__(self):
        self.next = 0x7F0000000000

    def empty(self, shape, dtype=np.float32, order="C"):
        n = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        mem = memory.UnownedMemory(self.next, n, None, device_id=0)
        self.next += (n + 1023) // 1024 * 1024
        return cp.ndarray(shape, dtype=dtype, memptr=memory.MemoryPointer(mem, 0))


@pytest.fixture
def fake(monkeypatch):
    """(device, launches): every launch as (variant, params bytes, maps bytes or None, grid dims)."""
    dev = FakeDevice()
    launches = []
    monkeypatch.setattr(cp, "empty", dev.empty)
    monkeypatch.setattr(cp.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(_launch, "_device_facts", lambda device_id: (90, 232448, "H100 (fake)", 132))

    def record(variant, params, dims, grid=0, extra_args=()):
        launches.append((variant, bytes(params.data), bytes(extra_args[0].data) if extra_args else None, dims))

    monkeypatch.setattr(_launch, "_launch", record)

    def encode(addr, dtype, rank, ptr, dims, strides, box, steps, *modes):
        # a map's bytes: its address, then what it was asked for
        words = [ptr] + list((ctypes.c_uint64 * 4).from_address(dims)) + list((ctypes.c_uint64 * 3).from_address(strides))
        ctypes.memmove(addr, struct.pack("=8Q", *words), 64)
        ctypes.memmove(addr + 64, bytes((ctypes.c_uint32 * 4).from_address(box)), 16)
        return 0

    def replace(addr, ptr):
        ctypes.memmove(addr, struct.pack("=Q", ptr), 8)
        return 0

    monkeypatch.setattr(_tma, "_encode_fn", lambda: encode)
    monkeypatch.setattr(_tma, "_replace_fn", lambda: replace)
    _launch.clear_forward_plans()
    yield dev, launches
    _launch.clear_forward_plans()


def _qkv(dev, shape=(2, 4, 1100, 64), dtype=np.float16):
    return tuple(dev.empty(shape, dtype) for _ in range(3))


def _without_addresses(params: bytes) -> bytes:
    raw = bytearray(params)
    for offset in _launch._FWD_POINTERS:
        raw[offset:offset + 8] = bytes(8)
    return bytes(raw)


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (32, True)])
def test_a_repeated_call_launches_what_the_full_path_did(fake, d, causal):
    dev, launches = fake
    q, k, v = _qkv(dev, (2, 4, 1100, d))
    out1, lse1 = cuflash.attention_forward(q, k, v, causal=causal)
    assert len(_launch._FORWARD_PLANS) == 1
    q2, k2, v2 = _qkv(dev, (2, 4, 1100, d))     # the same signature, other addresses
    out2, lse2 = cuflash.attention_forward(q2, k2, v2, causal=causal)
    (var1, params1, maps1, dims1), (var2, params2, maps2, dims2) = launches
    assert var2 is var1 and dims2 == dims1
    assert _without_addresses(params2) == _without_addresses(params1)
    fields = np.frombuffer(params2, dtype=_params.STRUCTS["FwdParams"])
    assert [int(fields[n]["ptr"][0]) for n in ("q", "k", "v", "out", "lse")] == \
        [x.data.ptr for x in (q2, k2, v2, out2, lse2)]
    assert (out2.shape, out2.dtype, lse2.shape, lse2.dtype) == (out1.shape, out1.dtype, lse1.shape, lse1.dtype)
    if maps1 is None:
        assert maps2 is None
        return
    # The maps: the full path's encoding for these arrays, but for their addresses, which are the new
    # arrays' (the output's only where the kernel reads its map: else it stays zeros).
    _launch.clear_forward_plans()
    cuflash.attention_forward(q2, k2, v2, causal=causal)
    encoded = launches[2][2]
    addresses = [struct.unpack_from("=Q", maps2, 128 * i)[0] for i in range(4)]
    stores_out = struct.unpack_from("=Q", encoded, 384)[0] != 0
    assert addresses == [q2.data.ptr, k2.data.ptr, v2.data.ptr, out2.data.ptr if stores_out else 0]
    assert [maps2[128 * i + 8:128 * (i + 1)] for i in range(4)] == [encoded[128 * i + 8:128 * (i + 1)] for i in range(4)]


@pytest.mark.parametrize("change", ["causal 1", "scale True", "scale", "dtype", "strides", "shape", "hook",
                                    "alignment", "bias", "window"])
def test_a_different_signature_takes_the_full_path(fake, monkeypatch, change):
    dev, launches = fake
    q, k, v = _qkv(dev)
    cuflash.attention_forward(q, k, v, causal=True, scale=1.0)
    kw = dict(causal=True, scale=1.0)
    # 1 == True and True == 1.0 as dict keys, but the checks refuse a causal of 1 and a scale of True
    if change == "causal 1":
        with pytest.raises(ValueError, match="causal"):
            cuflash.attention_forward(q, k, v, causal=1, scale=1.0)
        return
    if change == "scale True":
        with pytest.raises(ValueError, match="scale"):
            cuflash.attention_forward(q, k, v, causal=True, scale=True)
        return
    elif change == "scale":
        kw["scale"] = 0.25
    elif change == "dtype":
        q, k, v = _qkv(dev, dtype=cp.float32)
    elif change == "strides":
        big = dev.empty((2, 1100, 4, 64), np.float16)
        q = big.transpose(0, 2, 1, 3)
    elif change == "shape":
        q, k, v = _qkv(dev, (2, 4, 1200, 64))
    elif change == "hook":
        monkeypatch.setattr(_launch, "_compute_capability", lambda: 80)   # bench.py's "cuflash sm80"
    elif change == "alignment":
        q = cp.ndarray(q.shape, q.dtype, memptr=q.data + 8, strides=q.strides)
    elif change == "bias":
        kw["bias"] = dev.empty((1, 1, 1100, 1100), np.float16)
    elif change == "window":
        kw["window"] = (64, 0)
    before = len(_launch._FORWARD_PLANS)
    cuflash.attention_forward(q, k, v, **kw)
    stored = len(_launch._FORWARD_PLANS) - before
    assert stored == (0 if change in ("bias", "window") else 1)
    if change == "hook":
        assert launches[-1][0].arch == "sm80" and launches[0][0].arch == "sm90a"


@pytest.mark.parametrize("causal,scale,error", [([True], None, ValueError), (True, [0.5], ValueError),
                                                (True, np.array([0.5]), ValueError)])
def test_unhashable_options_get_the_checks_errors(fake, causal, scale, error):
    """The signature is formed before the checks: an option it cannot hold leaves the call to them."""
    dev, launches = fake
    q, k, v = _qkv(dev)
    with pytest.raises(error):
        cuflash.attention_forward(q, k, v, causal=causal, scale=scale)
    assert not launches


def test_tile_override_clears_the_plans(fake):
    dev, launches = fake
    q, k, v = _qkv(dev, (2, 4, 1100, 128))
    cuflash.attention_forward(q, k, v)
    assert _launch._FORWARD_PLANS
    with _variants.tile_override("fwd_mma", 128, _variants.Tile(64, 64, 4, 2, "test")):
        assert not _launch._FORWARD_PLANS
    assert not _launch._FORWARD_PLANS


def test_inputs_the_checks_copy_take_no_plan(fake, monkeypatch):
    """A last axis that is not unit-stride is copied by the checks: the kernel reads the copy, so a
    plan, which passes the caller's arrays, must not be stored."""
    dev, launches = fake
    q = dev.empty((2, 4, 1100, 128), np.float16)[..., ::2]
    k, v = (dev.empty((2, 4, 1100, 64), np.float16) for _ in range(2))
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: dev.empty(x.shape, x.dtype))
    cuflash.attention_forward(q, k, v)
    assert len(launches) == 1 and not _launch._FORWARD_PLANS
