"""The trainer's checks: what `GRPOTrainer` is given, checked before a model loads, before the Trainer starts and
before the engine starts, and what they measured, as one value (`TrainerInputs`) the trainer reads.

    check_call     the arguments themselves, before anything is loaded (TRL's order, what colograd refuses)
    check_trainer  the model, settings, data (every row of an in-memory dataset; a stream's first rows), images,
                   rewards and engine limits, with what the run cannot do (dynamic sampling, partial rollouts,
                   groups that span ranks)
    check_wrapped_trainer  once accelerate, DeepSpeed or FSDP have set up: what those refuse
"""

import logging
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback
from transformers.trainer_utils import has_length

from colograd.config.core import ConfigError, GRPOConfig
from colograd.config.trl_compat import QUANTIZED, check_refused_parameters, environment_dataset
from colograd.data.core import sampled_prompt_tokens
from colograd.engine.lora import check_lora
from colograd.engine.settings import architecture_name
from colograd.forward.logps import check_fp32_head
from colograd.models import logit_transform
from colograd.models.model_files import check_model_tokens
from colograd.models.precision import master_copy_warning
from colograd.preflight.core import check_data, check_prompts, check_settings, check_stream_data, prompt_room
from colograd.preflight.engine import check_engine
from colograd.preflight.env import check_environment
from colograd.rewards.core import RewardFunc
from colograd.rollout.dynamic import refuse_unrefillable
from colograd.rollout.partial import refuse_unresumable
from colograd.rollout.spans import check_spanning
from colograd.vision.checks import check_image_data
from colograd.vision.core import text_tokenizer


@dataclass(frozen=True)
class TrainerInputs:
    """What `check_trainer` measured, which sizes the engine and shapes the rollouts.

    train_dataset: the rows to train on: without invalid rows (`drop_invalid_prompts`); an environment's stand-in
        rows where one environment gives the prompts.
    lora_rank: the adapter's rank when the engine serves the adapter itself (`lora_sync: adapter`), else None.
    longest_prompt: the most tokens of any templated prompt the engine will get, where every one was measured
        (in-memory text datasets, no tools or environments), else None.
    images_per_prompt: the most images in one prompt (0: text prompts).
    expected_prompt_tokens: the longest prompt expected, which sizes the engine's KV cache where `max_prompt_length`
        does not: measured, or sampled from the first rows.
    """

    train_dataset: Any
    lora_rank: int | None
    longest_prompt: int | None
    images_per_prompt: int
    expected_prompt_tokens: int | None


def check_call(
    args: GRPOConfig,
    model: Any,
    eval_dataset: Any,
    processing_class: Any,
    reward_processing_classes: Any,
    quantization_config: Any,
) -> None:
    """The checks that need nothing loaded, first: the environment (caches, hardware, launch variables, and a model
    named by path), TRL's argument order, and what colograd refuses of TRL's parameters."""
    check_environment(args, model if isinstance(model, str) else None)
    check_argument_order(eval_dataset, reward_processing_classes)
    check_refused_parameters(quantization_config=quantization_config)
    check_trainer_arguments(eval_dataset, processing_class)


