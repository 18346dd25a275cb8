"""The KV cache colograd gives the engine, asked of vLLM's own start-up rule for every model of the zoo.

vLLM refuses to start when its cache cannot hold one sequence of the engine's whole context (plus the block its pool
holds back); colograd sizes the cache itself (`colograd.kv_cache`). Rather than repeat vLLM's arithmetic, each case
hands colograd's bytes to the function that raised at start-up for TRL's quickstart on 8k and 32k models
(`vllm.v1.core.kv_cache_utils.get_kv_cache_configs`), for the published configs (full size: no model is built), the
CPU's and a GPU's block sizes, small and large rollouts, prompts measured or not. No engine starts.
"""

import os
import tempfile

import pytest
import torch
import zoo
from transformers import LlamaConfig

import colograd.engine  # noqa: F401  (sets the environment vLLM reads at import)
from colograd import kv_cache, tiny
from colograd.config import GRPOConfig

# (block tokens, dtype, device bytes): vLLM's CPU attention's blocks; a GPU's 16-token blocks (FlashAttention 3) and
# 256-token ones (some FlashAttention 4 head sizes), on an 80 GB card.
DEVICES = {
    "cpu-fp32": (kv_cache.CPU_BLOCK_TOKENS, torch.float32, None),
    "cpu-bf16": (kv_cache.CPU_BLOCK_TOKENS, torch.bfloat16, None),
    "gpu-16": (16, torch.bfloat16, 80 * 10**9),
    "gpu-256": (256, torch.bfloat16, 80 * 10**9),
}
# The rollouts: TRL's quickstart (one prompt of 8 completions of up to 512 tokens, no prompt limit) with its prompts
# measured (an in-memory dataset), only sampled (a stream, an agent: the model's own context), or not known at all;
# and the Qwen recipe's (16 × 4 completions, prompts of up to 512 tokens and completions of up to 1,024).
ROLLOUTS = {
    "quickstart": ({}, 8, {"longest_prompt": 40}),
    "quickstart-stream": ({}, 8, {"prompt_tokens": 40}),
    "quickstart-unknown": ({}, 8, {}),
    "recipe": ({"max_prompt_length": 512, "max_completion_length": 1024, "per_device_train_batch_size": 16}, 64, {}),
}


@pytest.fixture(scope="module")
def vllm_config():
    """One `VllmConfig` (vLLM's own defaults for this machine) whose context, block size and batch each case sets."""
    from vllm.engine.arg_utils import EngineArgs

    with tempfile.TemporaryDirectory() as folder:
        config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=2048)  # fmt: skip
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(folder)
        tiny.build_tokenizer().save_pretrained(folder)
        return EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True).create_engine_config()


def vllm_accepts(base, specs: dict, context: int, block: int, available: int) -> bool:
    """Whether vLLM's start-up check takes `available` bytes of KV cache for these layers at this context."""
    from vllm.v1.attention.backends import utils as backends
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    config = base
    config.model_config.max_model_len = context
    config.cache_config.block_size = block
    # A sliding window's blocks depend on the tokens scheduled at once; the whole context is the most it can be.
    config.scheduler_config.max_num_batched_tokens = max(context, config.scheduler_config.max_num_batched_tokens)
    if config.cache_config.kv_cache_layout is None and hasattr(backends, "resolve_kv_cache_layout"):
        layouts = [[layout.name for layout in backends.get_supported_kv_cache_layouts([])]]
        backends.resolve_kv_cache_layout(config, layouts, list(specs.values()))
    try:
        get_kv_cache_configs(config, [dict(specs)], [available])
    except ValueError as err:
        if "To serve at least one request" in str(err) or "No available memory" in str(err):
            return False
        raise
    return True


