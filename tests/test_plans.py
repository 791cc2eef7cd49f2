"""Forward and backward plans (cuflash/_dispatch/plan.py) on the CPU: CuPy arrays on fake device memory,
the driver's launch, allocation and tensor-map functions replaced by recorders. A repeated call
takes its plan and launches exactly what the full path launched for it (the same variants, the
same params and maps but for the array addresses); a call whose signature differs in anything the
checks or the kernel choice read does not."""
import ctypes
from dataclasses import replace
import functools
import importlib.util
import struct
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import options  # noqa: E402
from cuflash._dispatch import masking as _masking  # noqa: E402
from cuflash._dispatch import model, plan, select  # noqa: E402
from cuflash._dispatch import packed as packed_  # noqa: E402
from cuflash._runtime import device, launch  # noqa: E402
from cuflash._runtime import params as _params  # noqa: E402
from cuflash._runtime import tma as _tma  # noqa: E402

import _variant_problems as vp  # noqa: E402


_HOST_CPU = Path(__file__).resolve().parent.parent / "benchmarks" / "host_cpu.py"
_spec = importlib.util.spec_from_file_location("host_cpu", _HOST_CPU)
host_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_cpu)
FakeDevice = host_cpu.FakeDevice   # fake memory, 1 KB aligned, never read (benchmarks/host_cpu.py)


@pytest.fixture
def fake(monkeypatch):
    """(device, launches): every launch as (variant, params bytes, maps bytes or None, grid)."""
    dev = FakeDevice()
    launches = []
    monkeypatch.setattr(cp, "empty", dev.empty)
    monkeypatch.setattr(cp, "zeros", dev.empty)   # the backward's dQ accumulator (never read here)
    monkeypatch.setattr(cp.cuda, "alloc", dev.alloc)   # the split forward's partials
    monkeypatch.setattr(cp.cuda, "get_current_stream", lambda: host_cpu._Stream)   # the split counters' key
    monkeypatch.setattr(plan, "_COUNTERS", {})
    monkeypatch.setattr(packed_, "_TABLES", {})   # packed block tables: uploaded again in every test
    monkeypatch.setattr(cp.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(device, "device_facts", lambda device_id: (90, 232448, "H100 (fake)", 132))

    def record(variant, params, grid, extra_args=()):
        launches.append((variant, bytes(params.data), bytes(extra_args[0].data) if extra_args else None, grid))

    monkeypatch.setattr(launch, "launch_kernel", record)

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
    plan.clear_plans()
    options._PROBLEMS.clear()
    _masking.clear_mod_states()
    yield dev, launches
    plan.clear_plans()
    options._PROBLEMS.clear()
    _masking.clear_mod_states()


def _qkv(dev, shape=(2, 4, 1100, 64), dtype=np.float16):
    return tuple(dev.empty(shape, dtype) for _ in range(3))


def _without(params: bytes, offsets) -> bytes:
    raw = bytearray(params)
    for offset in offsets:
        raw[offset:offset + 8] = bytes(8)
    return bytes(raw)


def _without_addresses(params: bytes) -> bytes:
    raw = bytearray(params)
    for offset in plan._FWD_ADDRESSES + plan._FWD_QUEUE:
        raw[offset:offset + 8] = bytes(8)
    return bytes(raw)


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True), (32, True)])
def test_a_repeated_call_launches_what_the_full_path_did(fake, d, causal):
    dev, launches = fake
    q, k, v = _qkv(dev, (2, 4, 1100, d))
    out1, lse1 = cuflash.attention_forward(q, k, v, causal=causal)
    assert len(plan._FORWARD_PLANS) == 1
    q2, k2, v2 = _qkv(dev, (2, 4, 1100, d))     # the same signature, other addresses
    out2, lse2 = cuflash.attention_forward(q2, k2, v2, causal=causal)
    (var1, params1, maps1, grid1), (var2, params2, maps2, grid2) = launches
    assert var2 is var1 and grid2 == grid1
    assert _without_addresses(params2) == _without_addresses(params1)
    fields = np.frombuffer(params2, dtype=_params.STRUCTS["FwdParams"])
    assert [int(fields[n]["ptr"][0]) for n in ("q", "k", "v", "out", "lse")] == \
        [x.data.ptr for x in (q2, k2, v2, out2, lse2)]
    assert (out2.shape, out2.dtype, lse2.shape, lse2.dtype) == (out1.shape, out1.dtype, lse1.shape, lse1.dtype)
    # A causal persistent grid's block queue: a new zeroed counter a call (two launches never share one).
    queues = [int(np.frombuffer(p, dtype=_params.STRUCTS["FwdParams"])["block_queue"][0]) for p in (params1, params2)]
    takes_queue = var1.schedule == "queue"
    assert takes_queue == (d == 128 and causal)
    assert [q_ != 0 for q_ in queues] == [takes_queue] * 2
    assert not takes_queue or queues[0] != queues[1]
    if maps1 is None:
        assert maps2 is None
        return
    # The maps: the full path's encoding for these arrays, but for their addresses, which are the new
    # arrays' (the output's only where the kernel reads its map: else it stays zeros).
    plan.clear_plans()
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
        monkeypatch.setattr(device, "compute_capability", lambda: 80)   # bench.py's "cuflash sm80"
    elif change == "alignment":
        q = cp.ndarray(q.shape, q.dtype, memptr=q.data + 8, strides=q.strides)
    elif change == "bias":
        kw["bias"] = dev.empty((1, 1, 1100, 1100), np.float16)
    elif change == "window":
        kw["window"] = (64, 0)
    before = len(plan._FORWARD_PLANS)
    cuflash.attention_forward(q, k, v, **kw)
    stored = len(plan._FORWARD_PLANS) - before
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
    assert plan._FORWARD_PLANS
    with select.tile_override("fwd_mma", 128, model.Tile(64, 64, 4, 2, "test")):
        assert not plan._FORWARD_PLANS
    assert not plan._FORWARD_PLANS


def test_inputs_the_checks_copy_take_no_plan(fake, monkeypatch):
    """A last axis that is not unit-stride is copied by the checks: the kernel reads the copy, so a
    plan, which passes the caller's arrays, must not be stored."""
    dev, launches = fake
    q = dev.empty((2, 4, 1100, 128), np.float16)[..., ::2]
    k, v = (dev.empty((2, 4, 1100, 64), np.float16) for _ in range(2))
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: dev.empty(x.shape, x.dtype))
    cuflash.attention_forward(q, k, v)
    assert len(launches) == 1 and not plan._FORWARD_PLANS


# ------------------------------------------------------------------ backward plans

_BWD_NAMES = ("q", "k", "v", "out", "dout", "lse", "dsum", "dq_acc", "dq", "dk", "dv")


def _bwd_inputs(dev, shape=(2, 4, 1100, 64), dtype=np.float16, dv=None):
    """dout, q, k, v, out, lse of one backward call (``dv``: the value head dim, default q's)."""
    vshape = shape[:-1] + (dv or shape[-1],)
    q, k = dev.empty(shape, dtype), dev.empty(shape, dtype)
    v, out, dout = (dev.empty(vshape, dtype) for _ in range(3))
    lse = dev.empty(shape[:-1], np.float64 if dtype == np.float64 else np.float32)
    return dout, q, k, v, out, lse


def _bwd_pointers(params: bytes) -> dict:
    fields = np.frombuffer(params, dtype=_params.STRUCTS["BwdParams"])
    return {n: int(fields[n]["ptr"][0]) for n in _BWD_NAMES}


def _bwd_without_addresses(params: bytes) -> bytes:
    raw = bytearray(params)
    for offset in plan._BWD_ADDRESSES:
        raw[offset:offset + 8] = bytes(8)
    return bytes(raw)


@pytest.fixture
def plans_run(monkeypatch):
    """One True for each backward call that took a stored plan (plan.backward ran without plan_backward)."""
    taken, planned = [], []
    real_backward, real_plan = plan.backward, plan.plan_backward

    def spy_plan(*args, **kwargs):
        planned.append(True)
        return real_plan(*args, **kwargs)

    def spy_backward(*args, **kwargs):
        n = len(planned)
        result = real_backward(*args, **kwargs)
        if len(planned) == n:
            taken.append(True)
        return result

    monkeypatch.setattr(plan, "plan_backward", spy_plan)
    monkeypatch.setattr(plan, "backward", spy_backward)
    return taken


@pytest.mark.parametrize("cc", [90, 80])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d,dtype,causal", [(64, np.float16, False), (64, np.float16, True),
                                            (128, np.float16, False), (128, np.float16, "bottom_right"),
                                            (33, np.float16, True), (128, np.float32, False)])
def test_a_repeated_backward_launches_what_the_full_path_did(fake, plans_run, monkeypatch, cc, deterministic, d,
                                                            dtype, causal):
    dev, launches = fake
    if cc == 80:
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    first = _bwd_inputs(dev, (2, 4, 1100, d), dtype)
    grads1 = cuflash.attention_backward(*first, causal=causal, deterministic=deterministic)
    assert len(plan._BACKWARD_PLANS) == 1 and not plans_run
    n = len(launches)
    second = _bwd_inputs(dev, (2, 4, 1100, d), dtype)     # the same signature, other addresses
    grads2 = cuflash.attention_backward(*second, causal=causal, deterministic=deterministic)
    assert plans_run == [True]
    full, planned = launches[:n], launches[n:]
    assert [(x[0], x[3]) for x in planned] == [(x[0], x[3]) for x in full]   # variants, grids
    assert [x[0] for x in full].count(None) == 0
    hopper = cc == 90 and not deterministic and dtype == np.float16 and d % 8 == 0
    assert any(x[0].family == "bwd_dkdv_wgmma" for x in full) == hopper
    for (_, params1, maps1, _), (_, params2, maps2, _) in zip(full, planned):
        assert _bwd_without_addresses(params2) == _bwd_without_addresses(params1)
        assert (maps1 is None) == (maps2 is None)
    for grads, inputs, (_, params, maps, _) in ((grads1, first, full[-1]), (grads2, second, planned[-1])):
        dout, q, k, v, out, lse = inputs
        ptr = _bwd_pointers(params)
        assert [ptr[n] for n in ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv")] == \
            [x.data.ptr for x in (q, k, v, out, dout, lse, *grads)]
        assert (ptr["dq_acc"] == 0) == deterministic
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]
    # the same allocations, in the same order, as the full path's (the fake device's addresses advance
    # by each allocation's size)
    p1, p2 = _bwd_pointers(full[-1][1]), _bwd_pointers(planned[-1][1])
    assert [p1[n] - p1["dsum"] for n in ("dq_acc", "dq", "dk", "dv") if p1[n]] == \
        [p2[n] - p2["dsum"] for n in ("dq_acc", "dq", "dk", "dv") if p2[n]]
    maps = [(x[2], x[1]) for x in full + planned if x[2] is not None]
    assert len(maps) == (2 if hopper else 0)
    for encoded, params in maps:
        # BwdTensorMaps: q, dout, k, v, the dQ accumulator, each pointed at this call's array; the
        # rest of each map (dims, strides, box) is the first call's encoding
        ptr = _bwd_pointers(params)
        assert [struct.unpack_from("=Q", encoded, 128 * i)[0] for i in range(5)] == \
            [ptr[n] for n in ("q", "dout", "k", "v", "dq_acc")]
    if hopper:
        (m1, _), (m2, _) = maps
        assert [m1[128 * i + 8:128 * (i + 1)] for i in range(5)] == [m2[128 * i + 8:128 * (i + 1)] for i in range(5)]


@pytest.mark.parametrize("change", ["strides", "dout strides", "dtype", "lse dtype", "shape", "causal", "causal 1",
                                    "deterministic", "deterministic 1", "scale", "scale int", "scale True",
                                    "scale -0.0", "alignment", "hook cc", "hook variants", "hook facts",
                                    "bias", "mask", "window", "dropout", "seed"])
def test_a_different_backward_signature_takes_the_full_path(fake, plans_run, monkeypatch, change):
    dev, launches = fake
    args = list(_bwd_inputs(dev))
    kw = dict(causal=True, scale=0.5, deterministic=False)
    cuflash.attention_backward(*args, **kw)
    assert len(plan._BACKWARD_PLANS) == 1
    stores = True
    if change in ("causal 1", "scale True"):
        with pytest.raises(ValueError, match=change.split()[0]):
            cuflash.attention_backward(*args, **dict(kw, **{change.split()[0]: 1 if change == "causal 1" else True}))
        assert not plans_run
        return
    if change == "strides":
        big = dev.empty((2, 1100, 4, 64), np.float16)
        args[1] = big.transpose(0, 2, 1, 3)
    elif change == "dout strides":
        big = dev.empty((2, 1100, 4, 64), np.float16)
        args[0] = big.transpose(0, 2, 1, 3)
    elif change == "dtype":
        args = list(_bwd_inputs(dev, dtype=np.float32))
    elif change == "lse dtype":   # the checks convert it: a copy, which a plan cannot pass
        args[5] = dev.empty(args[5].shape, np.float16)
        monkeypatch.setattr(cp.ndarray, "astype", lambda self, dtype, copy=True: dev.empty(self.shape, dtype),
                            raising=False)
        stores = False
    elif change == "shape":
        args = list(_bwd_inputs(dev, (2, 4, 1200, 64)))
    elif change == "causal":
        kw["causal"] = "bottom_right"
    elif change == "deterministic":
        kw["deterministic"] = True
    elif change == "deterministic 1":   # the API reads it as bool(deterministic): True's plan
        kw["deterministic"] = 1
    elif change == "scale":
        kw["scale"] = 0.25
    elif change == "scale int":
        kw["scale"] = 1
        stores = False
    elif change == "scale -0.0":   # -0.0 == 0.0 as dict keys, but not in the gradients' signs
        kw["scale"] = -0.0
        stores = False
    elif change == "alignment":
        q = args[1]
        args[1] = cp.ndarray(q.shape, q.dtype, memptr=q.data + 8, strides=q.strides)
    elif change == "hook cc":
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    elif change == "hook variants":
        monkeypatch.setattr(plan, "backward_variants", functools.partial(select.backward_variants))
    elif change == "hook facts":
        monkeypatch.setattr(device, "device_facts", lambda device_id: (80, 166912, "A100 (fake)", 108))
    else:
        stores = False
        if change == "bias":
            kw["bias"] = dev.empty((1, 1, 1100, 1100), np.float16)
            monkeypatch.setattr(_masking.DbiasPlan, "result", lambda plan, p, opts: kw["bias"])   # sums on the GPU
        elif change == "mask":
            kw["mask"] = dev.empty((2, 1, 1, 1100), np.bool_)
            monkeypatch.setattr(_masking, "block_states", lambda p, opts: (None, None))   # reads the mask
        elif change == "window":
            kw["window"] = (64, 0)
        elif change == "dropout":
            kw.update(dropout_p=0.1, seed=7)
        elif change == "seed":
            kw["seed"] = 7
    n = len(launches)
    for _ in range(2):   # twice: a call that stores no plan takes none the second time either
        grads = cuflash.attention_backward(*args, **kw)
        assert len(launches) > n
        assert [g.shape for g in grads[:3]] == [x.shape for x in args[1:4]]
        if not stores:
            assert len(plan._BACKWARD_PLANS) == 1 and not plans_run
    assert plans_run == ([True] if stores else [])
    assert len(plan._BACKWARD_PLANS) == (2 if stores else 1)
    if change in ("hook cc", "hook facts"):
        assert launches[-1][0].arch == "sm80" and launches[1][0].arch == "sm90a"


