"""Train a model with GRPO from a YAML recipe; command-line flags override the recipe's keys.

accelerate launch colograd/train.py --config recipes/grpo_qwen.yaml --max_steps 10
python colograd/train.py --config recipes/grpo_tiny.yaml          # one process
"""

import os
import sys
from typing import Any, NoReturn

import torch
from peft import get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from trl import ModelConfig, TrlParser, get_peft_config

from colograd import GRPOConfig, GRPOTrainer, ScriptArguments, tiny
from colograd.config import ConfigError
from colograd.config_loading import model_init_kwargs, tokenizer_kwargs
from colograd.data import load_prompts
from colograd.modelcard import Recipe
from colograd.rewards import resolve_reward
from colograd.trl_compat import DROPPED_KEYS, RENAMED_KEYS, unknown_key_message


def load_model(args: ModelConfig, training_args: GRPOConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy and its tokenizer: a built-in tiny model, a local folder, or a hub id.

    The lengths are checked against the model's config before its weights are read.
    """
    name = args.model_name_or_path
    if name is None:
        raise ConfigError("model_name_or_path is not set; give a hub id, a local folder or colograd:tiny-qwen2.")
    if name.startswith(tiny.PREFIX):
        if name not in tiny.TINY_MODELS:
            raise ConfigError(f"model_name_or_path={name!r}: the built-in models are {', '.join(tiny.TINY_MODELS)}.")
        return tiny.build_model(tie_word_embeddings=tiny.TINY_MODELS[name]), tiny.build_tokenizer()
    if name.startswith((".", "/")) and not os.path.isdir(name):
        raise ConfigError(f"model_name_or_path={name!r} does not exist; give an existing folder or a hub id.")
    load_kwargs = {"revision": args.model_revision, "trust_remote_code": training_args.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(name, **load_kwargs)
    except OSError as err:  # not a folder, and not a hub id that can be reached
        raise ConfigError(f"model_name_or_path={name!r} cannot be loaded: {str(err).splitlines()[0]}") from err
    training_args.check_lengths(config)
    dtype = args.dtype if args.dtype in (None, "auto") else getattr(torch, args.dtype)
    model_kwargs = {"dtype": dtype, "attn_implementation": args.attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(name, **load_kwargs | model_kwargs | model_init_kwargs(training_args))
    return model, AutoTokenizer.from_pretrained(name, **load_kwargs | tokenizer_kwargs(training_args))


def check_supported(model_args: ModelConfig) -> None:
    """Refuse options this version does not implement, rather than ignore them."""
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ConfigError("load_in_4bit / load_in_8bit: quantized training is not supported; remove the flag.")


def main(
    script_args: ScriptArguments, training_args: GRPOConfig, model_args: ModelConfig, recipe: Recipe | None = None
) -> None:
    """Load, train, save (with the model card) and, with `push_to_hub`, upload."""
    check_supported(model_args)
    reward_funcs = [resolve_reward(name) for name in script_args.reward_funcs]
    dataset = load_prompts(script_args)
    evaluates = training_args.eval_strategy != "no"
    eval_dataset = load_prompts(script_args, script_args.dataset_test_split) if evaluates else None
    model, tokenizer = load_model(model_args, training_args)
    if model_args.use_peft:
        try:
            model = get_peft_model(model, get_peft_config(model_args))
        except ValueError as err:  # e.g. target modules the model does not have
            raise ConfigError(f"lora_target_modules: {str(err).splitlines()[0]}") from err
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        recipe=recipe,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # writes README.md, the model card, beside the weights
    if training_args.push_to_hub:
        trainer.push_to_hub()


def cli(argv: list[str] | None = None) -> None:
    """Parse, then run; configuration mistakes end in one line on stderr and exit code 2."""
    parser = _Parser((ScriptArguments, GRPOConfig, ModelConfig))
    try:
        # Parsing raises ValueError for unknown recipe keys and for values the dataclasses reject.
        script_args, training_args, model_args = parser.parse_args_and_config(argv)
    except ValueError as err:
        _fail(err)
    argv = sys.argv[1:] if argv is None else argv
    recipe = Recipe.from_argv(argv, model_args.model_name_or_path, script_args.dataset_name)
    try:
        main(script_args, training_args, model_args, recipe)
    except ConfigError as err:
        _fail(err)


class _Parser(TrlParser):
    """TRL's parser, but a bad flag or value (`--num_generations eight`) ends in one line, not the full usage; an
    unknown key is named with the closest known one; a key transformers 5 renamed is read as its new name."""

    def error(self, message: str) -> NoReturn:
        _fail(message)

    def parse_args_and_config(self, args: list[str] | None = None, **kwargs: Any) -> tuple:
        args = list(sys.argv[1:] if args is None else args)
        for i, arg in enumerate(args):
            name, sep, value = arg.removeprefix("--").partition("=")
            if arg.startswith("--") and name in RENAMED_KEYS:
                args[i] = f"--{_renamed(name)}{sep}{value}"
        return super().parse_args_and_config(args, **kwargs)

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        for key in DROPPED_KEYS.keys() & kwargs.keys():
            print(f"colograd: note: {key} ignored: {DROPPED_KEYS[key]}.", file=sys.stderr)
            del kwargs[key]
        kwargs = {_renamed(key) if key in RENAMED_KEYS else key: value for key, value in kwargs.items()}
        known = {action.dest for action in self._actions}
        for key in kwargs:
            if key not in known:
                raise ValueError(unknown_key_message(key, sorted(known)))
        return super().set_defaults_with_config(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        # Checked here, before the dataclasses are built (and validated), so the unknown flag is what is reported.
        namespace, remaining = super().parse_known_args(args, namespace)
        flags = [arg for arg in remaining if arg.startswith("--")]
        if flags:
            known = sorted(action.dest for action in self._actions)
            raise ValueError(unknown_key_message(flags[0].removeprefix("--").partition("=")[0], known))
        return namespace, remaining


def _renamed(key: str) -> str:
    """The name transformers 5 gave a `TrainingArguments` key, with a note on stderr that it was read so."""
    print(f"colograd: note: {key} was renamed {RENAMED_KEYS[key]} in transformers 5; read as such.", file=sys.stderr)
    return RENAMED_KEYS[key]


def _fail(err: Exception | str) -> NoReturn:
    print(f"colograd: error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    cli()
