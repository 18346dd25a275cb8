"""A TRL-format recipe (open-r1's GRPO demo) runs unchanged but for its model and dataset: 2 processes, the real
engine, two steps at tiny sizes given as flags; the same launch exercises TRL's generation, data and logging
options: the training split streamed, and logs to wandb (offline) and trackio (local), read back here."""

import json
import re
import sqlite3
import struct
from typing import Any
from unittest.mock import patch

import pytest
import torch
from conftest import ROOT, launch
from datasets import Dataset
from test_data import rank_batches, two_ranks
from trl import ModelConfig

from colograd import GRPOConfig, GRPOTrainer, ScriptArguments, train
from colograd.data.core import load_prompts
from colograd.data.streaming import rollout_stream
from colograd.engine.rollout import Rollout
from colograd.forward.batch import pad_rollout
from colograd.models import tiny
from colograd.runs.completions import first_of_each_prompt

RECIPE = ROOT / "tests/configs/open_r1_grpo_demo.yaml"
# Tiny sizes, no upload (the recipe pushes to the hub), and trackio beside the recipe's wandb, both kept local.
FLAGS = ["--report_to", "wandb", "trackio", "--push_to_hub", "false", "--max_steps", "2",
         "--per_device_train_batch_size", "4", "--num_generations", "4", "--gradient_accumulation_steps", "1",
         "--max_prompt_length", "384",
         "--max_completion_length", "16"]  # fmt: skip
