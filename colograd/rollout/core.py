"""What one rollout call returns (`GRPOTrainer.sample`), and the metrics the trainer records from it.

The stages (`prepare_prompts`, `generate`, `score`, `compute_advantages`) only return values; the trainer records
their metrics from those values, around them, so an override owes nothing but its return value. Training and
evaluation take their rollouts from the same call and compute their own metrics from what it returns.
"""

from dataclasses import dataclass
from typing import Any

import torch
from trl.data_utils import is_conversational
from trl.trainer.utils import nanstd

from colograd.engine.rollout import Rollout
from colograd.grpo.loss import weighted_rewards
from colograd.rewards.core import RewardFunc, TimeLimits, score
from colograd.vision.checks import check_prompt_lengths, check_row
from colograd.vision.core import image_prompts


@dataclass
class PromptImages:
    """An image rollout's prompts beyond their ids: what the engine and the trainer each need of their images.

    images: each prompt's images, in order, as the engine gets them (it expands their placeholders itself).
    expanded_ids: each prompt's token ids with its images expanded as the processor does, which the trainer trains on.
    pixels: the processor's outputs for each prompt (`pixel_values` and the like).
    """

    images: list[list]
    expanded_ids: list[list[int]]
    pixels: list[dict]


class PreparedPrompts(tuple):
    """What `prepare_prompts` returns: it unpacks as `(prompts, prompt_ids, columns)`, as an override expects, and an
    image rollout's also carries `images` (`PromptImages`; None for text). An override that builds its own tuple
    has no images: its prompts are text."""

    images: PromptImages | None

    def __new__(cls, prompts: list, prompt_ids: list[list[int]], columns: dict, images: PromptImages | None = None):
        prepared = super().__new__(cls, (prompts, prompt_ids, columns))
        prepared.images = images
        return prepared


def vision_prompts(
    processing_class: Any,
    rows: list[dict],
    names: list[str],
    columns: dict[str, list],
    images_per_prompt: int,
    limit: int,
    args: Any,
) -> PreparedPrompts | None:
    """A vision-language run's rows as `prepare_prompts` returns them. Each row is checked first (`check_row`, as
    preflight checks its sample), so that a bad row stops the rollout before any work on it; in an image run
    (`images_per_prompt` > 0), the prompts' ids hold one placeholder per image, which the engine expands, and their
    `PromptImages` the processor's expansion, which the trainer trains on and which must fit `limit` tokens. None in a
    text run: its prompts are tokenized as text."""
    image_run, prompts = bool(images_per_prompt), [row["prompt"] for row in rows]
    images = [
        check_row(row, name, processing_class, image_run, images_per_prompt or None)
        for row, name in zip(rows, names, strict=True)
    ]
    if not image_run:
        return None
    prompt_ids, expanded, pixels = image_prompts(processing_class, prompts, images, args.chat_template_kwargs)
    setting = "max_prompt_length" if args.max_prompt_length else "the engine's context less a completion"
    check_prompt_lengths(expanded, names, limit, setting)
    return PreparedPrompts(prompts, prompt_ids, columns, PromptImages(images, expanded, pixels))


@dataclass
class ScoredRollout:
    """One rollout of a batch of dataset rows, scored.

    prompts: each row's `prompt`, as given (text or messages).
    prompt_ids: each templated prompt's token ids, as the engine received them (after truncation).
    columns: every other column of the rows, one value per row.
    rollout: the engine's G completions of each prompt, groups contiguous.
    rewards_NF: float32 [N completions, F reward functions], NaN where a function abstained.
    truncated_prompts: how many prompts were cut to fit (`max_prompt_length`, or the engine's context).
    images: an image rollout's images, expanded ids and pixels (`PromptImages`); None for text.
    """

    prompts: list
    prompt_ids: list[list[int]]
    columns: dict[str, list]
    rollout: Rollout
    rewards_NF: torch.Tensor
    truncated_prompts: int = 0
    images: PromptImages | None = None


def sampled_lengths(rollout: Rollout) -> torch.Tensor:
    """Each completion's length in the tokens the model sampled, [N] float32: inserted tool results do not count
    (TRL's way)."""
    counts = [sum(m) for m in rollout.tool_mask] if rollout.tool_mask else list(map(len, rollout.completion_ids))
    return torch.tensor(counts, dtype=torch.float32)


