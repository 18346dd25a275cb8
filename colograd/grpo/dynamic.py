"""DAPO's dynamic sampling: a rollout of informative groups only, refilled from the dataset.

A group whose completions all got the same total reward has zero advantage: it adds nothing to the gradient but
its share of the loss's denominator. `DynamicSampling.fill` samples the rank's prompts as usual, then, while some rank
has fewer informative groups than its batch holds, runs a refill round on every rank: prompts drawn from the
dataset by a permutation seeded with (seed, step, round), each rank its own slice, sampled and scored like the
first. It then keeps, on each rank, its first informative groups; when the rounds run out first, the fallback
completes the batch with the least uniform of the others, or stops.

Every decision that a collective depends on (whether another round runs, how many prompts it samples, whether the
fallback stops) is taken from numbers agreed across the ranks, so every rank runs the same rounds: a rank that
found its groups early still samples with the others, since rewards and advantages may gather across ranks. Groups
stay on the rank that sampled them.
"""

import math
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch
from trl.trainer.utils import nanstd

from colograd.data.streaming import NumberedRows, read_row
from colograd.engine.core import Rollout
from colograd.errors import ConfigError
from colograd.grpo.loss import weighted_rewards
from colograd.grpo.rollouts import PromptImages, RewardLogs, ScoredRollout

# Refill round k of a rollout is seeded as its step + k × this: apart from every other rollout's step.
ROUND_STRIDE = 1 << 40


def check_dynamic_sampling(args: Any, train_dataset: Any, agents: bool) -> None:
    """Refuse, before start-up, what dynamic sampling cannot refill: a stream (refill prompts are drawn by index),
    and rollouts of tools, environments or a `rollout_func` (their rounds would each reset the agents' state)."""
    if not args.dynamic_sampling:
        return
    if train_dataset is not None and not hasattr(train_dataset, "__len__"):
        raise ConfigError(
            "dynamic_sampling draws its refill prompts from train_dataset by index, which a stream (IterableDataset) "
            "cannot give; load the dataset in memory (dataset_streaming: false) or turn dynamic_sampling off."
        )
    if agents:
        raise ConfigError(
            "dynamic_sampling with tools, environment_factory or rollout_func is not supported (a refill round would "
            "run the agents again within one rollout); turn dynamic_sampling off for agent runs."
        )


