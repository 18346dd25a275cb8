"""Weight-sync benchmark: colograd's sync against the memory-copy floor, the model's loaders and a per-tensor sync.

On a Qwen2-architecture model built locally, in one process, with the real engine, on the device the engine runs
on: without a GPU ~135M parameters (untied head, as Qwen2.5-7B; fp32); on a GPU the layers of Qwen2.5-1.5B with its
vocabulary (1.5B parameters, untied head, bf16: what a bf16 engine holds), moved to the GPU, so the sync is a
GPU-to-GPU pass. Each time is a median of `repeats` timed runs after a warm-up (on a GPU, with the device
synchronized before the clock stops); the syncs of one engine and their floor take turns within each repeat:

- sync_s: `WeightPlan.sync`, the trainer → engine sync colograd runs after every optimizer step (on the direct
  path, a replay of the copy plan recorded from the model's loaders, `colograd.engine.copy_plan`);
- loader_sync_s: the same sync through the model's loaders (`model.load_weights`), copy plans off: the direct path
  before copy plans;
- memcpy_s: `torch._foreach_copy_` of the same tensors into preallocated buffers on the same device: one plain pass
  over the bytes, the floor for any in-process sync;
- per_tensor_s: one engine call per tensor through the loaders, as TRL's colocate sync does;
- fp32_master_*: the sync a `bf16: true` run makes, the trainer's fp32 weights into a bf16 engine, against its own
  floor, an fp32 → bf16 `torch._foreach_copy_` (fp32_master_memcpy_s);
- moe_* (without a GPU): a Qwen3-MoE of 128 experts a layer, whose loader copies each expert's tensors one call at
  a time, into an engine whose expert layers prepack what a sync writes (vLLM's CPU backend);
- lora_bytes_ratio: bytes of a full sync ÷ bytes of an adapter-only sync (LoRA r=16 on every linear layer);
- adapter_*: that adapter-only sync into an engine serving the adapter: adapter_sync_s, the tensors handed to the
  engine's worker as they are (`colograd.engine.lora.serve_adapter_in_worker`, what every sync after the first
  does), against adapter_folder_sync_s, through a folder vLLM's loader reads (the first sync's way, and every
  sync's before), and adapter_memcpy_s, a copy of the adapter's tensors: its floor;
- without a GPU, the default engine repacks linear weights for oneDNN (`vllm_cpu_repack_weights`) and a sync
  re-runs that processing, while the `cpu_plain_*` engine keeps plain weights that a sync copies into; the
  generation speed of both engines on the same prompts, since the choice between them trades one for the other.
"""

import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from colograd import GRPOConfig
from colograd.engine import copy_plan
from colograd.engine.core import Engine
from colograd.engine.requests import Sampling
from colograd.engine.sync import WeightPlan
from colograd.models import tiny

# The CPU's model: ~135M parameters. A GPU's: Qwen2.5-1.5B's layers and vocabulary (config.json of
# Qwen/Qwen2.5-1.5B-Instruct), in bf16.
CPU_SHAPE = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 12}  # fmt: skip
GPU_SHAPE = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2}  # fmt: skip


def build_model(device: torch.device | None = None, dtype: torch.dtype | None = None) -> Qwen2ForCausalLM:
    """The benchmark's model on `device` (default: a GPU where there is one, else the CPU), in `dtype` (default:
    bf16 on a GPU, fp32 on the CPU)."""
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
    return model.to(dtype or (torch.bfloat16 if on_gpu else torch.float32)).eval()


