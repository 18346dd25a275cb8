"""The model folder stage: a local model's files checked before its weights are read.

A model folder is several files that must agree; when one is broken, transformers fails on it late and in its own
words (a strict-dataclass traceback for ``hidden_size: "64"``, a safetensors header error for a copy cut short) or
not at all (a config with one layer more than the weights gets that layer randomly initialised, with a warning).
Each check below covers a whole kind of breakage, in the order a folder is read:

    json files     every ``*.json`` of the folder (config, generation config, tokenizer files) is UTF-8 JSON
    config         config.json is an object naming a model_type transformers knows; each field has the type of the
                   architecture's default, and sizes are positive
    tokenizer      it pads and ends sequences: a pad or eos token, and an end-of-sequence id somewhere
    weights        the weight files exist; every safetensors header parses and covers its file (which catches every
                   truncation); the tensors' names and shapes are those of the model the config describes (built
                   on the meta device: no memory, nothing read)

Each failure is a `ConfigError` naming the file and the fix. `colograd/train.py` runs the folder checks in
`load_model_config`, before the weights load (a folder without weights is refused by `load_model`, just before it
would read them); `check_weight_files` also checks a checkpoint's weights on resume.
"""

import difflib
import json
import os
import re
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from colograd.config.core import ConfigError

# Fields that count something: zero or negative is a broken config, which torch reports as a negative dimension.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# Bytes per element of each safetensors dtype (the format's own names).
_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "C64": 8,
    "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip
_HEADER_LIMIT = 100_000_000  # safetensors' own bound on a header's length
_LAYER_INDEX = re.compile(r"\.\d+\.")
_SHOWN = 3  # mismatches named in a message before "and N more"


def check_model_folder(folder: str, trust_remote_code: bool = False) -> None:
    """The checks that need no transformers object: the folder's JSON files, then config.json's shape and fields.

    Args:
        folder: a local model folder (`model_name_or_path`).
        trust_remote_code: whether a model_type transformers does not know may come from the folder's own code.

    Raises:
        ConfigError: naming the file, what is wrong with it and the fix.
    """
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json") and os.path.isfile(os.path.join(folder, name)):
            _read_json(folder, name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        if os.path.isfile(os.path.join(folder, "adapter_config.json")):
            return  # a PEFT adapter: transformers reads its base model's config from adapter_config.json
        raise ConfigError(f"model_name_or_path={folder!r} has no config.json; give the folder a model was saved to.")
    raw = _read_json(folder, "config.json")
    if not isinstance(raw, dict):
        raise ConfigError(f"{_where(folder)} is a JSON {type(raw).__name__}, not an object; restore it.")
    check_config_fields(folder, raw, trust_remote_code)


def _read_json(folder: str, name: str) -> object:
    """One of the folder's JSON files, parsed as transformers reads it (UTF-8, no byte-order mark)."""
    path = os.path.join(folder, name)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as err:
        problem = f"is not UTF-8 text (byte {err.start})"
    except json.JSONDecodeError as err:
        problem = f"is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
    raise ConfigError(
        f"{_where(folder, name)} {problem}; restore it from where the model came from (a copy cut short or edited "
        "by hand)."
    )


def _where(folder: str, name: str = "config.json") -> str:
    return f"model_name_or_path={folder!r}: {name}"


def check_config_fields(folder: str, raw: dict, trust_remote_code: bool = False, name: str = "config.json") -> None:
    """config.json's model_type is one transformers knows, each field has the type the architecture's config
    gives it by default, the sizes are positive and the dtype is one torch has. A sub-config (`text_config`) is
    checked the same way.

    Raises:
        ConfigError: naming the field, its value, what it should be.
    """
    where = _where(folder, name)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(
            f'{where} has no model_type; add the architecture\'s (e.g. "model_type": "qwen2"), as in the '
            "config the model was published with."
        )
    if model_type not in CONFIG_MAPPING:
        if trust_remote_code and "auto_map" in raw:
            return  # the folder's own code defines it
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{where}: model_type={model_type!r} is not an architecture transformers knows{hint}; fix the name, "
            "upgrade transformers, or set trust_remote_code: true for a model that ships its own code."
        )
    try:
        defaults = CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # an architecture whose config needs arguments: nothing to compare against
        defaults = {}
    for field, value in raw.items():
        problem = _field_problem(field, value, defaults.get(field))
        if problem:
            raise ConfigError(f"{where}: {field}={value!r} {problem}; fix the value in the file.")
        if isinstance(value, dict) and isinstance(value.get("model_type"), str) and field.endswith("_config"):
            check_config_fields(folder, value, trust_remote_code, f"{name}'s {field}")


