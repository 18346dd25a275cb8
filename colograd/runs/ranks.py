"""What one rank needs of the others' values during a step: a tensor gathered from every rank (`across_ranks`), each
of a list of numbers at its largest over the ranks (`largest_over_ranks`), a tensor's rows of every rank
(`gather_rows`), a reduction over the ranks that the backend has let go of when it returns (`all_reduce_settled`). All
are collectives."""

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

SETTLE_LIMIT = 5.0  # seconds `all_reduce_settled` waits for the backend to let go of its tensor, at most


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


def all_reduce_settled(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """`torch.distributed.all_reduce(tensor, op)` in place, returning once the backend holds `tensor` no more (without
    a process group, `tensor` as it is). The last collective of `train` (its run summary) goes through it.

    A collective returns when its result is in; the backend's thread that ran it (gloo's worker, NCCL's watchdog)
    lets go of its tensors a moment later (measured: after about one all-reduce in five on a 2-core CPU). Where the
    caller has dropped the tensor by then, that thread frees it, which takes the interpreter's lock; when that comes
    as the process exits, Python ends the thread inside torch's free and the process aborts ("terminate called
    without an active exception", SIGABRT): a run that finished and saved, reported as a failed launch. The wait
    takes the interpreter's lock off this thread (a sleep) until the tensor has no other holder than before the call,
    `SETTLE_LIMIT` seconds at most. The step's own collectives are not waited for: a backend thread still freeing one's
    tensor gets the interpreter's lock while this call waits without it, and NCCL's watchdog thread lets go of a
    collective's tensors only at its next look (`kWatchdogThreadSleepMillis`), a wait that each step would pay.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    holders = tensor._use_count()
    dist.all_reduce(tensor, op=op)
    deadline = time.monotonic() + SETTLE_LIMIT
    while tensor._use_count() > holders and time.monotonic() < deadline:
        time.sleep(0.0002)
    return tensor
