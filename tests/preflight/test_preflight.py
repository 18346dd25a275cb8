"""Preflight: generated bad inputs, each must end in exactly one line `colograd: error: ...` and exit code 2,
with no traceback, before any weights are read or any engine starts.

The bulk runs the command line's entry point in this process (hundreds of cases in seconds), with the model
loader and the engine replaced by functions that fail the test if called; a few cases run the real CLI.
Cases are generated with hypothesis (derandomized, so CI sees the same ones every time); `CASES` counts them
per class of input and is printed at the end of the module (`pytest -s`).
"""

import io
import json
import os
import sys
import uuid
from collections import Counter
from contextlib import redirect_stderr
from unittest.mock import patch

import pandas as pd
import pytest
import torch
from conftest import ROOT, refused, run_cli
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, Qwen2Config

from colograd import ScriptArguments, train
from colograd.config.core import ConfigError
from colograd.data.core import load_prompts
from colograd.models import tiny
from colograd.preflight.core import REWARD_ARGUMENTS, check_prompts
from colograd.rewards.names import BUILTIN_REWARDS

TINY = str(ROOT / "recipes/grpo_tiny.yaml")
NEED = 8  # the tiny recipe's rollout batch on one process: 64 completions / 8 per prompt
CASES: Counter = Counter()
SETTINGS = settings(
    max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
CHAT_TEMPLATE = (  # raises on '!', renders a message starting with '#' as nothing
    "{% for m in messages %}{% if '!' in m['content'] %}{{ raise_exception('no exclamations') }}{% endif %}"
    "{% if m['content'][:1] != '#' %}{{ m['role'][0] }}:{{ m['content'] }};{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module", autouse=True)
def work(tmp_path_factory):
    """A folder for generated files; `datasets` caches what it parses there, not in the user's cache."""
    import datasets

    folder = tmp_path_factory.mktemp("preflight")
    with patch.object(datasets.config, "HF_DATASETS_CACHE", str(folder / "cache")):
        yield folder
    print("\ngenerated cases per input class:", dict(sorted(CASES.items())), "total", sum(CASES.values()))


@pytest.fixture(scope="module")
def chat_model(work):
    """A model folder (config and tokenizer, no weights) whose tokenizer has `CHAT_TEMPLATE`."""
    return _model_folder(work / "chat-model", tiny.build_model().config, chat_template=CHAT_TEMPLATE)


def _model_folder(path, config, chat_template=None) -> str:
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = chat_template
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def cli_error(label: str, *flags: str, env: dict | None = None) -> str:
    """Run `colograd/train.py --config <tiny recipe> FLAGS` in this process and return its error line, checked as
    `conftest.refused` checks one; counted under `label`."""
    CASES[label] += 1
    return refused("--config", TINY, *flags, env=env)


def write(work, rows: list[dict], fmt: str = "jsonl") -> str:
    """Rows into a new file of format `fmt` (jsonl, json, csv, parquet)."""
    path = work / f"{uuid.uuid4().hex}.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    return str(path)


def letters(n: int = NEED) -> list[dict]:
    return [{"prompt": row["prompt"], "target": row["target"]} for row in tiny.letters_dataset(n)]


def messages(n: int = NEED) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}], "target": r["target"]} for r in letters(n)]


def out_dir(work) -> list[str]:
    return ["--output_dir", str(work / "out")]


# --- files that cannot be parsed ------------------------------------------------------------------------------


@SETTINGS
@given(line=st.integers(0, NEED - 1), junk=st.text(min_size=1, max_size=30))
def test_jsonl_line_that_is_not_an_object_is_named(work, line, junk):
    try:
        json.loads(junk)
        replacement = json.dumps([junk])  # valid JSON, but not an object
    except ValueError:
        replacement = junk.replace("\n", " ").replace("\r", " ")
    if not replacement.strip():
        replacement = "{"
    lines = [json.dumps(row) for row in letters()]
    lines[line] = replacement
    path = work / f"{uuid.uuid4().hex}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    message = cli_error("malformed jsonl line", *out_dir(work), "--dataset_name", str(path))
    assert str(path) in message and f"(line {line + 1}" in message


