"""Broken files, by class: every case ends in one ConfigError naming the file and the fix, before any weights are
read or any engine starts. The cases are generated: every encoding for every text format, every truncation
point of a weights file, every size field of a model config. Nothing here loads weights or starts an engine."""

import codecs
import json
import os
import shutil
from unittest.mock import patch

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config
from trl import ModelConfig

from colograd import GRPOConfig, GRPOTrainer, ScriptArguments
from colograd.config.core import ConfigError
from colograd.data.core import check_data_file, load_prompts
from colograd.models import tiny
from colograd.models.model_files import SIZE_FIELDS, check_special_tokens
from colograd.train import cli, load_model, load_model_config

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
    with pytest.raises(ConfigError, match="cannot be read: not a whole Parquet file .*copy or export it again"):
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


# --- model folders: JSON files, config fields, weights, tokenizer --------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny model saved as a user's folder is: config, safetensors weights, tokenizer, generation config."""
    folder = tmp_path_factory.mktemp("model") / "tiny"
    tiny.build_model().save_pretrained(folder)
    tiny.build_tokenizer().save_pretrained(folder)
    GenerationConfig(eos_token_id=1, pad_token_id=0).save_pretrained(folder)
    return folder


@pytest.fixture
def copy(model_folder, tmp_path):
    """A fresh copy of the model folder to break."""
    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    return folder


def load(folder, tmp_path):
    """`load_model_config` as the command line runs it: config and tokenizer, no weights read."""
    return load_model_config(ModelConfig(model_name_or_path=str(folder)), GRPOConfig(output_dir=str(tmp_path / "o")))


def edit_json(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def test_the_whole_folder_passes_every_check(copy, tmp_path):
    config, tokenizer, _ = load(copy, tmp_path)
    assert config.hidden_size == 128 and tokenizer.eos_token == "<eos>"


def test_through_the_command_line_a_broken_file_is_one_line_and_exit_2(copy, tmp_path, capsys, monkeypatch):
    os.truncate(copy / "model.safetensors", 1000)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were read"))
    argv = ["--config", "recipes/grpo_tiny.yaml", "--model_name_or_path", str(copy), "--output_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("colograd: error: ") and "model.safetensors" in err[-1]


JSON_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("name", JSON_FILES)
@pytest.mark.parametrize("damage", ["cut", "appended", "bom", "latin-1"])
def test_every_json_file_of_the_folder_must_parse(copy, tmp_path, name, damage):
    path = copy / name
    data = path.read_bytes()
    broken = {
        "cut": data[: len(data) // 2],
        "appended": data + b"}",
        "bom": codecs.BOM_UTF8 + data,
        "latin-1": data.replace(b"{", b'{"\xe9": 1, ', 1),
    }[damage]
    path.write_bytes(broken)
    with pytest.raises(ConfigError, match=f"{name} is not (valid JSON|UTF-8 text)") as err:
        load(copy, tmp_path)
    assert "restore it" in str(err.value)


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda c: c.pop("model_type"), "has no model_type"),
        (lambda c: c.update(model_type="qwen9"), "'qwen9' is not an architecture transformers knows .*'qwen3'"),
        (lambda c: c.update(model_type=""), "has no model_type"),
    ],
    ids=["missing", "unknown", "empty"],
)
def test_model_type_must_name_an_architecture(copy, tmp_path, change, said):
    edit_json(copy / "config.json", change)
    with pytest.raises(ConfigError, match=said):
        load(copy, tmp_path)


