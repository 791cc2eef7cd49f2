"""Every Python block of the README runs as pasted (CPU: with NumPy in CuPy's place).

A block may be preceded by ``<!-- requires: torch, cupy -->``; it is skipped, with
the reason, where one of those cannot run. Without a usable GPU, ``import cupy as
cp`` becomes ``import numpy as cp``: cuflash runs NumPy inputs on its CPU path, and
the README's snippets use only calls both libraries share.
"""
import importlib.util
import re
from pathlib import Path

import pytest

from cuflash._runtime.device import gpu_available

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"(?:<!-- requires: ([^>]*) -->\s*\n)?```python\n(.*?)```", re.S)
_GPU_OK, _GPU_WHY = gpu_available()


def _blocks():
    if not README.is_file():
        return []
    return [(m.group(1) or "", m.group(2), README.read_text()[:m.start()].count("\n") + 1)
            for m in _BLOCK.finditer(README.read_text())]


BLOCKS = _blocks()


def test_readme_has_runnable_blocks():
    assert README.is_file(), f"{README} not found (CI copies it beside the tests)"
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("requires,code,line", BLOCKS, ids=[f"README line {b[2]}" for b in BLOCKS])
def test_readme_block_runs(requires, code, line):
    for name in (r.strip() for r in requires.split(",") if r.strip()):
        if name == "cupy" and not _GPU_OK:
            pytest.skip(f"needs a GPU: {_GPU_WHY}")
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"needs {name}, which is not installed")
    if not _GPU_OK:
        code = code.replace("import cupy as cp", "import numpy as cp")
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme"})


ROOT = README.parent
_CI = ROOT / ".ci" / "run"


def test_readme_test_command_is_the_one_ci_runs():
    """The README's test command installs the extras .ci/run installs and runs the pytest line it runs."""
    text = README.read_text()
    assert 'pip install ".[cuda12,test]" && python -m pytest -q -rs' in text
    if not _CI.is_file():
        pytest.skip(".ci/run is not beside the README (CI runs the tests from a copy)")
    ci = _CI.read_text()
    assert 'pip install --quiet ".[cuda12,test]"' in ci
    assert re.search(r"^python -m pytest -q -rs$", ci, re.M)


def test_readme_demo_command_is_a_cli_command():
    text = README.read_text()
    assert 'pip install ".[cuda12]" && python -m cuflash demo' in text
    main = ROOT / "cuflash" / "__main__.py"
    if main.is_file():
        assert '"demo"' in main.read_text() or "'demo'" in main.read_text()


def test_readme_benchmark_files_exist():
    """Every benchmarks/ file the README names (scripts and committed results) is in the tree."""
    if not (ROOT / "benchmarks").is_dir():
        pytest.skip("benchmarks/ is not beside the README")
    names = set(re.findall(r"benchmarks/[\w./-]*\w", README.read_text()))
    missing = [n for n in sorted(names) if not (ROOT / n).exists()]
    assert names and not missing, missing
