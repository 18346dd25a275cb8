"""The code reward in training: the tiny code task trains through the real engine, its programs run in the sandbox,
their failure reasons reach the completions log, and rewards started while decoding equal those scored after."""

import json

import pytest
import torch

from colograd.agents.tools import MarkerToolParser
from colograd.data import code_task
from colograd.models import tiny
from colograd.rewards.code import CodeReward
from colograd.rewards.sandbox import SandboxLimits
from colograd.trainer import GRPOTrainer

pytestmark = pytest.mark.slow


def test_the_tiny_code_task_trains_and_rewards_started_while_decoding_equal_those_scored_after(tmp_path):
    reward = CodeReward(limits=SandboxLimits(wall_s=2.0, cpu_s=1), program=code_task.as_print)
    starts = []
    prefetch = reward.prefetch
    reward.prefetch = lambda **kwargs: starts.append(len(kwargs["completions"])) or prefetch(**kwargs)
    args = tiny.run_config(str(tmp_path), 2, per_device_train_batch_size=16, num_generations=4, logging_steps=1,
                           log_completions=True, max_completion_length=6)  # fmt: skip
    dataset = code_task.expressions_dataset(64)
    trainer = GRPOTrainer(
        model=tiny.build_model(),
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tiny.build_tokenizer(),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("rewards/code/mean" in h for h in logs)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    reasons = [row["extra"]["code_failure"] for row in rows]
    assert len(rows) == 32 and any(r is not None for r in reasons)  # the programs ran, and most failed
    assert all(r is None or r in ("syntax error", "wrong answer") or r.startswith("error: ") for r in reasons)
    assert starts == [4] * 8  # each prompt's 4 completions were handed over as they were sampled, 4 prompts a step

    # One more rollout: started while decoding, then scored; against the same completions scored afterwards only.
    batch = [dataset[i] for i in range(4)]
    trainer.sync_for_rollout()
    scored = trainer.sample(batch)
    assert starts[8:] == [4] * 4
    afterwards = CodeReward(limits=reward.sandbox.limits, program=code_task.as_print)
    trainer.reward_funcs = [afterwards]
    again = trainer.score(scored.prompts, scored.rollout, scored.columns)
    assert torch.equal(scored.rewards_NF, again)


def digit(text: str) -> str:
    """A digit, for the model to go on from.

    Args:
        text: the turn so far.
    """
    return str(len(text) % 10)


def test_the_agent_loop_hands_over_each_prompts_trajectories_as_they_complete(tmp_path):
    reward = CodeReward(limits=SandboxLimits(wall_s=2.0, cpu_s=1), program=code_task.as_print)
    starts = []
    prefetch = reward.prefetch
    reward.prefetch = lambda **kwargs: starts.append(kwargs["completion_ids"]) or prefetch(**kwargs)
    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=16, num_generations=4,
                           max_completion_length=12)  # fmt: skip
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = None  # tool results come back as the parser's plain text
    dataset = code_task.expressions_dataset(16)
    trainer = GRPOTrainer(tiny.build_model(), reward, args, dataset, processing_class=tokenizer, tools=[digit],
                          tool_call_parser=MarkerToolParser("+", "digit", "text"))  # fmt: skip
    trainer.sync_for_rollout()
    scored = trainer.sample([dataset[i] for i in range(4)])
    assert len(starts) == 4  # each prompt's 4 trajectories, once all were complete, tool results included
    assert sorted(ids for group in starts for ids in group) == sorted(scored.rollout.completion_ids)
    assert any(0 in mask for mask in scored.rollout.tool_mask)  # some trajectories called the tool
    trainer.reward_funcs = [CodeReward(limits=reward.sandbox.limits, program=code_task.as_print)]
    assert torch.equal(scored.rewards_NF, trainer.score(scored.prompts, scored.rollout, scored.columns))
