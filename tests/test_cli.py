"""The command line (CPU): info, help, argument errors, the no-GPU demo."""
from pathlib import Path

import pytest

import cuflash.__main__
from cuflash.__main__ import main
from cuflash._runtime.device import gpu_available


def test_info_runs(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cuflash" in out and "variants" in out


def test_no_command_prints_help_and_a_hint(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "choose a command" in out and "demo" in out and "compile" in out


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "demo" in out


@pytest.mark.parametrize("arch,message", [("sm_75", "'sm_75': cuflash builds for sm_80, sm_86, sm_89, sm_90, sm_120"),
                                          ("foo", "'foo': cuflash builds for"), ("sm_80,sm_61", "'sm_61'"),
                                          ("sm_100", "'sm_100'"), ("sm80", "'sm80'"), (",", "at least one")])
def test_compile_rejects_bad_arches_in_one_line(arch, message):
    with pytest.raises(SystemExit) as info:
        main(["compile", "--arch", arch])
    text = str(info.value)
    assert message in text and "\n" not in text


@pytest.mark.skipif(gpu_available()[0], reason="the GPU demo is exercised by the device run")
def test_demo_without_gpu_runs_numpy_path_and_says_why(capsys):
    assert main(["demo", "--seqlen", "100"]) == 0
    out = capsys.readouterr().out
    assert "No GPU here" in out and "forward + backward" in out
    assert "--seqlen" in out                      # the ignored flag is named


@pytest.mark.skipif(gpu_available()[0], reason="on a GPU this would run the benchmark")
def test_bench_says_what_it_needs():
    """From a source checkout: the script says it needs a GPU; installed: it names the repository."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "--quick"])
    assert "GPU" in str(info.value) or "source repository" in str(info.value)


@pytest.mark.skipif(gpu_available()[0], reason="on a GPU this would run the benchmark")
def test_bench_precision_runs_the_precision_script(capsys):
    """`bench --precision` runs benchmarks/bench_precision.py (its options, its no-GPU message);
    an installed package without the source tree names the repository instead."""
    if not (Path(cuflash.__main__.__file__).resolve().parent.parent / "benchmarks" / "bench_precision.py").is_file():
        with pytest.raises(SystemExit) as info:
            main(["bench", "--quick", "--precision"])
        assert "source repository" in str(info.value)
        return
    with pytest.raises(SystemExit) as info:
        main(["bench", "--precision", "--help"])
    assert info.value.code == 0 and "--logit-scale" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["bench", "--quick", "--precision"])
    assert "bench_precision.py" in str(info.value) and "GPU" in str(info.value)


def test_unknown_arguments_are_refused():
    with pytest.raises(SystemExit):
        main(["info", "--bogus"])
