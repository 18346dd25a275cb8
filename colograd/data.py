"""Loading the training prompts: a built-in task, a local file or folder, or a hub dataset.

Rows need a ``prompt``: text (standard) or a list of chat messages (conversational; the tokenizer's chat
template is applied per rollout). Every other column reaches the reward functions.
"""

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import datasets
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset
from transformers import PreTrainedTokenizerBase
from trl.data_utils import maybe_apply_chat_template

from colograd import sums, tiny
from colograd.config import ConfigError, ScriptArguments

BUILTIN_DATASETS = {"colograd:letters": tiny.letters_dataset, "colograd:sums": sums.sums_dataset}
T = TypeVar("T")
_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(
    args: ScriptArguments, split: str | None = None, streaming: bool = False
) -> Dataset | IterableDataset:
    """The split `split` (default: `args.dataset_train_split`) of `args.dataset_name`, with a `prompt` column;
    with `streaming`, as a `datasets.IterableDataset` read as training goes (TRL's `dataset_streaming`)."""
    name, split = args.dataset_name, split or args.dataset_train_split
    local = name.startswith(tiny.PREFIX) or os.path.exists(name)
    if local and args.dataset_config is not None:
        raise ConfigError(
            f"dataset_config={args.dataset_config!r} names a hub dataset's subset, but {name!r} is not a hub "
            "dataset; remove dataset_config."
        )
    if not local and (name.startswith((".", "/", "~")) or os.path.splitext(name)[1] in _FILE_FORMATS):
        raise ConfigError(
            f"dataset_name={name!r} does not exist; give an existing file or folder, or a hub dataset id."
        )
    if not local:
        try:
            with _quiet_datasets():
                dataset = load_dataset(name, args.dataset_config, split=split, streaming=streaming)
        except (OSError, ValueError) as err:  # unreachable or unknown id, unknown split or subset
            raise ConfigError(
                f"dataset_name={name!r} cannot be loaded ({first_line(err)}); give a local file or folder, or a "
                "hub dataset id that is reachable (or cached)."
            ) from err
    else:
        splits = _load_local(name, streaming)
        if split not in splits:
            which = "dataset_train_split" if split == args.dataset_train_split else "dataset_test_split"
            raise ConfigError(f"{which}={split!r}: {name!r} has the splits {', '.join(splits)}.")
        dataset = splits[split]
    # A stream is read (and a file parsed) only as it is iterated, and its columns may show only in its rows.
    first = _read(name, lambda: next(iter(dataset), None)) if streaming else None
    columns = dataset.column_names or list(first or ())
    column = args.dataset_prompt_column
    if column not in columns:
        raise ConfigError(
            f"dataset {name!r} has no {column!r} column (columns: {', '.join(columns)}); "
            "set dataset_prompt_column to the column holding the prompts."
        )
    if column != "prompt" or args.system_prompt is not None:
        dataset = dataset.map(_as_chat, fn_kwargs={"column": column, "system_prompt": args.system_prompt})
    empty = first is None if streaming else len(dataset) == 0
    if empty:
        raise ConfigError(f"dataset {name!r} split {split!r} is empty.")
    return dataset


def _load_local(name: str, streaming: bool = False) -> DatasetDict | IterableDatasetDict:
    """A built-in dataset (one split, train), a file (loaded as train), or a folder (its files name the splits)."""
    if name.startswith(tiny.PREFIX):
        if name not in BUILTIN_DATASETS:
            raise ConfigError(f"dataset_name={name!r}: the built-in datasets are {', '.join(BUILTIN_DATASETS)}.")
        dataset = BUILTIN_DATASETS[name]()
        return IterableDatasetDict(train=dataset.to_iterable_dataset()) if streaming else DatasetDict(train=dataset)
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1]
        if ext not in _FILE_FORMATS:
            raise ConfigError(f"dataset_name={name!r}: use a {', '.join(_FILE_FORMATS)} file or a dataset folder.")
        if os.path.getsize(name) == 0:  # `datasets` fails on it deep inside its schema inference
            raise ConfigError(f"dataset {name!r} is empty; give a file with at least one row.")
        return _read(name, lambda: load_dataset(_FILE_FORMATS[ext], data_files=name, streaming=streaming))
    return _read(name, lambda: load_dataset(name, streaming=streaming))


def keep_rows(features: list[dict]) -> list[dict]:
    """The trainer's data collator: a batch stays a list of dataset rows; tokenization happens per rollout."""
    return features


def tokenize_prompts(
    prompts: list,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt as a rollout feeds it to the engine: chat messages through the tokenizer's chat
    template (given the tools' JSON schemas, when the model may call tools, and `chat_template_kwargs`), text as
    it is; no special tokens added (a template adds its own), nothing truncated yet."""
    texts = [
        maybe_apply_chat_template({"prompt": p}, tokenizer, tools, **(template_kwargs or {}))["prompt"]
        for p in prompts
    ]
    return tokenizer(text=texts, add_special_tokens=False)["input_ids"]


def sampled_prompt_tokens(
    dataset: Any,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    rows: int = 256,
) -> int | None:
    """The most tokens among `rows` prompts spread evenly over an in-memory dataset, templated as a rollout feeds
    them to the engine: what the engine's KV cache is sized by when no `max_prompt_length` bounds prompts. An
    estimate (a longer prompt elsewhere only makes the engine schedule fewer sequences at once); None for a stream
    or an empty dataset."""
    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        return None
    step = max(1, len(dataset) // rows)
    prompts = dataset.select(range(0, len(dataset), step)[:rows])["prompt"]
    return max(map(len, tokenize_prompts(prompts, tokenizer, tools, template_kwargs)))


def _read(name: str, load: Callable[[], T]) -> T:
    """`load()` (which loads or reads `name`), with a parse error turned into one line naming the file and, where it
    can be found, the line."""
    try:
        with _quiet_datasets():
            return load()
    except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError) as err:  # TypeError: arrow types
        cause = err.__cause__ or err  # `datasets` wraps the parser's error, which says what is wrong
        where = _json_error_line(name) if name.endswith((".json", ".jsonl")) else None
        raise ConfigError(
            f"dataset {name!r} cannot be read{where or ''}: {first_line(cause)}; fix the file or convert it to "
            f"one of {', '.join(_FILE_FORMATS)}."
        ) from err


def _json_error_line(path: str) -> str | None:
    """`` (line N)``: where a JSON or JSON Lines file stops being valid, by Python's own parser, or None."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f" (line {err.lineno})"
        return None  # one valid document: the problem is its shape, which the reader's message gives
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            if line.strip() and not isinstance(json.loads(line), dict):
                return f" (line {number}: not a JSON object)"
        except json.JSONDecodeError:
            return f" (line {number})"
    return None


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence `datasets`' own error log and progress bars while loading: a failure is reported once, by us."""
    logger = logging.getLogger("datasets")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel("CRITICAL")
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def first_line(err: BaseException) -> str:
    """The first line of an error's message, for a one-line report."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")


def _as_chat(row: dict, column: str, system_prompt: str | None) -> dict:
    """open-r1's conversation: the system prompt, if any, then the prompt column's text as the user's turn."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return {"prompt": [*system, {"role": "user", "content": row[column]}]}
