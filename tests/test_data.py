"""Loading prompts: local files and folders, splits, and one-line errors. Nothing is downloaded."""

import json

import pytest

from colograd import ScriptArguments
from colograd.config import ConfigError
from colograd.data import load_prompts
from colograd.sums import sum_reward

ROWS = [{"prompt": "ab>a:", "target": "a"}, {"prompt": [{"role": "user", "content": "cd>d"}], "target": "d"}]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_jsonl_file_keeps_extra_columns(tmp_path):
    dataset = load_prompts(ScriptArguments(dataset_name=str(write_jsonl(tmp_path / "p.jsonl", ROWS[:1]))))
    assert dataset.column_names == ["prompt", "target"] and dataset[0]["target"] == "a"


def test_folder_files_name_the_splits_and_messages_survive(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS[1:] * 3)
    write_jsonl(tmp_path / "test.jsonl", ROWS[1:])
    train = load_prompts(ScriptArguments(dataset_name=str(tmp_path)))
    test = load_prompts(ScriptArguments(dataset_name=str(tmp_path), dataset_train_split="test"))
    assert len(train) == 3 and len(test) == 1
    assert train[0]["prompt"] == [{"role": "user", "content": "cd>d"}]  # conversational rows stay messages


def test_builtin_dataset():
    assert load_prompts(ScriptArguments(dataset_name="colograd:letters"))[0]["prompt"].endswith(":")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dataset_train_split": "validation"}, "dataset_train_split='validation'"),
        ({"dataset_config": "main"}, "dataset_config='main'"),
        ({"dataset_name": "colograd:nothing"}, "built-in datasets"),
    ],
)
def test_errors_name_the_field(tmp_path, kwargs, message):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:1])
    with pytest.raises(ConfigError, match=message):
        load_prompts(ScriptArguments(**{"dataset_name": str(path), **kwargs}))


def test_missing_prompt_column(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "x"}])
    with pytest.raises(ConfigError, match="no 'prompt' column"):
        load_prompts(ScriptArguments(dataset_name=str(path)))


def test_builtin_sums_are_chat_prompts_with_their_sum():
    dataset = load_prompts(ScriptArguments(dataset_name="colograd:sums"))
    assert len(dataset) == 4096 and dataset.column_names == ["prompt", "answer"]
    for row in dataset.select(range(20)):
        (message,) = row["prompt"]
        a, b = message["content"].removeprefix("What is ").split("?")[0].split(" + ")
        assert message["role"] == "user" and 1 <= int(a) <= 30 and row["answer"] == str(int(a) + int(b))


def test_sum_reward_reads_the_last_number_of_the_reply():
    replies = ["41", "28 + 13 = 41", "41, or 42", "The answer is forty-one.", "", "041", "-41"]
    completions = [[{"role": "assistant", "content": r}] for r in replies]
    assert sum_reward(completions, ["41"] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert sum_reward(["so 12 + 7 = 19"], ["19"]) == [1.0]  # text completions (standard prompts) too
