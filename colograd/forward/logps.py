"""Log-probs of completion tokens under a causal LM: padded or packed (padding-free), output layer in chunks.

A rollout is stored padded (see `colograd.forward.batch`): N rows of P prompt tokens (left-padded) and T completion
tokens (right-padded). The forward pass can run on those rows as they are, or on the same sequences packed
end to end (`pack`): no padding is computed, and the position ids restart at 0 for each sequence, which is how
transformers' attention masks tell packed sequences apart. Either way the result is [N, T], the log-prob of
each completion token at the sampling temperature (0 where there is no token).

Completions of the same prompt can also share one copy of it (`pack_shared`, GRPO's groups): the prompt is
computed once, each completion follows it with positions continuing from the prompt's end, and a 4D attention
mask lets each completion see only its prompt and itself. Log-probs and gradients are those of the unshared
sequences; the prompt's tokens are computed once per group instead of once per completion. `PromptSharing` says
when a forward pass shares and in which form the mask is built; `colograd.forward.packing` decides it for a run (always
on a CPU; on a GPU as segments without a mask, `colograd.forward.attention`, or only where sharing pays for the masked
kernel).

The output layer never produces the whole [tokens × vocabulary] logit matrix: for the duration of the forward
pass it is swapped for one that computes the log-probs of the wanted tokens a chunk at a time, and that, when
gradients are needed, recomputes each chunk's logits in the backward pass instead of keeping them. Each chunk's
logits first get what the model's forward does to its logits after the output layer (Granite's scaling, Gemma-2's
soft-cap: `colograd.models.logit_transform`), so the log-probs are those of the distribution the model defines.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.utils.checkpoint import checkpoint

from colograd.errors import ConfigError
from colograd.forward import attention, stateful
from colograd.forward.router import UNREAD, RouterRecord, RoutingReplay
from colograd.models import logit_transform
from colograd.models.logit_transform import LogitTransform
from colograd.vision.core import forward_images


@dataclass
class Packed:
    """Sequences packed into rows for one forward pass.

    input_ids, position_ids: [R, L]; each row holds whole sequences end to end, then padding.
    index_K: for each wanted completion token k, the flat position ([R × L]) whose logits predict it.
    target_K: the wanted token ids.
    scatter: (rows, columns) of each wanted token in the [N, T] result.
    tokens: the real (not padding) tokens the rows hold.
    attention_mask: None (position ids restarting at 0 tell the sequences apart) or, for shared prompts,
        [R, 1, L, L]: True where a token may attend, or additive (0 there, -inf elsewhere); or, packed for
        segment attention, a `colograd.forward.attention.segment_mask` (no mask values).
    weights: [R, L], how many sequences each position stands for: 0 for padding, a shared prompt's token one for
        each completion that shares it, else 1 (what a per-token statistic of the sequences weighs it by).
    source: [R × L], the flat position in the padded batch ([N × (P + T)]) each position's token comes from (a
        shared prompt's: its first sequence's), -1 for padding (what a per-token input of the batch is packed by).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index_K: torch.Tensor
    target_K: torch.Tensor
    scatter: tuple[torch.Tensor, torch.Tensor]
    tokens: int
    attention_mask: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    source: torch.Tensor | None = None