@SETTINGS
@given(cut=st.floats(0.0, 0.99))
def test_truncated_json_and_parquet_are_named(work, cut):
    for fmt in ("json", "parquet"):
        path = write(work, letters(), fmt)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: max(1, int(len(data) * cut))])
        message = cli_error(f"truncated {fmt}", *out_dir(work), "--dataset_name", path)
        assert path in message and "cannot be read" in message
        if fmt == "json":
            assert "(line 1)" in message


@SETTINGS
@given(line=st.integers(1, NEED - 1), extra=st.integers(1, 3))  # pandas reads a longer first row as an index
def test_csv_row_with_extra_fields_is_named(work, line, extra):
    path = write(work, letters(), "csv")
    lines = open(path).read().splitlines()
    lines[line + 1] += ",x" * extra
    open(path, "w").write("\n".join(lines) + "\n")
    message = cli_error("csv with extra fields", *out_dir(work), "--dataset_name", path)
    assert path in message and f"line {line + 2}" in message


@SETTINGS
@given(fmt=st.sampled_from(["jsonl", "json", "csv", "parquet"]), data=st.binary(min_size=1, max_size=200))
def test_random_bytes_in_any_format(work, fmt, data):
    path = work / f"{uuid.uuid4().hex}.{fmt}"
    path.write_bytes(data)
    cli_error(f"random bytes ({fmt})", *out_dir(work), "--dataset_name", str(path))


# --- rows: types and content ----------------------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.booleans())
WHITESPACE = st.text(alphabet=" \t\n\r\u00a0\u2003\u3000", max_size=6)
BAD_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.just("user")}),  # no content
    st.fixed_dictionaries({"content": st.just("ab")}),  # no role
    st.fixed_dictionaries({"role": st.one_of(st.integers(), st.just(""), st.just(" ")), "content": st.just("ab")}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(st.integers(), st.booleans())}),
    SCALARS.filter(lambda v: v is not None),  # a message that is not a dict
    st.text(max_size=5),
)
BAD_PROMPT = st.one_of(
    SCALARS,
    WHITESPACE,
    st.just([]),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just("ab")}),  # one message, not a list
    st.lists(BAD_MESSAGE, min_size=1, max_size=3),
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": WHITESPACE}), min_size=1, max_size=2),
)


@SETTINGS
@given(row=st.integers(0, NEED - 1), prompt=BAD_PROMPT, chat=st.booleans())
def test_bad_prompt_in_a_row_is_named(work, chat_model, row, prompt, chat):
    rows = messages() if chat else letters()
    rows[row]["prompt"] = prompt
    flags = ["--model_name_or_path", chat_model] if chat else []
    message = cli_error("bad prompt value", *out_dir(work), "--dataset_name", write(work, rows), *flags)
    # The first bad row is named: the one we broke, or (a text dataset given one row of messages) that row too.
    assert f"row {row}:" in message


@SETTINGS
@given(fmt=st.sampled_from(["jsonl", "csv", "parquet"]), value=st.one_of(st.integers(), st.booleans()))
def test_prompt_column_of_the_wrong_type(work, fmt, value):
    rows = [{"prompt": value, "target": "a"} for _ in range(NEED)]
    message = cli_error(f"prompt column of numbers ({fmt})", *out_dir(work), "--dataset_name", write(work, rows, fmt))
    assert "row 0: prompt is a" in message


