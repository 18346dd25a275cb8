"""The model zoo: the published `config.json` values of the models people train with GRPO, as facts, and the
shrinking that lets each run on a CPU in seconds.

Each entry is the model's own config.json (the keys that shape attention, rope, the vocabulary, tying, windows and
experts; the rest are transformers' defaults), read from huggingface.co/<id>/blob/main/config.json as first published
and cross-checked against independent copies (mlc-llm's `model_preset.py` at 79d603f, litgpt's `config.py` at
2685705, and configs vendored in test fixtures); docs/real-models.md has the table with the sources.

`shrunk` changes width and depth only: hidden size, layers, MLP (and expert) width. The context, the vocabulary,
rope type and scaling, tying, the head dimension, the ratio of query to KV heads, windows and the number of experts
stay real. Where the architecture ties the head dimension to the hidden size (vLLM's Qwen2 computes it as
hidden_size / heads; transformers checks Phi-3's rope factors against it), the hidden size can only shrink with the
head count: such a model keeps its head dimension and GQA ratio with one KV head.
"""

import math
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerFast

QWEN2_5 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0,
           "use_sliding_window": False, "rms_norm_eps": 1e-06, "hidden_act": "silu", "bos_token_id": 151643,
           "eos_token_id": 151645}  # fmt: skip
QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
         "max_position_embeddings": 40960, "head_dim": 128, "rope_theta": 1000000, "use_sliding_window": False,
         "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643,
         "eos_token_id": 151645}  # fmt: skip
LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
          "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
          "attention_bias": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}  # fmt: skip
LLAMA3_2_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
SMOLLM2 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-05, "hidden_act": "silu",
           "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # fmt: skip
# Phi-4-mini's longrope factors, one per rotated dimension pair (96 of its 128 head dims rotate).
PHI4_LONG_FACTOR = [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                    5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                    11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                    25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                    32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]  # fmt: skip

ZOO: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": {**QWEN2_5, "vocab_size": 151936, "max_position_embeddings": 32768,
                                   "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                                   "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
                                   "sliding_window": 32768, "max_window_layers": 21},
    "Qwen/Qwen2.5-1.5B-Instruct": {**QWEN2_5, "vocab_size": 151936, "max_position_embeddings": 32768,
                                   "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                                   "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True,
                                   "sliding_window": 32768, "max_window_layers": 21},
    "Qwen/Qwen2.5-7B-Instruct": {**QWEN2_5, "vocab_size": 152064, "max_position_embeddings": 32768,
                                 "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                                 "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
                                 "sliding_window": 131072, "max_window_layers": 28},
    "Qwen/Qwen3-0.6B": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True,
                        "max_window_layers": 28},
    "Qwen/Qwen3-4B": {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                      "max_window_layers": 36},
    "Qwen/Qwen3-8B": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                      "max_window_layers": 36},
    "Qwen/Qwen3-30B-A3B": {**QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                           "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                           "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
                           "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
                           "rope_theta": 1000000.0, "max_window_layers": 48},
    "meta-llama/Llama-3.2-1B-Instruct": {**LLAMA3, "hidden_size": 2048, "intermediate_size": 8192,
                                         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                                         "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": LLAMA3_2_ROPE},
    "meta-llama/Llama-3.2-3B-Instruct": {**LLAMA3, "hidden_size": 3072, "intermediate_size": 8192,
                                         "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
                                         "head_dim": 128, "tie_word_embeddings": True, "rope_scaling": LLAMA3_2_ROPE},
    "meta-llama/Llama-3.1-8B-Instruct": {**LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                         "tie_word_embeddings": False,
                                         "rope_scaling": {**LLAMA3_2_ROPE, "factor": 8.0}},
    "HuggingFaceTB/SmolLM2-135M-Instruct": {**SMOLLM2, "hidden_size": 576, "intermediate_size": 1536,
                                            "num_hidden_layers": 30, "num_attention_heads": 9,
                                            "num_key_value_heads": 3, "rope_theta": 100000},
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": {**SMOLLM2, "hidden_size": 2048, "intermediate_size": 8192,
                                            "num_hidden_layers": 24, "num_attention_heads": 32,
                                            "num_key_value_heads": 32, "rope_theta": 130000},
    "google/gemma-3-1b-it": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                             "vocab_size": 262144, "max_position_embeddings": 32768, "hidden_size": 1152,
                             "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                             "num_key_value_heads": 1, "head_dim": 256, "rope_theta": 1000000,
                             "rope_local_base_freq": 10000, "sliding_window": 512, "sliding_window_pattern": 6,
                             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
                             "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "bos_token_id": 2,
                             "eos_token_id": [1, 106], "pad_token_id": 0},
    "microsoft/Phi-4-mini-instruct": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                                      "vocab_size": 200064, "max_position_embeddings": 131072,
                                      "original_max_position_embeddings": 4096, "hidden_size": 3072,
                                      "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
                                      "num_key_value_heads": 8, "tie_word_embeddings": True, "rope_theta": 10000.0,
                                      "rope_scaling": {"type": "longrope", "long_factor": PHI4_LONG_FACTOR,
                                                       "short_factor": [1.0] * 48},
                                      "partial_rotary_factor": 0.75, "sliding_window": 262144,
                                      "rms_norm_eps": 1e-05, "hidden_act": "silu", "attention_bias": False,
                                      "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999},
    "mistralai/Mistral-7B-Instruct-v0.3": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                           "vocab_size": 32768, "max_position_embeddings": 32768,
                                           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                           "num_attention_heads": 32, "num_key_value_heads": 8,
                                           "tie_word_embeddings": False, "rope_theta": 1000000.0,
                                           "sliding_window": None, "rms_norm_eps": 1e-05, "hidden_act": "silu",
                                           "bos_token_id": 1, "eos_token_id": 2},
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": {**QWEN2_5, "vocab_size": 151936, "max_position_embeddings": 131072,
                                                  "hidden_size": 1536, "intermediate_size": 8960,
                                                  "num_hidden_layers": 28, "num_attention_heads": 12,
                                                  "num_key_value_heads": 2, "tie_word_embeddings": False,
                                                  "rope_theta": 10000, "sliding_window": 4096,
                                                  "max_window_layers": 21, "eos_token_id": 151643},
}  # fmt: skip

