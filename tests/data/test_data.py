"""Loading prompts: local files and folders, splits, and one-line errors. Nothing is downloaded."""

import json
from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from accelerate.utils import DataLoaderConfiguration
from datasets import IterableDataset

from colograd import GRPOConfig, ScriptArguments
from colograd.config.core import ConfigError
from colograd.data.core import keep_rows, load_prompts
from colograd.data.streaming import check_stream, check_stream_resume, rollout_stream
from colograd.data.sums import sum_reward
from colograd.models import tiny
from colograd.preflight.core import check_stream_data

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


# --- streamed datasets --------------------------------------------------------------------------------------------


def stream_args(tmp_path, **kwargs) -> GRPOConfig:
    """2 prompts per rank and micro-step (G=4), 2 micro-steps per rollout."""
    kwargs = {"per_device_train_batch_size": 8, "num_generations": 4, "steps_per_generation": 2, "max_steps": 3,
              **kwargs}  # fmt: skip
    return GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", **kwargs)


def two_ranks() -> SimpleNamespace:
    """What `rollout_stream` reads of the accelerator of a 2-process run."""
    return SimpleNamespace(num_processes=2, dataloader_config=DataLoaderConfiguration())


def rank_batches(stream, rank: int, world: int, batch_size: int, epoch: int = 0, skip: int = 0) -> list[list[str]]:
    """What rank `rank` of `world` trains on: accelerate's own preparation of the Trainer's dataloader."""
    loader = torch.utils.data.DataLoader(stream, batch_size=batch_size, collate_fn=keep_rows)
    loader = prepare_data_loader(loader, num_processes=world, process_index=rank, put_on_device=False,
                                 dispatch_batches=False)  # fmt: skip
    loader = skip_first_batches(loader, skip) if skip else loader
    loader.set_epoch(epoch)
    return [[row["prompt"] for row in batch] for batch in loader]


