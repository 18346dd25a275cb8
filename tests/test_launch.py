"""Launches the other multi-process tests do not cover: two machines (on loopback), and a launch config that
turns on bf16 mixed precision."""

import json
import subprocess

import pytest
from conftest import BIN, ROOT, _env, _free_port, launch

pytestmark = pytest.mark.slow  # multi-process launches with engines
STEPS = 3


def test_two_machines_on_loopback_train_with_parity(tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 1`, both "machines" on 127.0.0.1: each process is rank r of 2 and
    local rank 0 of its machine, and its engine must sample from the weights being trained."""
    port = str(_free_port())

    def node(rank: int) -> subprocess.Popen:
        cmd = [
            str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
            "--master_addr", "127.0.0.1", "--master_port", port,
            "tests/scripts/grpo_check.py", str(tmp_path), "--steps", str(STEPS),
        ]  # fmt: skip
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    nodes = [node(0), node(1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [rank["local_rank"] for rank in ranks] == [0, 0]
    # Without LOCAL_RANK the engine counts the lower ranks on its host: here both are on this one.
    assert [rank["derived_local_rank"] for rank in ranks] == [0, 1]
    assert ranks[0]["sampled"] != ranks[1]["sampled"]
    for rank in ranks:
        assert rank["world_size"] == 2
        assert rank["weights_agree"] == [True] * STEPS
        assert rank["parity_gap"] <= 1e-4
        steps = [h for h in rank["log_history"] if "loss" in h]
        assert len(steps) == STEPS
        assert max(h["sampling/sampling_logp_difference/max"] for h in steps) < 1e-3


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
