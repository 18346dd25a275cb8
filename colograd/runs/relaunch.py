"""A relaunch resumes its own run: whose checkpoints an output_dir holds, for a run that names none to resume.

A scheduler that requeues a failed job (Slurm's `--requeue`, a Kubernetes Job's restarts) runs the same command
again, and no one is there to add `--resume_from_checkpoint`. Every checkpoint's record names the setup of the run
that saves it from the moment its save begins (`colograd.runs.checkpoints.run_setup`), so a run that names no
checkpoint (with `auto_resume`, the default) compares its own setup with them (`judge`):

    this run's          the newest finished checkpoint names this run's setup: resume from it, said in one line
    this run, resized   ... on another number of ranks: resumed where the ranks' batches together stay the run's
                        and the checkpoint is DDP's or DeepSpeed's (`colograd.runs.universal`), said in one line
                        (`reshard_note`); else refused, naming both sizes and the per_device_train_batch_size
                        that would keep the run's batch
    another run's       it names another setup: refused, naming what differs; it names none (saved before records
                        held one): refused as any fresh start over another run's work (`colograd.runs.output_dir`)
    never saved         no finished checkpoint, and every unfinished one names this run's setup (the run was killed
                        during its first save): start afresh, removing them
    nothing there       a fresh start

torchrun's own restarts (`--max-restarts`, and `accelerate launch --max_restarts`, which runs torchrun's agent) are
refused at start (`colograd.config.core.check_elastic_restarts`): on this torch the restarted workers never form
their process group. Under torchrun's default (static) rendezvous the agent keeps one TCPStore across its rounds,
and the workers' `init_process_group` reads the keys the previous round left in it (pytorch issue #167288: a hang
in `init_process_group`, or gloo's `connectFullMesh` refused). A scheduler's relaunch starts a new store.

The whole setup is known once the trainer has the model, the dataset and the rewards; the command line's checks
before start-up know only the config's part (`config_setup`): they refuse what that part tells apart, and leave
the rest to the trainer.
"""

import os
from dataclasses import dataclass, field
from typing import Any

from colograd.runs.checkpoints import (
    RESHARD_FIELDS,
    checkpoint_problem,
    checkpoints,
    describe_differences,
    last_complete_checkpoint,
    recorded_setup,
    reshard_refusal,
    resharded,
    setup_differences,
)


@dataclass
class Relaunch:
    """What an output_dir holds for a run of a given setup that names no checkpoint.

    Attributes:
        checkpoint: this run's newest finished checkpoint, to resume from.
        unfinished: this run's unfinished saves, when it has no finished one: removed as it starts afresh.
        refusal: why the newest finished checkpoint is not one this run can resume (one line), or None.
    """

    checkpoint: str | None = None
    unfinished: list[str] = field(default_factory=list)
    refusal: str | None = None


def judge(output_dir: str, setup: dict[str, Any]) -> Relaunch:
    """Whose checkpoints `output_dir` holds, for a run of `setup` (whole, or the config's part: a field unknown on
    either side is not compared).

    A checkpoint whose record names no setup (saved before records held one, or its record unreadable) is nobody's
    in particular: neither resumed nor refused here (the fresh-start check refuses it as another run's).
    """
    folders = checkpoints(output_dir)
    found = last_complete_checkpoint(output_dir)
    if found is None:
        ours = [f for f in folders if _is_of(f, setup)]
        return Relaunch(unfinished=ours if ours == folders else [])
    recorded = recorded_setup(found)
    if recorded is None:
        return Relaunch()
    differ = setup_differences(recorded, setup)
    if not differ:
        return Relaunch(checkpoint=found)
    if "world_size" in differ and differ.keys() <= set(RESHARD_FIELDS):
        return Relaunch(
            refusal=f"output_dir={output_dir!r} holds this run's {os.path.basename(found)}, but "
            f"{reshard_refusal(recorded, setup)}; or set overwrite_output_dir: true to start over."
        )
    return Relaunch(
        refusal=f"output_dir={output_dir!r} holds another run's checkpoints: {os.path.basename(found)}, the newest "
        f"finished, was saved by a run set up differently ({describe_differences(differ)}); resume it with that "
        "run's settings, choose another output_dir, or set overwrite_output_dir: true to start over."
    )


def resume_note(checkpoint: str, output_dir: str) -> str:
    """The line that says a run resumes its own checkpoint, and why (a newer save that did not finish named)."""
    newest = checkpoints(output_dir)[-1]
    newer = "" if newest == checkpoint else f"; {newest} is incomplete ({checkpoint_problem(newest)})"
    return (
        f"resuming from {checkpoint}, the newest finished checkpoint in {output_dir}: it was saved by a run set up as "
        f"this one (auto_resume){newer}."
    )


def reshard_note(checkpoint: str, setup: dict[str, Any]) -> str | None:
    """The line that says a resumed run moves to another number of ranks (`resharded`), or None where it does not."""
    sizes = resharded(recorded_setup(checkpoint) or {}, setup)
    if sizes is None:
        return None
    universal = " (as DeepSpeed's universal checkpoint, converted once beside it)" * (setup["sharding"] == "deepspeed")
    return (
        f"{checkpoint} was saved on {sizes[0]} rank{'s' * (sizes[0] != 1)} and continues on {sizes[1]}{universal}: "
        "the model, optimizer, schedule and data position carry over; each rank's random state starts from the run's "
        "seed, and partial rollouts' carried groups are shared out among the ranks."
    )


def _is_of(checkpoint: str, setup: dict[str, Any]) -> bool:
    """Whether `checkpoint`'s record names a setup that agrees with `setup`."""
    recorded = recorded_setup(checkpoint)
    return recorded is not None and not setup_differences(recorded, setup)
