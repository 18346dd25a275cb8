"""The engine and the sync on their own, in one process, for several architectures vLLM supports."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from colograd import GRPOConfig, tiny
from colograd.engine import Engine
from colograd.sync import sync_weights


def llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def gpt2() -> torch.nn.Module:
    # Conv1D weights (transposed) and a fused c_attn: the engine's loader must translate both; head tied.
    config = GPT2Config(
        vocab_size=64, n_embd=128, n_layer=2, n_head=2, n_positions=256, eos_token_id=1, bos_token_id=1
    )
    return GPT2LMHeadModel(config)


ARCHITECTURES = {
    "qwen2": lambda: tiny.build_model(tie_word_embeddings=False),
    "qwen2-tied": lambda: tiny.build_model(tie_word_embeddings=True),
    "llama-gqa": llama,
    "gpt2-tied": gpt2,
}


def trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sync_gives_engine_the_trainer_weights(arch, tmp_path):
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]().eval()
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none")  # fmt: skip
    engine = Engine(model, tokenizer, args)
    ids = tokenizer("abcd>b:bbbb and more text")["input_ids"]

    sync_weights(model, engine)
    assert (engine.prompt_logprobs(ids) - trainer_logprobs(model, ids)).abs().max() <= 1e-4

    # A second sync after the weights move (as after an optimizer step), every tensor changed.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    before = engine.prompt_logprobs(ids)
    sync_weights(model, engine)
    after = engine.prompt_logprobs(ids)
    expected = trainer_logprobs(model, ids)
    assert (before - expected).abs().max() > 1e-2  # the change is large enough to notice
    assert (after - expected).abs().max() <= 1e-4
