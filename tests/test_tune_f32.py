"""benchmarks/tune_f32.py's offline parts (CPU): every candidate is what the selection launches on
an H100 (a tile that did not fit would fall back silently to another kernel and be timed under the
candidate's name), the launch check, and the error rule (NaN must fail it)."""
import importlib.util
import sys
from pathlib import Path

import pytest

from cuflash._dispatch import model as M
from cuflash._dispatch import select as V

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "tune_f32.py"


def _load(name="tune_f32"):
    spec = importlib.util.spec_from_file_location(name, _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tf = _load()


def test_imports_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # `import cupy` raises ImportError
    _load("_tune_f32_no_cupy")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family,candidates", [("fwd_tf32x3", tf.FWD_CANDIDATES), ("bwd_dkdv_tf32x3", tf.BWD_CANDIDATES),
                                               (tf.HOPPER_FWD, tf.FWD_WGMMA_CANDIDATES)])
def test_every_candidate_is_what_an_h100_launches(family, candidates, causal):
    for d, tiles in candidates.items():
        assert tiles[0] is None   # the table's tile first: the reference of the error rule
        for tile in tiles:
            want = tf.expected(family, d, tile)
            ran = tf.planned(d, causal, family, tile)
            assert ran and all(v.tile == want and v.split == want.split for v in ran), (d, tile, ran)
            assert all(v.smem_bytes <= tf.H100_SMEM for v in ran)
    # the override is gone afterwards: the table's kernels again (the fast split; the
    # Hopper forward's TF32X3_PARTS)
    split = 3 if family == tf.HOPPER_FWD else 2
    assert all(v.split == split and v.tile == tf.expected(family, 64, None) for v in tf.planned(64, causal, family, None))
    assert ("sm90a", tf.HOPPER_FWD, "float32", 64) in M.TABLES["plain"]   # without_hopper_forward put the row back


def test_check_ran_stops_on_a_fallback():
    fast = M.Tile(64, 32, 4, 2, "fast split", split=2)
    with tf.override("fwd_tf32x3", 64, fast):
        good = V.forward_variant("float32", 64, band=False, vec=True, cc=90, smem_limit=tf.H100_SMEM)
    tf.check_ran([M.Variant("bwd_dsum", "float32", 0), good], "fwd_tf32x3", 64, fast, "ok")
    table = V.forward_variant("float32", 64, band=False, vec=True, cc=90, smem_limit=tf.H100_SMEM)
    with pytest.raises(SystemExit):   # the table's kernel ran instead of the candidate
        tf.check_ran([table], "fwd_tf32x3", 64, fast, "x")
    with pytest.raises(SystemExit):   # the FMA fallback ran
        tf.check_ran([M.Variant("fwd_fma", "float32", 64)], "fwd_tf32x3", 64, fast, "x")
    with pytest.raises(SystemExit):   # the same tile, the other split
        tf.check_ran([good], "fwd_tf32x3", 64, M.Tile(64, 32, 4, 2, "fast split", split=1), "x")


def test_error_rule_flags_nan_and_inf():
    nan, inf = float("nan"), float("inf")
    assert not tf.flagged_errors([1e-7], None) and not tf.flagged_errors([1.9e-7], [1e-7])
    assert tf.flagged_errors([2.7e-7], [1e-7])   # 2 x 1e-7 + 2^-24 = 2.6e-7
    assert tf.flagged_errors([nan], None) and tf.flagged_errors([nan], [1e-7])
    assert tf.flagged_errors([1e-7, inf, 1e-7], [1e-7] * 3)
