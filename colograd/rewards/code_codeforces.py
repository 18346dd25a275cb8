"""open-r1's `cf_code` reward (huggingface/open-r1 @ 1416fa0c, `cf_code_reward` and
`utils/competitive_programming/cf_scoring.py`), with the judge of open-r1's Piston package (guipenedo/piston @ 7a38da2,
`packages/codeforces/1.0.0/compile` and `run`), run in colograd's sandbox instead of on Piston workers.

For a completion on a row of open-r1/codeforces (verifiable-prompts: `id`, `language`, `official_tests`,
`generated_checker`, `time_limit`, `memory_limit`, `input_mode`):

    code        the last ```` ```<language> ```` block of the completion's last message, `language` the row's
                (python or cpp)
    tests       the row's `official_tests`, then the problem's generated tests from
                ``$CF_TESTS_FOLDER/test_cases_<contest:04d>.parquet`` (none when the contest has no file)
    compile     C++: ``g++ -DONLINE_JUDGE -O2 -std=c++17 -pipe -s`` (the package's c++17, the language open-r1
                asks for), inside a sandbox; Python runs as it is
    run         each test a fresh execution in the completion's sandbox (`Sandbox.session`): the input with each
                line's trailing \\r removed on stdin (or as input.txt, the output read from output.txt, where
                `input_mode` is "file"); `time_limit` seconds (wall time, here not counting waits for a CPU),
                `memory_limit` MB of address space, the stack as large as the memory
    verdict     a test passes when the program exits 0 and: with a `generated_checker`, the checker (in a sandbox
                of its own) exits 0 printing 1 or 100 (whitespace aside), given the input, the expected output
                and the program's output, empty lines removed; without one, the two outputs are equal once "yes"
                and "no" (whole words, any case) are upper-cased and all whitespace is collapsed
                (`normalize_output`)
    score       no tests: None; no code block: -1.0; a program that does not compile: -0.1; else by
                `scoring_mode` (`score`): pass_fail 1.0 when every test passes, else 0.0 (the tests stop at the
                first failure); partial the fraction passed; weighted_sum pass_fail + 0.1 × the fraction

open-r1's `test_batch_size` (the recipe's `code_eval_test_batch_size`) is how many tests Piston ran at once; it
does not change the score, and is accepted for that. A row whose `language` is neither python nor cpp, or that lacks
a column the judge reads, is refused in one line (open-r1 gives such rows no reward, or fails every test).
"""

import json
import logging
import math
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from colograd.errors import ConfigError
from colograd.rewards.code import completion_text, each_row, extract_code
from colograd.rewards.code_checker import (
    COMPILE_LIMITS,
    Checker,
    CheckerError,
    Checkers,
    compile_cpp,
    row_checker,
)
from colograd.rewards.sandbox import Execution, Sandbox, SandboxLimits
from colograd.rewards.sandbox_session import Session, said_overloaded

logger = logging.getLogger(__name__)

SCORING_MODES = ("pass_fail", "partial", "weighted_sum")
LANGUAGES = ("python", "cpp")
NO_COMPILE_REWARD = -0.1  # open-r1's score_submission defaults
NO_SUBMISSION_REWARD = -1.0
CPP_FLAGS = ("-DONLINE_JUDGE", "-O2", "-std=c++17", "-pipe", "-s")
COLUMNS = ("id", "language", "official_tests", "generated_checker", "time_limit", "memory_limit", "input_mode")
TESTS_FOLDER = "CF_TESTS_FOLDER"
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE | re.ASCII)
_SPACE = re.compile(r"[ \t\n\v\f\r]+")  # tr's [:space:] in the C locale


def score(passed: int, total: int, scoring_mode: str) -> float:
    """open-r1's score of `passed` of `total` tests (total > 0; under pass_fail, `passed` counts up to the first
    failure)."""
    pass_fail = 1.0 if passed == total else 0.0
    if scoring_mode == "pass_fail":
        return pass_fail
    if scoring_mode == "partial":
        return passed / total
    if scoring_mode == "weighted_sum":
        return pass_fail + 0.1 * (passed / total)
    raise ValueError(f"Invalid scoring mode: {scoring_mode}")


