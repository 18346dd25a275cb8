"""Code rewards: the completion's program run against the row's tests, in the sandbox, with open-r1's meanings.

open-r1's `code_reward` takes the last ```` ```python ```` block of a completion (none: the empty program), runs it
once per test case of the row's ``verification_info`` (``{"language": "python", "test_cases": [{"input": ..., "output":
...}, ...]}``) with the case's input on stdin, and counts a case passed when the program exits 0 and its stripped
stdout matches the expected output line by line, each line stripped. Here every line counts: the output must have as
many lines as the expected one (`output_lines="all"`). open-r1 compares over the shorter of the two, so that a
program printing only the first of the expected lines passes; ``output_lines="shorter"`` keeps that meaning, for
comparisons with open-r1's numbers. The reward is the fraction of cases passed; `binary_code_reward` gives 1.0 when
it is above 0.99, else 0.0.

Rows may instead hold assert-style tests (MBPP's ``test_list``, AceCode's ``test_cases``, HumanEval's ``test`` and
``entry_point``: `colograd.rewards.code_tests`): each assert statement is one test, decided by a judge process that
never runs the program and holds the expected values (`colograd.rewards.code_harness`), with the same meanings: the
reward is the fraction of tests passed, `binary_code` 1.0 when it is above 0.99.

Executions run in a pool of threads (each waits on its own sandboxed process), sized to the machine's cores.
A completion's failure reason (the first failing test's: ``timeout``, ``memory``, ``wrong answer``, ``syntax error``,
``no code block``, ...) goes to the completions log as the ``<name>_failure`` column (TRL's ``log_extra``).

Scored while decoding: `prefetch` starts a completion's executions as soon as it is known; the call that scores the
rollout afterwards takes the started results instead of running them again, so the rewards are those of scoring after
the rollout, in the same order (`scores_while_decoding` marks the functions that take this).
"""

import contextlib
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from colograd.errors import ConfigError
from colograd.rewards.code_checker import CheckerBroken, Checkers, CheckRun
from colograd.rewards.code_tests import (
    LAYOUTS,
    ROW_NAME_COLUMNS,
    ROW_TEXT_COLUMNS,
    TEST_COLUMNS,
    AssertTests,
    RowCompileError,
    RowTestsError,
    StdioTests,
    row_tests,
    run_asserts,
    with_prelude,
)
from colograd.rewards.sandbox import Execution, Sandbox, SandboxLimits
from colograd.rewards.sandbox_session import Overloaded, said_overloaded

logger = logging.getLogger(__name__)

BINARY_THRESHOLD = 0.99  # open-r1's
SANDBOX_MODES = ("namespaces", "none")
OUTPUT_LINES = ("all", "shorter")
CHECKERS = ("lines", "tokens", "tokens_nocase", "float")
CASES = ("first_failure", "all")


def extract_code(completion: str, language: str = "python") -> str:
    """The last ```` ```<language> ```` fenced block of `completion`, or "" when it has none (open-r1's)."""
    matches = re.findall(rf"```{language}\n(.*?)```", completion, re.DOTALL)
    return matches[-1] if matches else ""


def output_matches(
    stdout: str, expected: str, lines: str = "all", checker: str = "lines", tolerance: float = 1e-6
) -> bool:
    """Whether a program's output matches the expected output, as `checker` compares them:

    lines           both stripped, compared line by line, each line stripped. `lines`: "all", every line, so the
                    counts must agree; "shorter", open-r1's comparison, over the shorter of the two (a program that
                    prints only the first expected line passes: gameable)
    tokens          the whitespace-separated tokens, equal in order (line breaks and spacing free: the default
                    checker of Codeforces and CodeContests' judges)
    tokens_nocase   the same, letters' case ignored ("YES" / "yes")
    float           the same tokens, a pair of numbers equal within `tolerance`, absolute or relative to the
                    expected one (testlib's real-number checkers)
    """
    if checker != "lines":
        got, want = stdout.split(), expected.split()
        if len(got) != len(want):
            return False
        if checker == "tokens_nocase":
            return [t.lower() for t in got] == [t.lower() for t in want]
        if checker == "float":
            return all(a == b or _close(a, b, tolerance) for a, b in zip(got, want, strict=True))
        return got == want
    got, want = stdout.strip().split("\n"), expected.split("\n")
    if lines == "all":
        want = expected.strip().split("\n")
        if len(got) != len(want):
            return False
    return all(a.strip() == b.strip() for a, b in zip(got, want, strict=False))


