"""A problem's own checker program (C++ with testlib's interface, or open-r1/codeforces' Python `generated_checker`):
its verdict is the only one, it runs in a sandbox of its own, and a broken checker is the problem's fault, not the
program's zero."""

import logging
import threading

import pytest

from colograd.errors import ConfigError
from colograd.rewards import code_checker
from colograd.rewards.code import CodeReward, check_code_rows
from colograd.rewards.code_checker import Checker, CheckerBroken, Checkers, row_checker
from colograd.rewards.sandbox import SandboxLimits

LIMITS = SandboxLimits(wall_s=10.0, cpu_s=2, memory_mib=256)

# Any-answer problem: print a permutation of 1..n with no p[i] == i (a derangement); the expected output is one.
CASES = [("2\n", "2 1\n"), ("3\n", "2 3 1\n"), ("5\n", "2 3 4 5 1\n")]
ROTATE_LEFT = "n = int(input())\nprint(*([n] + list(range(1, n))))\n"  # right, and never the expected output
SHIFT = "n = int(input())\nprint(*(list(range(2, n + 1)) + [1]))\n"  # right, and the expected output itself
IDENTITY = "n = int(input())\nprint(*range(1, n + 1))\n"  # a permutation, not a derangement
GARBAGE = "input()\nprint('no idea')\n"
CPP = r"""
#include <cstdio>
#include <vector>
int main(int argc, char **argv) {
    FILE *in = fopen(argv[1], "r"), *out = fopen(argv[2], "r");
    int n;
    if (fscanf(in, "%d", &n) != 1) return 3;
    std::vector<int> seen(n + 1, 0);
    for (int i = 1; i <= n; i++) {
        int p;
        if (fscanf(out, "%d", &p) != 1 || p < 1 || p > n || seen[p] || p == i) return 1;
        seen[p] = 1;
    }
    int extra;
    return fscanf(out, "%d", &extra) == 1 ? 1 : 0;
}
"""
PYTHON = """
import sys
n = int(open(sys.argv[1]).read())
words = open(sys.argv[3]).read().split()
ok = len(words) == n and sorted(words, key=int) == [str(i) for i in range(1, n + 1)]
ok = ok and all(int(w) != i + 1 for i, w in enumerate(words))
print(1 if ok else 0)
"""


def block(code: str) -> str:
    return f"```python\n{code}```\n"


def row(**checker) -> dict:
    return {"official_tests": [{"input": i, "output": o} for i, o in CASES], "id": "1234A", **checker}


def score(reward, programs, r):
    return reward([block(p) for p in programs], **{k: [v] * len(programs) for k, v in r.items()})


@pytest.fixture(scope="module")
def code() -> CodeReward:
    return CodeReward(limits=LIMITS, workers=2)


@pytest.mark.parametrize("kind", ["checker", "generated_checker"])
def test_an_any_answer_problem_is_scored_by_its_checker(code, kind):
    r = row(**{kind: CPP if kind == "checker" else PYTHON})
    assert score(code, [ROTATE_LEFT, SHIFT, IDENTITY, GARBAGE], r) == [1.0, 1.0, 0.0, 0.0]
    # Without the checker, the tokens must be the expected ones: the other right answer fails from n = 3 on (n = 2
    # has one derangement only).
    plain = {k: v for k, v in r.items() if k != kind}
    assert score(code, [ROTATE_LEFT, SHIFT], plain) == [1 / 3, 1.0]


def test_a_cpp_checker_judges_without_the_sandbox_too():
    """`code_sandbox: none` runs the checker from its own folder as well: its binary was looked for at the sandbox's
    /sandbox/checker, which only the sandbox has, and every completion got no reward."""
    unsandboxed = CodeReward(limits=LIMITS, workers=2, sandbox="none")
    assert score(unsandboxed, [ROTATE_LEFT, SHIFT, IDENTITY], row(checker=CPP)) == [1.0, 1.0, 0.0]


def test_the_checker_never_sees_the_programs_sandbox(code):
    # The program leaves files where a checker in its sandbox would find them; the checker accepts only where it
    # finds none of them, and only its three files and its own beside it.
    plants = (
        "import os\nfor path in ('planted', '/tmp/planted', 'solution_output.txt'):\n    open(path, 'w').write('1')\n"
    )
    looks = (
        "import os, sys\n"
        "mine = sorted(os.listdir('.'))\n"
        "print(1 if 'planted' not in os.listdir('/tmp') and mine == sorted(['checker.py', 'main.py', 'input.txt', "
        "'correct_output.txt', 'solution_output.txt']) and open(sys.argv[3]).read() == 'out\\n' else 0)\n"
    )
    r = {"official_tests": [{"input": "", "output": "out\n"}], "generated_checker": looks}
    assert score(code, [plants + "print('out')\n"], r) == [1.0]


