"""The engine's memory: a KV cache sized to the rollout, syncs that never walk the cache, one engine per process."""

import os

import pytest
import torch
from transformers import Qwen2Config

from colograd.config.core import GRPOConfig
from colograd.engine import kv_cache
from colograd.engine.core import Engine
from colograd.engine.settings import engine_settings
from colograd.engine.sync import WeightPlan
from colograd.errors import ConfigError
from colograd.models import tiny

# Qwen2.5-1.5B's attention: 28 layers, 12 query heads and 2 KV heads of 128 dims.
QWEN_1_5B = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                        intermediate_size=8960, vocab_size=64, max_position_embeddings=32768)  # fmt: skip


def config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(per_device_train_batch_size=128, num_generations=8, max_prompt_length=512,
                    max_completion_length=256, report_to="none")  # fmt: skip
    return GRPOConfig(output_dir=str(tmp_path), **settings | overrides)


def test_kv_bytes_per_token_by_hand():
    # keys and values × 28 layers × 2 KV heads × 128 dims × 2 bytes (bf16) = 28 KiB
    assert kv_cache.kv_bytes_per_token(QWEN_1_5B, torch.bfloat16) == 2 * 28 * 2 * 128 * 2 == 28 * 1024
    assert kv_cache.kv_bytes_per_token(QWEN_1_5B, torch.float32) == 56 * 1024
    # Tensor parallel over 2 ranks: one KV head each; over 4: still one (vLLM replicates a KV head it cannot split).
    assert kv_cache.kv_bytes_per_token(QWEN_1_5B, torch.bfloat16, tp_size=2) == 14 * 1024
    assert kv_cache.kv_bytes_per_token(QWEN_1_5B, torch.bfloat16, tp_size=4) == 14 * 1024


def test_rollout_kv_bytes_by_hand(tmp_path):
    args = config(tmp_path)
    # 128 sequences × (512 + 256 tokens: 48 blocks of 16) × 28 KiB × 1.25 margin ≈ 3.5 GB, not 24 GB (0.3 × 80 GB).
    need = 128 * (512 + 256) * 28 * 1024 * 1.25
    assert kv_cache.rollout_kv_bytes(args, QWEN_1_5B, torch.bfloat16, 128, 80 * 10**9) == pytest.approx(need, abs=1)
    # Without a GPU the cap is 1 GiB of host memory.
    assert kv_cache.rollout_kv_bytes(args, QWEN_1_5B, torch.bfloat16, 128, None) == 2**30
    # No prompt limit: the model's 32k context per sequence would need ~150 GB; the cache stops at 0.3 of the card.
    long = config(tmp_path, max_prompt_length=None)
    assert kv_cache.rollout_kv_bytes(long, QWEN_1_5B, torch.bfloat16, 128, 80 * 10**9) == 24 * 10**9
    # Never less than one sequence of the whole context and the block vLLM's pool holds back (it refuses to start
    # with less), counted in the largest blocks an attention backend takes (256 tokens).
    one = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=None)
    assert kv_cache.rollout_kv_bytes(one, QWEN_1_5B, torch.bfloat16, 1, 10**9) == (32768 + 256) * 28 * 1024
    # A context that is no whole number of the larger blocks some attention backends take: rounded up to them.
    # (A 1,000-token context, short prompts: one sequence needs 340 tokens with the margin; the floor, 1,024 + 256.)
    odd = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=None, vllm_max_model_length=1000)
    assert kv_cache.rollout_kv_bytes(odd, QWEN_1_5B, torch.bfloat16, 1, 10**9, prompt_tokens=10) == 1280 * 28 * 1024


def test_rollout_kv_bytes_from_the_longest_prompt(tmp_path):
    """Without max_prompt_length (TRL's default) the dataset's longest prompt bounds a sequence, not the context."""
    args = config(tmp_path, max_prompt_length=None)
    need = 128 * (208 + 256) * 28 * 1024 * 1.25  # a 200-token prompt and a completion: 29 blocks of 16
    assert kv_cache.rollout_kv_bytes(args, QWEN_1_5B, torch.bfloat16, 128, 80 * 10**9, 200) == int(need)
    # A prompt limit, where set, is what bounds prompts.
    limited = config(tmp_path, max_prompt_length=64)
    assert kv_cache.rollout_kv_bytes(limited, QWEN_1_5B, torch.bfloat16, 128, 80 * 10**9, 200) == int(
        128 * (64 + 256) * 28 * 1024 * 1.25
    )