def _close(token: str, expected: str, tolerance: float) -> bool:
    """Whether two tokens are numbers within `tolerance` of each other, absolutely or relative to `expected`."""
    try:
        a, b = float(token), float(expected)
    except ValueError:
        return False
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= tolerance * max(1.0, abs(b))


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or the content of a chat's last message; "" when that is None or not text (a
    tool call, image parts): the empty program."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list | tuple) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else ""
    return ""


@dataclass(frozen=True)
class CodeResult:
    """One completion against its tests: `passed` of `total`, and the first failure's reason (None if none).
    `scored`: False where the problem, not the program, is at fault (its checker is broken): no reward is given."""

    passed: int
    total: int
    reason: str | None
    scored: bool = True

    @property
    def rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


class CodeReward:
    """open-r1's `code` reward (or, with `binary`, `binary_code`) on a local sandbox.

    Args:
        binary: 1.0 when the pass rate is above 0.99, else 0.0 (open-r1's `binary_code_reward`).
        limits: what each execution (one stdin/stdout case, or all of a completion's assert-style tests) may use;
            open-r1 gives a case 5 s.
        sandbox: "namespaces" (the sandbox: `colograd.rewards.sandbox`), or "none": no isolation at all beyond rlimits
        and a
            temporary folder, the explicit opt-in for trusted code or a machine without namespaces.
        workers: executions run at once; None: one per core this process may use.
        program: how a completion's text becomes the program; default `extract_code` (its last python block).
        output_lines: how stdin/stdout cases compare the output: "all" its lines, or "shorter", open-r1's comparison
            over the shorter of the output's and the expected output's lines (gameable: see `output_matches`).
        checker: how a stdin/stdout case's output is compared: "lines" (with `output_lines`), "tokens",
            "tokens_nocase" or "float" (`output_matches`).
        tolerance: the "float" checker's absolute or relative tolerance.
        cases: how many of a row's stdin/stdout cases run: "first_failure", in order until one fails (the cases after
            it count as failed and are never sent to the sandbox: a competitive-programming judge's verdict), or
            "all", every one (open-r1's and TRL's `code_reward`: the reward is the fraction passed).

    Raises:
        ConfigError: an unknown `sandbox`, `output_lines`, `checker` or `cases`; `SandboxUnavailable` where the
            namespaces cannot be built.
    """

    scores_while_decoding = True

    def __init__(
        self,
        binary: bool = False,
        limits: SandboxLimits | None = None,
        sandbox: str = "namespaces",
        workers: int | None = None,
        program: Callable[[str], str] = extract_code,
        output_lines: str = "all",
        checker: str = "lines",
        tolerance: float = 1e-6,
        cases: str = "all",
    ) -> None:
        if sandbox not in SANDBOX_MODES:
            raise ConfigError(f"code_sandbox: {sandbox!r} is not one of {', '.join(SANDBOX_MODES)}.")
        if output_lines not in OUTPUT_LINES:
            raise ConfigError(f"code_output_lines: {output_lines!r} is not one of {', '.join(OUTPUT_LINES)}.")
        if checker not in CHECKERS:
            raise ConfigError(f"code_checker: {checker!r} is not one of {', '.join(CHECKERS)}.")
        if cases not in CASES:
            raise ConfigError(f"code_cases: {cases!r} is not one of {', '.join(CASES)}.")
        if not (0 <= tolerance < 1):
            raise ConfigError(f"code_float_tolerance={tolerance}: give a value in [0, 1), e.g. 1e-6.")
        self.binary = binary
        self.program = program
        self.output_lines = output_lines
        self.checker, self.tolerance = checker, tolerance
        self.cases = cases
        self.checkers = Checkers(isolated=sandbox == "namespaces")
        self._broken: set = set()  # the checkers said broken (each said once)
        self.__name__ = "binary_code" if binary else "code"
        self.sandbox = Sandbox(limits, isolated=sandbox == "namespaces")
        self.workers = workers or len(os.sched_getaffinity(0))
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="colograd-code")
        self._started: dict[tuple[str, StdioTests | AssertTests], Future] = {}  # by (program, tests): `prefetch`
        self._read: dict[tuple, tuple[tuple, StdioTests | AssertTests]] = {}  # a call's rows' tests: `_row_tests`
        self._lock = threading.Lock()

    def __call__(
        self,
        completions: list,
        verification_info: list | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        **columns: Any,
    ) -> list[float]:
        """Each completion's reward: the share of its row's tests its program passes (binary: 0 or 1).

        Args:
            completions: texts, or chats whose last message is the model's (``[{"role": "assistant", ...}]``).
            verification_info: one per completion, open-r1's stdin/stdout cases: a dict (or its JSON text) with
                ``test_cases``, each an ``input`` (stdin) and an ``output`` (expected stdout); ``language`` python.
            log_extra: TRL's; given, the failure reasons go to the completions log.
            columns: the dataset's other columns, one value per completion; rows without ``verification_info``
                give assert-style tests in those `colograd.rewards.code_tests` reads (``test_list``, ``test_cases``,
                ``test`` and ``entry_point``).

        Raises:
            RowTestsError: a row has no tests, or none in a layout read here (the message says which and why). A
                row whose tests parse but do not compile scores 0 instead, its failure reason ``row: ...`` saying why.
        """
        rows = _rows(completions, verification_info, columns)
        futures = [self._start(c, row) for c, row in zip(completions, rows, strict=True)]
        results = [f.result() for f in futures]
        with self._lock:
            self._started.clear()  # a started result serves the rollout it was started for, no later one
            self._read.clear()
        if log_extra is not None:
            log_extra(f"{self.__name__}_failure", [r.reason for r in results])
        if self.binary:
            return [(1.0 if r.rate > BINARY_THRESHOLD else 0.0) if r.scored else None for r in results]
        return [r.rate if r.scored else None for r in results]

    def prefetch(self, completions: list, verification_info: list | None = None, **columns: Any) -> None:
        """Start the executions of completions known before the rollout is scored; the scoring call takes them."""
        for completion, row in zip(completions, _rows(completions, verification_info, columns), strict=True):
            self._start(completion, row)

    def _start(self, completion: Any, row: dict[str, Any]) -> Future:
        try:
            tests = self._row_tests(row)
        except RowCompileError as err:  # the row's fault, found only now (preflight refuses it): scored 0, said why
            future: Future = Future()
            future.set_result(CodeResult(0, 1, f"row: {err}"))
            return future
        key = (self.program(completion_text(completion)), tests)
        with self._lock:
            future = self._started.get(key)
            if future is None:
                future = self._started[key] = self._pool.submit(self.run_tests, *key)
        return future

    def _row_tests(self, row: dict[str, Any]) -> StdioTests | AssertTests:
        """A row's tests, read once per scoring call however many of its completions are scored: its cases decoded
        once (LiveCodeBench's compressed ones decompressed once) and held once, not once per completion waiting to
        run (a group of 16 completions of a row with 10 MB of cases held 180 MB). Rows are told apart by the objects
        their columns hold, kept alive beside the tests so that no other row can take their identity."""
        key = tuple((name, id(value)) for name, value in row.items())
        with self._lock:
            held = self._read.get(key)
        if held is None:
            read = (tuple(row.values()), row_tests(row))
            with self._lock:
                held = self._read.setdefault(key, read)
        return held[1]

    def run_tests(self, code: str, tests: StdioTests | AssertTests) -> CodeResult:
        """Run `code` against `tests`, in this thread: stdin/stdout cases in one sandbox (`Sandbox.session`), one
        after the other, each a fresh execution, until the rest cannot change the reward (`_decided`: the first
        failure under `cases` "first_failure"; `binary_code`'s verdict; a program that does not compile) or all ran;
        assert-style tests all in one execution."""
        if isinstance(tests, AssertTests):
            if not code.strip():  # nothing to test: the tests would only fail on the names they call
                return CodeResult(0, len(tests.tests), "no code block")
            # run again while the machine stops it (`Sandbox.run`)
            run = run_asserts(self.sandbox, tests, with_prelude(tests.prelude, code))
            failures = run.failures
            if run.execution.reason == "overloaded":
                return _overloaded(len(failures))
            return CodeResult(failures.count(None), len(failures), next(filter(None, failures), None))
        cases = tests.cases
        if not code.strip():
            if tests.checker is not None:  # nothing ran, nothing to check
                return CodeResult(0, len(cases), "no code block")
            # open-r1 runs the empty program, which passes a case that expects no output
            passed = sum(self.matches("", expected) for _, expected in cases)
            return CodeResult(passed, len(cases), "no code block" if passed < len(cases) else None)
        try:
            with contextlib.ExitStack() as stack:
                check = None if tests.checker is None else stack.enter_context(CheckRun(self.checkers, tests.checker))
                return self._run_cases(with_prelude(tests.prelude, code), cases, check)
        except Overloaded:  # the checker's execution, at every try: its verdict is unknown
            return _overloaded(len(cases))
        except CheckerBroken as err:
            with self._lock:
                said = tests.checker not in self._broken
                self._broken.add(tests.checker)
            if said:
                logger.warning("code rewards: problem %s: %s; its completions get no code reward (None) until the "
                               "row is fixed or dropped", tests.problem or "(unnamed)", err)  # fmt: skip
            return CodeResult(0, len(cases), f"problem: {err}", scored=False)

    def _decided(self, failed: int, total: int, failure: str) -> bool:
        """Whether the cases not run yet can no longer change the reward, after `failed` of `total` failed: under
        `first_failure` at the first failure (the rest count as failed); `binary_code` once its pass rate can no longer
        be above `BINARY_THRESHOLD`; a program that does not compile fails every case alike. Under `all`, `code`
        (the fraction passed) runs every case."""
        binary_lost = self.binary and (total - failed) / total <= BINARY_THRESHOLD  # its best rate left
        return self.cases == "first_failure" or failure == "syntax error" or binary_lost

    def _run_cases(self, code: str, cases: tuple[tuple[str, str], ...], check: CheckRun | None) -> CodeResult:
        """The cases in one session, in order; each output judged by `check` where the row has a checker."""
        passed, failed, reason = 0, 0, None
        with self.sandbox.session(code) as session:
            for stdin, expected in cases:
                execution = session.case(stdin)
                if execution.reason == "overloaded":
                    return _overloaded(len(cases))
                if check is None or not execution.ok:
                    failure = self.failure(execution, expected)
                else:
                    failure = check.decide(stdin, execution.stdout, expected)
                passed += failure is None
                failed += failure is not None
                reason = reason or failure
                if failure is not None and self._decided(failed, len(cases), failure):
                    break
        return CodeResult(passed, len(cases), reason)

    def matches(self, stdout: str, expected: str) -> bool:
        """Whether a case's output is right, as this reward's checker compares (`output_matches`)."""
        return output_matches(stdout, expected, self.output_lines, self.checker, self.tolerance)

    def failure(self, execution: Execution, expected: str) -> str | None:
        """Why a stdin/stdout case failed, or None when it passed."""
        if not execution.ok:
            return execution.reason
        return None if self.matches(execution.stdout, expected) else "wrong answer"


