"""Bad recipes end in one line before anything slow: the file itself, values of the wrong shape, numbers out of range.

Each test runs the command line in-process with `main` replaced, so reaching it (that is, passing the checks)
fails the test; nothing loads a model or starts an engine.
"""

import dataclasses
import math
from pathlib import Path

import pytest
from trl import ModelConfig

import colograd.train
from colograd import GRPOConfig, ScriptArguments
from colograd.config.core import ConfigError
from colograd.config.ranges import RANGES, TRL_ONLY, check_ranges, numeric_fields
from colograd.config.recipe import read_recipe
from colograd.train import _Parser

ROOT = Path(__file__).resolve().parents[2]
TINY = (ROOT / "recipes/grpo_tiny.yaml").read_text()
PARSER = _Parser((ScriptArguments, GRPOConfig, ModelConfig))


@pytest.fixture
def cli(monkeypatch, capsys, tmp_path):
    """Run `colograd.train.cli(argv)`; return (exit code, stderr lines). Reaching `main` fails the test."""

    def never(*args, **kwargs):
        raise AssertionError("the bad input reached main: it was not caught before start-up")

    monkeypatch.setattr(colograd.train, "main", never)

    def run(argv: list[str]) -> tuple[int, list[str]]:
        with pytest.raises(SystemExit) as stop:
            colograd.train.cli([*argv, "--output_dir", str(tmp_path / "out")])
        return stop.value.code, capsys.readouterr().err.splitlines()

    return run


def recipe(tmp_path: Path, text: str | bytes, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def assert_one_line(code: int, lines: list[str], *parts: str) -> None:
    assert code == 2
    errors = [line for line in lines if line.startswith("colograd: error: ")]
    assert len(errors) == 1 and errors == lines[-1:], lines
    for part in parts:
        assert part in errors[0], errors[0]


# --- the file itself ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, parts",
    [
        (b"", ["is empty"]),
        (b"# only a comment\n", ["is empty"]),
        (b"- a\n- b\n", ["top level is a list, not a mapping"]),
        (b"just text\n", ["top level is text, not a mapping"]),
        (b"42\n", ["top level is a number"]),
        (b"\xff\xfebad\n", ["not UTF-8", "save it as UTF-8"]),
        (b"reward_funcs:\n\t- letters\n", ["line 2, column 1", "a tab character", "spaces"]),
        (b"max_steps: 1\nnum_generations:\t8\n", ["line 2, column 17", "a tab character"]),
        (b'save_strategy: "no\nmax_steps: 1\n', ["quoted scalar that began on line 1", "close every quote"]),
        (b"report_to: [none\n", ["flow sequence that began on line 1", "close every quote and bracket"]),
        (b"report_to: {a: 1\n", ["line 2", "close every quote and bracket"]),
        (b"max_steps: 1\n  seed: 2\n", ["line 2"]),
        (b"max_steps: 1\nseed: 2\nmax_steps: 3\n", ["line 3: max_steps is set twice (first on line 1); keep one"]),
        (b"1: 2\n", ["the key 1 is a number"]),
        (b"env: [A]\n", ["env is not a mapping"]),
    ],
)
def test_a_broken_recipe_file_is_one_line_naming_it(cli, tmp_path, text, parts):
    path = recipe(tmp_path, text)
    assert_one_line(*cli(["--config", path]), path, *parts)


def test_a_missing_recipe_or_a_folder_is_named(cli, tmp_path):
    assert_one_line(*cli(["--config", str(tmp_path / "nope.yaml")]), "nope.yaml: no such file")
    recipe(tmp_path, TINY, "tiny.yaml")
    assert_one_line(*cli(["--config", str(tmp_path)]), "is a folder", "tiny.yaml")
    assert_one_line(*cli(["--config"]), "--config needs a value")


def test_an_unreadable_recipe_is_named(cli, tmp_path, monkeypatch):
    path = recipe(tmp_path, TINY)

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)  # chmod does not stop root, which tests may run as
    assert_one_line(*cli(["--config", path]), path, "cannot be read (Permission denied)")


def test_config_equals_path_reads_the_recipe(tmp_path):
    path = recipe(tmp_path, TINY.replace("max_steps: 100", "max_steps: 7"))
    _, args, _ = PARSER.parse_args_and_config([f"--config={path}"])
    assert args.max_steps == 7


def test_a_yaml_merge_key_may_be_overridden(tmp_path):
    text = "base: &b {max_steps: 3, seed: 5}\n"  # not a field: only the merge matters
    loaded = read_recipe(recipe(tmp_path, text + "other:\n  <<: *b\n  seed: 6\n"))
    assert loaded["other"] == {"max_steps": 3, "seed": 6}


