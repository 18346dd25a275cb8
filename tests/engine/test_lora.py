"""What a PEFT LoRA adapter needs from the engine, checked before the engine starts (no engine here)."""

import pytest
from conftest import run_cli
from peft import LoraConfig, get_peft_model
from torch import nn

from colograd import trainer as trainer_module
from colograd.config.core import ConfigError
from colograd.engine.lora import check_lora, engine_max_lora_rank
from colograd.grpo import policy
from colograd.models import tiny
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
    copy is sent; tests/engine/test_engine.py checks its parity) and does not refuse PiSSA (its rewritten base is what
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
    monkeypatch.setattr(policy, "WeightPlan", lambda *args, **kwargs: plans.append(args))
    policy.weight_plan(model, 1, 8 if lora_sync == "adapter" else None)
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


class EngineModel(nn.Module):
    """Stands in for an engine's model under vLLM 0.26 with LoRA: the module paths of its LoRA wrappers that hide
    their layer (`base_layer`), vLLM's fused modules, and the model's own checkpoint renaming, if any."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, hidden: set[str], mapper=None) -> None:
        super().__init__()
        self._colograd_hidden_wrappers = hidden
        if mapper is not None:
            self.hf_to_vllm_mapper = mapper


def test_adapter_only_lora_base_weights_reach_layers_an_older_vllm_hides():
    """vLLM 0.26 with LoRA hides each adaptable layer in a wrapper that does not load weights: the base weights get
    the `base_layer` step under their checkpoint names (the model's loader renames and fuses them). A text model's
    checkpoint names are the engine's; a vision-language model's are renamed by its `hf_to_vllm_mapper` (LLaVA's,
    as vLLM 0.26 and 0.32 write it in models/llava.py), and must be matched through it."""
    from vllm.model_executor.models.utils import WeightsMapper

    from colograd.engine.weights import named_through_lora_wrappers

    llava = WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model.",
                                              "model.vision_tower.": "vision_tower.",
                                              "model.multi_modal_projector.": "multi_modal_projector.",
                                              "lm_head.": "language_model.lm_head."})  # fmt: skip
    layer = "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"
    text = EngineModel({"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"})
    names = [n for n, _ in named_through_lora_wrappers(text, [(f"model.layers.0.{leaf}", None) for leaf in layer])]
    assert names == ["model.layers.0.self_attn.q_proj.base_layer.weight",
                     "model.layers.0.mlp.down_proj.base_layer.weight",
                     "model.layers.0.input_layernorm.weight"]  # fmt: skip
    engine = "language_model.model.layers.0"
    vlm = EngineModel({f"{engine}.self_attn.qkv_proj", f"{engine}.mlp.down_proj"},
                      llava)  # fmt: skip
    weights = [(f"model.language_model.layers.0.{leaf}", None) for leaf in layer] + [("lm_head.weight", None)]
    names = [n for n, _ in named_through_lora_wrappers(vlm, weights)]
    assert names == ["model.language_model.layers.0.self_attn.q_proj.base_layer.weight",
                     "model.language_model.layers.0.mlp.down_proj.base_layer.weight",
                     "model.language_model.layers.0.input_layernorm.weight", "lm_head.weight"]  # fmt: skip
    # What the model's loader then sees: its own renaming of those names reaches the wrapped layer.
    mapped = llava._map_name(names[0])
    assert mapped == "language_model.model.layers.0.self_attn.q_proj.base_layer.weight"


def test_adapter_names_are_mapped_as_the_installed_vllm_loader_maps_them():
    """The in-place adapter sync maps PEFT names with the model's checkpoint mapper as vLLM's own LoRA loader does:
    renames only on 0.32 on (`get_rename_mapper`), everything but the stacking on 0.26 (`get_unstacked_mapper`, the
    lent GPU machine's build, where calling the newer name crashed the second sync)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.utils import WeightsMapper

    from colograd.engine.lora import _lora_names

    mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model."})
    names = _lora_names(mapper)
    assert names.apply_list(["model.language_model.layers.0.q_proj"]) == ["language_model.model.layers.0.q_proj"]
    older = SimpleNamespace(get_unstacked_mapper=lambda: "unstacked")  # vLLM 0.26's mapper has only this one
    assert _lora_names(older) == "unstacked"
    assert _lora_names(None) is None
