"""Differential: the reference solutions of MBPP's test split (Austin et al. 2021; 500 of the 974 of the full
`mbpp.jsonl`, vendored in `tests/rewards/mbpp/`), through the split harness, at the default limits, on a busy machine,
with reward calls in parallel. Each solution, and a wrong program per task (the solution with its result changed, or
another task's solution under this task's name), must score what one interpreter gives it: the program, the row's setup
and its asserts run together in a plain process, as MBPP's own harness runs them, each assert counted as the reward
counts it. A change to what crosses between the program and the judge that breaks a real test's meaning shows up as a
task whose score differs (task 533 hands the program the builtin type ``int``, which issue 49's split harness sent as a
call-only handle, so the solution's ``isinstance(x, data_type)`` raised TypeError: a right program scored 0).

Also here: the regression tests of what this differential found, and the protections a timed-out execution reports.
"""

import ast
import builtins
import concurrent.futures
import gzip
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from mutations import MUTATE

from colograd.rewards import code_wire
from colograd.rewards.code import CodeReward
from colograd.rewards.code_tests import AssertTests, run_asserts
from colograd.rewards.sandbox import Sandbox, SandboxLimits

DATA = Path(__file__).parent / "mbpp" / "mbpp.jsonl.gz"
# google-research/google-research's mbpp/mbpp.jsonl, byte for byte (tests/rewards/mbpp/README.md says how it was
# checked).
SHA256 = "ccf64ceae9c5403bf50a044cb6d505bfd2a2963ee58338ba268fd65beab92a9f"