def test_tile_override_clears_the_backward_plans(fake):
    dev, launches = fake
    cuflash.attention_backward(*_bwd_inputs(dev, (2, 4, 1100, 128)))
    assert plan._BACKWARD_PLANS
    with select.tile_override("bwd_dkdv_mma", 128, model.Tile(64, 64, 4, 2, "test")):
        assert not plan._BACKWARD_PLANS
    assert not plan._BACKWARD_PLANS


@pytest.mark.parametrize("shape", [(4, 1100, 64), (1100, 64), (2, 3, 4, 1100, 64)])
def test_other_ranks_are_planned_afresh(fake, plans_run, shape):
    """Inputs of 2, 3 or 5 dims have no signature (only 4-D CuPy arrays, the kernels' own views, take
    one): each call is planned afresh, and launches what the first did but for the addresses; the grads
    have the inputs' shapes."""
    dev, launches = fake
    first = _bwd_inputs(dev, shape, dv=32)
    grads1 = cuflash.attention_backward(*first)
    n = len(launches)
    second = _bwd_inputs(dev, shape, dv=32)
    grads2 = cuflash.attention_backward(*second)
    assert plans_run == [] and not plan._BACKWARD_PLANS
    assert [(x[0], x[3], _bwd_without_addresses(x[1])) for x in launches[n:]] == \
        [(x[0], x[3], _bwd_without_addresses(x[1])) for x in launches[:n]]
    for grads, inputs in ((grads1, first), (grads2, second)):
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in inputs[1:4]]
    ptr = _bwd_pointers(launches[-1][1])
    assert [ptr[n] for n in ("q", "k", "v", "out", "dout", "lse")] == [x.data.ptr for x in second[1:5] + second[:1]
                                                                        + second[5:]]


def test_backward_inputs_the_checks_copy_take_no_plan(fake, plans_run, monkeypatch):
    """A dout whose last axis is not unit-stride is copied by the checks: no plan."""
    dev, launches = fake
    dout, q, k, v, out, lse = _bwd_inputs(dev)
    dout = dev.empty((2, 4, 1100, 128), np.float16)[..., ::2]
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: dev.empty(x.shape, x.dtype))
    for _ in range(2):
        cuflash.attention_backward(dout, q, k, v, out, lse)
    assert not plan._BACKWARD_PLANS and not plans_run and len(launches) == 6


def test_backward_plans_without_readdressing_encode_their_maps_again(fake, plans_run, monkeypatch):
    """A driver without cuTensorMapReplaceAddress: the Hopper kernel's maps cannot be re-pointed, so a
    stored plan encodes them again for the new arrays (what the full path encodes for them)."""
    dev, launches = fake
    monkeypatch.setattr(_tma, "_replace_fn", lambda: None)
    cuflash.attention_backward(*_bwd_inputs(dev))
    assert any(x[2] is not None for x in launches) and plan._BACKWARD_PLANS
    second = _bwd_inputs(dev)
    n = len(launches)
    cuflash.attention_backward(*second)
    assert plans_run == [True]
    (replayed, params), = [(x[2], x[1]) for x in launches[n:] if x[2] is not None]
    plan.clear_plans()
    n = len(launches)
    cuflash.attention_backward(*second)
    (encoded, _), = [(x[2], x[1]) for x in launches[n:] if x[2] is not None]
    ptr = _bwd_pointers(params)   # each map points at this call's array; the rest is the full path's encoding
    assert [struct.unpack_from("=Q", replayed, 128 * i)[0] for i in range(5)] == \
        [ptr[n] for n in ("q", "dout", "k", "v", "dq_acc")]
    assert [replayed[128 * i + 8:128 * (i + 1)] for i in range(5)] == [encoded[128 * i + 8:128 * (i + 1)] for i in range(5)]


@pytest.mark.parametrize("cc", [90, 80])
def test_backward_plans_tell_which_array_is_misaligned(fake, plans_run, monkeypatch, cc):
    """out 8 bytes off a 16-byte boundary (which the kernel choice does not read) and then q so (which it
    does: 16-byte loads, tensor maps): different signatures, so the second call is chosen afresh, and
    launches what the full path launches for it."""
    dev, launches = fake
    monkeypatch.setattr(device, "compute_capability", lambda: cc)

    def shifted(x):
        return cp.ndarray(x.shape, x.dtype, memptr=dev.empty((x.size + 8,), x.dtype).data + 8, strides=x.strides)

    first = list(_bwd_inputs(dev))
    first[4] = shifted(first[4])
    cuflash.attention_backward(*first)
    second = list(_bwd_inputs(dev))
    second[1] = shifted(second[1])
    n = len(launches)
    cuflash.attention_backward(*second)
    assert plans_run == [] and len(plan._BACKWARD_PLANS) == 2
    planned = [x[0] for x in launches[n:]]
    plan.clear_plans()
    n = len(launches)
    cuflash.attention_backward(*second)
    assert [x[0] for x in launches[n:]] == planned
    assert all(v.arch == "sm80" and not v.vec for v in planned)   # misaligned q: no maps, element loads


# ------------------------------------------------------------------ signatures and the validation memo

def test_which_calls_get_a_signature(fake):
    """Plain 4-D CuPy calls only: no masking option, causal a bool or str, scale None or a float; the
    backward also refuses a scale of 0.0 (-0.0 == 0.0 as a key, not in the gradients' signs)."""
    dev, _ = fake
    q, k, v = _qkv(dev)
    assert options.forward_call(q, k, v).signature is not None
    assert options.forward_call(q, k, v, causal="bottom_right", scale=0.5).signature is not None
    for kw in (dict(scale=1), dict(window=(8, 0)), dict(dropout_p=0.1, seed=3), dict(seed=3),
               dict(bias=dev.empty((1, 1, 1100, 1100), np.float16))):
        assert options.forward_call(q, k, v, **kw).signature is None, kw
    assert options.forward_call(q[0], k[0], v[0]).signature is None   # 3-D: not the kernels' own views
    dout, q, k, v, out, lse = _bwd_inputs(dev)
    assert options.backward_call(dout, q, k, v, out, lse, scale=0.5).signature is not None
    for scale in (0.0, -0.0, 1):
        assert options.backward_call(dout, q, k, v, out, lse, scale=scale).signature is None, scale
    signatures = {options.forward_call(q, k, v, causal=c, scale=s).signature
                  for c in (False, True, "top_left") for s in (None, 0.5)}
    assert len(signatures) == 6   # True and "top_left" validate alike but are different keys


def test_a_seen_signature_is_not_validated_again(fake, monkeypatch):
    dev, _ = fake
    q, k, v = _qkv(dev)
    first = options.forward_call(q, k, v, causal=True)
    assert options._PROBLEMS[first.signature] is not None
    monkeypatch.setattr(options, "check_qkv", lambda *a, **kw: pytest.fail("validated again"))
    q2, k2, v2 = _qkv(dev)
    again = options.forward_call(q2, k2, v2, causal=True)
    assert again.signature == first.signature and again.problem.q is q2 and again.problem.v is v2
    strip = lambda p: (p.xp, p.dtype, p.lead, p.causal, p.scale, p.q_shape, p.d, p.dv, p.lq, p.lk, p.group)  # noqa
    assert strip(again.problem) == strip(first.problem)


def test_clear_selection_caches_clears_the_plans(fake):
    dev, _ = fake
    cuflash.attention_forward(*_qkv(dev))
    cuflash.attention_backward(*_bwd_inputs(dev))
    assert plan._FORWARD_PLANS and plan._BACKWARD_PLANS
    select.clear_selection_caches()
    assert not plan._FORWARD_PLANS and not plan._BACKWARD_PLANS


# ------------------------------------------------------------------ on the GPU

