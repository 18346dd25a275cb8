import io
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Test this checkout's package, also in subprocesses, whichever checkout the interpreter was installed from; and
# guard every process a test starts as this one is (`tests/offline/sitecustomize.py`, at their interpreter's start).
OFFLINE = ROOT / "tests" / "offline"
sys.path[:0] = [str(ROOT), str(OFFLINE)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(OFFLINE), os.environ.get("PYTHONPATH")]))

# Nothing downloads at run time: a connection out of this machine, from any code a test runs in this process (a hub
# download, a tracker, a dataset loader), fails the test at once, naming where it went, instead of a test that
# passes here and downloads (or waits on retries) elsewhere (`network_guard`); in a process the test started, the
# same reach ends that process with the same line. Launched processes also get HF_HUB_OFFLINE=1 (`_env`). The
# libraries' reports home are turned off, as a user may turn them off, before the libraries read their switches at
# import: datasets counts a load of a local file by a request to its S3 bucket, and huggingface_hub sends PEFT's
# telemetry.
os.environ["HF_UPDATE_DOWNLOAD_COUNTS"] = "0"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
import network_guard  # noqa: E402

# pytest's failure is a BaseException: a library's retry loop, which catches Exception, cannot retry it
network_guard.install(pytest.fail)


def launch(
    script: str,
    *args: str,
    config: str = "recipes/accelerate_configs/cpu.yaml",
    env: dict[str, str] | None = None,
    timeout: float = 600,
    console_script: bool = False,
) -> subprocess.CompletedProcess:
    """Run `script` on 2 processes with accelerate's launcher and `config` (the project's CPU config); with
    `console_script`, through the `accelerate launch` command itself (see `launch_command`)."""
    _refuse_in_fast_tier(f"launches {script}")
    return subprocess.run(
        launch_command(script, *args, config=config, console_script=console_script),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_env(), **(env or {})},
    )


def start_launch(script: str, *args: str, log: Path) -> subprocess.Popen:
    """Start `launch(script, *args)` without waiting, in a session of its own (so that its whole process group
    can be signalled), its output going to `log`."""
    _refuse_in_fast_tier(f"launches {script}")
    with open(log, "w") as out:
        return subprocess.Popen(
            launch_command(script, *args), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_env(),
            start_new_session=True,
        )  # fmt: skip


