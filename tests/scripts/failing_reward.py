"""The tiny task's reward, raising at the optimizer step named by FAIL_AT_STEP: a failure in the middle of a run."""

import os

from colograd.models.tiny import letters_reward


def letters_or_fail(completions: list[str], target: list[str], trainer_state, **kwargs) -> list[float]:
    if trainer_state.global_step + 1 == int(os.environ.get("FAIL_AT_STEP", "0")):
        raise RuntimeError("injected failure")
    return letters_reward(completions, target)