def _gpu_qkv(shape=(2, 4, 600, 64), dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(cp.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(3))


@pytest.fixture
def clean_plans():
    plan.clear_plans()
    yield
    plan.clear_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_a_replayed_call_gives_bitwise_the_first_result(clean_plans, dtype, causal):
    q, k, v = _gpu_qkv(dtype=dtype)
    out1, lse1 = cuflash.attention_forward(q, k, v, causal=causal)
    assert len(plan._FORWARD_PLANS) == 1
    dout = cp.asarray(np.random.default_rng(1).standard_normal(out1.shape).astype(dtype))
    grads1 = cuflash.attention_backward(dout, q, k, v, out1, lse1, causal=causal, deterministic=True)
    assert len(plan._BACKWARD_PLANS) == 1
    out2, lse2 = cuflash.attention_forward(q, k, v, causal=causal)
    grads2 = cuflash.attention_backward(dout, q, k, v, out2, lse2, causal=causal, deterministic=True)
    assert len(plan._FORWARD_PLANS) == 1 and len(plan._BACKWARD_PLANS) == 1
    for a, b in zip((out1, lse1, *grads1), (out2, lse2, *grads2)):
        assert bytes(a.get().data) == bytes(b.get().data)


@pytest.mark.gpu
@pytest.mark.parametrize("change", ["strides", "dtype", "alignment", "causal", "scale type", "precision",
                                    "deterministic", "hook"])
def test_a_changed_signature_plans_again_on_the_gpu(clean_plans, monkeypatch, change):
    q, k, v = _gpu_qkv(dtype=np.float32 if change == "precision" else np.float16)
    kw = dict(causal=True)
    out, lse = cuflash.attention_forward(q, k, v, **kw)
    cuflash.attention_backward(out, q, k, v, out, lse, **kw)
    fwd, bwd = len(plan._FORWARD_PLANS), len(plan._BACKWARD_PLANS)
    dkw = {}
    if change == "strides":
        q = cp.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif change == "dtype":
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
    elif change == "alignment":
        raw = cp.empty(q.size + 4, q.dtype)
        raw[4:] = q.ravel()
        q = raw[4:].reshape(q.shape)   # 8 bytes off a 16-byte boundary
    elif change == "causal":
        kw["causal"] = "bottom_right"
    elif change == "scale type":
        kw["scale"] = 0.125   # a float where the first call took None (the same value)
    elif change == "precision":
        kw["precision"] = "tf32"
    elif change == "deterministic":
        dkw["deterministic"] = True
    elif change == "hook":
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    if change != "deterministic":
        out, lse = cuflash.attention_forward(q, k, v, **kw)
        assert len(plan._FORWARD_PLANS) == fwd + 1
    cuflash.attention_backward(out.astype(q.dtype), q, k, v, out.astype(q.dtype), lse, **kw, **dkw)
    assert len(plan._BACKWARD_PLANS) == bwd + 1


@pytest.mark.gpu
def test_tile_override_and_clear_selection_caches_clear_the_plans_on_the_gpu(clean_plans):
    q, k, v = _gpu_qkv(shape=(1, 2, 300, 128))
    out, lse = cuflash.attention_forward(q, k, v)
    cuflash.attention_backward(out, q, k, v, out, lse)
    assert plan._FORWARD_PLANS and plan._BACKWARD_PLANS
    with select.tile_override("fwd_mma", 128, model.Tile(64, 64, 4, 2, "test")):
        assert not plan._FORWARD_PLANS and not plan._BACKWARD_PLANS
        cuflash.attention_forward(q, k, v)
    assert not plan._FORWARD_PLANS
    cuflash.attention_forward(q, k, v)
    assert plan._FORWARD_PLANS
    select.clear_selection_caches()
    assert not plan._FORWARD_PLANS and not plan._BACKWARD_PLANS


def _fwd_fields(params: bytes):
    return np.frombuffer(params, dtype=_params.STRUCTS["FwdParams"])[0]


def test_a_decoding_call_splits_its_keys_and_packs_its_query_heads(fake):
    """One query row a sequence, 32 query heads over 8 K/V heads, a long cache: the decoding partial
    kernel (its warps split each key tile) over the key splits, each query block's last split merging
    them (split_counters, zeroed once a stream: no combine kernel); its rows are each K/V head's 4 query
    heads (packed GQA: dims see 8 heads of 4 rows, the K/V head read once for them)."""
    dev, launches = fake
    q = dev.empty((1, 32, 1, 128), np.float16)
    k, v = (dev.empty((1, 8, 16384, 128), np.float16) for _ in range(2))
    out, lse = cuflash.attention_forward(q, k, v, causal="bottom_right")
    (partial, params, maps, grid), = launches
    assert partial.kv_split and partial.family == "fwd_decode" and not partial.band and maps is None
    assert partial.tile.block_m == 16
    f = _fwd_fields(params)
    counters = int(f["split_counters"])
    assert counters != 0 and plan._COUNTERS[(0, 0)].data.ptr == counters and plan._COUNTERS[(0, 0)].size >= 8
    splits, split_tiles = int(f["num_splits"]), int(f["split_tiles"])
    tiles = -(-16384 // partial.tile.block_n)
    assert splits > 1 and split_tiles == -(-tiles // splits)
    assert grid == splits * 8          # one query block of 4 rows a K/V head
    dims = f["dims"]
    assert (int(dims["heads_q"]), int(dims["group"]), int(dims["lq"])) == (8, 1, 4)
    assert int(f["q"]["head_stride"]) == 4 * 128 and int(f["q"]["row_stride"]) == 128
    assert int(f["out"]["head_stride"]) == 4 * 128 and int(f["lse"]["head_stride"]) == 4
    assert int(f["out_partial"]["batch_stride"]) == 8 * 4 * 128 and int(f["out_partial"]["ptr"]) != 0
    assert int(f["lse_partial"]["batch_stride"]) == 8 * 4 and int(f["lse_partial"]["ptr"]) != 0
    # one buffer: lse's partials 256-byte aligned past O's
    o_bytes = splits * 8 * 4 * int(f["out_partial"]["row_stride"]) * 4
    gap = int(f["lse_partial"]["ptr"]) - int(f["out_partial"]["ptr"])
    assert gap >= o_bytes and gap % 256 == 0 and gap - o_bytes < 256
    assert out.shape == (1, 32, 1, 128) and lse.shape == (1, 32, 1) and lse.dtype == np.float32
    # replayed: the same kernel, fresh partial buffers, the same counters
    cuflash.attention_forward(q, k, v, causal="bottom_right")
    assert [x[0] for x in launches[1:]] == [partial]
    g = _fwd_fields(launches[1][1])
    assert int(g["out_partial"]["ptr"]) not in (0, int(f["out_partial"]["ptr"]))
    assert int(g["split_counters"]) == counters


@pytest.mark.parametrize("blocks, key_tiles, slots, expected", [
    (8, 2048, 396, 16),    # 128 CTAs: one an SM but 4
    (64, 512, 396, 2),     # 128 CTAs
    (128, 128, 396, 1),    # every SM but 4 has a block already
    (100, 512, 264, 1),    # a second split would spill past one wave of 264 slots
    (8, 4, 396, 4),        # no more splits than key tiles
    (1, 4096, 396, 125),   # one CTA an SM on all but 7 (within SPLIT_BALANCE of even; 126 splits take 33 tiles too)
    (200, 512, 396, 5),    # more blocks than SMs: 1000 CTAs, 2.53 waves of 396 slots (1.52 for two splits)
    (384, 128, 264, 2),    # 768 CTAs, 2.91 waves of 264 (one split: 1.45 waves)
    (512, 128, 264, 1),    # 1.94 waves of 264 already
])
def test_a_streaming_partial_kernel_takes_one_even_wave(blocks, key_tiles, slots, expected):
    """The decoding kernel's split count (select.split_count with sms): the fewest splits within one wave
    whose CTAs spread evenly over the SMs (132 SMs); more blocks than SMs, the fewest splits within
    SPLIT_MAX_WAVES waves whose last wave is nearly full."""
    assert select.split_count(blocks, key_tiles, slots, sms=132) == expected
    assert select.split_count(128, 128, 396, sms=132, min_splits=2) == 2   # packed rows: the split path
    assert select.split_count(512, 64, 396, sms=132, min_splits=2) == 3    # a full GPU: 1536 CTAs, 3.9 waves
    assert select.split_count(512, 1, 396, sms=132, min_splits=2) == 1     # one key tile: nothing to split


@settings(max_examples=300, deadline=None)
@given(blocks=st.integers(1, 2000), key_tiles=st.integers(1, 5000), ctas=st.integers(1, 4),
       streams=st.booleans(), min_splits=st.sampled_from([1, 2]))
def test_split_counts_stay_in_range(blocks, key_tiles, ctas, streams, min_splits):
    """Any call: a count in [1, min(MAX_SPLITS, key tiles)], at least min_splits where there are two tiles
    to split, and the streaming rule's count within one wave where one wave holds min_splits."""
    slots = 132 * ctas
    n = select.split_count(blocks, key_tiles, slots, sms=132 if streams else None, min_splits=min_splits)
    assert 1 <= n <= max(1, min(select.MAX_SPLITS, key_tiles))
    if key_tiles >= 2 and min_splits == 2:
        assert n >= 2
    if streams and blocks <= 132 and blocks * min_splits <= slots and key_tiles >= 2:
        assert blocks * n <= slots   # one wave
    if streams and blocks > 132 and blocks * min_splits <= select.SPLIT_MAX_WAVES * slots:
        assert blocks * n <= select.SPLIT_MAX_WAVES * slots


@pytest.mark.parametrize("num_splits", [1, 2, 7, 256])
def test_num_splits_is_taken_as_given(fake, num_splits):
    dev, launches = fake
    q, k, v = _qkv(dev, (2, 4, 100, 64))
    cuflash.attention_forward(q, k, v, causal=True, num_splits=num_splits)
    if num_splits == 1:
        assert len(launches) == 1 and not launches[0][0].kv_split
        return
    (partial, params, _, grid), (combine, _, _, _) = launches
    f = _fwd_fields(params)
    assert int(f["num_splits"]) == num_splits and partial.band     # causal, 100 x 100: the band stays
    assert int(f["dims"]["heads_q"]) == 4 and int(f["dims"]["lq"]) == 100     # a band: no packing
    assert grid == num_splits * partial.grid(2, 4, 1, 100, 100)
    assert int(f["split_tiles"]) == -(-(-(-100 // partial.tile.block_n)) // num_splits)


def test_unpacked_blocks_that_fill_the_sms_take_one_split_of_the_decoding_kernel(fake):
    """One query head a block (no GQA to pack) and a block for every SM: the decoding kernel over one split,
    which writes out and lse itself; more query rows than plan.UNPACKED_ONE_SPLIT_ROWS, the unsplit kernel; K/V
    heads shared by four query heads each, the decoding kernel too (benchmarks/bench_decode.py)."""
    dev, launches = fake
    q = dev.empty((4, 32, 1, 128), np.float16)
    k, v = (dev.empty((4, 32, 8192, 128), np.float16) for _ in range(2))
    cuflash.attention_forward(q, k, v)
    (variant, params, _, grid), = launches
    assert variant.family == "fwd_decode" and grid == 4 * 32 and int(_fwd_fields(params)["out_partial"]["ptr"]) == 0
    launches.clear()
    rows = plan.UNPACKED_ONE_SPLIT_ROWS + 1
    cuflash.attention_forward(dev.empty((4, 32, rows, 128), np.float16), k, v)
    assert len(launches) == 1 and not launches[0][0].kv_split
    launches.clear()
    q = dev.empty((16, 32, 1, 128), np.float16)
    k, v = (dev.empty((16, 8, 8192, 128), np.float16) for _ in range(2))
    cuflash.attention_forward(q, k, v)
    assert launches[0][0].kv_split and launches[0][0].family == "fwd_decode"


@pytest.mark.parametrize("head", [64, 128])
def test_decoding_blocks_that_fill_the_gpu_take_a_tile_of_several_ctas(fake, head):
    """16-bit decoding: a few long splits stream on one CTA an SM (the table's first tile); blocks that fill the
    GPU already (B=64, 8 K/V heads) take the tile of several CTAs an SM, whose CTAs hide each other's start."""
    dev, launches = fake
    chosen = {}
    for batch in (8, 64):
        launches.clear()
        q = dev.empty((batch, 32, 1, head), np.float16)
        k, v = (dev.empty((batch, 8, 4096, head), np.float16) for _ in range(2))
        cuflash.attention_forward(q, k, v)
        partial = launches[0][0]
        assert partial.family == "fwd_decode"
        chosen[batch] = partial.tile
    assert chosen[8].ctas == 1 and chosen[64].ctas > 1


def test_the_variant_sweeps_split_problems_launch_their_variants(fake, monkeypatch):
    """tests/test_variants_gpu.py runs each split-KV variant on the problem _variant_problems.problem_for
    predicts for it and asserts that variant launched: on the fake device the plan's own launches for those
    problems (contiguous (B, H, L, D) arrays, as the GPU checks make them) include every plain split variant,
    the decoding kernel's tiles (query-minor, 16-row strip) and the query heads packed under a band included."""
    dev, launches = fake
    missed = []
    for v in select.all_variants():
        if not v.kv_split or v.extra:
            continue
        p = vp.problem_for(v)
        if p.precision not in ("highest", "tf32"):
            continue
        monkeypatch.setattr(device, "device_facts",
                            lambda device_id, p=p: (p.cc, p.smem_limit, "fake", vp.FULL_SMS if p.full else 132))
        dt = {"bfloat16": ml_dtypes.bfloat16}.get(p.dtype, p.dtype)
        q = dev.empty((vp.BATCH, vp.HEADS_Q, p.lq, p.d), dt)
        k = dev.empty((vp.BATCH, vp.HEADS_K, p.lk, p.d), dt)
        w = dev.empty((vp.BATCH, vp.HEADS_K, p.lk, p.dv), dt)
        launches.clear()
        plan.clear_plans()
        cuflash.attention_forward(q, k, w, causal=p.causal, num_splits=p.num_splits, precision=p.precision)
        if v not in [launched[0] for launched in launches]:
            missed.append(v.name)
    assert not missed, missed


def test_a_float32_decoding_call_takes_the_decoding_kernel(fake):
    """float32 at precision "highest": the decoding kernel on 3xTF32 (the warps splitting each key tile), on
    its query-minor tile for blocks of at most 8 query rows (one query row of 4 heads a K/V head) and on the
    16-row strip above (4 rows of 4 heads); "tf32" keeps the TF32 split twin."""
    dev, launches = fake
    q = dev.empty((1, 32, 1, 128), np.float32)
    k, v = (dev.empty((1, 8, 16384, 128), np.float32) for _ in range(2))
    cuflash.attention_forward(q, k, v)
    (partial, *_), = launches
    assert partial.family == "fwd_decode" and partial.dtype == "float32" and partial.tile.block_m == 8
    launches.clear()
    cuflash.attention_forward(dev.empty((1, 32, 4, 128), np.float32), k, v)
    assert launches[0][0].family == "fwd_decode" and launches[0][0].tile.block_m == 16
    launches.clear()
    cuflash.attention_forward(q, k, v, precision="tf32")
    assert launches[0][0].family == "fwd_tf32" and launches[-1][0].family == "fwd_combine"


def test_a_causal_band_over_few_query_rows_still_packs_the_query_heads(fake):
    """Three new query rows a sequence (causal, bottom right) of 32 query heads over 8 K/V heads: the
    decoding kernel's strip holds a K/V head's 4 query heads x 3 positions, the band reading a row's
    position as row % 3 (MaskParams::band_period); 5 rows (20 packed) alike on its tile of two strips (32 rows
    at head dim 128), 16 (64 packed) on the 16-bit portable split twin; float32's split twin reads no period:
    5 rows of 2 query heads in the decoding kernel's strip instead of 4 heads' 20 rows. 128 query heads over 8 (16 a K/V head) of 16 rows: as many heads as fill one
    block of the portable kernel, so that the keys still split."""
    dev, launches = fake
    q = dev.empty((2, 32, 3, 128), np.float16)
    k, v = (dev.empty((2, 8, 16384, 128), np.float16) for _ in range(2))
    cuflash.attention_forward(q, k, v, causal="bottom_right")
    (partial, params, _, grid), = launches
    assert partial.family == "fwd_decode" and partial.band
    f = _fwd_fields(params)
    assert int(f["mask"]["band_period"]) == 3
    assert (int(f["dims"]["heads_q"]), int(f["dims"]["lq"])) == (8, 12)
    for lq, family in ((5, "fwd_decode"), (16, "fwd_mma")):   # 20 rows: two strips; 64: the split twin's block
        launches.clear()
        q = dev.empty((2, 32, lq, 128), np.float16)
        cuflash.attention_forward(q, k, v, causal="bottom_right")
        partial = launches[0][0]
        assert partial.family == family and partial.tile.block_m >= 4 * lq and partial.kv_split and partial.band
        assert not partial.extra
        f = _fwd_fields(launches[0][1])
        assert int(f["mask"]["band_period"]) == lq
        assert (int(f["dims"]["heads_q"]), int(f["dims"]["lq"])) == (8, 4 * lq)
    launches.clear()
    q = dev.empty((2, 32, 5, 128), np.float32)
    k, v = (dev.empty((2, 8, 16384, 128), np.float32) for _ in range(2))
    cuflash.attention_forward(q, k, v, causal="bottom_right", num_splits=4)
    f = _fwd_fields(launches[0][1])
    assert launches[0][0].family == "fwd_decode"
    assert int(f["mask"]["band_period"]) == 5 and (int(f["dims"]["heads_q"]), int(f["dims"]["lq"])) == (16, 10)
    for causal in (False, "bottom_right"):
        launches.clear()
        q = dev.empty((1, 128, 16, 128), np.float16)
        k, v = (dev.empty((1, 8, 65536, 128), np.float16) for _ in range(2))
        cuflash.attention_forward(q, k, v, causal=causal)
        partial, params, _, grid = launches[0]
        f = _fwd_fields(params)
        rows = int(f["dims"]["lq"])
        assert rows == 16 * (128 // int(f["dims"]["heads_q"])) and 16 < rows <= 128   # the portable block's 128
        assert int(f["num_splits"]) > 1 and grid >= device.sm_count()


@pytest.mark.parametrize("num_splits", [None, 1])
def test_a_large_batch_of_packed_rows_takes_one_split_of_the_decoding_kernel(fake, num_splits):
    """64 sequences, 32 query heads over 8 K/V heads, one query row: 512 blocks fill the GPU, but the unsplit
    kernels would read each K/V head by its 4 query heads apart; the decoding kernel over one split reads it
    once, on a tile of several CTAs an SM, and writes out and lse itself (no partial buffers, no counters)."""
    dev, launches = fake
    q = dev.empty((64, 32, 1, 128), np.float16)
    k, v = (dev.empty((64, 8, 4096, 128), np.float16) for _ in range(2))
    out, lse = cuflash.attention_forward(q, k, v, num_splits=num_splits)
    (partial, params, _, grid), = launches
    f = _fwd_fields(params)
    assert partial.family == "fwd_decode" and partial.tile.ctas > 1
    assert grid == 64 * 8 and int(f["num_splits"]) == 1
    assert int(f["out_partial"]["ptr"]) == 0 and int(f["split_counters"]) == 0
    assert int(f["out"]["ptr"]) == out.data.ptr and int(f["lse"]["ptr"]) == lse.data.ptr
    assert int(f["dims"]["heads_q"]) == 8 and int(f["dims"]["lq"]) == 4     # 4 query heads a block's rows
    cuflash.attention_forward(q, k, v, num_splits=2)
    partial, params, _, grid = launches[-1]
    assert grid == 2 * 64 * 8 and int(_fwd_fields(params)["split_counters"]) != 0


def test_a_long_query_block_stays_unsplit(fake):
    """Prefill: the query blocks fill the GPU or take the Hopper kernel; no split unless asked."""
    dev, launches = fake
    q, k, v = _qkv(dev, (1, 2, 1100, 64))
    cuflash.attention_forward(q, k, v)
    assert [x[0].family for x in launches] == ["fwd_wgmma"]


@pytest.mark.parametrize("bad, err", [(0, ValueError), (257, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_num_splits_is_refused(fake, bad, err):
    dev, launches = fake
    q, k, v = _qkv(dev, (1, 2, 10, 64))
    with pytest.raises(err, match="num_splits"):
        cuflash.attention_forward(q, k, v, num_splits=bad)
    assert not launches


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lq, lk", [(50, 300), (5, 5000)])
def test_a_16_bit_forward_in_the_accumulator_type_is_the_unsplit_calls_kernel(fake, d, lq, lk):
    """forward_in_accumulator runs the kernel that attention_forward(num_splits=1) runs, writing O in float32:
    the Hopper forward's float32-output twin, or where one split of the decoding kernel takes the call (5 rows
    of 4 query heads at head dim 128, on its 32-row tile) that kernel's partial buffers."""
    dev, launches = fake
    q = dev.empty((2, 8, lq, d), np.float16)
    k, v = (dev.empty((2, 2, lk, d), np.float16) for _ in range(2))
    out, lse = cuflash.api.forward_in_accumulator(q, k, v, window=(None, 0))
    (variant, params, maps, grid), = launches
    cuflash.attention_forward(q, k, v, window=(None, 0), num_splits=1)
    plain = launches[-1][0]
    assert out.shape == (2, 8, lq, d) and out.dtype == np.float32 and lse.dtype == np.float32
    f = _fwd_fields(params)
    if (lq, d) == (5, 128):
        assert variant == plain and variant.family == "fwd_decode" and variant.band
        assert int(f["out"]["ptr"]) == 0 and int(f["out_partial"]["ptr"]) != 0 and int(f["num_splits"]) == 1
        return
    assert variant.family == "fwd_wgmma" and variant.acc_out and variant.band and plain == replace(variant,
                                                                                                   acc_out=False)
    assert variant.name.endswith(", false, true>")   # PACKED false, ACC_OUT true
    assert not any(maps[384:])   # O leaves from the registers: its map left as zeros
    assert out.data.ptr == int(f["out"]["ptr"])


def test_a_float32_forward_in_the_accumulator_type_is_the_plain_forward(fake):
    dev, launches = fake
    q, k, v = (dev.empty((2, 8, 50, 64), np.float32) for _ in range(3))
    out, _ = cuflash.api.forward_in_accumulator(q, k, v, causal=True)
    cuflash.attention_forward(q, k, v, causal=True)
    assert launches[0][0] == launches[1][0] and not launches[0][0].kv_split and out.dtype == np.float32


def test_a_forward_in_the_accumulator_type_is_one_split_without_combine(fake):
    """Off the Hopper forward (here: a bias, EXTRA): the portable kernel's split twin, one split."""
    dev, launches = fake
    q = dev.empty((2, 8, 50, 64), np.float16)
    k, v = (dev.empty((2, 2, 300, 64), np.float16) for _ in range(2))
    bias = dev.empty((2, 8, 50, 300), np.float16)
    out, lse = cuflash.api.forward_in_accumulator(q, k, v, causal=True, bias=bias)
    (partial, params, maps, grid), = launches
    assert partial.kv_split and maps is None and int(_fwd_fields(params)["num_splits"]) == 1
    assert out.shape == (2, 8, 50, 64) and out.dtype == np.float32 and lse.dtype == np.float32
    assert out.data.ptr == int(_fwd_fields(params)["out_partial"]["ptr"])


def test_key_lengths_go_to_the_split_kernels_by_address(fake):
    """A KV cache of ragged lengths: the split-KV kernels (one split too) read each sequence's key count
    from the array the call passes (MaskParams::key_lengths), written a call like the arrays'."""
    dev, launches = fake
    q = dev.empty((2, 8, 1, 128), np.float16)
    k, v = (dev.empty((2, 2, 4096, 128), np.float16) for _ in range(2))
    for _ in range(2):
        lengths = dev.empty((2,), np.int32)
        cuflash.api.forward_with_key_lengths(q, k, v, lengths, causal="bottom_right", num_splits=1)
        partial, params, _, _ = launches[-1]      # one split: the decoding kernel writes out and lse itself
        f = _fwd_fields(params)
        assert partial.kv_split and partial.family == "fwd_decode" and not partial.band
        assert int(f["split_counters"]) == 0 and int(f["out_partial"]["ptr"]) == 0
        assert int(f["out"]["ptr"]) != 0 and int(f["lse"]["ptr"]) != 0
        assert int(f["mask"]["key_lengths"]) == lengths.data.ptr
        assert int(f["dims"]["lq"]) == 4 and int(f["dims"]["heads_q"]) == 2     # packed: 4 query heads a K/V head
    with pytest.raises(TypeError, match="int32"):
        cuflash.api.forward_with_key_lengths(q, k, v, dev.empty((2,), np.int64))


def test_a_paged_cache_goes_to_the_split_kernels_by_page_table(fake):
    """Pages (num_pages, Hk, page_size, D) read in place: the views' batch stride is a page's, the page
    table's address is written a call, page size and pages a sequence packed, float64 on the decoding kernel
    too; float64 at head dim 256 (the fp64 split twin's own loader), K / V of different strides, pages of a
    size other than a power of two and offsets within a page past 32 bits are refused, for the caller to
    gather the pages."""
    dev, launches = fake
    q = dev.empty((2, 8, 1, 128), np.float16)
    k, v = (dev.empty((40, 2, 16, 128), np.float16) for _ in range(2))
    table, lengths = dev.empty((2, 20), np.int32), dev.empty((2,), np.int32)
    cuflash.api.forward_with_key_lengths(q, k, v, lengths, causal="bottom_right", page_table=table)
    partial, params, _, _ = launches[-1]
    f = _fwd_fields(params)
    assert partial.kv_split and partial.family == "fwd_decode"
    assert int(f["mask"]["page_table"]) == table.data.ptr and int(f["mask"]["key_lengths"]) == lengths.data.ptr
    assert (int(f["mask"]["page_size"]), int(f["mask"]["pages_per_seq"]), int(f["mask"]["num_pages"])) == (16, 20, 40)
    assert int(f["k"]["batch_stride"]) == 2 * 16 * 128 and int(f["dims"]["lk"]) == 20 * 16
    q64 = dev.empty((2, 8, 1, 128), np.float64)
    k64, v64 = (dev.empty((40, 2, 16, 128), np.float64) for _ in range(2))
    cuflash.api.forward_with_key_lengths(q64, k64, v64, lengths, causal="bottom_right", page_table=table)
    partial, params, _, _ = launches[-1]
    assert partial.family == "fwd_decode" and partial.dtype == "float64"
    assert (partial.tile.block_n, partial.tile.warps) == (48, 6)   # 16 rows a thread: one page entry from pages of 16
    assert int(_fwd_fields(params)["mask"]["page_table"]) == table.data.ptr
    q256 = dev.empty((2, 8, 1, 256), np.float64)
    k256, v256 = (dev.empty((40, 2, 16, 256), np.float64) for _ in range(2))
    with pytest.raises(ValueError, match="reads no such paged cache"):
        cuflash.api.forward_with_key_lengths(q256, k256, v256, lengths, causal="bottom_right", page_table=table)
    v_wide = dev.empty((40, 2, 16, 256), np.float16)[..., :128]      # V's strides differ from K's
    with pytest.raises(ValueError, match="reads no such paged cache"):
        cuflash.api.forward_with_key_lengths(q, k, v_wide, lengths, causal="bottom_right", page_table=table)
    k24, v24 = (dev.empty((40, 2, 24, 128), np.float16) for _ in range(2))   # pages of 24: not a power of two
    with pytest.raises(ValueError, match="reads no such paged cache"):
        cuflash.api.forward_with_key_lengths(q, k24, v24, lengths, causal="bottom_right", page_table=table)
    # a head-major pool (Hk, num_pages, page_size, D) seen page-major: its heads 2^28 elements apart, past 32 bits
    pool_k, pool_v = (dev.empty((16, 2 ** 17, 16, 128), np.float16).swapaxes(0, 1) for _ in range(2))
    q16 = dev.empty((2, 16, 1, 128), np.float16)
    with pytest.raises(ValueError, match="reads no such paged cache"):
        cuflash.api.forward_with_key_lengths(q16, pool_k, pool_v, lengths, causal="bottom_right", page_table=table)


def _kvcache_arrays(dev, paged: bool, dtype=np.float16):
    q = dev.empty((2, 8, 1, 128), dtype)
    shape = (40, 2, 16, 128) if paged else (2, 2, 320, 128)
    k, v = (dev.empty(shape, dtype) for _ in range(2))
    table = dev.empty((2, 20), np.int32) if paged else None
    return q, k, v, dev.empty((2,), np.int32), table


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window", [None, (64, None)])
def test_a_repeated_kvcache_call_launches_what_the_full_path_did(fake, monkeypatch, paged, window):
    """attention_with_kvcache keeps a checked call's plan by its signature: a repeated call (other
    arrays, the same shapes, strides and dtypes) is not checked again but for its values, and launches the
    full path's variant, grid and params but for the addresses (q, k, v, the lengths, the page table),
    which are the new arrays'."""
    dev, launches = fake
    first = _kvcache_arrays(dev, paged)
    cuflash.attention_with_kvcache(*first[:3], cache_seqlens=first[3], block_table=first[4], causal=True,
                                   window=window, validate=False)
    assert len(plan._CALL_PLANS) == 1
    monkeypatch.setattr(options, "forward_call", lambda *a, **kw: pytest.fail("checked again"))
    q, k, v, lengths, table = again = _kvcache_arrays(dev, paged)
    out, lse = cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table, causal=True,
                                              window=window, validate=False, return_lse=True)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((2, 8, 1, 128), np.float16, (2, 8, 1), np.float32)
    (var1, params1, _, grid1), (var2, params2, _, grid2) = launches
    assert var2 is var1 and var1.kv_split and grid2 == grid1
    f2 = _fwd_fields(params2)
    assert [int(f2[n]["ptr"]) for n in ("q", "k", "v")] == [x.data.ptr for x in again[:3]]
    assert int(f2["mask"]["key_lengths"]) == lengths.data.ptr
    assert int(f2["mask"]["page_table"]) == (table.data.ptr if paged else 0)
    addresses = plan._FWD_ADDRESSES + plan._FWD_PARTIALS + plan._FWD_KEY_LENGTHS + plan._FWD_PAGE_TABLE
    assert _without(params2, addresses) == _without(params1, addresses)


@pytest.mark.parametrize("change, error", [
    (dict(causal=1), TypeError), (dict(window=(64.0, None)), ValueError), (dict(num_splits=2.0), TypeError),
    (dict(scale=1), None), (dict(num_splits=np.int64(2)), None), (dict(window=[64, None]), None)])
def test_a_kvcache_call_of_another_signature_is_checked(fake, change, error):
    """Options of another type than the remembered call's (equal as dict keys) take the full path: its
    errors, or a call of its own; the remembered plan stays."""
    dev, launches = fake
    q, k, v, lengths, table = _kvcache_arrays(dev, True)
    base = dict(cache_seqlens=lengths, block_table=table, causal=True, window=(64, None), num_splits=2, scale=1.0,
                validate=False)
    cuflash.attention_with_kvcache(q, k, v, **base)
    kept = dict(plan._CALL_PLANS)
    if error is not None:
        with pytest.raises(error):
            cuflash.attention_with_kvcache(q, k, v, **{**base, **change})
    else:
        cuflash.attention_with_kvcache(q, k, v, **{**base, **change})
    assert all(plan._CALL_PLANS[key] is value for key, value in kept.items())


def test_a_bad_int_length_is_refused_before_the_lengths_are_written(fake, monkeypatch):
    """An int cache_seqlens out of range is refused before its value reaches the device (the driver's memset
    into the lengths buffer, kvcache._filled), on the full path and on a remembered call's."""
    from cuflash import kvcache

    dev, launches = fake
    q, k, v, _, _ = _kvcache_arrays(dev, False)
    written = []
    monkeypatch.setattr(kvcache, "_filled", lambda value, batch, cupy: written.append(value) or dev.empty((batch,),
                                                                                                        np.int32))
    for _ in range(2):
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=5)
    assert written == [5, 5] and len(plan._CALL_PLANS) == 1 and len(launches) == 2
    for bad, match in ((-1, ">= 0"), (321, "past the cache's 320")):
        with pytest.raises(ValueError, match=match):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=bad)
    assert written == [5, 5] and len(launches) == 2


@pytest.mark.parametrize("paged", [False, True])
def test_host_lengths_and_tables_are_checked_on_the_host_and_uploaded(fake, monkeypatch, paged):
    """NumPy lengths (and a NumPy table) with CuPy caches: checked on the host even with validate=False, before
    anything is uploaded; the kernels read the uploaded copies (kvcache._uploaded); a repeated call of the same
    signature is remembered."""
    from cuflash import kvcache

    dev, launches = fake
    q, k, v, _, _ = _kvcache_arrays(dev, paged)
    uploads = []

    def upload(values, cupy, device_id):
        uploads.append(values.copy())
        return dev.empty(values.shape, np.int32)

    monkeypatch.setattr(kvcache, "_uploaded", upload)
    lengths = np.array([5, 300], dtype=np.int64)
    table = np.arange(40, dtype=np.int32).reshape(2, 20) if paged else None
    for _ in range(2):
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table, validate=False)
    assert len(launches) == 2 and len(plan._CALL_PLANS) == 1
    assert [u.tolist() for u in uploads[:1 + paged]] == [lengths.tolist()] + ([table.tolist()] if paged else [])
    f = _fwd_fields(launches[-1][1])
    assert int(f["mask"]["key_lengths"]) != 0 and (int(f["mask"]["page_table"]) != 0) == paged
    uploads.clear()
    for bad, match in ((np.array([5, 321]), "past the cache's 320"), (np.array([-1, 3]), ">= 0")):
        with pytest.raises(ValueError, match=match):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=bad, block_table=table, validate=False)
    if paged:
        with pytest.raises(ValueError, match="outside"):
            cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=np.full_like(table, 40),
                                           validate=False)
    assert not uploads and len(launches) == 2


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("lengths_kind", ["cupy", "int", "numpy"])
def test_an_append_is_one_kernel_before_the_attention(fake, monkeypatch, paged, lengths_kind):
    """k_new / v_new go into the caches by one launch of kernels_cu/kv_append.cu (the fake device runs no CuPy
    kernel): its params name the new rows and the caches with their strides in elements ((B, L, H, D) stores
    seen through swapaxes, new rows cut from wider ones, a last-axis stride of 2), the lengths (an int as a
    value), the page table and the key counts it writes, which the attention kernel then reads; a repeated
    call of the signature (remembered) does the same with its own arrays."""
    from cuflash import kvcache

    dev, launches = fake
    monkeypatch.setattr(kvcache, "_STREAM_BUFFERS", {})
    uploaded = []
    monkeypatch.setattr(kvcache, "_uploaded", lambda values, cupy, device_id: uploaded.append(
        dev.empty(values.shape, np.int32)) or uploaded[-1])
    store = (40, 16, 2, 128) if paged else (2, 320, 2, 128)
    for v_step in (1, 1, 2):
        launches.clear()
        q = dev.empty((2, 8, 3, 128), np.float16)
        k, v = (dev.empty(store, np.float16).swapaxes(1, 2) for _ in range(2))
        k_new = dev.empty((2, 2, 3, 192), np.float16)[..., :128]
        v_new = dev.empty((2, 2, 3, 136 * v_step), np.float16)[..., 8 * v_step::v_step]
        table = dev.empty((2, 20), np.int32) if paged else None
        lengths = {"cupy": dev.empty((2,), np.int32), "int": 5, "numpy": np.array([5, 300])}[lengths_kind]
        cuflash.attention_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=lengths, block_table=table, causal=True,
                                       validate=False)
        (append, params, _, grid), (attend, attend_params, _, _) = launches
        assert append.name == "kv_append<unsigned short>" and attend.kv_split and grid == 2 * 2 * 3
        f = np.frombuffer(params, dtype=_params.STRUCTS["KvAppendParams"])[0]
        for name, x in (("k_new", k_new), ("v_new", v_new), ("k_cache", k), ("v_cache", v)):
            assert int(f[name]["ptr"]) == x.data.ptr
            assert f[name]["strides"].tolist() == [s // 2 for s in x.strides], name
        assert f["v_new"]["strides"][2:].tolist() == [136 * v_step, v_step] and f["k_cache"]["strides"][1] == 128
        if lengths_kind == "int":
            assert int(f["lengths"]) == 0 and int(f["length"]) == 5
        else:   # the lengths array (NumPy lengths: their uploaded copy)
            assert int(f["lengths"]) == (lengths if lengths_kind == "cupy" else uploaded[-1]).data.ptr
        assert int(f["page_table"]) == (table.data.ptr if paged else 0)
        assert [int(f[n]) for n in ("batch", "heads", "n_new", "d", "dv", "cap", "page_size", "pages_per_seq",
                                    "num_pages")] == [2, 2, 3, 128, 128, 320] + ([16, 20, 40] if paged else [1, 0, 0])
        assert int(f["total"]) != 0 and int(_fwd_fields(attend_params)["mask"]["key_lengths"]) == int(f["total"])
        assert len(plan._CALL_PLANS) == 1   # the unit-stride calls' signature (a last-axis step of 2 has none)


def test_lengths_and_tables_on_another_device_are_refused(fake):
    """The kernels read cache_seqlens and block_table by address: CuPy arrays of them on another device than q's
    are refused before anything is written or launched."""
    from cupy.cuda import memory

    dev, launches = fake
    q, k, v, lengths, table = _kvcache_arrays(dev, True)
    elsewhere = cp.ndarray((2, 20), np.int32, memory.MemoryPointer(memory.UnownedMemory(dev.next, 160, None,
                                                                                         device_id=1), 0))
    with pytest.raises(ValueError, match="block_table is on device 1"):
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=elsewhere, validate=False)
    with pytest.raises(ValueError, match="cache_seqlens is on device 1"):
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=elsewhere[:, 0], block_table=table, validate=False)
    assert not launches


def test_a_kvcache_call_of_other_shapes_is_checked(fake):
    dev, _ = fake
    q, k, v, lengths, table = _kvcache_arrays(dev, False)
    cuflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, validate=False)
    with pytest.raises(ValueError, match="must have shape"):
        cuflash.attention_with_kvcache(q, k, v, cache_seqlens=dev.empty((3,), np.int32), validate=False)
    with pytest.raises(ValueError, match="not a multiple"):
        cuflash.attention_with_kvcache(dev.empty((2, 7, 1, 128), np.float16), k, v, cache_seqlens=lengths,
                                       validate=False)
    with pytest.raises(TypeError, match="dtype"):
        cuflash.attention_with_kvcache(q, k, dev.empty((2, 2, 320, 128), np.float32), cache_seqlens=lengths,
                                       validate=False)
    select.clear_selection_caches()
    assert not plan._CALL_PLANS


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_backward_without_the_bias_gradient_launches_no_dbias_work(fake, dtype):
    """bias_grad=False: the bias still shapes the recomputed scores, but no dbias kernel runs and the
    params carry no dbias accumulator (DbiasParams off)."""
    dev, launches = fake
    q, k, v, out, dout = (dev.empty((2, 4, 300, 64), dtype) for _ in range(5))
    lse = dev.empty((2, 4, 300), np.float64 if dtype == np.float64 else np.float32)
    bias = dev.empty((1, 4, 300, 300), dtype)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, bias_grad=False)
    assert len(grads) == 3
    assert all(x[0].family != "bwd_dbias_mma" and x[0].extra for x in launches if x[0].family.startswith("bwd_dkdv")
               or x[0].family == "bwd_dbias_mma")
    params = [x[1] for x in launches if x[0].family.startswith("bwd_dkdv")][0]
    fields = np.frombuffer(params, dtype=_params.STRUCTS["BwdParams"], count=1)[0]
    assert int(fields["dbias"]["mode"]) == 0 and int(fields["mask"]["bias"]["ptr"]) == bias.data.ptr