@SETTINGS
@given(row=st.integers(1, NEED - 1), chat_first=st.booleans())
def test_text_and_chat_rows_mixed(work, chat_model, row, chat_first):
    rows = messages() if chat_first else letters()
    rows[row]["prompt"] = letters(1)[0]["prompt"] if chat_first else messages(1)[0]["prompt"]
    path = write(work, rows)
    message = cli_error(
        "text and chat rows mixed", *out_dir(work), "--dataset_name", path, "--model_name_or_path", chat_model
    )
    assert f"row {row}:" in message and "use one form for all rows" in message


@SETTINGS
@given(row=st.integers(0, NEED - 1), raising=st.booleans(), content=st.text(alphabet="abc ", min_size=1, max_size=8))
def test_template_that_raises_or_renders_nothing(work, chat_model, row, raising, content):
    rows = messages()
    if raising:
        rows[row]["prompt"] = [{"role": "user", "content": content + "!"}]
    else:
        rows[row]["prompt"] = [{"role": "user", "content": "#" + content}]
    path = write(work, rows)
    message = cli_error(
        "chat template fails", *out_dir(work), "--dataset_name", path, "--model_name_or_path", chat_model
    )
    expected = "no exclamations" if raising else "tokenizes to no tokens"
    assert f"row {row}:" in message and expected in message


def test_chat_prompts_without_a_chat_template(work):
    with torch.device("meta"):  # the architecture only
        config = tiny.build_model().config
    folder = _model_folder(work / "no-template", config, chat_template=None)
    flags = ["--model_name_or_path", folder, "--dataset_name", write(work, messages())]
    message = cli_error("no chat template", *out_dir(work), *flags)
    assert "row 0:" in message and "no chat template" in message


@SETTINGS
@given(column=st.sampled_from(REWARD_ARGUMENTS))
def test_column_named_like_a_reward_argument(work, column):
    rows = [{**row, column: 1} for row in letters()]
    message = cli_error("column clashes with a reward argument", *out_dir(work), "--dataset_name", write(work, rows))
    assert repr(column) in message


def test_invalid_rows_dropped_and_counted_when_asked(work, chat_model, capsys):
    rows = messages(NEED + 3)
    rows[2]["prompt"], rows[5]["prompt"] = "  ", [{"role": "user"}]
    rows[9]["prompt"] = [{"role": "user", "content": "#x"}]  # renders as nothing
    dataset = load_prompts(ScriptArguments(dataset_name=write(work, rows)))
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    with pytest.raises(ConfigError, match="row 2: prompt is empty"):
        check_prompts(dataset, tokenizer, "d")
    kept, _ = check_prompts(dataset, tokenizer, "d", drop_invalid=True)
    assert len(kept) == NEED and [r["target"] for r in kept] == [
        r["target"] for i, r in enumerate(rows) if i not in (2, 5, 9)
    ]
    assert "dropped 3 of 11 rows" in capsys.readouterr().out
    # Dropping that leaves less than a rollout batch is a size error, with the count.
    path = write(work, rows[: NEED - 1])  # rows 2 and 5 are invalid: 5 remain
    message = cli_error(
        "dropped below one batch",
        *out_dir(work),
        "--dataset_name",
        path,
        "--model_name_or_path",
        chat_model,
        "--drop_invalid_prompts",
        "true",
    )
    assert "has 5 usable rows" in message and f"{NEED} prompts" in message


# --- streamed datasets -----------------------------------------------------------------------------------------


def test_stream_without_max_steps(work):
    message = cli_error("stream without max_steps", *out_dir(work), "--dataset_streaming", "true", "--max_steps", "-1")
    assert "streamed dataset has no length" in message and "set max_steps" in message


@SETTINGS
@given(row=st.integers(0, NEED - 1), prompt=BAD_PROMPT)
def test_bad_prompt_in_the_first_rows_of_a_stream_is_named(work, row, prompt):
    rows = letters()
    rows[row]["prompt"] = prompt
    path = write(work, rows)
    message = cli_error(
        "stream: bad prompt value", *out_dir(work), "--dataset_name", path, "--dataset_streaming", "true"
    )
    assert f"(its first {NEED} rows)' row {row}:" in message or "cannot be read" in message