# --- values of the wrong type or shape ------------------------------------------------------------------------


def _wrong_value(name: str) -> object:
    """A value no field of this name takes: a mapping, or a list of lists where mappings are taken."""
    field_type, _ = PARSER._fields[name]
    takes_mapping = "dict" in str(field_type)
    return [[1]] if takes_mapping else {"wrong": 1}


# Fields whose types take anything (transformers' `Any`-typed ones): nothing is wrong for them.
UNTYPED = {name for name, (field_type, _) in PARSER._fields.items() if str(field_type) in ("typing.Any",)}


@pytest.mark.parametrize("name", sorted(set(PARSER._fields) - UNTYPED))
def test_every_field_refuses_a_value_of_the_wrong_shape(cli, tmp_path, name):
    """Generated: for each field of the three dataclasses, a recipe giving it a value of the wrong shape."""
    import yaml

    lines = [line for line in TINY.splitlines() if not line.startswith(f"{name}:")]
    text = "\n".join(lines) + f"\n{name}: " + yaml.safe_dump(_wrong_value(name), default_flow_style=True)
    path = recipe(tmp_path, text)
    assert_one_line(*cli(["--config", path]), path, f"{name}: ", "; give ")


@pytest.mark.parametrize(
    "line, message",
    [
        ('num_generations: "eight"', "num_generations: eight is text; give a whole number, e.g. `num_generations: 8`"),
        ("num_generations: [8]", "num_generations: [8] is a list; give a whole number"),
        ("num_generations:", "num_generations is empty (null); give a whole number"),
        ("max_steps: 10.5", "max_steps: 10.5 is a number; give a whole number"),
        ("temperature: true", "temperature: true is a boolean; give a number"),
        ("output_dir: {a: 1}", "output_dir: {a: 1} is a mapping; give text or null"),
        ("bf16: maybe", "bf16: maybe is text; give true or false"),
        ("reward_funcs: {letters: 1}", "reward_funcs: {letters: 1} is a mapping; give a list of text"),
        ("reward_weights: [a, b]", "reward_weights: [a, b] is a list; give a list of numbers or null"),
        ("save_strategy: no", "save_strategy: false is a boolean (YAML reads an unquoted yes/no"),
    ],
)
def test_wrong_shapes_are_named_with_the_fix(cli, tmp_path, line, message):
    key = line.split(":")[0]
    text = "\n".join(row for row in TINY.splitlines() if not row.startswith(f"{key}:")) + "\n" + line + "\n"
    assert_one_line(*cli(["--config", recipe(tmp_path, text)]), message)


@pytest.mark.parametrize(
    "line, name, value",
    [
        ("learning_rate: 1e-6", "learning_rate", 1e-6),  # YAML 1.1 reads 1e-6 as text; TRL's parser as a number
        ("log_completions: 'yes'", "log_completions", True),  # text where a boolean goes: read as a flag is
        ("reward_funcs: letters", "reward_funcs", ["letters"]),  # one value where a list goes: --reward_funcs x
        ("reward_weights: 0.5", "reward_weights", [0.5]),
        ("max_steps: 20.0", "max_steps", 20),
        ("dataset_config: 2023", "dataset_config", "2023"),  # a number where text goes reads back the same
        ("num_generations: '4'", "num_generations", 4),
        ("share_prompts: false", "share_prompts", False),  # a text field whose values include true and false
    ],
)
def test_values_convert_as_trls_parser_converts_them(tmp_path, line, name, value):
    key = line.split(":")[0]
    text = "\n".join(row for row in TINY.splitlines() if not row.startswith(f"{key}:")) + "\n" + line + "\n"
    parsed = PARSER.parse_args_and_config(["--config", recipe(tmp_path, text)])
    got = next(getattr(obj, name) for obj in parsed if hasattr(obj, name))
    assert got == value and type(got) is type(value)


# --- numbers out of range --------------------------------------------------------------------------------------


def _all_numeric_fields() -> list[str]:
    """Every numeric field of GRPOConfig and ScriptArguments, and those of ModelConfig colograd reads (LoRA)."""
    names = [f.name for cls in (GRPOConfig, ScriptArguments, ModelConfig) for f, *_ in numeric_fields(cls)]
    return sorted(set(names))


@pytest.mark.parametrize("name", _all_numeric_fields())
def test_every_numeric_field_declares_its_range(name):
    """A numeric field added later (by colograd, TRL or transformers) fails here until RANGES declares it."""
    assert name in RANGES, f"{name}: declare its range in colograd/config/ranges.py RANGES"