def test_a_config_that_is_not_an_object_is_refused(copy, tmp_path):
    (copy / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json is a JSON list, not an object"):
        load(copy, tmp_path)


# Every field of the architecture's config with a number or a flag by default; each gets a value of another type.
TYPED_FIELDS = sorted(
    k for k, v in Qwen2Config().to_dict().items() if isinstance(v, bool | int | float) and not k.endswith("_token_id")
)
WRONG = {bool: "yes", int: "64", float: "0.5x"}


@pytest.mark.parametrize("field", TYPED_FIELDS)
def test_every_typed_config_field_of_the_wrong_type_is_named(copy, tmp_path, field):
    default = Qwen2Config().to_dict()[field]
    wrong = WRONG[bool if isinstance(default, bool) else int if isinstance(default, int) else float]
    edit_json(copy / "config.json", lambda c: c.update({field: wrong}))
    with pytest.raises(ConfigError, match=f"config.json: {field}={wrong!r} should be") as err:
        load(copy, tmp_path)
    assert "fix the value in the file" in str(err.value)


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", ["64", 64.5, 0, -1, True], ids=["text", "fraction", "zero", "negative", "flag"])
def test_every_size_field_must_be_a_positive_whole_number(copy, tmp_path, field, value):
    edit_json(copy / "config.json", lambda c: c.update({field: value}))
    with pytest.raises(ConfigError, match=f"{field}={value!r} should be (a whole number|positive)"):
        load(copy, tmp_path)


@pytest.mark.parametrize("value", ["float99", 16, "Tensor"])
def test_a_dtype_torch_does_not_have_is_refused(copy, tmp_path, value):
    edit_json(copy / "config.json", lambda c: c.update(dtype=value))
    with pytest.raises(ConfigError, match="is not a torch dtype"):
        load(copy, tmp_path)


# --- weights ---------------------------------------------------------------------------------------------------


def header_length(path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize("cut", [0, 1, 7, 8, 9, "header", "header+8", 0.5, 0.9, -1], ids=str)
def test_safetensors_cut_anywhere_is_named_before_the_weights_load(copy, tmp_path, cut):
    path = copy / "model.safetensors"
    size, n = path.stat().st_size, header_length(path)
    end = {"header": n, "header+8": n + 8}.get(cut, cut)
    end = size + end if isinstance(end, int) and end < 0 else int(size * end) if isinstance(end, float) else end
    os.truncate(path, end)
    with pytest.raises(ConfigError, match="model.safetensors is not a whole safetensors file .*download it again"):
        load(copy, tmp_path)


@pytest.mark.parametrize(
    "damage",
    [b"\0" * 16, b"x" * 16],
    ids=["appended zeros", "appended bytes"],
)
def test_bytes_after_the_last_tensor_are_named(copy, tmp_path, damage):
    with open(copy / "model.safetensors", "ab") as f:
        f.write(damage)
    with pytest.raises(ConfigError, match="has bytes after its last tensor"):
        load(copy, tmp_path)


@pytest.mark.parametrize("content", [b"", os.urandom(4096), b"\x10\0\0\0\0\0\0\0[1, 2, 3, 4, 5, 6]"])
def test_a_file_that_is_not_safetensors_is_named(copy, tmp_path, content):
    (copy / "model.safetensors").write_bytes(content)
    with pytest.raises(ConfigError, match="is not a whole safetensors file"):
        load(copy, tmp_path)


def test_no_weights_at_all_is_named_just_before_they_would_load(copy, tmp_path, monkeypatch):
    os.remove(copy / "model.safetensors")
    load(copy, tmp_path)  # config and tokenizer are enough for what is checked before the weights load
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ConfigError, match="has a config.json but no weights"):
        load_model(ModelConfig(model_name_or_path=str(copy)), GRPOConfig(output_dir=str(tmp_path / "o")))


def test_an_index_naming_a_missing_shard_is_named(copy, tmp_path):
    os.remove(copy / "model.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="names model-00002-of-00002.safetensors, which is missing"):
        load(copy, tmp_path)


def test_a_pytorch_file_cut_short_is_named(copy, tmp_path):
    os.remove(copy / "model.safetensors")
    torch.save(tiny.build_model().state_dict(), copy / "pytorch_model.bin")
    os.truncate(copy / "pytorch_model.bin", 5000)
    with pytest.raises(ConfigError, match="pytorch_model.bin is cut short or not a PyTorch file"):
        load(copy, tmp_path)


def tied_and_layers(layers: int):
    return lambda c: c.update(num_hidden_layers=layers, layer_types=["full_attention"] * layers)


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda c: c.update(hidden_size=256, intermediate_size=512), "shapes differ: model.embed_tokens.weight is"),
        (lambda c: c.update(vocab_size=128), r"shapes differ: model.embed_tokens.weight is \[64, 128\] there"),
        (lambda c: c.update(intermediate_size=512), "shapes differ: model.layers.0.mlp"),
        (lambda c: c.update(num_key_value_heads=1), "shapes differ: model.layers.0.self_attn.k_proj"),
        (tied_and_layers(3), "tensors the model needs are missing .*model.layers.2."),
        (tied_and_layers(1), "tensors the model does not have .*model.layers.1."),
        (lambda c: c.update(tie_word_embeddings=True), "config.json ties tensors the weights hold apart"),
    ],
    ids=["hidden", "vocab", "mlp", "kv heads", "more layers", "fewer layers", "tied"],
)
def test_a_config_that_disagrees_with_the_weights_is_named_by_tensor(copy, tmp_path, change, said):
    edit_json(copy / "config.json", change)
    with pytest.raises(ConfigError, match=said) as err:
        load(copy, tmp_path)
    assert "the weights in model.safetensors do not match config.json" in str(err.value)


