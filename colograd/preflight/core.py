"""Preflight: every input of a run checked before any weights are read or any engine starts.

Each check runs the input through the code the run itself will use, on the real data, so a whole class of
mistakes fails here in seconds instead of minutes later with a library's traceback. Before this module runs, the
command line has read the recipe file and checked each value's type and range (colograd.config.recipe,
colograd.config.ranges), the environment (colograd.preflight.env: caches, hardware and launch variables, trackers)
and the model folder (colograd.models.model_files: JSON files, config fields, tokenizer end tokens, weight headers):

    destination   output_dir can be written and no other run holds it or its work (colograd.runs.output_dir);
                  resume_from_checkpoint is finished, intact and saved by a run set up as this one
                  (colograd.runs.checkpoints); push_to_hub can push
    files         a local data file's bytes: not empty, UTF-8 text, a whole Parquet file (colograd.data.core)
    data          every row's prompt is text or chat messages, templated and tokenized as a rollout does it (a
                  stream: its first rows, read without advancing the stream training reads)
    sizes         the dataset holds one full rollout batch for every rank; lengths fit the model and the engine
    rewards       every reward function accepts, by name, the arguments and dataset columns it will be called with;
                  the code rewards can read every row's tests (colograd.rewards.code.check_code_rows; cf_code's
                  and ioi_code's: colograd.rewards.code_codeforces.check_cf_rows, code_ioi.check_ioi_rows)
    engine        vLLM's own objects (SamplingParams, LoRAConfig) built from the config; layers whose KV cache
                  colograd sizes (no hybrid or Mamba layers); unquantized experts of a width the CPU kernel takes;
                  dtype and head size supported by the engine's backend

`colograd/train.py` runs `preflight` after parsing; `GRPOTrainer` runs `check_settings`, `check_prompts`,
`check_data` and `check_engine` (`colograd.preflight.engine`) on what it is given, before it builds its engine.
Every failure is a `ConfigError` naming the input, the problem and the fix.
"""

import copy
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from trl.data_utils import is_conversational

from colograd.config.core import ConfigError, GRPOConfig, ScriptArguments
from colograd.data.core import conversations_fix, first_line, load_prompts, tokenize_prompts
from colograd.data.streaming import PEEK_ROWS, check_stream, check_stream_resume, peek
from colograd.engine.kv_cache import engine_context
from colograd.models.model_files import on_meta_device
from colograd.preflight.engine import check_engine
from colograd.rewards.code import check_code_rows
from colograd.rewards.code_codeforces import check_cf_rows
from colograd.rewards.code_ioi import check_ioi_rows
from colograd.rewards.core import RewardFunc, resolve_reward, reward_name
from colograd.rewards.names import reward_meanings
from colograd.runs.checkpoints import check_resume, note
from colograd.runs.output_dir import check_output_dir, claim_output_dir

# What the trainer's `score` stage passes every reward function besides the dataset's columns (TRL's arguments).
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
_BATCH = 1024  # prompts templated and tokenized per call


@dataclass
class Inputs:
    """What preflight hands the run: the dataset to train on (invalid rows dropped when asked) and the
    resolved reward functions."""

    dataset: Dataset | IterableDataset
    reward_funcs: list[RewardFunc]
    eval_dataset: Dataset | None = None


