"""GRPO on a Mixture-of-Experts model of the zoo (or any model of it: tests/zoo/test_hybrids.py runs a hybrid), with
TRL's quickstart settings but a learning rate that moves the experts; run it in one process, or under a multi-process
launch (plain, or with a DeepSpeed ZeRO-3 config to train sharded):

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/moe_check.py OUT_DIR MODEL...

The models train one after another in the same processes, each with its own trainer and engine (with --bf16, in TRL's
bf16); those named after --bf16-models then train again, from the same initial weights, in bf16 with the sampling
correction on, so that one process's start-up serves both precisions. Each rank writes OUT_DIR/rank<r>.json with, per
run ("MODEL", or "MODEL (bf16)"): the trainer's log history, whether every rank held identical weights after every
optimizer step, the largest gap between engine and trainer log-probs after the final sync, whether the model was
sharded (and which parameters this rank then held only a part of) and into how many buckets the sync cut it, whether
the engine's experts are prepacked, and whether the running parity guard stayed on (the gate found the training pass
equal to the evaluation pass). With --replay the MoE models replay the engine's routing in every pass
(`routing_replay: rollout`); with --partial, partial rollouts carry groups across rollouts.
"""

import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from grpo_check import WeightsAgree, hf_logprobs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import zoo  # noqa: E402  (tests/zoo.py)

from colograd import GRPOConfig, GRPOTrainer  # noqa: E402
from colograd.engine.sync import is_sharded  # noqa: E402
from colograd.forward.router import router_of  # noqa: E402

QUESTIONS = ["what is 2+2?", "name a colour.", "say yes.", "(1+3)*2=?"]


def answer_length(completions: list, **kwargs) -> list[float]:
    """A reward any completion gets: its length's remainder by 3 (varied, so that advantages are not all zero)."""
    text = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 3) for t in text]


def parser() -> argparse.ArgumentParser:
    """The command line; other scripts build `check`'s options from it (`options`), so they get every default."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("models", nargs="+", help="models of tests/zoo.py (Mixture-of-Experts, or hybrid)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-mib", type=float, default=512)
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16 (the engine follows), with the sampling "
                        "correction on (vllm_importance_sampling_correction)")  # fmt: skip
    parser.add_argument("--bf16-models", nargs="*", default=[], help="models of MODEL... that train again after "
                        "all of them, from the same initial weights, as with --bf16")  # fmt: skip
    parser.add_argument("--replay", action="store_true", help="routing_replay: rollout for the MoE models")
    parser.add_argument("--partial", action="store_true", help="partial_rollouts: groups carried across rollouts")
    parser.add_argument("--shift-replay", action="store_true", help="a fault to catch: the engine's routing of every "
                        "completion reaches the trainer one position late")  # fmt: skip
    return parser


def options(out: str, model: str, *flags: str) -> argparse.Namespace:
    """`check`'s options for `model` as this script's command line gives them (`flags`: its options)."""
    return parser().parse_args([out, model, *flags])


def main() -> None:
    cli = parser().parse_args()
    if cli.shift_replay:
        from colograd.engine.routing import RoutingCapture

        captured = RoutingCapture.routes
        RoutingCapture.routes = lambda self, requests: [r.roll(1, dims=0) for r in captured(self, requests)]
    # Every model is built before the first trainer: once a trainer has set up ZeRO-3, transformers builds models
    # already partitioned (deepspeed.zero.Init), and the zoo's edit of their weights needs them whole.
    built = {name: zoo.stopping_model(name) for name in cli.models}
    again = {name: copy.deepcopy(built[name]) for name in cli.bf16_models}  # before any trainer moves the weights
    results = {name: check(name, *built.pop(name), cli.bf16, cli) for name in cli.models}
    results |= {f"{name} (bf16)": check(name, *again.pop(name), True, cli) for name in cli.bf16_models}
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(cli.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def check(name: str, model: torch.nn.Module, tokenizer, bf16: bool, cli: argparse.Namespace) -> dict:
    """Train `name` (`model`, `tokenizer`) for `cli.steps` steps, with TRL's bf16 if `bf16`; what the module's
    docstring lists."""
    # GRPOConfig's defaults (TRL's quickstart) but a learning rate that moves every expert in a few steps and
    # shorter completions (the stopping model answers in a few tokens anyway).
    out = os.path.join(cli.out, name.replace("/", "--") + ("-bf16" if bf16 else ""))
    replay = "rollout" if cli.replay and router_of(model, None) is not None else "off"
    args = GRPOConfig(output_dir=out, max_steps=cli.steps, learning_rate=1e-2, max_completion_length=64,
                      sync_bucket_mib=cli.bucket_mib, vllm_enforce_eager=True, save_strategy="no", report_to="none",
                      disable_tqdm=True, bf16=bf16, vllm_importance_sampling_correction=bf16 or cli.partial,
                      routing_replay=replay, partial_rollouts=cli.partial)  # fmt: skip
    callback = WeightsAgree()
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS]
    trainer = GRPOTrainer(model=model, reward_funcs=answer_length, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[callback])  # fmt: skip
    trainer.train()

    trainer.sync_weights()  # the last optimizer step has not reached the engine yet
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[3]}], add_generation_prompt=True,
                                         tokenize=False) + "8, or (1+3)*2 = 8."  # fmt: skip
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        gap = (trainer.engine.prompt_logprobs(ids) - hf_logprobs(model, ids)).abs().max().item()
    sharded = is_sharded(model)
    return {
        "log_history": trainer.state.log_history,
        "weights_agree": callback.per_step,
        "parity_gap": gap,
        "sharded": sharded,
        "partitioned": [n for n, p in model.named_parameters() if p.ds_tensor.numel() < p.ds_numel] if sharded else [],
        "sync_buckets": len(trainer.weight_plan.buckets),
        "prepacked_experts": trainer.engine.prepacked_experts,
        "running_guard": trainer.parity.running,  # the training pass read at every rollout, as the evaluation one
    }


if __name__ == "__main__":
    main()
