"""What an engine is built with (`engine_settings`: `vllm.LLM`'s arguments and what else fixes what it computes), the
architecture name vLLM picks its model class by, and the precision it samples in."""

import copy
import os
from typing import Any

import torch
from peft import PeftModel
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from colograd.config.core import GRPOConfig
from colograd.engine.hybrid import cpu_dtype, cpu_without_prefix_caching, cuda_arguments, state_layers
from colograd.engine.kv_cache import engine_max_model_len
from colograd.engine.lora import engine_max_lora_rank
from colograd.vision.core import engine_arguments, is_processor, is_vision_language, text_tokenizer

# The sleep level of an engine whose weights stay in place between rollouts, only its KV cache released.
KV_CACHE_ONLY = "kv_cache"
# Settings that fix an engine's behaviour without being `vllm.LLM` arguments.
NOT_LLM_ARGUMENTS = ("sleep_level", "architecture", "tokenizer", "stop_ids", "memory", "cpu_repack_weights")


def holds(key: str, held: Any, wanted: Any) -> bool:
    """Whether an engine built with `held` for setting `key` serves a trainer that wants `wanted`: a context
    (`max_model_len`) as long or longer does."""
    return key == "max_model_len" and held is not None and wanted is not None and held >= wanted


def engine_settings(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    args: GRPOConfig,
    lora_rank: int | None = None,
    sleep_level: int | str | None = None,
    longest_prompt: int | None = None,
    images_per_prompt: int = 1,
) -> dict[str, Any]:
    """What an engine for this trainer is built with: `vllm.LLM`'s arguments (but its memory, which `engine_memory`
    works out at start from what is free then), and what else fixes what it computes: the architecture, the
    tokenizer, the stop ids, the sleep level. Two trainers whose settings are equal can share an engine."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if sleep_level is not None and not args.vllm_enable_sleep_mode:
        raise ValueError("sleep_level needs vllm_enable_sleep_mode")
    if sleep_level is None:
        sleep_level = (KV_CACHE_ONLY if lora_rank else 2) if args.vllm_enable_sleep_mode else 0
    architecture = {k: v for k, v in engine_config(base).to_dict().items() if k not in _NOT_ARCHITECTURE}
    stop_ids = base.generation_config.eos_token_id if base.generation_config is not None else None
    lora = {"enable_lora": True, "max_lora_rank": engine_max_lora_rank(lora_rank), "max_loras": 1} if lora_rank else {}
    vision = {}
    if is_vision_language(base):  # trained on text alone (a tokenizer, not a processor): vLLM needs no image processor
        vision = engine_arguments(images_per_prompt) if is_processor(tokenizer) else {"language_model_only": True}
    tokenizer = text_tokenizer(tokenizer)
    # Routing replay on a GPU: vLLM's own route (its runner records each token's experts inside CUDA graphs);
    # the CPU engine has none, and colograd's capture reads its routers instead (`colograd.engine.routing`): a Python
    # hook, which the CPU engine's compiled forward would skip (the first rollout then stopped, its routing missing),
    # so that engine runs eagerly.
    replaying = args.routing_replay == "rollout"
    replay = {"enable_return_routed_experts": True} if replaying and torch.cuda.is_available() else {}
    eager = args.vllm_enforce_eager or (replaying and not torch.cuda.is_available())
    # None: one rollout of the whole TP group as one batch.
    seqs = args.vllm_max_num_seqs or (
        args.per_device_train_batch_size * args.steps_per_generation * args.vllm_tensor_parallel_size
    )
    # A prompt limit or the measured longest prompt, and a completion; else the model's own context (None).
    max_model_len = engine_max_model_len(args, base.config, longest_prompt)
    layers = engine_layers(model)  # vLLM's layer classes with state: what the dtype and prefix caching depend on
    return {
        "dtype": engine_dtype_name(model, args, layers),
        "tensor_parallel_size": args.vllm_tensor_parallel_size,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": args.vllm_max_num_batched_tokens,
        "max_model_len": max_model_len,
        "enforce_eager": eager,
        "enable_prefix_caching": args.vllm_enable_prefix_caching and caches_prefixes(layers),
        "enable_sleep_mode": args.vllm_enable_sleep_mode,
        **lora,
        **vision,
        **replay,
        **cuda_arguments(base.config.get_text_config(), args, seqs, max_model_len),
        "memory": (args.vllm_gpu_memory_utilization, args.vllm_kv_cache_gib),
        "cpu_repack_weights": args.vllm_cpu_repack_weights,
        "sleep_level": sleep_level,
        "architecture": architecture,
        "tokenizer": (type(tokenizer).__name__, len(tokenizer), tuple(tokenizer.all_special_ids)),
        "stop_ids": stop_ids,
    }


# Config entries that name or date a model rather than shape it.
_NOT_ARCHITECTURE = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")


def engine_config(model: PreTrainedModel) -> Any:
    """The model's config as the engine reads it: a model built from a config (not loaded) has no `architectures`,
    and vLLM picks its model class from it."""
    config = copy.deepcopy(model.config)
    config.architectures = [architecture_name(model)]
    return config


def triton_fp32_precision(dtype: torch.dtype) -> str | None:
    """Make a float32 engine on a GPU multiply in the trainer's float32 matmul precision; returns what was set.

    FlashAttention takes 16-bit inputs only, so vLLM gives a float32 engine its Triton attention, whose `tl.dot`
    runs float32 in TF32 on Ampere and newer unless `TRITON_F32_DEFAULT` says otherwise. The trainer multiplies in
    full float32 by default (`torch.get_float32_matmul_precision() == "highest"`), and TF32 attention alone put the
    engine 2.0e-3 nat away from it (H100, vLLM 0.26: 1.4e-6 with "ieee"). A user's own setting of the variable is
    kept. Triton reads it when it compiles a kernel, and keys its cache on it.

    Returns:
        The value set, or None where nothing was (a 16-bit engine, no GPU, or the variable already set).
    """
    if dtype != torch.float32 or not torch.cuda.is_available() or "TRITON_F32_DEFAULT" in os.environ:
        return None
    value = "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    os.environ["TRITON_F32_DEFAULT"] = value
    return value


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def architecture_name(model: nn.Module) -> str:
    """The architecture name vLLM picks its model class by: the model's class name (seen through FSDP2, which
    re-classes a sharded module as `FSDP<Name>`) where vLLM has a model of that name, else the checkpoint's own
    `architectures` name, else vLLM's spelling of the class name. The two can differ (Phi-3.5-MoE: transformers'
    `PhimoeForCausalLM`, the checkpoint's and vLLM's `PhiMoEForCausalLM`), and a name vLLM lacks sends it to its
    Transformers backend instead of its native model."""
    from torch.distributed.fsdp import FSDPModule
    from vllm import ModelRegistry

    name = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__
    native = set(ModelRegistry.get_supported_archs())
    if name in native:
        return name
    declared = [arch for arch in getattr(model.config, "architectures", None) or [] if arch in native]
    spelled = [arch for arch in sorted(native) if arch.lower() == name.lower()]
    return next(iter(declared + spelled), name)


def engine_dtype_name(model: PreTrainedModel, args: GRPOConfig, layers: list[type] | None = None) -> str:
    """The engine's dtype for this model (see `engine_dtype`), by name; `layers`: its `engine_layers`, if known."""
    layers = engine_layers(model) if layers is None else layers
    return str(engine_dtype(args, next(model.parameters()).dtype, layers)).removeprefix("torch.")


