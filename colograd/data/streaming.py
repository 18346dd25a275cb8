"""The trainer's rollout batches of prompts (`RolloutBatches`), and training on a streamed dataset
(`datasets.IterableDataset`), read in the order `RepeatSampler` gives a map-style one.

A stream cannot be indexed, so no sampler can pick its rows. Instead the stream itself is reordered: rollout
batches of `rollout_prompts` rows (all ranks' prompts), each yielded once per micro-step that trains on it
(`RolloutStream`). Every rank reads the same stream and accelerate's `IterableDatasetShard` hands each its own
contiguous slice of every batch, so ranks see different prompts, and a rank samples all G completions of its
prompts itself (n=G). Where groups span ranks, each batch is yielded once per rank too, so that each rank's slice is
the whole batch: every rank reads all the rollout's prompts and samples its share of their completions
(`colograd.rollout.spans`). It has no length, so a run needs `max_steps`; a stream that ends starts again (the next
epoch, reshuffled).
"""

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from transformers import Trainer
from transformers.trainer_utils import has_length
from trl.trainer.utils import RepeatSampler

from colograd.config.core import ConfigError, GRPOConfig
from colograd.data.core import first_line
from colograd.runs.checkpoints import STATE_FILE

PEEK_ROWS = 256  # rows of a stream that preflight checks (at least one rollout batch's)
# The key under which a row read for training carries its index in the dataset (a stream: its position as read), so
# that a check at its rollout can name it; the trainer removes it before anything else reads the row.
ROW_KEY = "__colograd_row__"


class RolloutStream(torch.utils.data.IterableDataset):
    """`dataset`'s rows in rollout batches of `batch_size` (all ranks' prompts), each batch `repeat_count` times;
    a trailing batch too short to fill a rollout is dropped, as `RepeatSampler` drops it.

    Args:
        dataset: the streamed rows.
        batch_size: prompts of one rollout over all ranks.
        repeat_count: micro-steps that train on one rollout (`steps_per_generation × num_iterations`).
        numbered: each row carries its name ("train_dataset row 300": its position in the stream, as read after
            any shuffle) under `ROW_KEY`, and a row that cannot be read is refused naming that position.
    """

    def __init__(
        self, dataset: datasets.IterableDataset, batch_size: int, repeat_count: int, numbered: bool = False
    ) -> None:
        self.dataset, self.batch_size, self.repeat_count = dataset, batch_size, repeat_count
        self.numbered = numbered

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer each epoch: a shuffled stream reshuffles with `seed + epoch`."""
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        rows = _numbered(iter(self.dataset)) if self.numbered else iter(self.dataset)
        while len(batch := list(itertools.islice(rows, self.batch_size))) == self.batch_size:
            for _ in range(self.repeat_count):
                yield from batch


def _numbered(rows: Iterator[dict], name: str = "train_dataset") -> Iterator[dict]:
    """`rows`, each with its name (by its position) under `ROW_KEY`; a row that cannot be read (an image that does
    not decode as the stream reads it) is refused in one line naming its position."""
    for index in itertools.count():
        try:
            row = next(rows)
        except StopIteration:
            return
        except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError) as err:
            raise ConfigError(f"{name} row {index} cannot be read ({first_line(err)}); fix or remove it.") from err
        yield {**row, ROW_KEY: f"{name} row {index}"}


class NumberedRows(torch.utils.data.Dataset):
    """An in-memory dataset whose rows carry their name ("train_dataset row 300") under `ROW_KEY`; a row that cannot
    be read (an image that does not decode) is refused in one line naming it."""

    def __init__(self, dataset: Any, name: str = "train_dataset") -> None:
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return {**read_row(self.dataset, index, self.name), ROW_KEY: f"{self.name} row {index}"}


def read_row(dataset: Any, index: int, name: str = "train_dataset") -> dict:
    """Row `index` of an in-memory dataset, or a one-line refusal naming it (an image that does not decode)."""
    try:
        return dataset[index]
    except Exception as err:  # datasets decodes an Image column as a row is read
        raise ConfigError(f"{name} row {index} cannot be read ({first_line(err)}); fix or remove it.") from None


def named_rows(rows: list[dict], name: str, indices: Iterable[int]) -> list[dict]:
    """`rows` carrying their names under `ROW_KEY`: `name` and each one's index in it (`indices`)."""
    return [{**row, ROW_KEY: f"{name} row {i}"} for row, i in zip(rows, indices, strict=True)]


