"""Configuration: validation messages, and every recipe parses into the dataclasses."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
import trl
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import launch_command_parser
from transformers import TrainingArguments
from trl import ModelConfig, TrlParser

from colograd import GRPOConfig, ScriptArguments
from colograd.config.core import COMMON_FIELDS, TOPICS, ConfigError
from colograd.config.trl_compat import DIFFERENT_DEFAULTS, refused_fields
from colograd.models import tiny
from colograd.rewards.core import resolve_reward
from colograd.train import _Parser, load_model

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "recipes/accelerate_configs").glob("*.yaml"))


def make(**kwargs) -> GRPOConfig:
    base = {"output_dir": "unused", "report_to": "none", "per_device_train_batch_size": 8, "num_generations": 4}
    return GRPOConfig(**{**base, **kwargs})


def test_defaults_follow_trl():
    args = make()
    assert args.loss_type == "dapo" and args.scale_rewards == "group" and args.epsilon_high == args.epsilon
    assert args.prompts_per_rollout == 2
    assert args.remove_unused_columns is False  # the reward functions need the dataset's columns


def test_generation_batch_follows_trl():
    # One process here: the global batch is per_device_train_batch_size.
    assert make(gradient_accumulation_steps=3).steps_per_generation == 3  # default: one rollout per optimizer step
    assert make(gradient_accumulation_steps=3).generation_batch_size == 24
    assert make(generation_batch_size=32).steps_per_generation == 4


@pytest.mark.parametrize(
    "accumulation, steps_per_generation, iterations, reuses",
    [(1, 1, 1, False), (4, 4, 1, False), (1, 2, 1, True), (1, 1, 2, True), (4, 2, 2, False), (3, 2, 1, True)],
)
def test_old_logps_needed_when_a_rollout_outlives_an_optimizer_step(
    accumulation, steps_per_generation, iterations, reuses
):
    args = make(gradient_accumulation_steps=accumulation, steps_per_generation=steps_per_generation,
                num_iterations=iterations)  # fmt: skip
    assert args.reuses_rollouts_across_updates is reuses


@pytest.mark.parametrize(
    "kwargs, engine",
    [
        ({}, True),
        ({"num_iterations": 2}, False),  # later passes train a policy that moved since sampling: stored trainer's
        ({"top_p": 0.9}, False),  # the engine's probabilities are renormalised over the nucleus
        ({"top_k": 5}, False),
        ({"vllm_importance_sampling_correction": True}, False),  # the correction compares the two
    ],
)
def test_engine_logps_stand_in_for_old_logps_only_when_equal_to_the_trainers(kwargs, engine):
    assert make(**kwargs).engine_logps_are_old_logps is engine


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"num_generations": 1, "per_device_train_batch_size": 1}, "num_generations"),
        ({"per_device_train_batch_size": 6}, "per_device_train_batch_size"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"scale_rewards": "std"}, "scale_rewards"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"importance_sampling_level": "group"}, "importance_sampling_level"),
        ({"beta": -0.1}, "beta"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"steps_per_generation": 2, "generation_batch_size": 16}, "steps_per_generation and generation_batch_size"),
        ({"generation_batch_size": 12}, "generation_batch_size=12"),
        ({"log_completions_steps": 0}, "log_completions_steps"),
        ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2 does not divide the 1 processes"),
        ({"vllm_max_num_seqs": 0}, "vllm_max_num_seqs"),
        ({"packed_row_tokens": 0}, "packed_row_tokens"),
        ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
        ({"vllm_importance_sampling_mode": "token"}, "vllm_importance_sampling_mode"),
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 2.0}, "clip_min=2.0"),
        ({"delta": 1.1}, "delta=1.1 caps the ratio below"),
        ({"num_generations_eval": 0}, "num_generations_eval=0"),
        ({"multi_objective_aggregation": "sum"}, "multi_objective_aggregation='sum' is unknown"),
        ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold=0.0"),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg=0.0"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5"),
        ({"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min=0.5"),
        ({"entropy_coef": 0.01, "micro_batch_tokens": 64}, "remove micro_batch_tokens or the entropy option"),
        ({"sync_ref_model": True}, "sync_ref_model with beta=0"),
        ({"beta": 0.04, "sync_ref_model": True, "ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha=1.5"),
        ({"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 0}, "ref_model_sync_steps=0"),
    ],
)
def test_invalid_fields_are_named(kwargs, names):
    with pytest.raises(ConfigError, match=names):
        make(**kwargs)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses(recipe):
    for parser_class in (TrlParser, _Parser):  # TRL's parser reads it too, and colograd's checks pass it
        parser = parser_class((ScriptArguments, GRPOConfig, ModelConfig))
        script_args, training_args, model_args = parser.parse_args_and_config(["--config", str(recipe)])
        assert model_args.model_name_or_path
        assert script_args.reward_funcs
    assert recipe.read_text().startswith("# accelerate launch"), "a recipe starts with the command that runs it"


# What each launcher config must set up: accelerate's distributed type, and the ZeRO stage where there is one.
LAUNCHERS = {
    "cpu.yaml": ("MULTI_GPU", None),
    "ddp.yaml": ("MULTI_GPU", None),
    "zero2.yaml": ("DEEPSPEED", 2),
    "zero3.yaml": ("DEEPSPEED", 3),
    "fsdp.yaml": ("FSDP", None),
}


def test_every_launcher_config_is_listed():
    assert sorted(p.name for p in ACCELERATE_CONFIGS) == sorted(LAUNCHERS)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_config_is_one_accelerate_accepts(name):
    config = ClusterConfig.from_yaml_file(ROOT / "recipes/accelerate_configs" / name)  # raises on unknown keys
    distributed_type, zero_stage = LAUNCHERS[name]
    assert config.distributed_type.value == distributed_type
    assert config.deepspeed_config.get("zero_stage") == zero_stage
    # accelerate turns the nested keys into `accelerate launch` flags: each must be one it knows.
    flags = {flag for action in launch_command_parser()._actions for flag in action.option_strings}
    unknown = [key for key in {**config.deepspeed_config, **config.fsdp_config} if f"--{key}" not in flags]
    assert not unknown


def test_cli_flags_override_recipe():
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    argv = ["--config", str(ROOT / "recipes/grpo_tiny.yaml"), "--max_steps", "3", "--learning_rate", "1e-5"]
    _, training_args, _ = parser.parse_args_and_config(argv)
    assert training_args.max_steps == 3 and training_args.learning_rate == 1e-5


def test_unknown_recipe_key_fails(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "recipes/grpo_tiny.yaml").read_text() + "\nnum_generatoins: 4\n")
    with pytest.raises(ValueError, match="num_generatoins"):
        TrlParser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(["--config", str(bad)])


def test_rewards_resolve_by_name_and_path():
    assert resolve_reward("letters").__name__ == "letters_reward"
    assert resolve_reward("colograd.models.tiny.letters_reward").__name__ == "letters_reward"
    with pytest.raises(ConfigError, match="neither a built-in"):
        resolve_reward("nonsense")
    with pytest.raises(ConfigError, match="no_such_reward"):
        resolve_reward("colograd.models.tiny.no_such_reward")


# --- TRL compatibility --------------------------------------------------------------------------------------


def _trl_fields() -> list[dataclasses.Field]:
    """TRL 1.16 GRPOConfig's own fields (those of transformers' TrainingArguments aside)."""
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f for f in dataclasses.fields(trl.GRPOConfig) if f.name not in base]


def _other_than(accepted: tuple) -> object:
    """A value outside `accepted`, of the accepted default's kind."""
    value = accepted[0]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return "other"


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("trl_field", _trl_fields(), ids=lambda f: f.name)
def test_every_trl_field_is_supported_or_refused(trl_field):
    """A field TRL adds later fails here until it is implemented or refused (colograd/config/trl_compat.py)."""
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    name = trl_field.name
    assert name in ours, f"TRL's {name} is neither implemented nor refused"
    refused = refused_fields()
    if name in refused:
        accepted, why = refused[name]
        assert _default(ours[name]) == accepted[0]
        for value in accepted:
            make(**{name: value})
        with pytest.raises(ConfigError, match=f"^{name}=.*: {re.escape(why)}$"):
            make(**{name: _other_than(accepted)})
    elif name not in DIFFERENT_DEFAULTS:
        assert _default(ours[name]) == _default(trl_field), f"{name}: TRL's default differs; list it or match it"


