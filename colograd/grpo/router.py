"""A Mixture-of-Experts router's load-balancing loss, added to the GRPO loss as TRL adds it, and the experts' load.

TRL 1.16's rule: `router_aux_loss_coef` unset takes the model config's own coefficient (0 when it declares none);
the loss is on when the config has `output_router_logits` and the coefficient is not 0; each training forward
adds coefficient × the model's load-balancing loss to the GRPO loss (so gradient accumulation divides both alike)
and logs the loss as `aux_loss`. A coefficient set for a model without router logits is refused.

colograd packs sequences, and shares prompts, in its forward passes, where the model's own computation of the loss
(which reads the attention mask as [batch, length]) does not apply. So the routers' outputs are recorded where
transformers records them (the model's `_can_record_outputs["router_logits"]`), and the model family's own
`load_balancing_loss_func` is called on them with each position weighted by the sequences it stands for: padding 0,
a shared prompt's token once per completion that shares it. That is the loss TRL computes on the same sequences,
padded.

The experts' load, logged for every MoE model: each expert's share of a layer's top-k assignments as a multiple of
the even share 1/E, its largest (`moe/expert_load/max`: E when one expert takes every token) and smallest
(`moe/expert_load/min`: 0 when an expert gets none) over layers and experts, so that a collapsing router shows.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from colograd.errors import ConfigError


@dataclass(frozen=True)
class Router:
    """How to read a model's routers: the module class whose output `index` is a layer's router logits, the
    experts (`num_experts`, `top_k`), and the loss (`coef` × `loss_func`; `coef` 0: no loss, the load only)."""

    router_class: type
    index: int
    num_experts: int
    top_k: int
    coef: float
    loss_func: Callable | None


def router_of(model: nn.Module, coef: float | None) -> Router | None:
    """The routers of `model` (its `router_aux_loss_coef` setting `coef`, TRL's), or None for a dense model.

    Raises:
        ConfigError: `coef` is set on a model without router logits, or the loss is on for a model whose
            transformers code has no load-balancing loss.
    """
    text_config = model.config.get_text_config()
    name = type(model).__name__
    if coef and not hasattr(text_config, "output_router_logits"):
        raise ConfigError(
            f"router_aux_loss_coef is {coef} but {name} is not a Mixture-of-Experts model that returns its router "
            "logits, so there is no load-balancing loss to weight; remove router_aux_loss_coef."
        )
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    recorder = next(
        (
            spec["router_logits"]
            for module in model.modules()
            if "router_logits" in (spec := getattr(module, "_can_record_outputs", None) or {})
        ),
        None,
    )
    if recorder is None or not hasattr(text_config, "output_router_logits"):
        return None
    # The family's model class holds the experts as its forward passes them to its own loss function.
    owner = next(
        (
            m
            for m in model.modules()
            if hasattr(m, "num_experts_per_tok")
            and hasattr(sys.modules[type(m).__module__], "load_balancing_loss_func")
        ),
        None,
    )
    if owner is not None:
        loss_func = sys.modules[type(owner).__module__].load_balancing_loss_func
        num_experts, top_k = owner.num_experts, owner.num_experts_per_tok
    else:  # no loss in transformers' code (DeepSeek-V2): the load only, from the config
        loss_func, top_k = None, getattr(text_config, "num_experts_per_tok", None)
        num_experts = next(
            (getattr(text_config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
             if getattr(text_config, key, None)),
            None,
        )  # fmt: skip
    if coef and loss_func is None:
        raise ConfigError(
            f"router_aux_loss_coef is {coef} but transformers' {name} has no load-balancing loss to add; set "
            "router_aux_loss_coef: 0."
        )
    if not num_experts or not top_k:
        return None
    return Router(recorder.target_class, recorder.index, int(num_experts), int(top_k), float(coef), loss_func)


class RouterRecord:
    """What the routers did in one forward pass (`colograd.grpo.logps.completion_logps` fills it)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.aux_loss: torch.Tensor | None = None  # the family's load-balancing loss (with grad), when `coef` ≠ 0
        self.load_LE: torch.Tensor | None = None  # each layer's expert shares × E, detached

    @contextmanager
    def recording(self, model: nn.Module) -> Iterator[list[torch.Tensor]]:
        """While active, each router of `model` appends its logits ([tokens, E]) to the yielded list."""
        logits: list[torch.Tensor] = []
        index = self.router.index

        def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            logits.append(output[index] if isinstance(output, tuple) else output)

        handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, self.router.router_class)]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()

    def finish(self, logits: list[torch.Tensor], weights: torch.Tensor) -> None:
        """The loss and the load from the recorded `logits`, each position weighted by `weights` (the forward's
        input shape: the sequences a position stands for, 0 for padding)."""
        router = self.router
        if not logits:
            return
        if router.coef:
            self.aux_loss = router.loss_func(tuple(logits), router.num_experts, router.top_k, weights)
        with torch.no_grad():
            # Each top-k assignment weighs as its position does; every layer routes the same positions.
            per_choice = weights.reshape(-1).float().to(logits[0].device).repeat_interleave(router.top_k)
            load = []
            for layer in logits:
                chosen = layer.float().topk(router.top_k, dim=-1).indices  # [tokens, k]
                counts = torch.zeros(router.num_experts, device=layer.device).index_add_(
                    0, chosen.flatten(), per_choice.to(layer.device)
                )
                load.append(counts * router.num_experts / counts.sum().clamp(min=1e-12))
            self.load_LE = torch.stack(load)

    def loss(self) -> torch.Tensor | float:
        """What the GRPO loss adds: `coef` × the load-balancing loss (0 when off)."""
        return self.router.coef * self.aux_loss if self.aux_loss is not None else 0.0

    def metrics(self) -> dict[str, float]:
        """`aux_loss` (TRL's name, when the loss is on) and the experts' load, largest and smallest."""
        out = {}
        if self.aux_loss is not None:
            out["aux_loss"] = self.aux_loss.item()
        if self.load_LE is not None:
            out["moe/expert_load/max"] = self.load_LE.max().item()
            out["moe/expert_load/min"] = self.load_LE.min().item()
        return out


# --- routing replay: the trainer's routers made to pick given experts -------------------------------------------
