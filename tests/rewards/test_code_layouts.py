"""Competitive-programming rows as their datasets ship them (CodeContests, APPS / TACO, LiveCodeBench, DeepCoder,
open-r1/codeforces) read into stdin/stdout cases, what is not read yet refused in one line, and the checkers that
compare a case's output the way contest judges do."""

import base64
import json
import os
import pickle
import zlib

import pytest

from colograd.rewards.code import CodeReward, output_matches
from colograd.rewards.code_layouts import PRELUDES
from colograd.rewards.code_tests import RowTestsError, StdioTests, row_tests
from colograd.rewards.sandbox import SandboxLimits

CASES = (("1 2\n", "3\n"), ("2 2\n", "4\n"), ("5 -5\n", "0\n"))


def lcb_private(cases: list[dict]) -> str:
    """LiveCodeBench's private cases as code_generation_lite ships them: base64 of zlib of a pickled JSON text."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


CASE_DICTS = [{"input": i, "output": o, "testtype": "stdin"} for i, o in CASES]
ROWS = {
    "CodeContests": {"public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                     "private_tests": {"input": ["2 2\n"], "output": ["4\n"]},
                     "generated_tests": {"input": ["5 -5\n"], "output": ["0\n"]}},
    "APPS": {"input_output": json.dumps({"inputs": [i for i, _ in CASES], "outputs": [o for _, o in CASES]})},
    "TACO (outputs as line lists)": {"input_output": json.dumps({"inputs": [i for i, _ in CASES],
                                                                  "outputs": [[o.strip()] for _, o in CASES]})},
    "LiveCodeBench": {"public_test_cases": json.dumps(CASE_DICTS[:1]),
                      "private_test_cases": lcb_private(CASE_DICTS[1:])},
    "DeepCoder": {"tests": json.dumps(CASE_DICTS)},
    "DeepCoder (TACO's)": {"tests": {"inputs": [i for i, _ in CASES], "outputs": [o for _, o in CASES]}},
    "open-r1/codeforces": {"official_tests": [{"input": i, "output": o} for i, o in CASES], "checker": None},
}  # fmt: skip


# Whose grader each layout's dataset is judged by, and so the imports it puts before a program (`PRELUDES`).
GRADERS = {"CodeContests": None, "APPS": "apps", "TACO (outputs as line lists)": "apps", "LiveCodeBench": "lcb",
           "DeepCoder": "lcb", "DeepCoder (TACO's)": "apps", "open-r1/codeforces": None}  # fmt: skip


@pytest.mark.parametrize("layout", ROWS)
def test_each_layout_is_read_as_its_stdin_stdout_cases(layout):
    tests = row_tests(ROWS[layout])
    expected = CASES if "line lists" not in layout else tuple((i, o.strip()) for i, o in CASES)
    assert tests == StdioTests(expected, prelude=PRELUDES.get(GRADERS[layout], ""))


# Unimported names the datasets' graders give a program (APPS's deque and List; LiveCodeBench's from its star
# imports), a recursion LiveCodeBench's grader allows (its limit 50000, Python's 1000), numpy only where read.
UNIMPORTED = "a, b = map(int, input().split())\nq = deque([a, b])\nxs: List[int] = list(q)\nprint(sum(xs))\n"
DEEP = "def f(n):\n    return 0 if n == 0 else f(n - 1)\n\na, b = map(int, input().split())\nprint(f(4000) + a + b)\n"
NUMPY_UNREAD = "import sys\na, b = map(int, input().split())\nprint(a + b + 100 * ('numpy' in sys.modules))\n"
NUMPY_READ = "a, b = map(int, input().split())\nprint(int(np.int64(a) + b))\n"


def test_a_program_the_trainer_cannot_read_is_scored_in_its_sandbox_not_raised_in_the_trainer(code):
    """The prelude reads the program's names in the trainer (whether it uses numpy): a program too deep for Python's
    compiler (5000 terms; 20000 unary minuses) is the sandbox's to fail, never an exception that stops the run."""
    tests = row_tests(ROWS["APPS"])
    for program in ("print(" + "+".join(["1"] * 5000) + ")\n", "x = " + "-" * 20000 + "1\n"):
        assert code.run_tests(program, tests).rate == 0.0