def test_trl_compat_tables_name_only_trl_fields():
    trl_names = {f.name for f in _trl_fields()}
    assert set(refused_fields()) <= trl_names and set(DIFFERENT_DEFAULTS) <= trl_names


def test_trl_recipe_keys_parse_with_trl_meaning(tmp_path):
    recipe = tmp_path / "trl.yaml"
    recipe.write_text(
        "use_vllm: true\nvllm_mode: colocate\nwarmup_ratio: 0.1\noverwrite_output_dir: true\n"
        "vllm_importance_sampling_cap: 2.0\ngeneration_kwargs: {stop: ['</answer>']}\nshuffle_dataset: false\n"
        "per_device_train_batch_size: 8\nnum_generations: 4\noutput_dir: unused\nreport_to: none\n"
    )
    _, args, _ = _Parser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(["--config", str(recipe)])
    assert args.use_vllm and args.vllm_mode == "colocate" and args.shuffle_dataset is False
    assert args.warmup_steps == 0.1  # transformers 5: a warmup_steps below 1 is a fraction of the steps
    assert args.vllm_importance_sampling_clip_max == 2.0
    assert args.generation_kwargs == {"stop": ["</answer>"]}
    assert not args.engine_logps_are_old_logps  # the engine's log-probs may no longer be the full softmax's