def test_combine_kernel_holds_every_split():
    """The combine (combine.cuh) keeps the weights of options.MAX_SPLITS splits in registers: its bound is
    the same."""
    import re
    from cuflash._runtime.build import kernel_dir
    src = (kernel_dir() / "combine.cuh").read_text()
    assert int(re.search(r"constexpr int MAX_SPLITS = (\d+);", src).group(1)) == options.MAX_SPLITS


@pytest.fixture
def uploads(fake, monkeypatch):
    """The host arrays copied to the (fake) device, as (address, a copy of the array): cp.asarray recorded."""
    dev, _ = fake
    seen = []

    def upload(x):
        arr = dev.empty(np.shape(x), np.asarray(x).dtype)
        seen.append((arr.data.ptr, np.array(x)))
        return arr

    monkeypatch.setattr(cp, "asarray", upload)
    return seen


@pytest.mark.parametrize("causal,window,band_from_end", [(False, None, 0), (True, None, 0), ("bottom_right", None, 1),
                                                         (False, (5, 2), 0), ("bottom_right", (7, None), 1)])
@pytest.mark.parametrize("hopper", [True, False])
def test_packed_forward_launches_one_kernel_over_the_block_table(fake, uploads, monkeypatch, causal, window,
                                                                band_from_end, hopper):
    """16-bit packed sequences: one PACKED launch (fwd_wgmma on Hopper, its tensor maps describing each packed
    (total, H, D) array as (D, total, H, 1), on the short-rows tile a CTA a block: the longest sequence has
    1000 keys; fwd_mma
    elsewhere, (table entries) x (query heads) CTAs); the block count in the params; q, k, v, out and lse
    seen with a batch stride of one row; the band through (0, 0), moved per sequence where aligned to the
    end; the table the host built, at the address the params hold."""
    from cuflash import varlen
    from cuflash._dispatch import packed
    dev, launches = fake
    if not hopper:
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    hq, hk, d = 8, 2, 64
    cu_q = np.array([0, 300, 301, 301, 1400], dtype=np.int32)
    cu_k = np.array([0, 500, 501, 900, 1900], dtype=np.int32)
    q = dev.empty((int(cu_q[-1]), hq, d), np.float16)
    k, v = (dev.empty((int(cu_k[-1]), hk, d), np.float16) for _ in range(2))
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, window=window)
    assert out.shape == (1400, hq, d) and lse.shape == (hq, 1400) and lse.dtype == np.float32
    [(variant, params, maps, grid)] = launches
    assert variant.packed and variant.family == ("fwd_wgmma" if hopper else "fwd_mma")
    assert variant.band == (causal is not False or window is not None)
    assert variant.schedule == "block" and variant.short == hopper
    if hopper:   # the fake encoder's bytes: address, dims (D, rows, H, B), byte strides of rows, heads, batch
        for i, (x, rows, heads) in enumerate(((q, 1400, hq), (k, 1900, hk), (v, 1900, hk))):
            words = struct.unpack_from("=8Q", maps, 128 * i)
            assert words == (x.data.ptr, d, rows, heads, 1, heads * d * 2, d * 2, heads * d * 2)
        assert not any(maps[384:])   # head dim 64: O is stored element by element, its map left as zeros
    else:
        assert maps is None
    [(table_ptr, table)] = uploads
    want = packed.block_table(cu_q, cu_k, variant.tile.block_m, "q", causal is not False)
    np.testing.assert_array_equal(table, want)
    assert grid == (len(want) * hq if variant.schedule == "block" else min(len(want) * hq, device.sm_count()))
    f = np.frombuffer(params, dtype=_params.STRUCTS["FwdParams"])[0]
    assert int(f["mask"]["packed_count"]) == len(want) * hq and int(f["block_queue"]) == 0
    assert int(f["mask"]["packed_blocks"]) == table_ptr and int(f["mask"]["band_from_end"]) == band_from_end
    if window is not None:
        assert int(f["mask"]["band_lo"]) == -window[0]
    if causal is not False:
        assert int(f["mask"]["band_hi"]) == 0
    for name, x, rows in (("q", q, hq * d), ("k", k, hk * d), ("v", v, hk * d), ("out", out, hq * d)):
        assert int(f[name]["ptr"]) == x.data.ptr
        assert int(f[name]["batch_stride"]) == int(f[name]["row_stride"]) == rows, name
    assert int(f["lse"]["batch_stride"]) == int(f["lse"]["row_stride"]) == 1 and int(f["lse"]["head_stride"]) == 1400
    assert (int(f["dims"]["heads_q"]), int(f["dims"]["group"])) == (hq, hq // hk)


def _equal_lengths_packed(dev, d: int):
    """(Hq, Hk, B, Lq, Lk, Dv, cu_q, cu_k, q, k, v): six sequences of 256 queries over 320 keys, GQA 8 / 2, value
    head dim d / 2, packed float16 arrays on the fake device."""
    hq, hk, b, lq, lk, dv = 8, 2, 6, 256, 320, d // 2
    cu_q, cu_k = (np.arange(0, b + 1, dtype=np.int32) * n for n in (lq, lk))
    q = dev.empty((b * lq, hq, d), np.float16)
    k, v = dev.empty((b * lk, hk, d), np.float16), dev.empty((b * lk, hk, dv), np.float16)
    return hq, hk, b, lq, lk, dv, cu_q, cu_k, q, k, v


@pytest.mark.parametrize("d, causal, window", [(64, False, None), (64, True, None), (128, "bottom_right", None),
                                               (128, False, (30, 0))])
@pytest.mark.parametrize("cc", [90, 80])
def test_sequences_of_equal_lengths_run_the_dense_forward_in_place(fake, uploads, monkeypatch, d, causal, window, cc):
    """Six sequences of 256 queries over 320 keys each (value head dim D / 2): one dense launch (no block
    table), q, k and v seen as (B, H, L, D) views of their packed memory, out and lse written where the packed
    call returns them (out (total, Hq, Dv), lse (Hq, total)), the band as a dense call of those lengths has it;
    on Hopper the tensor maps describe the same memory (head dim 128 stores O through one). A call with dropout
    (its mask follows the packed rows) and a call whose lengths differ take the other paths."""
    from cuflash import varlen
    dev, launches = fake
    if cc == 80:
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    hq, hk, b, lq, lk, dv, cu_q, cu_k, q, k, v = _equal_lengths_packed(dev, d)
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, window=window)
    assert out.shape == (b * lq, hq, dv) and out.strides == (hq * dv * 2, dv * 2, 2)
    assert lse.shape == (hq, b * lq) and lse.strides == (b * lq * 4, 4) and lse.dtype == np.float32
    [(variant, params, maps, _)] = launches
    assert not variant.packed and not uploads and variant.family == ("fwd_wgmma" if cc == 90 else "fwd_mma")
    assert variant.band == (causal is not False or window is not None)
    f = np.frombuffer(params, dtype=_params.STRUCTS["FwdParams"])[0]
    for name, x, n, h, dx in (("q", q, lq, hq, d), ("k", k, lk, hk, d), ("v", v, lk, hk, dv), ("out", out, lq, hq, dv)):
        assert int(f[name]["ptr"]) == x.data.ptr, name
        assert (int(f[name]["batch_stride"]), int(f[name]["head_stride"]), int(f[name]["row_stride"])) == \
            (n * h * dx, dx, h * dx), name
    assert int(f["lse"]["ptr"]) == lse.data.ptr
    assert (int(f["lse"]["batch_stride"]), int(f["lse"]["head_stride"]), int(f["lse"]["row_stride"])) == (lq, b * lq, 1)
    assert (int(f["dims"]["batch"]), int(f["dims"]["lq"]), int(f["dims"]["lk"])) == (b, lq, lk)
    assert int(f["mask"]["packed_count"]) == 0 and int(f["mask"]["packed_blocks"]) == 0
    if cc == 90:   # the fake encoder's bytes: address, dims (D, rows, H, B), byte strides of rows, heads, batch
        for i, (x, n, h, dx) in enumerate(((q, lq, hq, d), (k, lk, hk, d), (v, lk, hk, dv))
                                          + (((out, lq, hq, dv),) if d == 128 else ())):
            assert struct.unpack_from("=8Q", maps, 128 * i)[:8] == \
                (x.data.ptr, dx, n, h, b, h * dx * 2, dx * 2, n * h * dx * 2), i
    launches.clear()
    dropout = varlen._Packed(q, k, v, cu_q, cu_k, causal, None, window, 0.1, 3, "highest")
    assert varlen._uniform_forward(dropout, "highest") is None and not launches
    cu_q[1] -= 1
    varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, window=window)
    [(variant, _, _, _)] = launches
    assert variant.packed


