"""Layers that carry state along the sequence: what a hybrid model (Qwen3.5, Qwen3-Next, Granite-4.0-H, Falcon-H1,
Nemotron-H, Jamba, LFM2, Kimi-Linear, MiniMax) mixes with its attention layers.

A Mamba, linear-attention (Gated DeltaNet, Kimi's delta rule) or short-convolution layer reads each token through a
state the tokens before it left, not through keys and values it can be masked from. Two consequences for colograd:
the engine keeps that state in pages of its own, one per sequence (`colograd.engine.kv_cache` sizes them), and the
trainer cannot pack two sequences into one row as they are, because the second would start from the state the first
left (`colograd.forward.stateful` gives each such layer its sequences apart; else `colograd.forward.core` runs the
model's passes padded).

The layer kinds are read from the config as vLLM reads them (`ModelConfig.get_num_layers_by_block_type`):
`layers_block_type`, `layer_types` or MiniMax's `attn_type_list` (0 marks a linear layer).
"""

import functools
import inspect
from typing import Any

# Layer kinds that are a feed-forward block only (Nemotron-H lists its MLP and MoE layers beside its mixers).
FEED_FORWARD = frozenset({"mlp", "moe"})


def is_attention(kind: Any) -> bool:
    """Whether a layer kind of a config's layer list is attention with a per-token KV cache: "attention" (Jamba's
    and Granite 4's spelling), "full_attention", "sliding_attention" and the other "*_attention" kinds, except
    "linear_attention" (transformers' name for Mamba and linear-attention layers)."""
    return isinstance(kind, str) and kind.endswith("attention") and kind != "linear_attention"


def state_layer_kinds(text_config: Any) -> list[str]:
    """The kinds of the model's layers that carry state along the sequence, in order of first appearance; a model
    without attention heads (a Mamba model) is "attention-free". Empty for a model whose layers are all attention.

    Args:
        text_config: the model's text config (`config.get_text_config()`).
    """
    kinds: dict[str, None] = {}
    for name in ("layers_block_type", "layer_types"):
        listed = getattr(text_config, name, None) or ()
        kinds |= {str(kind): None for kind in listed if not is_attention(kind) and kind not in FEED_FORWARD}
    if any(kind != 1 for kind in getattr(text_config, "attn_type_list", None) or ()):
        kinds["linear_attention"] = None
    if not kinds and getattr(text_config, "num_attention_heads", None) is None:
        kinds["attention-free"] = None
    return list(kinds)


def state_layer_count(text_config: Any) -> int:
    """How many of the model's layers carry state (`state_layer_kinds`), counted in the first layer list that names
    one (Jamba's two lists name the same layers twice)."""
    for name in ("layers_block_type", "layer_types"):
        listed = getattr(text_config, name, None) or ()
        count = sum(1 for kind in listed if not is_attention(kind) and kind not in FEED_FORWARD)
        if count:
            return count
    return sum(1 for kind in getattr(text_config, "attn_type_list", None) or () if kind != 1)


def carries_state(config: Any) -> bool:
    """Whether any layer of the model carries state along the sequence (`state_layer_kinds`).

    Args:
        config: the model's config (a multimodal model's text config is read).
    """
    return bool(state_layer_kinds(config.get_text_config()))


# The bound vLLM's Mamba-2 layer puts on its time step, whatever the config says (`MambaMixer2`, vllm 0.32), and the
# reference layer's default (mamba_ssm's `Mamba2`: `dt_limit=(0.0, float("inf"))`).
ENGINE_TIME_STEP_LIMIT = (0.0, float("inf"))