# TRL options the recipe does not set, checked in the same launch.
OPTIONS = ["--min_p", "0.05", "--generation_kwargs", '{"stop": [";"]}', "--disable_dropout", "true",
           "--log_unique_prompts", "true", "--loss_type", "luspo", "--delta", "1.5",
           "--off_policy_mask_threshold", "0.5", "--vllm_structured_outputs_regex", "[abc]+;",
           # Evaluation on the file's one split, after each step.
           "--eval_strategy", "steps", "--eval_steps", "1", "--dataset_test_split", "train",
           "--num_generations_eval", "2", "--dataset_streaming", "true"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("open_r1")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(out), "TRACKIO_DIR": str(out / "trackio")}
    proc = launch("colograd/train.py", "--config", str(RECIPE), "--output_dir", str(out), *FLAGS, *OPTIONS, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc


def test_recipe_keeps_trl_and_open_r1_keys():
    keys = [line.split(":")[0] for line in RECIPE.read_text().splitlines() if line and not line.startswith((" ", "#"))]
    for key in ("use_vllm", "warmup_ratio", "torch_dtype", "overwrite_output_dir", "dataset_prompt_column"):
        assert key in keys  # TRL / open-r1 / transformers 4 keys, read as they are
    assert RECIPE.read_text().startswith("# accelerate launch")


@pytest.mark.slow
def test_recipe_trains_two_steps_with_its_rewards(run):
    out, proc = run
    state = json.loads((out / "checkpoint-2/trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2] and all(h["loss"] == h["loss"] for h in steps)  # not NaN
    for name in ("accuracy_reward", "format_reward", "tag_count_reward"):  # open-r1's functions' names
        assert all(f"rewards/{name}/mean" in h for h in steps)
    assert "warmup_ratio was renamed warmup_steps" in proc.stderr
    assert "rewards: accuracy is open-r1's accuracy" in proc.stderr and "format is open-r1's format" in proc.stderr


@pytest.mark.slow
def test_system_prompt_stop_strings_and_regex_reach_the_engine(run):
    out, _ = run
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt"][0]["role"] == "system" for r in rows)
    # A completion ends at the stop string (its token is kept, as TRL decodes the sampled ids), and matches the
    # structured-outputs regex (or a prefix of it, when cut at max_completion_length).
    assert all(re.fullmatch(r"[abc]*;?", r["completion"]) for r in rows)
    assert any(r["completion"].endswith(";") for r in rows)


@pytest.mark.slow
def test_evaluation_generates_scores_and_logs_trl_eval_metrics(run):
    out, _ = run
    state = json.loads((out / "checkpoint-2/trainer_state.json").read_text())
    evals = [h for h in state["log_history"] if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2]
    for entry in evals:
        for name in ("accuracy_reward", "format_reward", "tag_count_reward"):
            assert entry[f"eval_rewards/{name}/mean"] == entry[f"eval_rewards/{name}/mean"]  # present, not NaN
        assert 1 <= entry["eval_completions/min_length"] <= entry["eval_completions/mean_length"]
        assert entry["eval_completions/mean_length"] <= entry["eval_completions/max_length"] <= 16
        assert 0 <= entry["eval_completions/clipped_ratio"] <= 1
    # Training metrics were not mixed with evaluation's: one training entry per step, each with its own rewards.
    assert len([h for h in state["log_history"] if "loss" in h]) == 2


# --- options whose effect shows in the trainer's own stages, in this process (the engine replaced) -------------


def offline_trainer(tmp_path, model=None, tokenizer=None, **overrides) -> GRPOTrainer:
    """A `GRPOTrainer` built as a run builds it, on one process, with the engine replaced (no stage here uses it)."""
    args = tiny.run_config(str(tmp_path), steps=1, **overrides)
    with patch("colograd.trainer.Engine") as engine:
        engine.acquire.return_value.max_prompt_tokens = 512
        return GRPOTrainer(
            model or tiny.build_model(), "letters", args, Dataset.from_list(list(tiny.letters_dataset(8))),
            processing_class=tokenizer or tiny.build_tokenizer(),
        )  # fmt: skip


@pytest.mark.parametrize("disable", [False, True])
def test_disable_dropout_makes_the_training_forward_deterministic(tmp_path, disable):
    model = tiny.build_model()
    model.config.attention_dropout = 0.5  # Qwen2 applies it as a function, not as an nn.Dropout layer
    model = type(model)(model.config)
    trainer = offline_trainer(tmp_path, model, disable_dropout=disable)
    rollout = Rollout(completion_ids=[[9, 10, 11, 12]], logps=[[0.0] * 4], truncated=[True])
    batch = pad_rollout([[5, 6, 7, 8]], rollout, torch.zeros(1), 1, tiny.build_tokenizer().pad_token_id)
    model.eval()
    sampling_policy = trainer.completion_logps(model, batch)  # what the engine computes: no dropout
    model.train()  # as the Trainer trains
    torch.manual_seed(0)
    first, second = trainer.completion_logps(model, batch), trainer.completion_logps(model, batch)
    assert torch.equal(first, second) == disable
    assert torch.allclose(first, sampling_policy, atol=1e-6) == disable


def test_chat_template_kwargs_reach_the_template_of_every_rollout(tmp_path):
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template += "{% if enable_thinking is defined and not enable_thinking %}=;{% endif %}"
    rows = [{"prompt": [{"role": "user", "content": "ab>a"}], "target": "a"}]
    ids = {}
    for kwargs in (None, {"enable_thinking": True}, {"enable_thinking": False}):
        trainer = offline_trainer(tmp_path, tokenizer=tokenizer, chat_template_kwargs=kwargs)
        _, prompt_ids, _ = trainer.prepare_prompts(rows)
        ids[str(kwargs)] = tokenizer.decode(prompt_ids[0])
    assert ids["None"] == ids["{'enable_thinking': True}"] == "u:ab>a;a:"
    assert ids["{'enable_thinking': False}"] == "u:ab>a;a:=;"


@pytest.mark.slow
def test_reward_curve_and_completions_reach_wandb_offline_and_trackio(run):
    out, _ = run
    state = json.loads((out / "checkpoint-2/trainer_state.json").read_text())
    # The curves: the reward, and the mean length (which, unlike the tiny model's reward, varies by step).
    curves = {h["step"]: (h["reward"], h["completions/mean_length"]) for h in state["log_history"] if "loss" in h}
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    # log_unique_prompts: each step's table has one row per distinct prompt (1 prompt × 4 completions a rank).
    first = {row["step"]: row for row in reversed(completions)}
    expected = [[step, row["prompt"], row["completion"], row["advantage"]] for step, row in sorted(first.items())]
    # wandb (offline): the run's history, and the tables it wrote beside it.
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    history = wandb_history(next(run_dir.glob("*.wandb")))
    assert {h["train/global_step"]: curve(h, "train/") for h in history if "train/reward" in h} == curves
    tables = [
        json.loads((run_dir / "files" / h["completions"]["path"]).read_text()) for h in history if "completions" in h
    ]
    # TRL's table: the rewards (open-r1's, which log no extra columns, unlike TRL's accuracy_reward), the advantage.
    assert tables[0]["columns"] == ["step", "prompt", "completion", "accuracy_reward", "format_reward",
                                    "tag_count_reward", "advantage"]  # fmt: skip
    assert [[r[0], r[1], r[2], r[-1]] for t in tables for r in t["data"]] == expected
    # trackio (local): its database in TRACKIO_DIR.
    with sqlite3.connect(out / "trackio/huggingface.db") as db:
        logged = [json.loads(metrics) for (metrics,) in db.execute("SELECT metrics FROM metrics ORDER BY step")]
    assert {m["train/global_step"]: curve(m, "train/") for m in logged if "train/reward" in m} == curves
    rows = [r for m in logged if "completions" in m for r in m["completions"]["_value"]]
    assert [[r["step"], r["prompt"], r["completion"], r["advantage"]] for r in rows] == expected


def curve(logged: dict, prefix: str) -> tuple[float, float]:
    return logged[f"{prefix}reward"], logged[f"{prefix}completions/mean_length"]


def wandb_history(path) -> list[dict]:
    """The history records of an offline wandb run file: LevelDB-log blocks of 32 KiB after a 7-byte header,
    each record one or more chunks (7-byte header: checksum, length, type 1 whole / 2 first / 3 middle / 4 last)
    of a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, history = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                history.append(_nest({tuple(i.nested_key) or (i.key,): json.loads(i.value_json) for i in items}))
    return history


def _nest(flat: dict[tuple, Any]) -> dict:
    """wandb's items under nested keys (("completions", "path")) as nested dicts; others by their own key."""
    nested: dict = {}
    for key, value in flat.items():
        if len(key) == 1:
            nested[key[0]] = value
        else:
            nested.setdefault(key[0], {})["/".join(key[1:])] = value
    return nested


@pytest.mark.slow
def test_each_rank_trains_on_its_slice_of_the_streamed_split(run, tmp_path):
    out, _ = run
    parser = train._Parser((ScriptArguments, GRPOConfig, ModelConfig))
    argv = ["--config", str(RECIPE), *FLAGS, *OPTIONS, "--output_dir", str(tmp_path)]
    script_args, args, _ = parser.parse_args_and_config(argv)
    # What the 2 ranks read, by the pure simulation of the Trainer's dataloader (see tests/data/test_data.py).
    stream = rollout_stream(load_prompts(script_args, streaming=True), args, two_ranks())
    ranks = [rank_batches(stream, rank, 2, args.prompts_per_rollout) for rank in range(2)]
    assert all(set(map(str, a)).isdisjoint(map(str, b)) for a, b in zip(*ranks, strict=True))
    # The first rank logged its completions: whole groups (4 completions a prompt), of the prompts predicted.
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    predicted = [prompt for batch in ranks[0][:2] for prompt in batch for _ in range(4)]
    assert [row["prompt"] for row in logged] == predicted


@pytest.mark.parametrize("shuffle", [False, True])
def test_shuffle_dataset_false_keeps_the_dataset_order(tmp_path, shuffle):
    trainer = offline_trainer(tmp_path, shuffle_dataset=shuffle)  # 8 rows, one rollout of 8 prompts
    order = list(trainer._get_train_sampler())
    assert sorted(order) == list(range(8)) and (order == list(range(8))) == (not shuffle)


def test_log_unique_prompts_keeps_each_prompts_first_completion():
    chat = [{"role": "user", "content": "ab>a"}]
    prompts = [chat, chat, "x", "x", [{"role": "user", "content": "cd>d"}], "x", [dict(m) for m in chat]]
    assert first_of_each_prompt(prompts) == [0, 2, 4]  # a prompt repeated in another group is shown once, as in TRL
