"""Bad reward code, by class.

Import: every way a recipe's reward name can fail to give a reward function ends in one line (exit 2) before the
weights load. Run time: every way a reward function can misbehave (raise, return the wrong count, type or values,
never return) fails the step naming the function, or is taken where TRL takes it; a call that never returns is
given up on after the reward time limit, or soon after SIGTERM. In-process, with stand-in reward functions.
"""

import asyncio
import functools
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import refused

from colograd.config.core import ConfigError, GRPOConfig
from colograd.rewards import core as rewards
from colograd.rewards.core import RewardError, RewardTimeout, resolve_reward, score
from colograd.runs import time_limit
from colograd.runs.preemption import Preemption, StoppedBySigterm, stage_failures

PROMPTS = ["ab>a:", "ab>a:"]
COMPLETIONS = ["aa", "ab"]


LIMITS = {"now": rewards.TimeLimits()}  # what `call` scores within: the defaults; the fixtures below shorten them


def call(*funcs, **columns) -> torch.Tensor:
    ids = [[7, 7], [7, 8]]
    return score(
        list(funcs),
        prompts=PROMPTS,
        completions=COMPLETIONS,
        completion_ids=ids,
        columns=columns,
        limits=LIMITS["now"],
    )


# --- import: one line before start-up ---------------------------------------------------------------------------

GOOD = "def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n"
MODULES = {  # case: (module source, the attribute the recipe names, what the line says)
    "syntax_error": ("def reward(completions, **kwargs)\n    return []\n", "reward", r"syntax error \(.*, line 1"),
    "import_inside": ("import not_a_module_xyz\n" + GOOD, "reward", "No module named 'not_a_module_xyz'"),
    "raises_on_import": ("raise RuntimeError('no API key')\n", "reward", "raised RuntimeError: no API key"),
    "missing_name": (GOOD, "rewrad", "has no 'rewrad'"),
    "not_callable": ("reward = 0.5\n", "reward", r"is not a function \(its type is float\)"),
    "a_class": ("class Reward:\n    def __call__(self, completions, **kw):\n        return []\n", "Reward", "class"),
}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A working directory of the test's own, and a Python path and module table restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    return tmp_path


@pytest.mark.parametrize("form", ["dotted", "file"])
@pytest.mark.parametrize("case", MODULES)
def test_reward_code_that_does_not_import_is_one_line(in_tmp, case, form):
    source, attr, says = MODULES[case]
    (in_tmp / f"rw_{case}_{form}.py").write_text(source)
    name = f"rw_{case}_{form}.{attr}" if form == "dotted" else f"./rw_{case}_{form}.py:{attr}"
    with pytest.raises(ConfigError, match=says) as err:
        resolve_reward(name)
    assert "\n" not in str(err.value) and name in str(err.value)


@pytest.mark.parametrize(
    "name", ["no_such_module.reward", "./no_such_file.py:reward", "pkg.no_such.reward", "pkg/rewards.py"]
)
def test_a_missing_module_or_file_is_one_line(in_tmp, name):
    (in_tmp / "pkg").mkdir()
    (in_tmp / "pkg" / "__init__.py").write_text("")
    with pytest.raises(ConfigError, match="no module|no file|no function"):
        resolve_reward(name)


@pytest.mark.parametrize("form", ["my_rewards.reward", "my_rewards:reward", "my_rewards.py:reward"])
def test_a_module_in_the_working_directory_is_found_as_trl_finds_it(in_tmp, form):
    (in_tmp / "my_rewards.py").write_text(GOOD)
    assert resolve_reward(form)(completions=["a", "b"]) == [1.0, 1.0]


def test_a_class_given_to_the_trainer_is_refused():
    class Judge:
        def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)

    with pytest.raises(ConfigError, match="Judge is a class"):
        rewards.resolve_rewards([Judge], None)
    assert rewards.resolve_rewards([Judge()], None)[0][0](completions=["a"]) == [1.0]


@pytest.mark.parametrize("case", [*MODULES, "wrong_signature", "bad_timeout"])
def test_the_command_line_stops_before_start_up(in_tmp, root, case):
    source, attr, says = MODULES.get(case, ("def reward(x):\n    return [1.0]\n", "reward", "needs 'x'"))
    argv = ["--config", str(root / "recipes/grpo_tiny.yaml"), "--output_dir", str(in_tmp / "out")]
    if case == "bad_timeout":
        source, attr, says = GOOD, "reward", "--reward_timeout.*invalid float value: 'ten minutes'"
        argv += ["--reward_timeout", "ten minutes"]
    (in_tmp / f"cli_{case}.py").write_text(source)
    line = refused(*argv, "--reward_funcs", f"cli_{case}.{attr}")
    assert re.search(says, line), line


# --- run time: what a reward function returns --------------------------------------------------------------------


