"""open-r1's `ioi_code` reward (huggingface/open-r1 @ 1416fa0c, `ioi_code_reward`,
`utils/competitive_programming/ioi_scoring.py` and `ioi_utils.py`), with the CMS grader of open-r1's Piston package
(guipenedo/piston @ 7a38da2, `packages/cms_ioi/1.0.0/compile` and `run`), run in colograd's sandbox instead of on
Piston workers.

For a completion on a row of open-r1/ioi (one row per subtask: `id`, `subtask`, `score_precision`, `test_names`,
`grader_files`, `time_limit`, `memory_limit`, `year`; `test_cases` where the rows carry their tests):

    code        the last ```` ```cpp ```` block of the completion's last message, with open-r1's `add_includes`
                (``#include <bits/stdc++.h>``, the problem's header, ``using namespace std;`` where the code names
                neither it nor ``std::``)
    compile     ``g++ -DEVAL -std=gnu++17 -O2 -pipe -s`` of the code with the grader files' ``graders/grader.cpp`` and
                ``stub.cpp`` (where there), their headers beside them, inside a sandbox; once per completion (Piston
                compiled it for every test, alike)
    tests       the row's `test_names`, in order: from its `test_cases` (a mapping of test name to (input, output),
                or a list in `test_names`' order), else from the Hub's open-r1/ioi-test-cases (the row's `year`,
                loaded once per year; checked before the run starts)
    run         each test a fresh execution in the completion's sandbox, the test's input on stdin; the time and
                memory limits of the grader files' ``graders/grader_config.json`` (else the row's): wall seconds,
                here not counting waits for a CPU, and bytes of address space; the stack as large
    a test's    0 when the program fails (time, memory, a non-zero exit); with the problem's checker
    score       (``checker/checker.cpp``, compiled once per problem and run in a sandbox of its own on the input,
                the expected output and the program's output) the number it prints, in [0, 1]; without one 1 when
                the two outputs are equal as ``diff -b`` sees them, else 0
    reward      round(min of the tests' scores, score_precision), the tests stopping at the first 0: open-r1's
                subtask score, in [0, 1] (the subtask's points do not weigh it); no code block, or a program that
                does not compile: 0

Where open-r1 would score something other than the solution, the completion gets no reward (None, said once per
problem), never a number: a Communication task (a manager program talking to the solution: not run here), a test with
no expected output (the run script then takes the program's own output as its score), a test the tests lack, a
checker that does not compile or does not score the expected output 1. `code_eval_test_batch_size` (tests Piston ran
at once) and `ioi_provider` do not change the score, and are accepted for that.
"""

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

from colograd.errors import ConfigError
from colograd.rewards.code import each_row
from colograd.rewards.code_checker import CHECK_LIMITS, CheckerBroken, compile_cpp
from colograd.rewards.code_codeforces import JudgedReward, problem_limits
from colograd.rewards.sandbox import Execution
from colograd.rewards.sandbox_session import Session, said_overloaded

logger = logging.getLogger(__name__)

COLUMNS = ("id", "subtask", "score_precision", "test_names", "grader_files", "time_limit", "memory_limit", "year")
TESTS_COLUMN = "test_cases"
TESTS_DATASET = "open-r1/ioi-test-cases"
SOLUTION_FLAGS = ("-DEVAL", "-std=gnu++17", "-O2", "-pipe", "-s")
CHECKER_FLAGS = ("-x", "c++", "-std=gnu++17", "-O2")
GRADER_SOURCES = ("grader.cpp", "stub.cpp")  # compiled with the solution where the grader files hold them
_DIFF_SPACE = re.compile(r"[ \t\v\f\r]+")  # what `diff -b` counts as white space within a line


class Unjudged(Exception):
    """A completion open-r1 would score by something other than its solution: no reward; the message says why."""


@dataclass(frozen=True)
class Subtask:
    """A row, as the judge reads it."""

    id: str
    subtask: str
    precision: int
    test_names: tuple[str, ...]
    graders: tuple[tuple[str, bytes], ...]  # graders/'s files, by name
    checker: tuple[tuple[str, bytes], ...]  # checker/'s files, by name (none: the outputs are compared)
    task_type: str
    time_limit: float
    memory_mib: float
    year: int
    tests: dict[str, tuple[str, str]] | None  # the row's own test_cases; None: the Hub's
    language: ClassVar[str] = "cpp"  # of the code block read (open-r1's IOI solutions are C++)

    @property
    def sources(self) -> tuple[str, ...]:
        """The grader's sources compiled with the solution."""
        names = {name for name, _ in self.graders}
        return tuple(name for name in GRADER_SOURCES if name in names)


