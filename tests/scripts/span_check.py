"""A short GRPO run whose groups span ranks, recording what tests/launch/test_spanning_launch.py asserts; run it on 2
processes:

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/span_check.py OUT_DIR

3 completions per rank and micro-step × 2 micro-steps, G=4: each rollout is 3 prompts, the middle one's group split
between the ranks (2 completions on each). Each rank writes OUT_DIR/rank<r>.json with, per rollout: the prompts it
read, the prompt of each completion it scored, its rewards, the advantages it trained on and its completions; and the
log history and whether the ranks held the same weights after every step.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from colograd import GRPOTrainer
from colograd.models import tiny


def distinct_letters(completions: list[str], **kwargs) -> list[float]:
    """A reward that differs between completions of a random model: distinct characters per completion."""
    return [float(len(set(c))) for c in completions]


class WeightsAgree(TrainerCallback):
    def __init__(self) -> None:
        self.per_step: list[bool] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        flat = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, flat)
        self.per_step.append(all(torch.equal(flat, c) for c in copies))


class Recorded(GRPOTrainer):
    """Records each rollout's prompts, rewards, advantages and completions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollouts: list[dict] = []

    def score(self, prompts, rollout, columns):
        rewards_NF = super().score(prompts, rollout, columns)
        self.rollouts[-1] |= {"scored_prompts": list(prompts), "completions": rollout.completion_ids,
                              "rewards": rewards_NF[:, 0].tolist()}  # fmt: skip
        return rewards_NF

    def make_rollout(self, rows):
        self.rollouts.append({"rows": [row["prompt"] for row in rows]})
        slices = super().make_rollout(rows)
        self.rollouts[-1]["advantages"] = torch.cat([part["advantages"] for part in slices]).tolist()
        return slices


def main() -> None:
    out = sys.argv[1]
    args = tiny.run_config(
        out, 3, per_device_train_batch_size=3, num_generations=4, gradient_accumulation_steps=2,
        temperature=1.5, logging_steps=1, shuffle_dataset=True,
    )  # fmt: skip
    agree = WeightsAgree()
    trainer = Recorded(
        model=tiny.build_model(),
        reward_funcs=distinct_letters,
        args=args,
        train_dataset=tiny.letters_dataset(64),
        processing_class=tiny.build_tokenizer(),
        callbacks=[agree],
    )
    trainer.train()
    record = {
        "rollouts": trainer.rollouts,
        "log_history": trainer.state.log_history,
        "weights_agree": agree.per_step,
        "global_step": trainer.state.global_step,
    }
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