def test_sampled_prompt_tokens():
    from datasets import Dataset, IterableDataset

    from colograd.data.core import sampled_prompt_tokens

    tokenizer = tiny.build_tokenizer()
    rows = [{"prompt": "ab" * (i % 50 + 1)} for i in range(1000)]  # lengths 2 to 100, the longest every 50 rows
    assert sampled_prompt_tokens(Dataset.from_list(rows), tokenizer) == 100
    assert sampled_prompt_tokens(Dataset.from_list(rows[:3]), tokenizer) == 6
    chat = [{"prompt": [{"role": "user", "content": "abcd"}]}]
    text = tokenizer.apply_chat_template(chat[0]["prompt"], tokenize=False, add_generation_prompt=True)
    templated = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert sampled_prompt_tokens(Dataset.from_list(chat), tokenizer) == templated > 4
    assert sampled_prompt_tokens(IterableDataset.from_generator(lambda: iter(rows)), tokenizer) is None


def test_engine_memory_arguments(tmp_path, monkeypatch):
    """`vllm.LLM`'s memory arguments, and what the cache is then sized for from the engine's specs (`RolloutCache`):
    nothing where the size is explicit."""
    args = config(tmp_path)
    share = config(tmp_path, vllm_gpu_memory_utilization=0.3)  # configs first: they look for a GPU themselves
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    memory, cache = kv_cache.engine_memory(args, QWEN_1_5B, torch.bfloat16, 128)
    assert memory == {"kv_cache_memory_bytes": 2**30}
    assert cache == kv_cache.RolloutCache(max_num_seqs=128, longest=768, cap=2**30)  # a prompt of 512, a completion
    small = config(tmp_path, max_completion_length=16, max_prompt_length=16, per_device_train_batch_size=8)
    expected = int(8 * 128 * 28 * 1024 * 1.25)  # CPU blocks hold 128 tokens: one per sequence of 32
    memory, cache = kv_cache.engine_memory(small, QWEN_1_5B, torch.bfloat16, 8)
    assert memory == {"kv_cache_memory_bytes": expected}
    assert cache == kv_cache.RolloutCache(max_num_seqs=8, longest=32, cap=2**30)
    explicit = config(tmp_path, vllm_kv_cache_gib=0.5)
    assert kv_cache.engine_memory(explicit, QWEN_1_5B, torch.bfloat16, 128) == ({"kv_cache_memory_bytes": 2**29}, None)

    # A GPU (stubbed: 80 GB card, 60 GB free): the rollout's cache, and vLLM's start-up check asked for what is free.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * 10**9, 80 * 10**9))
    memory, cache = kv_cache.engine_memory(args, QWEN_1_5B, torch.bfloat16, 128)
    assert memory == {"kv_cache_memory_bytes": int(128 * 768 * 28 * 1024 * 1.25), "gpu_memory_utilization": 0.675}
    assert cache == kv_cache.RolloutCache(max_num_seqs=128, longest=768, cap=int(80 * 10**9 * 0.3))
    # An explicit fraction of the card is the override.
    assert kv_cache.engine_memory(share, QWEN_1_5B, torch.bfloat16, 128) == ({"gpu_memory_utilization": 0.3}, None)


@pytest.mark.parametrize("field, value", [("vllm_gpu_memory_utilization", 1.5), ("vllm_gpu_memory_utilization", 0),
                                          ("vllm_kv_cache_gib", -1), ("vllm_dtype", "float64")])  # fmt: skip
