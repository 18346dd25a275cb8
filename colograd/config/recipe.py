"""The recipe file: read, parsed as YAML and each value checked against its field's type, before anything slow.

`colograd/train.py --config FILE` reads a recipe here rather than in TRL's parser, which lets a missing file, a
YAML syntax error, a repeated key or a value of the wrong shape (`num_generations: [8]`) escape as a traceback or
pass unnoticed until a library trips on it late. Every such mistake becomes a `ConfigError` of one line naming the
file (and line, or key) and the fix.

Values are converted as TRL's parser converts them, so a TRL recipe means the same here: text where a number or a
boolean goes is read as the command line reads it (PyYAML reads `1e-6` as text, which becomes the number 1e-6;
`"yes"` becomes true), and a single value where a list goes becomes a list of one (`reward_funcs: accuracy`, as
`--reward_funcs accuracy` is).
"""

import dataclasses
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from transformers.hf_argparser import string_to_bool

from colograd.errors import ConfigError

# Text fields whose values include true and false (`share_prompts: auto | true | false`, TRL's `scale_rewards: false`):
# YAML's boolean there is meant, and the field reads it.
TEXT_OR_BOOLEAN = {"share_prompts", "scale_rewards"}
_FIX_YAML = "indent with spaces, close every quote and bracket, and write each key as `key: value`"


def read_recipe(path: str) -> dict[str, Any]:
    """The mapping of a YAML recipe file.

    Args:
        path: the file given to `--config`.

    Returns:
        The recipe's keys and values, as YAML reads them.

    Raises:
        ConfigError: the file is missing, a folder, unreadable or not UTF-8; its YAML is malformed or sets a key
            twice; its top level is not a mapping with text keys.
    """
    file = Path(path)
    if file.is_dir():
        found = sorted(p.name for p in file.glob("*.yaml"))[:3]
        hint = f" such as {file / found[0]}" if found else ""
        raise ConfigError(f"--config {path} is a folder; give a YAML recipe file{hint}.")
    try:
        text = file.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file; give the path of a YAML recipe (see recipes/).") from None
    except OSError as err:
        raise ConfigError(f"--config {path} cannot be read ({err.strerror}); check its permissions.") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"--config {path} is not UTF-8 text (byte {err.object[err.start]:#x} at offset {err.start}); save it as "
            "UTF-8."
        ) from None
    try:
        recipe = _load(text, path)
    except yaml.MarkedYAMLError as err:
        raise ConfigError(_yaml_message(path, err)) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]}); {_FIX_YAML}.") from None
    if recipe is None:
        raise ConfigError(f"{path} is empty; a recipe sets keys such as `model_name_or_path: ...` (see recipes/).")
    if not isinstance(recipe, dict):
        raise ConfigError(
            f"{path}: the top level is {_kind(recipe)}, not a mapping; write one `key: value` per line at the left "
            "margin (see recipes/)."
        )
    for key in recipe:
        if not isinstance(key, str):
            raise ConfigError(
                f"{path}: the key {key!r} is {_kind(key)}; keys are field names such as num_generations."
            )
    return recipe