def submission_score(code: str, total: int, compiled: bool, passed: int, scoring_mode: str) -> float | None:
    """A completion's reward as open-r1's `score_submission` decides it: None without tests, -1.0 without code,
    -0.1 when it does not compile, else `score`."""
    if total == 0:
        return None
    if not code:
        return NO_SUBMISSION_REWARD
    if not compiled:
        return NO_COMPILE_REWARD
    return score(passed, total, scoring_mode)


def tally(verdicts: Iterable[str | None], scoring_mode: str) -> tuple[int, str | None]:
    """(tests passed, the first failure's reason) over `verdicts` (each test's failure, None when it passed), taken
    one at a time: under pass_fail the first failure ends the tests, as open-r1's batches do; a test the machine
    stopped as overloaded at every try ends them, its reason "overloaded" (no score can be given)."""
    passed, reason = 0, None
    for failure in verdicts:
        if failure == "overloaded":  # the machine's verdict at every try (`Session.case`): no score can be given
            return passed, failure
        passed += failure is None
        reason = reason or failure
        if failure is not None and scoring_mode == "pass_fail":
            break
    return passed, reason


def normalize_output(text: str) -> str:
    """The Piston package's `normalize_output`: whole-word yes / no in any case upper-cased, then every run of
    whitespace (line breaks included) one space, none at the ends. Two outputs are equal after it (``diff -b``)."""
    return " ".join(_SPACE.split(_YES_NO.sub(lambda m: m.group(1).upper(), text))).strip()


def without_empty_lines(text: str) -> str:
    """``sed '/^$/d'``: the lines that are empty removed (a line of spaces stays)."""
    lines = text.split("\n")
    kept = [line for line in (lines[:-1] if text.endswith("\n") else lines) if line]
    return "".join(f"{line}\n" for line in kept)


def unix_lines(text: str) -> str:
    """``sed 's/\\r$//'``: each line's trailing carriage return removed."""
    return re.sub(r"\r(?=\n|$)", "", text)


def problem_limits(time_limit: float, memory_limit: float) -> SandboxLimits:
    """A judge's limits for a program: `time_limit` seconds of wall time (not counting waits for a CPU), `memory_limit`
    MB of address space, the stack as large as the memory (the judges' ``ulimit -s unlimited``)."""
    memory = max(1, math.ceil(memory_limit))
    return replace(
        SandboxLimits(),
        wall_s=time_limit,
        cpu_s=max(1, math.ceil(time_limit)),
        memory_mib=memory,
        stack_mib=memory,
        file_mib=256,
        disk_mib=256,
        output_kib=64 << 10,
    )


@dataclass(frozen=True)
class Problem:
    """A row, as the judge reads it."""

    id: str
    language: str
    tests: tuple[tuple[str, str], ...]
    checker: Checker | None
    time_limit: float
    memory_limit: float
    input_mode: str


def generated_tests(folder: str, problem_id: str) -> tuple[tuple[str, str], ...]:
    """The problem's generated tests: its rows of ``test_cases_<contest:04d>.parquet`` in `folder` (none when the
    contest has no file), as open-r1's `get_generated_tests` reads them."""
    contest = problem_id.split("/")[0]
    try:
        path = os.path.join(folder, f"test_cases_{int(contest):04d}.parquet")
    except ValueError:
        raise ConfigError(f"cf_code: problem id {problem_id!r} does not start with a contest number; give "
                          "open-r1/codeforces' ids (<contest>/<index>)") from None  # fmt: skip
    return _contest_tests(path).get(problem_id, ())


