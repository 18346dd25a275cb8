"""TRL 1.16's `GRPOTrainer.__init__` and `GRPOConfig` defaults, walked: what TRL code passes works with TRL's meaning
or stops in one line naming the parameter, and a parameter or default TRL adds or changes later fails here.

The trainers built here replace the engine (nothing checked here reaches it) unless marked slow; the slow ones
train on the real engine.
"""

import dataclasses
import inspect
import re
from unittest.mock import patch

import pytest
import torch
import trl
from conftest import run_cli
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen2ForSequenceClassification, TrainerCallback, TrainingArguments

from colograd import GRPOConfig, GRPOTrainer
from colograd.config.core import ConfigError
from colograd.config.trl_compat import (
    DIFFERENT_DEFAULTS,
    DIFFERENT_TRAINING_DEFAULTS,
    REFUSED_PARAMETERS,
    TRAINER_PARAMETERS,
    refused_fields,
)
from colograd.models import tiny
from colograd.preflight.core import check_prompts, prompt_room
from colograd.rewards.core import RewardModel, resolve_rewards

OURS_ONLY = ["recipe", "tool_call_parser"]  # colograd's own parameters, after TRL's, by keyword


def parameters(cls: type) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self


LETTERS = object()  # `offline`'s default dataset: 8 rows of the letters task


def offline(tmp_path, model=None, reward_funcs="letters", dataset=LETTERS, **kwargs) -> GRPOTrainer:
    """A `GRPOTrainer` built with the engine replaced: construction only (no stage here uses the engine)."""
    args = kwargs.pop("args", None) or tiny.run_config(str(tmp_path), steps=1)
    dataset = tiny.letters_dataset(8) if dataset is LETTERS else dataset
    with patch("colograd.trainer.Engine") as engine:
        engine.acquire.return_value.max_prompt_tokens = 512
        return GRPOTrainer(model or tiny.build_model(), reward_funcs, args, dataset,
                           processing_class=tiny.build_tokenizer(), **kwargs)  # fmt: skip


# --- the signature ------------------------------------------------------------------------------------------------


def test_parameters_are_trls_in_trls_order_then_ours_by_keyword():
    """A parameter TRL adds, renames, moves or gives another default fails here."""
    theirs, ours = parameters(trl.GRPOTrainer), parameters(GRPOTrainer)
    assert [p.name for p in ours] == [p.name for p in theirs] + OURS_ONLY
    for trl_param, param in zip(theirs, ours, strict=False):
        assert param.kind is trl_param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, param.name
        assert param.default == trl_param.default, f"{param.name}: TRL's default is {trl_param.default!r}"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])


def test_every_trl_parameter_says_how_it_is_taken():
    """docs/porting-trl.md's parameter table is rendered from `TRAINER_PARAMETERS`: one row per TRL parameter."""
    assert list(TRAINER_PARAMETERS) == [p.name for p in parameters(trl.GRPOTrainer)]
    assert set(REFUSED_PARAMETERS) <= set(TRAINER_PARAMETERS)


@pytest.mark.parametrize("name", REFUSED_PARAMETERS)
def test_refused_parameter_stops_in_one_line_naming_it(tmp_path, name):
    with pytest.raises(ConfigError, match=f"^{name}: {re.escape(REFUSED_PARAMETERS[name])}$"):
        offline(tmp_path, **{name: object()})


def test_a_quantized_base_is_refused_however_it_comes(tmp_path):
    with pytest.raises(ConfigError, match="^model_init_kwargs: quantization_config: .* full precision"):
        tiny.run_config(str(tmp_path), 1, model_init_kwargs={"quantization_config": {"load_in_4bit": True}})
    model = tiny.build_model()
    model.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes model
    with pytest.raises(ConfigError, match="^model is quantized: .* full precision"):
        offline(tmp_path, model)