def test_a_checker_that_does_not_compile_is_the_problems_fault(code, caplog):
    logged = {}
    r = row(checker="int main( { return 0; }\n")
    with caplog.at_level(logging.WARNING):
        rewards = code([block(ROTATE_LEFT)] * 2, **{k: [v] * 2 for k, v in r.items()},
                       log_extra=lambda column, values: logged.update({column: values}))  # fmt: skip
    assert rewards == [None, None]
    assert logged["code_failure"][0].startswith("problem: the checker does not compile")
    said = [rec.getMessage() for rec in caplog.records if "does not compile" in rec.getMessage()]
    assert len(said) == 1 and "problem id '1234A'" in said[0]


def test_a_checker_that_rejects_the_expected_output_is_the_problems_fault(code):
    crashes = "raise SystemExit('this checker is broken')\n"
    assert score(code, [ROTATE_LEFT], row(generated_checker=crashes)) == [None]
    silent = "print('accepted')\n"  # neither 1 nor 0, whatever the output
    assert score(code, [ROTATE_LEFT], row(generated_checker=silent)) == [None]


def test_a_checker_that_crashes_only_on_the_programs_output_fails_the_case(code):
    # A checker that cannot parse what the program printed, but accepts the expected output: the program's output
    # was wrong, not the checker, so a policy cannot turn its zero into no reward by printing what crashes it.
    strict = "import sys\nwords = list(map(int, open(sys.argv[3]).read().split()))\nprint(1)\n"
    assert score(code, [GARBAGE, SHIFT], row(generated_checker=strict)) == [0.0, 1.0]
    testlib_fail = "int main() { return 3; }\n"  # testlib's 'fail' on every output, the expected one too
    assert score(code, [SHIFT], row(checker=testlib_fail)) == [None]


def test_checkers_are_compiled_once_per_source():
    checkers = Checkers(isolated=True)
    checker = row_checker("checker", CPP)
    first = checkers._binary(checker)
    assert checkers._binary(row_checker("checker", CPP)) is first
    broken = row_checker("checker", "not c++")
    with pytest.raises(CheckerBroken, match="does not compile"):
        checkers._binary(broken)
    with pytest.raises(CheckerBroken):  # the failure is kept, not compiled again
        checkers._binary(broken)


# testlib's own real-number checker, as Polygon and Codeforces problems ship it (github.com/MikeMirzayanov/testlib
# @ 1e4e8a2, checkers/rcmp6.cpp, MIT): numbers equal within 1e-6, absolute or relative.
RCMP6 = r"""
#include "testlib.h"

using namespace std;

const double EPS = 1E-6;

int main(int argc, char *argv[]) {
    setName("compare two sequences of doubles, max absolute or relative  error = %.7f", EPS);
    registerTestlibCmd(argc, argv);

    int n = 0;
    double j = 0, p = 0;

    while (!ans.seekEof()) {
        n++;
        j = ans.readDouble();
        p = ouf.readDouble();
        if (!doubleCompare(j, p, EPS)) {
            quitf(_wa, "%d%s numbers differ - expected: '%.7f', found: '%.7f', error = '%.7f'",
                  n, englishEnding(n).c_str(), j, p, doubleDelta(j, p));
        }
    }

    if (n == 1)
        quitf(_ok, "found '%.7f', expected '%.7f', error '%.7f'", p, j, doubleDelta(j, p));

    quitf(_ok, "%d numbers", n);
}
"""
# The derangement checker above, written with testlib's streams as a problem's author would (input `inf`, the
# program's output `ouf`), included the other way (<testlib.h>).
DERANGEMENT = r"""
#include <testlib.h>
#include <vector>
int main(int argc, char *argv[]) {
    registerTestlibCmd(argc, argv);
    int n = inf.readInt();
    std::vector<int> seen(n + 1, 0);
    for (int i = 1; i <= n; i++) {
        int p = ouf.readInt(1, n, "p_i");
        if (seen[p] || p == i) quitf(_wa, "p_%d = %d is repeated or in place", i, p);
        seen[p] = 1;
    }
    if (!ouf.seekEof()) quitf(_pe, "extra output");
    quitf(_ok, "a derangement of %d", n);
}
"""


