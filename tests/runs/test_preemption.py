"""Interruptions lose nothing: SIGTERM checkpoints and stops, `kill -9` loses only the steps since the last
finished checkpoint, a failure names its step and stage, and Ctrl-C ends in one line naming them;
`--resume_from_checkpoint true` continues each.

One output folder goes through three 2-process runs of the tiny recipe (a checkpoint every 2 steps):
  1. SIGTERM reaches rank 1 alone after the step-2 checkpoint: both ranks stop at the same step and save it;
  2. resumed, it runs until a newer checkpoint is finished, then its whole process group gets SIGKILL;
  3. resumed again, it trains to the end.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli, start_launch, worker
from transformers import TrainerControl, TrainerState

from colograd import train
from colograd.runs.checkpoints import is_complete, last_complete_checkpoint
from colograd.runs.preemption import Interrupted, Preemption, exit_interrupted, stage_failures

MAX_STEPS = 40
FLAGS = [
    "colograd/train.py", "--config", "recipes/grpo_tiny.yaml", "--max_steps", str(MAX_STEPS), "--save_strategy",
    "steps", "--save_steps", "2", "--disable_tqdm", "true",
]  # fmt: skip


def wait_for(condition, proc, log: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def kill_job(proc) -> None:
    """SIGKILL to every process of the job, as a scheduler does: the launcher's process group and each worker's
    (torchrun starts every worker in a session of its own)."""
    workers = [worker(proc.pid, rank) for rank in (0, 1)]
    for group in (proc.pid, *workers):
        os.killpg(group, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "workers survived SIGKILL"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def step_of(checkpoint: str | None) -> int:
    return int(checkpoint.rsplit("-", 1)[1]) if checkpoint else 0


def logged_steps(checkpoint: str) -> list[int]:
    history = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["log_history"]
    return [entry["step"] for entry in history if "loss" in entry]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("preempted")
    flags = [*FLAGS, "--output_dir", str(out)]
    result = {}

    log = out / "1-sigterm.log"
    proc = start_launch(*flags, log=log)
    wait_for(lambda: is_complete(out / "checkpoint-2"), proc, log)
    os.kill(worker(proc.pid, rank=1), signal.SIGTERM)
    proc.wait(timeout=300)
    result["sigterm"] = (proc.returncode, log.read_text(), last_complete_checkpoint(str(out)))
    stopped = step_of(result["sigterm"][2])

    log = out / "2-kill.log"
    proc = start_launch(*flags, "--resume_from_checkpoint", "true", log=log)
    wait_for(lambda: step_of(last_complete_checkpoint(str(out))) > stopped, proc, log)
    kill_job(proc)
    result["kill"] = (proc.returncode, log.read_text(), last_complete_checkpoint(str(out)))
    killed = step_of(result["kill"][2])

    log = out / "3-resume.log"
    proc = start_launch(*flags, "--max_steps", str(killed + 2), "--resume_from_checkpoint", "true", log=log)
    proc.wait(timeout=400)
    result["resume"] = (proc.returncode, log.read_text(), last_complete_checkpoint(str(out)))
    return out, result


@pytest.mark.slow  # launches that are signalled, killed and resumed
def test_sigterm_to_one_rank_stops_both_at_one_step_with_a_checkpoint(runs):
    out, result = runs
    code, log, checkpoint = result["sigterm"]
    step = step_of(checkpoint)
    assert code != 0 and 2 <= step < MAX_STEPS, log[-3000:]
    assert f"stopped by SIGTERM after optimizer step {step}, checkpoint saved" in log, log[-3000:]
    # Both ranks saved their part, and nothing was saved past the step where they stopped.
    assert (Path(checkpoint) / "rng_state_0.pth").exists() and (Path(checkpoint) / "rng_state_1.pth").exists()
    assert logged_steps(checkpoint) == list(range(1, step + 1))
    # The launcher reports the ranks' exit code 143 with a traceback of its own; no frame of colograd's is in it.
    assert not re.search(r'File ".*/colograd/', log), log[-3000:]


@pytest.mark.slow  # launches that are signalled, killed and resumed
def test_kill_9_loses_only_the_steps_since_the_last_finished_checkpoint(runs):
    out, result = runs
    stopped = step_of(result["sigterm"][2])
    code, log, checkpoint = result["kill"]
    assert code == -signal.SIGKILL
    killed = step_of(checkpoint)
    assert killed > stopped
    # The resumed run continued the preempted one: one history, no step twice, none missing.
    assert logged_steps(checkpoint) == list(range(1, killed + 1)), log[-3000:]


@pytest.mark.slow  # launches that are signalled, killed and resumed
def test_resume_after_kill_9_trains_to_the_end(runs):
    out, result = runs
    killed = step_of(result["kill"][2])
    code, log, checkpoint = result["resume"]
    assert code == 0, log[-4000:]
    assert step_of(checkpoint) == killed + 2
    assert logged_steps(checkpoint) == list(range(1, killed + 3))
    assert (out / "model.safetensors").exists()


@pytest.mark.slow  # runs the command line
def test_failure_names_step_and_stage_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("FAIL_AT_STEP", "2")
    flags = ["--config", "recipes/grpo_tiny.yaml", "--max_steps", "3", "--save_strategy", "steps", "--save_steps"]
    flags += ["1", "--reward_funcs", "tests.scripts.failing_reward.letters_or_fail", "--output_dir", str(tmp_path)]
    proc = run_cli(*flags, "--disable_tqdm", "true")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("colograd: error: optimizer step 2, stage 'reward': RewardError:"), lines[-1]
    assert "injected failure" in lines[-1] and f"{tmp_path}/checkpoint-1, is intact" in lines[-1]
    assert is_complete(tmp_path / "checkpoint-1") and not (tmp_path / "checkpoint-2").exists()


# --- Ctrl-C, in-process ------------------------------------------------------------------------------------------


def test_ctrl_c_in_a_stage_names_the_step_and_the_stage(tmp_path):
    with pytest.raises(Interrupted, match=r"optimizer step 4, stage 'generate'"):
        with stage_failures("step", 4, str(tmp_path)), stage_failures("generate", 4, str(tmp_path)):
            raise KeyboardInterrupt


@pytest.mark.parametrize("rank", ["0", "1"])
def test_ctrl_c_ends_in_one_line_on_the_main_process_and_exit_130(tmp_path, monkeypatch, capsys, rank):
    finished = tmp_path / "checkpoint-2"
    finished.mkdir()
    (finished / "trainer_state.json").write_text('{"global_step": 2}')  # saved before records existed: finished
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit_:
        try:
            with stage_failures("reward", 3, str(tmp_path)):
                raise KeyboardInterrupt
        except KeyboardInterrupt as err:
            exit_interrupted(err, str(tmp_path))
    err = capsys.readouterr().err
    assert exit_.value.code == 130
    if rank == "1":
        assert err == ""
    else:
        assert err.splitlines() == [
            f"colograd: interrupted (Ctrl-C) during optimizer step 3, stage 'reward'; the last finished checkpoint, "
            f"{finished}, is intact: rerun with --resume_from_checkpoint true."
        ]


def test_ctrl_c_on_the_command_line_during_start_up(tmp_path, monkeypatch, capsys, root):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "load_model", interrupted)  # while the weights load
    with pytest.raises(SystemExit) as exit_:
        train.cli(["--config", str(root / "recipes/grpo_tiny.yaml"), "--output_dir", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 130 and lines == ["colograd: interrupted (Ctrl-C); no checkpoint was saved yet."], lines


# --- a signal while a reward function hangs, end to end -------------------------------------------------------------

HANG_FLAGS = [
    "--config", "recipes/grpo_tiny.yaml", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "1",
    "--reward_funcs", "tests.scripts.hanging_reward.letters_or_hang", "--disable_tqdm", "true",
]  # fmt: skip


def hung_run(tmp_path, monkeypatch, launcher: bool, *flags: str) -> tuple[subprocess.Popen, Path]:
    """A run whose reward never returns from optimizer step 2 on (checkpoint-1 finished before), started in a
    session of its own and waited for until the reward hangs. After SIGTERM the reward gets 2 s (not 10)."""
    marker, log = tmp_path / "hung", tmp_path / "run.log"
    monkeypatch.setenv("HANG_AT_STEP", "2")
    monkeypatch.setenv("HANG_MARKER", str(marker))
    flags = [*HANG_FLAGS, "--output_dir", str(tmp_path / "out"), "--reward_sigterm_wait", "2", *flags]
    if launcher:
        proc = start_launch("colograd/train.py", *flags, log=log)
    else:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "colograd/train.py", *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}, start_new_session=True,
            )  # fmt: skip
    wait_for(marker.exists, proc, log)
    return proc, log


def ended_within(proc: subprocess.Popen, seconds: float, log: Path) -> int:
    start = time.monotonic()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running {seconds} s after the signal:\n{log.read_text()[-3000:]}") from None
    return time.monotonic() - start


@pytest.mark.slow  # runs the command line
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, None], ids=["sigterm", "ctrl-c", "time-limit"])
def test_a_signal_during_a_hung_reward_ends_the_run_keeping_the_last_checkpoint(tmp_path, monkeypatch, signum):
    limit = ["--reward_timeout", "3"] if signum is None else []  # no signal: the reward time limit ends it
    proc, log = hung_run(tmp_path, monkeypatch, False, *limit)
    if signum is not None:
        os.kill(proc.pid, signum)
    ended_within(proc, 30, log)  # a scheduler's grace; SIGTERM waits 2 s here for the reward, Ctrl-C none
    out, text = tmp_path / "out", log.read_text()
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("colograd:")]
    kept = f"the last finished checkpoint, {out}/checkpoint-1, is intact: rerun with --resume_from_checkpoint true."
    if signum == signal.SIGTERM:
        assert proc.returncode == 143 and lines == [
            "colograd: stopped by SIGTERM during optimizer step 2, stage 'reward': reward function 'letters_or_hang' "
            f"had not returned 2 s after it; the unfinished step is not saved, {kept}"
        ], text[-3000:]
    elif signum == signal.SIGINT:
        assert proc.returncode == 130 and lines == [
            f"colograd: interrupted (Ctrl-C) during optimizer step 2, stage 'reward'; {kept}"
        ], text[-3000:]
    else:
        assert proc.returncode == 1 and len(lines) == 1, text[-3000:]
        says = "stage 'reward': RewardTimeout: reward function 'letters_or_hang' did not return within 3 s"
        assert lines[0].startswith(f"colograd: error: optimizer step 2, {says}"), lines
        assert kept.replace("intact: ", "intact: fix the cause and ").rstrip(".") in lines[0], lines
    assert is_complete(out / "checkpoint-1") and not (out / "checkpoint-2").exists()


@pytest.mark.slow  # launches 2 ranks
def test_sigterm_to_the_launcher_reaches_every_rank_and_ends_a_hung_run_within_the_grace(tmp_path, monkeypatch):
    # Kubernetes signals the container's first process: here accelerate launch, which passes SIGTERM to each rank.
    proc, log = hung_run(tmp_path, monkeypatch, launcher=True)
    os.kill(proc.pid, signal.SIGTERM)
    ended_within(proc, 30, log)
    text, out = log.read_text(), tmp_path / "out"
    assert proc.returncode != 0
    assert "colograd: stopped by SIGTERM during optimizer step 2, stage 'reward'" in text, text[-3000:]
    assert not re.search(r'File ".*/colograd/', text), text[-3000:]
    assert is_complete(out / "checkpoint-1") and not (out / "checkpoint-2").exists()


def test_ctrl_c_between_stages_names_the_step():
    preemption = Preemption()
    preemption.on_step_begin(None, TrainerState(global_step=6), TrainerControl())
    with pytest.raises(Interrupted, match=r"^optimizer step 7$"), preemption.armed():
        raise KeyboardInterrupt  # in transformers' loop: the optimizer step, a save, a callback
