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
from typing import Any

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
    # The family's loss function sits in its modeling module. The experts and top-k it is given: as the family's
    # causal LM holds them, else (the vision-language classes read them from the text config) from the config.
    family = next(
        (
            module
            for m in model.modules()
            if hasattr(module := sys.modules[type(m).__module__], "load_balancing_loss_func")
        ),
        None,
    )
    loss_func = family.load_balancing_loss_func if family is not None else None
    owner = next(
        (
            m
            for m in model.modules()
            if hasattr(m, "num_experts_per_tok") and sys.modules[type(m).__module__] is family
        ),
        None,
    )
    if owner is not None:
        num_experts, top_k = owner.num_experts, owner.num_experts_per_tok
    else:  # no loss in transformers' code (DeepSeek-V2), or a vision-language class: the config's
        top_k = getattr(text_config, "num_experts_per_tok", None)
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
    """What the routers did in one forward pass (`colograd.forward.logps.completion_logps` fills it)."""

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


def check_replay(args: Any, router: Router | None, model: nn.Module, rollout_func: bool) -> None:
    """Refuse `routing_replay` where it cannot apply: a dense model, or a `rollout_func` (its generation is the
    user's: no engine routing is recorded)."""
    if args.routing_replay == "off":
        return
    if router is None:
        raise ConfigError(
            f"routing_replay={args.routing_replay!r} but {type(model).__name__} is not a Mixture-of-Experts model "
            "with routers to replay; set routing_replay: off."
        )
    if rollout_func:
        raise ConfigError(
            "routing_replay=rollout with a rollout_func: the function generates, so the engine's routing of its "
            "completions is not recorded; set routing_replay: off."
        )


# The routes of a position whose routing nothing reads: padding, and a sequence's last token (no loss reads its output
# and no token attends to it). -1: a token the engine did not route, which the trainer then routes itself.
UNREAD = -2


