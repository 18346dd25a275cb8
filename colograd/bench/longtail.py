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

The partial-rollout half (`tail` sides): the same model, made to stop at any of `TAIL["stops"]` of its tokens (its
generation config's end-of-sequence ids; the engine stops at them too), so that a completion stops with a small
probability at each token, ~1 in 25: lengths run from 1 token to the limit (128), mean ~25, and each rollout's
longest completion is near the limit. The plain side waits for it; with `partial_rollouts` (over-provision 1.5) the
rollout stops once its 8 groups have finished and carries the rest. Learning rate 0 again, so that stale tokens are
sampled by the same weights and both sides sample one distribution. Reported: completion tokens the engine generates
per second of the generate phase (the goal: ≥ 1.3×), seconds per step, and the distribution of the staleness of the
groups trained (in weight versions: rollouts).
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
# Token ids the tail model stops at: <eos> and the characters 'w' and 'x' (`tiny.build_tokenizer`).
TAIL = {"max_completion_length": 128, "stops": [1, 24, 25], "overprovision": 1.5}


def first_letter(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """1 for a completion that starts with the target letter, else 0."""
    return [float(c[:1] == t) for c, t in zip(completions, target, strict=True)]


def run(as_json: bool = False, **overrides: Any) -> dict[str, Any]:
    """Both sides, each in a fresh process; prints the figures (a table, or one JSON line)."""
    w = {**WORKLOAD, **TAIL, **{k: v for k, v in overrides.items() if v is not None}}
    plain, dynamic = _process("plain", w), _process("dynamic", w)
    tail, partial = _process("tail", w), _process("partial", w)
    result = {
        "workload": w,
        "plain": plain,
        "dynamic": dynamic,
        "informative_groups_per_s_ratio": dynamic["informative_groups_per_s"] / plain["informative_groups_per_s"],
        "informative_groups_per_median_step_s_ratio": (
            dynamic["informative_groups_per_median_step_s"] / plain["informative_groups_per_median_step_s"]
        ),
        "tail": tail,
        "partial": partial,
        "generated_tokens_per_s_ratio": partial["generated_tokens_per_s"] / tail["generated_tokens_per_s"],
        "step_s_median_ratio": tail["step_s_median"] / partial["step_s_median"],
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
        f"Partial rollouts (over-provision {w['overprovision']}), the same model stopping at any of "
        f"{len(w['stops'])} tokens: completions of 1 to {w['max_completion_length']} tokens"
    )
    for side in ("tail", "partial"):
        s = r[side]
        lines.append(
            f"  {side:8s} {s['generated_tokens_per_s']:,.0f} tokens generated/s of the generate phase  "
            f"{s['step_s_median']:.3f} s/step (mean {s['step_s_mean']:.3f})  "
            f"{s['generated_tokens_per_step']:,.0f} tokens generated/step  mean completion "
            f"{s['completion_mean_length']:.1f} tokens"
        )
    staleness = ", ".join(f"{k}: {v:.2f}" for k, v in sorted(r["partial"]["staleness"].items()))
    lines.append(
        f"  tokens generated/s, partial / plain: {r['generated_tokens_per_s_ratio']:.2f}; s/step, plain / partial: "
        f"{r['step_s_median_ratio']:.2f}; groups trained by staleness (rollouts) {staleness}; stale tokens "
        f"{r['partial']['stale_token_fraction']:.2f} of those trained; carried groups dropped as too stale "
        f"{r['partial']['dropped_groups_per_step']:.2f}/step"
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
    long = side in ("tail", "partial")
    length = w["max_completion_length"] if long else 8
    model = build_model(w["shape"], len(tokenizer), 16 + length)
    if long:
        model.generation_config.eos_token_id = list(w["stops"])
    with tempfile.TemporaryDirectory() as out:
        args = tiny.run_config(
            out,
            w["warmup"] + w["steps"],
            learning_rate=0.0,
            per_device_train_batch_size=w["prompts"] * w["num_generations"],
            num_generations=w["num_generations"],
            max_completion_length=length,
            dynamic_sampling=side == "dynamic",
            dynamic_sampling_max_rounds=w["max_rounds"],
            partial_rollouts=side == "partial",
            partial_rollout_overprovision=w["overprovision"],
        )
        trainer = GRPOTrainer(model, first_letter, args, tiny.letters_dataset(), processing_class=tokenizer)
        staleness: list[int] = []
        if side == "partial":
            take = trainer.partial.take

            def recorded(*args: Any) -> Any:
                taken, version = take(*args), args[4]
                staleness.extend(version - group.oldest(version) for group in taken[0])
                return taken

            trainer.partial.take = recorded
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
    timed_staleness = staleness[w["warmup"] * w["prompts"] :]
    return {
        "generated_tokens_per_s": sum(h["tokens/generated"] for h in logs) / sum(h["time/generate"] for h in logs),
        "completion_mean_length": statistics.mean(h["completions/mean_length"] for h in logs),
        "staleness": {k: timed_staleness.count(k) / len(timed_staleness) for k in sorted(set(timed_staleness))},
        "stale_token_fraction": statistics.mean(h.get("partial_rollouts/stale_token_fraction", 0.0) for h in logs),
        "dropped_groups_per_step": statistics.mean(h.get("partial_rollouts/dropped_groups", 0.0) for h in logs),
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
