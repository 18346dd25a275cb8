"""Interruptions that lose nothing: a failure names its step and stage; a preemption checkpoints and stops.

Failure: an exception inside a stage of the step (generate, reward, logps, train, sync) becomes a `StepFailure`
naming the optimizer step, the stage and the last finished checkpoint to resume from. Checkpoints are never
touched by a failure, and `resume_from_checkpoint: true` only ever picks a finished one.

Preemption: SLURM and Kubernetes send SIGTERM, then SIGKILL after a grace period (30 s by default for
Kubernetes and torchrun, SLURM's `GraceTime`). `Preemption` turns SIGTERM into a flag; at the end of each
optimizer step the ranks agree on it (one scalar all-reduce, so a signal that reached one rank stops them
all at the same step), save a checkpoint and stop training.

Hang: while `Preemption` is armed, a process that reports no progress (a step or a stage begun or ended) for
`hang_timeout` seconds writes every rank's stacks and exits (`colograd.runs.hang`).
"""

import errno
import os
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from colograd.errors import said as in_one_line
from colograd.runs import hang
from colograd.runs.checkpoints import checkpoints, last_complete_checkpoint

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # ... and by Ctrl-C

# Set by `Preemption`'s handler while it is armed; read by waits that must not outlast a preemption's grace.
_sigterm = threading.Event()


def sigterm_received() -> bool:
    """Whether SIGTERM arrived during the current `train` call."""
    return _sigterm.is_set()


def _resume_hint(checkpoint: str | None, fix: bool = True) -> str:
    """Where a stopped run continues from; `fix`: it stopped on an error the user fixes first."""
    return (
        f"the last finished checkpoint, {checkpoint}, is intact: {'fix the cause and ' if fix else ''}rerun with "
        "--resume_from_checkpoint true"
        if checkpoint
        else "no checkpoint was saved yet"
    )


class StepFailure(RuntimeError):
    """An exception raised in a stage of an optimizer step; the original is its `__cause__`.

    Args:
        step: the optimizer step being computed (1-based, as logs number it).
        stage: the stage that raised.
        error: the exception.
        checkpoint: the last finished checkpoint in `output_dir`, or None.
    """

    def __init__(
        self, step: int, stage: str, error: BaseException, checkpoint: str | None, said: str | None = None
    ) -> None:
        said = said or in_one_line(error)
        super().__init__(f"optimizer step {step}, stage {stage!r}: {said} ({_resume_hint(checkpoint)}).")
        self.step, self.stage = step, stage


# What the libraries that write a save say when a write fails: torch's zip writer loses the errno ("unexpected pos",
# an iostream error); safetensors and Python keep it, in words or as ENOSPC / EDQUOT.
_WRITER_FAILED = ("inline_container.cc", "PytorchStreamWriter", "iostream error", "file write failed")
_DISK_FULL = ("No space left on device", "Disk quota exceeded")


def disk_full(error: BaseException, output_dir: str) -> str | None:
    """'no space left on <filesystem>: N MiB needed, F MiB free' when `error` is a write that failed on a full disk
    (or quota) under `output_dir`, else None: the error says so (ENOSPC, EDQUOT, their words), or torch's writer
    failed (its message loses the errno) with less than 1 MiB left. N is what the newest finished checkpoint holds
    (a save of this run takes about that), or, before the first, what the failed save had written (at least that)."""
    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    free = shutil.disk_usage(output_dir).free if os.path.isdir(output_dir) else 0
    told = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain)
    told = told or any(words in str(e) for e in chain for words in _DISK_FULL)
    if not told and not (free < 2**20 and any(words in str(e) for e in chain for words in _WRITER_FAILED)):
        return None
    finished = last_complete_checkpoint(output_dir)
    needed = _folder_bytes(finished or checkpoints(output_dir)[-1:])
    mount = os.path.realpath(output_dir)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    at_least = "" if finished else "at least "
    return f"no space left on {mount}: {at_least}{needed / 2**20:.0f} MiB needed, {free / 2**20:.0f} MiB free"


def _folder_bytes(folders: list[str] | str) -> int:
    """The bytes of the files under `folders` (one folder or a list)."""
    total = 0
    for folder in [folders] if isinstance(folders, str) else folders:
        for root, _, names in os.walk(folder):
            total += sum(os.path.getsize(os.path.join(root, name)) for name in names)
    return total


