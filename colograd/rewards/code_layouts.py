"""Competitive-programming rows: the stdin/stdout cases of the datasets code RL trains on, read as they ship.

    public_tests, private_tests,   CodeContests (deepmind/code_contests): each {"input": [...], "output": [...]};
    generated_tests                every case of the three, in that order
    input_output                   APPS, TACO: JSON text {"inputs": [...], "outputs": [...]}; with "fn_name" the
                                   problem is call-based (`CallCases`)
    public_test_cases,             LiveCodeBench (code_generation_lite): JSON text of [{"input", "output",
    private_test_cases             "testtype"}]; the private cases as shipped, base64 of zlib of a pickled JSON text
    tests                          DeepCoder: a list (or its JSON text) of {"input", "output"} cases ("testtype" /
                                   "type" saying stdin or functional), or TACO's {"inputs", "outputs"}
    official_tests                 open-r1/codeforces: [{"input", "output"}]; its `generated_checker` (Python),
                                   or a `checker` (C++, testlib's interface), judges each case where a row has
                                   one (`colograd.rewards.code_checker`)

A row of stdin/stdout cases becomes `StdioTests` (`colograd.rewards.code_tests`), compared as `code_checker` says. A
call-based row (APPS's and TACO's `fn_name`, LiveCodeBench's and DeepCoder's functional cases, the function's name in
`fn_name` or the row's `metadata`) becomes `CallCases`, which `code_tests` turns into assert-style tests for the split
harness: the function (a method of the program's `Solution` where it defines one, as LeetCode's problems and these
graders call it) called with each case's arguments, its result compared as the dataset's own grader compares it.
"""

import base64
import io
import json
import pickle
import zlib
from dataclasses import dataclass
from typing import Any

# The columns, in the order the layouts are looked for (after open-r1's verification_info).
CONTEST_COLUMNS = (
    "public_tests", "private_tests", "generated_tests", "input_output", "public_test_cases", "private_test_cases",
    "tests", "official_tests", "checker", "generated_checker", "metadata",
)  # fmt: skip
CONTEST_LAYOUTS = (
    "public_tests/private_tests/generated_tests (CodeContests), input_output (APPS, TACO), public_test_cases/"
    "private_test_cases (LiveCodeBench), tests (DeepCoder), official_tests (open-r1/codeforces)"
)
_FUNCTIONAL = {"functional", "function_call", "call", "call-based"}

# What the datasets' own graders put before every program they run, of both kinds of rows, so that a program may use
# these names unimported (a LeetCode-style starter's `List[int]`, `deque`, `gcd`): APPS's and TACO's
# (`testing_util.py`, its `sol` text) and LiveCodeBench's (`lcb_runner/evaluation/testing_util.py`, `import_string`,
# which DeepCoder's grader uses too), line for line. APPS's numpy line is put only where the program reads `np`
# (`code_tests.with_prelude`): numpy costs a tenth of a second to import, in every execution.
PRELUDES = {
    "apps": "".join(f"{line}\n" for line in [
        "import sys", "import time", "import itertools",
        "from itertools import accumulate, product, permutations, combinations", "import collections",
        "from collections import Counter, OrderedDict, deque, defaultdict, ChainMap",
        "from functools import lru_cache", "import math",
        "from math import sqrt, sin, cos, tan, ceil, fabs, floor, gcd, exp, log, log2", "import fractions",
        "from typing import List, Tuple", "import numpy as np", "import random", "import heapq", "from heapq import *",
    ]),
    "lcb": "".join(f"{line}\n" for line in [
        *(f"from {m} import *" for m in ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math",
                                         "random", "statistics", "itertools", "functools", "operator", "io", "sys",
                                         "json", "builtins", "typing")),
        *(f"import {m}" for m in ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math",
                                  "random", "statistics", "itertools", "functools", "operator", "io", "sys", "json")),
        "sys.setrecursionlimit(50000)",
    ]),
}  # fmt: skip


@dataclass(frozen=True)
class CallCases:
    """Call-based cases: `fn_name` called with each case's arguments, its result compared with the expected value
    as `grader` does ("apps": APPS's and TACO's, "lcb": LiveCodeBench's)."""

    fn_name: str
    cases: tuple[tuple[tuple, Any], ...]
    grader: str