def pack_rows(lengths: list[int], row_tokens: int | None = None) -> list[list[int]]:
    """Assign sequences to rows of at most `row_tokens` tokens, longest first, each to the first row it fits.

    A sequence longer than `row_tokens` gets a row of its own; None makes rows as long as the longest sequence.
    Returns the sequence indices of each row.
    """
    row_tokens = row_tokens or max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(max(row_tokens, lengths[i]))
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def pack(
    batch: dict[str, torch.Tensor], row_tokens: int | None = None, pad_token_id: int = 0, segments: str | None = None
) -> Packed:
    """The padded rollout rows of `batch` (input_ids, attention_mask, completion_ids) packed without padding.

    Vectorised: one host sync (the lengths, to plan the rows), then a scatter of every real token to its place.
    With `segments` (a `colograd.forward.attention.KERNELS` name) each sequence is a segment of its own
    (`segment_mask`).
    """
    input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    device, n = input_ids.device, input_ids.size(0)
    p = input_ids.size(1) - batch["completion_ids"].size(1)
    length_N, prompt_len_N = mask.sum(1), mask[:, :p].sum(1)
    lengths, prompt_lengths = torch.stack([length_N, prompt_len_N]).tolist()
    if min(prompt_lengths) < 1:
        raise ValueError(
            "every sequence needs at least one prompt token: its logits predict the first completion token"
        )
    rows = pack_rows(lengths, row_tokens)
    width = max(sum(lengths[i] for i in row) for row in rows)
    start = [0] * n  # where each sequence starts in the flat [R × L] layout
    for r, members in enumerate(rows):
        offset = r * width
        for i in members:
            start[i], offset = offset, offset + lengths[i]
    # Real tokens in row-major order are the sequences one after another (each row's are contiguous).
    seq_T = torch.repeat_interleave(torch.arange(n, device=device), length_N)
    first_T = torch.repeat_interleave(length_N.cumsum(0) - length_N, length_N)
    pos_T = torch.arange(len(seq_T), device=device) - first_T  # position of each token in its sequence
    dest_T = torch.tensor(start, device=device)[seq_T] + pos_T
    ids = torch.full((len(rows) * width,), pad_token_id, dtype=input_ids.dtype, device=device)
    ids[dest_T] = input_ids[mask]
    # Padding keeps position 0: each padding token is a sequence of its own, which nothing attends to.
    positions = torch.zeros(len(rows) * width, dtype=torch.long, device=device)
    positions[dest_T] = pos_T
    weights = torch.zeros(len(rows) * width, device=device)
    weights[dest_T] = 1.0
    source = torch.full((len(rows) * width,), -1, dtype=torch.long, device=device)
    source[dest_T] = mask.flatten().nonzero().squeeze(1)
    # Completion token j of a sequence is predicted by the logits at the token before it.
    column_T = pos_T - prompt_len_N[seq_T]
    wanted = column_T >= 0
    rows_K, cols_K = seq_T[wanted], column_T[wanted]
    mask = None
    if segments is not None:
        unit_of = torch.full((len(rows) * width,), -1, dtype=torch.long, device=device)
        unit_of[dest_T] = seq_T
        layout = attention.segments_of(unit_of, torch.zeros_like(unit_of), segments)
        mask = attention.segment_mask(layout, len(rows), device)
    return Packed(
        ids.view(len(rows), width),
        positions.view(len(rows), width),
        dest_T[wanted] - 1,
        batch["completion_ids"][rows_K, cols_K],
        (rows_K, cols_K),
        sum(lengths),
        mask,
        weights.view(len(rows), width),
        source,
    )


def share_units(
    prompt_len: int, completion_lens: list[int], attention_cost: float, max_tokens: int | None = None
) -> list[list[int]]:
    """Split completions of one prompt into units that each compute the prompt once.

    A unit takes the next completion while that costs less than a new copy of the prompt would: its tokens plus
    the attention it adds (every pair of the longer unit is computed, masked or not, `attention_cost` tokens
    each). So short completions of a long prompt share it widely, and long ones are not made to attend across a
    huge masked row. With `max_tokens` (`packed_row_tokens`) a unit also stops before it would hold more.
    Returns the completions' indices per unit, in order.
    """
    units: list[list[int]] = []
    length = 0
    for i, c in enumerate(completion_lens):
        join = c + attention_cost * ((length + c) ** 2 - length**2)
        fresh = prompt_len + c + attention_cost * (prompt_len + c) ** 2
        if units and join <= fresh and (max_tokens is None or length + c <= max_tokens):
            units[-1].append(i)
            length += c
        else:
            units.append([i])
            length = prompt_len + c
    return units


def forwarded_tokens(
    prompt_len: int, completion_lens: list[int], attention_cost: float, max_tokens: int | None = None
) -> int:
    """The tokens `pack_shared` computes for these completions of one prompt: a prompt per unit (`share_units`)
    plus every completion token."""
    units = share_units(prompt_len, completion_lens, attention_cost, max_tokens)
    return prompt_len * len(units) + sum(completion_lens)


