"""Evaluation during training: completions of held-out prompts from the engine, scored by the reward functions.

Each rank takes its share of the prompts (every world-th row) and generates for all of them in one engine call;
the metrics are sums and counts reduced over ranks, reported under TRL's eval names: `eval_reward`,
`eval_reward_std`, `eval_rewards/<func>/mean`, `eval_completions/{mean,min,max}_length`,
`eval_completions/clipped_ratio`, and with tools or environments `eval_tools/call_frequency` and
`eval_tools/failure_frequency`. With tools, environments or a `rollout_func`, the eval prompts go through the same
agent loop as training (`colograd.agents.core`), as TRL's evaluation does.
"""

from typing import Any

import torch

from colograd.errors import ConfigError
from colograd.grpo.loss import weighted_rewards
from colograd.rewards.core import reward_name
from colograd.rollout.core import sampled_lengths


def evaluate(trainer: Any, dataset: Any) -> dict[str, float]:
    """Sample `num_generations_eval` completions of this rank's share of `dataset`'s prompts with the trainer's
    engine, in one call, score them with its reward functions, and reduce TRL's eval metrics over ranks.

    Args:
        trainer: the `GRPOTrainer`; its rollout call (`sample`) runs the same stages as training.
        dataset: the eval prompts.
    """
    accelerator = trainer.accelerator
    rows = rank_share(dataset, accelerator.process_index, accelerator.num_processes)
    trainer.sync_for_rollout()
    scored = trainer.sample(rows, evaluation=True)
    lengths_N = sampled_lengths(scored.rollout)
    rewards_N = weighted_rewards(scored.rewards_NF, trainer.reward_weights)
    totals = eval_totals(scored.rewards_NF, rewards_N, lengths_N, torch.tensor(scored.rollout.truncated))
    totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    extremes = accelerator.gather(torch.stack([-lengths_N.min(), lengths_N.max()]).to(accelerator.device))
    low, high = extremes.view(-1, 2).amax(dim=0).tolist()
    metrics = eval_metrics(totals, [reward_name(f) for f in trainer.reward_funcs], -low, high)
    if trainer.agents is not None and trainer.agents.rollout_func is None:
        tools = tool_totals(scored.rollout.counts).to(accelerator.device)
        metrics |= eval_tool_metrics(accelerator.reduce(tools, reduction="sum").cpu())
    return metrics


def rank_share(dataset: Any, rank: int, world: int) -> list[dict]:
    """This rank's prompts: rows rank, rank + world, ... (every rank gets at least one)."""
    if dataset is None:
        raise ConfigError(
            "eval_strategy is set but there is no eval dataset; pass eval_dataset or set eval_strategy: no."
        )
    if len(dataset) < world:
        raise ConfigError(
            f"the eval dataset has {len(dataset)} rows for {world} processes; give at least one per process."
        )
    return [dataset[i] for i in range(rank, len(dataset), world)]


def eval_totals(
    rewards_NF: torch.Tensor, rewards_N: torch.Tensor, lengths_N: torch.Tensor, truncated_N: torch.Tensor
) -> torch.Tensor:
    """This rank's sums and counts, packed in one tensor so that one reduction over ranks serves them all.

    Args:
        rewards_NF: each reward function's reward of each completion (NaN where it abstained).
        rewards_N: the weighted total (NaN where every function abstained).
        lengths_N: completion lengths in tokens; truncated_N: 1 where cut at max_completion_length.

    Returns:
        [2F + 5]: per function its reward sum and count, then the total reward's sum, count and sum of squares,
        the completions' length sum, their number, and how many were truncated.
    """
    per_func = torch.stack([rewards_NF.nansum(0), (~rewards_NF.isnan()).sum(0)], dim=1)
    scored = rewards_N[~rewards_N.isnan()]
    rest = [scored.sum(), len(scored), (scored**2).sum(), lengths_N.sum(), len(lengths_N), truncated_N.sum()]
    return torch.cat([per_func.flatten().float(), torch.tensor([float(x) for x in rest])])


def eval_metrics(totals: torch.Tensor, names: list[str], min_length: float, max_length: float) -> dict[str, float]:
    """TRL's eval metrics from `eval_totals` summed over ranks, and the lengths' min and max over ranks."""
    per_func = totals[: 2 * len(names)].view(-1, 2).tolist()
    reward_sum, reward_count, reward_squares, length_sum, completions, truncated = totals[2 * len(names) :].tolist()
    mean = reward_sum / max(reward_count, 1.0)
    # The unbiased std of all ranks' rewards, as TRL's nanstd of the gathered ones.
    variance = (reward_squares - reward_count * mean**2) / max(reward_count - 1, 1.0)
    metrics = {"eval_reward": mean, "eval_reward_std": max(variance, 0.0) ** 0.5}
    for name, (total, count) in zip(names, per_func, strict=True):
        metrics[f"eval_rewards/{name}/mean"] = total / max(count, 1.0)
    metrics["eval_completions/mean_length"] = length_sum / completions
    metrics["eval_completions/min_length"] = min_length
    metrics["eval_completions/max_length"] = max_length
    metrics["eval_completions/clipped_ratio"] = truncated / completions
    return metrics


def tool_totals(counts: dict[str, int]) -> torch.Tensor:
    """This rank's completions, tool calls and failed calls (a tool rollout's `Rollout.counts`), for one
    reduction."""
    return torch.tensor([counts["completions"], counts["calls"], counts["failures"]], dtype=torch.float32)


def eval_tool_metrics(totals: torch.Tensor) -> dict[str, float]:
    """TRL's eval tool metrics from `tool_totals` summed over ranks: calls per completion, failures per call."""
    completions, calls, failures = totals.tolist()
    return {
        "eval_tools/call_frequency": calls / completions,
        "eval_tools/failure_frequency": failures / calls if calls else 0.0,
    }
