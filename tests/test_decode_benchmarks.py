"""The decoding benchmarks' offline parts (CPU): benchmarks/read_ceiling.py's kernels build with NVRTC for every
configuration's residency (at most 32 registers a thread, no spills), and benchmarks/tune_decode.py's candidate
tiles parse into the tiles the table would hold."""
import importlib.util
import sys
from pathlib import Path

import pytest

from _nvrtc import needs_nvrtc
from cuflash._dispatch.model import Tile

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
    sys.path.insert(0, str(_BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"_{name}_under_test", _BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(_BENCH))


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("kernel", ["read_once_4", "read_once_8"])
def test_the_read_ceiling_kernels_stay_resident(arch, kernel):
    """Eight CTAs of 256 threads an SM (the configurations of read_ceiling.py) need at most 32 registers."""
    from cuflash._runtime.build import compile_source_offline

    build = compile_source_offline(_load("read_ceiling").SOURCE, "read_ceiling.cu", kernel, arch)
    assert build.registers <= 32 and build.spill_stores == 0


def test_candidate_tiles_parse():
    parse = _load("tune_decode").parse_tile
    tile = parse("32x128x8x2")
    assert (tile.block_m, tile.block_n, tile.warps, tile.stages, tile.ctas) == (32, 128, 8, 2, 1)
    assert parse("16x64x4x3@3") == Tile(16, 64, 4, 3, "tune_decode.py candidate 16x64x4x3@3", ctas=3)