def rollout_metrics(scored: ScoredRollout, reward_names: list[str]) -> dict[str, float]:
    """The training metrics of a scored rollout: prompts truncated, completion lengths and truncation, and each
    reward function's mean and standard deviation (TRL's names)."""
    lengths_N = sampled_lengths(scored.rollout)
    truncated = scored.rollout.truncated
    metrics = {
        "prompts/truncated_ratio": scored.truncated_prompts / len(scored.prompt_ids),
        "completions/mean_length": lengths_N.mean().item(),
        "completions/min_length": lengths_N.min().item(),
        "completions/max_length": lengths_N.max().item(),
        "completions/clipped_ratio": sum(truncated) / len(truncated),
    }
    for j, name in enumerate(reward_names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(scored.rewards_NF[:, j]).item()
        metrics[f"rewards/{name}/std"] = nanstd(scored.rewards_NF[:, j]).item()
    return metrics


def scored_metrics(
    scored: ScoredRollout,
    reward_names: list[str],
    reward_weights: torch.Tensor,
    num_generations: int,
    vision: bool,
    every_NF: torch.Tensor | None = None,
) -> dict[str, float]:
    """Every metric a training rollout logs of itself: `rollout_metrics`, what its source measured
    (`Rollout.metrics`: the agents', partial rollouts'), `reward_metrics`, and in a vision-language run the images
    per prompt (shown at every step, so that a run whose rows lost their images says so).

    Args:
        every_NF: where groups span ranks, every rank's rewards in rank order (`gather_rows`): `reward_metrics` are
            then the whole rollout's, the same on every rank, since a rank's own rewards are not whole groups."""
    metrics = rollout_metrics(scored, reward_names) | scored.rollout.metrics
    if vision:
        images = scored.images.images if scored.images is not None else [[] for _ in scored.prompts]
        metrics["images/per_prompt"] = sum(map(len, images)) / max(1, len(images))
    rewards_NF = scored.rewards_NF if every_NF is None else every_NF
    return metrics | reward_metrics(rewards_NF, reward_weights, num_generations)


def reward_metrics(rewards_NF: torch.Tensor, reward_weights: torch.Tensor, num_generations: int) -> dict[str, float]:
    """The weighted total reward's mean and spread, and the share of groups whose completions all scored the same
    (their advantages are zero), as TRL logs them."""
    rewards_N = weighted_rewards(rewards_NF, reward_weights)
    group_std_G = nanstd(rewards_N.view(-1, num_generations), dim=1)
    zero_std_G = torch.isclose(group_std_G, torch.zeros_like(group_std_G))
    return {
        "reward": torch.nanmean(rewards_N).item(),
        "reward_std": nanstd(rewards_N).item(),
        "frac_reward_zero_std": zero_std_G.float().mean().item(),
    }


def gap_sampling(args: Any, state: Any, comparing: bool, evaluation: bool = False) -> tuple[bool, int]:
    """Whether a rollout asks the engine for the log-prob of the sampling-gap metric's completion, and which turn of
    an image run's rotation it is (`RolloutContext.gap_sample` and `gap_turn`), from the run's place alone (`state`:
    the Trainer's, before the rollout's first optimizer step) and whether the parity guard is comparing.

    Any request that asks makes vLLM do per-step work for the whole batch (generation at 0.87 of the engine's speed
    with one completion asking, 0.997 with none: the CPU, `--shape small`), so a training rollout asks only when an
    optimizer step it trains logs (every `logging_steps`, the first with `logging_first_step`, the last), or while
    the parity guard compares the engine with the trainer's pass (the gate, and a recheck after a rollout past the
    bound); the other steps generate at the engine's own speed. An evaluation's rollout always asks. The turn is the
    logging window of the rollout's last step: it moves on by one at each rollout that logs, and is the same after a
    resume."""
    span = -(-args.rollout_micro_steps // args.gradient_accumulation_steps)
    first = state.global_step + 1
    steps = range(first, first + span)  # the optimizer steps this rollout trains
    every = max(1, int(state.logging_steps or 1))
    turn = steps[-1] // every
    if evaluation or args.logging_strategy != "steps" or comparing:
        return True, turn
    logs = (
        any(step % every == 0 for step in steps)
        or (args.logging_first_step and first == 1)
        or 0 < state.max_steps <= steps[-1]
    )
    return logs, turn


def score_rollout(
    reward_funcs: list[RewardFunc],
    tokenizer: Any,
    prompts: list,
    rollout: Rollout,
    columns: dict[str, list],
    given: dict[str, Any],
    limits: TimeLimits,
) -> torch.Tensor:
    """The `score` stage's work: every reward function on every completion of `rollout`, as TRL calls them (the
    completions decoded, as chat messages when the prompts are; each prompt's columns repeated for its completions,
    the rollout's own columns beside them, and `given`: the trainer state and the logging hooks). Returns [N, F],
    NaN where a function abstained."""
    g = len(rollout.completion_ids) // len(prompts)
    texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    conversational = is_conversational({"prompt": prompts[0]})
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    repeat = lambda values: [v for v in values for _ in range(g)]  # noqa: E731 — one value per completion
    # The rollout's own columns (an agent's) hold one value per completion already.
    per_completion = {**{k: repeat(v) for k, v in columns.items()}, **rollout.columns, **given}
    return score(reward_funcs, repeat(prompts), completions, rollout.completion_ids, per_completion, limits)