class StoppedBySigterm(SystemExit):
    """SIGTERM came while a stage could not finish within the grace a scheduler gives: the process stops now with
    `PREEMPTED_EXIT_CODE`, without a checkpoint of the unfinished step (a SystemExit: nothing on the way catches
    it as an error).

    Args:
        what: what the stage was waiting for, e.g. "reward function 'judge' had not returned 10 s after it".
    """

    def __init__(self, what: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.what = what
        self.reported = False  # said by the innermost stage; an outer one lets it pass


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message names the optimizer step and, inside one, the stage."""

    def __init__(self, step: int, stage: str | None = None) -> None:
        super().__init__(f"optimizer step {step}" + (f", stage {stage!r}" if stage else ""))


@contextmanager
def stage_failures(stage: str, step: int, output_dir: str) -> Iterator[None]:
    """Re-raise an exception from the body as a `StepFailure` naming `step` and `stage` (an inner stage's
    `StepFailure` passes through: it names the innermost stage). Ctrl-C becomes `Interrupted`, naming them too; a
    stage stopped by SIGTERM (`StoppedBySigterm`) says so in one line on its way out. Entering and leaving the stage
    is progress (`colograd.runs.hang`)."""
    hang.progress(f"optimizer step {step}, stage {stage!r}")
    try:
        yield
        hang.progress(f"optimizer step {step}, after stage {stage!r}")
    except (StepFailure, Interrupted):
        raise
    except KeyboardInterrupt as err:
        raise Interrupted(step, stage) from err
    except StoppedBySigterm as err:
        if not err.reported:
            checkpoint = last_complete_checkpoint(output_dir)
            print(
                f"colograd: stopped by SIGTERM during optimizer step {step}, stage {stage!r}: {err.what}; the "
                f"unfinished step is not saved, {_resume_hint(checkpoint, fix=False)}.",
                file=sys.stderr,
                flush=True,
            )
            err.reported = True
        raise
    except Exception as err:
        raise StepFailure(step, stage, err, last_complete_checkpoint(output_dir), disk_full(err, output_dir)) from err


def exit_interrupted(err: KeyboardInterrupt, output_dir: str, debug: bool = False) -> NoReturn:
    """End a run stopped by Ctrl-C: one line on the main process (a launcher passes the signal to every rank)
    naming where it stopped and the checkpoint to resume from, the traceback only with `debug`; exit code 130."""
    if os.environ.get("RANK", "0") == "0":
        if debug:
            traceback.print_exception(err)
        where = f" during {err}" if isinstance(err, Interrupted) else ""
        print(
            f"colograd: interrupted (Ctrl-C){where}; {_resume_hint(last_complete_checkpoint(output_dir), fix=False)}.",
            file=sys.stderr,
            flush=True,
        )
    sys.exit(INTERRUPTED_EXIT_CODE)


class Preemption(TrainerCallback):
    """Stop at the end of the step during which SIGTERM arrived (on any rank), with a checkpoint of it.

    `armed()` installs the handler for the duration of a `train` call; `requested` tells afterwards whether
    training stopped for it. Meanwhile training is watched for a hang (`colograd.runs.hang`, from its start).
    """

    def __init__(self) -> None:
        self.requested = False
        self._signalled = False
        self._step = 0  # the optimizer step in progress, which a Ctrl-C outside the stages is said to stop

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Catch SIGTERM while the body runs (signal handlers can only be set from the main thread); Ctrl-C outside
        a stage (`stage_failures`) leaves it as `Interrupted`, naming the step."""
        self.requested = self._signalled = False
        _sigterm.clear()
        if threading.current_thread() is not threading.main_thread():
            with _watched():
                yield
            return
        previous = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            with _watched():
                yield
        except KeyboardInterrupt as err:
            if isinstance(err, Interrupted) or not self._step:
                raise
            raise Interrupted(self._step) from err
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step in progress finishes, and a launcher's repeated SIGTERM changes nothing.
        self._signalled = True
        _sigterm.set()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        hang.watch(args.hang_timeout, args.ddp_timeout, args.output_dir)  # stopped as `armed` ends
        return control

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        self._step = state.global_step + 1
        hang.progress(f"optimizer step {self._step}")
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        stop = torch.tensor(float(self._signalled), device=args.device)
        if dist.is_initialized():  # one scalar per step: cheap, and every rank takes the same decision
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            self.requested = True
            control.should_save = True
            control.should_training_stop = True
        hang.progress(f"optimizer step {state.global_step}, done")
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        """Say where the stopped run's checkpoint is and how to continue, once every rank's part is written."""
        if not self.requested:
            return
        if dist.is_initialized():  # every rank stopped on the same step, so every rank gets here
            dist.barrier()
        if state.is_world_process_zero:
            print(
                f"colograd: stopped by SIGTERM after optimizer step {state.global_step}, checkpoint saved in "
                f"{args.output_dir}; rerun with --resume_from_checkpoint true to continue.",
                flush=True,
            )


@contextmanager
def _watched() -> Iterator[None]:
    """Whatever ends the body, the hang watch `Preemption.on_train_begin` started ends with it."""
    try:
        yield
    finally:
        hang.stop()