def check_trainer(
    model: PreTrainedModel,
    processing_class: Any,
    args: GRPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    reward_funcs: list[RewardFunc],
    *,
    agents: Any = None,
    rollout_func: Any = None,
    environment_factory: Any = None,
) -> TrainerInputs:
    """Everything the trainer is given, checked before the Trainer and the engine start (a bad row, reward or
    setting fails here in one line); returns what the checks measured.

    Args:
        model: the policy, prepared (`colograd.models.policy.prepare_policy`).
        processing_class: its tokenizer, or a vision-language model's processor.
        reward_funcs: the resolved reward functions, an environment's own included.
        agents: the run's tools, environments or `rollout_func` (`colograd.agents.core.Agents`), if any.
        rollout_func, environment_factory: as given to the trainer: what the rewards are also called with.
    """
    check_reward_source(reward_funcs)
    refuse_unrefillable(args, train_dataset, agents is not None)
    # An environment reaches the rewards as `environments`; a rollout_func's own fields show only at rollout time,
    # so then the rewards' parameters are not checked before it.
    rewards_also_get = None if rollout_func else (["environments"] if environment_factory else [])
    # Image rows: checked first, on a sample of the rows (every row is checked again at its rollout: `check_row`);
    # their prompts' lengths count the expanded images (the text checks cannot).
    template = args.chat_template_kwargs
    images, longest_image = check_image_data(
        model, processing_class, train_dataset, template, max_prompt_length=args.max_prompt_length
    )
    if isinstance(eval_dataset, Dataset):
        eval_images, eval_longest = check_image_data(
            model, processing_class, eval_dataset, template, "eval_dataset", args.max_prompt_length
        )
        images = max(images, eval_images)
        if eval_longest is not None:
            longest_image = max(longest_image or 0, eval_longest)
    refuse_unresumable(args, train_dataset, agents is not None, bool(images))
    check_spanning(args, agents is not None, bool(images))
    tokenizer = text_tokenizer(processing_class)
    train_dataset, lora_rank, longest = check_trainer_inputs(
        model, tokenizer, args, train_dataset, reward_funcs, rewards_also_get, eval_dataset
    )
    # Every prompt measured bounds the engine's context, unless images (measured on the first rows only), turns of
    # tools or an environment lengthen them.
    if longest_image is not None or agents is not None:
        longest = None
    # After the checks: TRL's stand-in rows for an environment that gives the prompts have empty messages.
    train_dataset = environment_dataset(train_dataset, environment_factory, args)
    if longest_image is not None:
        expected = longest_image
    elif longest is None:
        schemas = (agents.schemas or None) if agents is not None else None
        expected = sampled_prompt_tokens(train_dataset, processing_class, schemas, template)
    else:
        expected = longest
    return TrainerInputs(train_dataset, lora_rank, longest, images, expected)


def check_argument_order(eval_dataset: Any, reward_processing_classes: Any = None) -> None:
    """Arguments given in another order than TRL's: a tokenizer where `eval_dataset` is (before
    `processing_class`), callbacks where `reward_processing_classes` is (before `callbacks`)."""
    if isinstance(eval_dataset, PreTrainedTokenizerBase):
        raise ConfigError(
            "eval_dataset is a tokenizer: GRPOTrainer takes TRL's argument order (model, reward_funcs, args, "
            "train_dataset, eval_dataset, processing_class); pass it as processing_class=..."
        )
    given = reward_processing_classes if isinstance(reward_processing_classes, list) else [reward_processing_classes]
    if any(isinstance(c, TrainerCallback) or (isinstance(c, type) and issubclass(c, TrainerCallback)) for c in given):
        raise ConfigError(
            "reward_processing_classes holds callbacks: GRPOTrainer takes TRL's argument order (..., "
            "processing_class, reward_processing_classes, callbacks); pass them as callbacks=..."
        )


def check_trainer_arguments(eval_dataset: Any, processing_class: Any) -> None:
    """What TRL's `GRPOTrainer` takes and colograd does not: several eval datasets; and a processing class that is
    neither a tokenizer nor a processor."""
    if isinstance(eval_dataset, dict):
        raise ConfigError(
            "eval_dataset is a dict of datasets, which colograd does not evaluate one by one; pass one Dataset."
        )
    if eval_dataset is not None and not has_length(eval_dataset):
        raise ConfigError("eval_dataset is a stream; evaluation takes an in-memory Dataset (e.g. its first rows).")
    if processing_class is not None and not isinstance(processing_class, PreTrainedTokenizerBase | ProcessorMixin):
        raise ConfigError(
            f"processing_class is a {type(processing_class).__name__}: pass the model's tokenizer, or for a "
            "vision-language model its processor (AutoProcessor)."
        )