def test_the_checkers_problems_ship_with_testlib_compile_and_judge(code):
    """testlib.h ships with colograd: a row's testlib checker compiles as the problem ships it (it used to be refused
    unless testlib.h was installed on the machine), and its verdict is the only one."""
    thirds = [(f"{n}\n", f"{n / 3:.9f}\n") for n in (1, 2, 100)]
    r = {"official_tests": [{"input": i, "output": o} for i, o in thirds], "checker": RCMP6}
    close = "print(f'{int(input()) / 3:.7f}')\n"  # 7 digits: within 1e-6 of the expected 9
    off = "print(int(input()) / 3 + 1e-4)\n"
    assert score(code, [close, off, GARBAGE], r) == [1.0, 0.0, 0.0]
    assert score(code, [close], {k: v for k, v in r.items() if k != "checker"}) == [0.0]  # plain lines differ
    assert score(code, [ROTATE_LEFT, SHIFT, IDENTITY, GARBAGE], row(checker=DERANGEMENT)) == [1.0, 1.0, 0.0, 0.0]


def test_one_problems_checker_compiling_holds_up_no_other_problem(monkeypatch):
    """A compile waits only for its own source: another problem's checker compiles (or is found compiled) meanwhile,
    and two completions of one problem compile its checker once. (All compiles used to wait on one lock.)"""
    checkers, started, other_done, compiled = Checkers(isolated=True), threading.Event(), threading.Event(), []

    def compile(checker):
        compiled.append(checker.source)
        if checker.source == "slow":
            started.set()
            return b"slow" if other_done.wait(30) else CheckerBroken("the other problem's checker waited for this one")
        return checker.source.encode()

    monkeypatch.setattr(checkers, "_compile", compile)
    slow = [threading.Thread(target=checkers._binary, args=(Checker("cpp", "slow"),)) for _ in range(2)]
    slow[0].start()
    assert started.wait(30)
    slow[1].start()  # the same problem's: waits for the compile under way
    assert checkers._binary(Checker("cpp", "other")) == b"other"
    other_done.set()
    for thread in slow:
        thread.join()
    assert checkers._binary(Checker("cpp", "slow")) == b"slow" and compiled == ["slow", "other"]


def test_rows_whose_checker_cannot_run_here_are_refused_before_the_run(code, monkeypatch):
    monkeypatch.setattr(code_checker.shutil, "which", lambda name: None)  # a machine without g++
    for bad, said in [
        ({"checker": '#include "testlib.h"\nint main() {}\n'}, "is a C\\+\\+ checker and this machine has no g\\+\\+"),
        ({"generated_checker": 3}, "generated_checker is a int, not the checker's source"),
    ]:
        columns = {"official_tests": [[{"input": "1", "output": "1"}]], **{k: [v] for k, v in bad.items()}}
        with pytest.raises(ConfigError, match=said):
            check_code_rows([code], list(columns), lambda names, c=columns: {n: c[n] for n in names}, "cf")


def checker_starved(monkeypatch, executions: int) -> list:
    """The first `executions` runs of any checker read as stopped by an overloaded machine (each really runs; only
    its verdict is replaced): the checker's own executions, not the program's. Returns those replaced."""
    from dataclasses import replace

    replaced = []
    real_session = Checkers.session

    def session(self, checker):
        opened = real_session(self, checker)
        real_case = opened._case  # one try: the session's own retry is what is tested

        def case(stdin, files):
            done = real_case(stdin, files)
            if len(replaced) < executions:
                replaced.append(stdin)
                return replace(done, reason="overloaded", exit_code=None, stdout="")
            return done

        opened._case = case
        return opened

    monkeypatch.setattr(Checkers, "session", session)
    return replaced


@pytest.mark.parametrize("kind", ["checker", "generated_checker"])
def test_a_checker_the_machine_starved_is_run_again_and_never_reads_as_a_wrong_answer(code, monkeypatch, caplog, kind):
    """A checker's execution stopped as "overloaded" runs again in a fresh sandbox, as a program's does: a right
    answer starved twice at its checker still scores 1.0. Starved at every try, the case's verdict is unknown: the
    completion gets no reward (None), neither a wrong answer (before, the checker's failure was settled by its verdict
    on the expected output, which passed: a right answer read as wrong) nor a broken checker."""
    from colograd.rewards.sandbox_session import OVERLOADED_TRIES

    r = row(**{kind: CPP if kind == "checker" else PYTHON})
    replaced = checker_starved(monkeypatch, 2)
    assert score(code, [ROTATE_LEFT], r) == [1.0] and len(replaced) == 2
    replaced = checker_starved(monkeypatch, 100)
    logs = []
    rewards = code(
        [block(ROTATE_LEFT)], log_extra=lambda name, values: logs.append(values), **{k: [v] for k, v in r.items()}
    )
    assert rewards == [None] and logs == [["overloaded"]] and len(replaced) == OVERLOADED_TRIES
    assert "stopped as overloaded 3 times in a row" in caplog.text and "problem" not in caplog.text