def add_includes(code: str, problem_id: str) -> str:
    """open-r1's `add_includes`: the includes and namespace its models forget, put before the code (none on none)."""
    if not code:
        return code
    header = "#include <bits/stdc++.h>\n"
    if f'#include "{problem_id}.h"' not in code:
        header += f'#include "{problem_id}.h"\n'
    if "using namespace std;" not in code and "std::" not in code:
        header += "\nusing namespace std;\n\n"
    return header + code


def diff_b_equal(expected: str, output: str) -> bool:
    """``diff -bq``'s verdict on two outputs: the same lines once each line's trailing white space is dropped and each
    run of white space within it counts as one; a missing last line break is no difference, an extra line is."""

    def lines(text: str) -> list[str]:
        split = text.split("\n")
        if text.endswith("\n"):
            split.pop()
        return [_DIFF_SPACE.sub(" ", line).rstrip(" ") for line in split]

    return lines(expected) == lines(output)


def echoed(text: str) -> str:
    """``echo "$(cat file)"``: how the run script hands the expected output on: its trailing line breaks one."""
    return text.rstrip("\n") + "\n"


def subtask_score(scores: Sequence[float], precision: int) -> float:
    """open-r1's `SubtaskResult.score`: the least of the tests' scores (those not run count 0), rounded; 0 without
    any."""
    return round(min(scores), precision) if scores else 0


def read_subtask(row: dict[str, Any]) -> Subtask:
    """The judge's view of one row.

    Raises:
        ConfigError: a column is missing or malformed, the grader files lack graders/grader_config.json or the
            problem's header, or the row's test_cases do not cover its test_names (one line, with the fix).
    """
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ConfigError(f"ioi_code: the rows lack {', '.join(missing)}; give open-r1/ioi's columns "
                          f"({', '.join(COLUMNS)})")  # fmt: skip
    problem = str(row["id"])
    try:
        files = [(str(path), content) for path, content in row["grader_files"]]
    except (TypeError, ValueError):
        raise ConfigError(f"ioi_code: problem {problem}: grader_files is not a list of [path, content] pairs; give "
                          "open-r1/ioi's") from None  # fmt: skip
    graders = tuple((p.removeprefix("graders/"), _bytes(c)) for p, c in files if p.startswith("graders/") and c)
    checker = tuple((p.removeprefix("checker/"), _bytes(c)) for p, c in files if p.startswith("checker/") and c)
    names = dict(graders)
    if "grader_config.json" not in names:
        raise ConfigError(f"ioi_code: problem {problem}: its grader_files lack graders/grader_config.json, which the "
                          "CMS grader reads the task type and limits from; give open-r1/ioi's")  # fmt: skip
    try:
        config = json.loads(names["grader_config.json"])
        assert isinstance(config, dict)
    except (ValueError, AssertionError):
        raise ConfigError(f"ioi_code: problem {problem}: graders/grader_config.json is not a JSON object") from None
    header = next((n for n in sorted(names) if n.endswith(".h") and n != "testlib.h"), None)
    if header != f"{problem.lower()}.h":
        raise ConfigError(f"ioi_code: problem {problem}: the grader's header is {header}, not {problem.lower()}.h: "
                          "the solution (named after the id) would never compile with it; fix the row's id or "
                          "grader_files")  # fmt: skip
    test_names = row["test_names"]
    if not isinstance(test_names, list | tuple) or not test_names or not all(isinstance(n, str) for n in test_names):
        raise ConfigError(f"ioi_code: problem {problem} subtask {row['subtask']}: test_names is not a non-empty list "
                          "of names")  # fmt: skip
    try:
        precision = int(row["score_precision"])
        time_limit = float(config.get("time_limit", row["time_limit"]))
        memory = config["memory_limit"] / 2**20 if "memory_limit" in config else float(row["memory_limit"])
        year = int(row["year"])
    except (TypeError, ValueError):
        raise ConfigError(f"ioi_code: problem {problem}: score_precision, time_limit, memory_limit or year is not a "
                          "number") from None  # fmt: skip
    _same_unit(problem, "time_limit", time_limit, row["time_limit"])
    _same_unit(problem, "memory_limit", memory, row["memory_limit"])
    tests = _row_tests(row.get(TESTS_COLUMN), tuple(test_names), problem) if row.get(TESTS_COLUMN) else None
    return Subtask(problem, str(row["subtask"]), precision, tuple(test_names), graders, checker,
                   str(config.get("task_type", "")), time_limit, memory, year, tests)  # fmt: skip


