"""The code rewards' meanings (open-r1's), worked by hand, for stdin/stdout and assert-style tests; scoring started
early giving the same rewards; rows whose tests cannot be read refused before the run starts."""

import json
import re
import threading

import pytest
from conftest import ROOT, refused

from colograd.config.core import ConfigError, ScriptArguments
from colograd.data import code_task
from colograd.rewards.code import CodeReward, check_code_rows, extract_code, output_matches
from colograd.rewards.code_tests import parse_python
from colograd.rewards.core import resolve_reward
from colograd.rewards.sandbox import SandboxLimits
from colograd.rewards.sandbox_session import Session

LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1)
SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
INFO = {
    "language": "python",
    "test_cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2\n", "output": "4\n"},
                   {"input": "5 -5\n", "output": "0\n"}],
}  # fmt: skip


def block(code: str, language: str = "python") -> str:
    return f"Here it is:\n```{language}\n{code}```\n"


@pytest.fixture(scope="module")
def code() -> CodeReward:
    return CodeReward(limits=LIMITS, workers=2)


def test_the_last_python_block_is_the_program():
    text = block("print(1)\n") + "then\n" + block("print(2)\n") + block("echo 3\n", "bash")
    assert extract_code(text) == "print(2)\n"
    assert extract_code("no code here") == "" and extract_code("```\nprint(1)\n```") == ""


def test_outputs_compare_every_line_stripped():
    assert output_matches(" 3 \n4\n\n", "3\n4") and output_matches("3\n4\n", "3\n4\n")
    assert not output_matches("3\n5", "3\n4")
    assert not output_matches("3", "3\n4") and not output_matches("3\n4\n5", "3\n4")  # a line short, a line more
    assert output_matches("", "") and output_matches("\n", "") and not output_matches("x", "")


def test_open_r1s_comparison_over_the_shorter_is_an_opt_in(code):
    assert output_matches("3", "3\n4", "shorter")  # open-r1 zips the lines: the shorter side decides
    first_line_only = {"language": "python", "test_cases": [{"input": "", "output": "3\n4\n"}]}
    shorter = CodeReward(limits=LIMITS, workers=1, output_lines="shorter")
    assert code([block("print(3)\n")], [first_line_only]) == [0.0]
    assert shorter([block("print(3)\n")], [first_line_only]) == [1.0]
    assert resolve_reward("code", ScriptArguments(code_output_lines="shorter")).output_lines == "shorter"
    with pytest.raises(ConfigError, match="code_output_lines: 'first'"):
        resolve_reward("code", ScriptArguments(code_output_lines="first"))


def test_the_reward_is_the_share_of_cases_passed(code):
    wrong_on_one = "a, b = map(int, input().split())\nprint(a + b if a != 5 else 1)\n"
    completions = [block(SUM), block(wrong_on_one), block("print(3)\n"), "no program"]
    assert code(completions, [INFO] * 4) == [1.0, 2 / 3, 1 / 3, 0.0]


def test_binary_needs_every_case(code):
    binary = CodeReward(binary=True, limits=LIMITS, workers=2)
    wrong_on_one = "a, b = map(int, input().split())\nprint(a + b if a != 5 else 1)\n"
    assert binary([block(SUM), block(wrong_on_one)], [INFO] * 2) == [1.0, 0.0]
    assert binary.__name__ == "binary_code" and code.__name__ == "code"


def test_an_empty_program_passes_only_cases_that_expect_nothing(code):
    silent = {"language": "python", "test_cases": [{"input": "", "output": ""}, {"input": "", "output": "1"}]}
    assert code(["no block"], [silent]) == [0.5]


def test_failure_reasons_reach_the_completions_log(code):
    logged = {}
    completions = [
        block(SUM),
        block("print(4)\n"),
        block("def (\n"),
        block("import time\ntime.sleep(100)\n"),
        block("x = bytearray(1 << 40)\n"),
        block("raise SystemExit(3)\n"),
        "none",
    ]
    one_case = {**INFO, "test_cases": INFO["test_cases"][:1]}  # the wall time is spent once
    code(completions, [one_case] * len(completions), log_extra=lambda column, values: logged.update({column: values}))
    assert logged == {
        "code_failure": [None, "wrong answer", "syntax error", "timeout", "memory", "exit code 3", "no code block"]
    }


