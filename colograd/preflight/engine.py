"""Preflight's engine stage: what the engine would refuse at start-up or at its first request, found before it
starts, by vLLM's own code where it has a check to run (see `colograd.preflight.core`).

vLLM is imported inside the functions: `colograd.engine.core` sets the environment vLLM reads at import.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PretrainedConfig

from colograd.config.core import ConfigError, GRPOConfig
from colograd.data.core import first_line
from colograd.engine.hybrid import cpu_dtype, cpu_refusal, cpu_without_prefix_caching, state_layers, unserved
from colograd.engine.kv_cache import uses_mla
from colograd.engine.lifetime import import_off_stack
from colograd.engine.lora import engine_max_lora_rank
from colograd.engine.moe import expert_count
from colograd.engine.requests import sampling_params
from colograd.engine.settings import engine_dtype as engine_dtype_of


def check_engine(
    args: GRPOConfig,
    model_config: PretrainedConfig,
    dtype: torch.dtype,
    lora_rank: int | None = None,
    architecture: str | None = None,
) -> None:
    """What the engine would refuse at start-up or at its first request, found by vLLM's own code where it has a
    check to run: the model's kind (layers with state the engine here can run, and in which dtype; experts its sync
    can write), the sampling settings, the LoRA settings, the dtype and the attention head size.

    `architecture`: the name vLLM picks its model class by (default: the config's first `architectures` entry)."""
    architecture = architecture or next(iter(getattr(model_config, "architectures", None) or []), None)
    with _quiet_logs():
        layers = state_layers(architecture, model_config.get_text_config()) if architecture else []
        missing = unserved(architecture, model_config.get_text_config()) if architecture else None
    if missing is not None:
        model_type = getattr(model_config.get_text_config(), "model_type", None)
        raise ConfigError(
            f"model_type {model_type!r} has {missing}: train a hybrid vLLM builds itself (docs/real-models.md lists "
            "the ones that train), or use a vLLM release that has it."
        )
    _check_layers(args, model_config, layers, lora_rank)
    _check_experts(model_config, torch.cuda.is_available())
    if args.temperature <= 0:
        raise ConfigError(
            f"temperature={args.temperature}: GRPO samples several completions per prompt and divides log-probs by "
            "the temperature; set it above 0 (1.0 samples from the model as it is)."
        )
    with _quiet_logs():  # vLLM's import-time warnings (no Triton on CPU, ...) would add lines to a one-line error
        import_off_stack("vllm.config", "vllm.sampling_params")  # (its first import logs platform warnings)
        from vllm.platforms import current_platform

    try:
        sampling_params(args)
    except (ValueError, *_vllm_errors()) as err:
        raise ConfigError(f"sampling settings: vLLM refuses them: {first_line(err)}.") from err
    if lora_rank is not None:
        engine_max_lora_rank(lora_rank)  # a rank between the sizes vLLM serves is rounded up; above them, refused
    context = getattr(model_config, "max_position_embeddings", None)
    if args.vllm_max_model_length is not None and context is not None and args.vllm_max_model_length > context:
        raise ConfigError(
            f"vllm_max_model_length={args.vllm_max_model_length} exceeds the model's context of {context} "
            "(max_position_embeddings); lower it, or leave it unset."
        )
    engine_dtype = engine_dtype_of(args, dtype, layers)
    supported = current_platform.supported_dtypes
    if engine_dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ConfigError(
            f"dtype {str(engine_dtype).removeprefix('torch.')}: the engine on this machine supports {names}; pick one."
        )
    if lora_rank is not None and engine_dtype == torch.float32 and not current_platform.is_cpu():
        raise ConfigError(
            "lora_sync: adapter on a GPU needs a 16-bit engine (vLLM's LoRA kernels take fp16/bf16 only): set "
            "bf16: true, or lora_sync: merged for an fp32 engine with exact parity, or vllm_dtype: bfloat16 to keep "
            "an fp32 trainer (sampling is then corrected by importance sampling)."
        )
    _check_head_size(model_config, current_platform)


def _check_layers(args: GRPOConfig, model_config: PretrainedConfig, layers: list[type], lora_rank: int | None) -> None:
    """Layers with state (`colograd.engine.hybrid`): on a machine without a GPU, refused where vLLM's CPU build
    cannot run them, and run in the one dtype it computes them in (said once here: the trainer keeps its own)."""
    if torch.cuda.is_available():
        return
    text = model_config.get_text_config()
    kind = f"model_type {getattr(text, 'model_type', None)!r}"
    refusal = cpu_refusal(layers, text)
    if refusal is not None:
        raise ConfigError(f"{kind} has {refusal}; train it on a GPU (vLLM's CUDA build runs it).")
    uncached = cpu_without_prefix_caching(layers)
    if uncached is not None and args.vllm_enable_prefix_caching:
        logging.getLogger("colograd.trainer").warning(
            "colograd: %s: the engine starts without prefix caching (vllm_enable_prefix_caching set aside).", uncached
        )
    only = cpu_dtype(layers)
    if only is None:
        return
    names = ", ".join(sorted({cls.__name__ for cls in layers}))
    only_name = str(only).removeprefix("torch.")
    if args.vllm_dtype and getattr(torch, args.vllm_dtype) != only:
        raise ConfigError(
            f"vllm_dtype={args.vllm_dtype}: vLLM's CPU build computes the {names} layers of {kind} in {only_name} "
            "only; "
            f"leave vllm_dtype unset (the engine then runs in {only_name}) or set it to {only_name}."
        )
    if lora_rank is not None:
        raise ConfigError(
            f"lora_sync: adapter on {kind}: vLLM's CPU build runs its {names} layers without LoRA ('lora isn't "
            "supported on CPU'); set lora_sync: merged (the adapter is merged into the weights at each sync)."
        )
    logging.getLogger("colograd.trainer").warning(
        "colograd: vLLM's CPU build computes the %s layers of %s in %s only: the engine runs in %s, the trainer in "
        "its own precision, and the parity gate's 16-bit tolerance applies.",
        names,
        kind,
        only_name,
        only_name,
    )


def _check_experts(model_config: PretrainedConfig, gpu: bool) -> None:
    """A Mixture-of-Experts model trains where the engine's experts can take the trainer's weights at every sync
    (see `colograd.engine.moe`): full-precision experts, on a GPU, or on vLLM's CPU backend where its grouped-GEMM
    kernel takes the hidden size (it pads the expert intermediate size itself)."""
    experts = expert_count(model_config)
    if experts is None:
        return
    kind = f"model_type {model_config.model_type!r} is a Mixture-of-Experts model ({experts} experts)"
    if getattr(model_config, "quantization_config", None) is not None:
        raise ConfigError(
            f"{kind} with quantized weights: colograd's sync writes full-precision expert weights, which vLLM's "
            "quantized expert kernels do not take in place; train it unquantized."
        )
    if gpu:
        return
    with _quiet_logs():
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    alignment = CPUUnquantizedExperts.output_alignment
    hidden = model_config.get_text_config().hidden_size
    if hidden % alignment:
        raise ConfigError(
            f"{kind} of hidden size {hidden}: vLLM's CPU expert kernel needs a multiple of {alignment}; use a GPU, "
            "or a model with such a hidden size."
        )


def _vllm_errors() -> tuple[type[Exception], ...]:
    """vLLM's own error class where the installed version has one (`vllm.exceptions.VLLMError` is newer than 0.26,
    the newest CUDA build for torch 2.11): preflight must not fail to import on an older engine."""
    try:
        from vllm.exceptions import VLLMError
    except ImportError:
        return ()
    return (VLLMError,)


def _check_head_size(model_config: PretrainedConfig, platform: Any) -> None:
    """On CPU, vLLM has one attention backend, with a fixed list of head sizes (GPU backends choose among
    several at start-up, so there the engine decides)."""
    if not platform.is_cpu():
        return
    with _quiet_logs():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    text = model_config.get_text_config()
    head_dims = _head_sizes(text)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    hint = "hidden_size / num_attention_heads = 64"
    if uses_mla(text):  # MLA attends over its cached latent: vLLM's CPU MLA backend takes its size, not head_dim
        with _quiet_logs():
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
        head_dims = [text.kv_lora_rank + text.qk_rope_head_dim]
        supported, hint = CPUMLABackend.get_supported_head_sizes(), "kv_lora_rank + qk_rope_head_dim = 512 + 64"
    for head_dim in head_dims:
        if head_dim not in supported:
            raise ConfigError(
                f"the model's attention head size is {head_dim}, which vLLM's CPU backend does not support (it "
                f"supports {', '.join(map(str, supported))}); use a model with one of those, e.g. {hint}."
            )


def _head_sizes(text: PretrainedConfig) -> list[int]:
    """The attention head sizes of the config's layers, each once: read layer by layer where transformers keeps them
    per layer (Gemma 4 sets 256 and 512, and reading one global `head_dim` raises there), else the config's own
    (`head_dim`, or hidden size / heads)."""
    sizes: set[int] = set()
    if getattr(text, "is_heterogeneous", False):  # as `colograd.engine.kv_cache.unsized_layers` tells them apart
        per_layer = text.per_layer_config
        sizes = {size for i in range(text.num_hidden_layers) if (size := getattr(per_layer[i], "head_dim", None))}
    if not sizes:
        heads = getattr(text, "num_attention_heads", None)
        size = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
        sizes = {size} if size else set()
    return sorted(sizes)


@contextmanager
def _quiet_logs() -> Iterator[None]:
    """No log record below ERROR while the body runs."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
