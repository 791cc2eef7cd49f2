"""benchmarks/bench_precision.py's pure-Python parts (CPU): options, cases, FLOPs, the exact
answer on the probe, the error function and the tables."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from cuflash import reference

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_precision.py"
if not _PATH.is_file():   # .ci/run copies benchmarks/ beside tests/; an installed package alone has no scripts
    pytest.skip("benchmarks/bench_precision.py ships with the source repository, not with the package",
                allow_module_level=True)
_spec = importlib.util.spec_from_file_location("bench_precision", _PATH)
bp = importlib.util.module_from_spec(_spec)
sys.modules["bench_precision"] = bp            # the process pool pickles its functions by module name
_spec.loader.exec_module(bp)


def test_module_imports_no_gpu_library():
    """The CPU CI has no GPU and may lack torch: importing the script must not need them."""
    text = _PATH.read_text()
    head = text[:text.index("# ----------------------------------------------------------------------------- cases")]
    assert "import cupy" not in head and "import torch" not in head


def test_defaults_and_quick():
    args = bp.parse_args([])
    assert args.lengths == (1024, 4096, 16384) and args.head_dims == (64, 128)
    assert args.dtypes == ("fp32", "fp64") and not args.no_bwd and args.logit_scale == 1.0
    assert args.ref == "longdouble" and args.skip == frozenset()
    quick = bp.parse_args(["--quick"])
    assert quick.lengths == (4096,)
    assert bp.parse_args(["--quick", "--lengths", "1024"]).lengths == (1024,)   # --lengths wins


def test_options():
    args = bp.parse_args(["--dtypes", "fp64", "--head-dims", "128", "--lengths", "2048,8192", "--no-bwd",
                          "--skip", "torch math tf32, naive cupy", "--logit-scale", "30", "--repeat", "5",
                          "--out", "somewhere", "--ref", "float64"])
    assert args.dtypes == ("fp64",) and args.head_dims == (128,) and args.lengths == (2048, 8192)
    assert args.no_bwd and args.skip == {"torch math tf32", "naive cupy"} and args.logit_scale == 30.0
    assert args.repeat == 5 and args.out == "somewhere" and args.ref == "float64"


@pytest.mark.parametrize("argv", [["--dtypes", "bf16"], ["--lengths", "1000"], ["--head-dims", "96"],
                                  ["--head-dims", "512"]])
def test_bad_options_are_refused(argv):
    with pytest.raises(SystemExit):
        bp.parse_args(argv)


def test_cases_keep_the_token_and_width_budget():
    got = bp.cases(("fp32", "fp64"), (64, 128), (1024, 4096, 16384))
    assert len(got) == 2 * 3 * 2 * 2 * 2
    for dtype, b, h, n, d, causal, pass_ in got:
        assert b * n == 16384 and h * d == 2048
    assert {c[6] for c in got} == {"fwd", "fwd+bwd"} and {c[5] for c in got} == {False, True}
    # grouped by (D, L): one set of inputs (and exact answers) at a time
    groups = [(c[4], c[3]) for c in got]
    assert groups == sorted(groups, key=groups.index)
    assert all(c[6] == "fwd" for c in bp.cases(("fp32",), (64,), (4096,), with_bwd=False))


def test_flops():
    assert bp.flops(4, 32, 4096, 64, False, "fwd") == 4 * 4 * 32 * 4096 * 4096 * 64
    assert bp.flops(4, 32, 4096, 64, True, "fwd") == 2 * 4 * 32 * 4096 * 4096 * 64
    assert bp.flops(1, 16, 16384, 128, True, "fwd+bwd") == 3.5 * 2 * 16 * 16384 * 16384 * 128


def test_memory_estimate_skips_only_materialising_contenders():
    assert bp.nxn_gb("cuflash", "fp64", 1, 16, 16384, "fwd") == 0
    assert bp.nxn_gb("torch math", "fp32", 4, 32, 4096, "fwd") == pytest.approx(2 * 4 * 32 * 4096**2 * 4 / 1e9)
    assert bp.nxn_gb("naive cupy", "fp64", 16, 32, 1024, "fwd+bwd") == pytest.approx(6 * 16 * 32 * 1024**2 * 8 / 1e9)
    assert bp.nxn_gb("torch math", "fp32", 1, 32, 16384, "fwd") > 40        # skipped by default


def test_probe_indices():
    idx = bp.probe_indices(4096, 64)
    assert len(idx) == 64 and idx[0] == 0 and idx[-1] == 4095 and (np.diff(idx) > 0).all()
    assert (bp.probe_indices(10, 64) == np.arange(10)).all()


def test_inputs_are_float32_and_logit_scaled():
    q, k, v, do = bp.make_inputs(2, 3, 16, 8, seed=1)
    assert q.dtype == np.float32 and q.shape == (2, 3, 16, 8)
    q30, k30, v30, _ = bp.make_inputs(2, 3, 16, 8, seed=1, logit_scale=30.0)
    np.testing.assert_array_equal(q30, q * np.float32(30))
    np.testing.assert_array_equal(v30, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("work", [np.float64, np.longdouble])
def test_exact_probe_matches_the_naive_reference(causal, work):
    q, k, v, do = (x[0, 0] for x in bp.make_inputs(1, 1, 300, 16, seed=3, logit_scale=2.0))
    rows = bp.probe_indices(300, 20)
    keys = rows[::-1] % 97            # any key set, not sorted
    got = bp.exact_probe(q, k, v, do, causal, rows, keys, work=work, block=64)
    ref = [x.astype(np.float64) for x in (q, k, v, do)]
    out, _ = reference.attention_naive(*ref[:3], causal=causal)
    dq, dk, dv = reference.attention_backward_naive(ref[3], *ref[:3], causal=causal)
    assert got["out"].dtype == work
    for name, want in (("out", out), ("dq", dq[rows]), ("dk", dk[keys]), ("dv", dv[keys])):
        np.testing.assert_allclose(got[name].astype(np.float64), want, rtol=1e-11, atol=1e-12, err_msg=name)


def test_exact_probe_in_long_double_beats_float64():
    """Long double is the float64 contenders' reference: its answer must be closer to the truth than
    float64's (the truth here: long double rows computed without the row-block split)."""
    q, k, v, do = (x[0, 0].astype(np.float64) for x in bp.make_inputs(1, 1, 128, 8, seed=4))
    rows = keys = np.arange(128)
    hi = bp.exact_probe(q, k, v, do, False, rows, keys, work=np.longdouble, block=128)
    lo = bp.exact_probe(q, k, v, do, False, rows, keys, work=np.float64, block=32)
    truth, _ = reference.attention_naive(q, k, v, dtype="longdouble")
    if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:     # x86: 80-bit extended
        assert bp.rel_error(hi["out"], truth) < 1e-18 < bp.rel_error(lo["out"], truth)


