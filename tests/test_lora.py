"""What a PEFT LoRA adapter needs from the engine, checked before the engine starts (no engine here)."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
from conftest import run_cli
from peft import LoraConfig, get_peft_model

from colograd import tiny
from colograd import trainer as trainer_module
from colograd.config import ConfigError
from colograd.lora import check_lora, engine_max_lora_rank
from colograd.trainer import GRPOTrainer


@pytest.mark.parametrize("rank, engine_rank", [(1, 1), (2, 8), (4, 8), (8, 8), (9, 16), (300, 320), (321, 512)])
def test_rank_is_rounded_up_to_a_size_vllm_accepts(rank, engine_rank):
    assert engine_max_lora_rank(rank) == engine_rank


def test_rank_above_vllm_largest_is_refused():
    with pytest.raises(ConfigError, match="LoRA rank 600 is above the largest rank vLLM serves \\(512\\)"):
        check_lora(LoraConfig(r=600), "adapter")
    assert check_lora(LoraConfig(r=600), "merged") is None  # merged weights have no rank limit


def test_adapter_rank_counts_rank_pattern():
    assert check_lora(LoraConfig(r=4, rank_pattern={"q_proj": 40}), "adapter") == 40


@pytest.mark.parametrize(
    "options, adapter_message, merged_message",
    [
        ({"use_dora": True}, "does not yet support DoRA", "DoRA (use_dora)"),
        ({"lora_bias": True}, "serve this adapter's lora_bias", "lora_bias"),
        ({"modules_to_save": ["lm_head"]}, "Unsupported modules_to_save: ['lm_head']", None),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'", None),
    ],
    ids=["dora", "lora-bias", "modules-to-save", "pissa"],
)
def test_options_the_sync_cannot_serve_are_refused(options, adapter_message, merged_message):
    """Adapter sync: vLLM's own loader check, run on the config. Merged sync serves modules_to_save (the trained
    copy is sent; tests/test_engine.py checks its parity) and does not refuse PiSSA (its rewritten base is what
    it sends), but refuses options whose merged weight is more than base + B·A."""
    config = LoraConfig(r=8, **options)
    with pytest.raises(ConfigError, match="lora_sync=adapter") as err:
        check_lora(config, "adapter")
    assert adapter_message in str(err.value) and "\n" not in str(err.value)
    if merged_message is None:
        assert check_lora(config, "merged") is None
    else:
        with pytest.raises(ConfigError, match="lora_sync=merged") as err:
            check_lora(config, "merged")
        assert merged_message in str(err.value)


@pytest.mark.parametrize(
    "options", [{"alora_invocation_tokens": [5, 6]}, {"layer_replication": [(0, 1)]}, {"use_qalora": True}]
)
def test_options_an_older_vllm_serves_as_a_plain_lora_are_refused_by_colograd(options, monkeypatch):
    """vLLM 0.26's own check lets these pass (its loader then serves a plain LoRA); colograd refuses them itself,
    so a run refuses them on every vLLM release, not only where vLLM does."""
    from vllm.lora.peft_helper import PEFTHelper

    monkeypatch.setattr(PEFTHelper, "validate_legal", lambda self, config: None)  # an older vLLM's check
    with pytest.raises(ConfigError, match="lora_sync=adapter: vLLM cannot serve this adapter's"):
        check_lora(LoraConfig(r=8, task_type="CAUSAL_LM", **options), "adapter")


def test_per_layer_ranks_are_refused_where_vllm_scales_every_layer_alike(monkeypatch):
    from vllm.lora.peft_helper import PEFTHelper

    config = LoraConfig(r=4, rank_pattern={"q_proj": 8}, alpha_pattern={"q_proj": 32})
    assert check_lora(config, "adapter") == 8  # vLLM 0.32 on scales each layer by its own rank and alpha
    monkeypatch.delattr(PEFTHelper, "get_rank_and_scaling")  # as in 0.26: one scale, lora_alpha / r
    with pytest.raises(ConfigError, match="per-layer rank or alpha .*set lora_sync: merged"):
        check_lora(config, "adapter")
    assert check_lora(LoraConfig(r=4), "adapter") == 4


@pytest.mark.parametrize(
    "lora_sync, expected_buckets", [("merged", 2**20), ("adapter", None), (None, None)], ids=lambda v: str(v)
)
def test_merged_lora_is_synced_in_buckets(lora_sync, expected_buckets, monkeypatch):
    """Unsharded weights are sent by reference in one call, but merged LoRA weights are built: in buckets."""
    model = tiny.build_model() if lora_sync is None else get_peft_model(tiny.build_model(), LoraConfig(r=8))
    plans = []
    monkeypatch.setattr(trainer_module, "WeightPlan", lambda *args, **kwargs: plans.append(args) or plan)
    plan = SimpleNamespace(sync=lambda engine: None)
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=0),
        engine=SimpleNamespace(stale=True),
        _synced_step=None,
        _weight_plan=None,
        _lora_rank=8 if lora_sync == "adapter" else None,
        args=SimpleNamespace(sync_bucket_mib=1),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        model=model,
        _timed=lambda phase: nullcontext(),
    )
    GRPOTrainer.sync_weights(trainer)
    assert plans == [(model, expected_buckets)]


@pytest.mark.slow
def test_unservable_adapter_is_one_line_before_the_engine_starts(tmp_path):
    proc = run_cli("--config", "recipes/grpo_tiny.yaml", "--output_dir", str(tmp_path), "--use_peft", "--use_dora",
                   "--lora_sync", "adapter")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("colograd: error: lora_sync=adapter") and "DoRA" in last, proc.stderr[-2000:]


def test_fp32_output_layer_over_a_lora_head_is_one_line_before_the_engine_starts(tmp_path, monkeypatch):
    # cast_lm_head_to_fp32 computes the output layer from its base weights: an adapter there would be bypassed.
    monkeypatch.setattr(trainer_module, "Engine", lambda *a, **k: pytest.fail("the engine started"))
    model = get_peft_model(tiny.build_model(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    args = tiny.run_config(str(tmp_path), 1, cast_lm_head_to_fp32=True)
    with pytest.raises(ConfigError, match="cast_lm_head_to_fp32 with a LoRA adapter on the output layer"):
        GRPOTrainer(model, "letters", args, tiny.letters_dataset(), processing_class=tiny.build_tokenizer())
