"""DAPO's dynamic sampling: a rollout of informative groups only, refilled from the dataset.

A group whose completions all got the same total reward has zero advantage: it adds nothing to the gradient but
its share of the loss's denominator. `DynamicSampling.fill` samples the rank's prompts as usual, then, while some rank
has fewer informative groups than its batch holds, runs a refill round on every rank: prompts drawn from the
dataset by a permutation seeded with (seed, step), each round the next prompts of it and each rank its own slice,
sampled and scored like the first. It then keeps, on each rank, its first informative groups; when the rounds run
out first, the fallback completes the batch with the least uniform of the others, or stops.

Every decision that a collective depends on (whether another round runs, how many prompts it samples, whether the
fallback stops) is taken from numbers agreed across the ranks, so every rank runs the same rounds: a rank that
found its groups early still samples with the others, since rewards and advantages may gather across ranks. Groups
stay on the rank that sampled them.
"""

import math
import warnings
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch
from trl.trainer.utils import nanstd

from colograd.data.streaming import NumberedRows, read_row
from colograd.engine.rollout import RewardLogs, Rollout
from colograd.errors import ConfigError
from colograd.grpo.loss import weighted_rewards
from colograd.rollout.core import PromptImages, ScoredRollout

# Refill round k of a rollout samples with its step + k × this as the engine's step: apart from every other
# rollout's.
ROUND_STRIDE = 1 << 40
# Rollouts in a row that `fallback: fill` completed with uniform groups before a warning; it repeats at twice as many.
WARN_AFTER = 3


def refuse_stream(train_dataset: Any, setting: str, prompts: str) -> None:
    """Refuse a streamed `train_dataset` for `setting`, which draws its `prompts` from it by index (`draw_rows`)."""
    if train_dataset is not None and not hasattr(train_dataset, "__len__"):
        raise ConfigError(
            f"{setting} draws its {prompts} from train_dataset by index, which a stream (IterableDataset) cannot "
            f"give; load the dataset in memory (dataset_streaming: false) or turn {setting} off."
        )


def refuse_unrefillable(args: Any, train_dataset: Any, agents: bool) -> None:
    """Refuse, before start-up, what dynamic sampling cannot refill: a stream (refill prompts are drawn by index),
    and rollouts of tools, environments or a `rollout_func` (their rounds would each reset the agents' state)."""
    if not args.dynamic_sampling:
        return
    refuse_stream(train_dataset, "dynamic_sampling", "refill prompts")
    if agents:
        raise ConfigError(
            "dynamic_sampling with tools, environment_factory or rollout_func is not supported (a refill round would "
            "run the agents again within one rollout); turn dynamic_sampling off for agent runs."
        )


def group_spread(
    rewards_NF: torch.Tensor, weights_F: torch.Tensor, num_generations: int, per_function: bool = False
) -> torch.Tensor:
    """How far each group's completions are from scoring alike, [P]: the standard deviation of their total
    (weighted) rewards; 0 for a group whose completions all scored alike, or that no function scored.

    With `per_function` (`multi_objective_aggregation: normalize_then_sum`, where each function's rewards are
    normalised within the group before they are summed), the largest standard deviation of one weighted function's
    rewards: a group then has zero advantages only when every function scored its completions alike, whatever
    their totals."""
    if per_function:
        weighted_NF = (rewards_NF * weights_F).masked_fill(weights_F == 0, float("nan"))
        spread_PF = nanstd(weighted_NF.view(-1, num_generations, rewards_NF.size(1)), dim=1)
        return spread_PF.nan_to_num(0.0).amax(dim=1)
    rewards_N = weighted_rewards(rewards_NF, weights_F)
    return nanstd(rewards_N.view(-1, num_generations), dim=1).nan_to_num(0.0)


