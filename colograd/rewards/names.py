"""The built-in reward names a recipe may give, each with its ecosystem's meaning: open-r1's registry names are
open-r1's functions (`colograd.rewards.open_r1`), the `trl grpo` script's names TRL's (`trl.rewards`), and colograd's
own names colograd's; `reward_meanings` says which each name became, in the run's first lines. A name's function is
made from the run's `ScriptArguments` (open-r1's parameters, the code sandbox) when the name is resolved
(`colograd.rewards.core.resolve_reward`)."""

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from colograd.errors import ConfigError

RewardFunc = Callable[..., list[float | None]]


def _letters(options: Any) -> RewardFunc:
    from colograd.models.tiny import letters_reward

    return letters_reward


def _colour(options: Any) -> RewardFunc:
    from colograd.models.tiny_vlm import colour_reward

    return colour_reward


def _trl(name: str) -> Callable[[Any], RewardFunc]:
    """TRL's reward function `name` (`trl.rewards`), imported when asked for."""
    return lambda options: getattr(importlib.import_module("trl.rewards"), name)


def _trl_soft_overlong(options: Any) -> RewardFunc:
    from trl.rewards import get_soft_overlong_punishment

    return get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)  # TRL's script's values


def _open_r1(name: str) -> Callable[[Any], RewardFunc]:
    """open-r1's reward function `name` (`colograd.rewards.open_r1`), which takes no parameters."""
    return lambda options: getattr(importlib.import_module("colograd.rewards.open_r1"), name)


def _cosine(options: Any) -> RewardFunc:
    from colograd.rewards.open_r1 import get_cosine_scaled_reward

    return get_cosine_scaled_reward(
        min_value_wrong=options.cosine_min_value_wrong,
        max_value_wrong=options.cosine_max_value_wrong,
        min_value_correct=options.cosine_min_value_correct,
        max_value_correct=options.cosine_max_value_correct,
        max_len=options.cosine_max_len,
    )


def _repetition(options: Any) -> RewardFunc:
    from colograd.rewards.open_r1 import get_repetition_penalty_reward

    try:
        return get_repetition_penalty_reward(options.repetition_n_grams, options.repetition_max_penalty)
    except ValueError as err:
        raise ConfigError(f"reward_funcs: repetition_penalty: {err}; give repetition_max_penalty <= 0.") from None


def _code_format(options: Any) -> RewardFunc:
    from colograd.rewards.open_r1 import get_code_format_reward

    return get_code_format_reward(options.code_language)


def _soft_overlong(options: Any) -> RewardFunc:
    from colograd.rewards.open_r1 import get_soft_overlong_punishment

    return get_soft_overlong_punishment(options.max_completion_len, options.soft_punish_cache)


def _code(options: Any) -> RewardFunc:
    from colograd.rewards.code import code_reward

    return code_reward(
        options.code_sandbox,
        options.code_output_lines,
        options.code_checker,
        options.code_float_tolerance,
        options.code_cases,
    )


def _cf_code(options: Any) -> RewardFunc:
    from colograd.rewards.code_codeforces import cf_code_reward

    return cf_code_reward(options.code_eval_test_batch_size, options.code_eval_scoring_mode, options.code_sandbox)


def _ioi_code(options: Any) -> RewardFunc:
    from colograd.rewards.code_ioi import ioi_code_reward

    return ioi_code_reward(options.code_eval_test_batch_size, options.ioi_provider, options.code_sandbox)


def _binary_code(options: Any) -> RewardFunc:
    from colograd.rewards.code import binary_code_reward

    return binary_code_reward(
        options.code_sandbox,
        options.code_output_lines,
        options.code_checker,
        options.code_float_tolerance,
        options.code_cases,
    )


@dataclass(frozen=True)
class Builtin:
    """A built-in reward name: how its function is made from the run's `ScriptArguments` (open-r1's parameters,
    the code sandbox), and what it is, in the words the run's first lines use."""

    make: Callable[[Any], RewardFunc]
    means: str


