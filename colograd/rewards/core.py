"""Reward functions: resolving them by name, reward models, and scoring a rollout in-rank.

A reward function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``,
where ``columns`` are the dataset's other columns (one value per completion) plus ``trainer_state``.
``None`` means "this function has no opinion on this sample": it is left out of that function's mean and
counts 0 in the weighted total. A function may be a coroutine function (``async def``): all of those run
concurrently, on an event loop of their own. A sequence-classification model serves as a reward through
`RewardModel`: its first logit scores prompt + completion.
"""

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
import threading
import types
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from trl.data_utils import apply_chat_template, is_conversational

from colograd.config.core import ConfigError
from colograd.config.loss import LossOptions
from colograd.rewards.names import BUILTIN_REWARDS
from colograd.runs.preemption import StoppedBySigterm, sigterm_received
from colograd.runs.time_limit import GaveUp, call_within

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


def resolve_reward(name: str, options: Any = None) -> RewardFunc:
    """A reward function from its name in a recipe.

    Args:
        name: a built-in name (`BUILTIN_REWARDS`: open-r1's, TRL's and colograd's, each with its ecosystem's
            meaning); a local folder or hub id (``org/model``) of a sequence-classification reward model; a dotted
            path to user code, ``pkg.rewards.length`` or ``pkg.rewards:length``, found from the working directory
            as TRL's script does; or a file and a name in it, ``path/to/rewards.py:length``.
        options: the run's `ScriptArguments` (or any object with its fields): open-r1's reward parameters, and how
            the code rewards run programs (`code_sandbox`, `code_output_lines`). None: their defaults.

    Raises:
        ConfigError: in one line, for anything that keeps the name from giving a reward function: a module that does
            not import (a syntax error, an import inside it failing, any error while it runs), a missing file or
            name, something that is not callable, a class where an instance is needed.
    """
    if name in BUILTIN_REWARDS:
        if options is None:
            from colograd.config.data import ScriptArguments

            options = ScriptArguments()
        return BUILTIN_REWARDS[name].make(options)
    if name.endswith(".py"):
        raise ConfigError(f"reward_funcs: {name!r} names a file but no function in it; write {name}:my_reward.")
    module_name, _, attr = name.rpartition(":")
    if module_name.endswith(".py"):
        return _checked_callable(name, getattr(_import_file(name, module_name), attr, None), attr)
    if os.path.isdir(name) or "/" in name:
        try:
            return RewardModel.from_pretrained(name)
        except OSError as err:
            raise ConfigError(f"reward_funcs: cannot load the reward model {name!r} ({err}).") from err
    module_name, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep:
        raise ConfigError(
            f"reward_funcs: {name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}), a "
            "reward model folder, "
            "a dotted path like my_pkg.rewards.my_reward, nor a file and a name like rewards.py:my_reward."
        )
    try:
        module = _import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name or module_name.startswith(f"{err.name}."):  # the named module, not its import
            raise ConfigError(
                f"reward_funcs: {name!r}: no module {err.name!r} in the working directory ({os.getcwd()}) or the "
                "Python path; run from the folder that holds it, or name its file: path/to/rewards.py:my_reward."
            ) from err
        raise ConfigError(_import_failure(name, err)) from err
    except Exception as err:  # whatever the module's own code raises while it is imported
        raise ConfigError(_import_failure(name, err)) from err
    return _checked_callable(name, getattr(module, attr, None), attr)


def _import_module(module_name: str) -> types.ModuleType:
    """Import a module; one the Python path does not hold is looked for in the working directory too, as TRL's script
    does (`python colograd/train.py` puts colograd/ on the path, not the folder it runs from). The folder goes last
    on the path, so that it shadows no installed module."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name.partition(".")[0] or os.getcwd() in sys.path:
            raise
    sys.path.append(os.getcwd())
    return importlib.import_module(module_name)


def _import_file(name: str, path: str) -> types.ModuleType:
    """Run a Python file as a module (named after the file), for a ``path/to/rewards.py:func`` reward."""
    if not os.path.isfile(path):
        raise ConfigError(f"reward_funcs: {name!r}: there is no file {path!r} (from {os.getcwd()}).")
    module_name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(module_name, module)  # pickling its functions (dataset maps, workers) finds it
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ConfigError(_import_failure(name, err)) from err
    return module


def _import_failure(name: str, err: BaseException) -> str:
    """One line for a module that failed while it was imported; a syntax error with its file and line."""
    if isinstance(err, SyntaxError):
        where = f"{err.filename}, line {err.lineno}: {err.msg}"
        return f"reward_funcs: {name!r}: its module has a syntax error ({where}); fix the file."
    detail = (str(err).strip().splitlines() or [""])[0]
    return f"reward_funcs: {name!r}: importing its module raised {type(err).__name__}: {detail}; fix the module."


def _checked_callable(name: str, func: Any, attr: str) -> RewardFunc:
    """`func`, found under `attr` for the recipe's `name`, if it can be a reward function; else a `ConfigError`."""
    if func is None:
        raise ConfigError(f"reward_funcs: {name!r}: its module has no {attr!r}; check the name.")
    problem = _not_a_reward(func)
    if problem:
        raise ConfigError(f"reward_funcs: {name!r} {problem}")
    return func


