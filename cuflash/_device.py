"""Whether a CUDA device can be used here (no global state beyond this query)."""
from __future__ import annotations


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a device; else (False, why)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return False, f"CuPy is not importable ({exc.__class__.__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA device ({exc.__class__.__name__}: {exc})"
    if count == 0:
        return False, "no CUDA device"
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return True, name.decode() if isinstance(name, bytes) else str(name)