def test_resuming_a_stream_read_to_its_end_is_refused(work):
    checkpoint = work / f"checkpoint-{uuid.uuid4().hex[:6]}"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 30, "epoch": 2.5}))
    flags = ["--dataset_streaming", "true", "--resume_from_checkpoint", str(checkpoint)]
    assert "read to its end 2 time(s)" in cli_error("stream: resume after its end", *out_dir(work), *flags)


# --- sizes and lengths ----------------------------------------------------------------------------------------


@SETTINGS
@given(group=st.sampled_from([2, 4, 8]), prompts=st.integers(1, 8), steps=st.integers(1, 3), data=st.data())
def test_dataset_smaller_than_one_rollout_batch(work, group, prompts, steps, data):
    need = prompts * steps
    assume(need > 1)
    rows = data.draw(st.integers(1, need - 1))
    flags = ["--num_generations", str(group), "--per_device_train_batch_size", str(group * prompts)]
    flags += ["--steps_per_generation", str(steps), "--dataset_name", write(work, letters(rows))]
    message = cli_error("dataset smaller than a rollout", *out_dir(work), *flags)
    assert f"has {rows} usable rows" in message and f"{need} prompts" in message


@SETTINGS
@given(prompt=st.integers(1, 600), completion=st.integers(1, 600), engine=st.one_of(st.none(), st.integers(1, 2000)))
def test_lengths_that_do_not_fit(work, prompt, completion, engine):
    assume(prompt + completion > 512 or (engine is not None and not prompt + completion <= engine <= 512))
    flags = ["--max_prompt_length", str(prompt), "--max_completion_length", str(completion)]
    flags += ["--vllm_max_model_length", str(engine)] if engine is not None else []
    message = cli_error("lengths", *out_dir(work), *flags)
    assert "exceeds" in message


# --- sampling, engine, LoRA -----------------------------------------------------------------------------------


@SETTINGS
@given(
    setting=st.sampled_from(["temperature", "top_p", "repetition_penalty"]),
    data=st.data(),
)
def test_sampling_settings_out_of_range(work, setting, data):
    bad = {
        "temperature": st.one_of(st.floats(-100, 0), st.floats(2.001, 100)),
        "top_p": st.one_of(st.floats(-10, 0), st.floats(1.001, 10)),
        "repetition_penalty": st.floats(-10, 0),
    }[setting]
    value = data.draw(bad)
    message = cli_error(f"sampling: {setting}", *out_dir(work), f"--{setting}", repr(value))
    assert setting in message


@SETTINGS
@given(heads=st.integers(1, 8), head_dim=st.sampled_from([8, 16, 24, 40, 48, 56, 72, 100, 120, 136, 200]))
def test_unsupported_attention_head_size(work, heads, head_dim):
    config = Qwen2Config(
        vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
    )  # fmt: skip
    folder = _model_folder(work / f"heads-{heads}-{head_dim}", config)
    message = cli_error("attention head size", *out_dir(work), "--model_name_or_path", folder)
    assert f"head size is {head_dim}" in message


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_mixture_of_experts_models_the_cpu_engine_cannot_run_are_refused(work, kind):
    # vLLM's CPU expert kernel needs a hidden size that is a multiple of 32 (tests/models/test_moe.py: those it runs).
    from transformers import MixtralConfig, Qwen2MoeConfig

    sizes = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                 num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    config = (
        Qwen2MoeConfig(num_experts=4, **sizes) if kind == "qwen2_moe" else MixtralConfig(num_local_experts=4, **sizes)
    )
    folder = _model_folder(work / f"moe-{kind}", config)
    message = cli_error("Mixture-of-Experts", *out_dir(work), "--model_name_or_path", folder)
    assert f"model_type '{kind}' is a Mixture-of-Experts model (4 experts) of hidden size 48" in message
    assert "multiple of 32" in message