# Width after shrinking (where the architecture lets the hidden size shrink on its own) and MLP / expert width.
HIDDEN = 64
INTERMEDIATE = 128
MOE_INTERMEDIATE = 32
LAYERS = 2
# Architectures where the head dimension follows the hidden size: vLLM's qwen2.py computes it so, and transformers
# checks Phi-3's longrope factors (one per rotated pair) against hidden_size / heads.
HEAD_DIM_FROM_HIDDEN = {"qwen2", "phi3"}


def head_dim(published: dict[str, Any]) -> int:
    """The model's head dimension: its `head_dim`, else hidden size / heads."""
    return published.get("head_dim") or published["hidden_size"] // published["num_attention_heads"]


def layers(published: dict[str, Any]) -> int:
    """Depth after shrinking: 2, or one whole period of a sliding/global pattern (Gemma 3: 5 local, 1 global)."""
    return published.get("sliding_window_pattern") or LAYERS


def layer_types(period: int, layers: int) -> list[str]:
    """Gemma 3's `sliding_window_pattern` as transformers 5 lists it: each `period`-th layer global, the rest local."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def shrunk(name: str) -> PretrainedConfig:
    """`name`'s published config, shrunk in width and depth only (see the module's docstring)."""
    published = ZOO[name]
    values = {**published, "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers(published)}
    dim = head_dim(published)
    if published["model_type"] in HEAD_DIM_FROM_HIDDEN:
        ratio = published["num_attention_heads"] // published["num_key_value_heads"]
        values |= {"num_attention_heads": ratio, "num_key_value_heads": 1, "hidden_size": ratio * dim}
    else:  # transformers checks that the hidden size is a whole number of heads
        heads = published["num_attention_heads"]
        values |= {"hidden_size": heads * math.ceil(HIDDEN / heads), "head_dim": dim}
    if "moe_intermediate_size" in published:
        values["moe_intermediate_size"] = MOE_INTERMEDIATE
    if "max_window_layers" in published:
        values["max_window_layers"] = min(published["max_window_layers"], values["num_hidden_layers"])
    if "sliding_window_pattern" in published:  # transformers 5 reads the pattern as layer types
        values["layer_types"] = layer_types(published["sliding_window_pattern"], values["num_hidden_layers"])
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    config.architectures = published["architectures"]
    return config


def special_ids(config: PretrainedConfig) -> dict[str, int]:
    """The model's special tokens by role, at their real ids: the first end-of-sequence id is the tokenizer's EOS."""
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    ids = {"eos": eos[0], **{f"eos{i}": e for i, e in enumerate(eos[1:], 1)}}
    if config.bos_token_id is not None and config.bos_token_id not in eos:
        ids["bos"] = config.bos_token_id
    if config.pad_token_id is not None and config.pad_token_id not in ids.values():
        ids["pad"] = config.pad_token_id
    return ids


CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=?.,:;<>()[]{}'\"!\n") + ["A", "B", "C", "D"]


def tokenizer_for(config: PretrainedConfig) -> PreTrainedTokenizerFast:
    """A character tokenizer over the model's whole vocabulary: one token per character in the low ids, the special
    tokens at the model's own ids (end-of-sequence, beginning, padding), filler tokens everywhere else, so that any id
    the engine samples decodes; a ChatML-like template in those characters."""
    specials = special_ids(config)
    by_id = {i: f"<|{role}|>" for role, i in specials.items()}
    free = (i for i in range(config.vocab_size) if i not in by_id)
    vocab = {token: i for i, token in by_id.items()} | {ch: next(free) for ch in CHARS}
    used = set(vocab.values())
    vocab |= {f"<t{i}>": i for i in range(config.vocab_size) if i not in used}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=by_id[specials["eos"]]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    pad = by_id[specials["pad"]] if "pad" in specials else by_id[specials["eos"]]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=by_id[specials["eos"]], pad_token=pad)
    tokenizer.add_special_tokens({"additional_special_tokens": sorted(by_id.values())})
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    return tokenizer


def stopping_model(name: str, seed: int = 0, eos_probability: float = 0.25) -> Any:
    """`name`'s shrunk model (float32, random weights) edited to end its answers after a few tokens, with its
    tokenizer: at every position it samples its end-of-sequence token with about `eos_probability`, so completions are
    a few tokens long (as a chat model's answer to a short question is) rather than a random model's whole
    `max_completion_length` over a 150k-token vocabulary.

    The edit: every token's embedding gets the same first coordinate, so the final hidden state of every position
    shares a positive first coordinate; the output layer's end-of-sequence row is then raised along it, by as much as
    one forward pass says gives that probability. Every shape stays as it was."""
    import torch
    from transformers import AutoModelForCausalLM

    config = shrunk(name)
    tokenizer = tokenizer_for(config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        embed[:, 0] = 1.0
        text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm: [T, H]
        logits = model(ids).logits[0]  # [T, V]
        # Raise the EOS logit to log(p / (1 - p)) above the log-sum-exp of the others, at the median position.
        others = torch.logsumexp(torch.cat([logits[:, :eos], logits[:, eos + 1 :]], dim=1), dim=1)
        target = others + math.log(eos_probability / (1 - eos_probability))
        raise_by = ((target - logits[:, eos]) / hidden[:, 0]).median()
        head[eos, 0] += raise_by
    return model, tokenizer


def kv_bytes_per_token(config: PretrainedConfig, itemsize: int) -> int:
    """Keys and values of every layer's KV heads for one token, worked out by hand from the config (without the
    padding vLLM adds to a model with layers of two kinds)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config.to_dict()) * itemsize


def whole(tokens: int, block: int) -> int:
    return math.ceil(tokens / block) * block


def kv_specs(config: PretrainedConfig, block_size: int, dtype: Any, tp_size: int = 1) -> dict[str, Any]:
    """The KV cache spec of each attention layer, as an engine of this config reports them to vLLM's start-up check
    (checked against a real engine's in tests/test_zoo.py)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from colograd.kv_cache import sliding_windows

    dim = head_dim(config.to_dict())
    heads = max(1, config.num_key_value_heads // tp_size)
    specs = {}
    for i, window in enumerate(sliding_windows(config)):
        common = {"block_size": block_size, "num_kv_heads": heads, "head_size": dim, "dtype": dtype}
        spec = FullAttentionSpec(**common) if window is None else SlidingWindowSpec(**common, sliding_window=window)
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    return specs


def published_config(name: str) -> PretrainedConfig:
    """`name`'s config as published, full size (for arithmetic: no model is built from it)."""
    published = dict(ZOO[name])
    if "sliding_window_pattern" in published:
        published["layer_types"] = layer_types(published["sliding_window_pattern"], published["num_hidden_layers"])
    config = AutoConfig.for_model(published.pop("model_type"), **published)
    config.architectures = ZOO[name]["architectures"]
    return config
