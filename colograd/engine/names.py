"""How the engine's model names a checkpoint tensor: vLLM's renaming of checkpoint names (`hf_to_vllm_mapper`), where
each model keeps it. Runs in the engine's worker (the functions that call it are handed to `LLM.collective_rpc`)."""

from typing import Any

from torch import nn


def engine_name(model: nn.Module, name: str) -> str | None:
    """The name of the engine's tensor that checkpoint `name` is loaded into, as far as renaming goes (a fused
    module's part keeps its own name: `q_proj`, loaded into `qkv_proj`); None for a name the model drops.

    vLLM renames in two places: the causal LM's `hf_to_vllm_mapper`, which its loader applies to every name, and a
    submodule's own, which that submodule's loader applies to the names under it (LFM2-MoE's decoder renames
    `expert_bias` to `gate.e_score_correction_bias` there). Both apply, the outer first."""
    mapped = _mapped(getattr(model, "hf_to_vllm_mapper", None), name)
    for path, mapper in _inner_mappers(model):
        if mapped is not None and mapped.startswith(path + "."):
            inner = _mapped(mapper, mapped[len(path) + 1 :])
            mapped = None if inner is None else f"{path}.{inner}"
    return mapped


def _mapped(mapper: Any, name: str) -> str | None:
    return mapper._map_name(name) if mapper is not None else name


def _inner_mappers(model: nn.Module) -> list[tuple[str, Any]]:
    """The submodules with a renaming of their own (not the causal LM's), by path; found once per engine model."""
    found = getattr(model, "_colograd_inner_mappers", None)
    if found is None:
        outer = getattr(model, "hf_to_vllm_mapper", None)
        found = [
            (path, mapper)
            for path, module in model.named_modules()
            if path
            and (mapper := getattr(type(module), "hf_to_vllm_mapper", None)) is not None
            and mapper is not outer
        ]
        model._colograd_inner_mappers = found
    return found
