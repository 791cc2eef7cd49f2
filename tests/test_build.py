"""Kernel build (CPU): sources, hashing, and the NVRTC compile of the kernel variants.

Default tier: one variant of each (kernel family, architecture) compiles with zero spill
bytes and no local memory (test_each_family_compiles_without_spills), NVRTC directly, no GPU.
The kernels static_assert the tile configuration, thread count and shared-memory size in each
variant's name expression, so a name expression that disagrees with its kernel fails to compile
(test_table_and_kernel_cannot_drift).

Marker ``sweep`` (``python -m pytest -m sweep``): every variant of the table for sm_80 and sm_90
(test_variant_compiles_without_spills) and the float64 tuning candidates, each with zero spills.
"""
import os
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import SELECTED

from cuflash import CompileError
from cuflash._runtime.build import compile_offline, inline_includes, load_source, source_hash
from cuflash._dispatch.select import all_variants

from _nvrtc import needs_nvrtc

ARCHES = ("sm_80", "sm_90")


def test_sources_are_self_contained():
    for entry in {v.entry for v in all_variants()}:
        src = load_source(entry)
        assert '#include "' not in src, "local headers must be inlined"
        assert "#include <" not in src, "kernels must not need CUDA headers"
        assert source_hash() in src.splitlines()[0]


def test_each_header_is_inlined_once():
    src = inline_includes('#include "params.cuh"\n#include "common.cuh"\n#include "params.cuh"\n')
    assert src.count("struct View {") == 1
    assert src.count("typedef long long int64;") == 1


# Every variant for every architecture that can run it (the Hopper variants for sm_90, as sm_90a).
VARIANTS = [(arch, v) for arch in ARCHES for v in all_variants() if v.compile_target(arch)]


def _representative(arch, variants):
    """The variant of one (family, arch) group that is compiled in the default tier: on sm_90 a row only
    sm_90 takes where the family has one (sm_80 builds the others), then the most code (EXTRA masking,
    a band, a dbias, 16-byte loads), then the largest head bucket and tile."""
    def key(v):
        only_here = arch == "sm_90" and v.compile_target("sm_80") is None
        return (only_here, v.extra, v.band, getattr(v, "dbias", False), v.vec, v.head or 0, v.smem_bytes, v.name)
    return max(variants, key=key)


def _representatives():
    groups = {}
    for arch, v in VARIANTS:
        groups.setdefault((arch, v.family), []).append(v)
    return [(arch, family, _representative(arch, vs)) for (arch, family), vs in sorted(groups.items())]


# One variant per (arch, family): the default tier's NVRTC compiles (39 of the sweep's ~2,000).
REPRESENTATIVES = _representatives()


def _build(job):
    arch, variant = job
    try:
        return compile_offline(variant.entry, variant.name, variant.compile_target(arch))
    except CompileError as exc:
        return exc