# The lists of a `Rollout` with one entry per prompt; the others have one per completion.
_PER_PROMPT = ("engine_prompt_ids",)
# A `Rollout`'s dicts: its reward columns (per completion, taken and joined per key), metrics and counts (the whole
# rollout's: kept as they are when groups are taken, averaged and summed when rounds are joined), and its reward
# logs (each round's taken by `DynamicSampling.fill`, the kept groups' put back in the joined rollout's own).
JOINED = ("columns", "metrics", "counts", "reward_logs")


def take_groups(scored: ScoredRollout, groups: list[int], num_generations: int) -> ScoredRollout:
    """The groups `groups` of `scored` (by index, in that order): their prompts, columns, completions, rewards and
    images. `truncated_prompts` becomes the kept groups' share of the rollout's count (the count is not per prompt)."""
    g = num_generations
    completions = [i * g + j for i in groups for j in range(g)]
    pick = lambda values, index: [values[i] for i in index]  # noqa: E731
    lists = {f.name: getattr(scored.rollout, f.name) for f in fields(Rollout) if f.name not in JOINED}
    rollout = replace(
        scored.rollout,
        **{
            name: pick(v, groups if name in _PER_PROMPT else completions) for name, v in lists.items() if v is not None
        },
        columns={k: pick(v, completions) for k, v in scored.rollout.columns.items()},
    )
    images = None
    if scored.images is not None:
        images = PromptImages(*(pick(getattr(scored.images, f.name), groups) for f in fields(PromptImages)))
    num_prompts = len(scored.prompt_ids)
    return ScoredRollout(
        prompts=pick(scored.prompts, groups),
        prompt_ids=pick(scored.prompt_ids, groups),
        columns={k: pick(v, groups) for k, v in scored.columns.items()},
        rollout=rollout,
        rewards_NF=scored.rewards_NF[completions],
        truncated_prompts=round(scored.truncated_prompts * len(groups) / max(1, num_prompts)),
        images=images,
    )


def join(parts: list[ScoredRollout]) -> ScoredRollout:
    """The scored rollouts `parts` as one: groups in order, every field concatenated (a field is None in every part
    or in none: each round of a run's rollout samples the same way); the rollouts' columns concatenated per key,
    their metrics averaged and their counts summed."""
    if len(parts) == 1:
        return parts[0]

    def cat(values: list[Any]) -> Any:
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError("dynamic sampling: the rounds of a rollout returned different fields; cannot join them")
        return [x for v in values for x in v]

    names = [f.name for f in fields(Rollout) if f.name not in JOINED]
    listed = {name: cat([getattr(p.rollout, name) for p in parts]) for name in names}
    rollout = Rollout(
        **listed,
        columns={k: cat([p.rollout.columns[k] for p in parts]) for k in parts[0].rollout.columns},
        metrics={k: sum(p.rollout.metrics[k] for p in parts) / len(parts) for k in parts[0].rollout.metrics},
        counts={k: sum(p.rollout.counts[k] for p in parts) for k in parts[0].rollout.counts},
    )
    images = None
    if parts[0].images is not None:
        images = PromptImages(*(cat([getattr(p.images, f.name) for p in parts]) for f in fields(PromptImages)))
    return ScoredRollout(
        prompts=cat([p.prompts for p in parts]),
        prompt_ids=cat([p.prompt_ids for p in parts]),
        columns={k: cat([p.columns[k] for p in parts]) for k in parts[0].columns},
        rollout=rollout,
        rewards_NF=torch.cat([p.rewards_NF for p in parts]),
        truncated_prompts=sum(p.truncated_prompts for p in parts),
        images=images,
    )


