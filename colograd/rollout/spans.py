"""Groups that span ranks (`GRPOConfig.groups_span_ranks`), TRL's way: every rank reads the same rollout's prompts;
their completions, each prompt's G laid consecutively, form one sequence over all ranks, and each rank samples its
own contiguous slice of it (`rank_share`). Group statistics then need every rank's rewards
(`colograd.grpo.loss.spanned_advantages`).

    prompts     p0          p1          p2            (G = 4, 3 completions per rank, 4 ranks)
    completions 0  1  2  3  4  5  6  7  8  9  10 11
    ranks       r0 r0 r0 r1 r1 r1 r2 r2 r2 r3 r3 r3   r1 samples 1 of p0 and 2 of p1: rows [p0, p1], counts [1, 2]
"""

import os
import sys
from typing import Any

from colograd.errors import ConfigError


def check_spanning(args: Any, agents: bool, images: bool) -> None:
    """Where groups span ranks: refuse what samples a rank's prompts a whole group at a time (tools, environments
    and `rollout_func`; image prompts), in one line naming the fix, and say once, from the first rank, that groups
    span ranks. (The config refuses its own such settings: `GRPOConfig.check_spanning_groups`.)"""
    if not args.groups_span_ranks:
        return
    batch, steps, g = args.per_device_train_batch_size, args.steps_per_generation, args.num_generations
    for what, used in (("tools, environments and rollout_func sample", agents), ("image prompts are sampled", images)):
        if used:
            raise ConfigError(
                f"{what} whole groups on one rank, and {args.rank_rollout_size()} completions per rank is not a "
                f"multiple of num_generations={g}; {args.whole_rank_groups_fix()}."
            )
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"colograd: note: {args.rank_rollout_size()} completions per rank is not a multiple of "
            f"num_generations={g}, so groups span ranks, as in TRL: every rank reads the rollout's "
            f"{args.rollout_prompts} prompts, samples its {batch * steps} of their completions, and advantages are "
            "computed over every rank's rewards.",
            file=sys.stderr,
            flush=True,
        )


def rank_share(prompts: int, num_generations: int, per_rank: int, rank: int) -> tuple[int, list[int]]:
    """The prompts a rank samples and how many completions of each, where the rollout's `prompts` × G completions
    are laid out consecutively over the ranks, `per_rank` each.

    Returns:
        (first, counts): the first prompt the rank samples, and its count of completions of it and of each next one
        (each between 1 and G, summing to `per_rank`).
    """
    start, end = rank * per_rank, (rank + 1) * per_rank
    if end > prompts * num_generations:
        raise ValueError(f"rank {rank}'s {per_rank} completions lie past the rollout's {prompts} prompts")
    first, last = start // num_generations, (end - 1) // num_generations
    counts = [min(end, (p + 1) * num_generations) - max(start, p * num_generations) for p in range(first, last + 1)]
    return first, counts


def check_share(completions: int, counts: list[int]) -> None:
    """Refuse a rollout of another size than the rank's share (`counts`), which a `generate` override that samples
    G of every prompt returns: the ranks' rewards would no longer line up into groups."""
    if completions != sum(counts):
        raise RuntimeError(
            f"GRPOTrainer.generate returned {completions} completions where groups span ranks and this rank's share "
            f"is {sum(counts)}; sample context.counts[i] completions of prompt i (as the engine's generate(..., "
            "counts=context.counts) does)."
        )


def per_completion(values: list, counts: list[int]) -> list:
    """Each prompt's value repeated for each of its completions (`counts`)."""
    return [v for v, n in zip(values, counts, strict=True) for _ in range(n)]
