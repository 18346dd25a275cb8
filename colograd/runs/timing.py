"""Where a step's time goes: per-phase seconds and token counts, per logging window and for the whole run.

Phases: `sync` (weights into the engine), `generate` (the engine call), `reward`, `logps` (old / reference
log-probs of a rollout, when the loss needs them), `train` (forward + backward; under DeepSpeed also its
optimizer step, which runs inside its backward), `optimizer` (gradient clipping excluded).
"""

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import TrainerCallback

from colograd.runs.ranks import all_reduce_settled

PHASES = ("sync", "generate", "reward", "logps", "train", "optimizer")


class PhaseTimes:
    """Seconds per phase and tokens per kind, summed over this run (this process)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, float] = defaultdict(float)

    @contextmanager
    def timed(self, phase: str, window: dict[str, list[float]]) -> Iterator[None]:
        """Time the block as `phase`, into the run's totals and as a `time/<phase>` entry of `window`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start, window)

    def add(self, phase: str, seconds: float, window: dict[str, list[float]]) -> None:
        self.seconds[phase] += seconds
        window[f"time/{phase}"].append(seconds)

    def count(self, kind: str, tokens: int, window: dict[str, list[float]]) -> None:
        """Add `tokens` of `kind` ("generated": completion tokens sampled; "trained": the tokens of the sequences
        trained on; "forwarded": the tokens their forward passes computed, fewer where completions share a prompt)."""
        self.tokens[kind] += tokens
        window[f"tokens/{kind}"].append(tokens)


def throughput(tokens: dict[str, float], seconds: dict[str, float], processes: int) -> dict[str, float]:
    """Tokens per second of generation and of training, over all processes.

    `tokens` and `seconds` are per process (means over the processes): tokens × processes / seconds.
    """
    rates = {}
    for kind, phase in (("generated", "generate"), ("trained", "train")):
        if seconds.get(phase):
            rates[f"throughput/{phase}_tokens_per_s"] = tokens.get(kind, 0.0) * processes / seconds[phase]
    return rates


def format_summary(steps: int, seconds: dict[str, float], rates: dict[str, float]) -> str:
    """The end-of-training table: each phase's seconds, share and seconds per step, then tokens/s."""
    total = sum(seconds.get(phase, 0.0) for phase in PHASES) or 1.0  # the training step's (evaluation apart)
    lines = [f"colograd: time per phase over {steps} steps (mean over processes)"]
    for phase in PHASES:
        if phase in seconds:
            s = seconds[phase]
            lines.append(f"  {phase:<10} {s:9.2f} s  {100 * s / total:5.1f}%  {s / max(steps, 1):8.3f} s/step")
    for name, rate in rates.items():
        what = name.removeprefix("throughput/").removesuffix("_tokens_per_s")
        lines.append(f"  {what} tokens/s (all processes): {rate:,.0f}")
    return "\n".join(lines)


def window_metrics(window: dict[str, list[float]], steps: int, accelerator: Accelerator) -> dict[str, float]:
    """A logging window's metrics over all processes: means over micro-steps and processes (max / min over
    processes for `*/max` / `*/min`); `time/*` and `tokens/*` as sums per optimizer step (the window's sum divided
    by its `steps`); and the window's `throughput/*_tokens_per_s` over all processes. Every process must call it."""
    # Every rank reduces the same names in the same order: a metric only some ranks recorded this window (a reward
    # function's `log_metric` on some of them) is averaged over the ranks that recorded it.
    names = sorted(set(gather_object(sorted(window)))) if accelerator.num_processes > 1 else sorted(window)
    per_step = ("time/", "tokens/")
    recorded = [bool(window.get(k)) for k in names]
    values = [
        sum(window[k]) / (steps if k.startswith(per_step) else len(window[k])) if has else 0.0
        for k, has in zip(names, recorded, strict=True)
    ]
    local = torch.tensor(values, device=accelerator.device)
    present = torch.tensor(recorded, device=accelerator.device)
    everywhere = accelerator.gather(torch.stack([local, present.to(local.dtype)]).unsqueeze(0))  # [ranks, 2, K]
    values_RK, present_RK = everywhere[:, 0], everywhere[:, 1].bool()
    mean = values_RK.sum(dim=0) / present_RK.sum(dim=0).clamp(min=1)
    inf = torch.full_like(values_RK, float("inf"))
    ends = lambda suffix: torch.tensor([k.endswith(suffix) for k in names], device=local.device)  # noqa: E731
    reduced = torch.where(ends("/max"), torch.where(present_RK, values_RK, -inf).amax(dim=0), mean)
    reduced = torch.where(ends("/min"), torch.where(present_RK, values_RK, inf).amin(dim=0), reduced)
    logs = dict(zip(names, reduced.tolist(), strict=True))
    tokens = {k.removeprefix("tokens/"): logs[k] for k in names if k.startswith("tokens/")}
    seconds = {k.removeprefix("time/"): logs[k] for k in names if k.startswith("time/")}
    return logs | throughput(tokens, seconds, accelerator.num_processes)


def run_summary(times: PhaseTimes, steps: int, accelerator: Accelerator) -> dict:
    """Where a run's time went: seconds per phase and tokens per process (means over processes), and tokens/s of
    generation and training over all processes. Every process must call it."""
    phases, kinds = sorted(times.seconds), sorted(times.tokens)
    local = torch.tensor(
        [times.seconds[p] for p in phases] + [times.tokens[k] for k in kinds], device=accelerator.device
    )
    # The last collective of `train`: settled, so that the process can exit as soon as it returns.
    mean = (all_reduce_settled(local) / accelerator.num_processes).tolist()
    seconds = dict(zip(phases, mean[: len(phases)], strict=True))
    tokens = dict(zip(kinds, mean[len(phases) :], strict=True))
    rates = throughput(tokens, seconds, accelerator.num_processes)
    return {"steps": steps, "seconds": seconds, "tokens_per_process": tokens, **rates}


class OptimizerTimer(TrainerCallback):
    """Times the Trainer's optimizer step (between its pre- and post-step callbacks) as phase `optimizer`."""

    def __init__(self, times: PhaseTimes, window: dict[str, list[float]]) -> None:
        self.times, self.window, self._start = times, window, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._start is not None:
            self.times.add("optimizer", time.perf_counter() - self._start, self.window)
            self._start = None