def draw_rows(dataset: Any, seed: int, step: int, rank: int, world: int, drawn: int, count: int) -> list[dict]:
    """This rank's `count` prompts drawn from `dataset` for the rollout at `step`, after `drawn` per rank earlier in
    the same rollout (dynamic sampling's refill rounds; partial rollouts' extra prompts).

    One permutation of the dataset per rollout, seeded by (seed, step) and the same on every rank; each draw takes the
    next `world × count` of it, each rank its own slice, so that no prompt comes back within a rollout before the
    dataset is used up (it wraps round then). A `NumberedRows` dataset gives its rows with their names."""
    generator = torch.Generator().manual_seed(hash((seed, step)) % 2**63)
    order = torch.randperm(len(dataset), generator=generator).tolist()
    start = world * drawn + rank * count
    pick = (lambda i: dataset[i]) if isinstance(dataset, NumberedRows) else (lambda i: read_row(dataset, i))
    return [pick(order[(start + i) % len(order)]) for i in range(count)]


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
        self.per_function = args.multi_objective_aggregation == "normalize_then_sum"
        self.streak = FillStreak()

    def rows(self, step: int, drawn: int, count: int) -> list[dict]:
        """This rank's `count` refill prompts of the rollout at `step`, after `drawn` per rank in its earlier rounds
        (`draw_rows`)."""
        return draw_rows(self.dataset, self.args.seed, step, self.rank, self.world, drawn, count)

    def refill_size(self, want: int, missing: int, informative: int, sampled: int) -> int:
        """The prompts a refill round samples for `missing` groups, `informative` having been found among `sampled`:
        as many as the share found so far says it takes (as many as sampled so far when none was found), times
        `dynamic_sampling_oversample`; at most 8 × the `want` groups of the batch; 0 when nothing is missing."""
        if missing <= 0:
            return 0
        expected = missing * sampled / informative if informative else sampled
        return min(math.ceil(expected * self.args.dynamic_sampling_oversample), 8 * want)

    def fill(
        self,
        rows: list[dict],
        sample: Callable[[list[dict], int], ScoredRollout],
        weights_F: torch.Tensor,
        most: Callable[[list[int]], list[int]],
        step: int,
    ) -> tuple[ScoredRollout, dict[str, float], int]:
        """This rank's rollout of `len(rows)` groups, informative ones first.

        Args:
            rows: the rank's prompts from the dataloader (the first round's).
            sample: samples and scores given rows in refill round k (`GRPOTrainer.sample`).
            weights_F: the reward functions' weights (a group is scored on its total reward).
            most: each of a list of numbers, its largest over every rank (the identity in one process).
            step: the rollout's place in the run, the same after a resume; it seeds the refill prompts.

        Returns:
            The rollout; its metrics (`dynamic_sampling/*`); the completion tokens sampled in groups it dropped.
        """
        args, want, g, eps = self.args, len(rows), self.g, self.args.dynamic_sampling_std_eps
        parts, spreads, extras, logged = [], [], [], []
        found = sampled = drawn = missing = count = 0
        for k in range(args.dynamic_sampling_max_rounds + 1):
            if k:
                rows, drawn = self.rows(step, drawn, count), drawn + count
            parts.append(sample(rows, k))
            extra, metrics = parts[-1].rollout.reward_logs.take()  # each round's reward logs (TRL's log_extra ...)
            extras.append(extra)
            logged.append(metrics)
            spreads.append(group_spread(parts[-1].rewards_NF, weights_F, g, self.per_function))
            found += int((spreads[-1] > eps).sum())
            sampled += len(spreads[-1])
            # The rank missing most decides, so that every rank runs the same rounds, each of as many prompts: the
            # collectives inside sampling and scoring meet.
            missing, count = most([max(0, want - found), self.refill_size(want, want - found, found, sampled)])
            if not missing:
                break
        rounds = len(parts) - 1
        if missing and args.dynamic_sampling_fallback == "error":  # `missing` is agreed: every rank stops here
            raise ConfigError(
                f"dynamic_sampling: after {rounds} refill rounds a rank has only {want - missing} of its {want} "
                f"groups with rewards that differ (std above dynamic_sampling_std_eps={eps}); raise "
                "dynamic_sampling_max_rounds or dynamic_sampling_oversample, or set dynamic_sampling_fallback: fill."
            )
        every, spread = join(parts), torch.cat(spreads)
        informative = [i for i in range(len(spread)) if spread[i] > eps][:want]
        chosen = set(informative)
        others = sorted((i for i in range(len(spread)) if i not in chosen), key=lambda i: -float(spread[i]))
        filled = others[: want - len(informative)]
        # `missing` is agreed, so every rank counts the same streak; one rank says it.
        where = f" on rank {self.rank}" if self.world > 1 else ""
        warning = self.streak.add(bool(missing), len(spread), want, len(informative), rounds, where)
        if warning and self.rank == 0:
            warnings.warn(warning, stacklevel=2)
        groups = informative + filled
        kept = take_groups(every, groups, g)
        # What the reward functions logged about the kept groups, in the rollout returned.
        _put_back(kept.rollout.reward_logs, extras, logged, [len(p.rollout.completion_ids) for p in parts], groups, g)
        dropped = set(range(len(spread))) - set(groups)
        lengths = [len(every.rollout.completion_ids[i * g + j]) for i in dropped for j in range(g)]
        metrics = {
            "dynamic_sampling/kept_fraction": want / len(spread),
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/discarded_groups": float(len(dropped)),
            "dynamic_sampling/filled_groups": float(len(filled)),
            # The reward over every group sampled: the reward metrics cover the groups trained only.
            "dynamic_sampling/sampled_reward_mean": torch.nanmean(
                weighted_rewards(every.rewards_NF, weights_F)
            ).item(),
        }
        return kept, metrics, sum(lengths)