@pytest.mark.parametrize("layout", ROWS)
def test_a_program_runs_after_the_imports_its_datasets_grader_gives_it(layout, code):
    """As each dataset's own grader runs it: APPS's and TACO's (`sol`'s imports) and LiveCodeBench's (`import_string`,
    DeepCoder's too) give a program names it did not import, CodeContests' and Codeforces' judges nothing: a right
    program written against a LeetCode-style starter (`List[int]`) scores 1 on the first and 0 on the second."""
    tests = row_tests(ROWS[layout])
    grader = GRADERS[layout]
    assert code.run_tests(UNIMPORTED, tests).rate == (1.0 if grader else 0.0)
    assert code.run_tests(DEEP, tests).rate == (1.0 if grader == "lcb" else 0.0)
    # A program's own __future__ imports (after its docstring) stay first, where Python requires them.
    future = '"""Sums."""\nfrom __future__ import annotations\nfrom __future__ import division\n'
    assert code.run_tests(future + UNIMPORTED, tests).rate == (1.0 if grader else 0.0)
    if grader == "apps":
        assert code.run_tests(NUMPY_READ, tests).rate == 1.0
        assert code.run_tests(NUMPY_UNREAD, tests).rate == 1.0  # numpy not imported for a program that reads no np


@pytest.mark.parametrize("layout", ROWS)
def test_a_right_program_passes_and_a_wrong_one_fails_on_each_layout(layout, code):
    right, wrong = (
        "a, b = map(int, input().split())\nprint(a + b)\n",
        "a, b = map(int, input().split())\nprint(a - b)\n",
    )
    row = ROWS[layout]
    assert code.run_tests(right, row_tests(row)).rate == 1.0
    assert code.run_tests(wrong, row_tests(row)).rate < 1.0


@pytest.fixture(scope="module")
def code() -> CodeReward:
    return CodeReward(limits=SandboxLimits(wall_s=2.0, cpu_s=1), workers=2)


@pytest.mark.parametrize(
    "row, said",
    [({"official_tests": [{"input": "1", "output": "1"}], "checker": ["not", "text"]}, "checker is a list, not the"),
     ({"public_tests": {"input": ["1"], "output": []}}, "public_tests has 1 inputs for 0 outputs"),
     ({"public_tests": {"input": [], "output": []}, "private_tests": None}, "public_tests holds no test case"),
     ({"input_output": "{not json"}, "input_output is not valid JSON"),
     ({"tests": ["assert f(1) == 1"]}, "tests case 0 is a str"),
     ({"public_test_cases": json.dumps([{"input": "1", "output": "1", "testtype": "functional"}])},
      "the function to call is None; give its name"),
     ({"tests": [{"input": "1", "output": "1", "testtype": "functional", "fn_name": "f"},
                 {"input": "1", "output": "1", "testtype": "stdin"}]}, "case 1 is stdin where others are call-based"),
     ({"tests": [{"input": "[1", "output": "1", "testtype": "functional", "fn_name": "f"}]}, "not JSON lines")],
)  # fmt: skip
def test_what_is_not_read_is_refused_in_one_line_naming_what_to_keep(row, said):
    with pytest.raises(RowTestsError, match=said) as err:
        row_tests(row)
    assert "\n" not in str(err.value)


