"""Loading the training prompts: a built-in task, a local file or folder, or a hub dataset.

Rows need a ``prompt``: text (standard) or a list of chat messages (conversational; the tokenizer's chat
template is applied per rollout). Every other column reaches the reward functions.
"""

import os

from datasets import Dataset, DatasetDict, load_dataset

from colograd import sums, tiny
from colograd.config import ConfigError, ScriptArguments

BUILTIN_DATASETS = {"colograd:letters": tiny.letters_dataset, "colograd:sums": sums.sums_dataset}
_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(args: ScriptArguments) -> Dataset:
    """The split `args.dataset_train_split` of `args.dataset_name`, checked to have a `prompt` column."""
    name, split = args.dataset_name, args.dataset_train_split
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
            raise ConfigError(f"dataset_train_split={split!r}: {name!r} has the splits {', '.join(splits)}.")
        dataset = splits[split]
    if "prompt" not in dataset.column_names:
        raise ConfigError(
            f"dataset {name!r} has no 'prompt' column (columns: {', '.join(dataset.column_names)}); "
            "rename the column holding the prompts to 'prompt'."
        )
    if len(dataset) == 0:
        raise ConfigError(f"dataset {name!r} split {split!r} is empty.")
    return dataset


def _load_local(name: str) -> DatasetDict:
    """A built-in dataset (one split, train), a file (loaded as train), or a folder (its files name the splits)."""
    if name.startswith(tiny.PREFIX):
        if name not in BUILTIN_DATASETS:
            raise ConfigError(f"dataset_name={name!r}: the built-in datasets are {', '.join(BUILTIN_DATASETS)}.")
        return DatasetDict(train=BUILTIN_DATASETS[name]())
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1]
        if ext not in _FILE_FORMATS:
            raise ConfigError(f"dataset_name={name!r}: use a {', '.join(_FILE_FORMATS)} file or a dataset folder.")
        if os.path.getsize(name) == 0:  # `datasets` fails on it deep inside its schema inference
            raise ConfigError(f"dataset {name!r} is empty; give a file with at least one row.")
        return load_dataset(_FILE_FORMATS[ext], data_files=name)
    return load_dataset(name)
