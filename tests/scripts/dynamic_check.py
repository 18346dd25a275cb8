"""Dynamic sampling on 2 ranks (tests/rollout/test_dynamic_sampling.py): rank 0's reward also leaves the groups of
prompts asking for 'a' or 'b' uniform, so rank 0 needs more refill rounds than rank 1.
Run under a multi-process launch:

    accelerate launch --config_file tests/configs/zero3_cpu.yaml tests/scripts/dynamic_check.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: per rollout, the refill rounds it ran, the groups it sampled and the uniform
groups it kept; its step losses; whether its weights were sharded.
"""

import argparse
import json
import os

import torch.distributed as dist

from colograd import GRPOTrainer
from colograd.engine.sync import is_sharded
from colograd.models import tiny
from colograd.rollout.dynamic import group_spread


def rank_reward(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """The letters reward; on rank 0, 0.5 whatever the completion for prompts asking for 'a' or 'b'."""
    uniform = "ab" if dist.get_rank() == 0 else ""
    return [
        0.5 if t in uniform else (c.count(t) / len(c) if c else 0.0) for c, t in zip(completions, target, strict=True)
    ]


def run(out: str) -> None:
    args = tiny.run_config(os.path.join(out, "run"), 2, dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    trainer = GRPOTrainer(tiny.build_model(), rank_reward, args, tiny.letters_dataset(256),
                          processing_class=tiny.build_tokenizer())  # fmt: skip
    record = {"rounds": [], "sampled": [], "uniform_kept": [], "first_round_found": []}
    fill = trainer.dynamic.fill

    def recorded_fill(rows, sample, weights, most, step):
        counts = []

        def counted(rows, round):
            counts.append(len(rows))
            scored = sample(rows, round)
            if round == 0:  # the informative groups this rank found in its own prompts
                spread = group_spread(scored.rewards_NF, weights, args.num_generations)
                record["first_round_found"].append(int((spread > args.dynamic_sampling_std_eps).sum()))
            return scored

        kept, metrics, dropped = fill(rows, counted, weights, most, step)
        record["rounds"].append(metrics["dynamic_sampling/rounds"])
        record["sampled"].append(sum(counts))
        spread = group_spread(kept.rewards_NF, weights, args.num_generations)
        record["uniform_kept"].append(int((spread <= args.dynamic_sampling_std_eps).sum()))
        return kept, metrics, dropped

    trainer.dynamic.fill = recorded_fill
    train_and_record(trainer, record, out)


def train_and_record(trainer: GRPOTrainer, record: dict, out: str) -> None:
    """Train, and write the rank's `record` with its step losses and whether its weights were sharded to
    OUT/rank<r>.json."""
    trainer.train()
    record["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    record["sharded"] = is_sharded(trainer.accelerator.unwrap_model(trainer.model))
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    run(parser.parse_args().out)
