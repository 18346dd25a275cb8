"""A TRL-format recipe (open-r1's GRPO demo) runs unchanged but for its model and dataset: 2 processes, the real
engine, two steps at tiny sizes given as flags; the same launch exercises TRL's generation and logging options."""

import json
import re

import pytest
from conftest import ROOT, launch

RECIPE = ROOT / "tests/configs/open_r1_grpo_demo.yaml"
# Tiny sizes, and no upload or tracker (the recipe pushes to the hub and reports to wandb).
FLAGS = ["--report_to", "none", "--push_to_hub", "false", "--max_steps", "2", "--per_device_train_batch_size", "4",
         "--num_generations", "4", "--gradient_accumulation_steps", "1", "--max_prompt_length", "384",
         "--max_completion_length", "16"]  # fmt: skip
# TRL options the recipe does not set, checked in the same launch.
OPTIONS = ["--min_p", "0.05", "--generation_kwargs", '{"stop": [";"]}', "--disable_dropout", "true",
           "--log_unique_prompts", "true", "--loss_type", "luspo", "--delta", "1.5",
           "--off_policy_mask_threshold", "0.5", "--vllm_structured_outputs_regex", "[abc]+;",
           # Evaluation on the file's one split, after each step.
           "--eval_strategy", "steps", "--eval_steps", "1", "--dataset_test_split", "train",
           "--num_generations_eval", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("open_r1")
    proc = launch("colograd/train.py", "--config", str(RECIPE), "--output_dir", str(out), *FLAGS, *OPTIONS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc


def test_recipe_keeps_trl_and_open_r1_keys():
    keys = [line.split(":")[0] for line in RECIPE.read_text().splitlines() if line and not line.startswith((" ", "#"))]
    for key in ("use_vllm", "warmup_ratio", "torch_dtype", "overwrite_output_dir", "dataset_prompt_column"):
        assert key in keys  # TRL / open-r1 / transformers 4 keys, read as they are
    assert RECIPE.read_text().startswith("# accelerate launch")


def test_recipe_trains_two_steps_with_its_rewards(run):
    out, proc = run
    state = json.loads((out / "checkpoint-2/trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2] and all(h["loss"] == h["loss"] for h in steps)  # not NaN
    for name in ("accuracy_reward", "think_format_reward", "tag_count_reward"):
        assert all(f"rewards/{name}/mean" in h for h in steps)
    assert "warmup_ratio was renamed warmup_steps" in proc.stderr


def test_system_prompt_stop_strings_and_regex_reach_the_engine(run):
    out, _ = run
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt"][0]["role"] == "system" for r in rows)
    # A completion ends at the stop string (its token is kept, as TRL decodes the sampled ids), and matches the
    # structured-outputs regex (or a prefix of it, when cut at max_completion_length).
    assert all(re.fullmatch(r"[abc]*;?", r["completion"]) for r in rows)
    assert any(r["completion"].endswith(";") for r in rows)


def test_evaluation_generates_scores_and_logs_trl_eval_metrics(run):
    out, _ = run
    state = json.loads((out / "checkpoint-2/trainer_state.json").read_text())
    evals = [h for h in state["log_history"] if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2]
    for entry in evals:
        for name in ("accuracy_reward", "think_format_reward", "tag_count_reward"):
            assert entry[f"eval_rewards/{name}/mean"] == entry[f"eval_rewards/{name}/mean"]  # present, not NaN
        assert 1 <= entry["eval_completions/min_length"] <= entry["eval_completions/mean_length"]
        assert entry["eval_completions/mean_length"] <= entry["eval_completions/max_length"] <= 16
        assert 0 <= entry["eval_completions/clipped_ratio"] <= 1
    # Training metrics were not mixed with evaluation's: one training entry per step, each with its own rewards.
    assert len([h for h in state["log_history"] if "loss" in h]) == 2
