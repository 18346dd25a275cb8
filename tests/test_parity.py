"""The parity guard (colograd/grpo/parity.py) through real runs: one family per class of engine/trainer disagreement,
each stopped before its first optimizer step when the class's fault is there, and trained exact once it is fixed.

Each test removes the fix (or injects the fault) and checks that the gate stops the run in one line, then checks that
the fixed run trains within the float32 tolerance, so that both the guard and the fix are needed for it to pass. The
models are zoo models (shrunk in width only, sharp weights: `zoo.stopping_model`); this file runs with the zoo, in a
process of its own (their vocabularies are real).
"""

import logging

import pytest
import torch
import zoo
from datasets import Dataset
from test_zoo import answer_length, chat_rows, step_log

from colograd import GRPOConfig, GRPOTrainer
from colograd.engine import sync
from colograd.grpo import parity
from colograd.grpo.parity import ParityError

pytestmark = pytest.mark.slow


def trainer_for(name: str, tmp_path, max_steps: int = 1, **settings) -> GRPOTrainer:
    """TRL's quickstart settings with short completions, on `name`'s stopping model."""
    settings = {"save_strategy": "no", "vllm_enforce_eager": True, "max_completion_length": 64, **settings}
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=max_steps, report_to="none", **settings)
    model, tokenizer = zoo.stopping_model(name)
    return GRPOTrainer(model=model, reward_funcs=answer_length, args=args,
                       train_dataset=Dataset.from_list(chat_rows() * 4), processing_class=tokenizer)  # fmt: skip


def stops_before_training(trainer: GRPOTrainer) -> str:
    """Train: the gate must stop the run at its first rollout, before any optimizer step. Returns the line."""
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ParityError) as err:
        trainer.train()
    line = str(err.value)
    assert "\n" not in line and "engine and trainer disagree" in line and "before training" in line
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # nothing trained
    return line


def test_a_routers_buffer_reaches_the_engine(tmp_path, monkeypatch):
    """GLM-4.5-Air's routers keep their score-correction bias in a persistent buffer. Sent with the parameters only,
    the engine routes by its dummy start-up values and samples from another model: the gate stops the run. With the
    buffers synced, the step is exact."""
    name = "zai-org/GLM-4.5-Air"
    with monkeypatch.context() as patched:
        patched.setattr(sync, "_persistent_buffers", lambda model: iter(()))  # the sync as it was: parameters only
        line = stops_before_training(trainer_for(name, tmp_path / "unsynced"))
    assert "Glm4MoeForCausalLM" in line
    trainer = trainer_for(name, tmp_path / "synced")
    trainer.train()
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= 1e-3


def test_warn_trains_on_with_the_gap_logged(tmp_path, monkeypatch, caplog):
    """`engine_parity: warn` turns the gate's stop into a warning: the run trains, and logs the gap."""
    monkeypatch.setattr(sync, "_persistent_buffers", lambda model: iter(()))
    trainer = trainer_for("zai-org/GLM-4.5-Air", tmp_path, engine_parity="warn")
    with caplog.at_level(logging.WARNING, logger=parity.__name__):
        trainer.train()
    assert trainer.state.global_step == 1
    assert any("engine and trainer disagree" in r.getMessage() for r in caplog.records)
    fp32 = parity.tolerance(torch.float32, torch.float32)
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] > fp32.max


def test_the_running_guard_stops_a_divergence_mid_run_with_a_checkpoint(tmp_path, monkeypatch, caplog):
    """From the third rollout on, every sync writes the output layer scaled by 3 into the engine (a sync gone wrong
    mid-run). The guard warns once at that step and stops the run after `PERSISTENT` such rollouts, with a checkpoint
    of the step it stopped at; the steps before trained as usual."""
    name = "Qwen/Qwen3-0.6B"
    own = sync.WeightPlan.sync
    syncs = []

    def drifting(plan, engine):
        syncs.append(1)
        if len(syncs) < 3:
            return own(plan, engine)
        head = plan.model.get_output_embeddings().weight
        with torch.no_grad():
            head.mul_(3.0)
            try:
                return own(plan, engine)
            finally:
                head.div_(3.0)

    monkeypatch.setattr(sync.WeightPlan, "sync", drifting)
    args = {"save_strategy": "steps", "save_steps": 100}
    trainer = trainer_for(name, tmp_path, max_steps=10, **args)
    with caplog.at_level(logging.WARNING, logger=parity.__name__), pytest.raises(ParityError) as err:
        trainer.train()
    assert "\n" not in str(err.value) and "stopped with a checkpoint" in str(err.value)
    stopped = 2 + parity.PERSISTENT  # two good steps, then PERSISTENT diverged rollouts
    assert trainer.state.global_step == stopped
    assert (tmp_path / f"checkpoint-{stopped}").is_dir()
    warnings = [r.getMessage() for r in caplog.records if "engine and trainer disagree" in r.getMessage()]
    assert len(warnings) == 1 and "at step 3" in warnings[0]
