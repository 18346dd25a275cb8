"""Reward functions: resolving them by name, and scoring a rollout in-rank.

A reward function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``,
where ``columns`` are the dataset's other columns (one value per completion) plus ``trainer_state``.
``None`` means "this function has no opinion on this sample": it is left out of that function's mean and
counts 0 in the weighted total.
"""

import importlib
from collections.abc import Callable, Sequence

import torch

from colograd.config import ConfigError

RewardFunc = Callable[..., list[float | None]]


def _letters() -> RewardFunc:
    from colograd.tiny import letters_reward

    return letters_reward


def _accuracy() -> RewardFunc:
    from trl.rewards import accuracy_reward

    return accuracy_reward


def _format() -> RewardFunc:
    from trl.rewards import think_format_reward

    return think_format_reward


BUILTIN_REWARDS: dict[str, Callable[[], RewardFunc]] = {
    "letters": _letters,
    "accuracy": _accuracy,
    "format": _format,
}


def resolve_reward(name: str) -> RewardFunc:
    """A built-in reward by name, or user code by dotted path: ``pkg.rewards.length`` or ``pkg.rewards:length``."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]()
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep:
        raise ConfigError(
            f"reward_funcs: {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor a dotted path "
            "like my_pkg.rewards.my_reward."
        )
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward_funcs: cannot import {name!r} ({err}); check the module is importable.") from err
    if not callable(func):
        raise ConfigError(f"reward_funcs: {name!r} is not callable.")
    return func


def reward_name(func: RewardFunc) -> str:
    """The name metrics use for a reward function: ``rewards/<name>/mean``."""
    return getattr(func, "__name__", type(func).__name__)


def score(
    reward_funcs: Sequence[RewardFunc],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> torch.Tensor:
    """Run every reward function on every completion.

    Returns:
        rewards_NF: float32 [N completions, F functions]; NaN where a function returned ``None``.
    """
    n = len(completions)
    rewards_NF = torch.zeros(n, len(reward_funcs), dtype=torch.float32)
    for j, func in enumerate(reward_funcs):
        values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if len(values) != n:
            raise ValueError(
                f"reward function {reward_name(func)!r} returned {len(values)} rewards for {n} completions"
            )
        rewards_NF[:, j] = torch.tensor([float("nan") if v is None else float(v) for v in values])
    return rewards_NF
