"""Memory soak (`python -m colograd.bench memory`): does a long run's resident memory grow? Trains the tiny default
(or, `--model qwen3.5`, the hybrid step benchmark's shrunk Qwen3.5 and workload, in bf16) in one process for many
steps, records the process's resident set size (RSS) and the allocator's memory in use (glibc's `mallinfo2`: what
is allocated and not freed, without the free heap that RSS also counts) after every optimizer step, and reports the
slope of a least-squares line through the steps after warm-up (the first 20%, where caches fill up).

(The failure soak, `python -m colograd.bench soak`, is `colograd.bench.soak`.)

A leak (a list that keeps every rollout, tensors kept alive by logged metrics) shows as a steady slope; a
flat line means memory is bounded by the step, whatever the run length.
"""

import ctypes
import json
import resource
import tempfile
import time

from transformers import TrainerCallback

from colograd import GRPOTrainer
from colograd.models import tiny

MODELS = ("tiny", "qwen3.5")


def rss_mib() -> float:
    """This process's resident memory now (Linux), in MiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]  # fmt: skip


def heap_in_use_mib() -> float | None:
    """The allocator's memory in use now (glibc's `mallinfo2`: allocated chunks, mapped ones included), in MiB; None
    where the C library has no `mallinfo2` (glibc before 2.33, another libc)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


class RecordRSS(TrainerCallback):
    def __init__(self) -> None:
        self.rss: list[float] = []
        self.in_use: list[float | None] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.rss.append(rss_mib())
        self.in_use.append(heap_in_use_mib())


def slope_per_100_steps(values: list[float]) -> float:
    """Least-squares slope of `values` against their index, × 100."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    cov = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    var = sum((i - mean_x) ** 2 for i in range(n))
    return 100 * cov / var


def run(steps: int = 300, as_json: bool = False, model: str = "tiny") -> dict[str, float]:
    """Train `model` (one of `MODELS`) for `steps` optimizer steps in this process and report its memory's slopes."""
    if model not in MODELS:
        raise ValueError(f"memory: --model is one of {', '.join(MODELS)}, not {model!r}")
    recorder = RecordRSS()
    with tempfile.TemporaryDirectory(prefix="colograd-bench-memory-") as out:
        if model == "tiny":
            args = tiny.run_config("outputs/bench-memory", steps, logging_steps=10)
            net, tokenizer = tiny.build_model(), tiny.build_tokenizer()
            dataset, reward = tiny.letters_dataset(max(2048, steps * 8)), "letters"
        else:  # the hybrid step benchmark's model and workload, colograd's side
            from colograd.bench.shapes import HYBRID, build_task, workload
            from colograd.bench.step import colograd_config

            w = {**workload(HYBRID), "model": HYBRID, "dtype": "bf16"}
            args = colograd_config(out, w, steps, logging_steps=10)
            net, tokenizer, dataset, reward = build_task(HYBRID, w)
        trainer = GRPOTrainer(
            model=net,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[recorder],
        )
        start = time.perf_counter()
        trainer.train()
    warm = len(recorder.rss) // 5
    after_warmup, in_use = recorder.rss[warm:], recorder.in_use[warm:]
    counted = None not in in_use
    result = {
        "model": model,
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "rss_after_warmup_mib": after_warmup[0],
        "rss_end_mib": recorder.rss[-1],
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "slope_mib_per_100_steps": slope_per_100_steps(after_warmup),
        "in_use_after_warmup_mib": in_use[0] if counted else None,
        "in_use_end_mib": in_use[-1] if counted else None,
        "in_use_slope_mib_per_100_steps": slope_per_100_steps(in_use) if counted else None,
    }
    if as_json:
        print(json.dumps(result))
    else:
        r = result
        print(f"{model}: {steps} steps in {r['seconds']:.0f} s; RSS after warm-up {r['rss_after_warmup_mib']:.0f} "
              f"MiB, at the end {r['rss_end_mib']:.0f} MiB, peak {r['rss_peak_mib']:.0f} MiB")  # fmt: skip
        print(f"slope after warm-up: {result['slope_mib_per_100_steps']:+.2f} MiB per 100 steps")
        if counted:
            print(f"allocator's memory in use: {r['in_use_after_warmup_mib']:.0f} MiB after warm-up, "
                  f"{r['in_use_end_mib']:.0f} at the end, slope {r['in_use_slope_mib_per_100_steps']:+.2f} MiB per "
                  "100 steps")  # fmt: skip
    return result
