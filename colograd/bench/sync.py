"""Weight-sync benchmark: colograd's sync against the memory-copy floor and a per-tensor sync.

On a Qwen2-architecture model of ~110M parameters built locally (tied embeddings, as Qwen2.5-0.5B), in one
process, with the real engine. Each figure is the median of `repeats` timed runs after a warm-up:

- sync_s: `WeightPlan.sync`, the trainer → engine sync colograd runs after every optimizer step;
- memcpy_s: `torch._foreach_copy_` of the same tensors into preallocated buffers — one plain pass over the
  bytes, the floor for any in-process sync;
- per_tensor_s: one engine call per tensor, as TRL's colocate sync does (it calls `load_weights` once per
  tensor). On CPU the only engine call that can write weights is the in-place reload, and one call per tensor
  leaves fused layers (qkv, gate_up) partly stale, so `per_tensor_parity_gap` is reported beside it;
- lora_bytes_ratio: bytes of a full sync ÷ bytes of an adapter-only sync (LoRA r=16 on every linear layer).
"""

import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from colograd import GRPOConfig, tiny
from colograd.engine import Engine
from colograd.sync import WeightPlan


def build_model() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first calls allocate
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parity_gap(model: torch.nn.Module, engine: Engine, ids: list[int]) -> float:
    """Largest |engine - trainer| log-prob over a sequence: proof the timed sync really moved the weights."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return (engine.prompt_logprobs(ids) - expected).abs().max().item()


def lora_bytes(model: torch.nn.Module) -> int:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    return sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if "lora_" in n)


def run(repeats: int = 7, as_json: bool = False) -> dict[str, float]:
    model = build_model()
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(
        output_dir="outputs/bench",
        per_device_train_batch_size=8,
        num_generations=8,
        max_prompt_length=64,
        max_completion_length=8,
        vllm_kv_cache_gib=0.1,
        vllm_enforce_eager=True,
        report_to="none",
    )
    engine = Engine(model, tokenizer, args)
    plan = WeightPlan(model)
    weights = [t for bucket in plan for _, t in bucket]
    buffers = [torch.empty_like(t) for t in weights]

    sync_s = median_time(lambda: plan.sync(engine), repeats)
    gap = parity_gap(model, engine, tokenizer("abcd>b:bbbb, then more text")["input_ids"])
    memcpy_s = median_time(lambda: torch._foreach_copy_(buffers, weights), repeats)
    named = [pair for bucket in plan for pair in bucket]
    per_tensor_s = median_time(lambda: [engine.load_weights([pair]) for pair in named], max(1, repeats // 3))
    per_tensor_gap = parity_gap(model, engine, tokenizer("abcd>b:bbbb, then more text")["input_ids"])

    result = {
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "bytes": plan.nbytes,
        "tensors": len(named),
        "sync_s": sync_s,
        "memcpy_s": memcpy_s,
        "per_tensor_s": per_tensor_s,
        "ratio_vs_memcpy": sync_s / memcpy_s,
        "speedup_vs_per_tensor": per_tensor_s / sync_s,
        "lora_bytes_ratio": plan.nbytes / lora_bytes(model),
        "parity_gap": gap,
        "per_tensor_parity_gap": per_tensor_gap,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    if as_json:
        print(json.dumps(result))
    else:
        r = result
        print(f"model: Qwen2 {r['params_m']:.1f}M parameters, {r['tensors']} tensors, {r['bytes'] / 2**20:.0f} MiB")
        print(f"colograd sync    {sync_s * 1e3:9.1f} ms  engine-trainer log-prob gap after it {gap:.1e}")
        print(f"memcpy floor     {memcpy_s * 1e3:9.1f} ms  ratio_vs_memcpy       {r['ratio_vs_memcpy']:.2f}")
        print(f"per-tensor sync  {per_tensor_s * 1e3:9.1f} ms  speedup_vs_per_tensor {r['speedup_vs_per_tensor']:.2f}")
        print(f"                              log-prob gap after per-tensor sync {per_tensor_gap:.1e}")
        print(f"LoRA r=16, adapter-only sync: 1/{r['lora_bytes_ratio']:.0f} of the bytes (lora_bytes_ratio)")
        print(f"device: {r['device']}; figures are medians of {repeats} runs")
    return result
