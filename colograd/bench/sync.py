"""Weight-sync benchmark: colograd's sync against the memory-copy floor and a per-tensor sync.

On a Qwen2-architecture model built locally, in one process, with the real engine, on the device the engine runs
on: without a GPU ~135M parameters (untied head, as Qwen2.5-7B; fp32); on a GPU the layers of Qwen2.5-1.5B with its
vocabulary (1.5B parameters, untied head, bf16: what a bf16 engine holds), moved to the GPU, so the sync is a
GPU-to-GPU pass. Each time is the median of `repeats` timed runs after a warm-up (on a GPU, with the device
synchronized before the clock stops):

- sync_s: `WeightPlan.sync`, the trainer → engine sync colograd runs after every optimizer step;
- memcpy_s: `torch._foreach_copy_` of the same tensors into preallocated buffers on the same device — one plain
  pass over the bytes, the floor for any in-process sync;
- per_tensor_s: one engine call per tensor, as TRL's colocate sync does (`load_weights` once per tensor);
- lora_bytes_ratio: bytes of a full sync ÷ bytes of an adapter-only sync (LoRA r=16 on every linear layer);
- without a GPU, the same sync into an engine that keeps vLLM's CPU default of repacking linear weights for
  oneDNN (`vllm_cpu_repack_weights`), and the generation speed of both engines on the same prompts, since
  the choice between them trades one for the other.
"""

import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from colograd import GRPOConfig
from colograd.engine.core import Engine
from colograd.engine.sync import WeightPlan
from colograd.models import tiny

# The CPU's model: ~135M parameters. A GPU's: Qwen2.5-1.5B's layers and vocabulary (config.json of
# Qwen/Qwen2.5-1.5B-Instruct), in bf16.
CPU_SHAPE = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 12}  # fmt: skip
GPU_SHAPE = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2}  # fmt: skip


def build_model(device: torch.device | None = None) -> Qwen2ForCausalLM:
    """The benchmark's model on `device` (default: a GPU where there is one, else the CPU)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    config = Qwen2Config(
        **(GPU_SHAPE if on_gpu else CPU_SHAPE),
        max_position_embeddings=512,
        tie_word_embeddings=False,  # vLLM refuses a lone tensor of a tied model, so per-tensor needs untied
    )
    torch.manual_seed(0)
    with device:  # built where it is trained: the sync on a GPU is a GPU-to-GPU pass
        model = Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16 if on_gpu else torch.float32).eval()


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn` after one untimed call; on a GPU the clock stops once the
    device has finished what the call queued."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    fn()  # warm-up: first calls allocate
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parity_gap(model: torch.nn.Module, engine: Engine, ids: list[int]) -> float:
    """Largest |engine - trainer| log-prob over a sequence: proof the timed sync really moved the weights."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
    return (engine.prompt_logprobs(ids) - expected.cpu()).abs().max().item()


def lora_bytes(model: torch.nn.Module) -> int:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    return sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if "lora_" in n)


def generation_tokens_per_s(engine: Engine, args: GRPOConfig, repeats: int) -> float:
    """Sampled tokens per second for 8 prompts × 4 completions × up to 16 tokens."""
    prompts = [[5 + (7 * i + j) % 40 for j in range(16)] for i in range(8)]
    tokens = 0

    def generate() -> None:
        nonlocal tokens
        tokens = sum(len(c) for c in engine.generate(prompts, args).completion_ids)

    seconds = median_time(generate, repeats)
    return tokens / seconds


def engine_args(repack: bool) -> GRPOConfig:
    return GRPOConfig(
        output_dir="outputs/bench",
        per_device_train_batch_size=8,
        num_generations=4,
        max_prompt_length=64,
        max_completion_length=16,
        vllm_kv_cache_gib=0.25,
        vllm_enforce_eager=True,
        vllm_cpu_repack_weights=repack,
        report_to="none",
    )