def returning(value):
    def bad(completions, **kwargs):
        return value() if callable(value) else value

    return bad


BAD_OUTPUTS = {  # case: (what the function returns, what the message says)
    "too_few": ([1.0], "returned 1 rewards for 2 completions"),
    "too_many": ([1.0, 1.0, 1.0], "returned 3 rewards for 2 completions"),
    "empty": ([], "returned 0 rewards"),
    "none": (None, "returned a NoneType"),
    "scalar": (1.0, "returned a float"),
    "dict": ({0: 1.0, 1: 1.0}, "returned a dict"),
    "set": ({1.0, 2.0}, "returned a set"),
    "text": ("11", "returned a str"),
    "tensor_2d": (torch.ones(2, 1), r"returned a Tensor of shape \(2, 1\)"),
    "array_0d": (np.float64(1.0), "returned a float64"),
    "inf": ([1.0, math.inf], "returned inf for completion 1"),
    "minus_inf": ([-math.inf, 1.0], "returned -inf for completion 0"),
    "numeric_texts": (["1.0", "0.5"], "returned '1.0' for completion 0"),
    "nested": ([[1.0], [1.0]], r"returned \[1.0\] for completion 0"),
}


@pytest.mark.parametrize("nan", [[1.0, math.nan], torch.tensor([1.0, float("nan")]), np.array([1.0, np.nan])])
def test_nan_is_taken_as_an_abstention_as_trl_takes_it_and_said_once(nan, capsys, monkeypatch):
    monkeypatch.setattr("colograd.rewards.core._NAN_NOTED", set())
    for _ in range(2):
        rewards_NF = call(returning(nan))
        assert rewards_NF[0, 0] == 1.0 and rewards_NF[1, 0].isnan()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "'bad' returned nan for completion 1" in lines[0] and "taken as None" in lines[0]


@pytest.mark.parametrize("case", BAD_OUTPUTS)
def test_unusable_output_fails_naming_the_function(case):
    value, says = BAD_OUTPUTS[case]
    with pytest.raises(RewardError, match=f"reward function 'bad' {says}"):
        call(returning(value))


async def _ones(completions, **kwargs):
    return [1.0] * len(completions)


TAKEN = {  # what TRL reads one value at a time, so takes too
    "tuple": (1.0, 0.5),
    "numpy": np.array([1.0, 0.5]),
    "numpy_float32_items": [np.float32(1.0), np.float32(0.5)],
    "tensor": torch.tensor([1.0, 0.5], dtype=torch.float64),
    "tensor_items": [torch.tensor(1.0), torch.tensor(0.5)],
    "bool_items": [True, 0.5],
    "generator": lambda: (v for v in [1.0, 0.5]),
    "map": lambda: map(float, [1, 0.5]),
}


@pytest.mark.parametrize("case", TAKEN)
def test_outputs_trl_takes_are_taken(case):
    assert call(returning(TAKEN[case]))[:, 0].tolist() == [1.0, 0.5]


def test_a_plain_function_returning_a_coroutine_is_awaited():
    plain = lambda completions, **kw: _ones(completions)  # noqa: E731
    assert call(plain, functools.partial(_ones)).tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_an_async_function_that_raises_is_named():
    async def sour(completions, **kwargs):
        raise KeyError("score")

    with pytest.raises(RewardError, match="reward function 'sour' raised KeyError"):
        call(sour)


def test_rewards_run_in_the_main_thread_where_sigalrm_timeouts_work():
    # math_verify (TRL's accuracy rewards) times itself with SIGALRM, which only the main thread may set.
    from trl.rewards import accuracy_reward

    solutions = [r"\frac{1}{2}", "3"]
    completions = [[{"role": "assistant", "content": r"\boxed{0.5}"}], [{"role": "assistant", "content": "2"}]]
    out = score([accuracy_reward], [[{"role": "user", "content": "q"}]] * 2, completions, [[1], [2]], {
        "solution": solutions
    })  # fmt: skip
    assert out[:, 0].tolist() == [1.0, 0.0]


# --- run time: a call that never returns ----------------------------------------------------------------------


def hangs(completions, **kwargs):
    while True:
        time.sleep(0.05)


def hangs_and_swallows(completions, **kwargs):
    while True:
        try:
            time.sleep(3600)
        except Exception:  # user code catching everything still lets the time limit through
            pass


async def hangs_async(completions, **kwargs):
    await asyncio.Event().wait()


@pytest.fixture
def limit(monkeypatch):
    monkeypatch.setitem(LIMITS, "now", rewards.TimeLimits(timeout=0.5))


@pytest.mark.parametrize("func", [hangs, hangs_and_swallows, hangs_async], ids=lambda f: f.__name__)
def test_a_reward_that_never_returns_fails_after_the_limit(limit, func):
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match=f"reward function '{func.__name__}' did not return within 0.5 s"):
        call(returning([1.0, 1.0]), func)
    assert time.monotonic() - start < 5
    assert call(returning([1.0, 0.5])).tolist() == [[1.0], [0.5]]  # the next call is not hit by a stray signal


