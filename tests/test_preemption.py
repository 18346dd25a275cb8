"""Interruptions lose nothing: SIGTERM checkpoints and stops, `kill -9` loses only the steps since the last
finished checkpoint, and a failure names its step and stage; `--resume_from_checkpoint true` continues each.

One output folder goes through three 2-process runs of the tiny recipe (a checkpoint every 2 steps):
  1. SIGTERM reaches rank 1 alone after the step-2 checkpoint: both ranks stop at the same step and save it;
  2. resumed, it runs until a newer checkpoint is finished, then its whole process group gets SIGKILL;
  3. resumed again, it trains to the end.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import run_cli, start_launch

from colograd.checkpoints import is_complete, last_complete_checkpoint

pytestmark = pytest.mark.slow  # launches that are signalled, killed and resumed
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


def worker(launcher: int, rank: int) -> int:
    """The pid of the launcher's child process that runs `rank`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no rank {rank} under process {launcher}")


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


def test_kill_9_loses_only_the_steps_since_the_last_finished_checkpoint(runs):
    out, result = runs
    stopped = step_of(result["sigterm"][2])
    code, log, checkpoint = result["kill"]
    assert code == -signal.SIGKILL
    killed = step_of(checkpoint)
    assert killed > stopped
    # The resumed run continued the preempted one: one history, no step twice, none missing.
    assert logged_steps(checkpoint) == list(range(1, killed + 1)), log[-3000:]


def test_resume_after_kill_9_trains_to_the_end(runs):
    out, result = runs
    killed = step_of(result["kill"][2])
    code, log, checkpoint = result["resume"]
    assert code == 0, log[-4000:]
    assert step_of(checkpoint) == killed + 2
    assert logged_steps(checkpoint) == list(range(1, killed + 3))
    assert (out / "model.safetensors").exists()


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