def _overloaded(total: int) -> CodeResult:
    """A completion whose execution was stopped as overloaded at every try: the machine's fault, not the program's,
    so it gets no reward (None, as a broken checker's problem does) rather than a 0: a completion no function
    scores is left out of its group's statistics (`colograd.grpo.loss.weighted_rewards`)."""
    said_overloaded()
    return CodeResult(0, total, "overloaded", scored=False)


def _rows(completions: list, verification_info: list | None, columns: dict[str, Any]) -> list[dict[str, Any]]:
    """Each completion's test columns (`TEST_COLUMNS`) and the columns that say what it was asked
    (`ROW_TEXT_COLUMNS`, and the prompt TRL passes as `prompts`), from the reward call's columns."""
    read = {*TEST_COLUMNS, *ROW_TEXT_COLUMNS, *ROW_NAME_COLUMNS}
    tested = {name: values for name, values in columns.items() if name in read}
    if columns.get("prompts") is not None:
        tested["prompt"] = columns["prompts"]
    if verification_info is not None:
        tested["verification_info"] = verification_info
    return [{name: values[i] for name, values in tested.items()} for i in range(len(completions))]


def check_code_rows(
    reward_funcs: list,
    column_names: list[str],
    read: Callable[[list[str]], dict[str, list] | Iterable[dict[str, list]]],
    name: str,
    also_given: Sequence[str] = (),
) -> None:
    """Every row's tests, read as the code rewards will read them, before any weights are loaded or engine started.

    Args:
        reward_funcs: the run's reward functions; nothing is checked (or read) without a `CodeReward` among them.
        column_names: the dataset's columns.
        read: the values of the named columns, one per row: all at once, or an iterable of such batches (a
            competitive-programming dataset's tests can be gigabytes, more than one process should hold at once).
        name: how messages name the dataset.
        also_given: keywords the rewards get besides the columns (an environment's): when they include a column of
            tests, the rows' tests are not the dataset's to check.

    Raises:
        ConfigError: in one line, the first row whose tests cannot be read: the reward, the row and the problem.
    """
    code = [f for f in reward_funcs if isinstance(f, CodeReward)]
    if not code or any(c in TEST_COLUMNS for c in also_given):
        return
    reward = code[0].__name__
    columns = [c for c in TEST_COLUMNS if c in column_names]
    if not columns:
        raise ConfigError(
            f"reward function {reward!r}: dataset {name!r} has no column of tests: none of {LAYOUTS} (its columns: "
            f"{', '.join(column_names)}); add one (docs/rewards.md shows each)."
        )
    for index, row in each_row(read(columns)):
        try:
            row_tests(row)
        except RowTestsError as err:
            raise ConfigError(f"reward function {reward!r}: dataset {name!r} row {index}: {err}.") from None


