"""Reward functions: resolving them by name, reward models, and scoring a rollout in-rank.

A reward function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``,
where ``columns`` are the dataset's other columns (one value per completion) plus ``trainer_state``.
``None`` means "this function has no opinion on this sample": it is left out of that function's mean and
counts 0 in the weighted total. A function may be a coroutine function (``async def``): all of those run
concurrently, on an event loop of their own. A sequence-classification model serves as a reward through
`RewardModel`: its first logit scores prompt + completion.
"""

import asyncio
import importlib
import inspect
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from trl.data_utils import apply_chat_template, is_conversational

from colograd.config import ConfigError

RewardFunc = Callable[..., list[float | None]]


class RewardModel:
    """A sequence-classification model as a reward function: the first logit of prompt + completion.

    Conversational samples are rendered with the reward tokenizer's chat template, as TRL does.

    Args:
        model: a `...ForSequenceClassification` model (one label is read).
        tokenizer: its tokenizer; needs a pad token, since samples are batched.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        # Batched scoring reads each row's last real token, which the model finds through the pad id.
        self.model.config.pad_token_id = tokenizer.pad_token_id
        self.__name__ = os.path.basename(str(model.config._name_or_path).rstrip("/")) or type(model).__name__

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        if is_conversational({"prompt": prompts[0]}):
            texts = [
                apply_chat_template({"messages": p + c}, self.tokenizer)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        device = next(self.model.parameters()).device
        batch = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(device)
        with torch.inference_mode():
            return self.model(**batch).logits[:, 0].float().tolist()

    @classmethod
    def from_pretrained(cls, name: str) -> "RewardModel":
        """Load a reward model and its tokenizer from a local folder or a hub id."""
        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)
        return cls(model, AutoTokenizer.from_pretrained(name))


def _letters() -> RewardFunc:
    from colograd.tiny import letters_reward

    return letters_reward


def _accuracy() -> RewardFunc:
    from trl.rewards import accuracy_reward

    return accuracy_reward


def _reasoning_accuracy() -> RewardFunc:
    from trl.rewards import reasoning_accuracy_reward

    return reasoning_accuracy_reward


def _think_format() -> RewardFunc:
    from trl.rewards import think_format_reward

    return think_format_reward


def tag_count_reward(completions: list, **kwargs: Any) -> list[float]:
    """open-r1's `tag_count`: 0.25 for each of `<think>\n`, `\n</think>\n`, `\n<answer>\n`, `\n</answer>` that
    occurs exactly once in a completion (text, or a chat's assistant message)."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(0.25 for tag in tags if text.count(tag) == 1) for text in texts]


BUILTIN_REWARDS: dict[str, Callable[[], RewardFunc]] = {
    "letters": _letters,
    "accuracy": _accuracy,
    "reasoning_accuracy": _reasoning_accuracy,
    "format": _think_format,
    "think_format": _think_format,
    "tag_count": lambda: tag_count_reward,
}


def resolve_reward(name: str) -> RewardFunc:
    """A reward function from its name in a recipe.

    Args:
        name: a built-in name (`BUILTIN_REWARDS`); a local folder or hub id (``org/model``) of a
            sequence-classification reward model; or a dotted path to user code, ``pkg.rewards.length`` or
            ``pkg.rewards:length``.
    """
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]()
    if os.path.isdir(name) or "/" in name:
        try:
            return RewardModel.from_pretrained(name)
        except OSError as err:
            raise ConfigError(f"reward_funcs: cannot load the reward model {name!r} ({err}).") from err
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep:
        raise ConfigError(
            f"reward_funcs: {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}), a reward model folder, "
            "nor a dotted path like my_pkg.rewards.my_reward."
        )
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward_funcs: cannot import {name!r} ({err}); check the module is importable.") from err
    if not callable(func):
        raise ConfigError(f"reward_funcs: {name!r} is not callable.")
    return func


def resolve_rewards(
    reward_funcs: RewardFunc | str | PreTrainedModel | list | None,
    reward_weights: list[float] | None,
    processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase | None] | None = None,
) -> tuple[list[RewardFunc], torch.Tensor]:
    """The trainer's reward functions and their weights, from TRL's `reward_funcs` and `reward_processing_classes`.

    Args:
        reward_funcs: functions, names (`resolve_reward`), sequence-classification models; one, a list, or None.
        reward_weights: one weight per function, or None for all 1.
        processing_classes: TRL's `reward_processing_classes`: the tokenizer of each reward model (one, or a list
            aligned with `reward_funcs`); an entry is read only for a model, and None loads the model's own.

    Returns:
        The functions, each model made a `RewardModel`, and their weights [F].
    """
    if reward_funcs is None:
        reward_funcs = []
    elif not isinstance(reward_funcs, list):
        reward_funcs = [reward_funcs]
    if processing_classes is None:
        processing_classes = [None] * len(reward_funcs)
    elif not isinstance(processing_classes, list):
        processing_classes = [processing_classes]
    if len(processing_classes) != len(reward_funcs):
        raise ConfigError(
            f"reward_processing_classes has {len(processing_classes)} entries for {len(reward_funcs)} reward "
            "functions; give one per function (None for those that are not reward models)."
        )
    funcs = [_resolve(f, tokenizer) for f, tokenizer in zip(reward_funcs, processing_classes, strict=True)]
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ConfigError(
            f"reward_weights has {len(reward_weights)} values for {len(funcs)} reward functions; give one weight "
            "per function."
        )
    return funcs, torch.tensor(reward_weights or [1.0] * len(funcs), dtype=torch.float32)


