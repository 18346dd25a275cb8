"""A tiny model, tokenizer and task built locally, so the default recipe and the tests need no download.

The model is a 2-layer Qwen2 (hidden 128, 2 heads → head_dim 64, a size vLLM's CPU attention accepts) over a
character-level vocabulary. The task is "answer with the letter after the arrow": the prompt ``"abd>b:"``
asks for completions made of ``b``. A randomly initialised model samples almost uniformly over the
vocabulary, so the reward starts near zero and rises within a few dozen GRPO steps — a visible learning
signal in minutes on a CPU.
"""

import random

from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from colograd.config.core import GRPOConfig

PREFIX = "colograd:"
TINY_MODELS = {"colograd:tiny-qwen2": False, "colograd:tiny-qwen2-tied": True}

_SPECIALS = ["<pad>", "<eos>"]
_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,:;>=+-?!")
_TASK_LETTERS = "abcd"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one token per character, plus ``<pad>`` and ``<eos>``."""
    vocab = {tok: i for i, tok in enumerate(_SPECIALS + _CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    # Chats in the characters the vocabulary has: "s:system;u:user;a:" (each role's first letter).
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    return tokenizer


def build_model(tie_word_embeddings: bool = False, seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised 2-layer Qwen2 (~0.4M parameters), identical for a given seed on every rank."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(model_config(tie_word_embeddings))


def model_config(tie_word_embeddings: bool = False) -> Qwen2Config:
    """The tiny Qwen2's config (also the text model of `colograd.models.tiny_vlm`)."""
    return Qwen2Config(
        vocab_size=64,  # the tokenizer uses 49; a round size, as real models pad theirs
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )


def letters_dataset(num_prompts: int = 2048, seed: int = 0) -> Dataset:
    """Prompts like ``"cabd>b:"``; the ``target`` column is the letter the completion should repeat."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        context = "".join(rng.choice(_TASK_LETTERS) for _ in range(4))
        target = rng.choice(_TASK_LETTERS)
        rows.append({"prompt": f"{context}>{target}:", "target": target})
    return Dataset.from_list(rows)


def letters_reward(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """Fraction of the completion's characters that are the target letter (0 for an empty completion)."""
    return [c.count(t) / len(c) if c else 0.0 for c, t in zip(completions, target, strict=True)]


def run_config(output_dir: str, steps: int, **overrides) -> GRPOConfig:
    """The settings of recipes/grpo_tiny.yaml for a run in code (tests, benchmarks): 8 prompts × 8 completions
    per rank, 8 tokens each, no saving or reporting; `overrides` replace any of them."""
    defaults = dict(
        num_generations=8,
        per_device_train_batch_size=64,
        max_prompt_length=16,
        max_completion_length=8,
        learning_rate=2e-3,
        lr_scheduler_type="constant",
        seed=42,
        vllm_kv_cache_gib=0.25,
        vllm_enforce_eager=True,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return GRPOConfig(output_dir=output_dir, max_steps=steps, **{**defaults, **overrides})
