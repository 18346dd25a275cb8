"""The engine and the sync on their own, in one process, for several architectures vLLM supports."""

import random
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from colograd import GRPOConfig
from colograd.engine import lora, sync
from colograd.engine import weights as engine_weights
from colograd.engine.core import Engine
from colograd.engine.requests import Sampling
from colograd.engine.sync import WeightPlan
from colograd.models import tiny
from colograd.runs import time_limit

pytestmark = pytest.mark.slow  # every test starts a vLLM engine


def llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def gpt2() -> torch.nn.Module:
    # Conv1D weights (transposed) and a fused c_attn: the engine's loader must translate both; head tied.
    config = GPT2Config(
        vocab_size=64, n_embd=128, n_layer=2, n_head=2, n_positions=256, eos_token_id=1, bos_token_id=1
    )
    return GPT2LMHeadModel(config)


ARCHITECTURES = {
    "qwen2": lambda: tiny.build_model(tie_word_embeddings=False),
    "qwen2-tied": lambda: tiny.build_model(tie_word_embeddings=True),
    "llama-gqa": llama,
    "gpt2-tied": gpt2,
}


def trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize(
    "arch, bucket_bytes, repack",
    [(arch, None, False) for arch in ARCHITECTURES]
    + [("qwen2-tied", 1, False), ("llama-gqa", 200_000, False)]
    + [("qwen2-tied", None, True), ("gpt2-tied", None, True), ("qwen2-tied", 1, True)],
    ids=lambda v: (
        v if isinstance(v, str) else {None: "whole", False: "direct", True: "repacked"}.get(v, f"buckets{v}")
    ),
)
def test_sync_gives_engine_the_trainer_weights(arch, bucket_bytes, repack, tmp_path):
    """One engine call, or (with `bucket_bytes`) one call per bucket of layers: a 1-byte budget sends every
    layer on its own; 200 kB sends several together. `repack`: vLLM's CPU default, where linear weights are
    repacked into oneDNN handles and a sync must re-run that processing (the reload path)."""
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]().eval()
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none", vllm_cpu_repack_weights=repack)  # fmt: skip
    engine = Engine(model, tokenizer, args)
    assert engine.direct_load is not repack
    ids = tokenizer("abcd>b:bbbb and more text")["input_ids"]

    plan = WeightPlan(model, bucket_bytes)
    assert len(plan.buckets) > 2 if bucket_bytes else len(plan.buckets) == 1
    plan.sync(engine)
    assert (engine.prompt_logprobs(ids) - trainer_logprobs(model, ids)).abs().max() <= 1e-4

    # A second sync after the weights move (as after an optimizer step), every tensor changed.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    before = engine.prompt_logprobs(ids)
    plan.sync(engine)
    after = engine.prompt_logprobs(ids)
    expected = trainer_logprobs(model, ids)
    assert (before - expected).abs().max() > 1e-2  # the change is large enough to notice
    assert (after - expected).abs().max() <= 1e-4


def lora_model(r: int = 8, **options) -> torch.nn.Module:
    """The tiny Qwen2 with LoRA on every linear layer and non-zero B, so the adapter changes the outputs; a
    `modules_to_save` copy (in `options`) is moved away from the original, so that it matters too."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(tiny.build_model(), LoraConfig(r=r, lora_alpha=16, target_modules=targets, **options))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
            if ".modules_to_save." in name:
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


def move_adapter(model: torch.nn.Module) -> None:
    """Change every adapter tensor, as an optimizer step on a LoRA model does."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.2)


def count_adapter_loads(engine: Engine) -> Callable[[], int]:
    """Count the engine's adapter loads (reads of the adapter's folder): wraps its worker's loader."""

    def wrap(worker) -> None:
        manager = worker.model_runner.lora_manager
        load, manager.loads = manager._load_adapter, 0

        def counting(request):
            manager.loads += 1
            return load(request)

        manager._load_adapter = counting

    engine.llm.collective_rpc(wrap)
    return lambda: engine.llm.collective_rpc(lambda worker: worker.model_runner.lora_manager.loads)[0]


@pytest.mark.parametrize("repack", [True, False], ids=["repacked", "direct"])
@pytest.mark.parametrize("adapter_only", [False, True], ids=["lora-merged", "lora-adapter-only"])
def test_lora_sync_gives_engine_the_adapted_model(adapter_only, repack, tmp_path, monkeypatch):
    """Merged: with a trained `modules_to_save` copy of the head, sent in place of the original. Adapter only:
    rank 4, which vLLM's LoRA does not take as is (the engine rounds up to 8); the adapter is read from its
    folder once, at the first sync, however many engine steps follow, and later versions are served from memory;
    with `repack` off, /dev/shm is made too small, so the adapter goes to a disk folder."""
    torch.manual_seed(0)
    model = lora_model(r=4) if adapter_only else lora_model(modules_to_save=["lm_head"])
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none")  # fmt: skip
    args.vllm_cpu_repack_weights = repack
    engine = Engine(model, tokenizer, args, lora_rank=4 if adapter_only else None)
    assert engine.direct_load is not repack
    ids = tokenizer("abcd>b:bbbb and more text")["input_ids"]
    with model.disable_adapter():
        base = trainer_logprobs(model, ids)
    if adapter_only:
        loads = count_adapter_loads(engine)
    if not repack:
        monkeypatch.setattr(lora.shutil, "disk_usage", lambda path: SimpleNamespace(free=1024))

    def rollout() -> None:  # prompt log-probs (one engine step), then completions (several steps)
        assert (engine.prompt_logprobs(ids) - trainer_logprobs(model, ids)).abs().max() <= 1e-4
        assert len(engine.generate([ids[:8]], Sampling.of(args)).completion_ids) == args.num_generations

    plan = WeightPlan(model, adapter_only=adapter_only)
    first = plan.sync(engine)
    rollout()
    assert (trainer_logprobs(model, ids) - base).abs().max() > 1e-2  # the adapter matters

    move_adapter(model)
    second = plan.sync(engine)
    rollout()
    if adapter_only:
        assert loads() == 1  # its folder once; later versions go from the tensors straight into the engine's slot
        assert engine._adapter_dir.name.startswith("/dev/shm/") is repack
        # The adapter's folder is removed even by a stuck process's exit (`time_limit.exit_stuck`), in /dev/shm too.
        assert engine._adapter_dir in set(time_limit._FOLDERS)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    if adapter_only:  # after the first sync, only the adapter moves
        assert second == adapter_bytes and first == plan.nbytes + adapter_bytes
    else:
        assert second == first


