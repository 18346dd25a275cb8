"""The tiny task's reward, never returning from the optimizer step named by HANG_AT_STEP on (a judge whose server
stopped answering); it touches HANG_MARKER first, so that a test knows when to signal."""

import os
import time
from pathlib import Path

from colograd.models.tiny import letters_reward


def hang_from_the_step_set(trainer_state) -> None:
    """Never return from the optimizer step HANG_AT_STEP names on (no hang where it is unset or empty)."""
    if trainer_state.global_step + 1 >= int(os.environ.get("HANG_AT_STEP") or 10**9):
        Path(os.environ["HANG_MARKER"]).touch()
        while True:
            time.sleep(1)


def letters_or_hang(completions: list[str], target: list[str], trainer_state, **kwargs) -> list[float]:
    hang_from_the_step_set(trainer_state)
    return letters_reward(completions, target)


def length_or_hang(completions: list[str], trainer_state, **kwargs) -> list[float]:
    """A reward any model's completions vary in (their length's remainder by 3), so that a model the tiny task means
    nothing to (a shrunk zoo model, answering in filler tokens) still gets advantages to learn from; with
    `letters_or_hang`'s hang."""
    hang_from_the_step_set(trainer_state)
    return [float(len(c) % 3) for c in completions]
