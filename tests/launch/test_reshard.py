"""A run moves to another number of ranks: 2 → 1 → 2 under torchrun, the ranks' batches together kept (DDP). Each
relaunch resumes the newest checkpoint by itself, says that it moved, and trains on exactly the data the
uninterrupted 2-rank run trains at the same steps: sample by sample, no repeats, no skips. The dataset holds 4 steps'
prompts, so the last relaunch resumes in the second epoch, whose order is not the first's (`EpochOrder`).

(The decision and its refusals, on checkpoints written as the trainer writes them: tests/launch/test_relaunch.py;
partial rollouts' carried groups shared out among the ranks: tests/grpo/test_partial_rollouts.py.)
"""

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT, _env, _free_port

from colograd.models import tiny

FLAGS = [
    "colograd/train.py", "--config", "recipes/grpo_tiny.yaml", "--save_strategy", "steps", "--save_steps", "2",
    "--disable_tqdm", "true", "--reward_funcs", "tests.scripts.recording_reward.letters_recorded",
]  # fmt: skip
PER_RANK = 16  # completions per rank and micro-step on 2 ranks: 2 prompts of 8 completions each


def run(out: Path, ranks: int, max_steps: int, record: Path) -> str:
    """Train into `out` on `ranks` processes under torchrun up to `max_steps`, keeping all ranks' batch at
    2 × PER_RANK, on the 16 prompts of `out`'s parent's dataset; returns the launch's output."""
    record.mkdir(exist_ok=True)
    data = out.parent / "letters.jsonl"
    if not data.exists():
        tiny.letters_dataset(16).to_json(str(data))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_port", str(_free_port()), *FLAGS, "--max_steps", str(max_steps), "--dataset_name", str(data),
           "--per_device_train_batch_size", str(2 * PER_RANK // ranks), "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**_env(), "RECORD_DIR": str(record)},
                          timeout=600)  # fmt: skip
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


@pytest.mark.slow  # three torchrun launches
def test_a_run_moves_from_2_ranks_to_1_and_back_on_the_data_of_an_uninterrupted_run(tmp_path):
    run(tmp_path / "reference", 2, 6, tmp_path / "reference-record")
    reference = trained(tmp_path / "reference-record")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6] and all(sum(c.values()) == 2 * PER_RANK for c in reference.values())

    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(tmp_path / "reference" / "checkpoint-2", out / "checkpoint-2")  # saved on 2 ranks
    said = run(out, 1, 4, tmp_path / "record")
    assert f"colograd: note: {out / 'checkpoint-2'} was saved on 2 ranks and continues on 1" in said, said[-3000:]
    said = run(out, 2, 6, tmp_path / "record")
    assert f"colograd: note: {out / 'checkpoint-4'} was saved on 1 rank and continues on 2" in said, said[-3000:]

    trained_on = trained(tmp_path / "record")
    assert sorted(trained_on) == [3, 4, 5, 6]  # only the steps after each checkpoint, none twice
    for step in (3, 4, 5, 6):  # 5 and 6: the second epoch
        assert trained_on[step] == reference[step], step
    assert reference[5] != reference[1]  # the second epoch's order is its own