def test_trl_calls_written_positionally_keep_their_meaning(tmp_path):
    """TRL's order: reward_processing_classes comes before callbacks, rollout_func before environment_factory."""

    class Seen(TrainerCallback):
        pass

    args, data, tokenizer = tiny.run_config(str(tmp_path), 1), tiny.letters_dataset(8), tiny.build_tokenizer()
    with patch("colograd.trainer.Engine"):
        trainer = GRPOTrainer(tiny.build_model(), "letters", args, data, None, tokenizer, None, [Seen()])
    assert any(isinstance(c, Seen) for c in trainer.callback_handler.callbacks)
    with pytest.raises(ConfigError, match="reward_processing_classes holds callbacks.*pass them as callbacks="):
        GRPOTrainer(tiny.build_model(), "letters", args, data, None, tokenizer, [Seen()])


# --- peft_config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora_sync, engine_rank", [("merged", None), ("adapter", 8)])
def test_peft_config_wraps_the_model_as_trls_does(tmp_path, lora_sync, engine_rank):
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    args = tiny.run_config(str(tmp_path), 1, lora_sync=lora_sync)
    trainer = offline(tmp_path, args=args, peft_config=lora)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(model, PeftModel) and trainer.inputs.lora_rank == engine_rank
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    # TRL seeds before PEFT draws the adapter at random: the same adapter as TRL's own trainer makes.
    config = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                            per_device_train_batch_size=8, num_generations=4, seed=args.seed)  # fmt: skip
    theirs = trl.GRPOTrainer(tiny.build_model(), tiny.letters_reward, config, tiny.letters_dataset(8),
                             processing_class=tiny.build_tokenizer(), peft_config=lora)  # fmt: skip
    trl_adapter = {n: p for n, p in theirs.model.named_parameters() if "lora_" in n}
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert ours.keys() == trl_adapter.keys()
    assert all(torch.equal(ours[n], trl_adapter[n]) for n in ours)


@pytest.mark.parametrize(
    "model, peft_config, message",
    [
        (tiny.build_model, {"r": 8}, "peft_config is a dict; give a peft.PeftConfig"),
        (lambda: get_peft_model(tiny.build_model(), LoraConfig(r=4)), LoraConfig(r=8), "has an adapter already"),
        (tiny.build_model, LoraConfig(r=8, target_modules=["no_such_proj"]), "^peft_config: Target modules"),
    ],
    ids=["not-a-peft-config", "already-a-peft-model", "unknown-targets"],
)
def test_peft_config_mistakes_stop_in_one_line(tmp_path, model, peft_config, message):
    with pytest.raises(ConfigError, match=message) as err:
        offline(tmp_path, model(), peft_config=peft_config)
    assert "\n" not in str(err.value)


# --- reward_funcs=None and reward_processing_classes --------------------------------------------------------------


class Scored:
    """An environment that owns its reward: 1 for every completion."""

    def reset(self, **row) -> None:
        return None

    def get_reward(self) -> float:
        return 1.0


class Unscored:
    def reset(self, **row) -> None:
        return None


def test_reward_funcs_may_be_none_where_an_environment_gives_the_reward(tmp_path):
    trainer = offline(tmp_path, reward_funcs=None, environment_factory=Scored)
    assert [f.__name__ for f in trainer.reward_funcs] == ["Scored"]
    assert trainer.reward_weights.tolist() == [1.0]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"environment_factory": Unscored}, {"rollout_func": lambda prompts, trainer: {}}],
    ids=["nothing", "environment-without-get_reward", "rollout_func"],
)
def test_reward_funcs_none_without_a_reward_source_stops_in_one_line(tmp_path, kwargs):
    # TRL's rule: a rollout_func's extra keys reach the reward functions, but do not score by themselves.
    # TRL's own words first (its tests match "No reward source provided"), then what to do.
    with pytest.raises(ValueError, match="^No reward source provided: reward_funcs is None and no environment gives"):
        offline(tmp_path, reward_funcs=None, **kwargs)


