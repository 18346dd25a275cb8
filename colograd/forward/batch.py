"""A rollout as padded tensors, and its split into the micro-batches that train on it.

Shapes: N completions (groups of G contiguous), P prompt tokens (left-padded), T completion tokens
(right-padded).
"""

from typing import TypedDict

import torch

from colograd.engine.rollout import Rollout
from colograd.forward.logps import PromptSharing, forwarded_tokens, plan_shared
from colograd.forward.router import UNREAD
from colograd.rollout.core import ScoredRollout
from colograd.vision.core import check_expansion, pad_pixels


class RolloutBatch(TypedDict, total=False):
    """One rollout slice as `GRPOTrainer.compute_loss` reads it: a dict (the Trainer moves and splits it as one),
    typed. `pad_rollout` fills the first eight; `make_rollout` adds `num_items` (and an image run's `mm_*` pixels,
    `colograd.vision.core.pad_pixels`), `rollout_logps` the old and reference log-probs, `split_by_tokens` the scale.
    """

    input_ids: torch.Tensor  # [N, P + T] long: prompt (left-padded) then completion (right-padded)
    attention_mask: torch.Tensor  # [N, P + T] long: 1 on real tokens
    position_ids: torch.Tensor  # [N, P + T] long
    completion_ids: torch.Tensor  # [N, T] long: input_ids[:, P:]
    completion_mask: torch.Tensor  # [N, T] long: the tokens the loss counts
    tool_mask: torch.Tensor  # [N, T] long: the tokens the engine sampled under this rollout's weights
    engine_logps: torch.Tensor  # [N, T] float: the engine's log-prob of each sampled token (NaN where not asked)
    advantages: torch.Tensor  # [N] float
    num_items: torch.Tensor  # [] float: the tokens a slice's loss is divided by (dapo), per rank and slice
    old_logps: torch.Tensor  # [N, T] float: the sampling policy's, when a slice trains after an optimizer step
    ref_logps: torch.Tensor  # [N, T] float: the reference policy's, when beta > 0
    loss_scale: torch.Tensor  # [] float: a pass's share of its slice, when a slice is trained in several passes
    routed_experts: torch.Tensor  # [N, P + T, layers, top_k] int16: the engine's routing (routing replay), else < 0
    fresh: torch.Tensor  # [] bool: the rollout's first micro-step, on the weights that sampled it (`training_step`)
    engine_asked: torch.Tensor  # [N] bool: the engine was asked each completion's log-probs (`Rollout.asked`)