def grader_of(given: dict[str, Any]) -> str | None:
    """Whose grader a row's stdin/stdout cases are the dataset of (`PRELUDES`): "apps" (APPS's and TACO's
    `input_output`, DeepCoder's TACO-style `tests`), "lcb" (LiveCodeBench's, DeepCoder's lists), or None where the
    dataset's judge runs the program as written (CodeContests', Codeforces')."""
    if any(c in given for c in ("public_tests", "private_tests", "generated_tests")):
        return None
    if "input_output" in given:
        return "apps"
    if "public_test_cases" in given or "private_test_cases" in given:
        return "lcb"
    if "tests" in given:
        return "apps" if isinstance(_json("tests", given["tests"]), dict) else "lcb"
    return None


class _Functional(Exception):
    """Raised inside the readers when a case is call-based: the row is read again as `CallCases`."""


class LayoutError(ValueError):
    """A row's cases cannot be read; the message (one line) names the column, the problem and the fix."""


def contest_cases(given: dict[str, Any]) -> tuple[tuple[str, str], ...] | CallCases | None:
    """The (stdin, expected stdout) cases of a competitive-programming row, its `CallCases` where the problem is
    call-based, or None when it has none of these layouts' columns.

    Raises:
        LayoutError: the cases are malformed, or mix stdin and call-based ones.
    """
    try:
        return _stdio_cases(given)
    except _Functional:
        return _call_cases(given)


def _stdio_cases(given: dict[str, Any]) -> tuple[tuple[str, str], ...] | None:
    if any(c in given for c in ("public_tests", "private_tests", "generated_tests")):
        return _nonempty("public_tests", [c for n in ("public_tests", "private_tests", "generated_tests")
                                          for c in _columns(n, given.get(n))])  # fmt: skip
    if "input_output" in given:
        return _nonempty("input_output", _inputs_outputs("input_output", _json("input_output", given["input_output"])))
    if "public_test_cases" in given or "private_test_cases" in given:
        cases = [c for n in ("public_test_cases", "private_test_cases") for c in _case_list(n, _lcb(n, given.get(n)))]
        return _nonempty("public_test_cases", cases)
    if "tests" in given:
        tests = _json("tests", given["tests"])
        cases = _inputs_outputs("tests", tests) if isinstance(tests, dict) else _case_list("tests", tests)
        return _nonempty("tests", cases)
    if "official_tests" in given:
        return _nonempty(
            "official_tests", _case_list("official_tests", _json("official_tests", given["official_tests"]))
        )
    return None


