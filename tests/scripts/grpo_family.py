"""Several short GRPO runs in the same processes, one per loss type, covering the GRPO family's options:

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/grpo_family.py OUT DATA_DIR

    grpo     beta > 0 (frozen reference copy), num_iterations 2, a conversational dataset folder with a chat
             template, four weighted rewards: sync with a dataset column, async, one that abstains, a reward model
    dr_grpo  importance_sampling_level sequence (GSPO), steps_per_generation 2 (one rollout, two optimizer steps),
             entropy masking and the adaptive entropy bonus
    bnpo     gradient accumulation 2 (one rollout per optimizer step), scale_rewards batch, masked truncations,
             sequence-level importance-sampling correction against the engine, padded (not packed) forward
    dapo     beta > 0, generation_batch_size over two optimizer steps, scale_rewards none, token-level
             importance-sampling correction, the reference updated toward the policy every 2 steps (sync_ref_model)
    lora     beta > 0 with a LoRA model: the reference is the model with its adapters disabled (no copy)

Each rank writes OUT/<run>-rank<r>.json: the log history, whether the ranks' weights agreed after every step,
the global step of every sync and of every rollout, per micro-step the largest |log π_θ - log π_old| (0 where
the loss used the current log-probs) and whether they were the engine's own, the first templated prompt, each
rollout's rewards and advantages, and whether the reference copy moved from the initial weights.
"""

import argparse
import asyncio
import json
import os

import torch
import torch.distributed as dist
from grpo_check import WeightsAgree
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from colograd import GRPOTrainer, ScriptArguments
from colograd.data.core import load_prompts
from colograd.models import tiny
from colograd.rewards.core import RewardModel

# Renders [user: "abcd>b"] as "u:abcd>b;a:" with characters the tiny tokenizer knows.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def target_letter(completions, target, **kwargs) -> list[float]:
    """The letters task on text or chat completions; `target` is a dataset column."""
    return tiny.letters_reward([_text(c) for c in completions], target)


async def short(completions, **kwargs) -> list[float]:
    await asyncio.sleep(0)
    return [-len(_text(c)) / 8 for c in completions]


def abstains_on_odd(completion_ids, **kwargs) -> list[float | None]:
    return [None if i % 2 else float(len(ids) % 3) for i, ids in enumerate(completion_ids)]


def reward_model() -> RewardModel:
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE  # conversational samples are scored as rendered chats
    return RewardModel(Qwen2ForSequenceClassification(config), tokenizer)