def vllm_floor(base, specs: dict, context: int, block: int, per_token: int) -> int:
    """The fewest bytes vLLM's start-up check takes, to within one token's KV (bisection with vLLM as the oracle)."""
    low, high = 0, (context + 4 * block) * per_token
    assert vllm_accepts(base, specs, context, block, high)
    while high - low > per_token:
        mid = (low + high) // 2
        low, high = (low, mid) if vllm_accepts(base, specs, context, block, mid) else (mid, high)
    return high


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", zoo.ZOO)
def test_vllm_starts_with_the_cache_colograd_gives(name, device, rollout, vllm_config, tmp_path):
    """colograd's bytes pass vLLM's start-up check, and so does its floor (one sequence of the whole context) alone,
    which exceeds vLLM's own minimum by no more than its rounding to 256-token blocks."""
    block, dtype, device_bytes = DEVICES[device]
    overrides, seqs, prompts = ROLLOUTS[rollout]
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)
    published = zoo.ZOO[name]
    config = zoo.published_config(name)
    context = kv_cache.engine_context(args, config, prompts.get("longest_prompt"))
    available = kv_cache.rollout_kv_bytes(args, config, dtype, seqs, device_bytes, **prompts)
    per_token = kv_cache.kv_bytes_per_token(config, dtype)
    if len(set(kv_cache.sliding_windows(config))) == 1:  # one kind of layer: no padding
        assert per_token == zoo.kv_bytes_per_token(config, dtype.itemsize)  # the count by hand from the config
    specs = zoo.kv_specs(config, block, dtype)
    assert vllm_accepts(vllm_config, specs, context, block, available), (
        f"{name}: vLLM refuses {available / 2**30:.3f} GiB for a {context}-token context"
    )
    minimum = vllm_floor(vllm_config, specs, context, block, per_token)
    windowed = any(w is not None for w in kv_cache.sliding_windows(config))
    floor = kv_cache.floor_bytes(context, per_token, block, windowed)
    assert vllm_accepts(vllm_config, specs, context, block, floor)
    # Above vLLM's minimum by at most the rounding to a 256-token block and its extra blocks counted as 256 tokens.
    assert floor <= minimum + (3 if windowed else 2) * kv_cache.FLOOR_BLOCK_TOKENS * per_token
    if rollout.startswith("quickstart") and not prompts.get("longest_prompt"):
        assert context == published["max_position_embeddings"]  # nothing bounds the prompts: the model's context


def test_the_floor_counts_the_block_vllm_holds_back(vllm_config, tmp_path):
    """SmolLM2's 8k context in the CPU's 128-token blocks: 64 blocks hold one whole-context sequence, but vLLM's pool
    keeps one back, so 64 are refused (the start-up error TRL's quickstart met) and colograd's floor is more."""
    config = zoo.published_config("HuggingFaceTB/SmolLM2-135M-Instruct")
    per_token = kv_cache.kv_bytes_per_token(config, torch.float32)
    specs = zoo.kv_specs(config, 128, torch.float32)
    assert not vllm_accepts(vllm_config, specs, 8192, 128, 8192 * per_token)
    assert vllm_accepts(vllm_config, specs, 8192, 128, (8192 + 128) * per_token)
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    assert kv_cache.rollout_kv_bytes(args, config, torch.float32, 8, None) >= (8192 + 128) * per_token


def test_measured_prompts_bound_the_context_and_the_floor(tmp_path):
    """Llama-3.1-8B at 128k: without a measured prompt the floor is one 131,072-token sequence, 16 GiB of bf16 KV;
    with every prompt measured (40 tokens) the context is 40 + 512 and the cache is the rollout's need."""
    config = zoo.published_config("meta-llama/Llama-3.1-8B-Instruct")
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    whole = kv_cache.rollout_kv_bytes(args, config, torch.bfloat16, 8, 80 * 10**9, prompt_tokens=40)
    assert whole == (131072 + 256) * 128 * 1024  # 128 KiB per token: 32 layers × 8 KV heads × 128 × 2 × 2 bytes
    measured = kv_cache.rollout_kv_bytes(args, config, torch.bfloat16, 8, 80 * 10**9, longest_prompt=40)
    assert kv_cache.engine_context(args, config, longest_prompt=40) == 552
    assert measured == int(8 * zoo.whole(552, 16) * 128 * 1024 * kv_cache.MARGIN)  # 5.6 MiB, not 16 GiB
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def test_a_model_with_two_kinds_of_layer_takes_vllms_padded_slots():
    """Gemma-3-1B: 22 sliding-window layers (window 512) and 4 global ones. vLLM groups them 4 by 4 and pads the
    sliding ones to 24: 28 slots of 1 KV head × 256 dims × 2 (keys, values) × 2 bytes = 28 KiB per bf16 token."""
    config = zoo.published_config("google/gemma-3-1b-it")
    assert kv_cache.sliding_windows(config).count(512) == 22 and kv_cache.sliding_windows(config).count(None) == 4
    assert kv_cache.kv_layer_slots(config) == 28
    assert kv_cache.kv_bytes_per_token(config, torch.bfloat16) == 28 * 1024
    assert kv_cache.kv_layer_slots(zoo.published_config("meta-llama/Llama-3.1-8B-Instruct")) == 32  # one kind