def _resolve(func: Any, tokenizer: PreTrainedTokenizerBase | None) -> RewardFunc:
    """One entry of `reward_funcs` as a reward function; a reward model gets `tokenizer`, or its own (TRL's)."""
    if isinstance(func, str):
        func = resolve_reward(func)
        if isinstance(func, RewardModel) and tokenizer is not None:
            return RewardModel(func.model, tokenizer)
        return func
    if isinstance(func, PreTrainedModel):
        return RewardModel(func, tokenizer if tokenizer is not None else _reward_tokenizer(func))
    if isinstance(func, torch.nn.Module):
        raise ConfigError(
            f"reward_funcs: {type(func).__name__} is a torch module but not a transformers model; pass a "
            "sequence-classification model, or wrap it in a function with TRL's reward signature."
        )
    return func


def _reward_tokenizer(model: PreTrainedModel) -> PreTrainedTokenizerBase:
    """A reward model's tokenizer, loaded from the name it was loaded from, as TRL does."""
    name = model.config._name_or_path
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"reward_funcs: cannot load the tokenizer of reward model {type(model).__name__} ({name!r}: "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}); pass it in reward_processing_classes."
        ) from err


def across_ranks(accelerator: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gather of every rank's values of a 1-D tensor: rewards, for what TRL normalises over the whole batch, and
    per-token entropies, for the high-entropy mask's quantile.

    Returns:
        A function of this rank's values [N] giving all ranks' [M] (on this rank's device), a rank with fewer
        padded with NaN, which the nan-aware statistics leave out. A collective: every rank must call it.
    """

    def gather(rewards_N: torch.Tensor) -> torch.Tensor:
        local = rewards_N.to(accelerator.device)
        padded = accelerator.pad_across_processes(local, dim=0, pad_index=float("nan"))
        return accelerator.gather(padded).to(rewards_N.device)

    return gather


def reward_name(func: RewardFunc) -> str:
    """The name metrics use for a reward function: ``rewards/<name>/mean``."""
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: RewardFunc) -> bool:
    # An instance whose __call__ is `async def` counts too.
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def score(
    reward_funcs: Sequence[RewardFunc],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> torch.Tensor:
    """Run every reward function on every completion; the async ones concurrently.

    Returns:
        rewards_NF: float32 [N completions, F functions]; NaN where a function returned ``None``.
    """
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    outputs: dict[int, list] = {}
    coroutines = {}
    for j, func in enumerate(reward_funcs):
        if _is_async(func):
            coroutines[j] = func(**kwargs)
            continue
        try:
            outputs[j] = func(**kwargs)
        except Exception as err:
            raise RewardError(_describe_failure(func, kwargs, err)) from err
    if coroutines:
        outputs.update(zip(coroutines, _run_concurrently(list(coroutines.values())), strict=True))

    n = len(completions)
    rewards_NF = torch.zeros(n, len(reward_funcs), dtype=torch.float32)
    for j, func in enumerate(reward_funcs):
        rewards_NF[:, j] = _checked(func, outputs[j], kwargs)
    return rewards_NF


class RewardError(ValueError):
    """A reward function failed or returned something unusable; the message names the function and sample."""


def _checked(func: RewardFunc, values: list, kwargs: dict) -> torch.Tensor:
    """The function's rewards as float32 [N] (NaN for None), or a `RewardError` naming the bad sample."""
    name, n = reward_name(func), len(kwargs["completions"])
    if not isinstance(values, list | tuple) or len(values) != n:
        got = f"{len(values)} rewards" if isinstance(values, list | tuple) else type(values).__name__
        raise RewardError(f"reward function {name!r} returned {got} for {n} completions; return a list of {n}.")
    rewards = []
    for i, value in enumerate(values):
        try:
            reward = float("nan") if value is None else float(value)
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {name!r} returned {value!r} for {_sample(kwargs, i)}; return a number or None."
            ) from None
        if value is not None and not math.isfinite(reward):
            raise RewardError(
                f"reward function {name!r} returned {reward} for {_sample(kwargs, i)}; return a finite number, "
                "or None to leave the sample out."
            )
        rewards.append(reward)
    return torch.tensor(rewards, dtype=torch.float32)


def _describe_failure(func: RewardFunc, kwargs: dict, err: Exception) -> str:
    """Name the function and, by scoring the samples one at a time, the first one it fails on."""
    name = reward_name(func)
    for i in range(len(kwargs["completions"])):
        one = {k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            func(**one)
        except Exception as sample_err:
            return f"reward function {name!r} raised {type(sample_err).__name__}: {sample_err} on {_sample(kwargs, i)}"
    return f"reward function {name!r} raised {type(err).__name__}: {err} (on the whole batch, on no single sample)"


def _sample(kwargs: dict, i: int) -> str:
    completion = kwargs["completions"][i]
    return f"completion {i} (prompt {str(kwargs['prompts'][i])[:60]!r}, completion {str(completion)[:60]!r})"


def _run_concurrently(coroutines: list) -> list:
    """Await the coroutines together and return their results in order.

    They run on a fresh event loop in a worker thread, so this works whether or not the caller already runs a
    loop (a notebook does).
    """

    async def gather() -> list:
        return await asyncio.gather(*coroutines)

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()