def launch_command(
    script: str, *args: str, config: str = "recipes/accelerate_configs/cpu.yaml", console_script: bool = False
) -> list[str]:
    """accelerate's launcher as its module runs it (`python -m accelerate.commands.launch`): the code and arguments of
    `accelerate launch`, without the 2 s the `accelerate` command spends importing every other subcommand, on each of
    the suite's launches. `console_script` gives the command users type."""
    launcher = (
        [str(BIN / "accelerate"), "launch"] if console_script else [sys.executable, "-m", "accelerate.commands.launch"]
    )
    return [
        *launcher,
        "--config_file", str(ROOT / config),
        "--main_process_port", str(_free_port()),
        script, *args,
    ]  # fmt: skip


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python colograd/train.py ARGS` in one process."""
    _refuse_in_fast_tier("runs colograd/train.py")
    cmd = [sys.executable, str(ROOT / "colograd/train.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env())


def refused(*argv: str, env: dict[str, str] | None = None) -> str:
    """Run `colograd/train.py ARGV` in this process and return its error line, having checked what a refused input
    must give: exit code 2, stderr exactly one line `colograd: error: ...`, no traceback, no weights read, no engine
    started. Seconds faster than `run_cli` per case: the libraries are imported once."""
    from colograd import train

    err, out = io.StringIO(), io.StringIO()
    with (
        patch("colograd.train.load_model", side_effect=AssertionError("weights were read")),
        patch("colograd.engine.core.Engine.acquire", side_effect=AssertionError("an engine was started")),
        patch("colograd.engine.core.Engine.__init__", side_effect=AssertionError("an engine was started")),
        patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", **(env or {})}),
        patch("huggingface_hub.constants.HF_HUB_OFFLINE", True),
        redirect_stderr(err),
        redirect_stdout(out),
        pytest.raises(SystemExit) as exit_,
    ):
        train.cli(list(argv))
    lines = err.getvalue().splitlines()
    assert exit_.value.code == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith("colograd: error: "), err.getvalue()
    assert "Traceback" not in err.getvalue() + out.getvalue()
    return lines[0]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_configure(config: pytest.Config) -> None:
    """A folder where tests/zoo.py keeps the models it builds, for this process and the ones it launches (they
    inherit the variable). `make test` names one for both of its sessions (the zoo's models are built by the first
    too), makes it new and removes it; otherwise the session makes its own and removes it at its end, so no later
    session reads a stale one."""
    import tempfile

    if os.environ.get("COLOGRAD_TEST_MODEL_CACHE"):  # the caller's: it made it, it removes it
        return
    config._colograd_model_cache = tempfile.mkdtemp(prefix="colograd-test-models-")
    os.environ["COLOGRAD_TEST_MODEL_CACHE"] = config._colograd_model_cache


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    if folder := getattr(config, "_colograd_model_cache", None):
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("COLOGRAD_TEST_MODEL_CACHE", None)


@pytest.fixture
def objects_built(monkeypatch) -> list[int]:
    """How many steps' sampled log-probs vLLM turned into Logprob objects (one entry per request per step)."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    built: list[int] = []
    update = LogprobsProcessor._update_sample_logprobs
    monkeypatch.setattr(LogprobsProcessor, "_update_sample_logprobs", lambda self, lists: built.append(1) or update(
        self, lists))  # fmt: skip
    return built


@pytest.fixture
def root() -> Path:
    return ROOT


# The fast tier (`pytest -m "not slow"`, `make test-fast`) starts no engine and launches no training process: those
# take seconds to minutes each on a CPU. A test that does either must be marked `slow`; run in the fast tier, it
# fails at once with that advice instead of quietly making the tier slow again.
_fast_tier_test: str | None = None  # the running test's id while the run deselects slow tests and it is unmarked
_LAUNCHERS = {"accelerate", "torchrun", "deepspeed"}
_LAUNCHER_MODULES = {"torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch"}


def _refuse_in_fast_tier(what: str) -> None:
    """Fail the running test if it runs in the fast tier.

    Args:
        what: what the test was about to do, for the message.

    Raises:
        pytest.fail.Exception: the run deselects slow tests and this one is not marked slow. Not an `Exception`,
            so code under test that catches errors (a check reporting FAIL) cannot swallow it.
    """
    if _fast_tier_test is not None:
        pytest.fail(
            f"{_fast_tier_test} {what} but is not marked slow: add @pytest.mark.slow (or "
            "`pytestmark = pytest.mark.slow` for a file of such tests) so that `make test-fast` stays fast"
        )


def _deselects_slow(item: pytest.Item) -> bool:
    """Whether this run's `-m` expression would deselect `item` if it were marked slow (pytest's own parser, so
    `-m "not slow"`, `-m "not slow and not gpu"` and the like all count)."""
    markexpr = item.config.getoption("markexpr")
    if not markexpr:
        return False
    marks = {mark.name for mark in item.iter_markers()} | {"slow"}
    return not Expression.compile(markexpr).evaluate(lambda name, **kwargs: name in marks)


# Project scripts that are not training work: the code sandbox's launcher runs one small program, in milliseconds.
_NOT_TRAINING = ("colograd/rewards/sandbox_launch.py",)


def _launched(args: object) -> str | None:
    """What a `subprocess` command launches if it is training work: a distributed launcher (as a program or a
    module), a script or module of this project, or a Jupyter kernel (a notebook's cells); None for anything else
    (a quick `python -c`, git)."""
    words = shlex.split(args) if isinstance(args, str) else [os.fsdecode(word) for word in args]
    if not words:
        return None
    if Path(words[0]).name in _LAUNCHERS:
        return Path(words[0]).name
    for i, word in enumerate(words):
        path = (ROOT / word).resolve()
        if word.endswith(".py") and path.is_relative_to(ROOT) and path.is_file():
            if str(path.relative_to(ROOT)) in _NOT_TRAINING:
                return None
            return str(path.relative_to(ROOT))
        module = words[i + 1] if word == "-m" and i + 1 < len(words) else ""
        if module in _LAUNCHER_MODULES or module.split(".")[0] in ("colograd", "ipykernel_launcher"):
            return f"python -m {module}"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Arm the fast-tier guard around the whole test, module-scoped fixtures included (a function-scoped fixture
    would be set up after them, too late for a module fixture's launch)."""
    global _fast_tier_test
    if item.get_closest_marker("slow") is not None or not _deselects_slow(item):
        return (yield)
    import vllm.entrypoints.llm

    real_execute_child = subprocess.Popen._execute_child

    def refuse_engine(llm: object, *args: object, **kwargs: object) -> None:
        _refuse_in_fast_tier("starts a vLLM engine")

    def refuse_launch(popen: subprocess.Popen, args: object, *rest: object) -> None:
        if (launched := _launched(args)) is not None:
            _refuse_in_fast_tier(f"launches {launched}")
        real_execute_child(popen, args, *rest)

    _fast_tier_test = item.nodeid
    started = time.perf_counter()
    # vLLM's own class, not the name `vllm.LLM`: a test may stand a fake in for the name (test_sleep does).
    # Popen's child start, not `subprocess.run`: modules that did `from subprocess import Popen` go through it too.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm.entrypoints.llm.LLM, "__init__", refuse_engine)
        patch.setattr(subprocess.Popen, "_execute_child", refuse_launch)
        try:
            return (yield)
        finally:
            _fast_tier_test = None
            if (took := time.perf_counter() - started) > FAST_TIER_TEST_S:
                _slow_in_fast_tier.append((item.nodeid, took))


# vLLM keeps, for the life of the process, what it computed for every model it was started on in module-level
# `lru_cache`s: its tokenizers among them (a 150-260k vocabulary's is tens of MB outside Python's heap, held by several
# caches: the tokenizer registry's, the processors', a keyword check's), and a trainer's engine is held in reference
# cycles that Python's collector may leave for long. One process runs a session's in-process engines one after another
# (the zoo: 88 models); without this, its memory grew by ~170 MB a test and each test's peak stacked on the previous
# engine's, until the zoo was killed for memory on 24 GiB (measured, 2026-11-29). Every vLLM cache is cleared, not a
# list of them: a cache only saves recomputing.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a slow test's fixtures are torn down, free what its engines left, as a new process would start."""
    try:
        return (yield)
    finally:
        if item.get_closest_marker("slow") is not None:
            release_engine_memory()


def release_engine_memory() -> None:
    import ctypes
    import functools
    import gc

    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
    gc.collect()
    if trim := getattr(ctypes.CDLL(None), "malloc_trim", None):  # glibc: hand the freed pages back
        trim(0)


# An unmarked test that takes over FAST_TIER_TEST_S seconds is named at the end of a fast-tier run. It is reported,
# not failed: a verdict that depended on the machine's load would make the suite non-deterministic.
FAST_TIER_TEST_S = 10.0
_slow_in_fast_tier: list[tuple[str, float]] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _slow_in_fast_tier:
        return
    terminalreporter.section(f"unmarked tests over {FAST_TIER_TEST_S:.0f} s (mark them slow, or make them faster)")
    for nodeid, took in sorted(_slow_in_fast_tier, key=lambda entry: -entry[1]):
        terminalreporter.write_line(f"{took:6.1f} s  {nodeid}")


def worker(launcher: int, rank: int) -> int:
    """The pid of the launcher's child process that runs `rank` (`colograd.bench.soak.worker_pid`, which the failure
    soak kills by)."""
    from colograd.bench.soak import worker_pid

    if (pid := worker_pid(launcher, rank)) is None:
        raise AssertionError(f"no rank {rank} under process {launcher}")
    return pid


def watch_rollouts(trainer: Any) -> set[str]:
    """The names of the trainer's attributes its rollouts set or delete from now on (`make_rollout`, and `sample` as
    evaluation calls it): `trainer` becomes an instance of a subclass of its class that records them. docs/design.md
    names the one a rollout may set (`weight_plan`)."""
    rebound: set[str] = set()
    base = type(trainer)

    def watched(stage):
        def run(self, *args, **kwargs):
            self.__dict__["_rolling"] = self.__dict__.get("_rolling", 0) + 1
            try:
                return stage(self, *args, **kwargs)
            finally:
                self.__dict__["_rolling"] -= 1

        return run

    def setattr_(self, name, value):
        if self.__dict__.get("_rolling"):
            rebound.add(name)
        base.__setattr__(self, name, value)

    def delattr_(self, name):
        if self.__dict__.get("_rolling"):
            rebound.add(name)
        base.__delattr__(self, name)

    body = {"make_rollout": watched(base.make_rollout), "sample": watched(base.sample)}
    trainer.__class__ = type(
        f"Watched{base.__name__}", (base,), body | {"__setattr__": setattr_, "__delattr__": delattr_}
    )
    return rebound