@dataclass
class SharedPlan:
    """Which sequences of a batch share a prompt copy (`plan_shared`).

    prompts, completions: each sequence's prompt and completion tokens, on the CPU.
    units: the sequences of each unit; a unit computes its first sequence's prompt once, then every member's
        completion.
    """

    prompts: list[torch.Tensor]
    completions: list[torch.Tensor]
    units: list[list[int]]

    def unit_lengths(self) -> list[int]:
        """The tokens each unit computes: its prompt once, then its completions."""
        return [len(self.prompts[u[0]]) + sum(len(self.completions[i]) for i in u) for u in self.units]

    def sequence_lengths(self) -> list[int]:
        """Each sequence's tokens (prompt + completion): what packing them unshared computes."""
        return [len(p) + len(c) for p, c in zip(self.prompts, self.completions, strict=True)]


def plan_shared(batch: dict[str, torch.Tensor], attention_cost: float, row_tokens: int | None = None) -> SharedPlan:
    """Group `batch`'s sequences by prompt tokens and split each group into units (`share_units`)."""
    input_ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].bool().cpu()
    p = input_ids.size(1) - batch["completion_ids"].size(1)
    prompts = [row[:p][keep[:p]] for row, keep in zip(input_ids, mask, strict=True)]
    completions = [row[p:][keep[p:]] for row, keep in zip(input_ids, mask, strict=True)]
    if min(len(prompt) for prompt in prompts) < 1:
        raise ValueError(
            "every sequence needs at least one prompt token: its logits predict the first completion token"
        )
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt.tolist()), []).append(i)
    units = []
    for members in groups.values():
        lens = [len(completions[i]) for i in members]
        shared = share_units(len(prompts[members[0]]), lens, attention_cost, row_tokens)
        units += [[members[j] for j in unit] for unit in shared]
    return SharedPlan(prompts, completions, units)


@dataclass(frozen=True)
class PromptSharing:
    """When and how a forward pass shares prompts (`pack_shared`).

    attention_cost: `colograd.forward.packing.prompt_sharing_cost` of the model; bounds a shared unit.
    min_saving: share only when that computes at least this fraction fewer tokens than packing every sequence
        whole would, where that packing runs without a mask (every row one sequence, no padding) and so gets the
        faster maskless kernel. Otherwise (or at 0) share whenever some prompt is computed fewer times.
    additive_mask: build the mask additive in the attention's compute dtype, rows padded to a multiple of 16
        (CUDA SDPA), instead of boolean.
    """

    attention_cost: float
    min_saving: float = 0.0
    additive_mask: bool = False

    def applies(self, plan: SharedPlan, row_tokens: int | None = None) -> bool:
        """Whether a forward pass over `plan`'s sequences should share their prompts."""
        lengths = plan.sequence_lengths()
        whole, shared = sum(lengths), sum(plan.unit_lengths())
        if shared >= whole:  # no prompt is shared: the plain packing computes the same tokens
            return False
        one_per_row = len(set(lengths)) == 1 and all(len(row) == 1 for row in pack_rows(lengths, row_tokens))
        if self.min_saving and one_per_row:  # unshared, no row needs a mask: transformers runs causal SDPA
            return shared <= (1 - self.min_saving) * whole
        return True