def group_spread(rewards_NF: torch.Tensor, weights_F: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Each group's standard deviation of its completions' total (weighted) rewards, [P]; 0 for a group whose
    completions all scored alike, or that no function scored."""
    rewards_N = weighted_rewards(rewards_NF, weights_F)
    return nanstd(rewards_N.view(-1, num_generations), dim=1).nan_to_num(0.0)


def take_groups(scored: ScoredRollout, groups: list[int], num_generations: int) -> ScoredRollout:
    """The groups `groups` of `scored` (by index, in that order): their prompts, columns, completions, rewards and
    images. `truncated_prompts` becomes the kept groups' share of the rollout's count (the count is not per prompt)."""
    g = num_generations
    completions = [i * g + j for i in groups for j in range(g)]
    num_prompts = len(scored.prompt_ids)
    pick = lambda values, index: [values[i] for i in index]  # noqa: E731
    rollout = _map_rollout(scored.rollout, lambda v: pick(v, completions if len(v) != num_prompts else groups), g)
    images = scored.images and PromptImages(
        *(pick(getattr(scored.images, f.name), groups) for f in fields(PromptImages))
    )
    return ScoredRollout(
        prompts=pick(scored.prompts, groups),
        prompt_ids=pick(scored.prompt_ids, groups),
        columns={k: pick(v, groups) for k, v in scored.columns.items()},
        rollout=rollout,
        rewards_NF=scored.rewards_NF[completions],
        truncated_prompts=round(scored.truncated_prompts * len(groups) / max(1, num_prompts)),
        images=images,
    )


def _map_rollout(rollout: Rollout, pick: Callable[[list], list], g: int) -> Rollout:
    """`rollout` with `pick` applied to each of its lists (per completion, or per prompt: `engine_prompt_ids`)."""
    return replace(
        rollout, **{f.name: pick(v) for f in fields(Rollout) if (v := getattr(rollout, f.name)) is not None}
    )


def join(parts: list[ScoredRollout]) -> ScoredRollout:
    """The scored rollouts `parts` as one: groups in order, every field concatenated."""
    first = parts[0]
    if len(parts) == 1:
        return first

    def cat(values: list[Any]) -> Any:
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):  # e.g. one round's prompts were all text, another's had images
            raise ValueError("dynamic sampling: the rounds of a rollout returned different fields; cannot join them")
        return [x for v in values for x in v]

    rollout = Rollout(**{f.name: cat([getattr(p.rollout, f.name) for p in parts]) for f in fields(Rollout)})
    images = None
    if any(p.images is not None for p in parts):
        no_images = lambda p: PromptImages([[]] * len(p.prompt_ids), p.prompt_ids, [{}] * len(p.prompt_ids))  # noqa: E731
        kept = [p.images or no_images(p) for p in parts]
        images = PromptImages(*(cat([getattr(i, f.name) for i in kept]) for f in fields(PromptImages)))
    return ScoredRollout(
        prompts=cat([p.prompts for p in parts]),
        prompt_ids=cat([p.prompt_ids for p in parts]),
        columns={k: cat([p.columns[k] for p in parts]) for k in first.columns},
        rollout=rollout,
        rewards_NF=torch.cat([p.rewards_NF for p in parts]),
        truncated_prompts=sum(p.truncated_prompts for p in parts),
        images=images,
    )


class DynamicSampling:
    """The refill rounds of one run: where their prompts come from, and the settings (`dynamic_sampling_*`).

    Args:
        args: the run's config.
        dataset: the training dataset (in memory: refill prompts are drawn from it by index).
        numbered: the rows carry their names (`NumberedRows`), as the dataloader's do in a vision-language run.
        rank, world: this process's place among the ranks.
    """

    def __init__(self, args: Any, dataset: Any, numbered: bool, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.dataset = NumberedRows(dataset) if numbered else dataset
        self.g = args.num_generations

    def rows(self, step: int, round: int, count: int) -> list[dict]:
        """This rank's `count` prompts of refill round `round` of the rollout at `step`: its slice of a permutation
        of the dataset seeded by (seed, step, round), the same on every rank (wrapping round when the ranks together
        want more rows than the dataset has)."""
        generator = torch.Generator().manual_seed(hash((self.args.seed, step, round)) % 2**63)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        start = self.rank * count
        return [self._row(order[(start + i) % len(order)]) for i in range(count)]

    def refill_size(self, want: int, missing: int, informative: int, sampled: int) -> int:
        """The prompts a refill round samples for `missing` groups, `informative` having been found among `sampled`:
        as many as the share found so far says it takes (as many as sampled so far when none was found), times
        `dynamic_sampling_oversample`; at most 8 × the `want` groups of the batch; 0 when nothing is missing."""
        if missing <= 0:
            return 0
        expected = missing * sampled / informative if informative else sampled
        return min(math.ceil(expected * self.args.dynamic_sampling_oversample), 8 * want)

    def _row(self, index: int) -> dict:
        return self.dataset[index] if isinstance(self.dataset, NumberedRows) else read_row(self.dataset, index)

    def fill(
        self,
        rows: list[dict],
        sample: Callable[[list[dict], int], ScoredRollout],
        weights_F: torch.Tensor,
        most: Callable[[int], int],
        step: int,
        logs: RewardLogs | None = None,
    ) -> tuple[ScoredRollout, dict[str, float], int]:
        """This rank's rollout of `len(rows)` groups, informative ones first.

        Args:
            rows: the rank's prompts from the dataloader (the first round's).
            sample: samples and scores given rows in refill round k (`GRPOTrainer.sample`).
            weights_F: the reward functions' weights (a group is scored on its total reward).
            most: the largest of a number over every rank (the identity in one process).
            step: the rollout's step, which seeds its refill prompts.
            logs: the reward functions' logs (TRL's `log_extra` / `log_metric`): each round's are taken, and what
                belongs to the kept groups is put back for the caller.

        Returns:
            The rollout; its metrics (`dynamic_sampling/*`); the completion tokens sampled in groups it dropped.
        """
        args, want, g = self.args, len(rows), self.g
        parts, extras, logged, informative, sampled, missing, count = [], [], [], 0, 0, 0, 0
        for round in range(args.dynamic_sampling_max_rounds + 1):
            if round:
                rows = self.rows(step, round, count)
            parts.append(sample(rows, round))
            if logs is not None:
                extra, metrics = logs.take()
                extras.append((extra, len(parts[-1].rollout.completion_ids)))
                logged.append(metrics)
            spread = group_spread(parts[-1].rewards_NF, weights_F, g)
            informative += int((spread > args.dynamic_sampling_std_eps).sum())
            sampled += len(spread)
            # The rank missing most decides, so that every rank runs the same rounds, each of as many prompts: the
            # collectives inside sampling and scoring meet.
            missing, count = most(
                [max(0, want - informative), self.refill_size(want, want - informative, informative, sampled)]
            )
            if not missing:
                break
        rounds = len(parts) - 1
        if missing and args.dynamic_sampling_fallback == "error":  # `missing` is agreed: every rank stops here
            raise ConfigError(
                f"dynamic_sampling: after {rounds} refill rounds a rank has only {want - missing} of its {want} "
                f"groups with rewards that differ (std above dynamic_sampling_std_eps="
                f"{args.dynamic_sampling_std_eps}); raise dynamic_sampling_max_rounds or "
                "dynamic_sampling_oversample, or set dynamic_sampling_fallback: fill."
            )
        every = join(parts)
        spread = group_spread(every.rewards_NF, weights_F, g)
        informative = [i for i in range(len(spread)) if spread[i] > args.dynamic_sampling_std_eps][:want]
        chosen = set(informative)
        others = sorted((i for i in range(len(spread)) if i not in chosen), key=lambda i: -float(spread[i]))
        filled = others[: want - len(informative)]
        groups = informative + filled
        kept = take_groups(every, groups, g)
        if logs is not None:
            _put_back(logs, extras, logged, groups, g)
        dropped = set(range(len(spread))) - set(groups)
        lengths = [len(every.rollout.completion_ids[i * g + j]) for i in dropped for j in range(g)]
        metrics = {
            "dynamic_sampling/kept_fraction": want / len(spread),
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/discarded_groups": float(len(dropped)),
            "dynamic_sampling/filled_groups": float(len(filled)),
        }
        return kept, metrics, sum(lengths)


def _put_back(
    logs: RewardLogs, extras: list[tuple[dict, int]], logged: list[dict[str, float]], groups: list[int], g: int
) -> None:
    """Give `logs` back what the rounds' reward functions logged for the kept groups: each extra column with one
    value per completion in every round, those of the kept completions; each metric's per-round means."""
    columns = set.intersection(*(set(extra) for extra, _ in extras))
    for column in sorted(columns):
        if all(len(extra[column]) == n for extra, n in extras):
            values = [v for extra, _ in extras for v in extra[column]]
            logs.log_extra(column, [values[i * g + j] for i in groups for j in range(g)])
    for metrics in logged:
        for name, value in metrics.items():
            logs.log_metric(name, value)
