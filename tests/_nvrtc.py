"""Whether NVRTC can compile here (CPU tests that build kernels skip with the reason otherwise)."""
import pytest

try:
    from cupy_backends.cuda.libs import nvrtc

    from cuflash._runtime.build import preload_nvrtc_wheel

    preload_nvrtc_wheel()
    nvrtc.getVersion()
    _WHY = None
except Exception as exc:  # pragma: no cover - depends on the install
    _WHY = f"NVRTC not loadable: {exc}"

needs_nvrtc = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
