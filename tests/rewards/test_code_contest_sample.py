"""Competitive-programming rows (tests/rewards/contest/, its README says where each comes from): written for these
tests in CodeContests' and open-r1/codeforces' schemas (sample.jsonl), and real rows of CodeContests, APPS and a
PRIME/TACO-style row, as those datasets ship them (real.jsonl, with solutions written here). Every right solution
scores 1.0 under two reward calls at once, and every wrong one (off by one, wrong format, too slow, an invalid answer
to an any-answer problem) scores what one unsandboxed interpreter gives, running the same cases with the same
comparison or checker, after the imports the dataset's own grader puts before a program (APPS's, LiveCodeBench's).

``COLOGRAD_CONTEST_SAMPLE=<file.jsonl>`` runs the same test on other rows of those schemas."""

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from colograd.rewards.code import CodeReward, output_matches
from colograd.rewards.code_layouts import PRELUDES, contest_cases, grader_of
from colograd.rewards.code_tests import AssertTests, row_tests
from colograd.rewards.sandbox import SandboxLimits

CONTEST = Path(__file__).parent / "contest"
SAMPLES = [Path(os.environ["COLOGRAD_CONTEST_SAMPLE"])] if os.environ.get("COLOGRAD_CONTEST_SAMPLE") else [
    CONTEST / "sample.jsonl", CONTEST / "real.jsonl"]  # fmt: skip
# Each row with the file it came from: the real rows (a CodeContests row runs 201 cases a solution) are slow.
ROWS = [(json.loads(line), sample.name == "real.jsonl")
        for sample in SAMPLES for line in sample.read_text().splitlines() if line.strip()]  # fmt: skip
# How each problem's output is compared where it has no checker program (the reward's code_checker).
COMPARISON = {
    "62_A. Fibonacci modulo": "lines",
    "62_B. Trip time": "float",
    "62_C. Almost a palindrome": "tokens_nocase",
}
CPU_S = 2
LIMITS = SandboxLimits(wall_s=20.0, cpu_s=CPU_S, memory_mib=512)
PYTHON3 = 3  # CodeContests' language code


def solutions(row: dict) -> tuple[list[str], list[str]]:
    """A row's right and wrong Python solutions."""
    if "colograd_solutions" in row:
        return row["colograd_solutions"]["right"], row["colograd_solutions"]["wrong"]

    def python(column: str) -> list[str]:
        given = row.get(column) or {"language": [], "solution": []}
        return [s for lang, s in zip(given["language"], given["solution"], strict=True) if lang == PYTHON3]

    return python("solutions"), python("incorrect_solutions")


def problem(row: dict) -> str:
    return row.get("name") or row.get("id") or row.get("url")


def reward_for(row: dict) -> CodeReward:
    return CodeReward(limits=LIMITS, workers=2, checker=COMPARISON.get(problem(row), "tokens"))


def columns(row: dict, n: int) -> dict:
    return {k: [v] * n for k, v in row.items() if k != "colograd_solutions"}


def block(code: str) -> str:
    return f"```python\n{code}```\n"


# `python -I main.py` under the CPU limit: a bare interpreter sets it and execs the program (the limit stays across
# exec). Not `preexec_fn`: with one, subprocess forks this process instead of vforking it, which copies its page tables
# at each spawn: ~0.25 s once the suite's heap holds several GiB, against ~0.02 s (1575_A alone spawns 201).
UNDER_CPU_LIMIT = [sys.executable, "-I", "-S", "-c", "import os, resource, sys\n"
                   f"resource.setrlimit(resource.RLIMIT_CPU, ({CPU_S}, {CPU_S + 1}))\n"
                   "os.execv(sys.executable, [sys.executable, '-I', 'main.py'])"]  # fmt: skip


