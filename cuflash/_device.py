"""Whether a CUDA device cuflash can use is here, said in plain words (no global state
beyond this query)."""
from __future__ import annotations

INSTALL_HINT = 'pip install ".[cuda12]"  (or ".[cuda13]" with a CUDA 13 driver)'


def explain_cuda_error(exc: BaseException) -> str:
    """One sentence for the CUDA errors a new user meets, with the next step."""
    text = f"{exc.__class__.__name__}: {exc}"
    if "InsufficientDriver" in text or "insufficient" in text.lower():
        return ("the NVIDIA driver is missing or older than the CUDA runtime CuPy was built for "
                "(install or update the driver, or use the cuda12 extra with an older driver)")
    if "NoDevice" in text or "no CUDA-capable device" in text:
        return "no NVIDIA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    if "cupy_backends" in text or "No module named 'cupy" in text:
        return f"CuPy is not installed: {INSTALL_HINT}"
    return f"CUDA is not usable here ({text.splitlines()[0][:200]})"


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
