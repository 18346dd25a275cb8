"""The tiny task's reward, recording what each rank scores: one line per rollout in `$RECORD_DIR/rank-<RANK>.jsonl`,
with the optimizer step it trains and every completion's prompt, so that a test can compare the data two runs
trained, step by step."""

import json
import os

from colograd.models.tiny import letters_reward


def letters_recorded(completions: list[str], target: list[str], prompts: list, trainer_state, **kwargs) -> list[float]:
    line = {"step": trainer_state.global_step + 1, "prompts": prompts}
    with open(os.path.join(os.environ["RECORD_DIR"], f"rank-{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
    return letters_reward(completions, target)
