"""benchmarks/varlen_vs_dense.py on a fake device (CPU): every contender of every row runs once a round, the
packed calls through cuflash.varlen's plans and the dense ones through cuflash's, forward and forward+backward,
and the rows report what was timed."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from test_plans import fake  # noqa: E402,F401  (the fake device fixture, used by vvd)

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "varlen_vs_dense.py"
if not _PATH.is_file():   # .ci/run copies benchmarks/ beside tests/; an installed package alone has no scripts
    pytest.skip("benchmarks/varlen_vs_dense.py ships with the source repository, not with the package",
                allow_module_level=True)


@pytest.fixture
def vvd(fake, monkeypatch):  # noqa: F811
    """The script with host arrays copied to fake device memory and each timing a count of calls."""
    dev, launches = fake
    sys.path.insert(0, str(_PATH.parent))
    spec = importlib.util.spec_from_file_location("varlen_vs_dense", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(cp, "asarray", lambda a, dtype=None: dev.empty(np.shape(a), np.asarray(a).dtype
                                                                       if dtype is None else dtype))
    monkeypatch.setattr(cp, "ascontiguousarray", lambda x: dev.empty(x.shape, x.dtype))
    monkeypatch.setattr(cp.ndarray, "astype", lambda self, dtype, **kw: dev.empty(self.shape, dtype))
    monkeypatch.setattr(module.bv.bench, "_cp_dtype", lambda name: np.float16)

    real_rng = np.random.default_rng

    class NoDraws:   # the inputs' values are never read here: no 65536 x 2048 normal draws
        def __init__(self, seed=None):
            self.rng = real_rng(seed)

        def standard_normal(self, shape, dtype=np.float64):
            return np.broadcast_to(np.zeros((), dtype), shape)

        def __getattr__(self, name):   # the case lengths' integer draws as they are
            return getattr(self.rng, name)

    monkeypatch.setattr(module.np.random, "default_rng", NoDraws)
    timings = []
    monkeypatch.setattr(module, "timed", lambda fn: (fn(), timings.append(len(launches)), 1.0)[2])
    return module, timings, launches


def test_rows_time_each_contender_once_a_round(vvd, capsys):
    module, timings, launches = vvd
    assert module.main(["--dims", "64", "--cases", "ab"]) == 0
    # causal or not x (varlen, two dense layouts; case a's equal lengths: and the packed kernel)
    assert len(timings) == 2 * 4 + 2 * 3
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 4 and all(" fwd TF/s varlen" in r for r in rows)
    assert ["packed kernel" in r for r in rows] == [True, True, False, False]
    families = {v.family for v, *_ in launches}
    assert any(v.packed for v, *_ in launches) and not any(f.startswith("bwd") for f in families)


def test_backward_and_rounds(vvd, capsys):
    module, timings, launches = vvd
    assert module.main(["--dims", "128", "--cases", "c", "--backward", "--rounds", "2"]) == 0
    assert len(timings) == 2 * 5 * 2   # causal or not x (long, short: packed and dense; the whole) x rounds
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and all("fwd+bwd" in r and "the two dense parts" in r for r in rows)
    assert any(v.packed and v.family.startswith("bwd") for v, *_ in launches)
    with pytest.raises(SystemExit):
        module.main(["--rounds", "0"])
