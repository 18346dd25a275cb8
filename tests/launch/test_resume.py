"""Checkpoints, resume and what a run leaves in output_dir, through `colograd/train.py` on 2 processes.

One uninterrupted 6-step run saves at steps 3 and 6. A second run of the same command is SIGKILLed (one worker)
during step 4, once its step-3 checkpoint is finished, and relaunched with the same command, next to an interrupted
save of step 6: it resumes from step 3 by itself and must reproduce steps 4-6 and the weights, bit for bit. The same
two runs are checked for the model card, the tensorboard event files and the completions log.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, _env, launch, launch_command, worker
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from colograd.runs.checkpoints import is_complete

pytestmark = pytest.mark.slow  # multi-process launches with engines
# The reward hangs from the step HANG_AT_STEP names, where it is set: the killed run is stopped mid-step by it.
FLAGS = [
    "colograd/train.py", "--config", "recipes/grpo_tiny.yaml", "--max_steps", "6", "--save_strategy", "steps",
    "--save_steps", "3", "--disable_tqdm", "true", "--report_to", "tensorboard", "--log_completions", "true",
    "--log_completions_steps", "2", "--num_completions_to_print", "2", "--reward_funcs",
    "tests.scripts.hanging_reward.letters_or_hang", "--reward_sigterm_wait", "1",
]  # fmt: skip
# The same weights and the same restored RNG state give the same samples, so rewards match exactly;
# losses come out of float reductions and are compared to within rounding.
EXACT = ["reward", "reward_std", "rewards/letters_or_hang/mean", "completions/mean_length", "frac_reward_zero_std"]
CLOSE = ["loss", "grad_norm"]


def start(cmd: list[str], log: Path, hang_at_step: str = "") -> subprocess.Popen:
    """Start `cmd` in a session of its own, its output appended to `log`; its reward hangs from `hang_at_step` on."""
    env = {**_env(), "HANG_AT_STEP": hang_at_step, "HANG_MARKER": str(log.with_suffix(".hung"))}
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def killed_and_relaunched(cmd: list[str], out: Path, log: Path) -> tuple[int, int]:
    """Run `cmd` until its reward hangs at step 4 (checkpoint-3 finished), SIGKILL its rank 1, then run `cmd` again
    with nothing changed but a save of step 6 cut short beside it; the exit codes of both."""
    proc = start(cmd, log, hang_at_step="4")
    deadline = time.monotonic() + 400
    while not log.with_suffix(".hung").exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
    assert is_complete(str(out / "checkpoint-3"))
    os.kill(worker(proc.pid, rank=1), signal.SIGKILL)
    killed = proc.wait(timeout=300)
    # A save of step 6 that was cut short: weights half-written, no trainer_state.json. It must be skipped.
    (out / "checkpoint-6").mkdir()
    (out / "checkpoint-6/model.safetensors").write_bytes(b"\0" * 100)
    return killed, start(cmd, log).wait(timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    full, resumed = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("resumed")
    # The README's `accelerate launch`.
    proc = launch(*FLAGS, "--output_dir", str(full), console_script=True, env={"HANG_AT_STEP": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    log = resumed.parent / "resumed.log"
    killed, code = killed_and_relaunched(launch_command(*FLAGS, "--output_dir", str(resumed)), resumed, log)
    assert killed != 0 and code == 0, log.read_text()[-5000:]
    note = f"colograd: note: resuming from {resumed}/checkpoint-3, the newest finished checkpoint"
    assert note in log.read_text()
    # Steps 4-6 trained, not all six again (a fresh start would end with the same weights too).
    assert log.read_text().split(note)[1].count("{'loss': ") == 3, log.read_text()[-4000:]
    return full, resumed


def steps(run_dir) -> dict[int, dict]:
    history = json.loads((run_dir / "checkpoint-6/trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry for entry in history if "loss" in entry}


def test_resumed_run_continues_the_uninterrupted_one(runs):
    full, resumed = map(steps, runs)
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        for name in EXACT:
            assert resumed[step][name] == full[step][name], f"step {step} {name}"
        for name in CLOSE:
            assert resumed[step][name] == pytest.approx(full[step][name], rel=1e-5, abs=1e-7), f"step {step} {name}"
    # The engine was re-synced from the checkpoint: it samples from the trainer's distribution, not dummy weights.
    assert resumed[4]["sampling/sampling_logp_difference/max"] < 1e-3


def test_resumed_run_ends_with_the_same_weights_bit_for_bit(runs):
    full, resumed = (load_file(run / "model.safetensors") for run in runs)
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(resumed[name], full[name]), name


def test_model_card_embeds_the_recipe_and_final_metrics(runs):
    full, _ = runs
    for folder, step in ((full, 6), (full / "checkpoint-3", 3)):
        card = ModelCard.load(folder / "README.md")
        assert {"colograd", "grpo"} <= set(card.data.tags)
        assert "`recipes/grpo_tiny.yaml`" in card.text
        assert "model_name_or_path: colograd:tiny-qwen2" in card.text  # the recipe file itself
        assert "--save_steps 3" in card.text  # and the flags that overrode it
        reward = steps(full)[step]["reward"]
        assert f"Logged at step {step}:" in card.text and f"| `reward` | {reward:.4g} |" in card.text


def test_tensorboard_event_files_hold_the_metrics(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    full, _ = runs
    (events,) = full.glob("runs/*/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("train/reward")] == [1, 2, 3, 4, 5, 6]


def test_completions_are_logged_every_other_step_from_the_first_rank(runs):
    full, resumed = (
        [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()] for run in runs
    )
    assert [r["step"] for r in full] == [2] * 64 + [4] * 64 + [6] * 64  # the first rank's 8 prompts × 8 completions
    assert set(full[0]) == {"step", "prompt", "completion", "rewards", "reward", "advantage"}
    assert full[0]["prompt"].endswith(":") and set(full[0]["rewards"]) == {"letters_or_hang"}
    # The resumed run dropped what the log held past its checkpoint and wrote it again: the same samples.
    assert resumed == full
