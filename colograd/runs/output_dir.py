"""The output_dir stage: a run owns its folder while it runs, and never takes another run's work for its own.

    claim        output_dir can be written; the first process writes a lock file, `_colograd_run.lock` (host, pid,
                 start time, command), before any slow start-up, and removes it at exit. A second run finds it and
                 stops, naming the first; a lock left by a process that no longer runs on this host is taken over
    relaunch     a run that names no checkpoint resumes its own newest finished one (`auto_resume`; whose it is:
                 `colograd.runs.relaunch`), so that a scheduler's relaunch of the same command continues the run
    fresh start  a run that resumes nothing refuses an output_dir holding another run's checkpoints or finished
                 model (resume it, choose another folder, or set overwrite_output_dir to start over)
    resume       the checkpoint is a finished save (`colograd.runs.checkpoints.resolve_checkpoint`); the trainer then
                 checks it was saved by a run set up as this one (`colograd.runs.checkpoints.check_setup`)

`check_output_dir` runs them; `colograd/train.py` calls it first, preflight and `GRPOTrainer.train` again (a
repeated call finds its own lock and does nothing new; only the trainer's knows the run's whole setup). Only the
first process (rank 0) takes the lock and judges the folder's contents: a refusal there ends the whole launch (the
launcher stops the other ranks), and is printed once.
"""

import atexit
import json
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from transformers import TrainingArguments
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from colograd.config.core import ConfigError
from colograd.runs.checkpoints import (
    RECORD_FILE,
    STATE_FILE,
    check_setup,
    checkpoint_step,
    checkpoints,
    config_setup,
    note,
    resolve_checkpoint,
)
from colograd.runs.relaunch import judge, resume_note

# "_": push_to_hub's upload of output_dir leaves out names starting with it, so a host name is never published.
LOCK_FILE = "_colograd_run.lock"
MODEL_FILES = (
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
)
COMPLETIONS_FILE = "completions.jsonl"  # appended to by each run (colograd.runs.completions.CompletionLog)
_held: set[str] = set()  # the lock files this process holds (real paths)


def check_output_dir(
    args: TrainingArguments, resume_from_checkpoint: str | bool | None, setup: dict[str, Any] | None = None
) -> str | None:
    """The whole stage: claim `output_dir`, then resolve the checkpoint to resume from, or check a fresh start.

    Args:
        args: the run's config (`output_dir`, `overwrite_output_dir`, `auto_resume`, `process_index`).
        resume_from_checkpoint: as `colograd.runs.checkpoints.resolve_checkpoint` takes it; None (not given) with
            `auto_resume`: this run's own newest finished checkpoint, if output_dir holds one (`resume_own_run`).
        setup: the run's whole setup (`colograd.runs.checkpoints.run_setup`), once the trainer knows it.

    Returns:
        The checkpoint to resume from, or None. Before `setup` is known, None also where the run may resume its own
        checkpoint: the trainer decides.

    Raises:
        ConfigError: output_dir cannot be written, another run holds it, it holds another run's work, or the
            checkpoint is not a finished save.
    """
    claim_output_dir(args)
    if resume_from_checkpoint is None and args.auto_resume and not args.overwrite_output_dir:
        return resume_own_run(args, setup)
    checkpoint = resolve_checkpoint(resume_from_checkpoint, args.output_dir)
    # A resume from a checkpoint elsewhere starts a branch here: it must not write over what this folder holds.
    if checkpoint is None or not _inside(checkpoint, args.output_dir):
        check_fresh_start(args)
    if checkpoint is not None and 0 < args.max_steps <= checkpoint_step(checkpoint):
        check_setup(checkpoint, setup or config_setup(args))  # another run's settings are refused first
        raise RunFinished(checkpoint, args)  # transformers would train one step past max_steps
    return checkpoint


def claim_output_dir(args: TrainingArguments) -> None:
    """Create `output_dir` and check it can be written; on the first process, take its lock.

    Raises:
        ConfigError: it cannot be written, or another run holds it.
    """
    out = args.output_dir
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".colograd-write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"output_dir={out!r} cannot be written ({err.strerror or err}); choose a folder you can write to."
        ) from err
    if args.process_index == 0:
        take_lock(out)