def measure(engine: Engine, args: GRPOConfig, plan: WeightPlan, model: torch.nn.Module, repeats: int) -> dict:
    """Sync, per-tensor sync and generation figures for one engine, with a parity check after each sync."""
    ids = tiny.build_tokenizer()("abcd>b:bbbb, then more text")["input_ids"]
    named = [pair for bucket in plan for pair in bucket]
    out: dict[str, float | str] = {"engine_path": "direct" if engine.direct_load else "reload"}
    out["sync_s"] = median_time(lambda: plan.sync(engine), repeats)
    out["parity_gap"] = parity_gap(model, engine, ids)
    out["per_tensor_s"] = median_time(lambda: [engine.load_weights([pair]) for pair in named], max(1, repeats // 3))
    out["per_tensor_parity_gap"] = parity_gap(model, engine, ids)
    out["generate_tokens_per_s"] = generation_tokens_per_s(engine, args, max(1, repeats // 3))
    return out


def run(repeats: int = 7, as_json: bool = False) -> dict[str, float]:
    model = build_model()
    tokenizer = tiny.build_tokenizer()
    plan = WeightPlan(model)
    weights = [t for bucket in plan for _, t in bucket]
    buffers = [torch.empty_like(t) for t in weights]
    result: dict[str, float | int | str] = {
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "bytes": plan.nbytes,
        "tensors": len(weights),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": str(weights[0].dtype).removeprefix("torch."),
        "memcpy_s": median_time(lambda: torch._foreach_copy_(buffers, weights), repeats),
    }
    # The default engine: on a CPU it repacks its weights for oneDNN, and a sync re-runs that processing.
    args = engine_args(repack=True)
    result.update(measure(Engine(model, tokenizer, args), args, plan, model, repeats))
    if not torch.cuda.is_available():
        # The alternative on a CPU: plain weights that a sync copies into; measured side by side.
        plain_args = engine_args(repack=False)
        plain = measure(Engine(model, tokenizer, plain_args), plain_args, plan, model, repeats)
        result.update({f"cpu_plain_{key}": value for key, value in plain.items() if key != "engine_path"})
        result["cpu_plain_ratio_vs_memcpy"] = result["cpu_plain_sync_s"] / result["memcpy_s"]
        result["cpu_plain_speedup_vs_per_tensor"] = result["cpu_plain_per_tensor_s"] / result["cpu_plain_sync_s"]
    result["ratio_vs_memcpy"] = result["sync_s"] / result["memcpy_s"]
    result["speedup_vs_per_tensor"] = result["per_tensor_s"] / result["sync_s"]
    result["lora_bytes_ratio"] = plan.nbytes / lora_bytes(model)
    if as_json:
        print(json.dumps(result))
    else:
        print_table(result, repeats)
    return result


def print_table(r: dict, repeats: int) -> None:
    ms = lambda seconds: f"{seconds * 1e3:9.2f} ms"  # noqa: E731
    print(f"model: Qwen2 {r['params_m']:.1f}M parameters, {r['tensors']} tensors, {r['bytes'] / 2**20:.0f} MiB "
          f"{r['dtype']}, {r['device']}; medians of {repeats} runs")  # fmt: skip
    print(f"memcpy floor        {ms(r['memcpy_s'])}  ({2 * r['bytes'] / r['memcpy_s'] / 1e9:.0f} GB/s read + write)")
    rows = [("", f"default engine ({r['engine_path']} sync)")]
    if "cpu_plain_sync_s" in r:
        rows.append(("cpu_plain_", "CPU engine with plain weights (vllm_cpu_repack_weights: false)"))
    for prefix, title in rows:
        ratio, speedup = r[f"{prefix}ratio_vs_memcpy"], r[f"{prefix}speedup_vs_per_tensor"]
        print(title)
        print(f"  colograd sync     {ms(r[prefix + 'sync_s'])}  ratio_vs_memcpy {ratio:6.2f}"
              f"   log-prob gap after it {r[prefix + 'parity_gap']:.1e}")  # fmt: skip
        print(f"  per-tensor sync   {ms(r[prefix + 'per_tensor_s'])}  speedup_vs_per_tensor {speedup:6.2f}"
              f"   log-prob gap after it {r[prefix + 'per_tensor_parity_gap']:.1e}")  # fmt: skip
        print(f"  generation        {r[prefix + 'generate_tokens_per_s']:9.1f} tokens/s")
    print(f"LoRA r=16 adapter-only sync moves 1/{r['lora_bytes_ratio']:.0f} of the bytes (lora_bytes_ratio)")
