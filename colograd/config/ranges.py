"""The range of every numeric field, declared once, checked when the config is built.

A value out of range (`num_generations: 0`, `top_p: 1.5`, `learning_rate: -1e-5`) otherwise passes the config and
is noticed late, by the engine or a library, after the model has loaded, or never. `RANGES` names the values
each numeric field of `GRPOConfig` (its `TrainingArguments` ones too) and of the `ModelConfig` fields colograd
reads may take; `check_ranges` refuses any other with one line naming the field and the range. A test walks every
numeric field and fails for one without an entry, so a field added later must declare its range.

Special values keep TRL's and transformers' meanings: `max_steps: -1` trains for `num_train_epochs`, `top_k` 0 or
-1 disables it, `save_steps`, `logging_steps`, `eval_steps` and `warmup_steps` below 1 are a fraction of the
training steps (the first three are not read while their strategy is not "steps"), `save_total_limit: 0` keeps every
checkpoint, `local_rank: -1` is no launcher.
"""

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from colograd.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (each included unless `*_open`), and the `special` values besides."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    special: tuple[float, ...] = ()
    why: str = ""
    when: str | None = None  # checked only while this strategy field is "steps" (transformers' rule)

    def holds(self, value: float) -> bool:
        """Whether `value` is in the range (NaN and infinities never are)."""
        if value in self.special:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below and math.isfinite(value)

    def describe(self) -> str:
        """The range in words, for the message: '1 or more', 'a value above 0', 'a value in (0, 1]', ..."""
        low, high = _number(self.low), _number(self.high)
        if math.isinf(self.high):
            words = f"a value above {low}" if self.low_open else f"{low} or more"
        elif math.isinf(self.low):
            words = f"a value below {high}" if self.high_open else f"{high} or less"
        else:
            words = f"a value in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if math.isinf(self.low) and math.isinf(self.high):
            words = "a finite number"
        return words + "".join(f", or {_number(s)}" for s in self.special)


# Whether a field is checked by `colograd.config.trl_compat` instead (accepted only at TRL's default value).
TRL_ONLY = Range(why="accepted only at TRL's default, see colograd/config/trl_compat.py")

ANY = Range()
AT_LEAST_1 = Range(1)
AT_LEAST_0 = Range(0)
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1)  # a probability or a mixing weight
SEED = Range(0, 2**32 - 1, why="numpy's seeds are 32-bit")


def _steps(strategy: str) -> Range:
    """A `*_steps` interval: above 0, read only while `strategy` is "steps" (transformers ignores it otherwise)."""
    return Range(0, low_open=True, why="below 1: a fraction of the training steps", when=strategy)