def check_trainer_inputs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    args: GRPOConfig,
    train_dataset: Any,
    reward_funcs: list[RewardFunc],
    rewards_also_get: list[str] | None = (),
    eval_dataset: Any = None,
) -> tuple[Any, int | None, int | None]:
    """What `GRPOTrainer` checks before the Trainer and the engine start: the model's adapter and head, the
    settings, every row of an in-memory dataset (the first rows of a stream) and of an in-memory `eval_dataset`,
    the engine's limits.

    Args:
        rewards_also_get: see `check_data`.

    Returns:
        The dataset (without its invalid rows, with `drop_invalid_prompts`); the adapter's rank when the engine
        serves the adapter itself (`lora_sync: adapter`), else None; and the most tokens of any templated prompt
        the run will give the engine, where every one was measured (in-memory datasets), else None.
    """
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        raise ConfigError(f"model is quantized: {QUANTIZED}.")
    # An adapter the chosen sync cannot serve is refused now, not at the first generation.
    lora_rank = check_lora(model.active_peft_config, args.lora_sync) if isinstance(model, PeftModel) else None
    if args.cast_lm_head_to_fp32:
        check_fp32_head(model.get_output_embeddings())
    logit_transform.of(model)  # what it does to its logits after the output layer, or a one-line refusal
    check_settings(args, model.config)
    check_model_tokens(model, tokenizer)
    room = prompt_room(args, model.config)
    longest = None
    if isinstance(train_dataset, Dataset):
        train_dataset, longest = check_prompts(
            train_dataset, tokenizer, template_kwargs=args.chat_template_kwargs, room=room
        )
        check_data(train_dataset, reward_funcs, args, rewards_also_get=rewards_also_get)
    elif train_dataset is not None and not has_length(train_dataset):
        train_dataset = check_stream_data(
            train_dataset, tokenizer, reward_funcs, args, rewards_also_get=rewards_also_get, room=room
        )
    for evaluated in eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]:
        if longest is not None and isinstance(evaluated, Dataset) and "prompt" in evaluated.column_names:
            _, eval_longest = check_prompts(
                evaluated, tokenizer, "eval_dataset", template_kwargs=args.chat_template_kwargs, room=room
            )
            longest = max(longest, eval_longest)
        elif evaluated is not None:
            longest = None  # prompts the checks have not measured: the engine keeps the model's context
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    check_engine(args, model.config, next(model.parameters()).dtype, lora_rank, architecture_name(base))
    return train_dataset, lora_rank, longest


def check_reward_source(reward_funcs: list[RewardFunc]) -> None:
    """At least one reward: `reward_funcs`, or an environment's `get_reward` (TRL's rule)."""
    if not reward_funcs:
        raise ConfigError(
            "No reward source provided: reward_funcs is None and no environment gives a reward; pass reward_funcs (a "
            "rollout_func's extra keys reach them as keyword arguments), or an environment_factory whose environments "
            "define get_reward."
        )


def check_wrapped_trainer(trainer: Any) -> None:
    """What `GRPOTrainer` checks once the Trainer has set up accelerate, DeepSpeed or FSDP, before the engine
    starts: the settings those refuse, and the master-weight warning."""
    args = trainer.args
    if args.micro_batch_tokens is not None and trainer.is_deepspeed_enabled:
        raise ConfigError(
            "micro_batch_tokens splits a micro-step into several backward passes, which DeepSpeed counts as "
            "micro-steps; remove it, or lower per_device_train_batch_size instead."
        )
    if trainer.is_fsdp_enabled and trainer.accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ConfigError("FSDP version 1 is not supported (flat parameters have no names); set fsdp_version: 2.")
    if args.vllm_enable_sleep_mode and not torch.cuda.is_available():
        raise ConfigError("vllm_enable_sleep_mode frees GPU memory and needs a GPU; remove it on this machine.")
    # DeepSpeed and FSDP2 step fp32 masters under mixed precision; DDP steps the parameters themselves.
    sharded_optimizer = trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled
    model = trainer.accelerator.unwrap_model(trainer.model)
    warning = master_copy_warning(model, sharded_optimizer and trainer.accelerator.mixed_precision != "no")
    if warning and trainer.accelerator.is_main_process:
        logging.getLogger("colograd.trainer").warning(warning)
