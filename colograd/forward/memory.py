"""Training memory on a GPU: how many tokens one forward + backward pass can hold, and each phase's peak.

A pass keeps each layer's activations until its backward reaches that layer, so its memory grows with its tokens.
When `micro_batch_tokens` is unset, `PassBudget` derives a budget for it on a GPU from the memory free at the
first pass (minus what training is still to allocate: gradients, optimizer state, autocast's weight copies) and
an estimate of the activation bytes per token from the model's config (`activation_bytes_per_token`).
"""

from typing import Any

import torch
from torch import nn

from colograd.config.loading import compute_dtype

# Share of the memory left for activations that passes may plan to use: the rest absorbs the allocator's
# fragmentation and what the estimate leaves out (temporaries of the backward pass, a shared prompt's mask).
HEADROOM = 0.8


def activation_bytes_per_token(config: Any, compute_bytes: int, residual_bytes: int) -> int:
    """Bytes a decoder-only transformer's forward keeps per token for the backward pass.

    Per layer: the MLP's four intermediate-size vectors (gate, up, the activation, their product) and about nine
    hidden-size vectors (the inputs of the projections, queries, rotated queries and keys, the attention's output
    and what SDPA saves) in the compute dtype, and four hidden-size vectors of the norms in the residual stream's
    dtype (the weights'); outside the layers four more (embeddings, final norm, the output layer's input).
    Measured by saved-tensor hooks (CPU, Qwen2-1.5B layer shapes), per token and layer: 116 KiB under bf16
    autocast with float32 weights (this rule: 121), 101 in bf16 (109), 190 in float32 (218); ~104 on an H100.

    Args:
        config: the model's text config: hidden_size, num_hidden_layers, intermediate_size (4 × hidden if absent;
            one per layer where the config lists them, as Gemma-3n's does).
        compute_bytes: bytes per element of the compute dtype (2 under bf16 autocast).
        residual_bytes: bytes per element of the weights' dtype.
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    inners = list(inner) if isinstance(inner, (list, tuple)) else [inner] * layers
    in_layers = sum(4 * width + 9 * hidden for width in inners) * compute_bytes + layers * 4 * hidden * residual_bytes
    return in_layers + 4 * hidden * residual_bytes


def output_layer_bytes(vocab_size: int, chunk_tokens: int) -> int:
    """The output layer's peak in the backward pass, whatever the pass's length: one chunk's float32 logits,
    their softmax and its gradient (`logps_chunk_tokens` at a time)."""
    return 3 * chunk_tokens * vocab_size * 4


def pending_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, autocast: torch.dtype | None) -> int:
    """GPU memory training will still allocate beyond activations: a gradient for each trainable parameter that
    has none yet, two state tensors each (Adam's moments) where the optimizer holds none yet, and under autocast a
    copy of each trainable weight in its dtype (kept for the whole forward + backward)."""
    state = optimizer.state if optimizer is not None else {}
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        size = p.numel() * p.element_size()
        total += size if p.grad is None else 0
        total += 2 * size if not state.get(p) else 0
        total += p.numel() * autocast.itemsize if autocast is not None and autocast != p.dtype else 0
    return total


def pass_token_budget(free_bytes: int, reserved_bytes: int, bytes_per_token: int, headroom: float = HEADROOM) -> int:
    """Tokens one forward + backward pass may hold: `headroom` of the memory free once `reserved_bytes` are
    allocated, over the activation bytes per token; at least 1 (a sequence longer than the budget gets a pass
    of its own)."""
    return max(1, int(headroom * (free_bytes - reserved_bytes)) // bytes_per_token)


def free_bytes(device: torch.device) -> int:
    """Memory a new tensor can take on `device`: the device's free memory and what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class PassBudget:
    """The per-pass token budget when `micro_batch_tokens` is unset: derived once, at the first pass, on a GPU.

    Args:
        model: the (unwrapped) model, for its config and dtypes.
        args: the run's `GRPOConfig`.
        deepspeed: whether DeepSpeed trains the model: it counts every backward pass as a micro-step, so no budget.
        announce: print the budget when derived (the main process).

    A budget is derived on a GPU with padding_free (a padded pass computes its padding too) and without the
    entropy terms, whose quantile and mean are taken over a micro-step's tokens (as `micro_batch_tokens` is
    refused with them).
    """

    def __init__(self, model: nn.Module, args: Any, deepspeed: bool = False, announce: bool = False) -> None:
        config = model.config.get_text_config()
        compute, weights = compute_dtype(model, args.mixed_precision), next(model.parameters()).dtype
        self.autocast = compute if compute != weights else None
        self.per_token = activation_bytes_per_token(config, compute.itemsize, weights.itemsize)
        self.head_bytes = output_layer_bytes(config.vocab_size, args.logps_chunk_tokens)
        self.device = args.device
        entropy_terms = args.top_entropy_quantile < 1.0 or args.entropy_coef != 0.0 or args.use_adaptive_entropy
        self.enabled = self.device.type == "cuda" and args.padding_free and not deepspeed and not entropy_terms
        self.announce = announce
        self._tokens: int | None = None

    def tokens(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int | None:
        """The budget (None where none is derived), computed at the first call: call it before the first pass,
        with the model as trained (wrapped or not) and its optimizer."""
        if not self.enabled:
            return None
        if self._tokens is None:
            free, reserved = free_bytes(self.device), pending_bytes(model, optimizer, self.autocast) + self.head_bytes
            self._tokens = pass_token_budget(free, reserved, self.per_token)
            if self.announce:
                print(
                    f"colograd: training passes of at most {self._tokens:,} tokens ({free / 2**30:.1f} GiB free, "
                    f"{reserved / 2**30:.1f} GiB still to allocate, ~{self.per_token / 2**20:.2f} MiB of "
                    "activations per token); set micro_batch_tokens to choose.",
                    flush=True,
                )
        return self._tokens
