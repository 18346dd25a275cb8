"""Many stdin/stdout cases in one sandbox per completion (`Sandbox.session`): nothing of one case reaches the next,
each case has its own limits, the cases after the first failure are never sent (`code_cases: first_failure`), and
`all` runs every one, open-r1's fraction."""

import os

import pytest

from colograd.errors import ConfigError
from colograd.rewards import sandbox_session
from colograd.rewards.code import CodeReward
from colograd.rewards.sandbox import Sandbox, SandboxLimits
from colograd.rewards.sandbox_session import Session

LIMITS = SandboxLimits(wall_s=30.0, cpu_s=1, memory_mib=256)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


def block(code: str) -> str:
    return f"```python\n{code}```\n"


def test_each_case_gets_a_fresh_folder_and_its_own_files(sandbox):
    code = (
        "import os, sys\nprint(sys.stdin.read(), sorted(os.listdir('.')), sorted(os.listdir('/tmp')))\n"
        "open('left.txt', 'w').write('x')\nopen('/tmp/left.tmp', 'w').write('x')\n"
    )
    with sandbox.session(code) as session:
        first = session.case("one", files={"data.txt": "1 2 3"})
        second = session.case("two")
    assert first.stdout == "one ['data.txt', 'main.py'] ['data.txt', 'main.py']\n"
    assert second.stdout == "two ['main.py'] ['main.py']\n"  # case one's writes and its file are gone


def test_nothing_a_case_started_runs_in_the_next(sandbox):
    # Case one leaves a child writing to stdout forever; case two waits, then prints. Were the child alive, its
    # lines would be in case two's output (or case two would never start).
    code = (
        "import os, sys, time\n"
        "if sys.stdin.read() == 'leave':\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            os.write(1, b'LEAK\\n')\n"
        "            time.sleep(0.01)\n"
        "else:\n"
        "    time.sleep(0.3)\n"
        "print('done')\n"
    )
    with sandbox.session(code) as session:
        first = session.case("leave")
        second = session.case("stay")
    assert first.ok and second.ok
    assert second.stdout == "done\n"


def test_each_case_has_its_own_cpu_time(sandbox):
    # Five cases of 0.4 s of CPU each: 2 s together, twice the limit of one (1 s), each within it.
    spin = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.4:\n    pass\nprint(1)\n"
    with sandbox.session(spin) as session:
        runs = [session.case("") for _ in range(5)]
    assert [r.reason for r in runs] == [None] * 5


def test_a_case_killed_from_outside_ends_its_sandbox_and_the_next_case_builds_another(sandbox):
    hang_on_zero = "import time\nif input() == '0':\n    time.sleep(1000)\nprint('ok')\n"
    limits = SandboxLimits(wall_s=1.0, cpu_s=1, memory_mib=256)
    with Sandbox(limits).session(hang_on_zero) as session:
        assert session.case("0\n").reason == "timeout" and not session.alive
        after = session.case("1\n")
        assert after.ok and after.stdout == "ok\n" and session.alive  # in a sandbox built again
    assert session.case("1\n").reason == "sandbox failed"  # nothing runs in a closed session


def test_output_to_stderr_counts_against_a_cases_output_limit():
    # Small writes, read a few at a time: only the end of stderr is kept, but every byte counts against the limit.
    limits = SandboxLimits(wall_s=5.0, cpu_s=5, memory_mib=256, output_kib=64)
    flood = "import os, time\nwhile True:\n    os.write(2, b'x' * 1000)\n    time.sleep(0.001)\n"
    with Sandbox(limits).session(flood) as session:
        assert session.case("").reason == "output limit"


def test_a_session_whose_launcher_cannot_start_leaves_nothing_behind(sandbox, monkeypatch):
    removed = []
    real_remove = sandbox._remove_cgroups
    monkeypatch.setattr(sandbox, "_remove_cgroups", lambda made: removed.append(made) or real_remove(made))

    def no_launcher(*args, **kwargs):
        raise OSError("no launcher")

    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(sandbox_session.subprocess, "Popen", no_launcher)
    with pytest.raises(OSError, match="no launcher"):
        sandbox.session("print(1)")
    assert len(removed) == 1 and sorted(os.listdir("/proc/self/fd")) == before


SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
FIVE = {
    "public_tests": {"input": ["1 2\n", "5 5\n"], "output": ["3\n", "10\n"]},
    "private_tests": {"input": ["0 0\n", "7 1\n", "2 2\n"], "output": ["0\n", "8\n", "4\n"]},
}
WRONG_ON_SECOND = "a, b = map(int, input().split())\nprint(a + b if a != 5 else 0)\n"