def _same_unit(problem: str, what: str, config: float, row: Any) -> None:
    """The grader's limit (grader_config.json's, which the CMS grader applies: seconds, bytes read as MiB) and the
    row's column for it agree within 10×; further apart, one of them is in another unit (milliseconds, kilobytes),
    and a limit 1000× too loose would let a slow program pass.

    Raises:
        ConfigError: they are 10× apart or more.
    """
    try:
        ratio = max(config, float(row)) / min(config, float(row))
    except (TypeError, ValueError, ZeroDivisionError):
        return
    if ratio >= 10:
        unit = "seconds" if what == "time_limit" else "MiB (its bytes / 2**20)"
        raise ConfigError(f"ioi_code: problem {problem}: graders/grader_config.json's {what} is {config:g} {unit} and "
                          f"the row's {what} is {row}, {ratio:.0f}× apart: one is in another unit; fix the row or its "
                          "grader_config.json")  # fmt: skip


def _bytes(content: str | bytes) -> bytes:
    return content if isinstance(content, bytes) else str(content).encode()


def _row_tests(given: Any, names: tuple[str, ...], problem: str) -> dict[str, tuple[str, str]]:
    """A row's own `test_cases`, as open-r1 reads them: by test name, or a list in `test_names`' order; each an
    (input, output) pair."""
    tests = dict(zip(names, given, strict=False)) if isinstance(given, list | tuple) else given
    try:
        found = {name: (str(tests[name][0]), str(tests[name][1])) for name in names}
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"ioi_code: problem {problem}: its test_cases do not give an (input, output) pair for each "
                          "of its test_names") from None  # fmt: skip
    return found


_years_lock = threading.Lock()  # a year is loaded once, whichever completions ask for it at once


def year_tests(year: int) -> dict[str, dict[str, tuple[str, str]]]:
    """The Hub's open-r1/ioi-test-cases of `year`: problem id -> test name -> (input, output), loaded at its first
    use in this process (open-r1's `load_ioi_tests_for_year`).

    Raises:
        ConfigError: they cannot be loaded (offline and not in the cache, or no such year).
    """
    with _years_lock:
        return _loaded_year(year)


@cache
def _loaded_year(year: int) -> dict[str, dict[str, tuple[str, str]]]:
    try:
        from datasets import load_dataset

        rows = load_dataset(TESTS_DATASET, name=str(year), split="train")
    except Exception as err:  # datasets' errors for a missing config, no network, an offline cache miss
        raise ConfigError(f"ioi_code: the tests of year {year} ({TESTS_DATASET}, config {year}) cannot be loaded "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}); go online "
                          f"once to cache them, or give the rows a {TESTS_COLUMN} column") from None  # fmt: skip
    found: dict[str, dict[str, tuple[str, str]]] = {}
    for test in rows:
        found.setdefault(test["problem_id"], {})[test["test_name"]] = (test["test_input"], test["test_output"])
    return found


def check_ioi_rows(
    reward_funcs: list,
    column_names: list[str],
    read: Callable[[list[str]], dict[str, list] | Iterable[dict[str, list]]],
    name: str,
    also_given: Sequence[str] = (),
) -> None:
    """Every row as `ioi_code` will read it, and the Hub's tests of each year the rows without `test_cases` need,
    before any weights are loaded or engine started; nothing is read without an `IoiCodeReward` among
    `reward_funcs` (`check_code_rows`' arguments). Communication tasks are counted and said in one note.

    Raises:
        ConfigError: in one line, the first row `ioi_code` cannot judge, or a year whose tests cannot be loaded.
    """
    if not any(isinstance(f, IoiCodeReward) for f in reward_funcs) or any(c in COLUMNS for c in also_given):
        return  # no ioi_code, or the rows' problems are an environment's to give
    missing = [c for c in COLUMNS if c not in column_names]
    if missing:
        raise ConfigError(f"reward function 'ioi_code': dataset {name!r} lacks {', '.join(missing)}; give "
                          f"open-r1/ioi's columns ({', '.join(COLUMNS)})")  # fmt: skip
    wanted = [c for c in (*COLUMNS, TESTS_COLUMN) if c in column_names]
    years, communication, rows = set(), set(), 0
    for index, row in each_row(read(wanted)):
        try:
            subtask = read_subtask(row)
        except ConfigError as err:
            raise ConfigError(f"reward function 'ioi_code': dataset {name!r} row {index}: "
                              f"{str(err).removeprefix('ioi_code: ')}") from None  # fmt: skip
        rows += 1
        if subtask.tests is None:
            years.add(subtask.year)
        if subtask.task_type != "Batch":
            communication.add(subtask.id)
    for year in sorted(years):
        try:
            year_tests(year)
        except ConfigError as err:
            said = str(err).removeprefix("ioi_code: ")
            raise ConfigError(f"reward function 'ioi_code': dataset {name!r}: {said}") from None
    if communication:
        from colograd.runs.checkpoints import note  # the preflight's notes: one line, from the first rank

        note(f"ioi_code: problems {', '.join(sorted(communication))} of dataset {name!r} are not Batch tasks (a "
             "manager talks to the solution): they are not judged here, and their completions get no ioi_code reward "
             "(None).")  # fmt: skip