class FillStreak:
    """The rollouts in a row that ran out of refill rounds and were completed with uniform groups (`fallback:
    fill`): a reward that is never informative otherwise trains on zero advantages (loss 0), silently, at the cost
    of every round's sampling."""

    def __init__(self) -> None:
        self.rollouts = self.sampled = self.trained = self.informative = 0

    def add(
        self, filled: bool, sampled: int, trained: int, informative: int, rounds: int, where: str = ""
    ) -> str | None:
        """Count one rollout: whether it was `filled` (on any rank), the groups this rank `sampled` and `trained`,
        and the `informative` ones among them, after `rounds` refill rounds; `where` names the rank in the warning.

        Returns:
            The warning to give when the streak reaches `WARN_AFTER` rollouts (again at 2×, 4×, ...), else None.
        """
        if not filled:
            self.rollouts = self.sampled = self.trained = self.informative = 0
            return None
        self.rollouts += 1
        self.sampled += sampled
        self.trained += trained
        self.informative += informative
        n = self.rollouts
        times, rest = divmod(n, WARN_AFTER)
        if not times or rest or times & (times - 1):
            return None
        return (
            f"dynamic_sampling: {n} rollouts in a row ran out of refill rounds ({rounds} each) and were filled with "
            f"groups whose rewards do not differ: {self.sampled} groups sampled for {self.trained} trained{where}, "
            f"{self.informative} of them informative{' (the loss is 0)' if not self.informative else ''}; check "
            "the reward functions, raise dynamic_sampling_max_rounds or dynamic_sampling_oversample, or set "
            "dynamic_sampling_fallback: error to stop the run instead."
        )


def _put_back(
    logs: RewardLogs,
    extras: list[dict[str, list]],
    logged: list[dict[str, float]],
    sizes: list[int],
    groups: list[int],
    g: int,
) -> None:
    """Give `logs` back what the rounds' reward functions logged for the kept groups: each extra column with one
    value per completion in every round (`sizes`), those of the kept completions; each metric's per-round means. A
    column some round did not log in full cannot be lined up with the completions, and is left out with a warning."""
    for column in sorted(set().union(*extras)):
        if all(len(extra.get(column, ())) == n for extra, n in zip(extras, sizes, strict=True)):
            values = [v for extra in extras for v in extra[column]]
            logs.log_extra(column, [values[i * g + j] for i in groups for j in range(g)])
        else:
            warnings.warn(
                f"dynamic_sampling: the reward log column {column!r} was not logged once per completion in every "
                "round, so it cannot follow the groups kept; it is left out of this rollout's completions log.",
                stacklevel=2,
            )
    for metrics in logged:
        for name, value in metrics.items():
            logs.log_metric(name, value)