def counted(monkeypatch) -> list:
    sent = []
    real = Session.case
    monkeypatch.setattr(
        Session, "case", lambda self, stdin="", files=None: sent.append(stdin) or real(self, stdin, files)
    )
    return sent


def test_the_cases_after_the_first_failure_are_never_sent(monkeypatch):
    sent = counted(monkeypatch)
    code = CodeReward(limits=LIMITS, workers=1, cases="first_failure")
    columns = {k: [v] * 2 for k, v in FIVE.items()}
    assert code([block(SUM), block(WRONG_ON_SECOND)], **columns) == [1.0, 1 / 5]
    assert sent == ["1 2\n", "5 5\n", "0 0\n", "7 1\n", "2 2\n", "1 2\n", "5 5\n"]


def test_all_runs_every_case_and_gives_the_fraction(monkeypatch):
    """The default, open-r1's and TRL's meaning of `code`: every case runs, the reward is the fraction passed."""
    sent = counted(monkeypatch)
    code = CodeReward(limits=LIMITS, workers=1)
    assert code.cases == "all"
    assert code([block(WRONG_ON_SECOND)], **{k: [v] for k, v in FIVE.items()}) == [4 / 5]
    assert len(sent) == 5
    sent.clear()
    binary = CodeReward(limits=LIMITS, workers=1, binary=True)
    assert binary([block(SUM), block(WRONG_ON_SECOND)], **{k: [v] * 2 for k, v in FIVE.items()}) == [1.0, 0.0]
    assert len(sent) == 5 + 2  # binary_code's verdict is decided at the first of 5 cases failed


