"""Shared fixtures: the `gpu` marker skips with a clear reason where no device is usable."""
import pytest

from cuflash._device import gpu_available

_GPU_OK, _GPU_WHY = gpu_available()


def pytest_collection_modifyitems(config, items):
    if _GPU_OK:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {_GPU_WHY}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"cuflash GPU: {_GPU_WHY if not _GPU_OK else 'yes, ' + _GPU_WHY}"


@pytest.fixture
def launches(monkeypatch):
    """The kernel variants launched during the test, in order (``_launch._launch`` recorded): proof of
    which kernel ran."""
    from cuflash import _launch

    seen = []
    real = _launch._launch

    def record(variant, *args, **kwargs):
        seen.append(variant)
        real(variant, *args, **kwargs)

    monkeypatch.setattr(_launch, "_launch", record)
    return seen