def _out_of_range(name: str) -> list[float]:
    """Values just outside the declared range of `name`, of its kind, and NaN for float fields."""
    declared = RANGES[name]
    classes = (GRPOConfig, ScriptArguments, ModelConfig)
    kind = next(k for cls in classes for f, k, *_ in numeric_fields(cls) if f.name == name)
    step = 1 if kind is int else 0.5
    values = []
    if not math.isinf(declared.low):
        values.append(declared.low if declared.low_open else declared.low - step)
    if not math.isinf(declared.high):
        values.append(declared.high if declared.high_open else declared.high + step)
    values = [kind(v) for v in values if v not in declared.special]
    if declared.special:
        values.append(kind(min(declared.special) - step))
    return values + ([math.nan, math.inf] if kind is float else [])


CHECKED = sorted(name for name in RANGES if RANGES[name] not in (TRL_ONLY,) and name in _all_numeric_fields())
MODEL_FIELDS = {f.name for f, *_ in numeric_fields(ModelConfig)}
SCRIPT_FIELDS = {f.name for f, *_ in numeric_fields(ScriptArguments)}
LIST_FIELDS = {f.name for f, _, _, is_list in numeric_fields(GRPOConfig) if is_list}


def _build(name: str, value: object) -> None:
    """The dataclass holding `name`, built with `value` (and a valid rest)."""
    if name in MODEL_FIELDS:
        check_ranges(ModelConfig(model_name_or_path="x", **{name: value}))
        return
    if name in SCRIPT_FIELDS:  # checked when built, as GRPOConfig is
        ScriptArguments(**{name: value})
        return
    base = {"output_dir": "unused", "report_to": "none", "per_device_train_batch_size": 8, "num_generations": 4}
    if RANGES[name].when:  # an interval is read only under its "steps" strategy
        base[RANGES[name].when] = "steps"
    GRPOConfig(**{**base, name: value})


@pytest.mark.parametrize("name, value", [(name, value) for name in CHECKED for value in _out_of_range(name)], ids=str)
def test_every_out_of_range_value_is_one_line_naming_the_field(name, value):
    """Generated: for each field with a bounded range, the values just past each bound (and NaN, infinity)."""
    with pytest.raises(ConfigError) as err:
        _build(name, [1.0, value] if name in LIST_FIELDS else value)
    message = str(err.value)
    assert message.startswith(f"{name}=") and "\n" not in message and "set it to" in message


@pytest.mark.parametrize("name", CHECKED)
@pytest.mark.parametrize("value", ["8", [8], True], ids=["text", "list", "boolean"])
def test_a_value_of_the_wrong_kind_is_refused_in_python_too(name, value):
    if name == "reward_weights" and value == [8]:
        return  # a list of one weight is right there
    with pytest.raises(ConfigError, match=f"^{name}="):
        _build(name, value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_steps": -1},  # train for num_train_epochs (transformers)
        {"top_k": -1},  # vLLM's "disabled"
        {"top_k": 0},  # TRL's "disabled"
        {"save_steps": 0.25, "logging_steps": 0.1, "eval_steps": 0.5, "warmup_steps": 0.1},  # ratios of the steps
        {"save_total_limit": 0},  # keeps every checkpoint
        {"save_strategy": "no", "save_steps": 0, "eval_steps": -1},  # intervals of strategies that are off
        {"learning_rate": 0.0, "beta": 0.0, "epsilon": 0.0, "max_grad_norm": 0.0},
        {"top_p": 1.0, "min_p": 0.0, "temperature": 1e-3},
        {"vllm_gpu_memory_utilization": 1.0, "num_generations": 2},
        {"entropy_coef": -0.01, "reward_weights": [1.0, -0.5]},  # a penalty and a negative weight are meanings
    ],
)
def test_trls_special_values_stay_valid(kwargs):
    base = {"output_dir": "unused", "report_to": "none", "per_device_train_batch_size": 8, "num_generations": 4}
    GRPOConfig(**{**base, **kwargs})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learning_rate", "-1e-5"], "learning_rate=-1e-05: set it to 0 or more."),
        (["--top_p", "1.5"], "top_p=1.5: set it to a value in (0, 1]."),
        (["--max_steps", "-5"], "max_steps=-5: set it to 1 or more, or -1 (-1 trains for num_train_epochs)."),
        (["--use_peft", "true", "--lora_r", "0"], "lora_r=0: set it to 1 or more."),
        (["--temperature", "0"], "temperature=0.0: set it to a value above 0"),
    ],
)
def test_out_of_range_flags_end_before_start_up(cli, argv, message):
    assert_one_line(*cli(["--config", str(ROOT / "recipes/grpo_tiny.yaml"), *argv]), message)


def test_ranges_name_only_fields_that_exist():
    assert set(RANGES) <= set(_all_numeric_fields()) | {f.name for f in dataclasses.fields(ModelConfig)}
