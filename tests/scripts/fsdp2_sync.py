"""Sync from an FSDP2-sharded model into each rank's engine; run it under a multi-process launch:

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/fsdp2_sync.py OUT_DIR

Each decoder layer and the root are `fully_shard`-ed (torch FSDP2, gloo), an optimizer step moves the
weights, and `WeightPlan` gathers them shard group by shard group into the engine. Each rank writes
OUT_DIR/rank<r>.json with the engine-vs-trainer log-prob gap before and after the sync.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from colograd import GRPOConfig
from colograd.engine.core import Engine
from colograd.engine.sync import WeightPlan, is_sharded
from colograd.models import tiny


def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    model = tiny.build_model(tie_word_embeddings=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=8,
        num_generations=8,
        max_prompt_length=32,
        max_completion_length=8,
        vllm_kv_cache_gib=0.1,
        vllm_enforce_eager=True,
        report_to="none",
    )
    engine = Engine(model, tokenizer, args)
    plan = WeightPlan(model, bucket_bytes=100_000)  # about one decoder layer per bucket
    plan.sync(engine)

    # One optimizer step on rank-specific data: FSDP2 reduces the gradients, every rank gets the same update.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(2, 40, (4, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(batch, labels=batch).loss.backward()
    optimizer.step()

    ids = tokenizer("abcd>b:bbbb and more text")["input_ids"]
    stale_gap = (engine.prompt_logprobs(ids) - logprobs(model, ids)).abs().max().item()
    plan.sync(engine)
    gap = (engine.prompt_logprobs(ids) - logprobs(model, ids)).abs().max().item()
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(
            {
                "sharded": is_sharded(model),
                "local_numel": local,
                "full_numel": sum(p.numel() for p in model.parameters()),
                "buckets": len(plan.buckets),
                "stale_gap": stale_gap,
                "parity_gap": gap,
            },
            f,
        )


if __name__ == "__main__":
    main()