RANGES: dict[str, Range] = {
    # Generation
    "num_generations": Range(2, why="GRPO compares the completions of a group"),
    "num_generations_eval": AT_LEAST_1,
    "steps_per_generation": AT_LEAST_1,
    "dynamic_sampling_max_rounds": AT_LEAST_0,
    "dynamic_sampling_std_eps": AT_LEAST_0,
    "dynamic_sampling_oversample": Range(1),
    "partial_rollout_overprovision": Range(1),
    "partial_rollout_max_staleness": AT_LEAST_0,
    "generation_batch_size": AT_LEAST_1,
    "max_prompt_length": AT_LEAST_1,
    "max_completion_length": AT_LEAST_1,
    "temperature": Range(0, low_open=True, why="the log-probs are divided by it"),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(0, special=(-1,), why="0 or -1 disables it"),
    "min_p": FRACTION,
    "repetition_penalty": POSITIVE,
    "max_tool_calling_iterations": AT_LEAST_0,
    "tool_timeout": POSITIVE,
    # Engine
    "vllm_gpu_memory_utilization": Range(0, 1, low_open=True),
    "vllm_kv_cache_gib": POSITIVE,
    "vllm_max_model_length": AT_LEAST_1,
    "vllm_max_num_seqs": AT_LEAST_1,
    "vllm_max_num_batched_tokens": AT_LEAST_1,
    "vllm_tensor_parallel_size": AT_LEAST_1,
    "sync_bucket_mib": POSITIVE,
    # Loss
    "beta": AT_LEAST_0,
    "num_iterations": AT_LEAST_1,
    "epsilon": AT_LEAST_0,
    "epsilon_high": AT_LEAST_0,
    "delta": Range(1, low_open=True, why="it caps the importance ratio"),
    "reward_weights": ANY,
    "reward_timeout": AT_LEAST_0,
    "reward_sigterm_wait": AT_LEAST_0,
    "vllm_importance_sampling_clip_max": POSITIVE,
    "vllm_importance_sampling_clip_min": AT_LEAST_0,
    "vllm_importance_sampling_cap": POSITIVE,
    "off_policy_mask_threshold": POSITIVE,
    "sapo_temperature_pos": POSITIVE,
    "sapo_temperature_neg": POSITIVE,
    "vespo_k_pos": AT_LEAST_0,
    "vespo_k_neg": AT_LEAST_0,
    "vespo_lambda_pos": POSITIVE,
    "vespo_lambda_neg": POSITIVE,
    "top_entropy_quantile": FRACTION,
    "entropy_coef": ANY,
    "entropy_coef_min": ANY,
    "entropy_coef_max": ANY,
    "entropy_coef_delta": AT_LEAST_0,
    "entropy_target": AT_LEAST_0,
    "ref_model_mixup_alpha": FRACTION,
    "ref_model_sync_steps": AT_LEAST_1,
    # Training forward
    "packed_row_tokens": AT_LEAST_1,
    "micro_batch_tokens": AT_LEAST_1,
    "logps_chunk_tokens": AT_LEAST_1,
    # Logging
    "num_completions_to_print": AT_LEAST_0,
    "log_completions_steps": AT_LEAST_1,
    # TrainingArguments
    "learning_rate": AT_LEAST_0,
    "per_device_train_batch_size": AT_LEAST_1,
    "per_device_eval_batch_size": AT_LEAST_1,
    "gradient_accumulation_steps": AT_LEAST_1,
    "eval_accumulation_steps": AT_LEAST_1,
    "num_train_epochs": POSITIVE,
    "max_steps": Range(1, special=(-1,), why="-1 trains for num_train_epochs"),
    "warmup_steps": Range(0, why="below 1: a fraction of the training steps"),
    "weight_decay": AT_LEAST_0,
    "adam_beta1": Range(0, 1, high_open=True),
    "adam_beta2": Range(0, 1, high_open=True),
    "adam_epsilon": AT_LEAST_0,
    "max_grad_norm": Range(0, why="0 turns clipping off"),
    "label_smoothing_factor": FRACTION,
    "neftune_noise_alpha": POSITIVE,
    "torch_empty_cache_steps": AT_LEAST_1,
    "logging_steps": _steps("logging_strategy"),
    "eval_steps": _steps("eval_strategy"),
    "eval_delay": AT_LEAST_0,
    "save_steps": _steps("save_strategy"),
    "save_total_limit": Range(0, why="0 keeps every checkpoint"),
    "seed": SEED,
    "data_seed": SEED,
    "dataloader_num_workers": AT_LEAST_0,
    "dataloader_prefetch_factor": AT_LEAST_1,
    "ddp_bucket_cap_mb": AT_LEAST_1,
    "ddp_timeout": AT_LEAST_1,
    "hang_timeout": AT_LEAST_0,
    "local_rank": Range(0, special=(-1,), why="-1: not launched"),
    # ModelConfig (LoRA from the command line)
    "lora_r": AT_LEAST_1,
    "lora_alpha": POSITIVE,
    "lora_dropout": Range(0, 1, high_open=True),
    # TRL fields colograd accepts only at TRL's default
    "vllm_server_port": TRL_ONLY,
    "vllm_server_timeout": TRL_ONLY,
    "vllm_group_port": TRL_ONLY,
    "pad_to_multiple_of": TRL_ONLY,
    "router_aux_loss_coef": AT_LEAST_0,
    # open-r1's reward parameters (its recipes set them; `colograd.config.open_r1`)
    "cosine_min_value_wrong": ANY,
    "cosine_max_value_wrong": ANY,
    "cosine_min_value_correct": ANY,
    "cosine_max_value_correct": ANY,
    "cosine_max_len": AT_LEAST_1,
    "repetition_n_grams": AT_LEAST_1,
    "repetition_max_penalty": Range(high=0, why="a penalty: open-r1 refuses a positive one"),
    "max_completion_len": AT_LEAST_1,
    "soft_punish_cache": AT_LEAST_0,
    "code_eval_test_batch_size": Range(special=(-1,), low=1, why="-1: every case at once (open-r1's)"),
    "parallel_code_exec_per_proc": AT_LEAST_1,
    "code_float_tolerance": Range(0, 1, high_open=True),
}


