"""Partial rollouts on 2 ranks (tests/rollout/test_partial_rollouts.py). Run under a multi-process launch:

    accelerate launch --config_file tests/configs/zero3_cpu.yaml tests/scripts/partial_check.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: per rollout, the groups it trained and how many of them it carried from the
last; the prompts it trained; its step losses; whether its weights were sharded.
"""

import argparse
import os

from dynamic_check import train_and_record

from colograd import GRPOTrainer
from colograd.models import tiny


def run(out: str) -> None:
    args = tiny.run_config(os.path.join(out, "run"), 3, num_generations=4, per_device_train_batch_size=24,
                           max_completion_length=48, partial_rollouts=True)  # fmt: skip
    model = tiny.build_model()
    model.generation_config.eos_token_id = [1, 40, 41, 42, 43]  # lengths from 1 token to the limit
    trainer = GRPOTrainer(model, tiny.letters_reward, args, tiny.letters_dataset(256),
                          processing_class=tiny.build_tokenizer())  # fmt: skip
    record = {"groups": [], "resumed": [], "prompts": []}
    take = trainer.partial.take

    def recorded_take(*args, **kwargs):
        taken, metrics, generated = take(*args, **kwargs)
        record["groups"].append(len(taken))
        record["resumed"].append(metrics["partial_rollouts/resumed_groups"])
        record["prompts"] += [group.row["prompt"] for group in taken]
        return taken, metrics, generated

    trainer.partial.take = recorded_take
    train_and_record(trainer, record, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    run(parser.parse_args().out)