def test_train_dataset_may_be_none_where_one_environment_gives_the_prompts(tmp_path):
    """TRL's stand-in: one rollout's rows of an empty user message; the environment's reset() writes the prompt."""
    args = tiny.run_config(str(tmp_path), 3, per_device_train_batch_size=16, num_generations=4)
    trainer = offline(tmp_path, reward_funcs=None, dataset=None, args=args, environment_factory=Scored)
    assert trainer.train_dataset["prompt"] == [[{"role": "user", "content": ""}]] * 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "train_dataset is None; pass a Dataset with a 'prompt' column"),
        ({"environment_factory": {"a": Scored, "b": Scored}}, "train_dataset is None with several environments"),
        ({"environment_factory": Scored, "args": "no max_steps"}, "set max_steps, the run's length"),
    ],
    ids=["no-environment", "several-environments", "no-max_steps"],
)
def test_train_dataset_none_otherwise_stops_in_one_line(tmp_path, kwargs, message):
    if kwargs.get("args") == "no max_steps":
        kwargs["args"] = tiny.run_config(str(tmp_path), -1)
    with pytest.raises(ConfigError, match=re.escape(message)):
        offline(tmp_path, dataset=None, **kwargs)


def reward_model() -> Qwen2ForSequenceClassification:
    base = tiny.build_model()
    base.config.num_labels = 1
    torch.manual_seed(0)
    return Qwen2ForSequenceClassification(base.config)


def test_reward_processing_classes_are_the_reward_models_tokenizers(tmp_path):
    model, tokenizer = reward_model(), tiny.build_tokenizer()
    funcs, weights = resolve_rewards([tiny.letters_reward, model], [1.0, 0.5], [None, tokenizer])
    assert funcs[0] is tiny.letters_reward and isinstance(funcs[1], RewardModel)
    assert funcs[1].model is model and funcs[1].tokenizer is tokenizer and weights.tolist() == [1.0, 0.5]
    # The reward is the model's first logit on prompt + completion, with that tokenizer.
    score = funcs[1](prompts=["ab>a:"], completions=["aa"])
    ids = tokenizer("ab>a:aa", return_tensors="pt", add_special_tokens=False)
    assert score == pytest.approx(model(**ids).logits[:, 0].tolist(), abs=1e-6)
    # A single tokenizer for a single reward model, as TRL takes it; a hub id or folder's own is replaced.
    (funcs,), _ = resolve_rewards(model, None, tokenizer)
    assert funcs.tokenizer is tokenizer
    folder = tmp_path / "rm"
    model.save_pretrained(folder)
    tiny.build_tokenizer().save_pretrained(folder)
    other = tiny.build_tokenizer()
    assert resolve_rewards(str(folder), None, other)[0][0].tokenizer is other
    # Without one, a model's tokenizer is loaded from where the model was (TRL's).
    loaded = Qwen2ForSequenceClassification.from_pretrained(folder)
    assert resolve_rewards(loaded, None)[0][0].tokenizer.chat_template == tokenizer.chat_template


@pytest.mark.parametrize(
    "reward_funcs, processing_classes, message",
    [
        (["letters", "letters"], [None], "reward_processing_classes has 1 entries for 2 reward functions"),
        (reward_model, None, "cannot load the tokenizer of reward model .*pass it in reward_processing_classes"),
        (lambda: torch.nn.Linear(2, 1), None, "Linear is a torch module but not a transformers model"),
    ],
    ids=["count", "no-tokenizer", "not-a-model"],
)
def test_reward_mistakes_stop_in_one_line(reward_funcs, processing_classes, message):
    funcs = reward_funcs() if callable(reward_funcs) else reward_funcs
    with pytest.raises(ConfigError, match=message) as err:
        resolve_rewards(funcs, None, processing_classes)
    assert "\n" not in str(err.value)


