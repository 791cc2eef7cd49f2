"""Kernel launches: select the variants of a call (``_variants``), build its params
struct (``_params``), launch on CuPy's current stream. Nothing here is per variant."""
from __future__ import annotations

import array
import contextlib
import functools
from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np

from . import _params, _tma, _variants
from ._checks import _cupy as _checks_cupy
from ._build import get_kernel
from ._variants import (TF32_BWD_FAMILIES, Variant, backward_variants, block_queue, forward_choice, head_bucket,
                        persistent_grid, row_class, vec_chunk)


MIN_COMPUTE_CAPABILITY = 80


@functools.lru_cache(maxsize=None)
def _device_facts(device_id: int) -> Tuple[int, int, str, int]:
    """(compute capability as 10 * major + minor, opt-in shared memory per block, name, SM count)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return 10 * props["major"] + props["minor"], props["sharedMemPerBlockOptin"], name, props["multiProcessorCount"]


def _smem_limit() -> int:
    """Shared memory per block the current GPU allows; RuntimeError for a GPU cuflash cannot run on."""
    import cupy

    cc, smem, name, _ = _device_facts(cupy.cuda.runtime.getDevice())
    if cc < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"cuflash needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper, "
                           f"Blackwell); this one, {name}, has {cc // 10}.{cc % 10}")
    return smem


def _compute_capability() -> int:
    """10 * major + minor of the current GPU (the tests and the benchmark's "cuflash sm80" contender
    patch this to take the portable path on a Hopper GPU)."""
    import cupy

    return _device_facts(cupy.cuda.runtime.getDevice())[0]


def vec_loads_ok(d: int, dv: int, *arrays) -> bool:
    """16-byte cp.async loads: rows of whole 16-byte chunks (8 16-bit or 2 fp64 elements, ``vec_chunk``),
    16-byte aligned base and row stride."""
    chunk = vec_chunk(arrays[0].itemsize)
    return (d % chunk == 0 and dv % chunk == 0
            and all(x.data.ptr % 16 == 0 and (x.strides[2] // x.itemsize) % chunk == 0 for x in arrays))


@functools.lru_cache(maxsize=None)
def _launch_config(variant: Variant, device_id: int) -> Tuple[int, int, int]:
    """(the compiled kernel's CUfunction handle, threads, shared-memory bytes) of a variant on a
    device: one cache lookup a launch (part of the compiled-kernel cache)."""
    return get_kernel(variant).kernel.ptr, variant.threads, variant.smem_bytes


@functools.lru_cache(maxsize=None)
def _cupy():
    """(cupy, cupy.cuda.driver), imported on the first launch (NumPy-only users need no CuPy)."""
    import cupy
    from cupy.cuda import driver

    return cupy, driver


def on_device(device_id: int):
    """A context in which ``device_id`` is the current device: CuPy's ``Device`` where another one
    is current, else a no-op (entering and leaving CuPy's costs a few microseconds of a call)."""
    cupy, _ = _cupy()
    return _CURRENT if cupy.cuda.runtime.getDevice() == device_id else cupy.cuda.Device(device_id)


_CURRENT = contextlib.nullcontext()


def _launch(variant: Variant, params: _params.HostArg, dims: Tuple[int, int, int, int, int], grid: int = 0,
            extra_args: tuple = ()) -> None:
    """Launch one variant with its params struct (and the kernel's further arguments, e.g. the
    Hopper forward's tensor maps, each a :class:`cuflash._params.HostArg`) on CuPy's current
    stream; ``dims`` = (batch, heads_q, group, lq, lk) size the grid unless ``grid`` (CTAs) is
    given. The arguments go to the driver's launch by their host addresses (``kernelParams``: the
    driver copies the bytes at the call), not through ``RawKernel.__call__``, which converts each
    argument first."""
    cupy, driver = _cupy()
    func, threads, smem = _launch_config(variant, cupy.cuda.runtime.getDevice())
    pointers = array.array("Q", (params.address,) if not extra_args else
                           [params.address] + [a.address for a in extra_args])
    driver.launchKernel(func, grid or variant.grid(*dims), 1, 1, threads, 1, 1, smem,
                        cupy.cuda.get_current_stream().ptr, pointers.buffer_info()[0], 0)


TMA_STORE_O_HEAD = 128
"""The 16-bit Hopper forward stores O through its tensor map from this head dim on
(``FwdWgmmaTraits::TMA_STORE_O``); below it, and in the float32 one, O is stored element by
element and its map is not encoded."""


def scale_folds(scale: float) -> bool:
    """Whether the plain kernels can take ``scale``: they fold ``scale * log2(e)`` (as float32)
    into the exponential, which needs it positive and normal (``ScoreMod::scores_stay_raw`` in
    kernels_cu/score_mod.cuh). Any other scale runs on the EXTRA variant, which scales first."""
    return _params.as_float32(scale * _params.LOG2E) >= float(np.finfo(np.float32).tiny)


def launch_forward(q, k, v, out, lse, *, dtype: str, masking, scale: float, group: int,
                   precision: str = "highest") -> "ForwardLaunch":
    """Run the forward kernel on 4-D views ``(B, H, L, D)`` (last axis unit-stride) into
    ``out`` and ``lse``; ``masking`` is the call's :class:`cuflash._masking.KernelMasking`;
    ``precision`` (float32 only) picks 3xTF32 ("highest") or TF32 ("tf32") tensor cores.
    Returns what it launched (a :class:`ForwardPlan`'s makings)."""
    d, dv = q.shape[3], v.shape[3]
    extra = masking.extra or not scale_folds(scale)
    head = head_bucket(max(d, dv))
    band = masking.band is not None
    variant, portable = forward_choice(dtype, head, band, extra, vec_loads_ok(d, dv, q, k, v),
                                        row_class(head, k.shape[2], band), _compute_capability(), _smem_limit(),
                                        precision)
    extra_args = ()
    if variant.arch == "sm90a":
        # The Hopper kernels (16-bit, and float32 on TF32 wgmma) load through tensor maps (the driver's
        # encoder and layouts a map can describe; float32 maps need the same 16-byte aligned bases and
        # strides) and read a bias by 16-byte chunks of its rows (16-bit: cp.async into shared memory;
        # float32: 8-byte pairs straight into the score fragments, bias_frags.cuh): any other call,
        # EXTRA or not, takes the portable kernel of the same GPU.
        map_boxes = (variant.tile.block_m, variant.tile.block_n,
                     variant.family == "fwd_wgmma" and head >= TMA_STORE_O_HEAD)
        maps = _tma.fwd_tensor_maps(q, k, v, out, *map_boxes) if masking.bias_in_chunks else None
        if maps is not None:
            extra_args = (maps,)
        else:
            variant, map_boxes = portable, None
    else:
        map_boxes = None
    dims = (q.shape[0], q.shape[1], group, q.shape[2], k.shape[2])
    ctas, queue = 0, None
    if persistent_grid(variant):
        cupy, _ = _cupy()
        ctas = min(variant.grid(*dims), _device_facts(cupy.cuda.runtime.getDevice())[3])
        if block_queue(variant):
            queue = new_block_queue()
    params = _params.fwd_params(q, k, v, out, lse, group=group, scale=scale, mask=masking.values,
                                block_queue=0 if queue is None else queue.data.ptr)
    _launch(variant, params, dims, ctas, extra_args=extra_args)
    return ForwardLaunch(variant, dims, ctas, params, map_boxes, extra_args[0] if extra_args else None,
                         queue is not None)


def new_block_queue():
    """A zeroed int32 on the current device: the counter a persistent grid takes its blocks from
    (FwdParams::block_queue). One a launch: CTAs of two launches never share one (two streams)."""
    cupy, _ = _cupy()
    return cupy.zeros(1, dtype=cupy.int32)


class ForwardLaunch(NamedTuple):
    """What :func:`launch_forward` launched: the variant, the grid's dims, its CTAs (0: a CTA a query
    block), its params, the boxes of its tensor maps ((block_m, block_n, store_out), or None for a
    kernel without maps), the maps, and whether it took its blocks from a block queue
    (:func:`new_block_queue`, a new one a launch)."""

    variant: Variant
    dims: Tuple[int, int, int, int, int]
    ctas: int
    params: _params.HostArg
    map_boxes: Optional[Tuple[int, int, bool]]
    maps: Optional[_params.HostArg]
    queue: bool = False


# ------------------------------------------------------------------ plans
#
# A call without masking options repeats, in a training or sampling loop, with the same shapes, strides,
# dtype and options: its checks, kernel choice and params differ only in the array addresses (five in a
# forward, eleven in a backward). Its first call runs the full path (api.attention_forward /
# api.attention_backward) and stores what it decided as a ForwardPlan or a BackwardPlan under the call's
# signature (forward_plan_key, backward_plan_key); a later call with that signature allocates what the
# full path allocated, writes the addresses into a copy of the params, re-points the Hopper kernels'
# tensor maps and launches the same kernels in the same order, skipping the Python of the checks and the
# choice (~25 us of a forward's host time, ~55 us of a backward's, measured without a GPU by
# .dev/host_local.py). The key holds everything the checks and the choice read: the arrays' type, dtypes,
# shapes, strides, devices and 16-byte alignment, causal and scale with their types (True == 1 as dict
# keys), the precision (and the backward's deterministic flag), and the hooks tests and benchmarks replace
# (the functions themselves, so that a replaced one is a different key); _variants.tile_override clears
# the plans with the selection caches. A plan is stored only where the kernels read the caller's arrays
# themselves (the checks copied none of them: the plan writes the caller's addresses), and never for a
# call with a masking option (bias, mask, window, block layout, dropout or a seed), whose params point at
# arrays the call builds from the options. Like the kernel cache it is a memo: a plan is a pure function
# of its key.

MAX_FORWARD_PLANS = 256
MAX_BACKWARD_PLANS = 256
_FORWARD_PLANS: dict = {}
_BACKWARD_PLANS: dict = {}


class ForwardPlan(NamedTuple):
    """What a forward call with a repeated signature needs: the device, the outputs' shapes and
    dtypes, the first call's launch (variant, dims, CTAs, map boxes), its params and maps as bytes
    with the addresses to be written in."""

    device: int
    out_shape: Tuple[int, ...]
    lse_shape: Tuple[int, ...]
    out_dtype: object
    lse_dtype: object
    launch: ForwardLaunch
    params: bytes              # FwdParams with the five array addresses (and the block queue's) zero
    maps: Optional[bytes]      # the first call's tensor maps (their addresses are replaced), or None


_FWD_POINTERS = tuple(_params.STRUCTS["FwdParams"].fields[name][1] for name in ("q", "k", "v", "out", "lse"))
_FWD_QUEUE = (_params.STRUCTS["FwdParams"].fields["block_queue"][1],)
_BWD_POINTERS = tuple(_params.STRUCTS["BwdParams"].fields[name][1]
                      for name in ("q", "k", "v", "out", "dout", "lse", "dsum", "dq_acc", "dq", "dk", "dv"))


def _without_addresses(params: _params.HostArg, pointers: tuple) -> bytes:
    """A params struct's bytes with the array addresses at ``pointers`` zero: a plan's template."""
    template = bytearray(params.data)
    for offset in pointers:
        template[offset:offset + 8] = bytes(8)
    return bytes(template)


def replayable(launch) -> bool:
    """Whether a launch (:class:`ForwardLaunch` or :class:`BackwardLaunch`) can be repeated by a plan:
    without tensor maps, or where the driver can re-point them."""
    return launch.maps is None or _tma.can_readdress()


def plans_apply(bias, mask, window, block_layout, seed, dropout_p) -> bool:
    """Whether a call's masking options leave it one a plan can repeat: none given (a dropout_p of
    exactly 0.0, as a float; anything else is for the checks to judge)."""
    return (bias is None and mask is None and window is None and block_layout is None and seed is None
            and type(dropout_p) is float and dropout_p == 0.0)


def _plain_options(causal, scale) -> bool:
    """Whether ``causal`` and ``scale`` are of types a signature may hold as they are: any value here
    is hashed before the checks run (and True == 1, 1.0 == 1 as dict keys)."""
    return (type(causal) is bool or type(causal) is str) and (scale is None or type(scale) is float)


def forward_plan_key(q, k, v, causal, scale, precision) -> Optional[tuple]:
    """The signature a plan is stored under, or None for a call that takes no plan (not three CuPy
    arrays of exactly ``cupy.ndarray``, not 4-D, or a causal / scale of a type the checks would
    have to judge: any value here is hashed before the checks run). A scale of 0.0 and one of -0.0
    share a key (equal as dict keys): both make every score 0, so out and lse are the same."""
    if not _plain_options(causal, scale):
        return None
    cupy = _checks_cupy()
    ndarray = None if cupy is None else cupy.ndarray
    if ndarray is None or type(q) is not ndarray or type(k) is not ndarray or type(v) is not ndarray:
        return None
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return None
    qd, kd, vd = q.data, k.data, v.data
    return (q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, q.dtype, k.dtype, v.dtype,
            qd.device_id, kd.device_id, vd.device_id, qd.ptr & 15, kd.ptr & 15, vd.ptr & 15,
            type(causal), causal, type(scale), scale, precision,
            _compute_capability, _smem_limit, _device_facts, forward_choice, _tma._encode_fn, persistent_grid,
            block_queue, _variants.HOPPER_FWD_PERSISTENT)


def backward_plan_key(dout, q, k, v, out, lse, causal, scale, precision, deterministic) -> Optional[tuple]:
    """The signature a backward plan is stored under, or None for a call that takes no plan (not six
    arrays of exactly ``cupy.ndarray``, a ``deterministic`` that is not a bool, a causal / scale of a
    type the checks would have to judge, or a scale of zero: 0.0 == -0.0 as dict keys, but the
    gradients, which are multiplied by it, carry its sign). Any number of dims: the full path stores
    a plan only where its 4-D views are the arrays' own memory (api.attention_backward)."""
    if type(deterministic) is not bool or not _plain_options(causal, scale) or scale == 0.0:
        return None
    cupy = _checks_cupy()
    nd = None if cupy is None else cupy.ndarray
    if (nd is None or type(dout) is not nd or type(q) is not nd or type(k) is not nd or type(v) is not nd
            or type(out) is not nd or type(lse) is not nd):
        return None
    gd, qd, kd, vd, od, ld = dout.data, q.data, k.data, v.data, out.data, lse.data
    return (dout.shape, q.shape, k.shape, v.shape, out.shape, lse.shape,
            dout.strides, q.strides, k.strides, v.strides, out.strides, lse.strides,
            dout.dtype, q.dtype, k.dtype, v.dtype, out.dtype, lse.dtype,
            gd.device_id, qd.device_id, kd.device_id, vd.device_id, od.device_id, ld.device_id,
            # each array's own: the choice reads some arrays' alignment and not others' (out, lse)
            gd.ptr & 15, qd.ptr & 15, kd.ptr & 15, vd.ptr & 15, od.ptr & 15, ld.ptr & 15,
            type(causal), causal, type(scale), scale, precision, deterministic,
            _compute_capability, _smem_limit, _device_facts, backward_variants, _tma._encode_fn)


def _store(plans: dict, limit: int, key: tuple, plan) -> None:
    """Keep ``plan`` under ``key`` in ``plans``, which hold at most ``limit``."""
    if len(plans) >= limit:
        plans.clear()   # a loop over more signatures than this re-plans (no LRU bookkeeping a call)
    plans[key] = plan


def forward_plan_for(key: Optional[tuple]) -> Optional["ForwardPlan"]:
    """The forward plan stored under ``key`` (None: none, or no key)."""
    return None if key is None else _FORWARD_PLANS.get(key)


def backward_plan_for(key: Optional[tuple]) -> Optional["BackwardPlan"]:
    """The backward plan stored under ``key`` (None: none, or no key)."""
    return None if key is None else _BACKWARD_PLANS.get(key)


def store_forward_plan(key: tuple, plan: ForwardPlan) -> None:
    _store(_FORWARD_PLANS, MAX_FORWARD_PLANS, key, plan)


def clear_plans() -> None:
    """Forget every forward and backward plan (a table or a hook they were chosen by changed)."""
    _FORWARD_PLANS.clear()
    _BACKWARD_PLANS.clear()


def forward_plan(out, lse, launch: ForwardLaunch) -> ForwardPlan:
    """The plan of a call that launched ``launch`` into ``out`` and ``lse``."""
    return ForwardPlan(out.data.device_id, out.shape, lse.shape, out.dtype, lse.dtype, launch,
                       _without_addresses(launch.params, _FWD_POINTERS + _FWD_QUEUE),
                       None if launch.maps is None else bytes(launch.maps.data))


def run_forward_plan(plan: ForwardPlan, q, k, v):
    """(out, lse) of a call whose signature has ``plan``; None where the driver has no
    ``cuTensorMapReplaceAddress`` after all (the caller then takes the full path; an error of the
    driver's raises, as the encoder's does on the full path)."""
    cupy, _ = _cupy()
    launch = plan.launch
    with on_device(plan.device):
        out = cupy.empty(plan.out_shape, dtype=plan.out_dtype)
        lse = cupy.empty(plan.lse_shape, dtype=plan.lse_dtype)
        extra_args = ()
        if launch.map_boxes is not None:
            maps = _tma.readdressed(plan.maps, (q, k, v, out if launch.map_boxes[2] else None))
            if maps is None:
                return None
            extra_args = (maps,)
        params = _params.HostArg(plan.params)
        params.put_addresses(_FWD_POINTERS, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr))
        if launch.queue:
            queue = new_block_queue()
            params.put_addresses(_FWD_QUEUE, (queue.data.ptr,))
        _launch(launch.variant, params, launch.dims, launch.ctas, extra_args=extra_args)
    return out, lse


class BackwardLaunch(NamedTuple):
    """What :func:`launch_backward` launched: its allocations (dsum; the dQ accumulator's padded
    buffer, None on the deterministic path; dq, dk, dv), its kernels in launch order as
    (variant, grid (0: from ``dims``), whether it takes the tensor maps), the grid's dims, its
    params and the Hopper dK/dV kernel's maps (``BwdTensorMaps``: q, dout, k, v, dq_acc), or None."""

    device: int
    acc_dtype: object
    dsum_shape: Tuple[int, ...]
    dq_acc_shape: Optional[Tuple[int, ...]]
    grad_dtype: object
    grad_shapes: Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]
    kernels: Tuple[Tuple[Variant, int, bool], ...]
    dims: Tuple[int, int, int, int, int]
    params: _params.HostArg
    maps: Optional[_params.HostArg]


