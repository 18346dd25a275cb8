"""What the step benchmark runs: the model shapes it builds, the workloads it trains, and the task of each.

Every shape is a Qwen2-architecture model built locally from a config over the tiny task's character vocabulary,
so nothing is downloaded: "tiny" is the default recipe's model (overhead-bound on a CPU: per-token Python and
kernel-launch costs dominate), "small" one where compute dominates on 2 CPU cores, and "qwen2.5-0.5b" /
"qwen2.5-1.5b" the layers of those models (hidden size, depth, heads, MLP width), for a GPU. With a 64-token
vocabulary their parameters are the real models' non-embedding ones. "smollm2" is a real pretrained model instead
(SmolLM2-135M-Instruct on the sums chat task). "llava-<shape>" is a vision-language model: the tiny LLaVA's image
encoder (`colograd.models.tiny_vlm`) before a language model of that shape, on the colour task. "moe" is a
Mixture-of-Experts model sized for a CPU (`MOE_SHAPE`: Qwen3-MoE, hidden 512, 8 experts, 2 per token) on the
letters task. "qwen3.5" is a hybrid (`HYBRID_SHAPE`: Qwen3.5's layers at a CPU's size, three Gated DeltaNet
linear-attention layers to one of full attention) on the letters task: vLLM's CPU build computes its linear
attention in bf16 only, so its engine runs in bf16 whatever the trainer does. "qwen3.5-4b-layers" is the same
pattern at Qwen3.5-4B's own widths (`HYBRID_4B_SHAPE`), where the engine's fixed memory no longer dominates.
"""

from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from colograd.data import sums
from colograd.errors import ConfigError
from colograd.models import pretrained, tiny, tiny_vlm

SHAPES = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "max_position_embeddings": 512},
    "small": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6,
              "num_key_value_heads": 2, "max_position_embeddings": 512},
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "max_position_embeddings": 32768},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768},
}  # fmt: skip
SMOLLM2 = "colograd:smollm2-135m-instruct"
LLAVA = "llava-"  # "llava-small": the tiny LLaVA's image encoder before the small language model
MOE = "moe"
# The MoE benchmark's model: Qwen3-MoE's architecture (Qwen3-30B-A3B's family: every layer sparse, top-k weights
# renormalised) at a CPU's size, 4 layers of 8 experts with 2 per token, as Mixtral routes. Hidden 512 and expert
# width 256 are multiples of 32, the alignment vLLM's CPU expert kernel needs (it refuses another hidden size and
# would zero-pad another width). 15.2M parameters, 12.6M of them in the experts (83%; 95-96% in Qwen3-30B-A3B and
# Mixtral-8x7B): the experts are most of what the sync moves.
MOE_SHAPE = {"hidden_size": 512, "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
             "norm_topk_prob": True, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 64, "max_position_embeddings": 512}  # fmt: skip
HYBRID = "qwen3.5"
# The hybrid benchmark's model: Qwen3.5's text model (Qwen3_5ForCausalLM) at a CPU's size, one period of its pattern
# (3 Gated DeltaNet layers, then full attention), its head sizes (256 for attention, 128 for linear attention) and a
# quarter of each attention head rotated; fewer heads and a narrower hidden size than Qwen3.5-0.8B. 17.7M parameters.
HYBRID_SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 256, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                "full_attention_interval": 4, "max_position_embeddings": 512}  # fmt: skip
# The same period at Qwen3.5-4B's widths (hidden 2560, MLP 9216, 16 query / 4 KV heads of 256, 16 key / 32 value
# linear-attention heads of 128; tests/zoo.py's published config), 4 of its 32 layers: 446M parameters, as many per
# layer as the real model's. Over the character vocabulary, so the output layer is not the real one's 248k.
HYBRID_4B = "qwen3.5-4b-layers"
HYBRID_4B_SHAPE = {**HYBRID_SHAPE, "hidden_size": 2560, "intermediate_size": 9216, "num_attention_heads": 16,
                   "num_key_value_heads": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32}  # fmt: skip
HYBRIDS = {HYBRID: HYBRID_SHAPE, HYBRID_4B: HYBRID_4B_SHAPE}
MODELS = (*SHAPES, "smollm2", *(LLAVA + shape for shape in SHAPES), MOE, *HYBRIDS)

