"""Stages owe nothing but their return values: the trainer records the metrics around them, and training and
evaluation take their rollouts from one call (`GRPOTrainer.sample`)."""

import json

import pytest
import torch
from conftest import watch_rollouts

from colograd import GRPOTrainer
from colograd.engine.rollout import Rollout
from colograd.models import tiny
from colograd.rollout.core import ScoredRollout, reward_metrics, rollout_metrics, sampled_lengths


def test_rollout_metrics_by_hand():
    rollout = Rollout([[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]], [[]] * 4, [True, False, False, True])
    rewards_NF = torch.tensor([[1.0, float("nan")], [0.0, 2.0], [3.0, 2.0], [0.0, 4.0]])
    scored = ScoredRollout(["a", "b"], [[1], [2]], {}, rollout, rewards_NF, truncated_prompts=1)
    metrics = rollout_metrics(scored, ["f", "g"])
    assert metrics == {
        "prompts/truncated_ratio": 0.5,
        "completions/mean_length": 2.5,
        "completions/min_length": 1.0,
        "completions/max_length": 4.0,
        "completions/clipped_ratio": 0.5,
        "rewards/f/mean": 1.0,
        "rewards/g/mean": pytest.approx(8 / 3),
        # TRL's nanstd: unbiased, over the rows the function scored (f: 1, 0, 3, 0; g: 2, 2, 4, its NaN left out).
        "rewards/f/std": pytest.approx(2**0.5),
        "rewards/g/std": pytest.approx((4 / 3) ** 0.5),
    }


def test_sampled_lengths_leave_inserted_tokens_out():
    rollout = Rollout([[1, 2, 3, 4], [5]], [[]] * 2, [False, False], tool_mask=[[1, 0, 0, 1], [1]])
    assert sampled_lengths(rollout).tolist() == [2.0, 1.0]


def test_reward_metrics_by_hand():
    # Two groups of 2; weights 1 and 0.5. Totals: 1, 1 (a group with zero spread), then 0, 4.
    rewards_NF = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [2.0, 4.0]])
    metrics = reward_metrics(rewards_NF, torch.tensor([1.0, 0.5]), num_generations=2)
    assert metrics["reward"] == pytest.approx(1.5)
    assert metrics["reward_std"] == pytest.approx(torch.tensor([1.0, 1.0, 0.0, 4.0]).std().item())
    assert metrics["frac_reward_zero_std"] == 0.5