# --- the lock ------------------------------------------------------------------------------------------------


@dataclass
class Holder:
    """The process a lock file names. `ticks` is its start time in clock ticks after boot (Linux), which tells a
    process apart from a later one given the same pid. `slurm_job` and `slurm_restarts`: the Slurm job it ran in
    and how many times that job had been requeued (`SLURM_JOB_ID`, `SLURM_RESTART_COUNT`), None outside Slurm."""

    host: str
    pid: int
    started: str
    ticks: int | None
    command: str
    slurm_job: str | None = None
    slurm_restarts: int | None = None

    @classmethod
    def me(cls) -> "Holder":
        command = shlex.join(sys.argv)[:200]
        started = datetime.now().astimezone().isoformat(timespec="seconds")
        job, restarts = _slurm_run()
        return cls(socket.gethostname(), os.getpid(), started, _start_ticks(os.getpid()), command, job, restarts)

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started} ({self.command})"


def take_lock(output_dir: str) -> None:
    """Write `output_dir`'s lock file for this process, removed when it exits.

    Raises:
        ConfigError: a running process holds it (or one on another host, which cannot be checked from here).
    """
    path = os.path.realpath(os.path.join(output_dir, LOCK_FILE))
    if path in _held:
        return
    me = Holder.me()
    for _ in range(3):  # a lost race with another run taking over the same stale lock: read it again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _refuse_or_take_over(path, output_dir)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(me), f)
        _held.add(path)
        atexit.register(_release, path, me)
        return
    raise ConfigError(f"output_dir={output_dir!r}: its lock file {path} keeps changing; start one run at a time.")


def _refuse_or_take_over(path: str, output_dir: str) -> None:
    """Another process's lock: refuse while it runs; remove it, with a note, when it is gone."""
    try:
        holder = _read_lock(path)
    except FileNotFoundError:  # released meanwhile: the next attempt takes it
        return
    if holder is not None:
        running = _running(holder)
        if running is None:
            raise ConfigError(
                f"output_dir={output_dir!r} is in use by another run: {holder.describe()}, not this host, so "
                f"whether it still runs cannot be checked here; choose another output_dir, wait for it to end, or "
                f"delete {path} if it is gone."
            )
        if running:
            raise ConfigError(
                f"output_dir={output_dir!r} is in use by another run: {holder.describe()}; choose another "
                "output_dir, or wait for that run to end."
            )
        gone = f"was held by {holder.describe()}, which no longer runs"
    else:
        gone = "holds an unreadable lock (a run stopped while writing it)"
    print(f"colograd: note: output_dir {output_dir} {gone}; taking it over.", file=sys.stderr, flush=True)
    try:
        os.remove(path)
    except FileNotFoundError:  # another run took it over first; the next attempt finds its lock
        pass


def _read_lock(path: str) -> Holder | None:
    """The lock's holder; None when the file cannot be parsed (read again shortly after, in case its writer is
    between creating and filling it)."""
    for attempt in range(5):
        try:
            with open(path) as f:
                return Holder(**json.load(f))
        except FileNotFoundError:
            raise
        except (OSError, ValueError, TypeError):
            time.sleep(0.1 * (attempt + 1))
    return None


def _running(holder: Holder) -> bool | None:
    """Whether the lock's process still runs; None when it ran on another host, unless it ran in an earlier run of
    this Slurm job: Slurm requeues a job (`--requeue`, on another node as often as not) once all its processes
    have ended."""
    if holder.host != socket.gethostname():
        job, restarts = _slurm_run()
        earlier = holder.slurm_restarts is not None and restarts is not None and holder.slurm_restarts < restarts
        return False if job is not None and holder.slurm_job == job and earlier else None
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    ticks = _start_ticks(holder.pid)
    return ticks is None or holder.ticks is None or ticks == holder.ticks


def _slurm_run() -> tuple[str | None, int | None]:
    """This process's Slurm job and how many times it was requeued, or (None, None) outside Slurm."""
    job, restarts = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0").strip()
    return (job, int(restarts) if restarts.isdigit() else None) if job else (None, None)


def _start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks after boot from /proc (None where there is no /proc); -1 for a
    zombie, which no longer runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return -1 if fields[0] == "Z" else int(fields[19])


