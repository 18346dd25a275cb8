"""Loading the training prompts: a built-in task, a local file or folder, or a hub dataset.

Rows need a ``prompt``: text (standard) or a list of chat messages (conversational; the tokenizer's chat
template is applied per rollout). Every other column reaches the reward functions.
"""

import os

from datasets import Dataset, DatasetDict, load_dataset

from colograd import tiny
from colograd.config import ConfigError, ScriptArguments

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(args: ScriptArguments, split: str | None = None) -> Dataset:
    """The split `split` (default: `args.dataset_train_split`) of `args.dataset_name`, with a `prompt` column."""
    name, split = args.dataset_name, split or args.dataset_train_split
    local = name.startswith(tiny.PREFIX) or os.path.exists(name)
    if local and args.dataset_config is not None:
        raise ConfigError(
            f"dataset_config={args.dataset_config!r} names a hub dataset's subset, but {name!r} is not a hub "
            "dataset; remove dataset_config."
        )
    if not local:
        dataset = load_dataset(name, args.dataset_config, split=split)
    else:
        splits = _load_local(name)
        if split not in splits:
            which = "dataset_train_split" if split == args.dataset_train_split else "dataset_test_split"
            raise ConfigError(f"{which}={split!r}: {name!r} has the splits {', '.join(splits)}.")
        dataset = splits[split]
    column = args.dataset_prompt_column
    if column not in dataset.column_names:
        raise ConfigError(
            f"dataset {name!r} has no {column!r} column (columns: {', '.join(dataset.column_names)}); "
            "set dataset_prompt_column to the column holding the prompts."
        )
    if column != "prompt" or args.system_prompt is not None:
        dataset = dataset.map(_as_chat, fn_kwargs={"column": column, "system_prompt": args.system_prompt})
    if len(dataset) == 0:
        raise ConfigError(f"dataset {name!r} split {split!r} is empty.")
    return dataset


def _load_local(name: str) -> DatasetDict:
    """A built-in dataset (one split, train), a file (loaded as train), or a folder (its files name the splits)."""
    if name.startswith(tiny.PREFIX):
        if name not in tiny.TINY_DATASETS:
            raise ConfigError(f"dataset_name={name!r}: the built-in datasets are {', '.join(tiny.TINY_DATASETS)}.")
        return DatasetDict(train=tiny.letters_dataset())
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1]
        if ext not in _FILE_FORMATS:
            raise ConfigError(f"dataset_name={name!r}: use a {', '.join(_FILE_FORMATS)} file or a dataset folder.")
        if os.path.getsize(name) == 0:  # `datasets` fails on it deep inside its schema inference
            raise ConfigError(f"dataset {name!r} is empty; give a file with at least one row.")
        return load_dataset(_FILE_FORMATS[ext], data_files=name)
    return load_dataset(name)


def _as_chat(row: dict, column: str, system_prompt: str | None) -> dict:
    """open-r1's conversation: the system prompt, if any, then the prompt column's text as the user's turn."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return {"prompt": [*system, {"role": "user", "content": row[column]}]}
