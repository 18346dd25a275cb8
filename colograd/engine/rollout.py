"""What one rollout is asked and what it returns: `RolloutContext` (built by `GRPOTrainer.sample`, read by the
`generate` stage and the agents) and `Rollout` (what the engine, the agent loop or partial rollouts give back)."""

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
    round: dynamic sampling's refill round (`colograd.grpo.dynamic`); 0 for a rollout's first.
    """

    rows: list[dict]
    step: int
    num_generations: int
    evaluation: bool = False
    round: int = 0


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
    stale: partial rollouts (`colograd.grpo.partial`): how many of each completion's tokens, the first ones, were
        sampled under older weights than this rollout's; None: none were.
    columns: what the reward functions get besides the rows' columns, one value per completion (an environment
        run's `environments`).
    metrics: the rollout's own metrics, recorded by the trainer as they are (tool runs' `tools/*`).
    counts: the rollout's totals that metrics over ranks are reduced from (tool runs: completions, calls, failures).
    routed: routing replay (`routing_replay: rollout`): the experts the engine's MoE layers chose for each position
        of each completion's sequence (prompt then completion), int16 [prompt + completion length, layers, top_k],
        -1 where the engine did not route it (`colograd.engine.routing`); None: not recorded.
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