def test_adapter_only_sync_reaches_lora_wrappers_that_do_not_forward(tmp_path, monkeypatch):
    """vLLM 0.26's LoRA wrappers neither load weights nor forward to their `base_layer` (0.32 added both). Made to
    behave so here, the base weights still reach the engine under `base_layer` names: parity after the first sync
    and after the adapter moves. Without the renaming the first sync raises "There is no module or parameter"."""
    from vllm.lora.layers.base import BaseLayerWithLoRA

    forward = BaseLayerWithLoRA.__getattr__

    def no_loading(self, name):
        if name == "load_weights":
            raise AttributeError(name)
        return forward(self, name)

    monkeypatch.delattr(BaseLayerWithLoRA, "load_weights")
    monkeypatch.setattr(BaseLayerWithLoRA, "__getattr__", no_loading)
    torch.manual_seed(0)
    model = lora_model()
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none", vllm_cpu_repack_weights=False)  # fmt: skip
    engine = Engine(model, tokenizer, args, lora_rank=8)
    hidden = engine.llm.collective_rpc(
        lambda worker: sorted(engine_weights._hidden_lora_wrappers(worker.model_runner.model))
    )[0]
    assert "model.layers.0.self_attn.qkv_proj" in hidden and "model.layers.1.mlp.gate_up_proj" in hidden
    ids = tokenizer("abcd>b:bbbb and more text")["input_ids"]
    plan = WeightPlan(model, adapter_only=True)
    for _ in range(2):
        plan.sync(engine)
        assert (engine.prompt_logprobs(ids) - trainer_logprobs(model, ids)).abs().max() <= 1e-4
        move_adapter(model)


def test_merged_lora_builds_one_bucket_of_weights_at_a_time(tmp_path, monkeypatch):
    """Every merged (base + B·A) tensor the sync builds is tracked while alive: in buckets of one decoder layer
    (a 1-byte budget), no more than the largest bucket's bytes exist at once; in one bucket, all of them do."""
    torch.manual_seed(0)
    model = lora_model()
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none", vllm_cpu_repack_weights=False)  # fmt: skip
    engine = Engine(model, tokenizer, args)
    ids = tokenizer("abcd>b:bbbb and more text")["input_ids"]
    alive: list[tuple[weakref.ref, int]] = []
    peak = [0]
    build = sync._tensor

    def tracked(model, unit, reread):
        tensor = build(model, unit, reread)
        if unit.lora is not None:
            alive.append((weakref.ref(tensor), tensor.nbytes))
            peak[0] = max(peak[0], sum(n for ref, n in alive if ref() is not None))
        return tensor

    monkeypatch.setattr(sync, "_tensor", tracked)
    merged_bytes = sum(u.param.nbytes for u in WeightPlan(model).buckets[0] if u.lora is not None)

    whole = WeightPlan(model)
    whole.sync(engine)
    assert peak[0] == merged_bytes  # one bucket: every merged weight at once

    alive.clear()
    peak[0] = 0
    bucketed = WeightPlan(model, bucket_bytes=1)
    move_adapter(model)
    bucketed.sync(engine)
    assert (engine.prompt_logprobs(ids) - trainer_logprobs(model, ids)).abs().max() <= 1e-4
    assert len(bucketed.buckets) > 2
    assert 0 < peak[0] <= max(sum(u.nbytes for u in bucket) for bucket in bucketed.buckets) < merged_bytes


def test_engine_stops_at_eos_ids_of_the_generation_config(tmp_path):
    """The model always predicts token `stop`, which only its generation config names as an end of sequence:
    the engine must stop there. Also: the engine's start leaves the trainer's float32 matmul precision, and
    seeds the process's generators with the engine's seed (docs/troubleshooting.md says so)."""
    stop = 5
    model = tiny.build_model()
    with torch.no_grad():
        # Hidden dimension 0 is large and positive in every embedding, and the final norm keeps only it: the
        # head sees the same direction at every position, and its row for `stop` turns that into a large logit.
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[stop, 0] = 10.0
    model.generation_config.eos_token_id = [1, stop]
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none", vllm_cpu_repack_weights=False)  # fmt: skip
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        engine = Engine(model, tokenizer, args)
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.initial_seed() == args.seed and random.getstate() == random.Random(args.seed).getstate()
    finally:
        torch.set_float32_matmul_precision(before)
    WeightPlan(model).sync(engine)
    rollout = engine.generate([tokenizer("abcd>b:")["input_ids"]], Sampling.of(args))
    assert rollout.completion_ids == [[stop]] * args.num_generations
    assert not any(rollout.truncated)
