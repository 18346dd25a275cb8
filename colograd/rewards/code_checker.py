"""A problem's own checker program (a special judge): the only verdict on a case's output where a row has one.

Two kinds, as the datasets ship them:

    checker             C++ source, testlib's interface: ``checker input.txt output.txt answer.txt`` (the case's
                        input, the program's output, the expected output); exit 0 accepts, 1 (wrong answer) and 2
                        (presentation error) reject. Compiled once per source with the machine's g++, inside the
                        sandbox, beside testlib.h (0.9.45, MIT, shipped in colograd/rewards/testlib/), so the
                        checkers Codeforces and Polygon problems ship (`#include "testlib.h"`) compile as they are
    generated_checker   Python source, open-r1/codeforces' interface: ``python checker.py input.txt
                        correct_output.txt solution_output.txt``; accepts when it exits 0 with 1 as the last word of
                        its output, rejects with 0

The checker runs in a sandbox of its own (`colograd.rewards.sandbox_session.Session`), one per completion with a fresh
folder for each case: it sees the three files and nothing of the program's sandbox, processes or files. Its verdict is
the only one. Any other outcome (a crash, a time-out, testlib's "fail" exit code 3, output that is neither 1 nor 0)
is decided by running the checker once more with the expected output as the program's: if it does not accept the
expected output either, the checker is broken, the problem's fault (`CheckerBroken`), and the completion is not
scored by this reward (None), with a warning naming the problem; if it does, the program's output is what it could
not take, and the case is failed. A checker that does not compile is the problem's fault in the same way.
"""

import base64
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from colograd.rewards.sandbox import Sandbox, SandboxLimits
from colograd.rewards.sandbox_session import Overloaded, Session

KINDS = {"checker": "cpp", "generated_checker": "python"}
# What compiling one checker, and checking one case, may use (the problem's programs, not the policy's: generous).
COMPILE_LIMITS = SandboxLimits(
    wall_s=120.0, cpu_s=60, memory_mib=2048, processes=32, file_mib=64, disk_mib=128, output_kib=32 << 10
)
CHECK_LIMITS = SandboxLimits(wall_s=30.0, cpu_s=10, memory_mib=1024, file_mib=64, disk_mib=256)
# testlib (github.com/MikeMirzayanov/testlib @ 1e4e8a2, its LICENSE beside it): handed to each checker's compile as a
# file of its folder, found by `#include "testlib.h"` and, with -I., by `#include <testlib.h>`.
TESTLIB = os.path.join(os.path.dirname(__file__), "testlib", "testlib.h")
CHECKER_FLAGS = ("-O2", "-std=gnu++17", "-I.")
_COMPILE = """\
import base64, subprocess, sys
done = subprocess.run(["g++", *{flags}, "-o", "program", "program.cpp"], capture_output=True)
if done.returncode != 0:
    sys.stderr.write(done.stderr.decode("utf-8", "replace")[-1500:])
    sys.exit(3)
sys.stdout.write(base64.b64encode(open("program", "rb").read()).decode())
"""


class CheckerError(ValueError):
    """A row's checker cannot be used as given; the message (one line) names the problem and the fix."""


class CheckerBroken(Exception):
    """The checker failed where the problem is at fault: it did not compile, or it does not accept the expected
    output. The message says which."""


@dataclass(frozen=True)
class Checker:
    """A problem's checker program: its language ("cpp" or "python") and source."""

    language: str
    source: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.language}\0{self.source}".encode()).hexdigest()[:12]


def row_checker(column: str, source: object) -> Checker:
    """The checker a row's `column` ("checker" or "generated_checker") holds.

    Raises:
        CheckerError: it is not text, or it is C++ and this machine has no g++.
    """
    if not isinstance(source, str) or not source.strip():
        raise CheckerError(f"{column} is a {type(source).__name__}, not the checker's source; give its text, or null")
    language = KINDS[column]
    if language == "cpp":
        if shutil.which("g++") is None:
            raise CheckerError(
                f"{column} is a C++ checker and this machine has no g++; install g++, or keep the rows without one"
            )
    return Checker(language, source)