def test_rel_error():
    exact = np.array([[3.0, 4.0]])
    assert bp.rel_error(exact, exact) == 0
    assert bp.rel_error([[3.0, 4.5]], exact) == pytest.approx(0.1)
    assert bp.rel_error([[0.0]], [[0.0]]) == 0                         # no division by zero
    assert math.isnan(bp.rel_error([[np.nan, 4.0]], exact))


def test_errors_pick_the_probe_of_batch_0_head_0():
    rng = np.random.default_rng(0)
    out, dq, dk, dv = (rng.standard_normal((2, 3, 10, 4)) for _ in range(4))
    rows, keys = np.array([0, 9]), np.array([1, 2, 3])
    exact = {"out": out[0, 0], "dq": dq[0, 0][rows], "dk": dk[0, 0][keys], "dv": dv[0, 0][keys] * 1.01}
    errs = bp.errors((out, dq, dk, dv), exact, rows, keys)
    assert errs["err_out"] == errs["err_dq"] == errs["err_dk"] == 0
    assert errs["err_dv"] == pytest.approx(0.01 / 1.01)
    assert bp.errors((out,), exact, rows, keys).keys() == {"err_out"}                       # forward only
    assert bp.errors((None, dq, dk, dv), exact, rows, keys).keys() == {"err_dq", "err_dk", "err_dv"}
    assert bp.errors((out, dq, dk, dv), {}, rows, keys) == {}                                # no reference