def each_row(batches: dict[str, list] | Iterable[dict[str, list]]) -> Iterator[tuple[int, dict]]:
    """(index, row) of every row of `batches` (columns' values, all at once or a batch at a time, as a preflight
    `read` gives them: a competitive-programming dataset's tests can be gigabytes), one batch held at a time."""
    first = 0
    for batch in [batches] if isinstance(batches, dict) else batches:
        rows = len(next(iter(batch.values())))
        for i in range(rows):
            yield first + i, {c: values[i] for c, values in batch.items()}
        first += rows


def code_reward(
    sandbox: str = "namespaces",
    output_lines: str = "all",
    checker: str = "lines",
    tolerance: float = 1e-6,
    cases: str = "all",
) -> CodeReward:
    """The built-in `code` reward (its pool and sandbox are made once per process and setting)."""
    return _shared(False, sandbox, output_lines, checker, tolerance, cases)


def binary_code_reward(
    sandbox: str = "namespaces",
    output_lines: str = "all",
    checker: str = "lines",
    tolerance: float = 1e-6,
    cases: str = "all",
) -> CodeReward:
    """The built-in `binary_code` reward."""
    return _shared(True, sandbox, output_lines, checker, tolerance, cases)


_SHARED: dict[tuple, CodeReward] = {}


def _shared(binary: bool, sandbox: str, output_lines: str, checker: str, tolerance: float, cases: str) -> CodeReward:
    key = (binary, sandbox, output_lines, checker, tolerance, cases)
    if key not in _SHARED:
        _SHARED[key] = CodeReward(binary=binary, sandbox=sandbox, output_lines=output_lines, checker=checker,
                                  tolerance=tolerance, cases=cases)  # fmt: skip
    return _SHARED[key]
