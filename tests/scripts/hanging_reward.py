"""The tiny task's reward, never returning from the optimizer step named by HANG_AT_STEP on (a judge whose server
stopped answering); it touches HANG_MARKER first, so that a test knows when to signal."""

import os
import time
from pathlib import Path

from colograd.models.tiny import letters_reward


def letters_or_hang(completions: list[str], target: list[str], trainer_state, **kwargs) -> list[float]:
    if trainer_state.global_step + 1 >= int(os.environ.get("HANG_AT_STEP", "0") or 10**9):
        Path(os.environ["HANG_MARKER"]).touch()
        while True:
            time.sleep(1)
    return letters_reward(completions, target)
