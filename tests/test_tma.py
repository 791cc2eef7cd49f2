"""Which arrays the Hopper forward's tensor maps can describe (cuflash/_tma.py), on the CPU:
the rules are the driver's (16-byte aligned base, strides positive multiples of 16 bytes)."""
from types import SimpleNamespace

import numpy as np

from cuflash import _tma


def fake(shape, strides=None, ptr=4096, itemsize=2):
    """An array-like with what tma_ok reads: shape, byte strides, itemsize, data.ptr."""
    if strides is None:
        strides = tuple(int(s) for s in np.empty(shape, dtype=np.float16).strides)
    return SimpleNamespace(shape=shape, strides=strides, itemsize=itemsize, data=SimpleNamespace(ptr=ptr))


def test_contiguous_and_transposed_views_pass():
    assert _tma.tma_ok(fake((2, 4, 100, 64)), fake((1, 1, 5, 128)))
    # (B, L, H, D) seen as (B, H, L, D): rows H * D * 2 bytes apart, heads D * 2
    assert _tma.tma_ok(fake((2, 3, 77, 64), strides=(77 * 3 * 128, 128, 3 * 128, 2)))


def test_rejected_layouts():
    assert not _tma.tma_ok(fake((2, 4, 100, 64), ptr=4096 + 8))                       # base not 16-byte aligned
    assert not _tma.tma_ok(fake((2, 4, 100, 60)))                                      # rows 120 bytes apart
    assert not _tma.tma_ok(fake((3, 4, 100, 64), strides=(0, 12800, 128, 2)))          # broadcast over batch
    assert not _tma.tma_ok(fake((2, 4, 100, 64), strides=(51200, 12800, 128, 4)))      # last axis not unit-stride
    assert not _tma.tma_ok(fake((2, 4, 100, 64), itemsize=4))                          # 32-bit elements
    assert not _tma.tma_ok(fake((2, 4, 100, 64)), fake((2, 4, 100, 64), ptr=4100))     # any one array decides


def test_length_one_axes_take_the_contiguous_stride():
    """A stride the copy engine never uses (a length-1 axis) does not disqualify the array, and the
    encoder is given a valid one in its place."""
    odd = fake((1, 1, 100, 64), strides=(2, 6, 128, 2))
    assert _tma.tma_ok(odd)
    assert _tma._byte_strides(odd) == [128, 128 * 100, 128 * 100]