@lru_cache(maxsize=32)  # open-r1's
def _contest_tests(path: str) -> dict[str, tuple[tuple[str, str], ...]]:
    if not os.path.exists(path):
        return {}
    try:
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(f"cf_code: reading {path} needs pyarrow; pip install pyarrow") from None
    table = pyarrow.parquet.read_table(path, columns=["problem_id", "input", "output"]).to_pydict()
    grouped: dict[str, list[tuple[str, str]]] = {}
    for problem, stdin, expected in zip(table["problem_id"], table["input"], table["output"], strict=True):
        grouped.setdefault(problem, []).append((stdin, expected))
    return {problem: tuple(tests) for problem, tests in grouped.items()}


def read_problem(row: dict[str, Any], tests_folder: str | None) -> Problem:
    """The judge's view of one row; `tests_folder` None leaves the generated tests out (a preflight's check).

    Raises:
        ConfigError: a column is missing, the language is neither python nor cpp, the official tests or the
            checker cannot be read (one line, with the fix).
    """
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ConfigError(f"cf_code: the rows lack {', '.join(missing)}; give open-r1/codeforces' columns "
                          f"({', '.join(COLUMNS)}), generated_checker null where the output is compared")  # fmt: skip
    if row["language"] not in LANGUAGES:
        raise ConfigError(f"cf_code: a row's language is {row['language']!r}; give python or cpp (open-r1 scores "
                          "no other)")  # fmt: skip
    official = row["official_tests"]
    try:
        official = json.loads(official) if isinstance(official, str) else official or []
        tests = tuple((t["input"], t["output"]) for t in official)
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"cf_code: a row's official_tests are not a list of {{'input', 'output'}} ({err!r}); "
                          "fix the row") from None  # fmt: skip
    if tests_folder is not None:
        tests += generated_tests(tests_folder, str(row["id"]))
    try:
        checker = row_checker("generated_checker", row["generated_checker"]) if row["generated_checker"] else None
    except CheckerError as err:
        raise ConfigError(f"cf_code: {err}") from None
    return Problem(str(row["id"]), row["language"], tests, checker, float(row["time_limit"]),
                   float(row["memory_limit"]), str(row["input_mode"]))  # fmt: skip


def check_cf_rows(
    reward_funcs: list,
    column_names: list[str],
    read: Callable[[list[str]], dict[str, list] | Iterable[dict[str, list]]],
    name: str,
    also_given: Sequence[str] = (),
) -> None:
    """Every row as `cf_code` will read it (its generated tests aside), before any weights are loaded or engine
    started; nothing is read without a `CfCodeReward` among `reward_funcs` (`check_code_rows`' arguments).

    Raises:
        ConfigError: in one line, the first row `cf_code` cannot judge: the row and the problem.
    """
    if not any(isinstance(f, CfCodeReward) for f in reward_funcs) or any(c in COLUMNS for c in also_given):
        return  # no cf_code, or the rows' problems are an environment's to give
    missing = [c for c in COLUMNS if c not in column_names]
    if missing:
        raise ConfigError(f"reward function 'cf_code': dataset {name!r} lacks {', '.join(missing)}; give "
                          f"open-r1/codeforces' columns ({', '.join(COLUMNS)})")  # fmt: skip
    for index, row in each_row(read([c for c in COLUMNS if c in column_names])):
        try:
            read_problem(row, None)
        except ConfigError as err:
            raise ConfigError(f"reward function 'cf_code': dataset {name!r} row {index}: "
                              f"{str(err).removeprefix('cf_code: ')}") from None  # fmt: skip


