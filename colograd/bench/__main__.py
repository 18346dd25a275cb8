"""`python -m colograd.bench {sync,soak,step,tools,entropy} [--json]`: run one benchmark."""

import argparse
import importlib
import os

BENCHMARKS = {
    "sync": "colograd.bench.sync",
    "soak": "colograd.bench.soak",
    "step": "colograd.bench.step",
    "tools": "colograd.bench.tools",
    "entropy": "colograd.bench.entropy",
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m colograd.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.add_argument(
        "--repeats",
        type=int,
        help="sync (default 7), tools and entropy (default 3): timed repetitions; medians are reported",
    )
    parser.add_argument("--steps", type=int, default=300, help="soak: training steps")
    parser.add_argument(
        "--model", choices=["tiny", "small", "smollm2"], default="small", help="step: the model (smollm2: pretrained)"
    )
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32", "both"], default="bf16", help="step: the precision (both: fp32 then bf16)"
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        help="step: train a step's completions in this many micro-steps (gradient accumulation), on both sides "
        "(default: the workload's, 4 for smollm2, 1 otherwise)",
    )
    args = parser.parse_args()
    bench = importlib.import_module(BENCHMARKS[args.name])
    if args.accumulation is not None:
        os.environ[bench.ACCUMULATION_ENV] = str(args.accumulation)
    if args.name == "soak":
        bench.run(steps=args.steps, as_json=args.json)
    elif args.name == "step":
        for dtype in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
            bench.run(size=args.model, dtype=dtype, as_json=args.json)
    elif args.name in ("tools", "entropy"):
        bench.run(repeats=args.repeats or 3, as_json=args.json)
    else:
        bench.run(repeats=args.repeats or 7, as_json=args.json)


if __name__ == "__main__":
    main()