def test_a_rows_cases_are_read_once_per_call_however_many_completions_it_has(monkeypatch):
    """A group's completions share their row's tests: LiveCodeBench's compressed cases are decompressed, and held,
    once per scoring call, not once per completion waiting to run (16 completions of a row with 10 MB of cases held
    180 MB before, 30 MB after, as tracemalloc's peak). Two rows of equal text are still two rows."""
    import base64
    import json
    import pickle
    import zlib

    from colograd.rewards import code as code_module

    read = []
    real = code_module.row_tests
    monkeypatch.setattr(code_module, "row_tests", lambda row: read.append(row) or real(row))
    pairs = [(i, o) for t in FIVE.values() for i, o in zip(t["input"], t["output"], strict=True)]
    cases = [{"input": i, "output": o, "testtype": "stdin"} for i, o in pairs]
    private = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases[1:])))).decode()
    lcb = {"public_test_cases": json.dumps(cases[:1]), "private_test_cases": private}
    code = CodeReward(limits=LIMITS, workers=2, cases="first_failure")
    rows = [lcb, {k: (v + " ")[:-1] for k, v in lcb.items()}]  # equal text in other objects: two rows
    columns = {k: [rows[i // 3][k] for i in range(6)] for k in lcb}
    programs = [block(SUM), block(WRONG_ON_SECOND), block(SUM)] * 2
    assert code(programs, **columns) == [1.0, 1 / 5, 1.0] * 2
    assert len(read) == 2
    assert code(programs, **columns) == [1.0, 1 / 5, 1.0] * 2  # the next call reads them again
    assert len(read) == 4


def test_binary_code_stops_only_where_its_verdict_is_decided(monkeypatch):
    """open-r1's `binary_code` is 1.0 above a 0.99 pass rate: with 150 cases one failure still passes, so the cases
    after it run; the second failure decides it (0.0), and the rest are never sent."""
    sent = counted(monkeypatch)
    inputs = [f"{i} 1\n" for i in range(150)]
    columns = {"public_tests": [{"input": inputs, "output": [f"{i + 1}\n" for i in range(150)]}]}
    binary = CodeReward(limits=LIMITS, workers=1, binary=True)
    fails_once = "a, b = map(int, input().split())\nprint(a + b if a != 3 else 0)\n"
    assert binary([block(fails_once)], **columns) == [1.0] and len(sent) == 150
    sent.clear()
    fails_twice = "a, b = map(int, input().split())\nprint(a + b if a not in (3, 7) else 0)\n"
    assert binary([block(fails_twice)], **columns) == [0.0] and sent == inputs[:8]


def test_all_goes_on_after_a_case_that_timed_out():
    limits = SandboxLimits(wall_s=1.0, cpu_s=1, memory_mib=256)
    code = CodeReward(limits=limits, workers=1, cases="all")
    hangs_on_five = "import time\na, b = map(int, input().split())\nif a == 5:\n    time.sleep(1000)\nprint(a + b)\n"
    assert code([block(hangs_on_five)], **{k: [v] for k, v in FIVE.items()}) == [4 / 5]


def test_the_contest_benchmark_reads_its_rows_and_reports_its_ratios():
    from colograd.bench.code import contest_rows, contest_throughput
    from colograd.rewards.code_tests import row_tests

    assert [len(row_tests(row).cases) for row in contest_rows(2, 50)] == [50, 50]
    figures = contest_throughput(repeats=1, problems=1, completions=2, cases=3)
    rates = figures["completions_per_s"]
    assert set(rates) == {"sandboxed", "sandboxed, 1 worker", "unsandboxed"} and min(rates.values()) > 0
    assert figures["ratio"] == rates["sandboxed"] / rates["unsandboxed"]


def test_an_unknown_cases_setting_is_refused():
    with pytest.raises(ConfigError, match="code_cases: 'some'"):
        CodeReward(cases="some")


# --- an execution the machine starved ("overloaded") -------------------------------------------------------------

SLOW_SUM = "import time\ntime.sleep(0.5)\n" + SUM  # still running at the clock's first check
SLOW_ADD = "import time\ntime.sleep(0.5)\ndef add(a, b):\n    return a + b\n"


def starved(monkeypatch, executions: int) -> list:
    """The first `executions` executions' clocks say "overloaded" at their first check (each ends there), as a
    machine that gives them under 1/BACKSTOP of its CPUs makes them; the rest run as they would. Returns the
    verdicts given, one per execution so stopped."""
    from colograd.rewards.sandbox_clock import Clock

    given = []
    real = Clock.check

    def check(self):
        if len(given) < executions:
            given.append("overloaded")
            return "overloaded", 0.0
        return real(self)

    monkeypatch.setattr(Clock, "check", check)
    return given


@pytest.mark.parametrize("layout", ["stdio", "asserts"])
def test_an_execution_stopped_as_overloaded_runs_again(monkeypatch, layout):
    """An execution stopped as "overloaded" is the machine's verdict, not the program's: the case (or the
    assert-style execution) runs again, and a correct program starved twice still scores 1.0 (it scored 0 before)."""
    code = CodeReward(limits=LIMITS, workers=1)
    program, row = (
        (SLOW_SUM, {"public_tests": [{"input": ["1 2\n"], "output": ["3\n"]}]})
        if layout == "stdio"
        else (SLOW_ADD, {"test_list": [["assert add(1, 2) == 3"]]})
    )
    given = starved(monkeypatch, 2)
    assert code([block(program)], **row) == [1.0]
    assert len(given) == 2


def test_a_users_own_reward_gets_the_machines_verdict_taken_back_too(monkeypatch):
    """The retry lives in the sandbox, not in colograd's rewards: a reward of one's own that runs programs through
    `Sandbox.run` or `Sandbox.session` gets a starved execution run again, and "overloaded" only when every try was."""
    from colograd.rewards.sandbox_session import OVERLOADED_TRIES

    sandbox = Sandbox(LIMITS)
    given = starved(monkeypatch, 2)
    run = sandbox.run(SLOW_SUM, "1 2\n")
    assert run.ok and run.stdout == "3\n" and len(given) == 2
    given = starved(monkeypatch, 2)
    with sandbox.session(SLOW_SUM) as session:
        first, second = session.case("1 2\n"), session.case("5 5\n")
    assert (first.stdout, second.stdout) == ("3\n", "10\n") and len(given) == 2
    given = starved(monkeypatch, 100)
    assert sandbox.run(SLOW_SUM, "1 2\n").reason == "overloaded" and len(given) == OVERLOADED_TRIES
    with sandbox.session(SLOW_SUM) as session:
        assert session.case("1 2\n").reason == "overloaded" and len(given) == 2 * OVERLOADED_TRIES


@pytest.mark.parametrize("layout", ["stdio", "asserts"])
def test_an_execution_overloaded_at_every_try_gets_no_reward(monkeypatch, caplog, layout):
    """Starved at each of its OVERLOADED_TRIES tries, a completion gets no code reward (None: the function's mean
    leaves it out), never a 0 the policy would be trained on, and the log says the machine is the cause."""
    from colograd.rewards.sandbox_session import OVERLOADED_TRIES

    code = CodeReward(limits=LIMITS, workers=1)
    program, row = (
        (SLOW_SUM, {"public_tests": [{"input": ["1 2\n", "5 5\n"], "output": ["3\n", "10\n"]}]})
        if layout == "stdio"
        else (SLOW_ADD, {"test_list": [["assert add(1, 2) == 3"]]})
    )
    given = starved(monkeypatch, 100)
    logs = []
    assert code([block(program)], log_extra=lambda name, values: logs.append((name, values)), **row) == [None]
    assert len(given) == OVERLOADED_TRIES == 3
    assert logs == [("code_failure", ["overloaded"])]
    assert "stopped as overloaded 3 times in a row" in caplog.text
