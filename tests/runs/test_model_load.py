"""A resumed model gets every tensor of its checkpoint (`colograd.runs.model_load`): Mixture-of-Experts families whose
experts transformers saves one by one included, which its `Trainer` left as the run began."""

import pytest
import torch
import zoo
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from colograd.errors import ConfigError
from colograd.runs.model_load import load_model_weights, saved_again_differs, saved_names

EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")
# Every family of the zoo with experts, and two without (one with tied embeddings, one without).
MOE = [name for name in zoo.ZOO | zoo.PARITY | zoo.HYBRIDS
       if any(zoo.shrunk(name).to_dict().get(k) for k in EXPERT_COUNTS)]  # fmt: skip
NAMES = [*MOE, "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-0.6B"]
# A family whose checkpoint names are not its model's: transformers' own load leaves its experts as they were.
CONVERTED = "Qwen/Qwen3-30B-A3B"


def saved_and_moved(name: str, folder, shard: str | None = None) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """`name`'s shrunk model saved in `folder` (in shards of at most `shard`), its state then (copied), and every
    tensor of it moved since, as an optimizer would."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(zoo.shrunk(name), dtype=torch.float32)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(1.0)
    return model, saved


SAVES_BACK_OTHERWISE = "do not save back to the same values"


@pytest.mark.parametrize("name", NAMES)
def test_a_resumed_model_holds_every_tensor_its_checkpoint_saved(name, tmp_path, caplog):
    model, saved = saved_and_moved(name, tmp_path)
    parameters = dict(model.named_parameters())
    load_model_weights(model, str(tmp_path), saved_names(str(tmp_path)))
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])] == []
    assert all(a is b for a, b in zip(parameters.values(), model.parameters(), strict=True))  # the optimizer's
    assert SAVES_BACK_OTHERWISE not in caplog.text  # the round-trip check is silent where the load is exact
    assert saved_again_differs(model, str(tmp_path)) == {}


def test_a_converted_load_that_does_not_give_back_the_saved_values_is_named(tmp_path, monkeypatch, caplog):
    """A family whose conversion is not undone exactly by the save (injected: `from_pretrained` hands back one
    expert's value one float32 step off, and a fused projection's row 1e-3 off) is named with its difference: the
    run resumes, and says it is not the uninterrupted one to the bit."""
    model, _ = saved_and_moved(CONVERTED, tmp_path)
    real = type(model).from_pretrained.__func__

    def inexact(cls, *args, **kwargs):
        loaded, info = real(cls, *args, **kwargs)
        with torch.no_grad():
            experts = loaded.model.layers[1].mlp.experts
            experts.gate_up_proj[2, 0, 0] = torch.nextafter(experts.gate_up_proj[2, 0, 0], torch.tensor(9.0))
            experts.down_proj[0, 3].add_(1e-3)
        return loaded, info

    monkeypatch.setattr(type(model), "from_pretrained", classmethod(inexact))
    with caplog.at_level("WARNING", logger="colograd.trainer"):
        load_model_weights(model, str(tmp_path), saved_names(str(tmp_path)))
    differs = saved_again_differs(model, str(tmp_path))
    assert set(differs) == {
        "model.layers.1.mlp.experts.2.gate_proj.weight",
        "model.layers.1.mlp.experts.0.down_proj.weight",
    }
    assert 0 < differs["model.layers.1.mlp.experts.2.gate_proj.weight"] < 1e-6
    assert differs["model.layers.1.mlp.experts.0.down_proj.weight"] == pytest.approx(1e-3, rel=1e-2)
    [line] = [r.getMessage() for r in caplog.records if SAVES_BACK_OTHERWISE in r.getMessage()]
    assert "experts.0.down_proj.weight (0.001)" in line and "experts.2.gate_proj.weight" in line


def test_the_moe_case_exists_transformers_load_leaves_the_experts_stale(tmp_path):
    """The reason for the above: a Qwen3-MoE checkpoint names its experts one by one, and `Trainer`'s
    `load_state_dict(strict=False)` leaves the model's fused experts as they were."""
    assert len(MOE) >= 10, MOE
    model, saved = saved_and_moved(CONVERTED, tmp_path)
    model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    stale = [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])]
    assert stale and all(".experts." in k for k in stale), stale