def check_ranges(config: Any) -> None:
    """Raise `ConfigError` for the first numeric field of `config` (a dataclass) outside its declared range, or
    not a number of its kind; None passes where the field may be None."""
    for f, kind, optional, is_list in numeric_fields(type(config)):
        declared = RANGES.get(f.name)
        if declared is None or declared is TRL_ONLY:
            continue
        value = getattr(config, f.name)
        if (value is None and optional) or not _applies(config, declared):
            continue
        if is_list and not isinstance(value, list | tuple):
            raise ConfigError(f"{f.name}={value!r}: give a list of numbers, each {declared.describe()}.")
        for number in value if is_list else [value]:
            _check(f.name, value, number, kind, declared, optional)


def _applies(config: Any, declared: Range) -> bool:
    """Whether the range applies: always, or while its strategy field is "steps" (a str or transformers' enum)."""
    if declared.when is None:
        return True
    strategy = getattr(config, declared.when, "steps")
    return getattr(strategy, "value", strategy) == "steps"


def _check(name: str, value: Any, number: Any, kind: type, declared: Range, optional: bool) -> None:
    """One number of a field (a list field's element) against its kind and range."""
    none = ", or to None" if optional else ""
    if kind is int and not (isinstance(number, int) and not isinstance(number, bool)):
        raise ConfigError(f"{name}={value!r}: set it to a whole number, {declared.describe()}{none}.")
    if not isinstance(number, int | float) or isinstance(number, bool):
        raise ConfigError(f"{name}={value!r}: set it to a number, {declared.describe()}{none}.")
    if not declared.holds(number):
        why = f" ({declared.why})" if declared.why else ""
        raise ConfigError(f"{name}={value!r}: set it to {declared.describe()}{none}{why}.")


@functools.cache
def numeric_fields(cls: type) -> list[tuple[dataclasses.Field, type, bool, bool]]:
    """The fields of dataclass `cls` that hold numbers (or lists of them): each with `int` or `float`, whether it
    may be None, and whether it is a list. A field that also takes text (`int | str`) counts as numeric."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        members = _members(hints[f.name])
        numbers = [m for m in members if m in (int, float)]
        if numbers:
            is_list = "list[" in str(hints[f.name])
            found.append((f, float if float in numbers else int, type(None) in members, is_list))
    return found


def _members(hint: Any) -> list[Any]:
    """A type hint's members: `int | None` -> [int, NoneType]; `list[float] | None` -> [float, NoneType]."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [m for member in typing.get_args(hint) for m in _members(member)]
    if typing.get_origin(hint) is list:
        return list(typing.get_args(hint))
    return [hint]


def _number(x: float) -> str:
    """A bound as it reads best: 1 rather than 1.0."""
    return str(int(x)) if float(x).is_integer() else str(x)
