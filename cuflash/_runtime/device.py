"""The device: whether one cuflash can use is here (said in plain words), and its facts
(compute capability, shared memory per block, SM count), read once per device."""
from __future__ import annotations

import contextlib
import functools
from typing import Tuple

MIN_COMPUTE_CAPABILITY = 80

INSTALL_HINT = 'pip install ".[cuda12]"  (or ".[cuda13]" with a CUDA 13 driver)'


def explain_cuda_error(exc: BaseException) -> str:
    """One sentence for the CUDA errors a new user meets, with the next step."""
    text = f"{exc.__class__.__name__}: {exc}"
    if "InsufficientDriver" in text or "insufficient" in text.lower():
        version = driver_cuda_version()
        if version is None:
            return "no NVIDIA GPU driver on this machine (NumPy arrays run on the CPU path)"
        return (f"the NVIDIA driver supports CUDA {version[0]}.{version[1]}, older than the CUDA runtime CuPy was "
                "built for: update the driver, or install the matching extra (.[cuda12] for a CUDA 12 driver)")
    if "NoDevice" in text or "no CUDA-capable device" in text:
        return "no NVIDIA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    if "cupy_backends" in text or "No module named 'cupy" in text:
        return f"CuPy is not installed: {INSTALL_HINT}"
    return f"CUDA is not usable here ({text.splitlines()[0][:200]})"


def driver_cuda_version():
    """(major, minor) of the CUDA version the installed NVIDIA driver supports, or None where there is
    no driver (libcuda does not load)."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value // 1000, version.value % 1000 // 10


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a GPU cuflash supports
    (compute capability 8.0 or newer); else (False, why, in plain words)."""
    try:
        import cupy
    except ImportError:
        return False, f"CuPy is not installed: {INSTALL_HINT}"
    except Exception as exc:  # a broken CUDA install
        return False, explain_cuda_error(exc)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, explain_cuda_error(exc)
    if count == 0:
        return False, "no NVIDIA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if 10 * props["major"] + props["minor"] < 80:
        return False, (f"{name} has compute capability {props['major']}.{props['minor']}; cuflash needs 8.0 or "
                       "newer (Ampere, Ada, Hopper, Blackwell)")
    return True, name


@functools.lru_cache(maxsize=None)
def cupy_modules():
    """(cupy, cupy.cuda.driver), imported on the first launch (NumPy-only users need no CuPy)."""
    import cupy
    from cupy.cuda import driver

    return cupy, driver


@functools.lru_cache(maxsize=None)
def device_facts(device_id: int) -> Tuple[int, int, str, int]:
    """(compute capability as 10 * major + minor, opt-in shared memory per block, name, SM count)."""
    cupy, _ = cupy_modules()
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return 10 * props["major"] + props["minor"], props["sharedMemPerBlockOptin"], name, props["multiProcessorCount"]


def current_device() -> int:
    return cupy_modules()[0].cuda.runtime.getDevice()


def smem_limit() -> int:
    """Shared memory per block the current GPU allows; RuntimeError for a GPU cuflash cannot run on."""
    cc, smem, name, _ = device_facts(current_device())
    if cc < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"cuflash needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper, "
                           f"Blackwell); this one, {name}, has {cc // 10}.{cc % 10}")
    return smem


def compute_capability() -> int:
    """10 * major + minor of the current GPU (tests and the benchmark's "cuflash sm80" contender
    replace this function to take the portable path on a Hopper GPU)."""
    return device_facts(current_device())[0]


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU."""
    return device_facts(current_device())[3]


_CURRENT = contextlib.nullcontext()


def on_device(device_id: int):
    """A context in which ``device_id`` is the current device: CuPy's ``Device`` where another one
    is current, else a no-op (entering and leaving CuPy's costs a few microseconds of a call)."""
    cupy, _ = cupy_modules()
    return _CURRENT if cupy.cuda.runtime.getDevice() == device_id else cupy.cuda.Device(device_id)


@functools.lru_cache(maxsize=None)
def memset32_fn():
    """The driver's ``cuMemsetD32Async(pointer, value, count, stream)`` (ctypes on libcuda; CuPy does not
    wrap it), or None where libcuda has none."""
    import ctypes

    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemsetD32Async
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p]
    return fn
