"""How much KV cache the colocated engine gets: what its rollouts need, not a fraction of the device.

A GRPO engine serves one known workload: at most `max_num_seqs` sequences of at most a prompt and a completion
each. A cache sized to that leaves the rest of the device to training. A fixed fraction of the card does not:
0.3 of an 80 GB GPU is ~24 GB of KV for a 1.5B model whose rollout needs ~1 GB, held through every training
step; and vLLM walks every block of it in Python whenever it resets its prefix cache or sleeps (767k blocks,
30 ms, for the tiny model), so a sync of a 1.3 MiB model took 30 times its copy.
"""

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from colograd.errors import ConfigError
from colograd.models.hybrid import state_layer_kinds

# Head-room over the counted need: requests that finish late, blocks in flight, a rounding of lengths.
MARGIN = 1.25
# Tokens per KV block: a sequence takes whole blocks (vLLM's default on GPUs; its CPU attention backend takes 128).
GPU_BLOCK_TOKENS = 16
CPU_BLOCK_TOKENS = 128
# vLLM refuses to start with less than one sequence of the whole context in whole blocks of its attention backend's
# size, which can be larger than 16 (FlashAttention 4 with large heads, vLLM 0.33): the floor is rounded to this.
FLOOR_BLOCK_TOKENS = 256
# When the counted need is larger (a long context and no prompt limit), the cache stops at this share of a GPU
# (TRL's default engine fraction) or this many bytes of host memory, which every rank of a CPU machine shares;
# vLLM then schedules fewer sequences at a time (and preempts), which is slower but correct.
GPU_CAP_FRACTION = 0.3
CPU_CAP_BYTES = 2**30
# The model types whose vLLM model files cache attention as MLA's one compressed latent per token when the config has
# a `kv_lora_rank`: the list of vLLM's `ModelArchConfigConvertorBase.is_deepseek_mla`
# (vllm/transformers_utils/model_arch_config_convertor.py), which `ModelConfig.use_mla` reads. Other configs with a
# `kv_lora_rank` (MiniCPM3) attend with plain keys and values. tests/engine/test_kv_floor.py holds this set to vLLM's.
MLA_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note", "deepseek_mtp",
    "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa", "glm4_moe_lite", "glm4_moe_lite_mtp", "kimi_k2",
    "kimi_linear", "longcat_flash", "pangu_ultra_moe", "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp",
    "bailing_hybrid_v3_mtp", "hy_v4", "hy_v4_mtp",
})  # fmt: skip


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of KV cache one token takes in one engine process, as vLLM's layers report their cache
    (`get_kv_cache_spec`): for each layer slot vLLM allocates (`kv_layer_slots`), the keys and values of the KV heads
    of the process's share, or for an MLA model (`uses_mla`) one latent of `kv_lora_rank + qk_rope_head_dim`, which
    every tensor-parallel rank holds whole.

    Args:
        model_config: the model's transformers config (a multimodal model's text config is read).
        dtype: the engine's compute dtype (the cache's, as vLLM's `kv_cache_dtype="auto"` keeps it).
        tp_size: tensor-parallel ranks sharing the engine; each holds its share of the KV heads (at least one).

    Returns:
        The bytes per token.

    Raises:
        ConfigError: the model has layers whose cache colograd does not size (`check_sized_layers`).
    """
    text = model_config.get_text_config()
    check_sized_layers(text)
    if uses_mla(text):
        # vLLM's `MLAAttention.get_kv_cache_spec`: an `MLAAttentionSpec` of 1 KV head of that size, no separate
        # values (head_size_v 0), and `max_tp_shards=1`: not split across ranks.
        return kv_layer_slots(text) * (text.kv_lora_rank + text.qk_rope_head_dim) * dtype.itemsize
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if is_deepseek_mla(text):  # MLA switched off: DeepseekV2Attention caches keys and values of qk_head_dim
        head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * kv_layer_slots(text) * max(1, kv_heads // tp_size) * head_dim * dtype.itemsize


def is_deepseek_mla(text_config: Any) -> bool:
    """Whether vLLM counts the model as a DeepSeek-style MLA model: one of `MLA_MODEL_TYPES` with a `kv_lora_rank`
    (vLLM's `ModelArchConfigConvertorBase.is_deepseek_mla`).

    Args:
        text_config: the model's text config.

    Returns:
        True for DeepSeek-V2/V3, Kimi-K2, Moonlight and the other types of the list.
    """
    model_type = getattr(text_config, "model_type", None)
    return model_type in MLA_MODEL_TYPES and getattr(text_config, "kv_lora_rank", None) is not None


def uses_mla(text_config: Any) -> bool:
    """Whether vLLM's engine runs the model's attention as MLA, caching one latent per token: `ModelConfig.use_mla`,
    which is `is_deepseek_mla` unless `VLLM_MLA_DISABLE` is set or the config attends bidirectionally
    (`is_causal: false`, which MLA's kernels do not serve).

    Args:
        text_config: the model's text config.

    Returns:
        True where the cache holds MLA latents.
    """
    if bool(int(os.environ.get("VLLM_MLA_DISABLE", "0"))) or getattr(text_config, "is_causal", True) is False:
        return False
    return is_deepseek_mla(text_config)


def unsized_layers(text_config: Any) -> str | None:
    """What in the model colograd cannot count its KV cache per token for from the config, or None where every
    layer is attention (full, sliding-window, or MLA). Such a model is sized from its layers' specs once its engine
    has started (`RolloutCache`); the count per token (`kv_bytes_per_token`) is for attention models only.

    vLLM gives Mamba, linear-attention and short-convolution layers (Jamba, Qwen3-Next, Qwen3.5, Granite 4 hybrid,
    Falcon-H1, LFM2, MiniMax) a state per sequence in pages of their own (`MambaSpec`), and raises the attention block
    size to match those pages; DeepSeek-V3.2's sparse attention adds an indexer cache per layer (`index_topk`),
    DeepSeek-V4's compresses its cache (`compress_ratios`). A config transformers keeps layer by layer
    (`is_heterogeneous`: Gemma 4's head sizes of 256 and 512) has no one size per token either.

    Args:
        text_config: the model's text config.

    Returns:
        A description of those layers, for an error message; None where colograd counts the model.
    """
    if getattr(text_config, "is_heterogeneous", False):  # transformers keeps these per layer: no one size per token
        return f"attention set layer by layer ({', '.join(sorted(text_config.per_layer_attributes))} per layer)"
    kinds = state_layer_kinds(text_config)
    if kinds == ["attention-free"]:
        return "no attention layers (a Mamba or other attention-free model)"
    if kinds:
        return f"hybrid, Mamba or linear-attention layers ({', '.join(kinds)})"
    if getattr(text_config, "index_topk", None) is not None:
        return "a sparse-attention indexer cache (index_topk)"
    if getattr(text_config, "compress_ratios", None) is not None:
        return "compressed attention (compress_ratios)"
    return None


def check_sized_layers(text_config: Any) -> None:
    """Refuse to count a KV cache per token for a model whose cache is not keys and values per token
    (`unsized_layers`): such a model's cache is sized from its engine's specs.

    Args:
        text_config: the model's text config.

    Raises:
        ConfigError: naming the model type and those layers.
    """
    layers = unsized_layers(text_config)
    if layers is not None:
        raise ConfigError(
            f"model_type {getattr(text_config, 'model_type', None)!r} has {layers}: its cache is not counted per "
            "token; size it from the engine's specs (RolloutCache)."
        )


def sliding_windows(text_config: Any) -> list[int | None]:
    """Each layer's attention window (None: the whole context), as vLLM's model files read a config: the layer's
    type where the config lists them (Gemma 3's local layers), else the config's `sliding_window` on every layer
    unless `use_sliding_window` is false (Qwen2's)."""
    window = getattr(text_config, "sliding_window", None)
    types = getattr(text_config, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types]
    off = getattr(text_config, "use_sliding_window", None) is False
    return [None if off else window] * text_config.num_hidden_layers


def kv_layer_slots(text_config: Any) -> int:
    """The layers vLLM allocates KV cache for: every layer, and for a model whose layers attend in different ways
    (Gemma 3's 22 sliding-window and 4 global layers) the padding vLLM's hybrid cache adds. It groups the layers of
    each kind into groups of one size (the fewest layers of any kind, or the most where no kind has 1.5 times the
    fewest) and pads every kind to whole groups: Gemma-3-1B takes 4 + 24 = 28 slots for its 26 layers.
    tests/engine/test_kv_floor.py holds this to vLLM's own grouping on every model of its zoo."""
    kinds: dict[int | None, int] = {}
    for window in sliding_windows(text_config):
        kinds[window] = kinds.get(window, 0) + 1
    if len(kinds) == 1:
        return text_config.num_hidden_layers
    fewest, most = min(kinds.values()), max(kinds.values())
    group = most if most < 1.5 * fewest else fewest
    return sum(-(-count // group) * group for count in kinds.values())


def engine_context(args: Any, model_config: Any, longest_prompt: int | None = None) -> int | None:
    """The engine's context length as colograd sets it: vllm_max_model_length, else a prompt of max_prompt_length
    and a completion, else the longest prompt the run will give (`longest_prompt`, measured on every row) and a
    completion, else the model's own (None where the config does not say: vLLM then decides).

    A context no longer than the run's sequences keeps the KV cache's floor (one whole-context sequence, which vLLM
    requires at start-up) at what the run needs: 16 GiB of bf16 KV for Llama-3.1-8B's 128k context, where its
    sequences are a few hundred tokens."""
    if args.vllm_max_model_length:
        return args.vllm_max_model_length
    if args.max_prompt_length:
        return args.max_prompt_length + args.max_completion_length
    own = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if longest_prompt is None:
        return own
    bounded = longest_prompt + args.max_completion_length
    return bounded if own is None else min(own, bounded)


def engine_max_model_len(args: Any, model_config: Any, longest_prompt: int | None = None) -> int | None:
    """`max_model_len` for `vllm.LLM`: `engine_context`, or None where that is the model's own (vLLM reads it)."""
    if not (args.vllm_max_model_length or args.max_prompt_length or longest_prompt is not None):
        return None
    return engine_context(args, model_config, longest_prompt)


def rollout_kv_bytes(
    args: Any,
    model_config: Any,
    dtype: torch.dtype,
    max_num_seqs: int,
    device_bytes: int | None,
    prompt_tokens: int | None = None,
    longest_prompt: int | None = None,
) -> int | None:
    """The KV cache for `max_num_seqs` sequences of a prompt and a completion each (in whole blocks), with `MARGIN`,
    at most `GPU_CAP_FRACTION` of a GPU of `device_bytes` (or `CPU_CAP_BYTES` without one), and never less than one
    sequence of the whole context (vLLM refuses to start with less). None when the context is unknown.

    Args:
        args: the run's config (lengths, vllm_tensor_parallel_size).
        model_config: the model's transformers config.
        dtype: the engine's dtype.
        max_num_seqs: sequences the engine decodes at once.
        device_bytes: the GPU's total memory; None on a machine without one.
        prompt_tokens: the longest prompt expected (`colograd.data.core.sampled_prompt_tokens`), where
        `max_prompt_length`
            does not bound prompts; None: the whole context.
        longest_prompt: the longest prompt of every row, measured: it bounds the engine's context
            (`engine_context`) and counts as `prompt_tokens`.
    """
    cache = rollout_cache(args, model_config, max_num_seqs, device_bytes, prompt_tokens, longest_prompt)
    if cache is None:
        return None
    context = engine_context(args, model_config, longest_prompt)
    per_token = kv_bytes_per_token(model_config, dtype, args.vllm_tensor_parallel_size)
    block = GPU_BLOCK_TOKENS if device_bytes else CPU_BLOCK_TOKENS
    need = math.ceil(max_num_seqs * _whole_blocks(cache.longest, block) * per_token * MARGIN)
    windowed = any(w is not None for w in sliding_windows(model_config.get_text_config()))
    return max(min(need, cache.cap), floor_bytes(context, per_token, block, windowed))


def floor_bytes(context: int, per_token: int, block: int, windowed: bool = False) -> int:
    """The least KV cache vLLM starts with: one sequence of the whole `context`, in whole blocks of the largest size
    an attention backend takes, the block vLLM's pool holds back (its null block), and, where a layer attends over a
    sliding window, one block more (vLLM gives a window one, as it may start inside a block)."""
    floor_block = max(block, FLOOR_BLOCK_TOKENS)
    return (_whole_blocks(context, floor_block) + floor_block * (2 if windowed else 1)) * per_token


def _whole_blocks(tokens: int, block: int) -> int:
    """`tokens` rounded up to whole blocks."""
    return -(-tokens // block) * block


def rollout_cache(
    args: Any,
    model_config: Any,
    max_num_seqs: int,
    device_bytes: int | None,
    prompt_tokens: int | None = None,
    longest_prompt: int | None = None,
) -> "RolloutCache | None":
    """What the engine's cache is sized for (`RolloutCache`): `max_num_seqs` sequences of the longest a rollout gives
    (a prompt of `max_prompt_length`, the measured `longest_prompt` or the expected `prompt_tokens`, else the whole
    context, and a completion), capped as `rollout_kv_bytes` caps it. None when the context is unknown."""
    context = engine_context(args, model_config, longest_prompt)
    if context is None:
        return None
    prompt_tokens = longest_prompt if longest_prompt is not None else prompt_tokens
    longest = min(context, (args.max_prompt_length or prompt_tokens or context) + args.max_completion_length)
    cap = int(device_bytes * GPU_CAP_FRACTION) if device_bytes else CPU_CAP_BYTES
    return RolloutCache(max_num_seqs, longest, cap)


@dataclass(frozen=True)
class RolloutCache:
    """The engine's cache as a rollout needs it, counted from the cache specs the engine's layers report to vLLM
    (`KVCacheSpec`: attention pages of keys and values or MLA latents, a sliding window's, the per-sequence state
    pages of Mamba, linear-attention and short-convolution layers, an indexer's), with vLLM's own accounting: its
    grouping of the layers into one pool of pages (`get_kv_cache_groups`, hybrid models' block sizes already
    aligned to their state pages), the bytes one block of the pool takes, and the pages one request of a given
    length claims in every group (`_max_memory_usage_bytes_from_groups`, the function vLLM's start-up check calls).

    max_num_seqs: sequences the engine runs at once (each holds its own state pages).
    longest: the tokens of a rollout's longest sequence (prompt and completion).
    cap: the most bytes the cache takes where the rollout would need more (vLLM then schedules fewer at once).
    """

    max_num_seqs: int
    longest: int
    cap: int

    def bytes(self, vllm_config: Any, specs: dict[str, Any]) -> int | None:
        """The cache for the rollout, with `MARGIN`, at most `cap`, and never less than vLLM's start-up floor: one
        request of the engine's whole context and the block its pool holds back. None where the installed vLLM has
        not this accounting (`counts_from_specs`): the engine keeps the size it was started with."""
        from vllm.v1.core import kv_cache_utils

        if not counts_from_specs():
            return None
        groups = kv_cache_utils.get_kv_cache_groups(vllm_config, dict(specs))  # (it may rewrite the dict it gets)
        need = math.ceil(self.max_num_seqs * _request_bytes(vllm_config, groups, self.longest) * MARGIN)
        context = vllm_config.model_config.max_model_len
        null_block = kv_cache_utils._pool_bytes_per_block(vllm_config, groups)
        floor = _request_bytes(vllm_config, groups, context) + null_block
        return max(min(need, self.cap), floor)


def _request_bytes(vllm_config: Any, groups: list[Any], tokens: int) -> int:
    """The pool bytes one request of `tokens` tokens claims (vLLM counts a request of its `max_model_len`)."""
    from vllm.v1.core import kv_cache_utils

    model_config = vllm_config.model_config
    context = model_config.max_model_len
    model_config.max_model_len = min(tokens, context)
    try:
        return kv_cache_utils._max_memory_usage_bytes_from_groups(vllm_config, groups)
    finally:
        model_config.max_model_len = context


def counts_from_specs() -> bool:
    """Whether the installed vLLM has the accounting `RolloutCache` asks (vllm 0.32 and 0.33 have it; 0.26, the newest
    CUDA build for torch 2.11, may not)."""
    from vllm.v1.core import kv_cache_utils

    names = ("get_kv_cache_groups", "_max_memory_usage_bytes_from_groups", "_pool_bytes_per_block")
    return all(hasattr(kv_cache_utils, name) for name in names)


def _allocated(vllm_config: Any, config: Any) -> int:
    """The bytes of the KV cache an engine allocated (`KVCacheConfig` `config`): its blocks × the bytes a block takes
    in every group's layers (the groups' tensors overlay one pool, one block id per group), or, with a vLLM without
    that accounting, its tensors' sizes."""
    from vllm.v1.core import kv_cache_utils

    if counts_from_specs():
        return config.num_blocks * kv_cache_utils._pool_bytes_per_block(vllm_config, config.kv_cache_groups)
    return sum(tensor.size for tensor in config.kv_cache_tensors)


def _holds_state(config: Any) -> bool:
    """Whether an engine's KV cache (`KVCacheConfig` `config`) has state pages: a group of layers that carry state
    along the sequence (`MambaSpec`: Mamba, linear attention, short convolutions), whatever the config calls them."""
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = [group.kv_cache_spec for group in config.kv_cache_groups]
    specs += [inner for spec in specs for inner in (getattr(spec, "kv_cache_specs", None) or {}).values()]
    return any(isinstance(spec, MambaSpec) for spec in specs)


@contextmanager
def sized_from_specs(cache: RolloutCache | None, sized: list[tuple[int, bool]]) -> Iterator[None]:
    """While an engine starts in this process: where `cache` is given, its KV cache is sized from the specs its
    layers report (`RolloutCache.bytes`), once vLLM has resolved the cache's layout and before it measures the memory
    it has (`determine_available_memory`, in `EngineCore._initialize_kv_caches`); `sized` gets the bytes the engine
    then allocated and whether its cache holds state pages (`_holds_state`). Without `cache` (an explicit size),
    `sized` still gets them."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore._initialize_kv_caches

    def initialize(engine_core: Any, vllm_config: Any) -> Any:
        executor = engine_core.model_executor
        measure = executor.determine_available_memory

        def determine_available_memory() -> list[int]:  # called once the cache's layout is resolved
            sized_bytes = cache.bytes(vllm_config, executor.get_kv_cache_specs()[0])
            if sized_bytes is not None:
                vllm_config.cache_config.kv_cache_memory_bytes = sized_bytes
            return measure()

        if cache is not None:
            executor.determine_available_memory = determine_available_memory
        try:
            config = original(engine_core, vllm_config)
        finally:
            vars(executor).pop("determine_available_memory", None)
        sized.append((_allocated(vllm_config, config), _holds_state(config)))
        return config

    EngineCore._initialize_kv_caches = initialize
    try:
        yield
    finally:
        EngineCore._initialize_kv_caches = original


def engine_memory(
    args: Any,
    model_config: Any,
    dtype: torch.dtype,
    max_num_seqs: int,
    prompt_tokens: int | None = None,
    longest_prompt: int | None = None,
) -> tuple[dict[str, Any], RolloutCache | None]:
    """The memory arguments of `vllm.LLM`, and what the cache is then sized for once the engine's layers report
    their specs (`sized_from_specs`): an explicit `vllm_gpu_memory_utilization` (GPU) or `vllm_kv_cache_gib` (no
    `RolloutCache`), else a cache sized to the rollout (`rollout_cache`, with `prompt_tokens` and `longest_prompt`),
    started at the count from the config (`rollout_kv_bytes`) where colograd can count it, else at the cap."""
    on_gpu = torch.cuda.is_available()
    device_bytes = torch.cuda.mem_get_info()[1] if on_gpu else None
    cache = None
    if on_gpu and args.vllm_gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": args.vllm_gpu_memory_utilization}, None
    if args.vllm_kv_cache_gib is not None:
        kv_bytes = int(args.vllm_kv_cache_gib * 2**30)
    else:
        cache = rollout_cache(args, model_config, max_num_seqs, device_bytes, prompt_tokens, longest_prompt)
        if cache is None:  # no context length to count with: the device's share, as before
            share = {"gpu_memory_utilization": GPU_CAP_FRACTION}
            return (share if on_gpu else {"kv_cache_memory_bytes": CPU_CAP_BYTES}), None
        counted = unsized_layers(model_config.get_text_config()) is None
        kv_bytes = (
            rollout_kv_bytes(args, model_config, dtype, max_num_seqs, device_bytes, prompt_tokens, longest_prompt)
            if counted
            else cache.cap
        )
    if not on_gpu:
        return {"kv_cache_memory_bytes": kv_bytes}, cache
    # vLLM still checks at start that `gpu_memory_utilization` of the card is free (the trainer's model and optimizer
    # already hold some). With the cache size given, that fraction sizes nothing else: ask for what is free.
    free, total = torch.cuda.mem_get_info()
    return {"kv_cache_memory_bytes": kv_bytes, "gpu_memory_utilization": round(0.9 * free / total, 4)}, cache
