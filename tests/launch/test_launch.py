"""A launch the other multi-process tests do not cover: a launch config that turns on bf16 mixed precision (two
machines on loopback: tests/launch/test_distributed.py, whose untied run that launch repeats)."""

import json

import pytest
from conftest import launch

pytestmark = pytest.mark.slow  # multi-process launches with engines


def test_bf16_launch_config_gives_a_bf16_engine_and_one_warning(tmp_path):
    proc = launch("tests/scripts/launch_precision.py", str(tmp_path), config="tests/configs/cpu_bf16.yaml")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)):
        assert rank["mixed_precision"] == "bf16"
        assert rank["first_param_dtype"] == "torch.float32"  # so bf16 comes from the launch config
        assert rank["engine_dtype"] == "torch.bfloat16"
    # bf16 decoder layers under DDP: warned once (rank 0), in one line.
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "no fp32 master copy" in line]
    assert len(lines) == 1, lines
