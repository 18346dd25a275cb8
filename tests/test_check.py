"""The GPU acceptance check (`python -m colograd.check`): its checks run here against vLLM's CPU build, which is
evidence that they measure what they claim; the command itself refuses to run without a GPU."""

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, _env

from colograd import check
from colograd.sync import WeightPlan

CPU = torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs instead")
def test_without_a_gpu_the_check_says_so_in_one_line_and_fails():
    proc = subprocess.run(
        [sys.executable, "-m", "colograd.check"], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "needs an NVIDIA GPU" in lines[0], lines


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sync_check_passes_on_a_cpu_engine(dtype):
    result = check.check_sync(check.tiny_setup(CPU), dtype)
    assert result.status == "pass", result.detail
    assert "stale" in result.detail and "GB/s" in result.detail


def test_sync_check_fails_when_a_sync_does_not_reach_the_engine(monkeypatch):
    """A sync that works once and then hands the engine nothing: the second parity must catch it."""
    real_sync = WeightPlan.sync
    calls = []

    def first_only(plan, engine):
        calls.append(1)
        return real_sync(plan, engine) if len(calls) == 1 else 0

    monkeypatch.setattr(WeightPlan, "sync", first_only)
    result = check.check_sync(check.tiny_setup(CPU), "float32")
    assert result.status == "FAIL", result.detail


def test_lora_check_passes_on_a_cpu_engine():
    setup = check.tiny_setup(CPU)
    setup.prompts, setup.repeats = 1, 1  # the speed figures are for GPUs; here only that they are measured
    result = check.check_lora(setup)
    assert result.status == "pass", result.detail
    assert "with the adapter" in result.detail


def test_table_counts_each_status():
    rows = [check.Result("a", "pass", "x"), check.Result("bb", "FAIL", "y"), check.Result("c", "skip", "z")]
    table = check.format_table(rows)
    assert table.splitlines()[-1] == "1 passed, 1 failed, 1 skipped"
    assert table.splitlines()[2].startswith("bb  FAIL")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and vLLM's CUDA build")
def test_gpu_check_passes():
    assert check.main([]) == 0