class RoutingReplay:
    """Routing replay, the trainer's half (`routing_replay: rollout`): while a pass's routing is set (`use`), each
    router of the models it is installed on picks, for every token, the experts the engine's router chose for it
    (`colograd.engine.routing`), and routes the token itself where the engine reported none.

    A router is a module of the family's router class (`Router.router_class`); the l-th of a model, in the model's
    order, replays the engine's l-th MoE layer. While it runs, the top-k it takes over its experts (`torch.topk` or
    `Tensor.topk` on [tokens, E]) is answered with the given experts and the router's own scores of them, so that the
    rest of the family's routing (softmax, renormalisation, scaling) runs as written and the scores keep their
    gradient; a top-k over expert groups (DeepSeek's group-limited routing) is answered with the groups that hold the
    given experts first. A router that runs without such a top-k cannot be replayed, and stops the pass.

    A pass without gradients clears the routing at its end. One with gradients leaves it set until its slice's
    backward is done (`cleared`, around the slice): a layer recomputed in the backward (gradient checkpointing)
    routes as it did in the forward.
    """

    def __init__(self, router: Router, nets: list[nn.Module | None]) -> None:
        self.router = router
        self.routes: torch.Tensor | None = None  # [tokens, layers, k] long, -1 where not given
        self.counts = torch.zeros(3, dtype=torch.float64)  # routed choices, differed, unreplayed (since `take`)
        self._layer: dict[nn.Module, int] = {}
        self._handles = []
        self.layers = 0  # the policy's routers, one per MoE layer
        for net in nets:
            if net is None:
                continue
            routers = [m for m in net.modules() if isinstance(m, router.router_class)]
            self.layers = self.layers or len(routers)
            for index, module in enumerate(routers):
                self._layer[module] = index
                self._handles.append(module.register_forward_pre_hook(self._before))
                self._handles.append(module.register_forward_hook(self._after, always_call=True))
        self._answered = 0
        self._real = (torch.topk, torch.Tensor.topk)

    def use(self, routes: torch.Tensor | None) -> None:
        """Route the next passes by `routes` ([tokens of the pass, layers, k], in the order the model flattens its
        input; -1 where the trainer routes a token itself, `UNREAD` where nothing reads the routing), or by the
        trainer's own routers (None)."""
        if routes is not None and routes.size(1) != self.layers:
            raise ValueError(
                f"routing_replay: the engine routed {routes.size(1)} MoE layers and the trainer's model has "
                f"{self.layers} routers, so their layers cannot be matched; set routing_replay: off."
            )
        self.routes = None if routes is None else routes.long()

    def probe(self, model: nn.Module) -> None:
        """Run the first router of `model` once on a few random tokens with given experts, so that a family whose
        routing cannot be replayed is refused at set-up rather than at its first pass (a router that takes other
        inputs than the hidden states is left to that first pass).

        Raises:
            ConfigError: the router chose its experts without a top-k the replay answers.
        """
        module = next((m for m in model.modules() if m in self._layer), None)
        weight = next(module.parameters(), None) if module is not None else None
        if weight is None:
            return
        hidden = torch.randn(4, model.config.get_text_config().hidden_size, dtype=weight.dtype, device=weight.device)
        given = torch.arange(self.router.top_k).expand(4, self.layers, -1)
        self.use(given)
        try:
            with torch.no_grad():
                module(hidden)
        except ValueError as error:
            if "routing_replay" in str(error):
                raise ConfigError(str(error)) from None
        except (TypeError, RuntimeError):
            pass  # another signature: the first pass checks
        finally:
            self.use(None)
            self.counts.zero_()

    @contextmanager
    def cleared(self) -> Iterator[None]:
        """The block's passes may set routing; after it (however it ends) the routers route by themselves again."""
        try:
            yield
        finally:
            self.routes = None

    def take(self) -> dict[str, float]:
        """The share of routing choices since the last `take` that the trainer's own routers would have made
        otherwise (`differed`) and that the engine did not report (`unreplayed`), over the positions whose routing is
        read (not `UNREAD`)."""
        total, differed, unreplayed = self.counts.tolist()
        self.counts.zero_()
        if not total:
            return {}
        return {"moe/routing_replay/differed": differed / total, "moe/routing_replay/unreplayed": unreplayed / total}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, module: nn.Module, args: tuple) -> None:
        if self.routes is None:
            return
        given = self.routes[:, self._layer[module]]
        self._answered = 0
        torch.topk = lambda *a, **k: self._topk(given, *a, **k)
        torch.Tensor.topk = lambda *a, **k: self._topk(given, *a, **k)

    def _after(self, module: nn.Module, args: tuple, output: object) -> None:
        torch.topk, torch.Tensor.topk = self._real
        if self.routes is not None and not self._answered:
            raise ValueError(
                f"routing_replay: {type(module).__name__} chose its experts without a top-k over its "
                f"{self.router.num_experts} experts, so its routing cannot be replayed; set routing_replay: off."
            )

    def _topk(self, given: torch.Tensor, input: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
              sorted: bool = True) -> torch.return_types.topk:  # fmt: skip
        own = self._real[0](input, k, dim, largest, sorted)
        experts = self.router.num_experts
        if input.dim() != 2 or dim not in (-1, 1) or not largest or input.size(0) != given.size(0):
            return own
        given = given.to(input.device)
        known = given[:, :1] >= 0  # a position is given all of its experts or none
        if input.size(1) == experts and k == given.size(1):
            chosen = torch.where(known, given, own.indices)
            with torch.no_grad():
                routed = given[:, 0] != UNREAD
                differs = (own.indices.sort(-1).values != chosen.sort(-1).values).any(-1)
                counts = torch.stack([routed.sum(), differs.sum(), (routed & ~known[:, 0]).sum()])
                self.counts = counts.double() + self.counts.to(counts.device)
            self._answered += 1
            return torch.return_types.topk((input.gather(-1, chosen), chosen))
        if experts % input.size(1) == 0 and input.size(1) < experts:  # expert groups: the given experts' first
            holds = torch.zeros_like(input, dtype=torch.bool)
            holds.scatter_(1, given.clamp(min=0) // (experts // input.size(1)), True)
            first = self._real[0](input.masked_fill(holds & known, float("inf")), k, dim, largest, sorted).indices
            return torch.return_types.topk((input.gather(-1, first), first))
        return own