def test_chats_and_json_text_are_read(code):
    chat = [{"role": "assistant", "content": block(SUM)}]
    assert code([chat], [json.dumps(INFO)]) == [1.0]


def test_other_languages_are_refused(code):
    with pytest.raises(ValueError, match="python only"):
        code([block(SUM)], [{**INFO, "language": "cpp"}])


def test_names_resolve_in_recipes():
    assert resolve_reward("code").__name__ == "code" and resolve_reward("binary_code").binary
    assert resolve_reward("code")([block(ADD)], test_list=[MBPP["test_list"]]) == [1.0]
    assert resolve_reward("code", ScriptArguments(code_sandbox="none")).sandbox.isolated is False
    with pytest.raises(ConfigError, match="code_sandbox: 'docker'"):
        resolve_reward("code", ScriptArguments(code_sandbox="docker"))


def test_started_early_the_rewards_are_the_same_and_run_once(code, monkeypatch):
    completions = [block(SUM), block("print(3)\n"), block(SUM), "none"]
    infos = [INFO, INFO, {**INFO, "test_cases": INFO["test_cases"][:1]}, INFO]
    after = code(completions, infos)
    runs = []
    real_case = Session.case
    monkeypatch.setattr(Session, "case", lambda self, *a, **k: runs.append(a) or real_case(self, *a, **k))
    code.prefetch(completions[:2], infos[:2])  # the first two finished while the others decode
    code.prefetch(completions[2:], infos[2:])
    assert code(completions, infos) == after
    # 3 + 3 (print(3) passes the first case and fails the others: the fraction reads them all) + 1 cases, each run
    # once: scoring took the started ones
    assert len(runs) == 7


def test_the_offline_code_task_is_solved_by_a_correct_program(code):
    rows = code_task.code_sums_dataset(4)
    assert code([block(SUM)] * 4, rows["verification_info"]) == [1.0] * 4
    assert "```python" in rows[0]["prompt"][0]["content"]


# --- assert-style tests ------------------------------------------------------------------------------------------

ADD = "def add(a, b):\n    return a + b\n"
WRONG_ON_ZERO = "def add(a, b):\n    return a + b if a else -1\n"
MBPP = {"test_list": ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-1, 1) == 0"],
        "test_setup_code": "", "test_imports": []}  # fmt: skip
HUMANEVAL = {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 5) == 5\n",
             "entry_point": "add"}  # fmt: skip