def row_names(rows: list[dict]) -> tuple[list[dict], list[str] | None]:
    """The rows without the name they carry (`ROW_KEY`), and each one's name ("train_dataset row 300"); None where
    the rows carry none."""
    if rows and ROW_KEY in rows[0]:
        return [{k: v for k, v in row.items() if k != ROW_KEY} for row in rows], [row[ROW_KEY] for row in rows]
    return rows, None


def rollout_stream(dataset: Any, args: GRPOConfig, accelerator: Accelerator, numbered: bool = False) -> RolloutStream:
    """The training stream of `dataset` (shuffled through a buffer with `shuffle_dataset`), for a dataloader of
    `prompts_per_rollout` rows per rank.

    Each rank must read the whole stream and keep its slice of every batch, so accelerate's dispatching (rank 0
    reads and sends) is turned off, and so is its sharding by the stream's files, which would give each rank
    other rollout batches of other lengths."""
    check_stream(dataset, args)
    if args.shuffle_dataset:
        dataset = dataset.shuffle(seed=args.seed)
    accelerator.dataloader_config.dispatch_batches = False
    world = accelerator.num_processes
    return RolloutStream(dataset, rollout_batch_size(args, world), rollout_repeats(args, world), numbered)


def rollout_batch_size(args: GRPOConfig, world: int) -> int:
    """Prompts of one rollout over all `world` ranks: each rank's `prompts_per_rollout`, or where groups span ranks,
    which every rank reads whole, those."""
    return args.prompts_per_rollout * (1 if args.groups_span_ranks else world)


def rollout_repeats(args: GRPOConfig, world: int) -> int:
    """How many times a rollout's batch of prompts is read: once per micro-step that trains on it, and where groups
    span ranks once per rank too, so that the slice accelerate hands each rank is the whole batch."""
    return args.rollout_micro_steps * (world if args.groups_span_ranks else 1)


def check_stream(dataset: Any, args: GRPOConfig) -> None:
    """A dataset without a length can be trained on when it is a `datasets.IterableDataset`, `max_steps` says how
    long, and one dataloader process reads it (several would each read all of it)."""
    if not isinstance(dataset, datasets.IterableDataset):
        raise ConfigError(
            f"train_dataset is a {type(dataset).__name__} without a length; give a datasets.Dataset, or a "
            "datasets.IterableDataset to stream it."
        )
    if args.max_steps <= 0:
        raise ConfigError(
            "a streamed dataset has no length, so the run's length must be given: set max_steps (e.g. --max_steps "
            "1000)."
        )
    if args.dataloader_num_workers:
        raise ConfigError(
            "dataloader_num_workers must be 0 with a streamed dataset: each worker would read the whole stream; "
            "remove it."
        )


def peek(dataset: datasets.IterableDataset, rows: int, name: str) -> list[dict]:
    """The first `rows` rows of the stream `name` (fewer if it is shorter). Iterating a `datasets` stream starts it
    afresh, so the stream training reads is not advanced.

    Raises:
        ConfigError: those rows cannot be read (a file that does not parse), in one line.
    """
    try:
        return list(itertools.islice(dataset, rows))
    except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError) as err:  # TypeError: arrow types
        raise ConfigError(
            f"dataset {name!r} cannot be read: {first_line(err.__cause__ or err)}; fix its first rows."
        ) from err


