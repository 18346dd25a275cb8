"""Evaluation metrics from per-rank totals: hand-worked values, and two ranks' totals summed as one reduction."""

import math

import pytest
import torch
from trl.trainer.utils import nanstd

from colograd.config.core import ConfigError
from colograd.rollout.evaluation import eval_metrics, eval_tool_metrics, eval_totals, rank_share, tool_totals

NAN = float("nan")


def test_metrics_of_one_rank_by_hand():
    rewards_NF = torch.tensor([[1.0, 0.0], [0.0, NAN], [1.0, 1.0]])
    rewards_N = torch.tensor([1.0, 0.0, 2.0])
    totals = eval_totals(rewards_NF, rewards_N, torch.tensor([4.0, 8.0, 3.0]), torch.tensor([False, True, False]))
    metrics = eval_metrics(totals, ["a", "b"], 3.0, 8.0)
    assert metrics["eval_rewards/a/mean"] == pytest.approx(2 / 3)
    assert metrics["eval_rewards/b/mean"] == pytest.approx(0.5)  # the abstention is left out
    assert metrics["eval_reward"] == pytest.approx(1.0) and metrics["eval_reward_std"] == pytest.approx(1.0)
    assert metrics["eval_completions/mean_length"] == pytest.approx(5.0)
    assert metrics["eval_completions/clipped_ratio"] == pytest.approx(1 / 3)
    assert (metrics["eval_completions/min_length"], metrics["eval_completions/max_length"]) == (3.0, 8.0)


def test_ranks_summed_equal_one_rank_with_all_completions():
    gen = torch.Generator().manual_seed(0)
    rewards_NF = torch.randn(10, 3, generator=gen)
    rewards_NF[2, 1] = NAN
    rewards_N = rewards_NF.nansum(1)
    rewards_N[7] = NAN
    lengths = torch.randint(1, 20, (10,), generator=gen).float()
    truncated = lengths > 15
    whole = eval_totals(rewards_NF, rewards_N, lengths, truncated)
    halves = [eval_totals(rewards_NF[s], rewards_N[s], lengths[s], truncated[s]) for s in (slice(0, 4), slice(4, 10))]
    assert torch.allclose(halves[0] + halves[1], whole)
    metrics = eval_metrics(whole, ["a", "b", "c"], 1.0, 19.0)
    assert metrics["eval_reward_std"] == pytest.approx(nanstd(rewards_N).item(), rel=1e-5)
    assert metrics["eval_rewards/b/mean"] == pytest.approx(torch.nanmean(rewards_NF[:, 1]).item(), rel=1e-5)
    assert not math.isnan(metrics["eval_reward"])


def test_rank_share_splits_rows_and_refuses_too_few():
    rows = [{"prompt": str(i)} for i in range(5)]
    assert [r["prompt"] for r in rank_share(rows, 1, 2)] == ["1", "3"]
    with pytest.raises(ConfigError, match="at least one per process"):
        rank_share(rows[:1], 0, 2)
    with pytest.raises(ConfigError, match="no eval dataset"):
        rank_share(None, 0, 2)


def test_tool_metrics_of_two_ranks_by_hand():
    # Rank 0: 4 completions, 3 calls, 1 failed; rank 1: 2 completions, no calls. Summed: 3 calls over 6 completions.
    totals = tool_totals({"completions": 4, "calls": 3, "failures": 1}) + tool_totals(
        {"completions": 2, "calls": 0, "failures": 0}
    )
    metrics = eval_tool_metrics(totals)
    assert metrics == {"eval_tools/call_frequency": 0.5, "eval_tools/failure_frequency": pytest.approx(1 / 3)}
    assert (
        eval_tool_metrics(tool_totals({"completions": 2, "calls": 0, "failures": 0}))["eval_tools/failure_frequency"]
        == 0.0
    )
