"""`colograd/train.py` as users run it: one process from a recipe, and one-line errors for bad input."""

import json

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow  # each test runs colograd/train.py in a process of its own
TINY = "recipes/grpo_tiny.yaml"


def test_one_process_run_trains_and_saves(tmp_path):
    proc = run_cli("--config", TINY, "--max_steps", "2", "--output_dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer.json").exists()
    assert "`recipes/grpo_tiny.yaml`" in (tmp_path / "README.md").read_text()  # the model card
    assert "'reward':" in proc.stdout + proc.stderr  # per-step logs


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
        (["--model_name_or_path", "no-such-org/no-such-model"], "cannot be loaded"),
    ],
)
def test_bad_input_is_one_line(flags, message, tmp_path):
    proc = run_cli("--config", TINY, "--output_dir", str(tmp_path), *flags)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("colograd: error:") and message in last, proc.stderr[-2000:]


@pytest.mark.parametrize("line, message", [("num_generations: eight", "invalid int value: 'eight'"),
                                           ("learning_rate: fast", "invalid float value: 'fast'")])  # fmt: skip
def test_wrong_type_in_recipe_is_one_line(line, message, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(open(TINY).read() + f"\n{line}\n")
    proc = run_cli("--config", str(recipe), "--output_dir", str(tmp_path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert message in proc.stderr


def test_unknown_recipe_key_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(open(TINY).read() + "\nlearning_rat: 1.0\n")
    proc = run_cli("--config", str(recipe), "--output_dir", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "learning_rat" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "rows, message",
    [([{"question": "a>a:"}], "has no 'prompt' column"), ([], "is empty")],
    ids=["no-prompt-column", "empty"],
)
def test_bad_dataset_is_one_line(rows, message, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = run_cli("--config", TINY, "--output_dir", str(tmp_path), "--dataset_name", str(data))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("colograd: error:") and message in last, proc.stderr[-2000:]


def test_long_prompts_are_cut_and_counted(tmp_path):
    # The tiny task's prompts are 7 characters; a limit of 3 keeps the last 3 tokens of every one.
    proc = run_cli("--config", TINY, "--max_steps", "1", "--max_prompt_length", "3", "--output_dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'prompts/truncated_ratio': '1'" in proc.stdout + proc.stderr
