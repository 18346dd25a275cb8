"""Decode speed against the hardware: one decode step of the engine against the time its memory reads take.

A decode step of B sequences reads every weight once and each sequence's KV cache so far; at the batch sizes of
a GRPO rollout it does little arithmetic per byte, so the floor for a step is those bytes over the device's
memory bandwidth. The step's time is measured through the engine the trainer uses: bare `vllm.LLM.generate`
calls of the rollout's requests with EOS ignored (every sequence decodes every token) and no log-probs, at two
lengths, so that the prefill and the call's fixed costs cancel in the difference. The bandwidth is measured,
not looked up: the median of a few device-to-device copies of a buffer larger than the caches. What is left
between the step and the floor is the engine's own (kernel launches, scheduling, sampling, Python per step).
"""

import statistics
from typing import Any

import torch

from colograd.bench.sync import median_time
from colograd.engine.kv_cache import kv_bytes_per_token
from colograd.engine.requests import sampling_params


def memory_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second a copy of `nbytes` moves on `device` (a read and a write of each byte), the median of
    `repeats` copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    _synchronize(device)
    return 2 * nbytes / median_time(lambda: (dst.copy_(src), _synchronize(device)), repeats)


def decode_step_seconds(trainer: Any, prompt_ids: list[list[int]], tokens: int, repeats: int = 3) -> float:
    """Seconds per decode step of the rollout's requests (`prompt_ids` × `num_generations`) through the trainer's
    engine: `tokens` and 1 completion tokens with EOS ignored and no log-probs, medians, differenced."""
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]

    def timed(max_tokens: int) -> float:
        params = sampling_params(trainer.args, logprobs=None, max_tokens=max_tokens, ignore_eos=True)
        llm = trainer.engine.requests().llm  # vLLM as it is
        return median_time(lambda: llm.generate(prompts, params, use_tqdm=False), repeats)

    return (timed(tokens) - timed(1)) / (tokens - 1)


def decode_floor_seconds(
    model: torch.nn.Module, engine_dtype: torch.dtype, sequences: int, context: float, bandwidth: float
) -> float:
    """The memory-read floor of one decode step: every weight once (in the engine's dtype; of the input
    embeddings only the step's rows, unless the output layer shares them) and `sequences` KV caches of `context`
    tokens on average, over `bandwidth` bytes/s."""
    read = {id(p): p.numel() for p in model.parameters()}
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        read[id(embedding)] = sequences * embedding.size(1)
    weights = sum(read.values()) * engine_dtype.itemsize
    kv = sequences * context * kv_bytes_per_token(model.config, engine_dtype)
    return (weights + kv) / bandwidth


def decode_against_floor(trainer: Any, prompts: int) -> dict[str, float]:
    """The engine's decode step on a rollout of the first `prompts` training prompts against its memory-read floor
    (`decode_floor_seconds`).

    Returns:
        decode_ms_per_step, decode_floor_ms, decode_vs_floor (their ratio: 1 would be the hardware's limit),
        memory_bandwidth_gb_s, and the step's tokens (sequences decoded together).
    """
    args = trainer.args
    _, prompt_ids, _ = trainer.prepare_prompts([trainer.train_dataset[i] for i in range(prompts)])
    model = trainer.accelerator.unwrap_model(trainer.model)
    tokens = args.max_completion_length
    step = decode_step_seconds(trainer, prompt_ids, tokens)
    bandwidth = memory_bandwidth(args.device)
    sequences = len(prompt_ids) * args.num_generations
    prompt = statistics.mean(len(ids) for ids in prompt_ids)
    engine_dtype = trainer.engine.dtype
    floor = decode_floor_seconds(model, engine_dtype, sequences, prompt + tokens / 2, bandwidth)
    return {
        "decode_ms_per_step": 1e3 * step,
        "decode_floor_ms": 1e3 * floor,
        "decode_vs_floor": step / floor,
        "memory_bandwidth_gb_s": bandwidth / 1e9,
        "decode_sequences": sequences,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