def _release(path: str, me: Holder) -> None:
    """Remove the lock at exit, if it is still this process's (a forked child inherits the exit hook, not the
    lock)."""
    if os.getpid() != me.pid:
        return
    try:
        if _read_lock(path) == me:
            os.remove(path)
    except (OSError, TypeError):
        pass
    _held.discard(path)


# --- a relaunch ----------------------------------------------------------------------------------------------


def resume_own_run(args: TrainingArguments, setup: dict[str, Any] | None) -> str | None:
    """`auto_resume`: this run's newest finished checkpoint in output_dir (said in one line), or a fresh start (this
    run's unfinished saves removed first, with a note); another run's work refused. With the config's part of the
    setup only (`setup` None), a checkpoint that may be this run's is left to the trainer's call.

    Raises:
        ConfigError: on the first process, output_dir's newest finished checkpoint was saved by a run set up
            differently (or on another number of ranks), or it holds another run's work.
    """
    out, first = args.output_dir, args.process_index == 0
    found = judge(out, config_setup(args) if setup is None else setup)
    if found.refusal is not None:
        if first:
            raise ConfigError(found.refusal)
        return None
    if found.checkpoint is not None:
        if 0 < args.max_steps <= checkpoint_step(found.checkpoint):  # transformers would train one step past it
            if _final_model_whole(found.checkpoint, out):
                raise ConfigError(
                    f"output_dir={out!r} holds this run's {os.path.basename(found.checkpoint)}, saved at its last "
                    f"step (max_steps {args.max_steps}): the run is over, and its final model is there; raise "
                    "max_steps to train on, or choose another output_dir."
                )
            raise RunFinished(found.checkpoint, args)  # the final save was lost: the checkpoint holds the model
        if setup is None:
            return None
        if first:
            note(resume_note(found.checkpoint, out))
        return found.checkpoint
    if found.unfinished and not _model_files(out):
        if setup is not None and first:
            _remove_previous(out, found.unfinished, "starting afresh, as no save of this run finished: removed its")
        return None
    check_fresh_start(args)
    return None


# --- a run whose last step is saved ----------------------------------------------------------------------------


class RunFinished(ConfigError):
    """The run resumes from a finished checkpoint at its last step (`max_steps`): nothing is left to train, and the
    final model is that checkpoint's. `colograd/train.py` writes it into output_dir (`finish_from_checkpoint`) and
    exits 0, so that a relaunch after a lost final save (a full disk, a preemption in it) ends the run."""

    def __init__(self, checkpoint: str, args: TrainingArguments) -> None:
        self.checkpoint, self.output_dir = checkpoint, args.output_dir
        super().__init__(
            f"{checkpoint} was saved at the run's last step (max_steps {args.max_steps}): there is nothing left to "
            "train; colograd/train.py writes the final model from it, or raise max_steps to train on."
        )


# What a checkpoint holds besides the model a final save writes: the optimizer's and scheduler's state, random
# states, the Trainer's state and colograd's records (`colograd.grpo.entropy`, `colograd.rollout.partial`),
# DeepSpeed's.
TRAINING_STATE = re.compile(
    r"(optimizer|scheduler|scaler|rng_state)[\w.-]*\.(pt|pth|bin)|entropy_ctrl_state\.json|latest|zero_to_fp32\.py|"
    + "|".join(re.escape(name) for name in (STATE_FILE, RECORD_FILE))
)


def _model_and_companions(checkpoint: str) -> list[str]:
    """The files of `checkpoint` a final save writes too: every file but the training state (`TRAINING_STATE`);
    folders are DeepSpeed's shards or colograd's per-rank state."""
    names = [n for n in sorted(os.listdir(checkpoint)) if os.path.isfile(os.path.join(checkpoint, n))]
    return [n for n in names if not TRAINING_STATE.fullmatch(n)]


def _final_model_whole(checkpoint: str, output_dir: str) -> bool:
    """Whether output_dir holds the final model of the run whose last step `checkpoint` holds: every file a final
    save writes is there, and each weights file has the checkpoint's size (the same weights, saved the same way). A
    final save killed midway leaves a file cut short, or none: that is no final model."""
    for name in _model_and_companions(checkpoint):
        ours, theirs = os.path.join(output_dir, name), os.path.join(checkpoint, name)
        if not os.path.isfile(ours):
            return False
        weights = name.endswith((".safetensors", ".bin")) and name != "training_args.bin"
        if weights and os.path.getsize(ours) != os.path.getsize(theirs):
            return False
    return True


