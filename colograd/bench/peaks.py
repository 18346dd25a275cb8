"""Peak GPU memory per phase of a training run: what torch's allocator held at most while each phase ran.

`torch.cuda.max_memory_allocated` is one counter per process. At every phase boundary the tracker reads it into
the phase that was running (the innermost one, when phases nest: TRL's rollout inside its training step) and
into the run's total, then resets it, so each phase gets the peak of its own intervals. It counts tensors
(model, gradients, optimizer state, activations, the in-process engine's weights, KV cache and graph pools), not
the CUDA context or NCCL buffers. Without a GPU it records nothing and reports None.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import TrainerCallback


class PhasePeaks:
    """Peak allocated GPU memory per phase, and over the whole run."""

    def __init__(self) -> None:
        self.enabled = torch.cuda.is_available()
        self.allocated: dict[str, int] = {}  # bytes, per phase
        self.total_allocated = 0
        self.total_reserved = 0
        self._open: list[str] = []

    def mark(self, phase: str | None = None) -> None:
        """Charge the peak since the last boundary to `phase` (default: the innermost open phase, if any) and to
        the total, then start a new interval."""
        if not self.enabled:
            return
        peak = torch.cuda.max_memory_allocated()
        phase = phase or (self._open[-1] if self._open else None)
        if phase is not None:
            self.allocated[phase] = max(self.allocated.get(phase, 0), peak)
        self.total_allocated = max(self.total_allocated, peak)
        self.total_reserved = max(self.total_reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def enter(self, phase: str) -> None:
        self.mark()
        self._open.append(phase)

    def exit(self, phase: str) -> None:
        self.mark()
        self._open.remove(phase)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the block's peak to `name` (minus phases nested in it, which get their own)."""
        self.enter(name)
        try:
            yield
        finally:
            self.exit(name)

    def report(self, names: dict[str, str] | None = None) -> dict[str, float | dict[str, float] | None]:
        """The peaks in MiB: `peak_gpu_mib` (allocated, whole run), `peak_gpu_reserved_mib` (what the allocator
        reserved from the device, whole run) and `peak_gpu_mib_by_phase`; all None without a GPU.

        Args:
            names: reported names of phases, where they differ from the tracked ones (e.g. TRL's "step" minus its
                rollout is its "train").
        """
        if not self.enabled:
            return {"peak_gpu_mib": None, "peak_gpu_reserved_mib": None, "peak_gpu_mib_by_phase": None}
        self.mark()
        names = names or {}
        return {
            "peak_gpu_mib": self.total_allocated / 2**20,
            "peak_gpu_reserved_mib": self.total_reserved / 2**20,
            "peak_gpu_mib_by_phase": {names.get(p, p): b / 2**20 for p, b in self.allocated.items()},
        }


class PeakCallback(TrainerCallback):
    """Feeds `PhasePeaks` the Trainer's own boundaries: start-up (model, engine, up to the first step; vLLM resets
    the counter while it profiles, so from there) and the optimizer step."""

    def __init__(self, peaks: PhasePeaks) -> None:
        self.peaks = peaks

    def on_train_begin(self, args, state, control, **kwargs):
        self.peaks.mark("startup")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.peaks.enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.peaks.exit("optimizer")