def medians(timed: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The median seconds of `repeats` calls of each function, after one untimed call of each (first calls allocate,
    and record copy plans), taking turns within each repeat so that the machine's load at any moment weighs on all
    alike; on a GPU the clock stops once the device has finished what the call queued."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for fn in timed.values():
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(repeats):
        for name, fn in timed.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn` after one untimed call (see `medians`)."""
    return medians({"fn": fn}, repeats)["fn"]


def copy_plans(engine: Engine, enabled: bool) -> None:
    """Whether the engine's direct-path loads replay copy plans (its default) or run the model's loaders."""
    engine.in_workers(copy_plan.set_enabled_in_engine, enabled)


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
        tokens = sum(len(c) for c in engine.generate(prompts, Sampling.of(args)).completion_ids)

    seconds = median_time(generate, repeats)
    return tokens / seconds


def engine_args(repack: bool, bf16: bool = False) -> GRPOConfig:
    return GRPOConfig(
        output_dir="outputs/bench",
        per_device_train_batch_size=8,
        num_generations=4,
        max_prompt_length=64,
        max_completion_length=16,
        vllm_kv_cache_gib=0.25,
        vllm_enforce_eager=True,
        vllm_cpu_repack_weights=repack,
        bf16=bf16,
        report_to="none",
    )


def measure(engine: Engine, args: GRPOConfig, plan: WeightPlan, model: torch.nn.Module, repeats: int) -> dict:
    """Sync, loader sync (on the direct path), per-tensor sync and generation figures for one engine, each sync
    kind followed by a parity check, and the copy plan's size."""
    ids = tiny.build_tokenizer()("abcd>b:bbbb, then more text")["input_ids"]
    weights = [t for bucket in plan for _, t in bucket]
    buffers = [torch.empty_like(t) for t in weights]
    out: dict[str, float | str] = {"engine_path": "direct" if engine.direct_load else "reload"}
    timed = {"sync_s": lambda: plan.sync(engine), "memcpy_s": lambda: torch._foreach_copy_(buffers, weights)}
    if engine.direct_load:
        timed["loader_sync_s"] = lambda: loader_sync(engine, plan)
    out |= medians(timed, repeats)
    out["parity_gap"] = parity_gap(model, engine, ids)
    out |= {f"plan_{key}": value for key, value in engine.in_workers(copy_plan.summary_in_engine)[0].items()}
    out["plan_refused"] = len(out["plan_refused"])
    copy_plans(engine, False)  # one loader call per tensor, as TRL's sync makes them
    named = [pair for bucket in plan for pair in bucket]
    out["per_tensor_s"] = median_time(lambda: [engine.load_weights([pair]) for pair in named], max(1, repeats // 3))
    out["per_tensor_parity_gap"] = parity_gap(model, engine, ids)
    copy_plans(engine, True)
    out["generate_tokens_per_s"] = generation_tokens_per_s(engine, args, max(1, repeats // 3))
    return out


def loader_sync(engine: Engine, plan: WeightPlan) -> None:
    copy_plans(engine, False)
    plan.sync(engine)
    copy_plans(engine, True)


def measure_row(model: torch.nn.Module, args: GRPOConfig, repeats: int) -> dict:
    """The sync of `model` into a new engine of `args`, as a plan replay and (on the direct path) through the
    loaders, against a copy of the same tensors into buffers of the engine's dtype: its floor."""
    plan = WeightPlan(model)
    engine = Engine(model, tiny.build_tokenizer(), args)
    weights = [t for bucket in plan for _, t in bucket]
    dtype = torch.bfloat16 if args.bf16 else weights[0].dtype
    buffers = [torch.empty_like(t, dtype=dtype) for t in weights]
    timed = {"sync_s": lambda: plan.sync(engine), "memcpy_s": lambda: torch._foreach_copy_(buffers, weights)}
    if engine.direct_load or engine.prepacked_experts:
        timed["loader_sync_s"] = lambda: loader_sync(engine, plan)
    out: dict[str, float | str] = {"engine_path": "direct" if engine.direct_load else "reload", "bytes": plan.nbytes}
    out["dense_path"] = "direct" if engine.direct_dense else "reload"  # outside the expert layers
    out |= medians(timed, repeats)
    out["parity_gap"] = parity_gap(model, engine, tiny.build_tokenizer()("abcd>b:bbbb, then more text")["input_ids"])
    out |= {f"plan_{key}": value for key, value in engine.in_workers(copy_plan.summary_in_engine)[0].items()}
    out["plan_refused"] = len(out["plan_refused"])
    return out


def measure_adapter(repeats: int) -> dict:
    """The adapter-only sync of LoRA r=16 on every linear layer of the bench's model, served from memory and
    through a folder, interleaved, against a copy of the adapter's tensors."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model(), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    args = engine_args(repack=False, bf16=torch.cuda.is_available())  # vLLM's GPU LoRA kernels take 16-bit only
    engine = Engine(model, tiny.build_tokenizer(), args, lora_rank=16)
    plan = WeightPlan(model, adapter_only=True)
    plan.sync(engine)  # the base, and the adapter's first version through its folder
    tensors = [p for name, p in model.named_parameters() if "lora_" in name]
    buffers = [torch.empty_like(t) for t in tensors]

    def through_folder() -> None:
        engine.forget_adapter()  # the engine then loads the adapter as a first version: from its folder
        plan._sync_adapter(engine)

    timed = {
        "adapter_sync_s": lambda: plan._sync_adapter(engine),
        "adapter_folder_sync_s": through_folder,
        "adapter_memcpy_s": lambda: torch._foreach_copy_(buffers, tensors),
    }
    out = medians(timed, repeats)
    out["adapter_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    out["adapter_speedup_vs_folder"] = out["adapter_folder_sync_s"] / out["adapter_sync_s"]
    out["adapter_ratio_vs_memcpy"] = out["adapter_sync_s"] / out["adapter_memcpy_s"]
    return out


def build_moe_model() -> torch.nn.Module:
    """Qwen3-MoE with Qwen3-30B-A3B's experts (128, 8 per token) and attention heads (32 query, 4 KV, of 128), at a
    CPU's width (hidden 128, experts 64 wide: multiples of 32, as vLLM's CPU expert kernel needs), 4 layers, over
    the tiny tokenizer, fp32: 12.6M of its 18.5M parameters in experts, each loaded by vLLM's loader one expert at a
    time (3 × 128 × 4 calls a sync)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tiny.build_tokenizer()), hidden_size=128, moe_intermediate_size=64, intermediate_size=256,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def ratios(r: dict, prefix: str = "") -> dict[str, float]:
    """A row's ratios: its sync (and loader sync) over its floor, and what the plan saves."""
    out = {f"{prefix}ratio_vs_memcpy": r[f"{prefix}sync_s"] / r[f"{prefix}memcpy_s"]}
    if f"{prefix}loader_sync_s" in r:
        out[f"{prefix}loader_ratio_vs_memcpy"] = r[f"{prefix}loader_sync_s"] / r[f"{prefix}memcpy_s"]
        out[f"{prefix}speedup_vs_loader"] = r[f"{prefix}loader_sync_s"] / r[f"{prefix}sync_s"]
    if f"{prefix}per_tensor_s" in r:
        out[f"{prefix}speedup_vs_per_tensor"] = r[f"{prefix}per_tensor_s"] / r[f"{prefix}sync_s"]
    return out


def run(repeats: int = 7, as_json: bool = False) -> dict[str, float]:
    model = build_model()
    tokenizer = tiny.build_tokenizer()
    plan = WeightPlan(model)
    weights = [t for bucket in plan for _, t in bucket]
    result: dict[str, float | int | str] = {
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "bytes": plan.nbytes,
        "tensors": len(weights),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": str(weights[0].dtype).removeprefix("torch."),
    }
    # The default engine: on a CPU it repacks its weights for oneDNN, and a sync re-runs that processing.
    args = engine_args(repack=True)
    result.update(measure(Engine(model, tokenizer, args), args, plan, model, repeats))
    result.update(ratios(result))
    if not torch.cuda.is_available():
        # The alternative on a CPU: plain weights that a sync copies into; measured side by side.
        plain_args = engine_args(repack=False)
        plain = measure(Engine(model, tokenizer, plain_args), plain_args, plan, model, repeats)
        result.update({f"cpu_plain_{key}": value for key, value in plain.items()})
        result.update(ratios(result, "cpu_plain_"))
    # What a `bf16: true` run syncs: fp32 masters into a bf16 engine with plain weights (the direct path).
    master = measure_row(build_model(dtype=torch.float32), engine_args(repack=False, bf16=True), repeats)
    result.update({f"fp32_master_{key}": value for key, value in master.items()})
    result.update(ratios(result, "fp32_master_"))
    if not torch.cuda.is_available():  # an expert layer's loader: one call per expert and shard
        experts = measure_row(build_moe_model(), engine_args(repack=False), repeats)
        result.update({f"moe_{key}": value for key, value in experts.items()})
        result.update(ratios(result, "moe_"))
    result["lora_bytes_ratio"] = plan.nbytes / lora_bytes(model)
    result.update(measure_adapter(repeats))
    result["load_average_1min"] = os.getloadavg()[0]
    # Read by the OpenMP runtime once, at start: spinning worker threads of the engine's kernels slow every copy here
    # several times over on a machine of few cores (run with OMP_WAIT_POLICY=PASSIVE there).
    result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "unset")
    if as_json:
        print(json.dumps(result))
    else:
        print_table(result, repeats)
    return result


def print_table(r: dict, repeats: int) -> None:
    ms = lambda seconds: f"{seconds * 1e3:9.2f} ms"  # noqa: E731
    print(f"model: Qwen2 {r['params_m']:.1f}M parameters, {r['tensors']} tensors, {r['bytes'] / 2**20:.0f} MiB "
          f"{r['dtype']}, {r['device']}; medians of {repeats} runs, interleaved per engine; load average "
          f"{r['load_average_1min']:.2f}; OMP_WAIT_POLICY {r['omp_wait_policy']}")  # fmt: skip
    rows = [("", f"default engine ({r['engine_path']} sync)")]
    if "cpu_plain_sync_s" in r:
        rows.append(("cpu_plain_", f"CPU engine with plain weights ({r['cpu_plain_engine_path']} sync)"))
    for prefix, title in rows:
        print(title)
        row_lines(r, prefix)
        print(f"  per-tensor sync   {ms(r[prefix + 'per_tensor_s'])}  speedup_vs_per_tensor "
              f"{r[prefix + 'speedup_vs_per_tensor']:6.2f}   log-prob gap after it "
              f"{r[prefix + 'per_tensor_parity_gap']:.1e}")  # fmt: skip
        print(f"  generation        {r[prefix + 'generate_tokens_per_s']:9.1f} tokens/s")
    print(f"fp32 masters into a bf16 engine ({r['fp32_master_engine_path']} sync), as `bf16: true` trains")
    row_lines(r, "fp32_master_", floor="fp32 -> bf16 copy")
    if "moe_sync_s" in r:
        print(f"Qwen3-MoE, 128 experts x 4 layers, {r['moe_bytes'] / 2**20:.0f} MiB fp32 (experts prepacked after "
              f"the copies; the other layers' sync {r['moe_dense_path']})")  # fmt: skip
        row_lines(r, "moe_")
    print(f"LoRA r=16 adapter-only sync moves 1/{r['lora_bytes_ratio']:.0f} of the bytes (lora_bytes_ratio)")
    print(f"  adapter copy floor {ms(r['adapter_memcpy_s'])}   ({r['adapter_bytes'] / 2**20:.1f} MiB)")
    print(
        f"  adapter sync      {ms(r['adapter_sync_s'])}  ratio_vs_memcpy {r['adapter_ratio_vs_memcpy']:6.2f}   "
        f"through a folder {ms(r['adapter_folder_sync_s'])}  speedup {r['adapter_speedup_vs_folder']:6.2f}"
    )


def row_lines(r: dict, prefix: str, floor: str = "memcpy floor") -> None:
    """An engine's floor, sync and (on the direct path) loader sync, with their ratios."""
    ms = lambda seconds: f"{seconds * 1e3:9.2f} ms"  # noqa: E731
    print(f"  {floor:<17} {ms(r[prefix + 'memcpy_s'])}")
    plan = f"   copy plan: {r[prefix + 'plan_tensors']} tensors in {r[prefix + 'plan_copies']} copies" * bool(
        r.get(prefix + "plan_plans")
    )
    print(f"  colograd sync     {ms(r[prefix + 'sync_s'])}  ratio_vs_memcpy {r[prefix + 'ratio_vs_memcpy']:6.2f}"
          f"   log-prob gap after it {r[prefix + 'parity_gap']:.1e}{plan}")  # fmt: skip
    if prefix + "loader_sync_s" in r:
        print(f"  loader sync       {ms(r[prefix + 'loader_sync_s'])}  ratio_vs_memcpy "
              f"{r[prefix + 'loader_ratio_vs_memcpy']:6.2f}   speedup_vs_loader "
              f"{r[prefix + 'speedup_vs_loader']:6.2f}")  # fmt: skip
