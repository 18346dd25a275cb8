"""Competitive-programming rows: the stdin/stdout cases of the datasets code RL trains on, read as they ship.

    public_tests, private_tests,   CodeContests (deepmind/code_contests): each {"input": [...], "output": [...]};
    generated_tests                every case of the three, in that order
    input_output                   APPS, TACO: JSON text {"inputs": [...], "outputs": [...]}; with "fn_name" the
                                   problem is call-based
    public_test_cases,             LiveCodeBench (code_generation_lite): JSON text of [{"input", "output",
    private_test_cases             "testtype"}]; the private cases as shipped, base64 of zlib of a pickled JSON text
    tests                          DeepCoder: a list (or its JSON text) of {"input", "output"} cases ("testtype" /
                                   "type" saying stdin or functional), or TACO's {"inputs", "outputs"}
    official_tests                 open-r1/codeforces: [{"input", "output"}]; a row whose `checker` is set needs
                                   that special judge

A row in one of these becomes `StdioTests` (`colograd.rewards.code_tests`), compared as `code_checker` says. What is
not read yet is refused in one line naming the rows to keep: call-based cases (APPS's `fn_name`, LiveCodeBench's and
DeepCoder's functional ones) and Codeforces problems with a checker program.
"""

import base64
import io
import json
import pickle
import zlib
from typing import Any

# The columns, in the order the layouts are looked for (after open-r1's verification_info).
CONTEST_COLUMNS = (
    "public_tests", "private_tests", "generated_tests", "input_output", "public_test_cases", "private_test_cases",
    "tests", "official_tests", "checker",
)  # fmt: skip
CONTEST_LAYOUTS = (
    "public_tests/private_tests/generated_tests (CodeContests), input_output (APPS, TACO), public_test_cases/"
    "private_test_cases (LiveCodeBench), tests (DeepCoder), official_tests (open-r1/codeforces)"
)
_FUNCTIONAL = {"functional", "function_call", "call", "call-based"}


class LayoutError(ValueError):
    """A row's cases cannot be read; the message (one line) names the column, the problem and the fix."""


def contest_cases(given: dict[str, Any]) -> tuple[tuple[str, str], ...] | None:
    """The (stdin, expected stdout) cases of a competitive-programming row, or None when it has none of these
    layouts' columns.

    Raises:
        LayoutError: the cases are malformed, call-based, or need a checker program.
    """
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
        if given.get("checker"):
            raise LayoutError(
                "official_tests: this problem is judged by its checker program (a C++ testlib checker), which the "
                "code rewards do not run yet; keep the rows without one (dataset.filter(lambda row: not "
                "row['checker']))"
            )
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
        raise _call_based(column, f"fn_name {value['fn_name']!r}")
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
            raise _call_based(column, f"case {k} is {kind}")
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


def _call_based(column: str, what: str) -> LayoutError:
    return LayoutError(
        f"{column}: {what}: call-based cases (a function called with arguments) are not read yet, only stdin/stdout "
        "ones; keep the stdin rows (dataset.filter), or give the row's tests as assert statements (test_list)"
    )


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
