"""The CPU backend's settings colograd makes before an engine starts (colograd/engine/cpu.py)."""

import torch
from torch._dynamo.utils import counters

from colograd.engine import cpu as engine_cpu


def test_the_sampler_counts_ranks_eagerly_with_vllms_own_expression():
    """vLLM's sampler gets an uncompiled rank count; on ties and on every row it counts what vLLM's function
    (the expression under its `torch.compile`) counts, so a change of vLLM's expression would show here."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    before, compiled = sampler.batched_count_greater_than, logprobs.batched_count_greater_than
    sampler.batched_count_greater_than = compiled  # as vLLM binds it, whatever an engine of this process did
    try:
        assert engine_cpu.count_ranks_eagerly()
        eager = sampler.batched_count_greater_than
        assert eager is not compiled and not hasattr(eager, "_torchdynamo_orig_callable")
        assert engine_cpu.count_ranks_eagerly() and sampler.batched_count_greater_than is eager  # once is enough
        x = torch.tensor([[0.1, 0.5, 0.5, -1.0], [2.0, 2.0, 2.0, 2.0], [-3.0, -1.0, -2.0, -4.0]])
        values = x[:, 1:2]
        expected = logprobs.batched_count_greater_than._torchdynamo_orig_callable(x, values)
        assert eager(x, values).tolist() == expected.tolist() == [2, 4, 1]
        logits = torch.randn(64, 151936).log_softmax(-1)  # a rollout's rows over a Qwen vocabulary
        sampled = logits.gather(-1, torch.randint(0, 151936, (64, 1)))
        frames = dict(counters["frames"])
        ranks = eager(logits, sampled)
        assert dict(counters["frames"]) == frames  # nothing was handed to torch.compile
        assert torch.equal(ranks, logprobs.batched_count_greater_than._torchdynamo_orig_callable(logits, sampled))
    finally:
        sampler.batched_count_greater_than = before


def test_a_latent_attention_engine_gets_the_reference_cpu_backend():
    """vLLM's AMX kernels for latent attention refuse fp32 weights at start-up (tests/models/test_moe.py's deepseek_v2
    on a CPU with AMX tiles) and, in bf16, empty a weight the sync's reload writes back (tests/zoo/test_parity.py):
    an MLA engine asks for the reference backend in any precision; other attention keeps vLLM's."""
    from transformers import DeepseekV2Config, LlamaConfig

    from colograd.engine.cpu import mla_backend

    deepseek = DeepseekV2Config()  # kv_lora_rank 512, as DeepSeek-V2's
    assert mla_backend(deepseek) == {"attention_backend": "CPU_MLA"}
    assert mla_backend(LlamaConfig()) == {}