class _Runs:
    """A pickle that would run a command when loaded (how a pickle runs code)."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/colograd-pickle-ran",))


def test_compressed_cases_are_unpickled_as_text_only():
    if os.path.exists("/tmp/colograd-pickle-ran"):
        os.remove("/tmp/colograd-pickle-ran")
    hostile = base64.b64encode(zlib.compress(pickle.dumps(_Runs()))).decode()
    with pytest.raises(RowTestsError, match="neither JSON nor LiveCodeBench's compressed cases .*posix.system"):
        row_tests({"private_test_cases": hostile})
    assert not os.path.exists("/tmp/colograd-pickle-ran")


@pytest.mark.parametrize(
    "stdout, expected, checker, right",
    [("1 2\n3", "1\n2 3\n", "tokens", True), ("1 2 3 4", "1 2 3", "tokens", False), ("1 2", "1 2", "lines", True),
     ("1  2\n3", "1\n2 3\n", "lines", False), ("YES\nno", "yes\nNO", "tokens_nocase", True),
     ("YES", "yes", "tokens", False), ("0.3333333", "0.333333333", "float", True),
     ("0.3334", "0.333333333", "float", False), ("1000000.5", "1000000", "float", True),
     ("1000002", "1000000", "float", False), ("abc 1.0000001", "abc 1", "float", True),
     ("abd 1", "abc 1", "float", False), ("nan", "0", "float", False), ("inf", "inf", "float", True),
     ("1e-7", "0", "float", True), ("2", "1 2", "float", False)],
)  # fmt: skip
def test_checkers_compare_as_contest_judges_do(stdout, expected, checker, right):
    assert output_matches(stdout, expected, "all", checker, 1e-6) is right


SUM_CALLS = {"inputs": [[1, 2], [2, 2], [5, -5]], "outputs": [[3], [4], [0]]}
LCB_CALLS = [
    {"input": f"{a}\n{b}", "output": json.dumps(a + b), "testtype": "functional"} for a, b in ((1, 2), (2, 2))
]
CALL_ROWS = {
    "APPS / TACO": {"input_output": json.dumps({**SUM_CALLS, "fn_name": "add_pair"})},
    "LiveCodeBench (functional)": {"public_test_cases": json.dumps(LCB_CALLS[:1]),
                                   "private_test_cases": lcb_private(LCB_CALLS[1:]),
                                   "metadata": json.dumps({"func_name": "add_pair"})},
    "DeepCoder (functional)": {"tests": [{**case, "fn_name": "add_pair"} for case in LCB_CALLS]},
}  # fmt: skip
RIGHT = {"function": "def add_pair(a, b):\n    return a + b\n",
         "Solution": "class Solution:\n    def add_pair(self, a, b):\n        return a + b\n"}  # fmt: skip


@pytest.mark.parametrize("layout", CALL_ROWS)
@pytest.mark.parametrize("form", RIGHT)
def test_call_based_rows_call_the_function_and_compare_as_their_grader(layout, form, code):
    tests = row_tests(CALL_ROWS[layout])
    assert code.run_tests(RIGHT[form], tests).rate == 1.0
    assert code.run_tests(RIGHT[form].replace("a + b", "a - b"), tests).rate < 1.0
    assert code.run_tests("print(3)\n", tests).rate == 0.0  # the expected values never reach the program


def test_apps_grader_reads_a_tuple_as_a_list_and_a_builtins_name_as_the_programs(code):
    pairs = row_tests({"input_output": json.dumps({"inputs": [[2]], "outputs": [[[1, 2]]], "fn_name": "divmod"})})
    assert code.run_tests("def divmod(n):\n    return (1, 2)\n", pairs).rate == 1.0  # APPS: tuple == list
    assert code.run_tests("x = 1\n", pairs).rate == 0.0  # not the builtin divmod: the program defines none


def test_preflight_reads_a_datasets_tests_a_batch_at_a_time_and_names_the_bad_row(code):
    """CodeContests' tests are gigabytes: preflight reads them in batches; a bad row is still named by its index."""
    from datasets import Dataset

    from colograd.config.core import ConfigError
    from colograd.preflight.core import _reader
    from colograd.rewards.code import check_code_rows

    good = {"input": ["1 2\n"], "output": ["3\n"]}
    rows = [{"public_tests": good if i != 513 else {"input": ["1"], "output": []}} for i in range(600)]
    dataset = Dataset.from_list(rows)
    batches = list(_reader(dataset, batch=256)(["public_tests"]))
    assert [len(b["public_tests"]) for b in batches] == [256, 256, 88]
    with pytest.raises(ConfigError, match="dataset 'cc' row 513: public_tests has 1 inputs for 0 outputs"):
        check_code_rows([code], dataset.column_names, _reader(dataset, batch=256), "cc")