class BackwardPlan(NamedTuple):
    """What a backward call with a repeated signature needs: the input shapes (the grads'), the first
    call's launch (allocations, kernels, dims), its params and maps as bytes with the addresses to be
    written in."""

    shapes: Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]   # q, k, v as given: the grads'
    launch: BackwardLaunch
    params: bytes              # BwdParams with the eleven array addresses zero
    maps: Optional[bytes]      # the first call's tensor maps (their addresses are replaced), or None


def store_backward_plan(key: tuple, plan: BackwardPlan) -> None:
    _store(_BACKWARD_PLANS, MAX_BACKWARD_PLANS, key, plan)


def backward_plan(shapes: tuple, launch: BackwardLaunch) -> BackwardPlan:
    """The plan of a call with inputs q, k, v of ``shapes`` that launched ``launch`` (no dbias)."""
    return BackwardPlan(tuple(shapes), launch, _without_addresses(launch.params, _BWD_POINTERS),
                        None if launch.maps is None else bytes(launch.maps.data))


def run_backward_plan(plan: BackwardPlan, dout, q, k, v, out, lse) -> Optional[tuple]:
    """(dq, dk, dv), shaped as q, k, v, of a call whose signature has ``plan``; None where the
    driver has no ``cuTensorMapReplaceAddress`` after all (the caller then takes the full path; an
    error of the driver's raises). Allocates
    what :func:`launch_backward` allocates, in its order (the dQ accumulator zeroed)."""
    cupy, _ = _cupy()
    launch = plan.launch
    grad_dtype, (dq_shape, dk_shape, dv_shape) = launch.grad_dtype, launch.grad_shapes
    with on_device(launch.device):
        dsum = cupy.empty(launch.dsum_shape, dtype=launch.acc_dtype)
        dq_acc = None if launch.dq_acc_shape is None else cupy.zeros(launch.dq_acc_shape, dtype=launch.acc_dtype)
        dq = cupy.empty(dq_shape, dtype=grad_dtype)
        dk = cupy.empty(dk_shape, dtype=grad_dtype)
        dv = cupy.empty(dv_shape, dtype=grad_dtype)
        maps = None
        if plan.maps is not None:
            # the accumulator's view [..., :d] starts where its padded buffer does
            maps = _tma.readdressed(plan.maps, (q, dout, k, v, dq_acc))
            if maps is None:
                return None
        params = _params.HostArg(plan.params)
        params.put_addresses(_BWD_POINTERS, (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr,
                                             lse.data.ptr, dsum.data.ptr, 0 if dq_acc is None else dq_acc.data.ptr,
                                             dq.data.ptr, dk.data.ptr, dv.data.ptr))
        dims = launch.dims
        for variant, grid, takes_maps in launch.kernels:
            _launch(variant, params, dims, grid, extra_args=(maps,) if takes_maps else ())
    qs, ks, vs = plan.shapes
    return (dq if dq_shape == qs else dq.reshape(qs), dk if dk_shape == ks else dk.reshape(ks),
            dv if dv_shape == vs else dv.reshape(vs))


