"""`python -m colograd.bench longtail`: what dynamic sampling buys where most groups teach nothing.

The workload: a freshly initialised model of `shapes.SHAPES[shape]` (default small: 6 layers, hidden 384, where
compute dominates on 2 CPU cores) on the letters task with a hard binary reward, 1 for a completion that starts with
the asked letter (`first_letter`): most groups have every completion wrong, so their advantages are zero, as on a
hard task or late in a run (`frac_reward_zero_std` reads 0.9-1.0 late in the default run). Both sides train the same
steps, once without and once with `dynamic_sampling`, each in a fresh process. The learning rate is 0, so that both
sides sample from the same policy at every step (a learning policy would make the two sides' groups diverge, and
the figure compare two distributions); every step still runs the whole rollout, forward, backward and optimizer.

Reported per side: informative groups trained per second (groups whose rewards differ, per step, over the mean
step's wall time: rollout, refills and training; and over the median step, which a step slowed by other work on
the machine moves less but which leaves out dynamic sampling's slower steps of more rounds), seconds per step (median
and mean), completion tokens generated
per step and the share of uniform groups trained; with dynamic sampling, its refill rounds per step. The ratio of
informative groups per second is the figure the goal is set on (≥ 1.5×).

Partial rollouts, the other half of the long tail, are not built: there is no side for them.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

WORKLOAD = {"shape": "small", "steps": 10, "warmup": 2, "prompts": 8, "num_generations": 8, "max_rounds": 4}


def first_letter(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """1 for a completion that starts with the target letter, else 0."""
    return [float(c[:1] == t) for c, t in zip(completions, target, strict=True)]


def run(as_json: bool = False, **overrides: Any) -> dict[str, Any]:
    """Both sides, each in a fresh process; prints the figures (a table, or one JSON line)."""
    w = {**WORKLOAD, **{k: v for k, v in overrides.items() if v is not None}}
    plain, dynamic = _process("plain", w), _process("dynamic", w)
    result = {
        "workload": w,
        "plain": plain,
        "dynamic": dynamic,
        "informative_groups_per_s_ratio": dynamic["informative_groups_per_s"] / plain["informative_groups_per_s"],
        "informative_groups_per_median_step_s_ratio": (
            dynamic["informative_groups_per_median_step_s"] / plain["informative_groups_per_median_step_s"]
        ),
        "load_average_1min": os.getloadavg()[0],
    }
    print(json.dumps(result) if as_json else report(result))
    return result


def report(r: dict[str, Any]) -> str:
    w = r["workload"]
    lines = [
        f"Dynamic sampling (at most {w['max_rounds']} refill rounds), the {w['shape']} model on the letters task, a "
        f"first-letter reward, learning rate 0; {w['prompts']} prompts × {w['num_generations']} completions of up to "
        f"8 tokens per step, {w['steps']} timed steps after {w['warmup']}, one process per side",
    ]
    for side in ("plain", "dynamic"):
        s = r[side]
        rounds = f", {s['rounds_per_step']:.2f} refill rounds/step" if side == "dynamic" else ""
        lines.append(
            f"  {side:8s} {s['informative_groups_per_s']:.2f} informative groups/s  {s['step_s_median']:.3f} s/step "
            f"(mean {s['step_s_mean']:.3f})  "
            f"{s['generated_tokens_per_step']:,.0f} tokens generated/step  uniform groups trained "
            f"{s['uniform_fraction']:.2f}{rounds}"
        )
    lines.append(
        f"  informative groups/s, dynamic / plain: {r['informative_groups_per_s_ratio']:.2f} (over the median step: "
        f"{r['informative_groups_per_median_step_s_ratio']:.2f})"
    )
    lines.append(
        f"  machine load (1-minute average) at the end: {r['load_average_1min']:.1f} on {os.cpu_count()} CPUs"
    )
    return "\n".join(lines)


def _process(side: str, w: dict[str, Any]) -> dict[str, Any]:
    """Run `side` in a fresh process (`python -m colograd.bench.longtail SIDE WORKLOAD_JSON`); its last line."""
    print(f"colograd.bench longtail: {side}...", file=sys.stderr, flush=True)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    with tempfile.NamedTemporaryFile(
        "w", prefix=f"colograd-bench-longtail-{side}-", suffix=".log", delete=False
    ) as log:
        proc = subprocess.run([sys.executable, "-m", "colograd.bench.longtail", side, json.dumps(w)],
                              stdout=subprocess.PIPE, stderr=log, text=True, env=env)  # fmt: skip
    if proc.returncode != 0:
        with open(log.name) as f:
            raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n{f.read()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _side(side: str, w: dict[str, Any]) -> dict[str, Any]:
    from transformers import TrainerCallback

    from colograd import GRPOTrainer
    from colograd.bench.shapes import build_model
    from colograd.models import tiny

    tokenizer = tiny.build_tokenizer()
    model = build_model(w["shape"], len(tokenizer), 16 + 8)
    with tempfile.TemporaryDirectory() as out:
        args = tiny.run_config(
            out,
            w["warmup"] + w["steps"],
            learning_rate=0.0,
            per_device_train_batch_size=w["prompts"] * w["num_generations"],
            num_generations=w["num_generations"],
            dynamic_sampling=side == "dynamic",
            dynamic_sampling_max_rounds=w["max_rounds"],
        )
        trainer = GRPOTrainer(model, first_letter, args, tiny.letters_dataset(), processing_class=tokenizer)
        times: list[float] = []

        class Clock(TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                self.start = time.perf_counter()

            def on_step_end(self, *a: Any, **k: Any) -> None:
                times.append(time.perf_counter() - self.start)

        trainer.add_callback(Clock())
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h][w["warmup"] :]
    timed = times[w["warmup"] :]
    uniform = [h["frac_reward_zero_std"] for h in logs]
    informative = statistics.mean((1 - u) * w["prompts"] for u in uniform)
    return {
        "step_s_median": statistics.median(timed),
        "step_s_mean": statistics.mean(timed),
        "informative_groups_per_s": informative / statistics.mean(timed),
        "informative_groups_per_median_step_s": informative / statistics.median(timed),
        "informative_groups_per_step": informative,
        "uniform_fraction": statistics.mean(uniform),
        "generated_tokens_per_step": statistics.mean(h["tokens/generated"] for h in logs),
        "rounds_per_step": statistics.mean(h.get("dynamic_sampling/rounds", 0.0) for h in logs),
        "reward_mean": statistics.mean(h["reward"] for h in logs),
    }


if __name__ == "__main__":
    print(json.dumps(_side(sys.argv[1], json.loads(sys.argv[2]))))