def _field_problem(field: str, value: object, default: object) -> str | None:
    """What is wrong with one config field's value, or None: the type of the architecture's default (an int
    where an int is, a number where a float is), a positive size, a torch dtype."""
    if field in ("dtype", "torch_dtype") and value is not None:
        if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
            return 'is not a torch dtype (e.g. "bfloat16", "float32")'
        return None
    if field in SIZE_FIELDS and (value is not None or default is not None):
        if not isinstance(value, int) or isinstance(value, bool):
            return "should be a whole number, without quotes"
        return None if value > 0 else "should be positive"
    if value is None or default is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "should be true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "should be a whole number"
    if isinstance(default, float):
        return None if isinstance(value, int | float) and not isinstance(value, bool) else "should be a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "should be text"
    return None


# --- tokenizer -----------------------------------------------------------------------------------------------


def check_special_tokens(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    eos_token_id: object,
    vocab_size: int | None = None,
    saved_tokens: set[str] | None = None,
) -> None:
    """The tokenizer can pad (the trainer pads with eos_token where pad_token is unset, as TRL does) and the
    model's completions can end: an end-of-sequence token the tokenizer's files define and the model can emit.

    Args:
        name: what the model was loaded from, for the message ("" for a model given as an object).
        tokenizer: the policy's tokenizer.
        eos_token_id: the model's end-of-sequence id(s) from its config or generation config, or None.
        vocab_size: the model's vocabulary size (its output layer's rows), None when unknown.
        saved_tokens: the tokens tokenizer.json defines (`saved_tokens`), None when unknown.

    Raises:
        ConfigError: naming the token that is missing or wrong, and where to set it.
    """
    where = f"model_name_or_path={name!r}: the tokenizer" if name else "processing_class (the tokenizer)"
    if tokenizer.pad_token is None and tokenizer.eos_token is None:
        raise ConfigError(
            f"{where} has neither a pad_token nor an eos_token, and batches are padded with one of them; set "
            '"eos_token" (the token that ends a reply) in tokenizer_config.json.'
        )
    if tokenizer.eos_token_id is None and eos_token_id in (None, []):
        raise ConfigError(
            f"{where} (eos_token) and config.json or generation_config.json (eos_token_id) name no end-of-sequence "
            'token, so no completion could end before max_completion_length; set "eos_token" in '
            "tokenizer_config.json."
        )
    eos = tokenizer.eos_token
    if eos is not None and saved_tokens is not None and eos not in saved_tokens:
        special = sorted(t for t in saved_tokens if t.startswith("<") and t.endswith(">"))[:4]
        raise ConfigError(
            f"{where}'s eos_token {eos!r} is not one of its tokens (tokenizer.json): transformers filled in "
            f'{type(tokenizer).__name__}\'s default, a new token the model never learned to emit; set "eos_token" in '
            f"tokenizer_config.json to the model's own{' (one of ' + ', '.join(special) + ')' if special else ''}."
        )
    if eos is not None and vocab_size is not None and tokenizer.eos_token_id >= vocab_size:
        raise ConfigError(
            f"{where}'s eos_token {eos!r} has id {tokenizer.eos_token_id}, beyond the model's vocab_size "
            f'{vocab_size}: the model cannot emit it; set "eos_token" in tokenizer_config.json to the model\'s own.'
        )


def check_model_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """`check_special_tokens` for a model given as an object (`GRPOTrainer`'s): its end-of-sequence id from its
    generation config, else its config."""
    text = model.config.get_text_config()
    generation = model.generation_config
    eos = generation.eos_token_id if generation is not None else None
    eos = eos if eos is not None else getattr(text, "eos_token_id", None)
    check_special_tokens("", tokenizer, eos, getattr(text, "vocab_size", None))


