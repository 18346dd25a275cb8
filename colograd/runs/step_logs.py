"""The trainer's logs: metrics recorded per micro-step and logged per window, each stage timed (a failure naming
its step and stage), completion samples, and the run's phase summary (`StepLogs`, a `GRPOTrainer` base)."""

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import Trainer

from colograd.runs.completions import CompletionLog
from colograd.runs.preemption import stage_failures
from colograd.runs.timing import OptimizerTimer, PhaseTimes, format_summary, run_summary, window_metrics


class StepLogs(Trainer):
    """What `GRPOTrainer` logs, and how (its state started by `_start_logs`)."""

    reward_func_names: list[str]
    reward_weights: torch.Tensor

    def _start_logs(self) -> None:
        """The logs' state: the current window's metrics, the phases' times, the completion log (main process)."""
        args = self.args
        self.metrics: dict[str, list[float]] = defaultdict(list)  # the current logging window's, per metric
        self._times = PhaseTimes()
        self.add_callback(OptimizerTimer(self._times, self.metrics))
        self.phase_summary: dict[str, Any] = {}  # filled at the end of `train` (see `summarize_phases`)
        self._last_logged_step = 0
        self._last_window: dict[str, float] = {}  # the last logged window's metrics (`log`)
        self._completion_log = (
            CompletionLog(args.output_dir, args.num_completions_to_print, args.log_unique_prompts, args.report_to)
            if args.log_completions and self.accelerator.is_main_process
            else None
        )

    def summarize_phases(self, steps: int) -> None:
        """Print (main process) and keep in `phase_summary` where this `train` call's time went: seconds per phase
        (mean over processes) and tokens/s of generation and training (all processes)."""
        self.phase_summary = run_summary(self._times, steps, self.accelerator)
        if self.accelerator.is_main_process:
            rates = {k: v for k, v in self.phase_summary.items() if k.startswith("throughput/")}
            print(format_summary(steps, self.phase_summary["seconds"], rates), flush=True)

    def _record(self, metrics: dict[str, float]) -> None:
        """Add one value of each metric to the current logging window (averaged over micro-steps and ranks when
        logged, see `log`)."""
        for name, value in metrics.items():
            self.metrics[name].append(value)

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Time a stage; an exception in it names the optimizer step and the stage (`StepFailure`)."""
        with stage_failures(phase, self.state.global_step + 1, self.args.output_dir):
            with self._times.timed(phase, self.metrics):
                yield

    def log_completions(
        self,
        prompts: list,
        rollout: Any,
        rewards_NF: torch.Tensor,
        advantages_N: torch.Tensor,
        extra: dict[str, list] | None = None,
        images: list[list] | None = None,
    ) -> None:
        """With `log_completions`, hand the first rank's rollout (a `colograd.engine.rollout.Rollout`), the columns
        its reward functions added with `log_extra` and each prompt's `images` when given, to the completion log
        every `log_completions_steps` (every logging step when unset)."""
        step = self.state.global_step + 1  # the optimizer step this rollout trains, as logs number it
        if self._completion_log is None or step % (self.args.log_completions_steps or self.state.logging_steps):
            return
        texts = self.processing_class.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        rewards = {name: rewards_NF[:, j].tolist() for j, name in enumerate(self.reward_func_names)}
        total_N = (rewards_NF * self.reward_weights).nansum(dim=1)
        self._completion_log.record(
            step, prompts, texts, rewards, total_N.tolist(), advantages_N.tolist(), extra, images
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add this window's GRPO metrics, averaged over micro-steps and ranks (max / min over ranks for `*/max` /
        `*/min`).

        `time/*` are seconds per optimizer step and `tokens/*` tokens per optimizer step and process: their sums over
        the window divided by its steps. `throughput/*_tokens_per_s` are the window's tokens/s over all processes.
        """
        # A step's entry, and (as TRL's `log` merges them) the end of training's, which takes what the last window
        # left when training ended between two logging steps.
        if self.metrics and ("loss" in logs or "train_runtime" in logs):
            steps = max(1, self.state.global_step - self._last_logged_step)
            self._last_window = window_metrics(self.metrics, steps, self.accelerator)
            logs.update(self._last_window)
            self.metrics.clear()
            self._last_logged_step = self.state.global_step
            super().log(logs, start_time)
            return
        super().log(logs, start_time)
        if "train_runtime" in logs:
            # Every step was logged: the end of training's entry in `log_history` gets the last window's metrics
            # again, as TRL's carries a window's (its default logs every 10 steps) and TRL's tests read them from
            # `log_history[-1]`. Trackers are not sent them twice; a step's entry is the one with a `loss`.
            self.state.log_history[-1].update({k: v for k, v in self._last_window.items() if k not in logs})