class RecordingTrainer(GRPOTrainer):
    """Records when the stages run, overriding each one to call the original."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.synced_at: list[int] = []
        self.rollouts_at: list[int] = []
        self.old_logp_gaps: list[float] = []
        self.old_from_engine: list[bool] = []
        self.first_prompt: str | None = None
        self.advantages: list[tuple[list, list]] = []

    def _write_weights(self) -> None:
        if self.state.global_step not in self.synced_at[-1:]:  # a new optimizer step's weights (not a rewrite)
            self.synced_at.append(self.state.global_step)
        super()._write_weights()

    def prepare_prompts(self, rows):
        prompts, prompt_ids, columns = super().prepare_prompts(rows)
        self.first_prompt = self.first_prompt or self.processing_class.decode(prompt_ids[0])
        return prompts, prompt_ids, columns

    def generate(self, prompt_ids, context, images=None):
        self.rollouts_at.append(self.state.global_step)
        return super().generate(prompt_ids, context, images)

    def compute_advantages(self, rewards_NF):
        advantages_N = super().compute_advantages(rewards_NF)
        self.advantages.append((rewards_NF.tolist(), advantages_N.tolist()))
        return advantages_N

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "old_logps" in inputs:
            self.old_from_engine.append(torch.equal(inputs["old_logps"], inputs["engine_logps"]))
            with torch.no_grad():
                gap = (self.completion_logps(model, inputs) - inputs["old_logps"]).abs().max().item()
        else:
            gap = 0.0
        self.old_logp_gaps.append(gap)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


RUNS = {
    "grpo": {
        "steps": 4,
        "config": {"loss_type": "grpo", "beta": 0.04, "num_iterations": 2, "reward_weights": [1.0, 0.5, 2.0, 0.1]},
    },
    "dr_grpo": {
        "steps": 4,
        "config": {
            "loss_type": "dr_grpo",
            "importance_sampling_level": "sequence",
            "steps_per_generation": 2,
            "top_entropy_quantile": 0.5,
            "use_adaptive_entropy": True,
            "entropy_coef": 0.01,
            "entropy_coef_delta": 0.01,
            "entropy_target": 10.0,  # above the tiny model's entropy: the coefficient rises every step
        },
    },
    "bnpo": {
        "steps": 2,
        "config": {
            "loss_type": "bnpo",
            "gradient_accumulation_steps": 2,
            "scale_rewards": "batch",
            "mask_truncated_completions": True,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "sequence_truncate",
            "padding_free": False,
        },
    },
    "dapo": {
        "steps": 4,
        "config": {
            "loss_type": "dapo",
            "beta": 0.04,
            "generation_batch_size": 64,
            "scale_rewards": "none",
            "vllm_importance_sampling_correction": True,
            "sync_ref_model": True,
            "ref_model_sync_steps": 2,
        },
    },
    "lora": {"steps": 3, "config": {"loss_type": "grpo", "beta": 0.04}},
}


FINISHED: list[GRPOTrainer] = []


def record_moved(trainer: GRPOTrainer) -> bool:
    """Whether the reference copy differs from the initial weights (all runs start from `tiny.build_model()`)."""
    if trainer.reference is None or trainer.reference.frozen is None:
        return False
    initial = tiny.build_model().parameters()
    return any(not torch.equal(p, q) for p, q in zip(trainer.reference.frozen.parameters(), initial, strict=True))


def train(name: str, out: str, data_dir: str) -> dict:
    run = RUNS[name]
    # 2 prompts × 8 completions per micro-step and rank.
    args = tiny.run_config(
        os.path.join(out, name),
        run["steps"],
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        max_prompt_length=24,
        vllm_kv_cache_gib=0.05,
        **run["config"],
    )
    tokenizer = tiny.build_tokenizer()
    if name == "grpo":
        tokenizer.chat_template = CHAT_TEMPLATE
        dataset = load_prompts(ScriptArguments(dataset_name=data_dir))
        reward_funcs = [target_letter, short, abstains_on_odd, reward_model()]
    else:
        dataset = tiny.letters_dataset()
        reward_funcs = ["letters"]
    model = tiny.build_model()
    if name == "lora":
        # New adapters start at zero (B = 0): the policy starts equal to its reference.
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    callback = WeightsAgree()
    trainer = RecordingTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.train()
    record = {
        "log_history": trainer.state.log_history,
        "weights_agree": callback.per_step,
        "synced_at": trainer.synced_at,
        "rollouts_at": trainer.rollouts_at,
        "old_logp_gaps": trainer.old_logp_gaps,
        "old_from_engine": trainer.old_from_engine,
        "first_prompt": trainer.first_prompt,
        "steps_per_generation": args.steps_per_generation,
        "reference_is_a_copy": trainer.reference is not None and trainer.reference.frozen is not None,
        "advantages": trainer.advantages,
        "reference_moved": record_moved(trainer),
    }
    # Kept alive: freeing a trainer shuts its engine down, and vLLM's shutdown under the external launcher tears
    # down the torch process group the next run needs.
    FINISHED.append(trainer)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("data_dir")
    cli = parser.parse_args()
    for name in RUNS:
        record = train(name, cli.out, cli.data_dir)
        with open(os.path.join(cli.out, f"{name}-rank{dist.get_rank()}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
