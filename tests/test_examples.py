"""The examples run as shipped (on NumPy arrays where there is no GPU) and reach what they print."""
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_learn_query_projection_converges(capsys):
    runpy.run_path(str(EXAMPLES / "learn_query_projection.py"), run_name="__main__")   # asserts its own curve
    out = capsys.readouterr().out
    assert "never rising" in out and out.count("step ") == 13


@pytest.mark.parametrize("device", ["here", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_decode_loop_matches_attention_at_every_step(capsys, device):
    """On whatever the machine has (NumPy without a GPU), and under the ``gpu`` marker on CuPy arrays."""
    runpy.run_path(str(EXAMPLES / "decode_loop.py"), run_name="__main__")   # asserts every step and the pages
    out = capsys.readouterr().out
    assert "every step matches" in out and "the pages hold every key and value" in out
    if device == "gpu":
        assert "running on NumPy" not in out   # CuPy arrays: the decoding kernel and the append kernel