@SETTINGS
@given(rank=st.integers(513, 100_000))
def test_lora_rank_the_engine_cannot_serve(work, rank):
    # Ranks up to vLLM's largest are rounded up to a size it serves; above it nothing can serve the adapter.
    flags = ["--use_peft", "--lora_sync", "adapter", "--lora_r", str(rank)]
    message = cli_error("LoRA rank", *out_dir(work), *flags)
    assert f"LoRA rank {rank} is above the largest rank vLLM serves" in message


# --- rewards --------------------------------------------------------------------------------------------------

IDENTIFIER = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: s not in (*REWARD_ARGUMENTS, "prompt", "target", "kwargs") and not __import__("keyword").iskeyword(s)
)


@SETTINGS
@given(kind=st.sampled_from(["missing", "positional", "no-kwargs"]), name=IDENTIFIER)
def test_reward_function_parameters_that_do_not_match_the_columns(work, kind, name):
    source = {
        "missing": f"def reward(completions, {name}, **kwargs):\n    return [0.0] * len(completions)\n",
        "positional": f"def reward({name}, /, completions, **kwargs):\n    return [0.0] * len(completions)\n",
        "no-kwargs": f"def reward(completions, target, {name}=None):\n    return [0.0] * len(completions)\n",
    }[kind]
    module = f"rewards_{uuid.uuid4().hex}"
    (work / f"{module}.py").write_text(source)
    sys.path.insert(0, str(work))
    try:
        message = cli_error(f"reward signature: {kind}", *out_dir(work), "--reward_funcs", f"{module}.reward")
    finally:
        sys.path.remove(str(work))
    assert "reward function 'reward'" in message
    assert {"missing": repr(name), "positional": "positional-only", "no-kwargs": "**kwargs"}[kind] in message


@SETTINGS
@given(name=st.one_of(IDENTIFIER, st.from_regex(r"[a-z]+(\.[a-z]+){1,2}", fullmatch=True)))
def test_reward_functions_that_do_not_resolve(work, name):
    assume(name not in BUILTIN_REWARDS)
    message = cli_error("unresolvable reward", *out_dir(work), "--reward_funcs", name)
    assert "reward" in message


@SETTINGS
@given(modules=st.lists(IDENTIFIER, min_size=1, max_size=3))
def test_lora_target_modules_the_model_does_not_have(work, modules):
    assume(not {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} & set(modules))
    message = cli_error("LoRA target modules", *out_dir(work), "--use_peft", "--lora_target_modules", *modules)
    assert "lora_target_modules" in message


# --- where things go, and where they come from ----------------------------------------------------------------


@SETTINGS
@given(name=IDENTIFIER, depth=st.integers(0, 2))
def test_output_dir_that_cannot_be_written(work, name, depth):
    blocker = work / f"file-{uuid.uuid4().hex}"
    blocker.write_text("a file, not a folder")
    target = os.path.join(blocker, *[name] * depth)
    message = cli_error("output_dir not writable", "--output_dir", target)
    assert "output_dir=" in message and "cannot be written" in message


@SETTINGS
@given(state=st.sampled_from(["missing", "no-state", "truncated-state"]))
def test_resume_from_a_checkpoint_that_is_not_finished(work, state):
    checkpoint = work / f"checkpoint-{uuid.uuid4().hex[:6]}"
    if state != "missing":
        checkpoint.mkdir()
    if state == "truncated-state":
        (checkpoint / "trainer_state.json").write_text('{"global_step": 3, "log_hi')
    message = cli_error(f"resume: {state}", *out_dir(work), "--resume_from_checkpoint", str(checkpoint))
    assert "resume_from_checkpoint" in message


def test_resume_true_without_a_finished_checkpoint(work):
    empty = work / f"run-{uuid.uuid4().hex}"
    message = cli_error("resume: none in output_dir", "--output_dir", str(empty), "--resume_from_checkpoint", "true")
    assert "holds no finished" in message


