"""The trainer's forward pass: its settings decided once per run (`Forward.of`), then the log-probs of a rollout
slice under a model (`logps`) and a slice cut into passes that fit the token budget (`passes`).

The settings: whether the passes are packed at all (a model with layers that carry state along the sequence,
`colograd.models.hybrid`, only where each such layer can be given its sequences apart, `colograd.forward.stateful`:
else a packed sequence would start from the state its neighbour left), how padding-free passes are packed (the segment
kernel, a prompt shared by its completions: `colograd.forward.packing`), the pass token budget
(`colograd.forward.memory.PassBudget`), the tokens never scored (a vision-language model's image placeholders), whether
the model takes position ids, and a Mixture-of-Experts model's routers (`colograd.forward.router`).
"""

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colograd.config.core import GRPOConfig
from colograd.config.loading import compute_dtype
from colograd.forward import attention
from colograd.forward.batch import RolloutBatch, split_by_tokens
from colograd.forward.logps import PromptSharing, completion_logps
from colograd.forward.memory import PassBudget
from colograd.forward.packing import forward_packing, keeps_packed_sequences_apart
from colograd.forward.router import Router, RouterRecord, RoutingReplay
from colograd.forward.stateful import KWARG, Apart
from colograd.models.hybrid import (
    bound_time_steps_as_configured,
    carries_state,
    normalize_groups_as_configured,
    state_layer_count,
    state_layer_kinds,
)
from colograd.vision.core import placeholder_ids, takes_position_ids

logger = logging.getLogger("colograd.trainer")