def preflight(
    script_args: ScriptArguments,
    training_args: GRPOConfig,
    model_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    dtype: torch.dtype,
    peft_config: Any = None,
    lora_rank: int | None = None,
) -> Inputs:
    """Check every input of a command-line run; raise `ConfigError` on the first problem.

    Args:
        script_args: the data and reward settings.
        training_args: the run's config.
        model_config: the policy's config (its weights are not needed).
        tokenizer: the policy's tokenizer.
        dtype: the dtype the policy's weights will have.
        peft_config: the LoRA adapter's PEFT config, when the policy gets one.
        lora_rank: the adapter's rank when the engine will serve a LoRA adapter (`lora_sync: adapter`).

    Returns:
        The dataset to train on and the reward functions.
    """
    check_settings(training_args, model_config)
    if peft_config is not None:
        check_lora_targets(model_config, peft_config)
    checkpoint = check_output_dir(training_args, training_args.resume_from_checkpoint)
    reward_funcs = [resolve_reward(name, script_args) for name in script_args.reward_funcs]
    name = script_args.dataset_name
    dataset = load_prompts(script_args, streaming=script_args.dataset_streaming)
    template_kwargs = training_args.chat_template_kwargs
    room = prompt_room(training_args, model_config)
    if script_args.dataset_streaming:
        check_stream_resume(dataset, checkpoint)
        dataset = check_stream_data(
            dataset, tokenizer, reward_funcs, training_args, name, script_args.drop_invalid_prompts, room=room
        )
    else:
        dataset, _ = check_prompts(dataset, tokenizer, name, script_args.drop_invalid_prompts, template_kwargs, room)
        check_data(dataset, reward_funcs, training_args, name)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        split = script_args.dataset_test_split
        eval_dataset = load_prompts(script_args, split)
        eval_dataset, _ = check_prompts(
            eval_dataset, tokenizer, f"{name} ({split})", script_args.drop_invalid_prompts, template_kwargs, room
        )
        check_rewards(reward_funcs, [c for c in eval_dataset.column_names if c != "prompt"])
        check_code_rows(reward_funcs, eval_dataset.column_names, _reader(eval_dataset), f"{name} ({split})")
        check_judged_rows(reward_funcs, eval_dataset.column_names, _reader(eval_dataset), f"{name} ({split})")
    check_resume(checkpoint, training_args, model_config, training_args.trust_remote_code)
    # Last: importing vLLM's pieces takes seconds, which a mistake found above should not wait for.
    check_engine(training_args, model_config, dtype, lora_rank)
    said = reward_meanings(script_args.reward_funcs)
    if said:  # what each built-in name became (open-r1's or TRL's), said once the inputs are known good
        note(said)
    return Inputs(dataset, reward_funcs, eval_dataset)


def check_settings(args: GRPOConfig, model_config: PretrainedConfig) -> None:
    """The quick checks of the configuration alone: destination and lengths."""
    check_destination(args)
    args.check_lengths(model_config)
    room = prompt_room(args, model_config)
    if room is not None and room < 1:
        raise ConfigError(
            f"max_completion_length={args.max_completion_length} fills the engine's context of "
            f"{engine_context(args, model_config)} tokens, leaving no room for a prompt; lower max_completion_length."
        )


def prompt_room(args: GRPOConfig, model_config: PretrainedConfig) -> int | None:
    """The most tokens a prompt may have without `max_prompt_length`: the engine's context (the model's own, unless
    vllm_max_model_length) less a whole completion. None where prompts are truncated instead (max_prompt_length)
    or the context is unknown."""
    context = engine_context(args, model_config)
    if args.max_prompt_length is not None or context is None:
        return None
    return context - args.max_completion_length


def check_data(
    dataset: Dataset,
    reward_funcs: list[RewardFunc],
    args: GRPOConfig,
    name: str = "train_dataset",
    rewards_also_get: list[str] | None = (),
) -> None:
    """The dataset against the run: one rollout batch per rank, and columns the reward functions accept.

    Args:
        rewards_also_get: keywords the rewards are passed besides the columns (an environment's), or None when
            they cannot be known before a rollout: the rewards' parameters are then not checked.
    """
    check_size(len(dataset), args, name)
    if rewards_also_get is not None:
        check_rewards(reward_funcs, [c for c in dataset.column_names if c != "prompt"] + list(rewards_also_get))
        check_code_rows(reward_funcs, dataset.column_names, _reader(dataset), name, rewards_also_get)
        check_judged_rows(reward_funcs, dataset.column_names, _reader(dataset), name, rewards_also_get)


def check_judged_rows(
    reward_funcs: list[RewardFunc],
    columns: list[str],
    read: Callable[[list[str]], Any],
    name: str,
    rewards_also_get: Sequence[str] | None = (),
) -> None:
    """The rows as open-r1's judged rewards (`cf_code`, `ioi_code`) will read them, each by its own check."""
    for check in (check_cf_rows, check_ioi_rows):
        check(reward_funcs, columns, read, name, rewards_also_get or ())


def _reader(dataset: Dataset, batch: int = 256) -> Callable[[list[str]], Iterator[dict[str, list]]]:
    """The values of the named columns of `dataset` (only those are read), `batch` rows at a time: a code dataset's
    tests (CodeContests' generated ones) can be gigabytes."""

    def read(columns: list[str]) -> Iterator[dict[str, list]]:
        selected = dataset.select_columns(columns)
        for start in range(0, len(selected), batch):
            yield selected[start : start + batch]

    return read