def test_the_trainer_passes_reward_processing_classes_on(tmp_path):
    model, tokenizer = reward_model(), tiny.build_tokenizer()
    trainer = offline(tmp_path, reward_funcs=["letters", model], reward_processing_classes=[None, tokenizer])
    assert isinstance(trainer.reward_funcs[1], RewardModel) and trainer.reward_funcs[1].tokenizer is tokenizer


# --- other arguments TRL takes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eval_dataset": {"a": tiny.letters_dataset(4)}}, "eval_dataset is a dict of datasets"),
        ({"eval_dataset": tiny.letters_dataset(4).to_iterable_dataset()}, "eval_dataset is a stream"),
    ],
)
def test_what_colograd_does_not_take_stops_in_one_line(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        offline(tmp_path, **kwargs)


def test_without_args_the_output_dir_is_trls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tiny.build_model()
    model.config.max_position_embeddings = 1024  # room for TRL's default 512-token completions and a prompt
    model.config._name_or_path = "org/tiny-model"
    with patch("colograd.trainer.Engine"):
        trainer = GRPOTrainer(model, "letters", train_dataset=tiny.letters_dataset(8),
                              processing_class=tiny.build_tokenizer())  # fmt: skip
    assert trainer.args.output_dir == "tiny-model-GRPO"


# --- defaults -----------------------------------------------------------------------------------------------------


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_every_shared_default_is_trls_or_has_a_reason():
    """Every field of TRL's GRPOConfig (TrainingArguments' included) that colograd has: the same default, or a
    reason in colograd/config/trl_compat.py (shown in docs/porting-trl.md), or a field accepted only at colograd's
    value."""
    ours = {f.name: _default(f) for f in dataclasses.fields(GRPOConfig)}
    theirs = {f.name: _default(f) for f in dataclasses.fields(trl.GRPOConfig)}
    differing = {name for name, value in theirs.items() if name in ours and ours[name] != value}
    listed = set(DIFFERENT_DEFAULTS) | set(DIFFERENT_TRAINING_DEFAULTS)
    assert differing - set(refused_fields()) == listed
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(DIFFERENT_TRAINING_DEFAULTS) <= base and not set(DIFFERENT_DEFAULTS) & base


def test_prompts_are_not_truncated_by_default_as_in_trl():
    assert not any(f.name == "max_prompt_length" for f in dataclasses.fields(trl.GRPOConfig))
    args = GRPOConfig(output_dir="unused", report_to="none")
    assert args.max_prompt_length is None and args.max_completion_length == 512 and args.learning_rate == 1e-6


# --- prompts without max_prompt_length ----------------------------------------------------------------------------


def test_a_prompt_must_leave_room_for_a_whole_completion(tmp_path):
    """The tiny model's context is 512 tokens: with max_completion_length 500, 12 are left for a prompt."""
    args = tiny.run_config(str(tmp_path), 1, max_prompt_length=None, max_completion_length=500)
    config, tokenizer = tiny.build_model().config, tiny.build_tokenizer()
    assert prompt_room(args, config) == 12
    assert prompt_room(tiny.run_config(str(tmp_path), 1), config) is None  # max_prompt_length truncates instead
    rows = [{"prompt": "ab>a:", "target": "a"}] * 4 + [{"prompt": "abcdabcdabcd>a:", "target": "a"}]
    message = "row 4: prompt is 15 tokens, more than the 12 the engine's context leaves beside a whole completion"
    with pytest.raises(ConfigError, match=message):
        check_prompts(Dataset.from_list(rows), tokenizer, room=12)
    kept, longest = check_prompts(Dataset.from_list(rows), tokenizer, drop_invalid=True, room=12)
    assert len(kept) == 4 and longest == 5  # the longest prompt kept, not the dropped one
    with pytest.raises(ConfigError, match=message):  # a Python caller's dataset, before any engine starts
        offline(tmp_path, args=args, dataset=Dataset.from_list(rows * 13))
    with pytest.raises(ConfigError, match="max_completion_length=512 fills the engine's context of 512 tokens"):
        offline(tmp_path, args=tiny.run_config(str(tmp_path), 1, max_prompt_length=None, max_completion_length=512))


@pytest.mark.slow
def test_a_trl_recipe_without_max_prompt_length_runs_on_a_512_token_model(tmp_path, root):
    """TRL 1.16's keys only (no max_prompt_length, which TRL does not have): the engine takes the model's context."""
    recipe = tmp_path / "trl.yaml"
    recipe.write_text(
        "model_name_or_path: colograd:tiny-qwen2\nreward_funcs: [letters]\nuse_vllm: true\nvllm_mode: colocate\n"
        "per_device_train_batch_size: 16\nnum_generations: 4\nmax_completion_length: 8\nlearning_rate: 1.0e-3\n"
        f"max_steps: 2\nlogging_steps: 1\nreport_to: none\nsave_strategy: 'no'\noutput_dir: {tmp_path / 'out'}\n"
        "vllm_enforce_eager: true\n"
    )
    proc = run_cli("--config", str(recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "time per phase over 2 steps" in proc.stdout + proc.stderr
    assert (tmp_path / "out" / "model.safetensors").exists()


def first_character(completions: list[str], **kwargs) -> list[float]:
    """A reward that differs within nearly every group, so that every step moves the adapter."""
    return [float(ord(c[0])) if c else 0.0 for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_peft_config_trains_and_the_engine_samples_the_trained_adapter(tmp_path, lora_sync):
    args = tiny.run_config(str(tmp_path), 2, lora_sync=lora_sync, per_device_train_batch_size=16, num_generations=4,
                           logging_steps=1)  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    trainer = GRPOTrainer(tiny.build_model(), first_character, args, tiny.letters_dataset(32),
                          processing_class=tiny.build_tokenizer(), peft_config=lora)  # fmt: skip
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # the adapter trained
    gaps = [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history if "loss" in h]
    # Step 2 samples after the first update: the engine computes what the trained model computes.
    assert len(gaps) == 2 and gaps[1] < 1e-4
    assert (trainer.engine.lora_request is not None) == (lora_sync == "adapter")


def test_the_attributes_trl_copies_from_its_config_read_ours():
    """Every attribute TRL's GRPOTrainer.__init__ copies from its config (`self.x = args.y`), read from TRL's own
    source, exists on colograd's trainer with TRL's value for the same config; and TRL's constants of the colocated
    mode (`use_vllm`, `vllm_mode`) and of a dense model (`aux_loss_enabled`)."""
    import inspect
    import re

    import trl.trainer.grpo_trainer as trl_grpo

    from colograd.config.trl_compat import TRLTrainerAttributes

    copied = set(re.findall(r"\n\s+self\.([a-z]\w*) = args\.", inspect.getsource(trl_grpo.GRPOTrainer.__init__)))
    assert {"temperature", "top_p", "max_completion_length", "beta", "epsilon_low"} <= copied  # the source was read
    trainer = TRLTrainerAttributes()
    trainer.args = GRPOConfig(output_dir="x", temperature=0.7, top_p=0.9, epsilon=0.3, epsilon_high=None, beta=0.04)
    # colograd's `log_completions` is its stage that logs them (a method); TRL's is the config's bool.
    for name in sorted(copied - {"log_completions"}):
        assert name in vars(TRLTrainerAttributes), f"TRL's trainer has `{name}`; colograd's does not"
        assert not callable(getattr(GRPOTrainer, name, None)) or name == "epsilon_high"
    assert (trainer.temperature, trainer.top_p, trainer.beta) == (0.7, 0.9, 0.04)
    assert trainer.epsilon_low == trainer.epsilon_high == 0.3  # TRL: epsilon_high falls back to epsilon
    assert (trainer.use_vllm, trainer.vllm_mode, trainer.aux_loss_enabled) == (True, "colocate", False)