def _nonempty(column: str, cases: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    if not cases:
        raise LayoutError(f"{column} holds no test case; drop the row or give it cases")
    return tuple(cases)


def _json(column: str, value: Any) -> Any:
    """A column's value, its JSON text parsed."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise LayoutError(f"{column} is not valid JSON ({err}); fix the text") from None


def _columns(column: str, value: Any) -> list[tuple[str, str]]:
    """CodeContests' {"input": [...], "output": [...]} (None: no cases)."""
    if value is None:
        return []
    value = _json(column, value)
    if not isinstance(value, dict) or not isinstance(value.get("input"), list | tuple):
        raise LayoutError(f"{column} is not {{'input': [...], 'output': [...]}} (CodeContests'); fix the row")
    return _pairs(column, list(value["input"]), list(value.get("output") or []))


def _inputs_outputs(column: str, value: Any) -> list[tuple[str, str]]:
    """APPS's and TACO's {"inputs": [...], "outputs": [...], "fn_name"?}."""
    if not isinstance(value, dict) or not isinstance(value.get("inputs"), list):
        raise LayoutError(f"{column} is not {{'inputs': [...], 'outputs': [...]}} (APPS's and TACO's); fix the row")
    if value.get("fn_name"):
        raise _Functional
    return _pairs(column, value["inputs"], value.get("outputs") or [])


def _case_list(column: str, value: Any) -> list[tuple[str, str]]:
    """A list of {"input", "output"} cases (LiveCodeBench's, DeepCoder's, Codeforces')."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise LayoutError(f"{column} is a {type(value).__name__}; give a list of {{'input': ..., 'output': ...}}")
    cases = []
    for k, case in enumerate(value):
        if not isinstance(case, dict):
            raise LayoutError(f"{column} case {k} is a {type(case).__name__}; give {{'input': ..., 'output': ...}}")
        kind = str(case.get("testtype") or case.get("type") or "stdin").lower()
        if kind in _FUNCTIONAL:
            raise _Functional
        cases += _pairs(f"{column} case {k}", [case.get("input")], [case.get("output")])
    return cases


def _pairs(column: str, inputs: list, outputs: list) -> list[tuple[str, str]]:
    """(stdin, expected) pairs; an expected output given as a list of lines is joined (APPS holds some so)."""
    if len(inputs) != len(outputs):
        raise LayoutError(f"{column} has {len(inputs)} inputs for {len(outputs)} outputs; give one output per input")
    pairs = []
    for stdin, expected in zip(inputs, outputs, strict=True):
        if isinstance(expected, list) and all(isinstance(line, str) for line in expected):
            expected = "\n".join(expected)
        if not isinstance(stdin, str) or not isinstance(expected, str):
            raise LayoutError(f"{column}: a case's input or output is not text; give both as text")
        pairs.append((stdin, expected))
    return pairs


def _call_cases(given: dict[str, Any]) -> CallCases:
    """A call-based row's `CallCases`: APPS's and TACO's {"inputs": [[args...]], "outputs": [...], "fn_name"}, or
    LiveCodeBench's and DeepCoder's cases, each argument a JSON line of "input", "output" JSON, the function's name in
    `fn_name` (a case's, DeepCoder's) or the row's `metadata` ({"func_name": ...}, LiveCodeBench's)."""
    for column in ("input_output", "tests"):
        value = _json(column, given[column]) if column in given else None
        if isinstance(value, dict):
            calls = [(tuple(args) if isinstance(args, list) else (args,), expected)
                     for args, expected in zip(value["inputs"], value.get("outputs") or [], strict=False)]  # fmt: skip
            if len(calls) != len(value["inputs"]):
                raise LayoutError(f"{column} has {len(value['inputs'])} inputs for {len(calls)} outputs")
            return CallCases(_name(column, value.get("fn_name")), tuple(calls), "apps")
    if "public_test_cases" in given or "private_test_cases" in given:
        column = "public_test_cases"
        cases = [c for n in ("public_test_cases", "private_test_cases") for c in _lcb(n, given.get(n)) or []]
    else:
        column = "tests"
        cases = _json("tests", given["tests"])
    metadata = _json("metadata", given.get("metadata")) or {}
    names = {c.get("fn_name") for c in cases if isinstance(c, dict)} - {None}
    name = names.pop() if len(names) == 1 else (metadata.get("func_name") if isinstance(metadata, dict) else None)
    calls = []
    for k, case in enumerate(cases):
        kind = str(case.get("testtype") or case.get("type") or "stdin").lower() if isinstance(case, dict) else ""
        if kind not in _FUNCTIONAL:
            said = f"{column} case {k} is {kind or 'not a dict'} where others are call-based; keep one kind"
            raise LayoutError(said)
        try:
            args = tuple(json.loads(line) for line in str(case.get("input")).split("\n"))
            expected = json.loads(case.get("output"))
        except (TypeError, json.JSONDecodeError) as err:
            raise LayoutError(f"{column} case {k}: its arguments or result are not JSON lines ({err})") from None
        calls.append((args, expected))
    return CallCases(_name(column, name), tuple(calls), "lcb")


def _name(column: str, name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise LayoutError(
            f"{column}: call-based cases, but the function to call is {name!r}; give its name (fn_name, or metadata's "
            "func_name)"
        )
    return name


def _lcb(column: str, value: Any) -> Any:
    """LiveCodeBench's cases: JSON text, or (its private cases as shipped) base64 of zlib of a pickled JSON text,
    unpickled with nothing but text allowed (`_TextOnly`)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        text = _TextOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
    except Exception as err:  # noqa: BLE001 (base64, zlib and pickle each raise their own)
        raise LayoutError(
            f"{column} is neither JSON nor LiveCodeBench's compressed cases ({err}); fix the row"
        ) from None
    if not isinstance(text, str):
        raise LayoutError(f"{column}'s compressed cases hold a {type(text).__name__}, not JSON text; fix the row")
    return _json(column, text)


class _TextOnly(pickle.Unpickler):
    """An unpickler that builds no object but the built-in ones a pickled text is made of: any class or function a
    pickle names (the way a pickle runs code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the pickle names {module}.{name}; only text is read")
