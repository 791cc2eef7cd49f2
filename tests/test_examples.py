"""The examples run as shipped (on NumPy arrays where there is no GPU) and reach what they print."""
import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_learn_query_projection_converges(capsys):
    runpy.run_path(str(EXAMPLES / "learn_query_projection.py"), run_name="__main__")   # asserts its own curve
    out = capsys.readouterr().out
    assert "never rising" in out and out.count("step ") == 13
