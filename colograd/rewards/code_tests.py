"""A row's tests for the code rewards (`colograd.rewards.code`): read from the layouts code datasets hold them in,
checked, and, for assert-style tests, run through the split harness (`colograd.rewards.code_harness`).

The layouts, looked for in this order (a column missing from a row, or null in it, does not count):

    verification_info   open-r1's stdin/stdout cases: {"language": "python", "test_cases": [{"input": ...,
                        "output": ...}, ...]}, a dict or its JSON text; one execution per case
    test_list           MBPP's assert statements, one test each; its test_imports (statements, MBPP's sanitized set)
                        run before the program and the tests, its test_setup_code after the program, before the tests
    test_cases          AceCode's assert statements, one test each
    test, entry_point   HumanEval's: `test` defines check(candidate); one test, check(<entry_point>)
    ...                 competitive programming's stdin/stdout cases as CodeContests, APPS / TACO, LiveCodeBench,
                        DeepCoder and open-r1/codeforces ship them (`colograd.rewards.code_layouts`)

Assert-style tests run in one execution per completion, split in two processes: the program's, which runs the
program as a module named ``solution`` (its ``if __name__ == "__main__":`` block does not run, as in HumanEval's
harness) and answers for its objects, and the judge's, which runs the tests and never runs model code. The expected
values never reach the program's process (`colograd.rewards.code_harness`). Which of a test's names are the
program's and which the judge's own is decided here, from the row alone (`judge_names`).

Rows are checked before they are scored: a test that does not parse or compile, asserts nothing that can run (an
assert inside a function the test never calls, or under ``if False:``), or uses nothing of the program (only builtins,
the standard library and the row's setup: it would pass or fail whatever the program does) is refused, in one line
naming the problem.
"""

import ast
import builtins
import functools
import json
import os
import re
import subprocess
import symtable
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from colograd.rewards import code_harness
from colograd.rewards.code_checker import KINDS, Checker, CheckerError, row_checker
from colograd.rewards.code_layouts import (
    CONTEST_COLUMNS,
    CONTEST_LAYOUTS,
    PRELUDES,
    CallCases,
    LayoutError,
    contest_cases,
    grader_of,
)
from colograd.rewards.sandbox import Execution, Sandbox

# The columns a row's tests are read from, in the order the layouts are looked for.
TEST_COLUMNS = (
    "verification_info", "test_list", "test_setup_code", "test_imports", "test_cases", "test", "entry_point",
    *CONTEST_COLUMNS,
)  # fmt: skip
LAYOUTS = (
    "verification_info (stdin/stdout cases), test_list or test_cases (assert statements), test with entry_point "
    f"(HumanEval's check), {CONTEST_LAYOUTS}"
)
_BUILTINS = frozenset(dir(builtins))
# Modules a test may use without importing them: they are the judge's, imported there, never the program's objects.
_JUDGE_MODULES = {**{name: name for name in sys.stdlib_module_names}, "numpy": "numpy", "np": "numpy"}
# CPython 3.11 keeps ast.parse's recursion count in one place per interpreter: when a parse lets another thread run
# (a finalizer the garbage collector calls mid-parse) and that thread parses too (the reward call reading rows while
# its pool's threads name each row's tests), one fails with "SystemError: AST constructor recursion depth mismatch".
# Every parse here holds this lock.
_PARSING = threading.Lock()


class RowTestsError(ValueError):
    """A row's tests cannot be read; the message (one line) names the problem and the fix."""


class RowCompileError(RowTestsError):
    """A row's test parses but does not compile (``nonlocal`` at module level, ``return`` outside a function): the
    reward scores it 0, preflight refuses it."""


@dataclass(frozen=True)
class StdioTests:
    """stdin/stdout cases: (input, expected output) pairs; `checker`: the problem's own checker program, the only
    verdict on each case's output where there is one (`colograd.rewards.code_checker`); `problem`: how messages name
    the row (its name or id column, where it has one)."""

    cases: tuple[tuple[str, str], ...]
    checker: Checker | None = None
    problem: str = field(default="", compare=False)
    prelude: str = ""  # run before the program, as the dataset's grader runs it (`code_layouts.PRELUDES`)