def dq_accumulator_shape(plan, b: int, hq: int, lq: int, d: int) -> Tuple[int, int, int, int]:
    """The shape of the atomic backward's fp32 dQ accumulator for a plan's kernels. The 16-bit tensor-core
    dK/dV kernel adds into 16 x 8 fragment tiles (atomics.cuh, dq_tile): rows up to whole steps of its tile,
    columns its head bucket, so that no reduction needs a test; the convert kernel reads them as tiles. The
    other kernels add row-major, rows padded to an even width (two columns at a time). Kernels read the
    accumulator's strides only, so they take the whole array (the Hopper kernel's tensor map the view
    ``[..., :d]``)."""
    tiled = next((v_ for v_ in plan if v_.family == "bwd_dkdv_mma" and v_.atomic_dq), None)
    if tiled is not None:
        rows = -(-lq // tiled.tile.block_m) * tiled.tile.block_m
        return (b, hq, rows, tiled.head)
    return (b, hq, lq, d + d % 2)


def launch_backward(dout, q, k, v, out, lse, *, dtype: str, masking, dbias_plan: Optional[Callable] = None,
                    scale: float, group: int, deterministic: bool, precision: str = "highest"):
    """Gradients ``(dq, dk, dv, dbias)`` (dq, dk, dv new contiguous 4-D arrays), then what it launched
    (a :class:`BackwardLaunch`, a :class:`BackwardPlan`'s makings), from 4-D views of
    the inputs and ``lse (B, Hq, Lq)`` in the accumulator dtype (any strides). ``dbias_plan``,
    called with ``kernel_tile=`` (the tensor-core path's dbias kernel tile and ``sm_count=``),
    ``key_major=True`` (the Hopper dK/dV kernel adds dS itself) or ``dkdv_tile=`` (the dK kernel's,
    FMA or float64 tensor-core, which adds dS itself), returns the call's
    :class:`cuflash._masking.DbiasPlan` (None: no bias), which is returned as ``dbias``. ``precision``
    (float32 only) picks 3xTF32 ("highest") or TF32 ("tf32") tensor cores, or "fma" the FMA kernels."""
    import cupy

    b, hq, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    acc_dtype = np.float64 if dtype == "float64" else np.float32
    extra = masking.extra or not scale_folds(scale)
    choose = functools.partial(backward_variants, dtype, head_bucket(max(d, dv)), band=masking.band is not None,
                               extra=extra, vec=vec_loads_ok(d, dv, q, k, v, dout), deterministic=deterministic,
                               smem_limit=_smem_limit(), dbias=dbias_plan is not None, precision=precision)
    dsum = cupy.empty((b, hq, lq), dtype=acc_dtype)
    plan = choose(cc=_compute_capability())
    hopper = next((v_ for v_ in plan if v_.family == "bwd_dkdv_wgmma"), None)
    if hopper is not None and not masking.bias_in_chunks:   # the portable plan (see launch_forward)
        plan, hopper = choose(cc=MIN_COMPUTE_CAPABILITY), None
    dq_acc_shape = None if deterministic else dq_accumulator_shape(plan, b, hq, lq, d)
    dq_acc = None if deterministic else cupy.zeros(dq_acc_shape, dtype=acc_dtype)   # (kernels read its strides)
    dq = cupy.empty((b, hq, lq, d), dtype=q.dtype)
    dk = cupy.empty((b, hk, lk, d), dtype=q.dtype)
    dv_ = cupy.empty((b, hk, lk, dv), dtype=q.dtype)
    hopper_maps = None
    if hopper is not None:   # (atomic dQ: dq_acc exists, row-major) its tensor maps, or the portable plan
        hopper_maps = _tma.bwd_tensor_maps(q, dout, k, v, dq_acc[..., :d], hopper.tile.block_m, hopper.tile.block_n)
        if hopper_maps is None:
            plan, hopper = choose(cc=MIN_COMPUTE_CAPABILITY), None
            dq_acc_shape = dq_accumulator_shape(plan, b, hq, lq, d)   # (the portable kernels' tiles)
            dq_acc = cupy.zeros(dq_acc_shape, dtype=acc_dtype)
    dbias = None
    dbias_values = _params.DBIAS_OFF
    dbias_kernel = next((v_ for v_ in plan if v_.family == "bwd_dbias_mma"), None)
    if dbias_plan is not None:
        if dbias_kernel is not None:
            sm_count = _device_facts(cupy.cuda.runtime.getDevice())[3]
            dbias = dbias_plan(kernel_tile=(dbias_kernel.tile.block_m, dbias_kernel.tile.block_n), sm_count=sm_count)
        elif hopper is not None and hopper.dbias:
            dbias = dbias_plan(key_major=True)
        else:
            dk_kernel = [v_ for v_ in plan if v_.family.startswith("bwd_dkdv") and v_.pass_ != 1][0]
            dbias = dbias_plan(dkdv_tile=(dk_kernel.tile.block_m, dk_kernel.tile.block_n),
                               key_major_for_atomics=any(dk_kernel.family == f[0] for f in TF32_BWD_FAMILIES.values()))
        dbias_values = dbias.values
    params = _params.bwd_params(q, k, v, out, dout, lse, dsum, dq_acc, dq, dk, dv_, group=group, scale=scale,
                                mask=masking.values, dbias=dbias_values)
    dims = (b, hq, group, lq, lk)
    kernels = []
    for variant in plan:
        if variant is dbias_kernel and not dbias.grid:
            continue   # dbias is exactly zero (a bias constant along keys)
        grid = dbias.grid if variant is dbias_kernel else 0
        _launch(variant, params, dims, grid, extra_args=(hopper_maps,) if variant is hopper else ())
        kernels.append((variant, grid, variant is hopper))
    launched = BackwardLaunch(dq.data.device_id, acc_dtype, dsum.shape, dq_acc_shape, q.dtype,
                              (dq.shape, dk.shape, dv_.shape), tuple(kernels), dims, params, hopper_maps)
    return dq, dk, dv_, dbias, launched