def _fake():
    base = {"B": 4, "H": 32, "L": 4096, "D": 64, "causal": True, "pass": "fwd", "flops": 1.0}
    return {"meta": {"device": "NVIDIA H100 80GB HBM3", "command": "python benchmarks/bench_precision.py --quick",
                     "commit": "abc1234", "torch": "2.5.1", "cupy": "13.3.0", "logit_scale": 1.0,
                     "ref": "longdouble", "probe": 64},
            "cases": [dict(base, dtype="fp32", results=[
                          {"contender": "cuflash highest", "ms": 2.0, "tflops": 100.0, "ms_queued": 1.9,
                           "err_out": 3.2e-7},
                          {"contender": "torch efficient", "ms": 3.0, "tflops": 66.7, "ms_queued": 2.9,
                           "err_out": 4.1e-7},
                          {"contender": "torch math", "error": "skipped: ~69 GB of n x n matrices > --max-gb 40"}]),
                      dict(base, dtype="fp64", results=[
                          {"contender": "cuflash", "ms": 10.0, "tflops": 20.0, "ms_queued": 9.0, "err_out": "nan"},
                          {"contender": "naive cupy", "ms": 30.0, "tflops": 7.0, "ms_queued": 29.0,
                           "err_out": 1e-16}])]}


def test_markdown_from_a_fake_results_dict():
    md = bp.markdown(_fake())
    lines = md.splitlines()
    assert lines[0] == "# cuflash float32 / float64: speed and error (NVIDIA H100 80GB HBM3)"
    assert "abc1234" in md and "--quick" in md
    header = next(i for i, l in enumerate(lines) if l.startswith("| pass"))
    rows = lines[header + 2:]
    assert len(rows) == 5 and all(r.count("|") == lines[header].count("|") for r in rows)
    highest = next(r for r in rows if "cuflash highest" in r)
    assert "| 2.000 | 100.0 | 1.900 | 1.50x | 3.2e-07 |" in highest        # peer 3 ms / 2 ms
    assert "| 1.00x |" in next(r for r in rows if "torch efficient" in r)
    assert "skipped: ~69 GB" in next(r for r in rows if "torch math" in r)
    fp64 = [r for r in rows if "| fp64 |" in r]
    assert "| nan |" in fp64[0] and "x |" not in fp64[0]                  # no SDPA math row: no ratio


def test_short_table_and_json_safety():
    case = _fake()["cases"][0]
    text = bp.short_table(case)
    assert "fp32 fwd B=4 H=32 L=4096 D=64 causal" in text and "1.50x" in text and "3.2e-07 / - / - / -" in text
    safe = bp._json_safe({"a": [float("nan"), 1.0, {"b": float("inf")}]})
    assert json.loads(json.dumps(safe, allow_nan=False)) == {"a": ["nan", 1.0, {"b": "inf"}]}
    assert bp.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_main_without_gpu_says_so():
    from cuflash._runtime.device import gpu_available

    if gpu_available()[0]:
        pytest.skip("on a GPU this would run the benchmark")
    with pytest.raises(SystemExit) as info:
        bp.main(["--quick"])
    assert "GPU" in str(info.value)


def test_exact_probe_in_a_process_pool_is_bitwise_the_same():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    q, k, v, do = (x[0, 0] for x in bp.make_inputs(1, 1, 200, 8, seed=5))
    rows = keys = bp.probe_indices(200, 16)
    alone = bp.exact_probe(q, k, v, do, True, rows, keys, block=64)
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        pooled = bp.exact_probe(q, k, v, do, True, rows, keys, block=64, pool=pool)
    for name in bp.FIELDS:
        np.testing.assert_array_equal(alone[name], pooled[name])
