"""A hang ends: a process that makes no progress for `hang_timeout` seconds writes its stacks and exits, and tells
the other ranks, which do the same; a reward call with a time limit of its own is left to that limit.

First the watch in this process (its exit replaced by a record), then a process whose interpreter is held by a C
call (faulthandler's own timer ends it), then a real 2-process launch whose reward sleeps forever on one rank.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, start_launch

from colograd.runs import hang
from colograd.runs.hang import HUNG_EXIT_CODE, collective_timeout


def test_collectives_wait_ddp_timeout_and_a_minute_past_hang_timeout():
    assert collective_timeout(ddp_timeout=1800, hang_timeout=1800) == 1860
    assert collective_timeout(ddp_timeout=7200, hang_timeout=1800) == 7200
    assert collective_timeout(ddp_timeout=1800, hang_timeout=0) == 1800  # no watch: ddp_timeout, on every backend


@pytest.fixture
def exits(monkeypatch):
    """The exit codes the watch ended the process with (none while it does not), looking often; its exit ends its
    thread instead of the process."""
    codes: list[int] = []

    def record(message: str | None, code: int) -> None:
        codes.append(code)
        hang._watch.done.set()

    monkeypatch.setattr(hang, "exit_stuck", record)
    monkeypatch.setattr(hang, "_POLL", 0.05)
    monkeypatch.setattr(hang, "_STORE_POLL", 0.1)
    yield codes
    hang.stop()  # and faulthandler's timer with it


def wait_for(codes: list[int], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not codes:
        assert time.monotonic() < deadline, "the watch did not end the process"
        time.sleep(0.05)


def test_no_progress_names_where_writes_the_stacks_and_exits_124(tmp_path, exits, capfd):
    hang.watch(1.0, 1800, str(tmp_path))
    hang.progress("optimizer step 3, stage 'reward'")
    wait_for(exits)
    assert exits == [HUNG_EXIT_CODE]
    err = capfd.readouterr().err
    line = err.splitlines()[0]
    assert re.match(r"colograd: error: rank 0 made no progress for \d+ s \(optimizer step 3, stage 'reward'\), more "
                    r"than hang_timeout \(1 s\); the Python stacks of every rank follow", line), line  # fmt: skip
    assert "no checkpoint was saved: relaunch the same command to resume" in line
    assert "in wait_for" in err and "Thread 0x" in err  # every thread's stack, the stuck one's among them


def test_progress_and_a_call_with_a_time_limit_of_its_own_keep_it_alive(tmp_path, exits, monkeypatch):
    hang.watch(1.5, 1800, str(tmp_path))
    for _ in range(40):  # 2 s of steps, each in time
        hang.progress("optimizer step 1, stage 'generate'")
        time.sleep(0.05)
    monkeypatch.setattr(hang, "limited_call_running", lambda: True)  # a reward call under reward_timeout
    time.sleep(3)
    monkeypatch.setattr(hang, "limited_call_running", lambda: False)  # it returned: the time runs again from here
    time.sleep(0.5)
    assert exits == []
    wait_for(exits)


class Store:
    """The launch's key-value store, as another rank's hang left it."""

    def __init__(self, said: dict[str, str]) -> None:
        self.said = said

    def check(self, keys: list[str]) -> bool:
        return all(key in self.said for key in keys)

    def get(self, key: str) -> bytes:
        return self.said[key].encode()


def test_a_rank_told_of_another_ranks_hang_writes_its_stacks_and_exits_too(tmp_path, exits, capfd, monkeypatch):
    said = {"colograd/hung/0": "rank 1 made no progress for 30 s (optimizer step 2, stage 'train')"}
    monkeypatch.setattr(hang, "_store", lambda: Store(said))
    hang.watch(600, 1800, str(tmp_path))
    hang.progress("optimizer step 2, stage 'train'")
    wait_for(exits)
    line = capfd.readouterr().err.splitlines()[0]
    assert line.startswith("colograd: error: rank 0 (optimizer step 2, stage 'train', for "), line
    assert line.endswith(
        "s) stops with the run, as rank 1 made no progress for 30 s (optimizer step 2, stage 'train'); its stacks "
        "follow."
    )


class SlowStore(Store):
    """A store whose every call takes 0.5 s (a round trip on a loaded machine, stretched), saying when one begins."""

    def __init__(self) -> None:
        super().__init__({})
        self.inside = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.inside.set()
        time.sleep(0.5)
        return False


def test_the_watch_ends_before_stop_returns_even_inside_a_store_call(tmp_path, exits, monkeypatch):
    # A thread still inside the store's C++ call (which lets go of the interpreter's lock) when the process exits is
    # ended there by Python, and the process aborts: `stop` returns only once the thread is gone.
    store = SlowStore()
    monkeypatch.setattr(hang, "_store", lambda: store)
    hang.watch(600, 1800, str(tmp_path))
    thread = hang._watch.thread
    assert store.inside.wait(10), "the watch never asked the store"
    hang.stop()
    assert not thread.is_alive()
    assert exits == []


@pytest.mark.slow  # a Python process that imports colograd (torch)
def test_a_call_that_holds_the_interpreter_is_ended_by_faulthandlers_timer(tmp_path):
    # A regular expression that backtracks for ages, in C, never letting another thread run: the watch's thread
    # cannot, faulthandler's (outside the interpreter) can.
    code = (
        "import re; from colograd.runs import hang; hang.BACKSTOP = 1.0\n"
        f"hang.watch(1.0, 1800, {str(tmp_path)!r}); hang.progress('a stage')\n"
        "def backtracks(): re.match(r'(a+)+$', 'a' * 64 + '!')\n"
        "backtracks()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Timeout (0:00:02)!" in proc.stderr and "in backtracks" in proc.stderr, proc.stderr[-3000:]


# --- a reward that sleeps forever on one rank, under a real launch ------------------------------------------------

REWARD = '''
import os
import time
from pathlib import Path

from colograd.models.tiny import letters_reward


def letters_or_sleep(completions, target, trainer_state, **kwargs):
    """The tiny task's reward, never returning on rank 1 from optimizer step 2 on."""
    if trainer_state.global_step + 1 >= 2 and os.environ["RANK"] == "1":
        Path(os.environ["HANG_MARKER"]).touch()
        while True:
            time.sleep(1)
    return letters_reward(completions, target)