@pytest.mark.parametrize(
    "recipe_line, argv, message",
    [
        ("num_generatoins: 4", [], "unknown option 'num_generatoins': did you mean 'num_generations'?"),
        ("", ["--lerning_rate", "1e-5"], "unknown option 'lerning_rate': did you mean 'learning_rate'?"),
        ("logging_dir: runs", [], "TENSORBOARD_LOGGING_DIR"),
        ("use_vllm: false", [], "use_vllm=False: colograd always generates with its in-process vLLM engine"),
        ("", ["--vllm_mode", "server"], "vllm_mode='server': colograd's engine is always colocated"),
    ],
)
def test_parser_messages_say_what_to_do(tmp_path, recipe_line, argv, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "recipes/grpo_tiny.yaml").read_text() + "\n" + recipe_line + "\n")
    parser = _Parser((ScriptArguments, GRPOConfig, ModelConfig))
    with pytest.raises(ValueError, match=re.escape(message)):
        parser.parse_args_and_config(["--config", str(recipe), *argv])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"generation_kwargs": {"stopp": ["x"]}}, "vllm.SamplingParams has no 'stopp'; did you mean 'stop'?"),
        ({"generation_kwargs": {"temperature": 0.5}}, "set 'temperature' with the field temperature instead"),
        ({"generation_kwargs": {"n": 2}}, "'n' is set by the trainer"),
        ({"generation_kwargs": "{not json"}, "generation_kwargs='{not json' is not a JSON object"),
        ({"chat_template_kwargs": "[1]"}, "give a mapping"),
        ({"min_p": 1.5}, "min_p=1.5"),
    ],
)
def test_generation_options_are_checked(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make(**kwargs)


def test_model_init_kwargs_and_revision_reach_from_pretrained(tmp_path):
    folder = tmp_path / "tiny"
    tiny.build_model().save_pretrained(folder)
    tiny.build_tokenizer().save_pretrained(folder)
    args = make(model_init_kwargs={"dtype": "bfloat16"}, trust_remote_code=True, max_prompt_length=64,
                max_completion_length=256)  # fmt: skip
    model, tokenizer = load_model(ModelConfig(model_name_or_path=str(folder)), args)
    assert model.dtype == torch.bfloat16  # model_init_kwargs override the model arguments (float32 by default)
    assert tokenizer.chat_template  # the folder's tokenizer
    with pytest.raises(ConfigError, match="model_init_kwargs="):
        make(model_init_kwargs="{dtype: bf16}")  # a flag's value must be JSON


def test_model_revision_picks_the_revision_of_config_tokenizer_and_weights(tmp_path, monkeypatch):
    # A hub cache holding two revisions of one repository, read offline: "small" has a narrower MLP than main.
    repo = tmp_path / "models--colograd-test--tiny"
    for revision, commit, width in (("main", "a" * 40, 256), ("small", "b" * 40, 64)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        model = tiny.build_model()
        model.config.intermediate_size = width
        type(model)(model.config).save_pretrained(repo / "snapshots" / commit)
        tokenizer = tiny.build_tokenizer()
        tokenizer.chat_template = f"{{# {revision} #}}" + tokenizer.chat_template
        tokenizer.save_pretrained(repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = make(max_prompt_length=64, max_completion_length=256)
    for revision, width in (("main", 256), ("small", 64)):
        model_args = ModelConfig(model_name_or_path="colograd-test/tiny", model_revision=revision)
        model, tokenizer = load_model(model_args, args)
        assert model.model.layers[0].mlp.up_proj.out_features == width  # the revision's weights
        assert tokenizer.chat_template.startswith(f"{{# {revision} #}}")


def test_configuration_reference_lists_every_field():
    """docs/reference.md is rendered from the dataclasses by a hook, one marker per class: a field of a class that
    has no marker (a new options class mixed into GRPOConfig, say) would be missing from the page."""
    spec = importlib.util.spec_from_file_location("reference_hook", ROOT / "docs/hooks/reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (ROOT / "docs/reference.md").read_text()  # as a checkout shows it, the tables written in
    listed = re.findall(r"^\| `(\w+)` \|", page, flags=re.MULTILINE)
    training = TrainingArguments.__dataclass_fields__
    expected = [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in training]
    expected += [name for name in GRPOConfig.__annotations__ if name in training]  # TRL's other defaults
    expected += [f.name for cls in (ScriptArguments, ModelConfig) for f in dataclasses.fields(cls)]
    assert sorted(set(expected) - set(listed)) == []
    assert len(listed) == len(set(listed))  # each field documented once
    for path in hook.PAGES:  # the tables in the repository are today's: rendering them again changes nothing
        assert hook.render(path.read_text()) == path.read_text(), f"{path.name} is stale: run make reference"


def test_help_leads_with_the_fields_people_set_and_ends_with_trls_refused_ones(capsys):
    """`--help` opens with the common fields (not with TRL's refused ones), then one section per topic module."""
    with pytest.raises(SystemExit) as stop:
        _Parser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_and_config(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    flags = re.findall(r"^  --(\w+)", text, flags=re.MULTILINE)
    head = ["model_name_or_path", "dataset_name", "reward_funcs", "output_dir", "learning_rate", "num_generations",
            "max_completion_length", "per_device_train_batch_size"]  # fmt: skip
    assert flags[: len(head)] == head
    assert flags[: len(COMMON_FIELDS)] == list(COMMON_FIELDS)
    last_title = TOPICS[-1][0]
    before, last = text.split(f"\n{last_title}:\n")
    assert set(refused_fields()) <= set(re.findall(r"^  --(\w+)", last, flags=re.MULTILINE))  # TRL's refused: last
    assert not set(refused_fields()) & set(re.findall(r"^  --(\w+)", before, flags=re.MULTILINE))
    sections = re.findall(r"^(\S[^\n]*):$", text, flags=re.MULTILINE)
    assert sections == ["options", "Most used", *(title for title, _ in TOPICS)]
    assert len(flags) == len(set(flags))  # every field once
