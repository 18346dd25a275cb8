"""What one rank needs of the others' values during a step: a tensor gathered from every rank (`across_ranks`), each
of a list of numbers at its largest over the ranks (`largest_over_ranks`), a tensor's rows of every rank
(`gather_rows`). All are collectives."""

from collections.abc import Callable
from typing import Any

import torch


def across_ranks(accelerator: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gather of every rank's values of a 1-D tensor: rewards, for what TRL normalises over the whole batch, and
    per-token entropies, for the high-entropy mask's quantile.

    Returns:
        A function of this rank's values [N] giving all ranks' [M] (on this rank's device), a rank with fewer
        padded with NaN, which the nan-aware statistics leave out. A collective: every rank must call it.
    """

    def gather(rewards_N: torch.Tensor) -> torch.Tensor:
        local = rewards_N.to(accelerator.device)
        padded = accelerator.pad_across_processes(local, dim=0, pad_index=float("nan"))
        return accelerator.gather(padded).to(rewards_N.device)

    return gather


def gather_rows(rows_NF: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Every rank's rows [N, ...] stacked in rank order [ranks × N, ...] through `gather` (`across_ranks`): where
    groups span ranks, the rollout's completions over all ranks in their order (every rank holds the same N). A
    collective: every rank must call it."""
    return gather(rows_NF.flatten()).view(-1, *rows_NF.shape[1:])


def largest_over_ranks(accelerator: Any) -> Callable[[list[int]], list[int]]:
    """Each of a list of numbers, its largest over every rank (a collective): `DynamicSampling.fill`'s `most`."""

    def most(numbers: list[int]) -> list[int]:
        every = accelerator.gather(torch.tensor(numbers, device=accelerator.device))
        return every.view(-1, len(numbers)).max(dim=0).values.tolist()

    return most
