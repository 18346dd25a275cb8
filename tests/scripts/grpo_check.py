"""A short GRPO run on the tiny task that records what the tests assert; run it under a multi-process launch:

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/grpo_check.py OUT_DIR [--tied]

Each rank writes OUT_DIR/rank<r>.json with: the trainer's log history, whether every rank held identical
weights after every optimizer step, the completions it sampled, its samples for one shared prompt, the
largest gap between engine and trainer log-probs after the final sync, and how the weights were held
(sharded or not) and synced (number of buckets), whether it trained the model's own tensors (not a copy),
and its local rank (given by the launcher, and derived without it). Launched with a DeepSpeed ZeRO-3 config it
trains sharded.

Several runs, one after another in the same processes (each with its own trainer and engine, as a notebook's second
trainer has), share one launch's start-up: separate them with --then, each with its own OUT_DIR and flags:

    ... tests/scripts/grpo_check.py OUT_A --steps 30 --then OUT_B --steps 30 --tied --then OUT_C --lora merged
"""

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback

from colograd import GRPOTrainer
from colograd.engine.launch import _local_rank
from colograd.engine.requests import Sampling
from colograd.engine.sync import is_sharded
from colograd.models import tiny


class WeightsAgree(TrainerCallback):
    """After each optimizer step, checks that every rank holds bit-identical weights."""

    def __init__(self) -> None:
        self.per_step: list[bool] = []
        self.local_numel: list[int] = []  # 0 under ZeRO-3: each rank holds only its shard (in ds_tensor)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        params = list(model.parameters())
        self.local_numel.append(sum(p.numel() for p in params))
        with zero3_gathered(params):  # ZeRO-3 holds a shard of each parameter per rank: compare whole ones
            flat = torch.cat([p.detach().flatten().clone() for p in params])
        copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, flat)
        self.per_step.append(all(torch.equal(flat, c) for c in copies))


def zero3_gathered(params: list[torch.nn.Parameter]):
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def reference_moved(trainer: GRPOTrainer, initial: torch.nn.Module) -> bool:
    """Whether the reference copy (whole, gathered under ZeRO-3) differs from the initial weights."""
    if trainer.reference is None or trainer.reference.frozen is None:
        return False
    params = list(trainer.reference.frozen.parameters())
    with zero3_gathered(params):
        return any(not torch.equal(p.cpu(), q) for p, q in zip(params, initial.parameters(), strict=True))


class RecordingTrainer(GRPOTrainer):
    """Overrides one stage, `generate`, to keep the sampled completions (and, to test failures, to end rank 1
    abruptly at step `die_at_step`, as a crash or an out-of-memory kill would)."""

    sampled: list[list[list[int]]] = []
    die_at_step: int | None = None

    def generate(self, prompt_ids, context, images=None):
        if self.die_at_step == self.state.global_step and dist.get_rank() == 1:
            os._exit(17)
        rollout = super().generate(prompt_ids, context, images)
        self.sampled.append(rollout.completion_ids)
        return rollout


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():  # on the CPU, whatever device the model is on (as the engine's log-probs are)
        logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1].float().cpu()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _attention_heads(worker) -> int:
    """Runs in the engine's worker: attention heads this rank computes (all of them unless tensor parallel)."""
    return worker.model_runner.model.model.layers[0].self_attn.num_heads


def local_rank_without_launcher() -> int:
    """The local rank the engine derives when no launcher set LOCAL_RANK or LOCAL_WORLD_SIZE (collective)."""
    saved = {key: os.environ.pop(key) for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if key in os.environ}
    try:
        return _local_rank(dist.get_rank(), dist.get_world_size())
    finally:
        os.environ.update(saved)


def main() -> None:
    words, runs = sys.argv[1:], [[]]
    for word in words:
        if word == "--then":
            runs.append([])
        else:
            runs[-1].append(word)
    for argv in runs:
        run(argv)


def run(argv: list[str]) -> None:
    """One run: train with the flags of `argv` (OUT_DIR and its flags) and write OUT_DIR/rank<r>.json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-mib", type=float, default=512)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--sync-ref-steps", type=int, help="sync_ref_model every this many optimizer steps")
    parser.add_argument("--lora", choices=["merged", "adapter"], help="train LoRA adapters, synced this way")
    parser.add_argument("--tp", type=int, default=1, help="vllm_tensor_parallel_size")
    parser.add_argument("--all-logps", action="store_true", help="the engine's log-prob of every completion token")
    parser.add_argument("--die-at-step", type=int, help="rank 1 exits abruptly when this step starts")
    cli = parser.parse_args(argv)

    args = tiny.run_config(
        os.path.join(cli.out, "run"),
        cli.steps,
        learning_rate=3e-3,
        sync_bucket_mib=cli.bucket_mib,
        beta=cli.beta,
        sync_ref_model=cli.sync_ref_steps is not None,
        ref_model_sync_steps=cli.sync_ref_steps or 512,
        lora_sync=cli.lora or "merged",
        vllm_tensor_parallel_size=cli.tp,
        sampling_gap_completions="all" if cli.all_logps else "one",
    )
    tokenizer = tiny.build_tokenizer()
    callback = WeightsAgree()
    model = tiny.build_model(tie_word_embeddings=cli.tied)
    if cli.lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]))
    built_at = next(model.parameters()).data_ptr()
    trainer = RecordingTrainer(
        model=model,
        reward_funcs="letters",
        args=args,
        train_dataset=tiny.letters_dataset(),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.sampled = []  # this run's own (the class's list would gather every run's of the process)
    trainer.die_at_step = cli.die_at_step
    trainer.train()
    trained_at = next(trainer.accelerator.unwrap_model(trainer.model).parameters()).data_ptr()

    # The last optimizer step has not reached the engine yet: sync it, then compare log-probs.
    trainer.sync_weights()
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    ids = tokenizer("abcd>b:bbbbbbbb")["input_ids"]
    gap = (trainer.engine.prompt_logprobs(ids) - hf_logprobs(model, ids)).abs().max().item()
    shared = trainer.engine.generate([tokenizer("abcd>a:")["input_ids"]], Sampling.of(args)).completion_ids

    rank = dist.get_rank()
    derived_local_rank = local_rank_without_launcher()
    with open(os.path.join(cli.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "world_size": dist.get_world_size(),
                "log_history": trainer.state.log_history,
                "weights_agree": callback.per_step,
                "sampled": trainer.sampled,
                "shared_prompt_samples": shared,
                "parity_gap": gap,
                "tied": model.config.tie_word_embeddings,
                "sharded": is_sharded(model),
                "sync_buckets": len(trainer.weight_plan.buckets),
                "local_numel": callback.local_numel,
                "reference_sharded": trainer.reference is not None and is_sharded(trainer.reference.frozen),
                "reference_moved": reference_moved(trainer, tiny.build_model(tie_word_embeddings=cli.tied)),
                "lora_request": trainer.engine.lora_request is not None,
                "engine_heads": trainer.engine.llm.collective_rpc(_attention_heads)[0],
                "sampler_tap": type(trainer.engine.sampler_tap()).__name__ if cli.all_logps else None,
                "local_rank": int(os.environ["LOCAL_RANK"]),
                "derived_local_rank": derived_local_rank,
                "trained_in_place": trained_at == built_at,
            },
            f,
        )


if __name__ == "__main__":
    main()