def finish_from_checkpoint(done: RunFinished, args: TrainingArguments) -> list[str]:
    """Write the final model of a run whose last step `done.checkpoint` holds: its files, less the training state
    (`TRAINING_STATE`; folders are DeepSpeed's shards or colograd's per-rank state), copied into output_dir, as
    the final save writes them (model, config, tokenizer, model card). On the first process; said in one line.

    Returns:
        The names copied.

    Raises:
        ConfigError: the checkpoint holds no model files (a DeepSpeed ZeRO-3 checkpoint saved without gathered
            weights): naming it and DeepSpeed's tool that consolidates them.
    """
    names = _model_and_companions(done.checkpoint)
    if not _model_files(done.checkpoint):
        raise ConfigError(
            f"{done.checkpoint} holds the run's last step but no model files (DeepSpeed's shards only); consolidate "
            f"them with {os.path.join(done.checkpoint, 'zero_to_fp32.py')}, or raise max_steps to train on."
        )
    if args.process_index == 0:
        for name in names:
            shutil.copy2(os.path.join(done.checkpoint, name), os.path.join(done.output_dir, f".{name}.tmp"))
        for name in names:  # whole files only: a copy cut short leaves a hidden temporary, not a model
            os.replace(os.path.join(done.output_dir, f".{name}.tmp"), os.path.join(done.output_dir, name))
        note(
            f"{os.path.basename(done.checkpoint)} holds the run's last step (max_steps {args.max_steps}): wrote the "
            f"final model from it into {done.output_dir}; nothing left to train."
        )
    return names


# --- a fresh start -------------------------------------------------------------------------------------------


def check_fresh_start(args: TrainingArguments) -> None:
    """A run that resumes nothing must not write over another run's checkpoints or finished model; with
    `overwrite_output_dir`, that run's checkpoints and completion log are removed instead (its model files are
    replaced by this run's at the end). On the first process only.

    Raises:
        ConfigError: `output_dir` holds another run's work, naming it and the three ways on.
    """
    if args.process_index != 0:
        return
    out = args.output_dir
    folders = checkpoints(out)
    if args.overwrite_output_dir:
        _remove_previous(out, folders)
        return
    model = _model_files(out)
    if not folders and not model:
        return
    found = []
    if folders:
        names = ", ".join(os.path.basename(c) for c in folders[-3:])
        found.append(f"checkpoints ({'..., ' if len(folders) > 3 else ''}{names})")
    if model:
        found.append(f"finished model ({model[0]})")
    resume = "resume it with --resume_from_checkpoint true, " if folders else ""
    raise ConfigError(
        f"output_dir={out!r} holds another run's {' and '.join(found)}; {resume}choose another output_dir, or set "
        "overwrite_output_dir: true to start over."
    )


def _model_files(output_dir: str) -> list[str]:
    """The names of the finished model's files in `output_dir`."""
    return [name for name in MODEL_FILES if os.path.isfile(os.path.join(output_dir, name))]


def _remove_previous(output_dir: str, folders: list[str], why: str | None = None) -> None:
    """Remove the previous run's checkpoints (so `resume_from_checkpoint: true` can never pick one of them) and its
    completion log (which this run would otherwise append to), with one note (`why`, when given, opens it)."""
    for folder in folders:
        shutil.rmtree(folder)
    log = os.path.join(output_dir, COMPLETIONS_FILE)
    removed = [os.path.basename(f) for f in folders]
    if os.path.isfile(log):
        os.remove(log)
        removed.append(COMPLETIONS_FILE)
    if removed:
        said = why or "overwrite_output_dir: removed the previous run's"
        print(f"colograd: note: {said} {', '.join(removed)} from {output_dir}.", file=sys.stderr, flush=True)


def _inside(checkpoint: str, output_dir: str) -> bool:
    return os.path.dirname(os.path.realpath(checkpoint)) == os.path.realpath(output_dir)
