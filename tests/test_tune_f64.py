"""benchmarks/tune_fwd.py, tune_bwd.py (--dtype float64) and dmma_rate.py, the parts that need no GPU
(branch f64-perf): the candidates they time are the WIDE_K variants they name, a float64 row that misses
its long-double check fails the run, and the MMA-rate kernels compile for sm_90."""
import contextlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from _nvrtc import needs_nvrtc

pytest.importorskip("cupy")
pytest.importorskip("ml_dtypes")

from cuflash._dispatch import plan  # noqa: E402
from cuflash._dispatch.model import SMEM_LIMITS  # noqa: E402
from cuflash._dispatch.select import backward_variants, forward_variant, tile_override  # noqa: E402

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
H100 = SMEM_LIMITS["sm_90 (H100, H200)"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tune_fwd():
    return _load("tune_fwd")


@pytest.fixture(scope="module")
def tune_bwd():
    return _load("tune_bwd")


def test_f64_rows_fail_on_error_nan_or_non_finite(tune_fwd):
    """tune_fwd printed the long-double error of a float64 row but never failed: a wrong fragment
    layout would have come back as a timing table (exit status 0) with an error column to spot."""
    assert tune_fwd.f64_failure(3e-16, True) == ""
    assert tune_fwd.f64_failure(0.4, True)
    assert tune_fwd.f64_failure(math.nan, True)
    assert tune_fwd.f64_failure(1e-16, False)


@pytest.mark.parametrize("d", [64, 128])
def test_tune_fwd_launches_the_candidate_it_names(tune_fwd, d):
    """Each float64 config reaches plan_forward's choice as the variant its label says (wide_k, tile)."""
    for cand in tune_fwd.CANDIDATES_F64[d]:
        if cand == "fma" or len(cand) != 4:
            continue
        bm, bn, warps, wide_k = cand
        label, ctx = tune_fwd.config(d, cand, True)
        with ctx:
            for band in (False, True):
                v, portable = plan.forward_choice("float64", d, band, False, True, "long", 90, H100)
                assert v is portable and v.family == "fwd_dmma" and v.wide_k == wide_k and v.band == band
                assert (v.tile.block_m, v.tile.block_n, v.tile.warps) == (bm, bn, warps), label
                assert v.name.endswith(f", {wide_k}>")
    v, _ = plan.forward_choice("float64", d, False, False, True, "long", 90, H100)
    assert v == forward_variant("float64", d, band=False, vec=True, cc=90, smem_limit=H100)   # restored


@pytest.mark.parametrize("d", [64, 128])
def test_tune_bwd_plans_carry_their_wide_k(tune_bwd, d):
    """Each float64 backward config's plan: dK/dV and dQ kernels at the wide_k of its label, the
    two-pass tile split into pass 1 (dV) and pass 2 (dK), no atomic dQ where deterministic."""
    for tile, det, dkdv_k, dq_k in tune_bwd.CANDIDATES_F64[d]:
        for band in (False, True):
            ctx = (tile_override("bwd_dkdv_dmma", d, tile, dtypes=("float64",)) if tile is not None
                   else contextlib.nullcontext())
            with ctx, tune_bwd.wide_backward(dkdv_k, dq_k):
                chosen = plan.backward_variants("float64", d, band=band, extra=False, vec=True, deterministic=det,
                                                 smem_limit=H100, cc=90)
            dkdv = [v for v in chosen if v.family == "bwd_dkdv_dmma"]
            dq = [v for v in chosen if v.family == "bwd_dq_dmma"]
            assert dkdv and all(v.wide_k == dkdv_k for v in dkdv)
            assert all(v.wide_k == dq_k for v in dq) and len(dq) == int(det)
            assert all(v.atomic_dq == (not det) for v in dkdv if v.pass_ != 1)
            if tile is not None and tile.passes == 2:
                assert [v.pass_ for v in dkdv] == [1, 2] and not any(v.atomic_dq for v in dkdv)
            else:
                assert [v.pass_ for v in dkdv] == [0]
    assert plan.backward_variants is backward_variants   # restored


@needs_nvrtc
def test_dmma_rate_kernels_compile_for_sm90():
    """dmma_rate.py's four kernels: every shape builds for sm_90 without spills; m16n8kK is refused on sm_80
    (the script skips them there)."""
    from cuflash import CompileError
    from cuflash._runtime.build import compile_source_offline

    rate = _load("dmma_rate")
    for shape in rate.SHAPES:
        build = compile_source_offline(rate.source(shape), "rate.cu", "rate", "sm_90")
        assert build.spills == 0, build.log
    with pytest.raises(CompileError):
        compile_source_offline(rate.source("m16n8k16"), "rate.cu", "rate", "sm_80")
