"""A short GRPO run on the built-in pretrained model, recording what tests/models/test_pretrained.py asserts; run it
under a multi-process launch (the second rank converts the GGUF file into $COLOGRAD_CACHE while the first waits):

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/smollm2_check.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json with: the trainer's log history, the tokenizer's special tokens, chat
template and generation config as loaded, the completions it sampled (ids, and text decoded without special
tokens), and the largest gap between engine and trainer log-probs after the final sync.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import GenerationConfig
from trl import ModelConfig

from colograd.data import sums
from colograd.engine.requests import Sampling
from colograd.models import pretrained, tiny
from colograd.train import load_model

sys.path.insert(0, os.path.dirname(__file__))
from grpo_check import RecordingTrainer, hf_logprobs  # noqa: E402

MODEL = "colograd:smollm2-135m-instruct"


def main() -> None:
    out = sys.argv[1]
    args = tiny.run_config(
        os.path.join(out, "run"),
        2,
        num_generations=4,
        per_device_train_batch_size=8,
        max_prompt_length=64,
        max_completion_length=24,
        learning_rate=1e-5,
        vllm_kv_cache_gib=0.25,
        logging_steps=1,
    )
    # The second process converts while the first waits: the conversion must not depend on being rank 0 (under a
    # process group transformers' save_pretrained writes weights on rank 0 only).
    if dist.get_rank() == 1:
        pretrained.materialise(MODEL)
    dist.barrier()
    model, tokenizer = load_model(ModelConfig(model_name_or_path=MODEL, dtype="float32"), args)
    folder = model.config._name_or_path
    trainer = RecordingTrainer(
        model=model,
        reward_funcs=sums.sum_reward,
        args=args,
        train_dataset=sums.sums_dataset(),
        processing_class=tokenizer,
    )
    trainer.sampled = []
    trainer.train()

    # The last optimizer step has not reached the engine yet: sync it, then compare log-probs on a chat.
    trainer.sync_weights()
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5"}]
    ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    gap = (trainer.engine.prompt_logprobs(ids) - hf_logprobs(model, ids)).abs().max().item()
    # A question the model answers briefly: samples that stop by themselves must end at the end-of-turn token.
    _, prompt_ids, _ = trainer.prepare_prompts([{"prompt": [{"role": "user", "content": "Say hello."}]}])
    rollout = trainer.engine.generate(prompt_ids, Sampling.of(args))
    sampled = [ids for step in trainer.sampled for ids in step] + rollout.completion_ids

    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "world_size": dist.get_world_size(),
                "folder": folder,
                "log_history": trainer.state.log_history,
                "parity_gap": gap,
                "tied": model.config.tie_word_embeddings,
                "dtype": str(next(model.parameters()).dtype),
                "quantization_config": getattr(model.config, "quantization_config", None),
                "eos": [tokenizer.eos_token, tokenizer.eos_token_id],
                "pad": [tokenizer.pad_token, tokenizer.pad_token_id],
                "generation_config": GenerationConfig.from_pretrained(folder).to_dict(),
                "templated": tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True),
                "completion_ids": sampled,
                "texts": tokenizer.batch_decode(sampled, skip_special_tokens=True),
                "weights_finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
            },
            f,
        )


if __name__ == "__main__":
    main()