def check_stream_data(
    dataset: IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    reward_funcs: list[RewardFunc],
    args: GRPOConfig,
    name: str = "train_dataset",
    drop_invalid: bool = False,
    rewards_also_get: list[str] | None = (),
    room: int | None = None,
) -> IterableDataset:
    """A streamed dataset against the run (`colograd.data.streaming.check_stream`), and its first rows (at least one
    rollout batch's) as `check_prompts` and `check_data` check an in-memory dataset; read afresh, so the stream
    training reads starts at its first row.

    Returns:
        The stream; with `drop_invalid`, filtered as it is read by the same row checks (`room`: see
        `check_prompts`).
    """
    check_stream(dataset, args)
    head = peek(dataset, max(PEEK_ROWS, args.rollout_prompts), name)
    columns = list(head[0]) if head else ["prompt"]
    head_name = f"{name} (its first {len(head)} rows)"
    prompts = [row["prompt"] for row in head]
    kept, _ = check_prompt_rows(columns, prompts, tokenizer, head_name, drop_invalid, args.chat_template_kwargs, room)
    check_size(len(kept), args, head_name)
    if rewards_also_get is not None:
        check_rewards(reward_funcs, [c for c in columns if c != "prompt"] + list(rewards_also_get))
        read = lambda names: {c: [row.get(c) for row in head] for c in names}  # noqa: E731
        check_code_rows(reward_funcs, columns, read, head_name, rewards_also_get)
        check_judged_rows(reward_funcs, columns, read, head_name, rewards_also_get)
    if not drop_invalid:
        return dataset
    template_kwargs = args.chat_template_kwargs

    def valid(batch: dict[str, list]) -> list[bool]:
        problems = _row_problems(batch["prompt"], tokenizer, template_kwargs, room)
        return [i not in problems for i in range(len(batch["prompt"]))]

    return dataset.filter(valid, batched=True)


# --- destination ---------------------------------------------------------------------------------------------


def check_destination(args: GRPOConfig) -> None:
    """`output_dir` can be written to and no other run holds it (the first process takes its lock, see
    `colograd.runs.output_dir`); `push_to_hub` has a valid repository name and a token."""
    claim_output_dir(args)
    if args.push_to_hub:
        _check_hub(args)


def _check_hub(args: GRPOConfig) -> None:
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ConfigError("push_to_hub needs the network, but HF_HUB_OFFLINE is set; unset it or drop push_to_hub.")
    repo_id = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ConfigError(
            f"push_to_hub: {repo_id!r} is not a valid repository name ({first_line(err)}); set hub_model_id to "
            "'name' or 'org/name'."
        ) from err
    if not (args.hub_token or get_token()):
        raise ConfigError(
            "push_to_hub: no Hugging Face token found; run `hf auth login`, set HF_TOKEN, or pass hub_token."
        )


def check_lora_targets(model_config: PretrainedConfig, peft_config: Any) -> None:
    """The adapter fits the model (its target modules exist): PEFT's own check, run on the model built on the
    meta device, which takes no memory and reads no weights."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with on_meta_device():
        model = AutoModelForCausalLM.from_config(model_config)
    try:
        get_peft_model(model, copy.deepcopy(peft_config))  # PEFT fills in the config it is given
    except ValueError as err:  # e.g. target modules the model does not have
        raise ConfigError(f"lora_target_modules: {first_line(err)}") from err


# --- data ----------------------------------------------------------------------------------------------------


def prompt_problem(prompt: Any, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """What is wrong with one row's prompt as the trainer will use it, or None when nothing is."""
    if prompt is None:
        return "prompt is missing (null)"
    if isinstance(prompt, str):
        return "prompt is empty or only whitespace" if not prompt.strip() else None
    if isinstance(prompt, dict):
        return "prompt is one message, not a list of messages; wrap it in a list"
    if not isinstance(prompt, list):
        return f"prompt is a {type(prompt).__name__} ({str(prompt)[:40]!r}); give text or a list of chat messages"
    if not prompt:
        return "prompt is an empty list of messages"
    for k, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"message {k} is a {type(message).__name__}, not a {{'role': ..., 'content': ...}} message"
        for key in ("role", "content"):
            if message.get(key) is None:
                return f"message {k} has no {key!r}"
        if not isinstance(message["role"], str) or not message["role"].strip():
            return f"message {k} has the role {message['role']!r}; use 'system', 'user' or 'assistant'"
        if not isinstance(message["content"], str | list):
            return f"message {k}'s content is a {type(message['content']).__name__}; give text"
    if all(isinstance(m["content"], str) and not m["content"].strip() for m in prompt):
        return "every message of the prompt is empty"
    if tokenizer.chat_template is None:
        return "prompt is chat messages, but the tokenizer has no chat template; give text or a tokenizer with one"
    return None


