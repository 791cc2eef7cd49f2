"""Kernel launches: a list of kernels, each with its grid, run in order on CuPy's current stream
with one params struct (and, for the Hopper kernels, their tensor maps). Nothing here chooses:
the list comes from :mod:`cuflash._dispatch`."""
from __future__ import annotations

import array
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Tuple

from . import device
from .build import get_kernel
from .params import HostArg


@dataclass(frozen=True)
class HelperKernel:
    """A small kernel outside the attention variants, as :func:`launch_kernel` takes a variant: a mask
    modification's block states (mask_mod_states.cu, with its prelude), a layout's spans (layout_spans.cu),
    the KV-cache append (kv_append.cu). ``name``: the name expression (a template's instantiation)."""

    entry: str
    name: str
    prelude: str = ""
    smem_bytes: int = 0
    nvrtc_arch: Optional[str] = None
    threads: int = 256


class KernelLaunch(NamedTuple):
    """One kernel of a list: the variant, its grid (CTAs), and whether it takes the list's tensor maps."""

    variant: object
    grid: int
    takes_maps: bool = False


@functools.lru_cache(maxsize=None)
def _launch_config(variant, device_id: int) -> Tuple[int, int, int]:
    """(the compiled kernel's CUfunction handle, threads, shared-memory bytes) of a variant on a
    device: one cache lookup a launch (part of the compiled-kernel cache)."""
    return get_kernel(variant).kernel.ptr, variant.threads, variant.smem_bytes


def launch_kernel(variant, params: HostArg, grid: int, extra_args: tuple = ()) -> None:
    """Launch one variant on ``grid`` CTAs with its params struct (and the kernel's further
    arguments, e.g. the Hopper kernels' tensor maps, each a :class:`HostArg`) on CuPy's current
    stream. The arguments go to the driver's launch by their host addresses (``kernelParams``: the
    driver copies the bytes at the call), not through ``RawKernel.__call__``, which converts each
    argument first."""
    cupy, driver = device.cupy_modules()
    func, threads, smem = _launch_config(variant, cupy.cuda.runtime.getDevice())
    pointers = array.array("Q", [params.address] + [a.address for a in extra_args])
    driver.launchKernel(func, grid, 1, 1, threads, 1, 1, smem, cupy.cuda.get_current_stream().ptr,
                        pointers.buffer_info()[0], 0)


def run(kernels: Sequence[KernelLaunch], params: HostArg, maps: "HostArg | None" = None) -> None:
    """Launch ``kernels`` in order with one params struct; those that take maps get ``maps``."""
    for k in kernels:
        launch_kernel(k.variant, params, k.grid, (maps,) if k.takes_maps else ())