_OPEN_R1 = "open-r1's"
# Each name means what its ecosystem means: open-r1's registry names (src/open_r1/rewards.py) are open-r1's
# functions, TRL's script names (trl/scripts/grpo.py) TRL's, and colograd's own names colograd's.
BUILTIN_REWARDS: dict[str, Builtin] = {
    # open-r1's 13 names
    "accuracy": Builtin(_open_r1("accuracy_reward"), f"{_OPEN_R1} accuracy (math_verify, strict LaTeX, boxed first)"),
    "format": Builtin(_open_r1("format_reward"), f"{_OPEN_R1} format (<think>...</think> then <answer>...</answer>)"),
    "tag_count": Builtin(_open_r1("tag_count_reward"), f"{_OPEN_R1} tag_count (0.25 per think/answer tag)"),
    "reasoning_steps": Builtin(_open_r1("reasoning_steps_reward"), f"{_OPEN_R1} reasoning_steps (3 steps: 1.0)"),
    "length": Builtin(_open_r1("len_reward"), f"{_OPEN_R1} length (Kimi 1.5, characters, within the batch)"),
    "cosine": Builtin(_cosine, f"{_OPEN_R1} cosine (correctness scaled by characters / cosine_max_len)"),
    "repetition_penalty": Builtin(_repetition, f"{_OPEN_R1} repetition_penalty (word n-grams)"),
    "code": Builtin(_code, f"{_OPEN_R1} code (pass rate, in colograd's sandbox)"),
    "binary_code": Builtin(_binary_code, f"{_OPEN_R1} binary_code (pass rate above 0.99, in colograd's sandbox)"),
    "cf_code": Builtin(
        _cf_code, f"{_OPEN_R1} cf_code (Codeforces tests, checker and code_eval_scoring_mode, in colograd's sandbox)"
    ),
    "ioi_code": Builtin(
        _ioi_code,
        f"{_OPEN_R1} ioi_code (an IOI subtask: the CMS grader's minimum over its tests, in colograd's sandbox)",
    ),
    "code_format": Builtin(_code_format, f"{_OPEN_R1} code_format (think, then an answer with a code_language block)"),
    "soft_overlong_punishment": Builtin(
        _soft_overlong, f"{_OPEN_R1} soft_overlong_punishment (max_completion_len, soft_punish_cache tokens)"
    ),
    # TRL's script's names
    "accuracy_reward": Builtin(_trl("accuracy_reward"), "TRL's accuracy_reward"),
    "think_format_reward": Builtin(_trl("think_format_reward"), "TRL's think_format_reward (<think>...</think> only)"),
    "reasoning_accuracy_reward": Builtin(_trl("reasoning_accuracy_reward"), "TRL's reasoning_accuracy_reward"),
    "get_soft_overlong_punishment": Builtin(
        _trl_soft_overlong, "TRL's get_soft_overlong_punishment (1280 tokens, 256 of them graded, TRL's script's)"
    ),
    # colograd's own, and its short names of TRL's functions
    "letters": Builtin(_letters, "colograd's letters (the built-in dataset)"),
    "colour": Builtin(_colour, "colograd's colour (the built-in image dataset)"),
    "think_format": Builtin(_trl("think_format_reward"), "TRL's think_format_reward (<think>...</think> only)"),
    "reasoning_accuracy": Builtin(_trl("reasoning_accuracy_reward"), "TRL's reasoning_accuracy_reward"),
}


def reward_meanings(names: Sequence[str]) -> str:
    """One line saying what each open-r1 or TRL name of `names` is ("" when there is none): 'rewards: accuracy is
    open-r1's accuracy (...); ...'. colograd's own names (`letters`) go unsaid."""
    builtins = [name for name in names if name in BUILTIN_REWARDS]
    said = [f"{n} is {BUILTIN_REWARDS[n].means}" for n in builtins if not BUILTIN_REWARDS[n].means.startswith("colo")]
    return f"rewards: {'; '.join(said)}." if said else ""