def test_each_assert_is_one_test_and_the_reward_is_the_share_passed(code):
    completions = [block(ADD), block(WRONG_ON_ZERO), block("def add(a, b):\n    return 0\n"), "no program"]
    assert code(completions, test_list=[MBPP["test_list"]] * 4) == [1.0, 2 / 3, 1 / 3, 0.0]
    assert code(completions[:2], test_cases=[MBPP["test_list"]] * 2) == [1.0, 2 / 3]  # AceCode's column
    binary = CodeReward(binary=True, limits=LIMITS, workers=2)
    assert binary(completions, test_list=[MBPP["test_list"]] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_humaneval_check_is_one_test(code):
    completions = [block(ADD), block(WRONG_ON_ZERO)]
    assert code(completions, **{k: [v] * 2 for k, v in HUMANEVAL.items()}) == [1.0, 0.0]


def test_setup_runs_before_the_program_and_main_blocks_do_not(code):
    row = {"test_list": ["assert area(Square(3)) == 9"], "test_setup_code": "class Square:\n    def __init__(self, "
           "side):\n        self.side = side\n", "test_imports": ["import math"]}  # fmt: skip
    program = "def area(s):\n    return int(math.pow(s.side, 2))\n\nif __name__ == '__main__':\n    area(input())\n"
    assert code([block(program)], **{k: [v] for k, v in row.items()}) == [1.0]


def test_rows_of_different_layouts_score_together(code):
    # A dataset joined from several keeps every column; a row's null columns do not count.
    columns = {"verification_info": [INFO, None, None], "test_list": [None, MBPP["test_list"], None],
               "test": [None, None, HUMANEVAL["test"]], "entry_point": [None, None, "add"]}  # fmt: skip
    assert code([block(SUM), block(ADD), block(ADD)], **columns) == [1.0, 1.0, 1.0]


def test_assert_failures_reach_the_completions_log_and_early_exits_pass_nothing(code):
    logged = {}
    completions = [
        block(ADD),
        block(WRONG_ON_ZERO),
        block("def add(a, b):\n    return a / 0\n"),
        block("def add(a, b) return\n"),
        block("import os\nos._exit(0)\n"),  # exits 0 before any test: no report, no pass
        block("import sys\ndef add(a, b):\n    sys.exit(0)\n"),
        block("import builtins, __main__\nbuiltins.exec = lambda *a: None\n__main__._outcome = lambda e: 'ok'\n"),
        block("x = bytearray(1 << 40)\n"),
        "none",
    ]
    rows = [MBPP["test_list"]] * len(completions)
    rewards = code(completions, test_list=rows, log_extra=lambda column, values: logged.update({column: values}))
    assert rewards == [1.0, 2 / 3] + [0.0] * 7
    assert logged == {"code_failure": [None, "wrong answer", "error: ZeroDivisionError", "syntax error",
                                       "exited early", "exited early", "error: NameError", "memory",
                                       "no code block"]}  # fmt: skip


def test_a_timeout_fails_the_tests_it_did_not_finish():
    code = CodeReward(limits=SandboxLimits(wall_s=1.0, cpu_s=1), workers=1)
    hangs_on_zero = "def add(a, b):\n    while not a:\n        pass\n    return a + b\n"
    logged = {}
    rewards = code([block(hangs_on_zero)], test_list=[MBPP["test_list"]], log_extra=lambda c, v: logged.update({c: v}))
    assert rewards == [1 / 3] and logged["code_failure"][0] in ("timeout", "cpu time")


def test_assert_tests_started_early_run_once(code, monkeypatch):
    completions, rows = [block(ADD), block(ADD), block(WRONG_ON_ZERO)], [MBPP["test_list"]] * 3
    after = code(completions, test_list=rows)
    runs = []
    real_run = code.sandbox.run
    monkeypatch.setattr(code.sandbox, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k))
    code.prefetch(completions, test_list=rows)
    assert code(completions, test_list=rows) == after == [1.0, 1.0, 2 / 3]
    assert len(runs) == 2  # one execution per distinct program, all its tests in it


