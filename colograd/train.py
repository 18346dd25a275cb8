"""Train a model with GRPO from a YAML recipe; command-line flags override the recipe's keys.

accelerate launch colograd/train.py --config recipes/grpo_qwen.yaml --max_steps 10
python colograd/train.py --config recipes/grpo_tiny.yaml          # one process
"""

import os
import sys
from typing import NoReturn

import torch
from peft import get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from trl import ModelConfig, TrlParser, get_peft_config

from colograd import GRPOConfig, GRPOTrainer, ScriptArguments, pretrained, tiny
from colograd.config import ConfigError
from colograd.data import load_prompts
from colograd.modelcard import Recipe
from colograd.rewards import resolve_reward


def load_model(args: ModelConfig, training_args: GRPOConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy and its tokenizer: a built-in tiny model, a built-in pretrained one (converted once into a
    local folder), a local folder, or a hub id.

    The lengths are checked against the model's config before its weights are read.
    """
    name = args.model_name_or_path
    if name is None:
        raise ConfigError("model_name_or_path is not set; give a hub id, a local folder or colograd:tiny-qwen2.")
    if name in pretrained.MODELS:
        name = pretrained.materialise(name)
    if name.startswith(tiny.PREFIX):
        if name not in tiny.TINY_MODELS:
            built_in = ", ".join([*tiny.TINY_MODELS, *pretrained.MODELS])
            raise ConfigError(f"model_name_or_path={name!r}: the built-in models are {built_in}.")
        return tiny.build_model(tie_word_embeddings=tiny.TINY_MODELS[name]), tiny.build_tokenizer()
    if name.startswith((".", "/")) and not os.path.isdir(name):
        raise ConfigError(f"model_name_or_path={name!r} does not exist; give an existing folder or a hub id.")
    try:
        config = AutoConfig.from_pretrained(name, revision=args.model_revision)
    except OSError as err:  # not a folder, and not a hub id that can be reached
        raise ConfigError(f"model_name_or_path={name!r} cannot be loaded: {str(err).splitlines()[0]}") from err
    training_args.check_lengths(config)
    dtype = args.dtype if args.dtype in (None, "auto") else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        name, revision=args.model_revision, dtype=dtype, attn_implementation=args.attn_implementation
    )
    return model, AutoTokenizer.from_pretrained(name, revision=args.model_revision)


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
    """TRL's parser, but a bad flag or value (`--num_generations eight`) ends in one line, not the full usage."""

    def error(self, message: str) -> NoReturn:
        _fail(message)


def _fail(err: Exception | str) -> NoReturn:
    print(f"colograd: error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    cli()