@pytest.mark.parametrize("d, causal", [(64, True), (128, False)])
@pytest.mark.parametrize("cc, deterministic", [(90, False), (90, True), (80, False)])
def test_sequences_of_equal_lengths_run_the_dense_backward_in_place(fake, uploads, monkeypatch, d, causal, cc,
                                                                    deterministic):
    """Six sequences of 256 queries over 320 keys (value head dim D / 2): the dense backward's launches (no
    block table, no packed kernel), every array seen as (B, H, L, D) views of its packed memory: q, k, v, out,
    dout read there, lse (Hq, total) as (B, Hq, L), and dq, dk, dv written where the call returns them, (total,
    H, D) arrays."""
    from cuflash import varlen
    dev, launches = fake
    if cc == 80:
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    hq, hk, b, lq, lk, dv, cu_q, cu_k, q, k, v = _equal_lengths_packed(dev, d)
    dout, out = (dev.empty((b * lq, hq, dv), np.float16) for _ in range(2))
    lse = dev.empty((hq, b * lq), np.float32)
    dq, dk, dv_ = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal,
                                                   deterministic=deterministic)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
    assert launches and not uploads and not any(v_.packed for v_, *_ in launches)
    assert launches[0][0].family == "bwd_dsum"
    assert any(v_.family == "bwd_dkdv_wgmma" for v_, *_ in launches) == (cc == 90 and not deterministic)
    for _, params, _, _ in launches:
        f = np.frombuffer(params, dtype=_params.STRUCTS["BwdParams"])[0]
        for name, x, n, h in (("q", q, lq, hq), ("dout", dout, lq, hq), ("out", out, lq, hq), ("k", k, lk, hk),
                              ("v", v, lk, hk), ("dq", dq, lq, hq), ("dk", dk, lk, hk), ("dv", dv_, lk, hk)):
            width = x.shape[2]
            assert int(f[name]["ptr"]) == x.data.ptr, name
            assert (int(f[name]["batch_stride"]), int(f[name]["head_stride"]), int(f[name]["row_stride"])) == \
                (n * h * width, width, h * width), name
        assert int(f["lse"]["ptr"]) == lse.data.ptr
        assert (int(f["lse"]["batch_stride"]), int(f["lse"]["head_stride"]), int(f["lse"]["row_stride"])) == \
            (lq, b * lq, 1)
        assert int(f["mask"]["packed_blocks"]) == 0