BAD_ROWS = {
    "no tests": ({"unit_tests": "[]"}, "no column of tests"),
    "empty test_list": ({"test_list": []}, "test_list is empty"),
    "test_list as text": ({"test_list": "assert add(1, 2) == 3"}, "test_list is a str"),
    "a test asserting nothing": ({"test_list": ["add(1, 2)"]}, "has no assert that runs"),
    "an assert of a constant": ({"test_list": ["add(1, 2)\nassert True"]}, "has no assert that runs"),
    "an assert under if False": ({"test_cases": ["if False:\n    assert add(1, 2) == 3"]}, "has no assert that runs"),
    "an assert in an uncalled function": (
        {"test_list": ["def t():\n    assert add(1, 2) == 3"]},
        "has no assert that runs",
    ),
    "check's asserts in a helper it never calls": (
        {
            "test": "def helper(c):\n    assert c(1, 2) == 3\ndef check(candidate):\n    candidate(1, 2)\n",
            "entry_point": "add",
        },
        "check(candidate) has no assert that runs",
    ),
    "a test of builtins only": ({"test_list": ["assert abs(-1) == len([1])"]}, "uses nothing of the program"),
    "builtins, one of them the program's?": (
        {"test_cases": ["assert max([1, 2]) == 2", "assert abs(min(1)) == 1"]},
        "named like a builtin",
    ),
    "a test of the setup only": (
        {"test_list": ["assert x == 1"], "test_setup_code": "x = 1"},
        "uses nothing of the program",
    ),
    "a test that does not parse": ({"test_cases": ["assert add(1, 2) =="]}, "does not parse as Python"),
    "test without entry_point": ({"test": HUMANEVAL["test"]}, "entry_point is not"),
    "test without check": ({"test": "assert add(1, 2) == 3", "entry_point": "add"}, "no check(candidate)"),
    "another language": ({"verification_info": {**INFO, "language": "cpp"}}, "python only"),
    "no stdin/stdout cases": ({"verification_info": {"language": "python", "test_cases": []}}, "no test_cases"),
    "asserts as stdin/stdout cases": ({"verification_info": {"test_cases": ["assert x"]}}, "go in a test_list"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_rows_whose_tests_cannot_be_read_are_refused_in_one_line(code, case):
    bad, problem = BAD_ROWS[case]
    rows = [{"prompt": "a", "test_list": MBPP["test_list"]}, {"prompt": "b", **bad}]
    if case == "no tests":
        rows = [{"prompt": "a", **bad}]
    columns = sorted({c for row in rows for c in row})
    with pytest.raises(ConfigError) as err:
        check_code_rows([code], columns, lambda names: {c: [r.get(c) for r in rows] for c in names}, "data")
    message = str(err.value)
    assert problem in message and "\n" not in message
    assert message.startswith("reward function 'code': dataset 'data'" + ("" if case == "no tests" else " row 1:"))
    with pytest.raises(ValueError, match=re.escape(problem if case != "no tests" else "no tests")):  # at scoring too
        code([block(ADD)] * len(rows), **{c: [r.get(c) for r in rows] for c in columns if c != "prompt"})


def test_the_run_refuses_a_bad_row_before_it_loads_weights(tmp_path):
    rows = [{"prompt": f"{i}+1=", "test_list": [f"assert add({i}, 1) == {i + 1}"]} for i in range(8)]
    rows[5]["test_list"] = []
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = refused("--config", str(ROOT / "recipes/grpo_tiny.yaml"), "--dataset_name", str(data),
                      "--reward_funcs", "code", "--output_dir", str(tmp_path / "out"))  # fmt: skip
    assert "reward function 'code'" in message and "row 5: test_list is empty" in message


def test_the_offline_function_task_is_solved_by_a_correct_function(code):
    rows = code_task.code_functions_dataset(4)
    assert code([block(ADD)] * 4, test_list=rows["test_list"]) == [1.0] * 4
    assert "```python" in rows[0]["prompt"][0]["content"]


def test_a_chat_completion_without_text_is_the_empty_program(code):
    chats = [[{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}],
             [{"role": "assistant", "content": [{"type": "image"}]}]]  # fmt: skip
    logged = {}
    assert code(chats, [INFO] * 2, log_extra=lambda c, v: logged.update({c: v})) == [0.0, 0.0]
    assert logged["code_failure"] == ["no code block"] * 2


class _Finalized:
    """Garbage whose finalizer runs Python: the collector may call it in the middle of a parse, and another thread
    then runs."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        sum(range(2000))


def test_the_row_reader_parses_safely_from_many_threads():
    # The reward call reads rows in its thread while its pool's threads name each row's tests; on CPython 3.11 two
    # unguarded parses at once fail one with "SystemError: AST constructor recursion depth mismatch" (bare
    # `ast.parse` in place of `parse_python` fails this in most runs on 3.11).
    source = "\n".join(f"def f{i}(x):\n    return [y * {i} for y in x if y > {i}] + list(map(lambda z: -z, x))"
                       for i in range(300))  # fmt: skip
    errors = []

    def parse_often():
        for _ in range(40):
            [_Finalized() for _ in range(200)]
            try:
                parse_python(source)
            except SystemError as err:
                errors.append(err)

    threads = [threading.Thread(target=parse_often) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_the_package_parses_python_only_through_the_guarded_parse():
    parses = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "colograd").rglob("*.py"))
        for line in path.read_text().splitlines()
        if "ast.parse(" in line and not line.lstrip().startswith(("#", '"""', "`"))
    ]
    assert parses == ["colograd/rewards/code_tests.py"]  # the one in `parse_python`, under its lock