def test_a_reward_that_raises_on_the_batch_and_hangs_on_a_sample_still_stops(limit):
    def moody(completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch")
        hangs(completions)

    with pytest.raises(RewardTimeout, match="'moody' \\(on one sample\\) did not return"):
        call(moody)


def test_the_limits_come_from_the_config_and_zero_is_no_limit(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), reward_timeout=0, reward_sigterm_wait=3, report_to="none")
    assert rewards.TimeLimits.of(args) == rewards.TimeLimits(timeout=None, sigterm_wait=3)
    default = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    assert rewards.TimeLimits.of(default) == rewards.TimeLimits() == rewards.TimeLimits(1800.0, 10.0)


@pytest.mark.parametrize("name", ["reward_timeout", "reward_sigterm_wait"])
@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_a_bad_limit_is_one_line(tmp_path, name, value):
    with pytest.raises(ConfigError, match=f"^{name}=.*set it to 0 or more"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", **{name: value})


def test_the_step_failure_names_function_step_and_stage(limit, tmp_path):
    with pytest.raises(Exception) as err, stage_failures("reward", 7, str(tmp_path)):
        call(hangs)
    assert str(err.value).startswith("optimizer step 7, stage 'reward': RewardTimeout: reward function 'hangs'")


# --- SIGTERM while a reward function runs -------------------------------------------------------------------------


def sigterm_in(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


@pytest.fixture
def patience(monkeypatch):
    monkeypatch.setitem(LIMITS, "now", rewards.TimeLimits(sigterm_wait=0.5))


@pytest.mark.parametrize("func", [hangs, hangs_async], ids=lambda f: f.__name__)
def test_sigterm_during_a_hung_reward_stops_within_the_patience(patience, tmp_path, capsys, func):
    preemption = Preemption()
    start = time.monotonic()
    with preemption.armed(), pytest.raises(StoppedBySigterm) as stopped, stage_failures("reward", 3, str(tmp_path)):
        sigterm_in(0.2)
        call(func)  # no limit but the default half hour: only SIGTERM ends it
    assert time.monotonic() - start < 5 and stopped.value.code == 143
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        f"colograd: stopped by SIGTERM during optimizer step 3, stage 'reward': reward function '{func.__name__}' "
        "had not returned 0.5 s after it; the unfinished step is not saved, no checkpoint was saved yet."
    ), line
    assert "\n" not in line


def test_sigterm_during_a_reward_that_returns_in_time_lets_the_step_finish(patience):
    def slow(completions, **kwargs):
        time.sleep(0.4)
        return [1.0] * len(completions)

    preemption = Preemption()
    with preemption.armed():
        sigterm_in(0.1)
        assert call(slow).tolist() == [[1.0], [1.0]]
    assert preemption._signalled  # the step ends as any preempted step does: checkpoint, exit 143


def test_a_reward_stuck_where_no_signal_reaches_ends_the_process(limit, monkeypatch):
    ended = []
    monkeypatch.setattr(time_limit, "EXIT_GRACE", 0.3)
    monkeypatch.setattr(time_limit, "exit_stuck", lambda message, code: ended.append((message, code)))

    def deaf(completions, **kwargs):  # as C code that never returns to Python: the signal waits
        signal.pthread_sigmask(signal.SIG_BLOCK, {time_limit.GIVE_UP_SIGNAL})
        try:
            time.sleep(1.5)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {time_limit.GIVE_UP_SIGNAL})
        return [1.0] * len(completions)

    with pytest.raises(RewardTimeout):  # unblocked at last, the signal is taken
        call(deaf)
    assert len(ended) == 1 and ended[0][1] == 1, ended
    assert ended[0][0].startswith("colograd: error: reward function 'deaf' did not return, its time limit passed")


def test_a_stuck_exit_removes_the_registered_folders_then_ends(monkeypatch, capsys):
    """`os._exit` skips the finalizers that remove temporary folders (the engine's, a LoRA adapter's in /dev/shm):
    `exit_stuck` removes the registered ones itself, one already gone included, then exits with the code."""
    exits = []
    monkeypatch.setattr(time_limit.os, "_exit", exits.append)
    kept, gone = (time_limit.removed_when_stuck(tempfile.TemporaryDirectory()) for _ in range(2))
    Path(kept.name, "adapter_model.safetensors").write_bytes(b"0" * 64)
    shutil.rmtree(gone.name)
    time_limit.exit_stuck("colograd: error: stuck", 1)
    assert exits == [1] and not os.path.exists(kept.name)
    assert capsys.readouterr().err == "colograd: error: stuck\n"