def _load(text: str, path: str) -> Any:
    """The YAML document in `text`, read by `_RecipeLoader` with `path` as the name its error marks carry."""
    loader = _RecipeLoader(text)
    loader.name = path
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key set twice in one mapping is an error (PyYAML keeps the last one, so
    the first would be ignored without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden, by design
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # the base class reports an unhashable key
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise ConfigError(
                    f"{key_node.start_mark.name}, line {line}: {key} is set twice (first on line {first_line[key]}); "
                    "keep one."
                )
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml_message(path: str, err: yaml.MarkedYAMLError) -> str:
    """One line for a YAML syntax error: where, what, where the construct it breaks began, and the fix."""
    mark = err.problem_mark or err.context_mark
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else path
    problem = (err.problem or "invalid YAML").replace("'\\t'", "a tab")
    if "\\t" in repr(err.problem) or "a tab" in problem:
        return f"{where}: a tab character; YAML indents with spaces only, so replace it with spaces."
    began = ""
    if err.context and err.context_mark and err.context_mark is not mark:
        began = f" ({err.context} that began on line {err.context_mark.line + 1})"
    return f"{where}: {problem}{began}; {_FIX_YAML}."


def check_recipe_value(path: str, key: str, value: Any, field_type: Any, default: Any) -> Any:
    """A recipe value as its field takes it, converted as TRL's parser converts it.

    Args:
        path: the recipe file, named in the message.
        key: the field name.
        value: what YAML read.
        field_type: the field's type hint (`int`, `float | None`, `list[str]`, ...).
        default: the field's default, shown as an example.

    Returns:
        The value, converted (text to a number or boolean, a single value to a list of one).

    Raises:
        ConfigError: the value cannot stand for the field: `num_generations: [8]`, `output_dir: {a: 1}`,
            `max_steps: 10.5`, `bf16: maybe`, an empty value for a field that needs one.
    """
    if key in TEXT_OR_BOOLEAN and isinstance(value, bool):
        return value
    try:
        return coerce(field_type, value)
    except _Mismatch:
        pass
    expected = describe(field_type)
    example = f", e.g. `{key}: {_yaml(default)}`" if default not in (None, dataclasses.MISSING) else ""
    if value is None:
        raise ConfigError(f"{path}: {key} is empty (null); give {expected}{example}, or remove the line.")
    hint = ""
    if isinstance(value, bool) and _accepts_text(field_type):
        hint = " (YAML reads an unquoted yes/no/on/off/true/false as a boolean: quote it)"
    raise ConfigError(f"{path}: {key}: {_yaml(value)} is {_kind(value)}{hint}; give {expected}{example}.")


class _Mismatch(Exception):
    """A value the type does not take."""


def coerce(field_type: Any, value: Any, convert: bool = True) -> Any:
    """`value` as a field of `field_type` takes it; raise `_Mismatch` where it cannot.

    Union members are tried first as they are (`int | str` keeps the text "8" as text), then with conversion.
    """
    origin = typing.get_origin(field_type)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(field_type)
        for strict in (True, False) if convert else (True,):
            for member in members:
                try:
                    return coerce(member, value, convert=not strict)
                except _Mismatch:
                    continue
        raise _Mismatch
    if field_type is type(None):
        if value is None:
            return None
        raise _Mismatch
    if field_type is Any or field_type is object:
        return value
    if origin is list or field_type is list:
        (item,) = typing.get_args(field_type) or (Any,)
        if isinstance(value, list):
            return [coerce(item, v, convert) for v in value]
        if convert and value is not None and not isinstance(value, dict):
            return [coerce(item, value, convert)]  # one value where a list goes: a list of one, as on the command line
        raise _Mismatch
    if origin is dict or field_type is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if origin is typing.Literal:
        if value in typing.get_args(field_type):
            return value
        raise _Mismatch
    return _scalar(field_type, value, convert)


def _scalar(field_type: Any, value: Any, convert: bool) -> Any:
    """A bool, int, float, str or enum field's value."""
    if field_type is bool:
        if isinstance(value, bool):
            return value
        if convert and isinstance(value, str):
            try:
                return string_to_bool(value)
            except Exception:  # noqa: BLE001 (argparse's ArgumentTypeError, message unused)
                raise _Mismatch from None
        raise _Mismatch
    if field_type is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _number(value) if convert else None
        if number is not None and math.isfinite(number) and float(number).is_integer():
            return int(number)
        raise _Mismatch
    if field_type is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        number = _number(value) if convert and isinstance(value, str) else None
        if number is not None:
            return number
        raise _Mismatch
    if field_type is str or (isinstance(field_type, type) and issubclass(field_type, enum.Enum)):
        if isinstance(value, str):
            return value
        if convert and isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # a number where text goes reads back the same (a revision, a config name)
        raise _Mismatch
    if isinstance(field_type, type):  # an object no YAML value is (accelerate's ParallelismConfig)
        if isinstance(value, field_type):
            return value
        raise _Mismatch
    return value  # a hint this stage does not read: left to the dataclass


def _number(value: Any) -> float | None:
    """The number a float (or text such as '1e-6', which YAML 1.1 reads as text) stands for, else None."""
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def describe(field_type: Any) -> str:
    """What a field of `field_type` takes, in words: 'a whole number', 'a list of text or null', ..."""
    origin = typing.get_origin(field_type)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(field_type) if m is not type(None)]
        words = " or ".join(dict.fromkeys(describe(m) for m in members))
        return words + (" or null" if len(members) < len(typing.get_args(field_type)) else "")
    if origin is list or field_type is list:
        (item,) = typing.get_args(field_type) or (Any,)
        plural = {"a whole number": "whole numbers", "a number": "numbers", "true or false": "booleans"}
        return f"a list of {plural.get(describe(item), describe(item))}" if item is not Any else "a list"
    if origin is dict or field_type is dict:
        return "a mapping (`{key: value}`)"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(field_type))
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}
    if isinstance(field_type, type) and issubclass(field_type, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in field_type)
    if field_type not in names and isinstance(field_type, type):
        return f"a {field_type.__name__} (set from Python)"
    return names.get(field_type, "a value")


def _accepts_text(field_type: Any) -> bool:
    """Whether `field_type` takes text (a quoted value), so a YAML boolean there was likely meant as text."""
    try:
        coerce(field_type, "text", convert=False)
    except _Mismatch:
        return False
    return True


def _kind(value: Any) -> str:
    """What a YAML value is, in words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {list: "a list", dict: "a mapping", str: "text", type(None): "empty"}.get(type(value), type(value).__name__)


def _yaml(value: Any) -> str:
    """`value` as it would be written in a recipe (flow style, one line)."""
    if isinstance(value, enum.Enum):
        value = value.value
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip().removesuffix("...").strip()