def test_engine_memory_fields_refused(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        config(tmp_path, **{field: value})


def test_engine_dtype_opt_in_turns_correction_on(tmp_path):
    """An fp32 trainer with a bf16 engine samples from a rounded policy: the correction is on, and the engine's
    log-probs no longer stand in for the sampling policy's."""
    plain = config(tmp_path)
    assert not plain.vllm_importance_sampling_correction and plain.engine_logps_are_old_logps
    rounded = config(tmp_path, vllm_dtype="bfloat16")
    assert rounded.vllm_importance_sampling_correction and not rounded.engine_logps_are_old_logps
    assert rounded.needs_engine_logps
    same = config(tmp_path, vllm_dtype="bfloat16", bf16=True)  # the trainer computes in bf16 already
    assert not same.engine_dtype_differs and not same.vllm_importance_sampling_correction


def test_needs_engine_logps_only_where_consumed(tmp_path):
    assert not config(tmp_path).needs_engine_logps  # on-policy, no correction: nothing reads them
    assert config(tmp_path, vllm_importance_sampling_correction=True).needs_engine_logps
    assert config(tmp_path, off_policy_mask_threshold=0.5).needs_engine_logps
    # A rollout trained after an optimizer step, once, unfiltered: the engine's log-probs are the old ones.
    reused = config(tmp_path, per_device_train_batch_size=16, steps_per_generation=2)
    assert reused.reuses_rollouts_across_updates and reused.needs_engine_logps
    # ... but with num_iterations > 1 the trainer computes them.
    assert not config(tmp_path, per_device_train_batch_size=16, num_iterations=2).needs_engine_logps


def stand_in(settings: dict) -> Engine:
    """An `Engine` with these settings and no vLLM behind it: the reuse rule is pure logic."""
    engine = Engine.__new__(Engine)
    engine.settings, engine.stale, engine.weights_version, engine.lora_request = settings, False, 3, "adapter"
    return engine


def test_second_trainer_reuses_or_is_refused(tmp_path, monkeypatch):
    import colograd.engine.core as engine_module

    model, tokenizer = tiny.build_model(), tiny.build_tokenizer()
    args = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=32, max_completion_length=16)
    held = stand_in(engine_settings(model, tokenizer, args))
    monkeypatch.setattr(engine_module, "_PROCESS_ENGINE", held)
    monkeypatch.setattr(engine_module, "one_engine_per_process", lambda: True)
    monkeypatch.setattr(Engine, "__init__", lambda *a, **k: pytest.fail("a second engine was started"))

    # Same settings (another run's output_dir, learning rate, seed): the same engine, its weights to be synced anew.
    again = config(tmp_path / "other", per_device_train_batch_size=8, max_prompt_length=32, max_completion_length=16,
                   learning_rate=1e-3)  # fmt: skip
    assert Engine.acquire(tiny.build_model(), tokenizer, again) is held
    assert held.stale and held.weights_version == 4 and held.lora_request is None

    # A longer completion changes the engine's context: one line naming it, before anything starts.
    longer = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=32, max_completion_length=64)
    with pytest.raises(ConfigError, match=r"already holds a colograd engine.*max_model_len.*restart"):
        Engine.acquire(model, tokenizer, longer)
    wider = tiny.build_model()
    wider.config.num_hidden_layers = 3
    with pytest.raises(ConfigError, match="architecture"):
        Engine.acquire(wider, tokenizer, args)
    with pytest.raises(ConfigError, match="dtype"):
        Engine.acquire(model, tokenizer, config(tmp_path, per_device_train_batch_size=8, max_prompt_length=32,
                                                max_completion_length=16, vllm_dtype="bfloat16"))  # fmt: skip


def test_without_gpu_each_trainer_gets_its_own_engine(tmp_path, monkeypatch):
    import colograd.engine.core as engine_module

    monkeypatch.setattr(engine_module, "_PROCESS_ENGINE", None)
    built = []
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **k: built.append(self))
    args = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=32, max_completion_length=16)
    first = Engine.acquire(tiny.build_model(), tiny.build_tokenizer(), args)
    second = Engine.acquire(tiny.build_model(), tiny.build_tokenizer(), args)
    # Each held by its trainer alone: a dropped trainer's engine goes with it, not later under another one.
    assert built == [first, second] and engine_module._PROCESS_ENGINE is None