@dataclass(frozen=True)
class AssertTests:
    """Assert-style tests: `imports` run before the program and in the judge; `setup` in the judge after the program
    ran (it may build the program's objects); then each of `tests`. `declared`: names that are the program's
    whatever else they name (HumanEval's entry_point). `classes`: the names the row says are classes (`row_classes`):
    the only program names whose objects' methods the judge calls. `prelude`: run before the program (not in the
    judge), as the dataset's grader runs it (`code_layouts.PRELUDES`)."""

    imports: str
    setup: str
    tests: tuple[str, ...]
    declared: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    prelude: str = ""


# The columns that say what a row asks for, besides its tests: the problem's text and a reference solution, as code
# datasets name them (MBPP: text, code; HumanEval: prompt, canonical_solution; APPS / TACO: question, solutions;
# KodCode: question, solution; LiveCodeBench: question_content). Read only for the classes they declare.
ROW_TEXT_COLUMNS = (
    "text", "prompt", "question", "question_content", "problem", "description", "instruction",
    "code", "solution", "solutions", "canonical_solution", "reference_solution", "starter_code",
)  # fmt: skip
# The columns that name a row, as code datasets hold them (CodeContests: name; open-r1/codeforces: id, title; APPS,
# TACO: problem_id; MBPP, HumanEval: task_id). Read only for messages.
ROW_NAME_COLUMNS = ("name", "id", "problem_id", "task_id", "title")
_CLASS = re.compile(r"\bclass\s+([A-Za-z_][A-Za-z_0-9]*)")


def row_classes(row: dict[str, Any]) -> tuple[str, ...]:
    """The classes a row declares: the names after `class` in its problem text or reference solution
    (`ROW_TEXT_COLUMNS`). Never the program's word, nor a name's spelling: a test that calls a
    function `Solve` and a method of what it returns (`Solve(x).startswith("a")`) reads that result as data unless
    the row says `Solve` is a class, so a program that makes it a class whose `startswith` says True gains nothing."""
    found = set()
    for column in ROW_TEXT_COLUMNS:
        value = row.get(column)
        if value is not None:
            found |= set(_CLASS.findall(value if isinstance(value, str) else json.dumps(value, default=str)))
    return tuple(sorted(found))


def row_tests(row: dict[str, Any]) -> StdioTests | AssertTests:
    """The tests of one row, from its columns (`TEST_COLUMNS`; others are ignored). Assert-style tests are parsed
    and checked here (never run), so that a test that cannot fail whatever the program does is refused rather than
    scored.

    Raises:
        RowTestsError: the row has no tests, they are not in a layout the code rewards read, or one of them cannot
            tell a right program from a wrong one.
    """
    tests = _row_tests(row)
    if isinstance(tests, AssertTests):
        return replace(tests, classes=tuple(sorted({*tests.classes, *row_classes(row)})))
    return tests


def _row_tests(row: dict[str, Any]) -> StdioTests | AssertTests:
    given = {k: v for k, v in row.items() if k in TEST_COLUMNS and v is not None}
    if "verification_info" in given:
        return _stdio(given["verification_info"])
    if "test_list" in given:
        setup = given.get("test_setup_code", "")
        if not isinstance(setup, str):
            raise RowTestsError(f"test_setup_code is a {type(setup).__name__}; give Python text")
        _parse("test_setup_code", setup)
        imports = "\n".join(text for text, _ in _statements("test_imports", given.get("test_imports", []), True))
        return _checked(AssertTests(imports, setup, _asserts("test_list", given["test_list"])), "test_list")
    if "test_cases" in given:
        return _checked(AssertTests("", "", _asserts("test_cases", given["test_cases"])), "test_cases")
    if "test" in given:
        return _humaneval(given["test"], given.get("entry_point"))
    try:
        cases = contest_cases(given)
    except LayoutError as err:
        raise RowTestsError(str(err)) from None
    if isinstance(cases, CallCases):
        return _call_asserts(cases)
    if cases is not None:
        return StdioTests(cases, _checker(given), problem_name(row), PRELUDES.get(grader_of(given), ""))
    raise RowTestsError(f"no tests: none of {LAYOUTS} is set; add one (docs/rewards.md shows each)")


