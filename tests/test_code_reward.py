"""The code rewards' meanings (open-r1's), worked by hand, and scoring started early giving the same rewards."""

import json

import pytest

from colograd import code_task
from colograd.code_rewards import CodeReward, extract_code, output_matches
from colograd.config import ConfigError
from colograd.rewards import resolve_reward
from colograd.sandbox import SandboxLimits

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


def test_outputs_compare_line_by_line_stripped_over_the_shorter():
    assert output_matches(" 3 \n4\n\n", "3\n4")
    assert not output_matches("3\n5", "3\n4")
    assert output_matches("3", "3\n4")  # open-r1 zips the lines: the shorter side decides


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
    assert resolve_reward("code", "none").sandbox.isolated is False
    with pytest.raises(ConfigError, match="code_sandbox: 'docker'"):
        resolve_reward("code", "docker")


def test_started_early_the_rewards_are_the_same_and_run_once(code, monkeypatch):
    completions = [block(SUM), block("print(3)\n"), block(SUM), "none"]
    infos = [INFO, INFO, {**INFO, "test_cases": INFO["test_cases"][:1]}, INFO]
    after = code(completions, infos)
    runs = []
    real_run = code.sandbox.run
    monkeypatch.setattr(code.sandbox, "run", lambda *a: runs.append(a) or real_run(*a))
    code.prefetch(completions[:2], infos[:2])  # the first two finished while the others decode
    code.prefetch(completions[2:], infos[2:])
    assert code(completions, infos) == after
    assert len(runs) == 7  # 3 + 3 + 1 cases, each run once: scoring took the started ones


def test_the_offline_code_task_is_solved_by_a_correct_program(code):
    rows = code_task.code_sums_dataset(4)
    assert code([block(SUM)] * 4, rows["verification_info"]) == [1.0] * 4
    assert "```python" in rows[0]["prompt"][0]["content"]
