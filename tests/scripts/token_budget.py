"""One optimizer step, with and without `micro_batch_tokens`, for each loss type; run it under a 2-process launch:

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/token_budget.py OUT

Gradient accumulation 2, so the passes of a micro-step run inside the Trainer's own `no_sync` as well as in the
step that reduces gradients. Each rank writes OUT/rank<r>.json: per loss type and budget, the completions sampled
(the same seed must give the same rollout, or the comparison means nothing), the number of passes per
micro-step, and the weights after the step (plain SGD, so they differ from the initial ones by lr × gradient).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from colograd import GRPOTrainer
from colograd.models import tiny

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
BUDGETS = [None, 40]
KEEP: list[GRPOTrainer] = []  # freeing a trainer shuts its engine down, and with it the process group


class Recording(GRPOTrainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: list[list[list[int]]] = []
        self.passes: list[int] = []

    def generate(self, prompt_ids, context, images=None):
        rollout = super().generate(prompt_ids, context, images)
        self.sampled.append(rollout.completion_ids)
        return rollout

    def training_step(self, *args, **kwargs):
        before = len(self.metrics["tokens/trained"])
        loss = super().training_step(*args, **kwargs)
        self.passes.append(len(self.metrics["tokens/trained"]) - before)
        return loss


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    cli = parser.parse_args()
    record = {"initial": _flat(tiny.build_model())}
    for loss_type in LOSS_TYPES:
        for budget in BUDGETS:
            args = tiny.run_config(
                os.path.join(cli.out, f"{loss_type}-{budget}"),
                1,
                per_device_train_batch_size=16,
                gradient_accumulation_steps=2,
                loss_type=loss_type,
                micro_batch_tokens=budget,
                learning_rate=0.1,
                optim="sgd",
                vllm_kv_cache_gib=0.05,
                logging_steps=1,
            )
            trainer = Recording(
                model=tiny.build_model(),
                reward_funcs="letters",
                args=args,
                train_dataset=tiny.letters_dataset(),
                processing_class=tiny.build_tokenizer(),
            )
            trainer.train()
            model = trainer.accelerator.unwrap_model(trainer.model)
            record[f"{loss_type}-{budget}"] = {
                "sampled": trainer.sampled,
                "passes": trainer.passes,
                "weights": _flat(model),
            }
            KEEP.append(trainer)
    with open(os.path.join(cli.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
