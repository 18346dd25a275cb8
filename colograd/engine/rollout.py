"""What one rollout is asked and what it returns: `RolloutContext` (built by `GRPOTrainer.sample`, read by the
`generate` stage and the agents) and `Rollout` (what the engine, the agent loop or partial rollouts give back, with
the `RewardLogs` its reward functions write)."""

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RolloutContext:
    """What `generate` is given besides the prompts: built by `sample` for each rollout call.

    rows: this rank's dataset rows, one per prompt: environments reset from them, a `rollout_func` reads their
        prompts, and early rewards their columns.
    step: seeds the sampling: the training rollout's place in the run, apart for each refill round; an
        evaluation's apart from every training step's.
    num_generations: G, the completions of each prompt.
    evaluation: an evaluation rollout (it always asks the sampling-gap metric's log-probs).
    round: dynamic sampling's refill round (`colograd.rollout.dynamic`); 0 for a rollout's first.
    gap_sample: whether the engine is asked the log-probs of the sampling-gap metric's completion
        (`colograd.rollout.core.gap_sampling`).
    gap_turn: an image run's turn of the metric's prompt: `generate` puts prompt `gap_turn % len(prompts)` first, so
        that the metric covers every row in turn.
    counts: where groups span ranks, the completions of each prompt this rank samples (its share of each group:
        `colograd.rollout.spans`); None: `num_generations` of each.
    """

    rows: list[dict]
    step: int
    num_generations: int
    evaluation: bool = False
    round: int = 0
    gap_sample: bool = True
    gap_turn: int = 0
    counts: list[int] | None = None


class RewardLogs:
    """What reward functions log through TRL's `log_extra` and `log_metric` arguments about one rollout's
    completions (`Rollout.reward_logs`, filled by the `score` stage): extra columns of the completions log, and
    scalar metrics (averaged over a logging window and the ranks, as every metric is)."""

    def __init__(self) -> None:
        self.extra: dict[str, list] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        """Add a column to the completions log: one value per completion of the call."""
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """Log one scalar for this rollout (several calls are averaged)."""
        self.metrics[name].append(float(value))

    def arguments(self) -> dict[str, Callable]:
        """The keyword arguments every reward function is called with, as TRL names them."""
        return {"log_extra": self.log_extra, "log_metric": self.log_metric}

    def take(self) -> tuple[dict[str, list], dict[str, float]]:
        """The extra columns and each metric's mean since the last call; forgets them."""
        extra, metrics = dict(self.extra), {k: sum(v) / len(v) for k, v in self.metrics.items() if v}
        self.extra.clear()
        self.metrics.clear()
        return extra, metrics


@dataclass
class Rollout:
    """What the engine returns for N = prompts × G completions, groups contiguous.

    completion_ids: token ids of each completion (ends with EOS when the model stopped by itself).
    logps: the engine's log-prob of each sampled token, after temperature (same length as its ids).
    truncated: whether each completion was cut at max_completion_length.
    tool_mask: for completions with tokens the engine did not sample (tool results inserted between turns), 1 on
        each sampled token and 0 on each inserted one; None: every token was sampled.
    prompt_ids: the prompt of each completion, when a rollout gave completions of one prompt different prompts
        (environments that add to them); None: completion i continues prompt i // G.
    stale: partial rollouts (`colograd.rollout.partial`): how many of each completion's tokens, the first ones, were
        sampled under older weights than this rollout's; None: none were.
    columns: what the reward functions get besides the rows' columns, one value per completion (an environment
        run's `environments`).
    metrics: the rollout's own metrics, recorded by the trainer as they are (tool runs' `tools/*`).
    counts: the rollout's totals that metrics over ranks are reduced from (tool runs: completions, calls, failures).
    routed: routing replay (`routing_replay: rollout`): the experts the engine's MoE layers chose for each position
        of each completion's sequence (prompt then completion), int16 [prompt + completion length, layers, top_k],
        -1 where the engine did not route it (`colograd.engine.routing`); None: not recorded.
    asked: whether the engine was asked the log-probs of each completion, so that a NaN in an asked completion's
        `logps` is the engine's own (it computed none: the parity guard counts it past any bound); None: not
        recorded (a NaN then may mean either).
    reward_logs: what the reward functions logged about these completions when `score` called them (TRL's
        `log_extra` / `log_metric`): each rollout its own, read by the trainer with the rollout's other metrics.
    """

    completion_ids: list[list[int]]
    logps: list[list[float]]
    truncated: list[bool]
    tool_mask: list[list[int]] | None = None
    prompt_ids: list[list[int]] | None = None
    engine_prompt_ids: list[list[int]] | None = None  # image prompts: each prompt as the engine expanded it
    stale: list[int] | None = None
    columns: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    routed: list[torch.Tensor] | None = None
    asked: list[bool] | None = None
    reward_logs: RewardLogs = field(default_factory=RewardLogs, compare=False, repr=False)