def pack_shared(
    batch: dict[str, torch.Tensor],
    attention_cost: float,
    row_tokens: int | None = None,
    pad_token_id: int = 0,
    mask_dtype: torch.dtype | None = None,
    plan: SharedPlan | None = None,
    segments: str | None = None,
) -> Packed:
    """The padded rollout rows of `batch` packed with each prompt computed once for the completions that share it.

    Sequences with the same prompt tokens form units (`share_units`): the prompt, then each completion, whose
    positions continue from the prompt's end. Units are packed into rows like sequences (`pack_rows`), and the
    attention mask lets a prompt token see its unit's earlier prompt tokens, and a completion token its unit's
    prompt and its own earlier tokens: each completion's log-probs are those it has alone. The first completion
    token of every member is predicted by the logits at the prompt's last token, which they share.

    Args:
        mask_dtype: None: a boolean mask. A float dtype (the attention's compute dtype): an additive mask (0 or
            -inf) and rows padded to a multiple of 16 tokens, which CUDA SDPA kernels take as they are: every
            layer then uses (and saves for its backward) this one tensor instead of converting its own copy.
        plan: `plan_shared(batch, attention_cost, row_tokens)`, when already made.
        segments: instead of a mask, the prompts and completions as segments for segment attention, run by this
            `colograd.forward.attention.KERNELS` kernel (`segment_mask`).
    """
    device = batch["input_ids"].device
    plan = plan or plan_shared(batch, attention_cost, row_tokens)
    prompts, completions, units = plan.prompts, plan.completions, plan.units
    unit_lengths = plan.unit_lengths()
    rows = pack_rows(unit_lengths, row_tokens)
    width = max(sum(unit_lengths[u] for u in row) for row in rows)
    if mask_dtype is not None:
        width = -(-width // 16) * 16  # padding tokens attend to themselves only
    ids = torch.full((len(rows), width), pad_token_id, dtype=batch["input_ids"].dtype)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    unit_of = torch.full((len(rows), width), -1)  # padding belongs to no unit
    branch = torch.zeros(len(rows), width, dtype=torch.long)  # 0: a prompt token; b: the unit's b-th completion
    weights = torch.zeros(len(rows), width)  # a prompt token stands for each of its unit's sequences
    source = torch.full((len(rows), width), -1, dtype=torch.long)
    full = batch["input_ids"].size(1)  # P + T
    p = full - batch["completion_ids"].size(1)
    index, seq, column = [], [], []
    for r, row in enumerate(rows):
        offset = 0
        for u in row:
            prompt = prompts[units[u][0]]
            end = offset + len(prompt)
            ids[r, offset:end], positions[r, offset:end], unit_of[r, offset:end] = (
                prompt,
                torch.arange(end - offset),
                u,
            )
            weights[r, offset:end] = len(units[u])
            source[r, offset:end] = units[u][0] * full + p - len(prompt) + torch.arange(len(prompt))
            last_prompt = r * width + end - 1
            offset = end
            for b, i in enumerate(units[u], 1):
                completion = completions[i]
                end = offset + len(completion)
                ids[r, offset:end], unit_of[r, offset:end], branch[r, offset:end] = completion, u, b
                weights[r, offset:end] = 1.0
                source[r, offset:end] = i * full + p + torch.arange(len(completion))
                positions[r, offset:end] = torch.arange(len(prompt), len(prompt) + len(completion))
                # Completion token j is predicted at the token before it: the prompt's last for j = 0.
                before = r * width + torch.arange(offset - 1, end - 1)
                before[:1] = last_prompt
                index.append(before)
                seq.append(torch.full((len(completion),), i))
                column.append(torch.arange(len(completion)))
                offset = end
    rows_K, cols_K = torch.cat(seq).to(device), torch.cat(column).to(device)
    return Packed(
        ids.to(device),
        positions.to(device),
        torch.cat(index).to(device),
        batch["completion_ids"][rows_K, cols_K],
        (rows_K, cols_K),
        sum(unit_lengths),
        _shared_mask(unit_of.to(device), branch.to(device), mask_dtype)
        if segments is None
        else attention.segment_mask(
            attention.segments_of(unit_of.flatten(), branch.flatten(), segments), len(rows), device
        ),
        weights.to(device),
        source.flatten().to(device),
    )


def _shared_mask(unit_of: torch.Tensor, branch: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """[R, 1, L, L] attention mask from each token's unit (-1: padding) and branch (0: prompt, b: b-th completion):
    same unit (not padding), key in the prompt or in the query's own completion, causal; boolean (True: attend)
    for `dtype` None, else additive in `dtype`."""
    # Built in place: [R, L, L] booleans, then (for an additive mask) one tensor of the compute dtype.
    allowed = unit_of[:, :, None] == unit_of[:, None, :]
    allowed &= unit_of[:, None, :] >= 0
    allowed &= (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    allowed.tril_()
    # Every token sees at least itself, so padding rows are never all-masked (NaN in sdpa).
    allowed.diagonal(dim1=-2, dim2=-1).fill_(True)
    if dtype is None:
        return allowed[:, None]
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return additive.masked_fill_(allowed.logical_not_(), float("-inf"))[:, None]


def completion_logps(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float = 1.0,
    padding_free: bool = True,
    row_tokens: int | None = None,
    chunk_tokens: int = 1024,
    head: nn.Module | None = None,
    entropy: str | None = None,
    fp32_head: bool = False,
    share_prompts: PromptSharing | float | None = None,
    count_tokens: Callable[[int], None] | None = None,
    segments: str | None = None,
    suppressed: list[int] | None = None,
    position_ids: bool = True,
    router: RouterRecord | None = None,
    replay: RoutingReplay | None = None,
    apart: stateful.Apart | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `batch`'s completion tokens under `model` at `temperature`: [N, T], 0 where there is no token.
    The log-probs are of the model's own distribution: what its forward does to the logits after the output layer
    is applied to each chunk (`colograd.models.logit_transform.of(model)`, learnt at the first call).

    Rows with images (a vision-language model: `batch` holds `colograd.vision.core.pad_pixels`' tensors) run padded,
    not
    packed: the model matches its image features to the placeholders in the order they come, which packing would
    reorder, and a shared prompt would hold one image for several rows.

    Args:
        model: the causal LM, possibly wrapped (DDP, DeepSpeed, PEFT): it is called, never bypassed.
        batch: input_ids, attention_mask, position_ids [N, P + T] and completion_ids [N, T] (`pad_rollout`).
        padding_free: run the forward pass on the sequences packed into rows of at most `row_tokens` tokens
            (None: the longest sequence's length).
        chunk_tokens: completion tokens whose logits exist at once.
        head: the output layer to swap (default: `model.get_output_embeddings()` through any wrappers).
        entropy: also the entropy of each position's next-token distribution at `temperature`, chunk by chunk
            like the log-probs: "detached" (no gradient: the `entropy` metric, the high-entropy mask) or "grad"
            (the entropy bonus). None: log-probs only.
        fp32_head: the output layer computes in float32, outside autocast (`cast_lm_head_to_fp32`).
        share_prompts: with `padding_free`, sequences with the same prompt compute it once (`pack_shared`) where
            `PromptSharing.applies`; a float is the attention cost of a `PromptSharing` that shares whenever that
            saves tokens (`colograd.forward.packing.prompt_sharing_cost`). None: each its own.
        count_tokens: called with the number of tokens the forward pass computes (padded: padding included).
        segments: with `padding_free`, run the attention on segments with this `colograd.forward.attention.KERNELS`
            kernel instead of a mask, where `model`'s attention is switched to it (`attention.install`; else this
            is ignored). All sequences then go in one row: segments, not rows, keep them apart.
        suppressed: token ids the engine never samples (image placeholders): left out of every distribution, as
            the engine's `logit_bias` of -inf leaves them out.
        position_ids: give the model the rows' position ids (False: a model that computes its own, M-RoPE).
        router: a Mixture-of-Experts model's `RouterRecord`, filled with what its routers did in this pass (the
            load-balancing loss and the experts' load, each position weighted by the sequences it stands for).
        replay: the routing replay installed on `model`: set to route this pass by `batch`'s `routed_experts` (the
            engine's routing), laid out as the pass's tokens, or by the model's own routers where `batch` has none.
        apart: with `padding_free`, a model with layers that carry state: the hooks on those layers
            (`colograd.forward.stateful.Apart`), given each packed row's sequences apart; prompts are then not shared.

    Returns:
        logps_NT; with `entropy`, (logps_NT, entropy_NT). Only the completion tokens' values are meaningful.
    """
    head = head if head is not None else _output_layer(model)
    transform = logit_transform.of(model)
    if fp32_head:
        check_fp32_head(head)
    completion_ids_NT = batch["completion_ids"]
    n, t = completion_ids_NT.shape
    images = forward_images(batch, _model_config(model))
    if padding_free and not images:
        segments = segments if segments is not None and attention.installed(model) else None
        dtype = _compute_dtype(head, completion_ids_NT.device)
        if apart is not None:  # each sequence whole, and no mask: the layers with state take them apart
            share_prompts, segments = None, None
        packed = pack_for_forward(batch, share_prompts, row_tokens, dtype, segments)
        inputs = {
            "input_ids": packed.input_ids,
            "position_ids": packed.position_ids,
            "attention_mask": packed.attention_mask,
        }
        if apart is not None:
            inputs[stateful.KWARG] = stateful.Sequences.of(packed.position_ids, packed.weights)
        index_K, target_K, weights = packed.index_K, packed.target_K, packed.weights
    else:
        width = batch["input_ids"].size(1)
        # Row i's logits at columns P - 1 … P + T - 2 predict its T completion tokens.
        index_K = (torch.arange(n)[:, None] * width + (width - t - 1) + torch.arange(t)[None, :]).flatten()
        index_K, target_K = index_K.to(completion_ids_NT.device), completion_ids_NT.flatten()
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")[: 3 if position_ids else 2]}
        inputs |= images
        weights = batch["attention_mask"]
    packed_rows = padding_free and not images
    if replay is not None:
        routes = batch.get("routed_experts")
        if routes is not None:
            source = packed.source if packed_rows else torch.arange(routes.size(0) * routes.size(1))
            routes = routes.flatten(0, 1)[source.clamp(min=0).to(routes.device)]
            routes[source < 0] = UNREAD
        replay.use(routes)
    if count_tokens is not None:
        count_tokens(packed.tokens if packed_rows else batch["input_ids"].numel())  # padded: padding included
    swap = _head_returns_logps(head, index_K, target_K, temperature, chunk_tokens, entropy, fp32_head, suppressed,
                               transform)  # fmt: skip
    counted = apart.counted() if apart is not None and packed_rows else nullcontext()
    with swap as left, router.recording(model) if router is not None else nullcontext([]) as routed, counted:
        out_K = model(**inputs, use_cache=False).logits  # [K], or [K, 2]: log-prob and entropy
    if replay is not None and not torch.is_grad_enabled():  # no backward will recompute a layer of this pass
        replay.use(None)
    if router is not None:
        router.finish(routed, weights)
    out_K = logit_transform.returned(out_K, left, transform, model)
    if packed_rows:
        out_K = out_K.new_zeros((n, t, *out_K.shape[1:])).index_put(packed.scatter, out_K)
    out_NT = out_K.view(n, t, -1)
    if entropy is None:
        return out_NT[..., 0]
    return out_NT[..., 0], out_NT[..., 1] if entropy == "grad" else out_NT[..., 1].detach()


def pack_for_forward(
    batch: dict[str, torch.Tensor],
    share_prompts: PromptSharing | float | None,
    row_tokens: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    segments: str | None = None,
) -> Packed:
    """`batch` packed for one forward pass: prompts shared where `share_prompts` says it applies (its additive
    mask in `compute_dtype`, the dtype of the attention's queries), else each sequence whole (`pack`); with
    `segments` (a `colograd.forward.attention.KERNELS` kernel) in one row, as segments instead of under a mask."""
    if segments is not None:
        row_tokens = int(batch["attention_mask"].sum())  # one row: the segments keep the sequences apart
    if share_prompts is None:
        return pack(batch, row_tokens, segments=segments)
    if not isinstance(share_prompts, PromptSharing):
        share_prompts = PromptSharing(share_prompts)
    plan = plan_shared(batch, share_prompts.attention_cost, row_tokens)
    if not share_prompts.applies(plan, row_tokens):
        return pack(batch, row_tokens, segments=segments)
    mask_dtype = compute_dtype if share_prompts.additive_mask and segments is None else None
    return pack_shared(
        batch, share_prompts.attention_cost, row_tokens, mask_dtype=mask_dtype, plan=plan, segments=segments
    )


def _compute_dtype(head: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the model's attention computes in on `device`: autocast's when it is on (it casts SDPA's inputs,
    a mask in another float dtype included, at every call), else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return head.weight.dtype


def check_fp32_head(head: nn.Module) -> None:
    """The output layer can compute in float32 (`cast_lm_head_to_fp32`): its base weights are used directly, so a
    LoRA adapter on it would be bypassed."""
    if isinstance(head, BaseTunerLayer):
        raise ConfigError(
            "cast_lm_head_to_fp32 with a LoRA adapter on the output layer: the adapter would be bypassed; remove "
            "lm_head from lora_target_modules, or set cast_lm_head_to_fp32: false."
        )


def _model_config(model: nn.Module) -> Any:
    """The model's config, seen through DDP / DeepSpeed (`.module`) wrappers (PEFT forwards it)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)


def _output_layer(model: nn.Module) -> nn.Module:
    """The model's output layer, seen through DDP / DeepSpeed (`.module`) and PEFT wrappers."""
    while not hasattr(model, "get_output_embeddings") and hasattr(model, "module"):
        model = model.module
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output layer (get_output_embeddings() is None).")
    return head


def _chunk_logps(
    forward,
    hidden_KH: torch.Tensor,
    target_K: torch.Tensor,
    temperature: float,
    entropy: str | None,
    suppressed: torch.Tensor | None = None,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """[K] log-probs of `target_K`, or [K, 2] log-probs and entropies, from one chunk's logits, transformed as the
    model's forward transforms them (`transform`, in float32), the `suppressed` ids' logits at a finite floor
    (probability 0, and 0 × logit stays 0 in the entropy)."""
    logits_KV = forward(hidden_KH).float()
    if transform:
        logits_KV = transform(logits_KV)
    logits_KV = logits_KV / temperature
    if suppressed is not None:
        logits_KV = logits_KV.index_fill(-1, suppressed, _NEVER)
    lse_K = logits_KV.logsumexp(-1)
    logps_K = logits_KV.gather(-1, target_K.unsqueeze(-1)).squeeze(-1) - lse_K
    if entropy is None:
        return logps_K
    if entropy == "grad":
        entropy_K = lse_K - (torch.softmax(logits_KV, -1) * logits_KV).sum(-1)
    else:
        # Computed last and without autograd, so a checkpoint's recomputation stops before it; in place, so it
        # costs one more [K, V] buffer.
        with torch.no_grad():
            entropy_K = lse_K - (logits_KV - lse_K[:, None]).exp_().mul_(logits_KV).sum(-1)
    return torch.stack([logps_K, entropy_K], -1)


# A logit no token is sampled at: exp(it - logsumexp) is 0 in float32.
_NEVER = -1e30


def _fp32_forward(head: nn.Module):
    """`head`'s linear map in float32, outside autocast: its weights are read (and upcast) at each call, so
    gathered (ZeRO-3) or updated weights are the ones used."""

    def forward(hidden_KH: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden_KH.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            return nn.functional.linear(hidden_KH.float(), head.weight.float(), bias)

    return forward


@contextmanager
def _head_returns_logps(
    head: nn.Module,
    index_K: torch.Tensor,
    target_K: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    entropy: str | None = None,
    fp32_head: bool = False,
    suppressed: list[int] | None = None,
    transform: LogitTransform | None = None,
) -> Iterator[list]:
    """While active, `head` maps the model's final hidden states [R, L, H] to the log-probs [K] of `target_K` at
    the flat positions `index_K` (with `entropy`, [K, 2]: log-probs and entropies), instead of to logits, the
    model's `transform` of its logits applied to each chunk; what the forward then does to them, the same transform,
    leaves them as they are. Yields the transform's operations the forward has yet to apply
    (`colograd.models.logit_transform.returned` checks). Hooks on `head` (DeepSpeed's gathers) still run."""
    forward = _fp32_forward(head) if fp32_head else head.forward
    own_forward = head.__dict__.get("forward")  # an instance-level forward (e.g. set by an accelerate hook)
    never = torch.tensor(suppressed, device=target_K.device) if suppressed else None
    transform = transform or LogitTransform()
    left: list = []

    def logps(hidden_RLH: torch.Tensor) -> torch.Tensor:
        hidden_KH = hidden_RLH.reshape(-1, hidden_RLH.size(-1))[index_K]
        parts = []
        for start in range(0, len(index_K), chunk_tokens):
            args = (forward, hidden_KH[start : start + chunk_tokens], target_K[start : start + chunk_tokens])
            if torch.is_grad_enabled():
                parts.append(
                    checkpoint(_chunk_logps, *args, temperature, entropy, never, transform, use_reentrant=False)
                )
            else:
                parts.append(_chunk_logps(*args, temperature, entropy, never, transform))
        empty = (0,) if entropy is None else (0, 2)
        out = torch.cat(parts) if parts else hidden_RLH.new_zeros(empty)
        return logit_transform.passthrough(out, transform, left)

    head.forward = logps
    try:
        yield left
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