class JudgedReward:
    """What open-r1's judged rewards (`cf_code`, `ioi_code`) share: a sandbox for the programs and one that compiles
    them, a pool that judges a call's completions at once, and the call itself: each completion's code judged on its
    row (`judge`), the first failures logged as `<name>_failure`."""

    __name__ = "judged"

    def __init__(self, sandbox: str, workers: int | None, compiles: str) -> None:
        """`compiles`: why the reward needs g++, said where the machine has none."""
        if sandbox not in ("namespaces", "none"):
            raise ConfigError(f"code_sandbox: {sandbox!r} is not one of namespaces, none.")
        if shutil.which("g++") is None:
            raise ConfigError(f"reward_funcs: {self.__name__}: this machine has no g++ ({compiles}); install g++")
        self.isolated = sandbox == "namespaces"
        self.sandbox = Sandbox(SandboxLimits(), isolated=self.isolated)
        self.compiler = self.sandbox.with_limits(COMPILE_LIMITS)
        self._pool = ThreadPoolExecutor(workers or len(os.sched_getaffinity(0)),
                                        thread_name_prefix=f"colograd-{self.__name__}")  # fmt: skip
        self._lock = threading.Lock()

    def __call__(
        self, completions: list, log_extra: Callable[[str, list], None] | None = None, **columns: Any
    ) -> list[float | None]:
        """Each completion's reward on its row (the dataset's columns, one value per completion)."""
        problems = self.rows(columns, len(completions))
        futures = [
            self._pool.submit(self.judge, extract_code(completion_text(c), p.language), p)
            for c, p in zip(completions, problems, strict=True)
        ]
        results = [f.result() for f in futures]
        if log_extra is not None:
            log_extra(f"{self.__name__}_failure", [why for _, why in results])
        return [reward for reward, _ in results]

    def rows(self, columns: dict[str, list], n: int) -> list:
        """The `n` rows of a call, as `judge` takes them (each with the `language` of its code block)."""
        raise NotImplementedError

    def judge(self, code: str, problem: Any) -> tuple[float | None, str | None]:
        """(the reward, the first failure's reason or None) of `code` on `problem`, in this thread."""
        raise NotImplementedError


