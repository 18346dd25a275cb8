"""`python -m colograd.bench {sync,soak,memory,step,vlm,moe,tools,entropy,sharing,code,longtail} [--json]`: run one
benchmark."""

import argparse
import importlib
import os
import sys
from typing import Any

# Benchmarks whose idle OpenMP threads must sleep rather than spin: on a 2-core machine the engine's spinning threads
# made every copy of the sync benchmark 4-10x slower. OpenMP reads the setting when torch loads, which importing
# colograd already did: such a benchmark starts again in a process that has it.
PASSIVE_WAITS = ("sync",)

BENCHMARKS = {
    "sync": "colograd.bench.sync",
    "soak": "colograd.bench.soak",
    "memory": "colograd.bench.memory",
    "step": "colograd.bench.step",
    "vlm": "colograd.bench.vlm",
    "moe": "colograd.bench.moe",
    "tools": "colograd.bench.tools",
    "entropy": "colograd.bench.entropy",
    "sharing": "colograd.bench.sharing",
    "code": "colograd.bench.code",
    "longtail": "colograd.bench.longtail",
}
# The step benchmark's model shapes (colograd.bench.shapes.SHAPES), the VLM benchmark's model names (shapes.LLAVA)
# and the MoE benchmark's model (shapes.MOE), named here so that parsing imports no torch.
SHAPES = ["tiny", "small", "qwen2.5-0.5b", "qwen2.5-1.5b"]
LLAVA = "llava-"
MOE = "moe"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m colograd.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.add_argument(
        "--repeats",
        type=int,
        help="sync, moe (default 7), tools, entropy, sharing and code (default 3): timed repetitions (moe: of its "
        "sync); medians are reported",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="soak: the run's steps (default 400); memory: training steps (default 300); step, vlm, moe, longtail: "
        "timed steps (default: the workload's)",
    )
    parser.add_argument("--save-steps", type=int, help="soak: steps between checkpoints (default 20)")
    parser.add_argument("--failures", type=int, help="soak: workers killed, one per launch (default 3)")
    parser.add_argument("--seed", type=int, help="soak: the kill schedule's seed (default: a new one, printed)")
    parser.add_argument("--nproc", type=int, help="soak: processes per launch (default 2)")
    parser.add_argument("--launcher", choices=["torchrun", "accelerate"], help="soak: the launcher (default torchrun)")
    parser.add_argument(
        "--model",
        choices=["tiny", "small", "smollm2", "qwen3.5", "qwen3.5-4b-layers"],
        help="step: the model (default small; smollm2: pretrained; qwen3.5: a hybrid, Qwen3.5's layers, CPU-sized; "
        "qwen3.5-4b-layers: the same 4 layers at Qwen3.5-4B's widths, 446M parameters); "
        "memory: tiny (default) or qwen3.5 (the hybrid step's workload, bf16)",
    )
    parser.add_argument(
        "--shape",
        choices=SHAPES,
        help="step, sharing: a Qwen2 model built from a config of this shape (qwen2.5-*: those models' layers, for "
        "a GPU, where step defaults to 16 prompts × 8 completions of ≤256 tokens in 4 micro-steps); vlm: the "
        "LLaVA's language model (default small)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp32", "both"],
        default="bf16",
        help="step, vlm, moe: the precision (both: fp32 then bf16)",
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        help="step, vlm, moe: train a step's completions in this many micro-steps (gradient accumulation), on both "
        "sides (default: the workload's, 4 for smollm2 and the qwen2.5 shapes, 1 otherwise)",
    )
    parser.add_argument("--prompts", type=int, help="step, vlm, moe: prompts per step; sharing: prompts (default 2)")
    parser.add_argument(
        "--generations",
        type=int,
        help="step, vlm, moe: completions per prompt (num_generations); sharing: (default 4)",
    )
    parser.add_argument(
        "--completion-tokens",
        type=int,
        help="step: most tokens per completion; vlm: tokens per completion (default 256); moe: (default 128); "
        "sharing: (default 128)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        help="step, moe: tokens per prompt (longer letters prompts; default: 7); sharing: (default 1024)",
    )
    parser.add_argument("--warmup", type=int, help="step, vlm, moe: untimed steps before the timed ones")
    parser.add_argument(
        "--contest-only",
        action="store_true",
        help="code: only the CodeContests-shaped workload (50 stdin/stdout cases a problem, sandboxed against one "
        "unsandboxed interpreter), no rollout",
    )
    return parser