def saved_tokens(folder: str) -> set[str] | None:
    """The tokens a folder's tokenizer.json defines (its vocabulary and added tokens); None without one, or for a
    vocabulary of a kind not read here."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    data = _read_json(folder, "tokenizer.json")
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        tokens = set(vocab)
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs
        tokens = {v[0] for v in vocab if isinstance(v, list) and v and isinstance(v[0], str)}
    else:
        return None
    return tokens | {t["content"] for t in data.get("added_tokens", []) if isinstance(t, dict) and "content" in t}


# --- weights -------------------------------------------------------------------------------------------------


def weight_files(folder: str) -> list[str]:
    """The weight files transformers loads from `folder`, in its order of preference: one safetensors file, the
    shards its index names, then the same for PyTorch's format; [] when there are none.

    Raises:
        ConfigError: an index names a shard the folder lacks.
    """
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if os.path.isfile(os.path.join(folder, single)):
            return [single]
        if os.path.isfile(os.path.join(folder, index)):
            weight_map = _read_json(folder, index)
            shards = sorted(set(weight_map.get("weight_map", {}).values())) if isinstance(weight_map, dict) else []
            missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
            if missing or not shards:
                what = f"names {missing[0]}, which is missing" if missing else "names no shards"
                raise ConfigError(f"{_where(folder, index)} {what}; copy the model's weight files whole.")
            return shards
    return []


def safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of a safetensors file, by name: dtype and shape, from its header alone. The header's offsets
    must account for every byte of the file, so any truncation (or bytes appended) is found here.

    Raises:
        ConfigError: the file is cut short, or is not safetensors.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else None
        if length is None or length > min(size - 8, _HEADER_LIMIT):
            _broken(path, f"its header is cut short or unreadable ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            _broken(path, "its header is not the JSON safetensors writes")
    if not isinstance(header, dict):
        _broken(path, "its header is not the JSON safetensors writes")
    header.pop("__metadata__", None)
    tensors, end = {}, 0
    for name, info in header.items():
        try:
            dtype, shape, (start, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            _broken(path, f"its header's entry for {name} is malformed")
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype in _DTYPE_BYTES and stop - start != numel * _DTYPE_BYTES[dtype]:
            _broken(path, f"its header gives {name} {stop - start} bytes for shape {list(shape)} of {dtype}")
        tensors[name], end = (dtype, shape), max(end, stop)
    data = size - 8 - length
    if end != data:
        cut = "is cut short" if end > data else "has bytes after its last tensor"
        _broken(path, f"it {cut}: {data} bytes of tensor data, its header accounts for {end}")
    return tensors


def _broken(path: str, problem: str) -> NoReturn:
    raise ConfigError(f"{path} is not a whole safetensors file ({problem}); copy or download it again.")


def check_weight_files(
    folder: str,
    config: PretrainedConfig | None,
    trust_remote_code: bool = False,
    label: str | None = None,
    against: str = "config.json",
    fix: str = "use the config.json the weights were saved with",
    required: bool = True,
) -> None:
    """The folder has weights, each file whole, holding the tensors the config's model has, in its shapes.

    Args:
        folder: a model folder, or a checkpoint's (whose weights must fit the run's model).
        config: the model's config; None checks the files alone.
        trust_remote_code: passed to transformers when it builds the model (on the meta device).
        label: how the message names the folder (default: as model_name_or_path).
        against: how the message names the config the weights must match.
        fix: what the message tells the user to do when the weights do not fit the config.
        required: whether a folder without weights is refused (a folder of config and tokenizer is enough for
            what is checked before the weights load).

    Raises:
        ConfigError: naming the file and the tensor(s), and the fix.
    """
    label = label or f"model_name_or_path={folder!r}"
    files = weight_files(folder)
    if not files and not required:
        return
    if not files:
        raise ConfigError(
            f"{label} has a config.json but no weights (model.safetensors, its shards with "
            "model.safetensors.index.json, or pytorch_model.bin); copy them into the folder."
        )
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in files:
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            tensors |= safetensors_header(path)
        elif not zipfile.is_zipfile(path):  # torch.save writes a zip, whose directory is at its end
            raise ConfigError(f"{path} is cut short or not a PyTorch file; copy or download it again.")
    if config is not None and tensors:
        expected = _expected_shapes(folder, config, trust_remote_code)
        if expected is not None:
            _compare(f"{label}: the weights in", f"do not match {against}", files, tensors, *expected, fix)


@contextmanager
def built_whole() -> Iterator[None]:
    """Build models whole while a ZeRO-3 config is active: transformers otherwise partitions a model as it builds it
    (`deepspeed.zero.Init`), which fails on the meta device (a model's shapes, checked when a ZeRO-3 run resumes) and
    for LLaVA's towers (built through `AutoModel.from_config`, then their empty shards initialised). DeepSpeed
    partitions the whole model when it wraps it."""
    from transformers.integrations import deepspeed

    kept = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = kept


@contextmanager
def on_meta_device() -> Iterator[None]:
    """Build models on the meta device (their shapes and modules only: no memory, no weights read), whole while a
    ZeRO-3 config is active (`built_whole`): transformers' DeepSpeed config is live from the moment the run's
    arguments are parsed under a DeepSpeed launch, and a model it partitions on the meta device fails ("Cannot copy
    out of meta tensor"). Every meta-device build in colograd goes through here."""
    with torch.device("meta"), built_whole():
        yield


def _expected_shapes(
    folder: str, config: PretrainedConfig, trust_remote_code: bool
) -> tuple[dict[str, tuple[int, ...]], list[list[str]]] | None:
    """The state dict's shapes of the model `config` describes (built on the meta device), and its groups of tied
    parameter names (one saved name serves the group); None when remote code cannot be built that way."""
    # A vision-language model is built as colograd loads it (`colograd.vision.core.load_pretrained`): image-text to
    # text, which a Qwen-VL's config needs (causal-LM classes do not take it).
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    try:
        with on_meta_device():
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as err:  # the config's values make no model (torch and transformers raise several types)
        if trust_remote_code:
            return None
        message = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            f"{_where(folder)} describes a model transformers cannot build ({message}); fix the field it names."
        ) from err
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return shapes, list(groups.values())


def _compare(
    label: str,
    against: str,
    files: list[str],
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    expected: dict[str, tuple[int, ...]],
    tied: list[list[str]],
    fix: str,
) -> None:
    """Shapes of the tensors both sides name; then, where the files name the model's tensors as transformers does
    (no renaming on load), the tensors the model needs that the files lack, and files' tensors of another size of
    the same model (one layer more)."""
    label += " " + files[0] + (f" and {len(files) - 1} more shards" if len(files) > 1 else "") + " " + against
    shapes = [
        f"{n} is {list(tensors[n][1])} there, {list(shape)} by the config"
        for n, shape in expected.items()
        if n in tensors and tensors[n][1] != shape
    ]
    _refuse(label, "shapes differ", shapes, fix)
    renamed = not set(tensors) <= set(expected)
    missing = [
        group[0]
        for group in tied
        if not any(n in tensors for n in group) and (not renamed or _pattern(group[0]) in _patterns(tensors))
    ]
    _refuse(label, "tensors the model needs are missing (they would be randomly initialised)", missing, fix)
    untied = [" and ".join(g) for g in tied if sum(n in tensors for n in g) > 1]  # a tied save holds one name
    _refuse(label, "config.json ties tensors the weights hold apart (set tie_word_embeddings: false)", untied, fix)
    extra = [n for n in tensors if n not in expected and _pattern(n) in _patterns(expected)]
    _refuse(label, "tensors the model does not have (a bigger model's; they would be dropped)", extra, fix)


def _refuse(label: str, problem: str, found: list[str], fix: str) -> None:
    """One line for the first of `found` (the tensors at fault), if any."""
    if found:
        more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
        raise ConfigError(f"{label}: {problem}: {'; '.join(found[:_SHOWN])}{more}; {fix}.")


def _pattern(name: str) -> str:
    """A tensor's name with its layer numbers left out: `model.layers.#.mlp.up_proj.weight`."""
    return _LAYER_INDEX.sub(".#.", name)


def _patterns(names: Iterable[str]) -> set[str]:
    return {_pattern(n) for n in names}