@pytest.mark.parametrize("window", [None, (64, 0)])
def test_equal_length_calls_reuse_their_plans(fake, uploads, monkeypatch, window):
    """A packed call of equal lengths repeated (a model's layers), windowed or not: one forward and one backward
    plan, and the repeated call launches what the first did (params equal but for the addresses)."""
    from cuflash import varlen
    dev, launches = fake
    planned = []
    for name in ("plan_forward", "plan_backward"):
        real = getattr(plan, name)
        monkeypatch.setattr(plan, name, lambda *a, real=real, name=name, **kw: planned.append(name) or real(*a, **kw))
    cu = np.arange(0, 9, dtype=np.int32) * 512
    q = dev.empty((4096, 8, 128), np.float16)
    kv = dev.empty((4096, 2, 128), np.float16)
    rounds = []
    for _ in range(3):
        launches.clear()
        out, lse = varlen.attention_varlen_forward(q, kv, kv, cu, cu, causal=True, window=window)
        varlen.attention_varlen_backward(out, q, kv, kv, out, lse, cu, cu, causal=True, window=window)
        rounds.append([(v_, _bwd_without_addresses(p_) if v_.family.startswith("bwd") else _without_addresses(p_), g)
                       for v_, p_, _, g in launches])
    assert planned == ["plan_forward", "plan_backward"]
    assert rounds[0] == rounds[1] == rounds[2] and not any(v_.packed for v_, *_ in rounds[0])


@pytest.mark.parametrize("width, vec", [(72, True), (68, False)])
@pytest.mark.parametrize("cc", [80, 90])
def test_heads_whose_rows_start_unaligned_take_element_loads(fake, uploads, monkeypatch, width, vec, cc):
    """Token-major q, k, v of `width`-element rows sliced to head dim 64, (B, L, H, width)[..., :64] seen as (B, H,
    L, 64) and packed (total, H, width)[..., :64]: their heads lie width x 2 bytes apart. 16-byte loads only where
    every row starts 16-byte aligned (72: 144 bytes; on Hopper the tensor-map kernels), else every kernel of the
    forward, the backward and the packed calls loads elements (68: 136 bytes; a 16-byte copy of head 1's rows
    would be misaligned, and no tensor map describes such strides)."""
    from cuflash import varlen
    dev, launches = fake
    if cc == 80:
        monkeypatch.setattr(device, "compute_capability", lambda: 80)
    x = dev.empty((2, 300, 4, width), np.float16)[..., :64].transpose(0, 2, 1, 3)
    out, lse = cuflash.attention_forward(x, x, x, causal=True)
    cuflash.attention_backward(out, x, x, x, out, lse, causal=True)
    packed = dev.empty((600, 4, width), np.float16)[..., :64]
    cu = np.array([0, 100, 600], dtype=np.int32)
    out, lse = varlen.attention_varlen_forward(packed, packed, packed, cu, cu, causal=True)
    varlen.attention_varlen_backward(out, packed, packed, packed, out, lse, cu, cu, causal=True)
    scoring = [v_ for v_, *_ in launches if v_.family.startswith(("fwd", "bwd_dkdv", "bwd_dq"))]
    hopper = [v_.arch == "sm90a" for v_ in scoring]
    assert len(scoring) >= 4 and all(hopper) == (cc == 90 and vec), [(v_.family, v_.vec) for v_ in scoring]
    assert all(v_.vec == vec for v_, sm90a in zip(scoring, hopper) if not sm90a), \
        [(v_.family, v_.vec) for v_ in scoring]


@pytest.mark.parametrize("other", ["dout", "out", "lse"])
def test_packed_backward_refuses_an_array_on_another_device(fake, uploads, other):
    """The varlen backward's dout, out or lse on another device than q: a ValueError naming both devices, no
    launch (as the dense backward's)."""
    from cupy.cuda import memory
    from cuflash import varlen
    dev, launches = fake
    hq, hk, d = 8, 2, 64
    cu = np.array([0, 300, 1400], dtype=np.int32)
    q, k, v, out, dout = (dev.empty((1400, h, d), np.float16) for h in (hq, hk, hk, hq, hq))
    lse = dev.empty((hq, 1400), np.float32)
    arrays = dict(dout=dout, out=out, lse=lse)
    x = arrays[other]
    mem = memory.UnownedMemory(0x7E0000000000, x.nbytes, None, device_id=1)
    arrays[other] = cp.ndarray(x.shape, dtype=x.dtype, memptr=memory.MemoryPointer(mem, 0))
    with pytest.raises(ValueError, match=f"{other} is on device 1, q on device 0"):
        varlen.attention_varlen_backward(arrays["dout"], q, k, v, arrays["out"], arrays["lse"], cu, cu)
    assert not launches


@pytest.mark.parametrize("d, causal, schedule", [(128, False, "queue"), (128, True, "queue"), (64, False, "stride"),
                                                (64, True, "block")])
def test_packed_hopper_forward_walks_its_table_on_the_long_rows_tile(fake, uploads, d, causal, schedule):
    """A sequence of 5000 keys: the long-rows tile. Head dim 128's has the two-consumer block ring: one CTA an
    SM takes the table's blocks from a zeroed counter of its own, longest sequence first; head dim 64's (three
    consumers) strides over them without a band and runs a CTA a block with one."""
    from cuflash import varlen
    dev, launches = fake
    cu = np.array([0, 700, 701, 5701], dtype=np.int32)
    q = dev.empty((5701, 4, d), np.float16)
    varlen.attention_varlen_forward(q, q, q, cu, cu, causal=causal)
    [(variant, params, _, grid)] = launches
    assert variant.family == "fwd_wgmma" and variant.packed and not variant.short and variant.schedule == schedule
    [(table_ptr, table)] = uploads
    f = np.frombuffer(params, dtype=_params.STRUCTS["FwdParams"])[0]
    blocks = len(table) * 4
    assert int(f["mask"]["packed_count"]) == blocks
    assert grid == (blocks if schedule == "block" else min(blocks, device.sm_count()))
    assert int(f["mask"]["packed_blocks"]) == table_ptr
    assert (int(f["block_queue"]) not in (0, table_ptr)) == (schedule == "queue")


def test_packed_calls_reuse_their_plan_and_table(fake, uploads, monkeypatch):
    """A packed call repeated with the same offsets (a model's layers) plans once and uploads its block table
    once; new offsets upload a new table, and a longest sequence of another row class picks another tile
    (the plan's key holds the class, not the length); another stream, another host thread on the per-thread
    default stream, or a new stream object behind a known handle uploads the table again, and the launch
    reads the table uploaded for it."""
    from cuflash import varlen
    dev, launches = fake
    planned = []
    plan_once = plan.plan_packed_forward
    monkeypatch.setattr(plan, "plan_packed_forward", lambda *a: planned.append(a[-1]) or plan_once(*a))

    def table_of(launch):   # the table address a launch's params hold
        return int(np.frombuffer(launch[1], dtype=_params.STRUCTS["FwdParams"])[0]["mask"]["packed_blocks"])

    q = dev.empty((6000, 4, 64), np.float16)
    same, other, longer = (np.array(c, dtype=np.int32) for c in ([0, 700, 6000], [0, 1000, 6000], [0, 1, 6000]))
    shorter = np.array([0, 499] + [500 * i for i in range(2, 12)] + [6000], dtype=np.int32)
    for cu in (shorter, shorter, shorter):
        varlen.attention_varlen_forward(q, q, q, cu, cu)
    assert len(planned) == 1 and len(uploads) == 1
    assert len({table_of(launch) for launch in launches}) == 1
    for cu in (same, other, longer):   # one row class (long), three tables
        varlen.attention_varlen_forward(q, q, q, cu, cu)
    assert len(planned) == 2 and len(uploads) == 4
    assert launches[0][0].short and not launches[-1][0].short
    assert [table_of(launch) for launch in launches[3:]] == [ptr for ptr, _ in uploads[1:]]

    class Other:
        ptr = 1

    class PerThread:   # the per-thread default stream: one handle, a table a host thread
        ptr = 2

    for stream, uploaded in ((Other, 5), (Other, 5), (PerThread, 6), (PerThread, 6)):
        monkeypatch.setattr(cp.cuda, "get_current_stream", lambda stream=stream: stream)
        varlen.attention_varlen_forward(q, q, q, shorter, shorter)
        assert len(planned) == 2 and len(uploads) == uploaded and table_of(launches[-1]) == uploads[-1][0]
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(varlen.attention_varlen_forward(q, q, q, shorter,
                                                                                                shorter)))
    worker.start()
    worker.join()
    assert other_thread and len(uploads) == 7 and table_of(launches[-1]) == uploads[-1][0]

    class Replaced:   # a new stream object behind a handle seen before: the table is uploaded again
        ptr = 1

    monkeypatch.setattr(cp.cuda, "get_current_stream", lambda: Replaced)
    varlen.attention_varlen_forward(q, q, q, shorter, shorter)
    assert len(uploads) == 8 and table_of(launches[-1]) == uploads[-1][0]


@pytest.mark.parametrize("d, causal", [(64, False), (128, "bottom_right")])
def test_packed_float32_forward_runs_the_3xtf32_kernel_a_cta_a_block(fake, uploads, d, causal):
    """float32 ("highest") on Hopper: the 3xTF32 forward's PACKED twin, a CTA a table block and query head,
    its maps describing the packed (total, H, D) float32 arrays as (D, total, H, 1) and O's map left as zeros
    (O is stored from the registers); the band moved per sequence where aligned to the end."""
    from cuflash import varlen
    dev, launches = fake
    cu_q = np.array([0, 300, 301, 1400], dtype=np.int32)
    cu_k = np.array([0, 500, 700, 1900], dtype=np.int32)
    q = dev.empty((1400, 4, d), np.float32)
    k, v = (dev.empty((1900, 2, d), np.float32) for _ in range(2))
    out, lse = varlen.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    [(variant, params, maps, grid)] = launches
    assert variant.family == "fwd_wgmma_tf32x3" and variant.packed and variant.schedule == "block"
    [(table_ptr, table)] = uploads
    assert grid == len(table) * 4
    for i, (x, rows, heads) in enumerate(((q, 1400, 4), (k, 1900, 2), (v, 1900, 2))):
        words = struct.unpack_from("=8Q", maps, 128 * i)
        assert words == (x.data.ptr, d, rows, heads, 1, heads * d * 4, d * 4, heads * d * 4)
    assert not any(maps[384:])
    f = np.frombuffer(params, dtype=_params.STRUCTS["FwdParams"])[0]
    assert int(f["mask"]["packed_count"]) == len(table) * 4 and int(f["mask"]["packed_blocks"]) == table_ptr
    assert int(f["mask"]["band_from_end"]) == (causal == "bottom_right")