def _checker(given: dict[str, Any]) -> Checker | None:
    """The row's checker program (`checker`, else `generated_checker`), or None when it has neither."""
    for column in KINDS:
        if given.get(column):
            try:
                return row_checker(column, given[column])
            except CheckerError as err:
                raise RowTestsError(str(err)) from None
    return None


def problem_name(row: dict[str, Any]) -> str:
    """How messages name a row: its first name or id column (`ROW_NAME_COLUMNS`), else ""."""
    for column in ROW_NAME_COLUMNS:
        if row.get(column) not in (None, ""):
            return f"{column} {str(row[column])[:80]!r}"
    return ""


def _stdio(info: Any) -> StdioTests:
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as err:
            raise RowTestsError(f"verification_info is not valid JSON ({err}); fix the text") from None
    if not isinstance(info, dict):
        raise RowTestsError(f"verification_info is a {type(info).__name__}; give a dict (or its JSON text)")
    language = info.get("language") or "python"
    if language != "python":
        raise RowTestsError(
            f"verification_info language {language!r}: the code rewards run python only; keep the python rows "
            "(dataset.filter)"
        )
    cases = info.get("test_cases")
    if not isinstance(cases, list) or not cases:
        raise RowTestsError("verification_info has no test_cases; give a list of {'input': ..., 'output': ...}")
    for k, case in enumerate(cases):
        if isinstance(case, str):
            raise RowTestsError(
                f"verification_info test case {k} is text, not {{'input': ..., 'output': ...}}; assert statements "
                "go in a test_list column"
            )
        for key in ("input", "output"):
            if not isinstance(case, dict) or not isinstance(case.get(key), str):
                raise RowTestsError(f"verification_info test case {k} has no {key!r} text; give one")
    return StdioTests(tuple((case["input"], case["output"]) for case in cases))


def _statements(column: str, value: Any, empty_ok: bool = False) -> list[tuple[str, ast.Module]]:
    """A column's Python statements, each with its parse (never run here); `empty_ok`: setup, not tests."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        what = "Python statements" if empty_ok else "assert statements, one per test"
        raise RowTestsError(f"{column} is a {type(value).__name__}; give a list of {what}")
    if not value and not empty_ok:
        raise RowTestsError(f"{column} is empty; give at least one assert statement")
    for k, statement in enumerate(value):
        if not isinstance(statement, str):
            raise RowTestsError(f"{column} item {k} is a {type(statement).__name__}; give Python text")
    return [(statement, _parse(f"{column} item {k}", statement)) for k, statement in enumerate(value)]


def _asserts(column: str, value: Any) -> tuple[str, ...]:
    tests = _statements(column, value)
    for k, (test, tree) in enumerate(tests):
        if not live_asserts(tree):
            raise RowTestsError(
                f"{column} item {k} ({test[:40]!r}) has no assert that runs (none at all, only asserts of a constant, "
                "or asserts inside a function it never calls or under a condition that is always false), so it would "
                "pass whatever the program does; make each test an assert that runs"
            )
    return tuple(test for test, _ in tests)


def live_asserts(tree: ast.Module) -> int:
    """The assert statements of `tree` that can run and test something: not of a constant (``assert True``), not
    inside a function it never calls, not under ``if``/``while`` of a constant false condition (or the ``else`` of
    a constant true one)."""
    functions = {
        node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    count, called, pending = 0, set(), [tree.body]
    while pending:
        for node in _reachable(pending.pop()):
            if isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant):
                count += 1
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
                if node.func.id not in called:
                    called.add(node.func.id)
                    pending.append(functions[node.func.id].body)
    return count


def _reachable(statements: list[ast.stmt]):
    """The nodes of `statements` that can run, not descending into function or class bodies (they run when called)
    nor into branches a constant condition rules out."""
    stack = list(reversed(statements))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.If | ast.While) and isinstance(node.test, ast.Constant):
            stack.append(node.test)
            stack.extend(reversed(node.body if node.test.value else node.orelse))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _humaneval(test: Any, entry_point: Any) -> AssertTests:
    if entry_point is None:
        raise RowTestsError(
            "test is set but entry_point is not: HumanEval's layout needs both (test defines check(candidate), "
            "entry_point names the function it checks); pytest-style test files are not run"
        )
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise RowTestsError(f"entry_point {entry_point!r} is not a Python name; give the function's name")
    if not isinstance(test, str):
        raise RowTestsError(f"test is a {type(test).__name__}; give Python text that defines check(candidate)")
    checks = [n for n in _parse("test", test).body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise RowTestsError("test defines no check(candidate) function (HumanEval's layout); define one")
    program = f"{test}\ncheck({entry_point})\n"
    if not live_asserts(_parse("test", program)):
        raise RowTestsError(
            "test's check(candidate) has no assert that runs (only asserts of a constant, or asserts inside a "
            "function it never calls or under a condition that is always false); make it assert on candidate"
        )
    return AssertTests("", "", (program,), (entry_point,))


# The judge's side of a call-based row: the function to call (a method of the program's `Solution` where it defines
# one, as LeetCode's problems and the datasets' graders call it) and the dataset grader's comparison. It runs in the
# judge, after the program; the names it does not define (`Solution`, the function) are the program's.
_CALL_SETUP = """
def _entry():
    try:
        return getattr(Solution(), {name!r})
    except Exception:
        return {name}


