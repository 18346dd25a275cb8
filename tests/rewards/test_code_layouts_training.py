"""`reward_funcs: [code]` trains on each competitive-programming layout as its dataset ships it, with only the dataset
changed: each layout's rows are written to a JSON-lines file, loaded the way `dataset_name` loads a local file
(`load_prompts`, through `datasets`' Arrow round trip of nested columns), checked as preflight checks them, and
sampled and scored by the trainer's own stages on the real engine. Each completion's program is a right or a wrong
one, chosen from its text, so every reward the trainer computes is known: a layout whose columns reached the reward
changed or incomplete would score a right program below 1."""

import json

import pytest
import torch
from test_code_layouts import ROWS

from colograd.config.data import ScriptArguments
from colograd.data.core import load_prompts
from colograd.models import tiny
from colograd.rewards.code import CodeReward, check_code_rows
from colograd.rewards.sandbox import SandboxLimits
from colograd.trainer import GRPOTrainer

pytestmark = pytest.mark.slow  # one engine start, a rollout per layout

RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
# Right on the first case (1 2) only: 1/3 where every case reached the reward, more where a layout's later columns
# (CodeContests' private and generated tests, LiveCodeBench's compressed private ones) were lost on the way.
WRONG = "input()\nprint(3)\n"
PROMPTS = 2  # rows per layout, each sampled num_generations times
G = 4


def program(completion: str) -> str:
    """The policy's program: right or wrong by its completion's length, so both occur in a rollout."""
    return RIGHT if len(completion) % 2 == 0 else WRONG


def written(layout: str, folder) -> str:
    """The layout's rows as a JSON-lines file, a prompt column beside their own columns."""
    path = folder / f"{layout.split()[0].replace('/', '-')}.jsonl"
    row = {"description": "Read two integers and print their sum.", **ROWS[layout]}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(PROMPTS)))
    return str(path)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> GRPOTrainer:
    folder = tmp_path_factory.mktemp("layouts")
    reward = CodeReward(limits=SandboxLimits(wall_s=2.0, cpu_s=1), workers=2, program=program)
    args = tiny.run_config(str(folder / "run"), 1, per_device_train_batch_size=PROMPTS * G, num_generations=G,
                           max_completion_length=8)  # fmt: skip
    dataset = load_prompts(ScriptArguments(dataset_name=written("CodeContests", folder),
                                           dataset_prompt_column="description"))  # fmt: skip
    return GRPOTrainer(tiny.build_model(), reward, args, dataset, processing_class=tiny.build_tokenizer())


@pytest.mark.parametrize("layout", ROWS)
def test_each_layout_loads_passes_preflight_and_scores_each_program_in_the_trainer(trainer, layout, tmp_path):
    path = written(layout, tmp_path)
    dataset = load_prompts(ScriptArguments(dataset_name=path, dataset_prompt_column="description"))
    check_code_rows(trainer.reward_funcs, dataset.column_names, lambda names: dataset.select_columns(names)[:], layout)
    trainer.sync_for_rollout()
    scored = trainer.sample([dataset[i] for i in range(PROMPTS)])
    texts = trainer.processing_class.batch_decode(scored.rollout.completion_ids, skip_special_tokens=True)
    expected = torch.tensor([1.0 if program(text) == RIGHT else 1 / 3 for text in texts])
    assert 1.0 in expected and expected.min() < 1, texts  # both programs in the rollout: the check has power
    assert torch.allclose(scored.rewards_NF[:, 0], expected), (layout, scored.rewards_NF[:, 0], texts)


def test_a_code_run_trains_a_step_on_a_contest_layout(trainer):
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1 and 0.0 < logs[0]["rewards/code/mean"] < 1.0, logs
