"""What each way of packing a training pass costs: shared prompts under a mask, as segments, or not shared.

On a model of one of `shapes.SHAPES` (random weights, float32 under bf16 autocast, as `bf16: true` trains), one
pass of `completion_logps` forward + backward over `prompts` prompts of `prompt_tokens` tokens with
`generations` completions each, of 1 to `completion_tokens` tokens (uniform), in each packing:

- `unshared`: every sequence whole, packed (transformers' packed-sequence mask);
- `shared_mask`: each prompt computed once, a 4D mask (boolean on a CPU, additive in the compute dtype on a GPU,
  as `prompt_sharing` gives it);
- `unshared_segments`, `shared_segments`: the same two as segments in CUDA's varlen kernels
  (`colograd.forward.attention`; on a GPU only, where `segment_kernel` finds one).

Medians of `repeats` interleaved runs after a warm-up, tokens computed, and on a GPU the peak memory torch
allocated in each (a packing that runs out of memory is reported so, and the others still run). A long-prompt
workload is where sharing saves most: the defaults, 2 prompts of 1,024 tokens × 4 completions of up to 128, are
~8,700 tokens unshared, as many as a micro-step of the 1.5B step benchmark, and fit an 80 GB GPU with that shape;
it is what docs/throughput.md asks a GPU to measure.
"""

import copy
import json
import math
import statistics
import time
from typing import Any

import torch

from colograd.bench.shapes import build_model
from colograd.engine.rollout import Rollout
from colograd.forward import attention
from colograd.forward.batch import pad_rollout
from colograd.forward.logps import PromptSharing, completion_logps, pack_for_forward
from colograd.forward.packing import prompt_sharing, segment_kernel


def grouped_batch(
    vocab: int, prompts: int, prompt_tokens: int, generations: int, completion_tokens: int, shortest_prompt: int = 0
) -> dict:
    """A padded rollout (`pad_rollout`) of random tokens: `prompts` prompts of `prompt_tokens` tokens (or, with
    `shortest_prompt`, of that many to `prompt_tokens`) × `generations` completions of 1 to `completion_tokens`."""
    gen = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(shortest_prompt or prompt_tokens, prompt_tokens + 1, (prompts,), generator=gen)
    prompt_ids = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in prompt_lengths.tolist()]
    lengths = torch.randint(1, completion_tokens + 1, (prompts * generations,), generator=gen).tolist()
    completions = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
    rollout = Rollout(completions, [[0.0] * n for n in lengths], [False] * len(lengths))
    return pad_rollout(prompt_ids, rollout, torch.zeros(len(lengths)), generations, pad_token_id=0)


def variants(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, tuple[Any, dict]]:
    """Each packing: the model to call and `completion_logps`'s keywords."""
    sharing = prompt_sharing(model, True, device, dtype) or PromptSharing(0.0)
    out = {"unshared": (model, {}), "shared_mask": (model, {"share_prompts": sharing})}
    kernel = segment_kernel(model, device, dtype)
    if kernel is not None:
        switched = copy.deepcopy(model)
        attention.install(switched)
        out["unshared_segments"] = (switched, {"segments": kernel})
        out["shared_segments"] = (switched, {"segments": kernel, "share_prompts": PromptSharing(0.0)})
    return out


def run(
    shape: str = "small",
    prompts: int = 2,
    prompt_tokens: int = 1024,
    generations: int = 4,
    completion_tokens: int = 128,
    repeats: int = 3,
    as_json: bool = False,
) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    model = build_model(shape, context=prompt_tokens + completion_tokens).to(device).train()
    batch = {k: v.to(device) for k, v in grouped_batch(model.config.vocab_size, prompts, prompt_tokens, generations,
                                                       completion_tokens).items()}  # fmt: skip
    mask = batch["completion_mask"].bool()

    def step(net: torch.nn.Module, kwargs: dict) -> tuple[float, float | None]:
        net.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            with torch.autocast(device.type, dtype):
                logps = completion_logps(net, batch, padding_free=True, **kwargs)
            (logps * mask).sum().backward()
        except torch.OutOfMemoryError:
            net.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return math.inf, None
        if device.type == "cuda":
            torch.cuda.synchronize()  # the kernels' time, once they finish
            return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**20
        return time.perf_counter() - start, None

    packings = variants(model, device, dtype)
    for net, kwargs in packings.values():
        step(net, kwargs)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in packings}
    peaks: dict[str, float | None] = {}
    for _ in range(repeats):
        for name, (net, kwargs) in packings.items():  # interleaved: noise falls on every packing alike
            seconds, peaks[name] = step(net, kwargs)
            times[name].append(seconds)
    tokens = {name: _forwarded(batch, kwargs, dtype) for name, (_, kwargs) in packings.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "workload": {
            "shape": shape,
            "prompts": prompts,
            "prompt_tokens": prompt_tokens,
            "generations": generations,
            "completion_tokens": completion_tokens,
            "device": str(device),
        },  # fmt: skip
        **{f"{name}_s": medians[name] for name in packings},
        **{f"{name}_vs_unshared": medians["unshared"] / medians[name] for name in packings},
        **{f"{name}_tokens": tokens[name] for name in packings},
        **{f"{name}_peak_mib": peaks[name] for name in packings},
    }
    print(json.dumps(report) if as_json else format_report(report, list(packings)))
    return report


def _forwarded(batch: dict, kwargs: dict, dtype: torch.dtype) -> int:
    """Tokens a pass with `completion_logps`'s `kwargs` computes."""
    return pack_for_forward(batch, kwargs.get("share_prompts"), None, dtype, kwargs.get("segments")).tokens


def format_report(report: dict[str, Any], packings: list[str]) -> str:
    """The figures of `run` as a table."""
    w = report["workload"]
    lines = [
        f"one forward + backward, {w['shape']} model under bf16 autocast on {w['device']}: {w['prompts']} prompts of "
        f"{w['prompt_tokens']} tokens × {w['generations']} completions of ≤{w['completion_tokens']} tokens"
    ]
    for name in packings:
        peak = report[f"{name}_peak_mib"]
        memory = f"  peak {peak:,.0f} MiB" if peak is not None else ""
        if math.isinf(report[f"{name}_s"]):
            lines.append(f"  {name:<18} out of memory  {report[f'{name}_tokens']:>8,} tokens")
            continue
        lines.append(
            f"  {name:<18} {report[f'{name}_s']:8.3f} s  ×{report[f'{name}_vs_unshared']:5.2f}  "
            f"{report[f'{name}_tokens']:>8,} tokens{memory}"
        )
    if "shared_segments" not in packings:
        lines.append("  (segments: CUDA's varlen kernels only; none on this machine)")
    return "\n".join(lines)