def _same(got, want):
    if isinstance(got, tuple):
        got = list(got)
    if got == want:
        return True
    if {apps}:  # APPS's and TACO's grader: an expected list of one also stands for its element
        if isinstance(want, list) and want and got == want[0]:
            return True
        try:
            return isinstance(got[0], tuple) and [list(x) for x in got] == want[0]
        except Exception:
            return False
    return False
"""


def _call_asserts(calls: CallCases) -> AssertTests:
    """A call-based row's tests: one assert per case, the function called with the case's arguments and its result
    compared as the dataset's grader compares it (`_CALL_SETUP`); the expected values stay in the judge."""
    setup = _CALL_SETUP.format(name=calls.fn_name, apps=calls.grader == "apps")
    tests = tuple(f"assert _same(_entry()(*{args!r}), {expected!r})" for args, expected in calls.cases)
    return AssertTests("", setup, tests, (calls.fn_name, "Solution"), ("Solution",), PRELUDES[calls.grader])


def _checked(tests: AssertTests, column: str) -> AssertTests:
    """`tests`, each of which uses something of the program: a name that is not a builtin, not imported by the row
    and not the test's own (directly, or through the setup's objects when the setup uses the program's). A row whose
    tests use none, and together call one builtin's name, asks for a function of that name (MBPP's ``sum(a, b)``):
    that name is then the program's in its tests (`AssertTests.declared`), and only that one."""
    imported = _bound(tests.imports)
    setup_names = _bound(tests.setup)
    setup_uses_program = bool(free_names(tests.setup) - _BUILTINS - imported)
    untested = []
    for k, test in enumerate(tests.tests):
        used = free_names(test) - _BUILTINS - imported
        used -= set(_modules_used(used, _called_names(test)))
        if not (used - setup_names) and not (used & setup_names and setup_uses_program):
            untested.append(k)
    if not untested:
        return tests
    called = set().union(*(_called_builtins(test) for test in tests.tests)) - imported - setup_names
    if len(untested) == len(tests.tests) and len(called) == 1:
        return replace(tests, declared=tuple(called))
    k = untested[0]
    raise RowTestsError(
        f"{column} item {k} ({tests.tests[k][:40]!r}) uses nothing of the program (only Python's builtins and the "
        "row's imports and setup), so it passes or fails whatever the program does; call the function under test (a "
        "function named like a builtin is the program's only where a row's tests call that one builtin and nothing "
        "else)"
    )


