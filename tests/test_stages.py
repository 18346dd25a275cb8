"""Stages owe nothing but their return values: the trainer records the metrics around them, and training and
evaluation take their rollouts from one call (`GRPOTrainer.sample`)."""

import pytest
import torch

from colograd import GRPOTrainer, tiny
from colograd.engine import Rollout
from colograd.rollouts import ScoredRollout, reward_metrics, rollout_metrics, sampled_lengths


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

    def generate(self, prompt_ids, num_generations=None):
        self.asked.append(num_generations)
        return super().generate(prompt_ids, num_generations)

    def score(self, prompts, rollout, columns):
        return torch.tensor([[float(len(ids))] for ids in rollout.completion_ids])

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
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/letters_reward/mean",
                 "completions/mean_length", "completions/clipped_ratio", "prompts/truncated_ratio"):  # fmt: skip
        assert all(name in log for log in logs), name
    # The score stage's rewards are completion lengths: the recorded metric is their mean, from its return value.
    assert logs[0]["rewards/letters_reward/mean"] == pytest.approx(logs[0]["completions/mean_length"])

    metrics = trainer.evaluate()
    assert trainer.asked == [4, 4, 2]  # two training rollouts, then one evaluation with num_generations_eval
    assert metrics["eval_reward"] == pytest.approx(metrics["eval_completions/mean_length"])
    # Evaluation recorded none of training's metrics, and its phases only under their own names.
    window = set(trainer._metrics)
    assert not window & {"reward", "completions/mean_length", "time/generate", "time/reward"}
    assert {"time/eval_generate", "time/eval_reward"} <= window
