"""A run moves to another number of ranks: 2 → 1 → 2, the ranks' batches together kept, under DDP (torchrun) and under
DeepSpeed ZeRO-3 (accelerate's launcher, the checkpoint loaded as DeepSpeed's universal checkpoint). Each relaunch
resumes the newest checkpoint by itself, says that it moved, and trains on exactly the data the uninterrupted 2-rank
run trains at the same steps: sample by sample, no repeats, no skips. The dataset holds 4 steps' prompts, so the last
relaunch resumes in the second epoch, whose order is not the first's (`EpochOrder`). The data's order is the
sampler's, whoever holds the model: one uninterrupted DDP run is the reference for both.

(The decision and its refusals, on checkpoints written as the trainer writes them: tests/launch/test_relaunch.py;
the conversion's refusals and DeepSpeed's shared step counts: tests/runs/test_universal.py; partial rollouts' carried
groups shared out among the ranks: tests/rollout/test_partial_rollouts.py.)
"""

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import ROOT, _env, _free_port

from colograd.models import tiny
from colograd.runs.checkpoints import is_complete

FLAGS = [
    "colograd/train.py", "--config", "recipes/grpo_tiny.yaml", "--save_strategy", "steps", "--save_steps", "2",
    "--disable_tqdm", "true", "--reward_funcs", "tests.scripts.recording_reward.letters_recorded",
]  # fmt: skip
ZERO3 = ROOT / "tests/configs/zero3_cpu.yaml"
PER_RANK = 16  # completions per rank and micro-step on 2 ranks: 2 prompts of 8 completions each


def run(out: Path, ranks: int, max_steps: int, record: Path, zero3: bool = False) -> str:
    """Train into `out` on `ranks` processes up to `max_steps` (under torchrun; `zero3`: accelerate's launcher with
    DeepSpeed ZeRO-3), keeping all ranks' batch at 2 × PER_RANK, on the 16 prompts of `out`'s parent's dataset;
    returns the launch's output."""
    record.mkdir(exist_ok=True)
    data = out.parent / "letters.jsonl"
    if not data.exists():
        tiny.letters_dataset(16).to_json(str(data))
    launcher = (
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3),
         "--num_processes", str(ranks), "--main_process_port", str(_free_port())]
        if zero3
        else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
              "--master_port", str(_free_port())]
    )  # fmt: skip
    cmd = [*launcher, *FLAGS, "--max_steps", str(max_steps), "--dataset_name", str(data),
           "--per_device_train_batch_size", str(2 * PER_RANK // ranks), "--output_dir", str(out)]  # fmt: skip
    env = {**_env(), "RECORD_DIR": str(record), **({"DS_ACCELERATOR": "cpu"} if zero3 else {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def trained(record: Path) -> dict[int, Counter]:
    """Every step's prompts over all ranks, as a multiset of (prompt, completions of it)."""
    steps: dict[int, Counter] = {}
    for path in record.glob("rank-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            steps.setdefault(entry["step"], Counter()).update(entry["prompts"])
    return steps


def adam_steps(checkpoint: Path) -> set[float]:
    """The step counts in a ZeRO-3 checkpoint's optimizer state, over every rank's file and parameter group."""
    steps = set()
    for path in checkpoint.glob("global_step*/*optim_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        steps |= {float(group["step"]) for group in state["optimizer_state_dict"]["state"].values()}
    return steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[int, Counter]]:
    """The uninterrupted 2-rank DDP run of 6 steps (its folder, and its data by step)."""
    folder = tmp_path_factory.mktemp("reshard")
    run(folder / "reference", 2, 6, folder / "reference-record")
    steps = trained(folder / "reference-record")
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and all(sum(c.values()) == 2 * PER_RANK for c in steps.values())
    assert steps[5] != steps[1]  # the second epoch's order is its own
    return folder / "reference", steps


@pytest.mark.slow  # three torchrun launches
def test_a_run_moves_from_2_ranks_to_1_and_back_on_the_data_of_an_uninterrupted_run(tmp_path, reference):
    folder, steps = reference
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(folder / "checkpoint-2", out / "checkpoint-2")  # saved on 2 ranks
    said = run(out, 1, 4, tmp_path / "record")
    assert f"colograd: note: {out / 'checkpoint-2'} was saved on 2 ranks and continues on 1" in said, said[-3000:]
    said = run(out, 2, 6, tmp_path / "record")
    assert f"colograd: note: {out / 'checkpoint-4'} was saved on 1 rank and continues on 2" in said, said[-3000:]

    trained_on = trained(tmp_path / "record")
    assert sorted(trained_on) == [3, 4, 5, 6]  # only the steps after each checkpoint, none twice
    for step in (3, 4, 5, 6):  # 5 and 6: the second epoch
        assert trained_on[step] == steps[step], step


@pytest.mark.slow  # three launches under DeepSpeed
def test_a_zero3_run_moves_from_2_ranks_to_1_and_back_as_its_universal_checkpoint(tmp_path, reference):
    _, steps = reference
    out, record = tmp_path / "out", tmp_path / "record"
    run(out, 2, 2, record, zero3=True)
    said = run(out, 1, 4, record, zero3=True)
    note = f"colograd: note: {out / 'checkpoint-2'} was saved on 2 ranks and continues on 1 (as DeepSpeed's universal"
    assert note in said, said[-3000:]
    said = run(out, 2, 6, record, zero3=True)
    assert f"colograd: note: {out / 'checkpoint-4'} was saved on 1 rank and continues on 2" in said, said[-3000:]

    trained_on = trained(record)
    assert sorted(trained_on) == [1, 2, 3, 4, 5, 6]
    for step in trained_on:
        assert trained_on[step] == steps[step], step
    # The optimizer continued: Adam counted each step once, in every parameter group (a fresh optimizer counts 2 at
    # checkpoint-4, DeepSpeed's shared step tensors 6), and the learning-rate schedule went on from its step.
    assert adam_steps(out / "checkpoint-2") == {2.0}
    assert adam_steps(out / "checkpoint-4") == {4.0}
    assert adam_steps(out / "checkpoint-6") == {6.0}
    logged = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    expected = json.loads((reference[0] / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    rates = lambda history: [e["learning_rate"] for e in history if "learning_rate" in e]  # noqa: E731
    assert rates(logged) == rates(expected) and len(rates(expected)) == 6
    # The conversion sits beside the checkpoint, which stays finished and is unchanged
    assert (out / "checkpoint-2" / "latest_universal").read_text() == "global_step2_universal"
    assert is_complete(str(out / "checkpoint-2")) and is_complete(str(out / "checkpoint-4"))