def _called_names(source: str) -> set[str]:
    return {
        node.func.id
        for node in ast.walk(parse_python(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def _modules_used(names: set[str], called: set[str]) -> dict[str, str]:
    """Of `names`, those a test uses as a module of the standard library or numpy (by name, not calling it), each
    with the module the judge imports for it."""
    return {name: _JUDGE_MODULES[name] for name in names if name in _JUDGE_MODULES and name not in called}


@dataclass(frozen=True)
class JudgeNames:
    """How the judge resolves a row's names. program: the names that are the program's (its entry point, the
    functions and classes the tests and setup use); modules: name -> module the judge imports for a test that uses
    it without importing it; classes: the program's names the row declares as classes (`row_classes`; their
    objects' methods may be called). Any other name a test uses is a NameError in the judge."""

    program: tuple[str, ...]
    modules: dict[str, str]
    classes: tuple[str, ...]


@functools.lru_cache(maxsize=4096)
def judge_names(tests: AssertTests) -> JudgeNames:
    """The names a row's tests and setup use, split between the judge and the program (`JudgeNames`)."""
    bound = _bound(tests.imports) | _bound(tests.setup)
    used, called = set(), set()
    for source in (tests.setup, *tests.tests):
        used |= free_names(source)
        called |= _called_names(source)
    used -= bound
    declared = set(tests.declared)
    modules = _modules_used(used - declared, called)
    program = sorted(declared | {name for name in used - set(modules) if name not in _BUILTINS})
    classes = tuple(name for name in program if name in tests.classes)
    return JudgeNames(tuple(program), modules, classes)


def _called_builtins(source: str) -> set[str]:
    return _called_names(source) & _BUILTINS


def with_prelude(prelude: str, code: str) -> str:
    """`code` run after `prelude` (a dataset grader's imports, `code_layouts.PRELUDES`), as that grader runs it; its
    numpy import only where `code` reads `np` unbound (the rest is cheap to import). The program's own `from
    __future__` imports (and the docstring before them) stay first, where Python requires them: the graders put the
    imports above them, and a right program that began so failed to compile there."""
    if not prelude:
        return code
    try:
        reads_np = "np" in free_names(code)
        head = _future_lines(parse_python(code))
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the program's text, read in the trainer
        reads_np, head = True, 0  # the prelude whole: the program runs (or fails to compile) in its sandbox
    if not reads_np:
        prelude = prelude.replace("import numpy as np\n", "")
    lines = code.splitlines(keepends=True)
    if head and not lines[head - 1].endswith("\n"):
        lines[head - 1] += "\n"
    return "".join(lines[:head]) + prelude + "".join(lines[head:])


def _future_lines(tree: ast.Module) -> int:
    """How many of a module's first lines hold its docstring and `from __future__` imports (0 where it has none)."""
    end = 0
    for k, node in enumerate(tree.body):
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            end = node.end_lineno or end
        elif not (k == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            break
    return end


def free_names(source: str) -> set[str]:
    """The global names `source` uses and does not bind itself (its own assignments, imports, functions, classes)."""
    if not source.strip():
        return set()
    table = symtable.symtable(source, "<test>", "exec")
    bound = _bound_in(table)
    used: set[str] = set()
    tables = [table]
    while tables:
        current = tables.pop()
        for symbol in current.get_symbols():
            if symbol.is_referenced() and (symbol.is_global() or current is table):
                used.add(symbol.get_name())
        tables.extend(current.get_children())
    return used - bound


def _bound(source: str) -> set[str]:
    return _bound_in(symtable.symtable(source, "<setup>", "exec")) if source.strip() else set()


def _bound_in(table: symtable.SymbolTable) -> set[str]:
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


def parse_python(source: str) -> ast.Module:
    """`ast.parse`, safe to call from any thread (`_PARSING`)."""
    with _PARSING:
        return ast.parse(source)


def _parse(what: str, source: str) -> ast.Module:
    try:
        tree = parse_python(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        detail = f"{type(err).__name__}: {getattr(err, 'msg', err)}"
        raise RowTestsError(f"{what} does not parse as Python ({detail}); fix it") from None
    check_compiles(what, source)
    return tree


def check_compiles(what: str, source: str) -> None:
    """Refuse, in one line naming `what`, Python that parses but does not compile (``nonlocal`` at module level,
    ``return`` or ``yield`` outside a function, ``break`` outside a loop): the judge compiles each test, and the
    name analysis (symtable) compiles it too.

    Raises:
        RowCompileError: it does not compile.
    """
    try:
        compile(source, f"<{what}>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        detail = f"{type(err).__name__}: {getattr(err, 'msg', err)}"
        raise RowCompileError(f"{what} does not compile as Python ({detail}); fix it") from None


# --- running assert-style tests -----------------------------------------------------------------------------------

# The harness's modules, by name and file, in the order they are loaded inside the sandbox.
HARNESS_MODULES = tuple(
    (f"colograd.rewards.{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    for name in code_harness.MODULES
)
_compiled: dict[str, bytes] = {}
_compiled_lock = threading.Lock()


def compiled_harness(python: str) -> bytes:
    """The split harness's modules compiled by `python` (the sandbox's interpreter, whose bytecode this must be),
    marshalled as (module name, code) pairs in loading order: both processes load them in well under a millisecond,
    where compiling their source took ~16 ms each."""
    with _compiled_lock:
        if python not in _compiled:
            compile_it = (
                f"import marshal, sys\nmodules = {HARNESS_MODULES!r}\n"
                "parts = [(name, compile(open(path, 'rb').read(), path, 'exec')) for name, path in modules]\n"
                "sys.stdout.buffer.write(marshal.dumps(parts))"
            )
            done = subprocess.run([python, "-I", "-S", "-c", compile_it], capture_output=True)
            if done.returncode != 0:
                raise RuntimeError(f"{python} cannot compile the code harness: {done.stderr.decode()[-500:]}")
            _compiled[python] = done.stdout
        return _compiled[python]


def assert_program(tests: AssertTests, code: str) -> str:
    """The program's process's main.py: load the harness (the file ``harness.bin`` beside it, which the launcher
    writes from the judge's job), then `serve` the row's imports and `code`. It holds nothing of the tests."""
    # Each module of the harness goes under its own name in sys.modules, so that a module's imports of those before
    # it find it (the sandbox has no colograd to import); `harness` is then the last one, the harness itself. The
    # judge loads it the same way (`sandbox_launch.run_judge`). `type(sys)` makes a module without importing `types`.
    return (
        "import marshal, sys\n"
        "for name, code in marshal.loads(open('harness.bin', 'rb').read()):\n"
        "    sys.modules[name] = harness = type(sys)(name)\n"
        "    exec(code, harness.__dict__)\n"
        f"harness.serve({tests.imports!r}, {code!r})\n"
    )


def judge_job(tests: AssertTests, python: str) -> dict:
    """What the judge gets (`colograd.rewards.code_harness.judge`): the compiled harness (hex), the tests, and how
    their names resolve (`judge_names`)."""
    names = judge_names(tests)
    return {"harness": compiled_harness(python).hex(), "imports": tests.imports, "setup": tests.setup,
            "tests": list(tests.tests), "program": list(names.program), "modules": names.modules,
            "classes": list(names.classes)}  # fmt: skip


@dataclass(frozen=True)
class AssertRun:
    """One execution of a program against its assert-style tests.

    execution: the execution (its stdout is what the program printed outside the tests' calls).
    failures: each test's failure reason (None: passed): the judge's verdict, else why the execution ended before
        the test was decided (``timeout``, ``memory``, ..., or ``exited early`` when the program's process exited
        without answering).
    """

    execution: Execution
    failures: list[str | None]


def run_asserts(sandbox: Sandbox, tests: AssertTests, code: str) -> AssertRun:
    """Run `code` against `tests` in `sandbox`: one execution, the program's process and the judge's."""
    execution = sandbox.run(assert_program(tests, code), judge=judge_job(tests, sandbox.python))
    ended = execution.reason or execution.judge_failure or "exited early"
    failures = []
    for i in range(len(tests.tests)):
        verdict = execution.verdicts.get(i, "ended")
        failures.append(None if verdict == "ok" else ended if verdict == "ended" else verdict)
    return AssertRun(replace(execution), failures)