@SETTINGS
@given(
    where=st.sampled_from(["missing file", "missing folder", "unknown extension", "empty file", "empty folder"]),
    name=IDENTIFIER,
)
def test_bad_dataset_paths(work, where, name):
    path = work / f"{uuid.uuid4().hex}-{name}"
    if where == "missing file":
        path = path.with_suffix(".jsonl")
    elif where == "missing folder":
        path = f"./{os.path.relpath(path, ROOT)}/"
    elif where == "unknown extension":
        path = path.with_suffix(".txt")
        path.write_text('{"prompt": "a"}\n')
    elif where == "empty file":
        path = path.with_suffix(".csv")
        path.write_text("")
    else:
        path.mkdir()
    message = cli_error(f"dataset path: {where}", *out_dir(work), "--dataset_name", str(path))
    assert str(path) in message


@SETTINGS
@given(name=IDENTIFIER)
def test_model_path_that_does_not_exist(work, name):
    message = cli_error("model path missing", *out_dir(work), "--model_name_or_path", f"./{name}/{uuid.uuid4().hex}")
    assert "does not exist" in message


@SETTINGS
@given(repo=st.one_of(st.just("a b"), st.just("x/y/z"), st.from_regex(r"[a-z]+--[a-z]+", fullmatch=True)))
def test_push_to_hub_settings_incomplete(work, repo):
    message = cli_error("push_to_hub: bad repository", *out_dir(work), "--push_to_hub", "--hub_model_id", repo,
                        env={"HF_HUB_OFFLINE": "0"})  # fmt: skip
    assert "hub_model_id" in message
    message = cli_error("push_to_hub: offline", *out_dir(work), "--push_to_hub", env={"HF_HUB_OFFLINE": "1"})
    assert "HF_HUB_OFFLINE" in message


@SETTINGS
@given(field=st.sampled_from(["num_generations", "max_steps", "max_completion_length", "seed"]),
       value=st.text(alphabet="abcxyz.-_ ", min_size=1, max_size=6).filter(lambda s: s.strip()))  # fmt: skip
def test_flags_of_the_wrong_type(work, field, value):
    assume(not value.strip().lstrip("-").isdigit())
    cli_error("flag of the wrong type", *out_dir(work), f"--{field}", value)