def check_stream_resume(dataset: Any, checkpoint: str | None) -> None:
    """For a streamed `dataset` (one without a length): resuming skips the micro-batches already trained by reading
    them again, which is exact while the stream was not read to its end; after that (the Trainer's epoch counter
    passed 1: it is exactly 1 at `max_steps` of a first pass) it would restart the stream instead.

    Raises:
        ConfigError: `checkpoint` was saved after the stream had ended once.
    """
    if checkpoint is None or has_length(dataset):
        return
    with open(os.path.join(checkpoint, STATE_FILE)) as f:
        epoch = json.load(f).get("epoch") or 0.0
    if epoch > 1:
        raise ConfigError(
            f"resume_from_checkpoint={checkpoint!r}: the streamed dataset had been read to its end {int(epoch)} "
            "time(s) when it was saved, and a resumed stream cannot be placed there; start afresh, or resume from a "
            "checkpoint saved in the stream's first pass."
        )


class RolloutBatches(Trainer):
    """`GRPOTrainer`'s data loading: each micro-step gets a rollout's worth of whole prompts, from a map-style dataset
    (`RepeatSampler`) or a stream (`RolloutStream`) in the same order."""

    numbered_rows = False  # rows carry their index (`ROW_KEY`), for a vision-language run's per-row checks
    resume_step = 0  # the optimizer step training (re)starts from: the data continues there

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """Each micro-step gets a rollout's worth of whole prompts: `prompts_per_rollout` (where groups span ranks,
        the whole rollout's prompts on every rank).

        Only the micro-steps that start a rollout use their batch; the sampler repeats each batch for the
        micro-steps that train on the rollout, so the Trainer's step counting stays TRL's.
        """
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer: training requires a train_dataset.")
        dataset = self.train_dataset  # a stream has no sampler: it is reordered into rollout batches instead
        # A vision-language run's rows carry their index, for the row checks at each rollout (`colograd.trainer`).
        numbered = self.numbered_rows
        if has_length(dataset):
            dataset = NumberedRows(dataset) if numbered else dataset
        else:
            dataset = rollout_stream(dataset, self.args, self.accelerator, numbered)
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self.args.prompts_per_rollout,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_train_sampler(self, dataset: Any = None) -> torch.utils.data.Sampler:
        """Shuffled prompts, each rollout's batch (for all ranks) repeated once per micro-step that trains on it (and
        once per rank where groups span ranks: `rollout_repeats`); a resumed run's in the order of the epoch it
        resumes in (`EpochOrder`)."""
        args, world = self.args, self.accelerator.num_processes
        sampler = EpochOrder(
            data_source=dataset if dataset is not None else self.train_dataset,
            mini_repeat_count=1,  # the engine samples a prompt's completions itself (n=G, or a rank's share)
            batch_size=rollout_batch_size(args, world),
            repeat_count=rollout_repeats(args, world),
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )
        # The optimizer steps of an epoch, as the Trainer counts them (its batches per rank // accumulation).
        steps_per_epoch = len(sampler) // (args.prompts_per_rollout * world * args.gradient_accumulation_steps)
        sampler.skip_epochs(self.resume_step // steps_per_epoch if steps_per_epoch else 0)
        return sampler


class EpochOrder(RepeatSampler):
    """TRL's `RepeatSampler`, whose epoch e is in the same order whether a run got there uninterrupted or resumed.

    `RepeatSampler` draws each epoch's order from one generator seeded once: epoch e's is its (e + 1)-th draw. A
    resumed run builds a new sampler, and the Trainer skips only the batches already trained in the epoch it
    resumes in, so without `skip_epochs` a run resumed in its second epoch would train on the first epoch's order.
    """

    def skip_epochs(self, epochs: int) -> None:
        """Draw, and drop, the orders of the `epochs` epochs a resumed run already trained."""
        if self.shuffle:
            for _ in range(epochs):
                torch.randperm(self.num_samples, generator=self.generator)
