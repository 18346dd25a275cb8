"""Choosing the checkpoint to resume from, never one whose save was interrupted.

A checkpoint folder is written piece by piece (weights, optimizer, scheduler, each rank's RNG state) and
`trainer_state.json` comes last, from the main process. A folder without it is an interrupted save: resuming
from it would fail or, worse, restart from half-written state, so it is never chosen.
"""

import json
import os
import re

from transformers import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from colograd.config import ConfigError

STATE_FILE = "trainer_state.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def is_complete(checkpoint: str) -> bool:
    """Whether the save of `checkpoint` finished: its state file exists and was written to the end (a crash
    while writing it leaves JSON that does not parse)."""
    try:
        with open(os.path.join(checkpoint, STATE_FILE)) as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer step a finished checkpoint was saved at."""
    return TrainerState.load_from_json(os.path.join(checkpoint, STATE_FILE)).global_step


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest finished `checkpoint-<step>` folder in `output_dir`, or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = [
        (int(match.group(1)), os.path.join(output_dir, name))
        for name in os.listdir(output_dir)
        if (match := _CHECKPOINT.match(name)) and is_complete(os.path.join(output_dir, name))
    ]
    return max(steps)[1] if steps else None


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder `resume_from_checkpoint` asks for.

    Args:
        resume_from_checkpoint: a checkpoint folder; True (or "true") for the newest finished one in
            `output_dir`; None or False to start afresh.
        output_dir: the run's output folder.

    Raises:
        ConfigError: the folder does not exist, its save did not finish, or `output_dir` holds no finished one.
    """
    if resume_from_checkpoint in (None, False, "false", "False"):
        return None
    if resume_from_checkpoint in (True, "true", "True") and not os.path.isdir(str(resume_from_checkpoint)):
        found = last_complete_checkpoint(output_dir)
        if found is None:
            raise ConfigError(
                f"resume_from_checkpoint: {output_dir!r} holds no finished {PREFIX_CHECKPOINT_DIR}-<step> folder; "
                "give a checkpoint path, or drop the flag to start afresh."
            )
        return found
    if not os.path.isdir(resume_from_checkpoint):
        raise ConfigError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} does not exist; give a checkpoint folder."
        )
    if not is_complete(resume_from_checkpoint):
        raise ConfigError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} has no complete {STATE_FILE}: its save was "
            "interrupted; resume from an earlier checkpoint."
        )
    return resume_from_checkpoint