def _not_a_reward(func: Any) -> str | None:
    """Why `func` cannot be called as a reward function (a class, something not callable), or None."""
    if inspect.isclass(func):
        return (
            f"is a class; reward_funcs takes a function or an instance: create one (my_reward = "
            f"{func.__name__}(...)) and give that."
        )
    if not callable(func):
        return f"is not a function (its type is {type(func).__name__}); give a function."
    return None


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
    problem = _not_a_reward(func)
    if problem:
        raise ConfigError(f"reward_funcs: {getattr(func, '__name__', repr(func)[:60])} {problem}")
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


def reward_name(func: RewardFunc) -> str:
    """The name metrics use for a reward function: ``rewards/<name>/mean``."""
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: RewardFunc) -> bool:
    # An instance whose __call__ is `async def` counts too, and a partial of either (TRL's `is_async_callable`).
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


# --- the time limit ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeLimits:
    """How long reward function calls may take (`reward_timeout`, `reward_sigterm_wait`).

    timeout: seconds per call, None for no limit. An LLM judge or a code sandbox over a large batch takes minutes;
        a call that never returns would hang the run forever.
    sigterm_wait: seconds a call may still take once SIGTERM came. A scheduler's grace is 30 s by default
        (Kubernetes, torchrun's shutdown), and the rest of the step and its checkpoint need the remainder.
    """

    timeout: float | None = LossOptions.reward_timeout
    sigterm_wait: float = LossOptions.reward_sigterm_wait

    @classmethod
    def of(cls, args: Any) -> "TimeLimits":
        """The run's limits (`reward_timeout` 0 is no limit)."""
        return cls(args.reward_timeout or None, args.reward_sigterm_wait)


_LIMITS: ContextVar[TimeLimits | None] = ContextVar("colograd_reward_time_limits", default=None)  # `score` sets it


class RewardError(ValueError):
    """A reward function failed or returned something unusable; the message names the function and sample."""


class RewardTimeout(RewardError):
    """A reward function did not return within its time limit (`reward_timeout`)."""


def _limited(call: Callable[[], Any], running: Callable[[], str]) -> Any:
    """`call()` within the reward time limits `score` was given (`colograd.runs.time_limit`), in this thread.

    Raises:
        RewardTimeout: past the limit.
        StoppedBySigterm: SIGTERM came and the call had not returned `sigterm_wait` seconds later.
    """
    limits = _LIMITS.get() or TimeLimits()
    try:
        return call_within(call, running, limits.timeout, limits.sigterm_wait, sigterm_received)
    except GaveUp as gave_up:
        if gave_up.reason == "sigterm":
            raise StoppedBySigterm(f"{gave_up.running} had not returned {limits.sigterm_wait:g} s after it") from None
        raise RewardTimeout(
            f"{gave_up.running} did not return within {limits.timeout:g} s; make it return sooner (a time limit of "
            "its own per sample), or give it longer: reward_timeout: <seconds>, 0 for no limit."
        ) from None


# --- scoring ----------------------------------------------------------------------------------------------------


def score(
    reward_funcs: Sequence[RewardFunc],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    limits: TimeLimits | None = None,
) -> torch.Tensor:
    """Run every reward function on every completion: the plain ones one after the other in this thread, the async
    ones concurrently; each call within `limits` (default `TimeLimits()`: `reward_timeout`'s and
    `reward_sigterm_wait`'s defaults).

    A function may return a list or tuple, a 1-D numpy array or tensor, or an iterator (TRL reads each) of one number
    or None per completion; a plain function may also return a coroutine, which is awaited.

    Returns:
        rewards_NF: float32 [N completions, F functions]; NaN where a function returned ``None``.

    Raises:
        RewardError: a function raised, did not return in time (`RewardTimeout`), or returned something unusable;
            the message names it and, where there is one, the sample.
        StoppedBySigterm: SIGTERM came while a function ran, and it did not return within `limits.sigterm_wait`.
    """
    token = _LIMITS.set(limits or TimeLimits())
    try:
        return _score(reward_funcs, {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                                     **columns})  # fmt: skip
    finally:
        _LIMITS.reset(token)


def _score(reward_funcs: Sequence[RewardFunc], kwargs: dict) -> torch.Tensor:
    """`score` within the time limits it set."""
    outputs: dict[int, Any] = {}
    awaiting: dict[int, Callable[[], Awaitable]] = {}
    for j, func in enumerate(reward_funcs):
        if _is_async(func):
            awaiting[j] = functools.partial(func, **kwargs)
            continue
        output = _call(func, kwargs)
        if inspect.isawaitable(output):  # a plain function handing back a coroutine: a lambda around an async one
            awaiting[j] = functools.partial(_await, output)
        else:
            outputs[j] = output
    if awaiting:
        outputs.update(_run_concurrently(awaiting, reward_funcs))

    n = len(kwargs["completions"])
    rewards_NF = torch.zeros(n, len(reward_funcs), dtype=torch.float32)
    for j, func in enumerate(reward_funcs):
        rewards_NF[:, j] = _checked(func, outputs[j], kwargs)
    return rewards_NF


