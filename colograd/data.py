"""Loading the training prompts: a built-in task, a local file or folder, or a hub dataset."""

import os

from datasets import Dataset, load_dataset

from colograd import tiny
from colograd.config import ConfigError, ScriptArguments

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompts(args: ScriptArguments) -> Dataset:
    """The train split named by `args`, checked to have a `prompt` column."""
    name = args.dataset_name
    if name.startswith(tiny.PREFIX):
        if name not in tiny.TINY_DATASETS:
            raise ConfigError(f"dataset_name={name!r}: the built-in datasets are {', '.join(tiny.TINY_DATASETS)}.")
        dataset = tiny.letters_dataset()
    elif os.path.isfile(name):
        ext = os.path.splitext(name)[1]
        if ext not in _FILE_FORMATS:
            raise ConfigError(f"dataset_name={name!r}: use a {', '.join(_FILE_FORMATS)} file or a dataset folder.")
        dataset = load_dataset(_FILE_FORMATS[ext], data_files=name, split="train")
    else:
        dataset = load_dataset(name, args.dataset_config, split=args.dataset_train_split)
    if "prompt" not in dataset.column_names:
        raise ConfigError(
            f"dataset {name!r} has no 'prompt' column (columns: {', '.join(dataset.column_names)}); "
            "rename the column holding the prompts to 'prompt'."
        )
    if len(dataset) == 0:
        raise ConfigError(f"dataset {name!r} split {args.dataset_train_split!r} is empty.")
    return dataset