# On a CPU: 2 prompts × 8 completions of ≤ 96 tokens per step, 2 warm-up steps, then 10 timed ones.
WORKLOAD = {
    "prompts": 2,  # per step
    "num_generations": 8,
    "max_completion_length": 96,
    "prompt_tokens": None,  # None: the letters prompts as they come (7 tokens); N: N tokens each
    "steps": 10,  # timed steps, after the warm-up ones
    "warmup": 2,
    "learning_rate": 1e-4,
    "seed": 0,
    "gradient_accumulation_steps": 1,
    # Every completion `max_completion_length` tokens long (end-of-sequence suppressed until then, on both sides);
    # False: completions end where the model samples it.
    "fixed_length": False,
}
# SmolLM2-135M-Instruct on the sums task: 4 prompts × 8 completions of ≤ 32 tokens, the recipe's shape. A step
# takes tens of seconds on 2 CPU cores (TRL's about twice colograd's), hence few of them. Both sides train a
# step's 32 completions in 4 micro-steps of 8 (one rollout, one optimizer step), as a user bounds the
# activations of a 49k-token vocabulary model on a small machine.
SMOLLM2_WORKLOAD = {
    **WORKLOAD,
    "prompts": 4,
    "max_completion_length": 32,
    "steps": 3,
    "warmup": 1,
    "learning_rate": 1e-5,
    "gradient_accumulation_steps": 4,
}
# The Qwen2.5 shapes, on a GPU: 16 prompts × 8 completions of ≤ 256 tokens, trained in 4 micro-steps of 32. Few
# timed steps, so that both sides (each building, compiling and starting its engine) fit in minutes.
GPU_WORKLOAD = {
    **WORKLOAD,
    "prompts": 16,
    "max_completion_length": 256,
    "steps": 8,
    "gradient_accumulation_steps": 4,
}
# A vision-language model (colograd.bench.vlm): 2 prompts of one image each × 8 completions of exactly 256 tokens,
# the length of a short reasoning trace; 2 warm-up steps, then 5 timed ones.
VLM_WORKLOAD = {**WORKLOAD, "max_completion_length": 256, "steps": 5, "fixed_length": True}
# The MoE model (colograd.bench.moe): 2 prompts × 8 completions of exactly 128 tokens, so that both sides generate
# and train on the same tokens; 2 warm-up steps, then 5 timed ones.
MOE_WORKLOAD = {**WORKLOAD, "max_completion_length": 128, "steps": 5, "fixed_length": True}


def workload(model: str, **overrides: Any) -> dict[str, Any]:
    """The workload run on `model`, with `overrides` (None values ignored) replacing its settings.

    Args:
        model: a key of `SHAPES`, "smollm2", "llava-" and a key of `SHAPES`, "moe" or a key of `HYBRIDS`.
        overrides: any of `WORKLOAD`'s keys, e.g. from the benchmark's flags.

    Returns:
        The workload's settings.

    Raises:
        ConfigError: a step's completions do not divide into its micro-steps, or a prompt size is too small.
    """
    if model.startswith(LLAVA):
        base = VLM_WORKLOAD
    elif model == MOE:
        base = MOE_WORKLOAD
    else:
        base = SMOLLM2_WORKLOAD if model == "smollm2" else GPU_WORKLOAD if model.startswith("qwen2.5") else WORKLOAD
    w = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    if (w["prompts"] * w["num_generations"]) % w["gradient_accumulation_steps"]:
        raise ConfigError(
            f"--accumulation {w['gradient_accumulation_steps']} does not divide the step's "
            f"{w['prompts'] * w['num_generations']} completions; give a divisor of it."
        )
    if w["prompt_tokens"] is not None and (model == "smollm2" or model.startswith(LLAVA)):
        raise ConfigError(
            f"--prompt-tokens sizes the letters prompts; leave it out for {model} (its task has its own prompts)."
        )
    if w["prompt_tokens"] is not None and w["prompt_tokens"] < 4:
        raise ConfigError(f"--prompt-tokens {w['prompt_tokens']}: give at least 4 (a letter, then '>x:').")
    return w


def completions_per_micro_step(w: dict[str, Any]) -> int:
    """Completions in one forward + backward pass: a step's, split over its gradient accumulation steps."""
    return w["prompts"] * w["num_generations"] // w["gradient_accumulation_steps"]


def build_config(shape: str = "small", vocab_size: int = 64, context: int = 0) -> Qwen2Config:
    """The config of `SHAPES[shape]` over the tiny tokenizer's special tokens, with room for `context` tokens.

    Args:
        shape: a key of `SHAPES`.
        vocab_size: the vocabulary (the tiny tokenizer's 49 characters fit in the default 64).
        context: the longest sequence the workload makes (prompt + completion); the shape's own
            `max_position_embeddings` when larger.

    Returns:
        A `Qwen2Config` with tied embeddings, as Qwen2.5-0.5B and -1.5B have.
    """
    sizes = SHAPES[shape]
    return Qwen2Config(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        **{**sizes, "max_position_embeddings": max(sizes["max_position_embeddings"], context)},
    )


def build_model(shape: str = "small", vocab_size: int = 64, context: int = 0) -> Qwen2ForCausalLM:
    """A freshly initialised model of `SHAPES[shape]`, the same on every call (tiny: 0.4M parameters, small: 9.5M,
    qwen2.5-0.5b: 358M, qwen2.5-1.5b: 1.31B), in float32 on the CPU."""
    torch.manual_seed(WORKLOAD["seed"])
    return Qwen2ForCausalLM(build_config(shape, vocab_size, context))