class IoiCodeReward(JudgedReward):
    """open-r1's `ioi_code` on colograd's sandbox (the module's docstring says what it computes).

    Args:
        test_batch_size: open-r1's; tests Piston ran at once. Accepted; the score does not depend on it.
        provider_type: open-r1's `ioi_provider` (piston or morph): where open-r1 ran the grader. Accepted; the
            grader runs here.
        sandbox: "namespaces" (the sandbox), or "none": rlimits and a temporary folder only (trusted code).
        workers: completions judged at once; None: one per core this process may use.

    Raises:
        ConfigError: an unknown sandbox, or no g++ on this machine.
    """

    __name__ = "ioi_code"

    def __init__(
        self,
        test_batch_size: int = 1,
        provider_type: str = "piston",
        sandbox: str = "namespaces",
        workers: int | None = None,
    ) -> None:
        super().__init__(sandbox, workers, "the CMS grader compiles C++ with it")
        self.test_batch_size, self.provider_type = test_batch_size, provider_type
        self.checkers = self.sandbox.with_limits(CHECK_LIMITS)
        self._checkers: dict[tuple, bytes | CheckerBroken] = {}
        self._compiling: dict[tuple, threading.Lock] = {}
        self._said: set[tuple[str, str]] = set()

    def rows(self, columns: dict[str, list], n: int) -> list[Subtask]:
        names = [c for c in (*COLUMNS, TESTS_COLUMN) if c in columns]
        return [read_subtask({c: columns[c][i] for c in names}) for i in range(n)]

    def judge(self, code: str, subtask: Subtask) -> tuple[float | None, str | None]:
        """(the reward, the first failure's reason or None) of `code` on `subtask`, in this thread."""
        try:
            if subtask.task_type != "Batch":
                raise Unjudged(f"a {subtask.task_type or 'untyped'} task, which colograd does not run")
            if not code:
                return 0.0, "no code block"
            tests = self._tests(subtask)
            binary, error = compile_cpp(self.compiler, add_includes(code, subtask.id),
                                        (*SOLUTION_FLAGS, *subtask.sources), dict(subtask.graders))  # fmt: skip
            if binary is None:
                return 0.0, f"compile error ({error})"
            checker = self._checker(subtask) if subtask.checker else None
            scores, reason = self._run(binary, subtask, tests, checker)
        except Unjudged as why:
            self._say(subtask.id, str(why))
            return None, "not judged"
        except CheckerBroken as err:
            self._say(subtask.id, f"its checker failed: {err}")
            return None, "checker"
        if reason == "overloaded":  # the machine's verdict at every try (`Session.case`): no score can be given
            said_overloaded()
            return None, reason
        ran_all = len(scores) == len(subtask.test_names)
        return subtask_score(scores if ran_all else [*scores, 0.0], subtask.precision), reason

    def _tests(self, subtask: Subtask) -> list[tuple[str, str]]:
        tests = subtask.tests
        if tests is None:
            tests = year_tests(subtask.year).get(subtask.id, {})
        lacking = [name for name in subtask.test_names if name not in tests]
        if lacking:
            raise Unjudged(f"its tests lack {lacking[0]} (subtask {subtask.subtask})")
        empty = [name for name in subtask.test_names if not tests[name][1]]
        if empty:  # the run script would take the program's own output as the score
            raise Unjudged(f"its test {empty[0]} has no expected output")
        return [tests[name] for name in subtask.test_names]

    def _run(
        self, binary: bytes, subtask: Subtask, tests: list[tuple[str, str]], checker: bytes | None
    ) -> tuple[list[float], str | None]:
        """Each test's score, in order, up to the first 0; the first failure's reason ("overloaded": stopped as the
        machine stopped one, at every try)."""
        sandbox = self.sandbox.with_limits(problem_limits(subtask.time_limit, subtask.memory_mib))
        scores, reason = [], None
        argv = ["./checker", "input.txt", "correct_output.txt", "contestant_output.txt"]
        checking = nullcontext() if checker is None else self.checkers.session("", argv, {"checker": checker})
        with sandbox.session("", ["./program"], {"program": binary}) as session, checking as check:
            for stdin, expected in tests:
                execution = session.case(stdin)
                score, failure = self._score(execution, stdin, expected, check)
                if failure == "overloaded":
                    return scores, failure
                scores.append(score)
                reason = reason or failure
                if score == 0.0:
                    break
        return scores, reason

    @staticmethod
    def _score(execution: Execution, stdin: str, expected: str, check: Session | None) -> tuple[float, str | None]:
        """A test's score and why it is not 1 (None when it is), as the run script decides it."""
        if not execution.ok:
            return 0.0, execution.reason
        if check is None:
            return (1.0, None) if diff_b_equal(echoed(expected), execution.stdout) else (0.0, "wrong answer")
        score = _checked(check, stdin, expected, execution.stdout)
        if score == "overloaded":
            return 0.0, score
        if score is None:  # the checker failed on this output: the output's fault where it scores the expected 1
            if _checked(check, stdin, expected, echoed(expected)) != 1.0:
                raise CheckerBroken("it neither scored the program's output nor scored the expected output 1")
            return 0.0, "wrong answer (checker failed on it)"
        return score, None if score == 1.0 else "wrong answer" if score == 0.0 else "partial"

    def _checker(self, subtask: Subtask) -> bytes:
        """The problem's checker, compiled at its first use (one compile per problem at a time).

        Raises:
            CheckerBroken: it does not compile.
        """
        files = dict(subtask.checker)
        if "checker.cpp" not in files:
            raise Unjudged("its checker/ holds no checker.cpp")
        key = tuple(sorted(files.items()))
        with self._lock:
            own = self._compiling.setdefault(key, threading.Lock())
        with own:
            with self._lock:
                found = self._checkers.get(key)
            if found is None:
                source = files.pop("checker.cpp").decode(errors="replace")
                binary, error = compile_cpp(self.compiler, source, CHECKER_FLAGS, files)
                found = CheckerBroken(f"it does not compile ({error})") if binary is None else binary
                with self._lock:
                    self._checkers[key] = found
        if isinstance(found, CheckerBroken):
            raise found
        return found

    def _say(self, problem: str, why: str) -> None:
        with self._lock:
            said = (problem, why) in self._said
            self._said.add((problem, why))
        if not said:
            logger.warning("ioi_code: problem %s: %s; its completions get no ioi_code reward (None)", problem, why)


def _checked(check: Session, stdin: str, expected: str, output: str) -> float | str | None:
    """The checker's score of `output` (the number it printed, as open-r1 reads it whatever its exit status), None
    where it printed none, a number outside [0, 1] (open-r1 would take it), or was stopped; "overloaded" where the
    machine stopped it at every try."""
    done = check.case(
        "", {"input.txt": stdin, "correct_output.txt": echoed(expected), "contestant_output.txt": output}
    )
    if done.reason == "overloaded":
        return "overloaded"
    if done.exit_code is None or done.signal is not None:
        return None
    try:
        score = float(done.stdout)
    except ValueError:
        return None
    return score if 0.0 <= score <= 1.0 else None  # a score outside [0, 1] (or NaN) is none: a test scores at most 1


_SHARED: dict[tuple, IoiCodeReward] = {}


def ioi_code_reward(test_batch_size: int = 1, provider_type: str = "piston", sandbox: str = "namespaces"):
    """The built-in `ioi_code` reward (its pool and sandboxes made once per process and setting)."""
    key = (test_batch_size, provider_type, sandbox)
    if key not in _SHARED:
        _SHARED[key] = IoiCodeReward(test_batch_size, provider_type, sandbox)
    return _SHARED[key]