def test_a_tied_model_saved_with_one_name_matches_its_config(tmp_path):
    folder = tmp_path / "tied"
    tiny.build_model(tie_word_embeddings=True).save_pretrained(folder)
    tiny.build_tokenizer().save_pretrained(folder)
    assert load(folder, tmp_path)[0].tie_word_embeddings


# --- tokenizer -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("removed", [["eos_token"], ["eos_token", "pad_token"]])
def test_a_tokenizer_config_without_its_eos_token_is_named(copy, tmp_path, removed):
    edit_json(copy / "tokenizer_config.json", lambda c: [c.pop(k, None) for k in removed])
    with pytest.raises(ConfigError, match=r"eos_token '.*' is not one of its tokens .*\(one of <eos>, <pad>\)"):
        load(copy, tmp_path)


def test_a_tokenizer_without_pad_pads_with_its_eos(copy, tmp_path):
    edit_json(copy / "tokenizer_config.json", lambda c: c.pop("pad_token"))
    assert load(copy, tmp_path)[1].eos_token == "<eos>"


def bare_tokenizer(**special):
    return PreTrainedTokenizerFast(tokenizer_object=tiny.build_tokenizer().backend_tokenizer, **special)


@pytest.mark.parametrize(
    "tokenizer, eos_id, vocab, said",
    [
        (lambda: bare_tokenizer(), 1, 64, "neither a pad_token nor an eos_token"),
        (lambda: bare_tokenizer(pad_token="<pad>"), None, 64, "name no end-of-sequence token"),
        (lambda: bare_tokenizer(pad_token="<pad>"), [], 64, "name no end-of-sequence token"),
        (lambda: bare_tokenizer(eos_token="<eos>"), None, 1, "beyond the model's vocab_size 1"),
    ],
    ids=["no pad no eos", "no eos anywhere", "empty eos list", "eos beyond vocab"],
)
def test_special_tokens(tokenizer, eos_id, vocab, said):
    with pytest.raises(ConfigError, match=said):
        check_special_tokens("m", tokenizer(), eos_id, vocab)


def test_an_eos_only_in_the_generation_config_is_enough():
    check_special_tokens("m", bare_tokenizer(pad_token="<pad>"), [1, 2], 64)


def test_a_malformed_tokenizer_json_of_valid_json_is_one_line(copy, tmp_path):
    edit_json(copy / "tokenizer.json", lambda t: t.update(model={"type": "WordLevel"}))
    with pytest.raises(ConfigError, match="its tokenizer cannot be loaded .*restore tokenizer.json"):
        load(copy, tmp_path)


def test_weights_transformers_cannot_load_for_a_reason_the_headers_hide_are_one_line(copy, tmp_path, monkeypatch):
    def mismatch(*args, **kwargs):
        raise RuntimeError("You set `ignore_mismatched_sizes` to `False`, thus raising an error.\nreport...")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", mismatch)
    with pytest.raises(ConfigError, match=r"its weights cannot be loaded \(You set `ignore_mismatched_sizes`"):
        load_model(ModelConfig(model_name_or_path=str(copy)), GRPOConfig(output_dir=str(tmp_path / "o")))


@pytest.mark.parametrize(
    "special, generation_eos, said",
    [({}, 1, "neither a pad_token nor an eos_token"), ({"pad_token": "<pad>"}, None, "no end-of-sequence token")],
    ids=["no pad no eos", "no eos anywhere"],
)
def test_the_trainer_refuses_such_a_tokenizer_before_its_engine_starts(tmp_path, special, generation_eos, said):
    model = tiny.build_model()
    model.generation_config.eos_token_id = generation_eos
    model.config.eos_token_id = None
    args = tiny.run_config(str(tmp_path), 1)
    with (
        patch("colograd.trainer.Engine.acquire", side_effect=AssertionError("an engine was started")),
        pytest.raises(ConfigError, match=f"processing_class \\(the tokenizer\\) .*{said}"),
    ):
        GRPOTrainer(model, "letters", args, tiny.letters_dataset(64), processing_class=bare_tokenizer(**special))
