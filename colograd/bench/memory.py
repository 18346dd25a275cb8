"""Memory soak (`python -m colograd.bench memory`): does a long run's resident memory grow? Trains the tiny default
in one process for many steps, records the process's resident set size (RSS) after every optimizer step, and
reports the slope of a least-squares line through the steps after warm-up (the first 20%, where caches fill up).

(The failure soak, `python -m colograd.bench soak`, is `colograd.bench.soak`.)

A leak (a list that keeps every rollout, tensors kept alive by logged metrics) shows as a steady slope; a
flat line means memory is bounded by the step, whatever the run length.
"""

import json
import resource
import time

from transformers import TrainerCallback

from colograd import GRPOTrainer
from colograd.models import tiny


def rss_mib() -> float:
    """This process's resident memory now (Linux), in MiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


class RecordRSS(TrainerCallback):
    def __init__(self) -> None:
        self.rss: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.rss.append(rss_mib())


def slope_per_100_steps(values: list[float]) -> float:
    """Least-squares slope of `values` against their index, × 100."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    cov = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    var = sum((i - mean_x) ** 2 for i in range(n))
    return 100 * cov / var


def run(steps: int = 300, as_json: bool = False) -> dict[str, float]:
    args = tiny.run_config("outputs/bench-memory", steps, logging_steps=10)
    recorder = RecordRSS()
    trainer = GRPOTrainer(
        model=tiny.build_model(),
        reward_funcs="letters",
        args=args,
        train_dataset=tiny.letters_dataset(num_prompts=max(2048, steps * 8)),
        processing_class=tiny.build_tokenizer(),
        callbacks=[recorder],
    )
    start = time.perf_counter()
    trainer.train()
    after_warmup = recorder.rss[len(recorder.rss) // 5 :]
    result = {
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "rss_after_warmup_mib": after_warmup[0],
        "rss_end_mib": recorder.rss[-1],
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "slope_mib_per_100_steps": slope_per_100_steps(after_warmup),
    }
    if as_json:
        print(json.dumps(result))
    else:
        r = result
        print(f"{steps} steps in {r['seconds']:.0f} s; RSS after warm-up {r['rss_after_warmup_mib']:.0f} MiB, "
              f"at the end {r['rss_end_mib']:.0f} MiB, peak {r['rss_peak_mib']:.0f} MiB")  # fmt: skip
        print(f"slope after warm-up: {result['slope_mib_per_100_steps']:+.2f} MiB per 100 steps")
    return result
