"""Which arrays the Hopper forward's tensor maps can describe (cuflash/_runtime/tma.py), on the CPU:
the rules are the driver's (16-byte aligned base, strides positive multiples of 16 bytes)."""
from types import SimpleNamespace

import numpy as np

from cuflash._runtime import tma as _tma


def fake(shape, strides=None, ptr=4096, itemsize=2):
    """An array-like with what tma_ok reads: shape, byte strides, itemsize, data.ptr."""
    if strides is None:
        strides = tuple(int(s) for s in np.empty(shape, dtype=np.float16).strides)
    return SimpleNamespace(shape=shape, strides=strides, itemsize=itemsize, data=SimpleNamespace(ptr=ptr))


def test_contiguous_and_transposed_views_pass():
    assert _tma.tma_ok(fake((2, 4, 100, 64)), fake((1, 1, 5, 128)))
    # (B, L, H, D) seen as (B, H, L, D): rows H * D * 2 bytes apart, heads D * 2
    assert _tma.tma_ok(fake((2, 3, 77, 64), strides=(77 * 3 * 128, 128, 3 * 128, 2)))


def test_float32_arrays_pass():
    """The float32 Hopper forward (flash_fwd_wgmma_tf32.cu) loads through the same maps, 32 columns a box."""
    assert _tma.tma_ok(fake((2, 4, 100, 64), strides=(4 * 100 * 256, 100 * 256, 256, 4), itemsize=4))


def test_rejected_layouts():
    assert not _tma.tma_ok(fake((2, 4, 100, 64), ptr=4096 + 8))                       # base not 16-byte aligned
    assert not _tma.tma_ok(fake((2, 4, 100, 60)))                                      # rows 120 bytes apart
    assert not _tma.tma_ok(fake((3, 4, 100, 64), strides=(0, 12800, 128, 2)))          # broadcast over batch
    assert not _tma.tma_ok(fake((2, 4, 100, 64), strides=(51200, 12800, 128, 4)))      # last axis not unit-stride
    assert not _tma.tma_ok(fake((2, 4, 100, 64), strides=(4 * 100 * 512, 100 * 512, 512, 8), itemsize=8))  # fp64
    assert not _tma.tma_ok(fake((2, 4, 100, 62), strides=(4 * 100 * 248, 100 * 248, 248, 4), itemsize=4))  # 248 B
    assert not _tma.tma_ok(fake((2, 4, 100, 64)), fake((2, 4, 100, 64), ptr=4100))     # any one array decides


def test_length_one_axes_take_the_contiguous_stride():
    """A stride the copy engine never uses (a length-1 axis) does not disqualify the array, and the
    encoder is given a valid one in its place."""
    odd = fake((1, 1, 100, 64), strides=(2, 6, 128, 2))
    assert _tma.tma_ok(odd)
    assert _tma._byte_strides(odd) == (128, 128 * 100, 128 * 100)


def test_maps_are_encoded_back_to_back_with_their_boxes(monkeypatch):
    """What the encoder is asked for, per array (dims innermost first, byte strides of L, H, B, a box of
    one 128-byte slab by the rows asked, the element type), and where each map lands: 128 bytes apart
    in one 64-byte aligned buffer, in argument order, the kernel argument one HostArg."""
    import ctypes

    calls = []

    def encoder(addr, dtype, rank, ptr, dims, strides, box, steps, *modes):
        # the array arguments arrive as addresses (what the driver reads through its pointers)
        assert addr % 64 == 0
        read = [(ctypes.c_uint64 * 4, dims), (ctypes.c_uint64 * 3, strides), (ctypes.c_uint32 * 4, box),
                (ctypes.c_uint32 * 4, steps)]
        calls.append((dtype, rank, ptr) + tuple(list(kind.from_address(at)) for kind, at in read))
        ctypes.memset(addr, len(calls), _tma.MAP_BYTES)   # map i is filled with the byte i + 1
        return 0

    monkeypatch.setattr(_tma, "_encode_fn", lambda: encoder)
    q = fake((2, 4, 100, 128), ptr=4096)
    k = fake((2, 1, 300, 128), ptr=8192)
    dq = fake((2, 4, 100, 128), strides=(4 * 100 * 512, 100 * 512, 512, 4), ptr=65536, itemsize=4)
    arg = _tma.bwd_tensor_maps(q, q, k, k, dq, 64, 128)
    assert arg.nbytes == 5 * _tma.MAP_BYTES and arg.address % 64 == 0
    raw = bytes(arg.data)
    assert [raw[i * _tma.MAP_BYTES] for i in range(5)] == [1, 2, 3, 4, 5]
    assert calls[0] == (1, 4, 4096, [128, 100, 4, 2], [256, 25600, 102400], [64, 64, 1, 1], [1, 1, 1, 1])
    assert calls[2][3:6] == ([128, 300, 1, 2], [256, 76800, 76800], [64, 128, 1, 1])
    assert calls[4][:2] == (7, 4) and calls[4][4:6] == ([512, 51200, 204800], [32, 64, 1, 1])   # float32: 32 columns


def test_a_map_the_kernel_does_not_read_is_left_as_zeros(monkeypatch):
    """fwd_tensor_maps(store_out=False) (the 16-bit forward below head dim 128 stores O element by element,
    the float32 one always): three encodes, not four, and the output's 128 bytes stay zero."""
    import ctypes

    calls = []

    def encoder(addr, dtype, rank, ptr, *rest):
        calls.append(ptr)
        ctypes.memset(addr, 0xAB, _tma.MAP_BYTES)
        return 0

    monkeypatch.setattr(_tma, "_encode_fn", lambda: encoder)
    q, k, v, out = (fake((2, 4, 100, 64), ptr=4096 * (i + 1)) for i in range(4))
    raw = bytes(_tma.fwd_tensor_maps(q, k, v, out, 128, 64, store_out=False).data)
    assert calls == [4096, 8192, 12288]
    assert raw[:3 * _tma.MAP_BYTES] == b"\xab" * (3 * _tma.MAP_BYTES) and raw[3 * _tma.MAP_BYTES:] == bytes(128)
    calls.clear()
    _tma.fwd_tensor_maps(q, k, v, out, 128, 64)
    assert calls == [4096, 8192, 12288, 16384]
    # an unreadable layout anywhere but in the skipped map still sends the call to the portable kernel
    assert _tma.fwd_tensor_maps(q, fake((2, 4, 100, 64), ptr=4100), v, out, 128, 64, store_out=False) is None
    assert _tma.fwd_tensor_maps(q, k, v, fake((2, 4, 100, 64), ptr=4100), 128, 64, store_out=False) is not None