class CfCodeReward(JudgedReward):
    """open-r1's `cf_code` on colograd's sandbox (the module's docstring says what it computes).

    Args:
        test_batch_size: open-r1's; tests Piston ran at once. Accepted; the score does not depend on it.
        scoring_mode: pass_fail, partial or weighted_sum (open-r1's `code_eval_scoring_mode`).
        sandbox: "namespaces" (the sandbox), or "none": rlimits and a temporary folder only (trusted code).
        workers: completions judged at once; None: one per core this process may use.
        tests_folder: the generated tests' folder; None: ``$CF_TESTS_FOLDER``, as open-r1.

    Raises:
        ConfigError: an unknown scoring mode or sandbox; no tests folder, or one that does not exist (open-r1
            scores nothing without it); no g++ on this machine.
    """

    __name__ = "cf_code"

    def __init__(
        self,
        test_batch_size: int = 1,
        scoring_mode: str = "weighted_sum",
        sandbox: str = "namespaces",
        workers: int | None = None,
        tests_folder: str | None = None,
    ) -> None:
        if scoring_mode not in SCORING_MODES:
            raise ConfigError(f"code_eval_scoring_mode: {scoring_mode!r} is not one of {', '.join(SCORING_MODES)}.")
        folder = tests_folder or os.environ.get(TESTS_FOLDER)
        if not folder or not os.path.isdir(folder):
            said = f"{TESTS_FOLDER}={folder} does not exist" if folder else f"{TESTS_FOLDER} is not set"
            raise ConfigError(
                f"reward_funcs: cf_code: {said}; open-r1's cf_code reads each problem's generated tests from there: "
                "download them (open-r1/codeforces' generated tests) and set it, or point it at an empty folder "
                "to judge on official_tests only."
            )
        super().__init__(sandbox, workers, "open-r1 compiles C++ with it")
        self.test_batch_size, self.scoring_mode, self.tests_folder = test_batch_size, scoring_mode, folder
        self.checkers = Checkers(isolated=self.isolated)

    def rows(self, columns: dict[str, list], n: int) -> list[Problem]:
        return [read_problem({c: columns[c][i] for c in COLUMNS if c in columns}, self.tests_folder) for i in range(n)]

    def judge(self, code: str, problem: Problem) -> tuple[float | None, str | None]:
        """(the reward, the first failure's reason or None) of `code` on `problem`, in this thread."""
        if not problem.tests or not code:
            return submission_score(code, len(problem.tests), True, 0, self.scoring_mode), "no code block"
        files: dict[str, bytes] = {}
        if problem.language == "cpp":
            binary, error = compile_cpp(self.compiler, code, CPP_FLAGS)
            if binary is None:
                return NO_COMPILE_REWARD, f"compile error ({error})"
            files["a.out"] = binary
        passed, reason = self._run_tests(code, files, problem)
        if reason == "overloaded":  # the machine's fault, not the program's: no reward, not a 0
            said_overloaded()
            return None, reason
        return submission_score(code, len(problem.tests), True, passed, self.scoring_mode), reason

    def _run_tests(self, code: str, files: dict[str, bytes], problem: Problem) -> tuple[int, str | None]:
        sandbox = self.sandbox.with_limits(problem_limits(problem.time_limit, problem.memory_limit))
        argv = self._argv(problem, sandbox)

        program = code if problem.language == "python" else ""  # C++ runs its binary, not main.py
        session = sandbox.session(program, argv, files)
        check = None if problem.checker is None else self.checkers.session(problem.checker)

        def verdicts() -> Iterator[str | None]:
            for stdin, expected in problem.tests:
                stdin = unix_lines(stdin)
                if problem.input_mode == "file":
                    execution = session.case("", {"input.txt": stdin})
                else:
                    execution = session.case(stdin)
                yield self._verdict(execution, stdin, expected, check)

        try:
            return tally(verdicts(), self.scoring_mode)
        finally:
            session.close()
            if check is not None:
                check.close()

    @staticmethod
    def _verdict(execution: Execution, stdin: str, expected: str, check: Session | None) -> str | None:
        """Why a test failed (None: it passed), as the Piston package's run script decides; where the machine stopped
        the checker as overloaded at every try (`Session.case`), "overloaded": unknown, not a wrong answer."""
        if not execution.ok:
            return execution.reason
        if check is None:
            same = normalize_output(expected) == normalize_output(execution.stdout)
            return None if same else "wrong answer"
        correct = without_empty_lines(unix_lines(expected.rstrip("\n") + "\n"))
        files = {"input.txt": stdin, "correct_output.txt": correct,
                 "solution_output.txt": without_empty_lines(execution.stdout)}  # fmt: skip
        done = check.case("", files)
        if done.reason == "overloaded":
            return "overloaded"
        return None if done.ok and "".join(done.stdout.split()) in ("1", "100") else "wrong answer (checker)"

    @staticmethod
    def _argv(problem: Problem, sandbox: Sandbox) -> list[str] | None:
        """What runs: the compiled program or the interpreter on main.py; where the problem reads input.txt and
        writes output.txt, a shell that runs it silenced, then prints output.txt, exiting with its status."""
        program = "./a.out" if problem.language == "cpp" else f"{sandbox.python} -I -X utf8 main.py"
        if problem.input_mode != "file":
            return [program] if problem.language == "cpp" else None
        return ["/bin/sh", "-c", f"{program} >/dev/null 2>&1; s=$?; cat output.txt 2>/dev/null; exit $s"]


_SHARED: dict[tuple, CfCodeReward] = {}


def cf_code_reward(test_batch_size: int = 1, scoring_mode: str = "weighted_sum", sandbox: str = "namespaces"):
    """The built-in `cf_code` reward (its pool and sandbox made once per process and setting)."""
    key = (test_batch_size, scoring_mode, sandbox, os.environ.get(TESTS_FOLDER))
    if key not in _SHARED:
        _SHARED[key] = CfCodeReward(test_batch_size, scoring_mode, sandbox)
    return _SHARED[key]