def _call(func: RewardFunc, kwargs: dict) -> Any:
    """One plain reward function on the batch, within the time limit; a failure named with the sample."""
    try:
        return _limited(lambda: func(**kwargs), lambda: f"reward function {reward_name(func)!r}")
    except RewardTimeout:
        raise
    except Exception as err:
        raise RewardError(_describe_failure(func, kwargs, err)) from err


async def _await(awaitable: Awaitable) -> Any:
    return await awaitable


_NAN_NOTED: set[str] = set()  # reward functions whose NaN was reported as taken for None (once each, per process)


def _checked(func: RewardFunc, values: Any, kwargs: dict) -> torch.Tensor:
    """The function's rewards as float32 [N] (NaN for None, and for NaN), or a `RewardError` naming the bad
    sample."""
    name, n = reward_name(func), len(kwargs["completions"])
    values = _as_list(name, values, n)
    rewards = []
    for i, value in enumerate(values):
        try:
            if isinstance(value, str | bytes):  # float("1") would take it; a text is a bug, not a score
                raise TypeError
            reward = float("nan") if value is None else float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several values
            raise RewardError(
                f"reward function {name!r} returned {value!r:.60} for {_sample(kwargs, i)}; return a number or None."
            ) from None
        if math.isinf(reward):
            raise RewardError(
                f"reward function {name!r} returned {reward} for {_sample(kwargs, i)}; return a finite number, "
                "or None to leave the sample out."
            )
        if value is not None and math.isnan(reward) and name not in _NAN_NOTED:
            # TRL's nan-aware sums take NaN as an abstention, as None: so does colograd, saying so once.
            _NAN_NOTED.add(name)
            print(
                f"colograd: warning: reward function {name!r} returned nan for {_sample(kwargs, i)}; taken as None "
                "(the sample left out of this function's reward), as TRL takes it.",
                file=sys.stderr,
            )
        rewards.append(reward)
    return torch.tensor(rewards, dtype=torch.float32)


def _as_list(name: str, values: Any, n: int) -> list:
    """A function's output as a list of its `n` values: what TRL reads one by one (a list, a tuple, a 1-D array or
    tensor, an iterator) is taken; a mapping, a set or a text is not: their items or order are not the rewards."""
    if isinstance(values, torch.Tensor | np.ndarray) and values.ndim == 1:
        values = values.tolist()
    elif isinstance(values, Iterator) and not isinstance(values, str | bytes):
        values = list(values)
    if not isinstance(values, list | tuple):
        shape = f" of shape {tuple(values.shape)}" if isinstance(values, torch.Tensor | np.ndarray) else ""
        raise RewardError(
            f"reward function {name!r} returned a {type(values).__name__}{shape}; return a list of {n} numbers (None "
            "to leave a sample out), one per completion, in order."
        )
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {n} completions; return {n}.")
    return values


def _describe_failure(func: RewardFunc, kwargs: dict, err: Exception) -> str:
    """Name the function and, by scoring the samples one at a time, the first one it fails on."""
    name = reward_name(func)
    for i in range(len(kwargs["completions"])):
        one = {k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            _limited(lambda one=one: func(**one), lambda: f"reward function {name!r} (on one sample)")
        except RewardTimeout:
            raise
        except Exception as sample_err:
            return f"reward function {name!r} raised {type(sample_err).__name__}: {sample_err} on {_sample(kwargs, i)}"
    return f"reward function {name!r} raised {type(err).__name__}: {err} (on the whole batch, on no single sample)"


def _sample(kwargs: dict, i: int) -> str:
    completion = kwargs["completions"][i]
    return f"completion {i} (prompt {str(kwargs['prompts'][i])[:60]!r}, completion {str(completion)[:60]!r})"


def _run_concurrently(calls: dict[int, Callable[[], Awaitable]], funcs: Sequence[RewardFunc]) -> dict[int, Any]:
    """Await the calls together; their results by index.

    They run on an event loop of their own in a daemon thread, so this works whether or not the caller already runs
    a loop (a notebook does), and a call that never returns holds nothing up once given up on: this thread waits
    within the time limit.
    """
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    async def one(j: int) -> None:
        try:
            results[j] = await calls[j]()
        except (Exception, asyncio.CancelledError) as err:
            errors[j] = err

    async def together() -> None:
        await asyncio.gather(*(one(j) for j in calls))

    def unfinished() -> str:
        names = [repr(reward_name(funcs[j])) for j in calls if j not in results and j not in errors]
        return f"reward function {' and '.join(names)}" if len(names) < 2 else f"reward functions {', '.join(names)}"

    worker = threading.Thread(target=asyncio.run, args=(together(),), name="colograd-async-rewards", daemon=True)
    worker.start()
    _limited(worker.join, unfinished)
    for j in sorted(errors):
        err = errors[j]
        raise RewardError(
            f"reward function {reward_name(funcs[j])!r} raised {type(err).__name__}: {err} (on the whole batch)"
        ) from err
    return results
