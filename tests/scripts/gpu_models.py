"""One zoo model trained for a few GRPO steps in this process (tests/scripts/moe_check.py's `check`: TRL's quickstart
settings, the zoo's shrunk published config with sharp weights), its figures written as one JSON object: the sampling
gap of every step (worst and mean), routing replay's two metrics where it is on, the engine-vs-trainer gap after the
final sync, whether the running parity guard stayed on, and the seconds it took; a run that raised gives its error's
last line instead. Made for a GPU machine, where a process keeps one engine (docs/gpu.md), so each model and setting
runs in a process of its own:

    python tests/scripts/gpu_models.py OUT.json Qwen/Qwen3-30B-A3B --bf16 --replay
"""

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
STARTED = time.time()


def stage(what: str) -> None:
    """One line on stderr at each stage, so that a run a time limit kills still says how far it got."""
    print(f"gpu_models: {what} ({time.time() - STARTED:.0f} s)", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("json")
    parser.add_argument("model", help="a model of tests/zoo.py")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--replay", action="store_true", help="routing_replay: rollout (an MoE model)")
    parser.add_argument("--published", action="store_true", help="a Qwen3.5 as its checkpoints are published, the "
                        "vision-language class (zoo.as_published: sharp weights, not a stopping model)")  # fmt: skip
    parser.add_argument("--stacks-after", type=float, help="seconds after which every thread's stack is printed "
                        "(to find where a run that a time limit will kill is waiting)")  # fmt: skip
    parser.add_argument("--runs", default="/tmp/gpu-models", help="the trainers' output folders")
    cli = parser.parse_args()
    if cli.stacks_after:  # before the imports: they alone can take a minute on a busy machine
        faulthandler.dump_traceback_later(cli.stacks_after, exit=False)
    stage(f"{cli.model}: importing")
    import moe_check
    import zoo

    started = time.time()
    row = {"model": cli.model, "bf16": cli.bf16, "replay": cli.replay, "published": cli.published}
    try:
        flags = ["--steps", str(cli.steps), *(["--replay"] if cli.replay else [])]
        check = moe_check.options(cli.runs, cli.model, *flags)
        stage("building the model")
        if cli.published:
            model, tokenizer = zoo.as_published(cli.model), zoo.tokenizer_for(zoo.shrunk(cli.model))
        else:
            model, tokenizer = zoo.stopping_model(cli.model)
        stage(f"training {cli.steps} steps (the engine starts first)")
        result = moe_check.check(cli.model, model, tokenizer, cli.bf16, check)
        stage("trained")
        steps = [h for h in result["log_history"] if "loss" in h]
        row |= {
            "gap_max": [h.get("sampling/sampling_logp_difference/max") for h in steps],
            "gap_mean": [h.get("sampling/sampling_logp_difference/mean") for h in steps],
            "differed": [h.get("moe/routing_replay/differed") for h in steps],
            "unreplayed": [h.get("moe/routing_replay/unreplayed") for h in steps],
            "reward": [h.get("reward") for h in steps],
            "parity_gap": result["parity_gap"],
            "running_guard": result["running_guard"],
        }
    except BaseException as error:  # noqa: BLE001 (the row records any failure, a refusal included)
        row["error"] = (str(error).strip().splitlines() or [type(error).__name__])[-1][:400]
        row["traceback"] = traceback.format_exc()[-3000:]
    row["seconds"] = round(time.time() - started, 1)
    with open(cli.json, "w") as f:
        json.dump(row, f, indent=1)
    print("ROW", json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)


if __name__ == "__main__":
    main()
