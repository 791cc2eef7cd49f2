"""The command line: info and the no-GPU demo (CPU)."""
import pytest

from cuflash.__main__ import main
from cuflash._device import gpu_available


def test_info_runs(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cuflash" in out and "variants" in out


@pytest.mark.skipif(gpu_available()[0], reason="the GPU demo is exercised by the device run")
def test_demo_without_gpu_runs_numpy_path(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "No GPU here" in out and "forward + backward" in out