def test_packed_forward_leaves_what_it_has_no_kernel_for_to_dense_launches(fake, monkeypatch):
    """float32 at precision "tf32" (no packed kernel), a negative scale (the EXTRA kernels) and rows that are
    not unit-stride (validation's copies are not the arrays a packed plan would address) take no packed plan;
    at head dim 256 (the FMA backward) there is a packed forward but no packed backward; float32 "highest"
    has packed 3xTF32 kernels: the Hopper forward on Hopper, the portable one below it, the portable
    backward everywhere."""
    from cuflash import varlen
    from cuflash._dispatch import plan as plan_
    dev, _ = fake
    cu = np.array([0, 64, 200], dtype=np.int32)
    for dtype, scale, precision in ((np.float32, None, "tf32"), (np.float16, -0.5, "highest")):
        q = dev.empty((200, 2, 64), dtype)
        call = varlen._Packed(q, q, q, cu, cu, False, scale, None, 0.0, None, precision)
        assert plan_.plan_packed_forward(q, q, q, call.p, call.opts, precision) is None
        assert plan_.plan_packed_backward(q, q, q, q, q, call.p, call.opts, precision) is None
    q = dev.empty((200, 2, 64), np.float32)
    call = varlen._Packed(q, q, q, cu, cu, False, None, None, 0.0, None, "highest")
    assert plan_.plan_packed_forward(q, q, q, call.p, call.opts, "highest").variant.family == "fwd_wgmma_tf32x3"
    for deterministic, last in ((False, "bwd_convert_dq"), (True, "bwd_dq_tf32x3")):   # the portable 3xTF32 lists
        packed_bwd = plan_.plan_packed_backward(q, q, q, q, q, call.p, call.opts, "highest", deterministic)
        assert [v.family for v in packed_bwd.kernels] == ["bwd_dsum", "bwd_dkdv_tf32x3", last]
    with monkeypatch.context() as m:   # below Hopper: the portable 3xTF32 forward's PACKED twin
        m.setattr(device, "compute_capability", lambda: 80)
        fwd = plan_.plan_packed_forward(q, q, q, call.p, call.opts, "highest")
        assert fwd.variant.family == "fwd_tf32x3" and fwd.variant.packed and fwd.maps is None
        assert plan_.plan_packed_backward(q, q, q, q, q, call.p, call.opts, "highest") is not None
    q = dev.empty((200, 2, 64), np.float16)
    call = varlen._Packed(q, q, q, cu, cu, False, None, None, 0.0, None, "highest")
    strided = dev.empty((200, 2, 128), np.float16)[..., ::2]
    assert plan_.plan_packed_forward(q, q, q, call.p, call.opts, "highest") is not None
    assert plan_.plan_packed_forward(strided, q, q, call.p, call.opts, "highest") is None
    assert plan_.plan_packed_backward(q, q, q, strided, q, call.p, call.opts, "highest") is None
    for dtype, d, backward in ((np.float16, 256, False), (np.float64, 64, True), (np.float64, 256, False)):
        q = dev.empty((200, 2, d), dtype)
        call = varlen._Packed(q, q, q, cu, cu, True, None, None, 0.0, None, "highest")
        assert plan_.plan_packed_forward(q, q, q, call.p, call.opts, "highest") is not None
        assert (plan_.plan_packed_backward(q, q, q, q, q, call.p, call.opts, "highest") is not None) == backward


@pytest.mark.parametrize("dtype, families", [(np.float16, ("bwd_dkdv_mma", "bwd_dq_mma")),
                                             (np.float32, ("bwd_dkdv_tf32x3", "bwd_dq_tf32x3"))])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_packed_backward_launches_dsum_then_the_packed_dkdv_and_dq_kernels(fake, uploads, monkeypatch, causal, dtype,
                                                                         families):
    """16-bit and float32 packed sequences' deterministic backward: dsum over every packed row, the PACKED dK/dV
    kernel over a key-major table (x Hk CTAs), the PACKED dQ kernel over a query-major one (x Hq), each table at
    the address its launch's params hold; the gradients' views with a batch stride of one row."""
    from cuflash import varlen
    from cuflash._dispatch import packed
    dev, launches = fake
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: x)
    hq, hk, d = 8, 2, 128
    cu_q = np.array([0, 300, 300, 1400], dtype=np.int32)
    cu_k = np.array([0, 500, 900, 1900], dtype=np.int32)
    q, dout = (dev.empty((1400, hq, d), dtype) for _ in range(2))
    k, v = (dev.empty((1900, hk, d), dtype) for _ in range(2))
    out = dev.empty((1400, hq, d), dtype)
    lse = dev.empty((hq, 1400), np.float32)
    dq, dk, dv = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal,
                                                  deterministic=True)
    assert [(x.shape, x.dtype) for x in (dq, dk, dv)] == [(x.shape, x.dtype) for x in (q, k, v)]
    (dsum, _, _, dsum_grid), *kv_launches, (dq_k, p_q, _, grid_q) = launches
    (dkdv, p_kv, _, grid_kv) = kv_launches[0]
    assert dsum.family == "bwd_dsum" and (dkdv.family, dq_k.family) == families
    assert dkdv.packed and dq_k.packed and not dkdv.atomic_dq
    # one dK/dV pass, or (float32 at head dim 128) dV then dK over the same table
    assert [v.pass_ for v, *_ in kv_launches] in ([0], [1, 2]) and all(g == grid_kv for *_, g in kv_launches)
    (ptr_kv, table_kv), (ptr_q, table_q) = uploads
    np.testing.assert_array_equal(table_kv, packed.block_table(cu_q, cu_k, dkdv.tile.block_n, "k", False))
    np.testing.assert_array_equal(table_q, packed.block_table(cu_q, cu_k, dq_k.tile.block_m, "q", causal is not False))
    assert grid_kv == len(table_kv) * hk and grid_q == len(table_q) * hq
    for params, ptr in [(params, ptr_kv) for _, params, _, _ in kv_launches] + [(p_q, ptr_q)]:
        f = np.frombuffer(params, dtype=_params.STRUCTS["BwdParams"])[0]
        assert int(f["mask"]["packed_blocks"]) == ptr
        assert int(f["mask"]["band_from_end"]) == int(causal == "bottom_right")
        for name, x, rows in (("q", q, hq * d), ("k", k, hk * d), ("dq", dq, hq * d), ("dk", dk, hk * d),
                              ("dv", dv, hk * d), ("dout", dout, hq * d)):
            assert int(f[name]["ptr"]) == x.data.ptr
            assert int(f[name]["batch_stride"]) == int(f[name]["row_stride"]) == rows, name
        assert int(f["lse"]["batch_stride"]) == int(f["dsum"]["batch_stride"]) == 1
        assert int(f["lse"]["head_stride"]) == 1400 and int(f["lse"]["ptr"]) == lse.data.ptr


@pytest.mark.parametrize("d", [64, 128])
def test_packed_backward_on_hopper_adds_dq_through_the_wgmma_kernel(fake, uploads, monkeypatch, d):
    """Not deterministic, on Hopper: dsum, the PACKED wgmma dK/dV kernel over a key-major table (x Hk CTAs)
    with tensor maps of the packed q, dout, k, v as (D, total, H, 1) and of the zeroed fp32 dQ accumulator
    (1, Hq, total, D), then the convert kernel over every packed row into dq."""
    from cuflash import varlen
    from cuflash._dispatch import packed
    dev, launches = fake
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: x)
    hq, hk = 8, 2
    cu_q = np.array([0, 300, 300, 1400], dtype=np.int32)
    cu_k = np.array([0, 500, 900, 1900], dtype=np.int32)
    q, dout, out = (dev.empty((1400, hq, d), np.float16) for _ in range(3))
    k, v = (dev.empty((1900, hk, d), np.float16) for _ in range(2))
    lse = dev.empty((hq, 1400), np.float32)
    dq, dk, dv = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    (dsum, _, _, _), (dkdv, p_kv, maps, grid_kv), (convert, p_c, _, grid_c) = launches
    assert (dsum.family, dkdv.family, convert.family) == ("bwd_dsum", "bwd_dkdv_wgmma", "bwd_convert_dq")
    assert dkdv.packed and dkdv.band and not dkdv.extra
    [(ptr_kv, table_kv)] = uploads
    np.testing.assert_array_equal(table_kv, packed.block_table(cu_q, cu_k, dkdv.tile.block_n, "k", False))
    assert grid_kv == len(table_kv) * hk and grid_c == convert.grid(1, hq, hq // hk, 1400, 1900)
    f = np.frombuffer(p_kv, dtype=_params.STRUCTS["BwdParams"])[0]
    assert int(f["mask"]["packed_blocks"]) == ptr_kv
    for i, (x, rows, heads) in enumerate(((q, 1400, hq), (dout, 1400, hq), (k, 1900, hk), (v, 1900, hk))):
        assert struct.unpack_from("=8Q", maps, 128 * i) == (x.data.ptr, d, rows, heads, 1, heads * d * 2, d * 2,
                                                            heads * d * 2)
    acc = struct.unpack_from("=8Q", maps, 128 * 4)   # the accumulator (1, Hq, total, D) of fp32, its [..., :d]
    assert acc[0] == int(f["dq_acc"]["ptr"]) and acc[1:5] == (d, 1400, hq, 1) and acc[5:7] == (d * 4, 1400 * d * 4)
    assert int(f["dq_acc"]["row_stride"]) == d and int(f["dq_acc"]["head_stride"]) == 1400 * d
    assert int(f["dq"]["ptr"]) == dq.data.ptr and int(f["dq"]["batch_stride"]) == int(f["dq"]["row_stride"]) == hq * d


@pytest.mark.parametrize("dtype, d, passes", [(np.float32, 64, [(0, True)]), (np.float32, 128, [(1, False), (2, True)]),
                                               (np.float64, 64, [(0, True)])])
@pytest.mark.parametrize("cc", [80, 90])
def test_packed_backward_of_float32_and_float64_adds_dq_with_atomics(fake, uploads, monkeypatch, dtype, d, passes,
                                                                   cc):
    """Not deterministic, float32 (3xTF32) and float64 on any GPU: dsum, the PACKED dK/dV pass or passes over one
    key-major table, the last adding dQ with atomics into the zeroed accumulator, whose params view has a batch
    stride of one row (a block adds from its sequence's first query row), then the convert kernel over every
    packed row into dq: no dQ kernel."""
    from cuflash import varlen
    from cuflash._dispatch import packed
    dev, launches = fake
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: x)
    monkeypatch.setattr(device, "compute_capability", lambda: cc)
    hq, hk = 8, 2
    cu_q = np.array([0, 300, 300, 1400], dtype=np.int32)
    cu_k = np.array([0, 500, 900, 1900], dtype=np.int32)
    q, dout, out = (dev.empty((1400, hq, d), dtype) for _ in range(3))
    k, v = (dev.empty((1900, hk, d), dtype) for _ in range(2))
    lse = dev.empty((hq, 1400), dtype)
    dq, dk, dv = varlen.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    (dsum, _, _, _), *kv_launches, (convert, p_c, _, grid_c) = launches
    assert dsum.family == "bwd_dsum" and convert.family == "bwd_convert_dq" and not convert.dq_tiled
    assert [(v_.pass_, v_.atomic_dq) for v_, *_ in kv_launches] == passes
    assert all(v_.packed and v_.band for v_, *_ in kv_launches)
    [(ptr_kv, table_kv)] = uploads
    block_n = kv_launches[0][0].tile.block_n
    np.testing.assert_array_equal(table_kv, packed.block_table(cu_q, cu_k, block_n, "k", False))
    assert all(g == len(table_kv) * hk for *_, g in kv_launches)
    assert grid_c == convert.grid(1, hq, hq // hk, 1400, 1900)
    for _, params, _, _ in kv_launches + [launches[-1]]:
        f = np.frombuffer(params, dtype=_params.STRUCTS["BwdParams"])[0]
        acc = f["dq_acc"]
        assert int(acc["ptr"]) != 0 and int(acc["row_stride"]) == int(acc["batch_stride"]) == d
        assert int(acc["head_stride"]) == 1400 * d
        assert int(f["dq"]["ptr"]) == dq.data.ptr and int(f["dq"]["batch_stride"]) == hq * d


def _words(params: bytes, struct_name: str = "FwdParams") -> list:
    return [int(w) for w in np.frombuffer(params, dtype=_params.STRUCTS[struct_name])["mask"]["mod_args"][0]]


def _document_mask(ids, runs=None):
    """cuflash.document_mask over the fake device's ``ids`` (the mask copies its ids and reads them on the
    host: here it is built from zeros and given ``ids``, and ``runs`` as ids on the host)."""
    mask = cuflash.document_mask(np.zeros(ids.shape, np.int32) if runs is None else runs)
    mask.params["doc"] = ids
    return mask


@pytest.mark.parametrize("d", [64, 128])
def test_a_call_with_modifications_compiles_them_in_and_passes_their_parameters(fake, d):
    """User modifications (cuflash.mods): the mask modification's block states computed first (once: the
    backward finds them cached), every scoring kernel built with the modifications' source (the Hopper
    forward on two consumer warpgroups at head dim 64), the parameter words in slot order: numbers' bits,
    arrays' addresses, and in the backward the trainable parameter's fresh gradient accumulator (softcap's cap
    is compiled in: no word)."""
    dev, launches = fake
    q, k, v = _qkv(dev, (2, 4, 1100, d))
    doc, weights = dev.empty((2, 1100), np.int32), dev.empty((4,), np.float32)
    scaled = cuflash.ScoreMod("score * k + acc_t(w[h])", grad="k", params={"k": 0.5, "w": weights},
                              param_grads={"w": ("h", "acc_t(1)")})
    mods = dict(score_mod=(cuflash.softcap(30.0), scaled), mask_mod=_document_mask(doc))
    out, lse = cuflash.attention_forward(q, k, v, causal=True, **mods)
    (states, states_params, _, states_grid), (spans, _, _, spans_grid), (fwd, fwd_params, _, _) = launches
    assert states.name == "mask_mod_states" and "CUF_USER_MASK 1" in states.prelude
    assert states_grid == 2 * 1 * 18 * 18   # B x heads (the mask reads b, not h) x 64-row blocks x 64-key blocks
    assert spans.name == "layout_spans" and spans_grid == 1   # a thread a line: 2 x 1 x (18 + 18) lines
    assert fwd.extra and fwd.prelude == cuflash.mods.resolve(*[mods["score_mod"]], mods["mask_mod"]).prelude(True)
    assert fwd.family == "fwd_wgmma" and (fwd.tile.warps == 12 if d == 64 else True)
    # softcap's cap is compiled in (no word); k's bits, the table, its gradient (none in a forward), the ids,
    # their length
    k_bits = struct.unpack("<I", struct.pack("<f", 0.5))[0]
    assert _words(fwd_params)[:6] == [k_bits, weights.data.ptr, 0, doc.data.ptr, 1100, 0]
    launches.clear()
    dout = dev.empty(out.shape, out.dtype)
    dq, dk, dv, grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **mods)
    assert set(grads) == {"w"} and grads["w"].shape == (4,) and grads["w"].dtype == np.float32
    scoring = [(var, params) for var, params, _, _ in launches if var.extra]
    assert scoring and all(var.prelude == fwd.prelude for var, _ in scoring)
    assert not any(var.name in ("mask_mod_states", "layout_spans") for var, *_ in launches)   # cached by the forward
    assert all(not var.prelude for var, *_ in launches if not var.extra)   # dsum, convert: as they are
    for _, params in scoring:
        assert _words(params, "BwdParams")[:6] == [k_bits, weights.data.ptr, grads["w"].data.ptr, doc.data.ptr, 1100, 0]