@pytest.mark.slow
def test_sync_salts_the_prefix_cache_instead_of_walking_it(tmp_path, monkeypatch):
    """A sync never resets the prefix cache (vLLM walks every block to do it), and no prompt KV computed under the
    old weights is reused after it; between syncs a repeated prompt is served from the cache."""
    from vllm import SamplingParams
    from vllm.v1.core.block_pool import BlockPool

    walks = []
    reset = BlockPool.reset_prefix_cache
    monkeypatch.setattr(BlockPool, "reset_prefix_cache", lambda self: walks.append(1) or reset(self))
    model, tokenizer = tiny.build_model().eval(), tiny.build_tokenizer()
    args = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=200, max_completion_length=8,
                  vllm_enforce_eager=True)  # fmt: skip
    engine = Engine(model, tokenizer, args)
    # Sized to the rollout: 8 sequences of up to 200 + 8 tokens (two 128-token CPU blocks each), with margin; far
    # below the 1 GiB cap.
    per_token = kv_cache.kv_bytes_per_token(model.config, torch.float32)
    most = kv_cache.rollout_kv_bytes(args, model.config, torch.float32, 8, None)
    assert 8 * 256 * per_token <= engine.kv_cache_bytes <= most
    plan = WeightPlan(model)
    plan.sync(engine)
    prompt = tokenizer("abcd" * 40 + ">a:")["input_ids"]  # over one 128-token block: a block to cache
    params = SamplingParams(max_tokens=2)

    def cached_tokens() -> int:
        return engine.llm.generate([engine.prompt(prompt)], params, use_tqdm=False)[0].num_cached_tokens

    cached_tokens()
    assert cached_tokens() > 0  # the same weights: the prompt's blocks are reused
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    plan.sync(engine)
    assert cached_tokens() == 0  # new weights: nothing computed under the old ones
    assert cached_tokens() > 0
    assert walks == []


@pytest.mark.parametrize(
    "settings, refused",
    [({}, True), ({"bf16": True}, False), ({"vllm_dtype": "bfloat16"}, False), ({"lora": False}, False)],
)
def test_adapter_lora_on_gpu_needs_a_16_bit_engine(tmp_path, monkeypatch, settings, refused):
    """vLLM's GPU LoRA kernels take fp16/bf16 activations only: an fp32 engine serving an adapter is refused before
    start-up on a GPU (stubbed platform), where the CPU build would have accepted it."""
    from vllm.platforms import current_platform

    from colograd.preflight.engine import check_engine

    lora = settings.pop("lora", True)
    args = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=32, max_completion_length=16, **settings)
    model = tiny.build_model()
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "supported_dtypes", [torch.float32, torch.bfloat16, torch.float16])
    check = lambda: check_engine(args, model.config, torch.float32, lora_rank=8 if lora else None)  # noqa: E731
    if refused:
        with pytest.raises(ConfigError, match=r"lora_sync: adapter on a GPU.*bf16: true.*merged"):
            check()
    else:
        check()


@pytest.mark.parametrize(
    "dtype, matmul_precision, preset, expected",
    [
        (torch.float32, "highest", None, "ieee"),
        (torch.float32, "high", None, "tf32"),
        (torch.bfloat16, "highest", None, None),
        (torch.float32, "highest", "tf32", None),
    ],
    ids=["fp32-exact", "fp32-tf32-trainer", "bf16-engine", "user-setting-kept"],
)
def test_float32_engine_on_a_gpu_multiplies_as_the_trainer_does(
    dtype, matmul_precision, preset, expected, monkeypatch
):
    """A float32 engine's Triton attention follows the trainer's float32 matmul precision (TF32 only where the
    trainer allows it: measured 2.0e-3 nat of engine/trainer gap on an H100 otherwise, 1.4e-6 with IEEE)."""
    from colograd.engine.settings import triton_fp32_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_F32_DEFAULT", preset or "recorded, so that the test's own setting is undone")
    if preset is None:
        monkeypatch.delenv("TRITON_F32_DEFAULT")
    kept = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        assert triton_fp32_precision(dtype) == expected
    finally:
        torch.set_float32_matmul_precision(kept)
    import os

    assert os.environ.get("TRITON_F32_DEFAULT") == (expected or preset)