def test_a_stream_reaches_each_rank_as_the_repeat_sampler_orders_prompts(tmp_path):
    rows = [{"prompt": f"p{i}", "target": "a"} for i in range(20)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    stream = load_prompts(ScriptArguments(dataset_name=str(path)), streaming=True)
    assert isinstance(stream, IterableDataset)
    args = stream_args(tmp_path, shuffle_dataset=False)
    accelerator = two_ranks()
    ordered = rollout_stream(stream, args, accelerator)
    assert accelerator.dataloader_config.dispatch_batches is False  # each rank reads the stream and keeps its slice
    per_rank = args.prompts_per_rollout  # 4 prompts a rollout
    ranks = [rank_batches(ordered, rank, 2, per_rank) for rank in range(2)]
    # Each rollout batch (8 prompts in stream order) is split between the ranks, and every rank's slice comes
    # twice (once per micro-step training on it); the 4 trailing prompts make no full rollout and are dropped.
    assert ranks[0] == [["p0", "p1", "p2", "p3"]] * 2 + [["p8", "p9", "p10", "p11"]] * 2
    assert ranks[1] == [["p4", "p5", "p6", "p7"]] * 2 + [["p12", "p13", "p14", "p15"]] * 2
    # Shuffled (through a buffer, by seed): another order each epoch, the same on every rank and every run, and
    # still disjoint between ranks.
    shuffled = rollout_stream(stream, stream_args(tmp_path), two_ranks())
    epochs = [[rank_batches(shuffled, rank, 2, per_rank, epoch) for rank in range(2)] for epoch in range(2)]
    assert epochs[0] != epochs[1] and epochs[0] == [rank_batches(shuffled, rank, 2, per_rank) for rank in range(2)]
    for rank0, rank1 in epochs:
        assert all(set(a).isdisjoint(b) for a, b in zip(rank0, rank1, strict=True))
    # Resuming (the Trainer skips the micro-batches already trained) continues where the run stopped.
    assert rank_batches(shuffled, 1, 2, per_rank, skip=3) == epochs[0][1][3:]


def test_a_stream_needs_max_steps_and_one_reader(tmp_path):
    stream = load_prompts(ScriptArguments(dataset_name="colograd:letters"), streaming=True)
    with pytest.raises(ConfigError, match="set max_steps"):
        check_stream(stream, stream_args(tmp_path, max_steps=-1))
    with pytest.raises(ConfigError, match="dataloader_num_workers must be 0"):
        check_stream(stream, stream_args(tmp_path, dataloader_num_workers=2))
    with pytest.raises(ConfigError, match="without a length"):
        check_stream(iter([]), stream_args(tmp_path))


def test_preflight_checks_a_streams_first_rows_without_advancing_it(tmp_path):
    rows = [{"prompt": f"ab{i}>", "target": "a"} for i in range(12)]
    rows[3]["prompt"] = "  "
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    stream = load_prompts(ScriptArguments(dataset_name=str(path)), streaming=True)
    tokenizer, args = tiny.build_tokenizer(), stream_args(tmp_path)
    with pytest.raises(ConfigError, match="row 3: prompt is empty"):
        check_stream_data(stream, tokenizer, [], args)
    kept = check_stream_data(stream, tokenizer, [], args, drop_invalid=True)
    # Training reads the stream from its first row, the invalid one filtered out as it goes.
    assert [row["prompt"] for row in kept] == [row["prompt"] for i, row in enumerate(rows) if i != 3]
    short = load_prompts(
        ScriptArguments(dataset_name=str(write_jsonl(tmp_path / "s.jsonl", rows[:3]))), streaming=True
    )
    with pytest.raises(ConfigError, match="has 3 usable rows, fewer than one rollout batch"):
        check_stream_data(short, tokenizer, [], args)


def test_resuming_a_stream_after_its_end_is_refused(tmp_path):
    stream = load_prompts(ScriptArguments(dataset_name="colograd:letters"), streaming=True)
    for epoch, refused in ((0.5, False), (1.0, False), (1.25, True)):
        checkpoint = tmp_path / f"checkpoint-{epoch}"
        checkpoint.mkdir()
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4, "epoch": epoch}))
        if refused:
            with pytest.raises(ConfigError, match="read to its end 1 time"):
                check_stream_resume(stream, str(checkpoint))
        else:
            check_stream_resume(stream, str(checkpoint))
        check_stream_resume(load_prompts(ScriptArguments(dataset_name="colograd:letters")), str(checkpoint))


@pytest.mark.parametrize("name", ["colograd:letters", "folder"])
def test_stream_of_a_builtin_or_a_folder_keeps_the_prompt_column(tmp_path, name):
    if name == "folder":
        write_jsonl(tmp_path / "train.jsonl", [{"question": "x?"}])
        name = str(tmp_path)
    args = ScriptArguments(dataset_name=name, dataset_prompt_column="question" if name == str(tmp_path) else "prompt")
    first = next(iter(load_prompts(args, streaming=True)))
    assert "prompt" in first
    empty = write_jsonl(tmp_path / "e.jsonl", [])
    empty.write_text("\n")
    with pytest.raises(ConfigError):
        load_prompts(ScriptArguments(dataset_name=str(empty)), streaming=True)


def test_a_resumed_runs_sampler_gives_each_epoch_the_order_an_uninterrupted_run_gives_it():
    """TRL's sampler draws epoch e's order as the (e + 1)-th draw of one generator; a resumed run's sampler skips the
    draws of the epochs it trained, so its epoch is in the uninterrupted run's order, not the first epoch's."""
    from colograd.data.streaming import EpochOrder

    def sampler():
        return EpochOrder(list(range(12)), mini_repeat_count=1, batch_size=4, repeat_count=2, seed=5)

    uninterrupted = sampler()
    epochs = [list(uninterrupted) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    for e in range(3):
        resumed = sampler()
        resumed.skip_epochs(e)
        assert list(resumed) == epochs[e]
    unshuffled = EpochOrder(list(range(12)), mini_repeat_count=1, batch_size=4, shuffle=False)
    unshuffled.skip_epochs(2)
    assert list(unshuffled) == list(range(12))