# --- the real command line ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "3"], "temperature must be in [0, 2]"),
        (["--dataset_name", "<rows:3>"], "has 3 usable rows, fewer than one rollout batch: 8 prompts"),
        (["--dataset_name", "<broken>"], "(line 2)"),
    ],
    ids=["sampling", "too-few-rows", "broken-file"],
)
@pytest.mark.slow
def test_cli_process(flags, message, tmp_path):
    if flags[-1] == "<rows:3>":
        flags[-1] = write(tmp_path, letters(3))
    elif flags[-1] == "<broken>":
        flags[-1] = str(tmp_path / "broken.jsonl")
        (tmp_path / "broken.jsonl").write_text('{"prompt": "ab>a:"}\n{"prompt": \n')
    proc = run_cli("--config", TINY, "--output_dir", str(tmp_path / "out"), *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colograd: error:") and message in lines[0], proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit):
        train.cli(["--config", TINY, "--output_dir", str(tmp_path), "--temperature", "3", "--debug"])
    assert "Traceback" in err.getvalue() and "VLLMValidationError" in err.getvalue()
    assert err.getvalue().splitlines()[-1].startswith("colograd: error:")


def test_trainer_checks_a_python_users_inputs_before_its_engine(tmp_path):
    from datasets import Dataset

    from colograd import GRPOTrainer

    args = tiny.run_config(str(tmp_path), steps=1)
    rows = letters()
    rows[3]["prompt"] = " "
    tokenizer = tiny.build_tokenizer()
    with patch("colograd.engine.core.Engine.acquire", side_effect=AssertionError("an engine was started")):
        with pytest.raises(ConfigError, match="row 3: prompt is empty"):
            GRPOTrainer(tiny.build_model(), "letters", args, Dataset.from_list(rows), processing_class=tokenizer)
        with pytest.raises(ConfigError, match="eval_dataset is a tokenizer"):
            GRPOTrainer(tiny.build_model(), "letters", args, Dataset.from_list(letters()), tokenizer)
        with pytest.raises(ConfigError, match="has 4 usable rows"):
            GRPOTrainer(tiny.build_model(), "letters", args, Dataset.from_list(letters(4)), processing_class=tokenizer)
        stream, endless = Dataset.from_list(letters()).to_iterable_dataset(), tiny.run_config(str(tmp_path), steps=-1)
        with pytest.raises(ConfigError, match="streamed dataset has no length"):
            GRPOTrainer(tiny.build_model(), "letters", endless, stream, processing_class=tokenizer)
        with pytest.raises(ConfigError, match=r"\(its first 8 rows\)' row 3: prompt is empty"):  # " ", as above
            GRPOTrainer(tiny.build_model(), "letters", args, Dataset.from_list(rows).to_iterable_dataset(),
                        processing_class=tokenizer)  # fmt: skip


def test_a_text_dataset_of_conversations_is_told_the_mapping_to_write():
    """LLaVA-Instruct / ShareGPT rows (a `conversations` column, no `prompt`) for a text model: one line that says so
    and gives the `dataset.map` building `prompt`, not datasets' own error about a missing column."""
    from datasets import Dataset

    rows = [{"conversations": [{"from": "human", "value": "what is 2+2?"}, {"from": "gpt", "value": "4"}]}]
    with pytest.raises(ConfigError) as err:
        check_prompts(Dataset.from_list(rows), tiny.build_tokenizer())
    assert "\n" not in str(err.value) and "'conversations' column and no 'prompt'" in str(err.value)
    assert "dataset.map(" in str(err.value) and "['value']" in str(err.value)


def test_models_built_on_the_meta_device_are_built_whole_under_zero3():
    """transformers' ZeRO-3 config is live once a DeepSpeed launch's arguments are parsed, and a model it partitions
    on the meta device fails ("Cannot copy out of meta tensor"): the LoRA target check refused every LoRA run under
    ZeRO-3 at start, the resume check every ZeRO-3 resume. Every meta-device build goes through `on_meta_device`."""
    from peft import LoraConfig
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from colograd.models import tiny
    from colograd.preflight.core import check_lora_targets

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    check_lora_targets(tiny.model_config(), LoraConfig(r=8, target_modules="all-linear"))
    assert is_deepspeed_zero3_enabled()  # the config active before stays active after
    del config
    builds = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "colograd").rglob("*.py"))
        for line in path.read_text().splitlines()
        if 'torch.device("meta")' in line and not line.lstrip().startswith("#")
    ]
    assert builds == ["colograd/models/model_files.py"]  # the one in `on_meta_device`


def test_head_sizes_set_per_layer_are_checked_layer_by_layer():
    """Gemma 4's config keeps its head sizes per layer (256 on sliding layers, `global_head_dim` 512 on global ones),
    and reading one global `head_dim` raises there: preflight ended in that traceback. Each layer's size is checked."""
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    from colograd.preflight.engine import _check_head_size, _head_sizes

    gemma4 = AutoConfig.for_model("gemma4_text")
    assert _head_sizes(gemma4) == [256, 512]
    _check_head_size(gemma4, current_platform)  # vLLM's CPU backend runs both
    with pytest.raises(ConfigError, match=r"head size is 200, which vLLM's CPU backend does not support"):
        _check_head_size(AutoConfig.for_model("gemma4_text", global_head_dim=200), current_platform)