class Unsandboxed:
    """One interpreter at a time, no sandbox: each case a bare `python -I main.py` under the same CPU limit, its
    output judged by the row's checker program (run unsandboxed too) or the same comparison; every case, the score
    the fraction passed (open-r1's `code_reward`, the reward's default `code_cases: all`)."""

    def __init__(self, row: dict, folder: str) -> None:
        self.row, self.folder = row, folder
        self.tests = row_tests(row)
        self.checker_argv = None
        checker = getattr(self.tests, "checker", None)  # call-based rows have none
        if checker is not None and checker.language == "cpp":
            Path(folder, "checker.cpp").write_text(self.tests.checker.source)
            subprocess.run(["g++", "-O2", "-std=gnu++17", "-o", "checker", "checker.cpp"], cwd=folder, check=True)
            self.checker_argv = ["./checker", "input.txt", "output.txt", "answer.txt"]
        elif checker is not None:
            Path(folder, "checker.py").write_text(self.tests.checker.source)
            self.checker_argv = [sys.executable, "-I", "checker.py", "input.txt", "correct_output.txt",
                                 "solution_output.txt"]  # fmt: skip

    def accepts(self, stdin: str, output: str, expected: str) -> bool:
        if self.checker_argv is None:
            return output_matches(output, expected, "all", COMPARISON.get(problem(self.row), "tokens"), 1e-6)
        names = ("input.txt", "output.txt", "answer.txt")
        if self.tests.checker.language == "python":
            names = ("input.txt", "solution_output.txt", "correct_output.txt")
        for name, text in zip(names, (stdin, output, expected), strict=True):
            Path(self.folder, name).write_text(text)
        done = subprocess.run(self.checker_argv, cwd=self.folder, capture_output=True, text=True, timeout=60)
        if self.tests.checker.language == "python":
            return done.returncode == 0 and done.stdout.split()[-1:] == ["1"]
        return done.returncode == 0

    def score(self, code: str) -> float:
        code = PRELUDES.get(grader_of(self.row), "") + code  # the whole prelude, numpy included
        if isinstance(self.tests, AssertTests):
            return self.called(code)
        Path(self.folder, "main.py").write_text(code)
        cases, passed = self.tests.cases, 0
        for stdin, expected in cases:
            done = subprocess.run(
                UNDER_CPU_LIMIT, cwd=self.folder, input=stdin, text=True, capture_output=True, timeout=600
            )
            passed += done.returncode == 0 and self.accepts(stdin, done.stdout, expected)
        return passed / len(cases)

    def called(self, code: str) -> float:
        """A call-based row: each case's call in the same interpreter, its result compared as APPS's grader does
        (a tuple as a list; an expected list of one also stands for its element)."""
        calls = contest_cases(self.row)
        Path(self.folder, "main.py").write_text(code + CALL_DRIVER.format(name=calls.fn_name))
        done = subprocess.run(
            UNDER_CPU_LIMIT,
            cwd=self.folder,
            text=True,
            capture_output=True,
            input=json.dumps([[list(args), want] for args, want in calls.cases]),
            timeout=600,
        )
        verdicts = done.stdout.split()[-len(calls.cases) :] if done.returncode == 0 else []
        return sum(v == "1" for v in verdicts) / len(calls.cases)


PARAMS = [pytest.param(row, id=problem(row), marks=[pytest.mark.slow] if slow else []) for row, slow in ROWS]
CALL_DRIVER = """

import json as _json, sys as _sys

try:
    _call = getattr(Solution(), {name!r})
except NameError:
    _call = {name}
for _args, _want in _json.loads(_sys.stdin.read()):
    try:
        _got = _call(*_args)
        _got = list(_got) if isinstance(_got, tuple) else _got
        _ok = _got == _want or (isinstance(_want, list) and len(_want) == 1 and _got == _want[0])
    except Exception:
        _ok = False
    print(int(_ok))
"""


@pytest.mark.parametrize("row", PARAMS)
def test_right_solutions_score_one_under_two_calls_at_once(row):
    right, _ = solutions(row)
    assert right, f"{problem(row)} has no Python solution to check"
    reward = reward_for(row)
    got = {}

    def call(k: int) -> None:
        got[k] = reward([block(s) for s in right], **columns(row, len(right)))

    calls = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for thread in calls:
        thread.start()
    for thread in calls:
        thread.join()
    assert got == {0: [1.0] * len(right), 1: [1.0] * len(right)}


@pytest.mark.parametrize("row", PARAMS)
def test_wrong_solutions_score_what_one_unsandboxed_interpreter_gives(row):
    _, wrong = solutions(row)
    assert wrong, f"{problem(row)} has no wrong Python solution to check"
    rewards = reward_for(row)([block(s) for s in wrong], **columns(row, len(wrong)))
    with tempfile.TemporaryDirectory() as folder:
        reference = Unsandboxed(row, folder)
        expected = [reference.score(s) for s in wrong]
    assert rewards == expected
    assert all(r < 1.0 for r in rewards), f"{problem(row)}: a wrong solution passed every case"