'''


@pytest.mark.slow  # launches 2 ranks
def test_a_reward_that_sleeps_forever_on_one_rank_ends_the_launch_with_every_ranks_stacks(tmp_path, monkeypatch):
    (tmp_path / "sleeping.py").write_text(REWARD)
    marker, log = tmp_path / "hung", tmp_path / "run.log"
    monkeypatch.setenv("HANG_MARKER", str(marker))
    flags = ["--config", "recipes/grpo_tiny.yaml", "--max_steps", "4", "--save_strategy", "steps", "--save_steps",
             "1", "--reward_funcs", f"{tmp_path}/sleeping.py:letters_or_sleep", "--hang_timeout", "30",
             "--disable_tqdm", "true", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = start_launch("colograd/train.py", *flags, log=log)
    deadline = time.monotonic() + 400
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
    try:
        proc.wait(timeout=300)  # hang_timeout (30 s), the other rank's look at the store (5 s), the launcher's end
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the hung launch did not end:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    assert proc.returncode != 0
    # Rank 1 waits in its reward call, which reward_timeout watches; rank 0 waits for it in a collective, with no
    # progress: rank 0 reports (naming the last stage it began or ended), rank 1 is told, and each writes its stacks
    # (rank 1's in the sleeping reward).
    said = r"rank 0 made no progress for \d+ s \(optimizer step 2, [^)]*stage '\w+'\)"
    assert re.search(f"colograd: error: {said}, more than hang_timeout \\(30 s\\)", text), text[-4000:]
    kept = f"the last finished checkpoint, {tmp_path}/out/checkpoint-1, is intact: relaunch the same command"
    assert kept in text
    told = r"colograd: error: rank 1 \(optimizer step 2, stage 'reward', for \d+ s\) stops with the run, as "
    assert re.search(f"{told}{said}; its stacks follow.", text), text[-4000:]
    assert 'sleeping.py", line 14 in letters_or_sleep' in text, text[-4000:]  # its `time.sleep(1)`
    assert f"exitcode  : {HUNG_EXIT_CODE}" in text  # the launcher's report of the ranks
