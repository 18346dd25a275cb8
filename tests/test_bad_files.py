"""Broken files, by class: every case ends in one ConfigError naming the file and the fix, before any weights are
read or any engine starts. The cases are generated: every encoding for every text format, every truncation
point of a weights file, every size field of a model config. Nothing here loads weights or starts an engine."""

import json
import os

import pytest

from colograd import ScriptArguments
from colograd.config import ConfigError
from colograd.data import check_data_file, load_prompts

ROWS = [{"prompt": f"abcd>{c}é:", "target": c} for c in "abcd" * 4]
TEXT = {
    "jsonl": "\n".join(json.dumps(r, ensure_ascii=False) for r in ROWS),
    "json": json.dumps(ROWS, ensure_ascii=False),
    "csv": "prompt,target\n" + "\n".join(f"{r['prompt']},{r['target']}" for r in ROWS),
}


def write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


# --- data files: encodings, bytes that are not text, empty files, Parquet cut short ----------------------------


@pytest.mark.parametrize("ext", list(TEXT))
@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig"])
def test_utf8_with_or_without_a_byte_order_mark_loads(tmp_path, ext, encoding):
    dataset = load_prompts(ScriptArguments(dataset_name=write(tmp_path / f"d.{ext}", TEXT[ext].encode(encoding))))
    assert dataset[0]["prompt"] == ROWS[0]["prompt"] and len(dataset) == len(ROWS)


@pytest.mark.parametrize(
    "ext, folder", [*((ext, folder) for ext in TEXT for folder in (False, True)), ("txt", True)]
)  # a text file is read from a folder only
@pytest.mark.parametrize(
    "encoding, said",
    [
        ("latin-1", "is not UTF-8 (byte 0xe9 on line"),
        ("cp1252", "is not UTF-8 (byte 0xe9 on line"),
        ("utf-16", "is UTF-16LE encoded"),
        ("utf-16-be", "looks like UTF-16"),
        ("utf-16-le", "looks like UTF-16"),
        ("utf-32", "is UTF-32LE encoded"),
    ],
)
def test_every_other_encoding_is_named_with_the_command_that_converts_it(tmp_path, ext, encoding, said, folder):
    text = TEXT.get(ext, "\n".join(r["prompt"] for r in ROWS))
    if folder:
        (tmp_path / "data").mkdir()
    path = _path(tmp_path, ext, folder)
    write(tmp_path / path, text.encode(encoding))
    with pytest.raises(ConfigError, match="colograd reads data files as UTF-8") as err:
        load_prompts(ScriptArguments(dataset_name=str(tmp_path / "data") if folder else path))
    assert repr(path) in str(err.value) and said in str(err.value) and "iconv -f " in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def _path(tmp_path, ext: str, folder: bool) -> str:
    """A data file alone, or the train split of a dataset folder."""
    return str(tmp_path / "data" / f"train.{ext}") if folder else str(tmp_path / f"d.{ext}")


@pytest.mark.parametrize("ext", [*TEXT, "txt"])
@pytest.mark.parametrize("position", [0, 0.5, -1])
def test_a_byte_that_is_not_utf8_anywhere_is_found_with_its_line(tmp_path, ext, position):
    data = TEXT.get(ext, "x\ny\nz").encode()
    at = int(len(data) * position) if position != -1 else len(data)
    path = write(tmp_path / f"d.{ext}", data[:at] + b"\xff" + data[at:])
    with pytest.raises(ConfigError, match=r"is not UTF-8 \(byte 0xff on line (\d+)") as err:
        check_data_file(path)
    line = data[:at].count(b"\n") + 1
    assert f"line {line};" in str(err.value)


def test_a_file_cut_inside_a_character_is_named_cut_short(tmp_path):
    path = write(tmp_path / "d.jsonl", TEXT["jsonl"].encode()[: TEXT["jsonl"].encode().index("é".encode()) + 1])
    with pytest.raises(ConfigError, match="ends in the middle of a character"):
        check_data_file(path)


@pytest.mark.parametrize(
    "ext, folder", [*((ext, folder) for ext in (*TEXT, "parquet") for folder in (False, True)), ("txt", True)]
)
@pytest.mark.parametrize("content", [b"", b"\n\n  \n"], ids=["empty", "whitespace"])
def test_an_empty_file_alone_or_in_a_folder_is_named(tmp_path, ext, content, folder):
    if folder:
        (tmp_path / "data").mkdir()
        write(tmp_path / "data" / "train.jsonl", TEXT["jsonl"].encode())
    path = write(tmp_path / ("data" if folder else ".") / f"empty.{ext}", content)
    with pytest.raises(ConfigError, match=r"is empty|holds only whitespace|not a whole Parquet") as err:
        load_prompts(ScriptArguments(dataset_name=str(tmp_path / "data") if folder else path))
    assert os.path.normpath(path) in str(err.value)


@pytest.fixture(scope="module")
def parquet_bytes(tmp_path_factory):
    import pandas as pd

    path = tmp_path_factory.mktemp("parquet") / "d.parquet"
    pd.DataFrame(ROWS).to_parquet(path)
    return path.read_bytes()


def test_a_whole_parquet_file_loads(tmp_path, parquet_bytes):
    assert len(load_prompts(ScriptArguments(dataset_name=write(tmp_path / "d.parquet", parquet_bytes)))) == len(ROWS)


@pytest.mark.parametrize("cut", [1, 4, 8, 12, 0.25, 0.5, 0.9, -5, -4, -1])
def test_a_parquet_file_cut_anywhere_is_named_cut_short(tmp_path, parquet_bytes, cut):
    end = len(parquet_bytes) + cut if cut < 0 else int(len(parquet_bytes) * cut) if cut < 1 else cut
    path = write(tmp_path / "d.parquet", parquet_bytes[:end])
    with pytest.raises(ConfigError, match="is not a whole Parquet file .*copy or export it again"):
        load_prompts(ScriptArguments(dataset_name=path))


def test_another_format_named_parquet_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no PAR1 marker at its start: not Parquet"):
        check_data_file(write(tmp_path / "d.parquet", TEXT["csv"].encode()))


@pytest.mark.parametrize("ext", ["jsonl", "json"])
@pytest.mark.parametrize("row", [0, 1, len(ROWS) // 2, len(ROWS) - 1])
def test_json_cut_inside_any_row_names_the_file_and_line(tmp_path, ext, row):
    data = TEXT[ext].encode()
    starts = [i for i in range(len(data)) if data.startswith(b'{"prompt"', i)]
    path = write(tmp_path / f"d.{ext}", data[: starts[row] + 12])  # inside the row's prompt
    with pytest.raises(ConfigError, match=r"cannot be read \(line \d+\)") as err:
        load_prompts(ScriptArguments(dataset_name=path))
    assert repr(path) in str(err.value)
    if ext == "jsonl":
        assert f"(line {row + 1})" in str(err.value)
