"""Short GRPO runs with tools and with an environment on the tiny task; run under a multi-process launch:

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/agents_run.py OUT_DIR

The tiny model writes random characters, so its tool calls are read by a parser of single characters: a turn that
ends with ";" calls `count`, one that ends with "?" calls `flaky` (it raises), one that ends with "!" calls `slow`
(it sleeps past the tool timeout), one that ends with "." calls `tally`, the tool of the completion's environment,
whose `reset` adds to the prompt and whose `get_reward` scores the completion. It trains with two updates per
rollout, importance-sampling correction and token-budget micro-batches. Each rank writes OUT_DIR/rank<r>.json with
what the tests assert.
"""

import json
import os
import sys
import time

import torch.distributed as dist

from colograd import GRPOTrainer
from colograd.agents.tools import ToolCall
from colograd.models import tiny

CALLS = {"count": 0, "flaky": 0, "slow": 0}


def count(text: str) -> str:
    """The number of characters of a text.

    Args:
        text: the text to measure.
    """
    CALLS["count"] += 1
    return str(len(text))


def flaky(text: str) -> str:
    """A tool that always fails.

    Args:
        text: ignored.
    """
    CALLS["flaky"] += 1
    raise RuntimeError("flaky tool failed")


def slow(text: str) -> str:
    """A tool slower than the timeout.

    Args:
        text: ignored.
    """
    CALLS["slow"] += 1
    time.sleep(1.5)
    return "late"


class CharacterParser:
    """A turn that ends with one of these characters calls its tool with the turn's text."""

    TOOLS = {";": "count", "?": "flaky", "!": "slow", ".": "tally"}

    def __init__(self) -> None:
        self.stop = list(self.TOOLS)

    def parse(self, text: str) -> list[ToolCall]:
        tool = self.TOOLS.get(text[-1:])
        return [ToolCall(tool, {"text": text[:-1]})] if tool else []


class Counter:
    """An environment: `reset` adds to the prompt, `tally` is its tool, `get_reward` scores the rollout."""

    def reset(self, prompt: str, target: str, **row) -> str:
        self.target, self.calls = target, 0
        return " go"

    def tally(self, text: str) -> str:
        """How often the target letter occurs in a text.

        Args:
            text: the text to look at.
        """
        self.calls += 1
        return str(text.count(self.target))

    def get_reward(self) -> float:
        return min(self.calls, 2) / 2


class RecordingTrainer(GRPOTrainer):
    """Keeps, per rollout, how many inserted tokens the batch holds and how many of them the loss would count, and
    the prompts and environments of the last rollout's completions."""

    masks: list[dict[str, int]] = []
    last_prompt_ids: list[list[int]] | None = None
    environments: list = []

    def generate(self, prompt_ids, context, images=None):
        rollout = super().generate(prompt_ids, context, images)
        self.last_prompt_ids = rollout.prompt_ids
        self.environments = rollout.columns["environments"]
        return rollout

    def make_rollout(self, rows):
        slices = super().make_rollout(rows)
        inserted = sum(int((s["attention_mask"][:, -s["tool_mask"].size(1) :] - s["tool_mask"]).sum()) for s in slices)
        counted = sum(int((s["completion_mask"] * (1 - s["tool_mask"])).sum()) for s in slices)
        self.masks.append({"inserted": inserted, "inserted_in_loss": counted})
        return slices


def main() -> None:
    out = sys.argv[1]
    tokenizer = tiny.build_tokenizer()
    args = tiny.run_config(out, 3, max_completion_length=24, num_iterations=2, micro_batch_tokens=400,
                           vllm_importance_sampling_correction=True, tool_timeout=0.5)  # fmt: skip
    trainer = RecordingTrainer(
        model=tiny.build_model(), reward_funcs="letters", args=args, train_dataset=tiny.letters_dataset(),
        processing_class=tokenizer, tools=[count, flaky, slow], environment_factory=Counter,
        tool_call_parser=CharacterParser(),
    )  # fmt: skip
    trainer.train()
    envs = trainer.environments
    record = {
        "log_history": trainer.state.log_history,
        "masks": trainer.masks,
        "calls": CALLS,
        "environments": len(envs),
        "distinct_environments": len({id(e) for e in envs}),
        "env_calls": sum(e.calls for e in envs),
        "prompt_ends_with_observation": all(tokenizer.decode(p[-3:]) == " go" for p in trainer.last_prompt_ids),
    }
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