class OwnStages(GRPOTrainer):
    """Replaces two stages outright (no `super()`), and records the group size each rollout asked for."""

    asked: list[int] = []
    phases: list[str] = []
    seen: dict[str, object] = {}  # what a stage was handed, as arguments

    def sync_weights(self):
        self.phases.append("sync_weights")
        super().sync_weights()

    def prepare_prompts(self, rows):
        self.phases.append("prepare_prompts")
        return super().prepare_prompts(rows)

    def generate(self, prompt_ids, context, images=None):
        self.asked.append(context.num_generations)
        self.phases.append("generate")
        return super().generate(prompt_ids, context, images)

    def score(self, prompts, rollout, columns):
        self.seen["score"] = (len(prompts), type(rollout).__name__, sorted(columns))
        return torch.tensor([[float(len(ids))] for ids in rollout.completion_ids])

    def rollout_logps(self, batch):
        self.seen["rollout_logps"] = sorted(batch)
        return super().rollout_logps(batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen["compute_loss"] = sorted(inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def compute_advantages(self, rewards_NF):
        rewards_GK = rewards_NF[:, 0].view(-1, self.args.num_generations)
        return (rewards_GK - rewards_GK.mean(dim=1, keepdim=True)).flatten()


@pytest.mark.slow
def test_overrides_without_super_keep_every_metric_and_evaluation_shares_the_rollout_call(tmp_path):
    rows = tiny.letters_dataset(16)
    args = tiny.run_config(
        str(tmp_path), 2, per_device_train_batch_size=16, num_generations=4, num_generations_eval=2, logging_steps=1
    )
    trainer = OwnStages(
        model=tiny.build_model(),
        reward_funcs=tiny.letters_reward,
        args=args,
        train_dataset=rows,
        eval_dataset=rows.select(range(3)),
        processing_class=tiny.build_tokenizer(),
    )
    rebound = watch_rollouts(trainer)
    trainer.train()
    # The weight sync is the step's first phase, before the prompts are read, and the rollout's only one.
    rollout = ["sync_weights", "prepare_prompts", "generate"]
    assert trainer.phases == rollout * 2, trainer.phases
    # A rollout leaves nothing on the trainer for another stage to read: the only attribute it sets is the weight
    # sync's plan, built at the first sync (docs/design.md, "The step").
    assert rebound == {"weight_plan"}, rebound
    # Each stage gets what it works on as its arguments: the rows' column, the rollout, the batch's tensors.
    assert trainer.seen["score"] == (4, "Rollout", ["target"]), trainer.seen  # 16 completions: 4 prompts × 4
    assert {"completion_ids", "completion_mask", "advantages", "engine_logps"} <= set(trainer.seen["rollout_logps"])
    assert set(trainer.seen["rollout_logps"]) <= set(trainer.seen["compute_loss"])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/letters_reward/mean",
                 "completions/mean_length", "completions/clipped_ratio", "prompts/truncated_ratio"):  # fmt: skip
        assert all(name in log for log in logs), name
    # The score stage's rewards are completion lengths: the recorded metric is their mean, from its return value.
    assert logs[0]["rewards/letters_reward/mean"] == pytest.approx(logs[0]["completions/mean_length"])

    metrics = trainer.evaluate()
    assert trainer.asked == [4, 4, 2]  # two training rollouts, then one evaluation with num_generations_eval
    assert rebound == {"weight_plan"}, rebound  # evaluation's rollout set nothing either
    assert metrics["eval_reward"] == pytest.approx(metrics["eval_completions/mean_length"])
    # Evaluation recorded none of training's metrics, and its phases only under their own names.
    window = set(trainer.metrics)
    assert not window & {"reward", "completions/mean_length", "time/generate", "time/reward"}
    assert {"time/eval_generate", "time/eval_reward"} <= window


def logging_reward(completions, log_extra, log_metric, **kwargs):
    """A TRL reward function that logs a column and a metric, as TRL's `log_extra` / `log_metric` allow."""
    log_extra("length", [len(c) for c in completions])
    log_metric("mean_length_seen", sum(map(len, completions)) / len(completions))
    return [1.0] * len(completions)


@pytest.mark.slow
def test_reward_functions_log_columns_and_metrics_as_in_trl(tmp_path):
    args = tiny.run_config(str(tmp_path), 1, per_device_train_batch_size=16, num_generations=4, logging_steps=1,
                           log_completions=True)  # fmt: skip
    trainer = GRPOTrainer(
        model=tiny.build_model(),
        reward_funcs=logging_reward,
        args=args,
        train_dataset=tiny.letters_dataset(16),
        processing_class=tiny.build_tokenizer(),
    )
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(row["extra"]["length"] == len(row["completion"]) for row in rows)
    assert log["mean_length_seen"] == pytest.approx(sum(len(row["completion"]) for row in rows) / 16)


class Ranks:
    """Stands in for the accelerator of rank 0 of two, whose other rank's gathered tensors are `other`."""

    num_processes, device = 2, "cpu"

    def __init__(self, other: torch.Tensor | None) -> None:
        self.other, self.sent = other, None

    def gather(self, tensor):
        self.sent = tensor
        return torch.cat([tensor, self.other]) if self.other is not None else tensor


def test_window_metrics_of_two_ranks_where_one_recorded_a_metric_the_other_did_not(monkeypatch):
    from colograd.runs import timing

    mine = {"reward": [1.0, 3.0], "extra/max": [5.0], "time/train": [2.0, 2.0]}
    theirs = {"reward": [4.0], "extra/max": [], "only_mine_seen/min": [], "time/train": [6.0]}
    mine["only_mine_seen/min"] = [-2.0]
    monkeypatch.setattr(timing, "gather_object", lambda names: sorted(set(mine) | set(theirs)))
    other = Ranks(None)
    timing.window_metrics(theirs, 2, other)  # what the other rank sends
    logs = timing.window_metrics(mine, 2, Ranks(other.sent))
    assert logs["reward"] == pytest.approx((2.0 + 4.0) / 2)
    assert logs["extra/max"] == 5.0 and logs["only_mine_seen/min"] == -2.0  # the rank without it is left out
    assert logs["time/train"] == pytest.approx((2.0 + 3.0) / 2)  # per optimizer step, mean over ranks