def bound_time_steps_as_configured(model: Any) -> tuple[int, Any, Any]:
    """Bound every Mamba-2 layer's time step (`dt`, after its softplus) by the config's `time_step_limit`, as the
    engine's does; returns how many layers were changed, and the bound each had and now has.

    vLLM's Mamba-2 layer bounds `dt` to (0, inf) (`MambaMixer2`, every family). transformers' Nemotron-H and Zamba2
    layers bound it below by `time_step_min` instead (0.001): an initialisation range of `dt_bias`, which their
    configs list beside a `time_step_limit` of (0, inf), and which the other families' layers (Mamba-2, Bamba,
    Falcon-H1, Granite-4.0-H) do not read at run time. A time step under it then differs between the engine and the
    trainer: a shrunk Nemotron-H's first Mamba layer was 0.003 off at the first token, its log-probs 0.06 nats, and the
    parity gate stopped it. The layers keep their config's bound, which is the engine's; a config that sets none
    (Zamba2's) gets the engine's, (0, inf).

    Args:
        model: the model (or a wrapper of it: DDP, DeepSpeed, PEFT); its own config is read.
    """
    configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "get_text_config")]
    if not configs:
        return 0, None, None
    limit = getattr(configs[0].get_text_config(), "time_step_limit", None) or ENGINE_TIME_STEP_LIMIT
    limit, changed, before = tuple(float(x) for x in limit), 0, None
    for module in model.modules():
        own = module.__dict__.get("time_step_limit")
        if isinstance(own, tuple) and tuple(float(x) for x in own) != limit:
            before, changed = own, changed + 1
            module.time_step_limit = limit
    return changed, before, limit


def normalize_groups_as_configured(model: Any) -> int:
    """Make every Mamba-2 layer whose config sets `n_groups` > 1 normalize its gated output one group at a time, as
    the engine's does; returns how many layers were changed.

    A Mamba-2 layer's output goes through a gated RMSNorm whose statistics are taken over each group of
    intermediate / n_groups channels: vLLM's `Mixer2RMSNormGated`, the reference layer (mamba_ssm's `Mamba2`,
    `group_size=d_ssm // ngroups`) and the fused kernel transformers itself calls on a GPU
    (`mamba_split_conv1d_scan_combined`). transformers' torch path of the Mamba-2, Bamba and Granite-4.0-H layers
    takes them over the whole width instead (their `*RMSNormGated`, which hold no group size; Falcon-H1's, Zamba2's
    and Nemotron-H's do). The two agree at one group, the published Granite-4.0-H, Bamba and small Mamba-2
    configs'; with more (Mamba-Codestral's 8) a shrunk Mamba-2's log-probs were 0.082 nats from the engine's (3.5 in a
    narrower shrink of 2 groups) and the parity gate stopped it. The changed norms compute what those layers were
    trained with; their weights are untouched.

    Args:
        model: the model (or a wrapper of it: DDP, DeepSpeed, PEFT).
    """
    changed = 0
    for module in model.modules():
        groups, norm = getattr(module, "n_groups", None), getattr(module, "norm", None)
        width = getattr(module, "intermediate_size", None)
        if not isinstance(groups, int) or groups <= 1 or not isinstance(width, int) or width % groups:
            continue
        if norm is None or hasattr(norm, "n_groups") or hasattr(norm, "group_size"):
            continue  # no norm, or one that knows its groups
        if "gate" not in inspect.signature(type(norm).forward).parameters:
            continue
        # accelerate's hooks (a device map's offloading) set the instance's `forward` to one that runs the hook
        # around `_old_forward`, the module's own: the computation is changed there, inside the hook.
        slot = "_old_forward" if "_old_forward" in norm.__dict__ else "forward"
        own = norm.__dict__.get(slot)
        if own is not None and (slot == "forward" or getattr(own, "func", None) is _grouped_gated_norm):
            continue  # changed already, or another library's wrapper (left to it: the parity gate judges the result)
        setattr(norm, slot, functools.partial(_grouped_gated_norm, norm, groups))
        changed += 1
    return changed


def _grouped_gated_norm(norm: Any, groups: int, hidden_states: Any, gate: Any = None) -> Any:
    """`norm`'s gated RMSNorm (gate first, then the norm, in float32) with its statistics taken over each of `groups`
    equal groups of the last dimension, as vLLM's `Mixer2RMSNormGated.forward_native` computes it."""
    import torch
    from torch.nn import functional

    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    if gate is not None:
        x = x * functional.silu(gate.to(torch.float32))
    *prefix, width = x.shape
    grouped = x.view(*prefix, groups, width // groups)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * grouped.view(*prefix, width).to(dtype)
