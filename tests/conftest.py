"""Test tiers, the GPU skip, and shared fixtures.

Tiers (markers registered in pyproject.toml, whose ``addopts`` leaves out both sweeps by default):

* default, ``python -m pytest -q -rs`` (the README and CI): every behavioural test on the CPU and one
  NVRTC compile per (kernel family, architecture); GPU tests are collected and skip with the reason.
* ``sweep``, ``python -m pytest -m sweep -n auto``: the NVRTC compile of every kernel variant for every
  architecture that takes it, with zero spills (CPU; CI runs it after the default run).
* ``gpu``, ``python -m pytest -m gpu -n auto``: the GPU tests, representative cases of every kernel
  family, dtype and masking option (40 s on an H200 host of 16 cores after ``python -m cuflash compile``).
* ``gpu_sweep``, ``python -m pytest -m gpu_sweep -n auto``: every kernel variant (and the full grids the
  ``gpu`` tier samples) on the GPU (3 minutes on the same host), or in parts::

      python -m pytest -q -m gpu_sweep -n auto --sweep-part 1/4     # then 2/4, 3/4, 4/4

  ``--sweep-part i/n`` keeps every n-th ``sweep`` / ``gpu_sweep`` test (round robin over the collection
  order, so each part spans every family); other tests are left alone. A ``gpu_sweep`` test runs only when
  the ``-m`` expression names ``gpu_sweep``: ``-m gpu`` leaves out the sampled grids' other cases (which
  carry both markers).

Without a usable GPU, ``gpu`` and ``gpu_sweep`` tests skip with the reason.
"""
import os
import re

import pytest

from cuflash._runtime.device import gpu_available

_GPU_OK, _GPU_WHY = gpu_available()
SELECTED = pytest.StashKey[list]()
"""``config.stash[SELECTED]``: the tests this run selected (after the tiers and ``--sweep-part``)."""
_GPU_MARKERS = ("gpu", "gpu_sweep")
_SWEEP_MARKERS = ("sweep", "gpu_sweep")


def pytest_configure(config):
    """With pytest-xdist, one BLAS thread a worker: the workers, fresh interpreters started after this,
    inherit it (N workers of N spinning OpenBLAS threads each ran the references ~10x slower on 16
    cores)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")


def pytest_addoption(parser):
    parser.addoption("--sweep-part", default=None, metavar="I/N",
                     help="run part I of N of the sweep / gpu_sweep tests (round robin; e.g. 2/4)")


def _sweep_part(config):
    text = config.getoption("--sweep-part")
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise pytest.UsageError(f"--sweep-part takes I/N with 1 <= I <= N, not {text!r}")
    return int(match.group(1)), int(match.group(2))


def _has(item, names):
    return any(item.get_closest_marker(name) is not None for name in names)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    names_gpu_sweep = "gpu_sweep" in (config.option.markexpr or "")
    part = _sweep_part(config)
    index = 0
    for item in items:
        if item.get_closest_marker("gpu_sweep") is not None and not names_gpu_sweep:
            drop.append(item)       # a sampled grid's other case: -m gpu leaves it out
            continue
        if part is not None and _has(item, _SWEEP_MARKERS):
            index += 1
            if (index - 1) % part[1] != part[0] - 1:
                drop.append(item)
                continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config.stash[SELECTED] = list(items)
    if _GPU_OK:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {_GPU_WHY}")
    for item in items:
        if _has(item, _GPU_MARKERS):
            item.add_marker(skip)


def pytest_report_header(config):
    return f"cuflash GPU: {_GPU_WHY if not _GPU_OK else 'yes, ' + _GPU_WHY}"


@pytest.fixture
def launches(monkeypatch):
    """The kernel variants launched during the test, in order (``launch.launch_kernel`` recorded): proof
    of which kernel ran. The small helper kernels that make block states and layout spans
    (cuflash._dispatch.masking) are not variants and are left out."""
    from cuflash._runtime import launch

    seen = []
    real = launch.launch_kernel

    def record(variant, *args, **kwargs):
        if hasattr(variant, "family"):
            seen.append(variant)
        real(variant, *args, **kwargs)

    monkeypatch.setattr(launch, "launch_kernel", record)
    return seen