@pytest.mark.slow
def test_a_dropped_trainer_is_freed_with_its_engine_and_optimizer():
    """A process that trains one trainer after another (a notebook, a sweep) frees each one it drops, engine
    included, and the next one trains. Two things had kept them: vLLM freezes the start-up heap against garbage
    collection (the trainer being built is in it), and a vLLM module keeps an import error whose traceback holds
    the frames that first imported it (a trainer's own); and vLLM's records for reloading each layer hold their
    layer. Freed, an engine must not take vLLM's process-wide parallel groups with it."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    script = ROOT / "tests/scripts/dropped_trainers.py"
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    alive = json.loads(done.stdout.strip().splitlines()[-1])["alive"]
    assert alive == [False] * 8, f"still alive (trainer, optimizer, engine, engine's embedding) × 2: {alive}"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_released_kv_cache_gives_its_pages_back_and_reads_as_allocated():
    from types import SimpleNamespace

    from colograd.engine import cpu as engine_cpu

    page = os.sysconf("SC_PAGE_SIZE")
    buffer = torch.zeros(64 * 2**20, dtype=torch.int8)  # as vLLM allocates a CPU cache: one buffer, a view per layer
    views = [buffer[: 32 * 2**20].view(-1, 1024), buffer[32 * 2**20 :].view(-1, 1024)]
    buffer.fill_(7)  # a rollout wrote into every page
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=views))
    before = _resident_bytes()
    dropped = engine_cpu.release_kv_cache(worker)
    # The whole pages inside the buffer, once for both views (its first and last may be shared with other memory).
    assert buffer.numel() - 2 * page <= dropped <= buffer.numel()
    assert before - _resident_bytes() >= 0.9 * dropped
    assert torch.count_nonzero(buffer) <= 2 * page  # zeroed, as torch.zeros left it, but for the edge pages
    assert engine_cpu.release_kv_cache(SimpleNamespace()) == 0  # a worker without such a cache: nothing to do


@pytest.mark.slow
def test_an_engine_samples_the_same_after_its_kv_cache_is_released(tmp_path):
    """The KV cache released between rollouts (its pages dropped, the cached prefixes forgotten) serves the next one
    as a fresh cache: the same seeded requests sample the same tokens with the same log-probs."""
    from vllm import SamplingParams

    from colograd.engine import cpu as engine_cpu

    model, tokenizer = tiny.build_model().eval(), tiny.build_tokenizer()
    args = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=200, max_completion_length=16,
                  vllm_enforce_eager=True)  # fmt: skip
    engine = Engine(model, tokenizer, args)
    WeightPlan(model).sync(engine)
    prompt = engine.prompt(tokenizer("abcd" * 40 + ">a:")["input_ids"])  # over one block: a prefix to cache
    params = SamplingParams(max_tokens=16, n=4, seed=3, logprobs=0, ignore_eos=True)

    def sample() -> list[tuple[list[int], list[float]]]:
        out = engine.llm.generate([prompt], params, use_tqdm=False)[0].outputs
        return [
            (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]) for c in out
        ]

    first = sample()
    dropped = sum(engine.llm.collective_rpc(engine_cpu.release_kv_cache))
    assert dropped >= 0.9 * engine.kv_cache_bytes
    engine.llm.reset_prefix_cache()
    assert sample() == first


@pytest.mark.slow
def test_an_engine_that_released_its_packed_weights_samples_the_same_after_the_next_sync(tmp_path):
    """After a rollout, an engine that repacks its linear weights drops the packed copies (a sync packs them again)
    and is stale: the next rollout's sync writes it whole, and the same seeded requests sample the same tokens with
    the same log-probs. Between the two, the engine refuses to sample instead of computing from freed memory."""
    from vllm import SamplingParams

    model, tokenizer = tiny.build_model().eval(), tiny.build_tokenizer()
    args = config(tmp_path, per_device_train_batch_size=8, max_prompt_length=200, max_completion_length=16,
                  vllm_enforce_eager=True)  # fmt: skip
    assert args.vllm_cpu_repack_weights  # the default: the engine packs its linear weights
    engine = Engine(model, tokenizer, args)
    assert not engine.direct_load
    plan, syncs = WeightPlan(model), []

    def sync() -> None:  # as the trainer's: write the weights only where the engine lacks them
        if engine.stale:
            plan.sync(engine)
            syncs.append(engine.weights_version)

    prompt = engine.prompt(tokenizer("abcd" * 10 + ">a:")["input_ids"])
    params = SamplingParams(max_tokens=16, n=4, seed=3, logprobs=0, ignore_eos=True)

    def sample() -> list[tuple[list[int], list[float]]]:
        out = engine.llm.generate([prompt], params, use_tqdm=False)[0].outputs
        return [
            (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]) for c in out
        ]

    sync()
    with engine.awake():
        first = sample()
    assert engine.stale and engine.packed_released and syncs == [1]
    with pytest.raises(RuntimeError, match="released its packed weights"):
        engine.prompt_logprobs(prompt["prompt_token_ids"])
    sync()
    with engine.awake():
        assert sample() == first
    assert syncs == [1, 2]  # written whole again, though the trainer's weights did not change