def engine_layers(model: nn.Module) -> list[type]:
    """vLLM's layer classes with state that the engine builds `model` from (`colograd.engine.hybrid.state_layers`)."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return state_layers(architecture_name(base), base.config.get_text_config())


def caches_prefixes(layers: list[type]) -> bool:
    """Whether the engine can cache prefixes for a model of these `layers` (`engine_layers`): not on vLLM's CPU build
    for Mamba-2 layers (`colograd.engine.hybrid.cpu_without_prefix_caching`; said before start-up,
    `colograd.preflight.engine`)."""
    return torch.cuda.is_available() or cpu_without_prefix_caching(layers) is None


def engine_dtype(args: GRPOConfig, parameter_dtype: torch.dtype, layers: list[type] = ()) -> torch.dtype:
    """The precision the trainer computes in, so that the engine samples from the policy being trained, unless
    `vllm_dtype` asks for another, or the CPU engine computes one of the model's `layers` (`engine_layers`) in one
    dtype only (Gated DeltaNet: bf16, `colograd.engine.hybrid.cpu_dtype`), which it then runs in: the trainer keeps
    its own precision, and the parity gate's 16-bit tolerance applies. (A `vllm_dtype` the layers cannot take is
    refused before start-up, `colograd.preflight.engine`.)

    `args.mixed_precision` is what the Trainer hands its Accelerator: `bf16` / `fp16` when set, else the
    accelerate launch config's `mixed_precision` (e.g. `ddp.yaml`'s bf16 autocast). Without mixed precision,
    the trainer's own parameter dtype (fp32 keeps parity exact).
    """
    if not args.vllm_dtype and not torch.cuda.is_available() and (only := cpu_dtype(list(layers))) is not None:
        return only
    name = args.vllm_dtype or {"bf16": "bfloat16", "fp16": "float16"}.get(args.mixed_precision)
    return getattr(torch, name) if name else parameter_dtype