@dataclass
class Forward:
    """How the trainer runs its model over a rollout slice.

    args: the run's config (temperature, packing, chunking, the fp32 head, `micro_batch_tokens`).
    packed: the passes run padding-free (`padding_free`, unless the model carries state along the sequence and its
        layers with state cannot be given their sequences apart).
    segments: the segment-attention kernel packed passes use, or None (packed under a mask, or padded).
    prompt_cost: how a pass shares a prompt among its completions (`PromptSharing`), or None (no sharing).
    suppressed: token ids never scored (a vision-language model's image placeholders).
    position_ids: whether the model takes position ids.
    router: a Mixture-of-Experts model's routers, recorded in a training pass (TRL's load-balancing loss), or None.
    replay: routing replay (`routing_replay: rollout`), installed on the policy and the reference, or None.
    budget: the per-pass token budget derived on a GPU when `micro_batch_tokens` is unset, or None.
    apart: a model with layers that carry state, packed: the hooks that give those layers their sequences apart
        (`colograd.forward.stateful`), or None.
    """

    args: GRPOConfig
    packed: bool = True
    segments: str | None = None
    prompt_cost: PromptSharing | None = None
    suppressed: list[int] = field(default_factory=list)
    position_ids: bool = True
    router: Router | None = None
    budget: PassBudget | None = None
    replay: RoutingReplay | None = None
    apart: Apart | None = None

    def __post_init__(self) -> None:
        self.packed = self.packed and self.args.padding_free

    @classmethod
    def of(
        cls,
        nets: list[nn.Module | None],
        args: GRPOConfig,
        processing_class: Any,
        router: Router | None = None,
        deepspeed: bool = False,
        announce: bool = False,
        engine_state: bool = False,
    ) -> "Forward":
        """The settings for the policy `nets[0]` (and the reference's copy, `nets[1]`, if any), decided once: their
        soft-capped attention scores soft-capped as the engine does, their packing probed.

        Args:
            deepspeed: DeepSpeed trains the model (no pass budget: it counts every pass as a micro-step).
            announce: print the pass budget when it is derived (the main process).
            engine_state: the engine's cache holds state pages (`Engine.holds_state`): the model carries state
                along the sequence even where its config lists no such layers.
        """
        policy = nets[0]
        attention.honour_softcaps(nets)
        for net in nets:
            changed, before, limit = bound_time_steps_as_configured(net) if net is not None else (0, None, None)
            if changed and announce and net is policy:
                logger.warning(
                    "colograd: note: the model's %d Mamba-2 layers bound their time step by %s, as the engine's do "
                    "(the config's time_step_limit, else vLLM's), where transformers' forward bounds it by %s.",
                    changed, limit, before,
                )  # fmt: skip
            grouped = normalize_groups_as_configured(net) if net is not None else 0
            if grouped and announce and net is policy:
                logger.warning(
                    "colograd: note: the model's %d Mamba-2 layers normalize their output in groups of channels "
                    "(n_groups), as the engine's and the published layer do, where transformers' torch path "
                    "normalizes the whole width.",
                    grouped,
                )
        takes_positions = takes_position_ids(policy.config)
        stateful = carries_state(policy.config) or engine_state
        apart = packed_apart(nets, policy) if args.padding_free and stateful and takes_positions else None
        packed = args.padding_free and (not stateful or apart is not None)
        if apart is not None and announce:
            logger.warning(
                "colograd: the model's %s layers carry state along the sequence: the trainer's passes run packed, "
                "each of those layers computing its sequences apart (padded within the layer; exact), and a prompt is "
                "not shared by its completions.",
                ", ".join(state_layer_kinds(policy.config.get_text_config())),
            )
        if packed and apart is None and takes_positions and not keeps_packed_sequences_apart(policy):
            packed = False
            if announce:
                logger.warning(
                    "colograd: %s's forward lets sequences packed in one row attend to each other (its mask is built "
                    "without the position ids): the trainer's passes run padded (exact; padding_free is set aside).",
                    type(policy).__name__,
                )
        elif args.padding_free and not packed and announce:
            kinds = ", ".join(state_layer_kinds(policy.config.get_text_config())) or "(state pages in the engine)"
            logger.warning(
                "colograd: the model's %s layers carry state along the sequence, which packing would pass from one "
                "sequence to the next: the trainer's passes run padded (exact; padding_free is set aside).",
                kinds,
            )
        packing = (None, None)
        if packed and apart is None:
            packing = forward_packing(nets, args, compute_dtype(policy, args.mixed_precision))
        budget = PassBudget(policy, args, deepspeed, announce)
        suppressed, position_ids = placeholder_ids(processing_class), takes_positions
        replay = RoutingReplay(router, nets) if args.routing_replay == "rollout" and router is not None else None
        if replay is not None and not deepspeed:  # ZeRO-3's routers hold no weights outside its forward
            replay.probe(policy)
        return cls(args, packed, *packing, suppressed, position_ids, router, budget, replay, apart)

    def logps(
        self,
        model: nn.Module,
        batch: RolloutBatch,
        entropy: str | None = None,
        count_tokens: Callable[[int], None] | None = None,
        router: RouterRecord | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the completion tokens under `model` at the sampling temperature, [N, T], and with `entropy`
        ("detached" / "grad") each position's entropy (`colograd.forward.logps.completion_logps`); `count_tokens` gets
        the tokens computed, `router` records the routers in the pass."""
        args = self.args
        return completion_logps(
            model,
            batch,
            temperature=args.temperature,
            padding_free=self.packed,
            row_tokens=args.packed_row_tokens,
            chunk_tokens=args.logps_chunk_tokens,
            entropy=entropy,
            fp32_head=args.cast_lm_head_to_fp32,
            share_prompts=self.prompt_cost,
            count_tokens=count_tokens,
            segments=self.segments,
            suppressed=self.suppressed,
            position_ids=self.position_ids,
            router=router,
            replay=self.replay,
            apart=self.apart,
        )

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around a slice's passes and their backward: PyTorch's deterministic kernels on a CPU
        (`deterministic_kernels`), and the routing replay that the passes set (a layer recomputed in the backward,
        gradient checkpointing, routes as its forward did) cleared after, so that no other forward of the model
        replays it."""
        cleared = self.replay.cleared() if self.replay is not None else nullcontext()
        with deterministic_kernels(self.args.device), cleared:
            yield

    def passes(
        self, model: nn.Module, batch: RolloutBatch, optimizer: torch.optim.Optimizer | None
    ) -> list[RolloutBatch] | None:
        """`batch` cut into passes of at most `micro_batch_tokens` tokens (or the budget derived from free memory
        on a GPU), each with its `loss_scale`; None where a slice trains in one pass."""
        args = self.args
        max_tokens = args.micro_batch_tokens or (self.budget.tokens(model, optimizer) if self.budget else None)
        if max_tokens is None:
            return None
        row_tokens = None if self.segments else args.packed_row_tokens  # segments: a pass is one row
        return split_by_tokens(batch, max_tokens, args.loss_type, self.prompt_cost, row_tokens)


@contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[None]:
    """PyTorch's deterministic algorithms while a CPU trainer computes (`torch.use_deterministic_algorithms`, only
    warning where an operation has none), the setting before restored after.

    Without them a Mixture-of-Experts model's backward is not the same twice on the same batch: its experts gather each
    token once per expert it is routed to (`hidden_states[index]` in transformers' experts), and that gather's
    backward adds the copies' gradients on several threads at once, in whatever order they finish (bits apart at each
    step: Qwen3-MoE, Qwen3.5-MoE, OLMoE, DeepSeek-V2, GLM-4.5, gpt-oss, Granite-4.0-H, LFM2-MoE). A run resumed from a
    checkpoint then parts from the uninterrupted one at the first near-tie it samples. The deterministic kernel sums
    them in index order. On a GPU the setting would also constrain cuBLAS and the attention kernels, whose runs are
    not bit-reproducible anyway: left as the user set it.

    The setting's other effect, filling every new tensor with NaN before its first write
    (`torch.utils.deterministic.fill_uninitialized_memory`), is a debugging aid that changes no result a kernel
    computes: it stays off while these kernels run (it cost 6% of a shrunk Qwen3.5's training phase)."""
    if device.type != "cpu":
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


def packed_apart(nets: list[nn.Module | None], policy: nn.Module) -> Apart | None:
    """The hooks that let a model with layers that carry state train packed (`colograd.forward.stateful`), on the
    policy and the reference's copy, or None where it must train padded: the layers found are not every one its
    config lists with state, or, given the layout, its packed sequences still reach each other (a family whose
    decoder layers do not hand the layout on to those layers)."""
    text = policy.config.get_text_config()
    apart = Apart(*[net for net in nets if net is not None])
    if not apart.layers or len(apart.layers) != state_layer_count(text) * len([n for n in nets if n is not None]):
        apart.remove()
        return None
    before = apart.calls
    if not keeps_packed_sequences_apart(policy, KWARG) or apart.calls - before < apart.per_model:
        apart.remove()
        return None
    return apart
