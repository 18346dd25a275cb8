"""`colograd/train.py` as users run it: one process from a recipe, and one-line errors for bad input.

The runs that train, and one refusal, run the script in a process of their own, as a user does (the one-process run
that trains and saves 2 steps is tests/runs/test_output_dir.py's first run, which the second-run refusals need anyway);
the other refusals run it in this process (`conftest.refused`), which checks the same line, exit code and absence
of a traceback, and also that no weights were read and no engine started.
"""

import json

import pytest
from conftest import ROOT, launch, refused, run_cli

TINY = str(ROOT / "recipes/grpo_tiny.yaml")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num_generations", "1", "--per_device_train_batch_size", "1"], "num_generations=1"),
        (["--per_device_train_batch_size", "12"], "per_device_train_batch_size=12"),
        (["--loss_type", "ppo"], "loss_type='ppo'"),
        (["--reward_funcs", "nope"], "reward_funcs: 'nope'"),
        (["--model_name_or_path", "./no/such/model"], "does not exist"),
        (["--model_name_or_path", "colograd:huge"], "built-in models"),
        (["--dataset_name", "colograd:nothing"], "built-in datasets"),
        (["--load_in_4bit"], "load_in_4bit"),
        (["--max_prompt_length", "500", "--max_completion_length", "100"], "exceeds the model's context of 512"),
        (["--vllm_max_model_length", "20"], "exceeds vllm_max_model_length=20"),
        (["--use_peft", "--lora_target_modules", "no_such_proj"], "lora_target_modules: "),
        (["--model_name_or_path", "no-such-org/no-such-model"], "'no-such-org/no-such-model' is not in the hub cache"),
    ],
)
def test_bad_input_is_one_line(flags, message, tmp_path):
    assert message in refused("--config", TINY, "--output_dir", str(tmp_path), *flags)


@pytest.mark.slow
def test_a_refusal_in_a_process_of_its_own_is_one_line(tmp_path):
    """What `refused` checks in this process holds for the script run as a user runs it (the libraries' own
    import-time output included)."""
    proc = run_cli("--config", TINY, "--output_dir", str(tmp_path), "--loss_type", "ppo")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[-1]], proc.stderr[-2000:]
    assert proc.stderr.startswith("colograd: error: loss_type='ppo'")


@pytest.mark.slow
def test_a_refusal_of_every_rank_of_a_launch_is_said_once(tmp_path):
    """Two ranks meet the same mistake at once: one line (whole, not run into the other rank's), exit code 2 in the
    launcher's report: the launcher stops rank 1 while it waits to say its line."""
    proc = launch("colograd/train.py", "--config", TINY, "--output_dir", str(tmp_path / "out"), "--num_generations",
                  "3", timeout=300)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if "colograd: error" in line]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert lines == [lines[0]] and lines[0].count("colograd: error") == 1, lines
    assert lines[0].startswith("colograd: error: per_device_train_batch_size=64"), lines


@pytest.mark.parametrize("local_rank", [None, "0", "-1", "abc", "1", "3"])
def test_local_rank_0_says_the_line_at_once_and_another_rank_after_a_wait(local_rank, monkeypatch, capsys):
    """Local rank 0, or a process outside a launch (a LOCAL_RANK that is not a rank is itself the mistake), says its
    line at once; another local rank says nothing before `SAID_WAIT_S`, in which a launcher stops it when rank 0
    failed too, then says its line: a mistake it meets alone is still seen. Every rank exits with the code."""
    from colograd import train

    waits = []
    monkeypatch.setattr(train.time, "sleep", lambda s: waits.append((s, capsys.readouterr().err)))
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(SystemExit) as exited:
        train._fail(ValueError("x\nmore"))
    assert exited.value.code == 2 and capsys.readouterr().err == "colograd: error: x\n"
    assert waits == ([(train.SAID_WAIT_S, "")] if local_rank in ("1", "3") else [])


def test_a_launch_variable_that_is_not_a_number_is_one_line(tmp_path):
    line = refused("--config", TINY, "--output_dir", str(tmp_path), env={"LOCAL_WORLD_SIZE": "two"})
    assert "LOCAL_WORLD_SIZE='two'" in line, line


def test_unknown_recipe_key_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(open(TINY).read() + "\nlearning_rat: 1.0\n")
    assert "learning_rat" in refused("--config", str(recipe), "--output_dir", str(tmp_path))


@pytest.mark.parametrize(
    "rows, message",
    [([{"question": "a>a:"}], "has no 'prompt' column"), ([], "is empty")],
    ids=["no-prompt-column", "empty"],
)
def test_bad_dataset_is_one_line(rows, message, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert message in refused("--config", TINY, "--output_dir", str(tmp_path), "--dataset_name", str(data))


@pytest.mark.slow
def test_long_prompts_are_cut_and_counted(tmp_path):
    # The tiny task's prompts are 7 characters; a limit of 3 keeps the last 3 tokens of every one.
    proc = run_cli("--config", TINY, "--max_steps", "1", "--max_prompt_length", "3", "--output_dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'prompts/truncated_ratio': '1'" in proc.stdout + proc.stderr