def pad_rollout(
    prompt_ids: list[list[int]],
    rollout: Rollout,
    advantages_N: torch.Tensor,
    num_generations: int,
    pad_token_id: int,
    mask_truncated_completions: bool = False,
    mask_stale_tokens: bool = False,
) -> RolloutBatch:
    """The tensors `GRPOTrainer.compute_loss` reads.

    Args:
        prompt_ids: token ids of each prompt; completion i belongs to prompt i // num_generations.
        rollout: the engine's completions, their sampled log-probs, and which were truncated.
        advantages_N: one advantage per completion.
        mask_truncated_completions: leave completions cut at max_completion_length out of `completion_mask`.
        mask_stale_tokens: leave the tokens sampled under older weights (`rollout.stale`, partial rollouts) out of
            `completion_mask`; they stay in the context of the tokens after them.

    Returns:
        input_ids, attention_mask, position_ids [N, P + T]; completion_ids, completion_mask, tool_mask,
        engine_logps [N, T]; advantages [N]; with the engine's routing (`rollout.routed`), routed_experts
        [N, P + T, layers, top_k], aligned with input_ids (-1 on positions the engine did not route, `UNREAD` on
        padding and on a completion's last token, whose routing nothing reads). `tool_mask` is 1 on each token the
        engine sampled under this rollout's weights (0 on inserted tool results, padding, and stale tokens of partial
        rollouts, and with replayed routing on every token of a completion that has stale ones: the sampling-gap
        metric and the parity guard compare the trainer with the engine there); `completion_mask` (the tokens
        the loss counts) is 0 on inserted tool results and padding, and on stale tokens with `mask_stale_tokens`.
    """
    completions = rollout.completion_ids
    if rollout.prompt_ids is not None:  # one prompt per completion
        prompt_ids, num_generations = rollout.prompt_ids, 1
    n, p, t = len(completions), max(map(len, prompt_ids)), max(1, max(map(len, completions)))
    input_ids = torch.full((n, p + t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, p + t), dtype=torch.long)
    engine_logps = torch.zeros((n, t))
    for i, (ids, logps) in enumerate(zip(completions, rollout.logps, strict=True)):
        prompt = prompt_ids[i // num_generations]
        input_ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        input_ids[i, p : p + len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, p - len(prompt) : p + len(ids)] = 1
        engine_logps[i, : len(logps)] = torch.tensor(logps)
    tool_mask = attention_mask[:, p:].clone()
    for i, mask in enumerate(rollout.tool_mask or []):
        tool_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.long)
    completion_mask = tool_mask.clone()
    for i, stale in enumerate(rollout.stale or []):
        tool_mask[i, :stale] = 0
    if mask_stale_tokens:
        completion_mask = completion_mask * tool_mask
    if rollout.routed is not None:
        # Replayed routing of a completion with stale tokens: its prompt's and earlier tokens' positions are routed as
        # the engine routed them then (older weights), while the engine recomputed them under this rollout's weights
        # to continue it; its new tokens read another context on each side: no parity figure.
        for i, stale in enumerate(rollout.stale or []):
            if stale:
                tool_mask[i] = 0
    if mask_truncated_completions:
        completion_mask[torch.tensor(rollout.truncated)] = 0
    batch = RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
        completion_ids=input_ids[:, p:],
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        engine_logps=engine_logps,
        advantages=advantages_N,
    )
    if rollout.asked is not None:
        batch["engine_asked"] = torch.tensor(rollout.asked, dtype=torch.bool)
    if rollout.routed is not None:
        routed = torch.full((n, p + t, *rollout.routed[0].shape[1:]), UNREAD, dtype=torch.int16)
        for i, routes in enumerate(rollout.routed):
            start = p - len(prompt_ids[i // num_generations])
            routed[i, start : start + routes.size(0)] = routes
            # The last token's routing is read by nothing: its output predicts past the completion.
            last = routed[i, start + routes.size(0) - 1]
            last[last == -1] = UNREAD
        batch["routed_experts"] = routed
    return batch


def rollout_batch(
    scored: ScoredRollout,
    advantages_N: torch.Tensor,
    num_generations: int,
    pad_token_id: int,
    mask_truncated_completions: bool = False,
    mask_stale_tokens: bool = False,
) -> RolloutBatch:
    """A scored rollout as the tensors `compute_loss` reads (`pad_rollout`): an image rollout's with its prompts as
    the processor expanded them, once the engine's own expansion is checked to be the same (`check_expansion`), and
    its pixels (`pad_pixels`)."""
    prompt_ids = scored.prompt_ids if scored.images is None else scored.images.expanded_ids
    if scored.images is not None:
        check_expansion(scored.rollout.engine_prompt_ids, prompt_ids)
    masks = (mask_truncated_completions, mask_stale_tokens)
    batch = pad_rollout(prompt_ids, scored.rollout, advantages_N, num_generations, pad_token_id, *masks)
    if scored.images is not None:
        batch.update(pad_pixels(scored.images.pixels, num_generations))
    return batch


def split_rows(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Split every per-completion tensor into `parts` consecutive row blocks; scalars are shared.

    Blocks are consecutive so that, when the rows divide into whole groups, each block holds whole groups.
    """
    chunked = {k: v.chunk(parts) if v.dim() else [v] * parts for k, v in batch.items()}
    return [{k: chunks[i] for k, chunks in chunked.items()} for i in range(parts)]


def split_by_tokens(
    batch: dict[str, torch.Tensor],
    max_tokens: int,
    loss_type: str,
    share_prompts: PromptSharing | float | None = None,
    row_tokens: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Split a micro-batch's rows into consecutive passes whose forward computes at most `max_tokens` real tokens
    (prompt + completion; a longer row makes a pass of its own), each with the `loss_scale` that makes the
    passes' scaled losses add up to the micro-batch's loss for `loss_type` (see `colograd.grpo.loss.reduce_loss`).

    With `share_prompts` (the forward's, and its `row_tokens`), where sharing applies to the micro-batch
    (`PromptSharing.applies`), a row with the prompt of the row before it in the pass costs what it adds to their
    shared copies (`forwarded_tokens`), so a pass holds whole groups where the budget allows. (Each pass's forward
    decides again; one that then computes its sequences whole holds at most 1 / (1 - `min_saving`) × the budget.)
    """
    mask = batch["attention_mask"]
    tokens_N = mask.sum(1).tolist()
    same_N, prompt_N = [False] * len(tokens_N), [0] * len(tokens_N)  # same_N: the row has the row before's prompt
    if share_prompts is not None and not isinstance(share_prompts, PromptSharing):
        share_prompts = PromptSharing(share_prompts)
    if share_prompts is not None and share_prompts.min_saving:
        plan = plan_shared(batch, share_prompts.attention_cost, row_tokens)
        share_prompts = share_prompts if share_prompts.applies(plan, row_tokens) else None
    if share_prompts is not None:
        p = mask.size(1) - batch["completion_ids"].size(1)
        ids, prompt_mask = batch["input_ids"][:, :p], mask[:, :p]
        same_N[1:] = ((ids[1:] == ids[:-1]) & (prompt_mask[1:] == prompt_mask[:-1])).all(1).tolist()
        prompt_N = prompt_mask.sum(1).tolist()
    bounds, used, group = [0], 0, []  # group: completion lengths of the pass's last run of one prompt
    for i, tokens in enumerate(tokens_N):
        completion = tokens - prompt_N[i]
        if same_N[i] and group:
            cost = forwarded_tokens(prompt_N[i], [*group, completion], share_prompts.attention_cost, row_tokens)
            cost -= forwarded_tokens(prompt_N[i], group, share_prompts.attention_cost, row_tokens)
        else:
            cost, group = tokens, []
        if used and used + cost > max_tokens:
            bounds.append(i)
            used, cost, group = 0, tokens, []
        used += cost
        group.append(completion)
    bounds.append(len(tokens_N))
    completion_tokens = batch["completion_mask"].sum().clamp(min=1)
    passes = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        part = {k: v[start:end] if v.dim() else v for k, v in batch.items()}
        if loss_type == "bnpo":  # a mean over the micro-batch's tokens
            scale = part["completion_mask"].sum() / completion_tokens
        elif loss_type in ("grpo", "dr_grpo", "sapo", "luspo"):  # a mean over its completions
            scale = torch.tensor((end - start) / len(tokens_N))
        else:  # dapo, cispo, vespo: their denominator, num_items, is already the micro-batch's
            scale = torch.tensor(1.0)
        passes.append({**part, "loss_scale": scale.float()})
    return passes