def build_moe_model(vocab_size: int = 64, context: int = 0) -> Qwen3MoeForCausalLM:
    """A freshly initialised model of `MOE_SHAPE` over the tiny tokenizer's special tokens, with room for `context`
    tokens, the same on every call, in float32 on the CPU (tied embeddings, as `build_config`'s)."""
    return _build(Qwen3MoeConfig, MOE_SHAPE, vocab_size, context)


def build_hybrid_model(vocab_size: int = 64, context: int = 0, model: str = HYBRID) -> torch.nn.Module:
    """The same of `HYBRIDS[model]` (Qwen3.5's text model)."""
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}
    return _build(Qwen3_5TextConfig, HYBRIDS[model], vocab_size, context, rope_parameters=rope)


def _build(config_class: type, sizes: dict[str, Any], vocab_size: int, context: int, **extra: Any) -> torch.nn.Module:
    """A freshly initialised model of `config_class` with `sizes` over the tiny tokenizer's special tokens, with room
    for `context` tokens, seeded with the workload's seed, in float32 on the CPU, its embeddings tied."""
    config = config_class(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        **extra,
        **{**sizes, "max_position_embeddings": max(sizes["max_position_embeddings"], context)},
    )
    torch.manual_seed(WORKLOAD["seed"])
    return AutoModelForCausalLM.from_config(config)


def expert_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, parameter) pairs of the model's routed experts (transformers 5's fused `experts.gate_up_proj`
    and `experts.down_proj`), in order; not the routers."""
    return [(name, p) for name, p in model.named_parameters() if ".experts." in name]


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters outside the input embedding (tied to the output layer here): the size Qwen's reports state."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embedding)


def letters_prompts(prompt_tokens: int | None, num_prompts: int = 2048, seed: int = 0) -> Dataset:
    """The letters task's prompts, as they come (`None`: 7 tokens) or of `prompt_tokens` tokens each: a longer run
    of context letters before the arrow (one token per character), with the same `target` column."""
    dataset = tiny.letters_dataset(num_prompts, seed)
    if prompt_tokens is None:
        return dataset
    gen = torch.Generator().manual_seed(seed)
    letters = "abcd"
    rows = []
    for row in dataset:
        context = torch.randint(len(letters), (prompt_tokens - 3,), generator=gen).tolist()
        rows.append({"prompt": "".join(letters[i] for i in context) + row["prompt"][-3:], "target": row["target"]})
    return Dataset.from_list(rows)


def build_task(model: str, w: dict[str, Any]) -> tuple[torch.nn.Module, Any, Dataset, Callable]:
    """Model, tokenizer, prompts and reward of workload `w` on `model`: the pretrained model on the sums task, a
    freshly initialised LLaVA (`llava-<shape>`) on the colour task, or a freshly initialised model of
    `SHAPES[model]`, `MOE_SHAPE` ("moe") or `HYBRIDS[model]` (Qwen3.5's layers) on the letters task.

    Returns:
        (model, tokenizer (a processor for a LLaVA), train dataset, reward function).
    """
    if model.startswith(LLAVA):
        # One token per character and 4 per image: the colour prompt is 16 tokens once its image is expanded.
        text = build_config(model.removeprefix(LLAVA), context=64 + w["max_completion_length"])
        built = tiny_vlm.build_model(seed=w["seed"], text_config=text)
        return built, tiny_vlm.build_processor(), tiny_vlm.colours_dataset(), tiny_vlm.colour_reward
    if model == MOE or model in HYBRIDS:
        tokenizer = tiny.build_tokenizer()
        context = (w["prompt_tokens"] or 7) + w["max_completion_length"]
        if model == MOE:
            built = build_moe_model(len(tokenizer), context)
        else:
            built = build_hybrid_model(len(tokenizer), context, model)
        return built, tokenizer, letters_prompts(w["prompt_tokens"]), tiny.letters_reward
    if model == "smollm2":
        folder = pretrained.materialise(SMOLLM2)
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return loaded, AutoTokenizer.from_pretrained(folder), sums.sums_dataset(), sums.sum_reward
    tokenizer = tiny.build_tokenizer()
    prompt_tokens = w["prompt_tokens"] or 7
    built = build_model(model, len(tokenizer), prompt_tokens + w["max_completion_length"])
    return built, tokenizer, letters_prompts(w["prompt_tokens"]), tiny.letters_reward


def saved_model(built: torch.nn.Module, tokenizer: Any, folder: str) -> str:
    """A folder holding `built` and `tokenizer`, for a trainer that loads its model by path (TRL's colocated
    engine loads the weights from the model's `name_or_path`, empty for a model built in memory).

    Args:
        built: the model to save (float32, as built or loaded; `save_pretrained` records its class in the config's
            `architectures`, which TRL reads to load it).
        tokenizer: its tokenizer.
        folder: where to save it.

    Returns:
        The folder's path.
    """
    built.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
