"""Kernel build (CPU): sources, hashing, and the NVRTC compile of every variant.

Every variant must compile for sm_80 and sm_90 with zero spill bytes; this runs
NVRTC directly and needs no GPU.
"""
import pytest

from cuflash import CompileError
from cuflash._build import compile_offline, load_source, source_hash
from cuflash._launch import all_variants

try:
    from cupy_backends.cuda.libs import nvrtc

    from cuflash._build import preload_nvrtc_wheel

    preload_nvrtc_wheel()
    nvrtc.getVersion()
    _NVRTC_WHY = None
except Exception as exc:  # pragma: no cover - depends on the install
    _NVRTC_WHY = f"NVRTC not loadable: {exc}"

needs_nvrtc = pytest.mark.skipif(_NVRTC_WHY is not None, reason=_NVRTC_WHY or "")


def test_sources_are_self_contained():
    for entry in {v.entry for v in all_variants()}:
        src = load_source(entry)
        assert '#include "' not in src, "local headers must be inlined"
        assert "#include <" not in src, "kernels must not need CUDA headers"
        assert source_hash() in src.splitlines()[0]


VARIANTS = [(arch, v) for arch in ("sm_80", "sm_90") for v in all_variants()]


@needs_nvrtc
@pytest.mark.parametrize("arch,variant", VARIANTS, ids=[f"{a}-{v.name}" for a, v in VARIANTS])
def test_variant_compiles_without_spills(arch, variant):
    build = compile_offline(variant.entry, variant.name, arch)
    assert build.spills == 0, f"{variant.name} spills on {arch}:\n{build.log}"
    assert build.stack_frame == 0, f"{variant.name} uses local memory on {arch}:\n{build.log}"
    assert build.registers <= 255
    assert variant.smem_bytes <= 227 * 1024


@needs_nvrtc
def test_compile_error_carries_log():
    with pytest.raises(CompileError) as info:
        compile_offline("flash_fwd.cu", "flash_fwd_mma<int, 64, 64, 4, false, false>", "sm_90")
    assert "error" in info.value.log
