"""benchmarks/fa2_tests.py on a small test file written like FlashAttention-2's (PyTorch on the CPU):
its flash_attn shim runs the calls on cuflash.torch, the padding helpers round-trip, and a feature
cuflash lacks is reported as a skip naming it."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (cuflash.torch is optional)")

RUNNER = Path(__file__).resolve().parent.parent / "benchmarks" / "fa2_tests.py"

FAKE = '''
import torch
from flash_attn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from flash_attn.bert_padding import pad_input, unpad_input

def test_output():
    q, k, v = (torch.randn(2, 10, 4, 16, dtype=torch.float64) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    assert torch.allclose(flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), causal=True), out)

def test_padding_helpers():
    x = torch.randn(2, 5, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    xu, idx, cu, longest, _ = unpad_input(x, mask)
    assert xu.shape == (8, 3) and cu.tolist() == [0, 3, 8] and longest == 5
    assert torch.equal(pad_input(xu, idx, 2, 5)[mask], x[mask])

def test_varlen():
    flash_attn_varlen_func(None, None, None, None, None, 1, 1)
'''


def test_runner_maps_flash_attn_onto_cuflash(tmp_path):
    test_file = tmp_path / "test_fake_fa2.py"
    test_file.write_text(FAKE)
    run = subprocess.run([sys.executable, str(RUNNER), str(test_file)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed, 1 skipped" in run.stdout and "cuflash lacks: flash_attn_varlen_func" in run.stdout