def check_prompts(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    name: str = "train_dataset",
    drop_invalid: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    room: int | None = None,
) -> Dataset:
    """Check every row's prompt, then template and tokenize it as a rollout will (`tokenize_prompts`).

    Args:
        dataset: rows with a `prompt` column.
        tokenizer: the policy's tokenizer.
        name: how messages name the dataset.
        drop_invalid: drop the rows with a problem (and print how many) instead of raising.
        template_kwargs: the run's `chat_template_kwargs`, which the rollouts give the chat template.
        room: the most tokens a prompt may have (`prompt_room`), or None when any length is taken.

    Returns:
        The dataset, without its invalid rows when `drop_invalid`, and the most tokens among its templated prompts
        (what the engine's context must hold beside a completion, `colograd.engine.kv_cache.engine_context`).

    Raises:
        ConfigError: the first invalid row (index and problem), unless `drop_invalid`; no valid row at all.
    """
    if "prompt" not in dataset.column_names:  # read the column only once it is known to be there
        check_prompt_rows(dataset.column_names, [], tokenizer, name, drop_invalid, template_kwargs, room,
                          first_row=dataset[0] if len(dataset) else None)  # fmt: skip
    kept, longest = check_prompt_rows(
        dataset.column_names, dataset["prompt"], tokenizer, name, drop_invalid, template_kwargs, room
    )
    return (dataset if len(kept) == len(dataset) else dataset.select(kept)), longest


def check_prompt_rows(
    columns: list[str],
    prompts: list,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    drop_invalid: bool,
    template_kwargs: dict[str, Any] | None,
    room: int | None = None,
    first_row: dict | None = None,
) -> list[int]:
    """`check_prompts` on a dataset's column names and prompts (for rows that need not share one arrow type);
    `first_row`, where the dataset has one, words the refusal of a dataset without prompts.

    Returns:
        The indices of the rows to keep, and the most tokens among their templated prompts.
    """
    if "prompt" not in columns and "conversations" in columns:
        raise ConfigError(f"{name}: {conversations_fix(first_row)}")
    if "prompt" not in columns:
        raise ConfigError(f"{name}: no 'prompt' column (columns: {', '.join(columns)}); add one.")
    _check_column_names(columns, name)
    lengths: dict[int, int] = {}
    problems = _row_problems(prompts, tokenizer, template_kwargs, room, lengths)
    if not problems:
        return list(range(len(prompts))), max(lengths.values(), default=0)
    first, problem = next(iter(problems.items()))
    if not drop_invalid:
        raise ConfigError(
            f"dataset {name!r} row {first}: {problem}. Fix the row, or set drop_invalid_prompts: true to skip such "
            f"rows ({len(problems)} of {len(prompts)} rows have a problem)."
        )
    if len(problems) == len(prompts):
        raise ConfigError(f"dataset {name!r}: no row has a valid prompt (row {first}: {problem}).")
    if int(os.environ.get("RANK", "0")) == 0:  # once per run, not once per rank
        print(
            f"colograd: dropped {len(problems)} of {len(prompts)} rows of dataset {name!r} with an invalid prompt "
            f"(drop_invalid_prompts); the first, row {first}: {problem}.",
            flush=True,
        )
    kept = [i for i in range(len(prompts)) if i not in problems]
    return kept, max((lengths[i] for i in kept), default=0)


