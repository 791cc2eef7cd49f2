"""The examples run as shipped (on NumPy arrays where there is no GPU) and reach what they print."""
import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_learn_query_projection_converges(capsys):
    runpy.run_path(str(EXAMPLES / "learn_query_projection.py"), run_name="__main__")   # asserts its own curve
    out = capsys.readouterr().out
    assert "never rising" in out and out.count("step ") == 13


def test_decode_loop_matches_attention_at_every_step(capsys):
    runpy.run_path(str(EXAMPLES / "decode_loop.py"), run_name="__main__")   # asserts every step and the pages
    out = capsys.readouterr().out
    assert "every step matches" in out and "the pages hold every key and value" in out