def _build_selected(request, test_name):
    """The (arch, variant) builds of the selected ``test_name`` cases, compiled once each in parallel
    threads (NVRTC releases the GIL). Under pytest-xdist (``-n``) a worker runs only some of the cases it
    collected, so there each case compiles its own variant (None here) and the workers are the parallelism."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    selected = request.config.stash[SELECTED]   # every test the run selected
    jobs = list(dict.fromkeys((item.callspec.params["arch"], item.callspec.params["variant"])
                              for item in selected if getattr(item, "originalname", None) == test_name))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(jobs, pool.map(_build, jobs)))


def _check_build(builds, arch, variant):
    build = builds[(arch, variant)] if builds is not None else _build((arch, variant))
    if isinstance(build, CompileError):
        pytest.fail(f"{variant.name} does not compile for {arch}:\n{build.log}")
    assert build.spills == 0, f"{variant.name} spills on {arch}:\n{build.log}"
    assert build.stack_frame == 0, f"{variant.name} uses local memory on {arch}:\n{build.log}"
    # Static __shared__ memory would add to the dynamic size the launcher sets (variant.smem_bytes), which
    # some tiles fill to a GPU class's limit; the dynamic size per GPU class is checked where tiles are
    # selected (test_variants.py).
    assert "bytes smem" not in build.log, f"{variant.name} has static shared memory on {arch}:\n{build.log}"


@pytest.fixture(scope="module")
def representative_builds(request):
    return _build_selected(request, "test_each_family_compiles_without_spills")


@pytest.fixture(scope="module")
def builds(request):
    """Every selected (arch, variant) of the table compiled once (the sweep)."""
    return _build_selected(request, "test_variant_compiles_without_spills")


def test_every_family_and_arch_has_a_representative():
    assert {(arch, v.family) for arch, v in VARIANTS} == {(arch, family) for arch, family, _ in REPRESENTATIVES}
    for arch, family, v in REPRESENTATIVES:
        assert v.family == family and v.compile_target(arch), (arch, v.name)


@needs_nvrtc
@pytest.mark.parametrize("arch,family,variant", REPRESENTATIVES, ids=[f"{a}-{f}" for a, f, _ in REPRESENTATIVES])
def test_each_family_compiles_without_spills(representative_builds, arch, family, variant):
    _check_build(representative_builds, arch, variant)


@pytest.mark.sweep
@needs_nvrtc
@pytest.mark.parametrize("arch,variant", VARIANTS, ids=[f"{a}-{v.name}" for a, v in VARIANTS])
def test_variant_compiles_without_spills(builds, arch, variant):
    _check_build(builds, arch, variant)


@needs_nvrtc
@pytest.mark.parametrize("family", ["fwd_mma", "fwd_dmma", "fwd_wgmma", "fwd_wgmma_tf32x3", "bwd_dkdv_mma", "bwd_dkdv_dmma", "bwd_dq_dmma",
                                    "bwd_dkdv_wgmma"])
def test_table_and_kernel_cannot_drift(family):
    """A name expression whose shared-memory size or thread count disagrees with the
    kernel's own layout is rejected at compile time."""
    family_variants = [v for v in all_variants() if v.family == family]
    v = next((v for v in family_variants if v.extra), family_variants[0])   # the EXTRA one where there is one
    good = f", {v.threads}, {v.smem_bytes}>"
    assert good in v.name
    for bad in (f", {v.threads}, {v.smem_bytes + 16}>", f", {2 * v.threads}, {v.smem_bytes}>"):
        with pytest.raises(CompileError, match="variant table"):
            compile_offline(v.entry, v.name.replace(good, bad), v.compile_target("sm_80") or "sm_90a")


@needs_nvrtc
def test_compile_error_carries_log():
    v = next(v for v in all_variants() if v.family == "fwd_mma")
    with pytest.raises(CompileError) as info:
        compile_offline(v.entry, v.name.replace("half_t", "int", 1), "sm_90")
    assert "error" in info.value.log


def _wide_k_candidates():
    """The fp64 m16n8kK candidates benchmarks/tune_fwd.py and tune_bwd.py time (--dtype float64; branch
    f64-perf): not in the table yet, so test_variant_compiles_without_spills does not build them."""
    from cuflash._dispatch.model import Tile, Variant

    def fwd(d, bm, bn, warps, k, band):
        return Variant("fwd_dmma", "float64", d, band=band, vec=True, tile=Tile(bm, bn, warps, 2, "tuning", wide_k=k))

    def wide(family, d, band, **kw):   # the sm80 row's tile on mma.m16n8k16
        v = Variant(family, "float64", d, band=band, vec=True, **kw)
        return replace(v, tile=replace(v.tile, wide_k=16))

    two_pass = Tile(16, 64, 4, 1, "tuning", passes=2, wide_k=16)
    out = []
    for band in (False, True):
        out += [fwd(64, 64, 32, 4, 16, band), fwd(64, 64, 32, 4, 4, band), fwd(64, 128, 32, 8, 16, band),
                fwd(128, 64, 32, 4, 16, band), fwd(128, 64, 32, 4, 4, band), fwd(128, 128, 16, 8, 16, band),
                wide("bwd_dkdv_dmma", 64, band), wide("bwd_dq_dmma", 64, band)]
        out += [Variant("bwd_dkdv_dmma", "float64", 128, band=band, vec=True, pass_=p, tile=two_pass)
                for p in (1, 2)]
    return out


@pytest.mark.sweep
@needs_nvrtc
@pytest.mark.parametrize("variant", _wide_k_candidates(), ids=lambda v: v.name)
def test_wide_k_candidates_compile_without_spills_on_sm90(variant):
    build = compile_offline(variant.entry, variant.name, variant.compile_target("sm_90"))
    assert build.spills == 0 and build.stack_frame == 0, f"{variant.name}:\n{build.log}"
