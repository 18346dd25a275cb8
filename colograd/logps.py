"""Log-probs of completion tokens under a causal LM: padded or packed (padding-free), output layer in chunks.

A rollout is stored padded (see `colograd.batch`): N rows of P prompt tokens (left-padded) and T completion
tokens (right-padded). The forward pass can run on those rows as they are, or on the same sequences packed
end to end (`pack`): no padding is computed, and the position ids restart at 0 for each sequence, which is how
transformers' attention masks tell packed sequences apart. Either way the result is [N, T], the log-prob of
each completion token at the sampling temperature (0 where there is no token).

The output layer never produces the whole [tokens × vocabulary] logit matrix: for the duration of the forward
pass it is swapped for one that computes the log-probs of the wanted tokens a chunk at a time, and that, when
gradients are needed, recomputes each chunk's logits in the backward pass instead of keeping them.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.utils.checkpoint import checkpoint

from colograd.errors import ConfigError


@dataclass
class Packed:
    """Sequences packed into rows for one forward pass.

    input_ids, position_ids: [R, L]; each row holds whole sequences end to end, then padding.
    index_K: for each wanted completion token k, the flat position ([R × L]) whose logits predict it.
    target_K: the wanted token ids.
    scatter: (rows, columns) of each wanted token in the [N, T] result.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index_K: torch.Tensor
    target_K: torch.Tensor
    scatter: tuple[torch.Tensor, torch.Tensor]


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


def pack(batch: dict[str, torch.Tensor], row_tokens: int | None = None, pad_token_id: int = 0) -> Packed:
    """The padded rollout rows of `batch` (input_ids, attention_mask, completion_ids) packed without padding.

    Vectorised: one host sync (the lengths, to plan the rows), then a scatter of every real token to its place.
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
    # Completion token j of a sequence is predicted by the logits at the token before it.
    column_T = pos_T - prompt_len_N[seq_T]
    wanted = column_T >= 0
    rows_K, cols_K = seq_T[wanted], column_T[wanted]
    return Packed(
        ids.view(len(rows), width),
        positions.view(len(rows), width),
        dest_T[wanted] - 1,
        batch["completion_ids"][rows_K, cols_K],
        (rows_K, cols_K),
    )


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `batch`'s completion tokens under `model` at `temperature`: [N, T], 0 where there is no token.

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

    Returns:
        logps_NT; with `entropy`, (logps_NT, entropy_NT). Only the completion tokens' values are meaningful.
    """
    head = head if head is not None else _output_layer(model)
    if fp32_head:
        check_fp32_head(head)
    completion_ids_NT = batch["completion_ids"]
    n, t = completion_ids_NT.shape
    if padding_free:
        packed = pack(batch, row_tokens)
        inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "attention_mask": None}
        index_K, target_K = packed.index_K, packed.target_K
    else:
        width = batch["input_ids"].size(1)
        # Row i's logits at columns P - 1 … P + T - 2 predict its T completion tokens.
        index_K = (torch.arange(n)[:, None] * width + (width - t - 1) + torch.arange(t)[None, :]).flatten()
        index_K, target_K = index_K.to(completion_ids_NT.device), completion_ids_NT.flatten()
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with _head_returns_logps(head, index_K, target_K, temperature, chunk_tokens, entropy, fp32_head):
        out_K = model(**inputs, use_cache=False).logits  # [K], or [K, 2]: log-prob and entropy
    if padding_free:
        out_K = out_K.new_zeros((n, t, *out_K.shape[1:])).index_put(packed.scatter, out_K)
    out_NT = out_K.view(n, t, -1)
    if entropy is None:
        return out_NT[..., 0]
    return out_NT[..., 0], out_NT[..., 1] if entropy == "grad" else out_NT[..., 1].detach()


def check_fp32_head(head: nn.Module) -> None:
    """The output layer can compute in float32 (`cast_lm_head_to_fp32`): its base weights are used directly, so a
    LoRA adapter on it would be bypassed."""
    if isinstance(head, BaseTunerLayer):
        raise ConfigError(
            "cast_lm_head_to_fp32 with a LoRA adapter on the output layer: the adapter would be bypassed; remove "
            "lm_head from lora_target_modules, or set cast_lm_head_to_fp32: false."
        )


def _output_layer(model: nn.Module) -> nn.Module:
    """The model's output layer, seen through DDP / DeepSpeed (`.module`) and PEFT wrappers."""
    while not hasattr(model, "get_output_embeddings") and hasattr(model, "module"):
        model = model.module
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output layer (get_output_embeddings() is None).")
    return head


def _chunk_logps(
    forward, hidden_KH: torch.Tensor, target_K: torch.Tensor, temperature: float, entropy: str | None
) -> torch.Tensor:
    """[K] log-probs of `target_K`, or [K, 2] log-probs and entropies, from one chunk's logits."""
    logits_KV = forward(hidden_KH).float() / temperature
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
) -> Iterator[None]:
    """While active, `head` maps the model's final hidden states [R, L, H] to the log-probs [K] of `target_K` at
    the flat positions `index_K` (with `entropy`, [K, 2]: log-probs and entropies), instead of to logits. Hooks on
    `head` (DeepSpeed's gathers) still run."""
    forward = _fp32_forward(head) if fp32_head else head.forward
    own_forward = head.__dict__.get("forward")  # an instance-level forward (e.g. set by an accelerate hook)

    def logps(hidden_RLH: torch.Tensor) -> torch.Tensor:
        hidden_KH = hidden_RLH.reshape(-1, hidden_RLH.size(-1))[index_K]
        parts = []
        for start in range(0, len(index_K), chunk_tokens):
            args = (forward, hidden_KH[start : start + chunk_tokens], target_K[start : start + chunk_tokens])
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_logps, *args, temperature, entropy, use_reentrant=False))
            else:
                parts.append(_chunk_logps(*args, temperature, entropy))
        empty = (0,) if entropy is None else (0, 2)
        return torch.cat(parts) if parts else hidden_RLH.new_zeros(empty)

    head.forward = logps
    try:
        yield
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
