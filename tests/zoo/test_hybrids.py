"""Hybrid models (layers that carry state along the sequence between their attention layers) through real runs on
vLLM's CPU engine: Qwen3.5-4B's text model (Gated DeltaNet, dense) from the zoo, shrunk in width only, sharp weights.

vLLM's CPU build computes Gated DeltaNet in bf16 only, so the engine runs in bf16 while the trainer keeps float32
(`colograd.engine.hybrid`), and the parity gate holds each rollout to its 16-bit bound. The engine's cache is sized
from the specs its layers report (`colograd.engine.kv_cache.RolloutCache`), the trainer's passes run padded
(`colograd.grpo.forward`), and the sync must reach every tensor the layers read: a convolution weight or `A_log` left
out stops the run at its first rollout, named by the gate's diagnosis.
"""

import json
import math

import pytest
import torch
from test_parity import stops_before_training, trainer_for

from colograd.engine.core import Engine
from colograd.grpo import parity

pytestmark = pytest.mark.slow

QWEN3_5 = "Qwen/Qwen3.5-4B"
BF16 = parity.tolerance(torch.bfloat16, torch.float32)


LAUNCHES = {  # accelerate's launch options: plain DDP, and DeepSpeed ZeRO-3 (the sync gathering a bucket at a time)
    "ddp": ({}, []),
    "zero3": ({"config": "tests/configs/zero3_cpu.yaml", "env": {"DS_ACCELERATOR": "cpu"}}, ["--bucket-mib", "1"]),
}


@pytest.mark.parametrize("layout", LAUNCHES)
def test_qwen3_5_trains_on_two_ranks_with_the_gate_on(layout, tmp_path, record_property):
    """TRL's quickstart settings (a learning rate that moves the weights), 2 ranks under accelerate's launcher, plain
    and under ZeRO-3: every step passes the gate's bf16 bound, the ranks hold the same weights after every step, and
    after the last sync the engine's log-probs of a whole answer are its trainer's within the bound."""
    from conftest import launch

    options, flags = LAUNCHES[layout]
    proc = launch("tests/scripts/moe_check.py", str(tmp_path), QWEN3_5, "--steps", "3", *flags, timeout=900, **options)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        run = json.loads((tmp_path / f"rank{rank}.json").read_text())[QWEN3_5]
        steps = [h for h in run["log_history"] if "loss" in h]
        gaps = [h["sampling/sampling_logp_difference/max"] for h in steps]
        means = [h["sampling/sampling_logp_difference/mean"] for h in steps]
        record_property(f"sampling gaps rank {rank}", [gaps, means, run["parity_gap"]])
        print(f"{layout} rank {rank}: worst-token gaps {gaps}, means {means}, after the last sync {run['parity_gap']}")
        assert len(steps) == 3 and run["weights_agree"] == [True] * 3
        assert run["sharded"] is (layout == "zero3")
        assert all(math.isfinite(h["loss"]) for h in steps)
        assert max(gaps) <= BF16.max and max(means) <= BF16.mean, (gaps, means)
        assert run["parity_gap"] <= BF16.max


# One tensor of the first Gated DeltaNet layer, as the trainer names it. (A `dt_bias` left out moves this shrunk
# model's log-probs by less than the gate's 16-bit bound on some rollouts: test_parity.py's fresh-engine comparison
# names it instead.)
UNSENT = {"convolution": "model.layers.0.linear_attn.conv1d.weight", "A_log": "model.layers.0.linear_attn.A_log"}


@pytest.mark.parametrize("tensor", UNSENT)
def test_a_state_layer_tensor_left_out_of_the_sync_stops_the_run(tensor, tmp_path, monkeypatch):
    """The sync sends every tensor; left out, one keeps the engine's start-up value (vLLM's dummy weights) and the
    gate stops the run in one line, naming it."""
    name = UNSENT[tensor]
    own = Engine.load_weights
    monkeypatch.setattr(Engine, "load_weights", lambda engine, weights: own(engine, [
        (n, t) for n, t in weights if n != name]))  # fmt: skip
    line = stops_before_training(trainer_for(QWEN3_5, tmp_path))
    print(line)
    assert "A freshly loaded engine differs" in line and name in line