def step_workload(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The step benchmark's model and the workload settings its flags give (those not given are left out)."""
    if args.model and args.shape:
        raise SystemExit("colograd.bench step: give --shape or --model, not both.")
    settings = {
        "prompts": args.prompts,
        "num_generations": args.generations,
        "max_completion_length": args.completion_tokens,
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "gradient_accumulation_steps": args.accumulation,
    }
    return args.shape or args.model or "small", {k: v for k, v in settings.items() if v is not None}


def vlm_workload(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The VLM benchmark's model (a LLaVA whose language model has the `--shape` given, default small) and the
    workload settings its flags give (those not given are left out)."""
    if args.model:
        raise SystemExit("colograd.bench vlm: --model is the step benchmark's; give the language model's --shape.")
    shape, settings = step_workload(args)
    return LLAVA + shape, settings


def moe_workload(args: argparse.Namespace) -> dict[str, Any]:
    """The workload settings the MoE benchmark's flags give (those not given are left out); its model is fixed
    (`shapes.MOE_SHAPE`)."""
    if args.model or args.shape:
        raise SystemExit("colograd.bench moe: its model is fixed (shapes.MOE_SHAPE); leave out --model and --shape.")
    return step_workload(args)[1]


def main() -> None:
    args = build_parser().parse_args()
    if args.name in PASSIVE_WAITS and "OMP_WAIT_POLICY" not in os.environ:
        command = [sys.executable, "-m", "colograd.bench", *sys.argv[1:]]
        os.execve(sys.executable, command, {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    bench = importlib.import_module(BENCHMARKS[args.name])
    if args.name == "memory":
        try:
            bench.run(steps=args.steps or 300, as_json=args.json, model=args.model or "tiny")
        except ValueError as err:
            raise SystemExit(f"colograd.bench {err}") from None
    elif args.name == "soak":
        given = {"steps": args.steps, "save_steps": args.save_steps, "failures": args.failures, "seed": args.seed,
                 "nproc": args.nproc, "launcher": args.launcher}  # fmt: skip
        try:
            settings = bench.settings(**given)
        except ValueError as err:  # one line, before any launch
            raise SystemExit(f"colograd.bench soak: {err}") from None
        bench.run(**settings, as_json=args.json)
    elif args.name in ("step", "vlm"):
        size, settings = step_workload(args) if args.name == "step" else vlm_workload(args)
        try:
            bench.workload(size, **settings)
        except ValueError as err:  # a ConfigError: one line, before any side starts
            raise SystemExit(f"colograd.bench {args.name}: {err}") from None
        for dtype in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
            bench.run(size=size, dtype=dtype, as_json=args.json, **settings)
    elif args.name == "moe":
        settings = moe_workload(args)
        try:
            bench.workload(MOE, **settings)
        except ValueError as err:  # a ConfigError: one line, before any process starts
            raise SystemExit(f"colograd.bench moe: {err}") from None
        for dtype in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
            bench.run(dtype=dtype, as_json=args.json, repeats=args.repeats or 7, **settings)
    elif args.name == "sharing":
        settings = {"prompts": args.prompts, "generations": args.generations, "prompt_tokens": args.prompt_tokens,
                    "completion_tokens": args.completion_tokens}  # fmt: skip
        given = {k: v for k, v in settings.items() if v is not None}
        bench.run(shape=args.shape or "small", repeats=args.repeats or 3, as_json=args.json, **given)
    elif args.name == "longtail":
        bench.run(as_json=args.json, steps=args.steps, prompts=args.prompts, num_generations=args.generations)
    elif args.name == "code":
        bench.run(repeats=args.repeats or 3, as_json=args.json, contest_only=args.contest_only)
    elif args.name in ("tools", "entropy"):
        bench.run(repeats=args.repeats or 3, as_json=args.json)
    else:
        bench.run(repeats=args.repeats or 7, as_json=args.json)


if __name__ == "__main__":
    main()