def _row_problems(
    prompts: list,
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: dict[str, Any] | None,
    room: int | None = None,
    lengths: dict[int, int] | None = None,
) -> dict[int, str]:
    """Row index → problem, for every row whose prompt is invalid, does not template and tokenize to tokens, or
    has more than `room` tokens. `lengths`, when given, receives each tokenized row's token count."""
    prompts = list(prompts)  # a dataset's column reads a row per index (1.3 s for 4,096 rows read four times each)
    problems = {i: p for i, prompt in enumerate(prompts) if (p := prompt_problem(prompt, tokenizer)) is not None}
    valid = [i for i in range(len(prompts)) if i not in problems]
    kind = {True: "chat messages", False: "text"}
    kinds = {i: kind[is_conversational({"prompt": prompts[i]})] for i in valid}
    for i in valid:  # a rollout gives its reward functions completions of one form for the whole batch
        if kinds[i] != kinds[valid[0]]:
            problems[i] = f"prompt is {kinds[i]}, but row {valid[0]}'s is {kinds[valid[0]]}; use one form for all rows"
    valid = [i for i in valid if i not in problems]
    for start in range(0, len(valid), _BATCH):
        rows = valid[start : start + _BATCH]
        try:
            ids = tokenize_prompts([prompts[i] for i in rows], tokenizer, template_kwargs=template_kwargs)
        except Exception:  # find the row that breaks the template or the tokenizer
            ids = [_tokenize_one(prompts[i], tokenizer, template_kwargs, problems, i) for i in rows]
        for i, row_ids in zip(rows, ids, strict=True):
            if row_ids is not None and lengths is not None:
                lengths[i] = len(row_ids)
            if row_ids is not None and not row_ids:
                problems[i] = "prompt tokenizes to no tokens"
            elif row_ids is not None and room is not None and len(row_ids) > room:
                problems[i] = (
                    f"prompt is {len(row_ids)} tokens, more than the {room} the engine's context leaves beside a "
                    "whole completion (max_completion_length); set max_prompt_length to keep prompts' last tokens, "
                    "or lower max_completion_length"
                )
    return dict(sorted(problems.items()))


def _tokenize_one(
    prompt: Any, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any] | None, problems: dict, i: int
) -> list[int] | None:
    try:
        return tokenize_prompts([prompt], tokenizer, template_kwargs=template_kwargs)[0]
    except Exception as err:  # a user template or tokenizer may raise anything
        problems[i] = f"templating and tokenizing the prompt failed ({type(err).__name__}: {first_line(err)})"
        return None


def _check_column_names(columns: list[str], name: str) -> None:
    clash = [c for c in columns if c in REWARD_ARGUMENTS]
    if clash:
        raise ConfigError(
            f"dataset {name!r} has a column {clash[0]!r}, a name the reward functions' own argument takes; rename "
            "the column."
        )


def check_size(rows: int, args: GRPOConfig, name: str = "train_dataset") -> None:
    """The dataset must fill one rollout batch of every rank, or training would run no step at all."""
    need = args.rollout_prompts
    if rows < need:
        raise ConfigError(
            f"dataset {name!r} has {rows} usable rows, fewer than one rollout batch: {need} prompts "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} × steps_per_generation "
            f"{args.steps_per_generation} × {args.world_size} processes / num_generations {args.num_generations}); "
            "add rows, or lower per_device_train_batch_size or steps_per_generation."
        )


# --- rewards -------------------------------------------------------------------------------------------------


def check_rewards(reward_funcs: list[RewardFunc], columns: list[str]) -> None:
    """Every reward function accepts, by name, what `colograd.rewards.core.score` will pass it: `REWARD_ARGUMENTS`
    and one keyword per dataset column; and needs nothing else."""
    passed = [*REWARD_ARGUMENTS, *columns]
    for func in reward_funcs:
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # a builtin or extension without a signature: nothing to check
            continue
        name = reward_name(func)
        for p in params:
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                raise ConfigError(
                    f"reward function {name!r}: parameter {p.name!r} is positional-only, but rewards are passed by "
                    "name; make it a regular parameter."
                )
            named = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            if named and p.default is p.empty and p.name not in passed:
                raise ConfigError(
                    f"reward function {name!r} needs {p.name!r}, which is not a dataset column (columns: "
                    f"{', '.join(columns) or 'none besides prompt'}); add the column, or give the parameter a default."
                )
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            extra = [a for a in passed if a not in accepted]
            if extra:
                raise ConfigError(
                    f"reward function {name!r} does not accept {', '.join(map(repr, extra))}, which every reward "
                    "function is passed; add **kwargs to its parameters."
                )


# --- engine --------------------------------------------------------------------------------------------------