@pytest.mark.parametrize("token_major", [False, True])
def test_a_document_mask_of_runs_runs_the_packed_kernels_over_its_documents(fake, uploads, monkeypatch, token_major):
    """A document mask of runs with causal: the PACKED forward (not EXTRA, no modification compiled in) over a
    table of the documents, each a sequence at row b x R + its first position of the dense arrays seen as packed
    (R = H x L for (B, H, L, D) memory, L for (B, L, H, D)); out and lse in q's axis order, their views sharing
    q's rows; q's tensor map (D, (B - 1) R + L, H, 1). The backward: dsum and convert over the dense arrays,
    the PACKED dK/dV kernel over the documents' key-major table, the gradients in the inputs' axis order."""
    dev, launches = fake
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: x)
    b, h, n, d = 2, 4, 1100, 64

    def array():
        if token_major:
            return dev.empty((b, n, h, d), np.float16).transpose(0, 2, 1, 3)
        return dev.empty((b, h, n, d), np.float16)

    q, k, v = array(), array(), array()
    ids = np.zeros((b, n), np.int32)
    ids[0, 300:], ids[0, 1000:], ids[1, 7:] = 1, 2, 5
    mask = _document_mask(dev.empty((b, n), np.int32), ids)
    out, lse = cuflash.attention_forward(q, k, v, causal=True, mask_mod=mask)
    [(fwd, params, maps, _)] = launches
    assert fwd.family == "fwd_wgmma" and fwd.packed and not fwd.extra and not fwd.prelude
    rows = n if token_major else h * n
    starts, lengths = np.array([0, 300, 1000, rows, rows + 7]), np.array([300, 700, 100, 7, 1093])
    spans = packed_.Spans(starts, lengths, starts, lengths)
    [(table_ptr, table)] = uploads
    np.testing.assert_array_equal(table, packed_.span_table(spans, fwd.tile.block_m, "q", True))
    assert out.shape == q.shape and out.strides == q.strides and lse.shape == (b, h, n)
    f = np.frombuffer(params, dtype=_params.STRUCTS["FwdParams"])[0]
    assert int(f["mask"]["packed_blocks"]) == table_ptr
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        it = x.itemsize
        assert int(f[name]["ptr"]) == x.data.ptr, name
        assert int(f[name]["batch_stride"]) == int(f[name]["row_stride"]) == x.strides[2] // it, name
        assert int(f[name]["head_stride"]) == x.strides[1] // it, name
    assert struct.unpack_from("=5Q", maps, 0) == (q.data.ptr, d, (b - 1) * rows + n, h, 1)
    launches.clear()
    uploads.clear()
    dout = array()
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, mask_mod=mask)
    (dsum, p_sum, _, grid_sum), (dkdv, p_kv, _, _), (convert, p_c, _, grid_c) = launches
    assert (dsum.family, dkdv.family, convert.family) == ("bwd_dsum", "bwd_dkdv_wgmma", "bwd_convert_dq")
    assert dkdv.packed and not dkdv.extra and not dkdv.prelude
    assert grid_sum == dsum.grid(b, h, 1, n, n) and grid_c == convert.grid(b, h, 1, n, n)
    [(ptr_kv, table_kv)] = uploads
    np.testing.assert_array_equal(table_kv, packed_.span_table(spans, dkdv.tile.block_n, "k", False))
    assert all(g.strides == x.strides for g, x in ((dq, q), (dk, k), (dv, v)))
    dense, kv = (np.frombuffer(x, dtype=_params.STRUCTS["BwdParams"])[0] for x in (p_sum, p_kv))
    assert int(kv["mask"]["packed_blocks"]) == ptr_kv
    for name, x in (("out", out), ("dout", dout), ("dq", dq), ("dk", dk)):
        assert int(dense[name]["ptr"]) == int(kv[name]["ptr"]) == x.data.ptr
        assert int(dense[name]["batch_stride"]) == x.strides[0] // 2 and int(dense[name]["row_stride"]) == x.strides[2] // 2
        assert int(kv[name]["batch_stride"]) == int(kv[name]["row_stride"]) == x.strides[2] // 2
    acc = kv["dq_acc"]
    assert int(acc["ptr"]) == int(dense["dq_acc"]["ptr"]) != 0 and int(acc["batch_stride"]) == int(acc["row_stride"])
    assert int(acc["row_stride"]) * rows == int(dense["dq_acc"]["batch_stride"])
    assert p_c == p_sum


def test_a_document_mask_not_of_runs_or_with_more_masking_keeps_the_masking_kernels(fake):
    """Documents that are not runs (an id again later in a row), other modifications or options, or
    Lq != Lk: the EXTRA kernels with the per-element test."""
    dev, launches = fake
    b, h, n, d = 2, 4, 300, 64
    q, k, v = _qkv(dev, (b, h, n, d))
    runs, again = np.zeros((b, n), np.int32), np.zeros((b, n), np.int32)
    runs[:, 100:] = 1
    again[:, 100:200] = 1
    for ids, kwargs in ((again, {}), (runs, dict(score_mod=cuflash.softcap(20.0))), (runs, dict(dropout_p=0.1, seed=1)),
                        (runs, dict(bias=dev.empty((1, h, n, n), np.float16)))):
        launches.clear()
        cuflash.attention_forward(q, k, v, causal=True, mask_mod=_document_mask(dev.empty((b, n), np.int32), ids),
                                  **kwargs)
        fwd = [var for var, *_ in launches if getattr(var, "family", "").startswith("fwd")]
        assert fwd and all(var.extra and not var.packed for var in fwd), kwargs
    launches.clear()
    cuflash.attention_forward(q[:, :, :200], k, v, mask_mod=_document_mask(dev.empty((b, n), np.int32), runs))
    assert all(not getattr(var, "packed", False) for var, *_ in launches)
    with pytest.raises(ValueError, match="at least max"):
        cuflash.attention_forward(q, k, v, mask_mod=_document_mask(dev.empty((b, n - 1), np.int32), runs[:, 1:]))
    with pytest.raises(ValueError, match="B = 2 rows"):
        cuflash.attention_forward(q, k, v, mask_mod=_document_mask(dev.empty((1, n), np.int32), runs[:1]))


def test_score_modifications_alone_run_on_the_plain_kernels(fake):
    """Score modifications alone take the plain Hopper kernels (their hooks on scores as held; the band forward
    walking its blocks from the queue with softcap, which runs everywhere, a CTA a block with one behind a branch)
    and the portable forward's EXTRA variant (its plain ones spill with them); not the decoding
    kernel (its split twin) nor packed GQA rows for few query rows; and at head dim 256 the portable backward
    (the Hopper one forms dS from a 16-bit P in another warpgroup)."""
    dev, launches = fake
    softcap = cuflash.softcap(30.0)
    q, k, v = _qkv(dev, (2, 4, 1100, 128))
    out, lse = cuflash.attention_forward(q, k, v, causal=True, score_mod=softcap)
    [(fwd, _, _, grid)] = launches
    assert fwd.family == "fwd_wgmma" and not fwd.extra and fwd.prelude and fwd.schedule == "queue"
    launches.clear()
    guarded = cuflash.ScoreMod(softcap.source, grad=softcap.grad, consts=softcap.consts, log2_units=True)
    cuflash.attention_forward(q, k, v, causal=True, score_mod=guarded)
    [(fwd, _, _, grid)] = launches
    assert fwd.family == "fwd_wgmma" and fwd.schedule == "block" and grid == 2 * 4 * 9
    launches.clear()
    cuflash.attention_backward(dev.empty(out.shape, out.dtype), q, k, v, out, lse, causal=True, score_mod=softcap)
    families = [var.family for var, *_ in launches]
    assert "bwd_dkdv_wgmma" in families and all(var.prelude for var, *_ in launches if var.family.startswith("bwd_dkdv"))
    launches.clear()
    qd = dev.empty((2, 8, 1, 128), np.float16)
    kd, vd = (dev.empty((2, 2, 8192, 128), np.float16) for _ in range(2))
    cuflash.attention_forward(qd, kd, vd, score_mod=softcap)
    partial = launches[0][0]
    assert partial.family == "fwd_mma" and partial.kv_split and partial.extra and partial.prelude
    f = np.frombuffer(launches[0][1], dtype=_params.STRUCTS["FwdParams"])[0]
    assert int(f["dims"]["heads_q"]) == 8 and int(f["dims"]["lq"]) == 1   # no packed GQA rows
    launches.clear()
    q, k, v = _qkv(dev, (2, 4, 1100, 256))
    out, lse = cuflash.attention_forward(q, k, v, causal=True, score_mod=softcap)
    launches.clear()
    cuflash.attention_backward(dev.empty(out.shape, out.dtype), q, k, v, out, lse, causal=True, score_mod=softcap)
    assert not any(var.family == "bwd_dkdv_wgmma" for var, *_ in launches)


def test_alibi_under_a_causal_band_takes_the_linear_bias(fake):
    """ALiBi alone where no query sees a key after it (causal at the start, at the end with Lq >= Lk, a left
    window with it) runs on the plain Hopper forward and dK/dV kernels with the linear bias's prelude, on the
    tile and schedule the call has without it; the other kernels, and every other call (keys after the query
    visible: no causal mask, at the end with Lq < Lk, a window reaching right; EXTRA options, another
    modification beside it, float32, head dim 256, the deterministic backward), take the modification's own
    prelude."""
    dev, launches = fake
    alibi = cuflash.alibi(dev.empty((4,), np.float32))

    def run(shape=(2, 4, 1100, 64), dtype=np.float16, kshape=None, backward=True, **kwargs):
        launches.clear()
        q = dev.empty(shape, dtype)
        k, v = (dev.empty(kshape or shape, dtype) for _ in range(2))
        out, lse = cuflash.attention_forward(q, k, v, **kwargs)
        if backward:
            cuflash.attention_backward(dev.empty(out.shape, out.dtype), q, k, v, out, lse,
                                       **{n: kwargs[n] for n in kwargs if n != "return_lse"})
        return [var for var, *_ in launches]

    for shape, dtype, kshape, kwargs in (((2, 4, 1100, 64), np.float16, None, dict(causal=True)),
                                         ((2, 4, 1100, 128), ml_dtypes.bfloat16, None,
                                          dict(causal="bottom_right", window=(100, 0))),
                                         ((2, 4, 300, 64), np.float16, (2, 4, 200, 64), dict(causal="bottom_right"))):
        plain = run(shape, dtype, kshape, **kwargs)
        linear = run(shape, dtype, kshape, score_mod=alibi, **kwargs)
        hopper = [var for var in linear if var.family in model.LINEAR_BIAS_FAMILIES]
        assert {var.family for var in hopper} == set(model.LINEAR_BIAS_FAMILIES)
        assert all(model.linear_bias(var) and not var.extra for var in hopper)
        assert [replace(var, prelude="") for var in linear] == plain   # the same tiles and schedules
    mods = cuflash.mods.resolve(alibi)
    for kwargs in (dict(causal=False), dict(causal="bottom_right", kshape=(2, 4, 1200, 64)), dict(window=(100, 5)),
                   dict(causal=True, dropout_p=0.1, seed=1), dict(causal=True, score_mod=(alibi, cuflash.softcap(9.0))),
                   dict(causal=True, dtype=np.float32), dict(causal=True, shape=(2, 4, 1100, 256)),
                   dict(causal=True, deterministic=True)):
        deterministic = kwargs.pop("deterministic", False)
        kwargs.setdefault("score_mod", alibi)
        if deterministic:
            launches.clear()
            q, k, v = _qkv(dev)
            out, lse = cuflash.attention_forward(q, k, v, causal=True, score_mod=alibi)
            assert model.linear_bias(launches[0][0])
            launches.clear()
            cuflash.attention_backward(dev.empty(out.shape, out.dtype), q, k, v, out, lse, causal=True,
                                       score_mod=alibi, deterministic=True)
            variants = [var for var, *_ in launches]
        else:
            variants = run(**kwargs)
        assert not any(model.linear_bias(var) for var in variants), (kwargs, [var.name for var in variants])
        scoring = [var for var in variants if var.family in model.SCORING_FAMILIES]
        assert scoring and all("CUF_USER_SCORE 1" in var.prelude for var in scoring)
    assert "CUF_LINEAR_BIAS 1" in mods.linear_prelude() and mods.linear
    with pytest.raises(ValueError, match="linear"):
        cuflash.mods.resolve((alibi, cuflash.softcap(9.0))).linear_prelude()


def test_score_modifications_on_the_portable_kernels_take_their_extra_variants(fake, monkeypatch):
    """Off Hopper: the portable forward's and the FMA backward's EXTRA variants (their plain ones spill with
    modifications), the tensor-core backward's plain ones."""
    dev, launches = fake
    monkeypatch.setattr(device, "compute_capability", lambda: 80)
    softcap = cuflash.softcap(30.0)
    for d, backward_extra in ((64, False), (256, True)):   # head dim 256 16-bit: the FMA backward
        launches.clear()
        q, k, v = _qkv(dev, (2, 4, 300, d))
        out, lse = cuflash.attention_forward(q, k, v, causal=True, score_mod=softcap)
        cuflash.attention_backward(dev.empty(out.shape, out.dtype), q, k, v, out, lse, causal=True, score_mod=softcap)
        scoring = [var for var, *_ in launches if var.family in model.SCORING_FAMILIES]
        assert scoring[0].family.startswith("fwd_") and scoring[0].extra and scoring[0].prelude
        assert all(var.extra == backward_extra and var.prelude for var in scoring[1:]), [str(v_) for v_ in scoring]