def mbpp_rows() -> list[dict]:
    raw = gzip.decompress(DATA.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == SHA256
    return [json.loads(line) for line in raw.splitlines()]


def test_the_vendored_data_is_mbpps_full_set():
    rows = mbpp_rows()
    assert [row["task_id"] for row in rows] == list(range(1, 975))
    assert all(len(row["test_list"]) == 3 and isinstance(row["test_setup_code"], str) for row in rows)


# --- the differential ------------------------------------------------------------------------------------------------

# Runs programs against their rows as MBPP's harness does (program, setup and asserts in one interpreter, one
# namespace), each assert on its own: one job per line on stdin, each in a process of its own (forked from this plain
# interpreter, which imports nothing else: a fresh interpreter costs ~20-80 ms on a busy machine, a fork ~2 ms), killed
# at the timeout; prints, per job, how many asserts passed (those not decided by the timeout failed) and the CPU
# seconds its process used.
ONE_INTERPRETER = """
import json, os, select, signal, sys, time
for line in sys.stdin:
    job = json.loads(line)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        sys.stdin = open(os.devnull)  # not the jobs this interpreter has read ahead
        names = {"__name__": "__main__"}
        try:
            exec(compile(job["program"], "solution.py", "exec"), names)
            exec(compile(job["setup"], "<setup>", "exec"), names)
            for test in job["tests"]:
                try:
                    exec(compile(test, "<test>", "exec"), names)
                    os.write(write, b"1")
                except BaseException:
                    os.write(write, b"0")
        finally:
            os._exit(0)
    os.close(write)
    verdicts, deadline = b"", time.monotonic() + job["timeout"]
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            break
        chunk = os.read(read, 64)
        if not chunk:
            break
        verdicts += chunk
    os.close(read)
    _, _, usage = os.wait4(pid, 0)
    print(verdicts.count(b"1"), usage.ru_utime + usage.ru_stime, flush=True)
"""


def one_interpreter(programs: list[str], rows: list[dict], timeout_s: float = 20.0) -> list[tuple[float, float]]:
    """The share of each row's asserts that its program passes in one plain interpreter, and the CPU seconds it took
    (program, setup and asserts), without the sandbox
    (asserts not decided within `timeout_s` fail, as the reward fails those a killed execution did not decide)."""
    jobs = "".join(
        json.dumps({"program": p, "setup": row["test_setup_code"], "tests": row["test_list"], "timeout": timeout_s})
        + "\n"
        for p, row in zip(programs, rows, strict=True)
    )
    done = subprocess.run([sys.executable, "-I", "-c", ONE_INTERPRETER], input=jobs, capture_output=True, text=True,
                          timeout=len(rows) * (timeout_s + 5), check=True)  # fmt: skip
    passed = [line.split() for line in done.stdout.splitlines()]
    assert len(passed) == len(rows)
    return [(int(n) / len(row["test_list"]), float(cpu)) for (n, cpu), row in zip(passed, rows, strict=True)]


def called_name(row: dict) -> str:
    """The program's function the row's asserts call first (a name the solution defines and the asserts call)."""
    defined = set()
    with warnings.catch_warnings():  # MBPP's regular expressions are plain strings with invalid escapes
        warnings.simplefilter("ignore")
        tree = ast.parse(row["code"])
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    for test in row["test_list"]:
        for node in ast.walk(ast.parse(test)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defined:
                return node.func.id
    raise AssertionError(f"task {row['task_id']}: its asserts call nothing its solution defines")


def wrong_programs(rows: list[dict]) -> list[str]:
    """A wrong program for each task: for an even task_id its solution mutated (`MUTATE`), for an odd one the next
    task's solution, with this task's function bound to that task's own (its values, its exceptions, its arity)."""
    names = [called_name(row) for row in rows]
    wrong = []
    for i, (row, name) in enumerate(zip(rows, names, strict=True)):
        j = (i + 1) % len(rows)
        other = f"{rows[j]['code']}\n{name} = {names[j]}\n"
        wrong.append(row["code"] + MUTATE.format(name=name) if row["task_id"] % 2 == 0 else other)
    return wrong


# MBPP's own test split (its README: task ids 11-510): the rows run here. All 974 solutions and a wrong program for
# each task took 3.3-4 minutes on the project's 2-core machine (and agreed); all 974 solutions and the test split's
# wrong programs, 2 to 4; this, about half that (docs/rewards.md).
TEST_SPLIT = range(11, 511)


@pytest.mark.slow
def test_every_solution_scores_one_and_every_wrong_program_what_one_interpreter_gives_under_load():
    # Both cores kept busy, two reward calls in parallel (the solutions of MBPP's test split, and a wrong program for
    # each of its tasks), at the default limits: each program scores what one interpreter says of it, which for
    # MBPP's solutions is 1.
    everything = mbpp_rows()
    tested = [
        (row, wrong)
        for row, wrong in zip(everything, wrong_programs(everything), strict=True)
        if row["task_id"] in TEST_SPLIT
    ]
    rows = [row for row, _ in tested]
    cases = {
        "solution": (rows, [row["code"] for row in rows]),
        "wrong program": (rows, [wrong for _, wrong in tested]),
    }
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        references = {kind: pool.submit(one_interpreter, given, of) for kind, (of, given) in cases.items()}
        measured = {kind: future.result() for kind, future in references.items()}
    expected = {kind: [score for score, _ in results] for kind, results in measured.items()}
    # A program whose CPU time is within 2x of the sandbox's limit may pass the limit on a loaded machine (task 123's
    # solution takes 4.5 s of the 5: under load, 1/3 once): for it, and only for it, a CPU-time kill is the one
    # other verdict taken. A handful at most, so that every other row keeps its exact comparison.
    near = {kind: [cpu > SandboxLimits().cpu_s / 2 for _, cpu in results] for kind, results in measured.items()}
    print({kind: [row["task_id"] for row, slow in zip(rows, near[kind], strict=True) if slow] for kind in cases})
    assert sum(map(sum, near.values())) < len(rows) / 50, near
    # Solutions that fail their own asserts in one interpreter are compared with that (none do on Python 3.11).
    broken = {row["task_id"]: e for row, e in zip(rows, expected["solution"], strict=True) if e != 1}
    assert len(broken) < len(rows) / 100, broken
    wrong = expected["wrong program"]  # both verdicts, and partial scores, are compared
    assert 0 < wrong.count(1.0) < len(wrong) / 10 and sum(0 < e < 1 for e in wrong) > 5
    code = CodeReward(workers=2)
    logged = {kind: {} for kind in cases}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(os.cpu_count())]  # fmt: skip
    try:
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            scored = {
                kind: pool.submit(code, [f"```python\n{p}```" for p in given],
                                  test_list=[row["test_list"] for row in of],
                                  test_setup_code=[row["test_setup_code"] for row in of],
                                  log_extra=lambda column, values, kind=kind: logged[kind].update({column: values}))
                for kind, (of, given) in cases.items()
            }  # fmt: skip
            rewards = {kind: future.result() for kind, future in scored.items()}
    finally:
        for process in busy:
            process.kill()
            process.wait()
    for kind, (of, _) in cases.items():
        outcomes = zip(of, rewards[kind], expected[kind], logged[kind]["code_failure"], near[kind], strict=True)
        differ = {row["task_id"]: (r, e, why) for row, r, e, why, slow in outcomes
                  if r != e and not (slow and why == "cpu time")}  # fmt: skip
        assert differ == {}, kind


# --- what the differential found -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def code() -> CodeReward:
    return CodeReward(limits=SandboxLimits(wall_s=10.0, cpu_s=4, memory_mib=512), workers=2)


def score(code: CodeReward, program: str, tests: list[str]) -> tuple[float, str | None]:
    logged: dict = {}
    reward = code([f"```python\n{program}```"], test_list=[tests], log_extra=lambda c, v: logged.update({c: v}))
    return reward[0], logged["code_failure"][0]


# MBPP's task 533, and the other ways a test hands the program a builtin type, or gets one back.
TYPES = [
    "assert remove_datatype((4, 5, 4, 7.7, 1.2), int) == [7.7, 1.2]",
    "assert remove_datatype((7, 8, 9, 'SR'), str) == [7, 8, 9]",
    "assert remove_datatype((7, 1.1, True, 'a'), (int, str)) == [1.1]",
    "assert kind(3) == int and kind('a') is str and kind([1]) is list",
    "assert isinstance(5, kind(5)) and kind(kind) == 'other'",
]
TYPES_RIGHT = """
def remove_datatype(items, data_type):
    return [item for item in items if not isinstance(item, data_type)]
def kind(x):
    return type(x) if type(x) in (int, str, list) else 'other'
"""


def test_a_builtin_type_a_test_passes_is_the_programs_own_builtin_type(code):
    assert score(code, TYPES_RIGHT, TYPES) == (1.0, None)
    # Wrong programs still fail: one that ignores the type, one that returns its own class named like a builtin.
    ignores = "def remove_datatype(items, data_type):\n    return list(items)\ndef kind(x):\n    return 'other'\n"
    assert score(code, ignores, TYPES)[0] == 0.0
    fake = "class int:\n    pass\ndef kind(x):\n    return int\n"
    assert score(code, fake, ["assert kind(3) == builtins.int"]) == (0.0, "not plain data: type")


def test_builtin_types_cross_by_name_as_the_receivers_own():
    def refuse(tag, items, depth):
        raise code_wire.ProgramGone("malformed reply")

    for kind in (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset):
        assert code_wire.decode(code_wire.encode(kind), refuse) is kind
    assert code_wire.decode(code_wire.encode((int, [str])), refuse) == (int, [str])
    for data in (["type", "object"], ["type", "type"], ["type", ["int"]], ["type"], ["type", "int", "str"]):
        with pytest.raises(code_wire.ProgramGone):
            code_wire.decode(data, refuse)
    with pytest.raises(code_wire.NotPlainData):  # a class that is not one of them stays what it was: not data
        code_wire.encode(type("int", (), {}))
    assert code_wire.encode(builtins.object, lambda value, depth: "handle") == "handle"


# --- the protections a timed-out execution reports -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    sandbox = Sandbox(SandboxLimits(wall_s=1.0, cpu_s=1, memory_mib=256, output_kib=16))
    if not sandbox.protections:
        pytest.skip("no protection beyond the namespaces holds on this machine: nothing to report")
    return sandbox


@pytest.mark.parametrize(
    "program, reason",
    [("import time\ntime.sleep(1000)\n", "timeout"), ("while True:\n    print('x' * 1000)\n", "output limit")],
)
def test_an_execution_killed_from_outside_reports_the_protections_it_ran_under(sandbox, program, reason):
    run = sandbox.run(program)
    assert run.reason == reason and run.protections == sandbox.protections


def test_a_timed_out_assert_run_reports_its_protections_and_keeps_the_tests_decided(sandbox):
    tests = AssertTests("", "", ("assert f() == 1", "assert g() == 2", "assert f() == 1"))
    run = run_asserts(sandbox, tests, "import time\ndef f():\n    return 1\ndef g():\n    time.sleep(1000)\n")
    assert run.failures == [None, "timeout", "timeout"] and run.execution.protections == sandbox.protections