@pytest.mark.parametrize("name", [CONVERTED, "Qwen/Qwen3-0.6B"], ids=["converted", "as saved"])
def test_a_checkpoint_in_shards_loads_every_tensor_a_shard_at_a_time(name, tmp_path):
    model, saved = saved_and_moved(name, tmp_path, shard="200KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    load_model_weights(model, str(tmp_path), saved_names(str(tmp_path)))
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])] == []


GONE = {  # a tensor removed from the checkpoint, and what the one line says
    "converted, an expert": (CONVERTED, ".experts.3.up_proj.weight", "conversion"),  # transformers' own line
    "converted, a tensor as saved": (CONVERTED, "layers.0.self_attn.q_proj.weight", None),  # found missing, refused
    "as saved": ("Qwen/Qwen3-0.6B", "layers.0.self_attn.q_proj.weight", None),
}


@pytest.mark.parametrize("case", GONE)
def test_a_checkpoint_without_one_of_the_models_tensors_is_refused_in_one_line(case, tmp_path):
    """Never a tensor trained from the values the run began with, nor one from_pretrained initialised afresh."""
    name, suffix, said = GONE[case]
    model, _ = saved_and_moved(name, tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    gone = next(k for k in tensors if k.endswith(suffix))
    save_file({k: v for k, v in tensors.items() if k != gone}, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        load_model_weights(model, str(tmp_path), saved_names(str(tmp_path)))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"The checkpoint {tmp_path} does not"), message
    assert (said or f"does not hold the model's {gone}") in message, message


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_a_vision_language_model_resumes_every_tensor_where_transformers_loaded_almost_none(version, tmp_path):
    """Qwen2-VL and Qwen2.5-VL save their weights under the Hub's names (`model.embed_tokens`, `visual.*`) where the
    model holds them under its own (`model.language_model.*`, `model.visual.*`): transformers' `Trainer` matched only
    `lm_head`, so a resumed vision-language run trained every other tensor from the values the run began with."""
    from transformers import AutoModelForImageTextToText

    from colograd.models.tiny_vlm import save_tiny_qwen_vl

    model = AutoModelForImageTextToText.from_pretrained(save_tiny_qwen_vl(str(tmp_path / "base"), version=version))
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    def moved() -> None:
        with torch.no_grad():
            for tensor in model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.add_(1.0)

    moved()
    model.load_state_dict(load_file(checkpoint / "model.safetensors"), strict=False)  # transformers' Trainer
    assert sum(not torch.equal(v, saved[k]) for k, v in model.state_dict().items()) > len(saved) * 0.9
    moved()
    load_model_weights(model, str(checkpoint), saved_names(str(checkpoint)))
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])] == []
    assert saved_again_differs(model, str(checkpoint)) == {}


def test_load_best_model_at_end_loads_every_tensor_too(tmp_path):
    """transformers' `_load_best_model` reads the best checkpoint as its resume does (`strict=False`): colograd's
    trainer loads it as a resume now does, a Qwen3-MoE's experts included."""
    from types import SimpleNamespace

    from colograd.runs.saving import ModelSaving

    model, saved = saved_and_moved(CONVERTED, tmp_path)
    trainer = SimpleNamespace(state=SimpleNamespace(best_model_checkpoint=str(tmp_path)), model=model,
                              is_deepspeed_enabled=False, is_fsdp_enabled=False)  # fmt: skip
    trainer._saved_whole = lambda checkpoint, model: ModelSaving._saved_whole(trainer, checkpoint, model)
    ModelSaving._load_best_model(trainer)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])] == []


@pytest.mark.parametrize("name", ["Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-35B-A3B"])
def test_qwen3_5_as_published_resumes_every_tensor(name, tmp_path):
    """Qwen3.5's published classes (`Qwen3_5ForConditionalGeneration`, read as saved; the MoE's, whose experts are
    saved one by one, through the conversions): every tensor back."""
    model = zoo.as_published(name)
    model.save_pretrained(tmp_path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(1.0)
    load_model_weights(model, str(tmp_path), saved_names(str(tmp_path)))
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, saved[k])] == []
    assert saved_again_differs(model, str(tmp_path)) == {}


def test_a_family_whose_save_transforms_values_is_read_through_its_conversions_whatever_its_names():
    """The direct read is taken only where transformers converts no tensor between checkpoint and model (renamings
    show in the names; a converter may keep a name and change the values)."""
    from colograd.runs.model_load import _converts_values

    def built(name):
        return AutoModelForCausalLM.from_config(zoo.shrunk(name), dtype=torch.float32)

    assert _converts_values(built(CONVERTED)) and not _converts_values(built("Qwen/Qwen3-0.6B"))