class Checkers:
    """Compiles checkers (once per source, in the sandbox) and opens their sessions.

    Args:
        isolated: whether the checkers run in the sandbox's namespaces (as the programs do).
    """

    def __init__(self, isolated: bool) -> None:
        self.isolated = isolated
        self._sandbox: Sandbox | None = None
        self._compiler: Sandbox | None = None
        self._binaries: dict[str, bytes | CheckerBroken] = {}
        self._lock = threading.Lock()  # the sandboxes and the maps below, held only to read or add to them
        self._compiling: dict[str, threading.Lock] = {}  # one per source: a compile waits only for its own source

    def session(self, checker: Checker) -> Session:
        """A session that checks one case per call of `check`.

        Raises:
            CheckerBroken: a C++ checker that does not compile.
        """
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(CHECK_LIMITS, isolated=self.isolated)
        if checker.language == "python":
            argv = [self._sandbox.python, "-I", "checker.py", "input.txt", "correct_output.txt", "solution_output.txt"]
            return self._sandbox.session("", argv, {"checker.py": checker.source.encode()})
        binary = self._binary(checker)
        return self._sandbox.session("", ["./checker", "input.txt", "output.txt", "answer.txt"],
                                     {"checker": binary})  # fmt: skip

    def _binary(self, checker: Checker) -> bytes:
        """The checker's binary, compiled at its first use; the completions of other problems go on meanwhile (their
        checkers compile beside it, or are already compiled)."""
        with self._lock:
            own = self._compiling.setdefault(checker.digest, threading.Lock())
        with own:
            with self._lock:
                found = self._binaries.get(checker.digest)
            if found is None:
                found = self._compile(checker)
                with self._lock:
                    self._binaries[checker.digest] = found
        if isinstance(found, CheckerBroken):
            raise found
        return found

    def _compile(self, checker: Checker) -> bytes | CheckerBroken:
        with self._lock:
            if self._compiler is None:
                self._compiler = Sandbox(COMPILE_LIMITS, isolated=self.isolated)
        with open(TESTLIB, "rb") as header:
            binary, error = compile_cpp(self._compiler, checker.source, CHECKER_FLAGS, {"testlib.h": header.read()})
        return CheckerBroken(f"the checker does not compile ({error})") if binary is None else binary


def compile_cpp(
    compiler: Sandbox, source: str, flags: Sequence[str], headers: dict[str, bytes] | None = None
) -> tuple[bytes | None, str]:
    """`source` compiled with the machine's g++ and `flags`, inside `compiler` (a sandbox: the source is untrusted,
    and g++ runs whatever its includes and flags make it read, within the sandbox's view and limits), with `headers`
    beside it in its folder.

    Returns:
        (the executable, "") or (None, why it did not compile: the reason and g++'s last line).
    """
    script = _COMPILE.format(flags=json.dumps(list(flags)))
    files = {"program.cpp": source.encode(), **(headers or {})}
    with compiler.session(script, files=files) as session:
        done = session.case("")
    if not done.ok:
        last = (done.stderr.strip().splitlines() or [done.reason or "no message"])[-1][:300]
        return None, f"{done.reason}: {last}"
    return base64.b64decode(done.stdout), ""


class CheckRun:
    """One completion's checking: a checker session (built again where a case killed the last sandbox: `Session`).

    Raises:
        CheckerBroken: (at construction) a C++ checker that does not compile.
    """

    def __init__(self, checkers: Checkers, checker: Checker) -> None:
        self.checkers, self.checker = checkers, checker
        self.session = checkers.session(checker)

    def __enter__(self) -> "CheckRun":
        return self

    def __exit__(self, *exc) -> None:
        self.session.close()

    def verdict(self, stdin: str, output: str, expected: str) -> str | None:
        """The checker's verdict on one case: None (accepted), "wrong answer", or "checker: <what>" when it neither
        accepted nor rejected.

        Raises:
            Overloaded: the machine stopped the checker as overloaded at every try (`Session.case`).
        """
        if self.checker.language == "python":
            files = {"input.txt": stdin, "correct_output.txt": expected, "solution_output.txt": output}
        else:
            files = {"input.txt": stdin, "output.txt": output, "answer.txt": expected}
        done = self.session.case("", files)
        if done.reason == "overloaded":
            raise Overloaded
        if self.checker.language == "python":
            words = done.stdout.split()
            if done.ok and words and words[-1] in ("1", "0"):
                return None if words[-1] == "1" else "wrong answer"
            return f"checker: {done.reason or 'printed neither 1 nor 0'}"
        if done.exit_code == 0:
            return None
        if done.exit_code in (1, 2):  # testlib's wrong answer, presentation error
            return "wrong answer"
        return f"checker: {done.reason}"

    def decide(self, stdin: str, output: str, expected: str) -> str | None:
        """`verdict`, where the checker neither accepted nor rejected settled by its verdict on the expected output.

        Raises:
            CheckerBroken: the checker does not accept the expected output either.
        """
        said = self.verdict(stdin, output, expected)
        if said is None or said == "wrong answer":
            return said
        if self.verdict(stdin, expected, expected) is not None:
            raise CheckerBroken(f"the checker does not accept the expected output ({said})")
        return "wrong answer"
