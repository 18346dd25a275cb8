"""Loading the training prompts: a built-in task, a local file or folder, or a hub dataset.

Rows need a ``prompt``: text (standard) or a list of chat messages (conversational; the tokenizer's chat
template is applied per rollout). Every other column reaches the reward functions.
"""

import codecs
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import datasets
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, load_dataset
from transformers import PreTrainedTokenizerBase
from trl.data_utils import maybe_apply_chat_template

from colograd.config.core import ConfigError, ScriptArguments
from colograd.data import code_task, sums
from colograd.models import tiny, tiny_vlm

BUILTIN_DATASETS = {
    "colograd:letters": tiny.letters_dataset,
    "colograd:sums": sums.sums_dataset,
    "colograd:code_sums": code_task.code_sums_dataset,
    "colograd:code_functions": code_task.code_functions_dataset,
    "colograd:colours": tiny_vlm.colours_dataset,
}
T = TypeVar("T")
_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# What `datasets` reads from a folder: text formats (read as UTF-8) and Parquet (binary, framed by its magic bytes).
_TEXT_FILES = (".json", ".jsonl", ".csv", ".tsv", ".txt")
_PARQUET_MAGIC = b"PAR1"
# Byte-order marks of the encodings a file can say it is in; longest first (UTF-32-LE's starts with UTF-16-LE's).
_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32LE"),
    (codecs.BOM_UTF32_BE, "UTF-32BE"),
    (codecs.BOM_UTF16_LE, "UTF-16LE"),
    (codecs.BOM_UTF16_BE, "UTF-16BE"),
)
_CHUNK = 1 << 24  # bytes decoded at a time: a large file is checked without holding it in memory


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
    if column == "prompt" and column not in columns and "conversations" in columns:
        row = first if streaming else _read(name, lambda: dataset[0]) if len(dataset) else None
        raise ConfigError(f"dataset {name!r}: {conversations_fix(row)}")
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
        check_data_file(name)
        return _read(name, lambda: load_dataset(_FILE_FORMATS[ext], data_files=name, streaming=streaming))
    for path in data_files(name):
        check_data_file(path)
    return _read(name, lambda: load_dataset(name, streaming=streaming))


# --- the bytes of local data files ---------------------------------------------------------------------------


def data_files(folder: str) -> list[str]:
    """The files of a dataset folder that `datasets` may read (text and Parquet files, hidden ones left out)."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        found += [
            os.path.join(root, n)
            for n in sorted(names)
            if not n.startswith((".", "_")) and n.endswith((*_TEXT_FILES, ".parquet"))
        ]
    return found


def check_data_file(path: str) -> None:
    """The file-level stage every local data file passes before `datasets` parses it: not empty, a text file
    in UTF-8 (a UTF-8 byte-order mark is fine), a Parquet file whole. Parsing errors (a JSON line cut short) are
    reported by `_read`, with their line.

    Raises:
        ConfigError: naming the file, what is wrong with its bytes, and the fix.
    """
    if os.path.getsize(path) == 0:  # `datasets` fails on it deep inside its schema inference
        raise ConfigError(f"dataset {path!r} is empty; give a file with at least one row (or remove it).")
    if path.endswith(".parquet"):
        _check_parquet(path)
    else:
        _check_utf8(path)


def _check_parquet(path: str) -> None:
    """A Parquet file starts and ends with its magic bytes: a copy cut short, or another format renamed, does not."""
    size, magic = os.path.getsize(path), len(_PARQUET_MAGIC)
    with open(path, "rb") as f:
        head = f.read(magic)
        f.seek(-min(2 * magic, size), os.SEEK_END)
        tail = f.read()  # the footer's length (4 bytes, little-endian), then the marker
    footer = int.from_bytes(tail[:magic], "little") if len(tail) == 2 * magic else size
    if head != _PARQUET_MAGIC:
        problem = "no PAR1 marker at its start: not Parquet"
    elif tail[-magic:] != _PARQUET_MAGIC or footer > size - 3 * magic:
        problem = "no whole footer at its end: cut short"
    else:
        return
    raise ConfigError(
        f"dataset {path!r} cannot be read: not a whole Parquet file ({problem}); copy or export it again."
    )


def _check_utf8(path: str) -> None:
    """A text data file must be UTF-8 and hold more than whitespace; decoded in chunks, so a large file is checked
    without being held in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines, offset, blank = 1, 0, True
    with open(path, "rb") as f:
        head = f.read(4)
        bom = next((enc for mark, enc in _BOMS if head.startswith(mark)), None)
        if bom is not None:
            _not_utf8(path, f"is {bom} encoded (it starts with that byte-order mark)", bom)
        f.seek(0)
        while chunk := f.read(_CHUNK):
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError as err:
                lines += chunk.count(b"\n", 0, err.start)
                _not_utf8(path, *_bad_byte(path, chunk[err.start], offset + err.start, lines))
            lines, offset = lines + chunk.count(b"\n"), offset + len(chunk)
            blank = blank and not text.lstrip("\ufeff").strip()
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            _not_utf8(path, "ends in the middle of a character (the file is cut short)", None)
    if blank:
        raise ConfigError(f"dataset {path!r} holds only whitespace; give a file with at least one row.")


def _bad_byte(path: str, byte: int, offset: int, line: int) -> tuple[str, str | None]:
    """What a byte that is not UTF-8 says about the file's encoding, and the encoding to convert from."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.count(0) > len(head) // 4:  # ASCII text in UTF-16 is every other byte zero
        return f"is not UTF-8 but looks like UTF-16 without a byte-order mark (byte {offset})", "UTF-16LE"
    return f"is not UTF-8 (byte 0x{byte:02x} on line {line}; perhaps Latin-1 or Windows-1252)", "CP1252"


def _not_utf8(path: str, problem: str, encoding: str | None) -> NoReturn:
    """Raise the one line for a text file in another encoding: what it is, and the command that converts it."""
    stem, ext = os.path.splitext(path)
    fix = (
        f"convert it to UTF-8, e.g. `iconv -f {encoding} -t UTF-8 {path} > {stem}.utf8{ext}`"
        if encoding
        else "copy or export it again"
    )
    raise ConfigError(f"dataset {path!r} cannot be read: it {problem}; colograd reads data files as UTF-8: {fix}.")


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


def conversations_fix(row: dict | None) -> str:
    """What to tell a dataset with a `conversations` column and no `prompt` (LLaVA-Instruct, ShareGPT): colograd
    prompts with a `prompt` column, and the `dataset.map` that builds it from the first turn of each conversation
    (its keys read from `row`: LLaVA's `from` / `value`, or `role` / `content`), the `<image>` placeholder taken out
    of its text (the image column places the images)."""
    turns = (row or {}).get("conversations")
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
    text = "value" if "value" in first or "content" not in first else "content"
    return (
        "it has a 'conversations' column and no 'prompt' (the LLaVA-Instruct / ShareGPT layout), and prompts are "
        "read from a 'prompt' column of chat messages: build it from each conversation's first turn, without its "
        "'<image>' placeholder (the image column places the image), with dataset = dataset.map(lambda row: "
        f"{{'prompt': [{{'role': 'user', 'content': row['conversations'][0][{text!r}]"
        ".replace('<image>', '').strip()}]})."
    )
